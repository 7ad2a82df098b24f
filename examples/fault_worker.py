"""Fault-injection worker for spotrun/torchrun tests and benchmarks.

Each step does a gloo all-reduce (so a dead peer breaks the collective, as in real DDP), sleeps
``--step-time`` and appends one JSON line to ``<out>/progress.jsonl``:
``{"rank", "world_size", "group_rank", "step", "restart", "pid", "t_mono", "t_wall"}``.
At ``--fail-at-step`` the ranks in ``--fail-ranks`` inject the chosen fault, only on the restart counts in
``--fail-restarts`` (default: every attempt), so a test decides exactly how often a failure happens.

Run it:
    python examples/fault_worker.py --steps 5                                   # single process, no fault
    spotrun --standalone --nproc-per-node 2 examples/fault_worker.py --steps 20 --fail-at-step 5 \\
        --raise "boom" --fail-restarts 0 --out /tmp/fw                           # fails once, then succeeds
    spotrun --nnodes 1:2 --rdzv-endpoint HOST:2379 --rdzv-id job1 examples/fault_worker.py --steps 100000
Faults: --exit-code N, --raise MESSAGE (recorded in the error file), --segfault, --hang (optionally
--ignore-sigterm), --sigkill-self.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fault-injection worker")
    p.add_argument("--steps", type=int, default=10, help="steps to run (0: forever)")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds of sleep per step")
    p.add_argument("--out", default=None, help="directory for progress.jsonl")
    p.add_argument("--fail-at-step", type=int, default=None, help="step at which to inject the fault")
    p.add_argument("--fail-ranks", default="0", help="comma-separated global ranks that fail ('all' for every rank)")
    p.add_argument("--fail-restarts", default="all", help="TORCHELASTIC_RESTART_COUNT values on which to fail")
    p.add_argument("--exit-code", type=int, default=None, help="exit with this code")
    p.add_argument("--raise", dest="raise_msg", default=None, help="raise RuntimeError(MESSAGE)")
    p.add_argument("--segfault", action="store_true", help="dereference a NULL pointer")
    p.add_argument("--hang", action="store_true", help="stop making progress forever")
    p.add_argument("--ignore-sigterm", action="store_true", help="every rank ignores SIGTERM from the start (stuck workers)")
    p.add_argument("--exit-0-on-sigterm", action="store_true",
                   help="a hand-written SIGTERM handler: finish the current step and exit 0")
    p.add_argument("--sigkill-self", action="store_true", help="SIGKILL this worker")
    p.add_argument("--no-collective", action="store_true", help="do not init a process group")
    return p.parse_args(argv)


def _selected(spec: str, value: int) -> bool:
    return spec == "all" or value in {int(x) for x in spec.split(",") if x.strip()}


def inject(args: argparse.Namespace) -> None:
    if args.segfault:
        ctypes.string_at(0)
    if args.sigkill_self:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.hang:
        while True:
            time.sleep(3600)
    if args.raise_msg is not None:
        raise RuntimeError(args.raise_msg)
    sys.exit(args.exit_code if args.exit_code is not None else 1)


def progress(out: str | None, record_: dict) -> None:
    if not out:
        return
    line = (json.dumps(record_) + "\n").encode()
    fd = os.open(os.path.join(out, "progress.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop = []
    if args.exit_0_on_sigterm:
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    collective = not args.no_collective and "MASTER_ADDR" in os.environ
    if collective:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    step = 0
    while (args.steps == 0 or step < args.steps) and not stop:
        if args.fail_at_step == step and _selected(args.fail_ranks, rank) and _selected(args.fail_restarts, restart):
            inject(args)
        if collective:
            t = torch.ones(1)
            dist.all_reduce(t)
            if int(t.item()) != world:
                raise RuntimeError(f"all_reduce gave {t.item()}, expected world size {world}")
        time.sleep(args.step_time)
        step += 1
        progress(args.out, {
            "rank": rank, "world_size": world, "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            "step": step, "restart": restart, "pid": os.getpid(),
            "t_mono": time.monotonic(), "t_wall": time.time(),
        })
    if collective:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
