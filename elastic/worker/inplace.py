"""Re-form in place: the training function runs again in the same process with the new group.

:func:`run` calls ``fn(generation, ...)``; when the agent re-forms the group around this worker (a peer's planned
leave, a lost peer), it releases what the entry tracked (:meth:`Generation.track`), destroys the old default group,
joins the new one and calls ``fn`` again. What ``fn`` did not track (model, optimizer, compiled code, CUDA context)
stays. Opt-in by use (the ``inplace-{local_rank}`` mark); outside spotrun ``fn`` runs once. Fallbacks to a restart
are reported to the agent (``fallback-{local_rank}.json``). The guide: docs/concepts/reform-in-place.md.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from checkpoint.api import CheckpointError
from checkpoint.collective import clear_groups_aborted, groups_aborted
from checkpoint.memory.jit import is_collective_failure
from elastic.api import InPlaceFallback
from elastic.worker.abort import abort_process_group
from elastic.worker.mailbox import GroupAssignment
from elastic.worker.reform import LOSS_NOTICE_WAIT, InPlaceReform, ReformConfig
from elastic.worker.watcher import PeerLossWatcher, set_wrapper_watching

if TYPE_CHECKING:
    from elastic.worker.preemption import Preemption

logger = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")


class InPlaceFallbackError(SystemExit):
    """The worker gave up re-forming in place (``why``); it exits and its agent restarts it.

    A ``SystemExit`` on purpose (not in the ``SpotrunError`` tree): the process must end, a script's ``except
    Exception`` must not keep it, and uncaught it ends the worker with this one line and status 1, no traceback
    (the fallback is an orderly exit the agent expects, reported to it through the mailbox first)."""

    def __init__(self, why: InPlaceFallback, detail: str) -> None:
        super().__init__(f"in-place re-form abandoned ({why.value}): {detail}; exiting for a restart")
        self.why = why
        self.detail = detail


@dataclass(frozen=True, kw_only=True, slots=True)
class InPlaceConfig:
    """How :func:`run` waits for and joins a re-formed group."""

    enabled: bool = True
    """False: one entry, as without the wrapper (the script cannot go on in place as configured)."""
    backend: str | None = None
    """Backend of the re-formed default group; None: the old group's."""
    pg_timeout: timedelta | None = None
    """Timeout of the re-formed default group; None: torch's default."""
    wait_timeout: timedelta = timedelta(seconds=120)
    """How long a waiting worker waits for its new group before it falls back to a restart."""
    loss_notice_wait: timedelta = timedelta(seconds=LOSS_NOTICE_WAIT)
    """After a broken collective: how long to wait for the agent's word of a lost peer (none: own failure)."""

    def __post_init__(self) -> None:
        for name in ("wait_timeout", "loss_notice_wait"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"{name} must be a positive datetime.timedelta, got {value!r}")
        if self.pg_timeout is not None and (not isinstance(self.pg_timeout, timedelta) or
                                            self.pg_timeout <= timedelta(0)):
            raise ValueError(f"pg_timeout must be None or a positive datetime.timedelta, got {self.pg_timeout!r}")
        if self.backend is not None and not self.backend:
            raise ValueError("backend must be None (the old group's) or a backend name such as 'gloo' or 'nccl'")


@dataclass(slots=True)
class _Tracked:
    obj: Any
    release: Callable[[Any], object] | None


@dataclass(eq=False, slots=True)
class Generation:
    """One entry of the training function: its place in the group, and what holds the group."""

    iteration: int
    """0 at the first entry, then one more per in-place re-form."""
    rank: int
    world_size: int
    local_rank: int
    after_loss: bool = False
    """This entry follows a lost peer rather than a planned leave."""
    in_place: bool = False
    """This worker can be re-formed in place (under spotrun, not turned off)."""
    resumed_at: int | None = None
    """The last step the previous entry completed; None at the first entry."""
    # needs_restore's answer and whether a rank kept its process (both voted at the entry); what marks the worker
    # joinable at the first read of needs_restore; what reports a fallback to the agent and gives its error.
    _restore: bool = True
    _survivors: bool = False
    _on_asked: Callable[[], None] | None = None
    _fall_back: Callable[[InPlaceFallback, str], BaseException] | None = None
    _tracked: list[_Tracked] = field(default_factory=list)
    _preemptions: list[Preemption] = field(default_factory=list)
    _step: int | None = None

    @property
    def reformed(self) -> bool:
        """This entry follows an in-place re-form."""
        return self.iteration > 0

    @property
    def needs_restore(self) -> bool:
        """Every rank must restore the training state now, the same (collective) restore a new worker runs:
        True at the first entry, and after a re-form that took in new workers (a joining node, a peer node's
        restarted workers) or found the survivors at different or unknown steps. False: the state in memory is
        every rank's last completed step (:attr:`resumed_at`), go on from it. Asking this is what lets new
        workers join this worker's group in place; a function that does not ask is restarted when they do. Read
        it at every entry, whatever else the function tests; after the restore, call :meth:`restored`."""
        if self._on_asked is not None:
            self._on_asked()
            self._on_asked = None
        return self._restore

    def resume(self, load: Callable[[], int | None]) -> int:
        """The last completed step to go on from: when :attr:`needs_restore`, ``load()`` (the restore, returning
        the step it restored or None) checked by :meth:`restored`, else :attr:`resumed_at`; 0 for none.
        Collective when it restores: ``start = gen.resume(lambda: ckpt.load(state)) + 1``."""
        if self.needs_restore:
            step = load()
            self.restored(step)
            return step or 0
        return self.resumed_at or 0

    def restored(self, step: int | None) -> None:
        """After the restore that :attr:`needs_restore` asked for: the step it restored (None: nothing).
        Collective (one all-reduce), so every rank that restored calls it. When some ranks kept their processes
        and the ranks did not all restore the same step (nothing on disk or in memory yet: the survivors would
        keep their trained state while the new workers start from scratch), every rank falls back to a restart
        (``restore_differs``), which starts them all alike.

        Raises:
            InPlaceFallbackError: the restored steps differ across the ranks of a re-formed group.
        """
        if not self._survivors or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        got = -1 if step is None else step
        bounds = torch.tensor([got, -got], dtype=torch.int64, device=collective_device())
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        high, low = int(bounds[0]), -int(bounds[1])
        if high == low and low >= 0:
            return
        held = "their trained state" if self.resumed_at is None else f"step {self.resumed_at}"
        detail = (f"the ranks restored steps {low} to {high}" if low >= 0 else
                  f"a rank restored nothing (no checkpoint or memory snapshot yet) while survivors hold {held}")
        if self._fall_back is None:
            raise InPlaceFallbackError(InPlaceFallback.RESTORE_DIFFERS, detail)
        raise self._fall_back(InPlaceFallback.RESTORE_DIFFERS, detail)

    def track(self, obj: T, release: Callable[[T], object] | None = None) -> T:
        """Register ``obj`` (built on this group) and return it. Before the group is replaced, tracked objects
        are released newest first: ``release(obj)`` when given, else a ``Preemption`` closed, a process group
        destroyed, anything with ``close()`` closed, anything else (a DDP module, a sampler) dropped."""
        if _is_preemption(obj):
            self._preemptions.append(obj)  # type: ignore[arg-type]  # checked by _is_preemption
        self._tracked.append(_Tracked(obj, release))
        return obj

    def preemption(self, **kwargs: Any) -> Preemption:
        """A tracked ``Preemption(**kwargs)`` helper on this group (collective)."""
        from elastic.worker.preemption import Preemption  # here: importing it announces a helper to the agent

        return self.track(Preemption(**kwargs))

    def new_group(self, ranks: list[int] | None = None, **kwargs: Any) -> Any:
        """A tracked ``torch.distributed.new_group(ranks, **kwargs)`` (collective)."""
        return self.track(dist.new_group(ranks, **kwargs))

    def completed(self, step: int) -> None:
        """The last step this rank completed, for a loop without a ``Preemption`` helper (checked after a loss)."""
        self._step = step

    @property
    def last_step(self) -> int | None:
        """The last completed step this entry told (``completed`` or its ``Preemption``), or None."""
        steps = [p.last_step for p in self._preemptions if p.last_step is not None]
        if self._step is not None:
            steps.append(self._step)
        return max(steps) if steps else None

    def _release(self, *, quiet: bool) -> list[BaseException]:
        """Release every tracked object, newest first; returns the errors (each logged, never raised)."""
        errors: list[BaseException] = []
        while self._tracked:
            item = self._tracked.pop()
            try:
                _release_one(item)
            except Exception as exc:  # noqa: BLE001 - every object is released; the errors are returned
                errors.append(exc)
                log = logger.info if quiet else logger.warning
                log("[rank %d] releasing %s failed: %s", self.rank, type(item.obj).__name__, exc)
            item.obj = None
        self._preemptions.clear()
        return errors


def _is_preemption(obj: object) -> bool:
    """``obj`` is a ``Preemption`` (without importing its module: the import announces a helper to the agent)."""
    module = sys.modules.get("elastic.worker.preemption")
    return module is not None and isinstance(obj, module.Preemption)


def _release_one(item: _Tracked) -> None:
    obj = item.obj
    if item.release is not None:
        item.release(obj)
    elif _is_preemption(obj):
        obj.close()
    elif isinstance(obj, dist.ProcessGroup):
        if dist.is_initialized():
            dist.destroy_process_group(obj)
    elif callable(getattr(obj, "close", None)):
        obj.close()


def _stop_watching(watcher: PeerLossWatcher) -> None:
    watcher.stop()
    set_wrapper_watching(False)


def _default_backend() -> str:
    if dist.is_initialized():
        return str(dist.get_backend())
    return "nccl" if torch.cuda.is_available() else "gloo"


NO_STEP = -(2**62)
"""A rank's neutral contribution to the entry's step bounds (the all-reduce takes the maximum)."""


@dataclass(frozen=True, slots=True)
class EntryVote:
    """One rank's say at an entry, or (after :func:`agree_on_entry`'s all-reduce) every rank's together."""

    # fresh: a new process (its first entry); survivor: it kept its process through a re-form; unaware: a
    # survivor whose function never asked needs_restore (it cannot restore); unknown: a survivor of a lost peer
    # that told no step; a survivor's completed step s gives (s, -s), a new process NO_STEP.
    fresh: bool
    survivor: bool
    unaware: bool
    unknown: bool
    step_max: int = NO_STEP
    neg_step_min: int = NO_STEP

    @classmethod
    def of(cls, *, fresh: bool, aware: bool, after_loss: bool, step: int | None) -> EntryVote:
        # A survivor's step counts after a planned stop too (the agreed step, the same for all).
        high, neg_low = (step, -step) if step is not None and not fresh else (NO_STEP, NO_STEP)
        return cls(fresh=fresh, survivor=not fresh, unaware=not fresh and not aware,
                   unknown=after_loss and not fresh and step is None, step_max=high, neg_step_min=neg_low)

    def to_list(self) -> list[int]:
        return [int(self.fresh), int(self.survivor), int(self.unaware), int(self.unknown), self.step_max,
                self.neg_step_min]

    @classmethod
    def from_list(cls, values: list[int]) -> EntryVote:
        fresh, survivor, unaware, unknown, step_max, neg_step_min = values
        return cls(fresh=fresh > 0, survivor=survivor > 0, unaware=unaware > 0, unknown=unknown > 0,
                   step_max=step_max, neg_step_min=neg_step_min)


@dataclass(frozen=True, slots=True)
class EntryDecision:
    restore: bool
    """Every rank restores (``Generation.needs_restore``)."""
    survivors: bool = False
    """Some rank kept its process (``Generation.restored`` then checks the restore)."""
    fallback: tuple[InPlaceFallback, str] | None = None
    """Every rank falls back to a restart instead, and why."""


def decide_entry(vote: EntryVote) -> EntryDecision:
    """What every rank does at an entry, from the votes of all (the same answer on every rank).

    New workers in the group, survivors at different completed steps or one that told none: every rank
    restores (the restore agrees on one step for all, as after a restart), unless a survivor's function cannot
    (it never asked ``needs_restore``): then every rank falls back to a restart, new workers included."""
    steps_differ = vote.step_max != NO_STEP and vote.step_max != -vote.neg_step_min
    if not (vote.fresh or vote.unknown or steps_differ):
        return EntryDecision(restore=False, survivors=vote.survivor)
    if not vote.unaware:
        return EntryDecision(restore=True, survivors=vote.survivor)
    if vote.fresh:
        why, detail = InPlaceFallback.NEW_NODE, "new workers joined the group and a survivor's training function " \
            "does not ask Generation.needs_restore (it cannot take part in their restore)"
    elif vote.unknown:
        why, detail = InPlaceFallback.STEP_UNKNOWN, "a survivor's training function told no completed step " \
            "(use Generation.preemption() or Generation.completed(step))"
    else:
        why, detail = InPlaceFallback.STEPS_DIFFER, f"the survivors stand at steps {-vote.neg_step_min} to " \
            f"{vote.step_max}"
    return EntryDecision(restore=False, survivors=vote.survivor, fallback=(why, detail))


def collective_device() -> torch.device:
    """Where a small tensor for a collective on the default group lives: the CPU when the group has a CPU backend
    (gloo, ``cpu:gloo,cuda:nccl``); else (NCCL alone, however spelt) the group's bound device
    (``init_process_group(device_id=...)``), else the current CUDA device when the script set one, else
    ``LOCAL_RANK``'s (torchrun's convention: a script that never called ``torch.cuda.set_device`` would otherwise
    put every local rank's tensor on device 0, which NCCL refuses)."""
    if "cpu:" in str(dist.get_backend_config()):
        return torch.device("cpu")
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if isinstance(bound, torch.device):
        return bound
    current = torch.cuda.current_device()
    if current != 0:
        return torch.device("cuda", current)
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))


def agree_on_entry(vote: EntryVote) -> EntryVote:
    """Every rank's votes together (collective on the default group: one all-reduce of six ints)."""
    values = torch.tensor(vote.to_list(), dtype=torch.int64, device=collective_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return EntryVote.from_list([int(v) for v in values.tolist()])


class _Runner:
    """The loop of :func:`run`: enter, wait, release, rebuild, enter again."""

    def __init__(self, config: InPlaceConfig) -> None:
        self.config = config
        self.reform = InPlaceReform(ReformConfig(timeout=config.wait_timeout.total_seconds()), enabled=config.enabled)
        self.local_rank = self.reform.local_rank
        self._abort_lock = threading.Lock()

    def generation(self, iteration: int, after_loss: bool, resumed_at: int | None) -> Generation:
        """The next entry's generation; with a group, every rank decides together whether all restore."""
        self.reform.mark_capable()  # again at every entry: the agent's re-form cleared the mailbox
        if self.reform.joinable:
            self.reform.mark_joinable()
        gen = Generation(iteration=iteration, rank=int(os.environ.get("RANK", "0")),
                         world_size=int(os.environ.get("WORLD_SIZE", "1")), local_rank=self.local_rank,
                         after_loss=after_loss, in_place=self.reform.enabled, resumed_at=resumed_at,
                         _on_asked=None if self.reform.joinable else self.reform.mark_joinable,
                         _fall_back=self.fall_back)
        vote = EntryVote.of(fresh=iteration == 0, aware=self.reform.joinable, after_loss=after_loss, step=resumed_at)
        # Every rank votes, whatever its config or node: a rank that skipped would pair its first collective
        # with the others' vote.
        if dist.is_initialized() and dist.get_world_size() > 1:
            try:
                vote = agree_on_entry(vote)
            except Exception as exc:
                if iteration == 0:
                    raise  # a new worker's first collective: as without the wrapper
                raise self.fall_back(InPlaceFallback.REBUILD_FAILED, f"agreeing on the entry: {exc}") from exc
        decision = decide_entry(vote)
        if decision.fallback is not None:
            raise self.fall_back(*decision.fallback)
        gen._restore, gen._survivors = decision.restore, decision.survivors
        self.watch(gen)
        return gen

    def watch(self, gen: Generation) -> None:
        """Under spotrun, a peer-loss watcher for this entry (tracked: stopped at the release), so a collective
        blocked on a silent or paused peer raises when the agent posts the loss, whether or not the function
        builds a ``Preemption`` helper (which then starts none of its own)."""
        if self.reform.mailbox is None:
            return
        watcher = PeerLossWatcher(self.reform.mailbox, self.local_rank, self.abort_group).start()
        set_wrapper_watching(True)
        gen.track(watcher, release=_stop_watching)

    def abort_group(self) -> None:
        """Abort the default group once (its blocked collectives raise, on this rank and on the ranks blocked
        on it); best effort: a failure is logged."""
        with self._abort_lock:  # the watcher's thread and the main thread may both get here
            if not dist.is_initialized() or groups_aborted():
                return
            try:
                abort_process_group()
            except Exception as exc:  # noqa: BLE001 - the wait in place goes on; the agent decides
                logger.warning("[local rank %d] could not abort the broken process group: %s", self.local_rank, exc)

    def acknowledged(self) -> bool:
        """This worker acknowledged an agreed step (its ``Preemption`` stopped for a planned change)."""
        if self.reform.mailbox is None:
            return False
        try:
            return self.local_rank in self.reform.mailbox.acknowledgements()
        except OSError:
            return False

    def fall_back(self, why: InPlaceFallback, detail: str) -> InPlaceFallbackError:
        """Tell the agent why this worker leaves the in-place path; the error to raise."""
        logger.warning("[local rank %d] in-place re-form abandoned (%s): %s; exiting for a restart", self.local_rank,
                       why.value, detail)
        if self.reform.mailbox is not None:
            try:
                self.reform.mailbox.report_fallback(self.local_rank, why.value, detail)
            except OSError as exc:
                logger.warning("[local rank %d] could not report the fallback to the agent: %s", self.local_rank, exc)
        return InPlaceFallbackError(why, detail)

    def rebuild(self, gen: Generation, assignment: GroupAssignment, *, after_loss: bool) -> None:
        """Release the old group's objects and join the new group; raises ``InPlaceFallbackError`` (reported to
        the agent) when either fails. The next entry checks the steps (:func:`decide_entry`)."""
        began = time.monotonic()
        # After a loss a save in flight cannot commit (its collectives broke): expected, and never loaded.
        errors = [e for e in gen._release(quiet=after_loss) if not (after_loss and isinstance(e, CheckpointError))]
        if errors:
            raise self.fall_back(InPlaceFallback.REBUILD_FAILED, f"releasing the old group's objects: {errors[0]}")
        backend = self.config.backend or _default_backend()
        try:
            self.reform.rebuild(assignment, backend, self.config.pg_timeout)
            clear_groups_aborted()  # the checkpointer's collectives run again on the new groups
        except Exception as exc:
            raise self.fall_back(InPlaceFallback.REBUILD_FAILED, f"joining the new group: {exc}") from exc
        logger.info("[rank %d/%d] re-formed in place in %.3f s (%s)", assignment.rank, assignment.world_size,
                    time.monotonic() - began, "after a lost peer" if after_loss else "after a peer's planned leave")


def run(fn: Callable[..., R], *args: Any, config: InPlaceConfig | None = None, **kwargs: Any) -> R:
    """Call ``fn(generation, *args, **kwargs)``, and again with the new group after each in-place re-form.

    ``fn`` builds what depends on the group from ``generation`` and tracks it; it returns at the end of training
    or at a ``Preemption`` stop (a peer's leave: entered again), and lets a broken collective propagate (a lost
    peer: entered again once the agent re-formed the group). The default group must exist before the call.

    Returns:
        What the last entry of ``fn`` returned.

    Raises:
        InPlaceFallbackError: the re-form in place was abandoned (the agent restarts this worker).
        Exception: what ``fn`` raised, when it is not a peer loss re-formed in place.
    """
    runner = _Runner(config or InPlaceConfig())
    iteration, after_loss, resumed_at = 0, False, None
    while True:
        gen = runner.generation(iteration, after_loss, resumed_at)
        try:
            result = fn(gen, *args, **kwargs)
        except Exception as exc:
            if not gen.in_place or not is_collective_failure(exc):
                gen._release(quiet=True)
                raise
            runner.abort_group()  # a survivor blocked on this one (not on the lost peer) raises too
            assignment = runner.reform.wait_after_loss(runner.config.loss_notice_wait.total_seconds())
            if assignment is None:
                gen._release(quiet=True)
                if runner.reform.timed_out:
                    raise runner.fall_back(InPlaceFallback.TIMEOUT, "no re-formed group after the peer loss within "
                                           f"{runner.config.wait_timeout.total_seconds():.0f} s") from exc
                raise
            traceback.clear_frames(exc.__traceback__)  # the frames hold the old group's objects (DDP, helpers)
            del exc
            after_loss = True
        else:
            assignment = runner.reform.wait() if gen.in_place and runner.acknowledged() else None
            if assignment is None:
                errors = gen._release(quiet=False)
                if runner.reform.timed_out:
                    # The plain script's path: the step is committed, the agent restarts the worker.
                    runner.fall_back(InPlaceFallback.TIMEOUT, "no re-formed group after the planned stop within "
                                     f"{runner.config.wait_timeout.total_seconds():.0f} s")
                if errors:
                    raise errors[0]  # e.g. the final save failed: the script fails as it would without the wrapper
                return result
            after_loss = False
        resumed_at = gen.last_step
        runner.rebuild(gen, assignment, after_loss=after_loss)
        iteration += 1
