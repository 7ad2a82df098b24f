"""Checkpoint benchmark: spotrun's Checkpointer vs DCP async_save, a bare copy and safetensors + fsync.

Run (1 rank, local disk; ~1 GiB fp32 in 16 tensors by default)::

    .venv/bin/python bench/ckpt_bench.py --dir /tmp/ckpt-bench --size-mib 1024 --reps 3

Measures, each as median [min-max] over ``--reps`` runs:

* stall: time the training thread is blocked (save call -> state safe to modify);
* interference: slowdown of a single-threaded matmul loop running while the save writes
  (mean iteration time during the save / alone);
* total: save call -> durable on disk (committed);
* load: GB/s into preallocated tensors (from the page cache: the files were just written);
* host RSS growth over 10 consecutive saves.

Multi-rank parts (gloo, one process per rank; see ``bench/ckpt_reshard_bench.py``), in the same run::

    .venv/bin/python bench/ckpt_bench.py --dir /tmp/ckpt-bench --size-mib 1024 --reps 3 --reshard --ranks 2

* ``--reshard``: the state as 16 DTensors ``Shard(0)`` saved at world size 4, loaded at 4 and at 3: load
  time and bytes read / owned per rank, spotrun vs ``dcp.load`` (target: resharded reads <= 1.1x owned);
* ``--ranks 2``: a DDP-style replicated state (``--size-mib`` per rank), each rank writes ~1/2: stall and
  total save time, spotrun vs ``dcp.async_save`` (default stager), ``dcp.save`` and a bare copy.

``--skip-single`` leaves out the 1-rank tables.

A small checkpoint's load in fresh processes (``examples/train_gpt.py``'s state at its small size, spotrun vs
the example's ``dcp.load`` anchor; see ``bench/ckpt_small_load.py``)::

    .venv/bin/python bench/ckpt_bench.py --scenario small-load --reps 15

Prints Markdown tables. Timings on a shared machine are noisy: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_state(size_mib: int, n: int = 16) -> dict[str, torch.Tensor]:
    per = size_mib * (1 << 20) // 4 // n
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:02d}.weight": torch.randn(per, generator=g) for i in range(n)}


def fmt(xs: list[float], unit: str = "s", scale: float = 1.0) -> str:
    if not xs:
        return "n/a"
    xs = [x * scale for x in xs]
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}] {unit}"


class ComputeLoop:
    """A single-threaded matmul loop standing in for the training step."""

    def __init__(self) -> None:
        self.a = torch.randn(384, 384)
        self.b = torch.randn(384, 384)

    def iteration(self) -> float:
        t = time.perf_counter()
        for _ in range(4):
            self.a = torch.mm(self.a, self.b).tanh_()
        return time.perf_counter() - t

    def baseline(self, seconds: float = 1.5) -> float:
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            times.append(self.iteration())
        return statistics.median(times)

    def during(self, done: Callable[[], bool]) -> float | None:
        times = []
        while not done():
            times.append(self.iteration())
        return statistics.median(times) if len(times) >= 3 else None


# --------------------------------------------------------------------------- methods
class Method:
    name = ""

    def start(self, step: int, state: dict[str, torch.Tensor], root: str) -> None: ...
    def staged(self) -> None: ...
    def finish(self) -> None: ...
    def is_done(self) -> bool:
        return True

    def close(self) -> None: ...


class BareCopy(Method):
    name = "bare copy_ (lower bound of stall)"

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.bufs = {k: torch.empty_like(v) for k, v in state.items()}

    def start(self, step, state, root):
        for k, v in state.items():
            self.bufs[k].copy_(v)


class Spotrun(Method):
    def __init__(self, writer: str = "thread") -> None:
        self.writer = writer
        self.name = f"spotrun Checkpointer (writer={writer})"
        self.ckpt: Any = None
        self.root: str | None = None

    def start(self, step, state, root):
        from checkpoint import CheckpointConfig, Checkpointer

        if self.root != root:
            if self.ckpt is not None:
                self.ckpt.close()
            self.ckpt = Checkpointer(root, CheckpointConfig(keep_last=1000, writer=self.writer))
            self.root = root
        self.ckpt.save(step, state)

    def finish(self):
        self.ckpt.wait()

    def is_done(self):
        return not self.ckpt._saves.busy

    def close(self):
        if self.ckpt is not None:
            self.ckpt.close()


class DcpAsync(Method):
    def __init__(self, kept_stager: bool) -> None:
        self.kept = kept_stager
        self.name = "dcp.async_save (kept DefaultStager(StagingOptions()))" if kept_stager else "dcp.async_save (default stager)"
        self.stager: Any = None
        self.resp: Any = None
        if kept_stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            try:
                self.stager = DefaultStager(StagingOptions())
            except Exception as exc:  # noqa: BLE001 - CPU-only builds may refuse pinned memory
                print(f"# DefaultStager(StagingOptions()) unavailable here ({exc}); "
                      "using StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)")
                self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False))

    def start(self, step, state, root):
        import torch.distributed.checkpoint as dcp

        self.resp = dcp.async_save(
            state, checkpoint_id=os.path.join(root, f"step-{step}"), async_stager=self.stager, no_dist=True
        )

    def staged(self):
        sc = getattr(self.resp, "staging_completion", None)
        if sc is not None:
            sc.result()

    def _upload(self):
        return getattr(self.resp, "upload_completion", self.resp)

    def finish(self):
        self._upload().result()

    def is_done(self):
        return self._upload().done()

    def close(self):
        if self.stager is not None:
            self.stager.close()


class SafetensorsSync(Method):
    name = "safetensors.save_file + fsync (sync)"

    def start(self, step, state, root):
        from safetensors.torch import save_file

        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, f"step-{step}.safetensors")
        save_file(state, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- measurements
def _prune(root: str, keep_step: int) -> None:
    """Delete every step directory but the newest (outside the timed region; keeps the disk small)."""
    for name in os.listdir(root):
        if name.startswith("step-") and name.split(".")[0] not in (f"step-{keep_step}", f"step-{keep_step:09d}"):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


def timed_save(method: Method, step: int, state, root: str) -> tuple[float, float]:
    """One save after an ``os.sync()`` (outside the timing): (stall, total); older steps pruned afterwards."""
    os.sync()
    t0 = time.perf_counter()
    method.start(step, state, root)
    method.staged()
    stall = time.perf_counter() - t0
    method.finish()
    total = time.perf_counter() - t0
    _prune(root, step)
    return stall, total


def measure_saves(methods: list[Method], state, base: str, reps: int, loop: ComputeLoop) -> dict[str, dict[str, list[float]]]:
    """Per rep, every method once alone (stall, total), then every async one with the loop running
    (interference). The arms are interleaved (order alternating every rep) and each timed save starts
    after an ``os.sync()`` outside the timing: on this VM's disk an fsync's cost depends on the dirty pages
    earlier saves left behind, and running arms back to back made the first one pay for the others."""
    out = {m.name: {"stall": [], "total": [], "interference": []} for m in methods}
    roots = {m.name: tempfile.mkdtemp(dir=base) for m in methods}
    step = 0
    for rep in range(reps + 1):  # rep 0 warms up (allocations, imports); buffers are reused after it
        for method in methods if rep % 2 == 0 else methods[::-1]:
            stall, total = timed_save(method, step, state, roots[method.name])
            step += 1
            if rep:
                out[method.name]["stall"].append(stall)
                out[method.name]["total"].append(total)
        for method in methods:
            if isinstance(method, (BareCopy, SafetensorsSync)):
                continue  # blocking: nothing runs beside it
            root = roots[method.name]
            os.sync()
            baseline = loop.baseline(0.7)  # right before the save: the machine's load drifts
            method.start(step, state, root)
            method.staged()
            during = loop.during(method.is_done)
            method.finish()
            _prune(root, step)
            step += 1
            if rep and during is not None:
                out[method.name]["interference"].append(during / baseline)
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    return out


def measure_stall_pairs(bare: BareCopy, spot: Method, state, base: str, pairs: int) -> list[float]:
    """Stall of ``spot`` / bare copy, measured back to back ``pairs`` times (plus a warm-up pair): a ratio
    of ~70 ms figures needs more samples than the table's reps to rise above memory-bandwidth noise."""
    root = tempfile.mkdtemp(dir=base)
    ratios = []
    for i in range(pairs + 1):
        b, _ = timed_save(bare, i, state, root)
        s, _ = timed_save(spot, i, state, root)
        if i:
            ratios.append(s / b)
    shutil.rmtree(root, ignore_errors=True)
    return ratios


def measure_rss(method: Method, state, base: str, saves: int = 10) -> float:
    root = tempfile.mkdtemp(dir=base)
    samples = []
    for step in range(saves):
        method.start(step, state, root)
        method.staged()
        method.finish()
        samples.append(rss_mib())
        _prune(root, step)
    shutil.rmtree(root, ignore_errors=True)
    return max(samples) - samples[0]


def measure_load(state, base: str, reps: int) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    from checkpoint import Checkpointer

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = tempfile.mkdtemp(dir=base)
    with Checkpointer(f"{root}/spot") as ckpt:
        ckpt.save(1, state)
    dcp.save(state, checkpoint_id=f"{root}/dcp", no_dist=True)
    save_file(state, f"{root}/st.safetensors")
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    out: dict[str, list[float]] = {"spotrun load (verify on)": [], "spotrun load (verify off)": [], "dcp.load": [], "safetensors load_file + copy_ into model": [], "safetensors load_file (lazy mmap, no copy)": []}
    from checkpoint import CheckpointConfig

    for _ in range(reps + 1):
        t = time.perf_counter()
        with Checkpointer(f"{root}/spot") as ckpt:
            ckpt.load(dst)
        out["spotrun load (verify on)"].append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        with Checkpointer(f"{root}/spot", CheckpointConfig(verify_on_load=False)) as ckpt:
            ckpt.load(dst)
        out["spotrun load (verify off)"].append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dcp.load(dst, checkpoint_id=f"{root}/dcp", no_dist=True)
        out["dcp.load"].append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        loaded = load_file(f"{root}/st.safetensors")
        out["safetensors load_file (lazy mmap, no copy)"].append(nbytes / (time.perf_counter() - t) / 1e9)
        del loaded
        t = time.perf_counter()
        loaded = load_file(f"{root}/st.safetensors")
        for k, v in loaded.items():
            dst[k].copy_(v)
        out["safetensors load_file + copy_ into model"].append(nbytes / (time.perf_counter() - t) / 1e9)
        del loaded
    assert all(torch.equal(dst[k], state[k]) for k in state)
    shutil.rmtree(root, ignore_errors=True)
    return {k: v[1:] for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--size-mib", type=int, nargs="+", default=[1024],
                        help="state size(s) for the 1-rank tables (e.g. 1024 4096); the multi-rank parts use the first")
    parser.add_argument("--loop-threads", type=int, default=1,
                        help="torch threads of the compute loop (interference); 2 makes it use both cores")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rss-saves", type=int, default=10)
    parser.add_argument("--stall-pairs", type=int, default=15, help="back-to-back bare copy / spotrun stall pairs")
    parser.add_argument("--process-writer", action="store_true", help="also measure writer=\"process\" (shared-memory staging, writer process)")
    parser.add_argument("--reshard", action="store_true", help="also measure 4->4 and 4->3 resharded loads (4, then 3 gloo processes)")
    parser.add_argument("--ranks", type=int, default=1, help=">= 2: also measure replicated saves at this many gloo ranks")
    parser.add_argument("--skip-single", action="store_true", help="leave out the 1-rank tables")
    parser.add_argument("--scenario", choices=("default", "small-load"), default="default",
                        help="small-load: only the fresh-process load of a small checkpoint vs dcp.load "
                             "(bench/ckpt_small_load.py; --reps processes per arm)")
    args = parser.parse_args()
    if min(args.size_mib) < 1 or args.reps < 1 or args.ranks < 1 or args.loop_threads < 1:
        parser.error("--size-mib, --reps, --ranks and --loop-threads must be >= 1")
    if args.scenario == "small-load":
        import ckpt_small_load  # a sibling of this script (its directory is on sys.path)

        ckpt_small_load.run(args.reps, args.dir)
        return
    base = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    os.makedirs(base, exist_ok=True)
    try:
        if not args.skip_single:
            for size_mib in args.size_mib:
                run_single(args, base, size_mib)
        run_multi_rank(args, base)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


def run_multi_rank(args: argparse.Namespace, base: str) -> None:
    """The multi-rank parts, in their own processes (bench/ckpt_reshard_bench.py), after the 1-rank ones."""
    if not args.reshard and args.ranks < 2:
        return
    import ckpt_reshard_bench as multi  # a sibling of this script (its directory is on sys.path)

    argv = ["--dir", base, "--size-mib", str(args.size_mib[0]), "--reps", str(args.reps)]
    if args.reshard:
        print("\n## resharded loads (gloo processes)", flush=True)
        multi.main([*argv, "--mode", "reshard"])
    if args.ranks >= 2:
        print(f"\n## {args.ranks}-rank replicated saves (gloo processes)", flush=True)
        multi.main([*argv, "--mode", "replicated", "--ranks", str(args.ranks)])


def run_single(args: argparse.Namespace, base: str, size_mib: int) -> None:
    """The 1-rank tables (this process) for one state size."""
    torch.set_num_threads(args.loop_threads)  # 1: the loop and the copies share one thread, like one rank per core
    load_before = os.getloadavg()
    state = make_state(size_mib)
    loop = ComputeLoop()
    loop.baseline(0.5)  # warm-up; each save re-measures its own baseline
    bare, spot, st = BareCopy(state), Spotrun(), SafetensorsSync()
    methods: list[Method] = [bare, spot, DcpAsync(False)]
    if size_mib <= 2048:  # a kept stager holds another full copy; at 4 GiB the arms would not fit in 24 GiB
        methods.append(DcpAsync(True))
    methods.append(st)
    if args.process_writer:
        methods.append(Spotrun("process"))
    results = measure_saves(methods, state, base, args.reps, loop)
    stall_pairs = measure_stall_pairs(bare, spot, state, base, args.stall_pairs)
    print("# measured saves", flush=True)
    rss = {}
    for m in [m for m in methods if not isinstance(m, (BareCopy, SafetensorsSync))]:
        rss[m.name] = measure_rss(m, state, base, args.rss_saves)
        m.close()
    for m in methods:
        m.close()
    del bare
    loads = measure_load(state, base, args.reps)
    load_after = os.getloadavg()

    size = sum(t.numel() * t.element_size() for t in state.values()) / (1 << 30)
    print(f"\n{size:.2f} GiB fp32 in {len(state)} tensors, 1 rank, {base}; reps={args.reps}; arms interleaved, "
          f"os.sync() before each timed save; torch threads={args.loop_threads}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}\n")
    print("| method | stall (save -> safe to modify) | interference (loop slowdown) | total (durable) | RSS growth over 10 saves |")
    print("|---|---|---|---|---|")
    for m in methods:
        r = results[m.name]
        inter = fmt(r["interference"], "x") if r["interference"] else "n/a (blocking)"
        print(f"| {m.name} | {fmt(r['stall'])} | {inter} | {fmt(r['total'])} | {rss.get(m.name, float('nan')):.0f} MiB |")
    print("\n| loader | throughput |")
    print("|---|---|")
    for name, xs in loads.items():
        print(f"| {name} | {fmt(xs, 'GB/s')} |")
    r_bare, r_spot, r_st = results[BareCopy.name], results[spot.name], results[st.name]
    print("\nratios vs targets:")
    print(f"- stall / bare copy: {statistics.median(r_spot['stall']) / statistics.median(r_bare['stall']):.2f} (ratio of the "
          f"table's medians); paired back to back over {len(stall_pairs)} pairs: {fmt(stall_pairs, 'x')} (target <= 1.1)")
    if r_spot["interference"]:
        print(f"- interference: {statistics.median(r_spot['interference']):.2f}x (target <= 1.3)")
    print(f"- total / safetensors+fsync: {statistics.median(r_spot['total']) / statistics.median(r_st['total']):.2f} "
          f"(target <= 1.2; ratio of medians); per-rep paired ratio "
          f"{fmt([a / b for a, b in zip(r_spot['total'], r_st['total'])], 'x')}")
    if args.process_writer:
        proc = results[methods[-1].name]
        print(f"- writer=process: stall / bare {statistics.median(proc['stall']) / statistics.median(r_bare['stall']):.2f}, "
              f"interference {statistics.median(proc['interference']) if proc['interference'] else float('nan'):.2f}x, "
              f"total / safetensors+fsync {statistics.median(proc['total']) / statistics.median(r_st['total']):.2f}")
    verify_on = statistics.median(loads["spotrun load (verify on)"])
    print(f"- load / safetensors: {verify_on / statistics.median(loads['safetensors load_file + copy_ into model']):.2f} "
          f"(target >= 0.8; reference: load_file + copy_ into the model)")


if __name__ == "__main__":
    main()
