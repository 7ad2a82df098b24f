"""A re-form at the same world size with this process at another rank: FSDP2's new shards must match their
placements. torch caches DTensor sharding by specs whose device meshes compare equal across process groups;
``clear_dtensor_caches`` (called by every in-place rebuild) empties them. Two real processes, gloo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elastic.worker.reform import clear_dtensor_caches

pytestmark = pytest.mark.timeout(120)


def _generation(rank: int, store: Path, clear: bool) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if clear:
        clear_dtensor_caches()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = nn.Sequential(nn.Embedding(29, 8), nn.Linear(8, 29))  # 29 rows: uneven shards, 15 and 14
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        weight = model[0].weight
        (coordinate,) = weight.device_mesh.get_coordinate()
        return int(weight.to_local().shape[0]), (15, 14)[coordinate]
    finally:
        dist.destroy_process_group()


def _worker(index: int, root: str, clear: bool, results: dict) -> None:
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    seen = [_generation(index, Path(root) / "g0", clear), _generation(1 - index, Path(root) / "g1", clear)]
    results[index] = seen


def test_fsdp2_shards_match_their_mesh_after_a_rank_swap(tmp_path: Path) -> None:
    """Without the clear, torch 2.13 gives the second generation's parameters the first mesh (local 15 rows
    where the coordinate says 14, and the other way round)."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path), True, results), nprocs=2)
        seen = dict(results)
    assert all(local == expected for runs in seen.values() for local, expected in runs), \
        f"(local rows, rows its placements give) per generation: {seen}"
