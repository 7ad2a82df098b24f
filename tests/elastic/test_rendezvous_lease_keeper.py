"""``LeaseKeeper`` against a real etcd: one thread and one stream per tick keep many leases alive, and each
owner hears what happened to its own lease; a refresh cannot starve the leases (a stream is bounded below the
interval, a partial answer is completed at once, etcd's "too many requests" is no outage, a late keeper says so
once) (``elastic/rendezvous/lease_keeper.py``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.etcd_client import EtcdConnection
from elastic.rendezvous.lease_keeper import LeaseKeeper, refresh_interval
from tests.elastic.doubles import FakeRpcError
from tests.elastic.test_rendezvous_etcd import make_config
from tests.harness.procs import wait_for

TTL = 1


class _Owner:
    """A lease holder that records what the keeper told it."""

    def __init__(self, lease: int | None) -> None:
        self.lease = lease
        self.ttls: list[int] = []
        self.failures: list[BaseException] = []
        self.gone = threading.Event()
        self.failed = threading.Event()

    def lease_to_keep(self) -> int | None:
        return self.lease

    def lease_refreshed(self, lease: int, ttl: int) -> None:
        assert lease == self.lease
        self.ttls.append(ttl)
        if ttl <= 0:
            self.gone.set()

    def lease_refresh_failed(self, exc: BaseException) -> None:
        self.failures.append(exc)
        self.failed.set()


class _Scripted(LeaseKeeper):
    """A keeper whose streams go to the real etcd, except that ``script`` may cut an answer short: it gets the
    leases asked for and returns (the leases to really ask for, the error to end the stream with, or None)."""

    def __init__(self, *args: Any, script: Any, **kwargs: Any) -> None:
        self.script = script
        self.streams: list[tuple[float, list[int]]] = []
        super().__init__(*args, **kwargs)

    def _keep_alive(self, leases: list[int], timeout: float) -> tuple[dict[int, int], BaseException | None]:
        self.streams.append((time.monotonic(), list(leases)))
        asked, error = self.script(len(self.streams), leases)
        answers, exc = super()._keep_alive(asked, timeout) if asked else ({}, None)
        return answers, error or exc


@pytest.mark.timeout(60)
def test_one_keeper_keeps_many_leases_and_tells_each_owner_its_own_news(etcd_server: EmbeddedEtcd) -> None:
    conn = EtcdConnection(make_config(etcd_server.endpoint, etcd_timeout=3.0))
    owners = [_Owner(conn.client.lease(TTL).id) for _ in range(20)]
    idle = _Owner(None)  # no lease yet: asks for nothing
    keeper = LeaseKeeper(conn, refresh_interval(TTL), name="rdzv-lease-test")
    try:
        for owner in [*owners, idle]:
            keeper.add(owner)
        # Four TTLs later every lease is still alive (unrefreshed, each would have expired after one).
        wait_for(lambda: all(len(o.ttls) >= 4 * 3 for o in owners), timeout=30, what="12 refreshes of each lease")
        assert all(t > 0 for o in owners for t in o.ttls), "etcd answered that a kept lease was gone"
        assert all(conn.client.get_lease_info(o.lease).TTL != -1 for o in owners)  # -1: expired
        assert not any(o.failures for o in owners) and not idle.ttls and not idle.failures
        assert [t.name for t in threading.enumerate()].count("rdzv-lease-test") == 1

        victim = owners[3]
        conn.client.revoke_lease(victim.lease)
        assert victim.gone.wait(10), "the owner of a revoked lease was not told it is gone"
        assert not any(o.gone.is_set() for o in owners if o is not victim)

        assert keeper.remove(victim) == len(owners)  # the others and the idle one
        etcd_server.stop()
        assert owners[0].failed.wait(10), "an unreachable etcd was not reported to the owners"
        assert all(o.failures for o in owners if o is not victim)
    finally:
        keeper.close()
        conn.close()
    assert "rdzv-lease-test" not in [t.name for t in threading.enumerate()]


def test_a_keeper_needs_a_positive_interval(etcd_server: EmbeddedEtcd) -> None:
    conn = EtcdConnection(make_config(etcd_server.endpoint))
    try:
        with pytest.raises(ValueError, match="interval must be > 0"):
            LeaseKeeper(conn, 0.0)
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_a_stalled_etcd_costs_a_tick_per_try_not_the_ttl(etcd_server: EmbeddedEtcd) -> None:
    """Each stream is bounded below the refresh interval: while etcd answers nothing the keeper tries again every
    tick (each try told to the owners), instead of waiting 5 s on one stream while a 3 s lease runs out."""
    ttl = 3
    conn = EtcdConnection(make_config(etcd_server.endpoint, lease_ttl=ttl, etcd_timeout=10.0))
    owners = [_Owner(conn.client.lease(ttl).id) for _ in range(5)]
    keeper = LeaseKeeper(conn, refresh_interval(ttl), name="rdzv-lease-stall")
    assert keeper.call_timeout < keeper.interval == refresh_interval(ttl) == 1.0
    assert etcd_server.pid is not None
    try:
        for owner in owners:
            keeper.add(owner)
        wait_for(lambda: all(o.ttls for o in owners), timeout=10, what="a first refresh of each lease")
        os.kill(etcd_server.pid, signal.SIGSTOP)  # etcd holds every request it gets: no answer, no error
        try:
            # Two ticks that each gave up within their time, during a stall shorter than python3-etcd3's 5 s per call
            # (with it, one stream waited through the whole stall and nothing was tried or told meanwhile).
            wait_for(lambda: all(len(o.failures) >= 2 for o in owners), timeout=4.5,
                     what="two refresh ticks of each lease to give up while etcd is stalled")
        finally:
            os.kill(etcd_server.pid, signal.SIGCONT)
        answered = [len(o.ttls) for o in owners]
        wait_for(lambda: all(len(o.ttls) > n for o, n in zip(owners, answered, strict=True)), timeout=10,
                 what="the leases to be refreshed again once etcd answers")
    finally:
        keeper.close()
        conn.close()


@pytest.mark.timeout(60)
def test_a_partial_answer_is_completed_at_once_and_told_to_nobody_as_a_failure(etcd_server: EmbeddedEtcd) -> None:
    ttl = 10  # an interval of 3.3 s: the rest must not wait for the next tick
    conn = EtcdConnection(make_config(etcd_server.endpoint, lease_ttl=ttl, etcd_timeout=10.0))
    owners = [_Owner(conn.client.lease(ttl).id) for _ in range(8)]

    def half_then_all(stream: int, leases: list[int]) -> tuple[list[int], BaseException | None]:
        if stream == 1:  # the first stream's deadline passes after half the answers
            return leases[: len(leases) // 2], FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return leases, None

    keeper = _Scripted(conn, refresh_interval(ttl), name="rdzv-lease-partial", script=half_then_all)
    try:
        for owner in owners:
            keeper.add(owner)
        wait_for(lambda: all(o.ttls for o in owners), timeout=10, what="every lease refreshed on the first tick")
        (first_at, first), (second_at, second) = keeper.streams[:2]
        assert sorted(first) == sorted(o.lease for o in owners)
        assert sorted(second) == sorted(first[len(first) // 2:]), "only the unanswered leases are asked again"
        assert second_at - first_at < 1.0 < keeper.interval, "the rest was asked a tick later, not at once"
        assert not any(o.failures for o in owners), "an owner whose lease was answered late was told it failed"
        assert all(t > 0 for o in owners for t in o.ttls)
    finally:
        keeper.close()
        conn.close()


@pytest.mark.timeout(60)
def test_too_many_requests_is_retried_next_tick_and_is_no_outage(
        etcd_server: EmbeddedEtcd, caplog: pytest.LogCaptureFixture) -> None:
    ttl = 1
    conn = EtcdConnection(make_config(etcd_server.endpoint, lease_ttl=ttl, etcd_timeout=10.0))
    owners = [_Owner(conn.client.lease(ttl).id) for _ in range(4)]
    busy = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests")

    def busy_twice(stream: int, leases: list[int]) -> tuple[list[int], BaseException | None]:
        return ([], busy) if stream <= 2 else (leases, None)

    caplog.set_level(logging.INFO, logger="elastic.rendezvous.lease_keeper")
    keeper = _Scripted(conn, refresh_interval(ttl), name="rdzv-lease-busy", script=busy_twice)
    try:
        for owner in owners:
            keeper.add(owner)
        wait_for(lambda: all(o.ttls for o in owners), timeout=10, what="the leases refreshed once etcd is not busy")
        assert len(keeper.streams) >= 3
        assert keeper.streams[1][0] - keeper.streams[0][0] >= 0.8 * keeper.interval, "a busy etcd is retried next tick"
        assert not any(o.failures for o in owners), f"etcd said it is busy: an owner was told of an outage {owners[0].failures} {keeper.streams}"
        busy_lines = [r for r in caplog.records if "answered RESOURCE_EXHAUSTED" in r.getMessage()]
        assert len(busy_lines) == 1 and busy_lines[0].levelno == logging.INFO
    finally:
        keeper.close()
        conn.close()


class _Slow(_Owner):
    """An owner whose callback holds the keeper's thread for ``hold`` s on its next ``times`` refreshes."""

    def __init__(self, lease: int, hold: float, times: int) -> None:
        super().__init__(lease)
        self.hold, self.times = hold, times

    def lease_refreshed(self, lease: int, ttl: int) -> None:
        super().lease_refreshed(lease, ttl)
        if self.times > 0:
            self.times -= 1
            time.sleep(self.hold)  # the starvation under test: the keeper's one thread is held


@pytest.mark.timeout(60)
def test_a_late_keeper_says_so_once(etcd_server: EmbeddedEtcd, caplog: pytest.LogCaptureFixture) -> None:
    ttl = 3
    conn = EtcdConnection(make_config(etcd_server.endpoint, lease_ttl=ttl, etcd_timeout=10.0))
    interval = refresh_interval(ttl)
    slow = _Slow(conn.client.lease(ttl).id, hold=2.3 * interval, times=3)  # three ticks in a row start late
    caplog.set_level(logging.DEBUG, logger="elastic.rendezvous.lease_keeper")
    keeper = LeaseKeeper(conn, interval, name="rdzv-lease-late")
    try:
        keeper.add(slow)
        wait_for(lambda: any("on time again" in r.getMessage() for r in caplog.records), timeout=30,
                 what="the keeper to be on time again")
        late = [r for r in caplog.records if "late" in r.getMessage() and "on time" not in r.getMessage()]
        assert len(late) >= 2, "the test did not make the keeper late twice"
        assert [r.levelno for r in late].count(logging.WARNING) == 1, "a late keeper must say so once, at WARNING"
        assert late[0].levelno == logging.WARNING and "rdzv-lease-late" in late[0].getMessage()
    finally:
        keeper.close()
        conn.close()


@pytest.mark.timeout(60)
def test_a_lease_etcd_holds_its_answer_for_does_not_hold_back_the_others(etcd_server: EmbeddedEtcd) -> None:
    """etcd answers a stream in order and holds the answer for an expired lease until it revoked it: the keeper
    asks for that lease after the others, so theirs are refreshed in the same tick."""
    ttl = 3
    conn = EtcdConnection(make_config(etcd_server.endpoint, lease_ttl=ttl, etcd_timeout=10.0))
    stuck = _Owner(conn.client.lease(ttl).id)
    others = [_Owner(conn.client.lease(ttl).id) for _ in range(5)]

    def held_at_stuck(_stream: int, leases: list[int]) -> tuple[list[int], BaseException | None]:
        if stuck.lease not in leases:
            return leases, None
        before = leases[: leases.index(stuck.lease)]
        time.sleep(0.95 * refresh_interval(ttl) * 0.7)  # etcd sits on the stuck lease until the stream's deadline
        return before, FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    keeper = _Scripted(conn, refresh_interval(ttl), name="rdzv-lease-held", script=held_at_stuck)
    try:
        for owner in [stuck, *others]:  # the stuck lease first: asked first until found out
            keeper.add(owner)
        wait_for(lambda: stuck.failures, timeout=10, what="the stuck lease's owner told of its failed refresh")
        assert all(o.ttls and not o.failures for o in others), "a held answer held back the other leases' refresh"
        (_, first), (_, second) = keeper.streams[:2]
        assert first[0] == stuck.lease and second[-1] == stuck.lease, "the stuck lease is asked for last"
        wait_for(lambda: all(len(o.ttls) >= 3 for o in others), timeout=10, what="three refreshes of the others")
        assert not any(o.failures for o in others)
    finally:
        keeper.close()
        conn.close()


class _Broken(_Owner):
    def lease_refreshed(self, lease: int, ttl: int) -> None:
        super().lease_refreshed(lease, ttl)
        raise RuntimeError("an owner's bug")


@pytest.mark.timeout(60)
def test_an_owner_that_fails_on_its_news_does_not_keep_the_others_from_theirs(etcd_server: EmbeddedEtcd) -> None:
    conn = EtcdConnection(make_config(etcd_server.endpoint, etcd_timeout=3.0))
    broken = _Broken(conn.client.lease(TTL).id)
    others = [_Owner(conn.client.lease(TTL).id) for _ in range(3)]
    keeper = LeaseKeeper(conn, refresh_interval(TTL), name="rdzv-lease-broken")
    try:
        for owner in [broken, *others]:  # the broken one is told first on every tick
            keeper.add(owner)
        wait_for(lambda: all(len(o.ttls) >= 3 for o in others), timeout=10, what="the others' leases kept")
        assert len(broken.ttls) >= 3 and not any(o.failures for o in others)
    finally:
        keeper.close()
        conn.close()
