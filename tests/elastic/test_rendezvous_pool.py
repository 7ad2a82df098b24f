"""The etcd edge of a process that hosts many agents (``ClientPool``, ``EtcdConnection``) against a real etcd: the
pool caps the requests in flight, etcd's "too many requests" is backed off from as a busy etcd (not an outage),
and a closed connection never has its channel closed under a call still running nor lets a handler thread
that outlived its handler log "Cannot invoke RPC on closed channel" (``elastic/rendezvous/etcd_client.py``)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from tenacity import wait_random_exponential

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.etcd_client import (
    OVERLOAD_MAX_WAIT_S,
    ClientPool,
    ConnectionClosedError,
    EtcdConnection,
    overload_aware_wait,
)
from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler
from tests.elastic.doubles import FakeRpcError
from tests.elastic.test_rendezvous_etcd import make_config
from tests.harness.procs import wait_for

_BUSY = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests")


class _InFlight:
    """Counts the calls running at once (the most seen in ``peak``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = self.peak = 0

    def run(self, conn: EtcdConnection) -> Any:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            value, _meta = conn.client.get("k")
            time.sleep(0.05)  # long enough for the other threads' calls to overlap with this one
            return value
        finally:
            with self._lock:
                self.now -= 1


@pytest.mark.timeout(60)
def test_a_pool_caps_the_calls_in_flight_and_a_lone_connection_is_not_capped(etcd_server: EmbeddedEtcd) -> None:
    config = make_config(etcd_server.endpoint)
    pool = ClientPool(max_in_flight=3, jitter_s=0.005)
    pooled = [EtcdConnection(config, pool=pool) for _ in range(4)]
    lone = EtcdConnection(config)
    try:
        pooled[0].client.put("k", "v")
        capped, free = _InFlight(), _InFlight()
        with ThreadPoolExecutor(max_workers=16) as threads:
            got = list(threads.map(lambda i: pooled[i % 4].call("read", lambda: capped.run(pooled[i % 4])), range(32)))
            assert got == [b"v"] * 32
            list(threads.map(lambda _i: lone.call("read", lambda: free.run(lone)), range(32)))
        assert 2 <= capped.peak <= 3, f"{capped.peak} calls of one pool in flight at once (cap 3)"
        assert free.peak > 3, "a connection without a pool (a real agent) must not be capped"
        # A call made within a call (one thread) takes no second slot: with one slot it would wait for itself.
        single = ClientPool(max_in_flight=1, jitter_s=0.0)
        conn = EtcdConnection(config, pool=single)
        try:
            assert conn.call("outer", lambda: conn.call("inner", lambda: conn.client.get("k")[0])) == b"v"
        finally:
            conn.close()
    finally:
        for c in [*pooled, lone]:
            c.close()
    with pytest.raises(ValueError, match="max_in_flight"):
        ClientPool(max_in_flight=0)


def test_too_many_requests_backs_off_longer_than_an_outage_retry_and_within_its_bound() -> None:
    wait = overload_aware_wait(wait_random_exponential(multiplier=0.05, max=1.0))

    def waits(exc: BaseException) -> list[float]:
        state = SimpleNamespace(attempt_number=6, outcome=SimpleNamespace(exception=lambda: exc))
        return [wait(state) for _ in range(300)]

    busy, down = waits(_BUSY), waits(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert max(down) <= 1.0
    assert 1.0 < max(busy) <= OVERLOAD_MAX_WAIT_S, "a busy etcd must be given more time than a retry's 1 s"
    assert min(busy) >= 0.0


@pytest.mark.timeout(60)
def test_too_many_requests_is_retried_as_a_busy_etcd_not_reported_as_unreachable(
        etcd_server: EmbeddedEtcd, caplog: pytest.LogCaptureFixture) -> None:
    slept: list[float] = []
    conn = EtcdConnection(make_config(etcd_server.endpoint), sleep=slept.append)
    tries: list[int] = []

    def busy_four_times() -> Any:
        tries.append(1)
        if len(tries) <= 4:
            raise _BUSY
        return conn.client.get("k")[0]

    caplog.set_level(logging.DEBUG, logger="elastic.rendezvous.etcd_client")
    try:
        assert conn.call("read", busy_four_times) is None
    finally:
        conn.close()
    assert len(tries) == 5 and len(slept) == 4
    lines = [r for r in caplog.records if "overloaded" in r.getMessage()]
    assert len(lines) == 4 and lines[0].levelno == logging.INFO, "the first busy answer is said at INFO"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "a busy etcd is not an outage"


@pytest.mark.timeout(60)
def test_a_pooled_channel_is_not_closed_under_a_call_still_running(etcd_server: EmbeddedEtcd) -> None:
    config = make_config(etcd_server.endpoint)
    pool = ClientPool()
    a, b = EtcdConnection(config, pool=pool), EtcdConnection(config, pool=pool)
    a.client.put("k", "v")
    inside, closed = threading.Event(), threading.Event()

    def read_after_both_closed() -> Any:
        inside.set()
        assert closed.wait(10)
        return a.client.get("k")[0]  # on the shared channel, after the last connection was closed

    with ThreadPoolExecutor(max_workers=1) as thread:
        result = thread.submit(a.call, "read", read_after_both_closed)
        assert inside.wait(10)
        a.close()
        b.close()  # the last reference: the channel would be closed now, under a's call
        closed.set()
        assert result.result(timeout=10) == b"v"
    assert not pool.open_count, "the shared client is closed once the call in flight ended"
    with pytest.raises(ConnectionClosedError, match="closed"):
        a.call("read", lambda: a.client.get("k"))


@pytest.mark.timeout(60)
def test_a_coordinator_thread_that_outlives_its_handler_stops_quietly(
        etcd_server: EmbeddedEtcd, caplog: pytest.LogCaptureFixture) -> None:
    """leave() waits 2 s for each thread: a coordinator still inside a step then finds its connection (and the
    pool's channel, when it was the last user) closed, and must end without an error."""
    config = make_config(etcd_server.endpoint, run_id="outlive", max_nodes=3)
    handler = EtcdV3RendezvousHandler(config, node_id="n0", pool=ClientPool())
    rounds = handler.rounds  # the round-forming transactions (rounds.RoundWriter), the coordinator's elect
    elect = rounds.elect
    entered, gate = threading.Event(), threading.Event()

    def held_elect(lease: int) -> None:
        entered.set()
        gate.wait(30)  # the coordinator is busy past leave()'s 2 s join
        elect(lease)

    rounds.elect = held_elect  # type: ignore[method-assign]  # the test's hold on the coordinator
    caplog.set_level(logging.WARNING)
    try:
        handler.register()
        assert entered.wait(10), "the coordinator never tried to be elected"
        handler.leave()
        coordinator = [t for t in threading.enumerate() if t.name == "rdzv-coord-n0"]
        assert coordinator, "the test needs the coordinator to outlive leave()"
        gate.set()
        wait_for(lambda: not coordinator[0].is_alive(), timeout=10, what="the coordinator thread to end")
    finally:
        gate.set()
        handler.simulate_crash()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or "closed channel" in r.getMessage()]
    assert not errors, [r.getMessage() for r in errors]
