"""Planned membership changes: pure decisions of what the agent tells its workers and when it acts.

A *planned* change is one the group hears about before it happens: this node got a preemption notice, a
peer published one (through the rendezvous), or a node waits to join. The agent posts a
:class:`~elastic.preemption.WorkerNotice` to its workers' mailbox; workers that use
:class:`~elastic.preemption.Preemption` agree on a step, commit it, acknowledge and exit 0. The leaving agent
then revokes its lease and exits (``--planned-leave-exit-code``, see :func:`leave_exit_code`), and the others
re-form at once and resume from that step, uncharged.

The notice tells the workers when the agent will stop waiting (``save_by``, :func:`with_save_by`); a save
that cannot commit by then is not started (``elastic.preemption.decide_planned_save``): the workers
acknowledge the agreed step as not saved, and the agent leaves or re-forms at once, recording why
(:func:`all_stopped`); the new group resumes from the last committed step.

Everything here is a function of plain data; the agent's hook (``elastic.planned.hook``) does the I/O.
:class:`PlannedChanges` holds one agent's state (its own notice, what it posted, the peers' deadlines) and
answers each monitor tick of a healthy group with actions (:meth:`PlannedChanges.tick`: a :class:`TickView` in,
a :class:`PlannedDecision` out), as ``elastic.rendezvous.state.decide`` does for rendezvous rounds.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

# The environment names live in elastic.api with the others; re-exported for callers that import them from here.
from elastic.api import ENV_PLANNED_LEAVE_EXIT_CODE as ENV_PLANNED_LEAVE_EXIT_CODE
from elastic.api import ENV_RESIZE_TIMEOUT as ENV_RESIZE_TIMEOUT
from elastic.notice import Notice, earliest
from elastic.worker.mailbox import WorkerNotice


@dataclass(frozen=True, slots=True)
class GroupView:
    """What the agent knows about its group at one monitor tick."""

    now: float
    """Wall-clock seconds (deadlines are wall-clock: they cross machines)."""
    own: Notice | None = None
    peer_deadlines: dict[str, float] = field(default_factory=dict)
    """Other participants of this round that published a notice -> their deadline."""
    lost: frozenset[str] = frozenset()
    """Participants of this round that are gone."""
    membership_changed: bool = False


def worker_notice(view: GroupView, resize_timeout: float) -> WorkerNotice | None:
    """The notice to post to the workers now, or None. The earliest deadline binds."""
    if view.own is not None:
        return WorkerNotice("preempt", view.own.deadline, view.own.source)
    if view.peer_deadlines:
        node, deadline = min(view.peer_deadlines.items(), key=lambda item: item[1])
        return WorkerNotice("peer_preempt", deadline, f"node {node}")
    if view.membership_changed and not view.lost:
        return WorkerNotice("resize", view.now + resize_timeout, "a node is waiting to join")
    return None


def with_save_by(notice: WorkerNotice, stop_grace: float) -> WorkerNotice:
    """The notice as posted: ``save_by`` is when :func:`while_posted` gives up on the workers, so they can
    skip a save that would not commit by then (None without a deadline: no bound)."""
    save_by = None if notice.deadline is None else notice.deadline - stop_grace
    return dataclasses.replace(notice, save_by=save_by)


def unplanned_loss(view: GroupView) -> frozenset[str]:
    """Peers gone without a notice (crashed): their workers are not saving anything, so waiting is pointless."""
    return view.lost - frozenset(view.peer_deadlines)


class PlannedStep(enum.Enum):
    """What the agent does while a planned stop is posted and its workers are still running."""

    WAIT = "wait"
    """Let the workers reach the agreed step and commit it."""
    ABANDON = "abandon"
    """Stop waiting: the deadline (minus the stop grace) has passed, or a peer crashed meanwhile."""


def while_posted(view: GroupView, posted: WorkerNotice, *, stop_grace: float) -> PlannedStep:
    """Wait for the agreed step unless there is no time left or a peer vanished without notice."""
    if unplanned_loss(view):
        return PlannedStep.ABANDON
    if posted.deadline is not None and view.now >= posted.deadline - stop_grace:
        return PlannedStep.ABANDON
    return PlannedStep.WAIT


def wait_for_helpers(*, seen_before: bool, now: float, deadline: float, stop_grace: float) -> bool:
    """With this node's notice pending and not every local worker running a ``Preemption`` helper: wait for
    them (True) or leave at once without a save (False). Workers that used the helper before are only
    starting up (a restart, a checkpoint load) and can still save while the deadline leaves room; workers
    that never did cannot be asked to stop at a step, and waiting would only keep the peers from re-forming."""
    return seen_before and now < deadline - stop_grace


class HelperOutlook(enum.Enum):
    """Whether this node's workers will stop at an agreed step for a notice (see :func:`helper_outlook`)."""

    READY = "ready"
    """Every local worker built its ``Preemption`` helper: post the stop, they commit an agreed step."""
    RESTARTING = "restarting"
    """Not built yet, but this agent's workers built them in an earlier group: they are restarting (imports,
    the restore, perhaps from the memory tier), and will commit an agreed step while the deadline leaves room."""
    COMING = "coming"
    """Not built yet in this agent's first group, but the script will build one (it imports the helper's
    module: ``announced``): it is starting (imports, ``init_process_group``, the restore) and has trained
    nothing since its restore, so the last committed step is the state: leaving now loses nothing (a planned
    leave, not a shutdown)."""
    NEVER = "never"
    """No sign of a helper: a plain torchrun script (SIGTERM: torchrun's immediate shutdown, as before)."""


def helper_outlook(*, ready: bool, seen_before: bool, announced: bool) -> HelperOutlook:
    """Whether the workers will stop at an agreed step, from plain facts.

    Args:
        ready: every local worker built its helper (``helper-{local_rank}``).
        seen_before: this agent's workers built helpers in an earlier group.
        announced: the script will build one: its source imports the helper's module
            (``elastic.launcher.imports_helper``, read once at start), or a local worker of this group
            imported it (``coming-{local_rank}``: a helper imported through another module of the script).
    """
    if ready:
        return HelperOutlook.READY
    if seen_before:
        return HelperOutlook.RESTARTING
    if announced:
        return HelperOutlook.COMING
    return HelperOutlook.NEVER


WHY_BEFORE_HELPERS = ("the notice came before the workers built their Preemption helpers: they trained nothing "
                      "since their restore, the last committed step is the state")
"""The ``why`` of a planned leave taken while the workers start (:attr:`HelperOutlook.COMING`)."""


def leave_exit_code(*, workers_finished: bool, configured: int) -> int:
    """Exit status of an agent that left the group for its own notice.

    ``configured`` (``--planned-leave-exit-code``) for every leave with training unfinished, whether the
    peers go on or all of them were preempted at once: a controller that recreates only failed pods (a
    Kubernetes Indexed Job) must bring this index back, and a whole preempted group exiting 0 would mark every
    index succeeded and complete the Job with training unfinished. 0 when the workers had already finished
    the run (they exited 0 without stopping at an agreed step): the job is over, a recreated pod would only
    wait for peers that are gone."""
    return 0 if workers_finished else configured


@dataclass(frozen=True, slots=True)
class Stopped:
    """Where the local workers stopped for a planned change."""

    step: int
    """The agreed step."""
    saved: bool
    why: str | None = None
    """Why it was not saved (None when saved)."""

    @property
    def committed(self) -> int | None:
        """The step to report as committed: None when it was not saved (the group resumes from the last
        committed step, which the agent does not know)."""
        return self.step if self.saved else None


def all_stopped(saved: dict[int, int], unsaved: dict[int, tuple[int, str]], local_world_size: int) -> Stopped | None:
    """Every local worker acknowledged one agreed step, saved (``saved``: local rank -> step) or not
    (``unsaved``: local rank -> (step, why)); None if one has not (or they disagree). One unsaved
    acknowledgement makes the step unsaved: the ranks decide together, but a step is committed only if all
    say so."""
    ranks = range(local_world_size)  # a stray ack-99.json must not stand in for a rank that is still saving
    saved = {rank: step for rank, step in saved.items() if rank in ranks}
    unsaved = {rank: record for rank, record in unsaved.items() if rank in ranks}
    steps = {*saved.values(), *(step for step, _ in unsaved.values())}
    if len(saved.keys() | unsaved.keys()) < local_world_size or len(steps) != 1:
        return None
    step = steps.pop()
    if not unsaved:
        return Stopped(step, saved=True)
    return Stopped(step, saved=False, why=unsaved[min(unsaved)][1])


# --- the coordinator: one agent's planned-change state, one tick at a time -----------------------------------


class PlannedTick(enum.Enum):
    """Outcome of one monitor tick of a healthy group, as far as planned changes go."""

    NONE = "none"
    """Nothing planned (or a crash, which the agent's restart path handles)."""
    WAITING = "waiting"
    """A planned stop is posted; the workers are on their way to the agreed step."""
    LEFT = "left"
    """This node left the group (its notice could not wait for the workers)."""


@dataclass(frozen=True, slots=True)
class TickView:
    """What the agent saw at one monitor tick of a healthy group (read by the agent; plain data)."""

    now: float
    """Wall-clock seconds (deadlines are wall-clock: they cross machines)."""
    peer_notices: Mapping[str, float] = field(default_factory=dict)
    """Other participants of this round whose notice is published now -> their deadline."""
    lost: frozenset[str] = frozenset()
    """Participants of this round that are gone."""
    membership_changed: bool = False
    helpers_ready: bool = False
    """Every local worker constructed a ``Preemption`` helper (it will stop by itself at an agreed step)."""
    helpers_announced: bool = False
    """The script will build a helper (see :func:`helper_outlook`)."""


@dataclass(frozen=True, slots=True)
class PostStop:
    """Post ``notice`` to the workers' mailbox (and record ``planned_stop_posted``)."""

    notice: WorkerNotice


@dataclass(frozen=True, slots=True)
class AbandonStop:
    """Stop waiting for the posted stop (record ``planned_stop_abandoned`` with ``why``)."""

    reason: str
    """The posted notice's reason."""
    why: str


@dataclass(frozen=True, slots=True)
class LeaveNow:
    """Stop the workers and leave the group without a saved step (``why`` goes in ``planned_leave``)."""

    why: str


@dataclass(frozen=True, slots=True)
class Reform:
    """Restart the worker group (a membership change: not counted against ``--max-restarts``)."""


PlannedAction = PostStop | AbandonStop | LeaveNow | Reform


@dataclass(frozen=True, slots=True)
class PlannedDecision:
    """What :meth:`PlannedChanges.tick` decided: the actions to perform, in order, and the tick's outcome."""

    outcome: PlannedTick
    actions: tuple[PlannedAction, ...] = ()


class AfterSuccess(enum.Enum):
    """What the agent does when its local workers all exited 0."""

    LEAVE = "leave"
    """Leave the group for this node's notice (the workers stopped for it, or it was posted)."""
    REFORM = "reform"
    """The workers stopped at the agreed step for a peer's notice or a joining node: re-form and resume."""
    FINISH = "finish"
    """Training finished: the exit barrier, then success."""


class SignalAction(enum.Enum):
    """What the agent does with a notice signal (SIGTERM, ``--preempt-signal``)."""

    LEAVE_NOW = "leave_now"
    """Between rounds: no worker to save anything; take the notice and leave at once, as a planned leave."""
    SHUT_DOWN = "shut_down"
    """torch's immediate shutdown: a second SIGTERM, or workers that do not use the helper."""
    NOTICE = "notice"
    """Take it as this node's notice; the monitor loop acts on it."""
    IGNORE = "ignore"
    """The run is over (finished or left): nothing runs that the notice could concern."""


class PlannedChanges:
    """One agent's planned-change state: its own notice, the stop posted to its workers, the deadlines of its
    peers' notices in this round and whether its workers ever ran ``Preemption`` helpers.

    No I/O: the agent reads the mailbox and the rendezvous into a :class:`TickView`, calls :meth:`tick` and
    performs the actions. :meth:`receive` may be called from another thread or a signal handler (it is one
    assignment).
    """

    def __init__(self, *, stop_grace: float, resize_timeout: float) -> None:
        """Args:
            stop_grace: seconds before a deadline at which waiting for the workers stops (``--stop-grace``).
            resize_timeout: how long a joining node's resize may take (``--resize-timeout``).
        """
        self.stop_grace = stop_grace
        self.resize_timeout = resize_timeout
        self.own: Notice | None = None
        """This node's notice (the earliest deadline, once received)."""
        self.posted: WorkerNotice | None = None
        """The stop posted to the current worker group, if any."""
        self.helpers_seen = False
        """A local worker group of this agent ran Preemption helpers once (they come back after a restart)."""
        self._published = False
        self._peer_deadlines: dict[str, float] = {}
        """Peer notices seen in this round: kept after the peer left (its key goes with its lease)."""

    @property
    def peer_deadlines(self) -> dict[str, float]:
        """Peers of this round that published a notice -> its deadline (kept after they left)."""
        return dict(self._peer_deadlines)

    @property
    def leaving(self) -> bool:
        """This node has a notice and posted the stop for it: its workers head for the agreed step to leave."""
        return self.own is not None and self.posted is not None

    def receive(self, notice: Notice) -> None:
        """This node will be taken away at ``notice.deadline`` (the earliest deadline binds)."""
        self.own = earliest(self.own, notice)

    def to_publish(self) -> Notice | None:
        """This node's notice the first time it is asked for after it arrived (published once), else None."""
        if self.own is None or self._published:
            return None
        self._published = True
        return self.own

    def new_group(self) -> None:
        """A new worker group starts: nothing is posted to it, and the peers' notices are of the next round."""
        self.posted = None
        self._peer_deadlines = {}

    def tick(self, view: TickView) -> PlannedDecision:
        """While the group is healthy: post a planned stop to the workers, wait for it, or give up on it.

        Args:
            view: what the agent saw at this tick.

        Returns:
            The actions to perform in order, and the outcome: ``WAITING`` while a stop is posted (or the
            group re-forms after one was abandoned), ``LEFT`` when this node leaves, else ``NONE``.
        """
        if not self.helpers_seen:
            self.helpers_seen = view.helpers_ready
        for node, deadline in view.peer_notices.items():
            self._peer_deadlines.setdefault(node, deadline)
        group = GroupView(now=view.now, own=self.own, peer_deadlines=dict(self._peer_deadlines), lost=view.lost,
                          membership_changed=view.membership_changed)
        if self.posted is not None:
            return self._while_posted(group, self.posted)
        notice = worker_notice(group, self.resize_timeout)
        if notice is None or unplanned_loss(group):
            return PlannedDecision(PlannedTick.NONE)  # nothing planned, or a crash: the agent's restart path
        if not view.helpers_ready:
            own = self.own
            if own is not None and (action := self._without_helpers(view, own)) is not None:
                return PlannedDecision(PlannedTick.LEFT, (action,))
            return PlannedDecision(PlannedTick.NONE)
        self.posted = with_save_by(notice, self.stop_grace)  # the workers skip a save that cannot fit
        return PlannedDecision(PlannedTick.WAITING, (PostStop(self.posted),))

    def outlook(self, *, helpers_ready: bool, announced: bool) -> HelperOutlook:
        """:func:`helper_outlook` with this agent's history."""
        return helper_outlook(ready=helpers_ready, seen_before=self.helpers_seen, announced=announced)

    def _without_helpers(self, view: TickView, own: Notice) -> LeaveNow | None:
        """This node has a notice and not every local worker runs a helper: leave now or wait for them."""
        outlook = self.outlook(helpers_ready=False, announced=view.helpers_announced)
        if outlook is HelperOutlook.COMING:
            return LeaveNow(WHY_BEFORE_HELPERS)
        if outlook is HelperOutlook.RESTARTING:
            if wait_for_helpers(seen_before=True, now=view.now, deadline=own.deadline, stop_grace=self.stop_grace):
                return None
            return LeaveNow("the workers did not start their Preemption helper in time")
        # The workers cannot stop at an agreed step: leave now so the peers re-form at once.
        return LeaveNow("the workers do not use elastic.preemption.Preemption")

    def _while_posted(self, group: GroupView, posted: WorkerNotice) -> PlannedDecision:
        if while_posted(group, posted, stop_grace=self.stop_grace) is PlannedStep.WAIT:
            return PlannedDecision(PlannedTick.WAITING)
        lost = unplanned_loss(group)
        why = f"peer(s) {sorted(lost)} vanished without notice" if lost else "the deadline left no time to save"
        self.posted = None
        abandon = AbandonStop(posted.reason, why)
        if self.own is not None:
            return PlannedDecision(PlannedTick.LEFT, (abandon, LeaveNow(why)))
        return PlannedDecision(PlannedTick.WAITING, (abandon, Reform()))

    def after_success(self, stopped: Stopped | None) -> AfterSuccess:
        """The local workers all exited 0; ``stopped``: where they acknowledged an agreed step, if they did."""
        if self.own is not None and (stopped is not None or self.posted is not None):
            return AfterSuccess.LEAVE
        if stopped is not None:
            return AfterSuccess.REFORM
        return AfterSuccess.FINISH

    def on_signal(self, *, between_rounds: bool, sigterm: bool, helpers_ready: bool, announced: bool = False,
                  run_over: bool = False) -> SignalAction:
        """A notice signal arrived.

        Args:
            between_rounds: no workers run (a recovery, a spare, before the first round).
            sigterm: the signal is SIGTERM, which may also insist on a shutdown (a second one).
            helpers_ready: every local worker runs a ``Preemption`` helper.
            announced: the script will build a helper (see :func:`helper_outlook`).
            run_over: the workers finished the run or this node left: nothing to stop or save.
        """
        if run_over:
            return SignalAction.IGNORE
        if between_rounds and self.own is None:
            return SignalAction.LEAVE_NOW
        if sigterm and self.own is not None:
            return SignalAction.SHUT_DOWN
        outlook = self.outlook(helpers_ready=helpers_ready, announced=announced)
        if outlook is HelperOutlook.COMING and self.own is None:
            return SignalAction.LEAVE_NOW
        if outlook is HelperOutlook.NEVER and sigterm:
            return SignalAction.SHUT_DOWN
        return SignalAction.NOTICE
