"""SIGKILL during a save at >= 20 seeded points: ``latest()`` always names a loadable, intact step.

One worker process imports torch once and forks a child per crash point (fork is ~ms; a fresh
interpreter per point would cost ~2 s of ``import torch``). The child saves with
``SPOTRUN_CKPT_CRASH_AT=<point>:<n>``; when the point is reached it announces itself on the pipe and
blocks, and the test kills it by PID with SIGKILL, then checks the checkpoint from this process.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps
from checkpoint.faults import CRASH_POINTS
from checkpoint.state import RNGState

SEED = 20261121
ROWS = 256

WORKER = r"""
import os, sys
import torch
torch.set_num_threads(1)
import checkpoint.faults as faults
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.state import RNGState

def say(text):
    os.write(1, (text + "\n").encode())

def child(point, n, step, uri):
    os.environ[faults.CRASH_AT_ENV] = f"{point}:{n}"
    os.environ[faults.CRASH_NOTIFY_FD_ENV] = "1"
    faults.reset()
    state = {"a": torch.full((ROWS, 1024), float(step)), "b": torch.full((ROWS, 1024), -float(step)),
             "step": step, "rng": RNGState()}
    cfg = CheckpointConfig(keep_last=2, async_mode=True, checksum_block_bytes=1 << 16,
                           max_shard_bytes=1 << 20, writer_threads=2)
    with Checkpointer(uri, cfg) as ckpt:
        ckpt.save(step, state)
    say(f"done {os.getpid()}")

# Warm up once (lazy imports, first-save planning) so each forked child only pays for its own save.
with Checkpointer("memory://crash-warmup", CheckpointConfig()) as warm:
    warm.save(0, {"a": torch.zeros(4), "step": 0})

for line in sys.stdin:
    point, n, step, uri = line.split()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child(point, int(n), int(step), uri)
        except BaseException as exc:
            say(f"error {os.getpid()} {type(exc).__name__}: {exc}".replace("\n", " "))
            code = 1
        os._exit(code)
    say(f"child {pid}")
    _, status = os.waitpid(pid, 0)
    say(f"exit {pid} {status}")
""".replace("ROWS", str(ROWS))


def schedule(rng: random.Random) -> list[tuple[str, int]]:
    """Every crash point once, plus seeded extra hits deep inside the shard writes and retention."""
    points = [(p, 1) for p in CRASH_POINTS]
    points += [("shard.block", rng.randint(2, 32)) for _ in range(4)]
    points += [("shard.before_commit", 2), ("shard.open", 2), ("retention.delete", 2)]
    rng.shuffle(points)
    return points


def expected_state(step: int) -> dict[str, object]:
    return {"a": torch.full((ROWS, 1024), float(step)), "b": torch.full((ROWS, 1024), -float(step)), "step": step}


def assert_loadable(uri: str) -> int:
    with Checkpointer(uri) as ckpt:
        latest = ckpt.latest()
        assert latest is not None, "a crash left no loadable step"
        dst = {"a": torch.zeros(ROWS, 1024), "b": torch.zeros(ROWS, 1024), "step": -1, "rng": RNGState()}
        assert ckpt.load(dst) == latest
    want = expected_state(latest)
    assert torch.equal(dst["a"], want["a"]) and torch.equal(dst["b"], want["b"]) and dst["step"] == latest
    return latest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_at_seeded_points_always_leaves_a_loadable_step(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    with Checkpointer(uri, CheckpointConfig(keep_last=2)) as ckpt:
        ckpt.save(1, {**expected_state(1), "rng": RNGState()})
    points = schedule(random.Random(SEED))
    assert len(points) >= 20
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1
    )
    outcomes: dict[str, int] = {"killed": 0, "completed": 0}
    try:
        latest = 1
        for i, (point, n) in enumerate(points):
            step = 10 * (i + 2)
            worker.stdin.write(f"{point} {n} {step} {uri}\n")
            worker.stdin.flush()
            tag, pid = worker.stdout.readline().split()[:2]
            assert tag == "child", tag
            line = worker.stdout.readline()
            if line.startswith("reached"):
                assert line.split()[1] == point
                os.kill(int(pid), signal.SIGKILL)
                outcomes["killed"] += 1
                exit_line = worker.stdout.readline()
                assert exit_line.startswith("exit")
            else:
                assert line.startswith("done"), f"{point}:{n}: {line}"
                outcomes["completed"] += 1
                assert worker.stdout.readline().startswith("exit")
            now = assert_loadable(uri)
            assert now in (latest, step), f"after a crash at {point}:{n} latest went from {latest} to {now}"
            if point in ("commit.after", "latest.before", "latest.after", "retention.before", "retention.delete"):
                assert now == step, f"the commit marker was written before {point}, step {step} must count"
            if point in (
                "stage.end",
                "shard.after_commit",
                "rank_objects.after",
                "records.gathered",
                "manifest.after",
                "commit.before",
            ):
                assert now == latest, f"crash at {point} is before the commit marker: step {step} must not count"
            latest = now
    finally:
        worker.stdin.close()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
    assert outcomes["killed"] >= 20, outcomes
    listing = list_steps(__import__("checkpoint.storage", fromlist=["Storage"]).Storage(uri))
    assert listing.committed and listing.committed[-1] == latest
