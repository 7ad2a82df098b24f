"""Safetensors shard files, written and read by byte range.

We lay the file out ourselves (8-byte little-endian header length, JSON header with ``dtype``, ``shape``,
``data_offsets``, then the data) so that every chunk's absolute byte range is known before a byte is
written, the data can be streamed straight from the staging buffer, and the per-block crc32 is computed
during the single pass that writes it (ISA-L's crc32 when available, see checksum.py). Files still load with ``safetensors.torch.load_file``.
Tensors inside a file are sorted by element size (largest first) so each one is naturally aligned.
"""

from __future__ import annotations

import json
import logging
import struct
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import torch

from checkpoint.api import (
    ChunkKey,
    ChunkRecord,
    CorruptCheckpointError,
    FileRecord,
    ReadRequest,
)
from checkpoint.api import ShardEntry as ShardEntry
from checkpoint.api import ShardLayout as ShardLayout
from checkpoint.checksum import crc32, crc32_combine
from checkpoint.confine import parse_json
from checkpoint.dtypes import torch_dtype
from checkpoint.faults import crash_point
from checkpoint.plan import chunk_view
from checkpoint.storage import Sink, Storage
from checkpoint.verify import BlockVerifier, truncated

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- layout
def chunk_name(key: ChunkKey, global_shape: Sequence[int]) -> str:
    """Tensor name inside a shard: the FQN for a whole tensor, ``fqn#o0,o1`` for a piece of one."""
    whole = tuple(key.lengths) == tuple(global_shape) and not any(key.offsets)
    return key.fqn if whole else f"{key.fqn}#{','.join(str(o) for o in key.offsets)}"


def build_layout(
    file: str,
    pieces: Sequence[tuple[int, ChunkKey, tuple[int, ...], str, int]],
    metadata: dict[str, str] | None = None,
) -> ShardLayout:
    """Plan a shard from ``(item_index, key, global_shape, dtype, nbytes)`` pieces."""

    def order(p: tuple[int, ChunkKey, tuple[int, ...], str, int]) -> tuple[int, str]:
        return (-torch_dtype(p[3]).itemsize, chunk_name(p[1], p[2]))

    entries: list[ShardEntry] = []
    offset = 0
    for index, key, gshape, dtype, nbytes in sorted(pieces, key=order):
        entries.append(ShardEntry(chunk_name(key, gshape), key, tuple(gshape), dtype, offset, nbytes, index))
        offset += nbytes
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.key.lengths), "data_offsets": [e.offset, e.offset + e.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors does
    return ShardLayout(file=file, entries=entries, header=struct.pack("<Q", len(raw)) + raw, data_bytes=offset)


def block_crcs(layout: ShardLayout, data: memoryview, block_bytes: int) -> list[list[int]]:
    """zlib.crc32 of every ``block_bytes`` block of every entry (blocks counted from the entry's start)."""
    out = []
    for entry in layout.entries:
        piece = data[entry.offset : entry.offset + entry.nbytes]
        out.append([crc32(piece[s : s + block_bytes]) for s in range(0, entry.nbytes, block_bytes)])
    return out


def write_shard(
    sink: Sink,
    layout: ShardLayout,
    data: memoryview,
    block_bytes: int,
    *,
    rank: int,
    crc_pool: Executor | None = None,
) -> tuple[FileRecord, list[tuple[ShardEntry, ChunkRecord]]]:
    """Stream ``layout.header`` + ``data`` into ``sink``; return the file record and each entry's chunk.

    With ``crc_pool`` the checksums are computed on another thread while this one writes (both release
    the GIL), so a save costs max(write, crc) instead of their sum; ``data`` does not change meanwhile.
    """
    crcs_future: Future[list[list[int]]] | None = None
    if crc_pool is not None:
        crcs_future = crc_pool.submit(block_crcs, layout, data, block_bytes)
    crash_point("shard.header")
    sink.write(layout.header)
    inline: list[list[int]] = []
    for entry in layout.entries:
        piece = data[entry.offset : entry.offset + entry.nbytes]
        blocks: list[int] = []
        for start in range(0, entry.nbytes, block_bytes):
            block = piece[start : start + block_bytes]
            if crcs_future is None:
                blocks.append(crc32(block))
            crash_point("shard.block")
            sink.write(block)
        inline.append(blocks)
    crcs = crcs_future.result() if crcs_future is not None else inline
    return shard_records(layout, crcs, block_bytes, rank=rank)


def shard_records(
    layout: ShardLayout, crcs: Sequence[Sequence[int]], block_bytes: int, *, rank: int
) -> tuple[FileRecord, list[tuple[ShardEntry, ChunkRecord]]]:
    """The file record and each entry's chunk record of a shard laid out as ``layout`` whose entries have the
    block checksums ``crcs`` (``block_crcs``): pure, so the memory tier (``checkpoint.memory``), whose bytes
    are already in place, describes its snapshots exactly like the durable shard files."""
    file_crc = crc32(layout.header)
    base = len(layout.header)
    chunks: list[tuple[ShardEntry, ChunkRecord]] = []
    for entry, blocks in zip(layout.entries, crcs):
        for i, crc in enumerate(blocks):
            file_crc = crc32_combine(file_crc, crc, min(block_bytes, entry.nbytes - i * block_bytes))
        chunks.append(
            (
                entry,
                ChunkRecord(
                    offsets=list(entry.key.offsets),
                    lengths=list(entry.key.lengths),
                    file=layout.file,
                    key=entry.name,
                    byte_range=[base + entry.offset, base + entry.offset + entry.nbytes],
                    block_crc32=list(blocks),
                ),
            )
        )
    return FileRecord(size=layout.size, crc32=file_crc, rank=rank), chunks


# --------------------------------------------------------------------------- reading
def read_header(storage: Storage, rel: str) -> tuple[int, dict[str, Any]]:
    """(data start offset, parsed JSON header) of a safetensors file."""
    prefix = storage.read_range(rel, 0, 8)
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"{storage.display(rel)} is truncated (no safetensors header)", file=rel)
    (n,) = struct.unpack("<Q", prefix)
    if n > 100 << 20:
        raise CorruptCheckpointError(f"{storage.display(rel)} has an implausible header length {n}", file=rel)
    raw = storage.read_range(rel, 8, 8 + n)
    if len(raw) != n:
        raise CorruptCheckpointError(f"{storage.display(rel)} is truncated inside its safetensors header", file=rel)
    header = parse_json(raw, f"the safetensors header of {storage.display(rel)}", file=rel)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{storage.display(rel)} has a safetensors header that is not a JSON object", file=rel)
    return 8 + n, header


def bytes_as_tensor(data: bytes | bytearray | memoryview, dtype: str) -> torch.Tensor:
    """A flat tensor of ``dtype`` over ``data`` without copying (read-only use)."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch_dtype(dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bytes are read-only; we only read from the view
        raw = torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(torch_dtype(dtype))


def _verifier(storage: Storage, path: str, req: ReadRequest, start: int, end: int, block_bytes: int) -> BlockVerifier:
    return BlockVerifier(
        req.block_crc32,
        path=storage.display(path),
        file=req.file,
        fqn=req.fqn,
        chunk_start=req.chunk_byte_range[0],
        start=start,
        end=end,
        block_bytes=block_bytes,
    )


def widened_range(req: ReadRequest, block_bytes: int, verify: bool) -> tuple[int, int]:
    """The bytes a load reads for ``req``: its ``read_range``, widened to whole checksum blocks when verifying."""
    start, end = req.read_range
    if verify:
        cstart, cend = req.chunk_byte_range
        start = cstart + (start - cstart) // block_bytes * block_bytes
        end = min(cstart + -(-(end - cstart) // block_bytes) * block_bytes, cend)
    return start, end


Fetch = Callable[[str, int, int], "bytes | bytearray | memoryview"]
"""``fetch(file, start, end)``: bytes ``[start, end)`` of a shard file of the step (fewer if it is shorter)."""


def verified_range(
    storage: Storage, step_rel: str, req: ReadRequest, block_bytes: int, verify: bool, fetch: Fetch | None = None
) -> tuple[bytes | bytearray | memoryview, int]:
    """Read ``req.read_range`` of ``step_rel/req.file`` (widened to whole checksum blocks when verifying),
    through ``fetch`` if given; return (bytes, absolute start)."""
    path = f"{step_rel}/{req.file}"
    start, end = widened_range(req, block_bytes, verify)
    data = fetch(req.file, start, end) if fetch is not None else storage.read_range(path, start, end)
    if len(data) != end - start:
        raise truncated(storage.display(path), req.file, req.fqn, start, end, len(data))
    if verify:
        _verifier(storage, path, req, start, end, block_bytes).feed(data)
    return data, start


def apply_read(
    storage: Storage,
    step_rel: str,
    req: ReadRequest,
    dst: torch.Tensor,
    block_bytes: int,
    verify: bool,
    fetch: Fetch | None = None,
) -> int:
    """Execute one ReadRequest into the destination piece ``dst`` (its bytes from ``fetch`` if given, else
    read from storage); returns bytes read."""
    if torch.is_grad_enabled():  # a caller running many small reads disables it once: entering it costs more
        with torch.no_grad():
            return apply_read(storage, step_rel, req, dst, block_bytes, verify, fetch)
    index = tuple(slice(a, b) for a, b in req.dst_slices)
    target = dst[index] if index else dst
    if fetch is None and _can_read_direct(req, target, block_bytes, verify):
        return _read_direct(storage, f"{step_rel}/{req.file}", req, target, block_bytes, verify)
    data, start = verified_range(storage, step_rel, req, block_bytes, verify, fetch)
    raw = bytes_as_tensor(data, "U8")
    lo, hi = req.read_range
    src = chunk_view(raw[lo - start : hi - start], req.dtype, req.chunk_lengths, req.chunk_byte_range[0], req.read_range, req.src_slices)
    target.copy_(src.reshape(target.shape) if src.shape != target.shape else src)
    return len(data)


def _can_read_direct(req: ReadRequest, target: torch.Tensor, block_bytes: int, verify: bool) -> bool:
    """True when the stored bytes can land in ``target`` as they are (no bounce buffer, one copy).

    ``read_range`` is minimal, so when its length equals the target's bytes the source elements are
    contiguous in the file and in the same order as in a contiguous target.
    """
    lo, hi = req.read_range
    if target.device.type != "cpu" or not target.is_contiguous() or hi - lo != target.numel() * target.element_size():
        return False
    if verify:
        cstart, cend = req.chunk_byte_range
        return (lo - cstart) % block_bytes == 0 and (hi == cend or (hi - cstart) % block_bytes == 0)
    return True


_VERIFY_PIECE_BYTES = 1 << 20
"""A verified direct read checks each piece of about this size (whole checksum blocks) right after reading
it, while the bytes are still in the CPU cache: one pass over memory instead of two (figures in
docs/benchmarks.md)."""


def _read_direct(
    storage: Storage,
    path: str,
    req: ReadRequest,
    target: torch.Tensor,
    block_bytes: int,
    verify: bool,
    part: tuple[int, int] | None = None,
) -> int:
    """Read ``req`` straight into ``target`` (``_can_read_direct``), or only the bytes ``part`` of its
    ``read_range`` (``direct_parts``: block-aligned, so each part is checked on its own)."""
    lo, hi = part if part is not None else req.read_range
    first = req.read_range[0]
    out = target.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")[lo - first : hi - first]
    verifier = _verifier(storage, path, req, lo, hi, block_bytes) if verify else None

    def check(offset: int, nbytes: int) -> None:
        assert verifier is not None
        verifier.feed(out[offset : offset + nbytes])

    got = storage.read_into(path, lo, out, piece_bytes=_VERIFY_PIECE_BYTES, on_piece=check if verify else None)
    if got != hi - lo:
        raise truncated(storage.display(path), req.file, req.fqn, lo, hi, got)
    return got


SMALL_LOAD_BYTES = 4 << 20
"""A load whose reads span less than this in total (summed over files) reads each file's span once, on the
calling thread, and serves every request from it (``small_load_spans``): for a small checkpoint (a few
hundred KB in ~100 tensors) a storage call per tensor and a thread pool to run them cost far more than
the bytes (bench/ckpt_small_load.py). Larger loads keep one ranged read per request in the pool."""


def small_load_spans(
    requests: Sequence[ReadRequest], block_bytes: int, verify: bool, limit: int | None = None
) -> dict[str, tuple[int, int]] | None:
    """Per file, the byte range ``[lo, hi)`` covering every read of ``requests`` in it, when these spans
    total less than ``limit`` (default ``SMALL_LOAD_BYTES``) and there is more than one request; None
    otherwise (read one by one)."""
    limit = SMALL_LOAD_BYTES if limit is None else limit
    if len(requests) <= 1:
        return None
    spans: dict[str, tuple[int, int]] = {}
    for req in requests:
        start, end = widened_range(req, block_bytes, verify)
        lo, hi = spans.get(req.file, (start, end))
        spans[req.file] = (min(lo, start), max(hi, end))
    return spans if sum(hi - lo for lo, hi in spans.values()) < limit else None


class SpanReader:
    """Serves ``fetch(file, start, end)`` from one read of each file's span (``small_load_spans``), made the
    first time the file is asked for: storage errors (missing, unreadable, not a regular file) surface at
    the same request as with one read per request, and a short file gives the same short slices."""

    def __init__(self, storage: Storage, step_rel: str, spans: dict[str, tuple[int, int]]) -> None:
        self.storage, self.step_rel, self.spans = storage, step_rel, spans
        self.buffers: dict[str, memoryview] = {}

    def prefetch(self, threads: int) -> None:
        """Read every file's span now, ``threads`` at a time: on remote storage one round trip per file would
        otherwise run one after another (a checkpoint saved by 16 ranks: 16 sequential GETs)."""
        files = [f for f in self.spans if f not in self.buffers]
        if threads <= 1 or len(files) <= 1:
            return
        with ThreadPoolExecutor(min(threads, len(files)), thread_name_prefix="ckpt-read") as pool:
            for file, data in zip(files, pool.map(self.read_span, files), strict=True):
                self.buffers[file] = data

    def read_span(self, file: str) -> memoryview:
        """Read ``file``'s span (what ``prefetch`` runs in its threads)."""
        lo, hi = self.spans[file]
        return memoryview(self.storage.read_range(f"{self.step_rel}/{file}", lo, hi))

    def fetch(self, file: str, start: int, end: int) -> memoryview:
        lo, _ = self.spans[file]
        if file not in self.buffers:
            self.buffers[file] = self.read_span(file)
        return self.buffers[file][start - lo : end - lo]


def direct_parts(req: ReadRequest, block_bytes: int, verify: bool, part_bytes: int) -> list[tuple[int, int]]:
    """``req.read_range`` of a direct read cut into consecutive parts of about ``part_bytes`` (whole checksum
    blocks when verifying: ``_can_read_direct`` puts its start on a block boundary, so every part starts on
    one and is checked on its own), for several threads to read one large tensor together."""
    lo, hi = req.read_range
    step = max(part_bytes // block_bytes, 1) * block_bytes if verify else max(part_bytes, 1)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def _direct_target(req: ReadRequest, dst: torch.Tensor, block_bytes: int, verify: bool) -> torch.Tensor | None:
    """The part of ``dst`` that ``req`` fills, when its bytes can land there as they are; else None."""
    with torch.no_grad():
        index = tuple(slice(a, b) for a, b in req.dst_slices)
        target = dst[index] if index else dst
    return target if _can_read_direct(req, target, block_bytes, verify) else None


def read_requests(
    storage: Storage,
    step_rel: str,
    requests: Sequence[ReadRequest],
    destinations: Callable[[ChunkKey], torch.Tensor],
    block_bytes: int,
    verify: bool,
    threads: int,
    *,
    part_bytes: int | None = None,
) -> int:
    """Run ranged reads in parallel threads, each copying into its destination; a small load reads each
    file once on this thread instead (``SMALL_LOAD_BYTES``). Returns bytes read.

    ``part_bytes`` (local, CPU-bound storage such as the memory tier's shared memory): a direct read larger
    than that is cut into parts (``direct_parts``) that the threads share, so one large tensor (an embedding)
    is not read by one thread while the others idle. None: one task per request (the durable tier's choice:
    a remote store's cost is per request)."""
    spans = small_load_spans(requests, block_bytes, verify)
    if spans is not None:
        reader = SpanReader(storage, step_rel, spans)
        if not storage.is_local:
            reader.prefetch(threads)
        fetch = reader.fetch
        with torch.no_grad():
            return sum(apply_read(storage, step_rel, r, destinations(r.dst), block_bytes, verify, fetch) for r in requests)
    if threads <= 1 or len(requests) <= 1:
        return sum(apply_read(storage, step_rel, r, destinations(r.dst), block_bytes, verify) for r in requests)
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-read") as pool:
        futures: list[Future[int]] = []
        for r in requests:
            dst = destinations(r.dst)
            large = part_bytes is not None and r.read_range[1] - r.read_range[0] > part_bytes
            target = _direct_target(r, dst, block_bytes, verify) if large else None
            if part_bytes is None or target is None:
                futures.append(pool.submit(apply_read, storage, step_rel, r, dst, block_bytes, verify))
                continue
            path = f"{step_rel}/{r.file}"
            futures += [
                pool.submit(_read_direct, storage, path, r, target, block_bytes, verify, part)
                for part in direct_parts(r, block_bytes, verify, part_bytes)
            ]
        return sum(f.result() for f in futures)
