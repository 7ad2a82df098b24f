"""elastic.data: the global cursor, per-rank shares and weights, the batch sampler, and the shard reducer."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic.data import (
    BatchConfig,
    DataCursor,
    ElasticBatches,
    ElasticDataError,
    accumulation_steps,
    epoch_permutation,
    global_batch_indices,
    loss_scale,
    micro_batch_sizes,
    plan_step,
    rank_bounds,
    rank_shares,
)
from elastic.deterministic import ShardGradReducer, dyadic_blocks, tree_sum


def _resume(batches: ElasticBatches) -> ElasticBatches:
    """What a restart does: a fresh holder restored from the JSON the Checkpointer would store."""
    fresh = ElasticBatches(batches.config)
    fresh.load_state_dict(json.loads(json.dumps(batches.state_dict())))
    return fresh


# --------------------------------------------------------------------------- every sample exactly once
@settings(max_examples=60, deadline=None)
@given(
    dataset_size=st.integers(1, 97),
    global_batch=st.integers(1, 40),
    max_micro=st.one_of(st.none(), st.integers(1, 9)),
    num_shards=st.one_of(st.none(), st.integers(1, 12)),
    segments=st.lists(st.tuples(st.integers(1, 7), st.integers(0, 9)), min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
)
def test_every_sample_of_an_epoch_once_across_world_size_changes(
    dataset_size: int, global_batch: int, max_micro: int | None, num_shards: int | None,
    segments: list[tuple[int, int]], seed: int,
) -> None:
    if num_shards is not None:
        num_shards, max_micro = min(num_shards, global_batch), None
    cfg = BatchConfig(global_batch=global_batch, dataset_size=dataset_size, max_micro_batch=max_micro,
                      seed=seed, num_shards=num_shards)
    batches = ElasticBatches(cfg)
    seen: list[int] = []  # stream order, all ranks' micro-batches of each step
    for world, steps in segments:  # run `steps` steps at `world` ranks, then stop and resume elsewhere
        for _ in range(steps):
            plans = [batches.plan(r, world) for r in range(world)]
            assert len({p.accumulation_steps for p in plans}) == 1 or num_shards is not None
            step_samples = [i for p in plans for m in p.micro_batches for i in m]
            assert [i for p in plans for i in p.indices] == step_samples
            assert len(step_samples) == global_batch
            seen.extend(step_samples)
            batches.advance()
        batches = _resume(batches)
    total = len(seen)
    assert batches.cursor.position(dataset_size) == total
    # The stream is epoch after epoch, each a permutation: complete epochs hold every sample once,
    # the epoch in progress holds no sample twice.
    for start in range(0, total, dataset_size):
        epoch = seen[start : start + dataset_size]
        counts = Counter(epoch)
        assert max(counts.values()) == 1
        if len(epoch) == dataset_size:
            assert sorted(epoch) == list(range(dataset_size))
        assert epoch == epoch_permutation(seed, start // dataset_size, dataset_size)[: len(epoch)].tolist()


# --------------------------------------------------------------------------- shares and weights
def test_shares_are_contiguous_and_differ_by_at_most_one() -> None:
    assert rank_shares(64, 3) == [22, 21, 21]
    assert [rank_bounds(64, 3, r) for r in range(3)] == [(0, 22), (22, 43), (43, 64)]
    assert rank_shares(2, 4) == [1, 1, 0, 0]
    with pytest.raises(ElasticDataError, match="rank 3 is outside world size 3"):
        rank_bounds(64, 3, 3)


def test_accumulation_is_the_same_on_every_rank_and_fits_the_micro_batch() -> None:
    assert accumulation_steps(64, 3, 8) == 3  # largest share 22 -> 3 micro-batches of <= 8
    assert accumulation_steps(64, 1, 16) == 4
    assert accumulation_steps(64, 2, None) == 1
    assert micro_batch_sizes(22, 3) == [8, 7, 7]
    assert micro_batch_sizes(21, 3) == [7, 7, 7]
    plan = plan_step(BatchConfig(global_batch=64, dataset_size=100, max_micro_batch=8), DataCursor(), 0, 3)
    assert [len(m) for m in plan.micro_batches] == [8, 7, 7]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_summed_loss_times_scale_averaged_like_ddp_is_the_global_mean(world: int) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 4, dtype=torch.float64), torch.randn(64, 1, dtype=torch.float64)
    w = torch.randn(4, 1, dtype=torch.float64, requires_grad=True)
    (torch.nn.functional.mse_loss(x @ w, y)).backward()
    expected = w.grad.clone()
    cfg = BatchConfig(global_batch=64, dataset_size=64, max_micro_batch=7)
    grads = []
    for rank in range(world):
        w.grad = None
        plan = plan_step(cfg, DataCursor(), rank, world)
        for micro in plan.micro_batches:
            idx = torch.tensor(micro, dtype=torch.long)  # the first global batch is the whole dataset
            loss = torch.nn.functional.mse_loss(x[idx] @ w, y[idx], reduction="sum")
            (loss * plan.loss_scale).backward()
        grads.append(w.grad.clone())
    ddp_average = sum(grads) / world  # what DDP's all-reduce computes
    torch.testing.assert_close(ddp_average, expected, rtol=1e-12, atol=1e-12)
    assert loss_scale(64, 3) == 3 / 64


def test_a_batch_crossing_the_epoch_end_continues_with_the_next_permutation() -> None:
    cursor = DataCursor(epoch=2, consumed=8, seed=5)
    got = global_batch_indices(cursor, 4, 10).tolist()
    assert got == epoch_permutation(5, 2, 10)[8:].tolist() + epoch_permutation(5, 3, 10)[:2].tolist()
    assert cursor.advanced(4, 10) == DataCursor(epoch=3, consumed=2, seed=5)
    assert epoch_permutation(1, 0, 50).tolist() != epoch_permutation(0, 1, 50).tolist()


# --------------------------------------------------------------------------- bad input
def test_bad_configs_and_cursors_say_what_is_wrong() -> None:
    with pytest.raises(ElasticDataError, match="global_batch must be an int >= 1"):
        BatchConfig(global_batch=0, dataset_size=10)
    with pytest.raises(ElasticDataError, match="num_shards=9 exceeds global_batch=8"):
        BatchConfig(global_batch=8, dataset_size=10, num_shards=9)
    with pytest.raises(ElasticDataError, match="max_micro_batch must be None with num_shards"):
        BatchConfig(global_batch=8, dataset_size=10, num_shards=2, max_micro_batch=2)
    batches = ElasticBatches(BatchConfig(global_batch=8, dataset_size=10, seed=3))
    with pytest.raises(ElasticDataError, match="dataset of 11 samples, this run has 10"):
        batches.load_state_dict({"epoch": 0, "consumed": 0, "seed": 3, "dataset_size": 11})
    with pytest.raises(ElasticDataError, match="seed 4, this run's BatchConfig.seed is 3"):
        batches.load_state_dict({"epoch": 0, "consumed": 0, "seed": 4, "dataset_size": 10})
    with pytest.raises(ElasticDataError, match="lacks one of epoch, consumed, seed"):
        batches.load_state_dict({"epoch": 0, "dataset_size": 10})
    with pytest.raises(ElasticDataError, match="consumed=10 is not inside an epoch of 10"):
        batches.load_state_dict({"epoch": 0, "consumed": 10, "seed": 3})
    with pytest.raises(ElasticDataError, match="gives a rank 2 samples for 3 micro-batches"):
        ElasticBatches(BatchConfig(global_batch=8, dataset_size=10, max_micro_batch=1)).sampler(0, 3)


# --------------------------------------------------------------------------- DataLoader
@pytest.mark.timeout(60)
def test_sampler_with_worker_processes_follows_the_cursor() -> None:
    cfg = BatchConfig(global_batch=12, dataset_size=30, max_micro_batch=4, seed=7)
    ds = TensorDataset(torch.arange(30))
    batches = ElasticBatches(cfg)
    for _ in range(2):  # a resumed job: the cursor is mid-epoch before the loader is created
        batches.advance()
    expected = []
    probe = ElasticBatches(cfg, DataCursor(epoch=0, consumed=24, seed=7))
    for _ in range(3):
        expected.extend(list(m) for m in probe.plan(1, 2).micro_batches)
        probe.advance()
    sampler = batches.sampler(1, 2, steps=3)
    assert len(sampler) == 6
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2)
    got = [b[0].tolist() for b in loader]
    assert got == expected
    assert batches.cursor == DataCursor(epoch=0, consumed=24, seed=7)  # iteration never moves the job's cursor


# --------------------------------------------------------------------------- deterministic shards
def _shard_total(world: int) -> torch.Tensor:
    """Simulate `world` ranks of the reducer in one process: each sums its shards up to its tree nodes, then
    the tree is finished from every rank's nodes (what ``finish`` does after its all_gather)."""
    cfg = BatchConfig(global_batch=30, dataset_size=30, num_shards=6)
    torch.manual_seed(0)
    x, y = torch.randn(30, 5), torch.randn(30, 1)
    known = {}
    for rank in range(world):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        reducer = ShardGradReducer(model.parameters(), num_shards=6, global_batch=30)
        reducer.begin()
        plan = plan_step(cfg, DataCursor(), rank, world)
        for shard, idx in zip(plan.shard_ids, plan.micro_batches):
            ix = torch.tensor(idx)
            reducer.add_shard(shard, nn.functional.mse_loss(model(x[ix]), y[ix], reduction="sum"))
        for node in dyadic_blocks(6, *rank_bounds(6, world, rank)):
            known[node] = tree_sum(6, reducer.leaves, node)
    return tree_sum(6, known) / 30


def test_shard_reducer_is_bit_identical_at_any_world_size() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    cfg = BatchConfig(global_batch=30, dataset_size=30, num_shards=6)
    torch.manual_seed(0)
    x, y = torch.randn(30, 5), torch.randn(30, 1)
    reducer = ShardGradReducer(model.parameters(), num_shards=6, global_batch=30)
    reducer.begin()
    plan = plan_step(cfg, DataCursor(), 0, 1)
    for shard, idx in zip(plan.shard_ids, plan.micro_batches):
        ix = torch.tensor(idx)
        reducer.add_shard(shard, nn.functional.mse_loss(model(x[ix]), y[ix], reduction="sum"))
    loss = reducer.finish()  # the real single-process path
    ref = torch.cat([*(p.grad.reshape(-1) for p in model.parameters()), loss.reshape(1)])
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x), y, reduction="sum") / 30)
    for world in (1, 2, 3, 4, 5, 6, 8):
        assert torch.equal(_shard_total(world), ref), world


@pytest.mark.parametrize("num_shards", [1, 2, 5, 6, 8, 13, 16])
def test_each_rank_sends_few_tree_nodes_that_tile_its_shards(num_shards: int) -> None:
    for world in range(1, 10):
        nodes = [dyadic_blocks(num_shards, *rank_bounds(num_shards, world, r)) for r in range(world)]
        covered = [s for rank_nodes in nodes for first, span in rank_nodes for s in range(first, min(first + span, num_shards))]
        assert covered == list(range(num_shards))
        assert max(len(n) for n in nodes) <= 2 * max(1, num_shards.bit_length())
        if num_shards in (8, 16) and num_shards % world == 0 and world & (world - 1) == 0:
            assert all(len(n) == 1 for n in nodes)  # power-of-two split: one node per rank, like DDP's one buffer


def test_shard_reducer_refuses_a_shard_twice_and_a_missing_shard() -> None:
    model = nn.Linear(2, 1)
    reducer = ShardGradReducer(model.parameters(), num_shards=2, global_batch=4)
    reducer.begin()
    reducer.add_shard(0, model(torch.ones(2, 2)).sum())
    with pytest.raises(ElasticDataError, match="shard 0 was already added"):
        reducer.add_shard(0, model(torch.ones(2, 2)).sum())
    with pytest.raises(ElasticDataError, match=r"must add exactly shards 0..1 this step, got \[0\]"):
        reducer.finish()
    with pytest.raises(ElasticDataError, match="shard 1 has no gradient"):
        tree_sum(2, {(0, 1): torch.zeros(1)})


def _reducer_worker(rank: int, world: int, store: str, out: str) -> None:
    """One rank of a real process group: rank-dependent initial weights (the reducer must broadcast rank 0's)."""
    torch.set_num_threads(1)
    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)
        model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
        if rank == 0:
            torch.manual_seed(1)
            model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
        reducer = ShardGradReducer(model.parameters(), num_shards=8, global_batch=40)
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(40, 5, generator=gen), torch.randn(40, 1, generator=gen)
        plan = plan_step(BatchConfig(global_batch=40, dataset_size=40, num_shards=8), DataCursor(), rank, world)
        reducer.begin()
        for shard, idx in zip(plan.shard_ids, plan.micro_batches):
            ix = torch.tensor(idx)
            reducer.add_shard(shard, nn.functional.mse_loss(model(x[ix]), y[ix], reduction="sum"))
        loss = reducer.finish()
        flat = torch.cat([loss.reshape(1), *(p.grad.reshape(-1) for p in model.parameters())])
        torch.save(flat, f"{out}.{rank}")
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shard_reducer_in_real_process_groups_matches_one_process_bit_for_bit(tmp_path) -> None:
    _reducer_worker(0, 1, "", str(tmp_path / "w1"))  # one process, no process group: the reference
    ref = torch.load(str(tmp_path / "w1.0"))
    out = str(tmp_path / "w3")
    # fork: no interpreter start per rank, and no multiprocessing resource tracker left behind
    torch.multiprocessing.start_processes(
        _reducer_worker, args=(3, str(tmp_path / "store"), out), nprocs=3, start_method="fork"
    )
    for rank in range(3):
        assert torch.equal(torch.load(f"{out}.{rank}"), ref), f"rank {rank} of 3"
