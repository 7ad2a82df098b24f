"""Memory tier benchmark (``checkpoint.memory``): snapshot overhead per step, restore speed from local shared
memory vs the durable local tier, from a peer's memory vs the link, and at a changed world size, in one run.

Run (from the repository root; a full run takes ~10 min on a quiet 2-core machine)::

    .venv/bin/python bench/memtier_bench.py --reps 3 --size-mib 256
    .venv/bin/python bench/memtier_bench.py --parts restore,peer --reps 5 --size-mib 256   # restores only

Parts (``--parts``, all by default), each as median [min-max] over ``--reps`` runs (modes interleaved, order
alternating per rep):

* overhead: examples/train_ddp.py under spotrun (``--standalone``, ``--nproc-per-node 2``), median step time of
  rank 0 from its progress lines (steps 20 onwards) with ``--memory-snapshot-every 1`` vs without; printed as
  the ratio and the milliseconds added per step;
* gpt: examples/train_gpt.py under spotrun (2 workers, ``--parallel ddp`` and ``fsdp``, ``--gpt-sizes``: 3M, 12M
  and 25M parameters by default) with ``--memory-snapshot-every auto`` vs without: mean step time of rank 0 after
  the first third of the steps (a snapshot every k steps costs its share), the ratio, the interval the ranks
  chose, how long a snapshot blocked the step (median ``memory_stage_ms`` of rank 0: what ``auto`` weighs), the shared memory the snapshots hold (``memory_bytes`` of the progress lines, both ranks) and the
  workers' peak resident memory with and without the tier;
* restore: in one process, a ``--size-mib`` state (16 fp32 tensors): how long ``snapshot`` blocks the caller
  (flatten, vote, copy into the shared-memory slot) and how long the background checksum + publish takes; the
  same state restored from its memory snapshot (``LocalShmTier.restore``, crc32-verified) vs
  ``Checkpointer.load`` from a local-disk checkpoint of it, warm (files in the page cache) and cold (their
  pages dropped with ``posix_fadvise(DONTNEED)`` first), in GB/s and as ratios memory / durable;
* peer: two gloo processes, each a "node" with its own keeper directory, snapshot a replicated ``--size-mib``
  state (``PeerShmTier``); then each rep restores it once with both keepers (``memory_local``) and once with
  rank 1 on a replacement node whose keeper is empty (``memory_peer``: every byte received from rank 0 over
  gloo, crc32-verified), beside the link itself (gloo send/recv of the same bytes, rank 0 -> rank 1, loopback
  here) and the link as a restore uses it (16 MiB messages, the receiver checking crc32s). Seconds and GB/s of
  rank 1, and peer / link;
* reshard: 4 ranks snapshot a ``--reshard-size-mib`` state on one node (sharded: DTensors Shard(0); replicated:
  plain tensors), then 4 and 3 ranks restore it: GB/s of the bytes all ranks read over the slowest rank's time.

Prints Markdown tables, the command and the machine's load average (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_ddp.py"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pythonpath() -> str:
    """This checkout first on the workers' path (an installed copy of the packages must not be measured)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


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
    env = dict(os.environ, LOGLEVEL="WARNING", PYTHONUNBUFFERED="1", PYTHONPATH=_pythonpath())
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


# --------------------------------------------------------------------------- overhead (train_gpt DDP / FSDP2, auto)
GPT = REPO / "examples" / "train_gpt.py"
GPT_STEPS = "3M=45,12M=30,25M=24,100M=24"
GPT_SIZES = {
    # name: (d_model, layers, heads); ~12 * layers * d_model^2 parameters (the char-level vocab is ~60). Sizes
    # for 2 CPU cores: a step of 100M parameters takes ~7 s there (a full bench would take an hour).
    "3M": (256, 4, 4),
    "12M": (384, 7, 6),
    "25M": (512, 8, 8),
    "100M": (768, 14, 12),  # not in the default sizes: --gpt-sizes 100M --gpt-steps 100M=24 on a larger machine
}
GPT_DEFAULT_SIZES = "3M,12M,25M"
GPT_RUN_TIMEOUT = 600


@dataclass(slots=True)
class GptRun:
    step_seconds: float
    """Mean seconds per step of rank 0 over the measured steps (a snapshot every k steps costs its share)."""
    every: int | None
    """The snapshot interval in use at the last step (None: tier off)."""
    shm_bytes: int
    """Shared memory the ranks' snapshot slots hold at the last step (the node's keeper directory)."""
    rss_bytes: int
    """Peak of the workers' summed resident memory (shared-memory pages they mapped included)."""
    params: int
    """The model's parameters (rank 0's log line), 0 when not found."""
    stage_ms: float | None = None
    """Median milliseconds a snapshot blocked rank 0's step (``memory_stage_ms`` of the measured steps; None: tier off)."""


def _tree_rss(root: int) -> int:
    """Summed resident bytes of ``root``'s descendants (not ``root``: the agent), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - tree
        tree |= frontier
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


def gpt_run(size: str, parallel: str, every: str, steps: int, warmup: int, workdir: Path) -> GptRun:
    """One spotrun run of train_gpt (2 workers); ``every`` "0": no memory tier."""
    d_model, layers, heads = GPT_SIZES[size]
    progress = workdir / f"gpt-{size}-{parallel}-{every}-{time.monotonic_ns()}.jsonl"
    argv = [sys.executable, "-m", "elastic.cli", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "--hang-timeout", "60", "--events-file", str(workdir / "events.jsonl"), str(GPT),
            "--steps", str(steps), "--d-model", str(d_model), "--layers", str(layers), "--heads", str(heads),
            "--context", "32", "--global-batch", "2", "--parallel", parallel, "--log-every", str(10 * steps),
            "--progress-file", str(progress), "--memory-snapshot-every", every]
    env = dict(os.environ, LOGLEVEL="WARNING", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath())
    # its own session: a run past the deadline is killed with its workers (the process group we started)
    log = progress.with_suffix(".log")  # a file, not a pipe: nothing reads while the run is sampled
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    peak = 0
    deadline = time.monotonic() + GPT_RUN_TIMEOUT
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"train_gpt {size} {parallel} (--memory-snapshot-every {every}) ran past "
                                   f"{GPT_RUN_TIMEOUT} s (killed)")
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.25)  # a sampling period, not a wait for an event
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text(errors="replace")
    lines = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
    rank0 = sorted((r for r in lines if r["rank"] == 0), key=lambda r: r["step"])
    if [r["step"] for r in rank0] != list(range(1, steps + 1)):
        raise RuntimeError(f"train_gpt {size} {parallel} (--memory-snapshot-every {every}) failed "
                           f"({proc.returncode}):\n{output[-3000:]}")
    last = {r["rank"]: r for r in lines if r["step"] == steps}
    seconds = (rank0[-1]["t_wall"] - rank0[warmup - 1]["t_wall"]) / (steps - warmup)
    shm = sum(int(r.get("memory_bytes", 0)) for r in last.values())
    interval = rank0[-1].get("memory_every")
    found = re.search(r"params=(\d+)", output)
    stages = [float(r["memory_stage_ms"]) for r in rank0[warmup:] if "memory_stage_ms" in r]
    return GptRun(seconds, None if interval is None else int(interval), shm, peak, int(found.group(1)) if found else 0,
                  statistics.median(stages) if stages else None)


def bench_gpt_overhead(reps: int, sizes: Sequence[str], parallels: Sequence[str], steps: dict[str, int],
                       workdir: Path) -> None:
    print("\n### Snapshot overhead per step: examples/train_gpt.py, spotrun 2 workers (gloo CPU), "
          "--memory-snapshot-every auto vs off\n")
    print("Step time: mean over the steps after the first third (a snapshot every k steps costs its share). "
          "Host memory: the shared memory the snapshot slots hold (both ranks), and the workers' peak resident "
          "memory with / without the tier (mapped snapshot pages included).\n")
    print("| model | parallel | params | step without (ms) | step with auto (ms) | ratio with / without | "
          "interval chosen (steps) | snapshot blocks (ms) | snapshot shm (MB) | worker RSS with / without (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for parallel in parallels:
            n = steps[size]
            warmup = max(2, n // 3)
            runs: dict[str, list[GptRun]] = {"0": [], "auto": []}
            for rep in range(reps):
                for every in (("0", "auto") if rep % 2 == 0 else ("auto", "0")):
                    runs[every].append(gpt_run(size, parallel, every, n, warmup, workdir))
            off, on = runs["0"], runs["auto"]
            ratios = [a.step_seconds / b.step_seconds for a, b in zip(on, off)]
            params = max(r.params for r in off + on)
            print(f"| {size} | {parallel} | {params / 1e6:.1f} M | {spread([r.step_seconds * 1e3 for r in off], '{:.0f}')} | "
                  f"{spread([r.step_seconds * 1e3 for r in on], '{:.0f}')} | {spread(ratios)} | "
                  f"{spread([float(r.every or 0) for r in on], '{:.0f}')} | "
                  f"{spread([r.stage_ms or 0.0 for r in on], '{:.1f}')} | "
                  f"{spread([r.shm_bytes / 1e6 for r in on], '{:.0f}')} | "
                  f"{spread([r.rss_bytes / 1e6 for r in on], '{:.0f}')} / {spread([r.rss_bytes / 1e6 for r in off], '{:.0f}')} |",
                  flush=True)


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
    out: dict[str, list[float]] = {"link": [], "verified": [], "memory_local": [], "memory_peer": [], "plan": []}
    wire = torch.empty(nbytes, dtype=torch.uint8)
    for rep in range(reps):
        for link in ("link", "verified") if rep % 2 == 0 else ("verified", "link"):
            dist.barrier()
            started = time.perf_counter()
            _send_or_receive(rank, wire, verify=link == "verified")
            out[link].append(time.perf_counter() - started)
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


def _send_or_receive(rank: int, wire: torch.Tensor, *, verify: bool) -> None:
    """The link, rank 0 -> rank 1: one gloo send of ``wire``; with ``verify`` the way a peer restore moves bytes
    (``peer.PIECE_BYTES`` messages posted ahead, the receiver checking each piece's crc32 as it completes)."""
    import torch.distributed as dist

    from checkpoint.checksum import crc32
    from checkpoint.memory.peer import PIECE_BYTES

    if not verify:
        (dist.send if rank == 0 else dist.recv)(wire, 1 - rank)
        return
    starts = range(0, wire.numel(), PIECE_BYTES)
    if rank == 0:
        for work in [dist.isend(wire[a : a + PIECE_BYTES], 1) for a in starts]:
            work.wait()
        return
    for a, work in [(a, dist.irecv(wire[a : a + PIECE_BYTES], 0)) for a in starts]:
        work.wait()
        crc32(wire[a : a + PIECE_BYTES].numpy().data)


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
    print("link: one gloo send/recv of the same bytes, rank 0 -> rank 1 (loopback here). link + crc32: the same bytes "
          "moved as a restore moves them (16 MiB messages posted ahead, the receiver checking each piece's crc32), "
          "with nothing else running. memory_peer: rank 1 on a replacement node receives every byte from rank 0 "
          "while rank 0 restores its own copy from its keeper (on one machine both share its cores).\n")
    print("| link (gloo send/recv) | link + crc32 | memory_local | memory_peer (replacement node) | peer / link | "
          "peer / (link + crc32) | memory_peer seconds | of which agreeing (s) | peer without agreeing / link |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {spread(rate['link'], '{:.2f}')} | {spread(rate['verified'], '{:.2f}')} | "
          f"{spread(rate['memory_local'], '{:.2f}')} | {spread(rate['memory_peer'], '{:.2f}')} | "
          f"{spread([p / link for p, link in zip(rate['memory_peer'], rate['link'])], '{:.2f}')} | "
          f"{spread([p / v for p, v in zip(rate['memory_peer'], rate['verified'])], '{:.2f}')} | "
          f"{spread(got['memory_peer'])} | {spread(got['plan'])} | "
          f"{spread([m / link for m, link in zip(moving, rate['link'])], '{:.2f}')} |")


# --------------------------------------------------------------------------- reshard from memory (4 -> 3 ranks)
def _reshard_states(world: int, size_mib: int, fill: bool) -> dict[str, dict[str, Any]]:
    """``sharded``: 16 DTensors Shard(0) over the ranks (FSDP-like; ``bench.ckpt_reshard_bench``'s state);
    ``replicated``: 16 plain tensors, the same on every rank (DDP-like)."""
    from bench.ckpt_reshard_bench import _rows, make_sharded_state

    replicated = make_state(size_mib)
    if not fill:
        replicated = zeros_like(replicated)
    return {"sharded": make_sharded_state(_rows(size_mib), world, fill), "replicated": replicated}


def _reshard_snapshot_worker(rank: int, world: int, dirs: dict[str, str], size_mib: int) -> None:
    from checkpoint.memory import LocalShmTier

    for kind, state in _reshard_states(world, size_mib, fill=True).items():
        tier = LocalShmTier(dirs[kind])
        try:
            if not tier.snapshot(1, state):
                raise RuntimeError(f"rank {rank}: the {kind} snapshot was not taken")
            tier.wait()
        finally:
            tier.close()


def _reshard_restore_worker(rank: int, world: int, dirs: dict[str, str], size_mib: int, rep: int) -> dict[str, Any]:
    """Restore both states from the 4 ranks' snapshots at this world size; per kind: the slowest rank's seconds
    and the bytes all ranks read."""
    import torch.distributed as dist

    from bench.ckpt_reshard_bench import _check_sharded, _slowest
    from checkpoint.memory import LocalShmTier

    states = _reshard_states(world, size_mib, fill=False)
    reference = make_state(size_mib)
    out: dict[str, Any] = {}
    for kind in ("sharded", "replicated") if rep % 2 == 0 else ("replicated", "sharded"):
        tier = LocalShmTier(dirs[kind])
        try:
            dist.barrier()
            started = time.perf_counter()
            report = tier.restore(states[kind], not_older_than=None)
            elapsed = time.perf_counter() - started
        finally:
            tier.close()
        if report is None or report.step != 1:
            raise RuntimeError(f"rank {rank}: the {kind} restore at world size {world} gave {report}")
        if kind == "sharded":
            _check_sharded(states[kind])
        elif not all(torch.equal(states[kind][k], reference[k]) for k in reference):
            raise RuntimeError(f"rank {rank}: the replicated restore at world size {world} is wrong")
        nbytes = torch.tensor([report.bytes], dtype=torch.int64)
        dist.all_reduce(nbytes)
        out[kind] = {"seconds": _slowest(elapsed), "bytes": int(nbytes.item())}
    return out


def bench_reshard(reps: int, size_mib: int) -> None:
    sys.path.insert(0, str(REPO))
    from tests.harness.dist import run_workers, shutdown

    root = tempfile.mkdtemp(prefix="spotrun-memtier-bench-", dir=SHM)
    dirs = {kind: os.path.join(root, kind) for kind in ("sharded", "replicated")}
    for d in dirs.values():
        os.mkdir(d)
    got: dict[int, dict[str, list[dict[str, Any]]]] = {4: {}, 3: {}}
    try:
        run_workers(_reshard_snapshot_worker, 4, (dirs, size_mib), tmpdir=root, timeout=600, start_method="spawn")
        for rep in range(reps):
            for world in (4, 3) if rep % 2 == 0 else (3, 4):
                out = run_workers(_reshard_restore_worker, world, (dirs, size_mib, rep), tmpdir=root, timeout=600,
                                  start_method="spawn")
                for kind, v in out[0].items():
                    got[world].setdefault(kind, []).append(v)
    finally:
        shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n### Restore from memory at a changed world size: a {size_mib} MiB state snapshotted by 4 ranks "
          "(one node), restored by 4 and by 3 (gloo CPU, spawned ranks on this machine)\n")
    print("GB/s: bytes all ranks read (crc32-verified) / seconds of the slowest rank. sharded: 16 DTensors Shard(0) "
          "(each rank reads its new rows, across the old shards' boundaries); replicated: 16 plain tensors (every "
          "rank reads the whole state from the 4 ranks' files).\n")
    print("| state | 4 -> 4 GB/s | 4 -> 4 seconds | 4 -> 3 GB/s | 4 -> 3 seconds | bytes read 4 / 3 (MB) | 4 -> 3 / 4 -> 4 |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("sharded", "replicated"):
        same, changed = got[4][kind], got[3][kind]
        rate = {w: [r["bytes"] / r["seconds"] / 1e9 for r in got[w][kind]] for w in (4, 3)}
        print(f"| {kind} | {spread(rate[4], '{:.2f}')} | {spread([r['seconds'] for r in same])} | "
              f"{spread(rate[3], '{:.2f}')} | {spread([r['seconds'] for r in changed])} | "
              f"{same[0]['bytes'] / 1e6:.0f} / {changed[0]['bytes'] / 1e6:.0f} | "
              f"{spread([a / b for a, b in zip(rate[3], rate[4])], '{:.2f}')} |")


PARTS = ("overhead", "gpt", "restore", "peer", "reshard")


def _gpt_steps(text: str) -> dict[str, int]:
    out = {}
    for item in text.split(","):
        size, _, n = item.partition("=")
        if size not in GPT_SIZES or not n.isdigit() or int(n) < 6:
            raise argparse.ArgumentTypeError(f"{item!r}: use SIZE=STEPS with SIZE in {sorted(GPT_SIZES)}, STEPS >= 6")
        out[size] = int(n)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run, of {','.join(PARTS)} (default: all; see the module docstring)")
    p.add_argument("--steps", type=int, default=200, help="train_ddp steps per run (overhead part)")
    p.add_argument("--size-mib", type=int, default=512, help="state size of the snapshot/restore parts")
    p.add_argument("--reshard-size-mib", type=int, default=256, help="state size of the reshard part")
    p.add_argument("--gpt-sizes", default=GPT_DEFAULT_SIZES, help=f"train_gpt model sizes (gpt part), of {','.join(GPT_SIZES)}")
    p.add_argument("--gpt-parallel", default="ddp,fsdp", help="train_gpt --parallel values (gpt part)")
    p.add_argument("--gpt-steps", type=_gpt_steps, default={},
                   help=f"train_gpt steps per run by size (gpt part; the first third is warm-up), default {GPT_STEPS}")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="local disk directory for the durable checkpoint")
    p.add_argument("--skip-overhead", action="store_true", help="leave out the training runs (overhead and gpt parts)")
    p.add_argument("--peer", action="store_true", help="also restore from a peer's memory (in the default parts already)")
    p.add_argument("--peer-only", action="store_true", help="only the restore-from-a-peer part")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        p.error(f"--parts {args.parts}: unknown part(s) {sorted(parts - set(PARTS))}; use some of {','.join(PARTS)}")
    sizes = args.gpt_sizes.split(",")
    if not set(sizes) <= set(GPT_SIZES) or not set(args.gpt_parallel.split(",")) <= {"ddp", "fsdp"}:
        p.error(f"--gpt-sizes takes some of {','.join(GPT_SIZES)}, --gpt-parallel some of ddp,fsdp")
    if args.peer_only:
        parts = {"peer"}
    if args.skip_overhead:
        parts -= {"overhead", "gpt"}
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("command: " + " ".join([Path(sys.executable).name, "bench/memtier_bench.py", *(argv if argv is not None else sys.argv[1:])]))
    with tempfile.TemporaryDirectory(prefix="memtier-bench-") as workdir:
        if "overhead" in parts:
            bench_overhead(args.reps, args.steps, Path(workdir))
        if "gpt" in parts:
            steps = {**_gpt_steps(GPT_STEPS), **args.gpt_steps}
            bench_gpt_overhead(args.reps, sizes, args.gpt_parallel.split(","), steps, Path(workdir))
    if "restore" in parts:
        bench_restore(args.reps, args.size_mib, args.dir)
    if "peer" in parts:
        bench_peer(args.reps, args.size_mib)
    if "reshard" in parts:
        bench_reshard(args.reps, args.reshard_size_mib)
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
