"""Worker side of a planned stop: one line in the training loop saves the step every rank agrees on.

    from elastic.preemption import Preemption
    preemption = Preemption()                 # after init_process_group, on every rank (collective)
    for ...:
        train_step(); step += 1
        if preemption.save_and_stop(ckpt, step, state):   # a notice: step is committed, leave the loop
            break

The agent tells its workers through the *mailbox* (``elastic.worker.mailbox``: the notice, the helpers, the
acknowledgements, the notice signals and the ``stopping`` mark); this module is the worker's side of it.

Agreement (every rank stops at the same step): notices reach nodes at different times, so the local view
alone would split the group. Every ``sync_every`` steps (the same step numbers on every rank, so the calls
pair up) the ranks all-reduce one int (MAX of "my node has a notice") on a dedicated gloo group (a
``checkpoint.collective.Collective``, bounded by ``timeout``); the first such step at which any rank saw a
notice is the agreed step on every rank. One 8-byte gloo all-reduce every ``sync_every`` steps is
negligible, and the notice is acted on at most ``sync_every`` steps late (deadlines are 30-120 s, steps well
under a second). Between sync steps the call is an integer modulo: no I/O, no collective.

Deadline-aware save: at the agreed step every rank reports how long its last saves took
(``Checkpointer.save_seconds_estimate``) and how long is left before ``save_by``, in one all-gather on the
same group; every rank then decides from the same numbers (:func:`decide_planned_save`): the slowest
estimate times ``save_margin`` (plus :data:`SAVE_SLACK_SECONDS`) against the least time left. When it does
not fit, no rank starts the save (none waits in the checkpointer's collectives for one that skipped): each
acknowledges the step as not saved, with the numbers in ``why``, and leaves the loop at once, so the node is
gone before its deadline instead of being killed mid-save, and the peers re-form without waiting out the
grace; the new group resumes from the last committed step. No estimate (no save yet in this process) or no
``save_by``: the save is tried, as before.

Under stock torchrun (no mailbox) the helper turns SIGTERM to the worker (what torchrun forwards when its
agent is stopped) into the same local notice, so the same loop saves the agreed step there too. Under spotrun
it does the same for the agent's notice signals (``.signals``) unless the agent marked the group ``stopping``.
A script that does not construct the helper keeps its own signal dispositions, as under torchrun.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from elastic.api import PlannedStopVoteError
from elastic.worker.heartbeat import report_step
from elastic.worker.mailbox import Mailbox, WorkerNotice, find_mailbox
from elastic.worker.watcher import PeerLossWatcher, wrapper_watching

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

DEFAULT_SYNC_EVERY = 8
#: How long a rank waits in the vote for its peers. The same as torch's default for gloo groups (what the
#: training's own CPU collectives wait) and the checkpointer's ``collective_timeout``: a shorter bound would
#: fail runs the training tolerates (rank 0 evaluating for minutes between two sync steps), a longer one
#: only delays the error when a peer is gone without its connection closing.
DEFAULT_VOTE_TIMEOUT = timedelta(minutes=30)
DEFAULT_SAVE_MARGIN = 1.5
"""A planned save is started only when the slowest recent save times this fits before ``save_by``: storage
and the host are slower at preemption time (the node is draining) than during steady training."""
SAVE_SLACK_SECONDS = 0.5
"""Added to every estimate: the acknowledgement, the workers' exit and the agent's tick after the commit."""


@runtime_checkable
class SnapshotsEachStep(Protocol):
    """A checkpointer that takes a snapshot after every completed step (``checkpoint.Checkpointer.snapshot``,
    a no-op unless its ``CheckpointConfig(memory=...)`` turns the memory tier on)."""

    def snapshot(self, step: int, state: Any) -> bool: ...


class PlannedSaver(Protocol):
    """What a planned stop needs of a checkpointer (``checkpoint.Checkpointer``): a save and its commit."""

    def save(self, step: int, state: Any) -> object: ...

    def wait(self) -> object: ...


@runtime_checkable
class EstimatesSave(Protocol):
    """A checkpointer that can say how long its next save will take (``Checkpointer.save_seconds_estimate``);
    without it a planned save is always tried."""

    @property
    def save_seconds_estimate(self) -> float | None: ...


def is_sync_step(step: int, sync_every: int) -> bool:
    """Ranks exchange their notice flags at these steps only (the same on every rank)."""
    return step % sync_every == 0


@dataclass(frozen=True, slots=True)
class SaveDecision:
    """Whether the ranks start the planned save (the same on every rank: made from the same numbers)."""

    save: bool
    why: str = ""
    """Why not, with the numbers (empty when saving)."""


def decide_planned_save(step: int, reports: Sequence[Sequence[float | None]], *,
                        margin: float = DEFAULT_SAVE_MARGIN) -> SaveDecision:
    """Start the planned save of ``step``, or not, from every rank's ``[estimate, seconds_left]`` (either None:
    unknown). The slowest estimate must fit, times ``margin`` plus :data:`SAVE_SLACK_SECONDS`, in the least
    time left; without an estimate or without a bound the save is tried (nothing better to go on)."""
    estimates = [e for e, _ in reports if e is not None]
    lefts = [left for _, left in reports if left is not None]
    if not estimates or not lefts:
        return SaveDecision(True)
    needed = max(estimates) * margin + SAVE_SLACK_SECONDS
    left = min(lefts)
    if needed <= left:
        return SaveDecision(True)
    return SaveDecision(False, f"save of step {step} needs ~{needed:.1f} s (estimate "
                               f"{max(estimates):.2f} s x {margin:g} + {SAVE_SLACK_SECONDS:g} s), "
                               f"{max(left, 0.0):.1f} s left before the deadline (less the stop grace)")


def _report(value: Any) -> float | None:
    """A rank's number for the all-gather (JSON: a float or None)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class Preemption:
    """Answers "stop here?" identically on every rank (see the module docstring for the protocol).

    Construct it on every rank after ``init_process_group`` (it creates a gloo group: collective).
    ``timeout`` bounds each vote (see :data:`DEFAULT_VOTE_TIMEOUT`); ``save_margin`` multiplies the save-time
    estimate when deciding whether the planned save fits before the agent's ``save_by``
    (see :data:`DEFAULT_SAVE_MARGIN`).
    """

    def __init__(self, *, sync_every: int = DEFAULT_SYNC_EVERY, process_group: ProcessGroup | None = None,
                 mailbox_dir: str | None = None, timeout: timedelta = DEFAULT_VOTE_TIMEOUT,
                 save_margin: float = DEFAULT_SAVE_MARGIN) -> None:
        """Args:
            sync_every: check for a notice every this many steps (one small all-reduce then; between those
                ``should_stop`` is an integer modulo).
            process_group: the training's group (default: the world); the votes run on a gloo group of its
                own made from it.
            mailbox_dir: the agent's mailbox (default: ``SPOTRUN_NOTICE_DIR``, or found through its link;
                none under stock torchrun, where a SIGTERM to the worker is the notice).
            timeout: how long a vote waits for the peer ranks.
            save_margin: how many times the slowest recent save a planned save may take before the deadline.

        Raises:
            ValueError: ``sync_every`` < 1, ``timeout`` not a positive ``timedelta``, ``save_margin`` < 1.
        """
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1 (steps between notice checks), got {sync_every!r}")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout must be a positive datetime.timedelta (how long a vote waits for the "
                             f"peers), got {timeout!r}")
        if isinstance(save_margin, bool) or not isinstance(save_margin, int | float) or not (
                math.isfinite(save_margin) and save_margin >= 1):
            raise ValueError(f"save_margin must be a number >= 1 (how many times the slowest recent save a "
                             f"planned save is allowed before the deadline), got {save_margin!r}")
        self.sync_every = sync_every
        self.timeout = timeout
        self.save_margin = float(save_margin)
        self.skipped: SaveDecision | None = None
        """Set when the agreed step's save was not started (it could not commit before ``save_by``)."""
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        path = mailbox_dir if mailbox_dir is not None else find_mailbox()
        self.mailbox = Mailbox(path) if path else None
        self.stop_step: int | None = None
        self.last_step: int | None = None
        """The last step passed to :meth:`save_and_stop` (the last one this rank completed): after a peer loss,
        ``elastic.inplace.run`` checks that every survivor stands at the same one."""
        self.notice: WorkerNotice | None = None
        self._signalled: signal.Signals | None = None
        """The notice signal this worker received itself (the first one), if any."""
        from checkpoint.collective import open_collectives  # imports torch: only where a helper is made

        # Our own gloo group (a local identity in a world of one): the vote never interleaves with the
        # training's collectives, and it is gloo whatever the training's backend is.
        (self._vote,) = open_collectives(process_group, timeout, 1)
        # A notice signal to the worker itself is the notice: under stock torchrun (or no launcher) SIGTERM,
        # what torchrun forwards when its agent is stopped; under spotrun the agent's notice signals, which a
        # scheduler that signals the whole job step (Slurm) delivers to the workers too. Under spotrun the
        # agent also stops workers with SIGTERM (restarts, where waiting would only slow recovery): it marks
        # the mailbox `stopping` first, and such a signal ends the worker at once (_on_notice_signal).
        notice_signals = self.mailbox.notice_signals() if self.mailbox is not None else {int(signal.SIGTERM)}
        try:
            for signum in sorted(notice_signals):
                signal.signal(signum, self._on_notice_signal)
        except ValueError:  # not the main thread: Python delivers signals to the main thread only
            logger.warning("[rank %s] Preemption constructed outside the main thread: a notice signal to this "
                           "worker is not taken as the notice", os.environ.get("RANK", "0"))
        self.watcher: PeerLossWatcher | None = None
        """Aborts the training's group when the agent posts a peer loss (under spotrun only)."""
        if self.mailbox is not None:
            from elastic.worker.abort import abort_process_group  # torch.distributed: only where a helper is made

            if not wrapper_watching():  # under elastic.inplace.run the wrapper's watcher aborts the group
                self.watcher = PeerLossWatcher(self.mailbox, self.local_rank,
                                               lambda: abort_process_group(process_group)).start()
            self.mailbox.register_helper(self.local_rank)

    def close(self) -> None:
        """Stop the peer-loss watcher: the group it would abort is being replaced (an in-place re-form)."""
        if self.watcher is not None:
            self.watcher.stop()

    def _on_notice_signal(self, signum: int, frame: Any) -> None:
        if self._signalled is not None or self._agent_stopping():
            # A second notice signal (the launcher insists), or the agent is stopping this worker group: end
            # now, as the unhandled signal would have.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signalled = signal.Signals(signum)

    def _agent_stopping(self) -> bool:
        if self.mailbox is None:
            return False
        try:
            return self.mailbox.stopping()
        except OSError:
            return False

    def _local_notice(self) -> WorkerNotice | None:
        # The agent's notice first: it carries the deadline and save_by that the save decision needs.
        posted = self.mailbox.read_notice() if self.mailbox is not None else None
        if posted is not None:
            return posted
        if self._signalled is not None:
            return WorkerNotice("preempt", None, self._signalled.name)
        return None

    def should_stop(self, step: int) -> bool:
        """True from the agreed step on (same answer on every rank at the same step). Call once per step.

        Collective at every ``sync_every``-th step (a one-int all-reduce): call it on every rank.

        Args:
            step: the step just completed (the same number on every rank).

        Returns:
            True when the group stops at ``step`` (and from then on), False otherwise.

        Raises:
            PlannedStopVoteError: a peer rank did not reach the vote within ``timeout``, or left.
        """
        if self.stop_step is not None:
            return True
        if not is_sync_step(step, self.sync_every):
            return False
        self.notice = self._local_notice()
        if not self._any_rank(step, self.notice is not None):
            return False
        self.stop_step = step
        logger.warning("[rank %s step %d] stopping at the agreed step for a planned change (%s)",
                       os.environ.get("RANK", "0"), step, self.notice or "another rank's notice")
        return True

    def _any_rank(self, step: int, flag: bool) -> bool:
        (anyone,) = self._collective(step, self._vote.any, flag)
        return anyone

    def _collective(self, step: int, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:  # gloo's timeout and closed-connection errors (DistBackendError)
            raise PlannedStopVoteError(
                f"[rank {os.environ.get('RANK', '0')} step {step}] the planned-stop vote failed: a peer rank did "
                f"not reach step {step} within {self.timeout.total_seconds():.0f} s, or left: {exc}"
            ) from exc

    def _decide_save(self, ckpt: PlannedSaver, step: int) -> SaveDecision:
        """The same decision on every rank: one all-gather of (estimate, seconds left) on the vote's group."""
        estimate = _report(ckpt.save_seconds_estimate if isinstance(ckpt, EstimatesSave) else None)
        save_by = self.notice.save_by if self.notice is not None else None
        left = None if save_by is None else save_by - time.time()
        reports = self._collective(step, self._vote.all_gather, [estimate, left])
        return decide_planned_save(step, reports, margin=self.save_margin)

    def acknowledge(self, step: int, *, saved: bool = True, why: str | None = None) -> None:
        """Tell the agent this worker committed ``step`` (or, ``saved=False``, stopped at it without a save,
        because of ``why``) and is leaving for the planned change. No-op without a mailbox (stock torchrun).

        Args:
            step: the agreed step.
            saved: whether ``step`` was committed.
            why: why it was not (shown in the agent's ``planned_leave`` event).
        """
        if self.mailbox is not None:
            self.mailbox.acknowledge(self.local_rank, step, saved=saved, why=why)

    def save_and_stop(self, ckpt: PlannedSaver | None, step: int, state: Any) -> bool:
        """If this is the agreed step: save ``state`` as ``step`` with ``ckpt`` (a ``Checkpointer``), wait for
        the commit, acknowledge, and return True (leave the training loop). Otherwise False (microseconds).
        First, at every step, ``ckpt.snapshot(step, state)`` when ``ckpt`` has it: a ``Checkpointer`` whose
        ``CheckpointConfig(memory=...)`` turns the memory tier on snapshots the step into host memory when due.

        When the save cannot commit before the agent's ``save_by`` (see the module docstring), no rank starts
        it: the step is acknowledged as not saved (``skipped`` says why) and True is returned all the same.

        Args:
            ckpt: the ``Checkpointer`` (any object with ``save(step, state)`` and ``wait()``; None: stop
                without saving).
            step: the step just completed (the same number on every rank).
            state: what to save (as for ``Checkpointer.save``).

        Returns:
            True: leave the training loop (the step is committed, or ``skipped`` says why not); False: go on.

        Raises:
            PlannedStopVoteError: a peer rank did not reach the vote within ``timeout``, or left.
            CheckpointError: the planned save failed (from ``ckpt.save``/``ckpt.wait``).
        """
        report_step(step)  # the agent's spotrun_training_step (a no-op outside spotrun)
        self.last_step = step
        if isinstance(ckpt, SnapshotsEachStep):
            ckpt.snapshot(step, state)  # the memory tier, when configured (before this step's vote can fail)
        if not self.should_stop(step):
            return False
        if ckpt is not None:
            decision = self._decide_save(ckpt, step)
            if not decision.save:
                self.skipped = decision
                logger.warning("[rank %s] step %d not saved for the planned change: %s",
                               os.environ.get("RANK", "0"), step, decision.why)
                self.acknowledge(step, saved=False, why=decision.why)
                return True
            began = time.monotonic()
            ckpt.save(step, state)
            ckpt.wait()
            logger.warning("[rank %s] step %d committed for the planned change in %.2f s",
                           os.environ.get("RANK", "0"), step, time.monotonic() - began)
        self.acknowledge(step)
        return True


def announce_helper(environ: Mapping[str, str] | None = None) -> bool:
    """Tell this worker's agent that the script will build a ``Preemption`` helper (``coming-{local_rank}``).

    Called once when this module is imported: a script imports it at its top, long before it builds the
    helper (after ``init_process_group`` and the restore), so an agent that gets its notice in between knows
    the workers will stop at an agreed step and have trained nothing yet (``elastic.planned.helper_outlook``).
    A no-op outside a spotrun worker (no ``LOCAL_RANK`` or no mailbox: stock torchrun, the warm forkserver's
    preload, a plain ``python``); never raises (a worker must not fail over a hint). True when written.
    """
    env = os.environ if environ is None else environ
    local_rank = env.get("LOCAL_RANK", "")
    if not local_rank.isdigit():
        return False
    try:
        path = find_mailbox(env)
        if not path:
            return False
        Mailbox(path).announce_helper(int(local_rank))
    except OSError as exc:
        logger.debug("could not announce the Preemption helper to the agent: %s", exc)
        return False
    return True


announce_helper()
