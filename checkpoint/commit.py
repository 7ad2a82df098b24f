"""The commit protocol, in one place (run on rank 0 once every rank's shards are durable).

1. Every rank writes its shard files (atomic per file: temp+fsync+rename on POSIX, completed upload on S3),
   then, if the state has per-rank entries, its ``objects-<rank>-of-<world>.json`` the same way.
2. Ranks send their records (chunks, byte ranges, block crc32s, file sizes and crc32s, the per-rank
   objects file's size, crc32 and keys) to rank 0.
3. Rank 0 merges them into the manifest and checks that the chunks tile every tensor exactly.
4. Rank 0 writes ``objects.json`` and ``model.safetensors.index.json`` (their sizes and crc32s go into the
   manifest's ``checksums``), checks that every file the manifest names is still there with its size (a step
   deleted by ``spotrun-ckpt rm`` during the save fails here instead of committing), then writes ``manifest.json``.
5. Rank 0 writes ``.commit`` (step, crc32 and size of the manifest bytes). From this moment the step exists.
6. Rank 0 rewrites ``latest`` (a hint only: readers trust commit markers, not ``latest``).
7. Retention runs (deleting a step removes its ``.commit`` first, so a half-deleted step is merely uncommitted).

A crash before 5 leaves an uncommitted directory that readers ignore and retention later removes; a crash
after 5 leaves a complete step. A committed step is never written again.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable, Sequence

from checkpoint._version import __version__
from checkpoint.api import (
    COMMIT_FILE,
    INDEX_FILE,
    JSON,
    LATEST_FILE,
    MANIFEST_FILE,
    OBJECTS_FILE,
    RANK_OBJECTS_FORMAT,
    RANK_OBJECTS_MAX_BYTES,
    CheckpointError,
    ChecksumRecord,
    CommitMarker,
    CorruptCheckpointError,
    Manifest,
    RankObjectsRecord,
    RankRecords,
    TensorRecord,
    step_dir,
)
from checkpoint.discover import check_files
from checkpoint.faults import crash_point
from checkpoint.plan import validate_tiling
from checkpoint.storage import Storage

logger = logging.getLogger(__name__)


def library_version() -> str:
    return __version__


def merge_records(
    results: Sequence[RankRecords],
    *,
    step: int,
    world_size: int,
    block_bytes: int,
    has_objects: bool,
    created_unix: float,
) -> Manifest:
    """All ranks' records -> the step's manifest (pure). Raises CheckpointError on a failed rank."""
    failed = [r for r in results if r.error]
    if failed:
        detail = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
        raise CheckpointError(f"step {step} not committed because a rank failed to write: {detail}")
    tensors: dict[str, TensorRecord] = {}
    files = {}
    rank_objects = merge_rank_objects(results, step=step)
    for r in results:
        for name, frec in r.files.items():
            if name in files or name in rank_objects:
                raise CheckpointError(f"step {step}: two ranks wrote the same file {name}")
            files[name] = frec
        for fqn, trec in r.tensors.items():
            merged = tensors.setdefault(fqn, TensorRecord(shape=list(trec.shape), dtype=trec.dtype))
            if merged.shape != trec.shape or merged.dtype != trec.dtype:
                raise CheckpointError(
                    f"step {step}: ranks disagree on tensor {fqn!r}: {merged.shape}/{merged.dtype} vs "
                    f"{trec.shape}/{trec.dtype} (rank {r.rank})"
                )
            merged.chunks.extend(trec.chunks)
    for trec in tensors.values():
        trec.chunks.sort(key=lambda c: c.offsets)
    manifest = Manifest(
        step=step,
        world_size=world_size,
        created_unix=created_unix,
        library_version=library_version(),
        tensors=tensors,
        files=files,
        has_objects=has_objects,
        checksum_block_bytes=block_bytes,
        rank_objects=rank_objects,
    )
    validate_tiling(manifest)
    return manifest


def merge_rank_objects(results: Sequence[RankRecords], *, step: int) -> dict[str, RankObjectsRecord]:
    """The per-rank objects files of all ranks (pure): none, or exactly one per rank with the same keys,
    so every rank of any later world size finds the copy its resize rule names."""
    merged: dict[str, RankObjectsRecord] = {}
    for r in results:
        for name, rec in r.rank_objects.items():
            if name in merged:
                raise CheckpointError(f"step {step}: two ranks wrote the same per-rank objects file {name}")
            merged[name] = rec
    if not merged:
        return merged
    by_rank: dict[int, RankObjectsRecord] = {}
    for rec in merged.values():
        if rec.rank in by_rank:
            raise CheckpointError(f"step {step}: rank {rec.rank} wrote more than one per-rank objects file")
        by_rank[rec.rank] = rec
    missing = sorted({r.rank for r in results} - set(by_rank))
    if missing:
        raise CheckpointError(f"step {step}: ranks {missing} wrote no per-rank objects while others did")
    keys = {tuple(sorted(rec.keys)) for rec in merged.values()}
    if len(keys) > 1:
        detail = "; ".join(f"rank {r}: {sorted(rec.keys)}" for r, rec in sorted(by_rank.items()))
        raise CheckpointError(
            f"step {step}: ranks disagree on the per-rank entries of the state ({detail}); every rank must put "
            f"the same PerRank keys in the state"
        )
    return merged


def rank_objects_payload(objects: dict[str, JSON], *, rank: int, world_size: int, step: int) -> bytes:
    """Bytes of a rank's per-rank objects file (pure); ValueError above ``RANK_OBJECTS_MAX_BYTES``."""
    doc = {"format": RANK_OBJECTS_FORMAT, "step": step, "rank": rank, "world_size": world_size, "objects": objects}
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    if len(data) > RANK_OBJECTS_MAX_BYTES:
        raise ValueError(
            f"rank {rank}'s per-rank state ({sorted(objects)}) is {len(data) / 2**20:.1f} MiB as JSON, more than "
            f"the {RANK_OBJECTS_MAX_BYTES / 2**20:.0f} MiB limit of a per-rank file (meant for RNG state and sampler "
            f"positions); put large values in the sharded state (a top-level entry without PerRank)"
        )
    return data


def build_index(manifest: Manifest) -> dict[str, JSON]:
    """Hugging Face-style index: ``weight_map`` names the file of each tensor (its first chunk's file)."""
    weight_map = {fqn: rec.chunks[0].file for fqn, rec in sorted(manifest.tensors.items()) if rec.chunks}
    total = sum(c.byte_range[1] - c.byte_range[0] for rec in manifest.tensors.values() for c in rec.chunks)
    chunked = sorted(fqn for fqn, rec in manifest.tensors.items() if len(rec.chunks) > 1)
    return {
        "metadata": {"total_size": total, "format": manifest.format, "step": manifest.step, "chunked": chunked},
        "weight_map": weight_map,
    }


def _dumps(obj: JSON) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def commit_step(
    storage: Storage,
    manifest: Manifest,
    objects: dict[str, JSON] | None,
    *,
    clock: Callable[[], float] = time.time,
) -> None:
    """Steps 4-6 of the protocol above (shards are already durable)."""
    rel = step_dir(manifest.step)
    if storage.exists(f"{rel}/{COMMIT_FILE}"):
        raise CheckpointError(f"step {manifest.step} is already committed at {storage.display(rel)}; refusing to overwrite it")
    if objects is not None:
        _write_checksummed(storage, manifest, OBJECTS_FILE, _dumps(objects))
    crash_point("objects.after")
    _write_checksummed(storage, manifest, INDEX_FILE, _dumps(build_index(manifest)))
    crash_point("index.after")
    crash_point("manifest.before")
    _check_still_there(storage, manifest)
    manifest_bytes = _dumps(manifest.to_json())
    storage.write_bytes(f"{rel}/{MANIFEST_FILE}", manifest_bytes)
    crash_point("manifest.after")
    marker = CommitMarker(
        step=manifest.step,
        manifest_crc32=zlib.crc32(manifest_bytes),
        manifest_size=len(manifest_bytes),
        created_unix=clock(),
    )
    crash_point("commit.before")
    storage.write_bytes(f"{rel}/{COMMIT_FILE}", _dumps(marker.to_json()))
    crash_point("commit.after")
    logger.info("committed step %d at %s (%d files)", manifest.step, storage.display(rel), len(manifest.files))
    write_latest(storage, manifest.step)


def _write_checksummed(storage: Storage, manifest: Manifest, name: str, data: bytes) -> None:
    storage.write_bytes(f"{step_dir(manifest.step)}/{name}", data)
    manifest.checksums[name] = ChecksumRecord(size=len(data), crc32=zlib.crc32(data))


def _check_still_there(storage: Storage, manifest: Manifest) -> None:
    """Every file the manifest names exists with its size right before the commit (one listing): the step
    directory may have been deleted (``spotrun-ckpt rm``) or damaged while the shards were written."""
    try:
        check_files(storage, manifest)
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"step {manifest.step} not committed: its files changed during the save: {exc}") from exc


def write_latest(storage: Storage, step: int) -> None:
    """Point the ``latest`` hint at ``step`` (only ever after its commit marker exists)."""
    crash_point("latest.before")
    storage.write_bytes(LATEST_FILE, (step_dir(step) + "\n").encode())
    crash_point("latest.after")
