"""The device check: what a machine with a GPU and 16 cores can show that the 2-core development VM cannot, in
one bounded run (under 8 minutes by default) that writes one JSON of results.

    python bench/device_check.py                              # everything; JSON to $OUT/device_check.json or ./
    python bench/device_check.py --cpu-only --quick --out r.json --parts rendezvous,memtier_restore   # CI's smoke

Parts, in order (``--parts`` picks some; each is bounded by its own time cap and by what is left of ``--budget``,
and one that cannot fit is recorded as skipped with the reason):

GPU (one child process; each check skipped with a printed reason where there is no CUDA or with ``--cpu-only``):

* ``gpu_stall``: a ~1 GiB state (``--state-mib``) on the GPU copied into a shared-memory slot the way the
  checkpointer and the memory tier do (``staging.copy_pieces``): device-to-host GB/s into a CUDA-registered
  (page-locked) mapping vs the same mapping pageable, and how long the training loop is blocked when the copy
  is issued behind ~0.2 s of queued compute: the side stream + event path into the registered mapping (returns
  at once, the copy runs after the queued work and the next forward waits for it on the GPU) vs the plain way, a
  ``non_blocking`` copy into the unregistered mapping followed by a device-wide ``torch.cuda.synchronize()``; the
  copied bytes are checked against the device's.
* ``gpu_restore``: host-to-device GB/s of the same state from page-locked memory (a registered mapping and
  ``pin_memory()``) vs pageable memory (what a restore from the memory tier or a checkpoint feeds the GPU).
* ``gpu_forkserver``: spotrun's warm forkserver started with its default preloads on a CUDA machine has not
  initialised CUDA (``elastic.workers.forkserver_cuda_initialized``) and a worker forked from it can use CUDA.
* ``gpu_abort``: a single-GPU job's NCCL group (world size 1) aborted by ``elastic.worker.abort`` from a
  watcher thread: the abort's time, a later collective failing instead of hanging, and a new NCCL group built
  in the same process afterwards (what an in-place re-form pays); one GPU cannot host a peer to block on.

CPU (the existing benchmarks, called with parameters; their printed tables are kept in the JSON):

* ``rendezvous``: ``bench/rendezvous_bench.py --agents 1000 4096``: one rendezvous round, a loss and the
  recovery round with 1,000 and 4,096 agents;
* ``memtier_restore``: ``bench/memtier_bench.py --parts restore``: shared-memory restore GB/s;
* ``snapshot_ab``: ``bench/memtier_bench.py --parts overhead``: snapshot overhead by whole-run A/B;
* ``goodput_fsdp``: ``bench/goodput_bench.py --parallel fsdp --faults kill,crash``: FSDP2 goodput under
  unplanned faults with the memory tier.

The JSON: ``{"version": 1, "host": {...}, "budget_s": ..., "parts": {name: {"status": "ok" | "failed" |
"timeout" | "skipped", "reason": ..., "seconds": ..., "figures": {...}, "output": "...last lines..."}}}``.
Exit status 0 when no part failed or timed out (skipped parts are not failures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the repository's packages come first
    sys.path.insert(0, str(REPO))

VERSION = 1
GPU_CHECKS = ("gpu_stall", "gpu_restore", "gpu_forkserver", "gpu_abort")
CPU_PARTS = ("rendezvous", "memtier_restore", "snapshot_ab", "goodput_fsdp")
PARTS = (*GPU_CHECKS, *CPU_PARTS)
DEFAULT_BUDGET_S = 450.0
"""The whole check's default bound: under the 8 minutes a device session plans for one run, with room to rerun."""
OUTPUT_TAIL = 6000
"""Characters of a benchmark's output kept in the JSON (its tables are at the end)."""


@dataclass(frozen=True, slots=True)
class Part:
    """One bounded step of the check: a command and how long it may take."""

    name: str
    cap_s: float
    """Most seconds it may run."""
    min_s: float
    """Fewest seconds worth starting it with: below that it is skipped as out of budget."""
    argv: tuple[str, ...] = ()
    """The benchmark command (CPU parts); empty for the GPU checks, run in one child process."""


def cpu_parts(quick: bool) -> dict[str, Part]:
    """The CPU parts' commands: full-size for a 16-core machine, or tiny (``--quick``) for CI's smoke run."""
    py = sys.executable
    if quick:
        return {
            "rendezvous": Part("rendezvous", 90, 20, (py, "-m", "bench.rendezvous_bench", "--agents", "4", "--procs", "1")),
            "memtier_restore": Part("memtier_restore", 90, 20, (py, "bench/memtier_bench.py", "--parts", "restore",
                                                                "--reps", "1", "--size-mib", "8")),
            "snapshot_ab": Part("snapshot_ab", 150, 60, (py, "bench/memtier_bench.py", "--parts", "overhead",
                                                         "--reps", "1", "--steps", "30")),
            "goodput_fsdp": Part("goodput_fsdp", 240, 120, (py, "bench/goodput_bench.py", "--parallel", "fsdp",
                                                            "--faults", "kill,crash", "--launchers", "spotrun-mem",
                                                            "--duration", "40", "--fault-every", "15")),
        }
    return {
        "rendezvous": Part("rendezvous", 120, 60, (py, "-m", "bench.rendezvous_bench", "--agents", "1000", "4096")),
        "memtier_restore": Part("memtier_restore", 45, 25, (py, "bench/memtier_bench.py", "--parts", "restore",
                                                            "--reps", "3", "--size-mib", "1024")),
        "snapshot_ab": Part("snapshot_ab", 70, 45, (py, "bench/memtier_bench.py", "--parts", "overhead",
                                                    "--reps", "1", "--steps", "150")),
        "goodput_fsdp": Part("goodput_fsdp", 135, 110, (py, "bench/goodput_bench.py", "--parallel", "fsdp",
                                                        "--faults", "kill,crash", "--launchers", "spotrun-mem",
                                                        "--duration", "90", "--fault-every", "30")),
    }


GPU_PART = Part("gpu", 90, 20)
"""The GPU checks, together in one child process (one CUDA context, one torch import)."""


def part_timeout(part: Part, remaining_s: float) -> float | None:
    """Seconds ``part`` may run with ``remaining_s`` of the budget left; None when that is below its minimum."""
    allowed = min(part.cap_s, remaining_s)
    return allowed if allowed >= part.min_s else None


def skipped(reason: str) -> dict[str, Any]:
    print(f"[device-check] skipped: {reason}", flush=True)
    return {"status": "skipped", "reason": reason, "seconds": 0.0, "figures": {}}


def gpu_skip_reason(cpu_only: bool, cuda_available: bool) -> str | None:
    """Why the GPU checks do not run here; None when they do."""
    if cpu_only:
        return "--cpu-only"
    if not cuda_available:
        return "no CUDA device on this machine (torch.cuda.is_available() is False)"
    return None


# --------------------------------------------------------------------------- runner (parent)


def run_command(argv: Sequence[str], timeout: float, env: dict[str, str]) -> tuple[str, str, float]:
    """Run ``argv`` in the repository root for at most ``timeout`` s: (status, output, seconds). The child
    leads its own session, so a timeout ends the benchmark and everything it started."""
    began = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(list(argv), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout)
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
            status = "timeout"
        log.seek(0)
        output = log.read().decode(errors="replace")
    return status, output, time.monotonic() - began


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def gpu_results(output: str) -> dict[str, dict[str, Any]]:
    """The GPU child's results: one ``DEVICE-CHECK {json}`` line per check it finished (kept when it later hung)."""
    found: dict[str, dict[str, Any]] = {}
    for line in output.splitlines():
        if line.startswith("DEVICE-CHECK "):
            item = json.loads(line[len("DEVICE-CHECK "):])
            found[item.pop("check")] = item
    return found


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    with contextlib.suppress(OSError, ValueError):
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    with contextlib.suppress(OSError):
        info["loadavg"] = os.getloadavg()
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
        # No CUDA context in the parent: the device's name comes from the GPU child.
    except ImportError as exc:
        info["torch"] = f"not importable: {exc}"
    return info


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    budget = float(args.budget)
    wanted = list(PARTS) if args.parts is None else args.parts
    results: dict[str, Any] = {
        "version": VERSION, "started_unix": time.time(), "argv": sys.argv[1:], "budget_s": budget,
        "quick": args.quick, "host": host_info(), "parts": {},
    }
    parts: dict[str, dict[str, Any]] = results["parts"]
    env = child_env()

    def remaining() -> float:
        return budget - (time.monotonic() - began)

    gpu_wanted = [c for c in GPU_CHECKS if c in wanted]
    if gpu_wanted:
        why = gpu_skip_reason(args.cpu_only, bool(results["host"].get("cuda")))
        timeout = part_timeout(GPU_PART, remaining())
        if why is None and timeout is None:
            why = f"out of budget ({remaining():.0f} s left, the GPU checks need {GPU_PART.min_s:.0f})"
        if why is not None:
            for check in gpu_wanted:
                parts[check] = skipped(f"{check}: {why}")
        else:
            assert timeout is not None
            argv = (sys.executable, "-m", "bench.device_check", "--gpu-child", ",".join(gpu_wanted),
                    "--state-mib", str(args.state_mib))
            print(f"[device-check] GPU checks {gpu_wanted} (at most {timeout:.0f} s)", flush=True)
            status, output, seconds = run_command(argv, timeout, env)
            found = gpu_results(output)
            for check in gpu_wanted:
                if check in found:
                    parts[check] = found[check]
                else:
                    parts[check] = {"status": "timeout" if status == "timeout" else "failed",
                                    "reason": f"the GPU child ended ({status}) before this check reported",
                                    "seconds": seconds, "figures": {}, "output": output[-OUTPUT_TAIL:]}
                print(f"[device-check] {check}: {parts[check]['status']} {json.dumps(parts[check].get('figures', {}))}",
                      flush=True)
    for name, part in cpu_parts(args.quick).items():
        if name not in wanted:
            continue
        timeout = part_timeout(part, remaining())
        if timeout is None:
            parts[name] = skipped(f"{name}: out of budget ({remaining():.0f} s left, needs {part.min_s:.0f})")
            continue
        print(f"[device-check] {name}: {' '.join(part.argv[1:])} (at most {timeout:.0f} s)", flush=True)
        status, output, seconds = run_command(part.argv, timeout, env)
        parts[name] = {"status": "ok" if status == "ok" else ("timeout" if status == "timeout" else "failed"),
                       "reason": "" if status == "ok" else status, "seconds": round(seconds, 2),
                       "command": " ".join(part.argv[1:]), "figures": {}, "output": output[-OUTPUT_TAIL:]}
        print(f"[device-check] {name}: {parts[name]['status']} in {seconds:.1f} s", flush=True)
    results["seconds"] = round(time.monotonic() - began, 2)
    return results


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "device_check.json" if out else Path("device_check.json")


# --------------------------------------------------------------------------- GPU checks (child)


def _report(check: str, began: float, figures: dict[str, Any], status: str = "ok", reason: str = "") -> None:
    line = {"check": check, "status": status, "reason": reason, "seconds": round(time.monotonic() - began, 3),
            "figures": figures}
    print("DEVICE-CHECK " + json.dumps(line), flush=True)


@contextlib.contextmanager
def _shm_buffer(nbytes: int) -> Iterator[tuple[mmap.mmap, Any]]:
    """A shared-memory file mapped like a memory-tier slot, and a uint8 tensor over it."""
    import torch

    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="spotrun-devcheck-", dir=directory)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)
    try:
        yield mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    finally:
        with contextlib.suppress(BufferError):
            mm.close()


def _state(mib: int) -> dict[str, Any]:
    """``mib`` MiB of fp32 parameters on cuda:0 in 8 tensors (a model's worth of pieces)."""
    import torch

    per = mib * 2**20 // 4 // 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, device="cuda", generator=gen) for i in range(8)}


def _layout(state: dict[str, Any]) -> tuple[Any, Any]:
    from checkpoint.shard import build_layout
    from checkpoint.state import flatten

    flat = flatten(state)
    pieces = [(n, i.key, i.global_shape, i.dtype, i.nbytes) for n, i in enumerate(flat.items)]
    return build_layout("device-check.safetensors", pieces), flat


def _compute(iterations: int) -> Callable[[], None]:
    """Queue about ``iterations`` bf16 8192^3 matrix products on the current stream (a forward's worth)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def forward() -> None:
        for _ in range(iterations):
            torch.mm(a, a)

    return forward


def _timed(fn: Callable[[], Any], reps: int = 3) -> float:
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_gpu_stall(state_mib: int) -> None:
    import torch

    from checkpoint.pinned import PinnedMapping
    from checkpoint.staging import copy_pieces, piece_views

    began = time.monotonic()
    state = _state(state_mib)
    layout, flat = _layout(state)
    nbytes = layout.data_bytes
    # ~0.2 s of queued work: sized from one timed product, so the figure means the same on any card.
    one = _timed(_compute(10)) / 10
    iterations = max(1, int(0.2 / max(one, 1e-6)))
    forward = _compute(iterations)
    compute_s = _timed(forward)
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "state_bytes": nbytes,
                               "queued_compute_s": round(compute_s, 4)}
    with _shm_buffer(nbytes) as (_, pageable_buf), _shm_buffer(nbytes) as (_, pinned_buf):
        pinned = PinnedMapping(pinned_buf)
        figures["registered"] = pinned.registered
        views: list[list[Any]] = []
        before: list[Any] = []
        try:
            for name, buf in (("pinned", pinned_buf), ("pageable", pageable_buf)):
                views = [piece_views(buf, layout)]
                seconds = _timed(lambda v=views: copy_pieces([layout], v, flat.items).wait())
                figures[f"d2h_{name}_gbps"] = round(nbytes / seconds / 1e9, 2)
            views = [piece_views(pinned_buf, layout)]
            before = piece_views(pageable_buf, layout)  # the plain way: unregistered, then synchronize
            # Behind queued compute: how long the caller is blocked, new path vs old.
            stalls_new, totals_new, stalls_old = [], [], []
            for _ in range(3):
                torch.cuda.synchronize()
                forward()
                t0 = time.perf_counter()
                fence = copy_pieces([layout], views, flat.items)
                stalls_new.append(time.perf_counter() - t0)
                forward()  # the next forward: queued at once, runs after the copies on the GPU
                fence.wait()
                torch.cuda.synchronize()
                totals_new.append(time.perf_counter() - t0)
                forward()
                t0 = time.perf_counter()
                with torch.no_grad():  # the plain way: non_blocking copies, then a device-wide synchronize
                    for entry, view in zip(layout.entries, before):
                        if view is not None:
                            view.copy_(flat.items[entry.item_index].tensor, non_blocking=True)
                torch.cuda.synchronize()
                stalls_old.append(time.perf_counter() - t0)
            figures["stall_event_path_s"] = round(statistics.median(stalls_new), 5)
            figures["stall_synchronize_path_s"] = round(statistics.median(stalls_old), 5)
            figures["forward_copy_forward_s"] = round(statistics.median(totals_new), 4)
            # The bytes are the device's.
            fence = copy_pieces([layout], views, flat.items)
            fence.wait()
            figures["bytes_match"] = all(
                view is not None and torch.equal(view, flat.items[e.item_index].tensor.cpu())
                for e, view in zip(layout.entries, views[0])
            )
        finally:
            views, before = [], []  # no view of the mappings outlives them
            pinned.release()
    ok = figures["bytes_match"] and figures["stall_event_path_s"] < figures["stall_synchronize_path_s"]
    _report("gpu_stall", began, figures, "ok" if ok else "failed",
            "" if ok else "bytes differ, or the event path blocked the caller longer than a device-wide synchronize")


def check_gpu_restore(state_mib: int) -> None:
    import torch

    from checkpoint.pinned import PinnedMapping

    began = time.monotonic()
    nbytes = state_mib * 2**20
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    figures: dict[str, Any] = {"bytes": nbytes}
    with _shm_buffer(nbytes) as (_, pageable_buf), _shm_buffer(nbytes) as (_, registered_buf):
        pinned = PinnedMapping(registered_buf)
        try:
            pin_tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            for name, host in (("registered_shm", registered_buf), ("pin_memory", pin_tensor),
                               ("pageable_shm", pageable_buf)):
                seconds = _timed(lambda h=host: device.copy_(h, non_blocking=True))
                figures[f"h2d_{name}_gbps"] = round(nbytes / seconds / 1e9, 2)
            del pin_tensor
        finally:
            pinned.release()
    _report("gpu_restore", began, figures)


def _cuda_worker(conn: Any) -> None:
    import torch

    x = torch.ones(1024, 1024, device="cuda")
    conn.send({"worker_used_cuda": float((x @ x).sum().item()) == 1024.0**3, "device": torch.cuda.get_device_name(0)})
    conn.close()


def check_gpu_forkserver() -> None:
    import multiprocessing

    from elastic.workers import DEFAULT_PRELOAD, forkserver_cuda_initialized, start_warm_forkserver

    began = time.monotonic()
    ready = start_warm_forkserver(DEFAULT_PRELOAD)
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_cuda_worker, args=(send,))
    worker.start()
    send.close()
    answer: dict[str, Any] = {"worker_used_cuda": False, "error": "no answer in 60 s"}
    if receive.poll(60):
        try:
            answer = receive.recv()
        except EOFError:  # the worker died before answering (its CUDA failed)
            answer = {"worker_used_cuda": False, "error": "the worker exited without an answer"}
    worker.join(30)
    answer["worker_exitcode"] = worker.exitcode
    figures = {"forkserver_ready_s": round(ready, 2), "forkserver_cuda_initialized": forkserver_cuda_initialized(),
               **answer}
    ok = figures["forkserver_cuda_initialized"] is False and bool(figures.get("worker_used_cuda"))
    _report("gpu_forkserver", began, figures, "ok" if ok else "failed",
            "" if ok else "the forkserver initialised CUDA, or its worker could not use CUDA")


def check_gpu_abort() -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from elastic.worker.abort import abort_process_group

    began = time.monotonic()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # the abort is ours, not the watchdog's
    torch.cuda.set_device(0)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", timeout=timedelta(seconds=30), device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    first_group_s = time.perf_counter() - t0
    reports: list[Any] = []
    watcher = threading.Thread(target=lambda: reports.append(abort_process_group()), name="abort-watcher")
    watcher.start()
    watcher.join(30)
    figures: dict[str, Any] = {"init_and_first_all_reduce_s": round(first_group_s, 3),
                               "abort_returned": bool(reports)}
    if reports:
        figures["abort_s"] = round(reports[0].seconds, 4)
        figures["backend"] = reports[0].backend
    t0 = time.perf_counter()
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        figures["later_collective"] = "completed"
    except Exception as exc:  # noqa: BLE001 - what it raises is the figure
        figures["later_collective"] = f"raised {type(exc).__name__}"
    figures["later_collective_s"] = round(time.perf_counter() - t0, 4)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    t0 = time.perf_counter()
    os.environ["MASTER_PORT"] = str(port + 1)
    dist.init_process_group("nccl", timeout=timedelta(seconds=30), device_id=torch.device("cuda", 0))
    dist.all_reduce(x)
    torch.cuda.synchronize()
    figures["new_group_and_first_all_reduce_s"] = round(time.perf_counter() - t0, 3)
    from elastic.worker.inplace import EntryVote, agree_on_entry, collective_device

    # The in-place wrapper's vote at each entry, on the NCCL group (its tensor on the group's device).
    figures["entry_vote_device"] = str(collective_device())
    vote = agree_on_entry(EntryVote.of(fresh=False, aware=True, after_loss=True, step=7))
    figures["entry_vote"] = "ok" if (vote.step_max, vote.neg_step_min) == (7, -7) else f"wrong: {vote}"
    dist.destroy_process_group()
    ok = bool(reports) and figures["later_collective"] != "completed" and figures["entry_vote"] == "ok"
    _report("gpu_abort", began, figures, "ok" if ok else "failed",
            "" if ok else "the abort did not return, or the aborted group still ran a collective")


def gpu_child(checks: Sequence[str], state_mib: int) -> int:
    """Run the GPU checks in order; each reports one line, a failing one reports its error and the rest go on."""
    runners: dict[str, Callable[[], None]] = {
        "gpu_stall": lambda: check_gpu_stall(state_mib),
        "gpu_restore": lambda: check_gpu_restore(state_mib),
        "gpu_forkserver": check_gpu_forkserver,
        "gpu_abort": check_gpu_abort,
    }
    for check in checks:
        began = time.monotonic()
        try:
            runners[check]()
        except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the next check still runs
            _report(check, began, {}, "failed", f"{type(exc).__name__}: {exc}")
    return 0


# --------------------------------------------------------------------------- CLI


def parse_parts(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="the JSON's path (default: $OUT/device_check.json, else ./)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for the whole check (default {DEFAULT_BUDGET_S:.0f}: under 8 min)")
    p.add_argument("--parts", type=parse_parts, default=None, help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    p.add_argument("--cpu-only", action="store_true", help="skip the GPU checks even where CUDA is available")
    p.add_argument("--quick", action="store_true", help="tiny CPU parts (CI's smoke run), not figures")
    p.add_argument("--state-mib", type=int, default=1024, help="the GPU checks' state size (default 1 GiB)")
    p.add_argument("--gpu-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget <= 0 or args.state_mib <= 0:
        p.error(f"--budget and --state-mib must be > 0, got {args.budget} and {args.state_mib}")
    if args.gpu_child is not None:
        return gpu_child(args.gpu_child.split(","), args.state_mib)
    out = args.out or default_out()
    results = run_check(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    bad = [n for n, r in results["parts"].items() if r["status"] in ("failed", "timeout")]
    print(f"[device-check] {len(results['parts'])} parts in {results['seconds']:.0f} s; JSON: {out}"
          + (f"; failed: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
