"""bench/mttr_report.py's pure parts: stage breakdown per fault, per-type summary, missing stages as n/a."""

from __future__ import annotations

import pytest

from bench.mttr_report import STAGES, Fault, breakdown, render, resume_times, summarize


def _ev(name: str, t: float, node: str = "h:1") -> dict:
    return {"event": name, "t_wall": t, "node": node}


EVENTS = [
    _ev("failure_detected", 10.5), _ev("workers_stopped", 11.0), _ev("rendezvous_started", 11.1),
    _ev("rendezvous_completed", 11.2), _ev("workers_started", 12.0),
    _ev("failure_detected", 30.2), _ev("workers_stopped", 30.4), _ev("rendezvous_completed", 30.6),
    _ev("workers_started", 31.0),
]
PROGRESS = [{"t_wall": 9.0}, {"t_wall": 13.0}, {"t_wall": 32.5}]


def test_breakdown_is_cumulative_from_injection_and_bounded_by_the_next_fault() -> None:
    faults = [Fault("kill_worker", 10.0), Fault("kill_worker", 30.0)]
    first, second = breakdown(faults, EVENTS, PROGRESS, resumes=[12.5, 31.5])
    expected = {"detection": 0.5, "stop": 1.0, "rendezvous": 1.2, "process_start": 2.0, "checkpoint_load": 2.5,
                "first_step": 3.0}
    assert first.stages == pytest.approx(expected)
    assert second.stages["detection"] == pytest.approx(0.2) and second.stages["first_step"] == 2.5
    table = summarize([first, second])
    median, worst, n = table["kill_worker"]["first_step"]  # type: ignore[misc]
    assert (median, worst, n) == (2.75, 3.0, 2)


def test_multi_node_stages_wait_for_the_last_node_and_missing_sources_are_na() -> None:
    events = [_ev("failure_detected", 1.0, "a:1"), _ev("failure_detected", 1.4, "b:2"),
              _ev("workers_started", 2.0, "a:1"), _ev("workers_started", 2.6, "b:2")]
    (rec,) = breakdown([Fault("kill_agent", 0.5)], events, progress=None, resumes=None)
    assert rec.stages["detection"] == pytest.approx(0.9) and rec.stages["process_start"] == pytest.approx(2.1)
    assert rec.stages["stop"] is None and rec.stages["checkpoint_load"] is None and rec.stages["first_step"] is None
    text = render(summarize([rec]), {"kill_agent": 1})
    assert "| kill_agent | 1 | 0.90 / 0.90 | n/a |" in text
    assert all(stage in text for stage in STAGES)


def test_resume_lines_of_train_ddp_are_parsed() -> None:
    log = ("noise\n2026-11-23 00:04:50,250 train_ddp [rank 0/2 restart 1] resumed from step 10 (samples_seen=640)\n"
           "2026-11-23 00:04:50,251 train_ddp [rank 1/2 restart 1] something else\n")
    (t,) = resume_times(log)
    assert t % 1 == pytest.approx(0.25)


def test_a_fault_never_detected_has_no_recovery_stages() -> None:
    # Injected before the workers started: the start-up rendezvous must not be counted as its recovery.
    events = [_ev("rendezvous_completed", 5.0), _ev("workers_started", 5.5)]
    (rec,) = breakdown([Fault("storage_latency", 1.0)], events, [{"t_wall": 6.0}], resumes=[])
    assert all(v is None for v in rec.stages.values()), rec.stages
