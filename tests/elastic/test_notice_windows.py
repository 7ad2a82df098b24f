"""A preemption notice at any moment of a node's life is a planned leave (issue 27), with real agents, etcd and
workers: while the agent starts (its imports, the forkserver's warm-up, the etcd connect), while its workers start
(imports, ``init_process_group``, the restore: before their ``Preemption`` helpers exist), whether the signal
reaches the agent alone or every process of the node (as Slurm signals a job step). The node exits 0 with a
``planned_leave`` event (``saved: false`` and why), the other node trains on to the end, and nothing is lost:
the survivors resume from the last committed step.

The other windows are covered where their code lives: between rounds and as a spare
(tests/elastic/test_agent_planned.py), while training (tests/elastic/test_planned.py), the exit barrier and
after the run (tests/elastic/test_planned_coordinator.py: ``run_over``, and below)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.events import read_events
from elastic.planned import WHY_BEFORE_HELPERS
from elastic.planned.hook import WHY_BETWEEN_ROUNDS
from elastic.worker.mailbox import Mailbox
from elastic.worker.preemption import announce_helper
from tests.harness.procs import EXAMPLES, REPO, SPOTRUN, Launcher, read_jsonl, wait_for

TRAIN = str(EXAMPLES / "train_ddp.py")
RDZV_CONF = "lease_ttl=2,last_call_timeout=0.3,join_timeout=90"
STEPS = 40


def _agent(tmp_path: Path, name: str, endpoint: str, run_id: str) -> Launcher:
    return Launcher(
        [*SPOTRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
         "--rdzv-conf", RDZV_CONF, "--max-restarts", "0", "--stop-grace", "1", "--monitor-interval", "0.1",
         "--log-dir", str(tmp_path / f"logs-{name}"), "--events-file", str(tmp_path / f"events-{name}.jsonl"),
         TRAIN, "--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
         "--step-time", "0.05", "--preempt-sync-every", "2", "--log-every", "1000",
         "--progress-file", str(tmp_path / "progress.jsonl")],
        tmp_path / f"{name}.log",
    )


def _events(tmp_path: Path, name: str, event: str) -> list[dict]:
    path = tmp_path / f"events-{name}.jsonl"
    return [e for e in read_events(str(path)) if e["event"] == event] if path.exists() else []


def _progress(tmp_path: Path) -> list[dict]:
    path = tmp_path / "progress.jsonl"
    return read_jsonl(path) if path.exists() else []


def _close(agents: list[Launcher]) -> None:
    for agent in agents:
        agent.close()


def _assert_left_and_the_other_finished(tmp_path: Path, leaver: Launcher, other: Launcher) -> dict:
    """The leaver exited 0 as a planned leave; the other agent trained every step and exited 0."""
    assert leaver.wait(90) == 0, leaver.output()[-3000:]
    leaves = _events(tmp_path, "b", "planned_leave")
    assert len(leaves) == 1, leaves
    # A round of b alone (a slow to start on a loaded host) is re-formed when a arrives: that membership change is
    # no failure of b's; anything else would be the notice taken for one.
    failures = [e for e in _events(tmp_path, "b", "failure_detected") if e.get("cause") != "membership_change"]
    assert not failures, f"the notice is not a failure: {failures}"
    assert "Traceback" not in leaver.output(), leaver.output()[-3000:]
    assert other.wait(180) == 0, other.output()[-3000:]
    steps = [p["step"] for p in _progress(tmp_path)]
    assert max(steps) == STEPS, "the job went on to the end on the other node"
    return leaves[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("whole_node", [False, True], ids=["agent", "every-process"])
def test_a_notice_as_the_workers_start_is_a_planned_leave(tmp_path: Path, etcd_server, whole_node: bool) -> None:
    """SIGTERM to agent b right after its workers started (to the agent, or 0.3 s later to every process of the
    node, its workers included, as Slurm signals a step): b used to exit 1 (torch's immediate shutdown)."""
    agents = [_agent(tmp_path, "a", etcd_server.endpoint, "start"), _agent(tmp_path, "b", etcd_server.endpoint, "start")]
    a, b = agents
    try:
        wait_for(lambda: _events(tmp_path, "b", "workers_started"), 120, "b's workers to start", interval=0.005)
        if whole_node:
            time.sleep(0.3)  # the workers are importing and joining the group: what the signal hits is the point
            tree = b.snapshot_tree()
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        else:
            b.signal(signal.SIGTERM)
        leave = _assert_left_and_the_other_finished(tmp_path, b, a)
        if leave["saved"] is False:
            assert leave["why"].startswith(WHY_BEFORE_HELPERS), leave
        # else: the helpers were already built (a loaded machine's scheduling): a committed agreed step is as good
    finally:
        _close(agents)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0.5, 1.5, 4.0])
def test_a_notice_while_the_agent_starts_is_a_planned_leave(tmp_path: Path, etcd_server, delay: float) -> None:
    """SIGTERM to agent b ``delay`` s after its process started: its imports, the forkserver's warm-up, the etcd
    connect or its first rendezvous, whichever it is in. It used to exit -15 (imports) or 1 (start-up). (The
    interpreter's own start, the few tens of milliseconds before spotrun's first line runs, is the one moment a
    notice still ends the process as the default disposition does.)"""
    a = _agent(tmp_path, "a", etcd_server.endpoint, "boot")
    b = _agent(tmp_path, "b", etcd_server.endpoint, "boot")
    try:
        wait_for(lambda: time.time() - b.started_at >= delay, delay + 5, "the delay", interval=0.005)
        b.signal(signal.SIGTERM)
        leave = _assert_left_and_the_other_finished(tmp_path, b, a)
        if leave["saved"] is False:
            assert leave["why"].startswith((WHY_BETWEEN_ROUNDS, WHY_BEFORE_HELPERS)), leave
        else:  # an idle machine: b was already training at the moment, and committed an agreed step
            assert isinstance(leave["step"], int), leave
    finally:
        _close([a, b])


def test_the_warm_forkserver_does_not_preload_the_helpers_module() -> None:
    """A warm worker must run ``elastic.worker.preemption``'s import itself: that import announces the helper
    (``coming-{local_rank}``), which a preloaded module would never do in the worker."""
    code = ("import importlib, sys\nfrom elastic.warm import DEFAULT_PRELOAD\n"
            "for name in DEFAULT_PRELOAD: importlib.import_module(name)\n"
            "print('elastic.worker.preemption' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_a_worker_importing_the_helper_announces_it(tmp_path: Path) -> None:
    box = tmp_path / "box"
    box.mkdir()
    env = {"LOCAL_RANK": "1", "SPOTRUN_NOTICE_DIR": str(box)}
    assert announce_helper(env) is True
    assert Mailbox(str(box)).helpers_coming() == {1}
    assert announce_helper({"SPOTRUN_NOTICE_DIR": str(box)}) is False, "no LOCAL_RANK: not a worker (the forkserver)"
    assert announce_helper({"LOCAL_RANK": "0"}) is False, "no mailbox: stock torchrun"
