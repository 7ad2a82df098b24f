"""Memory tier benchmark (``checkpoint.memory``): snapshot overhead per step, and restore speed from local shared
memory vs the durable local tier, side by side in one run.

Run (from the repository root)::

    .venv/bin/python bench/memtier_bench.py --reps 3 --steps 200 --size-mib 512

Measures, each as median [min-max] over ``--reps`` runs (modes interleaved, order alternating per rep):

* overhead: examples/train_ddp.py under spotrun (``--standalone``, ``--nproc-per-node 2``), median step time of
  rank 0 from its progress lines (steps 20 onwards) with ``--memory-snapshot-every 1`` vs without; printed as
  the ratio and the milliseconds added per step;
* snapshot: in one process, a ``--size-mib`` state (16 fp32 tensors): how long ``snapshot`` blocks the caller
  (flatten, vote, copy into the shared-memory slot) and how long the background checksum + publish takes;
* restore: the same state restored from its memory snapshot (``LocalShmTier.restore``, crc32-verified) vs
  ``Checkpointer.load`` from a local-disk checkpoint of it, warm (files in the page cache) and cold (their
  pages dropped with ``posix_fadvise(DONTNEED)`` first), in GB/s and as ratios memory / durable;
* restore from a peer (``--peer``): two gloo processes, each a "node" with its own keeper directory, snapshot a
  replicated ``--size-mib`` state (``PeerShmTier``); then each rep restores it once with both keepers
  (``memory_local``) and once with rank 1 on a replacement node whose keeper is empty (``memory_peer``: every
  byte received from rank 0 over gloo, crc32-verified), beside the link itself (gloo send/recv of the same
  bytes, rank 0 -> rank 1, loopback here). Seconds and GB/s of rank 1, and peer / link.

Prints Markdown tables; the machine's load average is printed with them (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_ddp.py"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def spread(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


# --------------------------------------------------------------------------- overhead (train_ddp under spotrun)
def train_step_seconds(steps: int, every: int, workdir: Path) -> float:
    """Median seconds per step of rank 0 in one spotrun run of train_ddp (``every`` 0: no memory tier)."""
    progress = workdir / f"progress-{every}-{time.monotonic_ns()}.jsonl"
    argv = [sys.executable, "-m", "elastic.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "--hang-timeout", "15",
            "--events-file", str(workdir / "events.jsonl"), str(TRAIN), "--steps", str(steps), "--ckpt-every",
            str(10 * steps), "--log-every", str(10 * steps), "--progress-file", str(progress),
            "--memory-snapshot-every", str(every)]
    env = dict(os.environ, LOGLEVEL="WARNING", PYTHONUNBUFFERED="1")
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    walls = sorted((r["step"], r["t_wall"]) for r in map(json.loads, progress.read_text().splitlines()) if r["rank"] == 0)
    if [s for s, _ in walls] != list(range(1, steps + 1)):
        raise RuntimeError(f"train_ddp (--memory-snapshot-every {every}) failed ({result.returncode}):\n{result.stderr[-3000:]}")
    if result.returncode != 0:
        # Every step ran; a worker stuck tearing down after its last step (seen under heavy load, with and without
        # the memory tier) does not change the step times measured here.
        print(f"note: a run with --memory-snapshot-every {every} exited {result.returncode} after its last step")
    deltas = [b[1] - a[1] for a, b in zip(walls, walls[1:]) if a[0] >= 20]
    return statistics.median(deltas)


def bench_overhead(reps: int, steps: int, workdir: Path) -> None:
    off: list[float] = []
    on: list[float] = []
    for rep in range(reps):
        for every in ((0, 1) if rep % 2 == 0 else (1, 0)):
            (on if every else off).append(train_step_seconds(steps, every, workdir))
    ratios = [a / b for a, b in zip(on, off)]
    added = [(a - b) * 1e3 for a, b in zip(on, off)]
    print("\n### Snapshot overhead per step: examples/train_ddp.py, spotrun 2 workers, gloo CPU\n")
    print("| step time without (ms) | with --memory-snapshot-every 1 (ms) | ratio with / without | added ms/step |")
    print("|---|---|---|---|")
    print(f"| {spread([x * 1e3 for x in off])} | {spread([x * 1e3 for x in on])} | {spread(ratios)} | {spread(added)} |")


# --------------------------------------------------------------------------- snapshot and restore (one process)
def make_state(size_mib: int, n: int = 16) -> dict[str, torch.Tensor]:
    per = size_mib * (1 << 20) // 4 // n
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:02d}.weight": torch.randn(per, generator=g) for i in range(n)}


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def drop_page_cache(directory: str) -> None:
    """Evict the (clean, fsynced) pages of every file under ``directory`` from the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bench_restore(reps: int, size_mib: int, disk_dir: str) -> None:
    from checkpoint import CheckpointConfig, Checkpointer
    from checkpoint.memory import LocalShmTier, MemoryTierConfig

    state = make_state(size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    shm_dir = tempfile.mkdtemp(prefix="spotrun-memtier-bench-", dir=SHM)
    ckpt_dir = tempfile.mkdtemp(prefix="memtier-bench-durable-", dir=disk_dir)
    stalls: list[float] = []
    publishes: list[float] = []
    rates: dict[str, list[float]] = {"memory_local": [], "durable (warm)": [], "durable (cold)": []}
    try:
        tier = LocalShmTier(shm_dir, MemoryTierConfig())
        try:
            for step in range(1, reps + 2):
                tier.snapshot(step, state)
                stall = tier.last_stage_seconds
                publishes.append(timed(tier.wait))
                stalls.append(stall)
            stalls, publishes = stalls[1:], publishes[1:]  # the first one allocates the slot
            with Checkpointer(ckpt_dir, CheckpointConfig(async_mode=False)) as ckpt:
                ckpt.save(1, state)
                for rep in range(reps):
                    order = ["memory_local", "durable (warm)", "durable (cold)"]
                    for mode in order if rep % 2 == 0 else order[::-1]:
                        dst = zeros_like(state)
                        if mode == "memory_local":
                            seconds = timed(functools.partial(tier.restore, dst, not_older_than=None))
                        else:
                            if mode == "durable (cold)":
                                drop_page_cache(ckpt_dir)
                            seconds = timed(functools.partial(ckpt.load, dst))
                        assert all(torch.equal(dst[k], state[k]) for k in state), mode
                        rates[mode].append(nbytes / seconds / 1e9)
        finally:
            tier.close()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    print(f"\n### Snapshot of a {size_mib} MiB state (16 fp32 tensors, one process)\n")
    print("| blocks the caller (s) | copy GB/s | background checksum + publish (s) |")
    print("|---|---|---|")
    print(f"| {spread(stalls)} | {spread([nbytes / s / 1e9 for s in stalls], '{:.2f}')} | {spread(publishes)} |")
    print(f"\n### Restore of the {size_mib} MiB state (crc32 verified), GB/s\n")
    print("| memory_local | durable local (warm) | durable local (cold) | memory / warm | memory / cold |")
    print("|---|---|---|---|---|")
    mem = rates["memory_local"]
    warm = rates["durable (warm)"]
    cold = rates["durable (cold)"]
    print(f"| {spread(mem, '{:.2f}')} | {spread(warm, '{:.2f}')} | {spread(cold, '{:.2f}')} | "
          f"{spread([a / b for a, b in zip(mem, warm)], '{:.2f}')} | {spread([a / b for a, b in zip(mem, cold)], '{:.2f}')} |")


# --------------------------------------------------------------------------- restore from a peer (two processes)
def _peer_worker(rank: int, world: int, dirs: list[str], size_mib: int, reps: int) -> dict[str, list[float]]:
    """Rank ``rank`` of the peer bench (see the module docstring); rank 1's timings are the ones reported."""
    import torch.distributed as dist

    from checkpoint.memory import MemoryTierConfig, PeerShmTier

    state = make_state(size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    tier = PeerShmTier(dirs[rank], MemoryTierConfig(), node=f"node{rank}")
    try:
        tier.snapshot(1, state)
        tier.wait()
    finally:
        tier.close()
    out: dict[str, list[float]] = {"link": [], "memory_local": [], "memory_peer": [], "plan": []}
    wire = torch.empty(nbytes, dtype=torch.uint8)
    for rep in range(reps):
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            dist.send(wire, dst=1)
        else:
            dist.recv(wire, src=0)
        out["link"].append(time.perf_counter() - started)
        for mode in ("memory_local", "memory_peer") if rep % 2 == 0 else ("memory_peer", "memory_local"):
            replaced = mode == "memory_peer" and rank == 1
            restorer = PeerShmTier(dirs[2] if replaced else dirs[rank], node="node1-replacement" if replaced else f"node{rank}")
            try:
                dst = zeros_like(state)
                dist.barrier()
                report = restorer.restore(dst, not_older_than=None)
            finally:
                restorer.close()
            if report is None or report.source.value != mode or not all(torch.equal(dst[k], state[k]) for k in state):
                raise RuntimeError(f"rank {rank}: {mode} restore gave {report}")
            out[mode].append(report.seconds)
            if mode == "memory_peer":
                out["plan"].append(restorer.last_plan_seconds)
    return out


def bench_peer(reps: int, size_mib: int) -> None:
    sys.path.insert(0, str(REPO))
    from tests.harness.dist import run_workers, shutdown

    root = tempfile.mkdtemp(prefix="spotrun-memtier-bench-", dir=SHM)
    dirs = [os.path.join(root, n) for n in ("node0", "node1", "replacement")]
    for d in dirs:
        os.mkdir(d)
    try:
        out = run_workers(_peer_worker, 2, (dirs, size_mib, reps), tmpdir=root, timeout=1200, start_method="spawn")
    finally:
        shutdown()
        shutil.rmtree(root, ignore_errors=True)
    nbytes = size_mib * (1 << 20)
    got = out[1]
    rate = {k: [nbytes / s / 1e9 for s in v] for k, v in got.items() if k != "plan"}
    moving = [nbytes / (s - p) / 1e9 for s, p in zip(got["memory_peer"], got["plan"])]
    print(f"\n### Restore of a {size_mib} MiB replicated state from a peer's memory (2 gloo processes, rank 1), GB/s\n")
    print("| link (gloo send/recv) | memory_local | memory_peer (replacement node) | peer / link | memory_peer "
          "seconds | of which agreeing (s) | peer without agreeing / link |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {spread(rate['link'], '{:.2f}')} | {spread(rate['memory_local'], '{:.2f}')} | "
          f"{spread(rate['memory_peer'], '{:.2f}')} | "
          f"{spread([p / link for p, link in zip(rate['memory_peer'], rate['link'])], '{:.2f}')} | "
          f"{spread(got['memory_peer'])} | {spread(got['plan'])} | "
          f"{spread([m / link for m, link in zip(moving, rate['link'])], '{:.2f}')} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="train_ddp steps per run (overhead part)")
    p.add_argument("--size-mib", type=int, default=512, help="state size of the snapshot/restore parts")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="local disk directory for the durable checkpoint")
    p.add_argument("--skip-overhead", action="store_true", help="leave out the train_ddp runs")
    p.add_argument("--peer", action="store_true", help="also restore from a peer's memory (two processes)")
    p.add_argument("--peer-only", action="store_true", help="only the restore-from-a-peer part")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    if args.peer_only:
        bench_peer(args.reps, args.size_mib)
        return
    if not args.skip_overhead:
        with tempfile.TemporaryDirectory(prefix="memtier-bench-") as workdir:
            bench_overhead(args.reps, args.steps, Path(workdir))
    bench_restore(args.reps, args.size_mib, args.dir)
    if args.peer:
        bench_peer(args.reps, args.size_mib)


if __name__ == "__main__":
    main()
