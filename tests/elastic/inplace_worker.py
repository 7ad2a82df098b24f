"""A small DDP worker for the in-place re-form tests: the same loop with ``elastic.inplace.run`` or without it.

    spotrun --nnodes 1:2 ... tests/elastic/inplace_worker.py --mode wrapped --steps 60 --progress-file P

``--mode wrapped``: the loop runs under ``elastic.inplace.run``; ``plain``: a torchrun script without the wrapper
(every change restarts it); ``fail-release``: wrapped, with an object on the group whose release raises (a
rebuild error: the wrapper falls back to a restart). One progress line per step and rank: rank, world_size,
step, pid, t_wall, iteration (the wrapper's entry). No checkpoint: a restarted worker starts again at step 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic import inplace
from elastic.preemption import Preemption


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.args = args
        self.model = nn.Linear(8, 1)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.step = 0

    def progress(self, rank: int, world: int, iteration: int) -> None:
        line = {"rank": rank, "world_size": world, "step": self.step, "pid": os.getpid(), "t_wall": time.time(),
                "iteration": iteration}
        fd = os.open(self.args.progress_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)


def train(rank: int, world: int, iteration: int, job: Job, ddp: nn.Module, preemption: Preemption) -> None:
    while job.step < job.args.steps:
        gen = torch.Generator().manual_seed(job.step)
        x = torch.randn(4, 8, generator=gen)
        job.optim.zero_grad()
        ddp(x).sum().backward()
        job.optim.step()
        job.step += 1
        job.progress(rank, world, iteration)
        time.sleep(job.args.step_time)
        if preemption.save_and_stop(None, job.step, {}):
            return


def release_fails(obj: object) -> None:
    raise RuntimeError("injected: this object cannot be released")


def generation(gen: inplace.Generation, job: Job) -> None:
    if job.args.mode == "fail-release" and gen.iteration == 0:
        gen.track(object(), release=release_fails)
    ddp = gen.track(DistributedDataParallel(job.model))
    train(gen.rank, gen.world_size, gen.iteration, job, ddp, gen.preemption(sync_every=2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("wrapped", "plain", "fail-release"), default="wrapped")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--progress-file", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    job = Job(args)
    try:
        if args.mode == "plain":
            ddp = DistributedDataParallel(job.model)
            train(dist.get_rank(), dist.get_world_size(), 0, job, ddp, Preemption(sync_every=2))
            del ddp
        else:
            inplace.run(generation, job, config=inplace.InPlaceConfig(pg_timeout=timedelta(seconds=60)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
