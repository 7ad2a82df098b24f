"""Buddy copies: the pieces of a rank's snapshot that exist on its node only (``replicated=False`` items: FSDP2/HSDP
shards) and its per-rank objects, copied to one rank of the buddy node after each snapshot.

``peerplan.buddy_pairs`` picks the pairs (a ring over the nodes, buddies on different hosts whenever the job spans
several). The receiver writes the copy into its own keeper as ``peer-{step}-{gen}-{rank}-of-{world}`` (the snapshot
format, with the snapshot's own block crc32s). The copy runs on the tier's background thread over its own gloo
group, with non-blocking sends straight from the published slot, so it overlaps the next training step like the
checksums do. A receiver keeps, per sending rank, the copy of the last complete step and the one being written. A
job with nothing unique to a node (pure DDP without per-rank objects) copies nothing, and says so once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from checkpoint.api import ChunkKey
from checkpoint.collective import Collective, check_groups_alive
from checkpoint.memory.api import MemoryTierError, ShmSpaceError, SnapshotId, SnapshotManifest
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.layout import encode_footer
from checkpoint.memory.nodeplan import NodePlan
from checkpoint.memory.once import WarnOnce
from checkpoint.memory.peerplan import buddy_pairs, node_unique, parse_peer_name, peer_name, pieces, plan_buddy_copy
from checkpoint.memory.publish import read_manifest
from checkpoint.memory.slots import Slot, check_room
from checkpoint.state import FlatState

logger = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20
"""Largest message of a transfer (a receiver verifies each piece as it completes, while it is in the cache)."""
BUDDY_TAG = 1


class BuddyCopies:
    """``Replication`` to a buddy node's keeper (collective over ``group`` to plan; ``xfer`` to copy)."""

    def __init__(self, *, group: Collective, xfer: Collective, directory: str, gen: str, node: str, host: str,
                 config: MemoryTierConfig, warnings: WarnOnce) -> None:
        self.group, self.xfer, self.directory, self.gen = group, xfer, directory, gen
        self.node, self.host, self.config, self.warnings = node, host, config, warnings
        self.rank, self.world_size = group.rank, group.world_size
        self.buddy: int | None = None
        """The rank this rank sends its buddy copy to (None: nothing to send, or no other node)."""
        self.sources: list[int] = []
        """The ranks that send their buddy copies to this rank, in rank order."""
        self.unique: set[ChunkKey] = set()
        """The pieces of this rank's snapshot that no other node holds."""
        self.copy_bytes = 0
        """Bytes of one set of the copies this node's ranks keep of their sources' snapshots."""
        self.complete = -1
        self.bytes_sent = 0
        self.copies_received = 0

    # ------------------------------------------------------------------ Replication hooks
    def planned(self, flat: FlatState, plan: NodePlan) -> int:
        mine = [[i.key.fqn, list(i.key.offsets), list(i.key.lengths)] for i in flat.items if i.nbytes > 0]
        gathered = self.group.all_gather({"node": self.node, "host": self.host, "items": mine})
        nodes = [str(g["node"]) for g in gathered]
        held = [[ChunkKey(f, tuple(o), tuple(n)) for f, o, n in g["items"]] for g in gathered]
        writes = {e.key for e in plan.layout.entries}
        everyone_unique = node_unique(held, nodes)
        unique = [keys & writes if r == self.rank else keys for r, keys in enumerate(everyone_unique)]
        # every rank's flag must be the same everywhere: a rank sends when its own snapshot has unique pieces
        sends = self.group.all_gather(bool(unique[self.rank]) or bool(flat.rank_objects))
        pairs = buddy_pairs(nodes, [str(g["host"]) for g in gathered], [bool(x) for x in sends])
        self.unique = unique[self.rank]
        self.buddy = pairs.get(self.rank)
        self.sources = sorted(src for src, dst in pairs.items() if dst == self.rank)
        self.copy_bytes = sum(plan.snapshot_bytes[src].get(key, 0) for src, dst in pairs.items()
                              if nodes[dst] == self.node for key in everyone_unique[src])
        if not any(sends) and self.warnings.first("no-buddy"):
            logger.info("[rank %d] memory tier: no buddy copies (nothing is on one node only: every node's "
                        "snapshots hold the whole replicated state)", self.rank)
        elif len(set(nodes)) < 2 and self.warnings.first("one-node"):
            logger.info("[rank %d] memory tier: one node, no buddy copies (a node loss restores from the durable "
                        "tier)", self.rank)
        elif pairs:
            logger.info("[rank %d] memory tier buddies: sends to rank %s, keeps copies of ranks %s (node %s)",
                        self.rank, self.buddy, self.sources, self.node)
        return self.copy_bytes

    def published(self, slot: Slot | None, step: int) -> None:
        """Send this rank's buddy copy of ``step`` (an empty message when it has none) and receive the copies
        this rank keeps; the sends are non-blocking, straight from the published slot."""
        if self.buddy is None and not self.sources:
            return
        check_groups_alive()  # a send on an aborted gloo group can wait forever
        group = self.xfer.group
        works: list[dist.Work | None] = []
        keep: list[torch.Tensor] = []
        if self.buddy is not None:
            segments: list[torch.Tensor] = []
            if slot is not None:
                try:
                    segments = self.segments(slot, step)
                except (OSError, MemoryTierError) as exc:  # an empty message: the buddy must not wait for us
                    self.warnings.warn("buddy-send", "[rank %d step %d] no buddy copy sent: %s", self.rank, step, exc)
            self.bytes_sent += sum(s.numel() for s in segments)
            head = torch.tensor([len(segments), sum(s.numel() for s in segments)], dtype=torch.int64)
            lens = torch.tensor([s.numel() for s in segments], dtype=torch.int64)
            keep += [head, lens, *segments]
            works.append(dist.isend(head, group=group, group_dst=self.buddy, tag=BUDDY_TAG))
            if segments:
                works.append(dist.isend(lens, group=group, group_dst=self.buddy, tag=BUDDY_TAG))
                works += [dist.isend(s, group=group, group_dst=self.buddy, tag=BUDDY_TAG) for s in segments]
        try:
            for src in self.sources:
                self.receive(src, step)
        finally:
            for work in works:
                if work is not None:
                    work.wait()
            del keep

    def housekeep(self, complete: int, leader: bool) -> None:
        self.complete = complete
        if complete < 0 or not leader:
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                parsed = parse_peer_name(name)
                if parsed is not None and parsed[0].gen != self.gen:  # copies of earlier workers' snapshots
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.directory, name))

    # ------------------------------------------------------------------ the copy
    def segments(self, slot: Slot, step: int) -> list[torch.Tensor]:
        """The buddy copy of the just-published ``slot`` as byte tensors: header, data runs (views of the slot,
        in ``PIECE_BYTES`` pieces) and manifest + footer."""
        origin = read_manifest(slot.path)
        name = peer_name(SnapshotId(step, self.gen), self.rank, self.world_size)
        copy = plan_buddy_copy(slot.layout, origin, self.unique, name)
        manifest = SnapshotManifest(
            step=step, gen=self.gen, rank=self.rank, world_size=self.world_size, node=self.node,
            created_unix=origin.created_unix, checksum_block_bytes=origin.checksum_block_bytes,
            records=copy.records, objects=origin.objects, rank_objects=origin.rank_objects,
        )
        raw = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
        tail = raw + encode_footer(copy.layout.size, len(raw), zlib.crc32(raw))
        whole = torch.frombuffer(slot.mm, dtype=torch.uint8, count=slot.layout.size) if copy.runs else None
        segments = [torch.frombuffer(bytearray(copy.layout.header), dtype=torch.uint8)]
        for lo, hi in copy.runs:
            assert whole is not None
            segments += [whole[a:b] for a, b in pieces(lo, hi, PIECE_BYTES)]
        segments.append(torch.frombuffer(bytearray(tail), dtype=torch.uint8))
        return segments

    def receive(self, src: int, step: int) -> None:
        """Receive rank ``src``'s buddy copy of ``step`` into this node's keeper (drained and dropped when there
        is no room or the keeper is gone: the sender must never wait forever)."""
        check_groups_alive()
        group = self.xfer.group
        head = torch.zeros(2, dtype=torch.int64)
        dist.recv(head, group=group, group_src=src, tag=BUDDY_TAG)
        count, total = (int(v) for v in head.tolist())
        if count == 0:
            return
        lens = torch.zeros(count, dtype=torch.int64)
        dist.recv(lens, group=group, group_src=src, tag=BUDDY_TAG)
        sizes = [int(v) for v in lens.tolist()]
        tmp = os.path.join(self.directory, f".tmp-{self.gen}-peer-{src:05d}")
        final = os.path.join(self.directory, peer_name(SnapshotId(step, self.gen), src, self.world_size))
        fd = -1
        mm: mmap.mmap | None = None
        try:
            check_room(self.directory, total, self.config)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            os.posix_fallocate(fd, 0, total)
            mm = mmap.mmap(fd, total)
        except (OSError, ShmSpaceError) as exc:
            self.warnings.warn("buddy-room", "[rank %d step %d] buddy copy of rank %d dropped: %s", self.rank, step,
                               src, exc)
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            drain(sizes, src, group)
            return
        try:
            whole = torch.frombuffer(mm, dtype=torch.uint8, count=total)
            offset = 0
            for size in sizes:
                dist.recv(whole[offset : offset + size], group=group, group_src=src, tag=BUDDY_TAG)
                offset += size
            del whole
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                mm.close()
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
        except BaseException:
            if fd >= 0:
                with contextlib.suppress(BufferError):
                    mm.close()
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.copies_received += 1
        self.drop_old_copies(src, step)

    def drop_old_copies(self, src: int, step: int) -> None:
        """Keep, of rank ``src``'s copies, the one of the last complete step and ``step``'s."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                parsed = parse_peer_name(name)
                if parsed is None:
                    continue
                snap, rank, _ = parsed
                if snap.gen == self.gen and rank == src and snap.step != step and snap.step < self.complete:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.directory, name))


def drain(sizes: Sequence[int], src: int, group: dist.ProcessGroup | None, tag: int = BUDDY_TAG) -> None:
    """Receive and drop messages of ``sizes`` bytes from ``src`` (one piece buffer at a time)."""
    scratch: torch.Tensor | None = None
    for size in sizes:
        if scratch is None or scratch.numel() < size:
            scratch = torch.empty(size, dtype=torch.uint8)
        dist.recv(scratch[:size], group=group, group_src=src, tag=tag)
