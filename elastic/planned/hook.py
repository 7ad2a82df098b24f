"""The agent's hook for planned changes: notices in, the stop posted to the workers, leaving and re-forming.

A notice arrives by a call: a notice signal (:meth:`PlannedFeature.on_signal`), a metadata notice from the
poller thread or one the launcher took at start-up (:meth:`PlannedFeature.receive`). The pure policy
(:class:`~elastic.planned.policy.PlannedChanges`) decides at once what the signal means (leave now, shut down,
a notice); what needs the mailbox or the rendezvous (publishing the notice, posting the stop) runs in the
agent's monitor loop (:meth:`PlannedFeature.on_tick`), on the main thread that owns both: a signal handler
must not re-enter the rendezvous client it interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError

from elastic.agent_hooks import (
    NEXT_TICK,
    PROCEED,
    AgentFeature,
    AgentHost,
    EndRun,
    Tick,
    Verdict,
    WorkersStarted,
    WorkersStarting,
    WorkersStopped,
)
from elastic.api import RecoveryCause, RecoveryEvent
from elastic.config import AgentSettings
from elastic.membership import MembershipView, first_line, warn_one_line
from elastic.notice import SIGTERM_SOURCE, Notice, parse_signal_spec
from elastic.planned.channel import acknowledged_stop, committed_at, every_local_worker
from elastic.planned.inplace import InPlaceReformer
from elastic.planned.policy import (
    WHY_BEFORE_HELPERS,
    AbandonStop,
    AfterSuccess,
    HelperOutlook,
    LeaveNow,
    PlannedChanges,
    PlannedDecision,
    PlannedTick,
    PostStop,
    Reform,
    SignalAction,
    Stopped,
    TickView,
    leave_exit_code,
)
from elastic.worker.mailbox import Mailbox

logger = logging.getLogger(__name__)

WHY_BETWEEN_ROUNDS = "the notice came between rounds (no workers running): nothing to save"
ACK_POLL_INTERVAL = 0.01
"""Seconds between two looks at the mailbox's acknowledgements while this node's workers save for its notice."""


class LeaveForNotice(BaseException):
    """A notice with nothing to save: the agent leaves at once, as a planned leave (``why`` in ``planned_leave``).

    Raised by the notice signal handler inside whatever the main thread is blocked in (the rendezvous' wait for
    a round has no other way out); a ``BaseException``, like ``KeyboardInterrupt``, so that no ``except
    Exception`` on the way swallows it. The agent's run catches it (:meth:`PlannedFeature.leave_between_rounds`).
    """

    def __init__(self, why: str = WHY_BETWEEN_ROUNDS) -> None:
        super().__init__(why)
        self.why = why


class PlannedFeature(AgentFeature):
    """Planned changes of one agent: its notice, the stop posted to its workers, its leave. ``mailbox`` None:
    workers cannot be asked to stop at an agreed step; ``memory_dir``: just-in-time snapshots after a peer loss."""

    def __init__(self, host: AgentHost, membership: MembershipView, settings: AgentSettings, mailbox: Mailbox | None,
                 *, memory_dir: str | None = None, script_imports_helper: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.changes = PlannedChanges(stop_grace=settings.stop_grace, resize_timeout=settings.resize_timeout)
        """The pure decisions and their state (this node's notice, the stop posted)."""
        self.mailbox = mailbox
        self.in_place = InPlaceReformer(host, membership, self.changes, mailbox, memory_dir=memory_dir,
                                        stop_grace=settings.stop_grace, clock=clock)
        self.exit_status = 0
        """What the process exits with after a run that did not fail (``--planned-leave-exit-code`` on a leave)."""
        self.in_exit_barrier = False
        """The local workers finished the run (the agent waits for its peers): a notice has nothing to stop."""
        self.run_over = False
        """The agent's run returned: a notice signal now is only logged."""
        self._host = host
        self._membership = membership
        self._settings = settings
        self._script_imports_helper = script_imports_helper
        self._signals = notice_signal_graces(settings)
        self._running = False
        self._in_rendezvous = False

    @property
    def own(self) -> Notice | None:
        """This node's notice (the earliest deadline), once received."""
        return self.changes.own

    # --- notices in ---------------------------------------------------------------------------------------

    def receive(self, notice: Notice) -> None:
        """This node will be taken away at ``notice.deadline`` (any thread or a signal handler: one assignment)."""
        self.changes.receive(notice)

    def receive_early(self, signum: int, received_at: float) -> None:
        """A notice signal the launcher recorded before the handlers were installed: this node has not joined a
        round, it leaves at its first rendezvous."""
        source, grace = self._signals.get(signum, (f"signal:{signal.Signals(signum).name}",
                                                    self._settings.preempt_grace))
        logger.warning("%s %s during the agent's start-up: leaving as a planned leave", self._host.ctx(),
                       signal.Signals(signum).name)
        self.receive(Notice(source, received_at + grace, f"signal {signal.Signals(signum).name} at start-up"))

    def install_signal_handlers(self) -> None:
        """Make the notice signals (SIGTERM, ``--preempt-signal``) notices to this agent. Main thread only; again
        after each worker start (torch's ``PContext.start`` replaces the handlers)."""
        for signum in self._signals:
            signal.signal(signum, self.on_signal)

    def on_signal(self, signum: int, frame: object = None) -> None:
        """A notice signal: decided at once by the policy (``PlannedChanges.on_signal``) and acted on here.

        Raises:
            LeaveForNotice: nothing to save: the agent leaves now.
            SignalException: torch's immediate shutdown (a second SIGTERM, workers without the helper).
        """
        source, grace = self._signals[signum]
        name = signal.Signals(signum).name
        if self.in_exit_barrier and not self.run_over and self.changes.own is None:
            # The workers finished, nothing to save or stop; the exit barrier ends by the deadline.
            self.receive(Notice(source, time.time() + grace, f"signal {name}"))
            return
        between_rounds = self._in_rendezvous or not self._running
        action = self.changes.on_signal(between_rounds=between_rounds, sigterm=signum == signal.SIGTERM,
                                        helpers_ready=self.helpers_ready(), announced=self.helpers_announced(),
                                        run_over=self.run_over)
        if action is SignalAction.IGNORE:
            logger.info("%s %s after the run ended: nothing to do", self._host.ctx(), name)
            return
        if action is SignalAction.SHUT_DOWN:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        self.receive(Notice(source, time.time() + grace, f"signal {name}"))
        if action is SignalAction.LEAVE_NOW:
            # A scheduler counts torch's shutdown as a failure: leave as a planned leave instead.
            raise LeaveForNotice(WHY_BETWEEN_ROUNDS if between_rounds else WHY_BEFORE_HELPERS)

    @contextlib.contextmanager
    def between_rounds(self) -> Iterator[None]:
        """Around a rendezvous: a node with a notice does not join a round only to leave it, and a notice that
        arrives while it waits is acted on at once.

        Raises:
            LeaveForNotice: this node already has a notice.
        """
        self._in_rendezvous = True
        try:
            if self.changes.own is not None:
                raise LeaveForNotice
            yield
        finally:
            self._in_rendezvous = False

    # --- hooks ----------------------------------------------------------------------------------------------

    def on_workers_starting(self, event: WorkersStarting) -> None:
        if self.mailbox is not None:
            self.mailbox.clear()  # helpers and acks of the previous group must not count for this one
            # For workers whose environment a wrapper rebuilt without SPOTRUN_NOTICE_DIR (elastic.preemption).
            self.mailbox.publish_link(self._host.worker_group.spec.rdzv_handler.get_run_id(), event.group_rank)
        self.changes.new_group()

    def on_workers_started(self, event: WorkersStarted) -> None:
        self._running = True

    def on_workers_stopped(self, event: WorkersStopped) -> None:
        self._running = False

    def workers_closing(self) -> None:
        """CHANGE: a worker's helper takes a notice signal that reaches it directly (Slurm signals every process
        of the step) as the notice; the agent's own SIGTERM to stop the group must still end it at once."""
        if self.mailbox is None:
            return
        try:
            self.mailbox.mark_stopping()
        except OSError as exc:
            logger.warning("%s cannot mark the workers' mailbox as stopping (%s): workers using the preemption "
                           "helper take the stop signal for a notice and are killed after the stop grace",
                           self._host.ctx(), exc)

    def on_tick(self, tick: Tick) -> Verdict:
        self.publish_own_notice()
        result = tick.result
        if result.state == WorkerState.HEALTHY:
            return self._while_healthy()
        if result.state == WorkerState.SUCCEEDED:
            return self._after_success()
        if result.state in {WorkerState.UNHEALTHY, WorkerState.FAILED} and (
                self.changes.leaving or self.failed_before_helpers()):
            # CHANGE (overlapping faults): the workers failed while heading for this node's agreed step, most
            # often because a peer crashed at the same moment. The node still goes away for its notice, as a
            # preemption (a failure would count against a Kubernetes Job's backoff limit and keep Slurm from
            # requeueing), with saved: false and why; the survivors restore without it. Workers that had not
            # built their helpers yet died of the notice signal themselves (Slurm signals the whole step): they
            # had trained nothing since their restore, the same planned leave.
            why = (self.why_failed_during_stop(result) if self.changes.leaving
                   else f"{WHY_BEFORE_HELPERS} (the workers ended on the notice signal: exit codes by "
                        f"rank { {rank: f.exitcode for rank, f in result.failures.items()} })")
            self._host.stop_workers()
            self.leave(step=None, why=why)
            return EndRun(self.left_result(workers_finished=False))
        return PROCEED

    def _while_healthy(self) -> Verdict:
        self.in_place.abort_for_restarted_peers()  # the workers' collective with a peer's dead ones may hang
        if (leaving := self.leaving_stop()) is not None:
            # CHANGE: this node's workers stopped at the agreed step and are on their way out: leave now.
            return EndRun(self.leave_after_acknowledgement(leaving))
        if (waiting := self.in_place.waiting()) is not None:
            # CHANGE: the workers acknowledged a peer's planned leave and wait in their processes: re-form
            # around them instead of restarting them.
            self.in_place.reform(waiting)
            return NEXT_TICK
        if self.in_place.broken_for_join():
            # CHANGE: a peer's workers failed and restarted (its agent waits in the rendezvous); ours broke their
            # collective and wait in their processes: re-form around them, the peer's new workers restore.
            self.in_place.reform_after_break()
            return NEXT_TICK
        planned = self.tick()
        if planned is PlannedTick.WAITING:
            return NEXT_TICK
        if planned is PlannedTick.LEFT:
            return EndRun(self.left_result(workers_finished=False))
        return PROCEED

    def _after_success(self) -> Verdict:
        # CHANGE: workers that acknowledged a step stopped for a planned change: the job is not over.
        stopped = self.acknowledged_stop()
        after = self.changes.after_success(stopped)
        if after is AfterSuccess.LEAVE:
            return EndRun(self.leave_for_notice(stopped))
        if after is AfterSuccess.REFORM:
            assert stopped is not None
            self.in_place.report_fallback(None)  # in-place workers that timed out waiting
            self.restart_for_planned_change(stopped)
            return NEXT_TICK
        return PROCEED

    # --- the monitor loop's wait ------------------------------------------------------------------------------

    @property
    def waiting_for_stop(self) -> bool:
        """A stop is posted: the monitor loop waits with :meth:`wait_for_stop`."""
        return self.changes.posted is not None

    def wait_for_stop(self, timeout: float, *, poll_acks: bool = True) -> None:
        """Up to ``timeout`` s, returning as soon as a local worker returns or exits, or every local worker
        acknowledged the agreed step (this node leaving, or waiting in place): a planned change resumes from
        the committed step without waiting for the next monitor tick."""
        leaving = poll_acks and self.changes.own is not None and self.mailbox is not None
        in_place = poll_acks and self.in_place.posted()

        def done() -> bool:
            # A leaving node polls its mailbox for the acknowledgements: the peers' rendezvous waits for this
            # node's lease, not for its workers' exit. Workers that re-form in place never exit.
            return (leaving and self.acknowledged_stop() is not None) or bool(self.in_place.peers_restarting()) or (
                in_place and (self.in_place.waiting() is not None or self.in_place.broken_for_join()))

        self._host.wait_for_workers(timeout, done, ACK_POLL_INTERVAL if leaving or in_place else timeout)

    # --- what the workers say (the mailbox) ------------------------------------------------------------------

    def helpers_ready(self) -> bool:
        """Every local worker constructed a ``Preemption`` helper (it will stop by itself at an agreed step)."""
        return every_local_worker(self.mailbox, Mailbox.helpers, self._local_world_size())

    def helpers_announced(self) -> bool:
        """The script will build a helper: its source imports the helper's module, or a local worker of this
        group imported it (``coming-{local_rank}``)."""
        if self.mailbox is None:
            return False
        if self._script_imports_helper:
            return True
        try:
            return bool(self.mailbox.helpers_coming())
        except OSError:
            return False

    def failed_before_helpers(self) -> bool:
        """This node has a notice and its workers, which announced helpers but had not built them, failed: they
        took the notice signal themselves, before they trained anything since their restore."""
        if self.changes.own is None:
            return False
        outlook = self.changes.outlook(helpers_ready=self.helpers_ready(), announced=self.helpers_announced())
        return outlook is HelperOutlook.COMING

    def acknowledged_stop(self) -> Stopped | None:
        """Where every local worker stopped for the planned change, saved or not (None: they did not all)."""
        return acknowledged_stop(self.mailbox, self._local_world_size())

    def leaving_stop(self) -> Stopped | None:
        """Where this node's workers all stopped for its own notice, else None."""
        return self.acknowledged_stop() if self.changes.leaving else None

    def committed_at(self) -> float | None:
        """When the local workers had committed the agreed step (the start of a planned change's resume time)."""
        return committed_at(self.mailbox)

    def _local_world_size(self) -> int:
        return self._host.worker_group.spec.local_world_size

    # --- one tick of a healthy group ---------------------------------------------------------------------------

    def publish_own_notice(self) -> None:
        """Publish this node's notice to its peers and record it (once per notice)."""
        notice = self.changes.to_publish()
        if notice is None:
            return
        published = False
        if self._membership.notices is not None:
            try:
                self._membership.notices.publish_notice(notice.to_json())
                published = True
            except RendezvousError as exc:
                warn_one_line(logger, exc, "%s could not publish the preemption notice (%s); peers learn of it when "
                              "this node leaves", self._host.ctx(), first_line(exc))
        logger.warning("%s preemption notice (%s): deadline in %.1f s", self._host.ctx(), notice.source,
                       notice.deadline - time.time())
        self._host.emit(RecoveryEvent.NOTICE_RECEIVED, source=notice.source, deadline=notice.deadline,
                        detail=notice.detail, published=published)

    def tick_view(self) -> TickView:
        """What the policy looks at: the mailbox, the peers' notices, the membership."""
        helpers_ready = self.helpers_ready()
        peers: dict[str, float] = {}
        lost: frozenset[str] = frozenset()
        now = time.time()
        notices = self._membership.notices
        if notices is not None:
            try:
                peers = {node: float(notice.get("deadline") or now) for node, notice in notices.peer_notices().items()}
                lost = frozenset(notices.lost_peers())
            except RendezvousError:
                pass
        return TickView(now=now, peer_notices=peers, lost=lost, membership_changed=self._membership.changed(),
                        helpers_ready=helpers_ready, helpers_announced=self.helpers_announced())

    def tick(self) -> PlannedTick:
        """While healthy: ask the policy what to do (``PlannedChanges.tick``) and do it."""
        if self.mailbox is None:
            return PlannedTick.NONE
        decision = self.changes.tick(self.tick_view())
        self.perform(decision)
        return decision.outcome

    def perform(self, decision: PlannedDecision) -> None:
        """The I/O of a planned-change decision, in order: post, abandon, leave, re-form."""
        host = self._host
        for action in decision.actions:
            if isinstance(action, PostStop):
                assert self.mailbox is not None, "a stop is posted only with a mailbox"
                notice = action.notice
                self.mailbox.post(notice)
                logger.warning("%s planned stop posted to the workers: %s (deadline in %s s)", host.ctx(),
                               notice.reason, "-" if notice.deadline is None else f"{notice.deadline - time.time():.1f}")
                host.emit(RecoveryEvent.PLANNED_STOP_POSTED, reason=notice.reason, deadline=notice.deadline,
                          source=notice.source)
            elif isinstance(action, AbandonStop):
                logger.warning("%s planned stop (%s) abandoned: %s", host.ctx(), action.reason, action.why)
                host.emit(RecoveryEvent.PLANNED_STOP_ABANDONED, reason=action.reason, why=action.why)
            elif isinstance(action, LeaveNow):
                host.stop_workers()
                self.leave(step=None, why=action.why)
            elif isinstance(action, Reform):
                host.restart_workers()  # not charged: a membership change
            else:
                raise AssertionError(f"unknown planned action {action!r}")

    # --- leaving and re-forming ----------------------------------------------------------------------------------

    def leave(self, *, step: int | None, why: str | None, agreed_step: int | None = None) -> None:
        """Revoke the lease and record the leave; ``step`` is the committed step (None: nothing saved, then
        ``agreed_step`` is where workers that skipped the save stopped)."""
        notice = self.changes.own
        self._membership.leave()
        late = notice is not None and time.time() > notice.deadline
        logger.warning("%s left the group for the preemption notice (%s%s)", self._host.ctx(),
                       f"step {step} committed" if step is not None else f"nothing saved: {why}",
                       ", after the deadline" if late else "")
        self._host.begin_recovery(RecoveryCause.PLANNED_LEAVE)
        self._host.emit(RecoveryEvent.PLANNED_LEAVE, step=step, saved=step is not None, why=why, late=late,
                        agreed_step=agreed_step if agreed_step is not None else step,
                        committed_at=self.committed_at() if step is not None else None,
                        source=notice.source if notice else None, deadline=notice.deadline if notice else None)

    def leave_between_rounds(self, why: str) -> RunResult:
        """A notice with nothing to save (:class:`LeaveForNotice`): stop what runs, leave, planned-leave code."""
        self._host.stop_workers()
        self.leave(step=None, why=why)
        return self.left_result(workers_finished=False)

    def why_failed_during_stop(self, run_result: RunResult) -> str:
        """The ``why`` of a leave whose workers failed before the agreed step: their exit codes, and the peers
        already known lost (a crash that broke the collective)."""
        failures = {rank: f.exitcode for rank, f in run_result.failures.items()}
        lost = self._membership.lost_peers()
        peers = f"; peer(s) {sorted(lost)} lost meanwhile" if lost else ""
        return f"the workers failed during the planned stop (exit codes by rank {failures}){peers}"

    def leave_for_notice(self, stopped: Stopped | None) -> RunResult:
        """The workers stopped at the agreed step (committed, or skipped: it could not commit before the
        deadline) and exited 0: revoke the lease (peers re-form now) and exit with the planned-leave code."""
        self._host.stop_workers()
        if stopped is None:
            self.leave(step=None, why="the workers exited without acknowledging a step")
        else:
            self.leave(step=stopped.committed, why=stopped.why, agreed_step=stopped.step)
        # Workers that use the helper and exit 0 without stopping at an agreed step finished the run.
        return self.left_result(workers_finished=stopped is None)

    def leave_after_acknowledgement(self, stopped: Stopped) -> RunResult:
        """Every local worker stopped at the agreed step for this node's notice and is exiting: revoke the lease
        first, so the peers re-form while the workers tear down, then wait for them, bounded by the notice's
        deadline. Workers that fail after their acknowledgement still fail the agent."""
        host = self._host
        self.leave(step=stopped.committed, why=stopped.why, agreed_step=stopped.step)
        notice = self.changes.own
        until = notice.deadline - self._settings.stop_grace if notice is not None else time.time()
        result = host.monitor()
        while result.state == WorkerState.HEALTHY and (remaining := until - time.time()) > 0:
            self.wait_for_stop(min(remaining, host.worker_group.spec.monitor_interval), poll_acks=False)
            result = host.monitor()
        host.stop_workers()  # past the deadline: those still running go now
        if result.state == WorkerState.FAILED:
            logger.warning("%s workers failed after stopping at step %d for the planned leave", host.ctx(),
                           stopped.step)
            host.emit(RecoveryEvent.RUN_FINISHED, state=WorkerState.FAILED.name)
            return result
        return self.left_result(workers_finished=False)

    def left_result(self, *, workers_finished: bool) -> RunResult:
        """Success for every local worker (torch records one event per worker from the return values); the
        process exits with ``--planned-leave-exit-code`` unless the workers had finished the run."""
        self.exit_status = leave_exit_code(workers_finished=workers_finished,
                                           configured=self._settings.planned_leave_exit_code)
        self._host.emit(RecoveryEvent.RUN_FINISHED, state=WorkerState.SUCCEEDED.name, exit_code=self.exit_status)
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in self._host.worker_group.workers})

    def restart_for_planned_change(self, stopped: Stopped) -> None:
        """Our workers stopped at the agreed step for a peer's notice or a joining node: re-form now and resume
        from it, or, when they skipped its save, from the last committed step; not counted."""
        host = self._host
        posted = self.changes.posted
        reason = posted.reason if posted is not None else "unknown"
        if stopped.saved:
            logger.info("%s workers committed step %d for a planned change (%s); re-forming the group",
                        host.ctx(), stopped.step, reason)
        else:
            logger.warning("%s workers stopped at step %d for a planned change (%s) without saving it (%s); "
                           "re-forming the group from the last committed step", host.ctx(), stopped.step, reason,
                           stopped.why)
        host.begin_recovery(RecoveryCause.SCALE_UP if reason == "resize" else RecoveryCause.PLANNED_LEAVE)
        host.emit(RecoveryEvent.PLANNED_RESTART, step=stopped.committed, reason=reason,
                  committed_at=self.committed_at() if stopped.saved else None, saved=stopped.saved,
                  why=stopped.why, agreed_step=stopped.step)
        host.restart_workers()


def notice_signal_graces(settings: AgentSettings) -> dict[int, tuple[str, float]]:
    """The notice signals -> (notice source, seconds to the deadline): SIGTERM and ``--preempt-signal``."""
    graces = {int(signal.SIGTERM): (SIGTERM_SOURCE, settings.preempt_grace)}
    if settings.preempt_signal:
        sig, grace = parse_signal_spec(settings.preempt_signal, settings.preempt_grace)
        graces[int(sig)] = (f"signal:{sig.name}", grace)
    return graces
