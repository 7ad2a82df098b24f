"""Prometheus metrics of the agent (``--metrics-port``, env ``SPOTRUN_METRICS_PORT``; off by default).

The metrics are derived from the recovery events and nothing else: :class:`MetricsSink` wraps the agent's
:class:`~elastic.api.EventSink` (the ``events.jsonl`` writer), forwards every event unchanged and then updates
the metrics from it, so a scrape and ``spotrun report`` on the events file can never disagree on what
happened. The update is a pure function of (event, fields, time) over :class:`AgentMetrics`; the HTTP server
(prometheus-client's, in a daemon thread) is started and stopped by :func:`serve`.

Exposed (Prometheus text format, ``GET /metrics``)::

    spotrun_restarts_total{cause}                 worker group restarts, by recovery cause
    spotrun_failures_detected_total{cause}        failure_detected events, by their (finer) cause
    spotrun_recovery_stage_seconds{stage}         histogram: stop, rendezvous, start, total (first event of
                                                  the recovery on this node -> its workers_started)
    spotrun_world_size / spotrun_group_world_size gauges (workers / nodes of the current round)
    spotrun_rendezvous_round                      gauge: the rendezvous round this node is in
    spotrun_notices_received_total{source}        preemption notices this node received
    spotrun_planned_leaves_total{saved}           this node left for its notice, its step saved or not
    spotrun_planned_restarts_total                the group re-formed at an agreed step (not a failure)
    spotrun_hang_detections_total                 hung local worker groups killed
    spotrun_etcd_outages_total / spotrun_etcd_outage_seconds_total
                                                  rendezvous outages ridden out (or fatal) and their length

Progress and durability (``elastic.vitals``, once a second from the workers' progress files, the
checkpointer's save records and the memory tier's snapshots in the keeper directory; gauges appear once known)::

    spotrun_training_step                         the step every local worker completed (elastic.progress.
                                                  report_step; Preemption.save_and_stop reports it)
    spotrun_training_steps_total                  steps the slowest local worker completed (its beats)
    spotrun_steps_per_second                      the slowest local worker's pace over the straggler window
    spotrun_checkpoint_durable_step               last step committed to the durable tier
    spotrun_checkpoint_durable_timestamp_seconds  when it committed (Unix s); _age_seconds: how long ago
    spotrun_checkpoint_save_interval_seconds      time between the last two commits
    spotrun_checkpoint_saves_total{outcome}       committed / failed saves (once per node and save)
    spotrun_checkpoint_save_seconds_total         save() -> commit seconds (slowest local rank), summed
    spotrun_checkpoint_save_bytes_total           bytes the local ranks wrote for committed saves
    spotrun_checkpoint_last_save_seconds          the last committed save's seconds
    spotrun_memory_snapshot_step                  newest memory tier snapshot on this node
    spotrun_memory_snapshot_timestamp_seconds     when it was written; _age_seconds: how long ago
    spotrun_etcd_unreachable_seconds              how long the rendezvous has been failing now (0: it answers)
    spotrun_stragglers                            local ranks named stragglers now (elastic.straggler)
    spotrun_stragglers_detected_total             straggler_detected events
    spotrun_step_time_ratio{local_rank}           each local rank's step time over its local peers' median

Every labelled counter is created at 0 for each of its known label values (:data:`LABEL_VALUES`), so that
``increase()`` and absence alerts work from the first scrape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from checkpoint.memory.api import RestoreSource
from elastic.api import EventSink, FailureCause, RecoveryCause, RecoveryEvent
from elastic.notice import SOURCES

logger = logging.getLogger(__name__)

STAGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Histogram buckets (seconds) of the recovery stages: a warm restart takes ~1 s, a cold one tens."""

_STAGE_OF = {
    RecoveryEvent.WORKERS_STOPPED: "stop",
    RecoveryEvent.RENDEZVOUS_COMPLETED: "rendezvous",
    RecoveryEvent.WORKERS_STARTED: "start",
}


LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "restarts": tuple(c.value for c in RecoveryCause),
    "failures": tuple(c.value for c in FailureCause),
    "notices": ("sigterm", *SOURCES),
    "planned_leaves": ("true", "false"),
    "restores": (*(s.value for s in RestoreSource), "mixed"),
    "saves": ("committed", "failed"),
}
"""The label values each labelled counter starts with at 0 (attribute name -> values); others appear as seen."""


class AgentMetrics:
    """The agent's metric families, registered in their own registry (one per agent: tests run several)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.restarts = Counter("spotrun_restarts", "Worker group restarts, by recovery cause.", ["cause"], registry=r)
        self.failures = Counter("spotrun_failures_detected", "Failures detected by the agent, by cause.", ["cause"],
                                registry=r)
        self.stage_seconds = Histogram("spotrun_recovery_stage_seconds",
                                       "Seconds each recovery stage took on this node (total: the whole recovery).",
                                       ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.world_size = Gauge("spotrun_world_size", "Workers in the job (WORLD_SIZE) in the current round.",
                                registry=r)
        self.group_world_size = Gauge("spotrun_group_world_size", "Nodes in the current round.", registry=r)
        self.round = Gauge("spotrun_rendezvous_round", "Rendezvous round this node is in.", registry=r)
        self.notices = Counter("spotrun_notices_received", "Preemption notices this node received, by source.",
                               ["source"], registry=r)
        self.planned_leaves = Counter("spotrun_planned_leaves", "This node left the group for its notice.",
                                      ["saved"], registry=r)
        self.planned_restarts = Counter("spotrun_planned_restarts", "The group re-formed at an agreed step.",
                                        registry=r)
        self.hangs = Counter("spotrun_hang_detections", "Hung local worker groups detected and killed.", registry=r)
        self.outages = Counter("spotrun_etcd_outages", "Rendezvous (etcd) outages, ridden out or fatal.", registry=r)
        self.outage_seconds = Counter("spotrun_etcd_outage_seconds", "Seconds the rendezvous was unreachable.",
                                      registry=r)
        self.restores = Counter("spotrun_restores", "Worker restores on this node, by source (memory_local, "
                                "memory_peer, durable).", ["source"], registry=r)
        self.restore_seconds = Histogram("spotrun_restore_seconds", "Seconds the slowest local worker took to "
                                         "restore its state, by source.", ["source"], buckets=STAGE_BUCKETS,
                                         registry=r)
        self.training_step = Gauge("spotrun_training_step", "The training step every local worker completed "
                                   "(as reported by elastic.progress.report_step).", registry=r)
        self.steps = Counter("spotrun_training_steps", "Steps the slowest local worker completed (optimizer "
                             "steps or heartbeats), over every restart.", registry=r)
        self.steps_per_second = Gauge("spotrun_steps_per_second", "Steps per second of the slowest local worker "
                                      "over its recent steps.", registry=r)
        self.durable_step = Gauge("spotrun_checkpoint_durable_step", "Last step committed to the durable tier.",
                                  registry=r)
        self.durable_timestamp = Gauge("spotrun_checkpoint_durable_timestamp_seconds",
                                       "When the last durable step committed (Unix seconds).", registry=r)
        self.durable_age = Gauge("spotrun_checkpoint_durable_age_seconds",
                                 "Seconds since the last durable step committed.", registry=r)
        self.save_interval = Gauge("spotrun_checkpoint_save_interval_seconds",
                                   "Seconds between the last two durable commits.", registry=r)
        self.saves = Counter("spotrun_checkpoint_saves", "Durable checkpoint saves, by outcome (committed, "
                             "failed), once per node and save.", ["outcome"], registry=r)
        self.save_seconds = Counter("spotrun_checkpoint_save_seconds", "Seconds from save() to the commit of "
                                    "the committed saves (slowest local rank), summed.", registry=r)
        self.save_bytes = Counter("spotrun_checkpoint_save_bytes", "Bytes the local ranks wrote for committed "
                                  "saves.", registry=r)
        self.last_save_seconds = Gauge("spotrun_checkpoint_last_save_seconds",
                                       "Seconds from save() to the commit of the last committed save.", registry=r)
        self.memory_step = Gauge("spotrun_memory_snapshot_step", "Newest memory tier snapshot on this node.",
                                 registry=r)
        self.memory_timestamp = Gauge("spotrun_memory_snapshot_timestamp_seconds",
                                      "When the newest memory snapshot was written (Unix seconds).", registry=r)
        self.memory_age = Gauge("spotrun_memory_snapshot_age_seconds",
                                "Seconds since the newest memory snapshot was written.", registry=r)
        self.etcd_unreachable = Gauge("spotrun_etcd_unreachable_seconds", "Seconds the rendezvous (etcd) has "
                                      "been failing now (0 while it answers).", registry=r)
        self.stragglers = Gauge("spotrun_stragglers", "Local ranks named stragglers now.", registry=r)
        self.stragglers_detected = Counter("spotrun_stragglers_detected", "Ranks named stragglers "
                                           "(straggler_detected events).", registry=r)
        self.step_time_ratio = Gauge("spotrun_step_time_ratio", "Each local rank's step time over the median of "
                                     "its local peers'.", ["local_rank"], registry=r)
        for name, values in LABEL_VALUES.items():
            family = getattr(self, name)
            for value in values:
                family.labels(value)
        for stage in (*_STAGE_OF.values(), "total"):
            self.stage_seconds.labels(stage)


@dataclass(slots=True)
class RecoveryClock:
    """When this node's current recovery began and when it last reached a stage (monotonic seconds)."""

    began: float | None = None
    last: float | None = None
    stages: dict[str, float] = field(default_factory=dict)


def observe(metrics: AgentMetrics, clock: RecoveryClock, event: RecoveryEvent, fields: dict[str, Any],
            now: float) -> None:
    """Update ``metrics`` (and the recovery ``clock``) from one event emitted at ``now``."""
    cause = fields.get("recovery_cause")
    if cause and clock.began is None:
        clock.began = clock.last = now
    stage = _STAGE_OF.get(event)
    if stage is not None and clock.began is not None and clock.last is not None:
        metrics.stage_seconds.labels(stage).observe(max(0.0, now - clock.last))
        clock.last = now
    if event is RecoveryEvent.WORKERS_STARTED:
        if cause and clock.began is not None:
            metrics.stage_seconds.labels("total").observe(max(0.0, now - clock.began))
            metrics.restarts.labels(str(cause)).inc()
        clock.began = clock.last = None
    elif event is RecoveryEvent.RUN_FINISHED:
        clock.began = clock.last = None
    _observe_counts(metrics, event, fields)
    _observe_gauges(metrics, event, fields)


def _observe_counts(metrics: AgentMetrics, event: RecoveryEvent, fields: dict[str, Any]) -> None:
    if event is RecoveryEvent.FAILURE_DETECTED:
        metrics.failures.labels(str(fields.get("cause", "unknown"))).inc()
    elif event is RecoveryEvent.NOTICE_RECEIVED:
        metrics.notices.labels(str(fields.get("source", "unknown"))).inc()
    elif event is RecoveryEvent.PLANNED_LEAVE:
        metrics.planned_leaves.labels("true" if fields.get("saved") else "false").inc()
    elif event is RecoveryEvent.PLANNED_RESTART:
        metrics.planned_restarts.inc()
    elif event is RecoveryEvent.HANG_DETECTED:
        metrics.hangs.inc()
    elif event is RecoveryEvent.RESTORE_COMPLETED:
        metrics.restores.labels(str(fields.get("restore_source", "unknown"))).inc()
        seconds = fields.get("restore_seconds")
        if isinstance(seconds, (int, float)) and seconds >= 0:
            metrics.restore_seconds.labels(str(fields.get("restore_source", "unknown"))).observe(float(seconds))
    elif event is RecoveryEvent.ETCD_OUTAGE:
        metrics.outages.inc()
        seconds = fields.get("seconds")
        if isinstance(seconds, (int, float)) and seconds > 0:
            metrics.outage_seconds.inc(float(seconds))


def _observe_gauges(metrics: AgentMetrics, event: RecoveryEvent, fields: dict[str, Any]) -> None:
    if event is not RecoveryEvent.WORKERS_STARTED:
        return  # the round's sizes are settled once its workers run
    for gauge, name in ((metrics.world_size, "world_size"), (metrics.group_world_size, "group_world_size"),
                        (metrics.round, "rdzv_round")):
        value = fields.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            gauge.set(value)


class MetricsSink:
    """An :class:`~elastic.api.EventSink` that forwards to ``inner``, then updates :class:`AgentMetrics`."""

    def __init__(self, inner: EventSink, metrics: AgentMetrics | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.metrics = metrics if metrics is not None else AgentMetrics()
        self._clock = clock
        self._recovery = RecoveryClock()

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        self.inner.emit(event, **fields)
        try:
            observe(self.metrics, self._recovery, event, fields, self._clock())
        except Exception:  # a metric must never take the agent down; the event is written (logged, so not blind)
            logger.warning("could not update the metrics for %s", event.value, exc_info=True)


@dataclass(slots=True)
class MetricsServer:
    """The running exporter: ``port`` it listens on (the one asked for, or the one picked for 0)."""

    port: int
    _stop: Callable[[], None]

    def close(self) -> None:
        self._stop()


def serve(metrics: AgentMetrics, port: int, addr: str = "0.0.0.0") -> MetricsServer:
    """Serve ``metrics`` at ``http://addr:port/metrics`` from a daemon thread (port 0: any free port).

    Raises:
        OSError: the port cannot be bound (in use, or privileged).
    """
    server, thread = start_http_server(port, addr=addr, registry=metrics.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    bound = int(server.server_address[1])
    logger.info("metrics at http://%s:%d/metrics", addr, bound)
    return MetricsServer(bound, stop)
