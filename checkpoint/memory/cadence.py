"""How often to snapshot: the configured interval, or with ``every="auto"`` the smallest one whose staging blocks
at most ``overhead_target`` of the training time (``layout.choose_every``), from medians of recent step and
staging times, so one slow snapshot on a loaded host does not set the interval for the next hundred steps.
Times are passed in: no clock here."""

from __future__ import annotations

import logging
import statistics

from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.layout import choose_every
from checkpoint.memory.slots import SLOTS

logger = logging.getLogger(__name__)

STEP_SAMPLES = 16
"""Recent step times ``every="auto"`` takes the median of."""
STAGE_SAMPLES = 5
"""Recent snapshots' staging times ``every="auto"`` takes the median of."""


class Cadence:
    """The interval in use, and the step and staging times ``every="auto"`` chooses the next one from."""

    def __init__(self, config: MemoryTierConfig) -> None:
        self.config = config
        self.every = 1 if config.every == "auto" else int(config.every)
        """The interval in use (``"auto"`` starts at 1 and settles once step and staging times are measured)."""
        self.intervals: list[float] = []
        """Recent step times, without the staging they blocked for."""
        self.stages: list[float] = []
        """Staging seconds of the recent snapshots (not the first ``SLOTS`` of a plan: they map new slots)."""
        self.last_stage_seconds = 0.0
        """Seconds the last snapshot blocked the caller (flatten, the vote's own latency, copy; not the vote's wait
        for slower ranks, which the next gradient all-reduce would wait instead)."""
        self._stages_to_skip = SLOTS
        self._last_call: float | None = None
        self._staged_at: float | None = None
        self._sampled = False  # the last staging went into ``stages``

    def clock_step(self, now: float) -> None:
        """Time the step since the previous call (without the staging it blocked for)."""
        if self._last_call is not None:
            staged = self.last_stage_seconds if self._staged_at is not None and self._staged_at > self._last_call else 0.0
            self.intervals.append(max(0.0, now - self._last_call - staged))
            del self.intervals[:-STEP_SAMPLES]
        self._last_call = now

    def staged(self, seconds: float, now: float) -> None:
        """A periodic snapshot blocked the caller ``seconds``, ending at ``now``; the first ones of a plan map
        their slots, a one-off cost left out of the samples."""
        self.last_stage_seconds = seconds
        self._staged_at = now
        self._sampled = self._stages_to_skip <= 0
        if not self._sampled:
            self._stages_to_skip -= 1
            return
        self.stages.append(seconds)
        del self.stages[:-STAGE_SAMPLES]

    def blocked_more(self, seconds: float, now: float) -> None:
        """The last snapshot also blocked the caller ``seconds`` (``synchronous``: its publish and copies), ending
        at ``now``: counted as its staging, so ``every="auto"`` keeps the overhead target."""
        self.last_stage_seconds += seconds
        self._staged_at = now
        if self._sampled:
            self.stages[-1] += seconds

    def replanned(self) -> None:
        """A new plan: its first snapshots map new slots, and the old samples measured another layout."""
        self.stages, self._stages_to_skip = [], SLOTS

    def step_seconds(self) -> float:
        return statistics.median(self.intervals) if self.intervals else 0.0

    def stage_seconds(self) -> float:
        return statistics.median(self.stages) if self.stages else self.last_stage_seconds

    def propose(self) -> int:
        """This rank's interval for the next snapshots (the slowest rank's wins in the vote)."""
        if self.config.every != "auto":
            return int(self.config.every)
        if len(self.intervals) < 2 or not self.stages:
            return self.every  # nothing measured yet: keep snapshotting to measure
        return choose_every(self.step_seconds(), self.stage_seconds(), self.config.overhead_target,
                            self.config.max_every)

    def adopt(self, every: int, *, rank: int, step: int) -> None:
        """Use the interval the ranks agreed on (the same on every rank from the next step)."""
        if every == self.every:
            return
        logger.info("[rank %d step %d] memory snapshot every %d step(s) (was %d): %.4fs staging per snapshot, "
                    "%.4fs per step, overhead target %.1f%%", rank, step, every, self.every,
                    self.stage_seconds(), self.step_seconds(), 100 * self.config.overhead_target)
        self.every = int(every)
