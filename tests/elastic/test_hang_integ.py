"""Hang detection end to end: one of two workers hangs (in Python, or SIGSTOPped); nothing in the script."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.events import read_events
from tests.harness.procs import EXAMPLES, SPOTRUN, Launcher, read_jsonl, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAULT = str(EXAMPLES / "fault_worker.py")
HANG_TIMEOUT = 2.0
STARTUP_TIMEOUT = 3.0


@contextlib.contextmanager
def _spotrun(tmp_path: Path, max_restarts: int, *worker_args: str) -> Iterator[Launcher]:
    launcher = Launcher(
        [*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
         "--stop-grace", "1", "--peer-loss-grace", "0", "--hang-timeout", str(HANG_TIMEOUT), "--hang-startup-timeout", str(STARTUP_TIMEOUT),
         "--events-file", str(tmp_path / "events.jsonl"), "--log-dir", str(tmp_path / "logs"),
         FAULT, "--step-time", "0.1", "--out", str(tmp_path / "out"), *worker_args],
        tmp_path / "spotrun.log",
    )
    try:
        yield launcher
    finally:
        launcher.close()


def _events(tmp_path: Path, name: str) -> list[dict]:
    return [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == name]


def test_a_rank_hung_in_python_is_found_within_its_budget_dumped_named_and_the_job_resumes(tmp_path: Path) -> None:
    with _spotrun(tmp_path, 1, "--steps", "50", "--fail-at-step", "40", "--fail-ranks", "1", "--hang",
                  "--fail-restarts", "0") as job:
        assert job.wait(90) == 0, job.output()[-4000:]
        out = job.output()
    progress = read_jsonl(tmp_path / "out" / "progress.jsonl")
    first = [p for p in progress if p["restart"] == 0]
    hung_since = max(p["t_mono"] for p in first if p["rank"] == 1)  # rank 1's last step before it hung
    started = _events(tmp_path, "workers_started")
    detected = _events(tmp_path, "hang_detected")
    assert len(detected) == 1 and set(detected[0]["hung"]) == {"1"}, detected  # rank 0 only waited for it
    budget_ends = max(hung_since + HANG_TIMEOUT, started[0]["t_mono"] + STARTUP_TIMEOUT)
    assert detected[0]["t_mono"] <= budget_ends + 1.0, (detected[0]["t_mono"] - hung_since, detected)
    assert detected[0]["t_mono"] >= hung_since + HANG_TIMEOUT  # not before its budget
    failure = _events(tmp_path, "failure_detected")
    assert [(f["cause"], f["recovery_cause"]) for f in failure] == [("hang", "hang")]
    # every event of the recovery carries its cause; the first start and the end none
    assert [e["recovery_cause"] for e in _events(tmp_path, "workers_started")] == [None, "hang"]
    assert _events(tmp_path, "rendezvous_completed")[-1]["recovery_cause"] == "hang"
    # both ranks finished all steps after exactly one restart
    assert {(p["rank"], p["step"]) for p in progress if p["restart"] == 1} >= {(0, 50), (1, 50)}
    # every worker's stack is in the agent's log: the hung one in the script, the other in the collective
    assert "rank 1 (local rank 1" in out and "is hung: no progress" in out
    stack1 = out.split("stack of local rank 1")[1]
    assert "in inject" in stack1.split("stack of local rank")[0], out[-4000:]
    stack0 = out.split("stack of local rank 0")[1].split("stack of local rank 1")[0]
    assert "in all_reduce" in stack0, out[-4000:]


def test_a_sigstopped_rank_is_named_in_the_failure_summary_when_restarts_are_exhausted(tmp_path: Path) -> None:
    with _spotrun(tmp_path, 0, "--steps", "0") as job:
        def rank1_pid() -> int | None:
            steps = [p for p in read_jsonl(tmp_path / "out" / "progress.jsonl") if p["rank"] == 1 and p["step"] >= 3]
            return steps[-1]["pid"] if steps else None

        pid = wait_for(rank1_pid, 60, "rank 1 to make progress")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = wait_for(lambda: _events(tmp_path, "hang_detected"), 30, "hang_detected")[0]
        assert job.wait(60) == 1
        out = job.output()
    assert set(stopped_at["hung"]) == {"1"} and "stopped" in stopped_at["hung"]["1"]
    # torch's root-cause summary names rank 1 (that hung), not rank 0 (that waited for it)
    summary = out[out.index("Root Cause"):]
    assert "rank      : 1" in summary and "HangDetected: rank 1" in summary, summary
    assert "rank      : 0" not in summary, summary
