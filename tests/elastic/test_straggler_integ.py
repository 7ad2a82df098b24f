"""Straggler detection end to end: three workers stepping at their own pace under a real agent, one slowed by a
set factor (tests/elastic/pace_worker.py), is named in a ``straggler_detected`` event within a bounded number of
its steps; an even run names nobody."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.events import read_events
from tests.harness.procs import SPOTRUN, Launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WORKER = str(Path(__file__).parent / "pace_worker.py")
WINDOW = 10
STEP_TIME = 0.05


def _run(tmp_path: Path, *worker_args: str) -> list[dict]:
    launcher = Launcher(
        [*SPOTRUN, "--standalone", "--nproc-per-node", "3", "--monitor-interval", "0.1",
         "--straggler-factor", "1.5", "--straggler-window", str(WINDOW),
         "--events-file", str(tmp_path / "events.jsonl"), WORKER, "--step-time", str(STEP_TIME),
         "--out", str(tmp_path / "out"), *worker_args],
        tmp_path / "spotrun.log",
    )
    try:
        assert launcher.wait(90) == 0, launcher.output()[-3000:]
    finally:
        launcher.close()
    return read_events(str(tmp_path / "events.jsonl"))


def _steps_done_by(path: Path, wall: float) -> int:
    return sum(1 for line in path.read_text().splitlines() if float(line.split()[1]) <= wall)


def test_a_rank_slowed_by_the_factor_is_named_within_a_bounded_number_of_its_steps(tmp_path: Path) -> None:
    events = _run(tmp_path, "--steps", "40", "--slow-rank", "2", "--slow-factor", "2.5")
    detected = [e for e in events if e["event"] == "straggler_detected"]
    assert len(detected) == 1, [e["event"] for e in events]
    (d,) = detected
    assert (d["rank"], d["local_rank"], d["factor"], d["window"]) == (2, 2, 1.5, WINDOW)
    assert d["ratio"] > 1.5 and d["step_time"] > d["peers_step_time"]
    # Named once the slow rank completed its window, plus the metrics tick (1 s) and a sampling tick: at
    # 0.125 s a step, at most ~10 more of its steps.
    done = _steps_done_by(tmp_path / "out" / "rank-2.steps", d["t_wall"])
    assert WINDOW <= done <= 2 * WINDOW + 2, done


def test_an_even_run_names_no_straggler(tmp_path: Path) -> None:
    events = _run(tmp_path, "--steps", "60")
    assert [e for e in events if e["event"].startswith("straggler")] == []
    assert [e["state"] for e in events if e["event"] == "run_finished"] == ["SUCCEEDED"]
