"""Hang detection: the pure verdict over progress samples, and the worker/agent progress file round trip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic.api import LaunchConfigError
from elastic.hang import (
    HangPolicy,
    ProgressSample,
    budget,
    judge,
    new_track,
    observe,
    waiting_on_peers,
)
from elastic.progress import MAGIC, ProgressBoard, dump_path, progress_path, remove_orphaned_progress_files
from tests.harness.procs import REPO, wait_for

pytestmark = pytest.mark.timeout(60)

FIXED = HangPolicy(timeout=5.0, startup_timeout=30.0, warmup_beats=2)


def _run(track, samples, policy=FIXED):
    """Feed (time, beats, cpu, stopped) samples; return the verdict at the last time."""
    now = 0.0
    for now, beats, cpu, stopped in samples:
        observe(track, ProgressSample(beats=beats, activity=cpu, stopped=stopped), now)
    return judge({1: track}, policy, now)


def test_a_worker_that_keeps_beating_is_never_hung() -> None:
    track = new_track(0.0)
    verdict = _run(track, [(t, t, 100, False) for t in range(100)])
    assert not verdict.hung and not verdict.need_stack


def test_cpu_use_alone_is_progress_but_a_flat_main_thread_is_a_stall() -> None:
    track = new_track(0.0)
    busy = [(float(t), 3, 100 + t, False) for t in range(40)]
    assert not _run(track, busy).need_stack
    stall = [(40.0 + t, 3, 139, False) for t in range(5)]  # flat since 39 s: 5 s at 44 s, not over
    assert not _run(track, stall).need_stack
    verdict = _run(track, [(45.5, 3, 139, False)])
    assert verdict.need_stack == {1} and not verdict.hung


def test_a_stalled_worker_is_hung_unless_its_stack_waits_on_peers() -> None:
    track = new_track(0.0)
    _run(track, [(0.0, 0, 1, False), (1.0, 2, 2, False), (2.0, 3, 3, False)])
    track.waiting_on_peers = False
    verdict = _run(track, [(8.0, 3, 3, False)])
    assert set(verdict.hung) == {1} and "no progress for 6.0 s (budget 5.0 s)" in verdict.hung[1]
    track.waiting_on_peers = True
    verdict = _run(track, [(9.0, 3, 3, False)])
    assert not verdict.hung and verdict.waiting == {1}
    # progress ends the stall and forgets the stack look
    _run(track, [(9.5, 4, 3, False)])
    assert track.waiting_on_peers is None


def test_a_stopped_worker_is_hung_without_a_stack_look() -> None:
    track = new_track(0.0)
    _run(track, [(0.0, 0, 1, False), (1.0, 3, 2, False)])
    verdict = _run(track, [(7.0, 3, 2, True)])
    assert "stopped" in verdict.hung[1]


def test_startup_budget_until_warmup_beats_but_not_forever() -> None:
    policy = HangPolicy(timeout=5.0, startup_timeout=30.0, warmup_beats=3)
    track = new_track(0.0)
    observe(track, ProgressSample(beats=1, activity=1), 1.0)
    assert budget(track, policy, 10.0) == 30.0
    assert not judge({0: track}, policy, 25.0).need_stack  # 24 s flat, still starting up
    assert budget(track, policy, 31.0) == 5.0  # start-up window over even without 3 beats
    observe(track, ProgressSample(beats=3, activity=2), 2.0)
    assert budget(track, policy, 3.0) == 5.0


def test_adaptive_budget_is_a_multiple_of_the_slowest_recent_step_with_a_floor() -> None:
    policy = HangPolicy(multiplier=10.0, floor=4.0, startup_timeout=100.0, warmup_beats=2)
    track = new_track(0.0)
    for i in range(1, 6):
        observe(track, ProgressSample(beats=i, activity=i), i * 0.1)
    assert budget(track, policy, 1.0) == 4.0  # 10 x 0.1 s < floor
    observe(track, ProgressSample(beats=7, activity=9), 0.5 + 2.0)  # two steps in 2 s: 1 s per step
    assert budget(track, policy, 3.0) == pytest.approx(10.0)


@pytest.mark.parametrize("kwargs", [{"timeout": 0}, {"timeout": -1.0}, {"startup_timeout": float("nan")},
                                    {"floor": 0}, {"warmup_beats": 0}])
def test_policy_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(LaunchConfigError, match="hang detection"):
        HangPolicy(**kwargs)


DUMP_IN_COLLECTIVE = textwrap.dedent("""\
    Thread 0x00007f0000000002 (most recent call first):
      File "/x/threading.py", line 982 in run

    Current thread 0x00007f0000000001 (most recent call first):
      File "/venv/torch/distributed/distributed_c10d.py", line 2950 in all_reduce
      File "/job/train.py", line 40 in main
""")


def test_waiting_on_peers_reads_the_main_threads_frames() -> None:
    assert waiting_on_peers(DUMP_IN_COLLECTIVE)
    assert waiting_on_peers(DUMP_IN_COLLECTIVE, main_thread_id=0x7F0000000001)
    assert not waiting_on_peers(DUMP_IN_COLLECTIVE, main_thread_id=0x7F0000000002)
    assert not waiting_on_peers('Current thread 0x1 (most recent call first):\n  File "/job/x.py", line 3 in sleep\n')
    assert not waiting_on_peers("")
    wrapped = ('Current thread 0x1 (most recent call first):\n  File "/job/x.py", line 3 in inject\n'
               '  File "/venv/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 9 in wrapper\n')
    assert not waiting_on_peers(wrapped)  # torch's entrypoint wrappers are outer frames of every worker


WORKER = textwrap.dedent("""\
    import sys, time, torch
    from elastic import progress
    assert progress.install()
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(3):
        p.grad = torch.ones(1); opt.step()
    progress.heartbeat()
    print("ready", flush=True)
    time.sleep(60)
""")


def test_board_sees_optimizer_steps_heartbeats_and_dumps_a_stuck_workers_stack(tmp_path: Path) -> None:
    board = ProgressBoard("job/1", root=str(tmp_path))
    board.reset(group_rank=0, local_ranks=[0])
    env = dict(os.environ, TORCHELASTIC_RUN_ID="job/1", GROUP_RANK="0", LOCAL_RANK="0", PYTHONPATH=str(REPO))
    env_root = f"import elastic.worker.runfiles as R; R._root = lambda: {str(tmp_path)!r}\n"
    proc = subprocess.Popen([sys.executable, "-c", env_root + WORKER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        sample = board.sample(0, proc.pid)
        assert sample is not None and sample.beats == 4 and not sample.stopped
        # "ready" is printed just before the sleep: a dump can still catch the worker on the print line.
        dumps = wait_for(lambda: (d := board.stacks({0: proc.pid})) and "line 11 in <module>" in d[0] and d, 5,
                         "a stack dump of the worker in its sleep (line 11)")
        assert not waiting_on_peers(dumps[0], board.main_thread_id(0))
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: (s := board.sample(0, proc.pid)) is not None and s.stopped, 5, "T state")
    finally:
        proc.kill()
        proc.wait()
        board.close()
    assert not list(tmp_path.iterdir())


def test_a_symlink_planted_at_the_boards_temporary_name_is_not_followed(tmp_path: Path) -> None:
    """/dev/shm is shared and the names are guessable: a link at ``<path>.tmp<pid>`` must not make the agent
    truncate and write into its target."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 100)
    path = progress_path("job", 0, 0, str(tmp_path))
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    board = ProgressBoard("job", root=str(tmp_path))
    board.reset(group_rank=0, local_ranks=[0])
    try:
        assert victim.read_bytes() == b"precious" * 100, "the link's target was written"
        assert not os.path.islink(path) and os.path.getsize(path) == 64
    finally:
        board.close()


def test_the_progress_files_of_a_killed_agent_are_removed_by_the_next_ones_sweep(tmp_path: Path) -> None:
    """SIGKILL skips the board's close(): the files' locks die with the agent, a live agent's files stay."""
    root = str(tmp_path)
    script = ("import sys, time; from elastic.progress import ProgressBoard, dump_path, progress_path; "
              "ProgressBoard('killed', root=sys.argv[1]).reset(0, [0, 1]); "
              "open(dump_path(progress_path('killed', 0, 0, sys.argv[1])), 'w').close(); "
              "print('ready', flush=True); time.sleep(60)")
    dead = [progress_path("killed", 0, rank, root) for rank in (0, 1)]
    live = ProgressBoard("alive", root=root)
    live.reset(0, [0])
    legacy = progress_path("legacy", 0, 0, root)  # an older spotrun's file, without a lock: never taken
    with open(legacy, "wb") as handle:
        handle.write(MAGIC.to_bytes(8, "little") + bytes(56))
    fifo = progress_path("fifo", 0, 0, root)  # not a file of ours (anyone can make such a name in /dev/shm)
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", script, root], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert remove_orphaned_progress_files(root) == 0, "a live agent's files are never taken"
        assert all(os.path.exists(p) for p in dead)
    finally:
        proc.kill()
        proc.wait(10)
    try:
        assert remove_orphaned_progress_files(root) == 2
        assert not any(os.path.exists(p) for p in dead) and not os.path.exists(dump_path(dead[0]))
        assert os.path.exists(progress_path("alive", 0, 0, root)) and os.path.exists(legacy)
    finally:
        live.close()
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in (fifo, legacy))


def test_heartbeat_is_a_noop_outside_spotrun() -> None:
    code = "from elastic import progress\nprogress.heartbeat()\nprint(progress.install())"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# --- flags, causes and the one-line failure log -------------------------------------------------------------


def test_hang_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.cli import build_parser, settings_from_args

    def settings(*argv: str):
        return settings_from_args(build_parser().parse_args([*argv, "train.py", "--hang", "--preempt"]))

    for name in ("SPOTRUN_HANG_TIMEOUT", "SPOTRUN_HANG_STARTUP_TIMEOUT", "SPOTRUN_HANG_DETECTION"):
        monkeypatch.delenv(name, raising=False)
    assert settings().hang == HangPolicy()  # on by default, adaptive
    assert settings("--hang-timeout", "7", "--hang-startup-timeout", "90").hang == HangPolicy(timeout=7,
                                                                                              startup_timeout=90)
    assert settings("--no-hang-detection").hang is None
    monkeypatch.setenv("SPOTRUN_HANG_TIMEOUT", "4")
    monkeypatch.setenv("SPOTRUN_HANG_STARTUP_TIMEOUT", "50")
    assert settings().hang == HangPolicy(timeout=4, startup_timeout=50)
    monkeypatch.setenv("SPOTRUN_HANG_DETECTION", "0")
    assert settings().hang is None
    monkeypatch.setenv("SPOTRUN_HANG_DETECTION", "maybe")
    with pytest.raises(LaunchConfigError, match="SPOTRUN_HANG_DETECTION"):
        settings()
    monkeypatch.delenv("SPOTRUN_HANG_DETECTION")
    with pytest.raises(LaunchConfigError, match="timeout"):
        settings("--hang-timeout", "0")
    # the script's own --hang/--preempt are passed through, never taken for an abbreviated spotrun flag
    args = build_parser().parse_args(["train.py", "--hang", "--preempt"])
    assert args.training_script_args == ["--hang", "--preempt"]


def test_recovery_cause_of_a_failed_group() -> None:
    from elastic.api import RecoveryCause
    from elastic.failures import recovery_cause_of_failure

    assert recovery_cause_of_failure(hung=True, peer=RecoveryCause.PEER_LOST) is RecoveryCause.HANG
    assert recovery_cause_of_failure(hung=False, peer=RecoveryCause.PEER_LOST) is RecoveryCause.PEER_LOST
    assert recovery_cause_of_failure(hung=False, peer=RecoveryCause.PEER_FAILURE) is RecoveryCause.PEER_FAILURE
    assert recovery_cause_of_failure(hung=False, peer=None) is RecoveryCause.FAILURE


def test_torchs_worker_failure_traceback_becomes_one_line(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from elastic.agent_procs import quiet_worker_failure_tracebacks

    quiet_worker_failure_tracebacks()
    quiet_worker_failure_tracebacks()  # idempotent
    torch_logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    try:
        raise RuntimeError("\n\n-- Process 1 terminated with the following error:\nTraceback ...\n  gloo: reset")
    except RuntimeError:
        with caplog.at_level(logging.ERROR, logger=torch_logger.name):
            torch_logger.exception("failed (exitcode: %s) local_rank: %s", 1, 1)
            torch_logger.exception("something else")
    first, other = caplog.records
    assert first.exc_info is None and first.getMessage().startswith("failed (exitcode: 1) local_rank: 1: -- Process 1")
    assert "\n" not in first.getMessage()
    assert other.exc_info is not None  # only torch's worker-failure record is shortened
