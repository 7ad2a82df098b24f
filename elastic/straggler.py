"""Straggler detection: pure decisions over each local rank's step times (no I/O; ``elastic.vitals`` acts).

A rank's *step time* is the mean seconds per step over its last ``window`` steps, from the beat counter the hang
detection already samples (``elastic.progress``: one beat per optimizer step or ``heartbeat()``). A rank whose
step time exceeds ``factor`` times the median step time of its local peers is a *straggler*.

What this can see, and what not: the agent samples only its own node's workers, so peers are the local
ranks (no key is added to etcd). In a job whose ranks synchronise every step (DDP's gradient all-reduce, FSDP),
every rank completes each step when the slowest does, so their step times are equal and a slow rank shows as a
job-wide drop in ``spotrun_steps_per_second``, not as a straggler; it is named when ranks step at their own pace
(independent replicas, pipeline stages, local-SGD/DiLoCo-style training between synchronisations, workers
that each read and preprocess their own data).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic import options
from elastic.api import LaunchConfigError

DEFAULT_FACTOR = options.STRAGGLER_FACTOR.default
DEFAULT_WINDOW = options.STRAGGLER_WINDOW.default


@dataclass(kw_only=True, slots=True)
class StragglerPolicy:
    """When a rank counts as a straggler (``--straggler-factor``, ``--straggler-window``)."""

    factor: float = DEFAULT_FACTOR
    """A rank is a straggler when its step time exceeds this many times its peers' median (> 1)."""

    window: int = DEFAULT_WINDOW
    """Steps a rank's step time is averaged over; no rank is judged before it completed this many."""

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
                or not math.isfinite(self.factor) or self.factor <= 1:
            raise LaunchConfigError(f"--straggler-factor must be a finite number > 1, got {self.factor!r}; "
                                    f"e.g. --straggler-factor {DEFAULT_FACTOR} (or --straggler-factor 0 to turn it off)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not 2 <= self.window <= 10_000:
            raise LaunchConfigError(f"--straggler-window must be an integer from 2 to 10000 steps, got "
                                    f"{self.window!r}; e.g. --straggler-window {DEFAULT_WINDOW}")


@dataclass(slots=True)
class Pace:
    """One worker's beats as the agent saw them: (time, beats) at each sample where the count moved."""

    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4 * DEFAULT_WINDOW + 8))


def new_pace(window: int) -> Pace:
    return Pace(deque(maxlen=4 * window + 8))


def note(pace: Pace, now: float, beats: int) -> None:
    """Fold one sample in (a count that did not move, or went back, adds nothing)."""
    if not pace.samples or beats > pace.samples[-1][1]:
        pace.samples.append((now, beats))


def step_time(pace: Pace, window: int) -> float | None:
    """Mean seconds per step over the last ``window`` steps (or a little more: samples are taken per tick), or
    None before ``window`` steps were seen."""
    if not pace.samples:
        return None
    t_last, b_last = pace.samples[-1]
    for t, b in reversed(pace.samples):
        if b_last - b >= window:
            return (t_last - t) / (b_last - b)
    return None


def find_stragglers(step_times: Mapping[int, float], factor: float) -> dict[int, float]:
    """Rank -> its step time over its peers' median, for each rank slower than ``factor`` times that median.
    Needs at least two ranks; ranks whose peers show no time (median 0) are not judged."""
    out: dict[int, float] = {}
    if len(step_times) < 2:
        return out
    for rank, seconds in step_times.items():
        peers = statistics.median(t for r, t in step_times.items() if r != rank)
        if peers > 0 and seconds > factor * peers:
            out[rank] = seconds / peers
    return out
