"""The checkpoint root is checked when a Checkpointer is created (``checkpoint.location``: write, read back,
remove a probe), and a failed save removes its own partial step directory at once (never a committed step, never
another step), so a full disk is not filled further by every later attempt. The examples turn a checkpoint error
into one line and exit status 1."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from checkpoint.api import COMMIT_FILE, CheckpointError, CheckpointStorageError, step_dir
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps
from checkpoint.location import PROBE_PREFIX, check_location
from tests.checkpoint.conftest import Backend, s3_options
from tests.harness.procs import EXAMPLES, REPO

pytestmark = pytest.mark.timeout(120)


def _mount_tmpfs(path: Path, options: str) -> None:
    """A tmpfs at ``path`` (we run as root in CI); the test is skipped, with the reason printed, when mounting
    is not possible here."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs ({options}): {done.stderr.strip() or done.returncode}"
        print(reason)
        pytest.skip(reason)


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "ro,size=1m")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=30)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 60 KiB filesystem: a small save fits, a large one fills it."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=60k")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=30)


# --- the probe ------------------------------------------------------------------------------------------------


def test_a_read_only_location_fails_at_construction_with_one_line(read_only_fs: Path) -> None:
    uri = str(read_only_fs / "run")
    with pytest.raises(CheckpointStorageError) as caught:
        Checkpointer(uri)
    message = str(caught.value)
    assert message.startswith(f"checkpoint location {uri} is not usable: ") and "Read-only file system" in message
    assert "\n" not in message and caught.value.errno == errno.EROFS


def test_a_location_under_a_file_fails_at_construction(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    uri = str(tmp_path / "plain" / "ckpt")
    with pytest.raises(CheckpointStorageError, match=rf"checkpoint location {uri} is not usable: .*[Nn]ot a directory"):
        Checkpointer(uri)


def test_a_missing_s3_bucket_fails_at_construction(moto_endpoint: str) -> None:
    uri = "s3://no-such-bucket-spotrun/run"
    with pytest.raises(CheckpointStorageError, match=r"checkpoint location s3://no-such-bucket-spotrun/run is not usable"):
        Checkpointer(uri, CheckpointConfig(storage_options=s3_options(moto_endpoint), retry_timeout=timedelta(seconds=5)))


def test_the_probe_leaves_nothing_behind(backend: Backend) -> None:
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        check_location(ckpt.storage, rank=3)
        assert not [name for name in ckpt.storage.listdir() if name.startswith(PROBE_PREFIX)]
        ckpt.save(1, {"w": torch.ones(4)})
        ckpt.wait()
        assert list_steps(ckpt.storage).committed == [1]


def test_check_location_false_skips_the_probe(read_only_fs: Path) -> None:
    with Checkpointer(str(read_only_fs), CheckpointConfig(check_location=False)) as ckpt:
        assert ckpt.latest() is None  # a read-only root can still be read


def test_check_location_must_be_a_bool() -> None:
    with pytest.raises(CheckpointError, match="check_location='yes' must be True or False"):
        CheckpointConfig(check_location="yes")  # type: ignore[arg-type]


# --- a failed save's files ------------------------------------------------------------------------------------


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_a_failed_save_removes_its_own_step_directory_only(small_fs: Path) -> None:
    root = small_fs / "run"
    small = {"w": torch.arange(256, dtype=torch.float32)}  # 1 KiB
    big = {"w": torch.randn(64 * 1024)}  # 256 KiB: cannot fit in 60 KiB
    with Checkpointer(str(root), CheckpointConfig(keep_last=3, max_consecutive_failed_saves=5)) as ckpt:
        ckpt.save(1, small)
        ckpt.wait()
        other = root / step_dir(7)  # another writer's step, uncommitted: not this save's to remove
        other.mkdir()
        (other / "note").write_text("x")
        for step in (2, 3, 4):  # each fails; without the removal the second could not even start its files
            ckpt.save(step, big)
            with pytest.raises(CheckpointStorageError, match="No space left") as caught:
                ckpt.wait()
            assert caught.value.errno == errno.ENOSPC
            assert _dirs(root) == [step_dir(1), step_dir(7)], f"step {step}'s partial files stayed"
        # a save of the committed step fails before writing, and the committed step is kept whole
        ckpt.save(1, small)
        with pytest.raises(CheckpointError, match="already committed"):
            ckpt.wait()
        assert (root / step_dir(1) / COMMIT_FILE).exists()
        dst = {"w": torch.zeros(256)}
        assert ckpt.load(dst) == 1 and torch.equal(dst["w"], small["w"])
        ckpt.save(5, small)  # the space the failed saves took is free again
        ckpt.wait()
        assert ckpt.latest() == 5
    assert (other / "note").read_text() == "x"


def test_a_failed_save_on_s3_removes_its_objects(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On S3 a failed save (here: rank 0's commit refused after every shard was uploaded) leaves no objects."""
    import uuid

    uri = f"s3://spotrun-ckpt-test/{uuid.uuid4().hex[:10]}"
    config = CheckpointConfig(storage_options=s3_options(moto_endpoint), retry_timeout=timedelta(seconds=5))
    with Checkpointer(uri, config) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)})
        ckpt.wait()

        def refuse(storage: object, manifest: object, objects: object) -> None:
            raise CheckpointStorageError("injected: commit refused")

        monkeypatch.setattr("checkpoint.save_thread.commit_step", refuse)
        ckpt.save(2, {"w": torch.ones(8)})
        with pytest.raises(CheckpointStorageError, match="injected"):
            ckpt.wait()
        assert ckpt.storage.listdir(step_dir(2)) == {}
        assert step_dir(1) in ckpt.storage.listdir() and ckpt.latest() == 1


# --- the examples ---------------------------------------------------------------------------------------------


def _example(script: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_train_ddp_on_a_read_only_location_exits_1_with_one_line(read_only_fs: Path) -> None:
    done = _example("train_ddp.py", "--steps", "2", "--ckpt-dir", str(read_only_fs / "run"), "--no-memory-tier")
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"checkpoint location {read_only_fs / 'run'} is not usable" in errors[0]
    assert "Read-only file system" in errors[0]


def test_train_ddp_whose_final_save_fails_exits_1_with_one_line(small_fs: Path) -> None:
    """The only save is the final one, and it does not fit: never an exit 0, and one line."""
    filler = small_fs / "filler"
    with open(filler, "wb") as handle:  # leave room for the probe, not for a shard
        try:
            handle.write(b"\0" * (60 << 10))
        except OSError:
            pass
    os.truncate(filler, os.path.getsize(filler) - 4096)
    done = _example("train_ddp.py", "--steps", "3", "--ckpt-every", "100", "--ckpt-dir", str(small_fs / "run"),
                    "--no-memory-tier")
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "step-000000003" in errors[0] and "No space left" in errors[0]
    assert _dirs(small_fs / "run") == []  # the failed step's directory was removed


def test_train_ddp_started_again_when_finished_says_nothing_to_do(tmp_path: Path) -> None:
    """A finished run started again prints one line saying so and where its checkpoints are (rank 0)."""
    from tests.harness.procs import SPOTRUN, make_env

    ckpt = tmp_path / "ckpt"
    argv = [*SPOTRUN, "--standalone", "--nproc-per-node", "1", "--no-warm-workers",
            str(EXAMPLES / "train_ddp.py"), "--steps", "4", "--ckpt-dir", str(ckpt), "--no-memory-tier"]
    env = make_env(LOGLEVEL="WARNING", XDG_STATE_HOME=str(tmp_path / "state"))
    first = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"step 4 of 4: nothing to do, checkpoints in {ckpt}" in again.stdout.splitlines(), again.stdout
