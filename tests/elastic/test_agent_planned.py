"""The agent's planned-change I/O without processes: exit barrier, notice signals, mailbox posting, leaving.

The decisions themselves (what to post, when to give up, when to leave) are the coordinator's and are tested
on plain data in test_planned_coordinator.py; these tests check that the agent reads the mailbox and the
rendezvous into its view and performs the actions (events, the lease, the mailbox)."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException

from elastic.agent import SpotrunAgent
from elastic.agent_hooks import WorkersStarted
from elastic.config import AgentSettings
from elastic.planned import WHY_BEFORE_HELPERS, PlannedTick
from elastic.planned.hook import WHY_BETWEEN_ROUNDS, LeaveForNotice
from elastic.preemption import Mailbox
from elastic.rendezvous.api import NoticeAwareHandler, RendezvousConnectionError, RendezvousStateError
from tests.elastic.doubles import MemoryEventLog
from tests.elastic.test_agent_membership import AwareHandler

pytestmark = pytest.mark.timeout(60)


class NoticeHandler(AwareHandler):
    """A membership-aware handler that also carries notices (like etcd-v3), driven by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[dict[str, Any]] = []
        self.peers: dict[str, dict[str, Any]] = {}
        self.lost: set[str] = set()
        self.restarted: set[str] = set()
        self.announced = 0
        self.number = 7
        self.restart_error: Exception | None = None

    @property
    def round(self) -> int | None:
        return self.number

    def publish_notice(self, notice: dict[str, Any]) -> None:
        self.published.append(notice)

    def publish_restart(self) -> None:
        if self.restart_error is not None:
            raise self.restart_error
        self.announced += 1

    def restarted_peers(self) -> set[str]:
        return set(self.restarted)

    def peer_notices(self) -> dict[str, dict[str, Any]]:
        return dict(self.peers)

    def lost_peers(self) -> set[str]:
        return set(self.lost)


def _agent(tmp_path: Path, handler: NoticeHandler, **settings: Any) -> tuple[SpotrunAgent, Mailbox, MemoryEventLog]:
    assert isinstance(handler, NoticeAwareHandler)
    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint="/bin/true", args=(), rdzv_handler=handler,
                      max_restarts=0, monitor_interval=0.01)
    box = Mailbox(str(tmp_path / "mailbox"))
    (tmp_path / "mailbox").mkdir()
    events = MemoryEventLog()
    agent = SpotrunAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), settings=AgentSettings(**settings),
                         events=events, tie_workers_to_agent=False, mailbox=box)
    agent.get_worker_group().group_world_size = 2
    agent.planned.on_workers_started(WorkersStarted({0: 1}, {0: 0}))  # as if its workers ran (else: between rounds)
    return agent, box, events


def test_exit_barrier_returns_at_once_when_a_peer_left(tmp_path: Path) -> None:
    handler = NoticeHandler()
    agent, _, _ = _agent(tmp_path, handler)
    handler.lost = {"b"}
    began = time.monotonic()
    assert agent.exit_barrier.wait(HashStore(), 2) is False, "a peer that left never arrives: not a success"
    assert time.monotonic() - began < 2


def test_exit_barrier_passes_when_every_peer_arrives(tmp_path: Path) -> None:
    agent, _, _ = _agent(tmp_path, NoticeHandler())
    store = HashStore()
    store.add("spotrun/exit_barrier/arrived", 1)  # the other agent got there first
    assert agent.exit_barrier.wait(store, 2) is True


def test_a_rendezvous_error_in_the_exit_barrier_is_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(NoticeHandler):
        def lost_peers(self) -> set[str]:
            raise RendezvousStateError("corrupt rendezvous key '/x' in etcd\ndetails")

    agent, _, _ = _agent(tmp_path, Broken())
    with caplog.at_level(logging.WARNING, logger="elastic"):
        assert agent.exit_barrier.wait(HashStore(), 2) is True, "the workers finished: success, as torch reports"
    (record,) = [r for r in caplog.records if "exit barrier failed" in r.getMessage()]
    assert not record.exc_info and "corrupt rendezvous key" in record.getMessage(), "no traceback"
    assert "\n" not in record.getMessage()


def test_the_exit_barriers_traceback_is_a_debug_record_even_with_the_logger_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A console at WARNING under a logger at DEBUG (a file handler wants the details) shows one line."""
    class Broken(NoticeHandler):
        def lost_peers(self) -> set[str]:
            raise RendezvousStateError("corrupt rendezvous key '/x' in etcd\ndetails")

    agent, _, _ = _agent(tmp_path, Broken())
    with caplog.at_level(logging.DEBUG, logger="elastic"):
        assert agent.exit_barrier.wait(HashStore(), 2) is True
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        f"{agent.ctx()} exit barrier failed (corrupt rendezvous key '/x' in etcd); the workers finished, "
        "reporting success"]
    assert not warnings[0].exc_info, "no traceback at WARNING"
    (debug,) = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert isinstance(debug.exc_info[1], RendezvousStateError), "the traceback is kept, at DEBUG"


def test_a_permanent_rendezvous_error_ends_the_exit_barrier_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed watch cannot show a peer that left any more: waiting out exit_barrier_timeout (300 s) for it
    would only hide the error. The workers finished: success, with the cause in one line."""
    handler = NoticeHandler()
    handler.error = RendezvousStateError("corrupt rendezvous key '/x/ctl/round' in etcd")
    agent, _, _ = _agent(tmp_path, handler)
    agent.get_worker_group().state = WorkerState.SUCCEEDED  # as in _invoke_run: the barrier comes after the workers
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="elastic"):
        assert agent.exit_barrier.wait(HashStore(), 2) is True  # the peer never arrives
    assert time.monotonic() - began < 5.0, "ended by the error, not by exit_barrier_timeout"
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "exit barrier failed (corrupt rendezvous key '/x/ctl/round' in etcd)" in record.getMessage()


def test_a_transient_rendezvous_error_in_the_exit_barrier_keeps_waiting_for_the_peers(tmp_path: Path) -> None:
    calls = []

    class Blip(NoticeHandler):
        def wait_membership_change(self, timeout: float) -> bool:
            calls.append(timeout)
            if len(calls) == 1:
                raise RendezvousConnectionError("etcd restarting")
            store.add("spotrun/exit_barrier/arrived", 1)  # the peer arrives meanwhile
            return False

    store = HashStore()
    agent, _, _ = _agent(tmp_path, Blip())
    agent.get_worker_group().state = WorkerState.SUCCEEDED
    assert agent.exit_barrier.wait(store, 2) is True
    assert len(calls) == 2, "it went on waiting after the blip, until the peer arrived"


def test_a_single_node_skips_the_exit_barrier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No peer to wait for: torch's barrier of one would only touch the store (and log a store error with a
    traceback at ERROR)."""
    class NoStore(HashStore):
        def add(self, key: str, value: int) -> int:
            raise AssertionError("the exit barrier of one node used the store")

    agent, _, _ = _agent(tmp_path, NoticeHandler())
    with caplog.at_level(logging.DEBUG):
        assert agent.exit_barrier.wait(NoStore(), 1) is True
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_sigterm_is_a_notice_only_when_the_workers_can_save(tmp_path: Path) -> None:
    handler = NoticeHandler()
    agent, box, events = _agent(tmp_path, handler, preempt_grace=42.0)
    with pytest.raises(SignalException):  # no Preemption helper registered: torch's immediate stop
        agent.planned.on_signal(signal.SIGTERM, None)
    box.register_helper(0)
    agent.planned.on_signal(signal.SIGTERM, None)
    assert agent.planned.own is not None and agent.planned.own.source == "sigterm"
    assert agent.planned.own.deadline == pytest.approx(time.time() + 42.0, abs=5)
    agent.planned.publish_own_notice()
    agent.planned.publish_own_notice()
    assert [n["source"] for n in handler.published] == ["sigterm"], "published once"
    assert agent.planned.tick() is PlannedTick.WAITING
    notice = box.read_notice()
    assert notice is not None and notice.reason == "preempt"
    assert [e["event"] for e in events.records] == ["notice_received", "planned_stop_posted"]
    with pytest.raises(SignalException):  # a second SIGTERM insists
        agent.planned.on_signal(signal.SIGTERM, None)


def test_sigterm_before_announced_helpers_exist_leaves_with_why(tmp_path: Path) -> None:
    """The workers imported the helper's module (``coming-0``) but have not built it: nothing trained since
    their restore, so a SIGTERM is a planned leave at once, not torch's immediate stop (issue 27)."""
    agent, box, _ = _agent(tmp_path, NoticeHandler())
    box.announce_helper(0)
    with pytest.raises(LeaveForNotice) as left:
        agent.planned.on_signal(signal.SIGTERM, None)
    assert left.value.why == WHY_BEFORE_HELPERS
    assert agent.planned.own is not None and agent.planned.own.source == "sigterm"


def test_a_notice_in_the_exit_barrier_ends_the_wait_at_the_deadline(tmp_path: Path) -> None:
    agent, _, _ = _agent(tmp_path, NoticeHandler(), preempt_grace=1.5, stop_grace=1.0)
    agent.planned.in_exit_barrier = True  # the workers finished; the peer has not arrived yet
    agent.planned.on_signal(signal.SIGTERM, None)  # taken as a notice, not a shutdown
    assert agent.planned.own is not None
    began = time.monotonic()
    assert agent.exit_barrier.wait(HashStore(), 2) is True, "this node's workers finished: a success"
    assert time.monotonic() - began < 5, "left by the notice's deadline, not after exit_barrier_timeout"


def test_a_notice_signal_after_the_run_is_only_logged(tmp_path: Path) -> None:
    agent, _, _ = _agent(tmp_path, NoticeHandler())
    agent.planned.run_over = True
    agent.planned.on_signal(signal.SIGTERM, None)
    agent.planned.on_signal(signal.SIGTERM, None)
    assert agent.planned.own is None


def test_an_early_notice_makes_the_first_rendezvous_a_planned_leave(tmp_path: Path) -> None:
    handler = NoticeHandler()
    agent, _, events = _agent(tmp_path, handler)
    agent.receive_early_notice(int(signal.SIGTERM), time.time())
    result = agent.run()  # NoticeHandler.next_rendezvous raises: the node must not ask for a round
    assert result.state is WorkerState.SUCCEEDED and handler.left == 1
    (leave,) = [e for e in events.records if e["event"] == "planned_leave"]
    assert leave["why"] == WHY_BETWEEN_ROUNDS and leave["source"] == "sigterm"


def test_a_peer_notice_is_posted_and_its_departure_is_not_a_crash(tmp_path: Path) -> None:
    handler = NoticeHandler()
    agent, box, _ = _agent(tmp_path, handler)
    box.register_helper(0)
    handler.peers = {"b": {"deadline": time.time() + 60, "source": "aws"}}
    assert agent.planned.tick() is PlannedTick.WAITING
    assert box.read_notice().reason == "peer_preempt"
    handler.peers, handler.lost = {}, {"b"}  # b revoked its lease: its notice key went with it
    assert agent.planned.tick() is PlannedTick.WAITING, "keep waiting for the agreed step"
    assert agent.get_worker_group().state != WorkerState.FAILED


def test_preempt_signal_spec_is_validated() -> None:
    from elastic.api import LaunchConfigError

    with pytest.raises(LaunchConfigError, match="unknown signal"):
        AgentSettings(preempt_signal="BOGUS")
    with pytest.raises(LaunchConfigError, match="preempt_grace"):
        AgentSettings(preempt_grace=-1)


def test_a_deadline_too_short_to_save_is_recorded_and_the_node_still_leaves(tmp_path: Path) -> None:
    from elastic.notice import Notice

    handler = NoticeHandler()
    agent, box, events = _agent(tmp_path, handler, stop_grace=1.0)
    box.register_helper(0)
    agent.receive_notice(Notice("aws", time.time() + 0.5, "spot instance-action terminate"))
    assert agent.planned.tick() is PlannedTick.WAITING  # posted: the workers may still make it
    assert agent.planned.tick() is PlannedTick.LEFT, "0.5 s left is less than the stop grace"
    names = [e["event"] for e in events.records]
    assert names[-3:] == ["planned_stop_abandoned", "workers_stopped", "planned_leave"]
    leave = events.records[-1]
    assert leave["saved"] is False and leave["step"] is None and leave["source"] == "aws"
    assert "deadline" in events.records[-3]["why"]
    assert handler.left == 1, "the lease is revoked so the peers re-form at once"


def test_a_metadata_notice_without_helpers_leaves_at_once_and_says_why(tmp_path: Path) -> None:
    from elastic.notice import Notice

    handler = NoticeHandler()
    agent, _, events = _agent(tmp_path, handler, planned_leave_exit_code=75)
    agent.receive_notice(Notice("gcp", time.time() + 30, "instance/preempted TRUE"))
    assert agent.planned.tick() is PlannedTick.LEFT, "workers that never used the helper cannot save"
    leave = events.records[-1]
    assert leave["event"] == "planned_leave" and leave["saved"] is False and leave["step"] is None
    assert "do not use elastic.preemption.Preemption" in leave["why"] and leave["source"] == "gcp"
    assert handler.left == 1
    agent.planned.left_result(workers_finished=False)
    assert agent.exit_status == 75 and events.records[-1]["exit_code"] == 75


def test_a_leaving_node_revokes_its_lease_before_its_acknowledged_workers_exit(tmp_path: Path) -> None:
    """The peers' rendezvous waits for this node's lease: once every local worker committed the agreed step
    and acknowledged it, the node leaves at once and only then waits for its workers' teardown."""
    from torch.distributed.elastic.agent.server.api import RunResult

    from elastic.notice import Notice

    handler = NoticeHandler()
    agent, box, events = _agent(tmp_path, handler)
    box.register_helper(0)
    agent.receive_notice(Notice("sigterm", time.time() + 60, "SIGTERM"))
    assert agent.planned.tick() is PlannedTick.WAITING
    assert agent.planned.leaving_stop() is None, "nothing acknowledged yet"
    box.acknowledge(0, 12)
    stopped = agent.planned.leaving_stop()
    assert stopped is not None and stopped.committed == 12
    seen: list[tuple[int, str]] = []  # (leaves so far, worker state) at each look at the workers

    def monitor(group: Any) -> RunResult:
        state = WorkerState.HEALTHY if len(seen) < 3 else WorkerState.SUCCEEDED  # tearing down, then gone
        seen.append((handler.left, state.name))
        return RunResult(state=state)

    agent.monitor = lambda: monitor(None)  # type: ignore[method-assign]
    agent.stop_workers = lambda: events.records.append({"event": "workers_stopped"})  # type: ignore[method-assign]
    result = agent.planned.leave_after_acknowledgement(stopped)
    assert seen[0] == (1, "HEALTHY"), "the lease was revoked while the workers were still running"
    assert result.state == WorkerState.SUCCEEDED and agent.exit_status == 0
    names = [e["event"] for e in events.records]
    assert names[-3:] == ["planned_leave", "workers_stopped", "run_finished"], names
    leave = [e for e in events.records if e["event"] == "planned_leave"][0]
    assert leave["step"] == 12 and leave["saved"] is True


def test_workers_that_fail_after_their_acknowledgement_still_fail_the_leaving_agent(tmp_path: Path) -> None:
    from torch.distributed.elastic.agent.server.api import RunResult

    from elastic.notice import Notice

    agent, box, events = _agent(tmp_path, NoticeHandler())
    box.register_helper(0)
    agent.receive_notice(Notice("sigterm", time.time() + 60, "SIGTERM"))
    agent.planned.tick()
    box.acknowledge(0, 4, saved=False, why="no time")
    stopped = agent.planned.leaving_stop()
    assert stopped is not None and stopped.committed is None and stopped.step == 4, "an unsaved stop leaves early too"
    agent.monitor = lambda: RunResult(state=WorkerState.FAILED)  # type: ignore[method-assign]
    agent.stop_workers = lambda: None  # type: ignore[method-assign]
    assert agent.planned.leave_after_acknowledgement(stopped).state == WorkerState.FAILED
    (leave,) = [e for e in events.records if e["event"] == "planned_leave"]
    assert leave["saved"] is False and leave["agreed_step"] == 4 and leave["why"] == "no time"
    assert [e["state"] for e in events.records if e["event"] == "run_finished"] == ["FAILED"]


class SpareHandler(NoticeHandler):
    """A node that was in a round (``participants``) and now waits in the rendezvous, e.g. as a spare; the
    test's SIGTERM arrives while it waits (the handler calls the agent's signal handler from inside)."""

    participants = ("a", "b")

    def __init__(self) -> None:
        super().__init__()
        self.agent: SpotrunAgent | None = None

    def next_rendezvous(self) -> Any:
        assert self.agent is not None
        self.agent.planned.on_signal(signal.SIGTERM, None)
        raise AssertionError("a notice between rounds must end the wait in the rendezvous")


def test_a_notice_between_rounds_leaves_at_once_as_a_planned_leave(tmp_path: Path) -> None:
    """Overlapping faults: SIGTERM to a node re-forming after a peer's crash (or waiting as a spare) used to
    be held until a round it would never get; it now leaves at once, with the planned-leave code."""
    handler = SpareHandler()
    agent, box, events = _agent(tmp_path, handler, planned_leave_exit_code=75)
    handler.agent = agent
    box.register_helper(0)  # a helper of the workers of the last round (stale: they were stopped)
    result = agent.run()
    assert result.state is WorkerState.SUCCEEDED
    assert agent.exit_status == 75
    assert handler.left == 1, "the lease goes at once: peers re-form without waiting for it"
    (leave,) = [e for e in events.records if e["event"] == "planned_leave"]
    assert leave["saved"] is False and "between rounds" in leave["why"], leave
    assert [e["exit_code"] for e in events.records if e["event"] == "run_finished"] == [75]


class FirstRoundHandler(SpareHandler):
    """A node that never was in a round (a replacement joining, a spare of a full job): SIGTERM in its first wait."""

    participants = ()


def test_a_notice_before_the_first_round_leaves_as_a_planned_leave(tmp_path: Path) -> None:
    """A replacement node preempted while it waits for its first round has nothing to save either: planned-leave
    code, not torch's exit by signal (which a Kubernetes Job or Slurm counts as a failure)."""
    handler = FirstRoundHandler()
    agent, _, events = _agent(tmp_path, handler, planned_leave_exit_code=75)
    handler.agent = agent
    result = agent.run()
    assert result.state is WorkerState.SUCCEEDED and agent.exit_status == 75
    assert handler.left == 1
    (leave,) = [e for e in events.records if e["event"] == "planned_leave"]
    assert leave["saved"] is False and "between rounds" in leave["why"], leave
