"""Cost of the deterministic mode: a step with fixed-order shard gradients vs a normal DDP step, same job.

    python bench/deterministic_bench.py                       # 2 ranks, MLP 256 wide, global batch 64, 8 shards
    python bench/deterministic_bench.py --hidden 1024 --shards 16 --steps 20

Both arms run the step functions of ``examples/train_ddp.py`` (``train_step`` + ``global_mean_loss`` with
``DistributedDataParallel``, vs ``deterministic_step`` with ``elastic.deterministic.ShardGradReducer``) on
the same model, data and optimizer, gloo on CPU, one intra-op thread per rank (what torchrun/spotrun give
a multi-worker node, and what the deterministic mode needs). The arms alternate within each round so
load drifts hit both alike. Prints the median step time of each arm and their ratio (deterministic / DDP).
Timings on a loaded machine are not comparable with another run; compare the ratio of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from elastic.data import BatchConfig, ElasticBatches  # noqa: E402 - needs the repo root on sys.path first
from elastic.deterministic import ShardGradReducer  # noqa: E402 - as above

FEATURES = 32


def _model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(FEATURES, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(hidden, 1))


def _micro(x: torch.Tensor, y: torch.Tensor, micro_batches: Any) -> Any:
    for idx in micro_batches:
        ix = torch.tensor(idx, dtype=torch.long)
        yield x[ix], y[ix]


def _run_arm(arm: str, args: argparse.Namespace, rank: int, world: int, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Median seconds per step of one arm (after warm-up)."""
    import train_ddp  # the example's step functions: bench what the example runs

    x, y = data
    model = _model(args.hidden, args.layers)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    shards = args.shards if arm == "deterministic" else None
    batches = ElasticBatches(BatchConfig(global_batch=args.global_batch, dataset_size=len(x), num_shards=shards))
    reducer = None
    if arm == "deterministic":
        reducer = ShardGradReducer(model.parameters(), num_shards=args.shards, global_batch=args.global_batch)
        ddp: nn.Module = model
    else:
        ddp = DistributedDataParallel(model)
    times = []
    cpu = torch.device("cpu")
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        plan = batches.plan(rank, world)
        micro = _micro(x, y, plan.micro_batches)
        optim.zero_grad(set_to_none=True)
        if reducer is None:
            train_ddp.global_mean_loss(train_ddp.train_step(model, ddp, plan, micro, cpu), args.global_batch)
        else:
            train_ddp.deterministic_step(model, reducer, plan, micro, cpu)
        optim.step()
        batches.advance()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, args: argparse.Namespace, store_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=args.world)
    try:
        gen = torch.Generator().manual_seed(1)
        data = (torch.randn(4096, FEATURES, generator=gen), torch.randn(4096, 1, generator=gen))
        results: dict[str, list[float]] = {"ddp": [], "deterministic": []}
        for _ in range(args.rounds):
            for arm in ("ddp", "deterministic"):
                results[arm].append(_run_arm(arm, args, rank, args.world, data))
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (processes on this host)")
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    p.add_argument("--layers", type=int, default=2, help="hidden layers")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--shards", type=int, default=8, help="virtual micro-batches of the deterministic arm")
    p.add_argument("--steps", type=int, default=30, help="timed steps per arm and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two arms")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args, tmp, out), nprocs=args.world, join=True)
        results = json.loads(Path(out).read_text())
    params = sum(q.numel() for q in _model(args.hidden, args.layers).parameters())
    ddp, det = statistics.median(results["ddp"]), statistics.median(results["deterministic"])
    print(f"# deterministic mode vs DDP: {args.world} ranks (gloo, CPU, 1 thread each), {params} parameters, "
          f"global batch {args.global_batch}, {args.shards} shards; load average {os.getloadavg()[0]:.1f}")
    print("| arm | median step (ms) | per round (ms) |")
    print("|---|---|---|")
    for arm, value in (("DDP (loss scaled by world/global batch)", ddp), ("deterministic (shard reducer)", det)):
        key = "ddp" if arm.startswith("DDP") else "deterministic"
        rounds = ", ".join(f"{v * 1e3:.2f}" for v in results[key])
        print(f"| {arm} | {value * 1e3:.2f} | {rounds} |")
    print(f"ratio deterministic / DDP: {det / ddp:.2f}x")


if __name__ == "__main__":
    main()
