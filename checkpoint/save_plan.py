"""Who writes what, kept between saves: every rank's item metadata is gathered and the writers reassigned
(``plan.assign_writers``) only when the items change, then this rank's files are laid out
(``writer.plan_files``)."""

from __future__ import annotations

import logging
from typing import Any

from checkpoint.api import ChunkKey, rank_objects_file_name
from checkpoint.collective import Collective
from checkpoint.commit import rank_objects_payload
from checkpoint.plan import assign_writers
from checkpoint.save_thread import RankPayload
from checkpoint.shard import ShardLayout
from checkpoint.state import FlatState
from checkpoint.writer import plan_files

logger = logging.getLogger(__name__)


def items_signature(flat: FlatState) -> tuple[Any, ...]:
    """What a save plan depends on: each item's key, dtype, shape and whether it is replicated."""
    return tuple((i.key, i.dtype, tuple(i.global_shape), i.replicated) for i in flat.items)


def rank_payload(flat: FlatState, step: int, *, rank: int, world_size: int) -> RankPayload | None:
    """This rank's per-rank objects file (name, bytes, keys), encoded now so the save snapshots it;
    ValueError when it is too large."""
    if not flat.rank_objects:
        return None
    data = rank_objects_payload(flat.rank_objects, rank=rank, world_size=world_size, step=step)
    return rank_objects_file_name(rank, world_size), data, sorted(flat.rank_objects)


class SavePlan:
    """This rank's shard layouts for the current items (the foreground group's gather when they change)."""

    def __init__(self, collective: Collective, *, max_shard_bytes: int) -> None:
        self._fg = collective
        self._max_shard_bytes = max_shard_bytes
        self.signature: tuple[Any, ...] | None = None
        """``items_signature`` of the items ``layouts`` were planned for."""
        self.layouts: list[ShardLayout] = []

    def replan(self, flat: FlatState, signature: tuple[Any, ...]) -> None:
        """Gather every rank's item metadata once, decide who writes what, lay out this rank's files.
        Collective."""
        rank = self._fg.rank
        mine = [[i.key.fqn, list(i.key.offsets), list(i.key.lengths), i.nbytes, i.replicated] for i in flat.items]
        everyone = [
            [(ChunkKey(f, tuple(o), tuple(ln)), n, r) for f, o, ln, n, r in theirs]
            for theirs in self._fg.all_gather(mine)
        ]
        writes = set(assign_writers(everyone)[rank])
        indices = [i for i, item in enumerate(flat.items) if item.key in writes]
        self.layouts = plan_files(
            flat.items, indices, rank=rank, world_size=self._fg.world_size, max_shard_bytes=self._max_shard_bytes
        )
        self.signature = signature
        logger.info(
            "[rank %d] save plan: writes %d of %d local pieces into %d file(s), %d bytes",
            rank,
            len(indices),
            len(flat.items),
            len(self.layouts),
            sum(lay.data_bytes for lay in self.layouts),
        )

