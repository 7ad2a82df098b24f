"""Export a (possibly sharded) step as a consolidated Hugging Face-style directory.

Output: full tensors in ``model-00001-of-0000N.safetensors`` (at most ``max_shard_bytes`` each, a larger
tensor alone in its file) and ``model.safetensors.index.json`` with ``weight_map``; loadable by
``safetensors.torch.load_file``. Tensors are assembled one file at a time, so peak memory is about one
output shard.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

import torch

from checkpoint.api import INDEX_FILE, ChunkKey, Manifest, ReadRequest, step_dir
from checkpoint.dtypes import element_size, torch_dtype
from checkpoint.plan import min_byte_range
from checkpoint.shard import apply_read, build_layout, write_shard
from checkpoint.storage import Storage

logger = logging.getLogger(__name__)


def _tensor_nbytes(manifest: Manifest, fqn: str) -> int:
    rec = manifest.tensors[fqn]
    return math.prod(rec.shape) * element_size(rec.dtype)


def group_output_files(manifest: Manifest, max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per output file, in name order, each file at most ``max_shard_bytes`` (pure)."""
    groups: list[list[str]] = []
    size = 0
    for fqn in sorted(manifest.tensors):
        nbytes = _tensor_nbytes(manifest, fqn)
        if not groups or (size + nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(fqn)
        size += nbytes
    return groups


def assemble(storage: Storage, manifest: Manifest, fqn: str, *, verify: bool = True) -> torch.Tensor:
    """The full tensor ``fqn``, read chunk by chunk (checksums verified)."""
    rec = manifest.tensors[fqn]
    out = torch.empty(rec.shape, dtype=torch_dtype(rec.dtype))
    esz = element_size(rec.dtype)
    for chunk in rec.chunks:
        src = tuple((0, n) for n in chunk.lengths)
        if any(n == 0 for n in chunk.lengths):
            continue
        start = chunk.byte_range[0]
        req = ReadRequest(
            file=chunk.file,
            fqn=fqn,
            dtype=rec.dtype,
            chunk_byte_range=(chunk.byte_range[0], chunk.byte_range[1]),
            chunk_lengths=tuple(chunk.lengths),
            block_crc32=tuple(chunk.block_crc32),
            read_range=min_byte_range(start, chunk.lengths, src, esz) if src else (start, start + esz),
            src_slices=src,
            dst=ChunkKey(fqn, (0,) * len(rec.shape), tuple(rec.shape)),
            dst_slices=tuple((o, o + n) for o, n in zip(chunk.offsets, chunk.lengths)),
        )
        apply_read(storage, step_dir(manifest.step), req, out, manifest.checksum_block_bytes, verify)
    return out


def export_step(
    storage: Storage,
    manifest: Manifest,
    out: Storage,
    *,
    max_shard_bytes: int = 5 << 30,
    progress: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """Write the consolidated export into ``out``; returns the weight map. ``progress(nbytes)`` per tensor."""
    groups = group_output_files(manifest, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for n, names in enumerate(groups, start=1):
        file = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for fqn in names:
            tensors[fqn] = assemble(storage, manifest, fqn).contiguous()
            if progress:
                progress(tensors[fqn].numel() * tensors[fqn].element_size())
        pieces = [
            (i, ChunkKey(fqn, (0,) * t.dim(), tuple(t.shape)), tuple(t.shape), manifest.tensors[fqn].dtype, t.numel() * t.element_size())
            for i, (fqn, t) in enumerate(tensors.items())
        ]
        layout = build_layout(file, pieces, metadata={"spotrun_step": str(manifest.step)})
        buf = torch.empty(layout.data_bytes, dtype=torch.uint8)
        flat = list(tensors.values())
        for e in layout.entries:
            if e.nbytes:
                buf[e.offset : e.offset + e.nbytes].view(flat[e.item_index].dtype).view(e.key.lengths).copy_(flat[e.item_index])
        data = memoryview(buf.numpy()).cast("B")
        out.write_stream(file, lambda sink: write_shard(sink, layout, data, 1 << 22, rank=0))
        weight_map.update({fqn: file for fqn in names})
        total += layout.data_bytes
        logger.info("export: wrote %s (%d tensors)", out.display(file), len(names))
    index = {"metadata": {"total_size": total, "spotrun_step": manifest.step}, "weight_map": weight_map}
    out.write_bytes(INDEX_FILE, json.dumps(index, indent=1, sort_keys=True).encode())
    return weight_map
