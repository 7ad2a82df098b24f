"""The Checkpointer: async sharded saves, loads at any world size. It composes the parts and owns none of the
mechanics.

Save (per rank): ``flatten`` the state -> one foreground vote (busy, new items, a rank's state rejected) ->
``save_plan.SavePlan`` (who writes what, replanned only when the items change) -> the ``ShardWriter``
(``writer.open_writer``: thread or process, chosen once) stages the pieces this rank writes into reused host
buffers (the only time the training step blocks) -> ``save_thread.SaveThread`` writes, commits and prunes in
the background. Load: ``loader.Loader``; with ``config.memory``, ``checkpoint.memory.resume`` first.

Collectives go through two ``collective.Collective`` objects created at construction (collective, same order on
all ranks): a foreground one (training thread: the save vote, the item metadata, the step choices) and a
background one (writer thread: the commit). Neither is the training's default group, so a collective the writer
thread runs can never interleave with the training's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from checkpoint.api import CheckpointError, SaveFailure, SaveInProgressError, ShardWriter
from checkpoint.collective import open_collectives
from checkpoint.config import CheckpointConfig
from checkpoint.discover import latest_good_step
from checkpoint.loader import Loader
from checkpoint.location import check_location_on_every_rank
from checkpoint.memory.api import RestoreReport
from checkpoint.memory.attach import AttachedMemory
from checkpoint.memory.resume import restore
from checkpoint.save_plan import SavePlan, items_signature, rank_payload
from checkpoint.save_thread import SAVE_TIMES_KEPT, SaveThread, tolerate_failed_save
from checkpoint.state import FlatState, flatten
from checkpoint.storage import StorageSpec
from checkpoint.writer import open_writer

__all__ = ["SAVE_TIMES_KEPT", "Checkpointer", "tolerate_failed_save"]

logger = logging.getLogger(__name__)


class Checkpointer:
    """Save and load training state under ``uri`` (local path, ``file://``, ``memory://``, ``s3://``).

    Use one per training run, constructed on every rank (the construction is collective when
    ``torch.distributed`` is initialised)::

        with Checkpointer("s3://bucket/run1", CheckpointConfig(keep_last=2)) as ckpt:
            start = (ckpt.load(state) or 0) + 1
            for step in range(start, steps):
                train_step()
                if step % 100 == 0:
                    ckpt.save(step, state)   # returns after the host copy
    """

    def __init__(
        self,
        uri: str,
        config: CheckpointConfig | None = None,
        *,
        process_group: Any = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        on_save_failure: Callable[[SaveFailure], None] | None = None,
    ) -> None:
        """Args:
            uri: the checkpoint root (local path, ``file://``, ``s3://``, ``memory://``, any fsspec URL).
            config: how to save, keep and load (default ``CheckpointConfig()``).
            process_group: the group whose ranks save together (default: the world, if initialised).
            sleep: the storage retries' sleep (injected by tests).
            clock: the storage retries' clock (injected by tests).
            on_save_failure: called on the training thread, at the next ``save``, with each background save
                that failed while training went on (see ``CheckpointConfig.max_consecutive_failed_saves``).

        Raises:
            CheckpointStorageError: the location cannot be opened.
        """
        self.config = config or CheckpointConfig()
        c = self.config
        spec = StorageSpec.from_config(uri, c)
        self.storage = spec.open(sleep=sleep, clock=clock)
        self._fg, bg = open_collectives(process_group, c.collective_timeout, 2)
        """Foreground (training thread) and background (writer thread) collectives."""
        self.rank, self.world_size = self._fg.rank, self._fg.world_size
        if c.check_location:
            check_location_on_every_rank(self.storage, self._fg)
        self._memory: AttachedMemory | None = (
            None if c.memory is None else AttachedMemory.open(c.memory, process_group)
        )
        """The memory tier (``config.memory``): ``snapshot`` feeds it, ``load`` restores from it first."""
        self._writer: ShardWriter = open_writer(c, self.storage, spec, self.rank)
        self._plan = SavePlan(self._fg, max_shard_bytes=c.max_shard_bytes)
        self._saves = SaveThread(c, self.storage, self._writer, bg, on_save_failure=on_save_failure)
        self._loader = Loader(c, self.storage, self._fg)
        self._closed = False
        self.last_stage_seconds = 0.0
        """Wall time the last ``save`` blocked the caller (flatten + vote + staging copy)."""
        self.last_load_bytes = 0
        """Bytes this rank read in its last ``load``/``read`` (``checkpoint.memory.restore`` reports them)."""

    def __repr__(self) -> str:
        return f"Checkpointer({self.storage.display()!r}, rank={self.rank}/{self.world_size})"

    @property
    def writer(self) -> ShardWriter:
        """The shard writer saves go through (``config.writer``: threads of this process, or a child process)."""
        return self._writer

    @property
    def save_pending(self) -> bool:
        """Whether a save started and was not waited for yet (``wait`` collects its outcome)."""
        return self._saves.pending

    @property
    def failed_saves_in_a_row(self) -> int:
        """Background saves that failed since the last committed one (0 after a commit)."""
        return self._saves.failed_in_a_row

    @property
    def recent_save_seconds(self) -> tuple[float, ...]:
        """Seconds from ``save()`` to the commit (vote, stage, write, commit; not the flatten, whose first call
        in a process pays a one-time import, nor the wait for a previous save still in flight, nor
        retention) of the last few saves this process committed, oldest first; empty before the first."""
        return self._saves.save_seconds

    @property
    def save_seconds_estimate(self) -> float | None:
        """How long the next save should take to commit on this rank: the slowest of
        ``recent_save_seconds``, twice that while a save is in flight (the next one waits for it first), or
        None before the first committed save (used by ``elastic.preemption.Preemption`` to skip a planned
        save that cannot commit before the deadline)."""
        seconds = self._saves.save_seconds
        if not seconds:
            return None
        return max(seconds) * (2 if self._saves.busy else 1)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Stage ``state`` to host memory and write it as ``step`` in the background (see ``wait``).

        A failure of the previous save is reported (ERROR log line, ``on_save_failure``) and this save goes
        ahead; once ``max_consecutive_failed_saves`` saves in a row failed, it is raised instead (on every
        rank: every rank learns the same outcome of each save).

        Collective: call it on every rank of the group with the same ``step``.

        Args:
            step: the step number to save as (a non-negative int, not yet committed at this location).
            state: top-level name -> value: objects with ``state_dict()``/``load_state_dict()`` (models, DDP
                or FSDP2, optimizers, schedulers), tensors, JSON values, ``PerRank(...)`` and ``RNGState()``.

        Raises:
            CheckpointError: the previous saves failed too often (their last error), the state was rejected
                on some rank, or this Checkpointer is broken.
            SaveInProgressError: a save is in flight and ``when_busy="refuse"``.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        started = time.perf_counter()
        state_error: TypeError | ValueError | None
        try:
            flat = flatten(state)
            payload = rank_payload(flat, step, rank=self.rank, world_size=self.world_size)
        except (TypeError, ValueError) as exc:  # bad state on this rank: vote, so no rank waits for it
            flat, payload, state_error = FlatState(), None, exc
        else:
            state_error = None
        # Timed for save_seconds_estimate from here: the first flatten of a process imports
        # torch.distributed.tensor (seconds, once), which no later save pays.
        timed_from = time.perf_counter()
        signature = items_signature(flat)
        # every rank takes the same branch: busy / new items / refused anywhere
        any_busy, any_changed, any_bad = self._fg.any(
            self._saves.busy, signature != self._plan.signature, state_error is not None
        )
        if any_bad:  # every rank raises, so none is left waiting in the commit's collectives
            if state_error is not None:
                raise state_error
            raise CheckpointError(f"rank {self.rank}: step {step} not saved: another rank's state was rejected (see its error)")
        if any_busy and self.config.when_busy == "refuse":
            raise SaveInProgressError(
                f"rank {self.rank}: save of step {self._saves.in_flight} is still writing; step {step} was not saved "
                f'(use when_busy="wait" to block instead)'
            )
        waited = time.perf_counter()
        self._saves.settle_previous()  # waits if busy; reports (or raises) the previous save's failure either way
        timed_from += time.perf_counter() - waited  # the previous save's time is not this one's
        if any_changed:
            self._plan.replan(flat, signature)
        buffers = self._writer.stage(self._plan.layouts, flat.items)
        objects = flat.objects if self.rank == 0 else None
        self.last_stage_seconds = time.perf_counter() - started
        logger.debug("[rank %d step %d] staged in %.3fs", self.rank, step, self.last_stage_seconds)
        self._saves.submit(step, list(self._plan.layouts), buffers, objects, payload, timed_from)
        if not self.config.async_mode:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save is committed; re-raise its error (once).

        Raises:
            CheckpointError: the in-flight save failed (storage past its retries, a rank failed, the commit
                was aborted); the step is not committed and the previous commit stays the latest.
        """
        self._saves.wait()

    # ------------------------------------------------------------------ discover / load
    def latest(self) -> int | None:
        """Newest committed step that is intact (uncommitted and corrupt steps are skipped), or None.

        Returns:
            The step number, or None when the location holds no committed step.

        Raises:
            CheckpointStorageError: storage failed past its retries, or no committed step could be read
                (rather than starting fresh over checkpoints it cannot see).
        """
        self._check_open()
        return latest_good_step(self.storage)

    def load(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """Restore ``state`` in place from ``step`` (default: the newest restorable step) at the current world size.

        With ``config.memory`` and ``step=None``, the newest memory snapshot every rank can read (this node's
        keeper, else a peer's) is restored when it is not older than the newest committed durable step; else the
        durable tier, as :meth:`load_durable`. ``last_restore`` says which source, step, bytes and seconds.
        Otherwise the same as :meth:`load_durable`, whose documentation gives the arguments and errors.

        Collective: call it on every rank of the group.
        """
        if step is not None or self._memory is None:
            return self.load_durable(state, step)
        self._check_open()
        report = restore(self, state, memory=self._memory.tier)
        self._memory.last_restore = report
        return None if report is None else report.step

    @property
    def last_restore(self) -> RestoreReport | None:
        """The source, step, bytes and seconds of the last memory-aware ``load`` (``config.memory``), or None."""
        return None if self._memory is None else self._memory.last_restore

    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as the completed ``step`` into host shared memory when ``config.memory`` says it
        is due (``checkpoint.memory``); a no-op returning False without ``config.memory``. Call it after every
        step, once the optimizer stepped (``elastic.preemption.Preemption.save_and_stop`` does). Never raises for
        lack of room or a failed snapshot (logged once): training goes on with the last complete one.

        Collective on the steps it acts on, like ``save``. Returns True when a snapshot was started.
        """
        if self._memory is None:
            return False
        self._check_open()
        return self._memory.snapshot(step, state)

    def load_durable(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """Restore ``state`` in place from ``step`` (default: latest good step) at the current world size,
        from the durable tier only (whatever ``config.memory`` says).

        Returns the step loaded, or None when there is no checkpoint yet (only with ``step=None``). With
        ``step=None``, damage found only while reading (a checksum mismatch, a truncated shard) makes every
        rank fall back to the next older good step, with a warning: a job that keeps restarting must not
        stay stuck on one bad checkpoint. A named ``step`` is loaded or raises.

        Collective: call it on every rank of the group.

        Args:
            state: the live state to restore into, with the same top-level names as at save time (each rank
                reads only the byte ranges of the pieces it holds, at any world size).
            step: the step to load; None (default): the newest good step.

        Returns:
            The step loaded, or None when there is no checkpoint yet (``step=None`` only).

        Raises:
            CheckpointNotFoundError: the named ``step`` does not exist.
            CorruptCheckpointError: the named ``step`` is damaged.
            IncompatibleCheckpointError: the step does not match ``state`` (names, shapes) or has a newer
                format version; ``state`` may be partly overwritten.
            CheckpointStorageError: storage failed past its retries.
        """
        self._check_open()
        self.wait()
        loaded = self._loader.load(state, step)
        self.last_load_bytes = self._loader.last_load_bytes
        last = self._saves.last_committed
        if loaded is not None and (last is None or loaded > last):
            self._saves.last_committed = loaded
        return loaded

    def read(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """Every shared top-level entry of ``step`` (default: latest good) as plain values, tensors in full.

        For callers with no live state to load into (Lightning's ``CheckpointIO.load_checkpoint``): the load
        path of :meth:`load` into a state built from the step's own manifest. On this process only (no
        collective, no fallback to an older step): every rank that calls it reads the whole step. Per-rank
        entries are not included.

        Args:
            step: the step to read; None (default): the newest good step.

        Returns:
            ``(step, state)``: the step read and its shared entries, tensors whole.

        Raises:
            CheckpointNotFoundError: there is no committed step (or not ``step``).
            CorruptCheckpointError: the step is damaged.
        """
        self._check_open()
        chosen, state = self._loader.read(step)
        self.last_load_bytes = self._loader.last_load_bytes
        return chosen, state

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        if self._saves.broken is not None:
            self.wait()  # the failed save's own error first (raised once)
            raise CheckpointError(f"this Checkpointer cannot be used any more: {self._saves.broken}; create a new one "
                                  f"(after the process group is rebuilt)")

    def close(self) -> None:
        """Flush the in-flight save (re-raising its error) and release threads and buffers."""
        if self._closed:
            return
        try:
            if self._memory is not None:
                self._memory.close()
        finally:
            try:
                self.wait()
            finally:
                self._closed = True
                self._saves.close()
                self._writer.close()
                self.storage.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        if self._memory is not None and not self._closed:
            self._memory.on_failure(exc)  # a failed collective: the last completed step, just in time
        try:
            self.close()
        except CheckpointError:
            logger.exception("error while closing the checkpointer after another error")


