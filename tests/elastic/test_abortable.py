"""Abortable groups (issue 29): a peer that hangs instead of dying costs no completed step and no stop grace.

Two spotrun agents (one worker each) run examples/train_ddp.py with the memory tier snapshotting every 10 steps.
Node B is SIGSTOPped whole (agent, worker, keeper: a paused VM, a partition): nothing resets a connection, so the
survivor's gloo all-reduce waits, as NCCL waits on any lost peer. When the survivor's agent sees B's lease
expire it posts ``peer-lost.json``; its worker's watcher (started by its ``Preemption`` helper) aborts the
group, the all-reduce raises, the worker snapshots its last completed step just in time and exits, and the new
group of one restores that step from memory: 0 steps redone. Before, the worker sat blocked until the agent's
SIGKILL after ``--stop-grace`` and the restore fell back to the periodic snapshot. That restart path runs with
``SPOTRUN_REFORM_IN_PLACE=0``; by default train_ddp.py re-forms in place (``elastic.inplace``): the same worker
process trains on from the next step.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest

from elastic.api import ENV_REFORM_IN_PLACE
from elastic.etcd_server import EmbeddedEtcd
from elastic.events import read_events
from elastic.memory_keeper import remove_orphaned_keepers
from elastic.progress import remove_orphaned_progress_files
from elastic.worker.mailbox import remove_orphaned_mailboxes
from tests.harness.procs import EXAMPLES, SPOTRUN, Launcher, make_env, read_jsonl, signal_all, wait_for
from tests.harness.tracebacks import unexpected_tracebacks

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


def _node(endpoint: str, run: Path, name: str, *, train: list[str] | None = None, **env: str) -> Launcher:
    """One agent (a "node") of one worker running ``train`` (default: train_ddp.py with the memory tier)."""
    script = [*TRAIN, "--ckpt-dir", str(run / "ckpt")] if train is None else train
    argv = [*SPOTRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "0", "--stop-grace", "3",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "abort", "--rdzv-conf", RDZV_CONF,
            "--events-file", str(run / f"events-{name}.jsonl"), *script,
            "--progress-file", str(run / "progress.jsonl")]  # fmt: skip
    full = make_env(LOGLEVEL="INFO", **env)
    if ENV_REFORM_IN_PLACE not in env:
        full.pop(ENV_REFORM_IN_PLACE, None)  # none inherited from the shell: in place is chosen by use
    return Launcher(argv, run / f"{name}.log", env=full)


def _fault_node_b(tmp_path: Path, etcd_server: EmbeddedEtcd, fault: signal.Signals = signal.SIGKILL, *,
                  train: list[str] | None = None, **env: str) -> tuple[list[dict], list[int], str]:
    """Two agents (``_node``: ``train``, ``env``); once both trained to step STOP_AT, ``fault`` to the whole of
    node B, then node A left to train alone. Returns the progress lines (at world size 2 before the fault, and
    all after it: a first round that formed before B arrived trained alone too), B's pids and A's log."""
    progress = tmp_path / "progress.jsonl"
    a = _node(etcd_server.endpoint, tmp_path, "a", train=train, **env)
    b = _node(etcd_server.endpoint, tmp_path, "b", train=train, **env)
    victims: list[int] = []
    try:
        wait_for(lambda: any(r["world_size"] == 2 for r in read_jsonl(progress)), timeout=240, what="the 2-node group")
        wait_for(lambda: any(r["step"] >= STOP_AT for r in read_jsonl(progress)), timeout=240, what=f"step {STOP_AT}")
        victims = b.snapshot_tree()
        faulted_at = len(read_jsonl(progress))
        signal_all(victims, fault)  # node B whole: agent, forkserver, worker, keeper
        wait_for(lambda: any(r["world_size"] == 1 for r in read_jsonl(progress)[faulted_at:]), timeout=120,
                 what="the survivor to train alone")
        log = a.output()
    finally:
        signal_all(victims, signal.SIGKILL)
        b.close()
        a.close()
        _sweep_node_b()
    lines = read_jsonl(progress)
    return [r for r in lines[:faulted_at] if r["world_size"] == 2] + lines[faulted_at:], victims, log


def test_a_paused_peer_is_aborted_and_costs_no_completed_step(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    # The restart path (train_ddp.py re-forms in place by default): SPOTRUN_REFORM_IN_PLACE=0 forces restarts.
    lines, victims, log = _fault_node_b(tmp_path, etcd_server, signal.SIGSTOP, SPOTRUN_REFORM_IN_PLACE="0")
    survivor = {r["pid"] for r in lines if r["world_size"] == 2} - set(victims)
    (old_pid,) = survivor
    before = max(r["step"] for r in lines if r["pid"] == old_pid)
    stopped_at = max(r["t_wall"] for r in lines if r["pid"] == old_pid)
    alone = [r for r in lines if r["world_size"] == 1]
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
    """train_ddp.py runs under ``elastic.inplace.run`` (no variable set): the survivor's worker aborts its group,
    snapshots its last completed step and waits in its process; its agent re-forms around it. The same process
    trains on at world size 1 from the very next step (0 steps redone, no restart, no restore)."""
    lines, victims, log = _fault_node_b(tmp_path, etcd_server, fault)
    (old_pid,) = {r["pid"] for r in lines if r["world_size"] == 2} - set(victims)
    before = max(r["step"] for r in lines if r["pid"] == old_pid and r["world_size"] == 2)
    alone = [r for r in lines if r["world_size"] == 1]
    assert {r["pid"] for r in alone} == {old_pid}, "the survivor's worker process trains on: no restart"
    assert alone[0]["step"] == before + 1, f"trained to step {before} together, then step {alone[0]['step']} alone"
    assert alone[0].get("reformed_in_place") is True, alone[0]
    assert "re-forming around them" in log, log[-3000:]
    started = [e for e in read_events(str(tmp_path / "events-a.jsonl")) if e["event"] == "workers_started"]
    assert started[-1].get("in_place") is True, started[-1]


WORKER = str(Path(__file__).with_name("inplace_worker.py"))


def _worker(mode: str) -> list[str]:
    """tests/elastic/inplace_worker.py in ``mode``."""
    return [WORKER, "--mode", mode, "--steps", str(STEPS), "--step-time", "0.1"]


def test_a_script_without_the_wrapper_is_restarted_as_before(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    """Drop-in intact: a plain DDP script (no ``elastic.inplace``) marks nothing, so after node B's loss the
    survivor's agent restarts its worker (a new process), as before; nothing is re-formed in place."""
    lines, victims, log = _fault_node_b(tmp_path, etcd_server, train=_worker("plain"))
    (old_pid,) = {r["pid"] for r in lines if r["world_size"] == 2} - set(victims)
    alone = [r for r in lines if r["world_size"] == 1]
    assert old_pid not in {r["pid"] for r in alone}, "a new worker process trains alone"
    assert alone[0]["step"] == 1, "no checkpoint in this script: the restarted worker starts over"
    events = read_events(str(tmp_path / "events-a.jsonl"))
    assert not [e for e in events if e.get("in_place")], "nothing re-formed in place"
    assert not [e for e in events if e["event"] == "in_place_fallback"], "no in-place attempt to fall back from"
    assert "re-forming around them" not in log


def test_a_rebuild_error_falls_back_to_a_restart_with_its_event(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    """The wrapped worker waits in place after node B's loss and is assigned its new group, but releasing an
    object of the old group raises: it reports ``rebuild_failed`` and exits, and its agent emits
    ``in_place_fallback`` and restarts it (not charged: ``--max-restarts 0``)."""
    lines, victims, log = _fault_node_b(tmp_path, etcd_server, train=_worker("fail-release"))
    (old_pid,) = {r["pid"] for r in lines if r["world_size"] == 2} - set(victims)
    alone = [r for r in lines if r["world_size"] == 1]
    assert old_pid not in {r["pid"] for r in alone}, "the worker that fell back was restarted"
    events = read_events(str(tmp_path / "events-a.jsonl"))
    (fallback,) = [e for e in events if e["event"] == "in_place_fallback"]
    assert fallback["why"] == "rebuild_failed" and "injected" in fallback["detail"], fallback
    assert fallback["ranks"] == [0]
    later = [e["event"] for e in events if e["t_wall"] > fallback["t_wall"]]
    assert "workers_started" in later, later
    assert "in-place re-form abandoned (rebuild_failed)" in log, log[-3000:]
    assert not unexpected_tracebacks(log), log[-3000:]  # an orderly exit (InPlaceFallbackError is a SystemExit)


def test_fsdp2_survivor_of_a_killed_peer_reshards_in_place_from_memory(tmp_path: Path,
                                                                       etcd_server: EmbeddedEtcd) -> None:
    """train_gpt.py --parallel fsdp, a snapshot every step: node B SIGKILLed whole. The survivor's worker keeps its
    process, shards the model again at world size 1 and restores through the memory tier's resharding read path
    (its own just-in-time snapshot, B's shards from the buddy copy it holds): at most two steps redone."""
    train = [str(EXAMPLES / "train_gpt.py"), "--parallel", "fsdp", "--steps", str(STEPS), "--global-batch", "8",
             "--context", "32", "--corpus-chars", "8192", "--log-every", "1000", "--ckpt-every", "1000",
             "--step-time", "0.1", "--pg-timeout", "60", "--memory-snapshot-every", "1",
             "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    lines, victims, log = _fault_node_b(tmp_path, etcd_server, train=train)
    (old_pid,) = {r["pid"] for r in lines if r["world_size"] == 2} - set(victims)
    before = max(r["step"] for r in lines if r["pid"] == old_pid and r["world_size"] == 2)
    alone = [r for r in lines if r["world_size"] == 1]
    assert {r["pid"] for r in alone} == {old_pid}, "the survivor's worker process trains on: no restart"
    first = alone[0]
    assert first.get("reformed_in_place") is True, first
    assert first["restore_source"] in {"memory_local", "memory_peer"}, first
    # B's shards come from the buddy copy A holds, which trails the step in flight (its exchange is asynchronous).
    assert before - 2 <= first["restore_step"] <= before and first["step"] == first["restore_step"] + 1, (before, first)
    assert "re-forming around them" in log, log[-3000:]
