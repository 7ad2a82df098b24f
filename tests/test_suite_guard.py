"""The suite's process guard itself: a process orphaned by its parent is seen as ours."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.harness.procs import descendants


def test_orphaned_grandchild_is_reparented_to_the_session_and_visible() -> None:
    # The child starts a grandchild and exits at once, orphaning it.
    code = "import subprocess,sys; p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)'],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL); print(p.pid)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    grandchild = int(out.stdout.strip())
    try:
        assert grandchild in descendants(os.getpid())
    finally:
        os.kill(grandchild, 9)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(grandchild, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == grandchild:
                break
            time.sleep(0.01)
    assert grandchild not in descendants(os.getpid())
