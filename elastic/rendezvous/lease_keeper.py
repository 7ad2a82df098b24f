"""Lease keeping: one thread and one ``LeaseKeepAlive`` stream per tick for every lease handed to a keeper.

An agent process has one lease (its registration) and one ``LeaseKeeper`` of its own. A process that hosts
many agents (the rendezvous bench, a test) shares one keeper between them through the ``ClientPool`` that
shares their etcd client: a thread and a stream per lease would start threads and gRPC streams for every agent
every second, enough work at a thousand agents to starve the refreshes. One keeper sends every lease's request
on one stream and reads the answers back.

The keeper only talks to etcd; what an answer means is its owner's business (``LeaseOwner``): a refreshed
lease says etcd is reachable, a TTL of 0 says the lease is gone (re-register), a failure counts towards the
owner's outage bound. Owners must not block in their callbacks: the keeper's one thread serves them all.

A refresh cannot starve the leases it keeps:

* each stream may take at most ``call_timeout`` s, below the refresh interval (a third of the TTL), so one slow
  or lost answer costs one tick, not the TTL;
* the answers that did come are used even when the stream then failed, and when only some leases were answered
  the others are asked again at once (a new stream) rather than a tick later; only a tick that stopped making
  progress (or ran out of time) tells the owners of the leases left unanswered that the refresh failed;
* etcd answers a stream's requests in order and holds its answer for an expired lease until it has revoked it:
  the lease a stream got stuck on is asked for after the others from then on, so an expired lease (a dead or
  re-registering agent's) does not hold back the refresh of every lease behind it;
* etcd's "too many requests" (``RESOURCE_EXHAUSTED``) is an answer from a reachable etcd: it is retried on the next
  tick and not reported to the owners as an outage;
* a tick that starts more than an interval late (the process is starved of CPU: its leases are at risk) is logged
  once per episode at WARNING, the rest of the episode at DEBUG.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from etcd3 import etcdrpc

from .etcd_client import EtcdConnection, describe, is_overloaded, is_token_expired, is_transient

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.2
"""Shortest time between two refreshes, whatever the TTL."""

CALL_SHARE = 0.7
"""A refresh stream's deadline as a share of the refresh interval (bounded by the connection's per-call timeout)."""

LATE_WARN_EVERY_S = 60.0
"""Fewest seconds between two WARNING lines about late ticks (one per episode of lateness)."""


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

    def __init__(self, conn: EtcdConnection, interval: float, *, name: str = "rdzv-lease",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0 s, got {interval!r}")
        self._conn = conn
        self._interval = interval
        self.call_timeout = min(conn.per_call_timeout, CALL_SHARE * interval)
        """Seconds one refresh stream may take: below ``interval``, so a slow answer costs one tick."""
        self._clock = clock
        self._name = name
        self._lock = threading.Lock()
        self._owners: list[LeaseOwner] = []
        self._stop = threading.Event()
        self._late_ticks = 0
        """Ticks in a row that started more than an interval late (0: on time)."""
        self._late_warned_at: float | None = None
        self._overloaded = False
        """etcd answered "too many requests" on the last try (logged once until it answers again)."""
        self._suspects: set[int] = set()
        """Leases a stream ran out of time on (expired ones, held by etcd until revoked): asked for last."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def connection(self) -> EtcdConnection:
        return self._conn

    @property
    def interval(self) -> float:
        return self._interval

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
        due = self._clock() + self._interval
        while not self._stop.wait(max(0.0, due - self._clock())):
            started = self._clock()
            self._note_lateness(started - due)
            due = started + self._interval  # no catching up: a late tick is followed by one an interval later
            try:
                self.refresh_once(until=due)
            except Exception:  # a bug: say so and keep the leases alive on the next tick
                log.exception("lease keeper: a refresh round failed unexpectedly")

    def _note_lateness(self, late_by: float) -> None:
        """Say once per episode (and at most every ``LATE_WARN_EVERY_S``) that ticks come over an interval late."""
        if late_by <= self._interval:
            if self._late_ticks:
                log.info("lease keeper %s: on time again after %d late tick(s)", self._name, self._late_ticks)
            self._late_ticks = 0
            return
        self._late_ticks += 1
        now = self._clock()
        first = self._late_ticks == 1 and (
            self._late_warned_at is None or now - self._late_warned_at >= LATE_WARN_EVERY_S)
        if first:
            self._late_warned_at = now
        log.log(logging.WARNING if first else logging.DEBUG,
                "lease keeper %s: a refresh started %.1f s late (interval %.2f s, %d lease(s)): this process is "
                "starved of CPU and its leases may expire", self._name, late_by, self._interval, self.owners)

    def refresh_once(self, until: float | None = None) -> None:
        """Refresh every owner's lease now (one stream; the keeper's thread calls it every ``interval`` s).

        etcd answers a stream's requests in order, and holds the answer for an expired lease until it has revoked
        it (up to its 0.5 s expiry scan, longer when many leases expired at once): that one lease would hold back
        every lease behind it. So the first lease left unanswered by a stream that ran out of time is a suspect,
        asked for after the others from then on, and what a stream left unanswered is asked again at once (a new
        stream) while it made progress (answers, or a new suspect) and ``until`` (default: one interval from now)
        has not come; the owners of the leases still unanswered are told that the refresh failed."""
        with self._lock:
            wanted = [(owner, owner.lease_to_keep()) for owner in self._owners]
        pending = {lease: owner for owner, lease in wanted if lease is not None}
        self._suspects &= pending.keys()
        deadline = (self._clock() + self._interval) if until is None else until
        renewed = False
        while pending and not self._stop.is_set():
            order = sorted(pending, key=lambda lease: lease in self._suspects)  # stable: suspects last
            began = self._clock()
            answers, exc = self._keep_alive(order, self.call_timeout)
            ran_out = exc is not None and self._clock() - began >= 0.9 * self.call_timeout
            for lease, ttl in answers.items():
                owner = pending.pop(lease, None)
                self._suspects.discard(lease)
                if owner is not None:
                    _tell(owner.lease_refreshed, lease, ttl)
            if not pending or self._stop.is_set():
                break
            if exc is not None and is_token_expired(exc) and not renewed:
                renewed = True
                try:
                    self._conn.renew_token(exc)
                    continue  # ask again at once with the new token
                except Exception as renew_exc:  # noqa: BLE001 (counts as etcd unreachable)
                    exc = renew_exc
            else:
                blocker = next(lease for lease in order if lease in pending)
                new_suspect = ran_out and blocker not in self._suspects
                if new_suspect:
                    self._suspects.add(blocker)
                    log.debug("lease keeper %s: no answer for lease %x: asking for it after the others", self._name,
                              blocker)
                if (answers or new_suspect) and self._clock() < deadline:
                    continue  # progress: ask for the rest at once
            self._failed(exc, list(pending.values()))
            return
        if self._overloaded and not pending:
            self._overloaded = False
            log.info("lease keeper %s: etcd answers again after \"too many requests\"", self._name)

    def _keep_alive(self, leases: list[int], timeout: float) -> tuple[dict[int, int], BaseException | None]:
        """(lease -> TTL etcd answered (0: no such lease), the error that ended the stream early or None), from one
        ``LeaseKeepAlive`` stream of at most ``timeout`` s. The requests side half-closes after the last request,
        and etcd answers each request in turn before it ends the stream."""
        answers: dict[int, int] = {}
        try:
            with self._conn.in_use("refresh leases"):  # a pooled channel is not closed under the stream
                client = self._conn.client
                requests = [etcdrpc.LeaseKeepAliveRequest(ID=lease) for lease in leases]
                stream: Any = client.leasestub.LeaseKeepAlive(
                    iter(requests), timeout, credentials=client.call_credentials, metadata=client.metadata
                )
                for response in stream:
                    answers[int(response.ID)] = int(response.TTL)
                    if len(answers) == len(leases):
                        stream.cancel()  # all answered: do not wait for the server's end of stream
                        break
        except Exception as exc:  # noqa: BLE001 (classified by the caller; the answers that came still count)
            return answers, exc
        return answers, None

    def _failed(self, exc: BaseException | None, owners: list[LeaseOwner]) -> None:
        """Tell ``owners`` (no answer for their leases this tick) why, unless the keeper is stopping or etcd only
        said it is busy."""
        if self._stop.is_set():
            return
        if exc is None:
            exc = TimeoutError(f"etcd gave no answer within {self.call_timeout:.2f} s")
        if is_overloaded(exc):
            if not self._overloaded:
                self._overloaded = True
                log.info("lease keeper %s: etcd answered %s for %d lease(s); trying again next tick", self._name,
                         describe(exc), len(owners))
            return
        if not is_transient(exc) and not isinstance(exc, TimeoutError):
            log.error("lease keeper: refresh failed unexpectedly: %s", describe(exc))
        for owner in owners:
            _tell(owner.lease_refresh_failed, exc)


def _tell(callback: Callable[..., None], *args: Any) -> None:
    """Call an owner back; one owner's bug must not keep the others from hearing of their leases."""
    try:
        callback(*args)
    except Exception:
        log.exception("lease keeper: an owner failed on its lease's news")
