"""Helpers for the state/plan tests: an in-memory "storage" that runs the real planner end to end (the
multi-process launcher is ``tests.harness.dist``).

The in-memory store writes each rank's assigned pieces into one byte blob per rank exactly as a shard
file would hold them (C-contiguous, back to back), builds a real Manifest with per-block crc32, and
loads through ``plan_reads`` + ``chunk_view``: the whole flatten -> plan -> bytes -> apply chain without
the Checkpointer.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint.api import ChunkRecord, FileRecord, Manifest, TensorRecord
from checkpoint.plan import assign_writers, chunk_view, plan_reads, validate_tiling
from checkpoint.state import FlatState

BLOCK = 64  # tiny checksum blocks so tests cross block boundaries


# --------------------------------------------------------------------------- in-memory store
@dataclass
class MemoryCheckpoint:
    manifest: Manifest
    files: dict[str, bytes]
    objects: dict[str, Any]
    rank_objects: list[dict[str, Any]] | None = None
    """Each saving rank's per-rank skeletons (``FlatState.rank_objects``)."""


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def block_crcs(data: bytes, block: int = BLOCK) -> list[int]:
    return [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]


def save_flats(flats: Sequence[FlatState], step: int = 1) -> MemoryCheckpoint:
    """Plan and "write" the flattened states of all ranks (rank r = flats[r])."""
    plan = assign_writers([[(i.key, i.nbytes, i.replicated) for i in f.items] for f in flats])
    files: dict[str, bytes] = {}
    tensors: dict[str, TensorRecord] = {}
    file_records: dict[str, FileRecord] = {}
    for rank, (flat, keys) in enumerate(zip(flats, plan)):
        by_key = {i.key: i for i in flat.items}
        name = f"rank-{rank:05d}.safetensors"
        blob = bytearray()
        for key in keys:
            item = by_key[key]
            data = tensor_bytes(item.tensor)
            rec = tensors.setdefault(key.fqn, TensorRecord(shape=list(item.global_shape), dtype=item.dtype))
            rec.chunks.append(
                ChunkRecord(
                    offsets=list(key.offsets),
                    lengths=list(key.lengths),
                    file=name,
                    key=key.fqn,
                    byte_range=[len(blob), len(blob) + len(data)],
                    block_crc32=block_crcs(data),
                )
            )
            blob += data
        files[name] = bytes(blob)
        file_records[name] = FileRecord(size=len(blob), crc32=zlib.crc32(blob), rank=rank)
    manifest = Manifest(
        step=step,
        world_size=len(flats),
        created_unix=time.time(),
        library_version="test",
        tensors=tensors,
        files=file_records,
        has_objects=True,
        checksum_block_bytes=BLOCK,
    )
    validate_tiling(manifest)
    return MemoryCheckpoint(
        manifest=manifest, files=files, objects=flats[0].objects, rank_objects=[f.rank_objects for f in flats]
    )


def load_flat(ckpt: MemoryCheckpoint, flat: FlatState, rank: int = 0) -> tuple[FlatState, int]:
    """Fill ``flat``'s destination pieces from ``ckpt``; returns (flat with the checkpoint's objects and saved
    rank ``rank % saved world size``'s per-rank objects, bytes read)."""
    validate_tiling(ckpt.manifest)
    by_key = {i.key: i for i in flat.items}
    nread = 0
    for req in plan_reads(ckpt.manifest, flat.items):
        lo, hi = req.read_range
        raw = ckpt.files[req.file][lo:hi]
        nread += len(raw)
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        src = chunk_view(buf, req.dtype, req.chunk_lengths, req.chunk_byte_range[0], req.read_range, req.src_slices)
        dst = by_key[req.dst].tensor
        dst[tuple(slice(a, b) for a, b in req.dst_slices)].copy_(src)
    saved = ckpt.rank_objects or [{}]
    return FlatState(
        items=flat.items, objects=ckpt.objects, rank_objects=saved[rank % len(saved)], per_rank=flat.per_rank
    ), nread
