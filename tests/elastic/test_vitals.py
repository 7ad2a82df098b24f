"""The agent's progress and durability metrics (elastic.vitals) from the workers' save records
(checkpoint.save_record), the memory tier's snapshot names and the progress samples, on plain files with an
injected clock; and every labelled counter present at 0 before any event."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from checkpoint.memory.api import SnapshotId
from checkpoint.memory.layout import snapshot_name
from checkpoint.save_record import SaveRecord, SaveRecorder, parse_save_record, read_save_records, record_name
from elastic.metrics import LABEL_VALUES, AgentMetrics
from elastic.vitals import Vitals, WorkerProgress


def _value(metrics: AgentMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _vitals(tmp_path: Path, metrics: AgentMetrics, wall: list[float]) -> Vitals:
    return Vitals(metrics=metrics, emit=lambda *a, **k: None, straggler=None, memory_dir=str(tmp_path),
                  wall_clock=lambda: wall[0], interval=0.0)


def test_every_labelled_counter_is_there_at_0_before_any_event() -> None:
    metrics = AgentMetrics()
    for cause in LABEL_VALUES["restarts"]:
        assert _value(metrics, "spotrun_restarts_total", cause=cause) == 0
    assert _value(metrics, "spotrun_checkpoint_saves_total", outcome="failed") == 0
    assert _value(metrics, "spotrun_checkpoint_saves_total", outcome="committed") == 0
    assert _value(metrics, "spotrun_restores_total", source="memory_peer") == 0
    assert _value(metrics, "spotrun_notices_received_total", source="sigterm") == 0
    assert _value(metrics, "spotrun_recovery_stage_seconds_count", stage="total") == 0
    assert _value(metrics, "spotrun_training_steps_total") == 0


def test_saves_commits_and_failures_become_counters_ages_and_bytes(tmp_path: Path) -> None:
    wall = [1000.0]
    metrics = AgentMetrics()
    vitals = _vitals(tmp_path, metrics, wall)
    ranks = [SaveRecorder(r, str(tmp_path), wall_clock=lambda: wall[0]) for r in (0, 1)]
    for rec, nbytes in zip(ranks, (100, 60), strict=True):
        rec.committed(10, 0.5 + rec.record.rank, nbytes)  # every rank learns each commit
    vitals.tick({})
    assert _value(metrics, "spotrun_checkpoint_saves_total", outcome="committed") == 1  # once per node and save
    assert _value(metrics, "spotrun_checkpoint_save_bytes_total") == 160
    assert _value(metrics, "spotrun_checkpoint_save_seconds_total") == pytest.approx(1.5)  # the slowest rank
    assert _value(metrics, "spotrun_checkpoint_durable_step") == 10
    assert _value(metrics, "spotrun_checkpoint_durable_age_seconds") == 0
    wall[0] = 1030.0
    for rec in ranks:
        rec.failed()
    vitals.tick({})
    assert _value(metrics, "spotrun_checkpoint_saves_total", outcome="failed") == 1
    assert _value(metrics, "spotrun_checkpoint_durable_age_seconds") == 30  # the failure did not refresh it
    wall[0] = 1060.0
    for rec in ranks:
        rec.committed(30, 0.25, 10)
    vitals.tick({})
    vitals.tick({})  # a record read twice counts once
    assert _value(metrics, "spotrun_checkpoint_saves_total", outcome="committed") == 2
    assert _value(metrics, "spotrun_checkpoint_durable_step") == 30
    assert _value(metrics, "spotrun_checkpoint_save_interval_seconds") == 60
    assert _value(metrics, "spotrun_checkpoint_last_save_seconds") == 0.25
    # A restarted worker (new pid) starts its counts from 0: nothing is subtracted, its first save counts.
    restarted = SaveRecord(rank=0, pid=ranks[0].record.pid + 1, saves_failed=1)
    (tmp_path / record_name(0)).write_text(json.dumps(dataclasses.asdict(restarted)))
    vitals.tick({})
    assert _value(metrics, "spotrun_checkpoint_saves_total", outcome="failed") == 2
    assert _value(metrics, "spotrun_checkpoint_durable_step") == 30  # the agent remembers across restarts


def test_the_newest_memory_snapshot_and_its_age(tmp_path: Path) -> None:
    wall = [5000.0]
    metrics = AgentMetrics()
    vitals = _vitals(tmp_path, metrics, wall)
    for step, mtime in ((7, 4990.0), (9, 4995.0)):
        path = tmp_path / snapshot_name(SnapshotId(step, "0badcafe"), 0, 2)
        path.write_bytes(b"x")
        os.utime(path, (mtime, mtime))
    (tmp_path / "snap-999999999-junk").write_bytes(b"x")  # not a snapshot's name: ignored
    vitals.tick({})
    assert _value(metrics, "spotrun_memory_snapshot_step") == 9
    assert _value(metrics, "spotrun_memory_snapshot_age_seconds") == 5


def test_progress_gives_the_training_step_the_steps_and_the_pace_of_the_slowest_worker(tmp_path: Path) -> None:
    now = [0.0]
    metrics = AgentMetrics()
    vitals = Vitals(metrics=metrics, emit=lambda *a, **k: None, straggler=None, memory_dir=None,
                    clock=lambda: now[0], interval=0.0)
    vitals.started({0: 0, 1: 1})
    for i in range(1, 31):
        now[0] = i * 0.1
        vitals.tick({0: WorkerProgress(i, 100 + i), 1: WorkerProgress(i - 1, 100 + i - 1)})
    assert _value(metrics, "spotrun_training_step") == 129
    assert _value(metrics, "spotrun_training_steps_total") == 29
    assert _value(metrics, "spotrun_steps_per_second") == pytest.approx(10, rel=0.1)
    vitals.started({0: 0, 1: 1})  # restarted workers count from 0 again; the counter goes on
    assert _value(metrics, "spotrun_steps_per_second") == 0  # no pace while the new workers start
    now[0] += 0.1
    vitals.tick({0: WorkerProgress(3, None), 1: WorkerProgress(2, None)})
    assert _value(metrics, "spotrun_training_steps_total") == 31


@pytest.mark.parametrize(("raw", "needle"), [
    (b"[]", "not a JSON object"), (b"{", "not JSON"), (b" " * 5000, "bytes"),
    (json.dumps({"rank": -1, "pid": 1, "saves_committed": 0, "saves_failed": 0, "save_seconds_total": 0,
                 "save_bytes_total": 0}).encode(), "rank"),
    (json.dumps({"rank": 0, "pid": 1, "saves_committed": True, "saves_failed": 0, "save_seconds_total": 0,
                 "save_bytes_total": 0}).encode(), "saves_committed"),
    (b'{"rank": 0, "pid": 1, "saves_committed": 0, "saves_failed": 0, "save_seconds_total": NaN, '
     b'"save_bytes_total": 0}', "save_seconds_total"),
])
def test_a_bad_save_record_is_refused_naming_the_problem(raw: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_save_record(raw)


def test_bad_records_are_skipped_and_good_ones_read(tmp_path: Path, caplog: Any) -> None:
    SaveRecorder(3, str(tmp_path)).committed(5, 1.0, 10)
    (tmp_path / record_name(4)).write_text("garbage")
    os.symlink("/etc/passwd", tmp_path / record_name(5))
    got = read_save_records(str(tmp_path))
    assert [(r.rank, r.durable_step, r.saves_committed) for r in got] == [(3, 5, 1)]
    assert "ignoring the save record" in caplog.text


def test_without_a_keeper_directory_the_recorder_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    monkeypatch.delenv("SPOTRUN_MEMORY_DIR", raising=False)
    recorder = SaveRecorder(0)
    recorder.committed(1, 0.1, 1)
    assert recorder.directory is None and recorder.record.saves_committed == 1
    SaveRecorder(0, str(tmp_path / "gone")).failed()  # a directory that went away: logged, never raised
