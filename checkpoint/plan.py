"""Pure planning: who writes which piece on save, and which byte ranges each rank reads on load.

Nothing here does I/O or talks to other ranks. Save: every rank's items are gathered (by the caller)
into plain ``(ChunkKey, nbytes, replicated)`` tuples and :func:`assign_writers` decides, identically on
every rank, who writes what. Load: :func:`plan_reads` intersects the pieces this rank wants (its live
local shards, possibly at a new world size) with the stored chunks of the manifest and returns one
:class:`~checkpoint.api.ReadRequest` per overlap, reading only the minimal contiguous byte range of each
chunk. :func:`chunk_view` turns the bytes of such a range into a tensor view of the requested elements.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .api import (
    ChunkKey,
    ChunkRecord,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    Manifest,
    ReadRequest,
    TensorItem,
    TensorRecord,
)
from .dtypes import element_size, torch_dtype

if TYPE_CHECKING:
    import torch  # on first use: spotrun-ckpt ls and inspect run without torch

logger = logging.getLogger(__name__)

__all__ = [
    "assign_writers",
    "c_strides",
    "chunk_view",
    "element_size",
    "min_byte_range",
    "plan_reads",
    "validate_tiling",
]

Box = tuple[tuple[int, int], ...]  # per dim [start, stop)


def c_strides(lengths: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of shape ``lengths``."""
    strides = [1] * len(lengths)
    for d in range(len(lengths) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(lengths[d + 1]), 1)
    return tuple(strides)


def _volume(lengths: Iterable[int]) -> int:
    return math.prod(int(x) for x in lengths)


def _key_order(key: ChunkKey) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    return (key.fqn, tuple(key.offsets), tuple(key.lengths))


# --------------------------------------------------------------------------- save: who writes what
def assign_writers(all_ranks: Sequence[Sequence[tuple[ChunkKey, int, bool]]]) -> list[list[ChunkKey]]:
    """Decide which rank writes which piece; pure and deterministic (every rank computes the same answer).

    ``all_ranks[r]`` lists rank ``r``'s pieces as ``(key, nbytes, replicated)``. A non-replicated piece is
    written by its owner. Each distinct replicated piece is written by exactly one of the ranks holding it,
    chosen greedily largest-first onto the least-loaded holder (ties: lower rank), so that replicated bytes
    (a whole DDP model) spread to about ``1/N`` per rank on top of what each rank must write anyway.

    Empty pieces (a zero length in some dimension, e.g. the shard of a rank past the end of an uneven
    split) carry no data and are skipped, except that a tensor whose every piece is empty (a global
    tensor with zero elements) still gets exactly one piece written so the manifest records it.

    Returns, per rank, the keys it writes in the order that rank listed them.
    Raises ValueError when the ranks disagree (one key both replicated and not, a non-replicated key on
    two ranks, a replicated key with different sizes).
    """
    n = len(all_ranks)
    load = [0] * n
    chosen: list[set[ChunkKey]] = [set() for _ in range(n)]
    owner: dict[ChunkKey, int] = {}
    holders: dict[ChunkKey, list[int]] = {}
    sizes: dict[ChunkKey, int] = {}
    fqn_has_data: set[str] = set()
    empty_holders: dict[ChunkKey, list[int]] = {}

    for rank, items in enumerate(all_ranks):
        for key, nbytes, replicated in items:
            if _volume(key.lengths) > 0:
                fqn_has_data.add(key.fqn)
            else:
                # Uneven splits can give several ranks the same empty key: never an ownership conflict.
                empty_holders.setdefault(key, [])
                if rank not in empty_holders[key]:
                    empty_holders[key].append(rank)
                continue
            if replicated:
                if key in owner:
                    raise ValueError(f"piece {key} is replicated on rank {rank} but owned by rank {owner[key]}")
                if key in sizes and sizes[key] != nbytes:
                    raise ValueError(f"replicated piece {key} has {nbytes} bytes on rank {rank}, {sizes[key]} elsewhere")
                sizes[key] = int(nbytes)
                hs = holders.setdefault(key, [])
                if rank not in hs:
                    hs.append(rank)
            else:
                if key in holders:
                    raise ValueError(f"piece {key} is owned by rank {rank} but replicated on ranks {holders[key]}")
                if key in owner and owner[key] != rank:
                    raise ValueError(f"piece {key} is claimed (not replicated) by ranks {owner[key]} and {rank}")
                if key not in owner:
                    owner[key] = rank
                    chosen[rank].add(key)
                    load[rank] += int(nbytes)

    # Tensors with zero elements: write one (empty) piece so the tensor exists in the manifest.
    for key in sorted(empty_holders, key=_key_order):
        if key.fqn in fqn_has_data:
            continue
        fqn_has_data.add(key.fqn)  # one empty piece per such tensor is enough
        best = min(empty_holders[key], key=lambda r: (load[r], r))
        chosen[best].add(key)

    for key in sorted(holders, key=lambda k: (-sizes[k], _key_order(k))):
        best = min(holders[key], key=lambda r: (load[r], r))
        chosen[best].add(key)
        load[best] += sizes[key]

    logger.debug("assign_writers: %d ranks, bytes per rank %s", n, load)
    result: list[list[ChunkKey]] = []
    for rank, items in enumerate(all_ranks):
        seen: set[ChunkKey] = set()
        mine: list[ChunkKey] = []
        for key, _, _ in items:
            if key in chosen[rank] and key not in seen:
                seen.add(key)
                mine.append(key)
        result.append(mine)
    return result


# --------------------------------------------------------------------------- load: validation
def _chunk_box(chunk: ChunkRecord) -> Box:
    return tuple((int(o), int(o) + int(n)) for o, n in zip(chunk.offsets, chunk.lengths))


def _tiles_exactly(bounds: Box, boxes: Sequence[Box]) -> str | None:
    """None if the non-empty ``boxes`` tile ``bounds`` exactly (no overlap, no hole), else why not.

    Counts coverage on the grid spanned by all box boundaries (coordinate compression), so the cost is
    the number of grid cells, not the number of elements.
    """
    nonempty = [b for b in boxes if all(hi > lo for lo, hi in b)]
    if any(lo >= hi for lo, hi in bounds):
        return None  # nothing to cover
    ndim = len(bounds)
    if ndim == 0:
        n = len(nonempty)
        return None if n == 1 else f"{n} chunks cover a 0-dim tensor (expected 1)"
    if _row_slabs_tile(bounds, nonempty):
        return None  # the common case (whole tensors, dim-0 shards), without the grid
    return _grid_tiles(bounds, nonempty)


_MAX_GRID_CELLS = 1 << 22
"""Largest coverage grid the tiling check builds (16 MiB of int32); the chunk boundaries of a manifest decide
its size, so a crafted manifest could otherwise ask numpy for hundreds of GiB."""
_MAX_PAIRWISE_CHUNKS = 1024
"""Above the grid limit, chunks are compared pairwise (O(n^2)): at most this many."""


def _grid_tiles(bounds: Box, nonempty: Sequence[Box]) -> str | None:
    ndim = len(bounds)
    cuts: list[list[int]] = []
    for d in range(ndim):
        pts = {bounds[d][0], bounds[d][1]}
        for b in nonempty:
            pts.add(b[d][0])
            pts.add(b[d][1])
        cuts.append(sorted(pts))
    if ndim > 32 or math.prod(len(c) - 1 for c in cuts) > _MAX_GRID_CELLS:
        return _pairwise_tiles(bounds, nonempty)
    where = [{p: i for i, p in enumerate(c)} for c in cuts]
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for b in nonempty:
        grid[tuple(slice(where[d][b[d][0]], where[d][b[d][1]]) for d in range(ndim))] += 1
    if (grid > 1).any():
        cell = tuple(int(i) for i in np.argwhere(grid > 1)[0])
        return "chunks overlap at element " + str(tuple(cuts[d][cell[d]] for d in range(ndim)))
    if (grid == 0).any():
        cell = tuple(int(i) for i in np.argwhere(grid == 0)[0])
        return "no chunk covers element " + str(tuple(cuts[d][cell[d]] for d in range(ndim)))
    return None


def _pairwise_tiles(bounds: Box, boxes: Sequence[Box]) -> str | None:
    """Exact tiling without a grid: boxes inside ``bounds`` (checked by the caller) tile it when no two overlap
    and their volumes add up to its volume."""
    if len(boxes) > _MAX_PAIRWISE_CHUNKS:
        return f"{len(boxes)} chunks with irregular boundaries: too many to check (at most {_MAX_PAIRWISE_CHUNKS})"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(max(alo, blo) < min(ahi, bhi) for (alo, ahi), (blo, bhi) in zip(a, b)):
                return "chunks overlap at element " + str(tuple(max(alo, blo) for (alo, _), (blo, _) in zip(a, b)))
    covered = sum(math.prod(hi - lo for lo, hi in b) for b in boxes)
    total = math.prod(hi - lo for lo, hi in bounds)
    return None if covered == total else f"chunks cover {covered} of {total} elements"


def _row_slabs_tile(bounds: Box, boxes: Sequence[Box]) -> bool:
    """True when ``boxes`` span ``bounds`` fully in every dim but the first and, sorted, follow each other
    without gap or overlap along it (cheap; False means "ask the grid", not "does not tile")."""
    rest = bounds[1:]
    if any(b[1:] != rest for b in boxes):
        return False
    pos = bounds[0][0]
    for lo, hi in sorted(b[0] for b in boxes):
        if lo != pos:
            return False
        pos = hi
    return pos == bounds[0][1]


def _validate_tensor(fqn: str, rec: TensorRecord, block_bytes: int) -> None:
    esz = element_size(rec.dtype)
    shape = [int(s) for s in rec.shape]
    if any(s < 0 for s in shape):
        raise CorruptCheckpointError(f"tensor {fqn!r} has a negative dimension in shape {shape}", tensor=fqn)
    for chunk in rec.chunks:
        _check_chunk(fqn, rec, chunk, esz)
        where = f"chunk offsets={chunk.offsets} lengths={chunk.lengths} of tensor {fqn!r} (file {chunk.file})"
        nbytes = _volume(chunk.lengths) * esz
        n_blocks = -(-nbytes // block_bytes)
        if len(chunk.block_crc32) != n_blocks and not (nbytes == 0 and len(chunk.block_crc32) <= 1):
            raise CorruptCheckpointError(
                f"{where} has {len(chunk.block_crc32)} block checksums, expected {n_blocks}", tensor=fqn, file=chunk.file
            )
    why = _tiles_exactly(tuple((0, s) for s in shape), [_chunk_box(c) for c in rec.chunks])
    if why is not None:
        raise CorruptCheckpointError(f"manifest chunks of tensor {fqn!r} do not tile its shape {shape}: {why}", tensor=fqn)


def validate_tiling(manifest: Manifest) -> None:
    """Check that every tensor's chunks tile it exactly: inside bounds, no overlap, full cover, byte
    ranges and block-checksum counts consistent with the chunk sizes, every byte range inside its file's
    recorded size and no two sharing bytes (so the tensors need no more memory than the files hold, once
    ``check_files`` has compared those sizes with the real ones). Raises CorruptCheckpointError."""
    if manifest.checksum_block_bytes <= 0:
        raise CorruptCheckpointError(f"manifest checksum_block_bytes={manifest.checksum_block_bytes} must be positive")
    _check_byte_ranges(manifest)
    for fqn, rec in manifest.tensors.items():
        _validate_tensor(fqn, rec, manifest.checksum_block_bytes)


def _check_byte_ranges(manifest: Manifest) -> None:
    """Every chunk lies inside a file the manifest lists, within its recorded size, sharing no byte with another."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for fqn, rec in manifest.tensors.items():
        for c in rec.chunks:
            frec = manifest.files.get(c.file)
            if frec is None:
                raise CorruptCheckpointError(
                    f"tensor {fqn!r} points to {c.file}, which the manifest does not list", tensor=fqn, file=c.file
                )
            start, end = c.byte_range
            if not 0 <= start <= end <= frec.size:
                raise CorruptCheckpointError(
                    f"tensor {fqn!r}: byte range {c.byte_range} lies outside {c.file} ({frec.size} bytes)",
                    tensor=fqn,
                    file=c.file,
                )
            if end > start:
                by_file.setdefault(c.file, []).append((start, end, fqn))
    for name, ranges in by_file.items():
        ranges.sort()
        for (_, end_a, fqn_a), (start_b, _, fqn_b) in itertools.pairwise(ranges):
            if start_b < end_a:
                raise CorruptCheckpointError(
                    f"tensors {fqn_a!r} and {fqn_b!r} share bytes of {name} (from byte {start_b})", tensor=fqn_b, file=name
                )


# --------------------------------------------------------------------------- load: read plan
def min_byte_range(
    chunk_byte_start: int, chunk_lengths: Sequence[int], src_slices: Sequence[tuple[int, int]], esz: int
) -> tuple[int, int]:
    """Smallest absolute ``[start, end)`` byte range of a C-contiguous chunk holding every element of
    ``src_slices`` (which must be non-empty in every dim)."""
    strides = c_strides(chunk_lengths)
    first = sum(lo * st for (lo, _), st in zip(src_slices, strides))
    last = sum((hi - 1) * st for (_, hi), st in zip(src_slices, strides))
    return (chunk_byte_start + first * esz, chunk_byte_start + (last + 1) * esz)


def _check_wanted(item: TensorItem, rec: TensorRecord | None) -> TensorRecord:
    fqn = item.key.fqn
    if rec is None:
        raise IncompatibleCheckpointError(f"tensor {fqn!r} is not in the checkpoint")
    if tuple(int(s) for s in rec.shape) != tuple(item.global_shape):
        raise IncompatibleCheckpointError(
            f"tensor {fqn!r} has shape {tuple(rec.shape)} in the checkpoint but {tuple(item.global_shape)} in the live state"
        )
    if rec.dtype != item.dtype:
        raise IncompatibleCheckpointError(
            f"tensor {fqn!r} has dtype {rec.dtype} in the checkpoint but {item.dtype} in the live state"
        )
    if len(item.key.offsets) != len(rec.shape) or len(item.key.lengths) != len(rec.shape):
        raise ValueError(f"wanted piece {item.key} does not match the rank of tensor {fqn!r} (shape {rec.shape})")
    for o, n, s in zip(item.key.offsets, item.key.lengths, rec.shape):
        if o < 0 or n < 0 or o + n > s:
            raise ValueError(f"wanted piece {item.key} lies outside tensor {fqn!r} of shape {tuple(rec.shape)}")
    return rec


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


class _ChunkIndex:
    """Chunks of one tensor sorted by their dim-0 start, to find those overlapping a box in O(log n + k)."""

    __slots__ = ("boxes", "chunks", "max_len0", "starts")

    def __init__(self, fqn: str, rec: TensorRecord):
        ndim = len(rec.shape)
        for chunk in rec.chunks:
            if len(chunk.offsets) != ndim or len(chunk.lengths) != ndim:
                raise CorruptCheckpointError(
                    f"chunk offsets={chunk.offsets} lengths={chunk.lengths} of tensor {fqn!r} has the wrong rank "
                    f"for shape {rec.shape}",
                    tensor=fqn,
                    file=chunk.file,
                )
        ordered = sorted((_chunk_box(c), i) for i, c in enumerate(rec.chunks))
        self.chunks = [rec.chunks[i] for _, i in ordered]
        self.boxes = [b for b, _ in ordered]
        self.starts = [b[0][0] if b else 0 for b in self.boxes]
        self.max_len0 = max((b[0][1] - b[0][0] for b in self.boxes if b), default=0)

    def overlapping(self, want: Box) -> Iterable[tuple[ChunkRecord, Box]]:
        if not want:  # 0-dim: every chunk (there must be exactly one)
            return zip(self.chunks, self.boxes)
        lo, hi = want[0]
        first = bisect.bisect_right(self.starts, lo - self.max_len0)
        last = bisect.bisect_left(self.starts, hi)
        return zip(self.chunks[first:last], self.boxes[first:last])


def _check_chunk(fqn: str, rec: TensorRecord, chunk: ChunkRecord, esz: int) -> None:
    """The per-chunk part of validate_tiling, for the chunks a load touches."""
    where = f"chunk offsets={chunk.offsets} lengths={chunk.lengths} of tensor {fqn!r} (file {chunk.file})"
    if len(chunk.offsets) != len(rec.shape) or len(chunk.lengths) != len(rec.shape):
        raise CorruptCheckpointError(f"{where} has the wrong rank for shape {rec.shape}", tensor=fqn, file=chunk.file)
    for o, n, s in zip(chunk.offsets, chunk.lengths, rec.shape):
        if o < 0 or n < 0 or o + n > s:
            raise CorruptCheckpointError(f"{where} lies outside the tensor shape {rec.shape}", tensor=fqn, file=chunk.file)
    nbytes = _volume(chunk.lengths) * esz
    if len(chunk.byte_range) != 2 or chunk.byte_range[0] < 0 or chunk.byte_range[1] - chunk.byte_range[0] != nbytes:
        raise CorruptCheckpointError(
            f"{where} has byte_range {chunk.byte_range}, expected {nbytes} bytes", tensor=fqn, file=chunk.file
        )


def plan_reads(manifest: Manifest, wanted: Sequence[TensorItem]) -> list[ReadRequest]:
    """For each wanted local piece, one ReadRequest per stored chunk that overlaps it.

    ``read_range`` is the minimal contiguous byte range of the chunk holding the overlap, so a rank reads
    about the bytes it owns when row-sharded, whatever the saved and current world sizes. Requests come
    sorted by (file, read_range) so a reader can stream each file front to back.

    Raises IncompatibleCheckpointError naming the tensor when it is missing from the checkpoint or its
    global shape or dtype differ from the live one; CorruptCheckpointError when the manifest's chunks do
    not cover the wanted piece exactly (hole or overlap).
    """
    indexes: dict[str, _ChunkIndex] = {}
    requests: list[ReadRequest] = []
    for item in wanted:
        fqn = item.key.fqn
        rec = _check_wanted(item, manifest.tensors.get(fqn))
        esz = element_size(rec.dtype)
        want_box: Box = tuple((int(o), int(o) + int(n)) for o, n in zip(item.key.offsets, item.key.lengths))
        if any(lo >= hi for lo, hi in want_box):
            continue  # an empty local shard needs nothing (a 0-dim box is never empty)
        index = indexes.get(fqn)
        if index is None:
            index = indexes[fqn] = _ChunkIndex(fqn, rec)
        covered: list[Box] = []
        for chunk, cbox in index.overlapping(want_box):
            inter = _intersect(want_box, cbox)
            if inter is None:
                continue
            _check_chunk(fqn, rec, chunk, esz)
            covered.append(inter)
            src = tuple((lo - c0, hi - c0) for (lo, hi), (c0, _) in zip(inter, cbox))
            dst = tuple((lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(inter, want_box))
            start = int(chunk.byte_range[0])
            requests.append(
                ReadRequest(
                    file=chunk.file,
                    fqn=fqn,
                    dtype=rec.dtype,
                    chunk_byte_range=(start, int(chunk.byte_range[1])),
                    chunk_lengths=tuple(int(n) for n in chunk.lengths),
                    block_crc32=tuple(int(c) for c in chunk.block_crc32),
                    read_range=min_byte_range(start, chunk.lengths, src, esz),
                    src_slices=src,
                    dst=item.key,
                    dst_slices=dst,
                )
            )
        why = _tiles_exactly(want_box, covered)
        if why is not None:
            raise CorruptCheckpointError(
                f"the checkpoint's chunks of tensor {fqn!r} do not cover the wanted piece "
                f"offsets={item.key.offsets} lengths={item.key.lengths}: {why}",
                tensor=fqn,
            )
    requests.sort(key=lambda r: (r.file, r.read_range, r.fqn, r.dst.offsets))
    return requests


# --------------------------------------------------------------------------- load: bytes -> tensor view
def chunk_view(
    buf: torch.Tensor,
    dtype: torch.dtype | str,
    chunk_lengths: Sequence[int],
    chunk_byte_start: int,
    read_range: tuple[int, int],
    src_slices: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """View the bytes of ``read_range`` as the ``src_slices`` sub-box of the stored chunk.

    ``buf`` is a 1-D uint8 tensor holding exactly the absolute bytes ``[read_range[0], read_range[1])``
    of the file; the chunk starts at ``chunk_byte_start`` and is C-contiguous of shape ``chunk_lengths``.
    Returns a (possibly non-contiguous) view sharing ``buf``'s memory (a copy only if ``buf`` is
    misaligned for ``dtype``); the caller copies it into the destination slices.
    """
    import torch


    tdtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    esz = torch.empty((), dtype=tdtype).element_size()
    start, end = int(read_range[0]), int(read_range[1])
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"chunk_view needs a 1-D uint8 buffer, got {buf.dtype} of shape {tuple(buf.shape)}")
    if buf.numel() != end - start:
        raise ValueError(f"buffer holds {buf.numel()} bytes but read_range {read_range} spans {end - start}")
    rel = start - int(chunk_byte_start)
    if rel < 0 or rel % esz or (end - start) % esz:
        raise ValueError(
            f"read_range {read_range} is not element-aligned inside the chunk starting at byte {chunk_byte_start}"
        )
    if buf.storage_offset() % esz:
        buf = buf.clone()  # the dtype view needs an element-aligned storage offset
    typed = buf.view(tdtype)
    strides = c_strides(chunk_lengths)
    first = sum(int(lo) * st for (lo, _), st in zip(src_slices, strides)) - rel // esz
    size = tuple(int(hi) - int(lo) for lo, hi in src_slices)
    if first < 0:
        raise ValueError(f"src_slices {tuple(src_slices)} start before read_range {read_range}")
    if all(s > 0 for s in size):
        last = first + sum((s - 1) * st for s, st in zip(size, strides))
        if last >= typed.numel():
            raise ValueError(f"src_slices {tuple(src_slices)} end after read_range {read_range}")
    return torch.as_strided(typed, size, strides, typed.storage_offset() + first)
