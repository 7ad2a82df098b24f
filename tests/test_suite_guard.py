"""The suite's own shape: a process orphaned by its parent is seen as ours; a whole-suite run leaves the long cases out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.harness.procs import REPO, descendants


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


def _pytest_with_this_suites_hooks(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest on a tiny suite in ``root`` (one short and one long test under ``testpaths``) with this suite's
    collection hooks: the rule itself, without importing torch for the real long files."""
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = cases\nmarkers =\n    long: a long case\n")
    (root / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems, pytest_terminal_summary\n")
    (root / "cases").mkdir(exist_ok=True)
    (root / "cases" / "test_cases.py").write_text(
        "import pytest\n\ndef test_short():\n    pass\n\n@pytest.mark.long\ndef test_long():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=60)


def test_a_whole_suite_run_leaves_the_long_cases_out_and_says_how_to_run_them(tmp_path: Path) -> None:
    whole = _pytest_with_this_suites_hooks(tmp_path)  # no path, no -m: what tests/run.sh runs by default
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "test_short PASSED" in whole.stdout and "test_long" not in whole.stdout, whole.stdout
    assert "1 long tests (marker 'long') left out of this whole-suite run" in whole.stdout, whole.stdout
    assert "1 passed, 1 deselected" in whole.stdout, whole.stdout
    # CI's second step: -m long runs them and only them.
    long = _pytest_with_this_suites_hooks(tmp_path, "-m", "long")
    assert "test_long PASSED" in long.stdout and "test_short" not in long.stdout, long.stdout
    assert "left out" not in long.stdout, long.stdout
    # A path on the command line runs what it names, long or not.
    named = _pytest_with_this_suites_hooks(tmp_path, "cases/test_cases.py")
    assert "2 passed" in named.stdout and "left out" not in named.stdout, named.stdout
