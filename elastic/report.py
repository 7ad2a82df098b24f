"""MTTR report: how long each recovery stage took, per fault type and recovery cause.

    python bench/mttr_report.py --events run/events.jsonl [--journal run/journal.jsonl] \\
        [--progress run/progress.jsonl] [--worker-log run/agent.log ...]

A recovery is what spotrun's events say it is: every event from the one that starts a recovery up to its
``workers_started`` carries its ``recovery_cause`` (failure, hang, peer_lost, planned_leave, scale_up;
``elastic.api.RecoveryCause``), so planned leaves, scale-ups and hangs count as well as crashes. Per node, a
recovery runs from its first event with a cause to the ``workers_started`` that ends it; the nodes'
recoveries that overlap in time are one recovery of the job, labelled with the cause of the node that
started it first, and each stage is when the last node reached it (the job is recovered when every node is).

Stages, cumulative seconds from the fault: detection (the recovery's first event: ``hang_detected``,
``failure_detected``, ``planned_restart``/``planned_leave``), stop (``workers_stopped``), rendezvous
(``rendezvous_completed``), process start (``workers_started``), checkpoint load (train_ddp.py's ``resumed
from step`` log lines, ``--worker-log``) and first step (its ``--progress-file``). The fault is the chaos
journal's last injected fault before the detection (``spotrun-chaos --journal``; a scale-up has none); without one the clock
starts at the detection. Faults that caused no recovery (an etcd leader lost, a storage hiccup) are listed
with 0 restarts. Steps lost: the newest step reported before the workers started again minus the step they
resumed from. Per fault type and cause: median and worst.
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
NO_RECOVERY = "none"
"""The cause column of a fault that needed no recovery."""
_RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \[rank \d+/\d+ restart \d+\] resumed from step")
_STAGE_EVENTS = {"workers_stopped": "stop", "rendezvous_completed": "rendezvous", "workers_started": "process_start"}


@dataclass(slots=True)
class Fault:
    kind: str
    t_wall: float


@dataclass(slots=True)
class NodeRecovery:
    """One node's part of a recovery: wall times of its first event and of each stage it reached."""

    node: str
    cause: str
    start: float
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.stages.get("process_start", self.start)


@dataclass(slots=True)
class Recovery:
    """One recovery of the job, attributed to a fault (or not); stages in seconds from its origin."""

    cause: str
    fault: Fault | None
    origin: float
    """Wall time the clock starts at: the fault's injection, else the detection."""
    stages: dict[str, float | None] = field(default_factory=dict)
    steps_lost: int | None = None

    @property
    def kind(self) -> str:
        return self.fault.kind if self.fault is not None else "-"


def node_recoveries(events: Sequence[dict[str, Any]]) -> list[NodeRecovery]:
    """Per node, each run of events carrying a ``recovery_cause`` up to the ``workers_started`` ending it
    (a node that leaves ends without one). Pure."""
    open_: dict[str, NodeRecovery] = {}
    out: list[NodeRecovery] = []
    for e in sorted(events, key=lambda e: float(e["t_wall"])):
        cause = e.get("recovery_cause")
        node = str(e.get("node", ""))
        if not cause:
            if e.get("event") in ("workers_started", "run_finished") and node in open_:
                out.append(open_.pop(node))
            continue
        rec = open_.get(node)
        if rec is None:
            rec = open_[node] = NodeRecovery(node, str(cause), float(e["t_wall"]))
        stage = _STAGE_EVENTS.get(str(e.get("event")))
        if stage is not None:
            rec.stages.setdefault(stage, float(e["t_wall"]))
        if e.get("event") == "workers_started":
            out.append(open_.pop(node))
    out.extend(open_.values())
    return sorted(out, key=lambda r: r.start)


def job_recoveries(parts: Sequence[NodeRecovery]) -> list[list[NodeRecovery]]:
    """Node recoveries that overlap in time, grouped: one recovery of the job each (the first to start
    first). A node that left (no ``workers_started``) stays open until another node's recovery joins it:
    a preempted node's ``planned_leave`` comes just before its peers' ``planned_restart``."""
    groups: list[list[NodeRecovery]] = []
    end = float("-inf")
    waiting = False
    for part in sorted(parts, key=lambda r: r.start):
        if groups and (part.start <= end or waiting):
            groups[-1].append(part)
        else:
            groups.append([part])
            end = float("-inf")
        end = max(end, part.end)
        waiting = all("process_start" not in p.stages for p in groups[-1])
    return groups


def _last(group: Sequence[NodeRecovery], stage: str) -> float | None:
    times = [p.stages[stage] for p in group if stage in p.stages]
    return max(times) if times else None


def attribute(groups: Sequence[Sequence[NodeRecovery]], faults: Sequence[Fault],
              progress: Sequence[dict[str, Any]] | None, resumes: Sequence[float] | None) -> list[Recovery]:
    """Each job recovery with its fault (the newest injected before its detection, each fault used once;
    none for a scale-up),
    its stage times from the fault and its steps lost; then one 0-restart entry per fault left over. Pure."""
    unused = sorted(faults, key=lambda f: f.t_wall)
    steps = sorted((float(p["t_wall"]), int(p["step"])) for p in progress or () if "t_wall" in p and "step" in p)
    out = []
    starts = [min(p.start for p in group) for group in groups] + [float("inf")]
    for i, group in enumerate(groups):
        detected, until = starts[i], starts[i + 1]  # a later recovery's resume or step is not this one's
        # A node joining is nobody's fault: a scale-up is never charged to the fault before it.
        earlier = [f for f in unused if f.t_wall <= detected] if group[0].cause != "scale_up" else []
        fault = earlier[-1] if earlier else None
        if fault is not None:
            unused.remove(fault)
        origin = fault.t_wall if fault is not None else detected
        rec = Recovery(group[0].cause, fault, origin)
        rec.stages["detection"] = detected - origin
        for stage in ("stop", "rendezvous", "process_start"):
            t = _last(group, stage)
            rec.stages[stage] = None if t is None else t - origin
        started = _last(group, "process_start")
        rec.stages["checkpoint_load"] = _first_after(resumes, started, until, origin)
        rec.stages["first_step"] = _first_after([t for t, _ in steps] if progress is not None else None, started,
                                                until, origin)
        if started is not None and progress is not None:
            before = [s for t, s in steps if t < started]
            after = [s for t, s in steps if started <= t < until]
            if before and after:
                rec.steps_lost = max(0, max(before) - (after[0] - 1))
        out.append(rec)
    out.extend(Recovery(NO_RECOVERY, f, f.t_wall) for f in unused)
    return sorted(out, key=lambda r: r.origin)


def _first_after(times: Sequence[float] | None, started: float | None, until: float, origin: float) -> float | None:
    if times is None or started is None:
        return None
    later = [t for t in times if started <= t < until]
    return min(later) - origin if later else None


def faults_from(journal: Sequence[dict[str, Any]]) -> list[Fault]:
    """The faults the chaos journal says were injected (skipped and failed ones were not)."""
    return [Fault(str(r.get("kind", "?")), float(r["t_wall"])) for r in journal if r.get("record") == "injected"]


def recoveries(events: Sequence[dict[str, Any]], journal: Sequence[dict[str, Any]] = (),
               progress: Sequence[dict[str, Any]] | None = None, resumes: Sequence[float] | None = None) -> list[Recovery]:
    """Everything above in one call: the job's recoveries (and unrecovered faults) from the raw records."""
    return attribute(job_recoveries(node_recoveries(events)), faults_from(journal), progress, resumes)


Row = dict[str, "tuple[float, float, int] | None"]


def _stat(values: Sequence[float]) -> tuple[float, float, int] | None:
    return (statistics.median(values), max(values), len(values)) if values else None


def summarize(recs: Sequence[Recovery]) -> dict[tuple[str, str], Row]:
    """(fault kind, cause) -> stage (and ``steps_lost``) -> (median, worst, n seen); None when never seen."""
    keyed: dict[tuple[str, str], list[Recovery]] = {}
    for rec in recs:
        keyed.setdefault((rec.kind, rec.cause), []).append(rec)
    table: dict[tuple[str, str], Row] = {}
    for key, group in keyed.items():
        row: Row = {s: _stat([v for r in group if (v := r.stages.get(s)) is not None]) for s in STAGES}
        row["steps_lost"] = _stat([float(r.steps_lost) for r in group if r.steps_lost is not None])
        row["n"] = (len(group), len(group), len(group))
        table[key] = row
    return table


def _cell(stat: tuple[float, float, int] | None, fmt: str = ".2f") -> str:
    return "n/a" if stat is None else f"{stat[0]:{fmt}} / {stat[1]:{fmt}}"


def render(table: dict[tuple[str, str], Row]) -> str:
    """A markdown table: one row per (fault, cause), median / worst seconds from the fault per stage."""
    lines = ["| fault | cause | n | " + " | ".join(STAGES) + " | steps lost |", "|" + "---|" * (len(STAGES) + 4)]
    for (kind, cause), row in sorted(table.items()):
        n = row["n"][0] if row["n"] else 0
        if cause == NO_RECOVERY:
            cells = ["no restart"] * len(STAGES) + ["0"]
        else:
            cells = [_cell(row[s]) for s in STAGES] + [_cell(row["steps_lost"], ".0f")]
        lines.append(f"| {kind} | {cause} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def resume_times(log_text: str) -> list[float]:
    """Wall times of train_ddp.py's ``resumed from step`` lines (its log uses local-time asctime)."""
    out = []
    for line in log_text.splitlines():
        m = _RESUMED.match(line)
        if m:
            out.append(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", action="append", required=True, help="events.jsonl (repeatable: one per agent dir)")
    p.add_argument("--journal", default=None, help="chaos journal (spotrun-chaos --journal)")
    p.add_argument("--progress", default=None, help="train_ddp.py --progress-file (first step, steps lost)")
    p.add_argument("--worker-log", action="append", default=[], help="log with train_ddp.py's output (repeatable)")
    args = p.parse_args(argv)
    events = [e for path in args.events for e in read_events(path)]
    journal = read_events(args.journal) if args.journal else []
    progress = read_events(args.progress) if args.progress else None
    resumes = ([t for log in args.worker_log for t in resume_times(Path(log).read_text(errors="replace"))]
               if args.worker_log else None)
    recs = recoveries(events, journal, progress, resumes)
    if not recs:
        print("no recovery in the events and no injected fault in the journal")
        return 1
    print("seconds from the fault to each stage (cumulative), median / worst per fault type and recovery cause")
    print(render(summarize(recs)))
    missing = []
    if resumes is None:
        missing.append("checkpoint_load: events.jsonl has no checkpoint-load event; pass --worker-log")
    if progress is None:
        missing.append("first_step, steps lost: pass --progress")
    if not journal:
        missing.append("no --journal: the clock starts at each detection (detection is 0), fault type '-'")
    for line in missing:
        print(f"n/a {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
