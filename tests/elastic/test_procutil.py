"""``checkpoint._sys.procutil``: the parent-death signal and its race check, through each of its users' entry points
(the worker exec shim, the embedded etcd's preexec_fn)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import elastic.workers
from checkpoint._sys.procutil import ORPHANED_EXIT_CODE
from elastic.etcd_server import die_with_parent_preexec
from tests.harness.procs import reap, signal_all, wait_for

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")]

SHIM = [sys.executable, "-S", elastic.workers.__file__]


def test_shim_runs_standalone_and_execs_the_command() -> None:
    # -S and no PYTHONPATH: the shim must not need the package (only procutil, loaded from its folder).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([*SHIM, str(os.getpid()), "/bin/sh", "-c", "exit 3"], env=env, timeout=30)
    assert result.returncode == 3


def test_shim_exits_when_the_expected_parent_is_not_its_parent() -> None:
    # Same as the agent dying between fork and prctl: the child was re-parented before arming.
    result = subprocess.run([*SHIM, "0", "/bin/sh", "-c", "exit 3"], timeout=30)
    assert result.returncode == ORPHANED_EXIT_CODE


def test_etcd_preexec_exits_when_the_launcher_died_before_arming() -> None:
    proc = subprocess.Popen(["/bin/sh", "-c", "exit 0"], preexec_fn=die_with_parent_preexec(0))
    assert proc.wait(30) == ORPHANED_EXIT_CODE


def test_shim_child_is_killed_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen({SHIM!r} + [str(os.getpid()), 'sleep', '60'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    child = None
    try:
        child = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "the parent to start the shim"))
        # The shim execs `sleep` (same PID) once the signal is armed.
        wait_for(lambda: Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"), 30, "the shim to exec")
        parent.kill()
        parent.wait(10)
        reap([child], 10)  # SIGKILLed by the kernel; without the death signal `sleep 60` would outlive this
        child = None
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if child is not None:
            signal_all([child], signal.SIGKILL)
            reap([child], 10)
