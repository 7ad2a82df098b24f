"""``chaos::`` storage faults against the real checkpointer on local disk: transient EIO is retried, disk full
and permanent errors are reported naming the cause, and the last committed step still loads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from checkpoint.api import CheckpointStorageError
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps
from elastic.chaos.storage import register, write_control

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    register()
    path = str(tmp_path / "control.json")
    monkeypatch.setenv("SPOTRUN_CHAOS_STORAGE", path)
    return path


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), value)}


def _uri(tmp_path: Path) -> str:
    return f"chaos::file://{tmp_path}/ckpt"


def test_pass_through_without_faults(tmp_path: Path, control: str) -> None:
    with Checkpointer(_uri(tmp_path), CheckpointConfig()) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.wait()
        out = _state(0.0)
        assert ckpt.load(out) == 1
    assert torch.equal(out["w"], _state(1.0)["w"])


def test_disk_full_fails_the_save_and_the_previous_step_loads(tmp_path: Path, control: str) -> None:
    with Checkpointer(_uri(tmp_path), CheckpointConfig()) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.wait()
        write_control(control, 0, [{"kind": "disk_full", "params": {}, "until_wall": None}])
        with pytest.raises(CheckpointStorageError, match="No space left on device"):
            ckpt.save(2, _state(2.0))
            ckpt.wait()
    Path(control).unlink()
    with Checkpointer(_uri(tmp_path), CheckpointConfig()) as ckpt:
        assert list_steps(ckpt.storage).committed == [1]
        out = _state(0.0)
        assert ckpt.load(out) == 1
        assert torch.equal(out["w"], _state(1.0)["w"])


def test_transient_errors_are_retried_and_the_save_commits(tmp_path: Path, control: str) -> None:
    # A fifth of the writes fail with EIO (seeded): transient, so the checkpointer's retry policy gets them through.
    write_control(control, 5, [{"kind": "storage_error", "params": {"rate": 0.2, "ops": "write"}, "until_wall": None}])
    with Checkpointer(_uri(tmp_path), CheckpointConfig()) as ckpt:
        ckpt.save(3, _state(3.0))
        ckpt.wait()
    Path(control).unlink()
    with Checkpointer(_uri(tmp_path), CheckpointConfig()) as ckpt:
        out = _state(0.0)
        assert ckpt.load(out) == 3
        assert torch.equal(out["w"], _state(3.0)["w"])


def test_latency_and_expiry(tmp_path: Path, control: str) -> None:
    write_control(control, 0, [{"kind": "storage_latency", "params": {"seconds": 0.2}, "until_wall": None}])
    import fsspec

    fs, root = fsspec.core.url_to_fs(_uri(tmp_path))
    start = time.monotonic()
    fs.exists(root)
    assert time.monotonic() - start >= 0.2
    write_control(control, 0, [{"kind": "disk_full", "params": {}, "until_wall": time.time() - 1}])
    fs.makedirs(root, exist_ok=True)  # expired: no fault
    fs.pipe_file(f"{root}/x", b"1")
    assert fs.cat_file(f"{root}/x") == b"1"
