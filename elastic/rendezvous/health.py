"""``EtcdHealth``: whether etcd answers the handler, and the error that ends it once it cannot go on.

Every part of the handler that talks to etcd in the background (the watch, the lease keeper's callbacks, a
re-registration) reports here: an answer clears an outage, a failure starts or extends one, and an outage
longer than ``etcd_timeout`` becomes the handler's fatal ``RendezvousOutageError``. A failed watch or a corrupt
key is fatal too. Every public method of the handler raises the fatal error (``raise_if_fatal``), and the
threads waiting on the handler's condition are woken when it is set.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from .api import EtcdRendezvousConfig, RendezvousConnectionError, RendezvousError, RendezvousOutageError
from .etcd_client import describe

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""


def unreachable_at_shutdown(*, connect_failed: bool, fatal: RendezvousError | None) -> bool:
    """True when ``shutdown`` must not try to mark the job closed: etcd was already unreachable for
    ``etcd_timeout`` (or never reached), so ``close_timeout`` more would only double the wait. A failed watch
    (``RendezvousWatchError``) or a corrupt key does not say etcd is away: closing is still tried."""
    return connect_failed or isinstance(fatal, RendezvousConnectionError)


def is_lease_not_found(exc: BaseException | None) -> bool:
    """etcd says the lease named by a call no longer exists (expired or revoked): re-register, not an outage."""
    return (
        isinstance(exc, grpc.RpcError)
        and hasattr(exc, "code")
        and exc.code() == grpc.StatusCode.NOT_FOUND
        and "lease not found" in (exc.details() or "")
    )


class EtcdHealth:
    """The outage clock and the fatal error of one handler (``fatal`` is set under ``cond``, which is notified)."""

    def __init__(self, config: EtcdRendezvousConfig, cond: threading.Condition, clock: Callable[[], float],
                 ctx: Callable[[], str]) -> None:
        self._config = config
        self._cond = cond
        self._clock = clock
        self._ctx = ctx
        self.fatal: RendezvousError | None = None
        """The error every public method raises from now on (the first cause; a corrupt key replaces it)."""
        self.connect_failed = False
        """The last try to connect failed for want of etcd (``unreachable_at_shutdown``)."""
        self._unreachable_since: float | None = None

    def ok(self) -> None:
        """etcd answered: an outage, if any, is over."""
        if self._unreachable_since is not None:
            log.info("%setcd reachable again after %.1f s", self._ctx(), self._clock() - self._unreachable_since)
            self._unreachable_since = None

    def failed(self, exc: BaseException) -> None:
        """etcd could not be reached: start the outage clock, or end the handler once it ran past etcd_timeout."""
        now, since = self._clock(), self._unreachable_since  # read once: another thread may note etcd ok meanwhile
        if since is None:
            self._unreachable_since = now
            log.warning("%setcd at %s unreachable: %s", self._ctx(), self._config.endpoint_str, describe(exc))
            return
        if now - since > self._config.etcd_timeout and self.fatal is None:
            with self._cond:
                self.fatal = RendezvousOutageError(
                    f"{self._ctx()}etcd at {self._config.endpoint_str} unreachable for "
                    f"{now - since:.1f} s, more than etcd_timeout="
                    f"{self._config.etcd_timeout:g} s (last error: {describe(exc)}); giving up"
                )
                self._cond.notify_all()
            log.error("%s", self.fatal)  # the message starts with the context

    def fail(self, error: RendezvousError) -> None:
        """A background thread gave up with ``error``: fatal unless an earlier cause (an outage the lease thread
        measured) explains it already. Wakes every waiter."""
        with self._cond:
            if self.fatal is None:
                self.fatal = error
            self._cond.notify_all()

    def corrupt(self, error: RendezvousError) -> None:
        """A key under the run's prefix holds garbage: fatal, whatever came before (no lock: one assignment)."""
        self.fatal = error

    def raise_if_fatal(self) -> None:
        if self.fatal is not None:
            raise type(self.fatal)(str(self.fatal)) from self.fatal

    def unreachable(self) -> bool:
        """``unreachable_at_shutdown`` for this handler: etcd is known to be away."""
        return unreachable_at_shutdown(connect_failed=self.connect_failed, fatal=self.fatal)
