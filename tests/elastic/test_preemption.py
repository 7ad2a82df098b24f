"""The worker-side helper: every rank stops at the same step, commits it, and acknowledges to its agent."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.preemption import (
    LINK_KIND,
    Mailbox,
    PlannedStopVoteError,
    Preemption,
    WorkerNotice,
    find_mailbox,
    remove_orphaned_mailboxes,
)
from elastic.progress import run_scoped_path
from tests.harness.dist import run_workers
from tests.harness.procs import REPO, make_env


def test_single_process_stops_at_the_next_sync_step_and_acknowledges(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    helper = Preemption(sync_every=4, mailbox_dir=str(tmp_path))
    assert box.helpers() == {0}, "the agent must see that its worker stops by itself"
    stops = []
    for step in range(1, 20):
        if step == 5:
            box.post(WorkerNotice("preempt", 123.0, "sigterm"))
        if helper.save_and_stop(None, step, {}):
            stops.append(step)
            break
    assert stops == [8] and helper.notice == WorkerNotice("preempt", 123.0, "sigterm")
    assert box.acks() == {0: 8}
    acked = box.committed_at()
    assert acked is not None and abs(acked - time.time()) < 60, "the acknowledgement carries when it committed"
    box.clear()
    assert box.helpers() == set() and box.acks() == {} and box.committed_at() is None


def test_a_deeply_nested_mailbox_file_is_skipped_not_a_traceback(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    box.acknowledge(0, 7)
    hostile = "[" * 200_000 + "]" * 200_000  # json.load raises RecursionError on this, not ValueError
    (tmp_path / "ack-1.json").write_text(hostile)
    assert box.acks() == {0: 7}, "the hostile acknowledgement is ignored, the good one still counts"
    assert box.committed_at() is not None
    (tmp_path / "notice.json").write_text(hostile)
    assert box.read_notice() == WorkerNotice("preempt", None, "unreadable notice"), "still a notice, not a crash"


@pytest.mark.parametrize("depth", [100_000, 30_000], ids=["100k-deep (over the size bound)", "30k-deep (parsed)"])
def test_a_deeply_nested_acknowledgement_is_one_warning_not_a_recursion_error(
    tmp_path: Path, depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    box = Mailbox(str(tmp_path))
    box.acknowledge(0, 7)
    (tmp_path / "ack-1.json").write_text("[" * depth + "]" * depth)
    with caplog.at_level(logging.DEBUG, logger="elastic.worker.mailbox"):
        for _ in range(50):  # the agent polls every 10 ms while its node leaves
            assert box.stops() == ({0: 7}, {}), "rank 1 has not stopped; rank 0's acknowledgement still counts"
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]  # once, not once per poll
    assert "ignoring the malformed worker acknowledgement" in warning.getMessage()
    assert ("larger than 65536 bytes" if depth == 100_000 else "nested too deeply") in warning.getMessage()
    assert not warning.exc_info and "\n" not in warning.getMessage()
    (tmp_path / "ack-1.json").write_text('{"step": -3}')  # a new version of the file: said again
    assert box.acks() == {0: 7}
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2


def test_an_acknowledgement_that_is_a_fifo_does_not_block_the_poll(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    box.acknowledge(0, 3)
    os.mkfifo(tmp_path / "ack-1.json")  # no writer: a plain open() would block the agent forever
    began = time.monotonic()
    assert box.acks() == {0: 3}
    assert time.monotonic() - began < 1.0


def test_a_worker_without_the_env_var_finds_its_agents_mailbox_by_run_id_and_group_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper (accelerate launch, srun) rebuilt the worker's environment: torch's variables survive, ours not."""
    run_id = f"job-{uuid.uuid4().hex[:8]}"
    box = Mailbox.create(root=str(tmp_path))
    try:
        box.publish_link(run_id, 1)  # what the agent does at each worker start
        monkeypatch.delenv("SPOTRUN_NOTICE_DIR", raising=False)
        env = {"TORCHELASTIC_RUN_ID": run_id, "GROUP_RANK": "1"}
        assert find_mailbox(env) == os.path.realpath(box.path)
        assert find_mailbox({**env, "GROUP_RANK": "0"}) is None, "another node's group rank: not ours"
        assert find_mailbox({**env, "SPOTRUN_NOTICE_DIR": "/given"}) == "/given", "the variable still wins"
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        Preemption(sync_every=2)
        assert box.helpers() == {0}, "the helper registered with its agent, so the agent will wait for it"
        box.publish_link(run_id, 0)  # the next round gave this node group rank 0: the old name is dropped
        assert find_mailbox(env) is None and find_mailbox({**env, "GROUP_RANK": "0"}) == os.path.realpath(box.path)
    finally:
        box.remove()
    assert not os.path.exists(box.path) and not os.path.lexists(run_scoped_path(LINK_KIND, run_id, 0))
    assert find_mailbox({"TORCHELASTIC_RUN_ID": run_id, "GROUP_RANK": "0"}) is None


def test_the_mailbox_of_a_killed_agent_is_removed_by_the_next_one(tmp_path: Path) -> None:
    """SIGKILL (or a SIGTERM grace that ran out) skips the agent's cleanup: its lock dies with it."""
    script = ("import sys, time; from elastic.preemption import Mailbox; box = Mailbox.create(sys.argv[1]); "
              "box.publish_link(sys.argv[2], 0); box.acknowledge(0, 3); print(box.path, flush=True); time.sleep(60)")
    run_id = f"killed-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), run_id], cwd=REPO, env=make_env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        dead = proc.stdout.readline().strip()  # type: ignore[union-attr]
        legacy = tmp_path / "spotrun-mailbox-legacy"  # no lock (an older spotrun): whose it is, nobody knows
        legacy.mkdir()
        live = Mailbox.create(root=str(tmp_path))
        assert os.path.isdir(dead), "a live agent's mailbox is never taken"
        assert find_mailbox({"TORCHELASTIC_RUN_ID": run_id, "GROUP_RANK": "0"}) == os.path.realpath(dead)
    finally:
        proc.kill()
        proc.wait(10)
    assert find_mailbox({"TORCHELASTIC_RUN_ID": run_id, "GROUP_RANK": "0"}) is None, "never a dead agent's mailbox"
    assert remove_orphaned_mailboxes(str(tmp_path)) == 1
    assert not os.path.exists(dead) and not os.path.lexists(run_scoped_path(LINK_KIND, run_id, 0))
    assert os.path.isdir(live.path) and legacy.is_dir()
    live.remove()
    assert not os.path.exists(live.path)


@pytest.mark.parametrize("name, body", [
    ("ack-1.json", '{"step": 1e400, "time": 1.0}'),  # inf: int() raised OverflowError, uncaught
    ("ack-1.json", '{"step": true, "time": 1.0}'),
    ("ack-1.json", '{"step": -3, "time": 1.0}'),
    ("ack-1.json", '{"step": "7", "time": 1.0}'),
    ("ack-+1.json", '{"step": 7, "time": 1.0}'),  # int("+1") and int("1_0") parse: not names we write
    ("ack-1_0.json", '{"step": 7, "time": 1.0}'),
])
def test_a_malformed_acknowledgement_is_skipped(tmp_path: Path, name: str, body: str) -> None:
    """The agent polls the acknowledgements every 10 ms while its node leaves: none may crash it."""
    box = Mailbox(str(tmp_path))
    box.acknowledge(0, 7)
    (tmp_path / name).write_text(body)
    assert box.acks() == {0: 7} and box.unsaved() == {}
    assert box.committed_at() is not None


def test_sync_every_is_validated() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        Preemption(sync_every=0, mailbox_dir="/nonexistent")


def test_sigterm_is_the_notice_without_a_mailbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTRUN_NOTICE_DIR", raising=False)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        helper = Preemption(sync_every=2)
        assert not helper.should_stop(2)
        os.kill(os.getpid(), signal.SIGTERM)  # what stock torchrun forwards to its workers
        assert not helper.should_stop(3), "only at a sync step"
        assert helper.should_stop(4) and helper.stop_step == 4 and helper.should_stop(5)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _two_ranks(rank: int, world: int, root: str) -> tuple[int, int | None, int | None, list[float], str, Any]:
    """Rank 1's agent posts a notice at step 5; rank 0's never does: both must stop at the same step and
    commit it once. Then rank 1's agent posts a notice whose ``save_by`` is already past: neither rank
    starts the save (rank 0, which has time, follows rank 1's answer). Then a vote rank 1 never joins: rank 0
    fails within the vote's timeout, naming it."""
    import torch.distributed as dist

    from checkpoint import CheckpointConfig, Checkpointer

    box = Mailbox(os.path.join(root, f"mailbox-{rank}"))
    os.makedirs(box.path, exist_ok=True)
    os.environ["LOCAL_RANK"] = "0"
    helper = Preemption(sync_every=3, mailbox_dir=box.path)
    weights = torch.zeros(4)
    state = {"w": weights}
    with Checkpointer(os.path.join(root, "ckpt"), CheckpointConfig()) as ckpt:
        step = 0
        while step < 100:
            step += 1
            weights += step
            if rank == 1 and step == 5:
                box.post(WorkerNotice("preempt", None, "test"))
            if helper.save_and_stop(ckpt, step, state):
                break
        latest, acked = ckpt.latest(), box.acks().get(0)
        again = Preemption(sync_every=1, mailbox_dir=box.path)
        if rank == 1:
            box.post(WorkerNotice("preempt", time.time() + 1, "test", save_by=time.time()))
        weights += 1
        assert again.save_and_stop(ckpt, step + 1, state), "both ranks stop at the next step"
        skipped = [ckpt.latest(), box.unsaved().get(0, (None, ""))[0], again.skipped is not None]
    lonely = Preemption(sync_every=1, mailbox_dir=box.path, timeout=timedelta(seconds=1))
    vote_error = ""
    if rank == 0:
        began = time.monotonic()
        with pytest.raises(PlannedStopVoteError, match="did not reach step 7 within 1 s") as caught:
            lonely.should_stop(7)
        vote_error = f"{type(caught.value).__name__} after {time.monotonic() - began:.1f} s"
    dist.barrier()  # rank 1 waits here (the training's group) until rank 0's vote timed out
    return step, latest, acked, weights.tolist(), vote_error, skipped


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_every_rank_agrees_on_the_step_and_commits_it(tmp_path: Path) -> None:
    results = run_workers(_two_ranks, 2, (str(tmp_path),), tmpdir=str(tmp_path), timeout=50)
    assert [r[0] for r in results] == [6, 6], "both ranks stop at the first sync step after the notice"
    assert [r[1] for r in results] == [6, 6], "and that step is committed"
    assert [r[2] for r in results] == [6, 6], "and each rank acknowledged it to its agent"
    assert [r[5] for r in results] == [[6, 7, True], [6, 7, True]], "step 7 not saved on any rank, acknowledged so"
    error, seconds = results[0][4].split(" after ")
    assert error == "PlannedStopVoteError" and float(seconds.split()[0]) < 10, "a vote is bounded by its timeout"


def test_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="timeout must be a positive datetime.timedelta"):
        Preemption(mailbox_dir="/nonexistent", timeout=30)  # type: ignore[arg-type]


def test_a_helper_file_being_written_is_not_read(tmp_path) -> None:
    """A worker's atomic write creates ``helper-N.tmpPID`` before renaming it: the agent must not parse it
    (it did, and the agent died on int('1.tmp16786') in a CI run)."""
    box = Mailbox(str(tmp_path))
    (tmp_path / "helper-0").write_text("{}")
    (tmp_path / "helper-1.tmp16786").write_text("{")
    (tmp_path / "helper-x").write_text("{}")
    assert box.helpers() == {0}


@pytest.fixture
def notice_handlers() -> Any:
    """Restores SIGTERM's and SIGUSR2's handlers after a helper replaced them in this process."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_the_agents_notice_signals_are_the_workers_notice_too(tmp_path: Path, notice_handlers: Any) -> None:
    """Slurm signals every process of the job step: a worker running the helper under spotrun gets its agent's
    notice signal itself and must stop at the agreed step like one told through the mailbox (it died of it)."""
    box = Mailbox.create(root=str(tmp_path), notice_signals=(signal.SIGTERM, signal.SIGUSR2))
    try:
        assert box.notice_signals() == {signal.SIGTERM, signal.SIGUSR2}
        helper = Preemption(sync_every=2, mailbox_dir=box.path)
        assert not helper.should_stop(2)
        os.kill(os.getpid(), signal.SIGUSR2)  # --preempt-signal USR2 with #SBATCH --signal=USR2@120
        assert not helper.should_stop(3), "only at a sync step"
        assert helper.should_stop(4) and helper.notice == WorkerNotice("preempt", None, "SIGUSR2")
        # The agent's posted notice wins over the signal's: it carries the deadline the save decision needs.
        box.post(WorkerNotice("preempt", 123.0, "sigterm", save_by=120.0))
        assert helper._local_notice() == WorkerNotice("preempt", 123.0, "sigterm", save_by=120.0)
    finally:
        box.remove()
    assert not os.path.exists(box.path), "the signals file goes with the mailbox"


def test_a_mailbox_without_a_readable_signals_file_means_sigterm(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    assert box.notice_signals() == {signal.SIGTERM}, "an older agent's mailbox"
    for body in ("[9, 19]", "[true]", '{"a": 1}', "[", "[15.0]"):  # SIGKILL/SIGSTOP cannot be handled
        (tmp_path / ".signals").write_text(body)
        assert box.notice_signals() == {signal.SIGTERM}, body
    (tmp_path / ".signals").write_text("[12, 99999]")
    assert box.notice_signals() == {signal.SIGUSR2}


_HELPER_SCRIPT = """
import os, sys, time
from elastic.preemption import Preemption
helper = Preemption(sync_every=1, mailbox_dir=sys.argv[1])
print("ready", flush=True)
step = 0
while step < 100_000:
    step += 1
    if helper.save_and_stop(None, step, {}):
        print("stopped", step, helper.notice.source, flush=True)
        sys.exit(0)
    time.sleep(0.01)
sys.exit(3)
"""


def _start_helper(box: Mailbox) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HELPER_SCRIPT, box.path], cwd=REPO, env=make_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
    return proc


@pytest.mark.timeout(60)
def test_a_worker_stops_at_once_on_sigterm_while_its_agent_stops_the_group(tmp_path: Path) -> None:
    """The agent stops workers with SIGTERM for restarts (stop grace 3 s): it marks the mailbox `stopping`
    first, and the helper lets that SIGTERM end the worker as an unhandled one would, not wait for a save."""
    box = Mailbox.create(root=str(tmp_path))
    try:
        told = _start_helper(box)
        told.send_signal(signal.SIGTERM)
        out, err = told.communicate(timeout=30)
        assert told.returncode == 0 and out.split()[:1] == ["stopped"] and out.split()[2] == "SIGTERM", err
        assert box.acks(), "the notice signal was acknowledged like a posted notice"
        box.clear()
        stopped = _start_helper(box)
        box.mark_stopping()
        stopped.send_signal(signal.SIGTERM)
        _, err = stopped.communicate(timeout=30)
        assert stopped.returncode == -signal.SIGTERM, err
        assert not box.acks()
    finally:
        box.remove()
