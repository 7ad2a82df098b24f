"""Who snapshots what: every rank's item metadata gathered once per change of the items, so that each node holds
a whole copy of the replicated state (``layout.node_writers``) and this rank's pieces become one ``ShardLayout``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from checkpoint._sys.procutil import process_identity
from checkpoint.api import ChunkKey
from checkpoint.collective import Collective
from checkpoint.memory.layout import node_writers
from checkpoint.shard import ShardLayout, build_layout
from checkpoint.state import FlatState

logger = logging.getLogger(__name__)

Signature = tuple[tuple[ChunkKey, str, tuple[int, ...], bool], ...]


def signature(flat: FlatState) -> Signature:
    """What a snapshot plan depends on: each item's key, dtype, global shape and whether it is replicated."""
    return tuple((i.key, i.dtype, i.global_shape, i.replicated) for i in flat.items)


@dataclass(frozen=True, slots=True)
class NodePlan:
    """This rank's part of a snapshot plan and what it knows of its node (the same plan on every rank)."""

    rank: int
    layout: ShardLayout
    """The pieces this rank snapshots, as one shard."""
    nodes: list[str]
    """Every rank's node."""
    node_ranks: list[int]
    """The ranks of this rank's node: a just-in-time snapshot waits for their files."""
    node_procs: dict[int, str | None]
    """Per rank of this node, its process (``procutil.process_identity``): a just-in-time snapshot does not wait
    for the file of a rank whose process has exited (a crashed worker never publishes)."""
    snapshot_bytes: list[dict[ChunkKey, int]]
    """Per rank, the bytes of each piece it snapshots."""

    @property
    def leader(self) -> bool:
        """This rank is its node's first: it does the node's housekeeping and size check."""
        return self.rank == min(self.node_ranks)

    @property
    def node_bytes(self) -> int:
        """Bytes of one snapshot of every rank of this node."""
        return sum(sum(self.snapshot_bytes[r].values()) for r in self.node_ranks)


def plan_node(group: Collective, flat: FlatState, node: str) -> NodePlan:
    """Gather every rank's item metadata and node (collective); lay out the pieces this rank snapshots."""
    rank = group.rank
    mine = [[i.key.fqn, list(i.key.offsets), list(i.key.lengths), i.nbytes, i.replicated] for i in flat.items]
    gathered = group.all_gather({"node": node, "items": mine, "proc": process_identity(os.getpid())})
    nodes = [str(g["node"]) for g in gathered]
    everyone = [
        [(ChunkKey(f, tuple(o), tuple(ln)), int(n), bool(r)) for f, o, ln, n, r in g["items"]]
        for g in gathered
    ]
    writers = node_writers(everyone, nodes)
    writes = set(writers[rank])
    pieces = [
        (index, item.key, tuple(item.global_shape), item.dtype, item.nbytes)
        for index, item in enumerate(flat.items)
        if item.key in writes
    ]
    layout = build_layout("snapshot", pieces)
    node_ranks = [r for r, n in enumerate(nodes) if n == node]
    procs = {r: p if isinstance(p := g.get("proc"), str) else None  # another rank's: only a str
             for r, g in enumerate(gathered) if r in node_ranks}
    snapshot_bytes = [{key: n for key, n, _ in everyone[r] if key in set(writers[r])} for r in range(len(nodes))]
    logger.info(
        "[rank %d] memory snapshot plan: %d of %d local pieces, %d bytes per snapshot (node %s, %d rank(s))",
        rank, len(pieces), len(flat.items), layout.size, node, nodes.count(node),
    )
    return NodePlan(rank, layout, nodes, node_ranks, procs, snapshot_bytes)
