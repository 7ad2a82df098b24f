"""A node lost under spotrun: its replacement, whose keeper is empty, restores from the survivor's memory.

Two agents of one worker each (``tests.chaos.jobs.Nodes``: two "nodes" on this machine, each with its own
keeper directory) run examples/train_ddp.py with ``--memory-snapshot-every 1``; once step 15 is reported the
second agent is SIGKILLed with its worker and keeper (a node lost) and a new agent joins. The new group restores
from memory, not from the durable step 10: the replacement's rank receives every byte from the survivor's keeper
(``restore_source: memory_peer`` on the first progress line of both ranks), and the final checkpoint equals an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elastic.chaos.api import Fault, FaultKind, Schedule
from elastic.etcd_server import EmbeddedEtcd
from tests.chaos.jobs import STEPS, Job, Nodes, final_state
from tests.harness.procs import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1500)]  # long: ~35 s end to end (CI's long step)

KILL_AT = 15
DURABLE_BEFORE = 10
"""The newest durable step when the node is lost (``--ckpt-every`` 10)."""


def test_replacement_node_restores_from_the_survivors_memory(tmp_path: Path, etcd_server: EmbeddedEtcd) -> None:
    ref = Job(tmp_path / "ref", etcd_server.endpoint, "mempeer-ref")
    code, _ = ref.run(Schedule(), timeout=400)
    assert code == 0, ref.output()[-3000:]

    nodes = Nodes(tmp_path / "run", etcd_server.endpoint, "mempeer", max_restarts=0,
                  script_extra=("--preempt-sync-every", "2", "--memory-snapshot-every", "1"))
    injector = nodes.run(Schedule(seed=1, faults=(Fault(kind=FaultKind.KILL_AGENT, target="agent:1", at_step=KILL_AT),)),
                         timeout=900)
    codes = [a.proc.returncode for a in nodes.agents]
    assert codes == [0, -signal.SIGKILL, 0], f"exit codes {codes}\n{nodes.output()}"
    assert len(injector.injected) == 1
    nodes.assert_no_process_left()

    restores = [r for r in read_jsonl(nodes.progress_file) if "restore_source" in r]
    assert len(restores) == 2, restores  # the first line of each rank of the new group
    for r in restores:
        assert r["restore_source"] == "memory_peer", r
        assert r["restore_step"] > DURABLE_BEFORE and r["step"] == r["restore_step"] + 1, r
    step, tensors = final_state(nodes.ckpt)
    ref_step, ref_tensors = final_state(ref.ckpt)
    assert step == ref_step == STEPS
    assert tensors.keys() == ref_tensors.keys()
    differ = [k for k in tensors if not (tensors[k] == ref_tensors[k]).all()]
    assert not differ, f"final tensors differ from the uninterrupted run: {differ}"
