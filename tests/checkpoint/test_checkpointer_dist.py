"""Two gloo ranks through the real Checkpointer: dedicated groups, balanced writers, rank-0 commit,
all-or-nothing on a rank failure, and a resharded load at world size 1 (this process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint.api import step_dir
from checkpoint.checkpointer import Checkpointer
from checkpoint.storage import Storage
from tests.harness.dist import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def full_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "sharded": torch.randn(10, 6, generator=g),
        "rep_a": torch.randn(300, generator=g),
        "rep_b": torch.randn(40, 5, generator=g),
        "rep_c": torch.arange(77),
    }


def _worker(rank: int, world: int, uri: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import checkpoint.writer as mod
    from checkpoint.api import CheckpointError
    from checkpoint.config import CheckpointConfig

    mesh = init_device_mesh("cpu", (world,))
    vals = full_values()
    state = {
        "sharded": distribute_tensor(vals["sharded"], mesh, [Shard(0)]),
        **{k: v.clone() for k, v in vals.items() if k != "sharded"},
        "meta": {"step": 1},
    }
    out: dict[str, Any] = {}
    with Checkpointer(uri, CheckpointConfig(keep_last=3)) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        out["latest"] = ckpt.latest()
        # a failure on rank 1 only: nobody commits step 2 and every rank sees the error
        real = mod.write_rank_files
        if rank == 1:
            def broken(*a: Any, **k: Any) -> Any:
                raise OSError(28, "No space left on device (injected on rank 1)")

            mod.write_rank_files = broken
        ckpt.save(2, state)
        try:
            ckpt.wait()
            out["error"] = None
        except (CheckpointError, OSError) as exc:
            out["error"] = str(exc)
        mod.write_rank_files = real
        out["latest_after_failure"] = ckpt.latest()
        dist.barrier()
        dst = {
            "sharded": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
            "rep_a": torch.zeros(300),
            "rep_b": torch.zeros(40, 5),
            "rep_c": torch.zeros(77, dtype=torch.int64),
            "meta": {},
        }
        out["loaded"] = ckpt.load(dst)
        out["equal"] = all(
            torch.equal(dst[k].full_tensor() if k == "sharded" else dst[k], vals[k]) for k in vals
        ) and dst["meta"] == {"step": 1}
    return out


def test_two_ranks_save_commit_fail_and_reshard_to_one(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    results = run_workers(_worker, 2, (uri,), tmpdir=str(tmp_path), timeout=90)
    for rank, r in enumerate(results):
        assert r["latest"] == 1, (rank, r)
        assert r["error"] and "No space left on device" in r["error"], (rank, r)
        assert r["latest_after_failure"] == 1 and r["loaded"] == 1 and r["equal"], (rank, r)
    names = sorted(n for n in Storage(uri).listdir(step_dir(1)) if n.endswith(".safetensors"))
    assert names == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    vals = full_values()
    dst = {k: torch.zeros_like(v) for k, v in vals.items()} | {"meta": {}}
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(dst) == 1
        manifest = __import__("checkpoint.discover", fromlist=["x"]).validate_step(ckpt.storage, 1)
    assert manifest.world_size == 2 and len(manifest.tensors["sharded"].chunks) == 2
    for k, v in vals.items():
        assert torch.equal(dst[k], v), k


def _fallback_worker(rank: int, world: int, uri: str) -> dict[str, Any]:
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpoint.api import MANIFEST_FILE

    mesh = init_device_mesh("cpu", (world,))
    step1 = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": distribute_tensor(step1, mesh, [Shard(0)])})
        ckpt.save(2, {"w": distribute_tensor(step1 + 1000, mesh, [Shard(0)])})
        ckpt.wait()
        if rank == 0:  # damage the bytes of step 2 that only rank 1 reads (its row shard)
            root = Path(uri) / step_dir(2)
            chunk = next(c for c in json.loads((root / MANIFEST_FILE).read_text())["tensors"]["w"]["chunks"] if c["offsets"][0])
            path = root / chunk["file"]
            data = bytearray(path.read_bytes())
            data[chunk["byte_range"][0] + 17] ^= 0x08
            path.write_bytes(bytes(data))
        dist.barrier()
        dst = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])}
        loaded = ckpt.load(dst)
        return {"loaded": loaded, "equal": torch.equal(dst["w"].full_tensor(), step1)}


def test_damage_seen_by_one_rank_makes_every_rank_fall_back(tmp_path: Path) -> None:
    """Only rank 1 reads the damaged bytes; the ranks vote, and both load step 1 (not a mix of 1 and 2)."""
    results = run_workers(_fallback_worker, 2, (str(tmp_path / "run"),), tmpdir=str(tmp_path), timeout=90)
    assert [r["loaded"] for r in results] == [1, 1]
    assert all(r["equal"] for r in results)


def _hung_peer_worker(rank: int, world: int, uri: str) -> dict[str, Any]:
    import os
    import time
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpoint.api import CheckpointError
    from checkpoint.config import CheckpointConfig
    from checkpoint.faults import CRASH_AT_ENV

    mesh = init_device_mesh("cpu", (world,))  # sharded: every rank writes a shard of its own
    state = {"w": distribute_tensor(torch.arange(1000, dtype=torch.float32), mesh, [Shard(0)])}
    ckpt = Checkpointer(uri, CheckpointConfig(collective_timeout=timedelta(seconds=3)))
    ckpt.save(1, state)
    ckpt.wait()
    if rank == 1:
        os.environ[CRASH_AT_ENV] = "shard.open:1"  # rank 1's writer hangs before its shard: a frozen peer
        ckpt.save(2, state)
        return {"hung": True}  # this process is killed by the launcher (its writer thread never returns)
    ckpt.save(2, state)
    started = time.monotonic()
    out: dict[str, Any] = {}
    try:
        ckpt.wait()
    except CheckpointError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - started
    try:
        ckpt.save(3, state)
    except CheckpointError as exc:
        out["next_save"] = str(exc)
    from checkpoint.discover import latest_good_step

    out["latest"] = latest_good_step(Storage(uri))  # not a new Checkpointer: its construction is collective
    return out


@pytest.mark.timeout(60)
def test_a_hung_peer_fails_the_save_after_collective_timeout(tmp_path: Path) -> None:
    """Rank 1 freezes mid-save: rank 0 gets a CheckpointError naming the step after collective_timeout (3 s)
    instead of hanging for torch's 30 minutes; step 2 is not committed, step 1 stays the latest, and the
    broken Checkpointer refuses further saves."""
    results = run_workers(_hung_peer_worker, 2, (str(tmp_path / "run"),), tmpdir=str(tmp_path), timeout=40)
    r0 = results[0]
    assert "step 2 not committed" in r0["error"] and "collective_timeout=3s" in r0["error"], r0
    assert 2.5 <= r0["seconds"] < 20, r0
    assert "cannot be used any more" in r0["next_save"], r0
    assert r0["latest"] == 1
