"""A torchrun-style script that records what a worker can observe, for tests/elastic/test_fidelity.py.

Deliberately written the way many user scripts are: no ``if __name__ == "__main__"`` guard, a DataLoader with
``num_workers=2`` and a lambda ``collate_fn``, an ``atexit`` handler, a SIGTERM handler.

    torchrun --standalone --nproc-per-node 2 fidelity_worker.py --out DIR --mode observe
    spotrun  --standalone --nproc-per-node 5 fidelity_worker.py --out DIR --mode fail

``observe``: every rank writes ``observed.RANK.json`` and exits 0. ``fail``: once all ranks are ready, rank 1
exits 3, rank 2 ``sys.exit("...")``, rank 3 raises under ``@record``, rank 4 raises without it; rank 0 keeps
a DataLoader alive and waits for the agent's SIGTERM, which its handler records. Ranks 1-4 ignore SIGTERM, so
the exit code each reports is its own however slowly it gets out.
"""

import argparse
import atexit
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time

import numpy
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=("observe", "fail"), required=True)
args = parser.parse_args()
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])


def mark(name: str, text: str = "") -> None:
    with open(os.path.join(args.out, f"{name}.{rank}"), "w") as handle:
        handle.write(text)


atexit.register(mark, "atexit", "ran")


def note_loader_worker(worker_id: int) -> None:
    mark(f"loaderpid{worker_id}", str(os.getpid()))


def batches() -> DataLoader:
    offset = 10 * rank
    return DataLoader(list(range(8)), batch_size=4, num_workers=2, persistent_workers=True,
                      collate_fn=lambda items: [offset + item for item in items],
                      worker_init_fn=note_loader_worker)


def wait_for_all_ranks(name: str) -> None:
    mark(name)
    deadline = time.monotonic() + 120
    while not all(os.path.exists(os.path.join(args.out, f"{name}.{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            sys.exit(90)
        time.sleep(0.02)


def observe_ddp_process_group() -> dict:
    """What a DDP script can see of torch's import-order-dependent state: ``torch._dynamo`` is a lazy attribute
    of ``torch`` until DDP's constructor touches it, and the import it triggers gives the ten ``group=group.WORLD``
    defaults of ``torch.distributed.nn.functional`` the default group (which they then keep alive: freeing DDP
    after ``destroy_process_group`` does not free the group, see docs/concepts/launcher.md)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    world_group = dist.group.WORLD
    before = sys.getrefcount(world_group)
    lazy_before = "_dynamo" not in vars(torch)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    functional = sys.modules["torch.distributed.nn.functional"]
    holding = sorted(name for name, fn in vars(functional).items()
                     if callable(fn) and world_group in (getattr(fn, "__defaults__", None) or ()))
    seen = {"dynamo_lazy_before_ddp": lazy_before, "dynamo_attribute_after_ddp": "_dynamo" in vars(torch),
            "functional_defaults_holding_world": holding,
            "world_refs_added_by_ddp": sys.getrefcount(world_group) - before}
    del model
    dist.destroy_process_group()
    return seen


if args.mode == "observe":
    main_module = sys.modules["__main__"]
    observed = {
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "default_context": multiprocessing.get_context().get_start_method(),
        "current_process": multiprocessing.current_process().name,
        "parent_process": repr(multiprocessing.parent_process()),
        "signals": {sig.name: str(signal.getsignal(sig)) for sig in signal.Signals
                    if sig not in (signal.SIGKILL, signal.SIGSTOP)},
        "sigmask": sorted(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "threads": [thread.name for thread in threading.enumerate()],
        "sys_path0": sys.path[0],
        "sys_path_len": len(sys.path),
        "argv": sys.argv,
        "file": __file__,
        "name": __name__,
        "main_is_this": main_module.__dict__ is globals(),
        "main_keys": sorted(key for key in vars(main_module) if key.startswith("__")),
        "builtins": type(__builtins__).__name__,
        "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, type(sys.stdout.buffer).__name__,
                   sys.stdout.name, sys.stderr.errors],
        "stdin_line": sys.stdin.readline() if rank == 0 else None,
        "stdin_name": sys.stdin.name,
        "own_session": os.getsid(0) == os.getpid(),
        "own_group": os.getpgid(0) == os.getpid(),
        "env": dict(os.environ),
        "flags": str(sys.flags),
        "batches": list(batches()),
        "torch_threads": torch.get_num_threads(),
    }
    observed["ddp"] = observe_ddp_process_group()
    draws = {"numpy": numpy.random.random(), "random": random.random(), "torch": torch.rand(1).item(),
             "torch_seed": torch.initial_seed()}
    with open(os.path.join(args.out, f"observed.{rank}.json"), "w") as handle:
        json.dump(observed, handle)
    with open(os.path.join(args.out, f"draws.{rank}.json"), "w") as handle:
        json.dump(draws, handle)  # unseeded generators: per process, so compared across ranks
    # One write per line: print() writes the text and its newline apart, and unbuffered (-u, as torchrun runs
    # workers), two ranks' lines then interleave ("...rank=1fidelity-stderr rank=0"), under either launcher.
    sys.stdout.write(f"fidelity-stdout rank={rank}\n")
    sys.stdout.flush()
    sys.stderr.write(f"fidelity-stderr rank={rank}\n")
    sys.stderr.flush()
else:
    if rank == 0:
        def on_sigterm(signum: int, frame: object) -> None:
            # Both launchers SIGTERM the worker's whole process group, so the DataLoader workers die with it and
            # torch's SIGCHLD handler in this process raises "DataLoader worker ... is killed by signal" at
            # whatever Python line runs next, sometimes inside the atexit handler, whose marker is then lost (seen
            # under torchrun). A torch race, not a launcher difference: SIGCHLD's handler goes first (CPython runs
            # a pending SIGTERM's handler before a pending SIGCHLD's, and skips one that is no longer set).
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            mark("sigterm", "handled")
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_sigterm)
        loader = iter(batches())  # persistent loader workers stay alive until the worker goes
        next(loader)
    else:
        # Ranks 1-4 fail on their own: the agent's SIGTERM after the first failure must not decide which exit
        # code a slower one reports (on a loaded 2-core CI machine rank 1 and 2 took over 3 s to get out, and
        # torchrun's summary showed -15 for them): both launchers wait for them, as for any SIGTERM handler.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wait_for_all_ranks("ready")
    if rank == 0:
        time.sleep(120)
        sys.exit(5)  # never signalled: the test fails on this exit code
    if rank == 1:
        sys.exit(3)
    if rank == 2:
        sys.exit("fidelity-exit-message")

    @record
    def recorded_main() -> None:
        raise ValueError("fidelity-recorded")

    if rank == 3:
        recorded_main()
    raise RuntimeError("fidelity-unrecorded")
