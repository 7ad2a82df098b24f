"""writer="process": staging in shared memory, a per-rank writer process writes the shards."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from checkpoint.api import CheckpointConfigError, CheckpointError, CheckpointStorageError, step_dir
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps

pytestmark = pytest.mark.timeout(90)


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 40, generator=g), "ids": torch.arange(seed, seed + 9), "epoch": seed}


def zeros() -> dict[str, object]:
    return {"w": torch.zeros(300, 40), "ids": torch.zeros(9, dtype=torch.int64), "epoch": -1}


def test_process_writer_round_trip_and_reaping(backend) -> None:
    cfg = backend.config(writer="process", keep_last=2)
    if backend.name == "memory":
        with pytest.raises(CheckpointConfigError, match='cannot write to memory://'):
            Checkpointer(backend.uri, cfg)
        return
    with Checkpointer(backend.uri, cfg) as ckpt:
        child = ckpt.writer.client.proc
        for step in (1, 2, 3):
            ckpt.save(step, state(step))
        ckpt.wait()
        assert ckpt.writer.stager.allocations == 1
        assert list_steps(ckpt.storage).committed == [2, 3]
        dst = zeros()
        assert ckpt.load(dst) == 3
    assert child.poll() is not None  # closed and reaped with the checkpointer
    want = state(3)
    assert torch.equal(dst["w"], want["w"]) and torch.equal(dst["ids"], want["ids"]) and dst["epoch"] == 3
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("spotrun-ckpt-")]


def test_process_writer_storage_error_names_the_file(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with Checkpointer(str(root), CheckpointConfig(writer="process")) as ckpt:
        ckpt.save(1, state(1))
        ckpt.wait()
        (root / step_dir(2) / "shard-00000-of-00001.safetensors").mkdir(parents=True)  # blocks the rename
        ckpt.save(2, state(2))
        with pytest.raises(CheckpointStorageError, match=r"step-000000002/shard-00000-of-00001\.safetensors"):
            ckpt.wait()
        assert ckpt.latest() == 1


def test_dead_writer_process_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    from checkpoint.faults import CRASH_AT_ENV

    root = str(tmp_path / "run")
    # The writer process inherits this: it blocks on its 3rd block (the first of step 2: 2 blocks per save).
    monkeypatch.setenv(CRASH_AT_ENV, "shard.block:3")
    ckpt = Checkpointer(root, CheckpointConfig(writer="process"))
    monkeypatch.delenv(CRASH_AT_ENV)
    try:
        ckpt.save(1, state(1))
        ckpt.wait()
        proc = ckpt.writer.client.proc
        ckpt.save(2, state(2))
        os.kill(proc.pid, signal.SIGKILL)  # mid-write (or before it started): either way step 2 fails
        with pytest.raises(CheckpointError, match=r"writer process \(pid \d+\) (died with exit code -9|is gone)"):
            ckpt.wait()
        assert ckpt.latest() == 1
        ckpt.save(3, state(3))  # a new writer process takes over
        ckpt.wait()
        assert ckpt.writer.client.proc.pid != proc.pid and ckpt.latest() == 3
    finally:
        ckpt.close()
