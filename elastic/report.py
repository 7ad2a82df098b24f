"""``spotrun report``: a job's timeline and what its faults cost, from its ``events.jsonl`` files.

    spotrun report run/events.jsonl [more.jsonl ...] [--journal run/journal.jsonl] \\
        [--progress run/progress.jsonl] [--worker-log run/agent.log ...] [--html report.html]
    spotrun report --rdzv-id job1 [--log-dir DIR] ...   # the files spotrun wrote by default for that run

A recovery is what spotrun's events say it is: every event from the one that starts a recovery up to its
``workers_started`` carries its ``recovery_cause`` (failure, hang, peer_lost, planned_leave, scale_up, peer_failure;
``elastic.api.RecoveryCause``), so planned leaves, scale-ups and hangs count as well as crashes. Per node, a
recovery runs from its first event with a cause to the ``workers_started`` that ends it; the nodes'
recoveries that overlap in time are one recovery of the job, labelled with the cause of the node that
started it first, and each stage is when the last node reached it (the job is recovered when every node is).

Stages, cumulative seconds from the fault: detection (the recovery's first event: ``hang_detected``,
``failure_detected``, ``planned_restart``/``planned_leave``), stop (``workers_stopped``), rendezvous
(``rendezvous_completed``), process start (``workers_started``), checkpoint load (train_ddp.py's ``resumed
from step`` log lines, ``--worker-log``, else the agents' ``restore_completed`` events) and first step (its
``--progress-file``). The fault is the chaos
journal's last injected fault before the detection (``spotrun-chaos --journal``; a scale-up has none); without one the clock
starts at the detection. Faults that caused no recovery (an etcd leader lost, a storage hiccup) are listed
with 0 restarts. Steps lost: the newest step reported before the workers started again minus the step they
resumed from. Per fault type and cause: median and worst.

Totals (:func:`totals`): the job's span (first ``workers_started`` to the last event), the time each recovery
cost (from its fault to its last stage seen, plus its redone steps at the median step time when progress is
given) and the effective training time ratio, ``1 - lost / span``. The analysis is pure (lists of dicts in,
dataclasses out, the dataclasses in ``elastic.timeline``); reading files and printing happen in :func:`main`;
the HTML page is ``elastic.report_html``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.events import EVENTS_FILE_NAME, find_events_files, read_events, run_events_dir
from elastic.report_html import write_html
from elastic.timeline import NO_RECOVERY as NO_RECOVERY
from elastic.timeline import SEGMENT_KINDS as SEGMENT_KINDS
from elastic.timeline import STAGES as STAGES
from elastic.timeline import Fault as Fault
from elastic.timeline import Marker as Marker
from elastic.timeline import Recovery as Recovery
from elastic.timeline import Segment as Segment
from elastic.timeline import Timeline as Timeline
from elastic.timeline import Totals as Totals
from elastic.timeline import recovery_cost as recovery_cost
from elastic.timeline import stage_end as stage_end

_RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \[rank \d+/\d+ restart \d+\] resumed from step")
_STAGE_EVENTS = {"workers_stopped": "stop", "rendezvous_completed": "rendezvous", "workers_started": "process_start"}


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
    """Everything above in one call: the job's recoveries (and unrecovered faults) from the raw records.
    Without worker logs the checkpoint load is the agents' ``restore_completed`` events (workers restoring
    through ``checkpoint.memory.restore``), which also name each recovery's restore source."""
    restored = sorted((float(e["t_wall"]), str(e.get("restore_source", "?"))) for e in events
                      if e.get("event") == "restore_completed")
    if resumes is None and restored:
        resumes = [t for t, _ in restored]
    recs = attribute(job_recoveries(node_recoveries(events)), faults_from(journal), progress, resumes)
    for rec in recs:
        start = rec.stages.get("process_start")
        if rec.cause == NO_RECOVERY or start is None:
            continue
        after = [src for t, src in restored if t >= rec.origin + start]
        rec.restore_source = after[0] if after else None
    return recs


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


# --- validation ------------------------------------------------------------------------------------------------


def valid_records(records: Sequence[Any], *, need: Sequence[str] = ("t_wall",)) -> tuple[list[dict[str, Any]], int]:
    """The records that are JSON objects with a finite number in each ``need`` field, and how many were not.

    ``read_events`` already skips lines that are not JSON; this drops the ones a hand edit or another tool left
    without a time, so one bad line costs one line of the report instead of a traceback. Pure."""
    good: list[dict[str, Any]] = []
    for record in records:
        if isinstance(record, dict) and all(_is_number(record.get(name)) for name in need):
            good.append(record)
    return good, len(records) - len(good)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --- timeline -------------------------------------------------------------------------------------------------

_SEGMENT_END = {"workers_stopped": "stop", "rendezvous_completed": "rendezvous", "workers_started": "start"}
MARKER_EVENTS = {"notice_received": "notice", "hang_detected": "hang", "planned_leave": "leave",
                 "failure_detected": "failure", "run_finished": "end", "straggler_detected": "straggler"}
"""Events drawn as markers on their node's row (and faults from the chaos journal on every row; ``lost``: the
last sign of a node that ended without a ``run_finished``)."""


def timeline(events: Sequence[dict[str, Any]], faults: Sequence[Fault] = (),
             recs: Sequence[Recovery] = ()) -> Timeline:
    """Each node's time as training and recovery stages, with notices, hangs, leaves and faults marked. Pure.

    A node trains from a ``workers_started`` until its next event that starts a recovery (one with a
    ``recovery_cause``) or its ``run_finished``; then it is in ``stop``, ``rendezvous`` and ``start`` until the
    matching events. The time from a job recovery's fault to the node's first event is ``detection``, and
    after the restart ``load`` and ``first_step`` run until the recovery's checkpoint load and first step
    (when the report was given the worker logs and progress)."""
    ordered = sorted(events, key=lambda e: float(e["t_wall"]))
    nodes: list[str] = []
    segments: list[Segment] = []
    markers: list[Marker] = []
    state: dict[str, tuple[str, float]] = {}
    for e in ordered:
        node, name, t = str(e.get("node", "?")), str(e.get("event", "?")), float(e["t_wall"])
        if node not in nodes:
            nodes.append(node)
        if name in MARKER_EVENTS:
            markers.append(Marker(node, MARKER_EVENTS[name], t, _marker_label(e)))
        current = state.get(node)
        if name == "run_finished":
            if current is not None:
                segments.append(Segment(node, current[0], current[1], t))
            state.pop(node, None)
            continue
        if name == "workers_started":
            if current is not None and current[0] != "training":
                segments.append(Segment(node, "start", current[1], t))
            elif current is not None:
                segments.append(Segment(node, current[0], current[1], t))
            state[node] = ("training", t)
            continue
        if e.get("recovery_cause") and (current is None or current[0] == "training"):
            if current is not None:
                segments.append(Segment(node, "training", current[1], t))
            state[node] = ("stop", t)
            current = state[node]
        if current is not None and current[0] != "training" and name in _SEGMENT_END:
            kind = _SEGMENT_END[name]
            segments.append(Segment(node, kind, current[1], t))
            state[node] = ({"stop": "rendezvous", "rendezvous": "start"}.get(kind, kind), t)
    t1 = max([float(e["t_wall"]) for e in ordered] + [f.t_wall for f in faults], default=0.0)
    for node, (kind, since) in state.items():  # no run_finished: still going at the end, or gone without a word
        gone = _gone_at(ordered, node, since)
        if gone is not None:
            markers.append(Marker(node, "lost", gone, "no more events: killed or cut off (the job re-formed without it)"))
        end = gone if gone is not None else t1
        if end > since:
            segments.append(Segment(node, kind, since, end))
    segments.extend(_recovery_edges(segments, recs))
    markers.extend(Marker(None, "fault", f.t_wall, f.kind) for f in faults)
    t0 = min([float(e["t_wall"]) for e in ordered] + [f.t_wall for f in faults], default=0.0)
    return Timeline(tuple(nodes), tuple(sorted(segments, key=lambda s: (s.start, s.node))),
                    tuple(sorted(markers, key=lambda m: m.t)), t0, t1)


def _gone_at(ordered: Sequence[dict[str, Any]], node: str, since: float) -> float | None:
    """When the job went on without ``node`` (it wrote nothing after ``since``): the start of the first later
    recovery of another node (every live node takes part in each one), else None (it ran to the end)."""
    later = [r.start for r in node_recoveries(ordered) if r.node != node and r.start > since]
    return min(later) if later else None


def _recovery_edges(segments: Sequence[Segment], recs: Sequence[Recovery]) -> list[Segment]:
    """Detection (fault -> a node's first recovery event) and load / first step after each restart: stretches
    known for the job, cut out of each node's training."""
    out: list[Segment] = []
    for rec in recs:
        if rec.cause == NO_RECOVERY:
            continue
        for seg in segments:
            if seg.kind == "stop" and rec.fault is not None and rec.origin <= seg.start <= rec.origin + stage_end(rec):
                out.append(Segment(seg.node, "detection", rec.origin, seg.start))
            started = rec.origin + (rec.stages.get("process_start") or 0.0)
            if seg.kind == "training" and rec.origin <= seg.start <= started + 1e-9:
                edge = seg.start
                for stage, kind in (("checkpoint_load", "load"), ("first_step", "first_step")):
                    at = rec.stages.get(stage)
                    if at is not None and rec.origin + at > edge:
                        end = min(rec.origin + at, seg.end)
                        out.append(Segment(seg.node, kind, edge, end))
                        edge = end
    return out


def _marker_label(e: dict[str, Any]) -> str:
    name = str(e.get("event"))
    if name == "notice_received":
        deadline, t = e.get("deadline"), float(e["t_wall"])
        left = f", deadline in {deadline - t:.0f} s" if isinstance(deadline, (int, float)) and _is_number(deadline) else ""
        return f"notice ({e.get('source', '?')}{left})"
    if name == "planned_leave":
        return f"left at step {e.get('step')} (saved)" if e.get("saved") else f"left, not saved ({e.get('why')})"
    if name == "failure_detected":
        return f"failure: {e.get('cause', '?')}"
    if name == "run_finished":
        return f"finished: {e.get('state', '?')}"
    if name == "straggler_detected":
        return f"straggler: rank {e.get('rank', '?')}"
    return name.replace("_", " ")


def straggler_lines(events: Sequence[dict[str, Any]], t0: float) -> list[str]:
    """One line per ``straggler_detected`` event (pure): the rank, its node, how much slower, when, and when it
    was cleared (the next ``straggler_cleared`` of that rank on that node), fields checked before use."""
    ordered = sorted(events, key=lambda e: float(e["t_wall"]))
    lines = []
    for i, e in enumerate(ordered):
        if e.get("event") != "straggler_detected":
            continue
        node, rank = e.get("node", "?"), e.get("rank")
        numbers = [e.get(k) for k in ("ratio", "step_time", "peers_step_time")]
        how = ""
        if all(_is_number(v) for v in numbers):
            ratio, own, peers = (float(v) for v in numbers)  # type: ignore[arg-type]  # checked just above
            how = f": {ratio:.2f}x its local peers' median ({own:.3f} s vs {peers:.3f} s per step"
            how += f" over {e['window']} steps)" if isinstance(e.get("window"), int) else ")"
        cleared = next((c for c in ordered[i + 1:] if c.get("event") == "straggler_cleared"
                        and c.get("node") == node and c.get("rank") == rank), None)
        until = f", cleared at +{float(cleared['t_wall']) - t0:.1f} s" if cleared is not None else ", not cleared"
        lines.append(f"rank {rank} (local rank {e.get('local_rank', '?')}) on {node}{how}; "
                     f"from +{float(e['t_wall']) - t0:.1f} s{until}")
    return lines


# --- totals ---------------------------------------------------------------------------------------------------


def step_time(progress: Sequence[dict[str, Any]] | None) -> float | None:
    """Median seconds per step, from consecutive steps of one rank (the lowest) in the progress file. Pure."""
    if not progress:
        return None
    ranks = [p.get("rank", 0) for p in progress]
    first = min(ranks, key=lambda r: (str(type(r)), r))
    rows = sorted((float(p["t_wall"]), int(p["step"])) for p in progress
                  if p.get("rank", 0) == first and _is_number(p.get("step")))
    gaps = [(t2 - t1) / (s2 - s1) for (t1, s1), (t2, s2) in zip(rows, rows[1:]) if s2 > s1 and t2 > t1]
    return statistics.median(gaps) if gaps else None


def totals(events: Sequence[dict[str, Any]], recs: Sequence[Recovery],
           progress: Sequence[dict[str, Any]] | None = None) -> Totals:
    """The job's span, time lost per cause and the effective training time ratio. Pure."""
    started = [float(e["t_wall"]) for e in events if e.get("event") == "workers_started"]
    last = max((float(e["t_wall"]) for e in events), default=0.0)
    span = last - min(started) if started else 0.0
    per_step = step_time(progress)
    by_cause: dict[str, float] = {}
    for rec in recs:
        if rec.cause != NO_RECOVERY:
            by_cause[rec.cause] = by_cause.get(rec.cause, 0.0) + recovery_cost(rec, per_step)
    restarts = [r for r in recs if r.cause != NO_RECOVERY]
    known = [r.steps_lost for r in restarts if r.steps_lost is not None]
    return Totals(span=span, lost=sum(by_cause.values()), lost_by_cause=by_cause, recoveries=len(restarts),
                  steps_redone=sum(known) if known or not restarts else None, step_time=per_step)



# --- text -----------------------------------------------------------------------------------------------------


def _clock(t: float, t0: float) -> str:
    return f"+{t - t0:8.2f}s"


def render_recoveries(recs: Sequence[Recovery], per_step: float | None, t0: float) -> str:
    """One line per recovery: when, fault and cause, cumulative stage seconds, steps redone, cost."""
    names = {"detection": "detect", "stop": "stop", "rendezvous": "rdzv", "process_start": "start",
             "checkpoint_load": "load", "first_step": "step"}
    lines = []
    for i, rec in enumerate(recs, 1):
        head = f"#{i:<3} {_clock(rec.origin, t0)}  {rec.kind:<18} {rec.cause:<14}"
        if rec.cause == NO_RECOVERY:
            lines.append(f"{head} no restart")
            continue
        stages = "  ".join(f"{names[s]} {v:6.2f}" if (v := rec.stages.get(s)) is not None else f"{names[s]}    n/a"
                           for s in STAGES)
        redone = "n/a" if rec.steps_lost is None else str(rec.steps_lost)
        source = f"  from {rec.restore_source}" if rec.restore_source else ""
        lines.append(f"{head} {stages}  redone {redone:>4}  cost {recovery_cost(rec, per_step):6.2f}s{source}")
    return "\n".join(lines)


def render_totals(tot: Totals) -> str:
    lines = [f"span {tot.span:.1f} s, {tot.recoveries} recoveries, lost {tot.lost:.1f} s: "
             f"effective training time {100 * tot.effective_ratio:.1f}%"]
    for cause, seconds in sorted(tot.lost_by_cause.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cause:<14} {seconds:8.2f} s lost ({100 * seconds / tot.span if tot.span else 0:.1f}% of the span)")
    redo = (f"{tot.steps_redone} steps redone" if tot.steps_redone is not None
            else "steps redone: unknown (no --progress file)") + (f" ({tot.step_time:.3f} s/step)" if tot.step_time else "")
    lines.append(f"  {redo}")
    return "\n".join(lines)


def render_events(events: Sequence[dict[str, Any]], t0: float, limit: int = 200) -> str:
    """The job's events in time order, one line each (the first ``limit``)."""
    lines = []
    for e in sorted(events, key=lambda e: float(e["t_wall"]))[:limit]:
        cause = f" [{e['recovery_cause']}]" if e.get("recovery_cause") else ""
        extra = f"  {_marker_label(e)}" if e.get("event") in MARKER_EVENTS else ""
        lines.append(f"{_clock(float(e['t_wall']), t0)}  {str(e.get('node', '?')):<24} {e.get('event')}{cause}{extra}")
    if len(events) > limit:
        lines.append(f"... {len(events) - limit} more events")
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Inputs:
    """Everything the report reads, validated: events, chaos journal, progress, resume times."""

    events: list[dict[str, Any]]
    journal: list[dict[str, Any]]
    progress: list[dict[str, Any]] | None
    resumes: list[float] | None
    dropped: dict[str, int]
    """file -> records skipped for lacking a time (said once each in the report)."""


def load_inputs(events: Sequence[str], journal: str | None = None, progress: str | None = None,
                worker_logs: Sequence[str] = ()) -> Inputs:
    """Read and validate the report's files (a missing events file raises ``FileNotFoundError``)."""
    dropped: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    for path in events:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no events file at {path}")
        good, bad = valid_records(read_events(path), need=("t_wall",))
        out.extend(good)
        if bad:
            dropped[path] = bad
    jrn: list[dict[str, Any]] = []
    if journal:
        jrn, bad = valid_records(read_events(journal))
        if bad:
            dropped[journal] = bad
    prog: list[dict[str, Any]] | None = None
    if progress:
        prog, bad = valid_records(read_events(progress), need=("t_wall", "step"))
        if bad:
            dropped[progress] = bad
    resumes = ([t for log in worker_logs for t in resume_times(Path(log).read_text(errors="replace"))]
               if worker_logs else None)
    return Inputs(out, jrn, prog, resumes, dropped)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotrun report", description=__doc__.split("\n\n")[0])
    p.add_argument("events", nargs="*", help="events.jsonl files (one per agent directory, or one shared file); "
                                            "none: found from --rdzv-id / --log-dir")
    p.add_argument("--rdzv-id", "--rdzv_id", default=None,
                   help="the run id: its events files where spotrun writes them by default "
                        "($XDG_STATE_HOME/spotrun/runs/<run id>/*/events.jsonl), and only that run's events")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="the agents' --log-dir: its events.jsonl (with --rdzv-id, only that run's events)")
    p.add_argument("--journal", default=None, help="chaos journal (spotrun-chaos --journal): faults and their kinds")
    p.add_argument("--progress", default=None, help="progress file with t_wall and step per line (first step, "
                                                    "steps redone)")
    p.add_argument("--worker-log", action="append", default=[], help="log with train_ddp.py's 'resumed from step' "
                                                                     "lines (checkpoint load; repeatable)")
    p.add_argument("--html", default=None, metavar="OUT", help="also write a self-contained HTML page here")
    p.add_argument("--events-limit", type=int, default=60, help="events listed in the text timeline (default 60)")
    return p


def events_files(args: argparse.Namespace) -> list[str]:
    """The events files to read: those named, else the run's default files (``elastic.events``).

    Raises:
        FileNotFoundError: none named and none found for ``--rdzv-id`` / ``--log-dir`` (the message says where
            it looked), or neither was given.
    """
    if args.events:
        return list(args.events)
    if not args.rdzv_id and not args.log_dir:
        raise FileNotFoundError("name the events files, or give --rdzv-id (and --log-dir if the agents had one)")
    found = find_events_files(args.rdzv_id, args.log_dir)
    if not found:
        where = (os.path.join(args.log_dir, EVENTS_FILE_NAME) if args.log_dir
                 else os.path.join(run_events_dir(args.rdzv_id), "*", EVENTS_FILE_NAME))
        raise FileNotFoundError(f"no events file at {where}")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """``spotrun report``: prints the report; 1 when there is nothing to report, 2 for unreadable input."""
    args = build_parser().parse_args(argv)
    try:
        inputs = load_inputs(events_files(args), args.journal, args.progress, args.worker_log)
    except OSError as exc:
        print(f"spotrun report: error: {exc}", file=sys.stderr)
        return 2
    if args.rdzv_id:
        inputs = dataclasses.replace(inputs, events=[e for e in inputs.events if e.get("run_id") == args.rdzv_id])
    for path, count in inputs.dropped.items():
        print(f"note: skipped {count} record(s) of {path} without a valid time")
    if not inputs.events:
        print("no events: nothing to report (is this a spotrun events.jsonl?)")
        return 1
    recs = recoveries(inputs.events, inputs.journal, inputs.progress, inputs.resumes)
    tot = totals(inputs.events, recs, inputs.progress)
    line = timeline(inputs.events, faults_from(inputs.journal), recs)
    t0 = line.t0
    print(f"== timeline ({len(line.nodes)} nodes, {len(inputs.events)} events; times from the first event)")
    print(render_events(inputs.events, t0, args.events_limit))
    print("\n== recoveries (seconds from the fault to each stage, cumulative)")
    print(render_recoveries(recs, tot.step_time, t0) if recs else "none")
    print("\n== totals")
    print(render_totals(tot))
    slow = straggler_lines(inputs.events, t0)
    if slow:
        print("\n== stragglers (elastic.straggler: slower than the local peers' median by the factor)")
        print("\n".join(slow))
    if recs:
        print("\n== per fault type and cause (median / worst)")
        print(render(summarize(recs)))
    if args.html:
        runs = sorted({str(e["run_id"]) for e in inputs.events if e.get("run_id")})
        write_html(args.html, line, recs, tot, title="spotrun report" + (f": run {', '.join(runs)}" if runs else ""))
        print(f"\nwrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
