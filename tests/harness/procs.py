"""Process harness shared by the tests and bench/: start processes by PID, poll with deadlines, reap.

Everything here signals only processes it started and their descendants, by PID, never by name. Under pytest
the session is a child subreaper (tests/conftest.py), so workers orphaned by a killed agent are re-parented
to it and :func:`reap` can collect them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from elastic.events import read_events
from tests.harness.deadline import slowdown

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SPOTRUN = [sys.executable, "-m", "elastic.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

T = TypeVar("T")


class Timeout(AssertionError):
    """A condition polled with a deadline did not hold in time (an assertion failure in a test)."""


def _budget(timeout: float) -> tuple[float, str]:
    """``timeout`` (for an idle machine) stretched by the load now (tests/harness/deadline.py), and how to say it."""
    factor = slowdown()
    if factor <= 1.0:
        return timeout, f"{timeout:g} s"
    return timeout * factor, f"{timeout * factor:.0f} s ({timeout:g} s x{factor:.1f} for the load)"


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``check`` until it returns something truthy, or raise :class:`Timeout` after ``timeout`` s (scaled
    for the machine's load) naming ``what``. For conditions in other processes (files, /proc) that offer nothing
    to wait on."""
    budget, said = _budget(timeout)
    poll = Retrying(stop=stop_after_delay(budget), wait=wait_fixed(interval), retry=retry_if_result(lambda r: not r))
    try:
        return poll(check)
    except RetryError:
        raise Timeout(f"timed out after {said} waiting for {what}") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of ``path`` (events or --progress-file lines; one being appended is skipped)."""
    return read_events(str(path))


# --- /proc ----------------------------------------------------------------------------------------------------


def proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline) for every process we can read."""
    table: dict[int, tuple[int, str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(rest[1]), rest[0], cmd)
    return table


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """Live (non-zombie) descendants of ``root``: pid -> (state, cmdline)."""
    table = proc_table()
    found: dict[int, tuple[str, str]] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state, cmd) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = (state, cmd)
                frontier.append(pid)
    return {pid: v for pid, v in found.items() if v[0] != "Z"}


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    state = _state(pid)
    return state is not None and state != "Z"


def _without_resource_trackers(found: dict[int, tuple[str, str]]) -> list[int]:
    return [pid for pid, (_, cmd) in found.items() if "multiprocessing.resource_tracker" not in cmd]


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each PID that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def reap(pids: Iterable[int], timeout: float) -> None:
    """Wait up to ``timeout`` s (scaled for the load) for each PID to exit and reap it if it is our child (orphans
    re-parented to this subreaper session are); raise :class:`Timeout` naming the survivors."""

    def gone(pid: int) -> bool:
        try:
            return os.waitpid(pid, os.WNOHANG)[0] == pid
        except ChildProcessError:  # not our child: someone else reaps it
            return not pid_alive(pid)

    pending = set(pids)

    def all_gone() -> bool:
        pending.difference_update([pid for pid in pending if gone(pid)])
        return not pending

    try:
        wait_for(all_gone, timeout, "processes to exit", interval=0.02)
    except Timeout:
        raise Timeout(f"processes {sorted(pending)} still alive {_budget(timeout)[1]} later") from None


# --- launchers ------------------------------------------------------------------------------------------------


def make_env(**extra: str) -> dict[str, str]:
    """This environment for a launcher: unbuffered output, no inherited ``PET_RDZV_BACKEND``, the agents' log
    level from ``SPOTRUN_TEST_LOGLEVEL`` (default INFO, for tests that read the log), plus ``extra``."""
    env = dict(os.environ)
    env.pop("PET_RDZV_BACKEND", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = env.get("SPOTRUN_TEST_LOGLEVEL", "INFO")
    env.update(extra)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller must tolerate losing the race for it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class Launcher:
    """One spotrun/torchrun process (an agent) started by PID in its own session, output to a log file."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_handle = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            list(argv), cwd=REPO, env=env or make_env(), stdout=self._log_handle, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.tree: list[int] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def snapshot_tree(self) -> list[int]:
        """Record (and return) the launcher and its descendants now, e.g. to signal a whole node later."""
        self.tree = [self.pid, *_without_resource_trackers(descendants(self.pid))]
        return self.tree

    def wait(self, timeout: float) -> int:
        """The launcher's exit code, waited for up to ``timeout`` s scaled for the load."""
        budget, said = _budget(timeout)
        try:
            return self.proc.wait(budget)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"launcher pid {self.pid} still running after {said}:\n{self.output()[-3000:]}") from None

    def close(self, grace: float = 15.0) -> None:
        """SIGCONT (a stopped process cannot exit), SIGTERM, SIGKILL after ``grace`` s, reap; then SIGKILL what
        is left of its descendants and of :meth:`snapshot_tree`. Safe to call twice."""
        running = self.proc.poll() is None  # once reaped, its PID may belong to someone else
        # Never multiprocessing's resource tracker (elastic.chaos.targets.node_tree says why): it unlinks the
        # agent's named semaphores once the agent and its workers are gone, then exits by itself.
        alive = _without_resource_trackers(descendants(self.pid)) if running else []
        leftovers = [pid for pid in {*self.tree, *alive} if pid != self.pid]
        if running:
            signal_all([self.pid, *leftovers], signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
        signal_all(leftovers, signal.SIGKILL)
        self._log_handle.close()


def run_cli(argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a launcher to completion (pytest-timeout bounds the test; ``timeout``, scaled for the load, bounds this
    call)."""
    budget, _ = _budget(timeout)
    return subprocess.run(list(argv), cwd=REPO, env=env or make_env(), capture_output=True, text=True, timeout=budget)
