"""A torchrun script that ends with ``dist.destroy_process_group()`` while its DDP module is still alive (the
pattern of examples/quickstart.py without the Checkpointer): the case bench/exit_hang_bench.py counts hangs of."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--preimport", nargs="?", const="all", choices=("all", "dynamo", "rest"),
                        help="import what the warm forkserver preloads first (a cold worker with a warm one's "
                             "modules): all, only torch._dynamo, or all but torch._dynamo")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the imports (an experiment)")
    args = parser.parse_args()
    if args.preimport:
        import importlib

        from elastic.warm import DEFAULT_PRELOAD

        for name in DEFAULT_PRELOAD:
            if args.preimport == "all" or (name == "torch._dynamo") == (args.preimport == "dynamo"):
                importlib.import_module(name)
    if args.gc_freeze:
        import gc

        gc.freeze()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(16, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.steps):
        x = torch.randn(32, 16)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optim.zero_grad()
        loss.backward()
        optim.step()
    if dist.get_rank() == 0:
        print(f"done steps={args.steps}", flush=True)
    dist.destroy_process_group()  # DDP (its Reducer, which holds the process group) is still alive here


if __name__ == "__main__":
    main()
