"""``MirrorWatch``: keeps the handler's ``Mirror`` of ``P/ctl/`` current from etcd's watch.

It loads the view the handler wants and follows it: every key (the coordinator, or a newcomer clearing an ended
run) or the followers' view (the closed key, notices, posts, round; ``RunKeys.watched_ranges``). A real agent
has a stream of its own; handlers that share a ``ClientPool`` follow the followers' view through the pool's one
``WatchMux``. When the wanted view changes (this node became or stopped being the coordinator, or clears an
ended run) it loads the other view and follows that. etcd's answers and failures go to ``EtcdHealth``; a watch
that cannot be retried (etcd refuses it even with a fresh token, a bug) is the handler's fatal error. Every
change is applied under the handler's condition, which it notifies: the handler's waiting loops wake on it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from tenacity import Retrying, retry_if_exception, wait_random_exponential

from .api import (
    EtcdRendezvousConfig,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousOutageError,
    RendezvousWatchError,
)
from .etcd_client import (
    ClientPool,
    EtcdConnection,
    WatchCanceledError,
    describe,
    is_auth_refusal,
    is_overloaded,
    is_token_expired,
    is_transient,
    overload_aware_wait,
)
from .health import EtcdHealth
from .keys import RunKeys
from .mirror import SAFETY_RECHECK_S, Mirror, MirrorUpdater
from .watch_mux import WatchMux

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""


def watch_failure(exc: BaseException, context: str) -> RendezvousError:
    """The handler's fatal error once its watch gave up with ``exc``.

    A connection error caused by a transient one is ``EtcdConnection.call`` giving up on an etcd that stayed
    unreachable for its bound (the watch reloads and renews its token through it): an outage, as the lease
    thread would report it. Anything else (etcd refused the watch, an unexpected error) happened while etcd
    answered: a failed watch, after which ``shutdown`` still marks the job closed."""
    if isinstance(exc, RendezvousOutageError) or (
        isinstance(exc, RendezvousConnectionError) and exc.__cause__ is not None and is_transient(exc.__cause__)
    ):
        return RendezvousOutageError(f"{context}the etcd watch gave up: {exc}")
    return RendezvousWatchError(f"{context}the etcd watch failed: {exc}")


class _WatchTokenRenewed(WatchCanceledError):
    """etcd refused the watch for its auth token, which has been renewed: watch again at once."""


class MirrorWatch:
    """Follows the wanted view of ``P/ctl/`` into ``mirror`` (read it under ``cond``); ``follow`` is its thread.

    Also a ``WatchSubscriber`` of the pool's shared watch (``watch_mux.py``)."""

    def __init__(
        self,
        config: EtcdRendezvousConfig,
        keys: RunKeys,
        updater: MirrorUpdater,
        health: EtcdHealth,
        cond: threading.Condition,
        stop: threading.Event,
        *,
        node_id: str,
        lease: Callable[[], int | None],
        require_conn: Callable[[], EtcdConnection],
        clock: Callable[[], float],
        ctx: Callable[[], str],
        pool: ClientPool | None,
    ) -> None:
        """Args:
            updater: applies what the watch delivers to the mirror.
            health: told of etcd's answers and failures, and of a watch that gave up.
            cond: the handler's condition: guards ``mirror``, notified on every change.
            stop: set when the handler stops (the thread ends, waits are cut short).
            node_id, lease: this node and its current lease (it mirrors every key while it is the coordinator).
            require_conn: the handler's connection (once connected).
            pool: with a pool, the followers' view comes from the pool's shared watch."""
        self._config = config
        self._keys = keys
        self._updater = updater
        self._health = health
        self._cond = cond
        self._stop = stop
        self._node_id = node_id
        self._lease = lease
        self._require_conn = require_conn
        self._clock = clock
        self._ctx = ctx
        self._pool = pool
        self.thread: threading.Thread | None = None
        """The watch thread (``start``)."""
        self.mirror = Mirror()
        """The local copy (replaced by each load, changed by each event; under ``cond``)."""
        self.clearing = False
        """A newcomer is clearing an ended run: it mirrors every key (set under ``cond``, then ``change_view``)."""
        self._view_epoch = 0
        """Bumped (under the condition) when the wanted view changes from outside the watch thread."""
        self._watch_stream: Any = None
        self._watch_token_renewed = False
        """The watch was refused and the token renewed; a second refusal in a row is fatal."""
        self._mux: WatchMux | None = None
        """With a pool: the watch its handlers share (``watch_mux.py``), held from connect to release."""
        self._mux_fatal: BaseException | None = None
        """The pool's shared watch (``watch_mux``) gave up with this error."""

    def connect(self) -> EtcdConnection:
        """Open the handler's connection and load the mirror; an etcd that cannot be reached is recorded
        (``EtcdHealth.connect_failed``). The watch thread starts with ``start``, once the handler holds it."""
        try:
            conn = EtcdConnection(self._config, context=self._ctx, pool=self._pool)
        except RendezvousConnectionError:
            self._health.connect_failed = True
            raise
        try:
            self.load(conn)
        except BaseException as exc:
            self._health.connect_failed = isinstance(exc, RendezvousConnectionError)
            self.release_mux()
            conn.close()
            raise
        return conn

    def start(self) -> None:
        """Start the watch thread (``follow``)."""
        self.thread = threading.Thread(target=self.follow, name=f"rdzv-watch-{self._node_id}", daemon=True)
        self.thread.start()

    def load(self, conn: EtcdConnection) -> None:
        """The first load, at connect: read the followers' view (with a pool: take it from the shared watch)."""
        if self._pool is None:
            self._load(conn)
        else:
            self._load_shared()

    def cancel(self) -> None:
        """End the current stream now (the handler stops)."""
        stream = self._watch_stream
        if stream is not None:
            stream.cancel()

    def _want_full(self) -> bool:
        """Whether this node should mirror every key now (called under the condition)."""
        coordinator = self.mirror.coordinator
        leading = coordinator is not None and coordinator == (self._node_id, self._lease())
        return leading or self.clearing

    def _load(self, conn: EtcdConnection, full: bool = False) -> None:
        """Read the watched ranges (start, a change of view, or after the watch fell behind a compaction)."""
        mirror = Mirror(loaded=True, full=full)
        for key, range_end in self._keys.watched_ranges(full):
            resp = conn.call("read the rendezvous state", functools.partial(conn.read_range, key, range_end))
            self._updater.add_range(mirror, resp.kvs, int(resp.header.revision))
        with self._cond:
            self.mirror = mirror
            self._cond.notify_all()

    def _sleep_unless_stopped(self, seconds: float) -> None:
        """The watch loop's retry backoff: cut short by shutdown."""
        self._stop.wait(seconds)

    def follow(self) -> None:
        """The watch thread: follow the wanted view until the handler stops; a failure it cannot retry is fatal
        (``EtcdHealth.fail``)."""
        retrying = Retrying(
            stop=lambda _state: self._stop.is_set(),
            wait=overload_aware_wait(wait_random_exponential(multiplier=0.05, max=1.0)),
            retry=retry_if_exception(lambda exc: not self._stop.is_set() and (is_transient(exc) or isinstance(exc, WatchCanceledError))),
            sleep=self._sleep_unless_stopped,
            reraise=True,
        )
        try:
            retrying(self._watch_once)
        except Exception as exc:  # the thread must report, not die silently
            if not self._stop.is_set():
                # Our own errors carry a clear message; an unexpected one (a bug) keeps its traceback.
                log.error("%sthe rendezvous watch failed: %s", self._ctx(), exc, exc_info=not isinstance(exc, RendezvousError))
                # The first cause (an outage the lease thread measured) explains the rest.
                self._health.fail(watch_failure(exc, self._ctx()))

    def _watch_once(self) -> None:
        """Load the view this node wants and follow it; when the wanted view changes (this node became or
        stopped being the coordinator, or clears an ended run), load the other view and follow that."""
        while not self._stop.is_set():
            if not self._follow_view():
                return

    def _follow_view(self) -> bool:
        """One watch stream over the wanted view; True when it ended because the wanted view changed."""
        conn = self._require_conn()
        stream = None
        with self._cond:
            shared = self._pool is not None and not self._want_full()
        if shared:
            return self._follow_shared()
        try:
            with self._cond:
                full = self._want_full()
                needs_load = not self.mirror.loaded or self.mirror.full != full
                epoch = self._view_epoch
            if needs_load:
                self._load(conn, full)
            with self._cond:
                starts = [rev + 1 for rev in self.mirror.watch_revs]
            ranges = self._keys.watched_ranges(full)
            stream = conn.watch_ranges([(key, end, start) for (key, end), start in zip(ranges, starts, strict=True)])
            self._watch_stream = stream
            if self._stop.is_set() or self._view_epoch != epoch:
                stream.cancel()
                return not self._stop.is_set()
            for response in stream:
                if response.canceled and is_auth_refusal(response.cancel_reason):
                    self._renew_token_for_watch(conn, response.cancel_reason)
                    raise _WatchTokenRenewed(response.cancel_reason)
                self._watch_token_renewed = False  # a fresh token got the watch through
                self._health.ok()
                if response.compact_revision:
                    with self._cond:
                        self.mirror.loaded = False  # resync on the next attempt
                    raise WatchCanceledError(f"watch fell behind compaction at {response.compact_revision}")
                if response.canceled:
                    raise WatchCanceledError(f"watch canceled by etcd: {response.cancel_reason}")
                if response.events:
                    self._apply_events(response.events, int(response.watch_id))
                with self._cond:
                    if self._want_full() != full:
                        stream.cancel()
                        return True
        except RendezvousConnectionError:
            raise
        except Exception as exc:
            if self._stop.is_set():
                return False
            with self._cond:
                if self._view_epoch != epoch or self._want_full() != full:
                    return True  # canceled from outside for a change of view
            if isinstance(exc, _WatchTokenRenewed):
                raise
            if is_token_expired(exc):
                self._renew_token_for_watch(conn, describe(exc))
                raise _WatchTokenRenewed(describe(exc)) from exc
            if not is_overloaded(exc):  # "too many requests": a busy etcd answered, backed off from, no outage
                self._health.failed(exc)
            raise
        if not self._stop.is_set():
            raise WatchCanceledError("watch stream ended")
        return False

    # ------------------------------------------------------------------ the pool's shared watch (watch_mux.py)
    def _follow_shared(self) -> bool:
        """Follow the followers' view through the watch every handler of the pool shares (one stream per
        process instead of one per handler); True when it ended because the wanted view changed.

        Only with a ``ClientPool``, i.e. many agents in one process (the bench, tests); a real agent (no pool)
        keeps its own stream."""
        mux = self._mux
        assert mux is not None  # held from connect to release
        with self._cond:
            epoch = self._view_epoch
        mux.subscribe(self)  # never under our condition: the mux's callbacks take it
        try:
            with self._cond:
                while True:
                    if self._stop.is_set():
                        return False
                    fatal = self._mux_fatal
                    if isinstance(fatal, RendezvousError):  # a copy: every handler of the pool raises it
                        raise type(fatal)(str(fatal)) from fatal
                    if fatal is not None:
                        raise RendezvousWatchError(f"the shared etcd watch failed: {describe(fatal)}") from fatal
                    if self._view_epoch != epoch or self._want_full():
                        return True
                    self._cond.wait(SAFETY_RECHECK_S)
        finally:
            mux.unsubscribe(self)

    def _load_shared(self) -> None:
        """``_load`` from the pool's shared watch: its keys, without a read of our own (bounded by etcd_timeout)."""
        self._mux = mux = self._acquire_mux()
        try:
            state = mux.state(self._config.etcd_timeout)
        except RendezvousError:
            raise
        except Exception as exc:
            raise RendezvousWatchError(f"{self._ctx()}the shared etcd watch failed: {describe(exc)}") from exc
        if state is None:
            raise RendezvousConnectionError(
                f"{self._ctx()}etcd at {self._config.endpoint_str} unreachable for {self._config.etcd_timeout:.0f} s "
                f"while trying to read the rendezvous state (shared watch)")
        self.watch_reset(*state)

    def _mux_key(self) -> tuple[Any, ...]:
        return ("watch-mux", *ClientPool.key(self._config), self._config.run_prefix)

    def _acquire_mux(self) -> WatchMux:
        pool, config = self._pool, self._config
        assert pool is not None
        ranges = self._keys.watched_ranges(False)
        return pool.acquire_shared(self._mux_key(), lambda: WatchMux(
            EtcdConnection(config, pool=pool), ranges, name=f"rdzv-watch-mux-{config.run_id}"))

    def release_mux(self) -> None:
        """Let go of the pool's shared watch (the last handler to let go closes it)."""
        mux, self._mux = self._mux, None
        if mux is None or self._pool is None:
            return
        mux.unsubscribe(self)
        last = self._pool.release_shared(self._mux_key())
        if last is not None:
            last.close()
            last.connection.close()

    # WatchSubscriber (watch_mux.py), called from the mux's thread under its lock: never block here.
    def watch_reset(self, kvs: Any, revisions: Any) -> None:
        mirror = Mirror(loaded=True, full=False)
        for range_kvs, revision in zip(kvs, revisions, strict=True):
            self._updater.add_range(mirror, range_kvs, int(revision))
        with self._cond:
            self.mirror = mirror
            self._cond.notify_all()
        self._health.ok()

    def watch_events(self, events: Any, watch_id: int) -> None:
        self._apply_events(events, watch_id)
        self._health.ok()

    def watch_failed(self, exc: BaseException) -> None:
        if not self._stop.is_set():
            self._health.failed(exc)

    def watch_fatal(self, exc: BaseException) -> None:
        with self._cond:
            self._mux_fatal = exc
            self._cond.notify_all()

    def _apply_events(self, events: Any, watch_id: int) -> None:
        with self._cond:
            self._updater.apply_events(self.mirror, events, watch_id)
            self._cond.notify_all()

    def change_view(self) -> None:
        """The wanted view changed outside the watch thread: make it reload (call after the change)."""
        with self._cond:
            self._view_epoch += 1
            self._cond.notify_all()  # a follower on the shared watch waits on the condition, not a stream
        stream = self._watch_stream
        if stream is not None:
            stream.cancel()

    def _renew_token_for_watch(self, conn: EtcdConnection, reason: str) -> None:
        """etcd refused the watch for its token (after a restart it says "permission denied"): renew once;
        refused again with a fresh token, the user really lacks the permission and the job cannot go on."""
        if self._watch_token_renewed:
            raise RendezvousConnectionError(
                f"{self._ctx()}etcd refuses to let user {self._config.user!r} watch {self._keys.ctl!r} ({reason}), "
                f"even with a fresh token: grant its role readwrite on the prefix {self._config.etcd_prefix!r}/"
            )
        conn.call("renew the auth token", conn.renew_token)
        self._watch_token_renewed = True

    def wait_revision_after(self, revision: int, deadline: float) -> None:
        """Block until the watch delivered a change after ``revision`` (or ``deadline`` passed)."""
        self.wait_for(lambda m: m.revision > revision, deadline)

    def wait_for(self, ready: Callable[[Mirror], bool], deadline: float) -> None:
        """Block until the watch delivered a state with ``ready(mirror)`` (or ``deadline`` passed)."""
        with self._cond:
            while not ready(self.mirror):
                self._health.raise_if_fatal()
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return
                self._cond.wait(min(remaining, SAFETY_RECHECK_S))
