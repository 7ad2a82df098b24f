"""The Checkpointer: async sharded saves, loads at any world size. It orchestrates; each rule lives in its
own module.

Save (per rank): ``flatten`` the state -> decide who writes what (``plan.assign_writers``, recomputed only
when the items change) -> the ``ShardWriter`` (``writer.open_writer``: thread or process, chosen once)
stages the pieces this rank writes into reused host buffers (the only time the training step blocks) -> a
background thread has it write this rank's shard files, writes its per-rank objects file (``PerRank``
entries, encoded at ``save`` time), gathers every rank's records on rank 0, and rank 0 commits (see
``checkpoint.commit``) and prunes (``retention.apply_retention``).

Load: rank 0 picks the step -> ``discover.validate_step`` -> ``plan.plan_reads`` -> ``shard.read_requests``
(verified by ``verify``) -> ``state.apply``; per-rank entries come back through ``per_rank``; damage found
while reading falls back to an older step as ``fallback`` decides.

Collectives go through two ``collective.Collective`` objects created at construction (collective, same
order on all ranks): a foreground one for the cheap per-save vote, the item metadata gather and the step
choices (training thread), and a background one for the commit (writer thread). Neither is the training's
default group, so a collective the writer thread runs can never interleave with the training's own.

A background save that fails is not committed, rank 0 removes its step directory (never a committed one), and
the next ``save`` reports it and training goes on, up to ``max_consecutive_failed_saves`` failures in a row (``tolerate_failed_save``).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Final

from checkpoint.api import (
    COMMIT_FILE,
    JSON,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    ChunkKey,
    Manifest,
    RankObjectsRecord,
    RankRecords,
    SaveFailure,
    SaveInProgressError,
    ShardWriter,
    rank_objects_file_name,
    step_dir,
)
from checkpoint.collective import open_collectives
from checkpoint.commit import commit_step, merge_records, rank_objects_payload
from checkpoint.config import CheckpointConfig
from checkpoint.discover import (
    latest_good_manifest,
    latest_good_step,
    read_objects,
    validate_step,
)
from checkpoint.dtypes import torch_dtype
from checkpoint.fallback import LoadOutcome, load_with_fallback
from checkpoint.faults import crash_point
from checkpoint.location import check_location
from checkpoint.memory.api import RestoreReport
from checkpoint.memory.attach import AttachedMemory
from checkpoint.memory.resume import restore
from checkpoint.per_rank import load_rank_entries, saved_as_shared
from checkpoint.plan import assign_writers, plan_reads
from checkpoint.retention import apply_retention
from checkpoint.save_record import SaveRecorder
from checkpoint.shard import ShardLayout, read_requests
from checkpoint.state import FlatState, apply, blank_state, flatten
from checkpoint.storage import StorageSpec, lower_thread_priority
from checkpoint.writer import open_writer, plan_files

logger = logging.getLogger(__name__)

SAVE_TIMES_KEPT: Final = 4
"""How many recent committed saves ``Checkpointer.save_seconds_estimate`` looks at (the slowest wins: storage
speed varies, and a planned save that is cut off costs more than one skipped for a pessimistic guess)."""


def tolerate_failed_save(failed_in_a_row: int, limit: int, *, broken: bool) -> bool:
    """Whether the next ``save`` reports a failed background save and goes on (True) or raises it: fewer
    than ``limit`` saves in a row failed, and no collective broke (a broken one may leave ranks out of step).
    Every rank learns the same outcome of each save, so every rank decides alike."""
    return not broken and failed_in_a_row < limit


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
        self._on_save_failure = on_save_failure
        self._failed_in_a_row = 0
        self._last_committed: int | None = None
        self._fg, self._bg = open_collectives(process_group, c.collective_timeout, 2)
        """Foreground (training thread: vote, item metadata, step choice) and background (writer thread:
        records gather, commit outcome) collectives."""
        self.rank, self.world_size = self._fg.rank, self._fg.world_size
        if c.check_location:
            self._check_location()
        self._memory: AttachedMemory | None = (
            None if c.memory is None else AttachedMemory.open(c.memory, process_group)
        )
        """The memory tier (``config.memory``): ``snapshot`` feeds it, ``load`` restores from it first."""
        self._writer: ShardWriter = open_writer(c, self.storage, spec, self.rank)
        self._recorder = SaveRecorder(self.rank)
        """Each save's outcome, left for the spotrun agent's metrics (a no-op outside spotrun)."""
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="ckpt-bg", initializer=lower_thread_priority, initargs=(c.writer_nice,)
        )
        self._future: Future[int] | None = None
        self._in_flight: int | None = None
        self._signature: tuple[Any, ...] | None = None
        self._layouts: list[ShardLayout] = []
        self._closed = False
        self._broken: str | None = None
        """Set when a collective of the background group failed: the ranks may disagree on where they are in
        the sequence of collectives, so this Checkpointer refuses further saves and loads."""
        self.last_stage_seconds = 0.0
        """Wall time the last ``save`` blocked the caller (flatten + vote + staging copy)."""
        self.last_load_bytes = 0
        """Bytes this rank read in its last ``load``/``read`` (``checkpoint.memory.restore`` reports them)."""
        self._save_seconds: tuple[float, ...] = ()
        """Save-to-commit seconds of the last ``SAVE_TIMES_KEPT`` committed saves, oldest first. Replaced whole
        (never mutated) by the writer thread, so the training thread reads it without a lock."""
        self._validated: Manifest | None = None
        """The manifest this rank validated while choosing the step to load (rank 0 in ``_agree_on_step``
        and the fallback's older step), taken by ``_load_step`` so a load validates its step once."""

    def _check_location(self) -> None:
        """Every rank probes the root (``checkpoint.location``) and every rank raises when one failed, so none
        is left waiting in a later collective."""
        error: CheckpointStorageError | None = None
        try:
            check_location(self.storage, self.rank)
        except CheckpointStorageError as exc:
            error = exc
        (failed,) = self._fg.any(error is not None)
        if not failed:
            return
        self.storage.close()
        if error is not None:
            raise error
        raise CheckpointStorageError(
            f"checkpoint location {self.storage.display()} is not usable on another rank (see its error)",
            path=self.storage.display(),
        )

    def __repr__(self) -> str:
        return f"Checkpointer({self.storage.display()!r}, rank={self.rank}/{self.world_size})"

    @property
    def writer(self) -> ShardWriter:
        """The shard writer saves go through (``config.writer``: threads of this process, or a child process)."""
        return self._writer

    @property
    def save_pending(self) -> bool:
        """Whether a save started and was not waited for yet (``wait`` collects its outcome)."""
        return self._future is not None

    @property
    def failed_saves_in_a_row(self) -> int:
        """Background saves that failed since the last committed one (0 after a commit)."""
        return self._failed_in_a_row

    @property
    def recent_save_seconds(self) -> tuple[float, ...]:
        """Seconds from ``save()`` to the commit (vote, stage, write, commit; not the flatten, whose first call
        in a process pays a one-time import, nor the wait for a previous save still in flight, nor
        retention) of the last few saves this process committed, oldest first; empty before the first."""
        return self._save_seconds

    @property
    def save_seconds_estimate(self) -> float | None:
        """How long the next save should take to commit on this rank: the slowest of
        ``recent_save_seconds``, twice that while a save is in flight (the next one waits for it first), or
        None before the first committed save (used by ``elastic.preemption.Preemption`` to skip a planned
        save that cannot commit before the deadline)."""
        if not self._save_seconds:
            return None
        busy = self._future is not None and not self._future.done()
        return max(self._save_seconds) * (2 if busy else 1)

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
            rank_payload = self._rank_objects_payload(flat, step)
        except (TypeError, ValueError) as exc:  # bad state on this rank: vote, so no rank waits for it
            flat, rank_payload, state_error = FlatState(), None, exc
        else:
            state_error = None
        # Timed for save_seconds_estimate from here: the first flatten of a process imports
        # torch.distributed.tensor (seconds, once), which no later save pays.
        timed_from = time.perf_counter()
        signature = tuple((i.key, i.dtype, tuple(i.global_shape), i.replicated) for i in flat.items)
        busy = self._future is not None and not self._future.done()
        # every rank takes the same branch: busy / new items / refused anywhere
        any_busy, any_changed, any_bad = self._fg.any(busy, signature != self._signature, state_error is not None)
        if any_bad:  # every rank raises, so none is left waiting in the commit's collectives
            if state_error is not None:
                raise state_error
            raise CheckpointError(f"rank {self.rank}: step {step} not saved: another rank's state was rejected (see its error)")
        if any_busy and self.config.when_busy == "refuse":
            raise SaveInProgressError(
                f"rank {self.rank}: save of step {self._in_flight} is still writing; step {step} was not saved "
                f'(use when_busy="wait" to block instead)'
            )
        waited = time.perf_counter()
        self._settle_previous()  # waits if busy; reports (or raises) the previous save's failure either way
        timed_from += time.perf_counter() - waited  # the previous save's time is not this one's
        if any_changed:
            self._replan(flat)
            self._signature = signature
        buffers = self._writer.stage(self._layouts, flat.items)
        objects = flat.objects if self.rank == 0 else None
        self.last_stage_seconds = time.perf_counter() - started
        logger.debug("[rank %d step %d] staged in %.3fs", self.rank, step, self.last_stage_seconds)
        self._in_flight = step
        self._future = self._executor.submit(
            self._write_commit_and_record, step, list(self._layouts), buffers, objects, rank_payload, timed_from
        )
        if not self.config.async_mode:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save is committed; re-raise its error (once).

        Raises:
            CheckpointError: the in-flight save failed (storage past its retries, a rank failed, the commit
                was aborted); the step is not committed and the previous commit stays the latest.
        """
        future, self._future = self._future, None
        if future is None:
            return
        try:
            self._last_committed = future.result()
        except Exception:
            self._failed_in_a_row += 1
            raise
        else:
            self._failed_in_a_row = 0
        finally:
            self._in_flight = None

    def _settle_previous(self) -> None:
        """``wait`` for the in-flight save; its failure is reported and swallowed while fewer than
        ``max_consecutive_failed_saves`` saves in a row failed and the Checkpointer is not broken (a broken
        collective may leave the ranks out of step: that always raises)."""
        step = self._in_flight
        try:
            self.wait()
        except Exception as exc:
            limit = self.config.max_consecutive_failed_saves
            if step is None or not tolerate_failed_save(self._failed_in_a_row, limit, broken=self._broken is not None):
                if self._failed_in_a_row >= limit > 1:
                    logger.error("[rank %d] %d checkpoint saves in a row failed (max_consecutive_failed_saves=%d); "
                                 "raising the last error", self.rank, self._failed_in_a_row, limit)
                raise
            failure = SaveFailure(step=step, error=f"{type(exc).__name__}: {exc}", consecutive=self._failed_in_a_row,
                                  limit=limit, last_committed=self._last_committed)
            logger.error(
                "[rank %d step %d] checkpoint save failed and was not committed (%d of %d failed saves in a row "
                "tolerated; the last committed step %s is kept); training goes on: %s",
                self.rank, step, failure.consecutive, limit, failure.last_committed, failure.error,
            )
            if self._on_save_failure is not None:
                self._on_save_failure(failure)

    def _rank_objects_payload(self, flat: FlatState, step: int) -> tuple[str, bytes, list[str]] | None:
        """This rank's per-rank objects file (name, bytes, keys), encoded now so the save snapshots it;
        ValueError when it is too large."""
        if not flat.rank_objects:
            return None
        data = rank_objects_payload(flat.rank_objects, rank=self.rank, world_size=self.world_size, step=step)
        return rank_objects_file_name(self.rank, self.world_size), data, sorted(flat.rank_objects)

    def _replan(self, flat: FlatState) -> None:
        """Gather every rank's item metadata once, decide who writes what, lay out this rank's files."""
        mine = [[i.key.fqn, list(i.key.offsets), list(i.key.lengths), i.nbytes, i.replicated] for i in flat.items]
        everyone = [
            [(ChunkKey(f, tuple(o), tuple(ln)), n, r) for f, o, ln, n, r in theirs]
            for theirs in self._fg.all_gather(mine)
        ]
        writes = set(assign_writers(everyone)[self.rank])
        indices = [i for i, item in enumerate(flat.items) if item.key in writes]
        self._layouts = plan_files(
            flat.items,
            indices,
            rank=self.rank,
            world_size=self.world_size,
            max_shard_bytes=self.config.max_shard_bytes,
        )
        logger.info(
            "[rank %d] save plan: writes %d of %d local pieces into %d file(s), %d bytes",
            self.rank,
            len(indices),
            len(flat.items),
            len(self._layouts),
            sum(lay.data_bytes for lay in self._layouts),
        )

    def _write_and_commit(
        self,
        step: int,
        layouts: list[ShardLayout],
        buffers: list[memoryview],
        objects: dict[str, JSON] | None,
        rank_payload: tuple[str, bytes, list[str]] | None = None,
        started: float | None = None,
    ) -> int:
        """Background: write this rank's shards, then commit on rank 0; every rank learns the outcome.
        ``started`` (``perf_counter`` in ``save()``) times a committed save for ``save_seconds_estimate``."""
        rel = step_dir(step)
        local_error: BaseException | None = None
        try:
            if self.storage.exists(f"{rel}/{COMMIT_FILE}"):
                raise CheckpointError(
                    f"step {step} is already committed at {self.storage.display(rel)}; a committed step is never overwritten"
                )
            self.storage.makedirs(rel)
            records = self._writer.write(rel, layouts, buffers)
            if rank_payload is not None:
                name, data, keys = rank_payload
                self.storage.write_bytes(f"{rel}/{name}", data)  # atomic and durable, like a shard
                records.rank_objects[name] = RankObjectsRecord(
                    size=len(data), crc32=zlib.crc32(data), rank=self.rank, keys=keys
                )
                crash_point("rank_objects.after")
        except Exception as exc:  # noqa: BLE001 - becomes a vote not to commit, re-raised below
            logger.error("[rank %d step %d] writing shards failed: %s", self.rank, step, exc)
            local_error = exc
            records = RankRecords(rank=self.rank, error=f"{type(exc).__name__}: {exc}")
        all_records = self._collective("records gather", step, self._gather_records, records)
        crash_point("records.gathered")
        outcome: str | None = None
        commit_error: BaseException | None = None
        if self.rank == 0:
            try:
                assert all_records is not None
                manifest = merge_records(
                    all_records,
                    step=step,
                    world_size=self.world_size,
                    block_bytes=self.config.checksum_block_bytes,
                    has_objects=objects is not None,
                    created_unix=time.time(),
                )
                commit_step(self.storage, manifest, objects)
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                commit_error = exc
                outcome = str(exc)
        outcome = self._collective("outcome broadcast", step, self._bg.broadcast, outcome)
        if outcome is None and local_error is None and started is not None:
            self._record_save_seconds(time.perf_counter() - started)
        if self.rank == 0 and (outcome is not None or local_error is not None):
            # after the broadcast: every rank is done writing into the step directory
            self._remove_failed_step(step)
        if self.rank == 0 and outcome is None:
            apply_retention(self.storage, step, keep_last=self.config.keep_last, keep_every=self.config.keep_every)
            # after the broadcast: other ranks need not wait for deletions
        if local_error is not None:
            raise local_error
        if commit_error is not None:
            raise commit_error
        if outcome is not None:
            raise CheckpointError(outcome)
        return step

    def _remove_failed_step(self, step: int) -> None:
        """Delete what a failed save of ``step`` left (shards, per-rank files, a manifest without its commit
        marker), so the next save finds the space it needs on a full disk. Never a committed step: a save of a
        step that was already committed fails before writing, and its directory has the commit marker."""
        rel = step_dir(step)
        try:
            if self.storage.exists(f"{rel}/{COMMIT_FILE}"):
                return
            self.storage.rm(rel, recursive=True)
        except CheckpointError as exc:
            logger.warning("[rank %d step %d] could not remove the failed save's files at %s: %s",
                           self.rank, step, self.storage.display(rel), exc)
        else:
            logger.info("[rank %d step %d] removed the failed save's files at %s", self.rank, step,
                        self.storage.display(rel))

    def _write_commit_and_record(
        self,
        step: int,
        layouts: list[ShardLayout],
        buffers: list[memoryview],
        objects: dict[str, JSON] | None,
        rank_payload: tuple[str, bytes, list[str]] | None,
        started: float,
    ) -> int:
        """``_write_and_commit``, its outcome left for the agent's metrics (``checkpoint.save_record``)."""
        try:
            committed = self._write_and_commit(step, layouts, buffers, objects, rank_payload, started)
        except BaseException:
            self._recorder.failed()
            raise
        # The layouts, not the staging buffers: the process writer stages into its own process (no buffers here).
        nbytes = sum(layout.data_bytes for layout in layouts) + (len(rank_payload[1]) if rank_payload is not None else 0)
        self._recorder.committed(committed, time.perf_counter() - started, nbytes)
        return committed

    def _record_save_seconds(self, seconds: float) -> None:
        self._save_seconds = (*self._save_seconds, seconds)[-SAVE_TIMES_KEPT:]

    def _collective(self, what: str, step: int, fn: Any, *args: Any) -> Any:
        """Run one background collective; a failure (peer gone, ``collective_timeout``) becomes a
        CheckpointError naming the step, and breaks this Checkpointer (see ``_broken``)."""
        try:
            return fn(*args)
        except (RuntimeError, ValueError) as exc:  # gloo's DistBackendError / timeouts are RuntimeErrors
            self._broken = (
                f"the checkpoint {what} for step {step} failed on rank {self.rank} (another rank died, hung or "
                f"exceeded collective_timeout={self.config.collective_timeout.total_seconds():.0f}s): {exc}"
            )
            raise CheckpointError(f"step {step} not committed: {self._broken}") from exc

    def _gather_records(self, records: RankRecords) -> list[RankRecords] | None:
        gathered = self._bg.gather(records.to_json())
        return None if gathered is None else [RankRecords.from_json(g) for g in gathered]

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
        chosen = self._agree_on_step(step)
        if chosen is None:
            logger.info("[rank %d] no checkpoint at %s; starting fresh", self.rank, self.storage.display())
            return None
        loaded = load_with_fallback(
            chosen,
            step_named=step is not None,
            attempt=lambda at: self._load_step(state, at),
            worst=lambda mine: LoadOutcome(self._fg.max(mine)),
            older_step=lambda below: self._fg.rank0_decides(lambda: self._choose_good(below)),
            where=self.storage.display(),
            rank=self.rank,
        )
        if loaded is not None and (self._last_committed is None or loaded > self._last_committed):
            self._last_committed = loaded
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
        self._validated = None
        chosen = self._choose_good() if step is None else step
        if chosen is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {self.storage.display()}")
        manifest = self._validated_manifest(chosen)
        shared = read_objects(self.storage, manifest)
        tensors = {fqn: (rec.shape, torch_dtype(rec.dtype)) for fqn, rec in manifest.tensors.items()}
        state = blank_state(shared, tensors)
        self._read_into(state, manifest, shared)
        return chosen, state

    def _load_step(self, state: Mapping[str, Any], chosen: int) -> None:
        manifest = self._validated_manifest(chosen)
        self._read_into(state, manifest, read_objects(self.storage, manifest))

    def _read_into(self, state: Mapping[str, Any], manifest: Manifest, shared: dict[str, JSON]) -> None:
        started = time.perf_counter()
        chosen = manifest.step
        flat = flatten(state, as_shared=saved_as_shared(manifest, state, shared, rank=self.rank), keep_state_dicts=True)
        requests = plan_reads(manifest, flat.items)
        destinations = {item.key: item.tensor for item in flat.items}
        nbytes = read_requests(
            self.storage,
            step_dir(chosen),
            requests,
            destinations.__getitem__,
            manifest.checksum_block_bytes,
            self.config.verify_on_load,
            self._read_threads(),
        )
        flat.objects = shared
        flat.rank_objects = load_rank_entries(
            self.storage, manifest, flat.per_rank, rank=self.rank, world_size=self.world_size
        )
        apply(state, flat)
        self.last_load_bytes = nbytes
        logger.info(
            "[rank %d] loaded step %d: %d bytes in %d reads, %.2fs",
            self.rank,
            chosen,
            nbytes,
            len(requests),
            time.perf_counter() - started,
        )

    def _read_threads(self) -> int:
        if self.config.read_threads is not None:
            return self.config.read_threads
        if self.storage.is_local:
            return max(1, min(self.config.writer_threads, os.cpu_count() or 1))
        return self.config.writer_threads

    def _agree_on_step(self, step: int | None) -> int | None:
        """Rank 0 picks the step (so all ranks load the same one even if a commit lands meanwhile)."""
        self._validated = None  # never one left over from an earlier, failed load
        if step is not None:
            return step
        return self._fg.rank0_decides(self._choose_good)

    def _choose_good(self, below: int | None = None) -> int | None:
        """``latest_good_step`` (below ``below``), keeping the manifest it validated for ``_load_step``."""
        self._validated = latest_good_manifest(self.storage, below=below)
        return None if self._validated is None else self._validated.step

    def _validated_manifest(self, step: int) -> Manifest:
        """The manifest of ``step`` after ``validate_step``'s checks: the one this rank validated while
        choosing the step (taken once: a later load validates again), else validated now."""
        manifest, self._validated = self._validated, None
        if manifest is not None and manifest.step == step:
            return manifest
        return validate_step(self.storage, step)

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        if self._broken is not None:
            self.wait()  # the failed save's own error first (raised once)
            raise CheckpointError(f"this Checkpointer cannot be used any more: {self._broken}; create a new one "
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
                self._executor.shutdown(wait=True)
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


