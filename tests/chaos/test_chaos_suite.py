"""The chaos suite (``pytest -m chaos``): seeded faults injected into a real spotrun job, then assertions on
the final state: final step and exit code, final weights bit-identical to an uninterrupted run, only
committed checkpoints loaded (and the newest one), no process left, no etcd key left, restarts == faults.
Plus the faults a job cannot survive: each must end with a clear error, a non-zero exit and the last
committed checkpoint intact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import etcd3
import pytest
import torch

from elastic.chaos.api import Fault, FaultKind, Schedule
from elastic.chaos.storage import write_control
from elastic.events import read_events
from tests.chaos.jobs import CKPT_EVERY, STEPS, TRAIN, Job, committed_steps, final_state
from tests.harness.procs import SPOTRUN, Launcher, Timeout, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final weights and optimizer state of the same job with no fault (one run per module)."""
    from elastic.etcd_server import EmbeddedEtcd

    root = tmp_path_factory.mktemp("reference")
    with EmbeddedEtcd() as etcd:
        job = Job(root, etcd.endpoint, "reference")
        code, _ = job.run(Schedule(), timeout=90)
    assert code == 0, job.output()[-3000:]
    step, tensors = final_state(job.ckpt)
    assert step == STEPS
    return tensors


def _etcd_keys(endpoint: str, run_id: str) -> list[str]:
    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    try:
        return sorted(meta.key.decode() for _, meta in client.get_prefix(f"/spotrun/rdzv/{run_id}/"))
    finally:
        client.close()


def _assert_run_left_etcd_clean(endpoint: str, run_id: str) -> None:
    """After a clean end no key of the run is left: registrations and join keys go with their revoked leases,
    and the last agent to leave deletes the closed marker, the last round record and the rounds' c10d store
    (elastic/rendezvous/etcd_v3.py, ``_reap_ended_run``)."""
    try:
        wait_for(lambda: not _etcd_keys(endpoint, run_id), 5, f"run {run_id!r}'s etcd keys to go")
    except Timeout:
        pytest.fail(f"keys of run {run_id!r} left after a clean end: {_etcd_keys(endpoint, run_id)}")


def _assert_same(final: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert final.keys() == reference.keys()
    differ = [k for k in final if not torch.equal(final[k], reference[k])]
    assert not differ, f"final tensors differ from the uninterrupted run: {differ}"


@pytest.mark.parametrize("fault", [
    Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=15),
    Fault(kind=FaultKind.KILL_WORKER, target="worker:any", at_step=22),
])
def test_survivable_fault_ends_with_the_reference_weights(tmp_path: Path, etcd_server, reference, fault: Fault) -> None:
    job = Job(tmp_path, etcd_server.endpoint, "survive")
    code, injector = job.run(Schedule(seed=11, faults=(fault,)), timeout=100)
    assert code == 0, job.output()[-3000:]
    assert len(injector.injected) == 1, injector.injected
    assert len(job.restarts()) == len(injector.injected), job.restarts()  # restarts == faults injected
    step, tensors = final_state(job.ckpt)
    assert step == STEPS
    _assert_same(tensors, reference)
    committed = committed_steps(job.ckpt)
    resumed = job.resumed_steps()
    assert resumed, "the restarted workers did not resume from a checkpoint"
    assert all(s in committed for s in resumed), (resumed, committed)
    # The newest checkpoint committed before the fault is the one that was loaded (none newer was skipped).
    assert resumed[-1] >= job.committed_at_fault[0], (resumed, job.committed_at_fault)
    job.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "survive")


def test_restarts_exhausted_end_cleanly(tmp_path: Path, etcd_server) -> None:
    job = Job(tmp_path, etcd_server.endpoint, "exhausted", max_restarts=0)
    code, injector = job.run(Schedule(faults=(Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=15),)),
                             timeout=90)
    assert len(injector.injected) == 1
    assert code != 0
    assert "Signal 9 (SIGKILL)" in job.output() or "SIGKILL" in job.output(), job.output()[-3000:]
    _assert_last_committed_loads(job, expect_at_least=CKPT_EVERY)
    job.assert_no_process_left()


def test_permanent_storage_failure_ends_cleanly(tmp_path: Path, etcd_server) -> None:
    job = Job(tmp_path, etcd_server.endpoint, "storage", max_restarts=1)
    permanent = Fault(kind=FaultKind.STORAGE_ERROR, at_step=12, params={"rate": 1.0, "ops": "all"})
    code, injector = job.run(Schedule(faults=(permanent,)), timeout=100)
    assert len(injector.injected) == 1
    assert code != 0
    assert "Input/output error (injected by chaos://" in job.output(), job.output()[-3000:]
    assert "CheckpointStorageError" in job.output()
    write_control(job.control, 0, [])  # the storage heals: what was committed before is intact
    _assert_last_committed_loads(job, expect_at_least=CKPT_EVERY)
    job.assert_no_process_left()


def test_etcd_lost_past_its_bound_ends_cleanly(tmp_path: Path, etcd_server) -> None:
    # Steps slow enough that training outlasts the 3 s bound (training itself needs no etcd: a job that
    # ends within the bound succeeds, rightly).
    job = Job(tmp_path, etcd_server.endpoint, "quorum", max_restarts=3, steps=60, step_time=0.2,
              rdzv_conf="lease_ttl=2,last_call_timeout=0.5,join_timeout=60,etcd_timeout=3")
    down = Fault(kind=FaultKind.RESTART_ETCD, target="etcd:0", at_step=12, duration_s=600)
    code, injector = job.run(Schedule(faults=(down,)), timeout=90, endpoints=(etcd_server.endpoint,))
    try:
        assert len(injector.injected) == 1, injector.injected
        assert code != 0
        # One line naming the endpoint and the duration, no traceback; the workers were stopped.
        error = [line for line in job.output().splitlines() if line.startswith("spotrun: error:")]
        assert len(error) == 1, job.output()[-3000:]
        assert f"etcd at {etcd_server.endpoint} unreachable for " in error[0] and "etcd_timeout=3 s" in error[0]
        assert "Traceback" not in job.output(), job.output()[-3000:]
        last = [(e["event"], e.get("state")) for e in job.events][-2:]
        assert last == [("workers_stopped", None), ("run_finished", "FAILED")], last
        _assert_last_committed_loads(job, expect_at_least=CKPT_EVERY)
        job.assert_no_process_left()
    finally:
        for proc in injector.started:  # close() started the member again: ours to stop
            proc.kill()
            proc.wait(10)


def _assert_last_committed_loads(job: Job, expect_at_least: int) -> None:
    committed = committed_steps(job.ckpt)
    assert committed and committed[-1] >= expect_at_least, committed
    step, _ = final_state(job.ckpt)
    assert step == committed[-1]


def test_etcd_leader_killed_costs_no_restart(tmp_path: Path, etcd_cluster, reference) -> None:
    endpoints = ",".join(etcd_cluster)
    job = Job(tmp_path, endpoints, "leader")
    kill = Fault(kind=FaultKind.KILL_ETCD_LEADER, at_step=12, duration_s=1.0)
    code, injector = job.run(Schedule(faults=(kill,)), timeout=100, endpoints=tuple(etcd_cluster))
    try:
        assert code == 0, job.output()[-3000:]
        assert len(injector.injected) == 1, injector.injected
        assert job.restarts() == []  # the other two members keep the quorum: nothing to recover from
        step, tensors = final_state(job.ckpt)
        assert step == STEPS
        _assert_same(tensors, reference)
        job.assert_no_process_left()
        _assert_run_left_etcd_clean(etcd_cluster[0], "leader")
    finally:
        for proc in injector.started:
            proc.kill()
            proc.wait(10)


def test_spotrun_chaos_cli_wraps_a_standalone_job(tmp_path: Path, reference) -> None:
    """What a user types: spotrun-chaos around `spotrun --standalone ... train_ddp.py`; the worker is found
    through the command's --events-file, the job survives, the journal and events agree."""
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps({"seed": 5, "faults": [{"kind": "kill_worker", "target": "worker:0", "at_step": 15}]}))
    events, progress, journal = tmp_path / "events.jsonl", tmp_path / "progress.jsonl", tmp_path / "journal.jsonl"
    argv = [sys.executable, "-m", "elastic.chaos.cli", "--schedule", str(schedule), "--journal", str(journal),
            "--progress-file", str(progress), "--",
            *SPOTRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--events-file", str(events),
            TRAIN, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--step-time", "0.05",
            "--progress-file", str(progress), "--ckpt-dir", f"chaos::file://{tmp_path}/ckpt", "--pg-timeout", "20"]
    launcher = Launcher(argv, tmp_path / "chaos.log")
    try:
        code = launcher.wait(100)
    finally:
        launcher.close()
    assert code == 0, launcher.output()[-3000:]
    records = read_events(str(journal))
    injected = [r for r in records if r["record"] == "injected"]
    assert len(injected) == 1 and injected[0]["rank"] == 0, records
    assert records[-1]["record"] == "finished" and records[-1]["exit_code"] == 0
    assert len([e for e in read_events(str(events)) if e["event"] == "failure_detected"]) == 1
    step, tensors = final_state(f"chaos::file://{tmp_path}/ckpt")
    assert step == STEPS
    _assert_same(tensors, reference)
