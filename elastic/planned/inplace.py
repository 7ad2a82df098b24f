"""The agent's side of re-forming in place, and of the survivors' just-in-time snapshots after a peer loss.

Workers that run under ``elastic.inplace.run`` (each marked ``inplace-{local_rank}``) keep their process after a
peer's planned leave (or after a peer loss, once they aborted their group and snapshotted): they wait
(``waiting-{local_rank}``), and the agent runs the same rendezvous round as a restart, then tells each its new
rank, world size and store (``group-{local_rank}.json``) instead of replacing it; ``in_place_fallback`` says why
when they are restarted after all. Workers whose training function takes part in the restore of new workers
(``joinable-{local_rank}``) also stay for a joining node and for a peer node's restarted workers.
``SPOTRUN_REFORM_IN_PLACE=0`` turns it off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing import PContext
from torch.distributed.elastic.rendezvous import RendezvousError

from checkpoint.memory.records import snapshots_in
from elastic.agent_hooks import AgentHost
from elastic.api import InPlaceFallback, RecoveryCause, RecoveryEvent
from elastic.membership import MembershipView
from elastic.planned.channel import acknowledged_stop, committed_at, every_local_worker
from elastic.planned.policy import PlannedChanges, Stopped
from elastic.torch_internals import worker_processes
from elastic.worker.mailbox import GroupAssignment, Mailbox
from elastic.worker.reform import IN_PLACE_REASONS, JOIN_REASONS, in_place_enabled

logger = logging.getLogger(__name__)

JIT_POLL_INTERVAL = 0.02
"""Seconds between two looks at the workers while they may snapshot after a peer loss."""


@dataclass(frozen=True, slots=True)
class FallbackReport:
    why: str
    detail: str
    ranks: list[int]
    reported: bool
    """A worker reported it (its restart is not its own failure: not charged)."""


def decide_fallback(reported: Mapping[int, tuple[str, str]], default: InPlaceFallback | None, *, capable: bool,
                    local_world_size: int) -> FallbackReport | None:
    """The fallback to report: the workers' own reasons first, else ``default`` for capable workers; None: none."""
    if reported:
        (why, detail), *_ = sorted(set(reported.values()))
        return FallbackReport(why, detail, sorted(reported), reported=True)
    if default is None or not capable:
        return None
    return FallbackReport(default.value, "", list(range(local_world_size)), reported=False)


class InPlaceReformer:
    """Re-forms the group around waiting workers; lets the workers snapshot after a peer loss (up to
    ``stop_grace`` s, when ``memory_dir`` shows they snapshot)."""

    def __init__(self, host: AgentHost, membership: MembershipView, changes: PlannedChanges, mailbox: Mailbox | None,
                 *, memory_dir: str | None, stop_grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = in_place_enabled()
        """``SPOTRUN_REFORM_IN_PLACE`` is not 0 (then only workers that all can re-form in place, see ``capable``)."""
        self._host = host
        self._membership = membership
        self._changes = changes
        self._mailbox = mailbox
        self._memory_dir = memory_dir
        self._stop_grace = stop_grace
        self._clock = clock
        self._told_round: int | None = None  # the round whose peers' restart the workers were told of

    def capable(self) -> bool:
        """Every local worker runs under ``elastic.inplace.run`` and in place is not turned off."""
        return self.enabled and every_local_worker(self._mailbox, Mailbox.in_place_capable, self._local_world_size())

    def joinable(self) -> bool:
        """Every local worker can re-form in place and takes part in the restore of workers that join."""
        return self.capable() and every_local_worker(self._mailbox, Mailbox.joinable, self._local_world_size())

    def report_fallback(self, default: InPlaceFallback | None, *, worker_failed: bool = False) -> bool:
        """Emit ``in_place_fallback`` if there is one (``worker_failed``: a local worker failed while others waited
        in place); True when a worker reported it (its restart is not charged)."""
        if self._mailbox is None:
            return False
        try:
            if worker_failed and default is None and self._mailbox.waiting():
                default = InPlaceFallback.WORKER_FAILED
            reported = self._mailbox.fallbacks()
        except OSError:
            reported = {}
        report = decide_fallback(reported, default, capable=self.capable(), local_world_size=self._local_world_size())
        if report is None:
            return False
        self._host.emit(RecoveryEvent.IN_PLACE_FALLBACK, why=report.why, detail=report.detail, ranks=report.ranks)
        return report.reported

    def falls_back(self, previous: frozenset[str] | None, current: frozenset[str] | None) -> bool:
        """After the re-form's rendezvous: restart the workers instead (reported) when the round admitted a node
        that was not in the last one and the local workers cannot take part in its fresh workers' restore (not
        joinable), or a worker gave up waiting meanwhile."""
        admitted = previous is None or current is None or not current <= previous
        refused = admitted and not self.joinable()
        return self.report_fallback(InPlaceFallback.NEW_NODE if refused else None) or refused

    def posted(self) -> bool:
        """The stop posted to the workers is one that re-forms in place (a peer's planned leave; a joining node
        for joinable workers)."""
        posted = self._changes.posted
        if self._mailbox is None or self._changes.leaving or posted is None:
            return False
        if posted.reason in JOIN_REASONS:
            return self.joinable()
        return posted.reason in IN_PLACE_REASONS and self.capable()

    def waiting(self) -> Stopped | None:
        """Where every local worker stopped for a peer's planned leave and now waits in its process for the
        re-formed group; None otherwise."""
        if not self.posted() or (stopped := acknowledged_stop(self._mailbox, self._local_world_size())) is None:
            return None
        return stopped if every_local_worker(self._mailbox, Mailbox.waiting, self._local_world_size()) else None

    def all_waiting(self) -> bool:
        """Every local worker waits in its process for a re-formed group (``waiting-{local_rank}``)."""
        return self.capable() and every_local_worker(self._mailbox, Mailbox.waiting, self._local_world_size())

    def reform(self, stopped: Stopped) -> None:
        """The survivors' side of a peer's planned leave without a restart; the events keep their order
        (``planned_restart`` ... ``workers_started``, with ``in_place: true``)."""
        host = self._host
        posted = self._changes.posted
        reason = posted.reason if posted is not None else "unknown"
        logger.info("%s workers stopped at step %d for a planned change (%s); re-forming around them in place",
                    host.ctx(), stopped.step, reason)
        host.begin_recovery(RecoveryCause.SCALE_UP if reason in JOIN_REASONS else RecoveryCause.PLANNED_LEAVE)
        host.emit(RecoveryEvent.PLANNED_RESTART, step=stopped.committed, reason=reason,
                  committed_at=committed_at(self._mailbox) if stopped.saved else None, saved=stopped.saved,
                  why=stopped.why, agreed_step=stopped.step, in_place=True)
        self.reform_waiting_workers()

    def broken_for_join(self) -> bool:
        """A node waits to join (the stop posted is a ``resize``) while every local worker, joinable, waits in
        place without having stopped at the agreed step: their collective broke first. The joining node is most
        often a peer whose worker failed and whose agent restarted its workers (not a loss: its lease stays)."""
        posted = self._changes.posted
        return (posted is not None and posted.reason in JOIN_REASONS and self.joinable() and self.all_waiting()
                and acknowledged_stop(self._mailbox, self._local_world_size()) is None)

    def reform_after_break(self) -> None:
        """Re-form around workers whose collective broke when a peer's workers failed (see
        :meth:`broken_for_join`): the peer's new workers restore, the survivors take part."""
        logger.info("%s workers wait in place after a broken collective while a node waits to join (a peer's "
                    "workers restarted); re-forming around them", self._host.ctx())
        self._host.begin_recovery(RecoveryCause.PEER_FAILURE)
        self.reform_waiting_workers()

    def reform_waiting_workers(self) -> None:
        """The rendezvous round of a restart, then each waiting worker is told its place in the new group."""
        self._host.reform_in_place(self._assign)

    def _assign(self, group: WorkerGroup, restart_count: int) -> None:
        mailbox = self._mailbox
        assert mailbox is not None, "only with a mailbox"
        mailbox.clear()  # the acks, waiting marks and helpers of the old group
        self._changes.new_group()
        assert group.group_rank is not None and group.group_world_size is not None and group.master_addr is not None \
            and group.master_port is not None, "set by the rendezvous"
        for worker in group.workers:
            mailbox.assign(worker.local_rank, GroupAssignment(
                rank=worker.global_rank, world_size=worker.world_size, group_rank=group.group_rank,
                group_world_size=group.group_world_size, master_addr=group.master_addr,
                master_port=group.master_port, restart_count=restart_count))

    def after_peer_loss(self) -> bool:
        """A peer is gone: let the workers snapshot, then re-form around them when they all wait in place.
        True when the group re-formed in place (no restart)."""
        self.let_workers_snapshot()
        if not self.all_waiting():
            self.report_fallback(InPlaceFallback.NOT_WAITING)
            return False
        # CHANGE: the workers aborted their group, snapshotted their last completed step and wait in their
        # processes: re-form around them, no restart.
        logger.info("%s workers wait in place after the peer loss; re-forming around them", self._host.ctx())
        self.reform_waiting_workers()
        return True

    def let_workers_snapshot(self) -> None:
        """CHANGE (memory tier, just-in-time snapshots): a peer is gone, so the workers' next collective breaks
        and workers using the memory tier snapshot their last completed step before they exit
        (``checkpoint.memory.jit``). Give them up to ``--stop-grace`` to exit on their own first, but only when
        their keeper directory shows they snapshot and a lost peer may have died on a live host: a silent loss
        (power off, a partition, a paused node) resets no connection, their collectives stay blocked, so they
        are stopped at once; so are the workers of a node left out of a newer round."""
        pcontext = self._host.pcontext
        no_snapshots = self._memory_dir is None or not snapshots_in(self._memory_dir)
        if pcontext is None or (no_snapshots and not self.capable()):  # in-place workers are told all the same
            return
        # Workers that watch abort their groups: their collectives raise now, whatever the loss (snapshot, exit).
        if not self.abort_watched_groups() and not self._membership.lost_peers_refuse():
            logger.info("%s no just-in-time snapshot to wait for (the lost peers are silent or paused: no connection "
                        "reset breaks the workers' collectives; or the group re-formed without this node)",
                        self._host.ctx())
            return
        running = running_workers(pcontext)
        if running is None:
            return
        deadline = self._clock() + self._stop_grace
        while running() and not self.all_waiting() and self._clock() < deadline:
            time.sleep(JIT_POLL_INTERVAL)
        logger.info("%s workers %s after the peer loss (up to %.1fs for just-in-time snapshots)", self._host.ctx(),
                    "still running" if running() else "exited", self._stop_grace)

    def abort_watched_groups(self) -> bool:
        """CHANGE (abortable groups): tell the workers a peer is gone (``peer-lost.json``); True when every local
        worker runs a peer-loss watcher (``elastic.worker.watcher``), which aborts its process group, so a
        collective blocked on a silent or paused peer raises too and the just-in-time snapshot runs."""
        if self._mailbox is None:
            return False
        lost = self._membership.lost_peers()
        watching = every_local_worker(self._mailbox, Mailbox.watchers, self._local_world_size())
        try:
            if watching or self.capable():  # in-place workers wait for this word to re-form
                self._mailbox.post_peer_lost(sorted(lost))
        except OSError as exc:
            logger.warning("%s could not tell the workers of the peer loss: %s", self._host.ctx(), exc)
            return False
        if watching:
            logger.info("%s peer(s) %s lost: the workers abort their process group", self._host.ctx(), sorted(lost))
        return watching

    def peers_restarting(self) -> set[str]:
        """Peers that announced their workers' restart in this round, if this node's workers act on the word
        and were not told yet."""
        number = self._membership.round
        if self._mailbox is None or (number is not None and self._told_round == number):
            return set()
        restarted = self._membership.restarted_peers()
        if not restarted or self.unplanned_losses() or not (
                self.capable() or every_local_worker(self._mailbox, Mailbox.watchers, self._local_world_size())):
            return set()
        try:
            return set() if self._mailbox.peer_lost_posted() else restarted
        except OSError:
            return set()

    def unplanned_losses(self) -> set[str]:
        """Lost peers that published no notice (their loss is told by :meth:`after_peer_loss`)."""
        lost = self._membership.lost_peers()
        notices = self._membership.notices
        if not lost or notices is None:
            return lost
        try:
            return lost - set(notices.peer_notices())
        except RendezvousError:
            return lost

    def abort_for_restarted_peers(self) -> bool:
        """CHANGE (abortable groups): a peer's workers restart (its lease kept); our workers' collective with the
        dead ones may hang (NCCL): tell them (``peer-lost.json``, ``restarted``) so the watchers abort their groups;
        an unplanned loss is told instead. Once per round, also when the post fails. True when told now."""
        restarted = self.peers_restarting()
        if not restarted:
            return False
        assert self._mailbox is not None, "peers_restarting is empty without a mailbox"
        self._told_round = self._membership.round
        try:
            self._mailbox.post_peer_lost(sorted(restarted), restarted=True)
        except OSError as exc:
            logger.warning("%s could not tell the workers of the peers' restart: %s", self._host.ctx(), exc)
            return False
        logger.info("%s the workers of peer(s) %s failed and restart: the workers abort their process group",
                    self._host.ctx(), sorted(restarted))
        return True

    def _local_world_size(self) -> int:
        return self._host.worker_group.spec.local_world_size


def running_workers(pcontext: PContext) -> Callable[[], bool] | None:
    """A check "does any local worker still run?" for either kind of process context (None if unknown)."""
    processes = worker_processes(pcontext)
    if processes:
        return lambda: any(p.exitcode is None for p in processes)
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if isinstance(handlers, dict) and handlers:
        procs = [getattr(h, "proc", None) for h in handlers.values()]
        if all(hasattr(p, "poll") for p in procs):
            return lambda: any(p.poll() is None for p in procs)  # type: ignore[union-attr]
    return None
