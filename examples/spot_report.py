"""Read what a spotrun job left behind: a timeline of its recovery events, what each world size trained, steps
lost, and whether its final weights equal another run's (``examples/spot_demo.sh`` and ``bench/`` use it).

Inputs are spotrun's public files: ``events.jsonl`` (``--events-file``), the examples' ``--progress-file``
lines (``rank, world_size, step, pid, t_wall, loss``) and committed checkpoint directories.

    # timeline + steps per world size of a finished run
    python examples/spot_report.py timeline --events runs/events.jsonl --progress runs/progress.jsonl
    # PASS/FAIL (exit 1): every model/optimizer tensor of the newest committed step equal, bit for bit
    python examples/spot_report.py compare runs/ckpt runs/reference-ckpt
    # wait (bounded) until the job trains at world size 2 with 2 ranks reporting, e.g. from a script
    python examples/spot_report.py wait --progress runs/progress.jsonl --world 2 --timeout 300
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.events import read_events
from elastic.nodes import node_pid

# Fields worth showing on a timeline line, per event (the rest is context every line carries).
_DETAIL = ("cause", "reason", "source", "step", "saved", "late", "why", "world_size", "state", "action")


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive steps rank 0 trained in one worker process (one world size, one start of the workers)."""

    pid: int
    world_size: int
    first_step: int
    last_step: int
    t_start: float
    t_end: float


def segments(progress: Iterable[Mapping[str, Any]]) -> list[Segment]:
    """Rank 0's progress lines grouped by worker process, in time order."""
    by_pid: dict[int, list[Mapping[str, Any]]] = {}
    for line in progress:
        if line["rank"] == 0:
            by_pid.setdefault(int(line["pid"]), []).append(line)
    out = [Segment(pid, int(lines[0]["world_size"]), min(int(x["step"]) for x in lines),
                   max(int(x["step"]) for x in lines), min(x["t_wall"] for x in lines), max(x["t_wall"] for x in lines))
           for pid, lines in by_pid.items()]
    return sorted(out, key=lambda s: s.t_start)


def steps_lost(segs: list[Segment]) -> list[int]:
    """Per restart, how many already-trained steps the next segment trained again (0 = resumed exactly)."""
    lost = []
    for before, after in itertools.pairwise(segs):
        lost.append(max(0, before.last_step - after.first_step + 1))
    return lost


def node_labels(events: list[Mapping[str, Any]], names: Mapping[str, str]) -> dict[str, str]:
    """Node ids (``host-pid-suffix``, or ``host:pid`` in older events) -> the caller's names (by agent pid), or
    node-1, node-2, ... by first appearance."""
    labels: dict[str, str] = {}
    for e in events:
        node = str(e.get("node", "?"))
        if node not in labels:
            pid = node_pid(node)
            labels[node] = names.get(str(pid), f"node-{len(labels) + 1}")
    return labels


def timeline_lines(events: list[Mapping[str, Any]], segs: list[Segment], names: Mapping[str, str]) -> list[str]:
    """One line per event and per training segment, in wall-clock order, relative to the first."""
    labels = node_labels(events, names)
    times = [e["t_wall"] for e in events] + [s.t_start for s in segs]
    t0 = min(times, default=0.0)
    rows: list[tuple[float, str]] = []
    for e in events:
        detail = " ".join(f"{k}={e[k]}" for k in _DETAIL if k in e and e[k] is not None)
        rows.append((e["t_wall"], f"{labels[str(e['node'])]:<10} {e['event']:<24} {detail}"))
    for s in segs:
        rows.append((s.t_start, (f"{'training':<10} steps {s.first_step}..{s.last_step} at world size {s.world_size} "
                                f"(until +{s.t_end - t0:.1f}s)")))
    return [f"+{t - t0:7.1f}s  {text}" for t, text in sorted(rows, key=lambda r: r[0])]


def read_tensors(ckpt_dir: Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """Every tensor of the newest (or given) committed step, read from its safetensors files directly."""
    from safetensors.torch import load_file

    from checkpoint.api import COMMIT_FILE, step_dir

    if step is None:
        committed = [int(p.name.split("-")[1]) for p in ckpt_dir.glob("step-*") if (p / COMMIT_FILE).exists()]
        if not committed:
            raise SystemExit(f"no committed step in {ckpt_dir}")
        step = max(committed)
    tensors: dict[str, Any] = {}
    for shard in sorted((ckpt_dir / step_dir(step)).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return step, tensors


def compare(run: Path, reference: Path) -> list[str]:
    """Differences between the newest committed steps of two runs (empty: bit-identical, same step)."""
    import torch

    step_a, a = read_tensors(run)
    step_b, b = read_tensors(reference)
    problems = [f"final step {step_a} != reference step {step_b}"] if step_a != step_b else []
    if a.keys() != b.keys():
        problems.append(f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    for key in sorted(a.keys() & b.keys()):
        if not torch.equal(a[key], b[key]):
            diff = (a[key].double() - b[key].double()).abs().max().item()
            problems.append(f"{key}: max abs difference {diff:.3g}")
    return problems


def _wait(progress: Path, world: int, ranks: int, min_step: int, since: float, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [x for x in read_events(str(progress))
                 if x["world_size"] == world and x["step"] >= min_step and x["t_wall"] >= since]
        if len({x["rank"] for x in lines}) >= ranks:
            print(max(x["step"] for x in lines))
            return 0
        time.sleep(0.2)
    print(f"timed out after {timeout} s waiting for {ranks} ranks at world size {world}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("timeline", help="print the recovery timeline and the steps each world size trained")
    t.add_argument("--events", required=True)
    t.add_argument("--progress", required=True)
    t.add_argument("--name", action="append", default=[], metavar="PID=NAME", help="call agent PID this name")
    c = sub.add_parser("compare", help="PASS if the newest committed steps are bit-identical, else FAIL (exit 1)")
    c.add_argument("run", type=Path)
    c.add_argument("reference", type=Path)
    w = sub.add_parser("wait", help="wait until RANKS ranks report steps at world size WORLD; print the step")
    w.add_argument("--progress", required=True, type=Path)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--ranks", type=int, default=None, help="default: --world")
    w.add_argument("--min-step", type=int, default=0)
    w.add_argument("--since", type=float, default=0.0, help="only lines written after this Unix time")
    w.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)

    if args.cmd == "wait":
        return _wait(args.progress, args.world, args.ranks or args.world, args.min_step, args.since, args.timeout)
    if args.cmd == "compare":
        problems = compare(args.run, args.reference)
        if problems:
            print("FAIL: final weights differ from the uninterrupted run:\n  " + "\n  ".join(problems[:20]))
            return 1
        step, tensors = read_tensors(args.run)
        print(f"PASS: all {len(tensors)} model and optimizer tensors at step {step} are bit-identical "
              "to the uninterrupted run")
        return 0
    names = dict(item.split("=", 1) for item in args.name)
    segs = segments(read_events(args.progress))
    print("\n".join(timeline_lines(read_events(args.events), segs, names)))
    lost = steps_lost(segs)
    print(f"restarts: {len(lost)}; steps trained again after each: {lost} (total {sum(lost)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
