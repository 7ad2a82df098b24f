"""Export a (possibly sharded) step as a consolidated Hugging Face-style directory.

Output: full tensors in ``model-00001-of-0000N.safetensors`` (at most ``max_shard_bytes`` each, a larger
tensor alone in its file, ``format: pt`` in each header as transformers expects) and
``model.safetensors.index.json`` with ``weight_map``; loadable by ``safetensors.torch.load_file`` and, given the
model's ``config.json``, by ``AutoModel*.from_pretrained``. Tensors are assembled one file at a time, so peak
memory is about one output shard.

What is exported (decided by pure functions of the manifest): ``key`` selects one top-level entry (``"model"``)
and strips its prefix, so ``model.transformer.wte.weight`` is written as ``transformer.wte.weight`` and no
optimizer tensor lands in the model files. Tied weights (``ties``: target -> source, as in transformers'
``_tied_weights_keys``) are written once under the source name, as ``save_pretrained`` does; a target whose
values differ from its source is kept (it is not tied in this checkpoint).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping

import torch

from checkpoint.api import (
    INDEX_FILE,
    ChunkKey,
    IncompatibleCheckpointError,
    Manifest,
    ReadRequest,
    step_dir,
)
from checkpoint.dtypes import element_size, torch_dtype
from checkpoint.plan import min_byte_range
from checkpoint.shard import apply_read, build_layout, write_shard
from checkpoint.storage import Storage

logger = logging.getLogger(__name__)


def _tensor_nbytes(manifest: Manifest, fqn: str) -> int:
    rec = manifest.tensors[fqn]
    return math.prod(rec.shape) * element_size(rec.dtype)


def select_tensors(manifest: Manifest, key: str | None = None) -> dict[str, str]:
    """Exported name -> checkpoint tensor name (pure): every tensor as is, or those under top-level ``key`` with
    the ``key.`` prefix stripped; IncompatibleCheckpointError naming the keys that exist when none is under it."""
    if key is None:
        return {fqn: fqn for fqn in sorted(manifest.tensors)}
    prefix = f"{key}."
    chosen = {fqn[len(prefix) :]: fqn for fqn in sorted(manifest.tensors) if fqn.startswith(prefix)}
    if not chosen:
        tops = sorted({fqn.split(".", 1)[0] for fqn in manifest.tensors})
        raise IncompatibleCheckpointError(
            f"step {manifest.step} has no tensors under {key!r}; top-level entries with tensors: {tops}"
        )
    return chosen


def tied_pairs(names: Mapping[str, str], ties: Mapping[str, str]) -> dict[str, str]:
    """The exported (target -> source) pairs of ``ties`` whose both names are exported (pure)."""
    return {t: s for t, s in ties.items() if t in names and s in names and t != s}


def group_output_files(
    manifest: Manifest, max_shard_bytes: int, names: Mapping[str, str] | None = None
) -> list[list[str]]:
    """Exported names per output file, in name order, each file at most ``max_shard_bytes`` (pure).
    ``names`` maps exported name -> checkpoint tensor (default: every tensor under its own name)."""
    names = names if names is not None else {fqn: fqn for fqn in manifest.tensors}
    groups: list[list[str]] = []
    size = 0
    for name in sorted(names):
        nbytes = _tensor_nbytes(manifest, names[name])
        if not groups or (size + nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
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


def drop_tied(storage: Storage, manifest: Manifest, names: dict[str, str], ties: Mapping[str, str]) -> list[str]:
    """Remove from ``names`` each tie target whose values equal its source's; the names dropped."""
    dropped = []
    for target, source in sorted(tied_pairs(names, ties).items()):
        a, b = names[target], names[source]
        ra, rb = manifest.tensors[a], manifest.tensors[b]
        if ra.shape == rb.shape and ra.dtype == rb.dtype and torch.equal(assemble(storage, manifest, a), assemble(storage, manifest, b)):
            del names[target]
            dropped.append(target)
            logger.info("export: %s is tied to %s: written once, as %s", target, source, source)
        else:
            logger.warning("export: %s differs from %s although the model ties them; both are written", target, source)
    return dropped


def export_step(
    storage: Storage,
    manifest: Manifest,
    out: Storage,
    *,
    max_shard_bytes: int = 5 << 30,
    progress: Callable[[int], None] | None = None,
    key: str | None = None,
    ties: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Write the consolidated export into ``out``; returns the weight map. ``progress(nbytes)`` per tensor.

    ``key`` and ``ties``: see the module docstring (``select_tensors``, ``drop_tied``)."""
    selected = select_tensors(manifest, key)
    if ties:
        drop_tied(storage, manifest, selected, ties)
    groups = group_output_files(manifest, max_shard_bytes, selected)
    weight_map: dict[str, str] = {}
    total = 0
    for n, names in enumerate(groups, start=1):
        file = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = assemble(storage, manifest, selected[name]).contiguous()
            if progress:
                progress(tensors[name].numel() * tensors[name].element_size())
        pieces = [
            (i, ChunkKey(name, (0,) * t.dim(), tuple(t.shape)), tuple(t.shape), manifest.tensors[selected[name]].dtype, t.numel() * t.element_size())
            for i, (name, t) in enumerate(tensors.items())
        ]
        layout = build_layout(file, pieces, metadata={"format": "pt", "spotrun_step": str(manifest.step)})
        buf = torch.empty(layout.data_bytes, dtype=torch.uint8)
        flat = list(tensors.values())
        for e in layout.entries:
            if e.nbytes:
                buf[e.offset : e.offset + e.nbytes].view(flat[e.item_index].dtype).view(e.key.lengths).copy_(flat[e.item_index])
        data = buf.numpy().data.cast("B")
        out.write_stream(file, lambda sink: write_shard(sink, layout, data, 1 << 22, rank=0))  # noqa: B023 - called before the loop moves on
        weight_map.update({name: file for name in names})
        total += layout.data_bytes
        logger.info("export: wrote %s (%d tensors)", out.display(file), len(names))
    index = {"metadata": {"total_size": total, "spotrun_step": manifest.step}, "weight_map": weight_map}
    out.write_bytes(INDEX_FILE, json.dumps(index, indent=1, sort_keys=True).encode())
    return weight_map
