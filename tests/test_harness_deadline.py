"""The suite's one load factor (tests/harness/deadline.py): what stretches the harness's waits and each test's limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import deadline
from tests.harness.procs import REPO, Timeout, wait_for


def test_a_fixed_slowdown_is_used_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(deadline.SLOWDOWN_ENV, "2.5")
    assert deadline.slowdown() == 2.5
    assert deadline.scaled(4.0) == 10.0


@pytest.mark.parametrize("value", ["fast", "0.5", "nan", "-1"])
def test_a_bad_slowdown_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(deadline.SLOWDOWN_ENV, value)
    with pytest.raises(ValueError, match=deadline.SLOWDOWN_ENV):
        deadline.slowdown()


def test_the_measured_slowdown_follows_the_load_per_core_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(deadline.SLOWDOWN_ENV, raising=False)
    monkeypatch.setattr(deadline, "_cores", lambda: 2)
    for load, factor in [(0.3, 1.0), (2.0, 1.0), (5.0, 2.5), (100.0, deadline.MAX_SLOWDOWN)]:
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert deadline.slowdown() == factor


def test_wait_for_stretches_its_budget_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(deadline.SLOWDOWN_ENV, "3")
    calls: list[None] = []

    def third_call_holds() -> bool:  # would time out unstretched: 0.1 s, polled every 0.04 s
        calls.append(None)
        return len(calls) >= 5

    assert wait_for(third_call_holds, 0.1, "the fifth call", interval=0.04)
    with pytest.raises(Timeout, match=r"after 0 s \(0.05 s x3.0 for the load\) waiting for nothing"):
        wait_for(lambda: False, 0.05, "nothing", interval=0.01)


def test_each_tests_timeout_is_stretched_by_the_same_factor(tmp_path: Path) -> None:
    """A test that needs 1.5 s under a 1 s limit passes with SPOTRUN_TEST_SLOWDOWN=2 (this suite's hook) and
    fails without it."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_protocol\n")
    (tmp_path / "test_slow.py").write_text(
        "import time, pytest\n\n@pytest.mark.timeout(1)\ndef test_slow():\n    time.sleep(1.5)\n")
    env = {key: value for key, value in os.environ.items() if key != deadline.SLOWDOWN_ENV}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_slow.py"]
    stretched = subprocess.run(argv, cwd=tmp_path, env={**env, deadline.SLOWDOWN_ENV: "2"}, capture_output=True,
                               text=True, timeout=60)
    assert stretched.returncode == 0, stretched.stdout[-2000:]
    plain = subprocess.run(argv, cwd=tmp_path, env={**env, deadline.SLOWDOWN_ENV: "1"}, capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode == 1 and "Timeout" in plain.stdout, plain.stdout[-2000:]
