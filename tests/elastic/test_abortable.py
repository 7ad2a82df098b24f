"""Abortable groups (issue 29): a peer that hangs instead of dying costs no completed step and no stop grace.

Two spotrun agents (one worker each) run examples/train_ddp.py with the memory tier snapshotting every 10 steps.
Node B is SIGSTOPped whole (agent, worker, keeper: a paused VM, a partition): nothing resets a connection, so the
survivor's gloo all-reduce waits, as NCCL waits on any lost peer. When the survivor's agent sees B's lease
expire it posts ``peer-lost.json``; its worker's watcher (started by its ``Preemption`` helper) aborts the
group, the all-reduce raises, the worker snapshots its last completed step just in time and exits, and the new
group of one restores that step from memory: 0 steps redone. Before, the worker sat blocked until the agent's
SIGKILL after ``--stop-grace`` and the restore fell back to the periodic snapshot.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest

from elastic.etcd_server import EmbeddedEtcd
from elastic.events import read_events
from elastic.memory_keeper import remove_orphaned_keepers
from elastic.progress import remove_orphaned_progress_files
from elastic.worker.mailbox import remove_orphaned_mailboxes
from tests.harness.procs import EXAMPLES, SPOTRUN, Launcher, make_env, read_jsonl, signal_all, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 60
EVERY = 10
STOP_AT = 15
LEASE_TTL = 3.0
TRAIN = [str(EXAMPLES / "train_ddp.py"), "--global-batch", "64", "--dataset-size", "1000", "--steps", str(STEPS),
         "--ckpt-every", "1000", "--log-every", "1000", "--pg-timeout", "60", "--step-time", "0.1",
         "--memory-snapshot-every", str(EVERY)]  # fmt: skip
RDZV_CONF = f"lease_ttl={LEASE_TTL:g},last_call_timeout=0.5,join_timeout=60"


def _sweep_node_b() -> None:
    """What the SIGKILLed node B left on this host, as the next agent here would sweep it: its keeper
    directory, its progress files and its mailbox (with the link to it)."""
    remove_orphaned_keepers()
    remove_orphaned_progress_files()
    remove_orphaned_mailboxes(tempfile.gettempdir())


def _node(endpoint: str, run: Path, name: str, **env: str) -> Launcher:
    argv = [*SPOTRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "0", "--stop-grace", "3",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "abort", "--rdzv-conf", RDZV_CONF,
            "--events-file", str(run / f"events-{name}.jsonl"), *TRAIN, "--ckpt-dir", str(run / "ckpt"),
            "--progress-file", str(run / "progress.jsonl")]  # fmt: skip
    return Launcher(argv, run / f"{name}.log", env=make_env(LOGLEVEL="INFO", **env))


def test_a_paused_peer_is_aborted_and_costs_no_completed_step(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    progress = tmp_path / "progress.jsonl"
    a = _node(etcd_server.endpoint, tmp_path, "a")
    b = _node(etcd_server.endpoint, tmp_path, "b")
    victims: list[int] = []
    try:
        wait_for(lambda: any(r["world_size"] == 2 for r in read_jsonl(progress)), timeout=240, what="the 2-node group")
        wait_for(lambda: any(r["step"] >= STOP_AT for r in read_jsonl(progress)), timeout=240, what=f"step {STOP_AT}")
        victims = b.snapshot_tree()
        paused_at = len(read_jsonl(progress))  # a first round of A alone (B slow to start) trained at size 1 too
        signal_all(victims, signal.SIGSTOP)  # node B pauses: agent, forkserver, worker, keeper
        wait_for(lambda: any(r["world_size"] == 1 for r in read_jsonl(progress)[paused_at:]), timeout=120,
                 what="the survivor to train alone")
        log = a.output()
    finally:
        signal_all(victims, signal.SIGKILL)
        b.close()
        a.close()
        _sweep_node_b()

    lines = read_jsonl(progress)
    survivor = {r["pid"] for r in lines if r["world_size"] == 2} - set(victims)
    (old_pid,) = survivor
    before = max(r["step"] for r in lines if r["pid"] == old_pid)
    stopped_at = max(r["t_wall"] for r in lines if r["pid"] == old_pid)
    alone = [r for r in lines[paused_at:] if r["world_size"] == 1]
    restored = [r for r in alone if "restore_source" in r]
    assert restored and restored[0]["restore_source"] == "memory_local", restored
    assert restored[0]["restore_step"] == before, \
        f"trained to step {before} before the pause, resumed after {restored[0]['restore_step']} (steps redone)"
    assert "the workers abort their process group" in log, log[-3000:]
    events = [e["event"] for e in read_events(str(tmp_path / "events-a.jsonl"))]
    assert "failure_detected" in events
    # What the stop grace cost before: the survivor's worker was only SIGKILLed --stop-grace (3 s) after the loss.
    recovery = min(r["t_wall"] for r in alone) - stopped_at
    assert recovery < LEASE_TTL + 3.0 + 3.0, f"first step alone {recovery:.2f} s after the last step together"


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["paused", "killed"])
def test_a_lost_peer_is_re_formed_around_in_place(tmp_path: Path, etcd_server: EmbeddedEtcd,
                                                  fault: signal.Signals) -> None:
    """SPOTRUN_REFORM_IN_PLACE=1: the survivor's worker aborts its group, snapshots its last completed step and
    waits in its process; its agent re-forms around it. The same process trains on at world size 1 from the
    very next step (0 steps redone, no restart, no restore)."""
    progress = tmp_path / "progress.jsonl"
    a = _node(etcd_server.endpoint, tmp_path, "a", SPOTRUN_REFORM_IN_PLACE="1")
    b = _node(etcd_server.endpoint, tmp_path, "b", SPOTRUN_REFORM_IN_PLACE="1")
    victims: list[int] = []
    try:
        wait_for(lambda: any(r["world_size"] == 2 for r in read_jsonl(progress)), timeout=240, what="the 2-node group")
        wait_for(lambda: any(r["step"] >= STOP_AT for r in read_jsonl(progress)), timeout=240, what=f"step {STOP_AT}")
        victims = b.snapshot_tree()
        paused_at = len(read_jsonl(progress))  # a first round of A alone (B slow to start) trained at size 1 too
        signal_all(victims, fault)
        wait_for(lambda: any(r["world_size"] == 1 for r in read_jsonl(progress)[paused_at:]), timeout=120,
                 what="the survivor to train alone")
        log = a.output()
    finally:
        signal_all(victims, signal.SIGKILL)
        b.close()
        a.close()
        _sweep_node_b()

    lines = read_jsonl(progress)
    (old_pid,) = {r["pid"] for r in lines if r["world_size"] == 2} - set(victims)
    before = max(r["step"] for r in lines if r["pid"] == old_pid and r["world_size"] == 2)
    alone = [r for r in lines[paused_at:] if r["world_size"] == 1]
    assert {r["pid"] for r in alone} == {old_pid}, "the survivor's worker process trains on: no restart"
    assert alone[0]["step"] == before + 1, f"trained to step {before} together, then step {alone[0]['step']} alone"
    assert alone[0].get("reformed_in_place") is True, alone[0]
    assert "re-forming around them" in log, log[-3000:]
    started = [e for e in read_events(str(tmp_path / "events-a.jsonl")) if e["event"] == "workers_started"]
    assert started[-1].get("in_place") is True, started[-1]
