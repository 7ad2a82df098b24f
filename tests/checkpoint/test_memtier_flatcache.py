"""The memory tier's flatten cache (``checkpoint.memory.flatcache``): reused items alias the live tensors, and every
change that ``state.flatten`` would see (a parameter replaced or given new storage, optimizer state created after
the first snapshot, a param_group added, a scheduled learning rate) is seen; the tier's snapshots are the same
bytes with and without the cache, plain and FSDP2.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.flatcache import FlatCache
from checkpoint.memory.layout import FOOTER, decode_footer, parse_snapshot_name
from checkpoint.memory.shm import LocalShmTier
from checkpoint.state import FlatState, PerRank, flatten, forget_optimizer_state
from tests.harness.dist import run_workers

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@pytest.fixture
def shm_dirs() -> Iterator[tuple[str, str]]:
    paths = tuple(tempfile.mkdtemp(prefix="spotrun-memtier-test-", dir=SHM) for _ in range(2))
    try:
        yield paths  # type: ignore[misc]
    finally:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
    assert not any(os.path.exists(p) for p in paths)


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "meta": {"step": 0}, "mine": PerRank({"seen": 0})}


def _train(state: Mapping[str, Any], step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    state["optim"].zero_grad()
    state["model"](torch.randn(4, 8, generator=gen)).square().sum().backward()
    state["optim"].step()
    if "sched" in state:
        state["sched"].step()
    state["meta"]["step"] = step


def _described(flat: FlatState) -> list[tuple[Any, ...]]:
    return [(i.key, i.global_shape, i.dtype, i.replicated) for i in flat.items]


def _assert_same_flat(cached: FlatState, full: FlatState) -> None:
    """The cached flatten is the uncached one: same items, aliasing the same live bytes, same skeletons."""
    assert _described(cached) == _described(full)
    for a, b in zip(cached.items, full.items, strict=True):
        assert a.tensor.data_ptr() == b.tensor.data_ptr() or a.tensor.numel() == 0, a.key
        assert torch.equal(a.tensor, b.tensor), a.key
    assert cached.objects == full.objects
    assert cached.rank_objects == full.rank_objects and cached.per_rank == full.per_rank


def _item(flat: FlatState, fqn: str) -> torch.Tensor:
    (found,) = [i.tensor for i in flat.items if i.key.fqn == fqn]
    return found


def test_cached_flatten_is_flatten_and_reuses_model_and_optimizer_items() -> None:
    state, cache = _state(), FlatCache()
    for step in range(1, 5):
        _train(state, step)
        _assert_same_flat(cache.flatten(state), flatten(state))
    # the first call flattened the model and the optimizer through DCP; the next three reused both
    assert (cache.misses, cache.hits) == (2, 6)
    # the scheduled lr is read at every call, not cached
    assert cache.flatten(state).objects["optim"]["param_groups"][0]["lr"] == pytest.approx(0.01 * 0.5**4)  # type: ignore[index,call-overload]


def test_a_parameter_given_new_storage_or_replaced_is_captured_with_its_new_value() -> None:
    state, cache = _state(), FlatCache()
    model, optim = state["model"], state["optim"]
    _train(state, 1)
    cache.flatten(state)
    # the same Parameter object, new storage (``p.data = ...``): its id is unchanged, its bytes are not
    fresh = torch.full_like(model[0].weight, 7.0)
    model[0].weight.data = fresh
    flat = cache.flatten(state)
    assert torch.equal(_item(flat, "model.0.weight"), fresh)
    assert _item(flat, "model.0.weight").data_ptr() == fresh.data_ptr()
    _assert_same_flat(flat, flatten(state))
    # a new Parameter object in the model and the optimizer (its state moved along)
    old = model[2].bias
    new = torch.nn.Parameter(torch.full_like(old, -3.0))
    model[2].bias = new
    optim.param_groups[0]["params"] = [new if p is old else p for p in optim.param_groups[0]["params"]]
    optim.state[new] = optim.state.pop(old)
    optim.state[new]["exp_avg"] = torch.full_like(old, 0.25)
    flat = cache.flatten(state)
    assert torch.equal(_item(flat, "model.2.bias"), new.detach())
    assert torch.equal(_item(flat, "optim.state.2.bias.exp_avg"), torch.full_like(old, 0.25))
    _assert_same_flat(flat, flatten(state))
    _train(state, 2)  # and it keeps following the live values
    _assert_same_flat(cache.flatten(state), flatten(state))


def test_adam_state_created_after_the_first_snapshot_is_captured() -> None:
    state, cache = _state(), FlatCache()
    optim = state["optim"]
    first = cache.flatten(state)  # DCP initialises the empty optimizer (zero-lr step): zero moments, step 1
    assert float(_item(first, "optim.state.0.weight.step")) == 1.0
    forget_optimizer_state([optim])  # as a restore that found nothing does; the first real step makes new ones
    _train(state, 1)
    flat = cache.flatten(state)
    exp_avg = optim.state[state["model"][0].weight]["exp_avg"]
    assert _item(flat, "optim.state.0.weight.exp_avg").data_ptr() == exp_avg.data_ptr()
    assert torch.equal(_item(flat, "optim.state.0.weight.exp_avg"), exp_avg) and exp_avg.abs().sum() > 0
    assert float(_item(flat, "optim.state.0.weight.step")) == 1.0
    _assert_same_flat(flat, flatten(state))


def test_an_added_param_group_is_captured() -> None:
    state, cache = _state(), FlatCache()
    model, optim = state["model"], state["optim"]
    _train(state, 1)
    cache.flatten(state)
    model.append(torch.nn.Linear(3, 2))
    optim.add_param_group({"params": list(model[3].parameters()), "lr": 0.5})
    flat = cache.flatten(state)
    assert [g["lr"] for g in flat.objects["optim"]["param_groups"]][1] == 0.5  # type: ignore[index,call-overload]
    _assert_same_flat(flat, flatten(state))
    _train(state, 2)  # the new parameters get Adam state
    flat = cache.flatten(state)
    assert any(i.key.fqn == "optim.state.3.weight.exp_avg" for i in flat.items)
    _assert_same_flat(flat, flatten(state))


class _Uncached:
    """The tier without the cache: what it did before (``state.flatten`` at every snapshot)."""

    def flatten(self, state: Mapping[str, Any]) -> FlatState:
        return flatten(state)

    def clear(self) -> None:
        pass


def _published(directory: str) -> dict[int, bytes]:
    """Per step, the safetensors bytes (header and data) of this directory's published snapshot files."""
    out: dict[int, bytes] = {}
    for name in os.listdir(directory):
        parsed = parse_snapshot_name(name)
        if parsed is None:
            continue
        raw = Path(directory, name).read_bytes()
        offset, _, _ = decode_footer(raw[-FOOTER.size :], len(raw))
        out[parsed[0].step] = raw[:offset]
    return out


def test_snapshots_with_the_cache_are_the_bytes_of_snapshots_without(shm_dirs: tuple[str, str]) -> None:
    state = _state()
    cached = LocalShmTier(shm_dirs[0], MemoryTierConfig(every=1))
    plain = LocalShmTier(shm_dirs[1], MemoryTierConfig(every=1))
    plain.flat_cache = _Uncached()  # type: ignore[assignment]
    try:
        for step in range(1, 6):
            _train(state, step)
            if step == 3:  # a parameter given new storage between snapshots
                state["model"][0].bias.data = torch.arange(33, dtype=torch.float32)
            assert cached.snapshot(step, state) and plain.snapshot(step, state)
            cached.wait()
            plain.wait()
            a, b = _published(shm_dirs[0]), _published(shm_dirs[1])
            assert a[step] == b[step], step
        assert cached.flat_cache.hits > 0
    finally:
        cached.close()
        plain.close()


# --------------------------------------------------------------------------- FSDP2, two gloo processes
def _fsdp_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(net.parameters(), lr=0.01)
    state: dict[str, Any] = {"model": net, "optim": optim, "meta": {"step": 0}}
    cache = FlatCache()
    for step in range(1, 5):
        gen = torch.Generator().manual_seed(step * 10 + rank)
        optim.zero_grad()
        net(torch.randn(4, 6, generator=gen)).square().sum().backward()
        optim.step()
        if step == 3:
            forget_optimizer_state([optim])  # state made again at the next step: new tensors
        _assert_same_flat(cache.flatten(state), flatten(state))
    flat = cache.flatten(state)
    weight = net[0].weight
    assert isinstance(weight, DTensor)
    live = optim.state[weight]["exp_avg"].to_local()
    assert _item(flat, "optim.state.0.weight.exp_avg").data_ptr() == live.data_ptr()
    assert _item(flat, "model.0.weight").data_ptr() == weight.to_local().data_ptr()
    return {"hits": cache.hits, "misses": cache.misses}


def test_fsdp2_cached_flatten_aliases_the_local_shards(tmp_path: Path) -> None:
    out = run_workers(_fsdp_worker, 2, tmpdir=str(tmp_path), timeout=120)
    for r in out:
        # model and optimizer through DCP at the first call, at step 3 (state cleared: forgotten, then empty
        # at the check) and 4 (new state tensors); reused at step 2 and at the last call
        assert r["hits"] > 0 and r["misses"] >= 2


def test_auto_weighs_the_median_of_recent_snapshots_not_one_slow_vote(shm_dirs: tuple[str, str]) -> None:
    """One snapshot slowed by the host (a vote descheduled on a loaded machine) must not set the interval: ``auto``
    takes the median of the last few, leaving out the first ones of a plan (they map the slots)."""
    state = _state()
    tier = LocalShmTier(shm_dirs[0], MemoryTierConfig(every="auto"))
    try:
        for step in range(1, 4):
            _train(state, step)
            tier.snapshot(step, state)
        tier.wait()
        assert len(tier.cadence.stages) == 1  # the first two snapshots of the plan mapped their slots: not sampled
        tier.cadence.intervals = [0.1] * 8  # 100 ms steps; snapshots of 1 ms but one of 500 ms
        tier.cadence.stages = [0.001, 0.001, 0.5, 0.001, 0.001]
        tier.cadence.last_stage_seconds = 0.5
        assert tier.cadence.propose() == 1
        tier.cadence.stages = [0.001, 0.5, 0.5]  # slow as a rule: a longer interval
        assert tier.cadence.propose() == 100  # 0.5 s per snapshot / (2 % of 0.1 s): capped at max_every
    finally:
        tier.close()


def test_an_optimizer_with_state_dict_hooks_is_flattened_through_dcp_every_time() -> None:
    state, cache = _state(), FlatCache()
    seen: list[int] = []
    state["optim"].register_state_dict_post_hook(lambda o, sd: seen.append(1) or sd)
    for step in range(1, 4):
        _train(state, step)
        _assert_same_flat(cache.flatten(state), flatten(state))
    assert len(seen) == 6  # three cached and three plain flattens, each through the optimizer's state_dict
    assert (cache.hits, cache.misses) == (2, 4)  # the model reused; the optimizer never
