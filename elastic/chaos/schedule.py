"""Schedules: read from JSON, generated from a seed, and the pure decision of which faults are due."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from elastic.chaos.api import ChaosScheduleError, Fault, FaultKind, Schedule

_FAULT_KEYS = {"kind", "target", "at_s", "at_step", "after", "after_s", "duration_s", "params"}


def schedule_from_json(data: Any) -> Schedule:
    """A :class:`Schedule` from parsed JSON ``{"seed": N, "faults": [{"kind": ..., "at_s": ...}, ...]}``."""
    if not isinstance(data, dict):
        raise ChaosScheduleError(f"a schedule is a JSON object with 'seed' and 'faults', got {type(data).__name__}")
    unknown = set(data) - {"seed", "faults"}
    if unknown:
        raise ChaosScheduleError(f"unknown schedule keys {sorted(unknown)}; accepted: faults, seed")
    raw = data.get("faults", [])
    if not isinstance(raw, list):
        raise ChaosScheduleError("'faults' must be a list of objects")
    faults = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ChaosScheduleError(f"faults[{i}] must be an object, got {item!r}")
        bad = set(item) - _FAULT_KEYS
        if bad:
            raise ChaosScheduleError(f"faults[{i}]: unknown keys {sorted(bad)}; accepted: {', '.join(sorted(_FAULT_KEYS))}")
        if "kind" not in item:
            raise ChaosScheduleError(f"faults[{i}]: missing 'kind'")
        try:
            faults.append(Fault(**item))
        except ChaosScheduleError as exc:
            raise ChaosScheduleError(f"faults[{i}]: {exc}") from None
        except TypeError as exc:
            raise ChaosScheduleError(f"faults[{i}]: {exc}") from None
    return Schedule(seed=data.get("seed", 0), faults=tuple(faults))


def load_schedule(path: str) -> Schedule:
    """Read a schedule file; a missing file or bad JSON is a :class:`ChaosScheduleError` naming the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise ChaosScheduleError(f"cannot read schedule {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ChaosScheduleError(f"schedule {path} is not valid JSON: {exc}") from exc
    try:
        return schedule_from_json(data)
    except ChaosScheduleError as exc:
        raise ChaosScheduleError(f"schedule {path}: {exc}") from None


SURVIVABLE_KINDS: tuple[FaultKind, ...] = (FaultKind.KILL_WORKER, FaultKind.KILL_AGENT, FaultKind.TERM_AGENT)
"""Default kinds of :func:`random_schedule`: each costs exactly one restart of a single-agent job."""


def random_schedule(
    seed: int,
    *,
    duration_s: float,
    count: int,
    kinds: Sequence[FaultKind] = SURVIVABLE_KINDS,
    min_gap_s: float = 0.0,
) -> Schedule:
    """``count`` faults of ``kinds`` at seeded times in ``[0, duration_s)``, at least ``min_gap_s`` apart
    (so each recovery ends before the next fault). Same seed, same schedule."""
    if count < 0 or duration_s <= 0 or not kinds:
        raise ChaosScheduleError("random_schedule needs count >= 0, duration_s > 0 and at least one kind")
    if count and min_gap_s * count > duration_s:
        raise ChaosScheduleError(f"{count} faults {min_gap_s} s apart do not fit in {duration_s} s")
    rng = random.Random(seed)
    # Spread: draw count points in the slack, then add the gaps back, which keeps them min_gap_s apart.
    slack = duration_s - min_gap_s * count
    points = sorted(rng.uniform(0, slack) for _ in range(count))
    faults = tuple(
        Fault(kind=rng.choice(list(kinds)), at_s=round(p + i * min_gap_s, 3)) for i, p in enumerate(points)
    )
    return Schedule(seed=seed, faults=faults)


def due(schedule: Schedule, fired: Iterable[int] | Mapping[int, float], elapsed_s: float, step: int | None) -> list[int]:
    """Indices of faults not yet ``fired`` whose trigger is reached at ``elapsed_s`` seconds and training
    ``step`` (None: no progress known, step triggers wait), in trigger order. ``fired`` maps each fired fault
    to the ``elapsed_s`` it fired at (a plain iterable of indices: ``after`` triggers never come due)."""
    fired_at = fired if isinstance(fired, Mapping) else dict.fromkeys(fired, math.inf)
    ready = []
    for i, fault in enumerate(schedule.faults):
        if i in fired_at:
            continue
        if fault.at_s is not None and elapsed_s >= fault.at_s or fault.at_step is not None and step is not None and step >= fault.at_step or fault.after is not None and fault.after in fired_at and elapsed_s >= fired_at[fault.after] + fault.after_s:
            ready.append(i)
    return ready


def next_wake(schedule: Schedule, fired: Iterable[int] | Mapping[int, float], elapsed_s: float) -> float | None:
    """Seconds until the next time-triggered fault (None: none left; step triggers are polled)."""
    fired_at = fired if isinstance(fired, Mapping) else dict.fromkeys(fired, math.inf)
    times = [f.at_s for i, f in enumerate(schedule.faults) if i not in fired_at and f.at_s is not None]
    times += [fired_at[f.after] + f.after_s for i, f in enumerate(schedule.faults)
              if i not in fired_at and f.after is not None and f.after in fired_at and fired_at[f.after] < math.inf]
    return max(0.0, min(times) - elapsed_s) if times else None
