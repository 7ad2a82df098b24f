"""The Checkpointer: async sharded saves, loads at any world size.

Save (per rank): ``flatten`` the state -> decide who writes what (``plan.assign_writers``, recomputed only
when the items change) -> ``Stager`` copies the pieces this rank writes into reused host buffers (the only
time the training step blocks) -> a background thread writes this rank's shard files and its per-rank objects
file (``PerRank`` entries, encoded at ``save`` time), gathers every rank's records on rank 0 over a dedicated
gloo group, and rank 0 commits (see ``checkpoint.commit``). ``load`` gives each rank its own per-rank entries
back (at another world size, the copy ``api.per_rank_source`` names).

Two gloo groups are created at construction (collective, same order on all ranks): a foreground one for
the cheap per-save vote and the item metadata gather (training thread), and a background one for the
commit (writer thread). Neither is the training's default group, so a collective the writer thread runs
can never interleave with the training's own collectives.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.api import (
    JSON,
    COMMIT_FILE,
    ChunkKey,
    CheckpointConfigError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    RankObjectsRecord,
    SaveInProgressError,
    crash_point,
    per_rank_source,
    rank_objects_file_name,
    step_dir,
)
from checkpoint.commit import commit_step, merge_records, rank_objects_payload
from checkpoint.config import CheckpointConfig
from checkpoint.discover import latest_good_step, list_steps, read_objects, read_rank_objects, validate_step
from checkpoint.plan import assign_writers, plan_reads
from checkpoint.retention import delete_step, steps_to_delete
from checkpoint.shard import ShardLayout, read_requests
from checkpoint.staging import Stager
from checkpoint.state import FlatState, apply, flatten, per_rank_entries
from checkpoint.storage import RetryPolicy, Storage, lower_thread_priority
from checkpoint.writer import RankRecords, WriterProcess, plan_files, write_rank_files

logger = logging.getLogger(__name__)


_LOAD_OK, _LOAD_DAMAGED, _LOAD_FAILED = 0, 1, 2
"""A load attempt's outcome, ordered so the max over ranks is the worst."""


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
        sleep: Any = time.sleep,
    ) -> None:
        self.config = config or CheckpointConfig()
        c = self.config
        self.storage = Storage(
            uri,
            storage_options=c.storage_options,
            retry=RetryPolicy(
                max_attempts=c.max_retries, timeout=c.retry_timeout, max_wait=c.retry_max_wait, sleep=sleep
            ),
            upload_threads=c.writer_threads,
            multipart_chunk_bytes=c.multipart_chunk_bytes,
            thread_nice=c.writer_nice,
            writeback_bytes=c.writeback_bytes,
        )
        self.rank, self.world_size = 0, 1
        self._fg_group: Any = None
        self._bg_group: Any = None
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            if self.world_size > 1:
                self._fg_group = dist.new_group(ranks=ranks, backend="gloo", timeout=c.collective_timeout)
                self._bg_group = dist.new_group(ranks=ranks, backend="gloo", timeout=c.collective_timeout)
        self._writer_proc: WriterProcess | None = None
        if c.writer == "process":
            self._writer_proc = self._start_writer_process()
        shared = None
        if self._writer_proc is not None:  # page-cache-free shared memory where there is some
            shared = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self._stager = Stager(shared_dir=shared)
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

    def _start_writer_process(self) -> WriterProcess:
        if type(self.storage.fs).__name__ == "MemoryFileSystem":
            raise CheckpointConfigError(
                'writer="process" cannot write to memory:// (that filesystem lives inside this process); '
                'use writer="thread"'
            )
        c = self.config
        return WriterProcess(
            uri=self.storage.uri,
            storage_options=c.storage_options,
            retry={
                "max_attempts": c.max_retries,
                "timeout": c.retry_timeout.total_seconds(),
                "max_wait": c.retry_max_wait.total_seconds(),
            },
            upload_threads=c.writer_threads,
            multipart_chunk_bytes=c.multipart_chunk_bytes,
            nice=c.writer_nice,
            writeback_bytes=c.writeback_bytes,
        )

    def __repr__(self) -> str:
        return f"Checkpointer({self.storage.display()!r}, rank={self.rank}/{self.world_size})"

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Stage ``state`` to host memory and write it as ``step`` in the background (see ``wait``).

        Raises the error of the previous save if it failed (on every rank), SaveInProgressError when a
        save is in flight and ``when_busy="refuse"``.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        started = time.perf_counter()
        try:
            flat = flatten(state)
            rank_payload = self._rank_objects_payload(flat, step)
        except (TypeError, ValueError) as exc:  # bad state on this rank: vote, so no rank waits for it
            flat, rank_payload, state_error = FlatState(), None, exc
        else:
            state_error = None
        signature = tuple((i.key, i.dtype, tuple(i.global_shape), i.replicated) for i in flat.items)
        busy = self._future is not None and not self._future.done()
        any_busy, any_changed, any_bad = self._vote(busy, signature != self._signature, state_error is not None)
        if any_bad:  # every rank raises, so none is left waiting in the commit's collectives
            if state_error is not None:
                raise state_error
            raise CheckpointError(f"rank {self.rank}: step {step} not saved: another rank's state was rejected (see its error)")
        if any_busy and self.config.when_busy == "refuse":
            raise SaveInProgressError(
                f"rank {self.rank}: save of step {self._in_flight} is still writing; step {step} was not saved "
                f'(use when_busy="wait" to block instead)'
            )
        self.wait()  # waits if busy; re-raises the previous save's error either way
        if any_changed:
            self._replan(flat)
            self._signature = signature
        if self._writer_proc is not None and not self._writer_proc.alive:
            logger.warning(
                "[rank %d] checkpoint writer process %d died; starting a new one", self.rank, self._writer_proc.proc.pid
            )
            self._writer_proc.close()
            self._writer_proc = self._start_writer_process()
            self._stager.release()  # the new process must map fresh buffers
        buffers = self._stager.stage(self._layouts, flat.items)
        if self._writer_proc is not None and self._stager.shared_paths:
            self._writer_proc.attach(self._stager.shared_paths)  # new buffers: let the writer map them,
            self._stager.unlink_shared()  # then drop their names so a crash leaves nothing in /dev/shm
        objects = flat.objects if self.rank == 0 else None
        self.last_stage_seconds = time.perf_counter() - started
        logger.debug("[rank %d step %d] staged in %.3fs", self.rank, step, self.last_stage_seconds)
        self._in_flight = step
        if self._writer_proc is not None:
            buffers = []  # the writer process reads its own mapping; keep no views of ours alive
        self._future = self._executor.submit(
            self._write_and_commit, step, list(self._layouts), buffers, objects, rank_payload
        )
        if not self.config.async_mode:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save is committed; re-raise its error (once)."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        finally:
            self._in_flight = None

    def _vote(self, busy: bool, changed: bool, bad: bool = False) -> tuple[bool, bool, bool]:
        """Agree across ranks whether any rank is busy / has new items / refuses this save (so all take the
        same branch)."""
        if self._fg_group is None:
            return busy, changed, bad
        flags = torch.tensor([int(busy), int(changed), int(bad)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._fg_group)
        return bool(flags[0]), bool(flags[1]), bool(flags[2])

    def _rank_objects_payload(self, flat: FlatState, step: int) -> tuple[str, bytes, list[str]] | None:
        """This rank's per-rank objects file (name, bytes, keys), encoded now so the save snapshots it;
        ValueError when it is too large."""
        if not flat.rank_objects:
            return None
        data = rank_objects_payload(flat.rank_objects, rank=self.rank, world_size=self.world_size, step=step)
        return rank_objects_file_name(self.rank, self.world_size), data, sorted(flat.rank_objects)

    def _replan(self, flat: FlatState) -> None:
        """Gather every rank's item metadata once, decide who writes what, lay out this rank's files."""
        mine = [(i.key, i.nbytes, i.replicated) for i in flat.items]
        if self._fg_group is None:
            everyone = [mine]
        else:
            payload = json.dumps([[k.fqn, list(k.offsets), list(k.lengths), n, r] for k, n, r in mine])
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, payload, group=self._fg_group)
            everyone = [
                [(ChunkKey(f, tuple(o), tuple(ln)), n, r) for f, o, ln, n, r in json.loads(p)] for p in gathered
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
    ) -> int:
        """Background: write this rank's shards, then commit on rank 0; every rank learns the outcome."""
        rel = step_dir(step)
        local_error: BaseException | None = None
        try:
            if self.storage.exists(f"{rel}/{COMMIT_FILE}"):
                raise CheckpointError(
                    f"step {step} is already committed at {self.storage.display(rel)}; a committed step is never overwritten"
                )
            self.storage.makedirs(rel)
            if self._writer_proc is not None:
                records = self._writer_proc.write(
                    rel,
                    layouts,
                    block_bytes=self.config.checksum_block_bytes,
                    rank=self.rank,
                    threads=self.config.writer_threads,
                )
                if records.error:
                    raise CheckpointError(records.error)
            else:
                records = write_rank_files(
                    self.storage,
                    rel,
                    layouts,
                    buffers,
                    block_bytes=self.config.checksum_block_bytes,
                    rank=self.rank,
                    threads=self.config.writer_threads,
                    nice=self.config.writer_nice,
                )
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
        outcome = self._collective("outcome broadcast", step, self._broadcast_outcome, outcome)
        if self.rank == 0 and outcome is None:
            self._apply_retention(step)  # after the broadcast: other ranks need not wait for deletions
        if local_error is not None:
            raise local_error
        if commit_error is not None:
            raise commit_error
        if outcome is not None:
            raise CheckpointError(outcome)
        return step

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
        if self._bg_group is None:
            return [records]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(json.dumps(records.to_json()), gathered, group=self._bg_group, group_dst=0)
        if gathered is None:
            return None
        return [RankRecords.from_json(json.loads(g)) for g in gathered]

    def _broadcast_outcome(self, outcome: str | None) -> str | None:
        if self._bg_group is None:
            return outcome
        box = [outcome]
        dist.broadcast_object_list(box, group=self._bg_group, group_src=0)
        return box[0]

    def _apply_retention(self, committed_step: int) -> None:
        try:
            crash_point("retention.before")
            listing = list_steps(self.storage)
            doomed = steps_to_delete(
                listing.committed,
                listing.uncommitted,
                keep_last=self.config.keep_last,
                keep_every=self.config.keep_every,
                in_flight=committed_step,
                protect=self._newest_good(listing),
            )
            for step in doomed:
                delete_step(self.storage, step)
        except CheckpointError as exc:  # the new step is committed; failing to prune must not undo that
            logger.warning("[step %d] retention failed (old steps kept): %s", committed_step, exc)

    def _newest_good(self, listing: Any) -> tuple[int, ...]:
        """The newest step that validates (retention keeps it even when a newer commit turns out damaged)."""
        good = latest_good_step(self.storage, listing=listing)
        return () if good is None else (good,)

    # ------------------------------------------------------------------ discover / load
    def latest(self) -> int | None:
        """Newest committed step that is intact (uncommitted and corrupt steps are skipped), or None."""
        self._check_open()
        return latest_good_step(self.storage)

    def load(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """Restore ``state`` in place from ``step`` (default: latest good step) at the current world size.

        Returns the step loaded, or None when there is no checkpoint yet (only with ``step=None``). With
        ``step=None``, damage found only while reading (a checksum mismatch, a truncated shard) makes every
        rank fall back to the next older good step, with a warning: a job that keeps restarting must not
        stay stuck on one bad checkpoint. A named ``step`` is loaded or raises.
        """
        self._check_open()
        self.wait()
        chosen = self._agree_on_step(step)
        if chosen is None:
            logger.info("[rank %d] no checkpoint at %s; starting fresh", self.rank, self.storage.display())
            return None
        while True:
            error: BaseException | None = None
            try:
                self._load_step(state, chosen)
            except Exception as exc:  # noqa: BLE001 - voted on below, then re-raised or recovered from
                error = exc
            verdict = self._load_verdict(error)
            if verdict == _LOAD_OK:
                return chosen
            if verdict == _LOAD_FAILED or step is not None:
                if error is not None:
                    raise error
                raise CheckpointError(f"rank {self.rank}: loading step {chosen} failed on another rank (see its error)")
            older = self._agree_on_older_step(chosen)
            if older is None:
                if error is not None:
                    raise error
                raise CorruptCheckpointError(
                    f"step {chosen} at {self.storage.display()} is damaged (see the failing rank's error) "
                    f"and no older good step exists"
                )
            logger.warning(
                "[rank %d] step %d at %s is damaged (%s); falling back to step %d",
                self.rank,
                chosen,
                self.storage.display(),
                error if error is not None else "found by another rank",
                older,
            )
            chosen = older

    def _load_step(self, state: Mapping[str, Any], chosen: int) -> None:
        started = time.perf_counter()
        manifest = validate_step(self.storage, chosen)
        shared = read_objects(self.storage, manifest)
        flat = flatten(state, as_shared=self._saved_as_shared(manifest, state, shared))
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
        flat.rank_objects = self._load_rank_objects(manifest, flat.per_rank)
        apply(state, flat)
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

    def _load_verdict(self, error: BaseException | None) -> int:
        """Worst outcome over ranks: OK, DAMAGED (data of this step is corrupt: an older step may do) or
        FAILED (anything else: wrong state, storage unreachable; an older step would not help, or would
        silently lose progress)."""
        damaged = isinstance(error, (CorruptCheckpointError, CheckpointNotFoundError))  # NotFound: deleted meanwhile
        mine = _LOAD_OK if error is None else _LOAD_DAMAGED if damaged else _LOAD_FAILED
        if self._fg_group is None:
            return mine
        box = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._fg_group)
        return int(box.item())

    def _agree_on_older_step(self, below: int) -> int | None:
        """Rank 0 picks the newest good step older than ``below``; every rank gets its choice."""
        return self._rank0_decides(lambda: latest_good_step(self.storage, below=below))

    def _saved_as_shared(self, manifest: Any, state: Mapping[str, Any], shared: dict[str, JSON]) -> set[str]:
        """Per-rank keys of the live state that ``manifest``'s step saved as shared state (it predates per-rank
        entries, e.g. an ``RNGState`` saved by an older spotrun): they load rank 0's copy, as they were saved."""
        saved_per_rank = {k for rec in manifest.rank_objects.values() for k in rec.keys}
        legacy = {k for k in per_rank_entries(state) if k not in saved_per_rank and k in shared}
        if legacy and self.rank == 0:
            logger.warning(
                "[rank %d step %d] %s saved as shared state (before per-rank entries): every rank loads rank 0's copy",
                self.rank,
                manifest.step,
                sorted(legacy),
            )
        return legacy

    def _load_rank_objects(self, manifest: Any, per_rank: dict[str, str]) -> dict[str, JSON]:
        """This rank's copies of the per-rank entries, chosen by ``per_rank_source`` (each file read once,
        checked against the manifest). Entries whose rule is ``skip`` at a new world size are left out."""
        if not per_rank:
            return {}
        saved = manifest.world_size
        sources = {key: per_rank_source(self.rank, self.world_size, saved, rule) for key, rule in per_rank.items()}
        if saved != self.world_size and self.rank == 0:
            logger.warning(
                "[rank %d step %d] per-rank state saved at world size %d, loading at %d: %s "
                "(rank_modulo: rank r takes saved rank r %% %d's copy; rank0: saved rank 0's; skip: kept as is)",
                self.rank,
                manifest.step,
                saved,
                self.world_size,
                ", ".join(f"{k}={rule}" for k, rule in sorted(per_rank.items())),
                saved,
            )
        files: dict[int, dict[str, JSON]] = {}
        out: dict[str, JSON] = {}
        for key, src in sorted(sources.items()):
            if src is None:
                continue
            if src not in files:
                files[src] = read_rank_objects(self.storage, manifest, src)
            if key not in files[src]:
                raise IncompatibleCheckpointError(
                    f"step {manifest.step} has no per-rank entry {key!r} (saved per-rank entries: {sorted(files[src])}); "
                    f"remove the key from the state or wrap it as PerRank(..., on_resize='skip')"
                )
            out[key] = files[src][key]
            if src != self.rank:
                logger.info("[rank %d step %d] per-rank entry %r from saved rank %d", self.rank, manifest.step, key, src)
        return out

    def _agree_on_step(self, step: int | None) -> int | None:
        """Rank 0 picks the step (so all ranks load the same one even if a commit lands meanwhile)."""
        if step is not None:
            return step
        return self._rank0_decides(self.latest)

    def _rank0_decides(self, pick: Callable[[], int | None]) -> int | None:
        """``pick()`` on rank 0, its result on every rank (one broadcast on the foreground group)."""
        if self._fg_group is None:
            return pick()
        box: list[Any] = [pick() if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self._fg_group, group_src=0)
        return box[0]

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
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self.storage.close()
            if self._writer_proc is not None:
                self._writer_proc.close()
            self._stager.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError:
            logger.exception("error while closing the checkpointer after another error")


