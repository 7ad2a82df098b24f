"""Unit tests of the agent's building blocks: event log, settings, warm entrypoint parsing, death clock."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from elastic.api import LaunchConfigError, RecoveryEvent
from elastic.config import AgentSettings
from elastic.events import JsonlEventLog, read_events
from elastic.workers import (
    DeathClock,
    ScriptEntrypoint,
    shim_command,
    terminate_processes,
    wait_for_workers,
    warm_entrypoint,
)
from tests.elastic.doubles import MemoryEventLog
from tests.harness.procs import wait_for

pytestmark = pytest.mark.timeout(60)


def test_jsonl_event_log_appends_one_line_per_event_with_context(tmp_path: Path) -> None:
    ticks = iter([10.0, 11.5])
    log = JsonlEventLog(str(tmp_path / "sub" / "events.jsonl"), run_id="job", node="h:1",
                        clock=lambda: next(ticks), wall_clock=lambda: 1e9)
    log.emit(RecoveryEvent.FAILURE_DETECTED, round=3, cause="worker_failure")
    log.emit(RecoveryEvent.WORKERS_STARTED, round=4, pids=[1, 2])
    events = read_events(log.path)
    assert [e["event"] for e in events] == ["failure_detected", "workers_started"]
    assert events[0] == {"event": "failure_detected", "run_id": "job", "node": "h:1", "t_mono": 10.0,
                         "t_wall": 1e9, "round": 3, "cause": "worker_failure"}
    assert events[1]["t_mono"] - events[0]["t_mono"] == 1.5


def test_read_events_skips_a_partial_last_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"event": "a"}) + "\n" + '{"event": "b"')
    assert read_events(str(path)) == [{"event": "a"}]
    assert read_events(str(tmp_path / "missing.jsonl")) == []


def test_memory_event_log() -> None:
    log = MemoryEventLog()
    log.emit(RecoveryEvent.RENDEZVOUS_STARTED, round=0)
    assert log.records == [{"event": "rendezvous_started", "round": 0}]


@pytest.mark.parametrize("field", ["stop_grace", "peer_loss_grace"])
@pytest.mark.parametrize("value", [-1, float("nan"), float("inf")])
def test_settings_reject_bad_durations(field: str, value: float) -> None:
    with pytest.raises(LaunchConfigError, match=field):
        AgentSettings(**{field: value})


def test_warm_entrypoint_accepts_only_python_scripts_and_modules() -> None:
    entry, args = warm_entrypoint(sys.executable, ["-u", "train.py", "--lr", "1"])
    assert isinstance(entry, ScriptEntrypoint) and (entry.target, entry.module, args) == ("train.py", False, ["--lr", "1"])
    entry, args = warm_entrypoint(sys.executable, ["-u", "-m", "pkg.train", "x"])
    assert (entry.target, entry.module, entry.__name__, args) == ("pkg.train", True, "pkg.train", ["x"])
    assert warm_entrypoint("/bin/echo", ["hi"]) is None  # --no-python
    assert warm_entrypoint(sys.executable, ["-u", "-c", "print(1)"]) is None
    assert warm_entrypoint(lambda: None, []) is None  # --run-path


def test_shim_command_wraps_the_real_command() -> None:
    exe, args = shim_command("/bin/echo", ("a", "b"), agent_pid=42)
    assert exe == sys.executable and args[0] == "-S" and args[1].endswith("workers.py")
    assert args[2:] == ("42", "/bin/echo", "a", "b")


def _sleep_forever() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stuck worker
    time.sleep(600)


def _exit_3() -> None:
    os._exit(3)


def test_death_clock_orders_deaths_and_terminate_kills_stuck_processes() -> None:
    ctx = multiprocessing.get_context("fork")
    first, stuck = ctx.Process(target=_exit_3), ctx.Process(target=_sleep_forever)
    stuck.start()
    first.start()
    clock = DeathClock({0: first.sentinel, 1: stuck.sentinel})
    try:
        first.join(10)
        deadline = time.monotonic() + 5
        while 0 not in clock.died_at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 in clock.died_at and 1 not in clock.died_at
        began = time.monotonic()
        terminate_processes([first, stuck], grace=0.5)
        stuck.join(5)
        assert stuck.exitcode == -signal.SIGKILL, "SIGTERM is ignored, so SIGKILL after the grace"
        assert time.monotonic() - began < 3
    finally:
        clock.stop()
        for proc in (first, stuck):
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def _return_then_wait(queue: object, release: object) -> None:
    queue.put("returned")  # type: ignore[attr-defined]  # like torch's _wrap: the return value, then a wait
    release.wait(10)  # type: ignore[attr-defined]


def test_wait_for_workers_wakes_on_a_return_value_or_an_exit_not_at_the_timeout() -> None:
    """The agent waits on this while its workers head for an agreed step: it must act when they finish."""
    ctx = multiprocessing.get_context("fork")
    queue, release = ctx.SimpleQueue(), ctx.Event()
    worker = ctx.Process(target=_return_then_wait, args=(queue, release))
    worker.start()
    try:
        began = time.monotonic()
        assert wait_for_workers([worker], {0: queue}, 30)
        assert time.monotonic() - began < 10 and worker.is_alive(), "woken by the return value, before the exit"
        assert queue.get() == "returned"
        release.set()
        assert wait_for_workers([worker], {0: queue}, 30), "woken by the exit"
        worker.join(5)
        began = time.monotonic()
        assert not wait_for_workers([worker], {0: queue}, 0.2), "nothing left to happen: the timeout"
        assert not wait_for_workers(None, None, 0.05)
        assert time.monotonic() - began >= 0.2
    finally:
        if worker.is_alive():
            worker.kill()
        worker.join(5)


def _exit_3_or_ignore_sigterm(rank: int, ready: str) -> None:
    if rank == 0:
        sys.exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck, like a rank blocked in a collective
    Path(ready).touch()
    time.sleep(120)


def test_a_failed_worker_the_death_clock_has_not_noted_yet_still_gets_the_short_grace(tmp_path: Path) -> None:
    """torch's ProcessContext.join, on a worker's death, SIGTERMs the others and waits 30 s before SIGKILL; the
    agent stops them itself with --stop-grace first. It did that only once the death clock's thread had noted
    the death, and on a loaded machine that thread often ran after the agent's tick: the restart then took
    30 s (test_stuck_worker_is_killed_after_the_stop_grace failed 1 run in 5 beside two busy cores). Here the
    clock never notes it (no sentinels): the agent must see the death itself, and still name rank 0 first."""
    from torch.distributed.elastic.agent.server.api import Worker, WorkerState
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from elastic.agent_procs import default_close_timeout
    from elastic.torch_internals import worker_processes
    from tests.elastic.test_agent_membership import PollingHandler, make_agent

    agent = make_agent(PollingHandler(), tmp_path, settings=AgentSettings(stop_grace=1.0))
    ready = tmp_path / "rank-1-ignores-sigterm"
    pcontext = start_processes("stuck", _exit_3_or_ignore_sigterm, args={r: (r, str(ready)) for r in range(2)},
                               envs={0: {}, 1: {}}, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
                               start_method="fork")
    try:
        agent._pcontext = pcontext
        default_close_timeout(pcontext, 1.0, agent._workers_closing)
        agent._death_clock = DeathClock({})  # its thread has noted nothing (yet)
        group = agent.get_worker_group()
        group.workers = [Worker(local_rank=r, global_rank=r, role_rank=r, world_size=2, role_world_size=2)
                         for r in range(2)]  # fmt: skip
        for worker, pid in zip(group.workers, pcontext.pids().values()):
            worker.id = pid
        processes = worker_processes(pcontext)
        assert processes is not None
        processes[0].join(20)
        wait_for(ready.exists, 20, "rank 1 to ignore SIGTERM")
        assert processes[0].exitcode == 3 and processes[1].is_alive()
        began = time.monotonic()
        result = agent.monitor()
        took = time.monotonic() - began
        assert result.state == WorkerState.FAILED
        assert took < 10, f"the stuck rank was stopped after {took:.1f} s, not after the 1 s stop grace"
        assert processes[1].exitcode == -signal.SIGKILL, "it ignores SIGTERM: killed after the grace"
        first = next(iter(result.failures.values()))
        assert (first.local_rank, first.exitcode) == (0, 3), result.failures
        # rank 0 counts as dead on its own (noted before the close began), rank 1 as stopped by the agent
        assert set(agent._death_clock.died_at) == {0}
        assert agent._close_started_at is not None and agent._death_clock.died_at[0] <= agent._close_started_at
    finally:
        pcontext.close(timeout=1)
