"""The in-place re-form prototype (SPOTRUN_REFORM_IN_PLACE=1, elastic.worker.reform): the mailbox messages and,
end to end, a peer's planned leave after which the survivor's worker goes on in the same process."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from elastic.api import ENV_REFORM_IN_PLACE
from elastic.worker.mailbox import GroupAssignment, Mailbox, WorkerNotice
from elastic.worker.reform import InPlaceReform, ReformConfig
from tests.elastic.test_planned import _agent, _assert_resumed_exactly, _events, _progress, _running, _training_at
from tests.harness.procs import make_env, wait_for

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
    monkeypatch.setenv(ENV_REFORM_IN_PLACE, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    reform = InPlaceReform(ReformConfig(timeout=20), mailbox_dir=box.path)
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
    assert reform.wait() is None, "a joining node: not re-formed in place (prototype)"
    monkeypatch.delenv(ENV_REFORM_IN_PLACE)
    assert not InPlaceReform(mailbox_dir=box.path).enabled, "off unless SPOTRUN_REFORM_IN_PLACE=1"


@pytest.mark.slow
@pytest.mark.long  # ~30 s on 2 loaded cores; a prototype's end-to-end case
@pytest.mark.timeout(240)
def test_a_peers_planned_leave_keeps_the_survivors_worker_process(tmp_path: Path, etcd_server) -> None:
    env = make_env(**{ENV_REFORM_IN_PLACE: "1"})
    agents = [_agent(tmp_path, name, etcd_server.endpoint, "inplace", steps=80, env=env) for name in ("a", "b")]
    a, b = agents
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "two agents to train at world size 2")
        b.signal(signal.SIGTERM)
        assert b.wait(30) == 0, "the preempted agent leaves"
        agreed = _events(tmp_path, "planned_leave")[0]["step"]
        assert a.wait(90) == 0, "the survivor finishes the run at world size 1"
    progress = _progress(tmp_path)
    _assert_resumed_exactly(progress, agreed, 2, 1)
    survivor = {p["pid"] for p in progress if p["world_size"] == 1}
    before = {p["pid"] for p in progress if p["world_size"] == 2 and p["step"] == agreed}
    assert len(survivor) == 1 and survivor <= before, f"the survivor's worker kept its process: {survivor} {before}"
    restart = [e for e in _events(tmp_path, "planned_restart") if e.get("in_place")]
    assert len(restart) == 1 and restart[0]["agreed_step"] == agreed, _events(tmp_path, "planned_restart")
    started = [e for e in _events(tmp_path, "workers_started") if e.get("in_place")]
    assert len(started) == 1 and started[0]["world_size"] == 1 and started[0]["t_wall"] > restart[0]["t_wall"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("enabled", [True, False])
def test_the_agent_re_forms_in_place_only_when_every_worker_waits_for_a_peers_leave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    from elastic.planned import PlannedTick
    from tests.elastic.test_agent_planned import NoticeHandler
    from tests.elastic.test_agent_planned import _agent as unit_agent

    if enabled:
        monkeypatch.setenv(ENV_REFORM_IN_PLACE, "1")
    handler = NoticeHandler()
    agent, box, _ = unit_agent(tmp_path, handler)
    box.register_helper(0)
    handler.peers = {"b": {"deadline": time.time() + 60, "source": "aws"}}
    assert agent.planned.tick() is PlannedTick.WAITING and box.read_notice().reason == "peer_preempt"
    box.acknowledge(0, 12)
    assert agent.planned.in_place.waiting() is None, "acknowledged, but the worker did not say it waits"
    box.mark_waiting(0)
    stopped = agent.planned.in_place.waiting()
    if not enabled:
        assert stopped is None, "without SPOTRUN_REFORM_IN_PLACE=1 the workers are restarted as before"
        return
    assert stopped is not None and stopped.step == 12


@pytest.mark.timeout(30)
def test_this_nodes_own_notice_never_re_forms_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.notice import Notice
    from elastic.planned import PlannedTick
    from tests.elastic.test_agent_planned import NoticeHandler
    from tests.elastic.test_agent_planned import _agent as unit_agent

    monkeypatch.setenv(ENV_REFORM_IN_PLACE, "1")
    agent, box, _ = unit_agent(tmp_path, NoticeHandler())
    box.register_helper(0)
    agent.receive_notice(Notice("sigterm", time.time() + 60, "SIGTERM"))
    assert agent.planned.tick() is PlannedTick.WAITING
    box.acknowledge(0, 12)
    box.mark_waiting(0)
    assert agent.planned.in_place.waiting() is None, "the leaving node's workers exit"
    assert agent.planned.leaving_stop() is not None


@pytest.mark.slow
@pytest.mark.long  # ~40 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_a_leave_that_admits_a_spare_restarts_the_survivors_worker(tmp_path: Path, etcd_server) -> None:
    """The re-formed round takes a waiting spare in: its fresh worker restores through collectives, so the
    survivor's worker is restarted (as without the flag) instead of re-formed in place, and no step is lost."""
    env = make_env(**{ENV_REFORM_IN_PLACE: "1"})
    agents = [_agent(tmp_path, name, etcd_server.endpoint, "spare", steps=150, env=env) for name in ("a", "b")]
    a, b = agents
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "two agents to train at world size 2")
        agents.append(_agent(tmp_path, "c", etcd_server.endpoint, "spare", steps=150, env=env))
        spare = f"-{agents[2].pid}-"
        wait_for(lambda: any(spare in e["node"] for e in _events(tmp_path, "rendezvous_started")), 60,
                 "the spare to wait in the rendezvous")
        b.signal(signal.SIGTERM)
        assert b.wait(30) == 0, "the preempted agent leaves"
        agreed = _events(tmp_path, "planned_leave")[0]["step"]
        assert a.wait(120) == 0 and agents[2].wait(60) == 0, "the survivor and the spare finish the run"
    progress = _progress(tmp_path)
    old = {p["pid"] for p in progress if p["step"] <= agreed}
    after = [p for p in progress if p["step"] == agreed + 1]
    assert len(after) == 2 and all(p["world_size"] == 2 and p["pid"] not in old for p in after), after
    assert not [e for e in _events(tmp_path, "workers_started") if e.get("in_place")], "nothing re-formed in place"
