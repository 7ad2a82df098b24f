"""Small-checkpoint load in a fresh process: spotrun's ``Checkpointer.load`` vs the example's ``dcp.load``.

Run (``bench/ckpt_bench.py --scenario small-load`` forwards here)::

    .venv/bin/python bench/ckpt_small_load.py --reps 15

The state is ``examples/train_gpt.py``'s at ``--context 32 --d-model 32 --corpus-chars 16384 --global-batch 8``
(model, AdamW after a few steps, trainer counter, elastic data cursor; a few hundred KB), saved once by the spotrun
Checkpointer and once by the example's DCP anchor (``DCPCheckpoints``: ``get_state_dict`` + ``dcp.save``). Each
rep starts a fresh Python process per arm (arms interleaved, order alternating) that imports what spotrun's
warm forkserver preloads (``elastic.warm.DEFAULT_PRELOAD``: torch, ``torch.distributed.checkpoint`` and its
``state_dict``...), builds the example's fresh state (empty optimizer), then times:

* import: ``import checkpoint`` (spotrun) / nothing more to import (DCP is already imported);
* load: spotrun ``Checkpointer(root)`` + ``load(state)`` + ``close()`` / the example's ``DCPCheckpoints.load``
  (``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` + the extra entries' ``load_state_dict``), wall and
  CPU time of the process (on a shared machine the CPU time is the steadier figure: wall adds the waits for
  a core).

``--baseline DIR`` adds a third arm: the same spotrun load with the ``checkpoint`` package found in DIR (an
older commit), so before/after and the DCP anchor come from one interleaved run::

    git archive <commit> checkpoint | tar -x -C /tmp/before
    .venv/bin/python bench/ckpt_small_load.py --reps 15 --baseline /tmp/before

Every child reports a digest of the loaded model and optimizer state; the run fails unless each equals the
saved one. Figures are median [min-max] over ``--reps`` (no warm-up rep: every rep is a fresh process).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_ARGS = ["--context", "32", "--d-model", "32", "--corpus-chars", "16384", "--global-batch", "8"]
ARMS = ("spotrun", "dcp")


def _example_state() -> tuple[Any, Any, dict[str, Any]]:
    """(module, optimizer, state) of a fresh ``train_gpt.py`` worker at the example's small size."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "examples"))
    import train_gpt

    args = train_gpt.parse_args(EXAMPLE_ARGS)
    model = train_gpt.make_model(args.gpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    trainer = train_gpt.TrainerState()
    batches = train_gpt.ElasticBatches(args.batch_config)
    return train_gpt, args, {"model": model, "optim": optimizer, "trainer": trainer, "data": batches}


def _digest(state: dict[str, Any]) -> str:
    """sha256 over the model's and optimizer's tensors and the JSON entries, in a fixed order."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(state["model"], state["optim"])
    h = hashlib.sha256()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(prefix.encode())
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            h.update(f"{prefix}={value!r}".encode())

    walk("model", msd)
    walk("optim", osd)
    walk("trainer", state["trainer"].state_dict())
    walk("data", state["data"].state_dict())
    return h.hexdigest()


def save_both(root: str, steps: int = 3) -> str:
    """Train a few steps, save with each arm (step ``steps``); returns the state's digest."""
    import torch
    import torch.nn.functional as F

    from checkpoint import Checkpointer

    train_gpt, args, state = _example_state()
    model, optimizer = state["model"], state["optim"]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, args.gpt.vocab, (8, args.gpt.context + 1), generator=g)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state["trainer"].step += 1
        state["data"].advance()
    with Checkpointer(f"{root}/spot") as ckpt:
        ckpt.save(steps, state)
    extra = {"trainer": state["trainer"], "data": state["data"]}
    train_gpt.DCPCheckpoints(f"{root}/dcp", model, optimizer).save(steps, extra)
    return _digest(state)


def child(arm: str, root: str) -> dict[str, Any]:
    """One fresh worker's load (see the module docstring); the figures as a dict."""
    import importlib

    from elastic.warm import DEFAULT_PRELOAD

    for module in DEFAULT_PRELOAD:  # what spotrun's warm forkserver has imported before a worker starts
        importlib.import_module(module)

    train_gpt, _, state = _example_state()
    cpu0, t0 = time.process_time(), time.perf_counter()
    if arm == "spotrun":
        from checkpoint import Checkpointer
    import_s, import_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    cpu0, t0 = time.process_time(), time.perf_counter()
    if arm == "spotrun":
        with Checkpointer(f"{root}/spot") as ckpt:
            loaded = ckpt.load(state)
    else:
        extra = {"trainer": state["trainer"], "data": state["data"]}
        loaded = train_gpt.DCPCheckpoints(f"{root}/dcp", state["model"], state["optim"]).load(extra)
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if loaded is None:
        raise SystemExit(f"{arm}: nothing loaded from {root}")
    return {"import_s": import_s, "import_cpu_s": import_cpu, "load_s": load_s, "load_cpu_s": load_cpu,
            "digest": _digest(state)}


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}] ms"


def _child_run(arm: str, root: str, pythonpath: str, want: str, omp_threads: int) -> dict[str, Any]:
    """One fresh child process for ``arm`` with ``checkpoint`` imported from ``pythonpath``; its figures."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    if omp_threads:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", arm, "--root", root],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{arm} child failed ({proc.returncode}):\n{proc.stderr}")
    got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["digest"] != want:
        raise SystemExit(f"{arm}: the loaded state differs from the saved one")
    return got


def run(
    reps: int, base: str | None = None, baseline: str | None = None, omp_threads: int = 1
) -> dict[str, dict[str, list[float]]]:
    """Save once, then ``reps`` fresh-process loads per arm; prints the table and returns the samples.

    ``baseline``: a directory holding another version of the ``checkpoint`` package (e.g. a ``git archive``
    of an older commit), measured as one more arm of the same interleaved run (before/after)."""
    root = tempfile.mkdtemp(prefix="ckpt-small-load-", dir=base)
    here = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    # (label, child arm, PYTHONPATH of the child)
    arms = [("spotrun", "spotrun", here), ("dcp", "dcp", here)]
    if baseline is not None:
        arms.append(("spotrun (baseline)", "spotrun", os.pathsep.join([os.path.abspath(baseline), here])))
    out: dict[str, dict[str, list[float]]] = {
        a[0]: {"import_s": [], "import_cpu_s": [], "load_s": [], "load_cpu_s": []} for a in arms
    }
    try:
        want = save_both(root)
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        load_before = os.getloadavg()
        for rep in range(reps):
            for label, arm, path in arms if rep % 2 == 0 else arms[::-1]:
                got = _child_run(arm, root, path, want, omp_threads)
                for k in out[label]:
                    out[label][k].append(got[k])
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ntrain_gpt.py {' '.join(EXAMPLE_ARGS)}: model + AdamW + trainer + data, both checkpoints "
          f"{nbytes / 1024:.0f} KiB on disk; {reps} fresh processes per arm, interleaved, "
          f"OMP_NUM_THREADS={omp_threads or os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}\n")
    print("| arm | import checkpoint (wall) | import (CPU) | load (wall) | load (CPU, this process) |")
    print("|---|---|---|---|---|")
    for label, arm, _ in arms:
        r = out[label]
        if arm == "dcp":
            print(f"| example's DCP anchor (get_state_dict + dcp.load + set_state_dict) | (preloaded) | (preloaded) | "
                  f"{fmt(r['load_s'])} | {fmt(r['load_cpu_s'])} |")
        else:
            name = f"{label}: Checkpointer(root).load(state)"
            print(f"| {name} | {fmt(r['import_s'])} | {fmt(r['import_cpu_s'])} | {fmt(r['load_s'])} | "
                  f"{fmt(r['load_cpu_s'])} |")
    print()
    for label, _, _ in arms:
        if label != "dcp":
            _print_ratio(f"{label} load / DCP load", out[label]["load_s"], out["dcp"]["load_s"])
    if baseline is not None:
        before, after = out["spotrun (baseline)"], out["spotrun"]
        _print_ratio("spotrun (baseline) load / spotrun load, wall", before["load_s"], after["load_s"])
        _print_ratio("spotrun (baseline) load / spotrun load, CPU", before["load_cpu_s"], after["load_cpu_s"])
    return out


def _print_ratio(what: str, a: list[float], b: list[float]) -> None:
    paired = [x / y for x, y in zip(a, b)]
    print(f"- {what}: {statistics.median(a) / statistics.median(b):.2f} (ratio of medians); per-rep paired "
          f"{statistics.median(paired):.2f} [{min(paired):.2f}-{max(paired):.2f}]")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="fresh-process loads per arm")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also measure the checkpoint package found in DIR (e.g. `git archive <commit> checkpoint "
                             "| tar -x -C DIR`) in the same run: before/after")
    parser.add_argument("--omp-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of the children: 1 as torchrun/spotrun set it for --nproc-per-node > 1 "
                             "(0: inherit). With 2 threads on a busy machine the optimizer's first step (both arms "
                             "run one to create its state) stalls for tens of ms in OpenMP barriers")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.root)))
        return
    if args.reps < 1 or args.omp_threads < 0:
        parser.error("--reps must be >= 1 and --omp-threads >= 0")
    if args.baseline is not None and not os.path.isdir(os.path.join(args.baseline, "checkpoint")):
        parser.error(f"--baseline {args.baseline}: no checkpoint package there")
    run(args.reps, args.dir, args.baseline, args.omp_threads)


if __name__ == "__main__":
    main()
