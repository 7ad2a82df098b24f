"""Where an agent's events go by default (``elastic.events.default_events_path``), the one line that says so at
start, and one node name everywhere: the events carry the node id ``spotrun status`` lists (``elastic.nodes``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from elastic import report
from elastic.events import default_events_path, find_events_files, read_events, run_events_dir, state_home
from elastic.nodes import host_name, node_id
from tests.harness.procs import EXAMPLES, REPO, SPOTRUN, make_env

NODE_ID = re.compile(r"^[A-Za-z0-9_.-]+-\d+-[0-9a-f]{6}$")


def test_the_default_is_the_log_dir_else_a_per_run_directory_under_the_state_home(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": "/nonexistent"}
    assert default_events_path("job1", str(tmp_path / "logs"), env) == str(tmp_path / "logs" / "events.jsonl")
    assert default_events_path("job1", None, env) == str(
        tmp_path / "state" / "spotrun" / "runs" / "job1" / host_name() / "events.jsonl")
    assert state_home({"HOME": "/home/u"}) == "/home/u/.local/state"
    assert state_home({"HOME": "/home/u", "XDG_STATE_HOME": "relative"}) == "/home/u/.local/state"
    assert run_events_dir("a/../b c", env).endswith("/runs/a_.._b_c"), "a run id is one path component"
    assert find_events_files("job1", None, env) == []


def test_node_ids_have_one_form() -> None:
    first, second = node_id(), node_id()
    assert NODE_ID.match(first) and first != second


def test_spotrun_prints_the_events_path_once_and_report_finds_it_by_run_id(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = make_env(XDG_STATE_HOME=str(state), LOGLEVEL="WARNING")
    run = subprocess.run([*SPOTRUN, "--standalone", "--nproc-per-node", "1", "--no-warm-workers",
                          str(EXAMPLES / "print_env.py")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=90)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if line.startswith("spotrun: events of run ")]
    assert len(said) == 1, run.stderr
    run_id, path = re.fullmatch(r"spotrun: events of run (\S+): (.+)", said[0]).groups()  # type: ignore[union-attr]
    assert path == str(state / "spotrun" / "runs" / run_id / host_name() / "events.jsonl")
    events = read_events(path)
    assert {e["event"] for e in events} >= {"workers_started", "run_finished"}
    nodes = {e["node"] for e in events}
    assert len(nodes) == 1 and NODE_ID.match(nodes.pop()), "the rendezvous' node id, as spotrun status lists it"

    done = subprocess.run([*SPOTRUN, "report", "--rdzv-id", run_id], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"== timeline (1 nodes, {len(events)} events" in done.stdout


@pytest.mark.parametrize("given", ["flag", "env"])
def test_an_explicit_events_file_is_kept_and_printed(tmp_path: Path, given: str) -> None:
    target = tmp_path / "mine.jsonl"
    extra = {"SPOTRUN_EVENTS_FILE": str(target)} if given == "env" else {}
    flag = ["--events-file", str(target)] if given == "flag" else []
    env = make_env(XDG_STATE_HOME=str(tmp_path / "state"), LOGLEVEL="WARNING", **extra)
    run = subprocess.run([*SPOTRUN, "--standalone", "--nproc-per-node", "1", "--no-warm-workers", *flag,
                          str(EXAMPLES / "print_env.py")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=90)
    assert run.returncode == 0, run.stderr
    assert f": {target}" in run.stderr and read_events(str(target))
    assert not (tmp_path / "state").exists()
    assert report.main([str(target)]) == 0
