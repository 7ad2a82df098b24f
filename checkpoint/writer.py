"""Background writer: a rank's staged buffers -> its safetensors shard files, durable, with their records."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

from checkpoint.api import (
    JSON,
    ChunkRecord,
    FileRecord,
    TensorItem,
    TensorRecord,
    crash_point,
    shard_file_name,
)
from checkpoint.shard import ShardLayout, build_layout, write_shard
from checkpoint.storage import Sink, Storage, lower_thread_priority

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RankRecords:
    """What one rank wrote for a step (sent to rank 0 as JSON for the manifest)."""

    rank: int
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, JSON]:
        return {
            "rank": self.rank,
            "error": self.error,
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "files": {k: v.to_json() for k, v in self.files.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> RankRecords:
        return cls(
            rank=int(d["rank"]),
            error=d.get("error"),
            tensors={k: TensorRecord.from_json(v) for k, v in d["tensors"].items()},
            files={k: FileRecord.from_json(v) for k, v in d["files"].items()},
        )


def plan_files(
    items: Sequence[TensorItem],
    write_indices: Sequence[int],
    *,
    rank: int,
    world_size: int,
    max_shard_bytes: int,
) -> list[ShardLayout]:
    """Group the items this rank writes into shard files of at most ``max_shard_bytes`` (pure)."""
    parts: list[list[int]] = []
    size = 0
    for index in sorted(write_indices, key=lambda i: (items[i].key.fqn, items[i].key.offsets)):
        nbytes = items[index].nbytes
        if not parts or (size + nbytes > max_shard_bytes and parts[-1]):
            parts.append([])
            size = 0
        parts[-1].append(index)
        size += nbytes
    layouts = []
    for part, indices in enumerate(parts):
        pieces = [
            (i, items[i].key, tuple(items[i].global_shape), items[i].dtype, items[i].nbytes) for i in indices
        ]
        layouts.append(build_layout(shard_file_name(rank, world_size, part), pieces))
    return layouts


def _write_one(
    storage: Storage,
    step_rel: str,
    layout: ShardLayout,
    data: memoryview,
    block_bytes: int,
    rank: int,
    crc_pool: Executor | None,
) -> tuple[FileRecord, list[tuple[object, ChunkRecord]]]:
    rel = f"{step_rel}/{layout.file}"

    def produce(sink: Sink) -> tuple[FileRecord, list]:
        crash_point("shard.open")
        result = write_shard(sink, layout, data, block_bytes, rank=rank, crc_pool=crc_pool)
        crash_point("shard.before_commit")
        return result

    result = storage.write_stream(rel, produce)
    crash_point("shard.after_commit")
    logger.debug("rank %d wrote %s (%d bytes)", rank, storage.display(rel), layout.size)
    return result


def write_rank_files(
    storage: Storage,
    step_rel: str,
    layouts: Sequence[ShardLayout],
    buffers: Sequence[memoryview],
    *,
    block_bytes: int,
    rank: int,
    threads: int,
    nice: int = 0,
) -> RankRecords:
    """Write every shard file of this rank (files in parallel); returns the records for the manifest."""
    records = RankRecords(rank=rank)
    if not layouts:
        return records
    # One extra thread computes checksums while the writer threads write (see write_shard).
    with ThreadPoolExecutor(
        1, thread_name_prefix="ckpt-crc", initializer=lower_thread_priority, initargs=(nice,)
    ) as crc_pool:
        if threads <= 1 or len(layouts) == 1:
            results = [
                _write_one(storage, step_rel, lay, buf, block_bytes, rank, crc_pool) for lay, buf in zip(layouts, buffers)
            ]
        else:
            with ThreadPoolExecutor(
                min(threads, len(layouts)),
                thread_name_prefix="ckpt-write",
                initializer=lower_thread_priority,
                initargs=(nice,),
            ) as pool:
                futures = [
                    pool.submit(_write_one, storage, step_rel, lay, buf, block_bytes, rank, crc_pool)
                    for lay, buf in zip(layouts, buffers)
                ]
                results = [f.result() for f in futures]
    for layout, (file_record, chunks) in zip(layouts, results):
        records.files[layout.file] = file_record
        for entry, chunk in chunks:
            rec = records.tensors.setdefault(
                entry.key.fqn, TensorRecord(shape=list(entry.global_shape), dtype=entry.dtype)  # type: ignore[attr-defined]
            )
            rec.chunks.append(chunk)
    return records
