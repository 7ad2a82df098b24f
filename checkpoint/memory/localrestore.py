"""Restore from this node's keeper alone. Each rank lists its keeper directory, merges the manifests of each snapshot
group into a durable-style ``Manifest`` (``commit.merge_records``: the chunks must tile every tensor) and keeps the
groups it can restore from alone; the ranks agree on the newest group all of them can read
(``layout.choose_snapshot``) and load it with the durable read path (``plan.plan_reads``, ``shard.read_requests``
with crc32 checks, ``state.apply``), at any world size. A group that fails on any rank is removed and the next one
tried; when none is left the caller falls back to the durable tier."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkpoint.api import JSON, Manifest
from checkpoint.collective import Collective
from checkpoint.commit import merge_records
from checkpoint.config import CheckpointConfig
from checkpoint.fallback import LoadOutcome
from checkpoint.memory.api import (
    CorruptSnapshotError,
    MemoryTierError,
    PartialRestoreError,
    RestoreReport,
    RestoreSource,
    SnapshotId,
)
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.layout import choose_snapshot, parse_snapshot_name
from checkpoint.memory.publish import read_manifest
from checkpoint.per_rank import per_rank_source
from checkpoint.plan import plan_reads
from checkpoint.shard import read_requests
from checkpoint.state import apply, flatten
from checkpoint.storage import StorageSpec

logger = logging.getLogger(__name__)

GROUPS_LOOKED_AT = 4
"""Newest snapshot groups a restore examines (normally there are one or two)."""
READ_PART_BYTES = 8 << 20
"""A restore cuts a tensor's read larger than this into parts its read threads share (``shard.direct_parts``):
reading shared memory is CPU-bound (a copy and a crc32 pass), so one large tensor read by one thread would
leave the other cores idle."""


def read_threads(config: MemoryTierConfig) -> int:
    """Threads a restore reads this node's snapshot files with (``MemoryTierConfig.read_threads``)."""
    return config.read_threads or max(1, min(4, os.cpu_count() or 1))


@dataclass(slots=True)
class LocalGroup:
    """A snapshot group this rank can restore from alone (its node's keeper holds every piece it needs)."""

    snap: SnapshotId
    manifest: Manifest
    objects: dict[str, JSON]
    rank_objects: dict[int, dict[str, JSON]] = field(default_factory=dict)


class LocalRestore:
    """``Restorer`` from this node's keeper directory (collective over ``group``)."""

    def __init__(self, group: Collective, directory: str, config: MemoryTierConfig) -> None:
        self.group, self.directory, self.config = group, directory, config
        self.rank, self.world_size = group.rank, group.world_size
        self.last_fallback_reason: str | None = None

    def restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        self.last_fallback_reason = None
        started = time.perf_counter()
        per_rank = flatten(state).per_rank
        groups = self.readable_groups(per_rank)
        gathered = self.group.all_gather(
            {"groups": [[g.snap.step, g.snap.gen] for g in groups], "not_older_than": not_older_than}
        )
        floors = [g["not_older_than"] for g in gathered if g["not_older_than"] is not None]
        floor = max(floors) if floors else None
        lists = [{SnapshotId(int(s), str(gen)) for s, gen in g["groups"]} for g in gathered]
        by_id = {g.snap: g for g in groups}
        touched = False
        while True:
            choice = choose_snapshot([sorted(x, key=lambda s: s.step) for x in lists], not_older_than=floor)
            if choice is None:
                if touched:
                    raise PartialRestoreError(
                        f"rank {self.rank}: every memory snapshot failed while being restored and the live state "
                        f"was partly overwritten; restore it from the durable tier or restart"
                    )
                logger.info("[rank %d] no memory snapshot every rank can read (durable floor %s)", self.rank, floor)
                self.last_fallback_reason = f"no memory snapshot every rank can read (durable floor {floor})"
                return None
            error: BaseException | None = None
            nbytes = 0
            try:
                touched = True
                nbytes = self.load(by_id[choice], state)
            except Exception as exc:  # noqa: BLE001 - voted on below; every failure falls back
                error = exc
            worst = self.group.max(LoadOutcome.OK if error is None else LoadOutcome.DAMAGED)
            if worst == LoadOutcome.OK:
                seconds = time.perf_counter() - started
                logger.info(
                    "[rank %d] restored step %d from memory (gen %s): %d bytes in %.3fs",
                    self.rank, choice.step, choice.gen, nbytes, seconds,
                )
                return RestoreReport(RestoreSource.MEMORY_LOCAL, choice.step, nbytes, seconds)
            logger.warning(
                "[rank %d] memory snapshot of step %d (gen %s) not restored: %s; trying the next source",
                self.rank, choice.step, choice.gen, error if error is not None else "failed on another rank",
            )
            if error is not None:
                self.quarantine(choice)
            for x in lists:
                x.discard(choice)

    def readable_groups(self, per_rank: dict[str, str]) -> list[LocalGroup]:
        """The snapshot groups in this node's keeper this rank can restore from alone, newest first."""
        found: dict[SnapshotId, dict[int, tuple[str, int]]] = {}
        try:
            names = os.listdir(self.directory)
        except OSError as exc:  # the keeper directory is gone: nothing in memory
            logger.warning("[rank %d] memory tier directory unreadable: %s", self.rank, exc)
            return []
        for name in names:
            parsed = parse_snapshot_name(name)
            if parsed is not None:
                snap, rank, world = parsed
                found.setdefault(snap, {})[rank] = (name, world)
        out: list[LocalGroup] = []
        for snap in sorted(found, key=lambda s: s.step, reverse=True)[:GROUPS_LOOKED_AT]:
            try:
                out.append(self._group(snap, found[snap], per_rank))
            except Exception as exc:  # noqa: BLE001 - an unreadable group is skipped, like a corrupt step
                logger.warning("[rank %d] skipping memory snapshot of step %d (gen %s): %s", self.rank, snap.step, snap.gen, exc)
        return out

    def _group(self, snap: SnapshotId, files: dict[int, tuple[str, int]], per_rank: dict[str, str]) -> LocalGroup:
        worlds = {world for _, world in files.values()}
        if len(worlds) != 1:
            raise CorruptSnapshotError(f"files of world sizes {sorted(worlds)}")
        (world,) = worlds
        manifests = {rank: read_manifest(os.path.join(self.directory, name)) for rank, (name, _) in files.items()}
        for rank, m in manifests.items():
            if (m.step, m.gen, m.rank, m.world_size) != (snap.step, snap.gen, rank, world):
                raise CorruptSnapshotError(f"the manifest of {files[rank][0]} names step {m.step} gen {m.gen} rank {m.rank}")
        blocks = {m.checksum_block_bytes for m in manifests.values()}
        if len(blocks) != 1:
            raise CorruptSnapshotError(f"ranks used different checksum blocks {sorted(blocks)}")
        manifest = merge_records(
            [m.records for _, m in sorted(manifests.items())],
            step=snap.step,
            world_size=world,
            block_bytes=blocks.pop(),
            has_objects=True,
            created_unix=max(m.created_unix for m in manifests.values()),
        )  # CheckpointError / CorruptCheckpointError when the pieces here do not tile every tensor
        group = LocalGroup(snap, manifest, manifests[min(manifests)].objects)
        for key, rule in per_rank.items():
            src = per_rank_source(self.rank, self.world_size, world, rule)
            if src is None:
                continue
            if src not in manifests or key not in manifests[src].rank_objects:
                raise MemoryTierError(f"per-rank entry {key!r} of saved rank {src} is not in this node's memory")
            group.rank_objects[src] = manifests[src].rank_objects
        return group

    def load(self, group: LocalGroup, state: Mapping[str, Any]) -> int:
        """Read the group into ``state`` with the durable read path; returns the bytes read."""
        flat = flatten(state, keep_state_dicts=True)
        requests = plan_reads(group.manifest, flat.items)
        destinations = {item.key: item.tensor for item in flat.items}
        storage = StorageSpec.from_config(os.path.dirname(self.directory), CheckpointConfig(max_retries=1)).open()
        try:
            nbytes = read_requests(
                storage,
                os.path.basename(self.directory),
                requests,
                destinations.__getitem__,
                group.manifest.checksum_block_bytes,
                self.config.verify_on_restore,
                read_threads(self.config),
                part_bytes=READ_PART_BYTES,
            )
        finally:
            storage.close()
        flat.objects = group.objects
        saved_world = group.manifest.world_size
        rank_objects: dict[str, JSON] = {}
        for key, rule in flat.per_rank.items():
            src = per_rank_source(self.rank, self.world_size, saved_world, rule)
            if src is not None:
                rank_objects[key] = group.rank_objects[src][key]
        flat.rank_objects = rank_objects
        apply(state, flat)
        return nbytes

    def quarantine(self, snap: SnapshotId) -> None:
        """Remove a group this rank failed to read, so a restart does not pick it again."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                parsed = parse_snapshot_name(name)
                if parsed is not None and parsed[0] == snap:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.directory, name))
