"""Quickstart: a torchrun DDP script made fault tolerant (the README's example and the docs' quickstart).

Four additions to a plain DDP loop: the ``Checkpointer`` (async, sharded, loads at any world size), the
``Preemption`` line (on a notice every rank commits the same step and leaves), the loop in a function run by
``elastic.inplace.run`` (when a peer node leaves or is lost, the survivors' processes stay and the function is
entered again with the new group), and launching with ``spotrun``.
Its ``memory=MemoryTierConfig(...)`` option adds the memory tier: under spotrun every step is snapshotted into
host shared memory (``every="auto"``: as often as it costs under 2 % of the step), so a crashed worker or a lost
node resumes from the last completed step instead of the last durable checkpoint (off under torchrun, said once).

Run it (from the repository root):
    # one node, two workers, embedded etcd; run it again and it resumes from the last committed step
    spotrun --standalone --nproc-per-node 2 examples/quickstart.py --ckpt-dir runs/quickstart
    # unchanged under stock torchrun (a SIGTERM to the workers is then the notice)
    torchrun --standalone --nproc-per-node 2 examples/quickstart.py --ckpt-dir runs/quickstart
    # several nodes: 1 to 4, joins and losses handled at the next round
    spotrun --nnodes 1:4 --nproc-per-node 2 --rdzv-endpoint ETCD_HOST:2379 --rdzv-id job1 \\
        examples/quickstart.py --ckpt-dir s3://bucket/job1
Rank 0 prints ``step=N loss=X world_size=W`` at its first step and every 20 steps. On a GPU machine each worker
trains on the GPU of its ``LOCAL_RANK`` with ``nccl``; elsewhere on the CPU with ``gloo`` (the same numbers).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from checkpoint import CheckpointConfig, Checkpointer, MemoryTierConfig
from checkpoint.api import CheckpointError
from elastic import inplace
from elastic.preemption import Preemption  # noqa: F401 - says the script builds a helper (gen.preemption)

_first_step = True


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One SGD step on a synthetic regression batch drawn from (step, rank): the data a real job would load.
    Rank 0 prints the first step of this process and every 20th."""
    global _first_step
    gen = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    # drawn on the CPU, then moved to the model's device: the same batch on every device
    x = torch.randn(32, 16, generator=gen).to(next(model.parameters()).device)
    y = x.sum(dim=1, keepdim=True)
    loss = nn.functional.mse_loss(model(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    if dist.get_rank() == 0 and (_first_step or step % 20 == 0):
        print(f"step={step} loss={loss.item():.5f} world_size={dist.get_world_size()}", flush=True)
    _first_step = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="checkpoint root: a path, file://, s3://, memory://")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ckpt-every", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cpu")
    if torch.cuda.is_available():  # one GPU per worker, by its local rank
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # RANK, WORLD_SIZE... from the launcher
    torch.manual_seed(0)
    model = nn.Linear(16, 1).to(device)          # kept when the group re-forms in place
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    start = inplace.run(train, model, optim, args)  # re-enters train with the new group after a peer's change
    if start > args.steps and dist.get_rank() == 0:  # a finished run started again
        print(f"step {start - 1} of {args.steps}: nothing to do, checkpoints in {args.ckpt_dir}", flush=True)
    dist.destroy_process_group()


def train(gen: inplace.Generation, model: nn.Module, optim: torch.optim.Optimizer, args: argparse.Namespace) -> int:
    """Train with the current group; returns the first step this entry would have trained. What holds the group
    is tracked (``gen.track``): the wrapper releases it before the group is replaced."""
    # --8<-- [start:loop]
    state = {"model": gen.track(DistributedDataParallel(model)), "optim": optim}  # tracked: rebuilt at a re-form
    ckpt = gen.track(Checkpointer(args.ckpt_dir, CheckpointConfig(keep_last=2, memory=MemoryTierConfig(every="auto"))))
    start = gen.resume(lambda: ckpt.load(state)) + 1  # restores at the start and when new workers join
    preemption = gen.preemption()                # collective: every rank builds it
    for step in range(start, args.steps + 1):
        train_step(state["model"], optim, step)
        if preemption.save_and_stop(ckpt, step, state):
            break                                # a notice: `step` is committed on every rank
        if step % args.ckpt_every == 0:
            ckpt.save(step, state)               # blocks only for the host copy
    # --8<-- [end:loop]
    return start


if __name__ == "__main__":
    try:
        main()
    except CheckpointError as exc:  # the location cannot be written, or the last save failed: one line, exit 1
        sys.exit(f"quickstart.py: error: {exc}")
