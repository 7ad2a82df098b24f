"""The agent's Prometheus metrics (elastic.metrics): derived from the events it emits, served in the text format
and parsed back with prometheus-client's own parser; and ``--metrics-port`` on a real agent."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic.api import LaunchConfigError, RecoveryEvent
from elastic.config import AgentSettings
from elastic.metrics import AgentMetrics, MetricsSink, serve
from tests.harness.procs import SPOTRUN, Launcher, free_port, make_env, wait_for


class _List:
    def __init__(self) -> None:
        self.events: list[tuple[RecoveryEvent, dict[str, Any]]] = []

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        self.events.append((event, fields))


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_events_become_metrics_and_are_forwarded_unchanged() -> None:
    now = [0.0]
    inner = _List()
    sink = MetricsSink(inner, AgentMetrics(), clock=lambda: now[0])
    ctx = {"round": 1, "group_rank": 0, "group_world_size": 2, "world_size": 4, "rdzv_round": 1}

    def emit(event: RecoveryEvent, at: float, **fields: Any) -> None:
        now[0] = at
        sink.emit(event, **ctx, **fields)

    emit(RecoveryEvent.WORKERS_STARTED, 1.0, recovery_cause=None)  # first start: not a restart
    emit(RecoveryEvent.FAILURE_DETECTED, 10.0, recovery_cause="failure", cause="worker_failure")
    emit(RecoveryEvent.WORKERS_STOPPED, 10.5, recovery_cause="failure")
    emit(RecoveryEvent.RENDEZVOUS_COMPLETED, 11.5, recovery_cause="failure")
    emit(RecoveryEvent.WORKERS_STARTED, 13.5, recovery_cause="failure")
    emit(RecoveryEvent.NOTICE_RECEIVED, 20.0, recovery_cause=None, source="sigterm", deadline=50.0)
    emit(RecoveryEvent.HANG_DETECTED, 21.0, recovery_cause="hang")
    emit(RecoveryEvent.WORKERS_STARTED, 22.0, recovery_cause="hang")
    emit(RecoveryEvent.ETCD_OUTAGE, 30.0, recovery_cause=None, seconds=7.5, fatal=False)
    emit(RecoveryEvent.PLANNED_LEAVE, 40.0, recovery_cause="planned_leave", step=12, saved=True)
    emit(RecoveryEvent.PLANNED_LEAVE, 41.0, recovery_cause="planned_leave", step=None, saved=False)
    assert [e for e, _ in inner.events][:2] == [RecoveryEvent.WORKERS_STARTED, RecoveryEvent.FAILURE_DETECTED]
    assert inner.events[1][1]["cause"] == "worker_failure" and len(inner.events) == 11

    server = serve(sink.metrics, 0, addr="127.0.0.1")
    try:
        got = _scrape(server.port)
    finally:
        server.close()
    assert got[("spotrun_restarts_total", (("cause", "failure"),))] == 1
    assert got[("spotrun_restarts_total", (("cause", "hang"),))] == 1
    assert got[("spotrun_failures_detected_total", (("cause", "worker_failure"),))] == 1
    stage = "spotrun_recovery_stage_seconds"
    assert got[(f"{stage}_sum", (("stage", "stop"),))] == pytest.approx(0.5)
    assert got[(f"{stage}_sum", (("stage", "rendezvous"),))] == pytest.approx(1.0)
    assert got[(f"{stage}_sum", (("stage", "start"),))] == pytest.approx(2.0 + 1.0)  # and the hang's 1 s
    assert got[(f"{stage}_sum", (("stage", "total"),))] == pytest.approx(3.5 + 1.0)
    assert got[(f"{stage}_bucket", (("le", "0.5"), ("stage", "stop")))] == 1
    assert got[(f"{stage}_count", (("stage", "total"),))] == 2
    assert got[("spotrun_world_size", ())] == 4 and got[("spotrun_group_world_size", ())] == 2
    assert got[("spotrun_notices_received_total", (("source", "sigterm"),))] == 1
    assert got[("spotrun_planned_leaves_total", (("saved", "true"),))] == 1
    assert got[("spotrun_planned_leaves_total", (("saved", "false"),))] == 1
    assert got[("spotrun_hang_detections_total", ())] == 1
    assert got[("spotrun_etcd_outage_seconds_total", ())] == pytest.approx(7.5)
    assert got[("spotrun_etcd_outages_total", ())] == 1


def test_a_bad_metrics_port_is_refused_with_a_fix() -> None:
    with pytest.raises(LaunchConfigError, match="--metrics-port must be a TCP port"):
        AgentSettings(metrics_port=70000)
    with pytest.raises(LaunchConfigError, match="--metrics-port"):
        AgentSettings(metrics_port=True)  # type: ignore[arg-type]


def test_an_etcd_outage_ridden_out_is_an_event_with_its_length(tmp_path: Path) -> None:
    from elastic.rendezvous.api import RendezvousConnectionError
    from tests.elastic.doubles import MemoryEventLog
    from tests.elastic.test_agent_membership import AwareHandler, make_agent

    now = [100.0]
    handler = AwareHandler(error=RendezvousConnectionError("etcd refused to read"))
    events = MemoryEventLog()
    agent = make_agent(handler, tmp_path, clock=lambda: now[0], events=events)
    assert not agent.membership.changed()
    now[0] += 4.25
    handler.error = None
    assert not agent.membership.changed()
    (outage,) = [r for r in events.records if r["event"] == "etcd_outage"]
    assert outage["seconds"] == pytest.approx(4.25) and outage["fatal"] is False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_running_agent_serves_its_metrics(tmp_path: Path) -> None:
    """A real agent: its workers fail once (a restart by cause ``failure``), then run until released."""
    release, failed = tmp_path / "release", tmp_path / "failed-once"
    script = tmp_path / "wait.py"
    script.write_text("import os, sys, time\n"
                      f"if os.environ['RANK'] == '0' and not os.path.exists({str(failed)!r}):\n"
                      f"    open({str(failed)!r}, 'w').close()\n    sys.exit(3)\n"
                      f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.05)\n")
    port = free_port()
    agent = Launcher([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
                      "--max-restarts", "1", "--events-file", str(tmp_path / "events.jsonl"), str(script)],
                     tmp_path / "agent.log", make_env(SPOTRUN_METRICS_PORT=str(port)))
    restarted = ("spotrun_restarts_total", (("cause", "failure"),))
    try:
        def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            try:
                return _scrape(port)
            except OSError:
                return {}

        got = wait_for(lambda: (m := scrape()).get(restarted) == 1 and m, 60, "a restart in the metrics")
        assert got[("spotrun_world_size", ())] == 2 and got[("spotrun_group_world_size", ())] == 1
        assert got[("spotrun_failures_detected_total", (("cause", "worker_failure"),))] == 1
        assert got[("spotrun_recovery_stage_seconds_count", (("stage", "total"),))] == 1
        release.touch()
        assert agent.wait(60) == 0, agent.output()
    finally:
        agent.close()
