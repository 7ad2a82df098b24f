"""Multi-rank checkpoint benchmark: resharded loads (4 -> 3, 4 -> 4) and 2-rank replicated saves, each beside DCP.

Run (gloo on CPU, one process per rank; ~1 GiB fp32 in 16 tensors by default)::

    .venv/bin/python bench/ckpt_reshard_bench.py --mode reshard --size-mib 1024 --reps 3
    .venv/bin/python bench/ckpt_reshard_bench.py --mode replicated --ranks 2 --size-mib 1024 --reps 3

(``bench/ckpt_bench.py --reshard`` / ``--ranks 2`` forward here.)

``--mode reshard``: 16 tensors ``[rows, 1024]`` held as DTensors ``Shard(0)`` are saved at world size
``--save-world`` (4) by the spotrun Checkpointer and by ``dcp.save``, then loaded at ``--save-world`` (same
world size) and at ``--load-world`` (3, resharded). Per load: wall time (slowest rank) and, per rank, bytes
read / bytes owned. Bytes are counted by wrapping ``Storage.read_range`` / ``read_into`` (spotrun) and the
streams of DCP's ``FileSystemReader`` in this process only; the library is not changed. Loads hit the page
cache (the files were just written), so they measure CPU and planning cost, not the disk.

``--mode replicated``: a DDP-style state (the same plain tensors on every rank, ``--size-mib`` per rank),
each rank writes about 1/N of it. Per method: stall (save call -> caller may modify the state) and total
(save call -> durable/committed), slowest rank, vs ``dcp.async_save`` (default stager), ``dcp.save`` and a
bare ``copy_`` of the whole state and of the 1/N a rank writes.

Every figure is median [min-max] over ``--reps``; the first rep of each method is a warm-up and not counted.
Timings on a shared machine are noisy: the load average is printed with the tables.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests.harness
from tests.harness.dist import run_workers  # needs the repo root on sys.path first

_COLS = 1024
_N_TENSORS = 16


# --------------------------------------------------------------------------- formatting
def fmt(xs: list[float], unit: str = "s", digits: int = 3) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}] {unit}"


# --------------------------------------------------------------------------- byte counters (bench only)
class ByteCounter:
    """Thread-safe running total (reads run on the loader's thread pool)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total = 0

    def add(self, n: int) -> None:
        with self.lock:
            self.total += n

    def take(self) -> int:
        with self.lock:
            n, self.total = self.total, 0
            return n


SPOT_READ = ByteCounter()
DCP_READ = ByteCounter()


def instrument_spotrun_storage() -> None:
    """Count the bytes spotrun's loader reads, by wrapping Storage's ranged reads in this process."""
    from checkpoint.storage import Storage

    if getattr(Storage, "_bench_counted", False):
        return
    read_range, read_into = Storage.read_range, Storage.read_into

    def counted_range(self: Any, rel: str, start: int, end: int) -> bytes:
        data = read_range(self, rel, start, end)
        SPOT_READ.add(len(data))
        return data

    def counted_into(self: Any, rel: str, start: int, out: memoryview, **kwargs: Any) -> int:
        if not self.is_local:  # the remote path goes through read_range, which counts it
            return read_into(self, rel, start, out, **kwargs)
        n = read_into(self, rel, start, out, **kwargs)
        SPOT_READ.add(n)
        return n

    Storage.read_range = counted_range  # type: ignore[method-assign]  # counts the bytes read, bench only
    Storage.read_into = counted_into  # type: ignore[method-assign]  # counts the bytes read, bench only
    Storage._bench_counted = True  # type: ignore[attr-defined]  # marks the patch as applied


class _CountingStream(io.RawIOBase):
    """A read-only proxy of a binary file that counts the bytes read through it."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def readinto(self, b: Any) -> int:
        n = self.raw.readinto(b)
        DCP_READ.add(n or 0)
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        DCP_READ.add(len(data))
        return data

    def close(self) -> None:
        self.raw.close()
        super().close()


def counting_dcp_reader(path: str) -> Any:
    """A DCP FileSystemReader whose data streams count the bytes read."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class CountingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:  # type: ignore[override]  # @contextmanager wraps it
            with super().create_stream(path, mode) as stream:
                yield _CountingStream(stream) if "r" in mode else stream

    reader = FileSystemReader(path)
    reader.fs = CountingFileSystem()
    return reader


# --------------------------------------------------------------------------- launcher
def run_ranks(fn: Callable[..., Any], world: int, args: tuple, scratch: str, timeout: float) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` freshly spawned gloo processes (the shared harness)."""
    return run_workers(fn, world, args, tmpdir=scratch, timeout=timeout, start_method="spawn")


# --------------------------------------------------------------------------- reshard: sharded state
def _rows(size_mib: int) -> int:
    rows = size_mib * (1 << 20) // 4 // _N_TENSORS // _COLS
    if rows < 12:
        raise SystemExit(f"--size-mib {size_mib} is too small: need >= 1 MiB for {_N_TENSORS} tensors")
    return rows


def make_sharded_state(rows: int, world: int, fill: bool) -> dict[str, Any]:
    """16 DTensors [rows, 1024] Shard(0) over all ranks; ``fill``: value = 1000 * tensor + global row."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, zeros

    from checkpoint._sys.torch_internals import dtensor_local_chunk

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    for i in range(_N_TENSORS):
        t = zeros(rows, _COLS, device_mesh=mesh, placements=[Shard(0)])
        if fill:
            shape, offset = dtensor_local_chunk(t)
            local = t.to_local()
            local.copy_((torch.arange(offset[0], offset[0] + shape[0], dtype=torch.float32) + 1000.0 * i)[:, None])
        state[f"layer{i:02d}.weight"] = t
    return state


def _check_sharded(state: dict[str, Any]) -> None:
    import torch

    from checkpoint._sys.torch_internals import dtensor_local_chunk

    for i, (name, t) in enumerate(state.items()):
        shape, offset = dtensor_local_chunk(t)
        want = (torch.arange(offset[0], offset[0] + shape[0], dtype=torch.float32) + 1000.0 * i)[:, None]
        if not torch.equal(t.to_local(), want.expand(shape[0], _COLS)):
            raise AssertionError(f"{name}: loaded values are wrong on this rank")


def _zero(state: dict[str, Any]) -> None:
    for t in state.values():
        t.to_local().zero_()


def _owned(state: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in state.values())


def _slowest(seconds: float) -> float:
    """Max over ranks of a local duration (the load is done when the last rank is)."""
    import torch
    import torch.distributed as dist

    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def _timed_loads(state: dict[str, Any], root: str, reps: int) -> dict[str, Any]:
    """Per method: slowest-rank load times and this rank's bytes read (last rep), verifying every rep."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from checkpoint import CheckpointConfig, Checkpointer

    instrument_spotrun_storage()
    out: dict[str, Any] = {"owned": _owned(state)}
    dcp_pg = dist.new_group(backend="gloo")  # DCP's collectives never share a group with our timing ones
    methods: dict[str, Callable[[], None]] = {}
    spot = Checkpointer(f"{root}/spot", CheckpointConfig(keep_last=1000))
    spot_off = Checkpointer(f"{root}/spot", CheckpointConfig(keep_last=1000, verify_on_load=False))
    methods["spotrun load (verify on)"] = lambda: spot.load(state, step=1)
    methods["spotrun load (verify off)"] = lambda: spot_off.load(state, step=1)
    methods["dcp.load"] = lambda: dcp.load(state, storage_reader=counting_dcp_reader(f"{root}/dcp"), process_group=dcp_pg)
    counters = {"spotrun load (verify on)": SPOT_READ, "spotrun load (verify off)": SPOT_READ, "dcp.load": DCP_READ}
    try:
        for name, load in methods.items():
            times = []
            for rep in range(reps + 1):
                _zero(state)
                counters[name].take()
                dist.barrier()
                t = time.perf_counter()
                load()
                elapsed = time.perf_counter() - t
                read = counters[name].take()
                _check_sharded(state)
                slowest = _slowest(elapsed)
                if rep:
                    times.append(slowest)
            out[name] = {"times": times, "read": read}
    finally:
        spot.close()
        spot_off.close()
    return out


def reshard_save_worker(rank: int, world: int, root: str, rows: int, reps: int, block: int | None) -> dict[str, Any]:
    """At the save world size: save with both libraries, then time same-world-size loads."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from checkpoint import CheckpointConfig, Checkpointer

    state = make_sharded_state(rows, world, fill=True)
    dcp_pg = dist.new_group(backend="gloo")
    config = CheckpointConfig(keep_last=1000) if block is None else CheckpointConfig(keep_last=1000, checksum_block_bytes=block)
    with Checkpointer(f"{root}/spot", config) as ckpt:
        ckpt.save(1, state)
    dcp.save(state, checkpoint_id=f"{root}/dcp", process_group=dcp_pg)
    dist.barrier()
    return _timed_loads(state, root, reps)


def reshard_load_worker(rank: int, world: int, root: str, rows: int, reps: int) -> dict[str, Any]:
    """At a different world size: time resharded loads (destination starts at zero each rep)."""
    state = make_sharded_state(rows, world, fill=False)
    return _timed_loads(state, root, reps)


def print_load_table(title: str, per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """One Markdown table for one (save world -> load world); returns the worst read/owned per method."""
    print(f"\n**{title}**\n")
    print("| loader | load time (slowest rank) | bytes read / owned, per rank | worst rank |")
    print("|---|---|---|---|")
    worst: dict[str, float] = {}
    for name in (k for k in per_rank[0] if k != "owned"):
        ratios = [r[name]["read"] / r["owned"] for r in per_rank]
        worst[name] = max(ratios)
        cells = ", ".join(f"r{i} {x:.3f}" for i, x in enumerate(ratios))
        print(f"| {name} | {fmt(per_rank[0][name]['times'])} | {cells} | {worst[name]:.3f}x |")
    return worst


def run_reshard(args: argparse.Namespace, scratch: str) -> None:
    from checkpoint import CheckpointConfig

    rows = _rows(args.size_mib)
    root = tempfile.mkdtemp(dir=scratch, prefix="reshard-")
    before = os.getloadavg()
    t0 = time.perf_counter()
    saved = run_ranks(
        reshard_save_worker, args.save_world, (root, rows, args.reps, args.checksum_block_bytes), scratch, args.timeout
    )
    print(f"# saved at world {args.save_world} and loaded {args.save_world}->{args.save_world} "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    loaded = run_ranks(reshard_load_worker, args.load_world, (root, rows, args.reps), scratch, args.timeout)
    after = os.getloadavg()
    shutil.rmtree(root, ignore_errors=True)
    gib = rows * _COLS * 4 * _N_TENSORS / (1 << 30)
    block = args.checksum_block_bytes or f"default ({CheckpointConfig().checksum_block_bytes})"
    print(f"\n{gib:.3f} GiB fp32 in {_N_TENSORS} DTensors [{rows}, {_COLS}] Shard(0), gloo, "
          f"{os.cpu_count()} cores; reps={args.reps}; checksum_block_bytes={block}; "
          f"load average before {before[0]:.2f}, after {after[0]:.2f}; loads from the page cache")
    same = print_load_table(f"same world size: saved at {args.save_world}, loaded at {args.save_world}", saved)
    resh = print_load_table(f"resharded: saved at {args.save_world}, loaded at {args.load_world}", loaded)
    s_t = statistics.median(loaded[0]["spotrun load (verify on)"]["times"])
    d_t = statistics.median(loaded[0]["dcp.load"]["times"])
    s4 = statistics.median(saved[0]["spotrun load (verify on)"]["times"])
    d4 = statistics.median(saved[0]["dcp.load"]["times"])
    print("\nratios vs targets:")
    print(f"- resharded bytes read / owned (worst rank, verify on): {resh['spotrun load (verify on)']:.3f}x "
          f"(target <= 1.1; dcp.load {resh['dcp.load']:.3f}x)")
    print(f"- same-world bytes read / owned (worst rank, verify on): {same['spotrun load (verify on)']:.3f}x")
    print(f"- resharded load time / dcp.load: {s_t / d_t:.2f}; same-world load time / dcp.load: {s4 / d4:.2f}")


# --------------------------------------------------------------------------- replicated: 2-rank DDP-style saves
def replicated_worker(rank: int, world: int, root: str, size_mib: int, reps: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from checkpoint import CheckpointConfig, Checkpointer

    per = size_mib * (1 << 20) // 4 // _N_TENSORS
    g = torch.Generator().manual_seed(0)  # same seed: identical on every rank, like DDP
    state = {f"layer{i:02d}.weight": torch.randn(per, generator=g) for i in range(_N_TENSORS)}
    names = list(state)
    mine = names[rank::world]  # a bare copy of the share this rank writes (the stall's lower bound)
    bufs = {k: torch.empty_like(v) for k, v in state.items()}
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives get their own group
    spot = Checkpointer(f"{root}/spot", CheckpointConfig(keep_last=1000))
    step = [0]

    def bare_all() -> tuple[float, float]:
        t = time.perf_counter()
        for k, v in state.items():
            bufs[k].copy_(v)
        d = time.perf_counter() - t
        return d, d

    def bare_share() -> tuple[float, float]:
        t = time.perf_counter()
        for k in mine:
            bufs[k].copy_(state[k])
        d = time.perf_counter() - t
        return d, d

    def spotrun() -> tuple[float, float]:
        step[0] += 1
        t = time.perf_counter()
        spot.save(step[0], state)
        stall = time.perf_counter() - t
        spot.wait()
        return stall, time.perf_counter() - t

    def dcp_async() -> tuple[float, float]:
        step[0] += 1
        path = f"{root}/dcp-async-{step[0]}"
        t = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=path, process_group=dcp_pg)
        staging = getattr(resp, "staging_completion", None)
        if staging is not None:
            staging.result()
        stall = time.perf_counter() - t
        getattr(resp, "upload_completion", resp).result()
        total = time.perf_counter() - t
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return stall, total

    def dcp_sync() -> tuple[float, float]:
        step[0] += 1
        path = f"{root}/dcp-sync-{step[0]}"
        t = time.perf_counter()
        dcp.save(state, checkpoint_id=path, process_group=dcp_pg)
        d = time.perf_counter() - t
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return d, d

    methods = {
        "bare copy_ of the whole state": bare_all,
        f"bare copy_ of this rank's 1/{world} share": bare_share,
        "spotrun Checkpointer (writer=thread)": spotrun,
        "dcp.async_save (default stager)": dcp_async,
        "dcp.save (sync)": dcp_sync,
    }
    # Arms are interleaved (the order alternates every rep) and every timed save starts after an os.sync()
    # outside the timing: on this VM's disk an fsync's cost depends on how many dirty pages earlier saves
    # left behind, and running the arms one after the other made whichever ran first pay for the rest.
    out: dict[str, list[float]] = {f"{name}|{kind}": [] for name in methods for kind in ("stall", "total")}
    names = list(methods)
    try:
        for rep in range(reps + 1):  # rep 0 warms up every arm (allocations, imports) and is not counted
            for name in names if rep % 2 == 0 else names[::-1]:
                if rank == 0:
                    os.sync()
                dist.barrier()
                stall, total = methods[name]()
                stall, total = _slowest(stall), _slowest(total)
                if rep:
                    out[f"{name}|stall"].append(stall)
                    out[f"{name}|total"].append(total)
        # The stall target compares ~40-70 ms figures: back-to-back pairs give a steadier ratio than the medians.
        out["stall pairs"] = []
        for i in range(16):
            if rank == 0:
                os.sync()
            dist.barrier()
            share, _ = bare_share()
            if rank == 0:
                os.sync()
            dist.barrier()
            stall, _ = spotrun()
            share, stall = _slowest(share), _slowest(stall)
            if i:
                out["stall pairs"].append(stall / share)
    finally:
        spot.close()
    return out


def paired(xs: list[float], ys: list[float]) -> str:
    """Median [min-max] of xs[i] / ys[i]: the two arms of a rep ran next to each other, so the ratio
    cancels most of the drift of the disk between reps."""
    return fmt([x / y for x, y in zip(xs, ys)], "x", 2)


def run_replicated(args: argparse.Namespace, scratch: str) -> None:
    root = tempfile.mkdtemp(dir=scratch, prefix="replicated-")
    before = os.getloadavg()
    res = run_ranks(replicated_worker, args.ranks, (root, args.size_mib, args.reps), scratch, args.timeout)[0]
    after = os.getloadavg()
    shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.size_mib / 1024:.3f} GiB fp32 per rank in {_N_TENSORS} plain tensors (DDP-style, replicated), "
          f"{args.ranks} ranks, gloo, {os.cpu_count()} cores, local disk; reps={args.reps}; slowest rank; "
          f"load average before {before[0]:.2f}, after {after[0]:.2f}\n")
    print("| method | stall (save -> caller may modify) | total (durable / committed) |")
    print("|---|---|---|")
    names = list(dict.fromkeys(k.split("|")[0] for k in res if "|" in k))
    for name in names:
        print(f"| {name} | {fmt(res[name + '|stall'])} | {fmt(res[name + '|total'])} |")
    med = {k: statistics.median(v) for k, v in res.items()}
    share = f"bare copy_ of this rank's 1/{args.ranks} share"
    spot = "spotrun Checkpointer (writer=thread)"
    print("\nratios:")
    print(f"- spotrun stall / bare copy of its share: {med[spot + '|stall'] / med[share + '|stall']:.2f} (ratio of medians); "
          f"paired back to back over {len(res['stall pairs'])} pairs: {fmt(res['stall pairs'], 'x', 2)} (target <= 1.1)")
    print(f"- spotrun stall / bare copy of the whole state: {med[spot + '|stall'] / med['bare copy_ of the whole state|stall']:.2f}")
    print(f"- spotrun stall / dcp.async_save stall: {med[spot + '|stall'] / med['dcp.async_save (default stager)|stall']:.2f}")
    print(f"- spotrun total / dcp.async_save total: {med[spot + '|total'] / med['dcp.async_save (default stager)|total']:.2f}; "
          f"/ dcp.save: {med[spot + '|total'] / med['dcp.save (sync)|total']:.2f} (ratio of medians); per-rep paired "
          f"ratio to dcp.save: {paired(res[spot + '|total'], res['dcp.save (sync)|total'])}")


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["reshard", "replicated", "both"], default="both")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    p.add_argument("--size-mib", type=int, default=1024, help="total sharded state (reshard) / state per rank (replicated)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--save-world", type=int, default=4)
    p.add_argument("--load-world", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="world size of the replicated-save benchmark")
    p.add_argument("--checksum-block-bytes", type=int, default=None,
                   help="spotrun's checksum block size for the reshard save (default: the library default)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the rank processes are killed")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for name in ("size_mib", "reps", "save_world", "load_world", "ranks"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    scratch = args.dir or tempfile.mkdtemp(prefix="ckpt-dist-bench-")
    os.makedirs(scratch, exist_ok=True)
    try:
        if args.mode in ("reshard", "both"):
            run_reshard(args, scratch)
        if args.mode in ("replicated", "both"):
            run_replicated(args, scratch)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
