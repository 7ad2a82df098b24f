"""Disk full during a save: a clear CheckpointStorageError naming the file; the previous step still loads."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkpoint.api import CheckpointStorageError
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[str]:
    """An 8 MiB tmpfs (we run as root in CI); the test is skipped, with the reason, when mounting is not possible."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        reason = f"cannot mount an 8 MiB tmpfs to fill up ({done.stderr.strip() or done.returncode})"
        print(reason)
        pytest.skip(reason)
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=30)


def test_disk_full_is_reported_and_previous_step_survives(small_fs: str) -> None:
    small = {"w": torch.randn(256, 1024)}  # 1 MiB
    big = {"w": torch.randn(256, 1024), "x": torch.randn(3 << 20)}  # 13 MiB: cannot fit in 8 MiB
    uri = f"{small_fs}/run"
    with Checkpointer(uri, CheckpointConfig(keep_last=3)) as ckpt:
        ckpt.save(1, small)
        ckpt.wait()
        ckpt.save(2, big)
        with pytest.raises(CheckpointStorageError, match=r"step-000000002/shard-00000-of-00001\.safetensors.*No space left") as exc:
            ckpt.wait()
        assert exc.value.errno == errno.ENOSPC
        assert ckpt.latest() == 1
        dst = {"w": torch.zeros(256, 1024)}
        assert ckpt.load(dst) == 1 and torch.equal(dst["w"], small["w"])
        assert list_steps(ckpt.storage).committed == [1]
        # the failed temp file was removed, so the next (fitting) save succeeds
        ckpt.save(3, small)
        ckpt.wait()
        assert ckpt.latest() == 3
    leftovers = [p for p in Path(uri).rglob(".*.tmp-*")]
    assert leftovers == []
    assert os.statvfs(small_fs).f_bfree > 0
