"""A worker SIGKILL under spotrun resumes from the memory tier: at most one step redone, bit-identical result.

examples/train_ddp.py with ``--memory-snapshot-every 1`` runs under spotrun (2 workers, ``--max-restarts 1``, a
real etcd); once rank 1 has finished step 10 it is SIGKILLed. The agent restarts both workers, which restore
from the snapshots in the agent's keeper directory (``restore_source: memory_local`` on their first progress
line) and train on; no durable checkpoint exists before the end (``--ckpt-every`` 1000). The final checkpoint
and every step's loss equal those of an uninterrupted run bit for bit, and the keeper directory is gone after
the agent exits.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from elastic.etcd_server import EmbeddedEtcd
from tests.chaos.jobs import final_state
from tests.harness.procs import EXAMPLES, SPOTRUN, Launcher, make_env, read_jsonl, run_cli, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN = str(EXAMPLES / "train_ddp.py")
STEPS = 30
KILL_AFTER = 10
COMMON = ["--steps", str(STEPS), "--global-batch", "64", "--dataset-size", "1000", "--ckpt-every", "1000",
          "--log-every", "1000", "--memory-snapshot-every", "1"]
RDZV_CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"


def _spotrun(endpoint: str, run_id: str, restarts: int, ckpt: Path, progress: Path, events: Path) -> list[str]:
    return [*SPOTRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(restarts),
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", RDZV_CONF, "--events-file", str(events),
            TRAIN, *COMMON, "--ckpt-dir", str(ckpt), "--progress-file", str(progress)]


def _losses(progress: Path) -> dict[int, float]:
    """step -> rank 0's global loss (the last run of a step wins)."""
    return {r["step"]: r["loss"] for r in read_jsonl(progress) if r["rank"] == 0}


def _keeper_dirs(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("spotrun-memtier-") and run_id in n]


def test_worker_sigkill_resumes_from_memory_bit_identical(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    result = run_cli(_spotrun(etcd_server.endpoint, "memtier-ref", 0, ref / "ckpt", ref / "progress.jsonl",
                              ref / "events.jsonl"), timeout=300, env=make_env(LOGLEVEL="WARNING"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

    run = tmp_path / "run"
    run.mkdir()
    progress = run / "progress.jsonl"
    argv = _spotrun(etcd_server.endpoint, "memtier-kill", 1, run / "ckpt", progress, run / "events.jsonl")
    launcher = Launcher([*argv, "--step-time", "0.05"], run / "spotrun.log", env=make_env(LOGLEVEL="WARNING"))
    try:
        victim = wait_for(
            lambda: next((r for r in read_jsonl(progress) if r["rank"] == 1 and r["step"] >= KILL_AFTER), None),
            timeout=300, what=f"rank 1 finishing step {KILL_AFTER}",
        )
        assert _keeper_dirs("memtier-kill"), "the agent made no keeper directory"
        first_pids = {r["pid"] for r in read_jsonl(progress)}  # the workers before the fault
        os.kill(victim["pid"], signal.SIGKILL)
        assert launcher.wait(timeout=300) == 0, launcher.output()[-4000:]
    finally:
        launcher.close()

    lines = read_jsonl(progress)
    assert len(first_pids) == 2
    before = max(r["step"] for r in lines if r["pid"] in first_pids)
    restores = [r for r in lines if "restore_source" in r]
    assert len(restores) == 2, restores  # one first line per restarted rank
    assert {r["rank"] for r in restores} == {0, 1}
    for r in restores:
        assert r["restore_source"] == "memory_local"
        assert r["pid"] not in first_pids
        assert r["step"] == r["restore_step"] + 1
        assert r["restore_bytes"] > 0 and r["restore_seconds"] > 0
    redone = before - restores[0]["restore_step"]
    assert 0 <= redone <= 1, f"trained up to step {before}, resumed after step {restores[0]['restore_step']}"
    assert _losses(progress) == _losses(ref / "progress.jsonl")  # float equality of every step's loss
    # the agent reported the restart's restore once, for both local workers
    events = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "restore_completed"]
    assert len(events) == 1 and events[0]["ranks"] == [0, 1], events
    assert events[0]["restore_source"] == "memory_local"
    assert events[0]["restore_step"] == restores[0]["restore_step"]

    ref_step, ref_state = final_state(str(ref / "ckpt"))
    step, state = final_state(str(run / "ckpt"))
    assert step == ref_step == STEPS
    assert sorted(state) == sorted(ref_state)
    for name, tensor in ref_state.items():
        assert torch.equal(state[name], tensor), name
    assert _keeper_dirs("memtier-kill") == [] and _keeper_dirs("memtier-ref") == []
