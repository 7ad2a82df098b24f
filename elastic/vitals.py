"""The agent's watch on training progress and durability: metrics each tick, and straggler detection.

Reads what the agent already has on its node, once per :data:`TICK_INTERVAL` (the agent calls :meth:`Vitals.tick`
every monitor tick; the rest are no-ops): each local worker's beats and reported step (the hang watch's samples
of the progress files, ``elastic.progress``), the checkpointer's save records in the keeper directory
(``checkpoint.save_record``) and the memory tier's published snapshots there (``checkpoint.memory.layout``).
It sets the progress and durability metrics (``elastic.metrics``, when ``--metrics-port`` is on) and judges
stragglers (``elastic.straggler``): a newly slow rank gets one ``straggler_detected`` event (and
``straggler_cleared`` once it is back within the factor).

Nothing read is trusted: save records are parsed and range-checked (a bad one is skipped), snapshot names
are matched whole, and every listing is bounded.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from torch.distributed.elastic.rendezvous import RendezvousError

from checkpoint.memory.layout import parse_snapshot_name
from checkpoint.save_record import SaveRecord, read_save_records
from elastic.agent_hooks import PROCEED, AgentFeature, AgentHost, Tick, Verdict, WorkersStarted
from elastic.api import RecoveryEvent
from elastic.hangwatch import HangWatch
from elastic.membership import MembershipView, first_line
from elastic.metrics import AgentMetrics
from elastic.rendezvous.api import HealthReportingHandler
from elastic.straggler import Pace, StragglerPolicy, find_stragglers, new_pace, note, step_time

logger = logging.getLogger(__name__)

TICK_INTERVAL: Final = 1.0
"""Seconds between two looks (the monitor loop ticks every ``--monitor-interval``, 0.1 s by default)."""
MAX_DIR_ENTRIES: Final = 4096
"""Most keeper directory entries one look scans for snapshots."""


@dataclass(frozen=True, slots=True)
class WorkerProgress:
    """One local worker as the hang watch last sampled it."""

    beats: int
    step: int | None
    """The step it reported (``elastic.progress.report_step``), None when it never did."""


@dataclass(slots=True)
class _Seen:
    """A worker's save record as last folded into the counters (a new pid restarts its counts)."""

    pid: int
    committed: int = 0
    failed: int = 0
    seconds: float = 0.0
    nbytes: int = 0


class Vitals:
    """Progress, durability and stragglers of one agent's local workers (one tick per monitor loop pass)."""

    def __init__(self, *, metrics: AgentMetrics | None, emit: Callable[..., None],
                 straggler: StragglerPolicy | None, memory_dir: str | None, ctx: Callable[[], str] = lambda: "",
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 interval: float = TICK_INTERVAL) -> None:
        self._metrics = metrics
        self._emit = emit
        self._policy = straggler
        self._memory_dir = memory_dir
        self._ctx = ctx
        self._clock = clock
        self._wall_clock = wall_clock
        self._interval = interval
        self._next_at = 0.0
        self._ranks: dict[int, int] = {}
        """local rank -> global rank of the running workers."""
        self._paces: dict[int, Pace] = {}
        self._slowest_beats = 0
        self._stragglers: dict[int, float] = {}
        """local rank -> ratio, for the ranks currently named stragglers."""
        self._seen: dict[int, _Seen] = {}
        self._durable: tuple[int, float] | None = None
        self._save_interval: float | None = None

    def started(self, ranks: Mapping[int, int]) -> None:
        """New workers (local rank -> global rank): their beats start at 0, stragglers are judged afresh."""
        self._ranks = dict(ranks)
        window = self._policy.window if self._policy is not None else 20
        self._paces = {local: new_pace(window) for local in ranks}
        self._slowest_beats = 0
        self._stragglers.clear()
        if self._metrics is not None:
            self._metrics.stragglers.set(0)
            self._metrics.step_time_ratio.clear()
            self._metrics.steps_per_second.set(0)  # no pace until the new workers stepped a window

    def tick(self, progress: Mapping[int, WorkerProgress], *, unreachable_for: float = 0.0) -> None:
        """Look (at most once per interval): the workers' progress, the save records, the snapshots.
        ``unreachable_for``: seconds the rendezvous has been failing (0 while it answers)."""
        now = self._clock()
        if now < self._next_at:
            return
        self._next_at = now + self._interval
        try:
            if self._metrics is not None:
                self._metrics.etcd_unreachable.set(unreachable_for)
            self._progress(progress, now)
            if self._memory_dir is not None:
                self._durability(read_save_records(self._memory_dir))
                self._snapshots()
        except Exception:  # watching must never take the agent down (logged, so not blind)
            logger.warning("%s could not update the progress metrics", self._ctx(), exc_info=True)

    # --- progress and stragglers ------------------------------------------------------------------------

    def _progress(self, progress: Mapping[int, WorkerProgress], now: float) -> None:
        present = {r: p for r, p in progress.items() if r in self._paces}
        for local, p in present.items():
            note(self._paces[local], now, p.beats)
        m = self._metrics
        if present and m is not None:
            slowest = min(p.beats for p in present.values())
            if slowest > self._slowest_beats:
                m.steps.inc(slowest - self._slowest_beats)
                self._slowest_beats = slowest
            steps = [p.step for p in present.values()]
            if all(s is not None for s in steps):
                m.training_step.set(min(s for s in steps if s is not None))
            rates = [self._rate(pace, now) for pace in self._paces.values()]
            if rates and all(r is not None for r in rates):
                m.steps_per_second.set(min(r for r in rates if r is not None))
        if self._policy is not None:
            self._judge(self._policy)

    def _rate(self, pace: Pace, now: float) -> float | None:
        """Steps per second over the last window, counting the time since the last beat (a stall shows)."""
        window = self._policy.window if self._policy is not None else 20
        seconds = step_time(pace, window)
        if seconds is None or not pace.samples:
            return None
        t_last, b_last = pace.samples[-1]
        first = next((t for t, b in reversed(pace.samples) if b_last - b >= window), t_last)
        span = max(now, t_last) - first
        return window / span if span > 0 else None

    def _judge(self, policy: StragglerPolicy) -> None:
        times = {local: t for local, pace in self._paces.items() if (t := step_time(pace, policy.window)) is not None}
        slow = find_stragglers(times, policy.factor) if len(times) == len(self._paces) else {}
        m = self._metrics
        if m is not None:
            for local, t in times.items():
                peers = [v for r, v in times.items() if r != local]
                if peers and statistics.median(peers) > 0:
                    m.step_time_ratio.labels(str(local)).set(t / statistics.median(peers))
        for local, ratio in slow.items():
            if local in self._stragglers:
                continue
            median = statistics.median(v for r, v in times.items() if r != local)
            rank = self._ranks.get(local)
            logger.warning("%s rank %s (local rank %d) is a straggler: %.3f s per step, %.2fx its local peers' "
                           "median %.3f s over the last %d steps (factor %.2f)", self._ctx(), rank, local,
                           times[local], ratio, median, policy.window, policy.factor)
            self._emit(RecoveryEvent.STRAGGLER_DETECTED, rank=rank, local_rank=local, step_time=round(times[local], 6),
                       peers_step_time=round(median, 6), ratio=round(ratio, 3), factor=policy.factor,
                       window=policy.window)
            if m is not None:
                m.stragglers_detected.inc()
        for local in [r for r in self._stragglers if r not in slow]:
            rank = self._ranks.get(local)
            logger.info("%s rank %s (local rank %d) is no longer a straggler", self._ctx(), rank, local)
            self._emit(RecoveryEvent.STRAGGLER_CLEARED, rank=rank, local_rank=local)
        self._stragglers = dict(slow)
        if m is not None:
            m.stragglers.set(len(slow))

    @property
    def stragglers(self) -> dict[int, float]:
        """Global rank -> step time ratio of the ranks currently named stragglers."""
        return {self._ranks.get(local, local): ratio for local, ratio in self._stragglers.items()}

    # --- durability ---------------------------------------------------------------------------------------

    def _durability(self, records: list[SaveRecord]) -> None:
        m = self._metrics
        committed = failed = 0
        seconds = 0.0
        nbytes = 0
        last_seconds: float | None = None
        for r in records:
            seen = self._seen.get(r.rank)
            if seen is None or seen.pid != r.pid or r.saves_committed < seen.committed or r.saves_failed < seen.failed:
                seen = _Seen(pid=r.pid)  # a new process of this rank: its counts start again
            d_committed, d_failed = r.saves_committed - seen.committed, r.saves_failed - seen.failed
            committed, failed = max(committed, d_committed), max(failed, d_failed)
            seconds = max(seconds, r.save_seconds_total - seen.seconds)
            nbytes += max(0, r.save_bytes_total - seen.nbytes)
            if d_committed and r.last_save_seconds is not None:
                last_seconds = max(last_seconds or 0.0, r.last_save_seconds)
            self._seen[r.rank] = _Seen(r.pid, r.saves_committed, r.saves_failed, r.save_seconds_total,
                                       r.save_bytes_total)
            if r.durable_step is not None and r.durable_unix is not None:
                self._note_durable(r.durable_step, r.durable_unix)
        if m is None:
            return
        # Every rank learns the same outcome of each save (the checkpointer broadcasts it): a save counts once
        # per node; bytes are what the local ranks wrote together, seconds the slowest rank's.
        if committed:
            m.saves.labels("committed").inc(committed)
        if failed:
            m.saves.labels("failed").inc(failed)
        if seconds > 0:
            m.save_seconds.inc(seconds)
        if nbytes:
            m.save_bytes.inc(nbytes)
        if last_seconds is not None:
            m.last_save_seconds.set(last_seconds)
        if self._durable is not None:
            step, at = self._durable
            m.durable_step.set(step)
            m.durable_timestamp.set(at)
            m.durable_age.set(max(0.0, self._wall_clock() - at))
        if self._save_interval is not None:
            m.save_interval.set(self._save_interval)

    def _note_durable(self, step: int, at: float) -> None:
        if self._durable is None or step > self._durable[0]:
            if self._durable is not None and at > self._durable[1]:
                self._save_interval = at - self._durable[1]
            self._durable = (step, at)

    def _snapshots(self) -> None:
        m = self._metrics
        if m is None or self._memory_dir is None:
            return
        newest: tuple[int, float] | None = None
        try:
            with os.scandir(self._memory_dir) as it:
                for i, entry in enumerate(it):
                    if i >= MAX_DIR_ENTRIES:
                        break
                    parsed = parse_snapshot_name(entry.name)
                    if parsed is None or (newest is not None and parsed[0].step <= newest[0]):
                        continue
                    try:
                        newest = (parsed[0].step, entry.stat(follow_symlinks=False).st_mtime)
                    except OSError:
                        continue  # replaced by a newer snapshot meanwhile
        except OSError:
            return
        if newest is not None:
            m.memory_step.set(newest[0])
            m.memory_timestamp.set(newest[1])
            m.memory_age.set(max(0.0, self._wall_clock() - newest[1]))


def progress_of(beats: Mapping[int, int], steps: Mapping[int, int | None]) -> dict[int, WorkerProgress]:
    """The hang watch's samples as :meth:`Vitals.tick` takes them (local rank -> progress)."""
    return {local: WorkerProgress(b, steps.get(local)) for local, b in beats.items()}



class VitalsFeature(AgentFeature):
    """The agent's hook of :class:`Vitals`: new ranks at each start, one look per tick, and this node's straggler
    report for ``spotrun status`` whenever its set of stragglers changed (not while the rendezvous is failing:
    the monitor loop must not wait on it)."""

    def __init__(self, vitals: Vitals, host: AgentHost, membership: MembershipView, hang: HangWatch | None) -> None:
        self.vitals = vitals
        self._host = host
        self._membership = membership
        self._hang = hang
        self._published: set[int] = set()
        """Global ranks of the stragglers in this node's last health report."""

    def on_workers_started(self, event: WorkersStarted) -> None:
        self.vitals.started(event.global_ranks)

    def on_tick(self, tick: Tick) -> Verdict:
        hw = self._hang
        unreachable_for = self._membership.unreachable_for()
        self.vitals.tick(progress_of(hw.beats(), hw.steps()) if hw is not None else {},
                         unreachable_for=unreachable_for or 0.0)
        slow = self.vitals.stragglers
        handler = self._membership.handler
        if set(slow) == self._published or unreachable_for is not None \
                or not isinstance(handler, HealthReportingHandler):
            return PROCEED
        try:
            handler.publish_health({"stragglers": {str(r): round(x, 3) for r, x in slow.items()}} if slow else None)
            self._published = set(slow)
        except RendezvousError as exc:
            logger.warning("%s could not publish the stragglers for spotrun status: %s", self._host.ctx(),
                           first_line(exc))
        return PROCEED
