"""The suite's own shape: a process orphaned by its parent is seen as ours; a whole-suite run leaves the long cases out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


_INTERNAL_ERROR_AT_B = '''
import pytest
from tests.conftest import pytest_collection_finish, pytest_runtest_logreport, pytest_xdist_node_collection_finished


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if item.name == "test_b" and call.when == "call":
        raise RuntimeError("a plugin broke")  # pytest: INTERNALERROR, the session ends here
    return report
'''


def _suite_with_an_internal_error(root: Path) -> None:
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = cases\n")
    (root / "conftest.py").write_text(_INTERNAL_ERROR_AT_B)
    (root / "cases").mkdir()
    (root / "cases" / "test_one.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
                                                "def test_c():\n    pass\n")
    (root / "cases" / "test_two.py").write_text("def test_d():\n    pass\n")


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one-process", "xdist"])
def test_tests_an_internal_error_kept_from_running_are_named(tmp_path: Path, workers: list[str]) -> None:
    """pytest stopped by an INTERNALERROR counts only what ran (a fresh clone's run once ended at 18 % with 925
    tests never run and no failure text); the account names the ones that never ran, for tests/run.sh."""
    _suite_with_an_internal_error(tmp_path)
    account = tmp_path / "account"
    account.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPOTRUN_TEST_ACCOUNT": str(account)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run in an xdist worker
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "INTERNALERROR" in run.stdout + run.stderr, run.stdout + run.stderr
    named = subprocess.run([sys.executable, "-m", "tests.harness.accounting", str(account), str(run.returncode)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert named.returncode == 1, named.stdout + named.stderr
    missing = [line.split()[-1] for line in named.stdout.splitlines()[1:]]
    assert "cases/test_one.py::test_b" in missing and "cases/test_one.py::test_a" not in missing, named.stdout
    if not workers:  # one process: the session ended at b
        assert missing == ["cases/test_one.py::test_b", "cases/test_one.py::test_c", "cases/test_two.py::test_d"]
    assert "tests collected never ran" in named.stdout.splitlines()[0], named.stdout


def test_a_run_that_ran_everything_names_nothing(tmp_path: Path) -> None:
    account = tmp_path / "account"
    account.mkdir()
    (account / "collected").write_text("a.py::x\na.py::y\n")
    (account / "reported").write_text("a.py::y\na.py::x\na.py::x\n")
    named = subprocess.run([sys.executable, "-m", "tests.harness.accounting", str(account), "0"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert named.returncode == 0 and named.stdout == "", named.stdout


_PARSING_THREAD = '''
import ast, threading, pytest

SOURCE = open(ast.__file__).read()


class Finalized:
    def __del__(self):  # a finalizer run by the collector lets another thread in mid-parse
        pass


def _garbage():
    for _ in range(200):
        a, b = Finalized(), Finalized()
        a.b, b.a = b, a


@pytest.fixture
def parsing_thread():
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            ast.parse(SOURCE)
            _garbage()

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


@pytest.mark.parametrize("i", range(4))
def test_fails_while_another_thread_parses(parsing_thread, i):
    _garbage()
    assert i < 0
'''


def test_a_failure_formatted_while_another_thread_parses_is_reported_not_an_internal_error(tmp_path: Path) -> None:
    """CPython 3.11's AST race (python/cpython#106905) while pytest formats a failure: an INTERNALERROR ended the
    run (4 of 4 runs of this case without the guard, at the first or second failure). With the guard every failure is
    reported."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport\n")
    padding = "".join(f"\ndef pad_{i}(x):\n    return [x + {i} for _ in range(3) if x]\n" for i in range(3000))
    (tmp_path / "test_race.py").write_text(_PARSING_THREAD + padding)  # a long module: pytest parses it per failure
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_race.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "INTERNALERROR" not in run.stdout + run.stderr, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 1 and "4 failed" in run.stdout, run.stdout[-3000:]
