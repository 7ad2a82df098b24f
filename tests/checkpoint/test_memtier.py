"""The memory tier (``checkpoint.memory``): pure decisions, snapshot/restore round trips, a corrupt snapshot
skipped, the shm room check, a 2 -> 1 reshard from memory, and the keeper's lifetime (removal at exit, when its
agent is SIGKILLed, and the sweep of orphans).

Every test keeps its snapshots in its own directory under ``/dev/shm`` and removes it (the ``shm_dir`` fixture
asserts nothing else of ours is left there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint.api import CheckpointConfigError, ChunkKey
from checkpoint.memory.api import OWNER_LOCK, MemoryTier, RestoreSource, ShmSpaceError, SnapshotId
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.layout import (
    FOOTER,
    choose_snapshot,
    decode_footer,
    encode_footer,
    node_writers,
    parse_snapshot_name,
    pick_slot,
    room_for,
    size_for,
    snapshot_name,
)
from checkpoint.memory.shm import LocalShmTier
from checkpoint.memory.slots import check_room
from checkpoint.state import PerRank
from elastic import memory_keeper as keeper_module
from elastic.memory_keeper import Keeper, keeper_prefix, remove_orphaned_keepers
from tests.harness.dist import run_workers
from tests.harness.procs import reap, wait_for

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="spotrun-memtier-test-", dir=SHM)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert not os.path.exists(path)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 3))


def _state(seed: int) -> dict[str, Any]:
    model = _model(seed)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(1, 8)).sum().backward()  # momentum buffers exist after one step
    optim.step()
    optim.zero_grad()
    return {"model": model, "optim": optim, "meta": {"step": 0}, "mine": PerRank({"seen": 0})}


def _train(state: dict[str, Any], step: int, rank: int = 0) -> None:
    gen = torch.Generator().manual_seed(step)
    state["model"](torch.randn(4, 8, generator=gen)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["meta"]["step"] = step
    state["mine"].value["seen"] = step * 10 + rank


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, p in enumerate(state["model"].parameters()):
        out[f"momentum.{i}"] = state["optim"].state[p]["momentum_buffer"].clone()
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _snapshots(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if parse_snapshot_name(n) is not None)


# --------------------------------------------------------------------------- pure parts
def test_config_rejects_bad_values_with_a_fix() -> None:
    with pytest.raises(CheckpointConfigError, match="every=0"):
        MemoryTierConfig(every=0)
    with pytest.raises(CheckpointConfigError, match="when_busy"):
        MemoryTierConfig(when_busy="later")  # type: ignore[arg-type]
    with pytest.raises(CheckpointConfigError, match="min_free_fraction"):
        MemoryTierConfig(min_free_fraction=1.0)
    with pytest.raises(CheckpointConfigError, match="every=True"):
        MemoryTierConfig(every=True)
    with pytest.raises(CheckpointConfigError, match="synchronous=1"):
        MemoryTierConfig(synchronous=1)  # type: ignore[arg-type]


def test_names_and_footer_round_trip_and_reject_others() -> None:
    name = snapshot_name(SnapshotId(42, "0badc0de"), 1, 2)
    assert name == "snap-000000042-0badc0de-00001-of-00002.safetensors"
    assert parse_snapshot_name(name) == (SnapshotId(42, "0badc0de"), 1, 2)
    for other in ("snap-000000042-0badc0de-00002-of-00002.safetensors", ".tmp-0badc0de-00001-0", OWNER_LOCK,
                  "snap-42-0badc0de-00001-of-00002.safetensors"):
        assert parse_snapshot_name(other) is None
    raw = encode_footer(1000, 50, 1234)
    assert decode_footer(raw, 1000 + 50 + FOOTER.size) == (1000, 50, 1234)
    with pytest.raises(ValueError, match="does not end"):
        decode_footer(raw, 2000)
    with pytest.raises(ValueError, match="magic"):
        decode_footer(b"X" * FOOTER.size, 1000 + 50 + FOOTER.size)


def test_slot_choice_never_overwrites_the_complete_step() -> None:
    assert pick_slot([None, None], None) == 0
    assert pick_slot([5, None], 5) == 1
    assert pick_slot([5, 6], 6) == 0
    assert pick_slot([5, 6], 5) == 1  # a rank whose peer failed to publish 6 rewrites 6, keeps 5
    assert pick_slot([7, 6], None) == 1


def test_restore_choice_is_the_newest_common_group_not_older_than_durable() -> None:
    a, b, c = SnapshotId(9, "aaaaaaaa"), SnapshotId(10, "aaaaaaaa"), SnapshotId(8, "bbbbbbbb")
    assert choose_snapshot([[a, b], [a, b]], not_older_than=None) == b
    assert choose_snapshot([[a, b], [a]], not_older_than=None) == a  # rank 1 never published 10
    assert choose_snapshot([[a, b], [a, b]], not_older_than=11) is None  # a newer durable step wins
    assert choose_snapshot([[c], [a]], not_older_than=None) is None
    assert choose_snapshot([[a, b], [a, b]], not_older_than=10) == b


def test_node_writers_give_every_node_a_whole_replicated_copy() -> None:
    keys = [ChunkKey(f"w{i}", (0,), (10,)) for i in range(4)]
    replicated = [(k, 40, True) for k in keys]
    sharded = [ChunkKey("s", (r * 5,), (5,)) for r in range(4)]
    ranks = [[*replicated, (sharded[r], 20, False)] for r in range(4)]
    out = node_writers(ranks, ["n0", "n0", "n1", "n1"])
    for node_ranks in ((0, 1), (2, 3)):
        assert sorted(k.fqn for r in node_ranks for k in out[r] if k.fqn != "s") == ["w0", "w1", "w2", "w3"]
    assert all(sharded[r] in out[r] for r in range(4))


def test_room_check_names_sizes_and_fix(shm_dir: str) -> None:
    assert room_for(10, free=1000, total=2000, min_free_bytes=0, min_free_fraction=0.1) is None
    why = room_for(900, free=1000, total=2000, min_free_bytes=0, min_free_fraction=0.1)
    assert why is not None and "--shm-size" in why and "must stay free" in why
    with pytest.raises(ShmSpaceError, match="MiB of host shared memory"):
        check_room(shm_dir, 1 << 50, MemoryTierConfig())


# --------------------------------------------------------------------------- one process
def test_snapshot_restore_round_trip_is_bit_exact_and_reuses_two_slots(shm_dir: str) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir, MemoryTierConfig(every=2))
    try:
        for step in range(1, 8):
            _train(state, step)
            assert tier.snapshot(step, state) == (step % 2 == 0)
        tier.wait()
        # the last complete snapshot and the newest: older ones were overwritten (two slots, reused)
        assert [parse_snapshot_name(n)[0].step for n in _snapshots(shm_dir)] == [4, 6]  # type: ignore[index]
        assert tier.snapshots_published == 3
        # what train_gpt's progress lines report (memory_every, memory_bytes): the interval and both slots
        assert tier.interval == 2
        assert tier.nbytes == sum(os.path.getsize(os.path.join(shm_dir, n)) - _tail_bytes(shm_dir, n) for n in _snapshots(shm_dir))
    finally:
        tier.close()
    fresh = _state(1)
    tier2 = LocalShmTier(shm_dir)
    try:
        report = tier2.restore(fresh, not_older_than=None)
    finally:
        tier2.close()
    assert report is not None and report.source is RestoreSource.MEMORY_LOCAL and report.step == 6
    assert report.bytes > 0 and report.seconds > 0
    assert fresh["meta"] == {"step": 6} and fresh["mine"].value == {"seen": 60}
    # the state at step 6, recomputed from the same seed and steps (the live one went on to step 7)
    ref = _state(0)
    for step in range(1, 7):
        _train(ref, step)
    _assert_equal(_tensors(fresh), _tensors(ref))


def test_a_synchronous_snapshot_is_published_when_snapshot_returns(shm_dir: str) -> None:
    """``synchronous=True``: no snapshot runs behind the next step (a lost node redoes none of it); by default the
    publish is still in flight when ``snapshot`` returns."""
    for synchronous in (True, False):
        state = _state(0)
        tier = LocalShmTier(shm_dir, MemoryTierConfig(synchronous=synchronous))
        try:
            tier.snapshot(1, state)  # plans
            _train(state, 2)
            assert tier.snapshot(2, state)
            assert (tier.inflight.future is None) is synchronous
            if synchronous:
                assert tier.snapshots_published >= 1 and 2 in [parse_snapshot_name(n)[0].step for n in _snapshots(shm_dir)]  # type: ignore[index]
        finally:
            tier.close()


def _tail_bytes(directory: str, name: str) -> int:
    """Bytes of a snapshot file after its safetensors data (manifest and footer)."""
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
        f.seek(-FOOTER.size, os.SEEK_END)
        offset, _, _ = decode_footer(f.read(FOOTER.size), os.path.getsize(path))
    return os.path.getsize(path) - offset


def test_restore_skips_a_snapshot_older_than_the_durable_step(shm_dir: str) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir)
    try:
        _train(state, 1)
        assert tier.snapshot(1, state)
    finally:
        tier.close()
    fresh = _state(1)
    before = _tensors(fresh)
    tier2 = LocalShmTier(shm_dir)
    try:
        assert tier2.restore(fresh, not_older_than=2) is None
    finally:
        tier2.close()
    _assert_equal(_tensors(fresh), before)  # untouched


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_snapshot_is_skipped_like_a_corrupt_step(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir)
    try:
        for step in (1, 2):
            _train(state, step)
            assert tier.snapshot(step, state)
    finally:
        tier.close()
    newest = _snapshots(shm_dir)[-1]
    assert parse_snapshot_name(newest)[0].step == 2  # type: ignore[index]
    # a data byte of step 2 (inside the first tensor, after the safetensors header)
    with open(os.path.join(shm_dir, newest), "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    _flip_byte(os.path.join(shm_dir, newest), 8 + header_len + 3)
    fresh = _state(1)
    tier2 = LocalShmTier(shm_dir)
    try:
        with caplog.at_level(logging.WARNING, logger="checkpoint.memory.shm"):
            report = tier2.restore(fresh, not_older_than=None)
    finally:
        tier2.close()
    assert report is not None and report.step == 1
    assert "step 2" in caplog.text and "checksum mismatch" in caplog.text
    assert [parse_snapshot_name(n)[0].step for n in _snapshots(shm_dir)] == [1]  # type: ignore[index]
    ref = _state(0)
    _train(ref, 1)
    _assert_equal(_tensors(fresh), _tensors(ref))


def test_direct_parts_tile_the_read_on_block_boundaries() -> None:
    from checkpoint.api import ReadRequest
    from checkpoint.shard import direct_parts

    req = ReadRequest(fqn="w", file="f", chunk_lengths=(10_000,), dtype="F32", chunk_byte_range=(100, 40_100),
                      read_range=(100 + 8192, 40_100), src_slices=((2048, 10_000),), dst_slices=(),
                      dst=ChunkKey("w", (2048,), (7952,)), block_crc32=(0,) * 10)
    parts = direct_parts(req, 4096, True, 10_000)
    assert parts[0][0] == 100 + 8192 and parts[-1][1] == 40_100
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, no gap or overlap
    assert all((a - 100) % 4096 == 0 for a, _ in parts)  # each starts on a checksum block: checked on its own
    assert [b - a for a, b in parts[:-1]] == [8192] * (len(parts) - 1)  # whole blocks, at most part_bytes
    assert direct_parts(req, 4096, False, 10_000)[0] == (100 + 8192, 100 + 8192 + 10_000)


def test_a_large_tensor_read_in_parts_by_several_threads_is_exact_and_checked(
    shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    from checkpoint.memory.localrestore import READ_PART_BYTES

    g = torch.Generator().manual_seed(3)
    big = (READ_PART_BYTES * 5 // 4) // 4 + 1234  # fp32 elements: two parts, the second one short
    states = [{"emb": torch.randn(big, generator=g), "z": torch.randn(7, 3, generator=g)} for _ in range(2)]  # "emb" first in the file
    tier = LocalShmTier(shm_dir, MemoryTierConfig(read_threads=3))
    try:
        for step, state in enumerate(states, 1):
            assert tier.snapshot(step, state)
            tier.wait()
    finally:
        tier.close()
    fresh = {k: torch.zeros_like(v) for k, v in states[0].items()}
    tier2 = LocalShmTier(shm_dir, MemoryTierConfig(read_threads=3))
    try:
        report = tier2.restore(fresh, not_older_than=None)
        assert report is not None and report.step == 2
        _assert_equal(fresh, states[1])
        # a byte in the second part of step 2's large tensor: that part's check fails, step 1 is restored
        newest = os.path.join(shm_dir, _snapshots(shm_dir)[-1])
        with open(newest, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        _flip_byte(newest, 8 + header_len + READ_PART_BYTES + 5)
        with caplog.at_level(logging.WARNING, logger="checkpoint.memory.shm"):
            report = tier2.restore(fresh, not_older_than=None)
    finally:
        tier2.close()
    assert report is not None and report.step == 1
    assert "checksum mismatch" in caplog.text and f"block {READ_PART_BYTES >> 20}" in caplog.text
    _assert_equal(fresh, states[0])


def test_snapshot_with_a_damaged_manifest_is_not_a_candidate(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir)
    try:
        _train(state, 1)
        assert tier.snapshot(1, state)
    finally:
        tier.close()
    path = os.path.join(shm_dir, _snapshots(shm_dir)[0])
    _flip_byte(path, os.path.getsize(path) - FOOTER.size - 5)  # inside the JSON manifest
    fresh = _state(1)
    before = _tensors(fresh)
    tier2 = LocalShmTier(shm_dir)
    try:
        with caplog.at_level(logging.WARNING, logger="checkpoint.memory.shm"):
            assert tier2.restore(fresh, not_older_than=None) is None
    finally:
        tier2.close()
    assert "manifest fails its crc32" in caplog.text
    _assert_equal(_tensors(fresh), before)


def _two_snapshots_that_do_not_fit(tier: LocalShmTier, state: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Two training steps, each followed by a snapshot that must be refused; the tier ends up off."""
    try:
        with caplog.at_level(logging.WARNING, logger="checkpoint.memory.shm"):
            for step in (1, 2):
                _train(state, step)
                assert not tier.snapshot(step, state)
    finally:
        tier.close()
    assert not tier.enabled


def test_no_room_skips_with_a_warning_and_turns_the_tier_off(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    state = _state(0)
    # Keep the whole filesystem free: no snapshot fits whatever else uses /dev/shm (a fraction of 0.999999 fitted
    # a small state on an empty /dev/shm, and failed only once other runs had left files there).
    fs = os.statvfs(shm_dir)
    _two_snapshots_that_do_not_fit(LocalShmTier(shm_dir, MemoryTierConfig(min_free_bytes=fs.f_blocks * fs.f_frsize)),
                                   state, caplog)
    assert "must stay free" in caplog.text and "tier off" in caplog.text
    assert os.listdir(shm_dir) == []  # nothing allocated, nothing left


def test_a_shm_too_small_for_the_tier_is_one_error_at_start_naming_the_size(
    shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The size is checked at start (the first snapshot plan), once per node, with the size needed (two snapshots
    of each rank) and the fix: a /dev/shm with room for one snapshot but not two is one error at start, not a tier
    that turns itself off mid-run."""
    from checkpoint.state import flatten

    state = _state(0)
    fs = os.statvfs(shm_dir)
    total = fs.f_blocks * fs.f_frsize
    need = 2 * sum(item.nbytes for item in flatten(state).items)  # one rank: it snapshots everything, twice
    # room for less than two
    _two_snapshots_that_do_not_fit(LocalShmTier(shm_dir, MemoryTierConfig(min_free_bytes=total - need // 2)),
                                   state, caplog)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert f"need {need / 2**20:.1f} MiB ({need} bytes" in errors[0] and "/dev/shm of at least" in errors[0], errors
    assert "--shm-size" in errors[0] and shm_dir in errors[0]
    assert "memory snapshot skipped" not in caplog.text  # one message, not one per check
    assert os.listdir(shm_dir) == []
    fits = size_for(need, total=total, min_free_bytes=total - need, min_free_fraction=0.0)
    assert fits is None and size_for(need + 1, total=total, min_free_bytes=total - need, min_free_fraction=0.0)


@pytest.mark.parametrize("when_busy", ["skip", "wait"])
def test_failing_publishes_are_logged_and_turn_the_tier_off(
    shm_dir: str, when_busy: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state(0)
    tier = LocalShmTier(shm_dir, MemoryTierConfig(when_busy=when_busy))  # type: ignore[arg-type]
    calls = []

    def failing_publish(*args: Any) -> int:
        calls.append(args[1])
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(tier.publisher, "publish", failing_publish)
    try:
        with caplog.at_level(logging.WARNING, logger="checkpoint.memory.shm"):
            for step in range(1, 6):
                _train(state, step)
                tier.snapshot(step, state)
                if tier.inflight.future is not None:  # skip mode: the next snapshot must find this one finished
                    wait_for(tier.inflight.future.done, timeout=10, what="the publish to fail")
                if step == 1:
                    continue
                assert "memory snapshot failed: [Errno 28] No space left" in caplog.text  # read, not overwritten
            assert calls == [1, 2, 3] and not tier.enabled  # three failures in a row, then off at the next vote
    finally:
        tier.close()
    assert "tier turning off: 3 snapshots in a row failed to publish" in caplog.text and "memory tier off" in caplog.text


def test_without_a_keeper_directory_the_tier_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTRUN_MEMORY_DIR", raising=False)
    tier = LocalShmTier()
    try:
        assert isinstance(tier, MemoryTier)
        assert not tier.enabled
        assert not tier.snapshot(1, _state(0))
        assert tier.restore(_state(0), not_older_than=None) is None
    finally:
        tier.close()


# --------------------------------------------------------------------------- 2 -> 1 from memory
def _snapshot_two_ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    state = _state(0)
    tier = LocalShmTier(directory)
    try:
        for step in (1, 2, 3):
            _train(state, step, rank)
            tier.snapshot(step, state)
        tier.wait()
        return {"nbytes": tier.nbytes}
    finally:
        tier.close()


def test_reshard_two_ranks_to_one_from_memory(shm_dir: str, tmp_path: Path) -> None:
    out = run_workers(_snapshot_two_ranks, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=120)
    names = _snapshots(shm_dir)
    assert [parse_snapshot_name(n)[1:] for n in names] == [(0, 2), (1, 2), (0, 2), (1, 2)]  # type: ignore[index]
    # each rank holds about half of the replicated state (the node holds one whole copy)
    assert all(o["nbytes"] > 0 for o in out)
    fresh = _state(1)
    tier = LocalShmTier(shm_dir)
    try:
        report = tier.restore(fresh, not_older_than=None)
    finally:
        tier.close()
    assert report is not None and report.step == 3 and report.source is RestoreSource.MEMORY_LOCAL
    ref = _state(0)
    for step in (1, 2, 3):
        _train(ref, step)
    _assert_equal(_tensors(fresh), _tensors(ref))
    assert fresh["meta"] == {"step": 3}
    assert fresh["mine"].value == {"seen": 30}  # rank_modulo: new rank 0 takes saved rank 0's copy


# --------------------------------------------------------------------------- keeper lifetime
_AGENT = """
import sys, time
from elastic.memory_keeper import Keeper
k = Keeper.create("memtier-test-run", sys.argv[1], process=sys.argv[2] == "1")
open(k.path + "/snap-000000001-0badc0de-00000-of-00001.safetensors", "wb").write(b"x" * 4096)
print(k.path, k.process.pid if k.process else 0, flush=True)
time.sleep(120)
"""


def _fake_agent(root: str, keeper: bool, cwd: str | None = None) -> tuple[subprocess.Popen[str], str, int]:
    # sys.path[0] dropped (-P, which needs Python 3.11): the fake agent itself imports spotrun, not the working
    # directory's modules (as the spotrun script does)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; del sys.path[0]\n" + _AGENT, root, "1" if keeper else "0"],
                            stdout=subprocess.PIPE, text=True, cwd=cwd)
    assert proc.stdout is not None
    path, keeper_pid = proc.stdout.readline().split()
    return proc, path, int(keeper_pid)


def test_keeper_removes_the_directory_at_close(shm_dir: str) -> None:
    keeper = Keeper.create("memtier-test-run", shm_dir)
    try:
        assert keeper.path.startswith(keeper_prefix(shm_dir))
        assert os.path.isfile(os.path.join(keeper.path, OWNER_LOCK))
        Path(keeper.path, "snap-000000001-0badc0de-00000-of-00001.safetensors").write_bytes(b"x")
        assert remove_orphaned_keepers(shm_dir) == 0  # a live agent's directory is never swept
        assert os.path.isdir(keeper.path)
    finally:
        keeper.close()
    assert not os.path.exists(keeper.path)
    assert keeper.process is None


def _sigkill_agent_and_wait_freed(agent: subprocess.Popen[str], path: str, keeper: str = "the keeper") -> None:
    """SIGKILL the fake agent: its keeper (the one it has now) must notice and remove the snapshot directory."""
    agent.send_signal(signal.SIGKILL)
    agent.wait(timeout=30)
    wait_for(lambda: not os.path.exists(path), timeout=30, what=f"{keeper} removing its directory")


def test_keeper_process_frees_the_memory_when_its_agent_is_sigkilled(shm_dir: str) -> None:
    agent, path, keeper_pid = _fake_agent(shm_dir, keeper=True)
    try:
        assert os.path.isdir(path) and keeper_pid > 0
        _sigkill_agent_and_wait_freed(agent, path)
    finally:
        agent.kill()
        agent.wait(timeout=30)
        reap([keeper_pid], timeout=30)


def test_keeper_ignores_the_users_modules_in_the_working_directory(shm_dir: str, tmp_path: Path) -> None:
    # A training repository with its own checkpoint.py and elastic package, where the agent runs: the keeper
    # once started with ``python -m`` imported them and died, so a SIGKILLed agent leaked its snapshots.
    marker = tmp_path / "imported"
    hostile = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nraise SystemExit(1)\n"
    (tmp_path / "checkpoint.py").write_text(hostile)
    (tmp_path / "elastic").mkdir()
    (tmp_path / "elastic" / "__init__.py").write_text(hostile)
    agent, path, keeper_pid = _fake_agent(shm_dir, keeper=True, cwd=str(tmp_path))
    try:
        assert os.path.isdir(path) and keeper_pid > 0
        assert Path(f"/proc/{keeper_pid}/stat").read_text().split(") ")[1][0] != "Z", "the keeper died at start"
        _sigkill_agent_and_wait_freed(agent, path)
        assert not marker.exists(), marker.read_text()
    finally:
        agent.kill()
        agent.wait(timeout=30)
        reap([keeper_pid], timeout=30)


def test_a_keeper_that_dies_at_start_is_logged_as_an_error(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(keeper_module, "keeper_command", lambda path, pid: [sys.executable, "-c", "raise SystemExit(3)"])
    with caplog.at_level(logging.ERROR, logger="elastic.memory_keeper"):
        keeper = Keeper.create("memtier-test-run", shm_dir)
    try:
        assert "exited at start with code 3" in caplog.text and keeper.path in caplog.text
    finally:
        keeper.close()
    assert not os.path.exists(keeper.path)


def _new_keeper(keeper: Keeper, old_pid: int) -> int:
    """Wait until the agent's watch replaced the keeper ``old_pid``; the new keeper's PID."""
    proc = wait_for(lambda: keeper.process if keeper.process is not None and keeper.process.pid != old_pid else None,
                    timeout=30, what=f"a keeper in place of pid {old_pid}")
    return proc.pid


def _keeper_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "elastic.memory_keeper" and r.levelno >= logging.ERROR]


def test_a_keeper_sigkilled_is_replaced_logged_once_and_the_snapshots_stay(
    shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: nothing noticed a dead keeper; a later SIGKILL of the agent left its snapshots in RAM until the
    next agent start on the host. Now the agent's watch logs it once and starts another keeper."""
    caplog.set_level(logging.ERROR, logger="elastic.memory_keeper")
    keeper = Keeper.create("memtier-test-run", shm_dir)
    pids = []
    try:
        assert keeper.process is not None
        snap = Path(keeper.path, "snap-000000001-0badc0de-00000-of-00001.safetensors")
        snap.write_bytes(b"x")
        pids.append(keeper.process.pid)
        os.kill(pids[0], signal.SIGKILL)
        pids.append(_new_keeper(keeper, pids[0]))
        errors = _keeper_errors(caplog)
        assert len(errors) == 1, errors
        assert f"keeper (pid {pids[0]})" in errors[0] and "died" in errors[0] and "snapshots are intact" in errors[0]
        assert snap.read_bytes() == b"x"  # a restore still finds them
        assert Path(f"/proc/{pids[1]}/stat").read_text().split(") ")[1][0] != "Z", "the new keeper is not running"
        assert remove_orphaned_keepers(shm_dir) == 0  # still locked: no sweep takes a live agent's directory
        assert keeper.restarts == 1
    finally:
        keeper.close()
        reap(pids, timeout=30)
    assert not os.path.exists(keeper.path)
    assert len(_keeper_errors(caplog)) == 1  # closing is not a death


def test_a_keeper_that_left_took_the_directory_which_is_made_again(
    shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The keeper's death signal (sent by the kernel when its agent dies; here by hand) makes it remove the
    directory (its duty when the agent dies). Before: the directory stayed gone, the workers' snapshots failed, and every later group of workers turned the tier off on every
    node (one rank without a directory turns it off everywhere). Now the directory is made again: the restore
    of what was lost finds nothing (state untouched: the caller loads the next source), and snapshots resume."""
    caplog.set_level(logging.ERROR, logger="elastic.memory_keeper")
    keeper = Keeper.create("memtier-test-run", shm_dir)
    pids = []
    state = _state(0)
    try:
        assert keeper.process is not None
        tier = LocalShmTier(keeper.path)
        try:
            _train(state, 1)
            assert tier.snapshot(1, state)
            tier.wait()
            pids.append(keeper.process.pid)
            os.kill(pids[0], keeper_module.KEEPER_DEATH_SIGNAL)
            pids.append(_new_keeper(keeper, pids[0]))
            assert os.path.isdir(keeper.path)
            assert set(os.listdir(keeper.path)) - {keeper_module.SEMAPHORES} == {OWNER_LOCK}
            (error,) = _keeper_errors(caplog)
            assert "removed the directory" in error and "durable tier" in error
            assert remove_orphaned_keepers(shm_dir) == 0  # locked again before anything was put in it
            fresh = _state(5)
            before = _tensors(fresh)
            assert tier.restore(fresh, not_older_than=None) is None  # nothing in memory: next source
            _assert_equal(_tensors(fresh), before)  # nothing half-restored
            for step in (2, 3, 4):  # a slot whose file went with the old directory is skipped (a warning) and
                _train(state, step)  # dropped; the others land in the new directory
                tier.snapshot(step, state)
            tier.wait()
            assert f"snap-000000004-{tier.gen}-00000-of-00001.safetensors" in _snapshots(keeper.path)
            again = _state(6)
            report = tier.restore(again, not_older_than=None)
            assert report is not None and report.step == 4 and report.source is RestoreSource.MEMORY_LOCAL
            _assert_equal(_tensors(again), _tensors(state))
        finally:
            tier.close()
    finally:
        keeper.close()
        reap(pids, timeout=30)
    assert not os.path.exists(keeper.path)


def _ignored_signals(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (``SigIgn`` of /proc/PID/status)."""
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_a_keeper_ignores_notice_signals_and_keeps_the_snapshots(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """Slurm signals every process of the step. Before: at the notice the keeper removed the node's snapshots and
    left, and the agent logged ERROR '... died (exit code 0) while its agent lives: starting another'. Now the
    keeper ignores every notice signal; it ends when its agent closes it."""
    caplog.set_level(logging.WARNING, logger="elastic.memory_keeper")
    keeper = Keeper.create("memtier-test-run", shm_dir)
    pid = None
    try:
        assert keeper.process is not None
        pid = keeper.process.pid
        snap = Path(keeper.path, "snap-000000001-0badc0de-00000-of-00001.safetensors")
        snap.write_bytes(b"x")
        assert set(keeper_module.NOTICE_SIGNALS) <= _ignored_signals(pid)  # an ignored signal is dropped at send
        for notice in keeper_module.NOTICE_SIGNALS:
            os.kill(pid, notice)
        assert keeper.process is not None and keeper.process.pid == pid and keeper.process.poll() is None
        assert keeper.restarts == 0 and not _keeper_errors(caplog)
        assert snap.read_bytes() == b"x"
    finally:
        keeper.close()
        if pid is not None:
            reap([pid], timeout=30)
    assert not os.path.exists(keeper.path)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


_NOTICED_AGENT = """
import signal, sys
from elastic.memory_keeper import NOTICE_SIGNALS, Keeper
for notice in NOTICE_SIGNALS:  # a handler, as the real agent has (SIG_IGN would be inherited by the keeper)
    signal.signal(notice, lambda signum, frame: print("notice", signum, flush=True))
k = Keeper.create("memtier-test-run", sys.argv[1])
open(k.path + "/snap-000000001-0badc0de-00000-of-00001.safetensors", "wb").write(b"x" * 4096)
print(k.path, k.process.pid, flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        pid = k.process.pid
        k.close()
        print("closed", pid, k.restarts, flush=True)
    elif line.strip() == "pid":
        print("keeper", k.process.pid if k.process else 0, k.restarts, flush=True)
"""


def _noticed_agent(root: str) -> tuple[subprocess.Popen[str], str, int]:
    """A fake agent in its own session (a Slurm step's process group), with its keeper; stdin takes commands."""
    proc = subprocess.Popen([sys.executable, "-P", "-c", _NOTICED_AGENT, root], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    path, keeper_pid = proc.stdout.readline().split()
    return proc, path, int(keeper_pid)


def _ask(agent: subprocess.Popen[str], command: str) -> list[str]:
    assert agent.stdin is not None and agent.stdout is not None
    agent.stdin.write(command + "\n")
    agent.stdin.flush()
    while True:  # the notices the agent saw come first
        line = agent.stdout.readline().split()
        if not line or line[0] != "notice":
            return line


@pytest.mark.parametrize("end", ["close", "sigkill"])
def test_a_signal_to_the_agents_process_group_leaves_the_keeper_and_snapshots_alone(shm_dir: str, end: str) -> None:
    """Every notice Slurm may send, to the whole process group (``scancel --signal``, ``--signal=TERM@N``): the
    keeper stays (the same process, no restart, no ERROR line), the snapshots stay; then the keeper ends when the
    agent closes it, or when the agent dies."""
    agent, path, keeper_pid = _noticed_agent(shm_dir)
    try:
        snap = Path(path, "snap-000000001-0badc0de-00000-of-00001.safetensors")
        for notice in keeper_module.NOTICE_SIGNALS:
            os.killpg(agent.pid, notice)
        assert _ask(agent, "pid") == ["keeper", str(keeper_pid), "0"]  # the agent got them all, handled
        assert set(keeper_module.NOTICE_SIGNALS) <= _ignored_signals(keeper_pid)
        assert snap.stat().st_size == 4096
        if end == "close":
            assert _ask(agent, "close") == ["closed", str(keeper_pid), "0"]
            assert not os.path.exists(path)
        else:
            _sigkill_agent_and_wait_freed(agent, path)
        reap([keeper_pid], timeout=30)
        keeper_pid = 0
    finally:
        if keeper_pid:  # a failure above: the keeper (if alive) holds the agent's stderr open
            with contextlib.suppress(ProcessLookupError):
                os.kill(keeper_pid, signal.SIGKILL)
        agent.kill()
        _, err = agent.communicate(timeout=30)
        if keeper_pid:
            reap([keeper_pid], timeout=30)
    assert "died" not in err, err  # the agent's watch (no logging set up: the message alone on stderr)


_SEMAPHORE_AGENT = """
import multiprocessing, sys
from elastic.memory_keeper import Keeper
k = Keeper.create("memtier-test-run", sys.argv[1])
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, as torch's worker contexts make
print(k.path, k.process.pid, "sem." + lock._semlock.name.lstrip("/"), flush=True)
for line in sys.stdin:
    k.close()
    print("closed", flush=True)
"""


def _semaphore_agent(root: str) -> tuple[subprocess.Popen[str], str, int, Path]:
    """A fake agent (own session: a node's process group) holding a named semaphore, with its keeper; returns
    the agent, its keeper directory, the keeper's PID and the semaphore's file, once the keeper recorded it."""
    proc = subprocess.Popen([sys.executable, "-P", "-c", _SEMAPHORE_AGENT, root], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    path, keeper_pid, name = proc.stdout.readline().split()
    semaphore = Path("/dev/shm", name)
    assert semaphore.exists()
    listing = Path(path, keeper_module.SEMAPHORES)
    wait_for(lambda: listing.exists() and name in listing.read_text().split(), timeout=10,
             what="the keeper recording the agent's semaphore")
    return proc, path, int(keeper_pid), semaphore


def _end_session(agent: subprocess.Popen[str], pids: list[int]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(timeout=30)
    reap(pids, timeout=30)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="named semaphores live in /dev/shm (Linux)")
def test_a_node_lost_with_its_resource_tracker_leaves_no_semaphore_behind(shm_dir: str) -> None:
    """Agent, workers and multiprocessing's resource tracker SIGKILLed (a node lost whole): before, the agent's
    ``/dev/shm/sem.mp-*`` stayed until reboot. The keeper, which outlives them, unlinks what it recorded."""
    from elastic.chaos.targets import descendants

    agent, path, keeper_pid, semaphore = _semaphore_agent(shm_dir)
    others = [pid for pid in descendants(agent.pid) if pid != keeper_pid]  # the resource tracker
    try:
        assert others, "the semaphore started no resource tracker"
        for pid in [agent.pid, *others]:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not os.path.exists(path) and not semaphore.exists(), timeout=30,
                 what="the keeper removing the directory and the semaphore")
    finally:
        _end_session(agent, [keeper_pid, *others])


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="named semaphores live in /dev/shm (Linux)")
def test_a_node_lost_with_its_keeper_has_its_semaphores_swept_by_the_next_agent(shm_dir: str) -> None:
    from elastic.chaos.targets import descendants

    agent, path, keeper_pid, semaphore = _semaphore_agent(shm_dir)
    others = list(descendants(agent.pid))
    _end_session(agent, others)  # the whole process group: nobody is left to clean up
    assert os.path.isdir(path) and semaphore.exists()
    keeper = Keeper.create("memtier-test-run-2", shm_dir)  # the next agent on the host
    try:
        assert not os.path.exists(path) and not semaphore.exists()
    finally:
        keeper.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="named semaphores live in /dev/shm (Linux)")
def test_closing_the_keeper_leaves_a_live_agents_semaphores_to_the_agent(shm_dir: str) -> None:
    from elastic.chaos.targets import descendants

    agent, path, keeper_pid, semaphore = _semaphore_agent(shm_dir)
    others = [pid for pid in descendants(agent.pid) if pid != keeper_pid]
    try:
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write("close\n")
        agent.stdin.flush()
        assert agent.stdout.readline().split() == ["closed"]
        reap([keeper_pid], timeout=30)
        assert not os.path.exists(path)
        assert semaphore.exists()  # the agent's lock is alive: its finalizer unlinks it
        agent.stdin.close()
        assert agent.wait(timeout=30) == 0
        wait_for(lambda: not semaphore.exists(), timeout=30, what="the agent's own finalizer")
    finally:
        _end_session(agent, [keeper_pid, *others])


def test_a_keeper_that_keeps_dying_is_replaced_a_bounded_number_of_times(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(keeper_module, "KEEPER_RESTARTS", 1)
    caplog.set_level(logging.ERROR, logger="elastic.memory_keeper")
    keeper = Keeper.create("memtier-test-run", shm_dir)
    pids = []
    try:
        assert keeper.process is not None
        pids.append(keeper.process.pid)
        os.kill(pids[0], signal.SIGKILL)
        pids.append(_new_keeper(keeper, pids[0]))
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: keeper.process is None, timeout=30, what="the watch giving up")
        errors = _keeper_errors(caplog)
        assert len(errors) == 2 and "not starting another" in errors[1], errors
        assert os.path.isdir(keeper.path)
    finally:
        keeper.close()
        reap(pids, timeout=30)
    assert not os.path.exists(keeper.path)


def test_a_replaced_keeper_still_frees_the_memory_when_its_agent_is_sigkilled(shm_dir: str) -> None:
    from elastic.chaos.targets import descendants

    agent, path, first = _fake_agent(shm_dir, keeper=True)
    keepers = [first]
    try:
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: next((p for p in descendants(agent.pid) if p != first), None), timeout=30,
                          what="the fake agent's second keeper")
        keepers.append(second)
        wait_for(lambda: b"keeper.py" in Path(f"/proc/{second}/cmdline").read_bytes(), timeout=30,
                 what="the second keeper's exec")
        assert os.path.isdir(path)
        _sigkill_agent_and_wait_freed(agent, path, "the second keeper")
    finally:
        agent.kill()
        agent.wait(timeout=30)
        reap(keepers, timeout=30)


def test_keeper_standalone_names_match_the_package() -> None:
    import checkpoint.memory.api as api

    text = Path(keeper_module.__file__).read_text()
    assert f'MEMORY_KIND, OWNER_LOCK = "{api.MEMORY_KIND}", "{api.OWNER_LOCK}"' in text


def test_orphans_of_dead_agents_are_swept_at_the_next_start(shm_dir: str) -> None:
    agent, path, _ = _fake_agent(shm_dir, keeper=False)  # agent and keeper killed together: nobody cleans up
    try:
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
        assert os.path.isdir(path)
        keeper = Keeper.create("memtier-test-run-2", shm_dir)  # the next agent on the host
        try:
            assert not os.path.exists(path)
            assert os.path.isdir(keeper.path)
        finally:
            keeper.close()
    finally:
        agent.kill()
        agent.wait(timeout=30)


def test_snapshot_files_are_checksummed_safetensors(shm_dir: str) -> None:
    """The shm object is a safetensors shard followed by the manifest: its bytes match their crc32s."""
    state = _state(0)
    tier = LocalShmTier(shm_dir)
    try:
        _train(state, 1)
        assert tier.snapshot(1, state)
    finally:
        tier.close()
    path = os.path.join(shm_dir, _snapshots(shm_dir)[0])
    raw = Path(path).read_bytes()
    offset, length, crc = decode_footer(raw[-FOOTER.size :], len(raw))
    manifest = json.loads(raw[offset : offset + length])
    assert zlib.crc32(raw[offset : offset + length]) == crc
    (name, frec), = manifest["records"]["files"].items()
    assert name == os.path.basename(path) and frec["size"] == offset
    assert zlib.crc32(raw[:offset]) == frec["crc32"]
    from safetensors.torch import load

    tensors = load(raw[:offset])
    assert torch.equal(tensors["model.0.weight"], state["model"][0].weight)


def test_a_vanished_keeper_directory_skips_snapshots_and_restores_nothing(tmp_path: Path) -> None:
    directory = tempfile.mkdtemp(prefix="spotrun-memtier-test-", dir=SHM)
    state = _state(0)
    try:
        tier = LocalShmTier(directory)
        try:
            _train(state, 1)
            assert tier.snapshot(1, state)
            tier.wait()
            shutil.rmtree(directory)  # the keeper removed it (agent exiting) while the worker still runs
            _train(state, 2)
            assert not tier.snapshot(2, state)  # a warning, not a crash
            assert tier.restore(_state(1), not_older_than=None) is None
        finally:
            tier.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert not os.path.exists(directory)
