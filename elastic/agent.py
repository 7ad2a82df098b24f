"""``SpotrunAgent``: torch's ``LocalElasticAgent`` with fast, membership-aware recovery.

Everything torch does for workers is kept (environment, ranks, error files, log redirection, exit barrier).
Each place that changes torch's behaviour (2.13 to 2.15) is marked ``CHANGE:`` with the reason; the torch internals it
relies on are checked by ``elastic.torch_internals`` (at run time) and fingerprinted by
tests/elastic/test_torch_internals.py (when torch changes):

* with a :class:`~elastic.rendezvous.api.MembershipAwareHandler` (etcd-v3; checked once at start, other
  handlers get torch's ``num_nodes_waiting()`` polling, said once in the log) the monitor loop reacts to
  membership changes at once and sleeps on ``wait_membership_change`` instead of a blind ``time.sleep``;
* worker failures that coincide with a lost peer do not use up ``--max-restarts``;
* workers are stopped with a short SIGTERM->SIGKILL grace (torch waits 30 s), also when torch's process
  context closes the survivors of a crashed worker;
* workers die with the agent even on SIGKILL (parent-death signal via an exec shim, or in the entrypoint of
  warm workers forked from a torch-preloaded forkserver; see ``elastic.workers``);
* the failure summary lists every rank that failed on its own, root cause (first to die) first;
* transient rendezvous errors while monitoring (etcd restarting) do not kill a healthy job, but a rendezvous
  failing past its bound (``etcd_timeout``, ``elastic.outage``) stops the workers and fails the job;
* every recovery stage is written to a structured event log (``elastic.events``), each event of a recovery
  with its ``recovery_cause`` (failure, hang, peer_lost, planned_leave, scale_up);
* hung workers are detected (``elastic.hang``: progress files, ``/proc``, stack look at stalled ranks), their
  stacks logged, the hung rank killed and named in the failure summary, and the group restarted;
* a failed worker is one log line, not torch's ``logger.exception`` traceback;
* planned changes (``elastic.planned``): SIGTERM / ``--preempt-signal`` / metadata notices become a deadline
  published to the group; workers with a ``Preemption`` helper commit an agreed step, then the preempted
  agent revokes its lease and exits 0 (or ``--planned-leave-exit-code``) and the others re-form uncharged (a joining node: the same stop first);
* shutdown without traps: a worker that already returned is not waited for, and an agent whose workers
  finished does not sit in the exit barrier for a peer that left (it re-forms instead of reporting success).

Stale state (pytorch#135712): with the etcd-v3 backend the workers' TCPStore is a new server per round
(hosted by the round's rank-0 agent, ``rendezvous.worker_store``), so workers of a new round never see the
previous round's keys even when a membership-change round keeps ``TORCHELASTIC_RESTART_COUNT`` unchanged
(covered by tests/elastic/test_agent.py).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import time
import weakref
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.metrics import put_metric
from torch.distributed.elastic.multiprocessing import (
    LogsSpecs,
    PContext,
    ProcessFailure,
    SignalException,
)
from torch.distributed.elastic.rendezvous import RendezvousError

from checkpoint.memory.records import snapshots_in
from elastic.agent_hooks import (
    PROCEED,
    AgentFeature,
    EndRun,
    NextTick,
    Proceed,
    Tick,
    Verdict,
    WorkersStarted,
    WorkersStarting,
    WorkersStopping,
)
from elastic.api import EventSink, FailureCause, RecoveryCause, RecoveryEvent
from elastic.config import AgentSettings
from elastic.hangwatch import HangFeature, HangWatch
from elastic.membership import MembershipView, first_line, warn_one_line
from elastic.metrics import AgentMetrics
from elastic.notice import SIGTERM_SOURCE, Notice, parse_signal_spec
from elastic.planned import (
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
    all_stopped,
    leave_exit_code,
)
from elastic.progress import ProgressBoard
from elastic.restores import RESTORE_REPORT_WAIT as RESTORE_REPORT_WAIT
from elastic.restores import RestoreReports
from elastic.torch_internals import check_agent_internals, worker_processes, worker_return_values
from elastic.vitals import Vitals, VitalsFeature
from elastic.worker.mailbox import GroupAssignment, Mailbox
from elastic.worker.reform import IN_PLACE_REASONS, in_place_enabled
from elastic.workers import (
    DeathClock,
    PdeathsigEntrypoint,
    fall_back_to_plain_workers,
    shim_command,
    signal_worker,
    terminate_processes,
    wait_for_workers,
)

logger = logging.getLogger(__name__)

WHY_BETWEEN_ROUNDS = "the notice came between rounds (no workers running): nothing to save"
ACK_POLL_INTERVAL = 0.01
"""Seconds between two looks at the mailbox's acknowledgements while this node's workers save for its notice."""


class FailureAction(enum.Enum):
    """What to do after the local worker group failed."""

    RESTART_FREE = "restart_free"
    """Restart without using up a restart (the failure came with a membership change)."""
    RESTART_CHARGED = "restart_charged"
    """Restart and use up one of ``--max-restarts`` (refunded if the next round shows a peer was lost)."""
    GIVE_UP = "give_up"
    """Stop the workers and report the failure."""


class _NoticeWhileNotTraining(BaseException):
    """Raised by the notice handler when there is nothing to save (between rounds, or workers that have not
    built their helpers yet), caught in ``_invoke_run``: a BaseException so that no ``except Exception`` of the
    rendezvous code on the way swallows it. ``why`` goes in the ``planned_leave`` event."""

    def __init__(self, why: str = WHY_BETWEEN_ROUNDS) -> None:
        super().__init__(why)
        self.why = why


PEER_REVOKE_SEEN_S = 1.0
"""Longest wait for our etcd watch to show a peer lease this agent just revoked (milliseconds, normally)."""
JIT_POLL_INTERVAL = 0.02


def decide_on_failure(*, remaining_restarts: int, peer_lost: bool) -> FailureAction:
    """Pure decision for a failed worker group (torch always charges; spotrun forgives peer loss)."""
    if peer_lost:
        return FailureAction.RESTART_FREE
    if remaining_restarts > 0:
        return FailureAction.RESTART_CHARGED
    return FailureAction.GIVE_UP


def should_refund(*, charged: bool, previous_group_world_size: int | None, new_group_world_size: int,
                  previous_members: frozenset[str] | None = None, new_members: frozenset[str] | None = None) -> bool:
    """A charged restart is refunded when the round it led to has a different node count, or (when the backend
    names the round's nodes) lacks a node of the previous round: the failure coincided with a peer leaving
    (workers crash in a collective before the dead peer's lease expires, so the loss is only visible in the
    next round; a replacement that arrived meanwhile keeps the count but not the membership) or joining."""
    if not charged or previous_group_world_size is None:
        return False
    if previous_group_world_size != new_group_world_size:
        return True
    return previous_members is not None and new_members is not None and not previous_members <= new_members


class SpotrunAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that recovers from node loss, worker crashes and scale-up in seconds."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        settings: AgentSettings,
        events: EventSink,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        tie_workers_to_agent: bool = True,
        mailbox: Mailbox | None = None,
        clock: Callable[[], float] = time.monotonic,
        memory_dir: str | None = None,
        script_imports_helper: bool = False,
        metrics: AgentMetrics | None = None,
    ) -> None:
        """``clock`` (monotonic seconds) times the rendezvous outage bound (injected: tests drive it).
        ``memory_dir``: this node's memory tier keeper directory, where workers leave their restore and save
        records. ``script_imports_helper``: the training script will build a ``Preemption`` helper (its source
        says so), so a notice before the helpers exist is a planned leave (``planned.HelperOutlook.COMING``).
        ``metrics``: the exporter's metrics (``--metrics-port``) the progress watch sets."""
        if tie_workers_to_agent:
            # CHANGE: workers die with the agent (torch's start_new_session leaves orphans on agent SIGKILL).
            spec = _tie_entrypoint_to_agent(spec)
        super().__init__(
            spec,
            logs_specs,
            start_method=start_method,
            exit_barrier_timeout=exit_barrier_timeout,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
        )
        check_agent_internals(self)
        quiet_worker_failure_tracebacks()
        self._settings = settings
        self._events = events
        self._clock = clock
        self.membership = MembershipView(spec.rdzv_handler, self, clock=clock)
        """The rendezvous as the monitor loop sees it: membership changes, lost peers, the outage clock."""
        self._round = 0
        self._charged_restart_pending = False
        self._previous_group_world_size: int | None = None
        self._death_clock: DeathClock | None = None
        self._close_started_at: float | None = None
        # Planned changes (elastic.planned): the workers' mailbox; the decisions and their state in `planned`.
        self._mailbox = mailbox
        self._notices = self.membership.notices
        self.planned = PlannedChanges(stop_grace=settings.stop_grace, resize_timeout=settings.resize_timeout)
        """This agent's planned-change state (its notice, the stop posted to its workers), ticked by the monitor loop."""
        self._in_place_enabled = in_place_enabled()
        """SPOTRUN_REFORM_IN_PLACE=1 (prototype): a peer's planned leave re-forms around waiting workers."""
        self._notice_signals = self._notice_signal_graces()
        self._in_rendezvous = False
        """Between rounds: no workers run, a notice is acted on at once (``_NoticeWhileNotTraining``)."""
        self._workers_started_at: float | None = None
        """Monotonic time the current workers started (None: none run, the agent is between rounds)."""
        self._script_imports_helper = script_imports_helper
        """The training script's own source imports ``elastic.preemption`` (``launcher.imports_helper``)."""
        self._workers_done = False
        """The local workers finished the run (the exit barrier): a notice has nothing left to stop."""
        self._run_over = False
        """``run`` returned: a notice signal now is only logged."""
        watch = (HangWatch(settings.hang, ProgressBoard(spec.rdzv_handler.get_run_id()), ctx=self.ctx)
                 if settings.hang is not None else None)
        self.hang = HangFeature(watch, self) if watch is not None else None
        """Hang detection (``elastic.hang``): the local workers' progress, judged every monitor tick."""
        self._recovery_cause: RecoveryCause | None = None
        """Why the current recovery happens: on every event until its workers_started (None at first start)."""
        self._exit_status = 0
        """What the process should exit with after a successful run (``--planned-leave-exit-code`` on a leave)."""
        self._finished = False
        """The run ended: the workers succeeded and every peer of the round reached the exit barrier."""
        self._memory_dir = memory_dir
        vitals = Vitals(metrics=metrics, emit=self.emit, memory_dir=memory_dir, ctx=self.ctx,
                        straggler=settings.straggler if watch is not None else None)
        features: list[AgentFeature | None] = [
            self.membership,
            self.hang,
            RestoreReports(memory_dir, self, clock=clock) if memory_dir is not None else None,
            VitalsFeature(vitals, self, self.membership, watch),
        ]
        self._features = [feature for feature in features if feature is not None]
        """The features, called in this order at each hook (``elastic.agent_hooks``)."""

    @property
    def exit_status(self) -> int:
        """Exit status for a run that did not fail: 0, or ``--planned-leave-exit-code`` after this node left
        the group for its notice with training unfinished (see ``planned.leave_exit_code``)."""
        return self._exit_status

    @property
    def finished(self) -> bool:
        """True once the run finished (the workers succeeded, the exit barrier passed): not after a planned
        leave or a failure. The launcher then lets the rendezvous keep its ``finished`` marker."""
        return self._finished

    # --- what the features may ask (agent_hooks.AgentHost) ---------------------------------------------------

    @property
    def worker_group(self) -> WorkerGroup:
        """The local worker group."""
        return self._worker_group

    @property
    def pcontext(self) -> PContext | None:
        """The running workers' process context (None between rounds)."""
        return self._pcontext

    def monitor(self) -> RunResult:
        """Look at the local workers once."""
        return self._monitor_workers(self._worker_group)

    def stop_workers(self) -> None:
        """Stop the local workers with the short grace."""
        self._stop_workers(self._worker_group)

    def restart_workers(self) -> None:
        """Stop the workers, run a rendezvous round and start new ones."""
        self._restart_workers(self._worker_group)


    def ctx(self) -> str:
        """The log prefix: role, round, group rank."""
        wg = self._worker_group
        return f"[{wg.spec.role} round={self._round} group_rank={wg.group_rank}/{wg.group_world_size}]"

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        """Record ``event`` with this agent's context fields."""
        wg = self._worker_group
        self._events.emit(
            event,
            round=self._round,
            group_rank=wg.group_rank,
            group_world_size=wg.group_world_size,
            world_size=wg.workers[0].world_size if wg.workers else None,
            restarts_left=self._remaining_restarts,
            rdzv_round=self.membership.round,
            recovery_cause=self._recovery_cause.value if self._recovery_cause is not None else None,
            **fields,
        )

    def begin_recovery(self, cause: RecoveryCause) -> None:
        """Label the recovery starting now (the first cause wins until the workers are started again)."""
        if self._recovery_cause is None:
            self._recovery_cause = cause

    def release(self) -> None:
        """Remove what the agent keeps outside its process (progress files); called once at exit."""
        for feature in self._features:
            feature.close()

    # --- rendezvous, start and stop with events ------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.emit(RecoveryEvent.RENDEZVOUS_STARTED)
        previous_members = self.membership.round_members()
        self._in_rendezvous = True
        try:
            if self.planned.own is not None:
                # The notice came while the workers were being stopped, or before this node ever joined (a
                # metadata notice, or a signal the launcher took while it started): a node that is going away
                # does not join a round only to leave it.
                raise _NoticeWhileNotTraining
            super()._rendezvous(worker_group)
        finally:
            self._in_rendezvous = False
        new_members = self.membership.round_members()
        self._round += 1
        assert worker_group.group_world_size is not None, "torch's _rendezvous sets the group world size"
        if should_refund(
            charged=self._charged_restart_pending,
            previous_group_world_size=self._previous_group_world_size,
            new_group_world_size=worker_group.group_world_size,
            previous_members=previous_members,
            new_members=new_members,
        ):
            # CHANGE: the failure we charged was really a peer leaving or joining; give the restart back.
            self._remaining_restarts += 1
            gone = sorted(previous_members - (new_members or frozenset())) if previous_members else []
            logger.info("%s membership changed (%s -> %s nodes%s); restart not counted", self.ctx(),
                        self._previous_group_world_size, worker_group.group_world_size,
                        f", {', '.join(gone)} gone" if gone else "")
        self._charged_restart_pending = False
        self._previous_group_world_size = worker_group.group_world_size
        self.emit(RecoveryEvent.RENDEZVOUS_COMPLETED, master_addr=worker_group.master_addr,
                   master_port=worker_group.master_port)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        reason = fall_back_to_plain_workers(worker_group.spec)
        if reason is not None:
            # CHANGE: a warm worker that a script could tell apart from torchrun's is not started; from now
            # on this agent starts plain `python -u` subprocesses (the spec was rewritten, so this logs once).
            logger.warning("%s warm workers off: %s; starting workers as plain subprocesses like torchrun",
                           self.ctx(), reason)
        if self._mailbox is not None:
            self._mailbox.clear()  # helpers and acks of the previous group must not count for this one
            # For workers whose environment a wrapper rebuilt without SPOTRUN_NOTICE_DIR (elastic.preemption).
            self._mailbox.publish_link(worker_group.spec.rdzv_handler.get_run_id(), worker_group.group_rank or 0)
        self.planned.new_group()
        # group_rank is set by the rendezvous that always precedes a start
        starting = WorkersStarting(worker_group.group_rank or 0, worker_group.spec.local_world_size)
        for feature in self._features:
            feature.on_workers_starting(starting)
        # CHANGE: torch's PContext.start replaces the notice handlers with its own (an immediate shutdown): ours
        # are back at once. (Blocking the signals over the start instead would leak the mask into the workers,
        # which inherit it through fork and exec: a script would see SIGTERM blocked.)
        pids = super()._start_workers(worker_group)
        if self._pcontext is not None:
            # Before the notice handlers: a shutdown they start must already release returned workers at once.
            self._close_started_at = None
            _default_close_timeout(self._pcontext, self._settings.stop_grace, self._workers_closing)
            self._start_death_clock(self._pcontext)
        self._workers_started_at = time.monotonic()
        self.install_notice_handlers()
        self._workers_started(WorkersStarted(dict(pids), {w.local_rank: w.global_rank for w in worker_group.workers}))
        self.emit(RecoveryEvent.WORKERS_STARTED, pids=sorted(pids.values()))
        self._recovery_cause = None
        return pids

    def _note_close_started(self) -> None:
        if self._close_started_at is None:
            self._close_started_at = time.monotonic()

    def _workers_closing(self) -> None:
        """Called before the agent signals its workers to stop them (every path goes through the process
        context's ``close`` or the early termination in ``_monitor_workers``)."""
        self._note_close_started()
        if self._mailbox is not None:
            # CHANGE: a worker's Preemption helper takes a notice signal that reaches it directly (Slurm signals
            # every process of the step) as the notice; the agent's own SIGTERM to stop the group must still
            # end it at once (elastic.preemption, `stopping`).
            try:
                self._mailbox.mark_stopping()
            except OSError as exc:
                logger.warning("%s cannot mark the workers' mailbox as stopping (%s): workers using the preemption "
                               "helper take the stop signal for a notice and are killed after the stop grace",
                               self.ctx(), exc)

    def _start_death_clock(self, pcontext: PContext) -> None:
        if self._death_clock is not None:
            self._death_clock.stop()
        self._death_clock = None
        processes = worker_processes(pcontext)
        if processes:
            self._death_clock = DeathClock({rank: proc.sentinel for rank, proc in enumerate(processes)})

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._pcontext is not None and self._close_started_at is None:
            # CHANGE: on a failure torch.multiprocessing's ProcessContext.join SIGTERMs the other workers and
            # waits up to 30 s before SIGKILL; workers stuck in a collective with a Python SIGTERM handler
            # never run it. Terminate them ourselves with the short grace first. Asked of the processes here,
            # on this thread, not of the death clock: its thread may note the death only after this tick on a
            # loaded machine, and torch's join then saw it first (test_a_failed_worker_the_death_clock_has_not_
            # noted_yet_still_gets_the_short_grace).
            processes = worker_processes(self._pcontext)
            dead = [rank for rank, proc in enumerate(processes or []) if proc.exitcode not in (None, 0)]
            if dead:
                if self._death_clock is not None:
                    self._death_clock.note(dead)  # before the close starts: they died on their own
                self._workers_closing()
                _stop_workers(self._pcontext, signal.SIGTERM, self._settings.stop_grace)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and self._pcontext is not None:
            # CHANGE: torch's MultiprocessContext (warm workers) reports only the first dead process in
            # sentinel order, often a rank that crashed *because* the real culprit died, and error-file
            # timestamps have one-second resolution. Report every rank that died on its own (before the
            # agent started closing the group), ordered by death time, so ChildFailedError names the root
            # cause first.
            died_at = dict(self._death_clock.died_at) if self._death_clock is not None else {}
            result.failures = complete_failures(
                result.failures, self._pcontext, worker_group, died_at=died_at, close_started_at=self._close_started_at
            )
        for feature in self._features:  # CHANGE: the features judge the workers too (hang detection)
            if (judged := feature.on_monitor(result)) is not None:
                return judged
        return result

    def _workers_started(self, event: WorkersStarted) -> None:
        for feature in self._features:
            feature.on_workers_started(event)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # CHANGE: torch calls self._shutdown() with its 30 s default between SIGTERM and SIGKILL; workers
        # blocked in a collective with a dead peer ignore SIGTERM, so use a short grace.
        for feature in self._features:
            feature.on_stop(WorkersStopping())
        self._shutdown(timeout=self._settings.stop_grace)  # type: ignore[arg-type]  # torch says int; any seconds work
        self._workers_started_at = None
        self.emit(RecoveryEvent.WORKERS_STOPPED)

    def _let_workers_snapshot(self) -> None:
        """CHANGE (memory tier, just-in-time snapshots): a peer is gone, so the workers' next collective breaks
        and workers using the memory tier snapshot their last completed step before they exit
        (``checkpoint.memory.jit``). Stopping them at once would cut that short: give them up to
        ``--stop-grace`` to exit on their own first, and only when their keeper directory shows they snapshot
        and a lost peer may have died on a live host (``_lost_peers_refuse``). A silent loss (power off, a
        partition, a paused node) resets no connection: the workers' collectives stay blocked, so they are
        stopped at once instead of after the whole grace; so are the workers of a node left out of a newer
        round (its peers restored without its state)."""
        if self._memory_dir is None or self._pcontext is None or not snapshots_in(self._memory_dir):
            return
        # Workers that watch abort their groups: their collectives raise now, whatever the loss (snapshot, exit).
        if not self._abort_watched_groups() and not self.membership.lost_peers_refuse():
            logger.info("%s no just-in-time snapshot to wait for (the lost peers are silent or paused: no connection "
                        "reset breaks the workers' collectives; or the group re-formed without this node)", self.ctx())
            return
        running = _running_workers(self._pcontext)
        if running is None:
            return
        deadline = self._clock() + self._settings.stop_grace
        while running() and not self._all_waiting_in_place() and self._clock() < deadline:
            time.sleep(JIT_POLL_INTERVAL)
        logger.info("%s workers %s after the peer loss (up to %.1fs for just-in-time snapshots)", self.ctx(),
                    "still running" if running() else "exited", self._settings.stop_grace)

    def _abort_watched_groups(self) -> bool:
        """CHANGE (abortable groups): tell the workers a peer is gone (``peer-lost.json``); True when every local
        worker runs a peer-loss watcher (``elastic.worker.watcher``), which aborts its process group, so a
        collective blocked on a silent or paused peer raises too and the just-in-time snapshot runs."""
        if self._mailbox is None:
            return False
        lost = self.membership.lost_peers()
        watching = self._every_local_worker(Mailbox.watchers)
        try:
            if watching:
                self._mailbox.post_peer_lost(sorted(lost))
        except OSError as exc:
            logger.warning("%s could not tell the workers of the peer loss: %s", self.ctx(), exc)
            return False
        if watching:
            logger.info("%s peer(s) %s lost: the workers abort their process group", self.ctx(), sorted(lost))
        return watching

    # --- monitor loop ------------------------------------------------------------------------------------

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """CHANGE (overlapping faults): a notice that arrives between rounds (this node's workers stopped for a
        recovery, the node re-forming or waiting as a spare) has nothing to save: the node leaves at once, as a
        planned leave. It used to wait in the rendezvous (a spare: for good), holding its notice."""
        try:
            return self._monitor_loop(role)
        except _NoticeWhileNotTraining as notice:
            self._stop_workers(self._worker_group)
            self._leave(step=None, why=notice.why)
            return self._left_result(workers_finished=False)
        finally:
            self._run_over = True

    def _tick_features(self, tick: Tick) -> Verdict:
        for feature in self._features:
            if not isinstance(verdict := feature.on_tick(tick), Proceed):
                return verdict
        return PROCEED

    def _monitor_loop(self, role: str = DEFAULT_ROLE) -> RunResult:
        # Mirrors SimpleElasticAgent._invoke_run of torch 2.13 (unchanged to 2.15) with the CHANGEs marked below.
        spec = self._worker_group.spec
        role = spec.role
        logger.info("[%s] starting workers for entrypoint: %s", role, spec.get_entrypoint_name())
        self._initialize_workers(self._worker_group)

        while True:
            if self._worker_group.state == WorkerState.INIT:
                raise AssertionError("worker group is in INIT state inside the monitor loop")
            # CHANGE: wake up on a membership event instead of sleeping a full monitor interval; while the
            # workers head for an agreed step, the moment they finish (elastic.planned).
            if self.planned.posted is not None:
                self._wait_for_planned_stop(spec.monitor_interval)
            else:
                self.membership.wait(spec.monitor_interval)
            run_result = self._monitor_workers(self._worker_group)
            state = run_result.state
            self._worker_group.state = state
            put_metric(f"workers.{role}.remaining_restarts", self._remaining_restarts)
            put_metric(f"workers.{role}.{state.name.lower()}", 1)
            # CHANGE: the features' tick (restore reports, vitals, planned changes) may act on the group.
            verdict = self._tick_features(Tick(run_result))
            if isinstance(verdict, EndRun):
                return verdict.result
            if isinstance(verdict, NextTick):
                continue

            self._publish_own_notice()

            if state == WorkerState.HEALTHY and (leaving := self._leaving_stop()) is not None:
                # CHANGE: this node's workers stopped at the agreed step and are on their way out: leave now.
                return self._leave_after_acknowledgement(leaving)
            if state == WorkerState.SUCCEEDED:
                # CHANGE: workers that acknowledged a step stopped for a planned change: the job is not over.
                stopped = self._acknowledged_stop()
                after = self.planned.after_success(stopped)
                if after is AfterSuccess.LEAVE:
                    return self._leave_for_notice(stopped)
                if after is AfterSuccess.REFORM:
                    assert stopped is not None
                    self._restart_for_planned_change(stopped)
                    continue
                logger.info("%s worker group finished; waiting for other agents", self.ctx())
                self._workers_done = True
                try:
                    barrier_passed = self._exit_barrier_unless_peers_left()
                finally:
                    self._workers_done = False
                if not barrier_passed:
                    # CHANGE: torch waits up to 300 s for peers that left, then reports success.
                    self.begin_recovery(RecoveryCause.PEER_LOST)
                    self.emit(RecoveryEvent.FAILURE_DETECTED, cause=FailureCause.PEERS_LEFT_AT_EXIT.value)
                    self._restart_workers(self._worker_group)
                    continue
                self.emit(RecoveryEvent.RUN_FINISHED, state=state.name)
                self._finished = True
                return run_result
            if state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:
                if self.planned.leaving or self._failed_before_helpers():
                    # CHANGE (overlapping faults): the workers failed while heading for this node's agreed
                    # step, most often because a peer crashed at the same moment (their collective broke). The
                    # node still goes away for its notice, as a preemption: it exits with the planned-leave
                    # code (a failure here would count against a Kubernetes Job's backoff limit and keep Slurm
                    # from requeueing), recording saved: false and why. It does not wait to join the
                    # survivors' re-formed round to save there: its deadline is short and the survivors restore
                    # without it (docs/guides/preemption.md, "Overlapping faults").
                    # Workers that had not built their helpers yet died of the notice signal themselves (Slurm
                    # signals the whole step): they had trained nothing since their restore, so this is the same
                    # planned leave as when the agent gets the signal first.
                    why = (self._why_failed_during_stop(run_result) if self.planned.leaving
                           else f"{WHY_BEFORE_HELPERS} (the workers ended on the notice signal: exit codes by "
                                f"rank { {rank: f.exitcode for rank, f in run_result.failures.items()} })")
                    self._stop_workers(self._worker_group)
                    self._leave(step=None, why=why)
                    return self._left_result(workers_finished=False)
                result = self._handle_failure(run_result)
                if result is not None:
                    self.emit(RecoveryEvent.RUN_FINISHED, state=WorkerState.FAILED.name)
                    return result
            elif state == WorkerState.HEALTHY:
                if (waiting := self._waiting_in_place()) is not None:
                    # CHANGE (prototype, SPOTRUN_REFORM_IN_PLACE=1): the workers acknowledged a peer's planned
                    # leave and wait in their processes: re-form around them instead of restarting them.
                    self._reform_in_place(waiting)
                    continue
                planned = self._planned_tick()
                if planned is PlannedTick.WAITING:
                    continue
                if planned is PlannedTick.LEFT:
                    return self._left_result(workers_finished=False)
                # CHANGE: also reacts to a lost peer (membership_changed), not only to waiting nodes.
                if self.membership.changed():
                    self.begin_recovery(self.membership.cause())
                    logger.info("%s membership changed (%s); restarting worker group (not counted)", self.ctx(),
                                self._recovery_cause.value if self._recovery_cause else "?")
                    self.emit(RecoveryEvent.FAILURE_DETECTED, cause=FailureCause.MEMBERSHIP_CHANGE.value)
                    if self._recovery_cause is RecoveryCause.PEER_LOST:
                        self._let_workers_snapshot()
                        if self._all_waiting_in_place():
                            # CHANGE (SPOTRUN_REFORM_IN_PLACE=1): the workers aborted their group, snapshotted their
                            # last completed step and wait in their processes: re-form around them, no restart.
                            logger.info("%s workers wait in place after the peer loss; re-forming around them",
                                        self.ctx())
                            self._reform_waiting_workers()
                            continue
                    self._restart_workers(self._worker_group)
            else:
                raise RuntimeError(f"[{role}] Worker group in {state.name} state")

    # --- planned changes: notices, the workers' mailbox, leaving and re-forming (elastic.planned) ----------

    def receive_notice(self, notice: Notice) -> None:
        """This node will be taken away at ``notice.deadline`` (called from the poller thread or a signal
        handler: only an assignment; the monitor loop acts on it)."""
        self.planned.receive(notice)

    def receive_early_notice(self, signum: int, received_at: float) -> None:
        """A notice signal the launcher recorded before this agent's handlers were installed (its imports, the
        forkserver's warm-up): this node has not joined a round, it leaves at its first rendezvous."""
        source, grace = self._notice_signals.get(signum, (f"signal:{signal.Signals(signum).name}",
                                                           self._settings.preempt_grace))
        logger.warning("%s %s during the agent's start-up: leaving as a planned leave", self.ctx(),
                       signal.Signals(signum).name)
        self.receive_notice(Notice(source, received_at + grace, f"signal {signal.Signals(signum).name} at start-up"))

    def _notice_signal_graces(self) -> dict[int, tuple[str, float]]:
        graces = {int(signal.SIGTERM): (SIGTERM_SOURCE, self._settings.preempt_grace)}
        if self._settings.preempt_signal:
            sig, grace = parse_signal_spec(self._settings.preempt_signal, self._settings.preempt_grace)
            graces[int(sig)] = (f"signal:{sig.name}", grace)
        return graces

    def install_notice_handlers(self) -> None:
        """Make the notice signals (SIGTERM, ``--preempt-signal``) preemption notices to this agent. The
        launcher calls it before the first rendezvous; the agent again after each worker start (torch's
        ``PContext.start`` replaces the handlers). Main thread only (``signal.signal``)."""
        for signum in self._notice_signals:
            signal.signal(signum, self._on_notice_signal)

    def _on_notice_signal(self, signum: int, frame: object) -> None:
        source, grace = self._notice_signals[signum]
        if self._workers_done and not self._run_over and self.planned.own is None:
            # The exit barrier: the workers finished, nothing to save or stop; the barrier ends by the deadline.
            self.receive_notice(Notice(source, time.time() + grace, f"signal {signal.Signals(signum).name}"))
            return
        action = self.planned.on_signal(between_rounds=self._in_rendezvous or self._workers_started_at is None,
                                        sigterm=signum == signal.SIGTERM, helpers_ready=self._helpers_ready(),
                                        announced=self._helpers_announced(), run_over=self._run_over)
        if action is SignalAction.IGNORE:
            logger.info("%s %s after the run ended: nothing to do", self.ctx(), signal.Signals(signum).name)
            return
        if action is SignalAction.SHUT_DOWN:
            # A second SIGTERM, or workers that cannot save at an agreed step: torch's immediate shutdown.
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        self.receive_notice(Notice(source, time.time() + grace, f"signal {signal.Signals(signum).name}"))
        if action is SignalAction.LEAVE_NOW:
            # Nothing to save: between rounds (a recovery, a spare, a node that never joined a round yet) no worker
            # runs; workers that will build their helpers but have not yet trained nothing since their restore.
            # Leave now (_invoke_run), as a planned leave: a scheduler counts torch's shutdown as a failure.
            raise _NoticeWhileNotTraining(WHY_BETWEEN_ROUNDS if self._workers_started_at is None or self._in_rendezvous
                                          else WHY_BEFORE_HELPERS)

    def _every_local_worker(self, marks: Callable[[Mailbox], set[int]]) -> bool:
        """Every local worker left its mark of this kind in the mailbox (``marks``: ``Mailbox.helpers``,
        ``Mailbox.waiting``, ``Mailbox.watchers``); False without a mailbox or when it cannot be read."""
        if self._mailbox is None:
            return False
        try:
            return len(marks(self._mailbox)) >= self._worker_group.spec.local_world_size
        except OSError:
            return False

    def _helpers_ready(self) -> bool:
        """Every local worker constructed a ``Preemption`` helper (it will stop by itself at an agreed step)."""
        return self._every_local_worker(Mailbox.helpers)

    def _failed_before_helpers(self) -> bool:
        """This node has a notice and its workers, which announced helpers but had not built them, failed:
        they took the notice signal themselves (Slurm signals every process of the step), before they had
        trained anything since their restore. That is the notice, not a failure."""
        own = self.planned.own
        if own is None:
            return False
        outlook = self.planned.outlook(helpers_ready=self._helpers_ready(), announced=self._helpers_announced())
        return outlook is HelperOutlook.COMING

    def _helpers_announced(self) -> bool:
        """The script will build a helper: its source imports the helper's module, or a local worker of this
        group imported it (``coming-{local_rank}``)."""
        if self._mailbox is None:
            return False
        if self._script_imports_helper:
            return True
        try:
            return bool(self._mailbox.helpers_coming())
        except OSError:
            return False

    def _wait_for_planned_stop(self, timeout: float, *, poll_acks: bool = True) -> None:
        """Up to ``timeout`` s, returning as soon as a local worker returns or exits, or (this node leaving)
        every local worker acknowledged the agreed step: a planned change resumes from the committed step
        without waiting for the next monitor tick. A peer that vanishes meanwhile is seen at the next tick."""
        pcontext = self._pcontext
        processes = worker_processes(pcontext) if pcontext is not None else None
        returns = worker_return_values(pcontext)
        began = time.monotonic()
        # A leaving node also polls its mailbox for the acknowledgements (a directory listing, every
        # ACK_POLL_INTERVAL): the peers' rendezvous waits for this node's lease, not for its workers' exit.
        leaving = poll_acks and self.planned.own is not None and self._mailbox is not None
        # Workers that re-form in place never exit: the same poll sees them waiting (SPOTRUN_REFORM_IN_PLACE).
        in_place = poll_acks and self._in_place_posted()
        step = ACK_POLL_INTERVAL if leaving or in_place else timeout
        while True:
            remaining = timeout - (time.monotonic() - began)
            if remaining <= 0 or (leaving and self._acknowledged_stop() is not None) or (
                    in_place and self._waiting_in_place() is not None):
                return
            if wait_for_workers(processes, returns, min(step, remaining)):
                # never spin: a worker that returned stays "ready" until torch's next poll has read it
                time.sleep(max(0.0, min(timeout, 0.01) - (time.monotonic() - began)))
                return

    def _leaving_stop(self) -> Stopped | None:
        """Where this node's workers all stopped (committed, or skipped the save) for its own notice, else None."""
        if not self.planned.leaving:
            return None
        return self._acknowledged_stop()

    def _committed_at(self) -> float | None:
        """When the local workers had committed the agreed step (for the events: the start of a planned
        change's resume time, which bench/goodput_bench.py reports against its 1 s target)."""
        if self._mailbox is None:
            return None
        try:
            return self._mailbox.committed_at()
        except OSError:
            return None

    def _publish_own_notice(self) -> None:
        notice = self.planned.to_publish()
        if notice is None:
            return
        published = False
        if self._notices is not None:
            try:
                self._notices.publish_notice(notice.to_json())
                published = True
            except RendezvousError as exc:
                warn_one_line(logger, exc, "%s could not publish the preemption notice (%s); peers learn of it when "
                              "this node leaves", self.ctx(), first_line(exc))
        logger.warning("%s preemption notice (%s): deadline in %.1f s", self.ctx(), notice.source,
                       notice.deadline - time.time())
        self.emit(RecoveryEvent.NOTICE_RECEIVED, source=notice.source, deadline=notice.deadline,
                   detail=notice.detail, published=published)

    def _tick_view(self) -> TickView:
        """What the planned-change coordinator looks at: the mailbox, the peers' notices, the membership."""
        helpers_ready = self._helpers_ready()
        peers: dict[str, float] = {}
        lost: frozenset[str] = frozenset()
        now = time.time()
        if self._notices is not None:
            try:
                peers = {node: float(notice.get("deadline") or now)
                         for node, notice in self._notices.peer_notices().items()}
                lost = frozenset(self._notices.lost_peers())
            except RendezvousError:
                pass
        return TickView(now=now, peer_notices=peers, lost=lost, membership_changed=self.membership.changed(),
                        helpers_ready=helpers_ready, helpers_announced=self._helpers_announced())

    def _planned_tick(self) -> PlannedTick:
        """While healthy: ask the planned-change coordinator what to do (``PlannedChanges.tick``) and do it."""
        if self._mailbox is None:
            return PlannedTick.NONE
        decision = self.planned.tick(self._tick_view())
        self._perform(decision)
        return decision.outcome

    def _perform(self, decision: PlannedDecision) -> None:
        """The I/O of a planned-change decision, in order: post, abandon, leave, re-form."""
        for action in decision.actions:
            if isinstance(action, PostStop):
                assert self._mailbox is not None, "a stop is posted only with a mailbox"
                notice = action.notice
                self._mailbox.post(notice)
                logger.warning("%s planned stop posted to the workers: %s (deadline in %s s)", self.ctx(),
                               notice.reason, "-" if notice.deadline is None else f"{notice.deadline - time.time():.1f}")
                self.emit(RecoveryEvent.PLANNED_STOP_POSTED, reason=notice.reason, deadline=notice.deadline,
                           source=notice.source)
            elif isinstance(action, AbandonStop):
                logger.warning("%s planned stop (%s) abandoned: %s", self.ctx(), action.reason, action.why)
                self.emit(RecoveryEvent.PLANNED_STOP_ABANDONED, reason=action.reason, why=action.why)
            elif isinstance(action, LeaveNow):
                self._stop_workers(self._worker_group)
                self._leave(step=None, why=action.why)
            elif isinstance(action, Reform):
                self._restart_workers(self._worker_group)  # not charged: a membership change
            else:
                raise AssertionError(f"unknown planned action {action!r}")

    def _in_place_posted(self) -> bool:
        """SPOTRUN_REFORM_IN_PLACE is on and the stop posted to the workers is one that re-forms in place."""
        posted = self.planned.posted
        return (self._in_place_enabled and self._mailbox is not None and not self.planned.leaving
                and posted is not None and posted.reason in IN_PLACE_REASONS)

    def _waiting_in_place(self) -> Stopped | None:
        """Where every local worker stopped for a peer's planned leave and now waits in its process for the
        re-formed group (``elastic.worker.reform``); None otherwise."""
        if not self._in_place_posted() or (stopped := self._acknowledged_stop()) is None:
            return None
        assert self._mailbox is not None, "_in_place_posted checks the mailbox"
        try:
            waiting = self._mailbox.waiting()
        except OSError:
            return None
        return stopped if len(waiting) >= self._worker_group.spec.local_world_size else None

    def _reform_in_place(self, stopped: Stopped) -> None:
        """The survivors' side of a peer's planned leave without a restart: the same rendezvous round as
        :meth:`_restart_for_planned_change`, then each waiting worker is told its new rank, world size and
        store (``group-{local_rank}.json``) and rebuilds its process group; its process, imports, model and
        optimizer stay. The events keep their order (``planned_restart`` ... ``workers_started``, with
        ``in_place: true``)."""
        posted = self.planned.posted
        logger.info("%s workers stopped at step %d for a planned change (%s); re-forming around them in place",
                    self.ctx(), stopped.step, posted.reason if posted is not None else "?")
        self.begin_recovery(RecoveryCause.PLANNED_LEAVE)
        self.emit(RecoveryEvent.PLANNED_RESTART, step=stopped.committed,
                   reason=posted.reason if posted is not None else "unknown",
                   committed_at=self._committed_at() if stopped.saved else None, saved=stopped.saved,
                   why=stopped.why, agreed_step=stopped.step, in_place=True)
        self._reform_waiting_workers()

    def _all_waiting_in_place(self) -> bool:
        """Every local worker waits in its process for a re-formed group (``waiting-{local_rank}``)."""
        return self._in_place_enabled and self._every_local_worker(Mailbox.waiting)

    def _reform_waiting_workers(self) -> None:
        """The rendezvous round of a restart, then each waiting worker is told its new rank, world size and store
        (``group-{local_rank}.json``) instead of being replaced; a round that admitted a new node restarts them."""
        assert self._mailbox is not None and self._pcontext is not None, "only with running workers and a mailbox"
        group = self._worker_group
        previous = self.membership.round_members()
        self._rendezvous(group)  # torch's: new ranks in group.workers, this round's MASTER_ADDR/PORT
        current = self.membership.round_members()
        if previous is None or current is None or not current <= previous:
            # A node joined in the same round (a spare, a replacement): its fresh worker restores through
            # collectives that the waiting survivors would not join. Start new workers, as without the flag.
            logger.info("%s the re-formed round admitted a new node; restarting the workers instead", self.ctx())
            self._stop_workers(group)
            self._start_workers_after_rendezvous(group)
            return
        pids = self._pcontext.pids()
        for worker in group.workers:
            worker.id = pids[worker.local_rank]  # what torch's _start_workers records; its monitor compares them
        self._mailbox.clear()  # the acks, waiting marks and helpers of the old group
        self.planned.new_group()
        restart_count = group.spec.max_restarts - self._remaining_restarts
        assert group.group_rank is not None and group.group_world_size is not None and group.master_addr is not None \
            and group.master_port is not None, "set by the rendezvous"
        for worker in group.workers:
            self._mailbox.assign(worker.local_rank, GroupAssignment(
                rank=worker.global_rank, world_size=worker.world_size, group_rank=group.group_rank,
                group_world_size=group.group_world_size, master_addr=group.master_addr,
                master_port=group.master_port, restart_count=restart_count))
        group.state = WorkerState.HEALTHY
        self._workers_started(WorkersStarted(pids, {w.local_rank: w.global_rank for w in group.workers}, in_place=True))
        self.emit(RecoveryEvent.WORKERS_STARTED, pids=sorted(pids.values()), in_place=True)
        self._recovery_cause = None

    def _start_workers_after_rendezvous(self, group: WorkerGroup) -> None:
        """What torch's ``_initialize_workers`` does after its rendezvous (2.13 to 2.15)."""
        for local_rank, worker_id in self._start_workers(group).items():
            group.workers[local_rank].id = worker_id
        group.state = WorkerState.HEALTHY

    def _acknowledged_stop(self) -> Stopped | None:
        """Where every local worker stopped for the planned change, saved or not (None: they did not all)."""
        if self._mailbox is None:
            return None
        return all_stopped(*self._mailbox.stops(), self._worker_group.spec.local_world_size)

    def _leave(self, *, step: int | None, why: str | None, agreed_step: int | None = None) -> None:
        """Revoke the lease and record the leave; ``step`` is the committed step (None: nothing saved, then
        ``agreed_step`` is where workers that skipped the save stopped)."""
        notice = self.planned.own
        self.membership.leave()
        late = notice is not None and time.time() > notice.deadline
        logger.warning("%s left the group for the preemption notice (%s%s)", self.ctx(),
                       f"step {step} committed" if step is not None else f"nothing saved: {why}",
                       ", after the deadline" if late else "")
        self.begin_recovery(RecoveryCause.PLANNED_LEAVE)
        self.emit(RecoveryEvent.PLANNED_LEAVE, step=step, saved=step is not None, why=why, late=late,
                   agreed_step=agreed_step if agreed_step is not None else step,
                   committed_at=self._committed_at() if step is not None else None,
                   source=notice.source if notice else None, deadline=notice.deadline if notice else None)

    def _why_failed_during_stop(self, run_result: RunResult) -> str:
        """The ``why`` of a leave whose workers failed before the agreed step: their exit codes, and the peers
        already known lost (a crash that broke the collective)."""
        failures = {rank: f.exitcode for rank, f in run_result.failures.items()}
        lost = self.membership.lost_peers()
        peers = f"; peer(s) {sorted(lost)} lost meanwhile" if lost else ""
        return f"the workers failed during the planned stop (exit codes by rank {failures}){peers}"

    def _leave_for_notice(self, stopped: Stopped | None) -> RunResult:
        """The workers stopped at the agreed step (committed, or skipped: it could not commit before the
        deadline) and exited 0: revoke the lease (peers re-form now) and exit 0 (or
        ``--planned-leave-exit-code``)."""
        self._stop_workers(self._worker_group)
        if stopped is None:
            self._leave(step=None, why="the workers exited without acknowledging a step")
        else:
            self._leave(step=stopped.committed, why=stopped.why, agreed_step=stopped.step)
        # Workers that use the helper and exit 0 without stopping at an agreed step finished the run.
        return self._left_result(workers_finished=stopped is None)

    def _leave_after_acknowledgement(self, stopped: Stopped) -> RunResult:
        """Every local worker stopped at the agreed step for this node's notice (committed it, or skipped a
        save that could not commit in time) and is exiting: revoke the lease first, so the peers re-form while
        the workers tear down (process groups, interpreter exit: 0.1-0.3 s that nothing of this node is needed
        for any more), then wait for them, bounded by the notice's deadline.

        Workers that fail after their acknowledgement still fail the agent (as before): the ``planned_leave``
        event records the stop either way."""
        self._leave(step=stopped.committed, why=stopped.why, agreed_step=stopped.step)
        notice = self.planned.own
        until = notice.deadline - self._settings.stop_grace if notice is not None else time.time()
        result = self._monitor_workers(self._worker_group)
        while result.state == WorkerState.HEALTHY and (remaining := until - time.time()) > 0:
            self._wait_for_planned_stop(min(remaining, self._worker_group.spec.monitor_interval), poll_acks=False)
            result = self._monitor_workers(self._worker_group)
        self._stop_workers(self._worker_group)  # past the deadline: those still running go now
        if result.state == WorkerState.FAILED:
            logger.warning("%s workers failed after stopping at step %d for the planned leave", self.ctx(),
                           stopped.step)
            self.emit(RecoveryEvent.RUN_FINISHED, state=WorkerState.FAILED.name)
            return result
        return self._left_result(workers_finished=False)

    def _left_result(self, *, workers_finished: bool) -> RunResult:
        """Success for every local worker (torch records one event per worker from the return values); the
        process exits with ``--planned-leave-exit-code`` unless the workers had finished the run."""
        self._exit_status = leave_exit_code(workers_finished=workers_finished,
                                            configured=self._settings.planned_leave_exit_code)
        self.emit(RecoveryEvent.RUN_FINISHED, state=WorkerState.SUCCEEDED.name, exit_code=self._exit_status)
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in self._worker_group.workers})

    def _restart_for_planned_change(self, stopped: Stopped) -> None:
        """Our workers stopped at the agreed step for a peer's notice or a joining node: re-form now (the
        rendezvous waits for the leaver's lease to go and for the joiner) and resume from it, or, when they
        skipped its save (no time before the deadline), from the last committed step; not counted."""
        posted = self.planned.posted
        reason = posted.reason if posted is not None else "unknown"
        if stopped.saved:
            logger.info("%s workers committed step %d for a planned change (%s); re-forming the group",
                        self.ctx(), stopped.step, reason)
        else:
            logger.warning("%s workers stopped at step %d for a planned change (%s) without saving it (%s); "
                           "re-forming the group from the last committed step", self.ctx(), stopped.step, reason,
                           stopped.why)
        self.begin_recovery(RecoveryCause.SCALE_UP if reason == "resize" else RecoveryCause.PLANNED_LEAVE)
        self.emit(RecoveryEvent.PLANNED_RESTART, step=stopped.committed, reason=reason,
                   committed_at=self._committed_at() if stopped.saved else None, saved=stopped.saved,
                   why=stopped.why, agreed_step=stopped.step)
        self._restart_workers(self._worker_group)

    def _exit_barrier_unless_peers_left(self) -> bool:
        """torch's exit barrier, except that it returns False at once when a peer of this round is gone:
        a peer that left never arrives (torch waits ``exit_barrier_timeout``, 300 s, then reports success)."""
        size, store = self._worker_group.group_world_size, self._store
        if size is not None and size <= 1:
            return True  # CHANGE: no peer to wait for (torch's barrier of one only touches the store)
        if self._notices is None or store is None or size is None:
            self._exit_barrier()
            return True
        key = "spotrun/exit_barrier/arrived"
        began = time.monotonic()
        try:
            store.add(key, 1)
            while time.monotonic() - began < self._exit_barrier_timeout:
                if int(store.add(key, 0)) >= size:
                    return True
                if (own := self.planned.own) is not None and time.time() >= own.deadline - self._settings.stop_grace:
                    # This node's workers finished; its notice leaves no time to wait for the peers' own finish.
                    logger.warning("%s preemption notice: leaving the exit barrier (this node's workers finished)",
                                   self.ctx())
                    return True
                if self._notices.lost_peers():
                    logger.warning("%s peers %s left while this node finished: the run is not over", self.ctx(),
                                   sorted(self._notices.lost_peers()))
                    return False
                self._stop_waiting_for(0.1)
        except RendezvousError as exc:
            warn_one_line(logger, exc, "%s exit barrier failed (%s); the workers finished, reporting success",
                          self.ctx(), first_line(exc))
            return True
        logger.error("%s peers did not finish within %.0f s", self.ctx(), self._exit_barrier_timeout)
        return True

    def _stop_waiting_for(self, seconds: float) -> None:
        """The exit barrier's pause: a permanent rendezvous error ends the barrier (raised), since the handler can
        no longer show a peer that left, and waiting out ``exit_barrier_timeout`` (300 s) would only hide it."""
        if not self.membership.wait(seconds, raise_permanent=True):
            return
        time.sleep(seconds)  # a waiting node also counts as a change: do not spin while it waits

    def _handle_failure(self, run_result: RunResult) -> RunResult | None:
        """Restart the group (returns None) or give up (returns the failed result)."""
        failures = {rank: f.exitcode for rank, f in run_result.failures.items()}
        peer_lost = self.membership.changed()
        if not peer_lost and self.membership.confirm_dead_peers():
            # CHANGE: a dead peer's process was confirmed by a refused probe and its lease revoked: our watch
            # sees the registration go within milliseconds, not after the lease TTL.
            peer_lost = self.membership.wait_for_peer_loss(PEER_REVOKE_SEEN_S)
        if not peer_lost and self._remaining_restarts == 0:
            # CHANGE: last chance; a collective broken by a dead peer fails before the peer's lease expires
            # (the launcher stretches peer_loss_grace over the lease TTL, see launcher.peer_loss_window).
            peer_lost = self.membership.wait_for_peer_loss(self._settings.peer_loss_grace)
        action = decide_on_failure(remaining_restarts=self._remaining_restarts, peer_lost=peer_lost)
        cause = FailureCause.WORKER_FAILURE_WITH_PEER_LOSS if peer_lost else FailureCause.WORKER_FAILURE
        hung = self.hang is not None and self.hang.hung
        if hung:
            cause = FailureCause.HANG
        self.begin_recovery(recovery_cause_of_failure(hung=hung, peer_lost=peer_lost))
        self.emit(RecoveryEvent.FAILURE_DETECTED, cause=cause.value, failures=failures, action=action.value)
        # One line per recovery, visible at the CLI's default WARNING level (torch's is an INFO line).
        logger.warning("%s %s: worker group %s (exit codes by rank %s): %s; %s/%s restarts left", self.ctx(),
                       self._recovery_cause.value if self._recovery_cause else cause.value, run_result.state.name,
                       failures, action.value, self._remaining_restarts, self._worker_group.spec.max_restarts)
        if action is FailureAction.GIVE_UP:
            self._stop_workers(self._worker_group)
            self._worker_group.state = WorkerState.FAILED
            return run_result
        if action is FailureAction.RESTART_CHARGED:
            self._remaining_restarts -= 1
            self._charged_restart_pending = True
        self._restart_workers(self._worker_group)
        return None


class OneLineWorkerFailure(logging.Filter):
    """CHANGE: torch's ``MultiprocessContext._poll`` logs every failed worker with ``logger.exception``: the
    traceback of torch's own ``join()`` (or, for a function that raised, the worker's whole traceback, which
    the worker already printed and its error file holds). On every peer loss that was 7 to 40 lines of
    noise on the console; keep the record, as one line with the exception's first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.msg, str) and record.msg.startswith("failed (exitcode"):
            exc = record.exc_info[1]
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            record.msg += ": %s (worker output and error file have the details)"
            record.args = (*(record.args or ()), first)
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_worker_failure_tracebacks() -> None:
    """Install :class:`OneLineWorkerFailure` on torch's process-context logger (once)."""
    torch_logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, OneLineWorkerFailure) for f in torch_logger.filters):
        torch_logger.addFilter(OneLineWorkerFailure())


def recovery_cause_of_failure(*, hung: bool, peer_lost: bool) -> RecoveryCause:
    """The ``recovery_cause`` of a failed local group: a hang we detected, a peer that went away with it
    (the local crash is then a consequence), or a failure of its own."""
    if hung:
        return RecoveryCause.HANG
    return RecoveryCause.PEER_LOST if peer_lost else RecoveryCause.FAILURE


def complete_failures(
    failures: dict[int, ProcessFailure],
    pcontext: PContext,
    worker_group: WorkerGroup,
    *,
    died_at: dict[int, float],
    close_started_at: float | None,
) -> dict[int, ProcessFailure]:
    """Every rank that failed on its own, by global rank, in the order they died (root cause first). A worker
    that had returned and was SIGKILLed only to release it (``_RELEASED``) is no failure, whatever torch says."""
    released = _RELEASED.get(pcontext, set())
    merged = {rank: f for rank, f in failures.items() if f.local_rank not in released}
    pids = pcontext.pids()
    for local_rank, when in died_at.items():
        global_rank = worker_group.workers[local_rank].global_rank
        exitcode = _exitcode(pcontext, local_rank)
        # <=: the agent notes the deaths it saw itself (DeathClock.note) just before it starts the close, on the
        # same monotonic clock, so a tie is a death seen before the close.
        on_its_own = close_started_at is None or when <= close_started_at
        if global_rank in merged or not on_its_own or exitcode == 0 or local_rank in released:
            continue
        merged[global_rank] = ProcessFailure(
            local_rank=local_rank, pid=pids.get(local_rank, -1), exitcode=exitcode,
            error_file=pcontext.error_files[local_rank],
        )
    return dict(sorted(merged.items(), key=lambda item: failure_order(item[1], died_at)))


def failure_order(failure: ProcessFailure, died_at: dict[int, float]) -> tuple[float, int, float, float]:
    """Sort key, root cause first: death time when known; in a tie (deaths noted together: the death clock's
    thread ran late), a worker killed by a signal before one that raised, since a peer's death breaks the others'
    collective into an exception, never into a signal; then the error file's timestamp and mtime (sub-second).
    A worker without an error file gets torch's "now" as its timestamp, which alone would rank it last."""
    try:
        mtime = os.stat(failure.error_file).st_mtime
    except OSError:
        mtime = float("inf")
    return (died_at.get(failure.local_rank, float("inf")), 0 if failure.exitcode < 0 else 1, failure.timestamp, mtime)


def _running_workers(pcontext: PContext) -> Callable[[], bool] | None:
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


def _exitcode(pcontext: PContext, local_rank: int) -> int:
    """Exit code of a worker of a MultiprocessContext (1, like an uncaught exception, if unknown)."""
    processes = worker_processes(pcontext)
    exitcode = processes[local_rank].exitcode if processes and local_rank < len(processes) else None
    return 1 if exitcode is None else exitcode


def _default_close_timeout(pcontext: PContext, grace: float, on_close: Callable[[], None]) -> None:
    """CHANGE: when one worker fails, torch's ``PContext._poll`` calls ``self.close()`` with its 30 s default
    SIGTERM->SIGKILL wait for the surviving workers, inside ``_monitor_workers``. Survivors blocked in a
    collective with the dead worker ignore SIGTERM, so that alone costs 30 s per crash. Calls without an
    explicit timeout get ``grace`` instead; explicit ones (``--shutdown-timeout`` on agent exit) are kept."""
    original = pcontext.close

    def close(death_sig: signal.Signals | None = None, timeout: float | None = None) -> None:
        on_close()
        wait = grace if timeout is None else timeout
        began = time.monotonic()
        _stop_workers(pcontext, death_sig or signal.SIGTERM, wait)
        original(death_sig, max(0.0, wait - (time.monotonic() - began)))  # type: ignore[arg-type]  # torch says int; any seconds work

    pcontext.close = close  # type: ignore[method-assign]  # this instance only (CHANGE above)


def _stop_workers(pcontext: PContext, sig: signal.Signals, grace: float) -> None:
    """Signal every live worker, wait up to ``grace`` s, SIGKILL the rest; a worker whose script already
    returned is let go at once (``_stop_releasing_returned_workers``). Every path by which the agent stops its
    workers goes through here: before, the stop on a worker's death (``_monitor_workers``) skipped the release,
    and a warm worker that exited 0 on the SIGTERM sat in torch's ``_wrap`` for the whole grace (30 s with
    ``--stop-grace 30``, long enough for the agent's lease to lapse on a loaded machine)."""
    began = time.monotonic()
    _stop_releasing_returned_workers(pcontext, sig, grace)
    # CHANGE (warm workers): torch's MultiprocessContext signals only each worker's PID; warm workers lead
    # their own process group like torchrun's subprocess workers, so signal the group (DataLoader workers
    # too), as torch's SubprocessHandler.close does. torch's close then only joins and closes log tails.
    remaining = max(0.0, grace - (time.monotonic() - began))
    terminate_processes(worker_processes(pcontext) or [], remaining, sig)


_RELEASED: weakref.WeakKeyDictionary[PContext, set[int]] = weakref.WeakKeyDictionary()
"""Local ranks of each process context that had returned (script done, exit 0) and were SIGKILLed only to let
them out of torch's ``_wrap``: their -9 is not a failure (``complete_failures``), as under torchrun they exit 0."""


def _stop_releasing_returned_workers(pcontext: PContext, death_sig: signal.Signals, timeout: float) -> None:
    """CHANGE: a function worker that already returned waits in torch's ``_wrap`` for the agent's next poll
    (``_worker_finished_event``); an agent that is closing never polls again, so a worker that exited 0 on
    SIGTERM (a hand-written save handler) held the agent and its lease for the whole 30 s timeout. Setting
    the event is unsafe (torch: it deadlocks if a process died inside ``wait()``), so a worker whose return
    value is already queued, i.e. that has nothing left to do, is SIGKILLed at once instead."""
    processes = worker_processes(pcontext)
    ret_vals = worker_return_values(pcontext)
    if not processes or ret_vals is None:
        return
    from multiprocessing.connection import wait as wait_for_sentinels

    released = _RELEASED.setdefault(pcontext, set())

    for proc in processes:
        if proc.is_alive() and proc.pid is not None:  # alive implies started, so a pid
            signal_worker(proc.pid, death_sig)  # its process group when it leads one (warm workers)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [(rank, proc) for rank, proc in enumerate(processes) if proc.is_alive()]
        if not alive:
            return
        for rank, proc in alive:
            queue = ret_vals.get(rank)
            if queue is not None and not queue.empty() and proc.pid is not None:
                released.add(rank)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        wait_for_sentinels([proc.sentinel for _, proc in alive], timeout=min(0.1, max(0.0, deadline - time.monotonic())))


def _tie_entrypoint_to_agent(spec: WorkerSpec) -> WorkerSpec:
    """Route the worker command through the PDEATHSIG exec shim (same PID, env and stdio after exec)."""
    if isinstance(spec.entrypoint, str):
        entrypoint, args = shim_command(spec.entrypoint, tuple(spec.args))
        spec.entrypoint = entrypoint
        spec.args = args
    elif callable(spec.entrypoint):
        spec.entrypoint = PdeathsigEntrypoint(spec.entrypoint)
    return spec
