"""MTTR report: how long each recovery stage took after each injected fault, per fault type.

    python bench/mttr_report.py --events run/events.jsonl --journal run/journal.jsonl \\
        [--progress run/progress.jsonl] [--worker-log run/agent.log]

Reads spotrun's recovery events (``elastic.events.read_events``) and the chaos journal (``spotrun-chaos
--journal``); without a journal every ``failure_detected`` counts as one fault, typed by its ``cause``. For
each fault it prints the time from injection to each stage (cumulative): detection (``failure_detected``),
stop (``workers_stopped``), rendezvous (``rendezvous_completed``), process start (``workers_started``),
checkpoint load and first step. events.jsonl has no checkpoint-load or first-step event yet: checkpoint
load is read from train_ddp.py's ``resumed from step`` log lines (``--worker-log``), first step from its
``--progress-file`` lines; a stage with no source is "n/a" and the report says what is missing.
Per fault type: median and worst over the faults of that type. Stages of multi-node recoveries take the
last node to reach them (the job is recovered when every node is).
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.events import read_events

STAGES = ("detection", "stop", "rendezvous", "process_start", "checkpoint_load", "first_step")
_EVENT_OF_STAGE = {"detection": "failure_detected", "stop": "workers_stopped",
                   "rendezvous": "rendezvous_completed", "process_start": "workers_started"}
_RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \[rank \d+/\d+ restart \d+\] resumed from step")


@dataclass(slots=True)
class Fault:
    kind: str
    t_wall: float


@dataclass(slots=True)
class Recovery:
    fault: Fault
    stages: dict[str, float | None] = field(default_factory=dict)
    """Seconds from injection to each stage; None when the stage was not seen (or has no source)."""


def faults_from(journal: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]]) -> list[Fault]:
    """Injected faults of the journal; without one, each detection (typed by its cause) is a fault."""
    if journal:
        return [Fault(r.get("kind", "?"), float(r["t_wall"])) for r in journal if r.get("record") == "injected"]
    return [Fault(f"detected:{e.get('cause', '?')}", float(e["t_wall"])) for e in events
            if e.get("event") == "failure_detected"]


def _last_first(events: Sequence[dict[str, Any]], name: str, start: float, end: float) -> float | None:
    """Per node, the first ``name`` event in [start, end); the latest of those (the last node to get there)."""
    firsts: dict[str, float] = {}
    for e in events:
        t = float(e["t_wall"])
        if e.get("event") == name and start <= t < end and e.get("node", "") not in firsts:
            firsts[e.get("node", "")] = t
    return max(firsts.values()) if firsts else None


def breakdown(faults: Sequence[Fault], events: Sequence[dict[str, Any]], progress: Sequence[dict[str, Any]] | None,
              resumes: Sequence[float] | None) -> list[Recovery]:
    """One :class:`Recovery` per fault: stages searched between the fault and the next one (pure)."""
    ordered = sorted(faults, key=lambda f: f.t_wall)
    out = []
    for i, fault in enumerate(ordered):
        end = ordered[i + 1].t_wall if i + 1 < len(ordered) else float("inf")
        rec = Recovery(fault)
        since = fault.t_wall
        for stage in ("detection", "stop", "rendezvous", "process_start"):
            t = _last_first(events, _EVENT_OF_STAGE[stage], since, end)
            if t is None and stage == "detection":
                break  # never detected: no recovery (a later start-up rendezvous is not its recovery)
            rec.stages[stage] = None if t is None else t - fault.t_wall
            since = t if t is not None else since
        for stage in STAGES:
            rec.stages.setdefault(stage, None)
        started = rec.stages["process_start"] if rec.stages["detection"] is not None else None
        origin = fault.t_wall + started if started is not None else None
        rec.stages["checkpoint_load"] = _first_after(resumes, origin, end, fault.t_wall)
        steps = None if progress is None else [float(p["t_wall"]) for p in progress if "t_wall" in p]
        rec.stages["first_step"] = _first_after(steps, origin, end, fault.t_wall)
        out.append(rec)
    return out


def _first_after(times: Sequence[float] | None, origin: float | None, end: float, t0: float) -> float | None:
    if times is None or origin is None:
        return None
    later = [t for t in times if origin <= t < end]
    return min(later) - t0 if later else None


def summarize(recoveries: Sequence[Recovery]) -> dict[str, dict[str, tuple[float, float, int] | None]]:
    """kind -> stage -> (median, worst, n seen) over the recoveries of that kind; None when never seen."""
    kinds: dict[str, list[Recovery]] = {}
    for rec in recoveries:
        kinds.setdefault(rec.fault.kind, []).append(rec)
    table: dict[str, dict[str, tuple[float, float, int] | None]] = {}
    for kind, recs in kinds.items():
        row: dict[str, tuple[float, float, int] | None] = {}
        for stage in STAGES:
            seen = [v for r in recs if (v := r.stages.get(stage)) is not None]
            row[stage] = (statistics.median(seen), max(seen), len(seen)) if seen else None
        table[kind] = row
    return table


def resume_times(log_text: str) -> list[float]:
    """Wall times of train_ddp.py's ``resumed from step`` lines (its log uses local-time asctime)."""
    out = []
    for line in log_text.splitlines():
        m = _RESUMED.match(line)
        if m:
            out.append(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def render(table: dict[str, dict[str, tuple[float, float, int] | None]], counts: dict[str, int]) -> str:
    head = "| fault | n | " + " | ".join(STAGES) + " |"
    lines = [head, "|" + "---|" * (len(STAGES) + 2)]
    for kind, row in sorted(table.items()):
        cells = [("n/a" if row[s] is None else f"{row[s][0]:.2f} / {row[s][1]:.2f}") for s in STAGES]  # type: ignore[index]
        lines.append(f"| {kind} | {counts[kind]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", action="append", required=True, help="events.jsonl (repeatable: one per agent dir)")
    p.add_argument("--journal", default=None, help="chaos journal (spotrun-chaos --journal)")
    p.add_argument("--progress", default=None, help="train_ddp.py --progress-file (first step)")
    p.add_argument("--worker-log", default=None, help="log with train_ddp.py's output (checkpoint load)")
    args = p.parse_args(argv)
    events = [e for path in args.events for e in read_events(path)]
    journal = read_events(args.journal) if args.journal else []
    progress = read_events(args.progress) if args.progress else None
    resumes = resume_times(Path(args.worker_log).read_text(errors="replace")) if args.worker_log else None
    faults = faults_from(journal, events)
    if not faults:
        print("no faults: the journal has no injected fault and the events no failure_detected")
        return 1
    recoveries = breakdown(faults, events, progress, resumes)
    counts: dict[str, int] = {}
    for r in recoveries:
        counts[r.fault.kind] = counts.get(r.fault.kind, 0) + 1
    print("seconds from injection to each stage, median / worst per fault type")
    print(render(summarize(recoveries), counts))
    missing = []
    if resumes is None:
        missing.append("checkpoint_load: events.jsonl has no checkpoint-load event; pass --worker-log")
    if progress is None:
        missing.append("first_step: events.jsonl has no first-step event; pass --progress")
    if not journal:
        missing.append("no --journal: faults are the detections, so detection time is 0 and undetected faults are missing")
    for line in missing:
        print(f"n/a {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
