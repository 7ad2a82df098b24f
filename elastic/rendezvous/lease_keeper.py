"""Lease keeping: one thread and one ``LeaseKeepAlive`` stream per tick for every lease handed to a keeper.

An agent process has one lease (its registration) and one ``LeaseKeeper`` of its own. A process that hosts
many agents (the rendezvous bench, a test) shares one keeper between them through the ``ClientPool`` that
shares their etcd client: a thread and a stream per lease, refreshed every second, is ~3 thread starts and a
gRPC stream per agent per second, and at 1,000 agents on one host that work alone starved the refreshes
until leases expired. One keeper sends every lease's request on one stream and reads the answers back.

The keeper only talks to etcd; what an answer means is its owner's business (``LeaseOwner``): a refreshed
lease says etcd is reachable, a TTL of 0 says the lease is gone (re-register), a failure counts towards the
owner's outage bound. Owners must not block in their callbacks: the keeper's one thread serves them all.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from etcd3 import etcdrpc

from .etcd_client import EtcdConnection, describe, is_token_expired, is_transient

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.2
"""Shortest time between two refreshes, whatever the TTL."""


def refresh_interval(lease_ttl: int) -> float:
    """Seconds between two refreshes of a lease of ``lease_ttl`` s: three tries before it can expire."""
    return max(MIN_INTERVAL_S, lease_ttl / 3.0)


class LeaseOwner(Protocol):
    """What a keeper needs from the holder of a lease (the rendezvous handler)."""

    def lease_to_keep(self) -> int | None:
        """The lease to refresh now (None: none yet, or being replaced)."""

    def lease_refreshed(self, lease: int, ttl: int) -> None:
        """etcd answered for ``lease``: ``ttl`` > 0 s left, or <= 0 when the lease no longer exists."""

    def lease_refresh_failed(self, exc: BaseException) -> None:
        """The refresh failed (etcd unreachable, refused, or gave no answer for this lease)."""


class LeaseKeeper:
    """Refreshes the leases of its owners every ``interval`` s from one thread, over one stream per tick.

    ``add``/``remove`` owners at any time; ``close`` stops the thread. Thread-safe."""

    def __init__(self, conn: EtcdConnection, interval: float, *, name: str = "rdzv-lease") -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0 s, got {interval!r}")
        self._conn = conn
        self._interval = interval
        self._lock = threading.Lock()
        self._owners: list[LeaseOwner] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def connection(self) -> EtcdConnection:
        return self._conn

    @property
    def owners(self) -> int:
        with self._lock:
            return len(self._owners)

    def add(self, owner: LeaseOwner) -> None:
        with self._lock:
            if owner not in self._owners:
                self._owners.append(owner)

    def remove(self, owner: LeaseOwner) -> int:
        """Stop refreshing ``owner``'s lease; returns how many owners are left."""
        with self._lock:
            if owner in self._owners:
                self._owners.remove(owner)
            return len(self._owners)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.refresh_once()
            except Exception:  # a bug: say so and keep the leases alive on the next tick
                log.exception("lease keeper: a refresh round failed unexpectedly")

    def refresh_once(self) -> None:
        """Refresh every owner's lease now (one stream); the keeper's thread calls it every ``interval`` s."""
        with self._lock:
            wanted = [(owner, owner.lease_to_keep()) for owner in self._owners]
        by_lease = {lease: owner for owner, lease in wanted if lease is not None}
        if not by_lease:
            return
        try:
            answers = self._keep_alive(list(by_lease))
        except Exception as exc:  # noqa: BLE001 (classified, then every owner is told)
            if self._stop.is_set():
                return
            self._failed(exc, list(by_lease.values()))
            return
        for lease, owner in by_lease.items():
            ttl = answers.get(lease)
            if ttl is None:
                owner.lease_refresh_failed(TimeoutError(f"etcd gave no answer for lease {lease:x}"))
            else:
                owner.lease_refreshed(lease, ttl)

    def _keep_alive(self, leases: list[int]) -> dict[int, int]:
        """lease -> TTL etcd answered (0: no such lease), from one ``LeaseKeepAlive`` stream. The requests side
        half-closes after the last request, and etcd answers each request in turn before it ends the stream."""
        client = self._conn.client
        requests = [etcdrpc.LeaseKeepAliveRequest(ID=lease) for lease in leases]
        stream: Any = client.leasestub.LeaseKeepAlive(
            iter(requests), self._conn.per_call_timeout, credentials=client.call_credentials, metadata=client.metadata
        )
        answers: dict[int, int] = {}
        for response in stream:
            answers[int(response.ID)] = int(response.TTL)
            if len(answers) == len(leases):
                stream.cancel()  # all answered: do not wait for the server's end of stream
                break
        return answers

    def _failed(self, exc: BaseException, owners: list[LeaseOwner]) -> None:
        if is_token_expired(exc):
            try:
                self._conn.renew_token(exc)
                return  # the next tick refreshes with the new token
            except Exception as renew_exc:  # noqa: BLE001 (counts as etcd unreachable)
                exc = renew_exc
        elif not is_transient(exc):
            log.error("lease keeper: refresh failed unexpectedly: %s", describe(exc))
        for owner in owners:
            owner.lease_refresh_failed(exc)
