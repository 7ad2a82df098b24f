"""A worker that steps at its own pace (no per-step collective): its own tiny model and optimizer, a sleep of
``--step-time`` per step, ``--slow-factor`` times that on ``--slow-rank``. Each step's completion time goes to
``OUT/rank-R.steps`` (one ``step wall_time`` line), so a test can tell how many steps a rank had done by a time.

    spotrun --standalone --nproc-per-node 3 tests/elastic/pace_worker.py --steps 60 --step-time 0.05 \\
        --slow-rank 2 --slow-factor 2.5 --out /tmp/pace
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from elastic.progress import report_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seconds", type=float, default=None, help="run this long instead of --steps")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    pause = args.step_time * (args.slow_factor if rank == args.slow_rank else 1.0)
    model = torch.nn.Linear(8, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    os.makedirs(args.out, exist_ok=True)
    began = time.monotonic()
    with open(os.path.join(args.out, f"rank-{rank}.steps"), "w", buffering=1) as log:
        step = 0
        while (step < args.steps) if args.seconds is None else (time.monotonic() - began < args.seconds):
            step += 1
            loss = model(torch.ones(4, 8)).sum()
            loss.backward()
            optim.step()  # a beat (spotrun's optimizer hook)
            optim.zero_grad()
            report_step(step)
            log.write(f"{step} {time.time():.6f}\n")
            time.sleep(pause)


if __name__ == "__main__":
    main()
