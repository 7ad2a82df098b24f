"""The agent's contract with the rendezvous handler: ``MembershipAwareHandler`` checked once at start.

A handler with the protocol drives the monitor loop (its declared ``RendezvousError``s are handled as
transient, anything else propagates); a handler without it gets torch's polling path, said once in the log.
No process or server is started: the agent is only constructed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from etcd3.exceptions import ConnectionFailedError
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from elastic.agent import SpotrunAgent
from elastic.config import AgentSettings
from elastic.launcher import _leave_rendezvous
from elastic.rendezvous.api import (
    EtcdRendezvousConfig,
    MembershipAwareHandler,
    OutageBoundHandler,
    PeerProbingHandler,
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousOutageError,
    RendezvousStateError,
    RendezvousTimeoutError,
    RendezvousWatchError,
    is_permanent,
)
from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler, unreachable_at_shutdown, watch_failure
from tests.elastic.doubles import MemoryEventLog

pytestmark = pytest.mark.timeout(60)


class PollingHandler(RendezvousHandler):
    """torch's interface only (like c10d): the agent can only poll ``num_nodes_waiting``."""

    def __init__(self, waiting: int = 0) -> None:
        self.waiting = waiting
        self.polls = 0

    def get_backend(self) -> str:
        return "polling"

    def next_rendezvous(self) -> RendezvousInfo:
        raise NotImplementedError

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        self.polls += 1
        return self.waiting

    def get_run_id(self) -> str:
        return "job"

    def shutdown(self) -> bool:
        return True


class AwareHandler(PollingHandler):
    """Implements ``MembershipAwareHandler``; ``error`` is raised by its membership methods when set."""

    def __init__(self, *, changed: bool = False, error: Exception | None = None) -> None:
        super().__init__()
        self.changed = changed
        self.error = error
        self.waits: list[float] = []
        self.left = 0

    def get_backend(self) -> str:
        return "aware"

    @property
    def round(self) -> int | None:
        return 7

    def membership_changed(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.changed

    def wait_membership_change(self, timeout: float) -> bool:
        self.waits.append(timeout)
        if self.error is not None:
            raise self.error
        return self.changed

    def leave(self) -> None:
        self.left += 1
        if self.error is not None:
            raise self.error


class RenamedHandler(PollingHandler):
    """A membership-aware handler whose method was renamed: it must not pass for one."""

    @property
    def round(self) -> int | None:
        return 1

    def membership_has_changed(self) -> bool:
        return True

    def wait_membership_change(self, timeout: float) -> bool:
        return True

    def leave(self) -> None:
        pass


def make_agent(handler: RendezvousHandler, tmp_path: Path, clock: Callable[[], float] = time.monotonic,
               events: MemoryEventLog | None = None, settings: AgentSettings | None = None) -> SpotrunAgent:
    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint="/bin/true", args=(), rdzv_handler=handler,
                      max_restarts=0, monitor_interval=0.01)
    return SpotrunAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)), settings=settings or AgentSettings(),
                        events=events if events is not None else MemoryEventLog(), tie_workers_to_agent=False,
                        clock=clock)


def test_the_etcd_v3_handler_is_membership_aware() -> None:
    config = EtcdRendezvousConfig(run_id="job", endpoints=(("127.0.0.1", 2379),), min_nodes=1, max_nodes=2,
                                  etcd_timeout=7)
    handler = EtcdV3RendezvousHandler(config)
    assert isinstance(handler, MembershipAwareHandler)  # constructing does not connect
    assert isinstance(handler, OutageBoundHandler)
    assert isinstance(handler, PeerProbingHandler)  # a renamed method would silently turn the probes off
    assert (handler.outage_bound, handler.endpoint) == (7, "127.0.0.1:2379")


def test_a_renamed_method_is_not_membership_aware() -> None:
    assert not isinstance(RenamedHandler(), MembershipAwareHandler)
    assert isinstance(AwareHandler(), MembershipAwareHandler)


def test_handler_without_the_protocol_gets_torchs_polling_path_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handler = PollingHandler(waiting=0)
    with caplog.at_level(logging.INFO, logger="elastic"):
        agent = make_agent(handler, tmp_path)
        assert not agent.membership.wait(0.01)
        assert not agent.membership.changed()
        handler.waiting = 1
        assert agent.membership.changed()
        assert agent.membership.changed()
    notes = [r for r in caplog.records if "not membership-aware" in r.getMessage()]
    assert len(notes) == 1 and "'polling'" in notes[0].getMessage()
    assert handler.polls == 3
    assert agent.membership.round is None


def test_handler_with_the_protocol_drives_the_monitor_loop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    handler = AwareHandler(changed=True)
    with caplog.at_level(logging.INFO, logger="elastic"):
        agent = make_agent(handler, tmp_path)
    assert not [r for r in caplog.records if "not membership-aware" in r.getMessage()]
    assert agent.membership.wait(5.0) and handler.waits == [5.0]
    assert agent.membership.changed() and handler.polls == 0  # membership_changed answered first
    handler.changed = False
    assert not agent.membership.changed() and handler.polls == 1  # then torch's waiting-node signal
    assert agent.membership.round == 7


def test_declared_rendezvous_errors_of_a_membership_aware_handler_are_transient_within_the_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handler = AwareHandler(error=RendezvousConnectionError("etcd 127.0.0.1:1 refused to read"))
    agent = make_agent(handler, tmp_path)
    assert agent.membership.outage.bound == 30.0  # no OutageBoundHandler: the default etcd_timeout
    with caplog.at_level(logging.WARNING, logger="elastic"):
        for _ in range(5):  # monitor ticks: one warning per outage start, not one per tick
            assert not agent.membership.changed()
            assert not agent.membership.wait(0.01)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refused to read" in warnings[0] and "fails if this lasts 30 s more" in warnings[0]
    handler.error = None
    with caplog.at_level(logging.WARNING, logger="elastic"):
        assert not agent.membership.changed()
    assert "the rendezvous answers again" in caplog.records[-1].getMessage()
    assert agent.membership.outage.since is None  # a success resets the clock
    _leave_rendezvous(handler)  # logged, not raised: the agent is already exiting on a signal
    assert handler.left == 1


class BoundedHandler(AwareHandler):
    """An ``OutageBoundHandler``: declares its bound and endpoint."""

    outage_bound = 3.0
    endpoint = "etcd-0:2379,etcd-1:2379"


def test_rendezvous_failing_past_its_bound_stops_the_workers_and_fails_the_job(tmp_path: Path) -> None:
    now = [100.0]
    handler = BoundedHandler(error=RendezvousConnectionError("etcd refused to read"))
    events = MemoryEventLog()
    agent = make_agent(handler, tmp_path, clock=lambda: now[0], events=events)
    assert not agent.membership.changed()  # the outage starts: transient
    now[0] += 2.9
    assert not agent.membership.changed()  # still within the bound of 3 s
    now[0] += 0.6  # ... and has lasted 3.5 s
    with pytest.raises(RendezvousOutageError, match=r"etcd-0:2379,etcd-1:2379 failing for 3\.\d s, more than its "
                                                    r"bound of 3 s \(last error: etcd refused to read\)"):
        agent.membership.wait(0.01)
    finished = [r for r in events.records if r["event"] == "run_finished"]
    assert finished and finished[-1]["state"] == "FAILED" and "failing for" in finished[-1]["error"]


def test_a_handler_that_declares_its_outage_fatal_ends_the_job_at_once(tmp_path: Path) -> None:
    """etcd-v3 raises RendezvousOutageError once etcd was away past etcd_timeout: no second bound on top."""
    error = RendezvousOutageError("[run=job] etcd at etcd-0:2379 unreachable for 3.2 s, more than etcd_timeout=3 s")
    agent = make_agent(BoundedHandler(error=error), tmp_path)
    agent.get_worker_group().state = WorkerState.SUCCEEDED  # in the exit barrier the workers are done: not fatal
    assert not agent.membership.wait(0.01)
    agent.get_worker_group().state = WorkerState.HEALTHY
    with pytest.raises(RendezvousOutageError) as raised:
        agent.membership.changed()
    assert raised.value is error


@pytest.mark.parametrize("error", [
    RendezvousStateError("[run=job node=a round=2] corrupt rendezvous key '/spotrun/rdzv/job/ctl/round' in etcd: x"),
    RendezvousWatchError("[run=job node=a round=2] the etcd watch failed: permission denied"),
    RendezvousClosedError("the rendezvous of run 'job' is closed"),
])
def test_a_permanent_rendezvous_error_ends_the_job_at_once_with_its_message(tmp_path: Path, error: Exception) -> None:
    """No later call can succeed: the job must not wait out etcd_timeout (the clock never moves here)."""
    events = MemoryEventLog()
    agent = make_agent(BoundedHandler(error=error), tmp_path, clock=lambda: 5.0, events=events)
    with pytest.raises(type(error)) as raised:
        agent.membership.wait(0.01)
    assert raised.value is error
    finished = [r for r in events.records if r["event"] == "run_finished"]
    assert finished[-1]["state"] == "FAILED" and finished[-1]["error"] == str(error)


def test_which_rendezvous_errors_are_permanent() -> None:
    assert not is_permanent(RendezvousConnectionError("etcd restarting"))
    assert not is_permanent(RendezvousTimeoutError("a wait ran out"))
    assert not is_permanent(RuntimeError("a c10d store error outside the tree"))
    assert is_permanent(RendezvousOutageError("unreachable past etcd_timeout"))
    assert is_permanent(RendezvousWatchError("the watch failed"))
    assert is_permanent(RendezvousStateError("corrupt key"))
    assert is_permanent(RendezvousClosedError("closed"))
    assert is_permanent(RendezvousConfigError("bad conf"))


def test_a_refused_watch_is_its_own_kind_and_shutdown_still_closes_the_job() -> None:
    """etcd answered but refused the watch: not an outage, so ``shutdown`` tries to mark the job closed."""
    refused = RendezvousConnectionError("etcd refuses to let user 'u' watch '/p/ctl/' (permission denied), "
                                        "even with a fresh token")
    failed = watch_failure(refused, "[run=job node=a] ")
    assert type(failed) is RendezvousWatchError and not isinstance(failed, RendezvousConnectionError)
    assert str(failed) == f"[run=job node=a] the etcd watch failed: {refused}"
    assert is_permanent(failed)
    assert not unreachable_at_shutdown(connect_failed=False, fatal=failed)
    assert type(watch_failure(KeyError("a bug in the watch"), "")) is RendezvousWatchError


def test_a_watch_that_gave_up_on_an_unreachable_etcd_is_an_outage() -> None:
    """``EtcdConnection.call`` gave up retrying a transient error (the watch reloads through it): etcd is away,
    so ``shutdown`` does not spend close_timeout more on it."""
    gone = RendezvousConnectionError("etcd at etcd-0:2379 unreachable for 30 s while trying to load the state")
    gone.__cause__ = ConnectionFailedError()
    outage = watch_failure(gone, "")
    assert isinstance(outage, RendezvousOutageError) and "unreachable for 30 s" in str(outage)
    assert unreachable_at_shutdown(connect_failed=False, fatal=outage)
    assert unreachable_at_shutdown(connect_failed=True, fatal=None)
    assert not unreachable_at_shutdown(connect_failed=False, fatal=None)
    assert not unreachable_at_shutdown(connect_failed=False, fatal=RendezvousStateError("corrupt key"))


@pytest.mark.parametrize("error", [TypeError("membership_changed() takes 0 arguments"), AttributeError("_mirror")])
def test_other_errors_of_a_membership_aware_handler_propagate(tmp_path: Path, error: Exception) -> None:
    agent = make_agent(AwareHandler(error=error), tmp_path)
    with pytest.raises(type(error)):
        agent.membership.changed()
    with pytest.raises(type(error)):
        agent.membership.wait(0.01)
