"""The chaos suite (``pytest -m chaos``): seeded faults injected into a real spotrun job, then assertions on
the final state: final step and exit code, final weights bit-identical to an uninterrupted run, only
committed checkpoints loaded (and the newest one), no process left, no etcd key left, restarts == faults.
Plus the faults a job cannot survive: each must end with a clear error, a non-zero exit and the last
committed checkpoint intact."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import etcd3
import pytest
import torch

from elastic.chaos.api import Fault, FaultKind, Schedule
from elastic.chaos.storage import write_control
from elastic.events import read_events
from tests.chaos.jobs import CKPT_EVERY, STEPS, TRAIN, Job, Nodes, committed_steps, final_state
from tests.harness.procs import SPOTRUN, Launcher, Timeout, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(120)]


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


HANG_TIMEOUT = 2.0
"""--hang-timeout of the SIGSTOP case: a stopped worker is found in seconds, not at the gloo timeout."""


@pytest.mark.parametrize("faults", [
    # A hang and two crashes in one run (one job start for three cases): SIGSTOP (never SIGCONT: a frozen
    # process), found by the hang watch, named, killed and restarted; then worker 1 SIGKILLed, resumed from the
    # same checkpoint as the hang; then a seeded worker SIGKILLed after the next checkpoint.
    (Fault(kind=FaultKind.STOP_WORKER, target="worker:1", at_step=12),
     Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=15),
     Fault(kind=FaultKind.KILL_WORKER, target="worker:any", at_step=24)),
], ids=["stop-kill-kill"])
def test_survivable_fault_ends_with_the_reference_weights(tmp_path: Path, etcd_server, reference,
                                                          faults: tuple[Fault, ...]) -> None:
    job = Job(tmp_path, etcd_server.endpoint, "survive", hang_timeout=HANG_TIMEOUT)
    code, injector = job.run(Schedule(seed=11, faults=faults), timeout=100)
    assert code == 0, job.output()[-3000:]
    assert len(injector.injected) == len(faults), injector.injected
    assert len(job.restarts()) == len(injector.injected), job.restarts()  # restarts == faults injected
    step, tensors = final_state(job.ckpt)
    assert step == STEPS
    _assert_same(tensors, reference)
    committed = committed_steps(job.ckpt)
    resumed = job.resumed_steps()
    assert len(resumed) == len(faults), f"each restart resumes from a checkpoint: {resumed}"
    assert all(s in committed for s in resumed), (resumed, committed)
    # The newest checkpoint committed before each fault is the one that was loaded (none newer was skipped).
    assert all(r >= c for r, c in zip(resumed, job.committed_at_fault)), (resumed, job.committed_at_fault)
    _assert_hangs_found(job.events, injector.injected)
    job.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "survive")


def _assert_hangs_found(events: list[dict], injected: list[dict]) -> None:
    """Each SIGSTOPped worker is named in one hang_detected event within its timeout + 1 s, its recovery is
    labelled a hang, and no worker was called hung that was not stopped."""
    stopped = [r for r in injected if r["kind"] == FaultKind.STOP_WORKER.value]
    found = [e for e in events if e["event"] == "hang_detected"]
    assert [set(e["hung"]) for e in found] == [{str(r["rank"])} for r in stopped], (found, stopped)
    for record, event in zip(stopped, found):
        assert "stopped" in event["hung"][str(record["rank"])], event
        late = event["t_wall"] - record["t_wall"]
        assert late <= HANG_TIMEOUT + 1.0, f"hang found {late:.2f} s after the SIGSTOP (timeout {HANG_TIMEOUT} s)"
        after = [e for e in events if e["event"] == "failure_detected" and e["t_wall"] >= event["t_wall"]]
        assert after and after[0]["cause"] == "hang" and after[0]["recovery_cause"] == "hang", after[:1]


def test_restarts_exhausted_end_cleanly(tmp_path: Path, etcd_server) -> None:
    job = Job(tmp_path, etcd_server.endpoint, "exhausted", max_restarts=0)
    code, injector = job.run(Schedule(faults=(Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=15),)),
                             timeout=90)
    assert len(injector.injected) == 1
    assert code != 0
    assert "Signal 9 (SIGKILL)" in job.output() or "SIGKILL" in job.output(), job.output()[-3000:]
    _assert_last_committed_loads(job, expect_at_least=CKPT_EVERY)
    job.assert_no_process_left()


STORAGE_BURST_S = 3.0
"""A transient storage burst: every write fails for this long, ~10x the 0.26 s the old retry policy (5
attempts from 50 ms) lasted, well inside ``retry_timeout`` (60 s)."""


def test_storage_burst_costs_no_restart_and_no_weight(tmp_path: Path, etcd_server, reference) -> None:
    """Every checkpoint write fails with EIO for 3 s from step 9 (the save at step 10 is written inside the
    burst): the background save retries until the storage is back, training goes on, and the job ends with 0
    restarts, every periodic step committed and the reference weights bit for bit."""
    job = Job(tmp_path, etcd_server.endpoint, "blip", max_restarts=0)
    burst = Fault(kind=FaultKind.STORAGE_ERROR, at_step=9, duration_s=STORAGE_BURST_S,
                  params={"rate": 1.0, "ops": "write"})
    code, injector = job.run(Schedule(seed=2, faults=(burst,)), timeout=100)
    assert code == 0, job.output()[-3000:]
    assert len(injector.injected) == 1, injector.injected
    assert job.restarts() == [], job.restarts()
    assert job.resumed_steps() == [], "no rollback: the workers never restarted"
    # The burst really met a save, and outlasted the old policy's 5 attempts.
    attempts = [int(a) for a in re.findall(r"storage .* failed \(attempt (\d+)\), retrying", job.output())]
    assert attempts and max(attempts) > 5, job.output()[-3000:]
    assert "injected by chaos://, " in job.output()
    assert "checkpoint save failed" not in job.output(), job.output()[-3000:]
    assert committed_steps(job.ckpt) == [CKPT_EVERY, 2 * CKPT_EVERY, STEPS]
    step, tensors = final_state(job.ckpt)
    assert step == STEPS
    _assert_same(tensors, reference)
    job.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "blip")


def test_permanent_storage_failure_ends_cleanly(tmp_path: Path, etcd_server) -> None:
    # Retries end after 2 s (not the default 60 s): both failed saves and the failed load fit the test's time.
    job = Job(tmp_path, etcd_server.endpoint, "storage", max_restarts=1, extra=("--ckpt-retry-timeout", "2"))
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


@pytest.mark.timeout(360)  # four agent start-ups, three in turn: 4 min on a loaded 2-core machine, 30 s on a quiet one
def test_node_lost_and_node_preempted_end_with_the_reference_weights(tmp_path: Path, etcd_server, reference) -> None:
    """Two agents of one worker each (world size 2, as the reference) and --max-restarts 0: the second agent
    gets a SIGTERM (a preemption: it saves at an agreed step and leaves, nothing lost, nothing charged), its
    replacement is SIGKILLed with its worker (a node lost: the survivor's restart is free), and a second
    replacement joins. One run for both cases; the first agent survives both."""
    nodes = Nodes(tmp_path, etcd_server.endpoint, "nodes", max_restarts=0)
    faults = (Fault(kind=FaultKind.TERM_AGENT, target="agent:1", at_step=6),
              Fault(kind=FaultKind.KILL_AGENT, target="agent:1", at_step=18))
    injector = nodes.run(Schedule(seed=3, faults=faults), timeout=330)
    codes = [a.proc.returncode for a in nodes.agents]
    assert codes == [0, 0, -signal.SIGKILL, 0], f"exit codes {codes}\n{nodes.output()}"
    assert [r["kind"] for r in injector.injected] == [f.kind.value for f in faults], injector.injected
    survivor, leaver, lost, _ = nodes.agents
    assert [r["pid"] for r in injector.injected] == [leaver.pid, lost.pid]
    step, tensors = final_state(nodes.ckpt)
    assert step == STEPS
    _assert_same(tensors, reference)
    # The preempted node saved at the agreed step and the group went on from the next one: 0 steps lost.
    (leave,) = [e for e in nodes.events_of(leaver) if e["event"] == "planned_leave"]
    assert leave["saved"] and not leave["late"], leave
    progress = read_events(str(nodes.progress_file))
    before = [p["step"] for p in progress if p["t_wall"] <= leave["t_wall"]]
    after = [p["step"] for p in progress if p["t_wall"] > leave["t_wall"]]
    assert max(before) == leave["step"] and min(after) == leave["step"] + 1, (leave["step"], before[-3:], after[:3])
    # Restarts == faults: the survivor's workers started once, then once per fault, with the fault's cause;
    # neither counted against --max-restarts 0 (or the survivor would have given up).
    own = nodes.events_of(survivor)
    started = [e["recovery_cause"] for e in own if e["event"] == "workers_started"]
    assert started == [None, "planned_leave", "peer_lost"], started
    assert all(e["restarts_left"] == 0 for e in own if e["event"] == "workers_started")
    # The lost node is known either from its revoked lease first (the liveness probe: its port refused at once,
    # a membership change) or from the survivor's broken collective first (a worker failure with the peer lost).
    causes = [e["cause"] for e in own if e["event"] == "failure_detected"]
    assert causes in (["membership_change"], ["worker_failure_with_peer_loss"]), causes
    nodes.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "nodes")
