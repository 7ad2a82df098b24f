"""Damaged or foreign checkpoints and bad arguments: each gives a distinct, clear error naming the problem."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from checkpoint.api import (
    COMMIT_FILE,
    MANIFEST_FILE,
    CheckpointConfigError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    step_dir,
)
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig

pytestmark = pytest.mark.timeout(60)
SHARD = "shard-00000-of-00001.safetensors"


@pytest.fixture(autouse=True, params=["span-reads", "per-request-reads"])
def read_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every damage case on both load paths: these checkpoints are small, so by default they take the small-load
    path (one read per file); with the threshold at 0 they take the per-request ranged reads of big loads."""
    if request.param == "per-request-reads":
        monkeypatch.setattr("checkpoint.shard.SMALL_LOAD_BYTES", 0)
    return str(request.param)


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(64, 32), "b": torch.randn(32), "i": torch.arange(5)}


def zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32), "i": torch.zeros(5, dtype=torch.int64)}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with Checkpointer(str(root), CheckpointConfig(checksum_block_bytes=4096)) as ckpt:
        ckpt.save(1, state())
        ckpt.save(2, state())
        ckpt.wait()
    return root


def rewrite_manifest(root: Path, step: int, edit, *, resign: bool) -> None:
    path = root / step_dir(step) / MANIFEST_FILE
    data = json.loads(path.read_text())
    edit(data)
    raw = json.dumps(data).encode()
    path.write_bytes(raw)
    if resign:  # as if a buggy writer had committed it that way
        marker = root / step_dir(step) / COMMIT_FILE
        m = json.loads(marker.read_text())
        m.update(manifest_crc32=zlib.crc32(raw), manifest_size=len(raw))
        marker.write_text(json.dumps(m))


def test_flipped_byte_names_file_and_tensor(run: Path) -> None:
    shard = run / step_dir(2) / SHARD
    manifest = json.loads((run / step_dir(2) / MANIFEST_FILE).read_text())
    start = manifest["tensors"]["w"]["chunks"][0]["byte_range"][0]
    data = bytearray(shard.read_bytes())
    data[start + 5000] ^= 0x40
    shard.write_bytes(bytes(data))
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 2  # same size: only the checksums can tell
        with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in .*shard-00000-of-00001\.safetensors for tensor 'w'") as exc:
            ckpt.load(zeros(), step=2)
        assert exc.value.file.endswith(SHARD) and exc.value.tensor == "w"
    with Checkpointer(str(run), CheckpointConfig(verify_on_load=False)) as ckpt:
        assert ckpt.load(zeros()) == 2  # verification off: loads (damaged) data, as asked


def test_damage_found_while_loading_falls_back_to_the_previous_step(run: Path, caplog) -> None:
    """latest() cannot see a flipped byte (sizes match); the load finds it and, with step=None, loads the
    previous good step with a warning instead of failing: a restarting job must not stay stuck on it."""
    shard = run / step_dir(2) / SHARD
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 2
        dst = zeros()
        assert ckpt.load(dst) == 1
        assert all(torch.equal(dst[k], v) for k, v in state().items())  # step 1 wholly, over the partial step 2
        assert "step 2" in caplog.text and "falling back to step 1" in caplog.text
        assert "checksum mismatch" in caplog.text


def test_damage_with_no_older_step_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "one"
    with Checkpointer(str(root), CheckpointConfig(checksum_block_bytes=4096)) as ckpt:
        ckpt.save(7, state())
    shard = root / step_dir(7) / SHARD
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with Checkpointer(str(root)) as ckpt, pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ckpt.load(zeros())


def test_wrong_live_state_does_not_fall_back(run: Path) -> None:
    """An older step cannot fix a state that does not match: the error is raised, not papered over."""
    with Checkpointer(str(run)) as ckpt, pytest.raises(IncompatibleCheckpointError):
        ckpt.load({"w": torch.zeros(64, 31), "b": torch.zeros(32), "i": torch.zeros(5, dtype=torch.int64)})


def test_truncated_shard_falls_back_and_errors_when_asked_for(run: Path, caplog) -> None:
    shard = run / step_dir(2) / SHARD
    shard.write_bytes(shard.read_bytes()[:-100])
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 1
        assert "skipping corrupt checkpoint step 2" in caplog.text
        dst = zeros()
        assert ckpt.load(dst) == 1 and torch.equal(dst["w"], state()["w"])
        with pytest.raises(CorruptCheckpointError, match=r"shard-00000-of-00001\.safetensors has \d+ bytes, the manifest says \d+"):
            ckpt.load(zeros(), step=2)


def test_missing_shard(run: Path) -> None:
    (run / step_dir(2) / SHARD).unlink()
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 1
        with pytest.raises(CorruptCheckpointError, match=r"shard .*shard-00000-of-00001\.safetensors is missing \(step 2"):
            ckpt.load(zeros(), step=2)


def test_manifest_edited_after_commit(run: Path) -> None:
    rewrite_manifest(run, 2, lambda d: d["tensors"]["w"].update(shape=[64, 33]), resign=False)
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 1
        with pytest.raises(CorruptCheckpointError, match="does not match its commit marker"):
            ckpt.load(zeros(), step=2)


def test_manifest_with_wrong_shape(run: Path) -> None:
    # A committed manifest whose chunks no longer tile the tensor is corrupt: validating the step catches it.
    rewrite_manifest(run, 2, lambda d: d["tensors"]["w"].update(shape=[64, 33]), resign=True)
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 1
        with pytest.raises(CorruptCheckpointError, match=r"manifest .* is inconsistent: .*'w' do not tile its shape \[64, 33\]"):
            ckpt.load(zeros(), step=2)
        with pytest.raises(IncompatibleCheckpointError, match=r"tensor 'w' has shape \(64, 32\) in the checkpoint but \(64, 33\)"):
            ckpt.load({**zeros(), "w": torch.zeros(64, 33)}, step=1)


def test_unknown_format_version(run: Path) -> None:
    rewrite_manifest(run, 2, lambda d: d.update(version=99), resign=True)
    with (
        Checkpointer(str(run)) as ckpt,
        pytest.raises(IncompatibleCheckpointError, match="format version 99 is not supported.*upgrade spotrun"),
    ):
        ckpt.load(zeros(), step=2)


def test_unreadable_manifest(run: Path) -> None:
    (run / step_dir(2) / MANIFEST_FILE).write_text("{not json")
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 1
        with pytest.raises(CorruptCheckpointError, match="manifest .* is not valid JSON"):
            ckpt.load(zeros(), step=2)


def test_path_with_no_checkpoint(tmp_path: Path) -> None:
    with Checkpointer(str(tmp_path / "empty")) as ckpt:
        assert ckpt.latest() is None
        assert ckpt.load(zeros()) is None
        with pytest.raises(CheckpointNotFoundError, match="step 5 is not committed"):
            ckpt.load(zeros(), step=5)
    from checkpoint.discover import resolve_step
    from checkpoint.storage import Storage

    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at .*empty: no step-\\* directories"):
        resolve_step(Storage(str(tmp_path / "empty")), None)


def test_state_mismatch_names_the_tensor(run: Path) -> None:
    with Checkpointer(str(run)) as ckpt:
        with pytest.raises(IncompatibleCheckpointError, match="'extra' is not in the checkpoint"):
            ckpt.load({**zeros(), "extra": torch.zeros(3)})
        with pytest.raises(IncompatibleCheckpointError, match="tensor 'i' has dtype I64 in the checkpoint but F32"):
            ckpt.load({**zeros(), "i": torch.zeros(5)})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": 0}, r"keep_last=0 is invalid: it must be an integer >= 1"),
        ({"keep_every": 0}, r"keep_every=0 is invalid"),
        ({"when_busy": "drop"}, r'when_busy=\'drop\' is invalid: use "wait" or "refuse"'),
        ({"multipart_chunk_bytes": 1024}, r"S3 rejects parts under 5 MiB"),
        ({"writer_threads": 0}, r"writer_threads=0 is invalid"),
        ({"writer_nice": 20}, r"writer_nice=20 is invalid: use 0..19"),
        ({"storage_options": "endpoint"}, r"storage_options must be a dict"),
        ({"async_mode": "yes"}, r"async_mode='yes' must be True or False"),
    ],
)
def test_config_rejects_bad_values(kwargs, message) -> None:
    with pytest.raises(CheckpointConfigError, match=message):
        CheckpointConfig(**kwargs)


def test_bad_uri_and_step() -> None:
    from checkpoint.api import CheckpointError, CheckpointStorageError

    with pytest.raises(CheckpointStorageError, match="cannot open checkpoint location 'nosuchproto://x'"):
        Checkpointer("nosuchproto://x")
    with (
        Checkpointer("memory://bad-step") as ckpt,
        pytest.raises(CheckpointError, match="step must be a non-negative int"),
    ):
        ckpt.save(-1, state())


def test_flipped_byte_in_a_block_larger_than_a_read_piece(tmp_path: Path) -> None:
    """Blocks of 4 MiB are verified from 1 MiB read pieces (a running crc): damage in the middle of block 1
    is still found, and named as block 1."""
    root = tmp_path / "big"
    big = {"w": torch.arange(10 * (1 << 20) // 4, dtype=torch.float32)}  # 10 MiB: blocks 0, 1 (4 MiB), 2 (2 MiB)
    with Checkpointer(str(root), CheckpointConfig(checksum_block_bytes=4 << 20)) as ckpt:
        ckpt.save(1, big)
    manifest = json.loads((root / step_dir(1) / MANIFEST_FILE).read_text())
    start = manifest["tensors"]["w"]["chunks"][0]["byte_range"][0]
    shard = root / step_dir(1) / SHARD
    data = bytearray(shard.read_bytes())
    data[start + (6 << 20) + 123] ^= 0x10
    shard.write_bytes(bytes(data))
    with Checkpointer(str(root)) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' \(block 1, bytes"):
            ckpt.load({"w": torch.zeros_like(big["w"])}, step=1)
        dst = {"w": torch.zeros_like(big["w"])}
    with Checkpointer(str(root), CheckpointConfig(verify_on_load=False)) as ckpt:
        ckpt.load(dst, step=1)
    assert not torch.equal(dst["w"], big["w"])  # the damage is real: only the checksum stood between
