"""The memory tier across nodes (``checkpoint.memory.peer``, ``peerplan``): buddy copies and restores from peers.

Pure decisions first (buddies, which copy a rank reads, the transfer order), then real gloo processes with one
keeper directory per "node" (several nodes on this machine, as several agents would be): a replacement node
with an empty keeper restores DDP state from its peer at the same and at another world size; an FSDP2 job
that loses a node restores its shards from the buddy copy at a new world size; a damaged peer copy fails the
group on every rank and the next one is used; a node lost together with its buddy falls back to the durable
tier and says why. Every restored tensor is compared bit for bit with the snapshotted one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint.api import ChunkKey, ChunkRecord, FileRecord, RankRecords, TensorItem, TensorRecord
from checkpoint.memory.api import RestoreSource, SnapshotId, SnapshotManifest
from checkpoint.memory.layout import parse_snapshot_name
from checkpoint.memory.peerplan import (
    GroupNotCovered,
    HeldFile,
    Transfer,
    buddy_nodes,
    buddy_pairs,
    node_ring,
    node_unique,
    parse_any_name,
    parse_peer_name,
    peer_name,
    pick_sender,
    pieces,
    plan_buddy_copy,
    plan_group,
    transfers,
)
from checkpoint.memory.records import collect_restore_records, summarize
from checkpoint.shard import build_layout
from tests.harness.dist import run_workers

pytestmark = [pytest.mark.timeout(300)]

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
SNAP = SnapshotId(7, "0badc0de")


@pytest.fixture
def keepers() -> Iterator[dict[str, str]]:
    """Keeper directories of nodes A, B, C (and a replacement D), removed after the test."""
    root = tempfile.mkdtemp(prefix="spotrun-memtier-test-", dir=SHM)
    dirs = {n: os.path.join(root, n) for n in "ABCD"}
    for d in dirs.values():
        os.mkdir(d)
    try:
        yield dirs
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert not os.path.exists(root)


# --------------------------------------------------------------------------- pure: names and buddies
def test_peer_names_round_trip_and_differ_from_snapshots() -> None:
    name = peer_name(SNAP, 1, 3)
    assert name == "peer-000000007-0badc0de-00001-of-00003.safetensors"
    assert parse_peer_name(name) == (SNAP, 1, 3)
    assert parse_snapshot_name(name) is None  # LocalShmTier never mistakes a copy for a snapshot
    assert parse_any_name(name) == (SNAP, 1, 3, True)
    assert parse_any_name("snap-000000007-0badc0de-00001-of-00003.safetensors") == (SNAP, 1, 3, False)
    assert parse_peer_name("peer-000000007-0badc0de-00003-of-00003.safetensors") is None


def test_buddies_form_a_ring_on_one_host_and_cross_hosts_when_they_can() -> None:
    assert buddy_nodes({"a": "h"}) == {}
    assert buddy_nodes({"a": "h", "b": "h", "c": "h"}) == {"a": "b", "b": "c", "c": "a"}
    two_hosts = {"a1": "h1", "a2": "h1", "b1": "h2", "b2": "h2"}
    assert node_ring(two_hosts) == ["a1", "b1", "a2", "b2"]
    buddies = buddy_nodes(two_hosts)
    assert buddies == {"a1": "b1", "b1": "a2", "a2": "b2", "b2": "a1"}
    assert all(two_hosts[n] != two_hosts[b] for n, b in buddies.items())
    lopsided = {"a1": "h1", "a2": "h1", "a3": "h1", "b1": "h2"}
    assert all(lopsided[b] != lopsided[n] for n, b in buddy_nodes(lopsided).items())  # never the same host


def test_node_unique_pieces_are_what_a_node_loss_would_lose() -> None:
    w, s0, s1 = ChunkKey("w", (0,), (4,)), ChunkKey("s", (0,), (2,)), ChunkKey("s", (2,), (2,))
    # DDP over two nodes: nothing unique; FSDP shards: each rank's own; HSDP replicas inside node A: A's pieces
    assert node_unique([[w], [w]], ["A", "B"]) == [set(), set()]
    assert node_unique([[w, s0], [w, s1]], ["A", "B"]) == [{s0}, {s1}]
    assert node_unique([[s0], [s0], [s1]], ["A", "A", "B"]) == [{s0}, {s0}, {s1}]
    assert node_unique([[w], [w]], ["A", "A"]) == [{w}, {w}]  # one node: everything (but no buddy to send to)


def test_buddy_pairs_spread_a_nodes_ranks_over_its_buddys_ranks() -> None:
    nodes = ["A", "A", "B", "B", "C"]
    pairs = buddy_pairs(nodes, ["h"] * 5, [True] * 5)
    assert pairs == {0: 2, 1: 3, 2: 4, 3: 4, 4: 0}
    assert buddy_pairs(nodes, ["h"] * 5, [False] * 5) == {}  # pure DDP: nothing to copy
    assert buddy_pairs(["A", "A"], ["h", "h"], [True, True]) == {}  # one node: no buddy
    with pytest.raises(ValueError, match="hosts"):
        buddy_pairs(["A", "A"], ["h1", "h2"], [True, True])


# --------------------------------------------------------------------------- pure: restore plans
def _file(name: str, node: str, rank: int, chunks: dict[str, list[tuple[int, int]]], rank_objects: Any = None) -> HeldFile:
    """A held file whose tensors (shape (8,), F32) have the given row ranges."""
    tensors: dict[str, TensorRecord] = {}
    offset = 8
    for fqn, ranges in chunks.items():
        rec = tensors.setdefault(fqn, TensorRecord(shape=[8], dtype="F32"))
        for lo, hi in ranges:
            n = (hi - lo) * 4
            rec.chunks.append(ChunkRecord([lo], [hi - lo], name, fqn, [offset, offset + n], [0]))
            offset += n
    records = RankRecords(rank=rank, tensors=tensors, files={name: FileRecord(size=offset, crc32=0, rank=rank)})
    manifest = SnapshotManifest(step=SNAP.step, gen=SNAP.gen, rank=rank, world_size=2, node=node, created_unix=1.0,
                                checksum_block_bytes=1 << 20, records=records, objects={"o": 1},
                                rank_objects=rank_objects or {})
    return HeldFile(name, node, manifest)


def _want(fqn: str, lo: int, hi: int) -> TensorItem:
    return TensorItem(ChunkKey(fqn, (lo,), (hi - lo,)), (8,), "F32", torch.zeros(hi - lo), replicated=False)


def test_plan_reads_each_piece_once_from_this_node_first() -> None:
    # DDP on nodes A and B: each node holds the whole replicated tensor "w" (one copy each)
    a = _file("snap-a", "A", 0, {"w": [(0, 8)]})
    b = _file("snap-b", "B", 1, {"w": [(0, 8)]})
    for node, expect in (("A", "snap-a"), ("B", "snap-b")):
        plan = plan_group(SNAP, [a, b], node=node, node_order=["A", "B"], wanted=[_want("w", 0, 8)], per_rank={},
                          rank=0, world_size=1)
        assert [r.file for r in plan.requests] == [expect] and plan.remote(node) == []
    # a replacement node C holds nothing: it reads the nearest holder's copy (after C in ring order: A)
    plan = plan_group(SNAP, [a, b], node="C", node_order=["B", "C", "A"], wanted=[_want("w", 0, 8)], per_rank={},
                      rank=0, world_size=1)
    assert [(r.file, plan.holders[r.file]) for r in plan.remote("C")] == [("snap-a", "A")]


def test_plan_uses_the_buddy_copy_of_a_lost_rank_and_names_what_is_gone() -> None:
    # FSDP: rank 0 (node A) had rows 0-4, rank 1 (node B) rows 4-8; B keeps a copy of rank 0's rows
    b = _file("snap-b", "B", 1, {"s": [(4, 8)]}, rank_objects={"mine": 1})
    copy = _file("peer-a", "B", 0, {"s": [(0, 4)]}, rank_objects={"mine": 0})
    plan = plan_group(SNAP, [b, copy], node="B", node_order=["B"], wanted=[_want("s", 0, 8)],
                      per_rank={"mine": "rank_modulo"}, rank=0, world_size=1)
    assert sorted(r.file for r in plan.requests) == ["peer-a", "snap-b"]
    assert plan.rank_objects == {0: {"mine": 0}}  # new rank 0 takes saved rank 0's copy, from the buddy
    with pytest.raises(GroupNotCovered, match=r"saved rank\(s\) \[0\] have neither their snapshot nor a buddy copy"):
        plan_group(SNAP, [b], node="B", node_order=["B"], wanted=[_want("s", 0, 8)], per_rank={}, rank=0,
                   world_size=1)
    with pytest.raises(GroupNotCovered, match="per-rank entry 'mine' of saved rank 0"):
        plan_group(SNAP, [b, _file("peer-a", "B", 0, {"s": [(0, 4)]})], node="B", node_order=["B"],
                   wanted=[_want("s", 0, 8)], per_rank={"mine": "rank_modulo"}, rank=0, world_size=1)


def test_transfers_run_in_one_global_order_and_pieces_cut_ranges() -> None:
    needs = [[], [("f", 0, 10, 0), ("g", 5, 6, 2)], [("f", 10, 20, 0)]]
    assert transfers(needs) == [Transfer(0, 1, "f", 0, 10), Transfer(2, 1, "g", 5, 6), Transfer(0, 2, "f", 10, 20)]
    with pytest.raises(ValueError, match="asks rank 1"):
        transfers([[], [("f", 0, 1, 1)]])
    assert pieces(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert pieces(3, 3, 4) == []
    assert [pick_sender(r, "B", ["A", "B", "B"]) for r in range(3)] == [1, 2, 1]


def test_buddy_copy_keeps_only_unique_pieces_with_the_snapshots_checksums() -> None:
    rep, shard = ChunkKey("rep", (0,), (4,)), ChunkKey("shard", (4,), (2,))
    layout = build_layout("snap", [(0, rep, (4,), "F32", 16), (1, shard, (8,), "F32", 8)])
    records = RankRecords(rank=1, files={"snap": FileRecord(size=layout.size, crc32=0, rank=1)})
    for e in layout.entries:
        lo = len(layout.header) + e.offset
        records.tensors[e.key.fqn] = TensorRecord(
            shape=list(e.global_shape), dtype="F32",
            chunks=[ChunkRecord(list(e.key.offsets), list(e.key.lengths), "snap", e.name, [lo, lo + e.nbytes], [99])])
    origin = SnapshotManifest(step=7, gen=SNAP.gen, rank=1, world_size=2, node="A", created_unix=1.0,
                              checksum_block_bytes=1 << 20, records=records)
    copy = plan_buddy_copy(layout, origin, {shard}, "peer")
    (entry,) = copy.layout.entries
    assert entry.key == shard
    src = next(e for e in layout.entries if e.key == shard)
    assert copy.runs == [(len(layout.header) + src.offset, len(layout.header) + src.offset + 8)]
    (chunk,) = copy.records.tensors["shard"].chunks
    assert chunk.block_crc32 == [99] and chunk.file == "peer" and copy.records.rank == 1
    assert chunk.byte_range == [len(copy.layout.header), len(copy.layout.header) + 8]


# --------------------------------------------------------------------------- real processes: DDP
def _ddp_state(seed: int, per_rank: bool = True) -> dict[str, Any]:
    from checkpoint.state import PerRank

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 3))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(1, 8)).sum().backward()
    optim.step()
    optim.zero_grad()
    state: dict[str, Any] = {"model": model, "optim": optim, "meta": {"step": 0}}
    if per_rank:
        state["mine"] = PerRank({"seen": -1})
    return state


def _ddp_train(state: dict[str, Any], step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(step)  # the same on every rank: replicated state, as under DDP
    state["model"](torch.randn(4, 8, generator=gen)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["meta"]["step"] = step
    if "mine" in state:
        state["mine"].value["seen"] = step * 10 + rank


def _ddp_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, p in enumerate(state["model"].parameters()):
        out[f"momentum.{i}"] = state["optim"].state[p]["momentum_buffer"].clone()
    return out


def _tier(directory: str, node: str, **config: Any) -> Any:
    from checkpoint.memory.config import MemoryTierConfig
    from checkpoint.memory.peer import PeerShmTier

    return PeerShmTier(directory, MemoryTierConfig(**config), node=node, host="one-host")


def _ddp_snapshot(rank: int, world: int, dirs: list[str], nodes: list[str], steps: int, per_rank: bool) -> dict[str, Any]:
    state = _ddp_state(0, per_rank)
    tier = _tier(dirs[rank], nodes[rank])
    try:
        snaps: dict[int, Any] = {}
        for step in range(1, steps + 1):
            _ddp_train(state, step, rank)
            assert tier.snapshot(step, state)
            snaps[step] = _plain(_ddp_tensors(state))
        tier.wait()
        return {"snaps": snaps, "sent": tier.buddy_bytes_sent, "received": tier.buddy_copies_received,
                "copy_bytes": tier.buddies.copy_bytes}
    finally:
        tier.close()


def _ddp_snapshot_copied(rank: int, world: int, dirs: list[str], nodes: list[str], synchronous: bool) -> list[int]:
    """Per step, the newest step of the buddy copy this rank held the moment ``snapshot`` returned (0: none)."""
    state = _ddp_state(0, True)
    tier = _tier(dirs[rank], nodes[rank], synchronous=synchronous)
    try:
        held: list[int] = []
        for step in range(1, 4):
            _ddp_train(state, step, rank)
            assert tier.snapshot(step, state)
            copies = [parse_peer_name(f) for f in _files(dirs[rank])]
            held.append(max((c[0].step for c in copies if c is not None), default=0))
        return held
    finally:
        tier.close()


def _ddp_restore(rank: int, world: int, dirs: list[str], nodes: list[str], config: list[dict[str, Any]],
                 per_rank: bool = True) -> dict[str, Any]:
    state = _ddp_state(1, per_rank)
    tier = _tier(dirs[rank], nodes[rank], **config[rank])
    try:
        report = tier.restore(state, not_older_than=None)
        return {"report": None if report is None else report.to_json(), "tensors": _plain(_ddp_tensors(state)),
                "meta": state["meta"], "mine": state["mine"].value if per_rank else None, "reason": tier.last_fallback_reason}
    finally:
        tier.close()


def _plain(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """Tensors as plain data for the result queue (torch would share their storage by file descriptor, which
    dies with the worker): dtype, shape and the exact bytes."""
    return {k: (str(v.dtype), list(v.shape), v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for k, v in tensors.items()}


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name  # dtype, shape and every byte


def _files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if parse_any_name(n) is not None)


def test_replacement_node_restores_ddp_state_from_its_peer_at_any_world_size(keepers: dict[str, str], tmp_path: Path) -> None:
    a, b = keepers["A"], keepers["B"]
    out = run_workers(_ddp_snapshot, 2, ([a, b], ["A", "B"], 3, True), tmpdir=str(tmp_path), timeout=120)
    # each node keeps its own snapshots (the last complete step and the newest) and its buddy's per-rank objects
    copies = [parse_any_name(f) for f in _files(a) if f.startswith("peer-")]
    assert [(c[0].step, c[1]) for c in copies if c is not None] == [(2, 1), (3, 1)]
    assert out[0]["received"] == out[1]["received"] == 3 and out[0]["sent"] > 0
    shutil.rmtree(b)  # node B is replaced: its successor's keeper is empty
    os.mkdir(b)
    want = out[0]["snaps"][3]
    # same world size: rank 0 on A, rank 1 on the new B
    same = run_workers(_ddp_restore, 2, ([a, b], ["A", "B"], [{}, {}]), tmpdir=str(tmp_path), timeout=120)
    for rank, r in enumerate(same):
        assert r["report"]["restore_source"] == RestoreSource.MEMORY_PEER.value and r["report"]["restore_step"] == 3
        _assert_equal(r["tensors"], want)
        assert r["meta"] == {"step": 3}
        assert r["mine"] == {"seen": 30 + rank}  # rank 1's per-rank objects came from A's buddy copy
    # another world size: one rank on A, two on the new B
    grown = run_workers(_ddp_restore, 3, ([a, b, b], ["A", "B", "B"], [{}, {}, {}]), tmpdir=str(tmp_path), timeout=120)
    for rank, r in enumerate(grown):
        assert r["report"]["restore_source"] == "memory_peer" and r["report"]["restore_step"] == 3
        _assert_equal(r["tensors"], want)
        assert r["mine"] == {"seen": 30 + rank % 2}  # rank_modulo


def test_a_synchronous_snapshot_returns_with_its_buddy_copy_landed(keepers: dict[str, str], tmp_path: Path) -> None:
    """``MemoryTierConfig.synchronous``: when ``snapshot(step)`` returns, the buddy copy of that step (the other
    node's per-rank objects) is already in this node's keeper: a node lost now redoes none of the step (by
    default the copy runs behind the next step)."""
    a, b = keepers["A"], keepers["B"]
    out = run_workers(_ddp_snapshot_copied, 2, ([a, b], ["A", "B"], True), tmpdir=str(tmp_path), timeout=120)
    assert out == [[1, 2, 3], [1, 2, 3]], out


def test_without_a_replacement_the_restore_is_local(keepers: dict[str, str], tmp_path: Path) -> None:
    a, b = keepers["A"], keepers["B"]
    out = run_workers(_ddp_snapshot, 2, ([a, b], ["A", "B"], 2, False), tmpdir=str(tmp_path), timeout=120)
    assert out[0]["sent"] == out[1]["sent"] == 0  # pure DDP: nothing unique to a node, no copies
    assert out[0]["copy_bytes"] == out[1]["copy_bytes"] == 0  # ... and none counted by the size check at start
    assert not [f for d in (a, b) for f in _files(d) if f.startswith("peer-")]
    back = run_workers(_ddp_restore, 2, ([a, b], ["A", "B"], [{}, {}], False), tmpdir=str(tmp_path), timeout=120)
    for r in back:
        assert r["report"]["restore_source"] == "memory_local" and r["report"]["restore_step"] == 2
        _assert_equal(r["tensors"], out[0]["snaps"][2])


def _ddp_restore_and_go_on(rank: int, world: int, dirs: list[str], nodes: list[str]) -> dict[str, Any]:
    """Restore, then train and snapshot one more step (its buddy copies go to the new group's buddies)."""
    state = _ddp_state(1)
    tier = _tier(dirs[rank], nodes[rank])
    try:
        report = tier.restore(state, not_older_than=None)
        restored = _plain(_ddp_tensors(state))
        _ddp_train(state, 4, rank)
        assert tier.snapshot(4, state)
        tier.wait()
        return {"report": None if report is None else report.to_json(), "tensors": restored, "mine": state["mine"].value,
                "sent": tier.buddy_bytes_sent, "received": tier.buddy_copies_received, "gen": tier.gen}
    finally:
        tier.close()


def test_a_node_whose_buddy_is_lost_restores_from_its_own_memory_and_copies_to_a_living_buddy(
    keepers: dict[str, str], tmp_path: Path
) -> None:
    """Nodes A, B, C (buddies A -> B -> C -> A), per-rank objects on every rank (so there are buddy copies).
    B, A's buddy, is lost; A survives. The new group (A and C, world size 2) restores from memory alone, no byte
    from another node (A has its own snapshot; B's per-rank objects, which new rank 1 takes, are in C's buddy copy),
    and its next snapshot's copies go to the living buddies: A -> C and C -> A."""
    a, b, c = keepers["A"], keepers["B"], keepers["C"]
    out = run_workers(_ddp_snapshot, 3, ([a, b, c], ["A", "B", "C"], 3, True), tmpdir=str(tmp_path), timeout=120)
    assert [(p[0].step, p[1]) for p in map(parse_any_name, _files(b)) if p is not None and p[0].step == 3] == \
        [(3, 0), (3, 1)]  # A's copy of step 3 (rank 0) was on B, beside B's own snapshot
    shutil.rmtree(b)
    back = run_workers(_ddp_restore_and_go_on, 2, ([a, c], ["A", "C"]), tmpdir=str(tmp_path), timeout=120)
    for r in back:
        assert r["report"]["restore_source"] == "memory_local" and r["report"]["restore_step"] == 3, r["report"]
        _assert_equal(r["tensors"], out[0]["snaps"][3])
        assert r["received"] == 1 and r["sent"] > 0, r  # one copy each way for step 4
    gen = back[0]["gen"]
    # On each living node, the new group's files: its own snapshot and the other node's buddy copy of step 4.
    new = {d: sorted((f.startswith("peer-"), p[0].step, p[1]) for f in _files(d)
                     if (p := parse_any_name(f)) is not None and p[0].gen == gen) for d in (a, c)}
    assert new[a] == [(False, 4, 0), (True, 4, 1)] and new[c] == [(False, 4, 1), (True, 4, 0)], new


def _ddp_one_rank_starved(rank: int, world: int, dirs: list[str], nodes: list[str]) -> dict[str, Any]:
    state = _ddp_state(0)
    fs = os.statvfs(dirs[rank])
    room = {"min_free_bytes": fs.f_blocks * fs.f_frsize} if rank == 1 else {}  # rank 1 never has room
    tier = _tier(dirs[rank], nodes[rank], **room)
    try:
        started = []
        for step in (1, 2, 3):
            _ddp_train(state, step, rank)
            started.append(tier.snapshot(step, state))
        tier.wait()
        return {"started": started, "enabled": tier.enabled}
    finally:
        tier.close()


def test_a_rank_that_cannot_snapshot_still_answers_its_buddy(keepers: dict[str, str], tmp_path: Path) -> None:
    """Rank 1 runs out of room after the vote: its buddy (rank 0) still gets its (empty) message, so rank 0's
    background thread does not wait for it and the next snapshot turns the tier off on both, promptly."""
    a, b = keepers["A"], keepers["B"]
    out = run_workers(_ddp_one_rank_starved, 2, ([a, b], ["A", "B"]), tmpdir=str(tmp_path), timeout=120)
    assert out[0] == {"started": [True, False, False], "enabled": False}
    assert out[1] == {"started": [False, False, False], "enabled": False}
    assert not [f for f in _files(b)]  # rank 0's copy was received and dropped: no room on B either


def _flip_data_byte(path: str) -> None:
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 5)
        byte = f.read(1)
        f.seek(8 + header + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_damaged_bytes_from_a_peer_fail_the_group_on_every_rank(keepers: dict[str, str], tmp_path: Path) -> None:
    a, b = keepers["A"], keepers["B"]
    out = run_workers(_ddp_snapshot, 2, ([a, b], ["A", "B"], 3, True), tmpdir=str(tmp_path), timeout=120)
    shutil.rmtree(b)
    os.mkdir(b)
    newest = [f for f in _files(a) if f.startswith("snap-") and parse_any_name(f)[0].step == 3]  # type: ignore[index]
    assert len(newest) == 1
    _flip_data_byte(os.path.join(a, newest[0]))
    # A does not check what it reads itself: only the bytes B receives can reveal the damage
    back = run_workers(_ddp_restore, 2, ([a, b], ["A", "B"], [{"verify_on_restore": False}, {}]),
                       tmpdir=str(tmp_path), timeout=120)
    for r in back:
        assert r["report"]["restore_step"] == 2 and r["report"]["restore_source"] == "memory_peer"
        _assert_equal(r["tensors"], out[0]["snaps"][2])
    assert newest[0] not in os.listdir(a)  # the damaged file is removed by its node


# --------------------------------------------------------------------------- real processes: FSDP2
def _fsdp_state(seed: int, hsdp: bool = False) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from checkpoint.state import ModelOptimizer, PerRank

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))
    world = dist.get_world_size()
    if hsdp:  # ranks r and r + world/2 hold the same shard (replicate dimension first)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(net.parameters(), lr=0.01)
    return {"mo": ModelOptimizer(net, optim), "net": net, "optim": optim, "mine": PerRank({"rank": -1})}


def _fsdp_train(state: dict[str, Any], step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(step)
    state["optim"].zero_grad()
    state["net"](torch.randn(4, 6, generator=gen)).square().sum().backward()
    state["optim"].step()
    state["mine"].value["rank"] = rank * 100 + step


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, whole (collective: all-gathers the DTensors)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}", value[k])
        elif isinstance(value, DTensor):
            out[prefix] = value.full_tensor().clone()
        elif isinstance(value, torch.Tensor):
            out[prefix] = value.clone()

    walk("mo", state["mo"].state_dict())
    return out


def _fsdp_snapshot(rank: int, world: int, dirs: list[str], nodes: list[str], ckpt: str | None,
                   hsdp: bool = False) -> dict[str, Any]:
    from checkpoint.checkpointer import Checkpointer

    state = _fsdp_state(0, hsdp)
    tier = _tier(dirs[rank], nodes[rank])
    saved: dict[int, Any] = {}
    try:
        for step in (1, 2, 3):
            _fsdp_train(state, step, rank)
            assert tier.snapshot(step, state)
            saved[step] = _plain(_full(state))
            if ckpt is not None and step == 1:
                with Checkpointer(ckpt) as durable:
                    durable.save(step, state)
        tier.wait()
        return {"full": saved, "sent": tier.buddy_bytes_sent, "copy_bytes": tier.buddies.copy_bytes}
    finally:
        tier.close()


def _fsdp_restore(rank: int, world: int, dirs: list[str], nodes: list[str], ckpt: str | None) -> dict[str, Any]:
    from checkpoint.checkpointer import Checkpointer
    from checkpoint.memory.resume import restore

    state = _fsdp_state(1)
    tier = _tier(dirs[rank], nodes[rank])
    try:
        durable = Checkpointer(ckpt) if ckpt is not None else None
        try:
            report = restore(durable, state, memory=tier)
        finally:
            if durable is not None:
                durable.close()
        return {"report": None if report is None else report.to_json(), "full": _plain(_full(state)),
                "mine": state["mine"].value, "reason": tier.last_fallback_reason}
    finally:
        tier.close()


@pytest.mark.slow
def test_fsdp2_node_loss_restores_the_lost_shards_from_the_buddy_copy(keepers: dict[str, str], tmp_path: Path) -> None:
    a, b, c = keepers["A"], keepers["B"], keepers["C"]
    out = run_workers(_fsdp_snapshot, 3, ([a, b, c], ["A", "B", "C"], None), tmpdir=str(tmp_path), timeout=240)
    assert all(o["sent"] > 0 for o in out)  # every rank's shards went to its buddy (A -> B -> C -> A)
    # The size check at start counts the copies each node keeps: its source's shard bytes (what the source sends
    # per snapshot, less the copy's header, manifest and footer).
    for src in range(3):
        kept, sent = out[(src + 1) % 3]["copy_bytes"], out[src]["sent"] // 3
        assert 0 < kept <= sent < kept + 65536, (src, kept, sent)
    assert [f for f in _files(b) if f.startswith("peer-")] and [f for f in _files(c) if f.startswith("peer-")]
    shutil.rmtree(a)  # node A is lost with its keeper
    # world 2: rank 0 on C, rank 1 on B. Rank 0's rows include saved rank 0's, whose only copy is B's buddy copy
    back = run_workers(_fsdp_restore, 2, ([c, b], ["C", "B"], None), tmpdir=str(tmp_path), timeout=240)
    want = out[0]["full"][3]
    for rank, r in enumerate(back):
        assert r["report"]["restore_source"] == "memory_peer" and r["report"]["restore_step"] == 3, r
        _assert_equal(r["full"], want)
        assert r["mine"] == {"rank": rank * 100 + 3}  # saved rank 0's per-rank objects, from its buddy copy


@pytest.mark.slow
def test_a_node_lost_with_its_buddy_falls_back_to_the_durable_tier(keepers: dict[str, str], tmp_path: Path) -> None:
    a, b, c = keepers["A"], keepers["B"], keepers["C"]
    ckpt = str(tmp_path / "ckpt")
    out = run_workers(_fsdp_snapshot, 3, ([a, b, c], ["A", "B", "C"], ckpt), tmpdir=str(tmp_path), timeout=240)
    shutil.rmtree(a)  # A and its buddy B lost together: A's shards are nowhere in memory
    shutil.rmtree(b)
    (r,) = run_workers(_fsdp_restore, 1, ([c], ["C"], ckpt), tmpdir=str(tmp_path), timeout=240)
    assert r["report"]["restore_source"] == "durable" and r["report"]["restore_step"] == 1
    assert "saved rank(s) [0] have neither their snapshot nor a buddy copy" in r["reason"], r["reason"]
    # ... and says so where the agent reads it: its restore_completed event carries the reason.
    assert r["report"]["restore_fallback"] == r["reason"]
    (record,) = collect_restore_records(c)
    event = summarize([record])
    assert event["restore_source"] == "durable" and event["restore_fallback"] == r["reason"], event
    _assert_equal(r["full"], out[0]["full"][1])


@pytest.mark.slow
def test_hsdp_replicas_on_one_node_are_copied_to_its_buddy(keepers: dict[str, str], tmp_path: Path) -> None:
    """HSDP whose replicas of a shard live on one node (ranks 0 and 2 on A, 1 and 3 on B): the pieces are
    replicated, yet a loss of A would lose them; they go to B, and a restore without A finds them there."""
    a, b, c = keepers["A"], keepers["B"], keepers["C"]
    out = run_workers(_fsdp_snapshot, 4, ([a, b, a, b], ["A", "B", "A", "B"], None, True), tmpdir=str(tmp_path),
                      timeout=240)
    assert all(o["sent"] > 0 for o in out)
    shutil.rmtree(a)
    back = run_workers(_fsdp_restore, 2, ([c, b], ["C", "B"], None), tmpdir=str(tmp_path), timeout=240)
    for r in back:
        assert r["report"]["restore_source"] == "memory_peer" and r["report"]["restore_step"] == 3, r
        _assert_equal(r["full"], out[0]["full"][3])
