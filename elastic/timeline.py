"""A job's recoveries and timeline as plain data: what ``spotrun report`` computes (``elastic.report``) and its
text and HTML pages (``elastic.report_html``) draw. Pure: dataclasses, constants and the cost of a recovery."""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("detection", "stop", "rendezvous", "process_start", "checkpoint_load", "first_step")
NO_RECOVERY = "none"
"""The cause column of a fault that needed no recovery."""


SEGMENT_KINDS = ("training", "detection", "stop", "rendezvous", "start", "load", "first_step")
"""What a node was doing in a timeline segment: training, or one stage of a recovery (the stage it is in is
named after the event that ends it: ``stop`` lasts until ``workers_stopped``)."""


@dataclass(slots=True)
class Fault:
    kind: str
    t_wall: float


@dataclass(slots=True)
class Recovery:
    """One recovery of the job, attributed to a fault (or not); stages in seconds from its origin."""

    cause: str
    fault: Fault | None
    origin: float
    """Wall time the clock starts at: the fault's injection, else the detection."""
    stages: dict[str, float | None] = field(default_factory=dict)
    steps_lost: int | None = None
    restore_source: str | None = None
    """Where the workers restored from after it (``restore_completed``: memory_local, memory_peer, durable)."""

    @property
    def kind(self) -> str:
        return self.fault.kind if self.fault is not None else "-"


@dataclass(frozen=True, slots=True)
class Segment:
    """A span of one node's time: ``kind`` is one of :data:`SEGMENT_KINDS`."""

    node: str
    kind: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Marker:
    """An instant on the timeline: an event of one node, or a fault (``node`` None: the whole job)."""

    node: str | None
    kind: str
    t: float
    label: str


@dataclass(frozen=True, slots=True)
class Timeline:
    """Nodes (rows, in order of first appearance) x wall time: segments and markers, for text and HTML."""

    nodes: tuple[str, ...]
    segments: tuple[Segment, ...]
    markers: tuple[Marker, ...]
    t0: float
    t1: float


@dataclass(frozen=True, slots=True)
class Totals:
    """What the faults cost the job, in seconds of wall time."""

    span: float
    """From the first ``workers_started`` to the last event."""
    lost: float
    """Sum over recoveries of :func:`recovery_cost`."""
    lost_by_cause: dict[str, float]
    recoveries: int
    steps_redone: int | None
    """Steps trained again after the recoveries; None when unknown (recoveries, but no progress telling how many
    steps any of them redid)."""
    step_time: float | None
    """Median seconds between two consecutive steps in the progress file (None without one)."""

    @property
    def effective_ratio(self) -> float:
        """Share of the span spent training forward (1.0 when nothing was lost or nothing ran)."""
        return 1.0 if self.span <= 0 else max(0.0, 1.0 - self.lost / self.span)


def stage_end(rec: Recovery) -> float:
    """Seconds from a recovery's origin to the last stage seen (0 when none was)."""
    return max([v for v in rec.stages.values() if v is not None], default=0.0)


def steps_redone_text(tot: Totals) -> str:
    """The steps redone as the report shows them: a count, or ``unknown`` (no progress data)."""
    return "unknown" if tot.steps_redone is None else str(tot.steps_redone)


def recovery_cost(rec: Recovery, seconds_per_step: float | None) -> float:
    """Seconds a recovery took from training: fault (or detection) to its last stage seen, plus the redone
    steps' time. A fault that caused no recovery costs nothing."""
    if rec.cause == NO_RECOVERY:
        return 0.0
    redo = (rec.steps_lost or 0) * (seconds_per_step or 0.0)
    return stage_end(rec) + redo
