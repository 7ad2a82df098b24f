"""Planned membership changes: pure decisions of what the agent tells its workers and when it acts.

A *planned* change is one the group hears about before it happens: this node got a preemption notice, a
peer published one (through the rendezvous), or a node waits to join. Instead of killing the workers and
rolling back to the last periodic checkpoint, the agent posts a :class:`~elastic.preemption.WorkerNotice`
to its workers' mailbox; workers that use :class:`~elastic.preemption.Preemption` agree on a step, commit
it, acknowledge and exit 0. Then the leaving agent revokes its lease and exits 0 (``--planned-leave-exit-code``
for controllers that recreate only failed pods, see :func:`leave_exit_code`), and the others re-form at
once at the new size and resume from that step: zero steps lost. These restarts are not charged against
``--max-restarts``.

The notice tells the workers when the agent will stop waiting (``save_by``, :func:`with_save_by`); a save
that cannot commit by then is not started (``elastic.preemption.decide_planned_save``): the workers
acknowledge the agreed step as not saved, and the agent leaves or re-forms at once, recording why
(:func:`all_stopped`); the new group resumes from the last committed step.

What is decided here is a function of plain data (:class:`GroupView`); the agent does the I/O.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

# The environment names live in elastic.api with the others; re-exported here, where they were first defined.
from elastic.api import ENV_PLANNED_LEAVE_EXIT_CODE as ENV_PLANNED_LEAVE_EXIT_CODE
from elastic.api import ENV_RESIZE_TIMEOUT as ENV_RESIZE_TIMEOUT
from elastic.notice import Notice
from elastic.preemption import WorkerNotice


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
