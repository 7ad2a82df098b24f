"""Contracts of the memory tier: snapshots of a rank's state in host shared memory, beside the durable tier.

Data flow (one module each): ``config`` (how often, how much room to leave) -> ``layout`` (pure: names, the
footer, which step to restore, whether there is room) -> ``shm.LocalShmTier`` (the coordinator of a rank's
snapshots in its node's keeper directory: ``nodeplan``, ``slots``, ``vote``, ``cadence``, ``publish``; read back by
``localrestore``) -> ``resume`` (memory first, then the durable tier, and a :class:`RestoreReport` saying which).
The keeper, the directory's owner, is the agent's side.

A snapshot is laid out like a durable step, one shm object per rank per step: the rank's safetensors shard
(header + data, the same ``ShardLayout`` as a durable shard), then its JSON :class:`SnapshotManifest` (the
rank's ``RankRecords`` with block crc32s, the shared objects, its per-rank objects), then a fixed footer that
locates and checksums the manifest. The snapshots of one step on a node merge into an ordinary
:class:`~checkpoint.api.Manifest` (``commit.merge_records``), so the load path (``plan.plan_reads``,
``shard.read_requests``, ``state.apply``) is the durable one and reshards the same way. A snapshot is never
a committed checkpoint: it has no commit marker and lives outside the checkpoint root.

Across nodes (``peerplan``, pure; ``buddy`` and ``peerrestore`` plugged into ``peer.PeerShmTier`` through
``hooks``): what exists on one node only is copied to a buddy node's keeper (``peer-...`` files, the same format),
and a restore plans over the union of the current nodes' keepers, receiving the byte ranges its node lacks from a
peer (``restore_source: memory_peer``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

from checkpoint.api import (
    JSON,
    CheckpointError,
    CorruptCheckpointError,
    RankRecords,
    _int,
    _num,
    _obj,
    _str,
)

ENV_MEMORY_DIR: Final = "SPOTRUN_MEMORY_DIR"
"""Set by the agent for its workers: the keeper directory (host shared memory) their snapshots go to."""
MEMORY_KIND: Final = "memtier"
"""``run_scoped_path`` kind of keeper directories: ``/dev/shm/spotrun-memtier-{uid}-{run}.{hash}-{pid}-{token}``."""
SNAPSHOT_FORMAT: Final = "spotrun-memory-snapshot"
SNAPSHOT_VERSION: Final = 1
FOOTER_MAGIC: Final = b"SPOTMEM1"
OWNER_LOCK: Final = ".owner.lock"
"""In a keeper directory: ``flock``-ed by the agent and its keeper process while either lives."""


class MemoryTierError(CheckpointError):
    """Base of the memory tier's errors."""


class ShmSpaceError(MemoryTierError):
    """Host shared memory has too little free space for a snapshot (the message names the sizes and the fix)."""


class CorruptSnapshotError(MemoryTierError, CorruptCheckpointError):
    """A snapshot's footer, manifest or bytes fail their checks (truncated, overwritten, not ours)."""


class PartialRestoreError(MemoryTierError):
    """Every memory snapshot failed after the live state was partly overwritten: restore from the durable tier."""


class RestoreSource(str, enum.Enum):
    """Where a restore came from (``restore_source`` in progress lines and events; values are only added)."""

    MEMORY_LOCAL = "memory_local"
    MEMORY_PEER = "memory_peer"
    """Some bytes came from another node's keeper (``peer.PeerShmTier``): a replacement node, or a lost
    node's sharded state from its buddy's copy."""
    DURABLE = "durable"


@dataclass(frozen=True, slots=True)
class SnapshotId:
    """One snapshot group: a step saved by the ranks of one generation (one group of workers)."""

    step: int
    gen: str


@dataclass(slots=True)
class SnapshotManifest:
    """The JSON description of one rank's snapshot (between its shard bytes and its footer)."""

    step: int
    gen: str
    rank: int
    world_size: int
    node: str
    created_unix: float
    checksum_block_bytes: int
    records: RankRecords
    objects: dict[str, JSON] = field(default_factory=dict)
    """The shared JSON skeletons (``FlatState.objects``): every rank writes them, so any node has a copy."""
    rank_objects: dict[str, JSON] = field(default_factory=dict)
    """This rank's per-rank entries (``FlatState.rank_objects``, tensors inline)."""

    def to_json(self) -> dict[str, JSON]:
        return {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "step": self.step,
            "gen": self.gen,
            "rank": self.rank,
            "world_size": self.world_size,
            "node": self.node,
            "created_unix": self.created_unix,
            "checksum_block_bytes": self.checksum_block_bytes,
            "records": self.records.to_json(),
            "objects": self.objects,
            "rank_objects": self.rank_objects,
        }

    @classmethod
    def from_json(cls, d: JSON) -> SnapshotManifest:
        d = _obj(d, "snapshot manifest")
        if d.get("format") != SNAPSHOT_FORMAT or d.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"not a version {SNAPSHOT_VERSION} memory snapshot: {d.get('format')!r} {d.get('version')!r}")
        world = _int(d["world_size"], "world_size", 1)
        manifest = cls(
            step=_int(d["step"], "step"),
            gen=_str(d["gen"], "gen"),
            rank=_int(d["rank"], "rank", 0, world - 1),
            world_size=world,
            node=_str(d["node"], "node"),
            created_unix=_num(d["created_unix"], "created_unix"),
            checksum_block_bytes=_int(d["checksum_block_bytes"], "checksum_block_bytes", 1),
            records=RankRecords.from_json(_obj(d["records"], "records")),
            objects=_obj(d["objects"], "objects"),
            rank_objects=_obj(d["rank_objects"], "rank_objects"),
        )
        if manifest.records.rank != manifest.rank or manifest.records.error is not None:
            raise ValueError(f"records of rank {manifest.records.rank} in the snapshot of rank {manifest.rank}")
        return manifest


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """What a restore did: reported by the worker (progress line fields ``restore_*``)."""

    source: RestoreSource
    step: int
    bytes: int
    seconds: float
    fallback: str | None = None
    """Why memory was not used, when the tier was on and the restore came from the durable tier (e.g. a node
    and its buddy both lost); ``restore_fallback`` in progress lines and ``restore_completed`` events."""

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {
            "restore_source": self.source.value,
            "restore_step": self.step,
            "restore_bytes": self.bytes,
            "restore_seconds": self.seconds,
        }
        if self.fallback is not None:
            out["restore_fallback"] = self.fallback
        return out


@runtime_checkable
class MemoryTier(Protocol):
    """A rank's view of one memory tier (``shm.LocalShmTier``: this node's keeper; ``peer.PeerShmTier``: every node's).

    ``snapshot`` is called by every rank at every step (collective at the steps it acts on, like
    ``Checkpointer.save``); ``restore`` by every rank once, before training (collective).
    """

    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as ``step`` when the config says so; True when one was started. Never raises for
        lack of room or a failed snapshot (logged once): training goes on with the last complete one."""
        ...

    def restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        """Restore ``state`` from the newest snapshot every rank can read, if it is not older than
        ``not_older_than``; None (state untouched) when there is none."""
        ...

    def snapshot_on_failure(self, step: int, state: Mapping[str, Any], exc: BaseException | None = None) -> bool:
        """After a collective failed (a peer died mid-step), snapshot the last completed ``step`` without a
        collective (``checkpoint.memory.jit``); True when this node holds it whole. Never raises."""
        ...

    def wait(self) -> None:
        """Block until the snapshot in flight is published (or failed, logged)."""
        ...

    def close(self) -> None:
        """Finish the snapshot in flight and release buffers (the published snapshots stay for a restart)."""
        ...


@runtime_checkable
class KeeperTier(Protocol):
    """A tier in a keeper directory that knows its rank in its group (``shm.LocalShmTier``): a restore's record
    goes to that directory, for the agent's ``restore_completed`` event."""

    directory: str | None
    rank: int
    world_size: int


@runtime_checkable
class ExplainsFallback(Protocol):
    """A tier that says why its last ``restore`` returned None (``restore_fallback`` of the durable report)."""

    last_fallback_reason: str | None


class DurableTier(Protocol):
    """What a restore needs of the durable tier (``checkpoint.Checkpointer``): its newest step, a load from it,
    and what that load read. Declared here so that the restore order (``checkpoint.memory.resume``) does not
    import the checkpointer that calls it."""

    rank: int
    last_load_bytes: int

    def latest(self) -> int | None:
        """Newest committed, intact step, or None."""
        ...

    def load_durable(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """Restore ``state`` from the durable tier (default: its newest good step); the step, or None."""
        ...
