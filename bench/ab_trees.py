"""Before/after comparison of one benchmark command in two checkouts, run alternately in one session.

    python bench/ab_trees.py --before ../old-checkout --after . --pairs 3 -- \\
        bench/elastic_bench.py --launchers spotrun --scenarios nodes --reps 1 --sigstop-reps 0

Runs the command (a script path relative to each checkout, then its arguments) with each checkout's own
interpreter (``<checkout>/.venv/bin/python`` unless ``--python`` says otherwise) and the checkout as the
working directory, in the order before, after, before, after, ... so that a change in the machine's load
falls on both sides alike. Each invocation holds an exclusive ``flock`` on ``--lock`` (when given), so that
other users of that lock (end-to-end test runs) do not overlap a measurement.

The figures are read from the Markdown tables the command prints: every table row whose first cell names a
metric and whose chosen column (``--column``, the header's name; default: the second column) starts with a
number. A cell without a number (a failed repetition) counts as a failure of that metric. Prints, per metric,
each side's median and min-max, the after/before ratio of the medians and whether the two ranges overlap;
every invocation's output is kept under ``--out`` for the logs and breakdowns it names.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
SIDES = ("before", "after")


@dataclass(kw_only=True, slots=True)
class Side:
    """One checkout's samples: metric name -> values, ``None`` for an invocation where the metric failed."""

    tree: Path
    python: Path
    samples: dict[str, list[float | None]] = field(default_factory=dict)

    def summary(self, metric: str) -> tuple[float, float, float, int, int] | None:
        """(median, min, max, done, failed) of ``metric``, or ``None`` when it never produced a number."""
        values = self.samples.get(metric, [])
        done = [v for v in values if v is not None]
        if not done:
            return None
        return statistics.median(done), min(done), max(done), len(done), len(values) - len(done)


def table_rows(text: str, column: str | None) -> Iterator[tuple[str, float | None]]:
    """(metric, first number of the chosen column or ``None``) for each row of each Markdown table in ``text``."""
    index: int | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            index = None  # a table ends at its first non-table line
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if index is None:  # the header row
            index = cells.index(column) if column in cells else (1 if column is None else -1)
            continue
        if set("".join(cells)) <= set("-: ") or index < 0 or index >= len(cells):
            continue  # the separator row, or a table without the chosen column
        found = NUMBER.search(cells[index])
        yield cells[0], float(found.group()) if found and not cells[index].startswith("failed") else None


@contextlib.contextmanager
def held(lock: Path | None) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock`` for the duration, or nothing when no lock was asked for."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def invoke(side: Side, command: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
    """Run ``command`` in ``side``'s checkout with its interpreter; (exit status, stdout, seconds taken)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # each side imports only its own checkout
    env["VIRTUAL_ENV"] = str(side.python.parent.parent)
    started = time.monotonic()
    with open(log, "w") as err:
        try:
            done = subprocess.run([str(side.python), *command], cwd=side.tree, env=env, stdout=subprocess.PIPE,
                                  stderr=err, text=True, timeout=timeout, check=False)
            status, out = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            status, out = 124, exc.stdout if isinstance(exc.stdout, str) else ""
    return status, out, time.monotonic() - started


def cell(summary: tuple[float, float, float, int, int] | None) -> str:
    if summary is None:
        return "failed"
    median, low, high, done, failed = summary
    return f"{median:.2f} ({low:.2f}-{high:.2f}, n={done})" + (f", {failed} failed" if failed else "")


def report(sides: dict[str, Side], metrics: list[str]) -> None:
    print("| metric | before | after | after/before | ranges |")
    print("|---|---|---|---|---|")
    for metric in metrics:
        before, after = (sides[name].summary(metric) for name in SIDES)
        ratio = f"{after[0] / before[0]:.2f}" if before and after and before[0] else "-"
        if before and after:
            overlap = "overlap" if after[1] <= before[2] and before[1] <= after[2] else (
                "after slower" if after[1] > before[2] else "after faster")
        else:
            overlap = "-"
        print(f"| {metric} | {cell(before)} | {cell(after)} | {ratio} | {overlap} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the checkout measured first in each pair")
    parser.add_argument("--after", type=Path, required=True, help="the checkout measured second in each pair")
    parser.add_argument("--pairs", type=int, default=3, help="invocations per side (alternating)")
    parser.add_argument("--python", default=".venv/bin/python", help="each side's interpreter, relative to it")
    parser.add_argument("--lock", type=Path, default=None, help="flock this file around each invocation")
    parser.add_argument("--column", default=None, help="the table column to read (default: the second)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on one invocation after this many s")
    parser.add_argument("--budget", type=float, default=None,
                        help="start no new pair after this many s (fewer pairs than asked, both sides alike)")
    parser.add_argument("--out", type=Path, default=None, help="keep each invocation's output here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...], run in each checkout")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.pairs < 1:
        parser.error("give a command after -- and --pairs >= 1")
    sides = {name: Side(tree=tree.resolve(), python=(tree / args.python).absolute())
             for name, tree in zip(SIDES, (args.before, args.after), strict=True)}
    for side in sides.values():
        if not side.python.exists():
            parser.error(f"no interpreter at {side.python}")
    out = args.out or Path(tempfile.mkdtemp(prefix="spotrun-ab-"))
    out.mkdir(parents=True, exist_ok=True)
    metrics: list[str] = []
    load_before = os.getloadavg()
    started = time.monotonic()
    print(f"command: {' '.join(command)}\nbefore: {sides['before'].tree}\nafter: {sides['after'].tree}", flush=True)
    for pair in range(args.pairs):
        if args.budget is not None and pair and time.monotonic() - started > args.budget:
            print(f"budget of {args.budget:.0f} s spent: stopped after {pair} pairs", flush=True)
            break
        for name in SIDES:
            side = sides[name]
            with held(args.lock):
                load = os.getloadavg()[0]
                status, text, took = invoke(side, command, out / f"{pair}-{name}.stderr", args.timeout)
            (out / f"{pair}-{name}.stdout").write_text(text)
            rows = dict(table_rows(text, args.column))
            for metric, value in rows.items():
                if metric not in metrics:
                    metrics.append(metric)
                side.samples.setdefault(metric, []).append(value)
            shown = ", ".join(f"{m} {'failed' if v is None else f'{v:.2f}'}" for m, v in rows.items())
            print(f"pair {pair + 1}/{args.pairs} {name}: exit {status}, {took:.0f} s, load {load:.2f}: {shown}",
                  flush=True)
    load_after = os.getloadavg()
    print(f"\nload avg (1 min) {load_before[0]:.2f} before / {load_after[0]:.2f} after; outputs: {out}\n")
    report(sides, metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
