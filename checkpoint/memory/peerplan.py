"""Pure decisions of the memory tier across nodes: buddies, which copy of a piece a rank reads, who sends what.

No I/O here (``peer`` does the files and the transfers): every function is a function of plain data that all
ranks compute alike, and the unit tests call directly.

* Buddies (``buddy_nodes``, ``buddy_pairs``): a ring over the distinct node identities, hosts interleaved, so
  that a node's buddy is on another host whenever the job spans more than one; a rank's non-replicated pieces
  and per-rank objects go to one rank of its node's buddy (``peer-...`` files, ``peer_name``).
* Restore view (``plan_group``): one snapshot group as the *union* of the current nodes' keepers. Every piece
  is taken once (this node's copy first, else the nearest node's in ring order), the pieces must tile every
  tensor this rank needs and the per-rank objects it needs must be somewhere; otherwise the group is not a
  candidate, with a reason naming what is gone.
* Transfers (``pick_sender``, ``transfers``, ``pieces``): each remote byte range a reader needs is sent by
  one rank of a node holding it, in one global order (reader, then the reader's request order), which is
  deadlock-free for blocking point-to-point sends and receives.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Final

from checkpoint.api import (
    JSON,
    CheckpointError,
    ChunkKey,
    ChunkRecord,
    FileRecord,
    Manifest,
    RankRecords,
    ReadRequest,
    TensorItem,
    TensorRecord,
)
from checkpoint.commit import merge_records
from checkpoint.memory.api import MemoryTierError, SnapshotId, SnapshotManifest
from checkpoint.memory.layout import parse_group_name, parse_snapshot_name
from checkpoint.per_rank import per_rank_source
from checkpoint.plan import plan_reads
from checkpoint.shard import ShardLayout, build_layout, shard_records

PEER_PREFIX: Final = "peer-"
_PEER_NAME = re.compile(r"peer-(\d{9})-([0-9a-f]{8})-(\d{5})-of-(\d{5})\.safetensors")


def peer_name(snap: SnapshotId, rank: int, world_size: int) -> str:
    """File name of a buddy copy of saved rank ``rank``'s unique pieces, kept by another node's keeper:
    ``peer-000000042-1a2b3c4d-00001-of-00002.safetensors`` (same format as a snapshot, only those pieces)."""
    return f"{PEER_PREFIX}{snap.step:09d}-{snap.gen}-{rank:05d}-of-{world_size:05d}.safetensors"


def parse_peer_name(name: str) -> tuple[SnapshotId, int, int] | None:
    """(snapshot, rank, world size) of a buddy copy's name; None for any other name."""
    return parse_group_name(_PEER_NAME, name)


def parse_any_name(name: str) -> tuple[SnapshotId, int, int, bool] | None:
    """(snapshot, rank, world size, is a buddy copy) of a snapshot's or a buddy copy's name; None otherwise."""
    parsed = parse_snapshot_name(name)
    if parsed is not None:
        return (*parsed, False)
    peer = parse_peer_name(name)
    return None if peer is None else (*peer, True)


# --------------------------------------------------------------------------- buddies
def node_ring(hosts: Mapping[str, str]) -> list[str]:
    """The distinct nodes (``node -> host``) in ring order: hosts interleaved (first node of every host, then
    the second...), so neighbours are on different hosts as far as the counts allow."""
    by_host: dict[str, list[str]] = {}
    for node in sorted(hosts):
        by_host.setdefault(hosts[node], []).append(node)
    ring: list[str] = []
    depth = max((len(v) for v in by_host.values()), default=0)
    for i in range(depth):
        for host in sorted(by_host):
            if i < len(by_host[host]):
                ring.append(by_host[host][i])
    return ring


def buddy_nodes(hosts: Mapping[str, str]) -> dict[str, str]:
    """``node -> buddy node``: the next node in ``node_ring`` order on a different host, or the next node at
    all when every node is on one host (several agents on one machine). Empty for fewer than two nodes."""
    ring = node_ring(hosts)
    if len(ring) < 2:
        return {}
    single_host = len(set(hosts.values())) == 1
    out: dict[str, str] = {}
    for i, node in enumerate(ring):
        for step in range(1, len(ring)):
            cand = ring[(i + step) % len(ring)]
            if single_host or hosts[cand] != hosts[node]:
                out[node] = cand
                break
    return out


def node_unique(all_ranks: Sequence[Sequence[ChunkKey]], nodes: Sequence[str]) -> list[set[ChunkKey]]:
    """Per rank, the pieces it holds that no rank of another node holds: what a node loss would lose. FSDP2
    shards (one holder), and replicated pieces whose replicas are all on one node (HSDP with its replicate
    dimension inside a node); not DDP parameters on a job of several nodes."""
    if len(all_ranks) != len(nodes):
        raise ValueError(f"{len(all_ranks)} ranks but {len(nodes)} node names")
    where: dict[ChunkKey, set[str]] = {}
    for keys, node in zip(all_ranks, nodes):
        for key in keys:
            where.setdefault(key, set()).add(node)
    return [{k for k in keys if where[k] == {node}} for keys, node in zip(all_ranks, nodes)]


def buddy_pairs(rank_nodes: Sequence[str], rank_hosts: Sequence[str], senders: Sequence[bool]) -> dict[int, int]:
    """``sending rank -> receiving rank``: the k-th sending rank of node N sends its unique pieces to the
    (k mod m)-th of the m ranks of N's buddy node. Ranks with ``senders[r]`` False (nothing only they hold)
    send nothing; a job on one node has no buddy (empty)."""
    if not len(rank_nodes) == len(rank_hosts) == len(senders):
        raise ValueError(f"{len(rank_nodes)} node names, {len(rank_hosts)} hosts, {len(senders)} sender flags")
    hosts: dict[str, str] = {}
    for node, host in zip(rank_nodes, rank_hosts):
        if hosts.setdefault(node, host) != host:
            raise ValueError(f"node {node!r} is on hosts {hosts[node]!r} and {host!r}")
    buddies = buddy_nodes(hosts)
    members = {node: [r for r, n in enumerate(rank_nodes) if n == node] for node in hosts}
    out: dict[int, int] = {}
    for node, buddy in buddies.items():
        sending = [r for r in members[node] if senders[r]]
        for k, rank in enumerate(sending):
            out[rank] = members[buddy][k % len(members[buddy])]
    return out


# --------------------------------------------------------------------------- restore: one group, all nodes
@dataclass(frozen=True, slots=True)
class HeldFile:
    """One snapshot (or buddy copy) file, as a node's keeper holds it."""

    name: str
    node: str
    manifest: SnapshotManifest


@dataclass(slots=True)
class GroupPlan:
    """How this rank restores one group from the union of the keepers."""

    snap: SnapshotId
    manifest: Manifest
    """Every piece once (the chosen copy's file), tiling every tensor: the input of ``plan_reads``."""
    requests: list[ReadRequest]
    holders: dict[str, str]
    """file -> the node whose keeper holds it (for the files ``requests`` read)."""
    objects: dict[str, JSON]
    rank_objects: dict[int, dict[str, JSON]] = field(default_factory=dict)
    """Saved rank -> its per-rank objects (the saved ranks this rank's per-rank entries load from)."""

    def remote(self, node: str) -> list[ReadRequest]:
        return [r for r in self.requests if self.holders[r.file] != node]


class GroupNotCovered(MemoryTierError):
    """The current nodes' keepers together do not hold a whole snapshot group (the message says what is gone)."""


def _distance(order: Sequence[str], frm: str, to: str) -> int:
    if frm not in order or to not in order:
        return len(order)
    return (order.index(to) - order.index(frm)) % len(order)


def plan_group(
    snap: SnapshotId,
    files: Sequence[HeldFile],
    *,
    node: str,
    node_order: Sequence[str],
    wanted: Sequence[TensorItem],
    per_rank: Mapping[str, str],
    rank: int,
    world_size: int,
) -> GroupPlan:
    """This rank's plan to restore ``snap`` from ``files`` (every current node's copies of the group).

    Each piece (chunk key) is read from one copy: this node's if it has one, else the first node after this
    one in ``node_order`` (so readers spread over the holders). Raises GroupNotCovered (naming the saved ranks
    with neither a snapshot nor a buddy copy left) when the chosen pieces do not tile every tensor, miss a
    tensor ``wanted`` needs or a per-rank entry's saved rank; CorruptSnapshotError-like MemoryTierError when
    the files disagree (world size, checksum blocks).
    """
    if not files:
        raise GroupNotCovered(f"step {snap.step} (gen {snap.gen}): no file on any current node")
    worlds = {f.manifest.world_size for f in files}
    blocks = {f.manifest.checksum_block_bytes for f in files}
    if len(worlds) != 1 or len(blocks) != 1:
        raise MemoryTierError(f"step {snap.step} (gen {snap.gen}): files disagree on world size {sorted(worlds)} "
                              f"or checksum blocks {sorted(blocks)}")
    (saved_world,) = worlds
    (block_bytes,) = blocks
    for f in files:
        m = f.manifest
        if (m.step, m.gen) != (snap.step, snap.gen):
            raise MemoryTierError(f"{f.name} on {f.node} holds step {m.step} gen {m.gen}, not {snap.step} {snap.gen}")
    ordered: list[HeldFile] = []
    for f in sorted(files, key=lambda f: (_distance(node_order, node, f.node), f.name)):
        if all(f.name != o.name for o in ordered):  # the same file on two nodes: the nearest copy
            ordered.append(f)
    chosen: dict[tuple[str, tuple[int, ...], tuple[int, ...]], str] = {}
    for f in ordered:  # nearest copy first: it keeps every piece it holds that no nearer copy had
        for fqn, trec in f.manifest.records.tensors.items():
            for chunk in trec.chunks:
                chosen.setdefault((fqn, tuple(chunk.offsets), tuple(chunk.lengths)), f.name)
    by_name = {f.name: f for f in ordered}
    records: list[RankRecords] = []
    holders: dict[str, str] = {}
    for f in ordered:
        picked = _picked_records(f, chosen)
        if picked is not None:
            records.append(picked)
            holders[f.name] = f.node
    lost = _lost_ranks(files, saved_world)
    try:
        manifest = merge_records(
            records,
            step=snap.step,
            world_size=saved_world,
            block_bytes=block_bytes,
            has_objects=True,
            created_unix=max(f.manifest.created_unix for f in files),
        )
        requests = plan_reads(manifest, wanted)
    except CheckpointError as exc:
        raise GroupNotCovered(_not_covered(snap, lost, str(exc))) from exc
    plan = GroupPlan(snap, manifest, requests, holders, ordered[0].manifest.objects)
    for key, rule in per_rank.items():
        src = per_rank_source(rank, world_size, saved_world, rule)
        if src is None or src in plan.rank_objects:
            continue
        copy = next((f for f in ordered if f.manifest.rank == src and key in f.manifest.rank_objects), None)
        if copy is None:
            raise GroupNotCovered(_not_covered(snap, lost, f"per-rank entry {key!r} of saved rank {src} is on no current node"))
        plan.rank_objects[src] = by_name[copy.name].manifest.rank_objects
    return plan


def _picked_records(f: HeldFile, chosen: Mapping[tuple[str, tuple[int, ...], tuple[int, ...]], str]) -> RankRecords | None:
    """``f``'s records restricted to the chunks chosen from it; None when it contributes none."""
    tensors: dict[str, TensorRecord] = {}
    for fqn, trec in f.manifest.records.tensors.items():
        keep: list[ChunkRecord] = [
            c for c in trec.chunks if chosen.get((fqn, tuple(c.offsets), tuple(c.lengths))) == f.name
        ]
        if keep:
            tensors[fqn] = TensorRecord(shape=list(trec.shape), dtype=trec.dtype, chunks=keep)
    if not tensors:
        return None
    frec: FileRecord | None = f.manifest.records.files.get(f.name)
    if frec is None:
        raise MemoryTierError(f"{f.name} on {f.node}: its manifest describes files {sorted(f.manifest.records.files)}")
    return RankRecords(rank=f.manifest.rank, tensors=tensors, files={f.name: frec})


def _lost_ranks(files: Sequence[HeldFile], saved_world: int) -> list[int]:
    """Saved ranks with neither their snapshot nor a buddy copy among ``files``."""
    present = {f.manifest.rank for f in files}
    return [r for r in range(saved_world) if r not in present]


def _not_covered(snap: SnapshotId, lost: Sequence[int], what: str) -> str:
    gone = (f"; saved rank(s) {list(lost)} have neither their snapshot nor a buddy copy on a current node "
            f"(their node and its buddy were both lost, or the job has no buddy copies)") if lost else ""
    return f"memory snapshot of step {snap.step} (gen {snap.gen}) is not whole on the current nodes: {what}{gone}"


# --------------------------------------------------------------------------- transfers
@dataclass(frozen=True, slots=True)
class Transfer:
    """Bytes ``[start, end)`` of ``file``, sent by rank ``src`` (its node holds the file) to reader ``dst``."""

    src: int
    dst: int
    file: str
    start: int
    end: int


def pick_sender(reader: int, holder: str, rank_nodes: Sequence[str]) -> int:
    """The rank of node ``holder`` that sends to ``reader``: readers spread round-robin over its ranks."""
    ranks = [r for r, n in enumerate(rank_nodes) if n == holder]
    if not ranks:
        raise ValueError(f"no rank on node {holder!r}")
    return ranks[reader % len(ranks)]


def transfers(needs: Sequence[Sequence[tuple[str, int, int, int]]]) -> list[Transfer]:
    """Every transfer of a restore in the one global order: by reader rank, then in the order the reader
    asked (``needs[reader]``: ``(file, start, end, sender)`` in its request order). Each rank runs its sends
    and its receives in this order (sends on one thread, receives on another): the lowest pending transfer
    always has both ends ready, so blocking point-to-point calls cannot deadlock."""
    out: list[Transfer] = []
    for dst, wants in enumerate(needs):
        for file, start, end, src in wants:
            if src == dst or end < start:
                raise ValueError(f"rank {dst} asks rank {src} for [{start}, {end}) of {file}")
            out.append(Transfer(src, dst, file, start, end))
    return out


def pieces(start: int, end: int, piece_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into pieces of ``piece_bytes`` (the last shorter): what each message carries, so
    sender and receiver hold at most one piece and agree on the cut without talking."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes={piece_bytes} must be >= 1")
    return [(lo, min(lo + piece_bytes, end)) for lo in range(start, end, piece_bytes)]


# --------------------------------------------------------------------------- buddy copies
@dataclass(slots=True)
class BuddyCopy:
    """A buddy copy of one rank's snapshot, planned from the snapshot (its slot layout and manifest)."""

    layout: ShardLayout
    """The copy's own safetensors layout: only the unique pieces, in the snapshot's order."""
    records: RankRecords
    """Its records: the snapshot's chunk checksums (blocks are counted from each chunk's start), new places."""
    runs: list[tuple[int, int]]
    """Byte ranges of the snapshot file whose concatenation is the copy's data region."""


def plan_buddy_copy(layout: ShardLayout, origin: SnapshotManifest, unique: Set[ChunkKey], name: str) -> BuddyCopy:
    """The buddy copy ``name`` of the pieces of ``layout`` (a published snapshot described by ``origin``) whose
    keys are in ``unique`` (non-replicated: only this rank's node has them). Pure: the sender streams the header,
    the ``runs`` of its slot and the manifest; nothing is checksummed twice."""
    entries = [e for e in layout.entries if e.key in unique]
    sub = build_layout(name, [(e.item_index, e.key, e.global_shape, e.dtype, e.nbytes) for e in entries])
    crcs_of: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for fqn, trec in origin.records.tensors.items():
        for chunk in trec.chunks:
            crcs_of[(fqn, tuple(chunk.offsets), tuple(chunk.lengths))] = list(chunk.block_crc32)
    by_key = {e.key: e for e in entries}
    runs: list[tuple[int, int]] = []
    crcs: list[list[int]] = []
    base = len(layout.header)
    for entry in sub.entries:
        src = by_key[entry.key]
        try:
            crcs.append(crcs_of[(entry.key.fqn, tuple(entry.key.offsets), tuple(entry.key.lengths))])
        except KeyError:
            raise MemoryTierError(f"piece {entry.key} is in the snapshot layout but not in its manifest") from None
        lo, hi = base + src.offset, base + src.offset + src.nbytes
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        elif hi > lo:
            runs.append((lo, hi))
    file_record, chunks = shard_records(sub, crcs, origin.checksum_block_bytes, rank=origin.rank)
    records = RankRecords(rank=origin.rank, files={name: file_record})
    for entry, chunk in chunks:
        rec = records.tensors.setdefault(entry.key.fqn, TensorRecord(shape=list(entry.global_shape), dtype=entry.dtype))
        rec.chunks.append(chunk)
    return BuddyCopy(sub, records, runs)
