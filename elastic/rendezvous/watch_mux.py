"""One watch stream per process for the followers' view, fanned out to every handler of that process.

A real agent has one handler and its own stream. A process that hosts many agents (the rendezvous bench, a
test) would open one stream per agent, all over the same few keys (the closed key, the notices, the
coordinator's posts and the round key), each receiving its own copy of every event. The ``WatchMux`` that their
``ClientPool`` shares watches those ranges once and hands each response to every subscribed handler.

A subscriber first gets the ranges' current keys (``watch_reset``) and from then on every response
(``watch_events``), in order and under the mux's lock (so a subscriber never misses an event between the two,
and once ``unsubscribe`` returned it gets nothing more). When etcd cancels the watch (compaction) the mux
reads the ranges again and resets every subscriber; when it cannot reach etcd it tells each one
(``watch_failed``, counted towards its outage bound) and retries (etcd's "too many requests" is no outage: the
mux backs off longer and tells nobody); an error that retrying cannot cure (etcd
refuses the watch even with a fresh token) is ``watch_fatal``. Subscribers must not block in their callbacks,
and must not call the mux while holding a lock their callbacks take (the mux's lock comes first).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from etcd3.etcdrpc import kv_pb2
from tenacity import Retrying, retry_if_exception, wait_random_exponential

from .api import RendezvousConnectionError
from .etcd_client import (
    EtcdConnection,
    WatchCanceledError,
    WatchStream,
    describe,
    is_auth_refusal,
    is_overloaded,
    is_token_expired,
    is_transient,
    overload_aware_wait,
)

log = logging.getLogger(__name__)

Range = tuple[str, bytes | None]
"""(key, range_end): one key when range_end is None, else the keys in [key, range_end)."""


class WatchSubscriber(Protocol):
    """What a ``WatchMux`` tells a subscribed handler (called from the mux's thread, under its lock)."""

    def watch_reset(self, kvs: Sequence[Sequence[Any]], revisions: Sequence[int]) -> None:
        """The watched ranges' keys now: per range (in the mux's order) its ``KeyValue``s, and the revision
        each range was read at (events with a higher revision follow)."""

    def watch_events(self, events: Sequence[Any], watch_id: int) -> None:
        """One watch response: its events (etcd ``Event``s) for range ``watch_id``."""

    def watch_failed(self, exc: BaseException) -> None:
        """etcd could not be reached (the mux retries); counts towards the subscriber's outage bound."""

    def watch_fatal(self, exc: BaseException) -> None:
        """The mux gave up (retrying cannot help); no callback follows."""


class _Canceled(Exception):
    """The stream ended because the mux is closing."""


class WatchMux:
    """Watches ``ranges`` over ``conn`` from one thread and fans the responses out to its subscribers."""

    def __init__(self, conn: EtcdConnection, ranges: Sequence[Range], *, name: str = "rdzv-watch-mux") -> None:
        if not ranges:
            raise ValueError("a WatchMux needs at least one range")
        self._conn = conn
        self._ranges = list(ranges)
        self._lock = threading.Lock()
        self._subscribers: list[WatchSubscriber] = []
        self._kvs: list[dict[bytes, Any]] = [{} for _ in self._ranges]
        """Per range: key -> its current ``KeyValue`` (what a new subscriber is reset with)."""
        self._revs: list[int] = [0] * len(self._ranges)
        """Per range: the revision it was read at or the highest one its watcher delivered."""
        self._loaded = False
        self._loaded_once = threading.Event()
        """Set once the ranges were read (or the mux gave up): ``state`` waits for it."""
        self._fatal: BaseException | None = None
        self._token_renewed = False
        self._stream: WatchStream | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def connection(self) -> EtcdConnection:
        return self._conn

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def subscribe(self, subscriber: WatchSubscriber) -> None:
        """Start delivering to ``subscriber``: a reset with the current keys (once loaded), then every response."""
        with self._lock:
            if self._fatal is not None:
                subscriber.watch_fatal(self._fatal)
                return
            if subscriber in self._subscribers:
                return
            self._subscribers.append(subscriber)
            if self._loaded:
                subscriber.watch_reset(self._snapshot_locked(), list(self._revs))

    def state(self, timeout: float) -> tuple[list[list[Any]], list[int]] | None:
        """The watched ranges' keys and revisions (as ``watch_reset`` gives them) once the mux has read them, or
        None after ``timeout`` s; raises the error the mux gave up with. A handler loads its first view from it
        instead of reading the ranges itself."""
        self._loaded_once.wait(timeout)
        with self._lock:
            if self._fatal is not None:
                raise self._fatal
            if not self._loaded:
                return None
            return self._snapshot_locked(), list(self._revs)

    def unsubscribe(self, subscriber: WatchSubscriber) -> int:
        """Stop delivering to ``subscriber`` (nothing reaches it once this returns); returns how many are left."""
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)
            return len(self._subscribers)

    def close(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the mux's thread
    def _run(self) -> None:
        retrying = Retrying(
            stop=lambda _state: self._stop.is_set(),
            wait=overload_aware_wait(wait_random_exponential(multiplier=0.05, max=1.0)),
            retry=retry_if_exception(
                lambda exc: not self._stop.is_set() and (is_transient(exc) or isinstance(exc, WatchCanceledError))
            ),
            sleep=self._sleep_unless_stopped,
            reraise=True,
        )
        try:
            retrying(self._watch_once)
        except _Canceled:
            return
        except Exception as exc:
            if self._stop.is_set():
                return
            log.error("the shared rendezvous watch failed: %s", describe(exc),
                      exc_info=not isinstance(exc, RendezvousConnectionError))
            with self._lock:
                self._fatal = exc
                self._loaded_once.set()
                for subscriber in list(self._subscribers):
                    subscriber.watch_fatal(exc)

    def _sleep_unless_stopped(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _watch_once(self) -> None:
        """Read the ranges unless loaded, then follow them from the next revision until the stream breaks."""
        conn = self._conn
        try:
            if not self._loaded:
                self._load()
            with self._lock:
                starts = [rev + 1 for rev in self._revs]
            stream = conn.watch_ranges([(key, end, start) for (key, end), start in zip(self._ranges, starts, strict=True)])
            self._stream = stream
            if self._stop.is_set():
                stream.cancel()
                raise _Canceled
            for response in stream:
                if response.canceled and is_auth_refusal(response.cancel_reason):
                    self._renew_token(response.cancel_reason)
                    raise WatchCanceledError(f"watch refused ({response.cancel_reason}); token renewed")
                self._token_renewed = False
                if response.compact_revision:
                    self._loaded = False  # read the ranges again on the next attempt
                    raise WatchCanceledError(f"watch fell behind compaction at {response.compact_revision}")
                if response.canceled:
                    raise WatchCanceledError(f"watch canceled by etcd: {response.cancel_reason}")
                if response.events:
                    self._deliver(response.events, int(response.watch_id))
        except (_Canceled, RendezvousConnectionError):
            raise
        except Exception as exc:
            if self._stop.is_set():
                raise _Canceled from exc
            if isinstance(exc, WatchCanceledError):
                log.info("shared rendezvous watch: %s; watching again", exc)
                raise
            if is_token_expired(exc):
                self._renew_token(describe(exc))
                raise WatchCanceledError(f"token expired ({describe(exc)}); renewed") from exc
            if is_overloaded(exc):  # a busy etcd answered: back off longer, not an outage of the subscribers
                log.info("shared rendezvous watch: etcd is overloaded (%s); backing off", describe(exc))
                raise
            self._failed(exc)
            raise
        if self._stop.is_set():
            raise _Canceled
        raise WatchCanceledError("watch stream ended")

    def _load(self) -> None:
        conn = self._conn
        kvs: list[dict[bytes, Any]] = []
        revs: list[int] = []
        for key, range_end in self._ranges:
            resp = conn.call("read the rendezvous state", functools.partial(conn.read_range, key, range_end))
            kvs.append({bytes(kv.key): kv for kv in resp.kvs})
            revs.append(int(resp.header.revision))
        with self._lock:
            self._kvs, self._revs, self._loaded = kvs, revs, True
            self._loaded_once.set()
            snapshot = self._snapshot_locked()
            for subscriber in list(self._subscribers):
                subscriber.watch_reset(snapshot, list(revs))

    def _snapshot_locked(self) -> list[list[Any]]:
        return [list(by_key.values()) for by_key in self._kvs]

    def _deliver(self, events: Sequence[Any], watch_id: int) -> None:
        with self._lock:
            if 0 <= watch_id < len(self._kvs):
                by_key = self._kvs[watch_id]
                for ev in events:
                    if ev.type == kv_pb2.Event.PUT:
                        by_key[bytes(ev.kv.key)] = ev.kv
                    else:
                        by_key.pop(bytes(ev.kv.key), None)
                    self._revs[watch_id] = max(self._revs[watch_id], int(ev.kv.mod_revision))
            for subscriber in list(self._subscribers):
                try:
                    subscriber.watch_events(events, watch_id)
                except Exception:  # one subscriber's bug must not starve the others
                    log.exception("a subscriber of the shared rendezvous watch failed on an event")

    def _renew_token(self, reason: str) -> None:
        """etcd refused the watch for its token: renew once; refused again with a fresh token is fatal."""
        if self._token_renewed:
            raise RendezvousConnectionError(
                f"etcd refuses to let user {self._conn.config.user!r} watch the rendezvous ({reason}), even with a "
                f"fresh token: grant its role readwrite on the prefix {self._conn.config.etcd_prefix!r}/"
            )
        self._conn.call("renew the auth token", self._conn.renew_token)
        self._token_renewed = True

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            for subscriber in list(self._subscribers):
                subscriber.watch_failed(exc)
