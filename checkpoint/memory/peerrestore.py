"""Restore from the union of the current nodes' keepers (collective).

The node leaders offer the manifests of the newest groups in their keepers (snapshots and buddy copies); every
rank plans each group over the union (``peerplan.plan_group``: each piece once, this node's copy first) and the
ranks agree on the newest group every rank can plan, not older than the durable floor. Each rank reads its node's
files directly (the local read path, parallel) while it receives the other byte ranges from a rank of a node that
holds them (``peerplan.transfers``: one global order; sends on a helper thread, receives on the caller's), in
pieces of ``PIECE_BYTES``, straight into the destination tensor when the bytes line up, checking every block's
crc32 as it arrives. A damaged copy fails the group on every rank (one vote) and the next group is tried; when
none is left the caller restores from the durable tier and ``last_fallback_reason`` says why (e.g. a node and its
buddy both lost). The report says ``memory_peer`` when any rank received a byte from another node.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.api import JSON, CorruptCheckpointError, ReadRequest
from checkpoint.collective import Collective
from checkpoint.config import CheckpointConfig
from checkpoint.memory.api import (
    MemoryTierError,
    PartialRestoreError,
    RestoreReport,
    RestoreSource,
    SnapshotId,
    SnapshotManifest,
)
from checkpoint.memory.buddy import PIECE_BYTES
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.layout import choose_snapshot
from checkpoint.memory.localrestore import GROUPS_LOOKED_AT, READ_PART_BYTES, read_threads
from checkpoint.memory.peerplan import (
    GroupPlan,
    HeldFile,
    Transfer,
    node_ring,
    parse_any_name,
    pick_sender,
    pieces,
    plan_group,
    transfers,
)
from checkpoint.memory.publish import read_manifest
from checkpoint.per_rank import per_rank_source
from checkpoint.shard import apply_read, read_requests, widened_range
from checkpoint.state import apply, flatten
from checkpoint.storage import Storage, StorageSpec
from checkpoint.verify import BlockVerifier

logger = logging.getLogger(__name__)

BOUNCE_BYTES = 256 << 20
"""Most bytes of receive buffers a restoring rank holds at once (for pieces that cannot land in their tensor
as they are: a read across chunks of another layout); receives straight into the destination need none."""
RESTORE_TAG = 2


@dataclass(slots=True)
class Loaded:
    """What one rank's load of a group did."""

    nbytes: int = 0
    peer_bytes: int = 0
    error: BaseException | None = None
    bad: tuple[str, str] | None = None
    """(file, holder node) of the copy that failed its checks, when known."""


class PeerRestore:
    """``Restorer`` over every current node's keeper: ``group`` agrees, ``xfer`` carries the bytes."""

    def __init__(self, *, group: Collective, xfer: Collective, directory: str, node: str, host: str,
                 config: MemoryTierConfig) -> None:
        self.group, self.xfer, self.directory, self.node, self.host, self.config = group, xfer, directory, node, host, config
        self.rank, self.world_size = group.rank, group.world_size
        self.last_fallback_reason: str | None = None
        """Why the last ``restore`` found no memory snapshot (None when it restored from memory)."""
        self.last_plan_seconds = 0.0
        """Seconds the last ``restore`` took to agree on a group (offers, plans, votes) before reading it."""

    def restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        started = time.perf_counter()
        self.last_fallback_reason = None
        flat = flatten(state, keep_state_dicts=True)
        info = self.group.all_gather({"node": self.node, "host": self.host, "floor": not_older_than})
        rank_nodes = [str(i["node"]) for i in info]
        floors = [int(i["floor"]) for i in info if i["floor"] is not None]
        floor = max(floors) if floors else None
        leader = self.rank == min(r for r, n in enumerate(rank_nodes) if n == self.node)
        offers = self.group.all_gather(self.offer() if leader else {})
        held = held_files(offers, rank_nodes)
        order = node_ring({n: str(i["host"]) for n, i in zip(rank_nodes, info)})
        plans: dict[SnapshotId, GroupPlan] = {}
        why: dict[str, str] = {}
        for snap in sorted(held, key=lambda s: (s.step, s.gen), reverse=True):
            if floor is not None and snap.step < floor:
                continue
            try:
                plans[snap] = plan_group(snap, held[snap], node=self.node, node_order=order, wanted=flat.items,
                                         per_rank=flat.per_rank, rank=self.rank, world_size=self.world_size)
            except (MemoryTierError, ValueError) as exc:
                why[f"{snap.step}-{snap.gen}"] = str(exc)
        gathered = self.group.all_gather({"groups": [[s.step, s.gen] for s in plans], "why": why})
        lists = [{SnapshotId(int(s), str(g)) for s, g in x["groups"]} for x in gathered]
        touched = False
        self.last_plan_seconds = time.perf_counter() - started
        while True:
            choice = choose_snapshot([sorted(x, key=lambda s: s.step) for x in lists], not_older_than=floor)
            if choice is None:
                reason = fallback_reason(held, floor, gathered, touched)
                self.last_fallback_reason = reason
                # A first start has nothing anywhere (info); anything else lost snapshots (warning). Every rank
                # decided the same from the same gathered offers: rank 0 says it, the others only at debug level
                # (one line per job, not one per rank).
                level = logging.DEBUG if self.rank != 0 else logging.INFO if not held else logging.WARNING
                logger.log(level, "[rank %d] no memory snapshot to restore, falling back to the durable tier: %s",
                           self.rank, reason)
                if touched:
                    raise PartialRestoreError(
                        f"rank {self.rank}: every memory snapshot failed while being restored and the live state "
                        f"was partly overwritten; restore it from the durable tier or restart ({reason})"
                    )
                return None
            touched = True
            loaded = self.load_plan(plans[choice], state, rank_nodes)
            votes = self.group.all_gather({
                "ok": loaded.error is None,
                "bad": list(loaded.bad) if loaded.bad is not None else None,
                "peer": loaded.peer_bytes > 0,
            })
            if all(v["ok"] for v in votes):
                seconds = time.perf_counter() - started
                source = RestoreSource.MEMORY_PEER if any(v["peer"] for v in votes) else RestoreSource.MEMORY_LOCAL
                logger.info(
                    "[rank %d] restored step %d from memory (gen %s, %s): %d bytes, %d from another node, in %.3fs "
                    "(%.3fs to agree on it)", self.rank, choice.step, choice.gen, source.value, loaded.nbytes,
                    loaded.peer_bytes, seconds, self.last_plan_seconds,
                )
                return RestoreReport(source, choice.step, loaded.nbytes, seconds)
            logger.warning(
                "[rank %d] memory snapshot of step %d (gen %s) not restored: %s; trying the next source",
                self.rank, choice.step, choice.gen, loaded.error if loaded.error is not None else "failed on another rank",
            )
            self.quarantine_files(choice, [v["bad"] for v in votes if v["bad"] is not None], leader)
            for x in lists:
                x.discard(choice)

    def offer(self) -> dict[str, JSON]:
        """The manifests of the newest groups in this node's keeper (snapshots and buddy copies) that pass
        their checks: ``{file name: manifest}``."""
        try:
            names = os.listdir(self.directory)
        except OSError as exc:
            logger.warning("[rank %d] memory tier directory unreadable: %s", self.rank, exc)
            return {}
        found: dict[SnapshotId, list[tuple[str, int, int]]] = {}
        for name in names:
            parsed = parse_any_name(name)
            if parsed is not None:
                snap, rank, world, _ = parsed
                found.setdefault(snap, []).append((name, rank, world))
        out: dict[str, JSON] = {}
        for snap in sorted(found, key=lambda s: (s.step, s.gen), reverse=True)[:GROUPS_LOOKED_AT]:
            for name, rank, world in found[snap]:
                try:
                    m = read_manifest(os.path.join(self.directory, name))
                    if (m.step, m.gen, m.rank, m.world_size) != (snap.step, snap.gen, rank, world):
                        raise CorruptCheckpointError(f"{name}: its manifest names step {m.step} gen {m.gen} rank {m.rank}")
                except (CorruptCheckpointError, OSError) as exc:
                    logger.warning("[rank %d] skipping memory snapshot file %s: %s", self.rank, name, exc)
                    continue
                out[name] = m.to_json()
        return out

    def load_plan(self, plan: GroupPlan, state: Mapping[str, Any], rank_nodes: Sequence[str]) -> Loaded:
        """Read the group into ``state``: this node's files directly, the rest received from their holders,
        while this rank also sends what the others asked of it. Every rank takes part to the end whatever
        fails (it drains what it still expects and sends zeros for what it cannot read)."""
        out = Loaded()
        flat = flatten(state, keep_state_dicts=True)
        destinations = {item.key: item.tensor for item in flat.items}
        block = plan.manifest.checksum_block_bytes
        verify = self.config.verify_on_restore
        local = [r for r in plan.requests if plan.holders[r.file] == self.node]
        remote = [r for r in plan.requests if plan.holders[r.file] != self.node]
        needs = [
            (r.file, *widened_range(r, block, verify), pick_sender(self.rank, plan.holders[r.file], rank_nodes))
            for r in remote
        ]
        moves = transfers([[(str(f), int(a), int(b), int(s)) for f, a, b, s in x]
                           for x in self.group.all_gather([list(n) for n in needs])])
        sends = [t for t in moves if t.src == self.rank]
        storage = StorageSpec.from_config(os.path.dirname(self.directory), CheckpointConfig(max_retries=1)).open()
        threads = read_threads(self.config)
        pool = ThreadPoolExecutor(2, thread_name_prefix="memtier-peer")
        try:
            sending: Future[str | None] = pool.submit(self.send_all, sends)
            reading: Future[int] = pool.submit(
                read_requests, storage, os.path.basename(self.directory), local, destinations.__getitem__, block,
                verify, threads, part_bytes=READ_PART_BYTES,
            )
            with torch.no_grad():
                receiver = Receiver(storage, self.xfer.group, block, verify)
                for req, (_, start, end, src) in zip(remote, needs):
                    receiver.post(req, destinations[req.dst], src, start, end, plan.holders[req.file])
                receiver.finish()
                out.peer_bytes = receiver.nbytes
                if receiver.error is not None:
                    out.error, out.bad = receiver.error, (receiver.error_file, plan.holders[receiver.error_file])
            try:
                out.nbytes = reading.result() + out.peer_bytes
            except Exception as exc:  # noqa: BLE001 - voted on by the caller
                if out.error is None:
                    bad = exc.file if isinstance(exc, CorruptCheckpointError) else None
                    out.error, out.bad = exc, ((bad, self.node) if bad is not None else None)
            unreadable = sending.result()
            if unreadable is not None and out.error is None:
                out.error = MemoryTierError(f"could not send {unreadable} to a peer")
                out.bad = (unreadable, self.node)
        finally:
            pool.shutdown(wait=True)
            storage.close()
        if out.error is not None:
            return out
        flat.objects = plan.objects
        rank_objects: dict[str, JSON] = {}
        for key, rule in flat.per_rank.items():
            saved = per_rank_source(self.rank, self.world_size, plan.manifest.world_size, rule)
            if saved is not None:
                rank_objects[key] = plan.rank_objects[saved][key]
        flat.rank_objects = rank_objects
        try:
            apply(state, flat)
        except Exception as exc:  # noqa: BLE001 - voted on by the caller
            out.error = exc
        return out

    def send_all(self, sends: Sequence[Transfer]) -> str | None:
        """Helper thread: send every range asked of this rank, in the global order; zeros (which fail the
        reader's crc32 check) for a file this node cannot read. Returns the first unreadable file, if any."""
        group = self.xfer.group
        unreadable: str | None = None
        maps: dict[str, tuple[mmap.mmap, torch.Tensor] | None] = {}
        zeros: torch.Tensor | None = None
        works: list[Any] = []
        try:
            for t in sends:  # all posted at once (views of the mapped files: no copies), in the global order
                if t.file not in maps:
                    maps[t.file] = map_file(os.path.join(self.directory, t.file))
                mapped = maps[t.file]
                for a, b in pieces(t.start, t.end, PIECE_BYTES):
                    if mapped is not None and b <= mapped[1].numel():
                        piece = mapped[1][a:b]
                    else:
                        unreadable = unreadable or t.file
                        if zeros is None:
                            zeros = torch.zeros(PIECE_BYTES, dtype=torch.uint8)
                        piece = zeros[: b - a]
                    works.append(dist.isend(piece, group=group, group_dst=t.dst, tag=RESTORE_TAG))
            for work in works:
                work.wait()
        finally:
            for entry in maps.values():
                if entry is not None:
                    mm, tensor = entry
                    del tensor
                    with contextlib.suppress(BufferError):
                        mm.close()
        return unreadable

    def quarantine_files(self, snap: SnapshotId, bad: Sequence[Sequence[str]], leader: bool) -> None:
        """Remove, on the node leader, the files of this node that failed their checks in some rank's load."""
        if not leader or self.directory is None:
            return
        for file, node in bad:
            parsed = parse_any_name(file)
            if node == self.node and parsed is not None and parsed[0] == snap:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, file))


def held_files(offers: Sequence[Any], rank_nodes: Sequence[str]) -> dict[SnapshotId, list[HeldFile]]:
    """Every offered file, by group (a manifest that does not parse is skipped, like a corrupt file)."""
    held: dict[SnapshotId, list[HeldFile]] = {}
    for rank, offer in enumerate(offers):
        for name, raw in dict(offer).items():
            parsed = parse_any_name(name)
            if parsed is None:
                continue
            try:
                manifest = SnapshotManifest.from_json(raw)
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("memory snapshot file %s on %s skipped: %r", name, rank_nodes[rank], exc)
                continue
            held.setdefault(parsed[0], []).append(HeldFile(name, rank_nodes[rank], manifest))
    return held


def fallback_reason(held: Mapping[SnapshotId, Sequence[HeldFile]], floor: int | None, gathered: Sequence[Any],
                     touched: bool) -> str:
    """One sentence, the same on every rank: why no memory snapshot is restored."""
    if not held:
        return "no memory snapshot on any current node"
    newest = max(held, key=lambda s: (s.step, s.gen))
    if floor is not None and newest.step < floor:
        return f"the newest memory snapshot (step {newest.step}) is older than the durable step {floor}"
    key = f"{newest.step}-{newest.gen}"
    for g in gathered:
        if key in g["why"]:
            return str(g["why"][key])
    if touched:
        return f"every memory snapshot failed its checks (newest: step {newest.step})"
    return f"no memory snapshot every rank can restore (newest: step {newest.step})"


class Receiver:
    """The receiving side of a restore's transfers: receives are posted ahead (straight into the destination
    tensors when the bytes line up, else into bounce buffers, at most ``BOUNCE_BYTES`` of them at a time) and
    completed in order, each piece's blocks checked against their crc32s as it completes. After a failure the
    rest is still received (and ignored): the senders must never be left waiting."""

    def __init__(self, storage: Storage, group: dist.ProcessGroup | None, block: int, verify: bool) -> None:
        self.storage, self.group, self.block, self.verify = storage, group, block, verify
        self.window: deque[Pending] = deque()
        self.bounce = 0
        self.nbytes = 0
        self.error: BaseException | None = None
        self.error_file = ""

    def post(self, req: ReadRequest, dst: torch.Tensor, src: int, start: int, end: int, holder: str) -> None:
        """Post the receives of ``[start, end)`` of ``req.file`` (on node ``holder``) from rank ``src``, for
        ``req``'s part of ``dst``."""
        index = tuple(slice(a, b) for a, b in req.dst_slices)
        target = dst.detach()[index] if index else dst.detach()
        direct = (
            target.device.type == "cpu" and target.is_contiguous()
            and (start, end) == tuple(req.read_range) and end - start == target.numel() * target.element_size()
        )
        if not direct:
            while self.window and self.bounce + (end - start) > BOUNCE_BYTES:
                self._complete(self.window.popleft())
            self.bounce += end - start
        buf = target.reshape(-1).view(torch.uint8) if direct else torch.empty(end - start, dtype=torch.uint8)
        works = [
            dist.irecv(buf[a - start : b - start], group=self.group, group_src=src, tag=RESTORE_TAG)
            for a, b in pieces(start, end, PIECE_BYTES)
        ]
        self.window.append(Pending(req, dst, buf, works, start, end, direct, f"{holder}:{req.file}"))

    def finish(self) -> None:
        while self.window:
            self._complete(self.window.popleft())

    def _complete(self, p: Pending) -> None:
        req = p.req
        verifier = None
        if self.verify and p.direct and self.error is None:
            verifier = BlockVerifier(req.block_crc32, path=p.where, file=req.file, fqn=req.fqn,
                                     chunk_start=req.chunk_byte_range[0], start=p.start, end=p.end,
                                     block_bytes=self.block)
        waited = 0
        try:
            for (a, b), work in zip(pieces(p.start, p.end, PIECE_BYTES), p.works):
                work.wait()
                waited += 1
                if verifier is not None and self.error is None:
                    verifier.feed(p.buf[a - p.start : b - p.start].numpy().data)
            if not p.direct:
                self.bounce -= p.end - p.start
                if self.error is None:
                    view = memoryview(p.buf.numpy().data)
                    apply_read(self.storage, "peer", req, p.dst, self.block, self.verify,
                               lambda _f, s, e: view[s - p.start : e - p.start])
            self.nbytes += p.end - p.start
        except Exception as exc:  # noqa: BLE001 - voted on by the caller; the remaining pieces still arrive
            if self.error is None:
                self.error, self.error_file = exc, req.file
            for work in p.works[waited:]:  # each once: a second wait() on a gloo receive blocks
                work.wait()


@dataclass(slots=True)
class Pending:
    req: ReadRequest
    dst: torch.Tensor
    buf: torch.Tensor
    works: list[Any]
    start: int
    end: int
    direct: bool
    where: str
    """``node:file``, for messages."""


def map_file(path: str) -> tuple[mmap.mmap, torch.Tensor] | None:
    """A read-only mapping of ``path`` as a byte tensor (no copy); None when it cannot be read. The tensor is only
    ever sent from. Its pages are faulted in by gloo's send thread as it copies them into the socket, overlapped
    with the transfer (``MAP_POPULATE`` would make the first send wait until the whole file is mapped)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError:
        return None
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # "non-writable buffer": torch warns once, but nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        return mm, torch.frombuffer(mm, dtype=torch.uint8, count=size)


__all__ = ["BOUNCE_BYTES", "PeerRestore", "Receiver"]
