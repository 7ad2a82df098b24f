"""The in-place re-form (elastic.worker.reform, driven by elastic.inplace.run): the mailbox messages, the agent's
choice (in place only when every local worker can, never with SPOTRUN_REFORM_IN_PLACE=0) and, end to end, a
peer's planned leave after which the survivor's worker goes on in the same process."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from elastic.api import ENV_REFORM_IN_PLACE, InPlaceFallback
from elastic.chaos.hold import hold_sockets, release
from elastic.planned.inplace import decide_fallback
from elastic.worker.mailbox import GroupAssignment, Mailbox, WorkerNotice
from elastic.worker.reform import InPlaceReform, ReformConfig
from tests.elastic.test_agent_planned import NoticeHandler
from tests.elastic.test_agent_planned import _agent as unit_agent
from tests.elastic.test_planned import (
    RDZV_CONF,
    _agent,
    _assert_resumed_exactly,
    _events,
    _progress,
    _running,
    _training_at,
)
from tests.harness.procs import EXAMPLES, SPOTRUN, Launcher, make_env, wait_for

ASSIGNMENT = GroupAssignment(rank=1, world_size=3, group_rank=1, group_world_size=3, master_addr="10.0.0.1",
                             master_port=29500, restart_count=0)


def _box(tmp_path: Path) -> Mailbox:
    (tmp_path / "mailbox").mkdir()
    return Mailbox(str(tmp_path / "mailbox"))


@pytest.mark.timeout(30)
def test_an_assignment_is_read_once_and_gives_the_new_environment(tmp_path: Path) -> None:
    box = _box(tmp_path)
    assert box.take_assignment(0) is None
    box.assign(0, ASSIGNMENT)
    assert box.take_assignment(1) is None, "another local rank's assignment is not this worker's"
    assert box.take_assignment(0) == ASSIGNMENT
    assert box.take_assignment(0) is None, "consumed: a later re-form never reads a stale one"
    assert ASSIGNMENT.to_env()["WORLD_SIZE"] == "3" and ASSIGNMENT.to_env()["MASTER_PORT"] == "29500"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", [{"rank": 3}, {"world_size": 0}, {"master_port": 0}, {"master_addr": ""},
                                    {"group_rank": -1}, {"rank": "x"}, {"restart_count": None}])
def test_a_damaged_assignment_is_a_clear_error_naming_the_file(tmp_path: Path, damage: dict) -> None:
    """Nothing read is trusted: a group-N.json out of range (a rank past the world size would hang the new
    group's init) is refused with the file's name, not turned into a worker environment."""
    import dataclasses
    import json

    box = _box(tmp_path)
    (tmp_path / "mailbox" / "group-0.json").write_text(json.dumps({**dataclasses.asdict(ASSIGNMENT), **damage}))
    with pytest.raises(ValueError, match="group-0.json: not a group assignment"):
        box.take_assignment(0)


@pytest.mark.timeout(30)
def test_a_waiting_worker_takes_its_assignment_and_one_with_its_own_notice_exits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = _box(tmp_path)
    monkeypatch.delenv(ENV_REFORM_IN_PLACE, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    reform = InPlaceReform(ReformConfig(timeout=20), mailbox_dir=box.path)
    assert box.in_place_capable() == {0}, "the worker tells its agent it can re-form in place"
    box.post(WorkerNotice("peer_preempt", None, "node b"))
    posted = threading.Timer(0.2, box.assign, args=(0, ASSIGNMENT))
    posted.start()
    try:
        assert reform.wait() == ASSIGNMENT
    finally:
        posted.cancel()
    assert box.waiting() == {0}, "the agent sees the worker waiting"
    box.post(WorkerNotice("preempt", None, "this node"))
    assert reform.wait() is None, "this node's own notice: the worker exits, as without the flag"
    box.post(WorkerNotice("resize", None, "a node joins"))
    assert reform.wait() is None, "a joining node, and this worker's function cannot restore: exit as before"
    reform.joinable = True
    posted = threading.Timer(0.2, box.assign, args=(0, ASSIGNMENT))
    posted.start()
    try:
        assert reform.wait() == ASSIGNMENT, "a joinable worker waits in place for the joiner's group"
    finally:
        posted.cancel()
    monkeypatch.setenv(ENV_REFORM_IN_PLACE, "1")
    assert InPlaceReform(mailbox_dir=box.path).enabled, "the deprecated SPOTRUN_REFORM_IN_PLACE=1 changes nothing"
    (tmp_path / "mailbox" / "inplace-0").unlink()
    monkeypatch.setenv(ENV_REFORM_IN_PLACE, "0")
    assert not InPlaceReform(mailbox_dir=box.path).enabled, "SPOTRUN_REFORM_IN_PLACE=0 turns it off"
    assert box.in_place_capable() == set(), "and the worker does not say it can"


@pytest.mark.slow
@pytest.mark.long  # ~30 s on 2 loaded cores; a prototype's end-to-end case
@pytest.mark.timeout(240)
def test_a_peers_planned_leave_keeps_the_survivors_worker_process(tmp_path: Path, etcd_server) -> None:
    """train_ddp.py runs under elastic.inplace.run; no variable is set: in place is chosen by use."""
    env = _no_variable()
    agents = [_agent(tmp_path, name, etcd_server.endpoint, "inplace", steps=80, env=env) for name in ("a", "b")]
    a, b = agents
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "two agents to train at world size 2")
        left_at = len(_progress(tmp_path))  # a first round of A alone (B slow to start) trained at size 1 too
        b.signal(signal.SIGTERM)
        assert b.wait(30) == 0, "the preempted agent leaves"
        agreed = _events(tmp_path, "planned_leave")[0]["step"]
        assert a.wait(90) == 0, "the survivor finishes the run at world size 1"
    progress = _progress(tmp_path)
    _assert_resumed_exactly(progress, agreed, 2, 1)
    survivor = {p["pid"] for p in progress[left_at:] if p["world_size"] == 1}
    before = {p["pid"] for p in progress if p["world_size"] == 2 and p["step"] == agreed}
    assert len(survivor) == 1 and survivor <= before, f"the survivor's worker kept its process: {survivor} {before}"
    restart = [e for e in _events(tmp_path, "planned_restart") if e.get("in_place")]
    assert len(restart) == 1 and restart[0]["agreed_step"] == agreed, _events(tmp_path, "planned_restart")
    started = [e for e in _events(tmp_path, "workers_started") if e.get("in_place")]
    assert len(started) == 1 and started[0]["world_size"] == 1 and started[0]["t_wall"] > restart[0]["t_wall"]


def _no_variable() -> dict[str, str]:
    env = make_env()
    env.pop(ENV_REFORM_IN_PLACE, None)
    return env


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["capable", "not-capable", "turned-off"])
def test_the_agent_re_forms_in_place_only_when_every_worker_can_and_waits_for_a_peers_leave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    from elastic.planned import PlannedTick
    from tests.elastic.test_agent_planned import NoticeHandler
    from tests.elastic.test_agent_planned import _agent as unit_agent

    monkeypatch.delenv(ENV_REFORM_IN_PLACE, raising=False)
    if case == "turned-off":
        monkeypatch.setenv(ENV_REFORM_IN_PLACE, "0")
    handler = NoticeHandler()
    agent, box, _ = unit_agent(tmp_path, handler)
    box.register_helper(0)
    if case != "not-capable":
        box.mark_in_place(0)
    handler.peers = {"b": {"deadline": time.time() + 60, "source": "aws"}}
    assert agent.planned.tick() is PlannedTick.WAITING and box.read_notice().reason == "peer_preempt"
    box.acknowledge(0, 12)
    assert agent.planned.in_place.waiting() is None, "acknowledged, but the worker did not say it waits"
    box.mark_waiting(0)
    stopped = agent.planned.in_place.waiting()
    if case == "not-capable":
        assert stopped is None, "a worker that does not run under elastic.inplace.run is restarted as before"
        return
    if case == "turned-off":
        assert stopped is None, "SPOTRUN_REFORM_IN_PLACE=0: the workers are restarted as before"
        return
    assert stopped is not None and stopped.step == 12


@pytest.mark.timeout(30)
@pytest.mark.parametrize("joinable", [True, False])
def test_a_joining_node_re_forms_in_place_only_workers_that_take_part_in_its_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, joinable: bool) -> None:
    """A node waits to join (``resize``): workers that ask ``needs_restore`` (``joinable-N``) stay in their
    processes, at the agreed step or after a broken collective (a peer's restarted workers); others restart."""
    from elastic.planned import PlannedTick
    from tests.elastic.test_agent_planned import NoticeHandler
    from tests.elastic.test_agent_planned import _agent as unit_agent

    monkeypatch.delenv(ENV_REFORM_IN_PLACE, raising=False)
    handler = NoticeHandler()
    agent, box, _ = unit_agent(tmp_path, handler)
    box.register_helper(0)
    box.mark_in_place(0)
    if joinable:
        box.mark_joinable(0)
    handler.changed = True
    assert agent.planned.tick() is PlannedTick.WAITING and box.read_notice().reason == "resize"
    box.mark_waiting(0)
    assert agent.planned.in_place.broken_for_join() is joinable, "waiting without an acknowledgement: it broke"
    box.acknowledge(0, 12)
    assert agent.planned.in_place.broken_for_join() is False, "it stopped at the agreed step"
    stopped = agent.planned.in_place.waiting()
    assert (stopped is not None and stopped.step == 12) if joinable else stopped is None
    assert agent.planned.in_place.falls_back(frozenset({"a", "b"}), frozenset({"a", "b", "c"})) is not joinable


@pytest.mark.timeout(30)
@pytest.mark.parametrize("joinable", [True, False])
def test_a_peers_announced_restart_aborts_the_workers_groups_once_and_joinable_ones_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, joinable: bool) -> None:
    """A peer's workers failed and its agent restarts them (announced in the round, its lease kept): our workers'
    collective with the dead ones may hang (NCCL), so the agent tells them (``peer-lost.json``, ``restarted``)
    and their watchers abort the group; a joinable worker then waits in place for the re-form, another exits."""
    monkeypatch.delenv(ENV_REFORM_IN_PLACE, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    handler = NoticeHandler()
    agent, box, _ = unit_agent(tmp_path, handler)
    in_place = agent.planned.in_place
    handler.restarted = {"b"}
    assert in_place.peers_restarting() == set(), "no worker watches or re-forms in place: nobody to tell"
    assert in_place.abort_for_restarted_peers() is False and not box.peer_lost_posted()
    box.register_watcher(0)
    handler.restarted = set()
    assert in_place.abort_for_restarted_peers() is False and not box.peer_lost_posted()
    handler.restarted = {"b"}
    box.post_peer_lost(["c"])
    assert in_place.peers_restarting() == set(), "a loss told first stands (and the wait for it does not spin)"
    (tmp_path / "mailbox" / "peer-lost.json").unlink()
    handler.lost = {"c"}
    assert in_place.peers_restarting() == set(), "an unplanned loss is told by its own path, as a loss"
    handler.peers = {"c": {"deadline": time.time() + 60, "source": "aws"}}
    assert in_place.peers_restarting() == {"b"}, "a peer leaving with a notice does not hold back the word"
    handler.lost, handler.peers = set(), {}
    assert in_place.peers_restarting() == {"b"}
    assert in_place.abort_for_restarted_peers() is True
    assert box.peer_lost_posted() and box.peer_restarted()
    (tmp_path / "mailbox" / "peer-lost.json").unlink()
    assert in_place.peers_restarting() == set(), "told once per round"
    assert in_place.abort_for_restarted_peers() is False and not box.peer_lost_posted()
    handler.number = 8
    assert in_place.peers_restarting() == {"b"}, "a new round: told again"
    assert in_place.abort_for_restarted_peers() is True
    # The worker whose collective the watcher aborted:
    reform = InPlaceReform(ReformConfig(timeout=0.3), mailbox_dir=box.path)
    if joinable:
        reform.mark_joinable()
    assert reform.wait_after_loss(notice_wait=0.5) is None
    assert reform.timed_out is joinable, "a joinable worker waited for its new group; another exits at once"
    box.post_peer_lost(["b"])
    assert not box.peer_restarted(), "a loss posted after it is a loss"


@pytest.mark.timeout(30)
def test_a_peer_explains_a_failure_when_lost_or_when_it_announced_its_workers_restart(tmp_path: Path) -> None:
    """The agent's reading of its workers' failure (``MembershipView.peer_cause_of_failure``): a lost peer, a
    peer that announced its workers' restart (ours failed of the abort it caused: not charged, not announced
    again), else their own failure, which it announces (a failure to announce is only logged)."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from elastic.api import RecoveryCause

    handler = NoticeHandler()
    agent, _, _ = unit_agent(tmp_path, handler)
    membership = agent.membership
    assert membership.peer_cause_of_failure(last_chance_wait=None) is None
    handler.restarted = {"b"}
    assert membership.peer_cause_of_failure(last_chance_wait=None) is RecoveryCause.PEER_FAILURE
    handler.changed = True
    assert membership.peer_cause_of_failure(last_chance_wait=None) is RecoveryCause.PEER_LOST
    membership.announce_restart()
    assert handler.announced == 1
    handler.restart_error = RendezvousConnectionError("etcd is away")
    membership.announce_restart()  # logged, not raised: the peers then wait for their collectives' timeout
    assert handler.announced == 1


@pytest.mark.timeout(30)
def test_this_nodes_own_notice_never_re_forms_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.notice import Notice
    from elastic.planned import PlannedTick
    from tests.elastic.test_agent_planned import NoticeHandler
    from tests.elastic.test_agent_planned import _agent as unit_agent

    monkeypatch.delenv(ENV_REFORM_IN_PLACE, raising=False)
    agent, box, _ = unit_agent(tmp_path, NoticeHandler())
    box.register_helper(0)
    box.mark_in_place(0)
    agent.receive_notice(Notice("sigterm", time.time() + 60, "SIGTERM"))
    assert agent.planned.tick() is PlannedTick.WAITING
    box.acknowledge(0, 12)
    box.mark_waiting(0)
    assert agent.planned.in_place.waiting() is None, "the leaving node's workers exit"
    assert agent.planned.leaving_stop() is not None


def _pids_by_node(tmp_path: Path) -> dict[str, list[set[int]]]:
    """Per agent (its node id), the worker pids of each ``workers_started`` in order."""
    out: dict[str, list[set[int]]] = {}
    for e in _events(tmp_path, "workers_started"):
        out.setdefault(e["node"], []).append(set(e["pids"]))
    return out


def _node_of(tmp_path: Path, agent: Launcher) -> str:
    return next(node for node in _pids_by_node(tmp_path) if f"-{agent.pid}-" in node)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("change", ["join", "leave-and-spare"])
def test_a_joining_node_restores_while_the_survivors_keep_their_processes(
        tmp_path: Path, etcd_server, change: str) -> None:
    """A node joins (``join``: 2 -> 3) or a leave's round takes a waiting spare in (``leave-and-spare``: 2 -> 2):
    the survivors' workers stop at the agreed step, wait in their processes and take part in the joiner's
    restore (train_ddp.py asks ``Generation.needs_restore``); the joiner's fresh worker restores the agreed step
    from the memory tier or the checkpoint; no step is lost or repeated, nothing falls back to a restart."""
    env = _no_variable()
    nnodes = "1:3" if change == "join" else "1:2"
    agents = [_agent(tmp_path, name, etcd_server.endpoint, change, steps=150, nnodes=nnodes, env=env)
              for name in ("a", "b")]
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "two agents to train at world size 2")
        before_pids = {p["pid"] for p in _progress(tmp_path) if p["world_size"] == 2}
        agents.append(_agent(tmp_path, "c", etcd_server.endpoint, change, steps=150, nnodes=nnodes, env=env))
        if change == "leave-and-spare":
            spare = f"-{agents[2].pid}-"
            wait_for(lambda: any(spare in e["node"] for e in _events(tmp_path, "rendezvous_started")), 60,
                     "the spare to wait in the rendezvous")
            agents[1].signal(signal.SIGTERM)
            assert agents[1].wait(30) == 0, "the preempted agent leaves"
        for agent in agents if change == "join" else (agents[0], agents[2]):
            assert agent.wait(150) == 0, f"every agent finishes the run: {agent.output()[-2000:]}"
    progress = _progress(tmp_path)
    if change == "join":  # the last one: A may first train alone, and then B joins in place the same way
        restart = [e for e in _events(tmp_path, "planned_restart") if e.get("in_place")]
        assert restart and restart[-1]["reason"] == "resize", restart
        agreed, began = restart[-1]["agreed_step"], restart[-1]["t_wall"]
    else:  # the survivor may see B's notice, or only B gone (B's agent left first): in place either way
        (left,) = _events(tmp_path, "planned_leave")
        agreed, began = left["agreed_step"], left["t_wall"] - 5
    world = 3 if change == "join" else 2
    after = [p for p in progress if p["step"] == agreed + 1]
    assert len(after) == world and all(p["world_size"] == world for p in after), after
    kept = {p["pid"] for p in after} & before_pids
    survivors = 2 if change == "join" else 1
    assert len(kept) == survivors, f"the survivors' workers kept their processes: {after} (old pids {before_pids})"
    fresh = [p for p in after if p["pid"] not in before_pids]
    assert len(fresh) == 1 and fresh[0].get("restore_step") == agreed, f"the joiner restored the agreed step: {fresh}"
    assert all(p.get("reformed_in_place") for p in after if p["pid"] in kept), after
    for pid in kept:
        steps = [p["step"] for p in progress if p["pid"] == pid and p["world_size"] >= 2]
        assert steps == sorted(set(steps)) and steps[-1] == 150, f"no step repeated or lost by {pid}: {steps}"
    assert min(p["step"] for p in progress if p["pid"] == fresh[0]["pid"]) == agreed + 1
    assert not _events(tmp_path, "in_place_fallback"), _events(tmp_path, "in_place_fallback")
    started = [e for e in _events(tmp_path, "workers_started") if e.get("in_place") and e["t_wall"] > began]
    assert len(started) == survivors, started
    if change == "join":
        assert all(e["recovery_cause"] == "scale_up" for e in started), started


@pytest.mark.slow
@pytest.mark.long  # ~30 s each on 2 loaded cores
@pytest.mark.timeout(300)
@pytest.mark.parametrize("memory", ["memory-tier", "nothing-saved", "hung-collective"])
def test_a_peers_failed_worker_restarts_alone_and_the_survivor_keeps_its_process(
        tmp_path: Path, etcd_server, memory: str) -> None:
    """Node B's worker is SIGKILLed; B's agent restarts it (``--max-restarts 1``) and re-joins the round. Node
    A's worker, whose collective broke, waits in its process and takes part in the new worker's restore from the
    memory tier: at most one step is redone, both step together and A's worker process is the same. With
    nothing saved (no memory tier, no checkpoint yet) the restore finds nothing while A holds its trained state:
    every rank falls back (``restore_differs``) and both start again from step 1 together, as a restart would.
    ``hung-collective``: the dead worker's connections are held open (as NCCL sees a crashed peer, A's
    collective hangs instead of failing); B's agent announces the restart, A's agent tells its worker, whose
    watcher aborts the group: the same in-place re-form, A stepping again within seconds (a hung gloo
    collective would wait out its 30-minute timeout)."""
    env = _no_variable()
    script = ("--no-memory-tier",) if memory == "nothing-saved" else ()
    agents = [_agent(tmp_path, name, etcd_server.endpoint, "crash", steps=150, env=env, extra=("--max-restarts", "1"),
                     script=script) for name in ("a", "b")]
    a, b = agents
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "two agents to train at world size 2")
        wait_for(lambda: any(p["step"] >= 10 for p in _progress(tmp_path)), 60, "step 10")
        node_b = _node_of(tmp_path, b)
        (victim,) = _pids_by_node(tmp_path)[node_b][-1]
        killed_at = max(p["step"] for p in _progress(tmp_path))
        seen = len(_progress(tmp_path))
        held = hold_sockets(victim) if memory == "hung-collective" else []
        try:
            os.kill(victim, signal.SIGKILL)
            t_kill = time.time()
            if held:
                wait_for(lambda: any(p["pid"] != victim and p.get("reformed_in_place") for p in _progress(tmp_path)[seen:]),
                         60, "A's worker to step again in place, its collective with the dead worker aborted")
                resumed_in = min(p["t_wall"] for p in _progress(tmp_path)[seen:] if p.get("reformed_in_place")) - t_kill
        finally:
            release(held)
        assert a.wait(150) == 0 and b.wait(60) == 0, "both agents finish the run"
    node_a = _node_of(tmp_path, a)
    by_node = _pids_by_node(tmp_path)
    assert victim not in by_node[node_b][-1], "B's agent restarted its worker"
    started_a = [e for e in _events(tmp_path, "workers_started") if e["node"] == node_a]
    progress = _progress(tmp_path)
    new_pid = next(iter(by_node[node_b][-1]))
    assert max(p["step"] for p in progress) == 150
    if memory == "nothing-saved":
        old = {p["pid"] for p in progress[:seen]}
        firsts = {pid: min(p["step"] for p in progress[seen:] if p["pid"] == pid)
                  for pid in {p["pid"] for p in progress[seen:]} - old}
        assert list(firsts.values()) == [1, 1], f"nothing saved: both restarted workers begin at step 1: {firsts}"
        whys = {e["why"] for e in _events(tmp_path, "in_place_fallback")}
        assert whys == {"restore_differs"}, _events(tmp_path, "in_place_fallback")
        assert set(started_a[-1]["pids"]) != set(started_a[0]["pids"]) and not started_a[-1].get("in_place")
        return
    # The first step of each after its restore (A may log the step B died in before the re-form).
    restored = [p for p in progress[seen:] if "restore_step" in p or p.get("reformed_in_place")]
    first_new = min(p["step"] for p in restored if p["pid"] == new_pid)
    first_a = min(p["step"] for p in restored if p["pid"] != new_pid)
    assert first_a == first_new, f"both ranks step together after the fault: A at {first_a}, B at {first_new}"
    last = started_a[-1]  # A may have trained alone first; B's first worker then joined in place too
    assert last.get("in_place") and last["recovery_cause"] == "peer_failure", started_a
    assert set(last["pids"]) == set(started_a[0]["pids"]), "A's worker kept its process"
    assert first_new >= killed_at, f"at most one step redone: killed near {killed_at}, resumed at {first_new}"
    assert not _events(tmp_path, "in_place_fallback"), _events(tmp_path, "in_place_fallback")
    if memory == "hung-collective":
        assert resumed_in < 20, f"A stepped again {resumed_in:.1f} s after the crash"


def _gpt_agent(tmp_path: Path, name: str, endpoint: str, parallel: str, *, steps: int,
               nnodes: str = "1:2") -> Launcher:
    """One agent ("node") of one worker running examples/train_gpt.py at a small size, the memory tier on."""
    argv = [*SPOTRUN, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id",
            f"gpt-{parallel}", "--rdzv-conf", RDZV_CONF, "--max-restarts", "0", "--stop-grace", "1",
            "--monitor-interval", "0.1", "--events-file", str(tmp_path / "events.jsonl"),
            str(EXAMPLES / "train_gpt.py"), "--parallel", parallel, "--steps", str(steps),
            "--global-batch", "8", "--context", "32", "--corpus-chars", "8192", "--log-every", "1000",
            "--ckpt-every", "1000", "--ckpt-dir", str(tmp_path / "ckpt"), "--step-time", "0.05",
            "--preempt-sync-every", "2", "--memory-snapshot-every", "1",
            "--progress-file", str(tmp_path / "progress.jsonl")]  # fmt: skip
    return Launcher(argv, tmp_path / f"{name}.log", _no_variable())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_survivor_reshards_in_place_from_the_memory_tier(tmp_path: Path, etcd_server) -> None:
    """train_gpt.py --parallel fsdp, node B leaves with a notice: the survivor's worker keeps its process, shards
    the model again on the new mesh (world size 1) and restores its new shards through the memory tier's
    resharding read path at the agreed step: it trains on from the agreed step + 1."""
    agents = [_gpt_agent(tmp_path, name, etcd_server.endpoint, "fsdp", steps=40) for name in ("a", "b")]
    a, b = agents
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 180, "two agents to train at world size 2")
        wait_for(lambda: any(p["step"] >= 6 for p in _progress(tmp_path)), 120, "step 6")
        left_at = len(_progress(tmp_path))  # a first round of A alone (B slow to start) trained at size 1 too
        b.signal(signal.SIGTERM)
        assert b.wait(60) == 0, "the preempted agent leaves"
        agreed = _events(tmp_path, "planned_leave")[0]["step"]
        assert a.wait(120) == 0, "the survivor finishes the run at world size 1"
    progress = _progress(tmp_path)
    _assert_resumed_exactly(progress, agreed, 2, 1)
    alone = [p for p in progress[left_at:] if p["world_size"] == 1]
    before = {p["pid"] for p in progress if p["world_size"] == 2 and p["step"] == agreed}
    assert {p["pid"] for p in alone} <= before and len({p["pid"] for p in alone}) == 1, "same worker process"
    first = alone[0]
    assert first.get("reformed_in_place") is True, first
    assert first["restore_step"] == agreed and first["restore_source"] in {"memory_local", "memory_peer", "durable"}, first
    started = [e for e in _events(tmp_path, "workers_started") if e.get("in_place")]
    assert len(started) == 1 and started[0]["world_size"] == 1, _events(tmp_path, "workers_started")


@pytest.mark.slow
@pytest.mark.long  # ~60 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_fsdp2_survivors_reshard_in_place_when_a_node_joins(tmp_path: Path, etcd_server) -> None:
    """train_gpt.py --parallel fsdp at world size 2, a third node joins: the survivors keep their processes,
    shard the model on the 3-rank mesh and, with the joiner, restore the agreed step through the memory tier's
    resharding read path (the joiner reads the survivors' snapshots)."""
    # 150 steps: the third agent's start (seconds on a loaded host) must not reach the end of the run.
    agents = [_gpt_agent(tmp_path, name, etcd_server.endpoint, "fsdp", steps=150, nnodes="1:3") for name in ("a", "b")]
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 180, "two agents to train at world size 2")
        before = {p["pid"] for p in _progress(tmp_path) if p["world_size"] == 2}
        agents.append(_gpt_agent(tmp_path, "c", etcd_server.endpoint, "fsdp", steps=150, nnodes="1:3"))
        for agent in agents:
            assert agent.wait(180) == 0, f"every agent finishes the run: {agent.output()[-2000:]}"
    restart = [e for e in _events(tmp_path, "planned_restart") if e.get("in_place") and e["reason"] == "resize"]
    assert restart, _events(tmp_path, "planned_restart")
    agreed = restart[-1]["agreed_step"]
    progress = _progress(tmp_path)
    _assert_resumed_exactly(progress, agreed, 2, 3)
    first = [p for p in progress if p["step"] == agreed + 1]
    assert len(first) == 3 and all(p["restore_step"] == agreed for p in first), first
    fresh = [p for p in first if p["pid"] not in before]
    assert [p["restore_source"] for p in fresh] == ["memory_peer"], f"the joiner read the survivors' snapshots: {first}"
    assert len({p["pid"] for p in first} & before) == 2, f"the survivors kept their processes: {first} {before}"
    assert sum(1 for p in first if p.get("reformed_in_place")) == 2, first
    assert not _events(tmp_path, "in_place_fallback"), _events(tmp_path, "in_place_fallback")


@pytest.mark.timeout(30)
def test_the_agent_reports_why_in_place_workers_are_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's own reason (``fallback-N.json``) wins and makes the restart uncharged; else the agent's default
    reason, only for workers that could re-form in place; a plain script's restart reports nothing."""
    monkeypatch.delenv(ENV_REFORM_IN_PLACE, raising=False)
    agent, box, events = unit_agent(tmp_path, NoticeHandler())
    assert agent.planned.in_place.report_fallback(InPlaceFallback.NOT_WAITING) is False
    assert events.records == [], "a worker that cannot re-form in place: nothing to fall back from"
    box.mark_in_place(0)
    assert agent.planned.in_place.report_fallback(InPlaceFallback.NOT_WAITING) is False
    last = events.records[-1]
    assert (last["event"], last["why"], last["detail"], last["ranks"]) == ("in_place_fallback", "not_waiting", "", [0])
    box.report_fallback(0, "rebuild_failed", "joining the new group: connection refused")
    assert agent.planned.in_place.report_fallback(None) is True, "the worker's own report: not its own failure"
    assert events.records[-1]["why"] == "rebuild_failed" and "refused" in events.records[-1]["detail"]


def test_the_fallback_reported_is_the_workers_own_first() -> None:
    reported = {1: ("timeout", "no group within 120 s"), 0: ("rebuild_failed", "joining: refused")}
    report = decide_fallback(reported, InPlaceFallback.NEW_NODE, capable=True, local_world_size=2)
    assert report is not None and (report.why, report.ranks, report.reported) == ("rebuild_failed", [0, 1], True)
    report = decide_fallback({}, InPlaceFallback.NEW_NODE, capable=True, local_world_size=2)
    assert report is not None and (report.why, report.ranks, report.reported) == ("new_node", [0, 1], False)
    assert decide_fallback({}, InPlaceFallback.NEW_NODE, capable=False, local_world_size=2) is None
    assert decide_fallback({}, None, capable=True, local_world_size=2) is None
