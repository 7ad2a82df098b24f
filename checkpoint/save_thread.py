"""The background half of a save, on its own thread: write this rank's shards and per-rank objects file, gather
every rank's records, rank 0 commits (``checkpoint.commit``) and prunes (``retention``), every rank learns the
outcome; and what the training thread keeps of those outcomes (the save in flight, failures in a row, the last
committed step, recent save times).

Its collectives go through the background group only, so none can interleave with the training thread's. A
failed one breaks the ``Checkpointer``: the ranks may disagree on where they are in the sequence of collectives.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

from checkpoint.api import (
    COMMIT_FILE,
    JSON,
    CheckpointError,
    RankObjectsRecord,
    RankRecords,
    SaveFailure,
    ShardWriter,
    step_dir,
)
from checkpoint.collective import Collective
from checkpoint.commit import commit_step, merge_records
from checkpoint.config import CheckpointConfig
from checkpoint.faults import crash_point
from checkpoint.retention import apply_retention
from checkpoint.save_record import SaveRecorder
from checkpoint.shard import ShardLayout
from checkpoint.storage import Storage, lower_thread_priority

logger = logging.getLogger(__name__)

SAVE_TIMES_KEPT: Final = 4
"""How many recent committed saves ``Checkpointer.save_seconds_estimate`` looks at (the slowest wins: storage
speed varies, and a planned save that is cut off costs more than one skipped for a pessimistic guess)."""

RankPayload = tuple[str, bytes, list[str]]
"""A rank's per-rank objects file: name, bytes, keys."""


def tolerate_failed_save(failed_in_a_row: int, limit: int, *, broken: bool) -> bool:
    """Whether the next ``save`` reports a failed background save and goes on (True) or raises it: fewer
    than ``limit`` saves in a row failed, and no collective broke (a broken one may leave ranks out of step).
    Every rank learns the same outcome of each save, so every rank decides alike."""
    return not broken and failed_in_a_row < limit


class SaveThread:
    """One background save at a time, and the outcomes of the saves that ran."""

    def __init__(
        self,
        config: CheckpointConfig,
        storage: Storage,
        writer: ShardWriter,
        collective: Collective,
        *,
        on_save_failure: Callable[[SaveFailure], None] | None,
    ) -> None:
        self._config = config
        self._storage = storage
        self._writer = writer
        self._bg = collective
        self.rank, self.world_size = collective.rank, collective.world_size
        self._on_save_failure = on_save_failure
        self._recorder = SaveRecorder(self.rank)
        """Each save's outcome, left for the spotrun agent's metrics (a no-op outside spotrun)."""
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="ckpt-bg", initializer=lower_thread_priority, initargs=(config.writer_nice,)
        )
        self._future: Future[int] | None = None
        self.in_flight: int | None = None
        """The step being saved, until ``wait`` collects it."""
        self.failed_in_a_row = 0
        self.last_committed: int | None = None
        self.save_seconds: tuple[float, ...] = ()
        """Save-to-commit seconds of the last ``SAVE_TIMES_KEPT`` committed saves, oldest first. Replaced whole
        (never mutated) by the writer thread, so the training thread reads it without a lock."""
        self.broken: str | None = None
        """Why a background collective failed, once one did."""

    @property
    def pending(self) -> bool:
        """A save was submitted and not waited for yet."""
        return self._future is not None

    @property
    def busy(self) -> bool:
        """A save is still running."""
        return self._future is not None and not self._future.done()

    def submit(
        self,
        step: int,
        layouts: list[ShardLayout],
        buffers: list[memoryview],
        objects: dict[str, JSON] | None,
        rank_payload: RankPayload | None,
        started: float,
    ) -> None:
        """Write and commit a staged save of ``step`` in the background; ``started`` (``perf_counter``) times it."""
        self.in_flight = step
        self._future = self._executor.submit(
            self._write_commit_and_record, step, layouts, buffers, objects, rank_payload, started
        )

    def wait(self) -> None:
        """Block until the in-flight save is committed; re-raise its error (once)."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            self.last_committed = future.result()
        except Exception:
            self.failed_in_a_row += 1
            raise
        else:
            self.failed_in_a_row = 0
        finally:
            self.in_flight = None

    def settle_previous(self) -> None:
        """``wait`` for the in-flight save; its failure is reported and swallowed while fewer than
        ``max_consecutive_failed_saves`` saves in a row failed and no collective broke."""
        step = self.in_flight
        try:
            self.wait()
        except Exception as exc:
            limit = self._config.max_consecutive_failed_saves
            if step is None or not tolerate_failed_save(self.failed_in_a_row, limit, broken=self.broken is not None):
                if self.failed_in_a_row >= limit > 1:
                    logger.error("[rank %d] %d checkpoint saves in a row failed (max_consecutive_failed_saves=%d); "
                                 "raising the last error", self.rank, self.failed_in_a_row, limit)
                raise
            failure = SaveFailure(step=step, error=f"{type(exc).__name__}: {exc}", consecutive=self.failed_in_a_row,
                                  limit=limit, last_committed=self.last_committed)
            logger.error(
                "[rank %d step %d] checkpoint save failed and was not committed (%d of %d failed saves in a row "
                "tolerated; the last committed step %s is kept); training goes on: %s",
                self.rank, step, failure.consecutive, limit, failure.last_committed, failure.error,
            )
            if self._on_save_failure is not None:
                self._on_save_failure(failure)

    def close(self) -> None:
        """Stop the thread (after ``wait``)."""
        self._executor.shutdown(wait=True)

    def _write_commit_and_record(
        self,
        step: int,
        layouts: list[ShardLayout],
        buffers: list[memoryview],
        objects: dict[str, JSON] | None,
        rank_payload: RankPayload | None,
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

    def _write_and_commit(
        self,
        step: int,
        layouts: list[ShardLayout],
        buffers: list[memoryview],
        objects: dict[str, JSON] | None,
        rank_payload: RankPayload | None,
        started: float,
    ) -> int:
        """Write this rank's shards, then commit on rank 0; every rank learns the outcome."""
        storage = self._storage
        rel = step_dir(step)
        local_error: BaseException | None = None
        try:
            if storage.exists(f"{rel}/{COMMIT_FILE}"):
                raise CheckpointError(
                    f"step {step} is already committed at {storage.display(rel)}; a committed step is never overwritten"
                )
            storage.makedirs(rel)
            records = self._writer.write(rel, layouts, buffers)
            if rank_payload is not None:
                name, data, keys = rank_payload
                storage.write_bytes(f"{rel}/{name}", data)  # atomic and durable, like a shard
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
                    block_bytes=self._config.checksum_block_bytes,
                    has_objects=objects is not None,
                    created_unix=time.time(),
                )
                commit_step(storage, manifest, objects)
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                commit_error = exc
                outcome = str(exc)
        outcome = self._collective("outcome broadcast", step, self._bg.broadcast, outcome)
        if outcome is None and local_error is None:
            self.save_seconds = (*self.save_seconds, time.perf_counter() - started)[-SAVE_TIMES_KEPT:]
        if self.rank == 0 and (outcome is not None or local_error is not None):
            # after the broadcast: every rank is done writing into the step directory
            self._remove_failed_step(step)
        if self.rank == 0 and outcome is None:
            c = self._config
            apply_retention(storage, step, keep_last=c.keep_last, keep_every=c.keep_every)
            # after the broadcast: other ranks need not wait for deletions
        if local_error is not None:
            raise local_error
        if commit_error is not None:
            raise commit_error
        if outcome is not None:
            raise CheckpointError(outcome)
        return step

    def _remove_failed_step(self, step: int) -> None:
        """Delete what a failed save of ``step`` left, so the next save finds the space it needs on a full disk.
        Never a committed step: a save of a committed step fails before writing, and its directory has the
        commit marker."""
        rel = step_dir(step)
        try:
            if self._storage.exists(f"{rel}/{COMMIT_FILE}"):
                return
            self._storage.rm(rel, recursive=True)
        except CheckpointError as exc:
            logger.warning("[rank %d step %d] could not remove the failed save's files at %s: %s",
                           self.rank, step, self._storage.display(rel), exc)
        else:
            logger.info("[rank %d step %d] removed the failed save's files at %s", self.rank, step,
                        self._storage.display(rel))

    def _collective(self, what: str, step: int, fn: Any, *args: Any) -> Any:
        """Run one background collective; a failure (peer gone, ``collective_timeout``) becomes a
        CheckpointError naming the step, and sets ``broken``."""
        try:
            return fn(*args)
        except (RuntimeError, ValueError) as exc:  # gloo's DistBackendError / timeouts are RuntimeErrors
            self.broken = (
                f"the checkpoint {what} for step {step} failed on rank {self.rank} (another rank died, hung or "
                f"exceeded collective_timeout={self._config.collective_timeout.total_seconds():.0f}s): {exc}"
            )
            raise CheckpointError(f"step {step} not committed: {self.broken}") from exc

    def _gather_records(self, records: RankRecords) -> list[RankRecords] | None:
        gathered = self._bg.gather(records.to_json())
        return None if gathered is None else [RankRecords.from_json(g) for g in gathered]
