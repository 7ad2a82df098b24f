"""``OutageClock``: how long the rendezvous has been failing, and when that stops being transient.

The agent asks its rendezvous handler about membership every monitor tick. A failed query is transient while
the backend restarts or elects a leader, but a job whose backend stays away keeps training with no
coordination: nobody would notice a lost peer or a joining node, and the job could even end with exit 0
after the rest of the group is gone. The clock turns a run of failures into a verdict: tolerate them within
``bound`` (the rendezvous' ``etcd_timeout``), warn once when they start and then every ``remind_every``
seconds (not every 0.1 s tick), and declare the outage fatal past the bound. One success resets it.

Pure: the caller passes the time (``time.monotonic()`` in the agent, plain numbers in tests).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

DEFAULT_REMIND_EVERY_S = 5.0
"""Seconds between two warnings of one outage (the first comes at once)."""


class OutageVerdict(enum.Enum):
    """What the caller does with one observation."""

    OK = "ok"
    """Success, no outage was going on: nothing to say."""
    RECOVERED = "recovered"
    """Success after failures: say once that the backend is back."""
    WARN = "warn"
    """A failure, and a warning is due (the first of this outage, or ``remind_every`` after the last)."""
    QUIET = "quiet"
    """A failure within the bound, warned about recently: say nothing."""
    FATAL = "fatal"
    """Failing continuously for longer than the bound: end the job."""


@dataclass(frozen=True, slots=True)
class Observation:
    """A verdict with the numbers its log line needs."""

    verdict: OutageVerdict
    failing_for: float
    """Seconds since the first failure of the current outage (for RECOVERED: how long it lasted)."""
    fatal_in: float
    """Seconds left before the outage becomes fatal (0 once FATAL; ``bound`` when no outage)."""


@dataclass(slots=True)
class OutageClock:
    """Counts a continuous run of failures against ``bound`` seconds."""

    bound: float
    """Seconds of continuous failure that are still transient (the rendezvous' ``etcd_timeout``)."""
    remind_every: float = DEFAULT_REMIND_EVERY_S
    """Seconds between two warnings of one outage."""
    since: float | None = None
    """Time of the first failure of the current outage; None while the backend answers."""
    warned_at: float | None = None
    """Time of the last warning of the current outage."""

    def __post_init__(self) -> None:
        for name in ("bound", "remind_every"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"OutageClock.{name} must be a finite number of seconds > 0, got {value!r}")

    def observe(self, ok: bool, now: float) -> Observation:
        """Record one query's outcome at ``now`` and say what to do about it."""
        if ok:
            lasted = 0.0 if self.since is None else now - self.since
            verdict = OutageVerdict.OK if self.since is None else OutageVerdict.RECOVERED
            self.since = self.warned_at = None
            return Observation(verdict, lasted, self.bound)
        if self.since is None:
            self.since = now
        failing_for = now - self.since
        if failing_for > self.bound:
            return Observation(OutageVerdict.FATAL, failing_for, 0.0)
        fatal_in = self.bound - failing_for
        if self.warned_at is None or now - self.warned_at >= self.remind_every:
            self.warned_at = now
            return Observation(OutageVerdict.WARN, failing_for, fatal_in)
        return Observation(OutageVerdict.QUIET, failing_for, fatal_in)
