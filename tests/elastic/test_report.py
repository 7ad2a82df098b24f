"""``spotrun report`` (elastic.report, elastic.report_html) on synthetic events: the timeline's segments, the
cost of each recovery and the totals, the text report, a corrupt input, the self-contained HTML page, and the
``spotrun report`` entry through the CLI (a script named ``report`` in the working directory stays a script)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elastic import cli, report
from elastic.events import read_events
from elastic.report_html import render_page
from tests.harness.procs import SPOTRUN, make_env, run_cli


def _ev(name: str, t: float, cause: str | None = None, node: str = "a:1", **fields: object) -> dict:
    return {"event": name, "t_wall": t, "node": node, "recovery_cause": cause, **fields}


def _restart(t: float, cause: str, node: str, first: str = "failure_detected") -> list[dict]:
    return [_ev(first, t, cause, node), _ev("workers_stopped", t + 0.2, cause, node),
            _ev("rendezvous_started", t + 0.2, cause, node), _ev("rendezvous_completed", t + 0.6, cause, node),
            _ev("workers_started", t + 1.0, cause, node)]


# Two nodes train from t=100; a worker of a is killed at 110 (both restart); b gets a notice at 120 and leaves at
# an agreed step at 121 (a re-forms alone); the job ends at 140.
EVENTS = [
    _ev("rendezvous_completed", 99.5, node="a:1"), _ev("workers_started", 100.0, node="a:1"),
    _ev("rendezvous_completed", 99.5, node="b:2"), _ev("workers_started", 100.0, node="b:2"),
    *_restart(110.5, "failure", "a:1"), *_restart(110.6, "peer_lost", "b:2"),
    _ev("notice_received", 120.0, node="b:2", source="sigterm", deadline=150.0),
    _ev("planned_leave", 121.0, "planned_leave", "b:2", step=40, saved=True),
    _ev("run_finished", 121.0, "planned_leave", "b:2", state="SUCCEEDED"),
    *_restart(121.2, "planned_leave", "a:1", first="planned_restart"),
    _ev("run_finished", 140.0, node="a:1", state="SUCCEEDED"),
]
JOURNAL = [{"record": "injected", "kind": "kill_worker", "t_wall": 110.0}]
# rank 0 steps every 0.5 s from t=100 (step 1); after the crash it resumes from step 15 (5 redone)
PROGRESS = ([{"rank": 0, "t_wall": 100.0 + 0.5 * i, "step": i + 1} for i in range(20)]
            + [{"rank": 0, "t_wall": 112.0 + 0.5 * i, "step": 16 + i} for i in range(18)]
            + [{"rank": 0, "t_wall": 123.0 + 0.5 * i, "step": 41 + i} for i in range(30)])


def test_totals_charge_each_recovery_from_its_fault_to_its_first_step_plus_redone_steps() -> None:
    recs = report.recoveries(EVENTS, JOURNAL, PROGRESS)
    assert [(r.kind, r.cause) for r in recs] == [("kill_worker", "failure"), ("-", "planned_leave")]
    crash, leave = recs
    assert crash.stages["first_step"] == pytest.approx(2.0) and crash.steps_lost == 5
    tot = report.totals(EVENTS, recs, PROGRESS)
    assert tot.span == pytest.approx(40.0) and tot.step_time == pytest.approx(0.5)
    assert tot.lost_by_cause["failure"] == pytest.approx(2.0 + 5 * 0.5)
    assert tot.lost_by_cause["planned_leave"] == pytest.approx(123.0 - 121.0)  # detection at the leave
    assert tot.effective_ratio == pytest.approx(1 - (4.5 + 2.0) / 40.0)
    assert tot.recoveries == 2 and tot.steps_redone == 5


def test_the_timeline_splits_each_node_into_training_and_recovery_stages() -> None:
    recs = report.recoveries(EVENTS, JOURNAL, PROGRESS)
    line = report.timeline(EVENTS, report.faults_from(JOURNAL), recs)
    assert line.nodes == ("a:1", "b:2") and (line.t0, line.t1) == (99.5, 140.0)
    a = [(s.kind, s.start, s.end) for s in line.segments if s.node == "a:1"]
    assert ("training", 100.0, 110.5) in a
    assert ("detection", 110.0, 110.5) in a, "fault -> the node's first recovery event"
    assert ("stop", 110.5, 110.7) in a and ("rendezvous", 110.7, 111.1) in a and ("start", 111.1, 111.5) in a
    assert ("first_step", 111.5, 112.0) in [(k, s, pytest.approx(e)) for k, s, e in a]
    assert max(e for k, _, e in a if k == "training") == 140.0, "a trains alone until its run_finished"
    b = [(s.kind, s.start, s.end) for s in line.segments if s.node == "b:2"]
    assert b[-1][2] == 121.0, "b ends at its leave"
    kinds = {(m.node, m.kind) for m in line.markers}
    assert {("b:2", "notice"), ("b:2", "leave"), (None, "fault"), ("a:1", "failure")} <= kinds
    notice = next(m for m in line.markers if m.kind == "notice")
    assert notice.label == "notice (sigterm, deadline in 30 s)"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_report_lists_timeline_recoveries_and_totals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = _write(tmp_path / "events.jsonl", EVENTS)
    # A record without a time and a torn last line: one note, no traceback.
    with open(events, "a") as f:
        f.write(json.dumps({"event": "workers_started", "node": "x"}) + "\n" + '{"event": "work')
    journal = _write(tmp_path / "journal.jsonl", JOURNAL)
    progress = _write(tmp_path / "progress.jsonl", PROGRESS)
    html = tmp_path / "out.html"
    assert report.main([str(events), "--journal", str(journal), "--progress", str(progress), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert f"note: skipped 1 record(s) of {events} without a valid time" in out
    assert "== timeline (2 nodes" in out and "notice (sigterm, deadline in 30 s)" in out
    assert re.search(r"#1 .*kill_worker\s+failure .*redone\s+5\s+cost\s+4\.50s", out), out
    assert "effective training time 83.8%" in out
    assert re.search(r"failure\s+4\.50 s lost", out) and re.search(r"planned_leave\s+2\.00 s lost", out)
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_missing_or_empty_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no events file at" in capsys.readouterr().err
    empty = _write(tmp_path / "empty.jsonl", [])
    assert report.main([str(empty)]) == 1
    assert "nothing to report" in capsys.readouterr().out


def test_a_damaged_line_of_an_events_file_costs_that_line_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = _write(tmp_path / "events.jsonl", EVENTS)
    good = events.read_bytes()
    lines = good.splitlines(keepends=True)
    damaged = (lines[0] + b'{"event": "x\xff\xfe", "t_wall": 1}\n' + b"[" * 100_000 + b"\n" + b"\x80\x81\n"
               + b"".join(lines[1:]))
    events.write_bytes(damaged)
    records = read_events(str(events))
    assert len(records) == len(EVENTS) + 1 and records[1]["event"] == "x\ufffd\ufffd"
    assert report.main([str(events)]) == 0
    out = capsys.readouterr().out
    assert f"{len(EVENTS) + 1} events; times from the first event" in out  # the damaged lines alone are gone


def test_the_html_page_is_self_contained() -> None:
    recs = report.recoveries(EVENTS, JOURNAL, PROGRESS)
    line = report.timeline(EVENTS, report.faults_from(JOURNAL), recs)
    page = render_page(line, recs, report.totals(EVENTS, recs, PROGRESS), title="run <x>")
    assert "<title>run &lt;x&gt;</title>" in page, "text from the events is escaped"
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "nothing is fetched"
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert page.count('class="seg"') == len([s for s in line.segments if s.end > s.start])
    assert "83.8%" in page and "kill_worker" in page


def test_spotrun_report_subcommand_and_a_script_named_report(tmp_path: Path) -> None:
    assert cli.subcommand(["report", "x.jsonl"], is_file=lambda p: False) == ("report", None)
    name, note = cli.subcommand(["report", "--x"], is_file=lambda p: p == "report")
    assert name is None and note is not None and "spotrun-report" in note
    assert cli.subcommand(["train.py", "report"], is_file=lambda p: False) == (None, None)
    events = _write(tmp_path / "events.jsonl", EVENTS)
    done = run_cli([*SPOTRUN, "report", str(events)], timeout=60, env=make_env())
    assert done.returncode == 0, done.stderr
    assert "== totals" in done.stdout


def test_a_node_killed_without_a_word_ends_where_the_job_went_on_without_it() -> None:
    events = [_ev("workers_started", 0.0, node="a:1"), _ev("workers_started", 0.0, node="b:2"),
              *_restart(10.0, "peer_lost", "a:1"), _ev("run_finished", 20.0, node="a:1", state="SUCCEEDED")]
    line = report.timeline(events)
    b = [(s.kind, s.start, s.end) for s in line.segments if s.node == "b:2"]
    assert b == [("training", 0.0, 10.0)], "b's bar stops at a's recovery, not at the end of the file"
    assert [(m.node, m.kind, m.t) for m in line.markers if m.kind == "lost"] == [("b:2", "lost", 10.0)]


def test_steps_redone_is_unknown_without_progress_and_zero_without_recoveries() -> None:
    recs = report.recoveries(EVENTS, JOURNAL)  # no progress file: how many steps were redone is not known
    tot = report.totals(EVENTS, recs)
    assert tot.recoveries == 2 and tot.steps_redone is None
    assert "steps redone: unknown" in report.render_totals(tot)
    page = render_page(report.timeline(EVENTS, report.faults_from(JOURNAL), recs), recs, tot)
    assert "<b>unknown</b><span>steps redone</span>" in page
    quiet = [e for e in EVENTS if e["node"] == "a:1" and not e.get("recovery_cause")]
    assert report.totals(quiet, report.recoveries(quiet)).steps_redone == 0, "no recovery: nothing redone"


def test_detection_bars_do_not_share_the_faults_red() -> None:
    from elastic.report_html import COLOURS, FAULT_COLOUR

    def rgb(colour: str) -> tuple[int, ...]:
        return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))

    distance = sum((a - b) ** 2 for a, b in zip(rgb(COLOURS["detection"]), rgb(FAULT_COLOUR))) ** 0.5
    assert distance > 80, f"detection {COLOURS['detection']} vs fault {FAULT_COLOUR}: {distance:.0f} apart"


def test_report_finds_the_events_from_the_run_id_and_the_log_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic.events import default_events_path

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for node in ("a:1", "b:2"):  # two hosts of one run: one file each
        path = Path(default_events_path("job7", None)).parent.parent / node.replace(":", "_") / "events.jsonl"
        path.parent.mkdir(parents=True)
        _write(path, [dict(e, run_id="job7") for e in EVENTS if e["node"] == node])
    assert report.main(["--rdzv-id", "job7"]) == 0
    assert f"== timeline (2 nodes, {len(EVENTS)} events" in capsys.readouterr().out

    logs = tmp_path / "logs"
    logs.mkdir()
    other = [dict(e, run_id="old") for e in EVENTS[:3]]
    _write(logs / "events.jsonl", other + [dict(e, run_id="job7") for e in EVENTS])
    assert report.main(["--log-dir", str(logs), "--rdzv-id", "job7"]) == 0, "only that run's events"
    assert f"== timeline (2 nodes, {len(EVENTS)} events" in capsys.readouterr().out
    assert report.main(["--log-dir", str(logs)]) == 0
    assert f"{len(EVENTS) + 3} events" in capsys.readouterr().out

    assert report.main(["--rdzv-id", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no events file at {tmp_path / 'state' / 'spotrun' / 'runs' / 'nope'}" in err
    assert report.main([]) == 2
    assert "give --rdzv-id" in capsys.readouterr().err
