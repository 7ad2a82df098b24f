"""Pure decisions of the memory tier: names, the footer, who snapshots what, which slot, room, which step.

No I/O here: ``shm`` does the files, these functions decide from plain data (unit tests call them directly).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from typing import Final

from checkpoint.api import ChunkKey
from checkpoint.memory.api import FOOTER_MAGIC, SnapshotId
from checkpoint.plan import assign_writers

FOOTER: Final = struct.Struct("<8sQQI4x")
"""Last bytes of a snapshot: magic, manifest offset, manifest length, manifest crc32 (little-endian)."""
_NAME = re.compile(r"snap-(\d{9})-([0-9a-f]{8})-(\d{5})-of-(\d{5})\.safetensors")
TMP_PREFIX: Final = ".tmp-"
"""Snapshots being written (never read); a worker's own, or a dead worker's that the node leader removes."""


def snapshot_name(snap: SnapshotId, rank: int, world_size: int) -> str:
    """File name of a rank's published snapshot: ``snap-000000042-1a2b3c4d-00001-of-00002.safetensors``."""
    return f"snap-{snap.step:09d}-{snap.gen}-{rank:05d}-of-{world_size:05d}.safetensors"


def parse_snapshot_name(name: str) -> tuple[SnapshotId, int, int] | None:
    """(snapshot, rank, world size) of a published snapshot's name; None for any other name."""
    return parse_group_name(_NAME, name)


def parse_group_name(pattern: re.Pattern[str], name: str) -> tuple[SnapshotId, int, int] | None:
    """(snapshot, rank, world size) from ``name`` when ``pattern`` (groups: step, gen, rank, world) matches it
    whole and the rank is within the world; None otherwise. Snapshots and buddy copies share this shape."""
    m = pattern.fullmatch(name)
    if m is None:
        return None
    rank, world = int(m.group(3)), int(m.group(4))
    if world < 1 or rank >= world:
        return None
    return SnapshotId(int(m.group(1)), m.group(2)), rank, world


def tmp_name(gen: str, rank: int, slot: int) -> str:
    return f"{TMP_PREFIX}{gen}-{rank:05d}-{slot}"


def gen_of_tmp(name: str) -> str | None:
    if not name.startswith(TMP_PREFIX):
        return None
    return name[len(TMP_PREFIX) :].split("-", 1)[0]


def encode_footer(offset: int, length: int, crc: int) -> bytes:
    return FOOTER.pack(FOOTER_MAGIC, offset, length, crc)


def decode_footer(raw: bytes | bytearray, file_size: int) -> tuple[int, int, int]:
    """(manifest offset, length, crc32) from a snapshot's last ``FOOTER.size`` bytes; ValueError when the bytes
    are not a footer or do not place the manifest right before it."""
    if len(raw) != FOOTER.size:
        raise ValueError(f"footer of {len(raw)} bytes, expected {FOOTER.size}")
    magic, offset, length, crc = FOOTER.unpack(raw)
    if magic != FOOTER_MAGIC:
        raise ValueError(f"no snapshot footer (magic {magic!r})")
    if offset + length + FOOTER.size != file_size:
        raise ValueError(f"manifest [{offset}, +{length}) does not end at the footer of a {file_size}-byte file")
    return offset, length, crc


def node_writers(all_ranks: Sequence[Sequence[tuple[ChunkKey, int, bool]]], nodes: Sequence[str]) -> list[list[ChunkKey]]:
    """Which pieces each rank snapshots: ``plan.assign_writers`` within each node (ranks with the same
    ``nodes[rank]``), so every node holds a whole copy of the replicated state (a DDP model: each of a node's
    ranks snapshots ~1/local_world of it) and each rank its own shards (pure; every rank computes the same)."""
    if len(all_ranks) != len(nodes):
        raise ValueError(f"{len(all_ranks)} ranks but {len(nodes)} node names")
    out: list[list[ChunkKey]] = [[] for _ in all_ranks]
    for node in sorted(set(nodes)):
        members = [r for r, n in enumerate(nodes) if n == node]
        for rank, keys in zip(members, assign_writers([all_ranks[r] for r in members])):
            out[rank] = keys
    return out


def pick_slot(slot_steps: Sequence[int | None], complete: int | None) -> int:
    """The slot a new snapshot overwrites: never the one holding ``complete`` (the newest step every rank
    published, the one a restore would use); an empty slot first, else the oldest step."""
    free = [i for i, s in enumerate(slot_steps) if s is None]
    if free:
        return free[0]
    candidates = [i for i, s in enumerate(slot_steps) if s != complete]
    if not candidates:
        raise ValueError(f"every slot holds the complete step {complete}")
    return min(candidates, key=lambda i: slot_steps[i] or -1)


def min_free(total: int, *, min_free_bytes: int, min_free_fraction: float) -> int:
    """Bytes a snapshot always leaves free in a shared-memory filesystem of ``total`` bytes."""
    return max(min_free_bytes, int(total * min_free_fraction))


def room_for(need: int, *, free: int, total: int, min_free_bytes: int, min_free_fraction: float) -> str | None:
    """None when ``need`` more bytes leave enough free space, else why not (sizes and the fix)."""
    keep = min_free(total, min_free_bytes=min_free_bytes, min_free_fraction=min_free_fraction)
    if free - need >= keep:
        return None
    return (
        f"a snapshot needs {need / 2**20:.1f} MiB of host shared memory but only {free / 2**20:.1f} MiB of "
        f"{total / 2**20:.1f} MiB are free and {keep / 2**20:.1f} MiB must stay free; give the node a larger "
        f"/dev/shm (docker run --shm-size, a Kubernetes emptyDir with medium: Memory and a sizeLimit of at least "
        f"twice the per-node state) or snapshot less often"
    )


def size_for(need: int, *, total: int, min_free_bytes: int, min_free_fraction: float) -> str | None:
    """None when a shared-memory filesystem of ``total`` bytes can hold ``need`` bytes of snapshots at all
    (beside the free space always left), else why not, naming the size it needs (pure). Checked once at the
    start (the first snapshot plan), so that a ``/dev/shm`` too small for the tier (Docker's 64 MB default)
    is one clear error, not a tier that turns itself off at its second snapshot."""
    keep = min_free(total, min_free_bytes=min_free_bytes, min_free_fraction=min_free_fraction)
    if total - keep >= need:
        return None
    return (
        f"this node's memory snapshots need {need / 2**20:.1f} MiB ({need} bytes: the last complete snapshot and "
        f"the one being written, of each of its ranks and of the buddy copies it keeps) of host shared memory, but "
        f"the filesystem is "
        f"{total / 2**20:.1f} MiB and {keep / 2**20:.1f} MiB of it must stay free; give the node a /dev/shm of at "
        f"least {(need + keep) / 2**20:.0f} MiB (docker run --shm-size, a Kubernetes emptyDir with medium: Memory "
        f"and a sizeLimit), or run without the memory tier"
    )


def choose_snapshot(candidates: Sequence[Sequence[SnapshotId]], *, not_older_than: int | None) -> SnapshotId | None:
    """The newest snapshot every rank can read (each rank's list: the groups complete in its node's keeper),
    when not older than ``not_older_than`` (the newest durable step); None otherwise (pure)."""
    if not candidates:
        return None
    common = set(candidates[0]).intersection(*candidates[1:])
    usable = [s for s in common if not_older_than is None or s.step >= not_older_than]
    if not usable:
        return None
    return max(usable, key=lambda s: (s.step, s.gen))


def choose_every(step_seconds: float, stage_seconds: float, target: float, max_every: int) -> int:
    """The smallest snapshot interval (in steps) whose staging, ``stage_seconds`` per snapshot, blocks at most
    ``target`` of the training time (``step_seconds`` per step); 1 when every step fits; at most ``max_every``
    (pure). A zero step time (nothing measured) gives ``max_every`` unless staging is free too."""
    if stage_seconds <= 0:
        return 1
    if step_seconds <= 0:
        return max_every
    return max(1, min(max_every, math.ceil(stage_seconds / (target * step_seconds))))
