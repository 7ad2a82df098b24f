"""``SpotrunAgent``: torch's ``LocalElasticAgent`` with fast, membership-aware recovery.

Everything torch does for workers is kept (environment, ranks, error files, log redirection, exit barrier). The
core is torch's overrides, the monitor loop and the exit barrier; each departure from torch (2.13 to 2.15) is
marked ``CHANGE:``, and the torch internals it relies on are checked by ``elastic.torch_internals``. The
features plug in through ``elastic.agent_hooks``: the rendezvous view and its outage clock (``membership``),
hang detection (``hangwatch``), restore reports (``restores``), vitals (``vitals``) and planned changes
(``planned``). Worker processes are stopped and judged by ``agent_procs``; failures decided by ``failures``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.metrics import put_metric
from torch.distributed.elastic.multiprocessing import LogsSpecs, PContext

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
    WorkersStopped,
    WorkersStopping,
)
from elastic.agent_procs import (
    complete_failures,
    default_close_timeout,
    quiet_worker_failure_tracebacks,
    stop_processes,
    tie_entrypoint_to_agent,
    wait_for_workers_or,
)
from elastic.api import EventSink, FailureCause, RecoveryCause, RecoveryEvent
from elastic.config import AgentSettings
from elastic.exit_barrier import ExitBarrier
from elastic.failures import FailureAction, decide_on_failure, recovery_cause_of_failure, should_refund
from elastic.hangwatch import HangFeature, HangWatch
from elastic.membership import MembershipView
from elastic.metrics import AgentMetrics
from elastic.notice import Notice
from elastic.planned.hook import LeaveForNotice, PlannedFeature
from elastic.progress import ProgressBoard
from elastic.restores import RestoreReports
from elastic.torch_internals import check_agent_internals, worker_processes
from elastic.vitals import Vitals, VitalsFeature
from elastic.worker.mailbox import Mailbox
from elastic.workers import DeathClock, fall_back_to_plain_workers

__all__ = ["SpotrunAgent"]

logger = logging.getLogger(__name__)


class SpotrunAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that recovers from node loss, worker crashes and scale-up in seconds.

    Beyond torch's arguments: ``settings`` (recovery knobs), ``events`` (``events.jsonl``), ``mailbox`` (the
    workers' mailbox: None, no planned stops), ``clock`` (monotonic, injected), ``memory_dir`` (the memory tier
    keeper directory), ``script_imports_helper`` (the script imports ``elastic.preemption``), ``metrics``.
    """

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
        if tie_workers_to_agent:
            # CHANGE: workers die with the agent (torch's start_new_session leaves orphans on agent SIGKILL).
            spec = tie_entrypoint_to_agent(spec)
        super().__init__(spec, logs_specs, start_method=start_method, exit_barrier_timeout=exit_barrier_timeout,
                         log_line_prefix_template=log_line_prefix_template, shutdown_timeout=shutdown_timeout)
        check_agent_internals(self)
        quiet_worker_failure_tracebacks()
        self._settings = settings
        self._events = events
        self._round = 0
        self._charged_restart_pending = False
        self._previous_group_world_size: int | None = None
        self._death_clock: DeathClock | None = None
        self._close_started_at: float | None = None
        self._recovery_cause: RecoveryCause | None = None
        """Why the current recovery happens: on every event until its workers_started (None at first start)."""
        self._finished = False

        self.membership = MembershipView(spec.rdzv_handler, self, clock=clock)
        """The rendezvous as the monitor loop sees it: membership changes, lost peers, the outage clock."""
        watch = (HangWatch(settings.hang, ProgressBoard(spec.rdzv_handler.get_run_id()), ctx=self.ctx)
                 if settings.hang is not None else None)
        self.hang = HangFeature(watch, self) if watch is not None else None
        """Hang detection (``elastic.hang``), when on."""
        self.planned = PlannedFeature(self, self.membership, settings, mailbox, memory_dir=memory_dir,
                                      script_imports_helper=script_imports_helper, clock=clock)
        """Planned changes: notices, the stop posted to the workers, leaving and re-forming."""
        self.exit_barrier = ExitBarrier(self.membership, timeout=exit_barrier_timeout, ctx=self.ctx,
                                        leave_by=self._leave_by)
        vitals = Vitals(metrics=metrics, emit=self.emit, memory_dir=memory_dir, ctx=self.ctx,
                        straggler=settings.straggler if watch is not None else None)
        features: list[AgentFeature | None] = [
            self.membership,
            self.hang,
            RestoreReports(memory_dir, self, clock=clock) if memory_dir is not None else None,
            VitalsFeature(vitals, self, self.membership, watch),
            self.planned,
        ]
        self._features = [feature for feature in features if feature is not None]
        """Called in this order at each hook (``elastic.agent_hooks``)."""

    @property
    def exit_status(self) -> int:
        """0, or ``--planned-leave-exit-code`` after a leave with training unfinished (``leave_exit_code``)."""
        return self.planned.exit_status

    @property
    def finished(self) -> bool:
        """The workers succeeded and the exit barrier passed (not a leave or a failure): the launcher keeps the
        rendezvous' ``finished`` marker."""
        return self._finished

    def release(self) -> None:
        """Remove what the agent keeps outside its process (progress files); called once at exit."""
        for feature in self._features:
            feature.close()

    # --- notices (the launcher's calls) ------------------------------------------------------------------------

    def receive_notice(self, notice: Notice) -> None:
        """This node will be taken away at ``notice.deadline`` (from the poller thread or a signal handler)."""
        self.planned.receive(notice)

    def receive_early_notice(self, signum: int, received_at: float) -> None:
        """A notice signal the launcher recorded before this agent's handlers were installed."""
        self.planned.receive_early(signum, received_at)

    def install_notice_handlers(self) -> None:
        """Make the notice signals (SIGTERM, ``--preempt-signal``) preemption notices to this agent (main thread)."""
        self.planned.install_signal_handlers()

    # --- what the features may ask (agent_hooks.AgentHost) ---------------------------------------------------

    @property
    def worker_group(self) -> WorkerGroup:
        return self._worker_group

    @property
    def pcontext(self) -> PContext | None:
        return self._pcontext

    def ctx(self) -> str:
        wg = self._worker_group
        return f"[{wg.spec.role} round={self._round} group_rank={wg.group_rank}/{wg.group_world_size}]"

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
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
        if self._recovery_cause is None:
            self._recovery_cause = cause

    def monitor(self) -> RunResult:
        return self._monitor_workers(self._worker_group)

    def stop_workers(self) -> None:
        self._stop_workers(self._worker_group)

    def restart_workers(self) -> None:
        self._restart_workers(self._worker_group)

    def wait_for_workers(self, timeout: float, done: Callable[[], bool], poll: float) -> None:
        wait_for_workers_or(self._pcontext, timeout, done, poll)

    def reform_in_place(self, assign: Callable[[WorkerGroup, int], None]) -> None:
        group = self._worker_group
        previous = self.membership.round_members()
        self._rendezvous(group)  # torch's: new ranks in group.workers, this round's MASTER_ADDR/PORT
        current = self.membership.round_members()
        if self.planned.in_place.falls_back(previous, current):  # a new node, or a worker gave up waiting
            logger.info("%s the re-form in place falls back to a restart of the workers", self.ctx())
            self._stop_workers(group)
            for local_rank, worker_id in self._start_workers(group).items():  # torch's _initialize_workers
                group.workers[local_rank].id = worker_id
            group.state = WorkerState.HEALTHY
            return
        assert self._pcontext is not None, "only with running workers"
        pids = self._pcontext.pids()
        for worker in group.workers:
            worker.id = pids[worker.local_rank]  # what torch's _start_workers records; its monitor compares them
        assign(group, group.spec.max_restarts - self._remaining_restarts)
        group.state = WorkerState.HEALTHY
        self._workers_started(WorkersStarted(pids, {w.local_rank: w.global_rank for w in group.workers}, in_place=True))
        self.emit(RecoveryEvent.WORKERS_STARTED, pids=sorted(pids.values()), in_place=True)
        self._recovery_cause = None

    # --- torch's overrides ---------------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.emit(RecoveryEvent.RENDEZVOUS_STARTED)
        previous_members = self.membership.round_members()
        with self.planned.between_rounds():  # CHANGE: a notice now (or already) is a leave at once
            super()._rendezvous(worker_group)
        new_members = self.membership.round_members()
        self._round += 1
        assert worker_group.group_world_size is not None, "torch's _rendezvous sets the group world size"
        if should_refund(charged=self._charged_restart_pending,
                         previous_group_world_size=self._previous_group_world_size,
                         new_group_world_size=worker_group.group_world_size,
                         previous_members=previous_members, new_members=new_members):
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
        # group_rank is set by the rendezvous that always precedes a start
        starting = WorkersStarting(worker_group.group_rank or 0, worker_group.spec.local_world_size)
        for feature in self._features:
            feature.on_workers_starting(starting)
        pids = super()._start_workers(worker_group)
        if self._pcontext is not None:
            # Before the notice handlers: a shutdown they start must already release returned workers at once.
            self._close_started_at = None
            default_close_timeout(self._pcontext, self._settings.stop_grace, self._workers_closing)
            self._start_death_clock(self._pcontext)
        self._workers_started(WorkersStarted(dict(pids), {w.local_rank: w.global_rank for w in worker_group.workers}))
        self.emit(RecoveryEvent.WORKERS_STARTED, pids=sorted(pids.values()))
        self._recovery_cause = None
        return pids

    def _workers_started(self, event: WorkersStarted) -> None:
        # CHANGE: PContext.start put torch's handlers in (an immediate shutdown): ours are back as soon as the planned
        # feature knows the workers run. Blocking the signals over the start would leak the mask into the workers.
        self.planned.on_workers_started(event)
        self.install_notice_handlers()
        for feature in self._features:
            if feature is not self.planned:
                feature.on_workers_started(event)

    def _workers_closing(self) -> None:
        """Called before the agent signals its workers to stop them (every path goes through the process
        context's ``close`` or the early termination in ``_monitor_workers``)."""
        if self._close_started_at is None:
            self._close_started_at = time.monotonic()
        self.planned.workers_closing()

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
            # loaded machine, and torch's join then saw it first.
            processes = worker_processes(self._pcontext)
            dead = [rank for rank, proc in enumerate(processes or []) if proc.exitcode not in (None, 0)]
            if dead:
                if self._death_clock is not None:
                    self._death_clock.note(dead)  # before the close starts: they died on their own
                self._workers_closing()
                stop_processes(self._pcontext, signal.SIGTERM, self._settings.stop_grace)
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

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # CHANGE: torch calls self._shutdown() with its 30 s default between SIGTERM and SIGKILL; workers
        # blocked in a collective with a dead peer ignore SIGTERM, so use a short grace.
        for feature in self._features:
            feature.on_workers_stopping(WorkersStopping())
        self._shutdown(timeout=self._settings.stop_grace)  # type: ignore[arg-type]  # torch says int; any seconds work
        for feature in self._features:
            feature.on_workers_stopped(WorkersStopped())
        self.emit(RecoveryEvent.WORKERS_STOPPED)

    # --- the monitor loop ------------------------------------------------------------------------------------------

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """CHANGE (overlapping faults): a notice with nothing to save (between rounds, workers that have not
        built their helpers) interrupts whatever the agent waits in, and the node leaves at once, as a planned
        leave (``LeaveForNotice``)."""
        try:
            return self._monitor_loop(role)
        except LeaveForNotice as notice:
            return self.planned.leave_between_rounds(notice.why)
        finally:
            self.planned.run_over = True

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
            if self.planned.waiting_for_stop:
                self.planned.wait_for_stop(spec.monitor_interval)
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
            if state == WorkerState.SUCCEEDED:
                logger.info("%s worker group finished; waiting for other agents", self.ctx())
                self.planned.in_exit_barrier = True
                try:
                    barrier_passed = self._exit_barrier_unless_peers_left()
                finally:
                    self.planned.in_exit_barrier = False
                if not barrier_passed:  # CHANGE: torch waits up to 300 s for peers that left, then reports success.
                    self.begin_recovery(RecoveryCause.PEER_LOST)
                    self.emit(RecoveryEvent.FAILURE_DETECTED, cause=FailureCause.PEERS_LEFT_AT_EXIT.value)
                    self._restart_workers(self._worker_group)
                    continue
                self.emit(RecoveryEvent.RUN_FINISHED, state=state.name)
                self._finished = True
                return run_result
            if state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:
                result = self._handle_failure(run_result)
                if result is not None:
                    self.emit(RecoveryEvent.RUN_FINISHED, state=WorkerState.FAILED.name)
                    return result
            elif state == WorkerState.HEALTHY:
                # CHANGE: also reacts to a lost peer (membership_changed), not only to waiting nodes.
                if self.membership.changed():
                    self.begin_recovery(self.membership.cause())
                    logger.info("%s membership changed (%s); restarting worker group (not counted)", self.ctx(),
                                self._recovery_cause.value if self._recovery_cause else "?")
                    self.emit(RecoveryEvent.FAILURE_DETECTED, cause=FailureCause.MEMBERSHIP_CHANGE.value)
                    if self._recovery_cause is RecoveryCause.PEER_LOST and self.planned.in_place.after_peer_loss():
                        continue  # the workers snapshotted, wait in place and re-formed: no restart
                    self._restart_workers(self._worker_group)
            else:
                raise RuntimeError(f"[{role}] Worker group in {state.name} state")

    def _tick_features(self, tick: Tick) -> Verdict:
        for feature in self._features:
            if not isinstance(verdict := feature.on_tick(tick), Proceed):
                return verdict
        return PROCEED

    def _leave_by(self) -> float | None:
        own = self.planned.own
        return None if own is None else own.deadline - self._settings.stop_grace

    def _exit_barrier_unless_peers_left(self) -> bool:
        """torch's exit barrier, except that it returns False at once when a peer of this round is gone."""
        size, store = self._worker_group.group_world_size, self._store
        if size is not None and size <= 1:
            return True  # CHANGE: no peer to wait for (torch's barrier of one only touches the store)
        if self.membership.notices is None or store is None or size is None:
            self._exit_barrier()
            return True
        return self.exit_barrier.wait(store, size)

    def _handle_failure(self, run_result: RunResult) -> RunResult | None:
        """Restart the group (returns None) or give up (returns the failed result)."""
        failures = {rank: f.exitcode for rank, f in run_result.failures.items()}
        fell_back = self.planned.in_place.report_fallback(None, worker_failed=True)  # CHANGE (in place): uncharged
        # CHANGE: a peer lost (confirmed by a probe; at the last restart, waited for) or whose workers restart.
        peer = self.membership.peer_cause_of_failure(
            last_chance_wait=self._settings.peer_loss_grace if self._remaining_restarts == 0 else None)
        action = decide_on_failure(remaining_restarts=self._remaining_restarts, peer_lost=peer is not None or fell_back)
        hung = self.hang is not None and self.hang.hung
        cause = FailureCause.HANG if hung else (
            FailureCause.WORKER_FAILURE_WITH_PEER_LOSS if peer is RecoveryCause.PEER_LOST else FailureCause.WORKER_FAILURE)
        self.begin_recovery(recovery_cause_of_failure(hung=hung, peer=peer))
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
        if peer is None:  # CHANGE (in place): peers whose collectives with ours may hang (NCCL) abort them
            self.membership.announce_restart()
        self._restart_workers(self._worker_group)
        return None
