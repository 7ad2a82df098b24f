"""bench/mttr_report.py on a small synthetic events.jsonl: recoveries keyed on ``recovery_cause`` (crashes,
hangs, planned leaves, scale-ups, node losses), stage times from the fault, steps lost, faults that needed
no recovery, and the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.mttr_report import STAGES, main, recoveries, render, resume_times, summarize


def _ev(name: str, t: float, cause: str | None, node: str = "a:1", **fields: object) -> dict:
    return {"event": name, "t_wall": t, "node": node, "recovery_cause": cause, **fields}


def _restart(t: float, cause: str, node: str = "a:1", first: str = "failure_detected") -> list[dict]:
    """One node's recovery: its first event at t, then stop, rendezvous, start 0.1, 0.3, 0.5 s later."""
    return [_ev(first, t, cause, node), _ev("workers_stopped", t + 0.1, cause, node),
            _ev("rendezvous_started", t + 0.1, cause, node), _ev("rendezvous_completed", t + 0.3, cause, node),
            _ev("workers_started", t + 0.5, cause, node)]


EVENTS = [
    _ev("rendezvous_completed", 0.0, None), _ev("workers_started", 0.1, None),  # first start: no recovery
    *_restart(10.5, "failure"),                                  # a worker SIGKILLed at 10.0
    _ev("hang_detected", 22.0, "hang"), *_restart(23.0, "hang"),  # a worker SIGSTOPped at 20.0
    # a peer preempted at 30.0: it leaves (no restart of its own), this node re-forms at the agreed step
    _ev("notice_received", 30.1, None, "b:2"), _ev("planned_leave", 30.6, "planned_leave", "b:2"),
    _ev("run_finished", 30.6, "planned_leave", "b:2"),
    *_restart(30.7, "planned_leave", first="planned_restart"),
    *_restart(50.0, "scale_up", first="planned_restart"),        # a node joined: no fault injected
]
JOURNAL = [{"record": "injected", "kind": k, "t_wall": t} for k, t in
           [("kill_worker", 10.0), ("stop_worker", 20.0), ("term_agent", 30.0), ("kill_etcd_leader", 40.0)]]
JOURNAL.insert(1, {"record": "skipped", "kind": "partition", "t_wall": 15.0})
# steps every second from t=1 (step 1); each restart resumes some steps back
PROGRESS = ([{"t_wall": float(t), "step": t} for t in range(1, 11)]
            + [{"t_wall": 11.2, "step": 6}, {"t_wall": 12.0, "step": 7}]  # resumed from 5 after step 10: 5 lost
            + [{"t_wall": 24.0, "step": 9}] + [{"t_wall": 31.5, "step": 11}])


def test_each_cause_is_one_recovery_timed_from_its_fault() -> None:
    recs = recoveries(EVENTS, JOURNAL, PROGRESS, resumes=[11.1, 23.8, 31.4])
    assert [(r.kind, r.cause) for r in recs] == [("kill_worker", "failure"), ("stop_worker", "hang"),
                                                  ("term_agent", "planned_leave"), ("kill_etcd_leader", "none"),
                                                  ("-", "scale_up")]
    crash, hang, leave, etcd, grow = recs
    assert crash.stages == pytest.approx({"detection": 0.5, "stop": 0.6, "rendezvous": 0.8, "process_start": 1.0,
                                          "checkpoint_load": 1.1, "first_step": 1.2})
    assert crash.steps_lost == 5
    assert hang.stages["detection"] == pytest.approx(2.0)  # hang_detected, not the failure after it
    assert hang.stages["process_start"] == pytest.approx(3.5)
    # The preempted peer's planned_leave starts the recovery; the survivor's restart ends it; nothing lost.
    assert leave.stages["detection"] == pytest.approx(0.6) and leave.stages["process_start"] == pytest.approx(1.2)
    assert leave.steps_lost == 0
    assert etcd.stages == {} and etcd.steps_lost is None
    # No resume line between the hang's restart and the next recovery: n/a, not the next recovery's line.
    assert recoveries(EVENTS, JOURNAL, PROGRESS, resumes=[11.1, 31.4])[1].stages["checkpoint_load"] is None
    assert grow.fault is None and grow.stages["detection"] == 0.0 and grow.stages["process_start"] == pytest.approx(0.5)


def test_a_recovery_of_several_nodes_waits_for_the_last_node() -> None:
    # A node lost at 5.0: the survivor fails at once, its replacement's first start carries no cause.
    events = [*_restart(5.2, "peer_lost", "a:1"), *_restart(5.4, "failure", "c:3"),
              _ev("rendezvous_completed", 9.0, None, "d:4"), _ev("workers_started", 9.1, None, "d:4")]
    (rec,) = recoveries(events, [{"record": "injected", "kind": "kill_agent", "t_wall": 5.0}])
    assert rec.cause == "peer_lost"  # the node that started the recovery first names it
    assert rec.stages["detection"] == pytest.approx(0.2) and rec.stages["process_start"] == pytest.approx(0.9)
    assert rec.stages["checkpoint_load"] is None and rec.stages["first_step"] is None  # no sources given


def test_summary_and_markdown_table() -> None:
    recs = recoveries([*EVENTS, *_restart(70.5, "failure")],
                      [*JOURNAL, {"record": "injected", "kind": "kill_worker", "t_wall": 70.0}], PROGRESS, [])
    table = summarize(recs)
    assert table[("kill_worker", "failure")]["detection"] == (0.5, 0.5, 2)
    assert table[("kill_worker", "failure")]["n"][0] == 2  # type: ignore[index]
    text = render(table)
    assert text.splitlines()[0].startswith("| fault | cause | n | detection |")
    assert all(stage in text.splitlines()[0] for stage in STAGES)
    assert "| kill_etcd_leader | none | 1 | no restart |" in text
    assert "| stop_worker | hang | 1 | 2.00 / 2.00 |" in text
    assert "| kill_worker | failure | 2 | 0.50 / 0.50 | 0.60 / 0.60 | 0.80 / 0.80 | 1.00 / 1.00 | n/a | " in text


def test_resume_lines_of_train_ddp_are_parsed() -> None:
    log = ("noise\n2026-11-23 00:04:50,250 train_ddp [rank 0/2 restart 1] resumed from step 10 (samples_seen=640)\n"
           "2026-11-23 00:04:50,251 train_ddp [rank 1/2 restart 1] something else\n")
    (t,) = resume_times(log)
    assert t % 1 == pytest.approx(0.25)


def test_cli_prints_the_table_and_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events, journal = tmp_path / "events.jsonl", tmp_path / "journal.jsonl"
    events.write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    journal.write_text("".join(json.dumps(r) + "\n" for r in JOURNAL))
    assert main(["--events", str(events), "--journal", str(journal)]) == 0
    out = capsys.readouterr().out
    assert "| term_agent | planned_leave | 1 | 0.60 / 0.60 |" in out and "pass --worker-log" in out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["--events", str(empty)]) == 1
