"""The agent's view of the rendezvous while its workers train: membership changes, lost peers, the outage clock.

With a :class:`~elastic.rendezvous.api.MembershipAwareHandler` (etcd-v3) the monitor loop sleeps on
``wait_membership_change`` and reacts to a change at once; any other handler gets torch's
``num_nodes_waiting()`` polling (said once in the log). A failing rendezvous is tolerated within its bound
(:class:`~elastic.outage.OutageClock`): the workers do not need it while training, so an etcd restart must not
end a healthy job, but one that stays away must (nobody would notice a lost peer). A permanent error
(``rendezvous.api.is_permanent``) ends the job at once: no later call could succeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousHandler

from elastic.agent_hooks import AgentFeature, AgentHost
from elastic.api import RecoveryCause, RecoveryEvent
from elastic.outage import OutageClock, OutageVerdict
from elastic.rendezvous.api import (
    DEFAULT_ETCD_TIMEOUT_S,
    MembershipAwareHandler,
    NoticeAwareHandler,
    OutageBoundHandler,
    PeerProbingHandler,
    RendezvousOutageError,
    RestartAnnouncingHandler,
    RoundMembersHandler,
    is_permanent,
)

logger = logging.getLogger(__name__)

PEER_REVOKE_SEEN_S = 1.0
"""Longest wait for our etcd watch to show a peer lease this agent just revoked (milliseconds, normally)."""


class MembershipView(AgentFeature):
    """Membership signals of the rendezvous handler, each query timed against the outage bound.

    Args:
        handler: the rendezvous handler (its capabilities are checked once, here).
        host: the agent (log context, events, stopping the workers when the outage is fatal).
        clock: monotonic seconds for the outage clock (injected: tests drive it).
    """

    def __init__(self, handler: RendezvousHandler, host: AgentHost, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.handler = handler
        self.aware = membership_aware(handler)
        """The handler as a ``MembershipAwareHandler``, or None (torch's polling path)."""
        self.notices = handler if isinstance(handler, NoticeAwareHandler) else None
        """The handler as a ``NoticeAwareHandler`` (peers' notices, lost peers), or None."""
        self.outage = OutageClock(bound=outage_bound(handler))
        self._host = host
        self._clock = clock

    @property
    def round(self) -> int | None:
        """The backend's round number when it has one (etcd-v3's ``round``), for cross-node correlation."""
        return self.aware.round if self.aware is not None else None

    def changed(self) -> bool:
        """A peer left or a node waits to join (torch's ``num_nodes_waiting`` without the protocol)."""
        if self.aware is None:
            return self.nodes_waiting()
        try:
            changed = self.aware.membership_changed()
        except RendezvousError as exc:
            # Errors outside the declared tree (a bug, a changed handler) propagate.
            self.failed("query the rendezvous for membership changes", exc)
            return False
        self.ok()
        return changed or self.nodes_waiting()

    def nodes_waiting(self) -> bool:
        """torch's own signal: a node is waiting to join."""
        try:
            waiting = self.handler.num_nodes_waiting() > 0
        except SignalException:
            raise
        except Exception as exc:  # noqa: BLE001 - any handler's store error is an outage (below)
            # Any handler may sit behind this call (torch's c10d raises store errors outside the
            # RendezvousError tree), so here any error counts against the outage bound.
            self.failed("query the rendezvous for waiting nodes", exc)
            return False
        self.ok()
        return waiting

    def wait(self, timeout: float, *, raise_permanent: bool = False) -> bool:
        """Block up to ``timeout`` s, returning early (True) on a membership event when the handler has one;
        ``raise_permanent``: a permanent rendezvous error (``is_permanent``) is raised instead of handled."""
        if timeout <= 0:
            return False
        if self.aware is None:
            time.sleep(timeout)  # torch's path: poll once per monitor interval
            return False
        started = time.monotonic()
        try:
            changed = self.aware.wait_membership_change(timeout)
        except RendezvousError as exc:
            if raise_permanent and is_permanent(exc):
                raise
            self.failed("wait for membership changes", exc)
            time.sleep(max(0.0, timeout - (time.monotonic() - started)))
            return False
        self.ok()
        return changed

    def wait_for_peer_loss(self, window: float) -> bool:
        """Watch the membership up to ``window`` s: True as soon as it changes (a peer lost its lease),
        False when the window passes. Event-driven with a membership-aware handler, else polled."""
        deadline = time.monotonic() + window
        while not self.changed():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self.aware is not None:
                self.wait(remaining)
            else:
                time.sleep(min(remaining, self._host.worker_group.spec.monitor_interval))
        return True

    def ok(self) -> None:
        """A query answered: ends an outage (said once, ``etcd_outage`` with ``fatal: false``)."""
        seen = self.outage.observe(True, self._clock())
        if seen.verdict is OutageVerdict.RECOVERED:
            logger.warning("%s the rendezvous answers again after %.1f s", self._host.ctx(), seen.failing_for)
            self._host.emit(RecoveryEvent.ETCD_OUTAGE, seconds=round(seen.failing_for, 3), fatal=False)

    def failed(self, what: str, exc: BaseException) -> None:
        """CHANGE: torch lets a rendezvous error while monitoring kill the agent at once. Tolerated within the
        bound (warned at the start of an outage and every few seconds); past it, or for a permanent error, the
        workers are stopped and the job fails (:meth:`end_for_outage`), except in the exit barrier."""
        seen = self.outage.observe(False, self._clock())
        fatal = is_permanent(exc) or seen.verdict is OutageVerdict.FATAL
        if fatal and self._host.worker_group.state is not WorkerState.SUCCEEDED:  # exit barrier: done anyway
            self.end_for_outage(exc, seen.failing_for)
        if seen.verdict is OutageVerdict.WARN:
            warn_one_line(logger, exc, "%s cannot %s (%s); the job fails if this lasts %.0f s more", self._host.ctx(),
                          what, first_line(exc), seen.fatal_in)

    def end_for_outage(self, exc: BaseException, failing_for: float) -> NoReturn:
        """Stop the workers and raise a permanent error as is, else a ``RendezvousOutageError`` (the CLI prints
        it as one line, exit 1)."""
        host = self._host
        error = exc if is_permanent(exc) else RendezvousOutageError(
            f"rendezvous at {outage_endpoint(self.handler)} failing for {failing_for:.1f} s, "
            f"more than its bound of {self.outage.bound:g} s (last error: {first_line(exc)}); giving up")
        # A permanent error says what is wrong (the handler's own RendezvousOutageError carries the measured
        # duration; this clock started later).
        logger.error("%s %s; stopping the workers (committed checkpoints are kept)", host.ctx(),
                     first_line(error) if error is exc else f"rendezvous unavailable for {failing_for:.1f} s, "
                     "past its bound")
        host.stop_workers()
        host.worker_group.state = WorkerState.FAILED
        if not is_permanent(exc):
            host.emit(RecoveryEvent.ETCD_OUTAGE, seconds=round(failing_for, 3), fatal=True)
        host.emit(RecoveryEvent.RUN_FINISHED, state=WorkerState.FAILED.name, error=first_line(error))
        if error is exc:
            raise error
        raise error from exc

    def unreachable_for(self) -> float | None:
        """Seconds the rendezvous has been failing (None while it answers)."""
        since = self.outage.since
        return None if since is None else max(0.0, self._clock() - since)

    def lost_peers(self) -> set[str]:
        """Participants of this round that are gone (empty without notices, or when the handler errs)."""
        if self.notices is None:
            return set()
        try:
            return set(self.notices.lost_peers())
        except RendezvousError:
            return set()

    def announce_restart(self) -> None:
        """Tell the round this node's workers failed and restart (``RestartAnnouncingHandler``); a failure is
        only logged."""
        if not isinstance(self.handler, RestartAnnouncingHandler):
            return
        try:
            self.handler.publish_restart()
        except RendezvousError as exc:
            warn_one_line(logger, exc, "%s could not announce the workers' restart (%s); peers whose collectives "
                          "hang on the failed workers wait for their timeout", self._host.ctx(), first_line(exc))

    def restarted_peers(self) -> set[str]:
        """Peers of this round whose workers failed and restart (empty without the capability, or on an error)."""
        if not isinstance(self.handler, RestartAnnouncingHandler):
            return set()
        try:
            return set(self.handler.restarted_peers())
        except RendezvousError:
            return set()

    def peer_cause_of_failure(self, *, last_chance_wait: float | None) -> RecoveryCause | None:
        """What explains this node's workers' failure: ``PEER_LOST`` (seen, confirmed by a probe, or within
        ``last_chance_wait``), ``PEER_FAILURE`` (a peer announced its workers' restart), else None (their own)."""
        if self.changed():
            return RecoveryCause.PEER_LOST
        if self.confirm_dead_peers() and self.wait_for_peer_loss(PEER_REVOKE_SEEN_S):
            return RecoveryCause.PEER_LOST
        if self.restarted_peers():
            return RecoveryCause.PEER_FAILURE
        if last_chance_wait is not None and self.wait_for_peer_loss(last_chance_wait):
            return RecoveryCause.PEER_LOST
        return None

    def cause(self) -> RecoveryCause:
        """A membership change in a healthy group: a peer went away, else a node is joining."""
        return RecoveryCause.PEER_LOST if self.lost_peers() else RecoveryCause.SCALE_UP

    def confirm_dead_peers(self) -> bool:
        """Probe the round's peers (``liveness.py``): True when one's process is gone (its lease was revoked)."""
        if not isinstance(self.aware, PeerProbingHandler):
            return False
        try:
            dead = self.aware.probe_peers()
        except RendezvousError as exc:
            logger.debug("%s probing the peers failed: %s", self._host.ctx(), exc)
            return False
        if dead:
            logger.warning("%s peer agent(s) %s are gone (confirmed by a probe after the workers failed)",
                           self._host.ctx(), sorted(dead))
        return bool(dead)

    def lost_peers_refuse(self) -> bool:
        """The rendezvous's answer (``PeerProbingHandler.lost_peers_refuse``): True when a lost peer may have died
        on a live host, and whenever the handler cannot tell (another handler, an error). False for silent or
        paused peers and when a newer round formed without this node."""
        if not isinstance(self.aware, PeerProbingHandler):
            return True
        try:
            return bool(self.aware.lost_peers_refuse())
        except RendezvousError as exc:
            logger.debug("%s probing the lost peers failed: %s", self._host.ctx(), exc)
            return True

    def round_members(self) -> frozenset[str] | None:
        """Node ids of the last completed round, when the backend tells (None before the first round)."""
        if not isinstance(self.handler, RoundMembersHandler) or not self.handler.participants:
            return None
        return frozenset(self.handler.participants)

    def leave(self) -> None:
        """Revoke this node's lease (peers re-form now); a failure is logged: peers see the lease expire."""
        if self.aware is None:
            return
        try:
            self.aware.leave()
        except RendezvousError:
            logger.warning("%s leaving the rendezvous failed; peers notice when the lease expires", self._host.ctx())


def outage_bound(handler: RendezvousHandler) -> float:
    """Seconds a failing rendezvous is tolerated while monitoring: the handler's own bound (etcd-v3's
    ``etcd_timeout``), else the default ``etcd_timeout``."""
    if isinstance(handler, OutageBoundHandler):
        return handler.outage_bound
    return DEFAULT_ETCD_TIMEOUT_S


def outage_endpoint(handler: RendezvousHandler) -> str:
    """Where the rendezvous backend is, for the fatal error (torch's handlers do not say: their backend name)."""
    if isinstance(handler, OutageBoundHandler):
        return handler.endpoint
    return f"backend {handler.get_backend()!r}"


def membership_aware(handler: RendezvousHandler) -> MembershipAwareHandler | None:
    """The handler as a :class:`MembershipAwareHandler`, or None (said once) when it does not implement it."""
    if isinstance(handler, MembershipAwareHandler):
        return handler
    logger.info("rendezvous backend %r (%s) is not membership-aware (no MembershipAwareHandler): the agent polls "
                "num_nodes_waiting() every monitor interval like torch's, and a lost peer is noticed only when "
                "the workers fail", handler.get_backend(), type(handler).__name__)
    return None


def warn_one_line(log: logging.Logger, exc: BaseException, msg: str, *args: object) -> None:
    """A rendezvous error as one WARNING line (``msg`` names it, e.g. with :func:`first_line`); its traceback
    only as a separate DEBUG record, so a console at WARNING never shows it, whatever the logger's level."""
    log.warning(msg, *args)
    log.debug("traceback of the error above", exc_info=exc)


def first_line(exc: BaseException) -> str:
    """The first non-blank line of an error's message (its type's name if none)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
