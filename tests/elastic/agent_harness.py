"""Helpers for spotrun's process-level tests: start launchers by PID, poll files with deadlines, reap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from elastic.events import read_events

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SPOTRUN = [sys.executable, "-m", "elastic.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``check`` until it returns something truthy, or fail after ``timeout`` seconds naming ``what``."""
    poll = Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(interval), retry=retry_if_result(lambda r: not r))
    try:
        return poll(check)
    except RetryError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of ``path`` (a line being appended right now is skipped)."""
    return read_events(str(path))


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def make_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PET_RDZV_BACKEND", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = env.get("SPOTRUN_TEST_LOGLEVEL", "INFO")
    env.update(extra)
    return env


class Launcher:
    """One spotrun/torchrun process (an agent) started by PID with output captured to a file."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_handle = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            list(argv), cwd=REPO, env=env or make_env(), stdout=self._log_handle, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher pid {self.pid} still running after {timeout} s:\n{self.output()[-3000:]}") from None

    def close(self) -> None:
        """Terminate by PID (SIGTERM, then SIGKILL) and reap; safe to call twice."""
        if self.proc.poll() is None:
            if _is_stopped(self.proc.pid):
                os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_handle.close()


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "T"


def run_cli(argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a launcher to completion (pytest-timeout bounds the test; ``timeout`` bounds this call)."""
    return subprocess.run(list(argv), cwd=REPO, env=env or make_env(), capture_output=True, text=True, timeout=timeout)
