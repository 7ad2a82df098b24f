"""Publishing a snapshot, off the training loop's thread: checksum the staged bytes (``shard.block_crcs``, the
durable tier's blocks), append the JSON manifest and the footer, and rename the slot to its published name
(``snap-{step}-{gen}-{rank}-of-{world}.safetensors``), so a reader sees a whole snapshot or none. Also: reading a
snapshot's manifest back, removing what a complete step supersedes, and the round in flight."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from checkpoint.api import JSON, RankRecords, TensorRecord
from checkpoint.memory.api import CorruptSnapshotError, MemoryTierError, SnapshotId, SnapshotManifest
from checkpoint.memory.layout import (
    FOOTER,
    decode_footer,
    encode_footer,
    gen_of_tmp,
    parse_snapshot_name,
    snapshot_name,
)
from checkpoint.memory.slots import Slot
from checkpoint.shard import block_crcs, shard_records

logger = logging.getLogger(__name__)

MANIFEST_MAX_BYTES = 256 << 20
"""Largest snapshot manifest a restore reads (block crc32s of a huge rank, per-rank objects)."""


class Publisher:
    """Publishes this rank's slots under their step's name, and remembers the newest step it published."""

    def __init__(self, *, gen: str, rank: int, world_size: int, node: str, block_bytes: int) -> None:
        self.gen, self.rank, self.world_size, self.node, self.block_bytes = gen, rank, world_size, node, block_bytes
        self.published = -1
        """The newest step this rank published in this generation (-1: none yet)."""
        self.count = 0

    def publish(self, slot: Slot, step: int, objects: dict[str, JSON], rank_objects: dict[str, JSON]) -> int:
        """Checksum the staged bytes, append manifest and footer, publish under the step's name; returns ``step``."""
        slot.fence.wait()  # the device copies end here, off the training loop's thread
        layout = slot.layout
        name = snapshot_name(SnapshotId(step, self.gen), self.rank, self.world_size)
        block = self.block_bytes
        data = memoryview(slot.mm)[len(layout.header) : layout.size]
        try:
            crcs = block_crcs(layout, data, block)
        finally:
            data.release()
        file_record, chunks = shard_records(dataclasses.replace(layout, file=name), crcs, block, rank=self.rank)
        records = RankRecords(rank=self.rank, files={name: file_record})
        for entry, chunk in chunks:
            rec = records.tensors.setdefault(entry.key.fqn, TensorRecord(shape=list(entry.global_shape), dtype=entry.dtype))
            rec.chunks.append(chunk)
        manifest = SnapshotManifest(
            step=step,
            gen=self.gen,
            rank=self.rank,
            world_size=self.world_size,
            node=self.node,
            created_unix=time.time(),
            checksum_block_bytes=block,
            records=records,
            objects=objects,
            rank_objects=rank_objects,
        )
        raw = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
        tail = raw + encode_footer(layout.size, len(raw), zlib.crc32(raw))
        os.ftruncate(slot.fd, layout.size + len(tail))
        if os.pwrite(slot.fd, tail, layout.size) != len(tail):
            raise MemoryTierError(f"short write of the snapshot manifest of step {step} ({slot.path})")
        final = os.path.join(os.path.dirname(slot.path), name)
        os.rename(slot.path, final)
        slot.path, slot.step = final, step
        self.published = step
        self.count += 1
        logger.debug("[rank %d step %d] memory snapshot published: %s (%d bytes)", self.rank, step, final, layout.size)
        return step


def read_manifest(path: str) -> SnapshotManifest:
    """The manifest of the snapshot (or buddy copy) at ``path``, checked against its footer and crc32."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < FOOTER.size:
            raise CorruptSnapshotError(f"{path} is truncated ({size} bytes)")
        try:
            offset, length, crc = decode_footer(os.pread(fd, FOOTER.size, size - FOOTER.size), size)
        except ValueError as exc:
            raise CorruptSnapshotError(f"{path}: {exc}") from exc
        if length > MANIFEST_MAX_BYTES:
            raise CorruptSnapshotError(f"{path}: manifest of {length} bytes is implausible")
        raw = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(raw) != length or zlib.crc32(raw) != crc:
        raise CorruptSnapshotError(f"{path}: the manifest fails its crc32")
    try:
        return SnapshotManifest.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptSnapshotError(f"{path}: malformed manifest: {exc!r}") from exc


def remove_superseded(directory: str, *, gen: str, rank: int, complete: int, held: set[str], leader: bool) -> None:
    """Remove what ``complete`` (every rank published it) supersedes: this rank's older snapshots that no slot
    holds (``held``), and, on the node's leader, every file of earlier generations (workers before a restart)."""
    if complete < 0:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parsed = parse_snapshot_name(name)
        path = os.path.join(directory, name)
        if parsed is not None:
            snap, owner, _ = parsed
            mine_old = snap.gen == gen and owner == rank and snap.step < complete and path not in held
            foreign = snap.gen != gen and leader
            if not (mine_old or foreign):
                continue
        elif not (leader and gen_of_tmp(name) not in (None, gen)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class InFlight:
    """The round running on the tier's background thread: its future and the slot it writes."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="memtier")
        self.future: Future[int] | None = None
        self.slot: Slot | None = None
        """The slot the last round that had one writes (or wrote)."""

    def submit(self, slot: Slot | None, fn: Callable[[], int]) -> None:
        if slot is not None:
            self.slot = slot
        self.future = self.executor.submit(fn)

    def busy(self) -> bool:
        return self.future is not None and not self.future.done()

    def take(self) -> Future[int] | None:
        """The future of the round in flight, forgotten here (its outcome is the caller's to read)."""
        future, self.future = self.future, None
        return future

    def wait_briefly(self, timeout: float, on_error: Callable[[Exception], None]) -> bool:
        """Wait up to ``timeout`` s for the round in flight; False when it is still running (``slot`` may be
        in use)."""
        future = self.future
        if future is None:
            return True
        try:
            future.result(timeout=timeout)
        except FutureTimeout:
            return False
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop this one
            on_error(exc)
        self.future = None
        return True

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
