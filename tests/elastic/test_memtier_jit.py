"""A node SIGKILLed mid-run costs no completed step with a memory snapshot only every 10 steps (just in time).

Two spotrun agents (two "nodes", one worker each, ``--nnodes 1:2``) run examples/train_ddp.py with
``--memory-snapshot-every 10`` and no durable checkpoint before the end. Node B (agent, worker, keeper) is
SIGKILLed at a step that is not a multiple of 10. The survivor's collective breaks; its worker snapshots its last
completed step into its keeper just in time (``snapshot_on_failure``), the agent re-forms the group alone and the
new worker restores that step from memory: 0 steps redone, where the periodic snapshot alone would redo up to 9.
The agent reports the restore in events.jsonl (``restore_completed``, ``memory_local``). ``--deterministic``
makes the result bit-identical to an uninterrupted run at any world size.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic.etcd_server import EmbeddedEtcd
from elastic.memory_keeper import remove_orphaned_keepers
from elastic.report import recoveries
from tests.chaos.jobs import final_state
from tests.harness.procs import EXAMPLES, REPO, SPOTRUN, Launcher, make_env, read_jsonl, signal_all, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]  # long: ~22 s end to end (CI's long step)

STEPS = 40
EVERY = 10
KILL_AT = 15
TRAIN = [str(EXAMPLES / "train_ddp.py"), "--deterministic", "--global-batch", "64", "--dataset-size", "1000",
         "--steps", str(STEPS), "--ckpt-every", "1000", "--log-every", "1000", "--pg-timeout", "60"]  # fmt: skip
RDZV_CONF = "lease_ttl=3,last_call_timeout=0.5,join_timeout=60"


def _node(endpoint: str, run: Path, name: str) -> Launcher:
    argv = [*SPOTRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "0",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "jit", "--rdzv-conf", RDZV_CONF,
            "--events-file", str(run / f"events-{name}.jsonl"), *TRAIN, "--step-time", "0.1",
            "--memory-snapshot-every", str(EVERY), "--ckpt-dir", str(run / "ckpt"),
            "--progress-file", str(run / "progress.jsonl")]  # fmt: skip
    # The restart path (train_ddp.py re-forms in place by default, tests/elastic/test_abortable.py).
    return Launcher(argv, run / f"{name}.log", env=make_env(LOGLEVEL="WARNING", SPOTRUN_REFORM_IN_PLACE="0"))


def test_node_loss_restores_the_last_completed_step_from_a_just_in_time_snapshot(
    tmp_path: Path, etcd_server: EmbeddedEtcd
) -> None:
    ref = tmp_path / "ref"
    result = subprocess.run([sys.executable, *TRAIN, "--ckpt-dir", str(ref)], cwd=REPO, capture_output=True, text=True,
                            timeout=240, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

    run = tmp_path / "run"
    run.mkdir()
    progress = run / "progress.jsonl"
    a = _node(etcd_server.endpoint, run, "a")
    b = _node(etcd_server.endpoint, run, "b")
    try:
        wait_for(lambda: any(r["world_size"] == 2 for r in read_jsonl(progress)), timeout=240, what="the 2-node group")
        wait_for(lambda: any(r["step"] >= KILL_AT for r in read_jsonl(progress)), timeout=240, what=f"step {KILL_AT}")
        victims = set(b.snapshot_tree())
        # A first round of A alone (B slow to start on a loaded host) trains and restores too: look after the kill.
        killed_at, events_before = len(read_jsonl(progress)), len(read_jsonl(run / "events-a.jsonl"))
        signal_all(victims, signal.SIGKILL)  # node B: agent, forkserver, worker, keeper
        assert a.wait(timeout=300) == 0, a.output()[-4000:]
    finally:
        b.close()
        a.close()
        remove_orphaned_keepers()  # node B's keeper directory (its keeper was killed with it)

    lines = read_jsonl(progress)
    first = [r for r in lines if r["world_size"] == 2]
    (survivor_pid,) = {r["pid"] for r in first} - victims
    before = max(r["step"] for r in lines if r["pid"] == survivor_pid)
    assert before % EVERY, f"the fault came right after a periodic snapshot (step {before}): nothing to show"
    restores = [r for r in lines[killed_at:] if "restore_source" in r]
    assert len(restores) == 1, restores  # the re-formed group of one worker
    (restored,) = restores
    assert restored["world_size"] == 1 and restored["restore_source"] == "memory_local"
    assert restored["restore_step"] == before, f"trained to step {before}, resumed after {restored['restore_step']}"
    assert "just-in-time memory snapshot of step" in a.output()

    events = [e for e in read_jsonl(run / "events-a.jsonl")[events_before:] if e["event"] == "restore_completed"]
    assert len(events) == 1, events
    assert events[0]["restore_source"] == "memory_local" and events[0]["restore_step"] == before
    assert events[0]["ranks"] == [0] and events[0]["restore_bytes"] > 0

    # spotrun report: the recovery restored from memory and redid no step
    rec = [r for r in recoveries(read_jsonl(run / "events-a.jsonl"), progress=lines) if r.cause != "none"][-1]
    assert rec.restore_source == "memory_local" and rec.steps_lost == 0
    assert rec.stages["checkpoint_load"] is not None

    _, ref_state = final_state(str(ref))
    step, state = final_state(str(run / "ckpt"))
    assert step == STEPS and state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(state[name], tensor), f"{name} differs from the uninterrupted run"
