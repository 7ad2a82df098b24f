"""Overlapping faults (issue 16): a second fault inside the first one's recovery, or at the same instant.

What spotrun does (docs/guides/preemption.md, "Overlapping faults"):

* a notice and a peer crash together: the noticed node leaves for its notice with the planned-leave exit code
  (``saved: false`` and why, when its workers failed before the agreed step); the survivors re-form without
  both and restore from the newest committed step;
* a second node lost during a recovery, a notice during a recovery, two nodes lost at once: one more re-form
  each (or one for both, when the second fault lands before the first re-form completes); nothing is charged
  against ``--max-restarts``;
* the etcd leader lost during a planned stop: the quorum's other members answer, the stop completes as usual.

Every case ends with the weights of an uninterrupted run (``--deterministic``: bit-identical at any world
size, so the reference is one plain process), no process left, and the agents' exit codes as designed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic.chaos.api import Fault, FaultKind, Schedule
from tests.chaos.jobs import CKPT_EVERY, TRAIN, Nodes, final_state
from tests.harness.procs import REPO

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.long]

STEPS = 44
DETERMINISTIC = ("--preempt-sync-every", "2", "--deterministic")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run, one plain process (``--deterministic`` is bit-identical at any world size)."""
    ckpt = tmp_path_factory.mktemp("overlap-ref") / "ckpt"
    argv = [sys.executable, TRAIN, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--ckpt-dir",
            f"chaos::file://{ckpt}", *DETERMINISTIC]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    step, tensors = final_state(f"chaos::file://{ckpt}")
    assert step == STEPS
    return tensors


def _assert_reference(nodes: Nodes, reference: dict[str, torch.Tensor]) -> None:
    step, tensors = final_state(nodes.ckpt)
    assert step == STEPS, nodes.output()
    assert tensors.keys() == reference.keys()
    differ = [k for k in tensors if not torch.equal(tensors[k], reference[k])]
    assert not differ, f"final tensors differ from the uninterrupted run: {differ}"


def _assert_exit_codes(nodes: Nodes, injected: list[dict]) -> None:
    """SIGKILLed agents -9; every other agent, the preempted ones included, 0 (the planned-leave code)."""
    killed = {r["pid"] for r in injected if r["kind"] == FaultKind.KILL_AGENT.value}
    codes = {a.pid: a.proc.returncode for a in nodes.agents}
    expected = {pid: -signal.SIGKILL if pid in killed else 0 for pid in codes}
    assert codes == expected, f"exit codes {codes}, expected {expected}\n{nodes.output()}"


@pytest.mark.timeout(900)  # eight agent faults, each replaced by a new agent: ~2 min quiet, ~8 min loaded
def test_overlapping_node_faults_end_with_the_reference_weights(tmp_path: Path, etcd_server, reference) -> None:
    """Three agents of one worker each (``--nnodes 3``: every lost node is replaced, as a cluster would) and
    ``--max-restarts 0``; four pairs of overlapping faults in one run."""
    nodes = Nodes(tmp_path, etcd_server.endpoint, "overlap", nodes=3, steps=STEPS, step_time=0.1,
                  script_extra=DETERMINISTIC)  # fmt: skip
    faults = (
        # a notice and a crash at the same instant (one tick of the injector: the same few ms)
        Fault(kind=FaultKind.TERM_AGENT, target="agent:2", at_step=6),
        Fault(kind=FaultKind.KILL_AGENT, target="agent:1", at_step=6),
        # a second node lost during the recovery from the first
        Fault(kind=FaultKind.KILL_AGENT, target="agent:1", at_step=16),
        Fault(kind=FaultKind.KILL_AGENT, target="agent:0", after=2, after_s=1.0),
        # a notice during a recovery
        Fault(kind=FaultKind.KILL_AGENT, target="agent:2", at_step=26),
        Fault(kind=FaultKind.TERM_AGENT, target="agent:0", after=4, after_s=1.0),
        # two nodes lost at once
        Fault(kind=FaultKind.KILL_AGENT, target="agent:0", at_step=36),
        Fault(kind=FaultKind.KILL_AGENT, target="agent:1", at_step=36),
    )
    injector = nodes.run(Schedule(seed=16, faults=faults), timeout=840)
    injected = injector.injected
    assert len(injected) == len(faults), injector.injected
    _assert_exit_codes(nodes, injected)
    _assert_reference(nodes, reference)
    # The node noticed at the same instant as the crash left as a preemption: a planned_leave event, and when
    # its workers failed before the agreed step, saved: false with the reason.
    leaver = next(a for a in nodes.agents if a.pid == injected[0]["pid"])
    (leave,) = [e for e in nodes.events_of(leaver) if e["event"] == "planned_leave"]
    if not leave["saved"]:
        assert leave["why"], leave
    assert [e["state"] for e in nodes.events_of(leaver) if e["event"] == "run_finished"] == ["SUCCEEDED"]
    nodes.assert_no_process_left()


@pytest.mark.timeout(600)
def test_etcd_leader_lost_during_a_planned_stop(tmp_path: Path, etcd_cluster, reference) -> None:
    """A notice, and 0.2 s later the etcd leader SIGKILLed (restarted after 1 s): the quorum's other two
    members answer, the noticed node commits the agreed step and leaves, 0 steps lost."""
    nodes = Nodes(tmp_path, ",".join(etcd_cluster), "overlap-etcd", nodes=2, steps=STEPS, step_time=0.1,
                  script_extra=DETERMINISTIC)  # fmt: skip
    faults = (Fault(kind=FaultKind.TERM_AGENT, target="agent:1", at_step=8),
              Fault(kind=FaultKind.KILL_ETCD_LEADER, target="etcd:leader", after=0, after_s=0.2, duration_s=1.0))
    try:
        injector = nodes.run(Schedule(seed=17, faults=faults), timeout=540, endpoints=tuple(etcd_cluster))
    finally:
        for proc in nodes.injector.started if nodes.injector else ():
            proc.kill()
            proc.wait(10)
    assert [r["kind"] for r in injector.injected] == [f.kind.value for f in faults], injector.injected
    _assert_exit_codes(nodes, injector.injected)
    leaver = next(a for a in nodes.agents if a.pid == injector.injected[0]["pid"])
    (leave,) = [e for e in nodes.events_of(leaver) if e["event"] == "planned_leave"]
    assert leave["saved"], leave
    _assert_reference(nodes, reference)
    nodes.assert_no_process_left()
