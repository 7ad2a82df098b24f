"""The chaos suite (``pytest -m chaos``): seeded faults injected into a real spotrun job, then assertions on
the final state: final step and exit code, final weights bit-identical to an uninterrupted run, only
committed checkpoints loaded (and the newest one), no process left, no etcd key left, restarts == faults.
With the memory tier on (``--memory-snapshot-every 1``), the unplanned faults (worker SIGKILL, node SIGKILL with
a replacement or without one, two faults in a row) must restore from memory (``restore_completed`` events) and
redo at most one step each. Plus the faults a job cannot survive: each must end with a clear error, a non-zero exit and the last
committed checkpoint intact."""

from __future__ import annotations

import json
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import etcd3
import pytest
import torch

from elastic.chaos.api import Fault, FaultKind, Schedule
from elastic.chaos.storage import write_control
from elastic.events import read_events
from elastic.memory_keeper import remove_orphaned_keepers
from tests.chaos.jobs import CKPT_EVERY, STEPS, TRAIN, Job, Nodes, committed_steps, final_objects, final_state
from tests.harness.procs import SPOTRUN, Launcher, Timeout, run_cli, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(120)]


@dataclass(frozen=True)
class Outcome:
    """What a run ended with: every tensor of its final checkpoint, the checkpoint's JSON objects (the data
    cursor, the trainer's step and samples seen) and each step's global loss (rank 0's progress lines)."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    losses: dict[int, float]


def _outcome(ckpt: str, progress: Path) -> Outcome:
    step, tensors = final_state(ckpt)
    assert step == STEPS
    losses = {line["step"]: line["loss"] for line in read_events(str(progress)) if line["rank"] == 0}
    assert sorted(losses) == list(range(1, STEPS + 1)), sorted(losses)
    return Outcome(tensors, final_objects(ckpt), losses)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The same job with no fault (one run per module)."""
    from elastic.etcd_server import EmbeddedEtcd

    root = tmp_path_factory.mktemp("reference")
    with EmbeddedEtcd() as etcd:
        job = Job(root, etcd.endpoint, "reference")
        code, _ = job.run(Schedule(), timeout=90)
    assert code == 0, job.output()[-3000:]
    return _outcome(job.ckpt, job.progress_file)


@pytest.fixture(scope="module")
def reference(reference_run: Outcome) -> dict[str, torch.Tensor]:
    """Final weights and optimizer state of the same job with no fault."""
    return reference_run.tensors


DETERMINISTIC = ("--preempt-sync-every", "2", "--deterministic")


@pytest.fixture(scope="module")
def deterministic_reference(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The same job with ``--deterministic``, uninterrupted, as one plain process (deterministic mode is
    bit-identical at any world size, so no process group at all is the strongest contrast)."""
    root = tmp_path_factory.mktemp("deterministic-reference")
    ckpt, progress = f"chaos::file://{root}/ckpt", root / "progress.jsonl"
    argv = [sys.executable, TRAIN, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--ckpt-dir", ckpt,
            "--progress-file", str(progress), *DETERMINISTIC]  # fmt: skip
    result = run_cli(argv, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return _outcome(ckpt, progress)


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
    (elastic/rendezvous/cleanup.py, ``EndedRun.reap``)."""
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


MEMORY = ("memory_local", "memory_peer")


def _restarts_from_progress(progress: list[dict]) -> list[dict]:
    """Each restart that restored something, from the progress lines (appended in time order; a restarted
    worker's first line carries its restore's ``restore_*`` fields): its source(s), the step it restored and
    the newest step any worker had reported before it (``reached``). ``reached - step`` is the steps redone."""
    restarts: list[dict] = []
    reached = 0
    for line in progress:
        if "restore_source" in line:
            if not restarts or len(restarts[-1]["pids"]) == restarts[-1]["world_size"]:
                restarts.append({"step": line["restore_step"], "reached": reached, "world_size": line["world_size"],
                                 "pids": set(), "sources": set()})
            current = restarts[-1]
            assert line["restore_step"] == current["step"], f"the ranks of one restart restored other steps: {line}"
            current["pids"].add(line["pid"])
            current["sources"].add(line["restore_source"])
        reached = max(reached, line["step"])
    return restarts


def _assert_restored_from_memory(restarts: list[dict], faults: int) -> None:
    """One restart per fault, each from memory, each redoing at most one step."""
    assert len(restarts) == faults, restarts
    for restart in restarts:
        assert restart["sources"] <= set(MEMORY), f"not restored from memory: {restart}"
        assert 0 <= restart["reached"] - restart["step"] <= 1, f"more than one step redone: {restart}"


def _rel_diff(final: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, max |final - reference| / max |reference| (as tests/elastic/test_exactness.py: relative to
    the tensor's magnitude, since a near-cancelled element keeps its terms' absolute rounding)."""
    assert final.keys() == reference.keys()
    exact = [k for k, r in reference.items() if not r.is_floating_point() and not torch.equal(final[k], r)]
    assert not exact, f"integer tensors differ: {exact}"
    return {k: ((final[k].double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)).item()
            for k, r in reference.items() if r.is_floating_point()}


def test_unplanned_worker_faults_restore_from_memory_bit_identical(tmp_path: Path, etcd_server, reference) -> None:
    """Memory tier on (a snapshot every step): worker 1 SIGKILLed, then worker 0 SIGKILLed two steps into the
    recovered run (two faults in a row, both between the same two durable checkpoints). Each restart restores
    from the node's memory (``memory_local``, in the progress lines and in one ``restore_completed`` event per
    fault), redoes at most one step, and the job ends with the reference weights bit for bit. The durable tier
    alone would redo 2 and 6 steps here."""
    faults = (Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=12),
              Fault(kind=FaultKind.KILL_WORKER, target="worker:0", at_step=16))
    job = Job(tmp_path, etcd_server.endpoint, "memkill", memory_every=1)
    code, injector = job.run(Schedule(seed=17, faults=faults), timeout=100)
    assert code == 0, job.output()[-3000:]
    assert len(injector.injected) == len(faults), injector.injected
    assert len(job.restarts()) == len(faults), job.restarts()
    restarts = _restarts_from_progress(read_events(str(job.progress_file)))
    _assert_restored_from_memory(restarts, len(faults))
    # The agent says so too: one restore_completed per fault, from this node's memory, at the step restored.
    events = job.restores()
    assert [(e["restore_source"], e["restore_step"], e["ranks"]) for e in events] == \
        [("memory_local", r["step"], [0, 1]) for r in restarts], (events, restarts)
    assert all(e["restore_bytes"] > 0 for e in events), events
    assert job.resumed_steps() == [r["step"] for r in restarts]
    step, tensors = final_state(job.ckpt)
    assert step == STEPS
    _assert_same(tensors, reference)
    job.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "memkill")


def test_a_dead_keeper_is_replaced_and_memory_restores_go_on(tmp_path: Path, etcd_server, reference) -> None:
    """Memory tier on. The agent's keeper is SIGKILLed: the snapshots stay, and the next worker SIGKILL still
    restores from memory. Then the new keeper gets a SIGTERM, which makes it remove the node's snapshots as it
    leaves. The agent logs each death once, starts another keeper and makes the directory again, so the
    workers' snapshots resume there and the next worker SIGKILL restores from memory again (before: the
    directory stayed gone, every later snapshot failed and that restore came from the durable step 20).
    The job ends with the reference weights bit for bit."""
    faults = (Fault(kind=FaultKind.KILL_KEEPER, target="agent:0", at_step=6),
              Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=11),
              Fault(kind=FaultKind.KILL_KEEPER, target="agent:0", at_step=15, params={"signal": "TERM"}),
              Fault(kind=FaultKind.KILL_WORKER, target="worker:0", at_step=23))
    # Slower steps: the keeper sent its death signal by hand waits up to AGENT_EXIT_WAIT (3 s) for its agent's
    # pipe before it takes the agent for alive and leaves; the run must outlast that to see the second death.
    job = Job(tmp_path, etcd_server.endpoint, "memkeeper", memory_every=1, step_time=0.3)
    code, injector = job.run(Schedule(seed=19, faults=faults), timeout=100)
    assert code == 0, job.output()[-3000:]
    assert [r["kind"] for r in injector.injected] == [f.kind.value for f in faults], injector.injected
    assert len(job.restarts()) == 2, job.restarts()  # a keeper's death stops no worker
    restarts = _restarts_from_progress(read_events(str(job.progress_file)))
    _assert_restored_from_memory(restarts, 2)
    events = job.restores()
    assert [(e["restore_source"], e["restore_step"]) for e in events] == [("memory_local", r["step"]) for r in restarts]
    # Each death logged once, by the agent, naming the keeper's PID.
    deaths = [line for line in job.output().splitlines() if "memory tier keeper (pid" in line and " died " in line]
    killed, termed = (r["pid"] for r in injector.injected if r["kind"] == FaultKind.KILL_KEEPER.value)
    assert len(deaths) == 2, deaths
    assert f"(pid {killed})" in deaths[0] and "snapshots are intact" in deaths[0], deaths
    assert f"(pid {termed})" in deaths[1] and "removed the directory" in deaths[1], deaths
    step, tensors = final_state(job.ckpt)
    assert step == STEPS
    _assert_same(tensors, reference)
    job.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "memkeeper")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("in_place", [False, True], ids=["restart", "in-place"])
def test_node_lost_for_good_goes_on_at_the_smaller_world_size(tmp_path: Path, etcd_server, reference_run: Outcome,
                                                              in_place: bool) -> None:
    """Two agents of one worker each (``--nnodes 1:2``), memory tier on; node 1 (agent, worker and keeper) is
    SIGKILLed and not replaced. The survivor's group re-forms alone (world size 1, same global batch). With
    restarts (``SPOTRUN_REFORM_IN_PLACE=0``) its new worker restores from its own memory, redoing at most one
    step; in place (train_ddp.py's default) the same worker process trains on from its next step, restoring
    nothing. Either way the final state is within the 1e-5 bound of the uninterrupted world-size-2 run (the
    gradient sums are grouped differently, as in test_exactness.py)."""
    # The first round waits for both agents (up to 60 s: one agent's start-up can lag far behind on a loaded
    # machine); last_call_timeout is for the first round only, the re-form after the loss does not wait for it.
    nodes = Nodes(tmp_path, etcd_server.endpoint, "memshrink", memory_every=1, min_nodes=1, replace=False,
                  rdzv_conf="lease_ttl=2,last_call_timeout=60,join_timeout=300", in_place=in_place)
    try:
        injector = nodes.run(Schedule(seed=4, faults=(Fault(kind=FaultKind.KILL_AGENT, target="agent:1", at_step=12),)),
                             timeout=210)
    finally:
        remove_orphaned_keepers()  # the lost node's keeper directory (its keeper died with it; no agent sweeps it)
    codes = [a.proc.returncode for a in nodes.agents]
    assert codes == [0, -signal.SIGKILL], f"exit codes {codes}\n{nodes.output()}"
    assert len(injector.injected) == 1, injector.injected
    survivor, lost = nodes.agents
    progress = read_events(str(nodes.progress_file))
    assert {p["world_size"] for p in progress if "restore_source" not in p and p["step"] <= 12} == {2}, progress[:3]
    if in_place:
        lines = _assert_re_formed_in_place(nodes, survivor, progress, reference_run, ["peer_lost"])
        # Before the loss the same size as the reference: every step's loss equal to it, bit for bit.
        together = [p for p in lines if p["world_size"] == 2]
        assert [p["loss"] for p in together] == [reference_run.losses[p["step"]] for p in together], together
        assert not nodes.restores(), "nothing restored: the survivor's state stayed in its process"
    else:
        restarts = _restarts_from_progress(progress)
        _assert_restored_from_memory(restarts, 1)
        assert restarts[0]["world_size"] == 1 and restarts[0]["sources"] == {"memory_local"}, restarts
        (event,) = [e for e in nodes.events_of(survivor) if e["event"] == "restore_completed"]
        assert (event["restore_source"], event["restore_step"]) == ("memory_local", restarts[0]["step"]), event
    _assert_final(nodes, reference_run, exact=False)
    nodes.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "memshrink")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("deterministic", [False, True], ids=["within-1e-5", "deterministic-bit-identical"])
def test_a_paused_node_then_a_notice_re_form_in_place_and_end_exact(
        tmp_path: Path, etcd_server, reference_run: Outcome, deterministic_reference: Outcome,
        deterministic: bool) -> None:
    """Three agents of one worker each (``--nnodes 1:3``, none replaced), memory tier on, in place (train_ddp.py's
    default), two faults in a row: node 2 is paused whole (``stop_agent``: a silent loss, seen when its lease
    lapses; the two survivors abort their blocked collective and must stand at the same step: 3 -> 2), then node
    1 gets a notice (a planned leave at the agreed step, committed: 2 -> 1). Each survivor's worker keeps its
    process and trains on from its next step. The final state is within 1e-5 of the uninterrupted world-size-2
    run; with ``--deterministic`` (bit-identical at any world size) it is the uninterrupted run's bit for bit,
    every step's loss included: what a survivor keeps in its process across a re-form (weights, momentum, data
    cursor) is exactly what a restarted worker would restore. The paused node is SIGKILLed once the survivors
    trained past it (a cloud reclaiming a hung VM), which only ends its processes."""
    reference = deterministic_reference if deterministic else reference_run
    nodes = Nodes(tmp_path, etcd_server.endpoint, "inplace2", nodes=3, memory_every=1, min_nodes=1, replace=False,
                  rdzv_conf="lease_ttl=2,last_call_timeout=60,join_timeout=300", in_place=True,
                  script_extra=DETERMINISTIC if deterministic else Nodes.script_extra)
    faults = (Fault(kind=FaultKind.STOP_AGENT, target="agent:2", at_step=6),
              Fault(kind=FaultKind.KILL_AGENT, target="agent:2", at_step=12),  # past step 7: the survivors re-formed
              Fault(kind=FaultKind.TERM_AGENT, target="agent:1", at_step=18))
    try:
        injector = nodes.run(Schedule(seed=29, faults=faults), timeout=270)
    finally:
        remove_orphaned_keepers()  # the paused node's keeper directory (SIGKILLed with it; no agent sweeps it)
    survivor, leaver, paused = nodes.agents
    assert [r["kind"] for r in injector.injected] == [f.kind.value for f in faults], injector.injected
    assert [r["pid"] for r in injector.injected] == [paused.pid, paused.pid, leaver.pid], injector.injected
    codes = [a.proc.returncode for a in nodes.agents]
    assert codes == [0, 0, -signal.SIGKILL], f"exit codes {codes}\n{nodes.output()}"
    (leave,) = [e for e in nodes.events_of(leaver) if e["event"] == "planned_leave"]
    assert leave["saved"], leave
    progress = read_events(str(nodes.progress_file))
    lines = _assert_re_formed_in_place(nodes, survivor, progress, reference, ["peer_lost", "planned_leave"],
                                       exact=deterministic)
    left = _assert_re_formed_in_place(nodes, leaver, progress, reference, ["peer_lost"], to_step=leave["step"],
                                      exact=deterministic)
    _assert_re_formed_in_place(nodes, paused, progress, reference, [], to_step=None, exact=deterministic)
    worlds = [p["world_size"] for p in lines]
    assert worlds == sorted(worlds, reverse=True) and set(worlds) == {3, 2, 1}, worlds
    # The two survivors of the pause re-formed at the same step; the leave at the agreed step, which was
    # committed: the survivor's next step is the one after it.
    first = [[p["step"] for p in w if p.get("reformed_in_place")] for w in (lines, left)]
    assert first[0][0] == first[1][0] and first[0][1] == leave["step"] + 1, (first, leave)
    assert not nodes.restores(), "nothing restored: every survivor's state stayed in its process"
    _assert_final(nodes, reference, exact=deterministic)
    nodes.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "inplace2")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("held", [False, True], ids=["crash", "crash-held"])
def test_a_peers_worker_crash_re_forms_in_place_bit_identical(tmp_path: Path, etcd_server,
                                                              reference_run: Outcome, held: bool) -> None:
    """Two agents of one worker each (world size 2, as the reference), memory tier on, in place (train_ddp.py's
    default): the worker of rank 1 is SIGKILLed; its agent restarts it (``--max-restarts 1``) and re-joins, while
    the other node's worker, whose collective broke, waits in its process and restores with the new worker
    (``recovery_cause`` ``peer_failure``). At the same world size throughout, the job ends bit-identical to the
    uninterrupted run, and every step the survivor ran, a redone one included, had the reference's loss.
    ``crash-held``: the dead worker's connections stay open (``hold_connections``), so the survivor's collective
    hangs as NCCL's would, and is aborted on the crashed node's announcement: the same outcome."""
    run_id = "peerfail-held" if held else "peerfail"
    nodes = Nodes(tmp_path, etcd_server.endpoint, run_id, max_restarts=1, memory_every=1, in_place=True)
    fault = Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=12, params={"hold_connections": held})
    injector = nodes.run(Schedule(seed=5, faults=(fault,)), timeout=210)
    codes = [a.proc.returncode for a in nodes.agents]
    assert codes == [0, 0], f"exit codes {codes}\n{nodes.output()}"
    (killed,) = injector.injected
    assert not held or killed["held"] >= 1, f"the dead worker's connections were held open: {killed}"
    first = {a.pid: [e for e in nodes.events_of(a) if e["event"] == "workers_started"] for a in nodes.agents}
    (crashed,) = [a for a in nodes.agents if killed["pid"] in first[a.pid][0]["pids"]]
    (survivor,) = [a for a in nodes.agents if a is not crashed]
    started = first[survivor.pid]
    assert [(e.get("recovery_cause"), e.get("in_place", False)) for e in started] == \
        [(None, False), ("peer_failure", True)], started
    assert started[1]["pids"] == started[0]["pids"], f"the survivor's worker was replaced: {started}"
    assert killed["pid"] not in first[crashed.pid][-1]["pids"], "the crashed node's agent started a new worker"
    assert not [e for e in nodes.events if e["event"] == "in_place_fallback"], "no re-form fell back to a restart"
    progress = read_events(str(nodes.progress_file))
    (pid,) = started[0]["pids"]
    lines = [p for p in progress if p["pid"] == pid]
    (resumed,) = [p for p in lines if p.get("reformed_in_place")]
    assert resumed.get("restore_source") in MEMORY, f"the survivor restored with the new worker, from memory: {resumed}"
    before = [p["step"] for p in lines if p["t_wall"] < resumed["t_wall"]]
    assert before == list(range(1, before[-1] + 1)), before
    assert 0 <= before[-1] - resumed["restore_step"] <= 1, f"more than one step redone: {before[-1]}, {resumed}"
    assert [p["step"] for p in lines if p["t_wall"] >= resumed["t_wall"]] == \
        list(range(resumed["restore_step"] + 1, STEPS + 1)), lines
    assert [p["loss"] for p in lines] == [reference_run.losses[p["step"]] for p in lines], lines
    _assert_final(nodes, reference_run, exact=True)
    nodes.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, run_id)


def _assert_final(nodes: Nodes, reference: Outcome, *, exact: bool) -> None:
    """The final checkpoint is step STEPS with the reference's objects (the data cursor and samples seen: no
    sample skipped or repeated) and its tensors, bit for bit (``exact``) or within 1e-5 of each tensor's
    largest magnitude."""
    step, tensors = final_state(nodes.ckpt)
    assert step == STEPS
    assert final_objects(nodes.ckpt) == reference.objects
    if exact:
        _assert_same(tensors, reference.tensors)
    else:
        rel = _rel_diff(tensors, reference.tensors)
        assert max(rel.values()) <= 1e-5, rel


def _assert_re_formed_in_place(nodes: Nodes, agent: Launcher, progress: list[dict], reference: Outcome,
                               causes: list[str], *, to_step: int | None = STEPS, exact: bool = False) -> list[dict]:
    """``agent``'s worker was re-formed in place once per fault it lived through (``causes``: each re-form's
    ``recovery_cause``): its ``workers_started`` events after the first carry ``in_place`` and the first one's
    pids, nothing fell back to a restart, and its worker process reported every step from 1 to ``to_step``
    (None: as far as it got) exactly once, in order (none skipped, none redone), restoring nothing, the first
    step at each new world size marked ``reformed_in_place``, each step's global loss the reference's (bit for
    bit with ``exact``, else within 1e-5: step N's loss is computed on step N's samples with the weights after
    step N-1, so a sample skipped or repeated, or a weight off, shows there first). Returns the worker's
    progress lines."""
    assert not [e for e in nodes.events if e["event"] == "in_place_fallback"], "no re-form fell back to a restart"
    started = [e for e in nodes.events_of(agent) if e["event"] == "workers_started"]
    assert [e.get("recovery_cause") for e in started] == [None, *causes], started
    assert [e.get("in_place", False) for e in started] == [False] + [True] * len(causes), started
    assert all(e["pids"] == started[0]["pids"] for e in started), f"the worker process was replaced: {started}"
    (pid,) = started[0]["pids"]
    lines = [p for p in progress if p["pid"] == pid]
    last = (lines[-1]["step"] if lines else 0) if to_step is None else to_step
    assert [p["step"] for p in lines] == list(range(1, last + 1)), [(p["step"], p["world_size"]) for p in lines]
    assert not [p for p in lines if "restore_source" in p], "restored nothing: the state stayed in the process"
    changed = [b["step"] for a, b in zip(lines, lines[1:]) if a["world_size"] != b["world_size"]]
    assert [p["step"] for p in lines if p.get("reformed_in_place")] == changed, lines
    assert len(changed) == len(causes), lines
    off = {p["step"]: (p["loss"], reference.losses[p["step"]]) for p in lines
           if (p["loss"] != reference.losses[p["step"]] if exact
               else p["loss"] != pytest.approx(reference.losses[p["step"]], rel=1e-5))}
    assert not off, f"steps whose loss differs from the uninterrupted run's (run, reference): {off}"
    return lines


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
@pytest.mark.parametrize("in_place", [False, True], ids=["restart", "in-place"])
def test_node_lost_and_node_preempted_end_with_the_reference_weights(tmp_path: Path, etcd_server, reference,
                                                                     in_place: bool) -> None:
    """Two agents of one worker each (world size 2, as the reference) and --max-restarts 0: the second agent
    gets a SIGTERM (a preemption: it saves at an agreed step and leaves, nothing lost, nothing charged), its
    replacement is SIGKILLed with its worker and keeper (a node lost: the survivor's restart is free), and a
    second replacement joins. One run for both cases; the first agent survives both. The memory tier is on: the
    planned leave restores its agreed step from memory (snapshotted before its save; the replacement reads the
    survivor's), the node loss too (the survivor its own, the replacement the survivor's), redoing at most one
    step. Run with restarts (``SPOTRUN_REFORM_IN_PLACE=0``) and in place (train_ddp.py's default: each change
    back to world size 2 is a join in place, the survivor's worker keeps its process and restores with the new
    one): bit-identical to the uninterrupted run either way."""
    nodes = Nodes(tmp_path, etcd_server.endpoint, "nodes", max_restarts=0, memory_every=1, in_place=in_place)
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
    # In place (train_ddp.py's default) each change is a join in place: the survivor's worker waits in its
    # process, and at the entry it restores with the replacement's new worker (needs_restore), as a restarted one
    # would; without, each change starts a new worker.
    assert not [e for e in own if e["event"] == "in_place_fallback"], "no re-form fell back to a restart"
    assert [e.get("in_place", False) for e in own if e["event"] == "workers_started"] == [False, in_place, in_place]
    pids = [tuple(e["pids"]) for e in own if e["event"] == "workers_started"]
    assert (len(set(pids)) == 1) == in_place, f"the survivor's worker pids: {pids}"
    # The lost node is known either from its revoked lease first (the liveness probe: its port refused at once,
    # a membership change) or from the survivor's broken collective first (a worker failure with the peer lost).
    causes = [e["cause"] for e in own if e["event"] == "failure_detected"]
    assert causes in (["membership_change"], ["worker_failure_with_peer_loss"]), causes
    # Where each restart's state came from: both from memory, the planned one at the agreed step (the workers
    # snapshot it before its save), the unplanned one at most one step back.
    planned, unplanned = _restarts_from_progress(progress)
    assert planned["sources"] == {"memory_peer"} and planned["step"] == leave["step"] == planned["reached"], planned
    _assert_restored_from_memory([unplanned], 1)
    replacement = nodes.agents[3]
    restored = {agent: [(e["restore_source"], e["restore_step"]) for e in nodes.events_of(agent)
                        if e["event"] == "restore_completed"] for agent in (survivor, replacement)}
    # The replacement's keeper was empty: its bytes came from the survivor's, and a group's report says
    # memory_peer when any rank received a byte from another node (so the survivor's event says it too).
    assert restored[survivor] == [("memory_peer", leave["step"]), ("memory_peer", unplanned["step"])], restored
    assert restored[replacement] == [("memory_peer", unplanned["step"])], restored
    nodes.assert_no_process_left()
    _assert_run_left_etcd_clean(etcd_server.endpoint, "nodes")
