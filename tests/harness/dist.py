"""Spawn-and-collect launcher for torch.distributed work: ``world`` gloo processes, one result per rank.

Used by the multi-process checkpoint tests and by ``bench/ckpt_reshard_bench.py``. Workers rendezvous
through a FileStore in a scratch directory (no TCP port to pick), each runs ``fn(rank, world, *args)``
with one intra-op thread (one rank per core, as on a training machine) and sends back its result or its
traceback; on failure or timeout every worker is killed and reaped by PID.

Start methods: ``"forkserver"`` (default) forks workers from a server that imported torch once (fast,
and safe: the server never ran an OpenMP region); ``"spawn"`` starts each worker from scratch (the
benchmarks, which must not inherit anything). Call ``shutdown()`` when done (the suite does at its end): it
stops the forkserver and the resource tracker, which the suite would otherwise report as leftovers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests.harness.deadline import scaled

PRELOAD = (
    "torch", "torch.distributed", "checkpoint.state", "checkpoint.plan",
    # Imported lazily by every save/load (DTensor checks), by DCP's state-dict helpers and by the first
    # fully_shard call (torch._dynamo): seconds per worker, paid once here instead. pytest: the tests' worker
    # functions live in test modules, which import it.
    "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict",
    "torch._dynamo", "checkpoint", "pytest",
)
"""Modules the forkserver imports once for every worker it forks (none starts a thread or an OpenMP region)."""

_FORKSERVER: Any = None


def _context(start_method: str) -> Any:
    global _FORKSERVER
    if start_method != "forkserver":
        return mp.get_context(start_method)
    if _FORKSERVER is None:
        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(list(PRELOAD))
        # Fork one no-op child now: the server imports PRELOAD first (seconds on a loaded machine), and that
        # belongs to no caller's worker deadline.
        warmup = _FORKSERVER.Process(target=int)
        warmup.start()
        warmup.join()
    return _FORKSERVER


def shutdown() -> None:
    """Stop the forkserver and the resource tracker this module started (the suite fails on leftovers).

    Python has no public API for this; the private ``_stop`` methods close the pipe the helper process
    waits on and ``waitpid`` it, which is exactly the reaping we need.
    """
    global _FORKSERVER
    if _FORKSERVER is None:
        return
    from multiprocessing import forkserver, resource_tracker

    forkserver._forkserver._stop()
    resource_tracker._resource_tracker._stop()
    _FORKSERVER = None


def _entry(fn: Callable[..., Any], rank: int, world: int, store_path: str, results: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        results.put((rank, "error", traceback.format_exc()))


def run_workers(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    *,
    tmpdir: str,
    timeout: float = 60.0,
    start_method: str = "forkserver",
    may_die: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; return the results by rank.

    ``fn`` must be importable (module level). Raises RuntimeError with the worker's traceback if any worker
    fails, TimeoutError if they do not all finish within ``timeout`` seconds; every worker is reaped.
    ``may_die``: ranks that may end without a result (a test kills them): their result is None.
    """
    ctx = _context(start_method)
    store_path = os.path.join(tmpdir, f"store-{world}-{time.monotonic_ns()}")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store_path, results, args), daemon=True) for r in range(world)]
    out: dict[int, Any] = {}
    timeout = scaled(timeout)  # written for an idle machine (tests/harness/deadline.py)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(out) + sum(1 for r in may_die if r not in out and procs[r].exitcode not in (None, 0)) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{world - len(out)} of {world} workers did not finish in {timeout:.0f}s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in may_die]
                if dead:
                    raise RuntimeError(f"worker pid {dead[0].pid} exited with code {dead[0].exitcode}") from None
                continue
            if status != "ok":
                raise RuntimeError(f"worker rank {rank} of {world} failed:\n{value}")
            out[rank] = value
        return [out.get(r) for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=max(1.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        results.join_thread()
