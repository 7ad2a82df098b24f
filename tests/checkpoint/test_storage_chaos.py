"""``chaos::`` wraps the backend its inner location picks: over a local path the faults meet the POSIX
backend's own code (fsync-rename sink, symlink confinement, ranged reads), over S3 the multipart upload.
Before, ``chaos::file://`` reached the generic fsspec path, which production on local disk never takes."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

import checkpoint.backends.local as local_mod
from checkpoint.api import CheckpointStorageError, UnsafePathError
from checkpoint.backends.local import LocalAtomicSink, LocalBackend
from checkpoint.backends.s3 import MultipartSink, S3Backend
from checkpoint.storage import RetryPolicy, Storage
from elastic.chaos.storage import ChaosBackend, register, write_control
from tests.checkpoint.conftest import BUCKET, s3_options

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    register()
    path = str(tmp_path / "control.json")
    monkeypatch.setenv("SPOTRUN_CHAOS_STORAGE", path)
    return path


def _no_retry() -> RetryPolicy:
    return RetryPolicy(max_attempts=2, timeout=timedelta(seconds=5), sleep=lambda _s: None)


def test_chaos_over_a_local_path_writes_through_the_atomic_fsync_rename_sink(tmp_path: Path, control: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync_dir = local_mod.fsync_dir
    monkeypatch.setattr(local_mod, "fsync_dir", lambda path: (synced.append(path), real_fsync_dir(path)))
    storage = Storage(f"chaos::file://{tmp_path}/ck", retry=_no_retry())
    assert isinstance(storage.backend, ChaosBackend) and isinstance(storage.backend.inner, LocalBackend)
    assert storage.is_local
    sink = storage.open_sink("d/f.bin")
    assert isinstance(sink.inner, LocalAtomicSink)  # type: ignore[attr-defined]
    sink.write(b"x" * 1000)
    names = os.listdir(tmp_path / "ck" / "d")
    assert len(names) == 1 and names[0].startswith(".f.bin.tmp-")  # written beside, under a temp name
    sink.commit()
    assert os.listdir(tmp_path / "ck" / "d") == ["f.bin"]
    assert synced == [str(tmp_path / "ck" / "d")]  # the rename made durable
    # A fault at commit runs the local sink's abort: the temp file goes, the final name never appears.
    write_control(control, 0, [{"kind": "disk_full", "params": {}, "until_wall": None}])
    with pytest.raises(CheckpointStorageError, match="No space left on device"):
        storage.write_bytes("d/g.bin", b"y" * 1000)
    assert os.listdir(tmp_path / "ck" / "d") == ["f.bin"]


def test_chaos_over_a_local_path_keeps_the_symlink_confinement(tmp_path: Path, control: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not yours")
    root = tmp_path / "ck"
    root.mkdir()
    os.symlink(outside, root / "step-000000001")
    storage = Storage(f"chaos::file://{root}", retry=_no_retry())
    assert "step-000000001" not in storage.listdir("")  # listings leave symlinks out
    with pytest.raises(UnsafePathError, match="outside the checkpoint root"):
        storage.read_bytes("step-000000001/secret")
    with pytest.raises(UnsafePathError):
        storage.write_bytes("step-000000001/planted", b"z")
    with pytest.raises(UnsafePathError):
        storage.rm("step-000000001/secret")
    assert sorted(os.listdir(outside)) == ["secret"]


def test_chaos_over_a_local_path_reads_ranges_in_pieces(tmp_path: Path, control: str) -> None:
    storage = Storage(f"chaos::file://{tmp_path}/ck")
    storage.write_bytes("f", bytes(range(256)) * 64)
    out = bytearray(10000)
    pieces: list[tuple[int, int]] = []
    assert storage.read_into("f", 5, memoryview(out), piece_bytes=4096, on_piece=lambda o, n: pieces.append((o, n))) == 10000
    assert pieces == [(0, 4096), (4096, 4096), (8192, 1808)]  # local: piece by piece (remote: one piece)
    assert bytes(out) == (bytes(range(256)) * 64)[5:10005]


def test_chaos_over_s3_runs_the_multipart_upload_and_its_abort(moto_endpoint: str, control: str) -> None:
    import boto3

    prefix = uuid.uuid4().hex[:10]
    storage = Storage(f"chaos::s3://{BUCKET}/{prefix}", storage_options=s3_options(moto_endpoint),
                      multipart_chunk_bytes=5 << 20, retry=_no_retry())
    assert isinstance(storage.backend, ChaosBackend) and isinstance(storage.backend.inner, S3Backend)
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    payload = bytes(range(256)) * (48 * 1024)  # 12 MiB: 3 parts
    write_control(control, 0, [{"kind": "storage_error", "params": {"rate": 1.0, "ops": "write"}, "until_wall": None}])
    with pytest.raises(CheckpointStorageError, match="Input/output error"):
        storage.write_stream("big.bin", lambda sink: (isinstance(sink.inner, MultipartSink) or pytest.fail("not multipart"),
                                                     sink.write(payload)))
    uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert uploads == []  # each failed attempt aborted its multipart upload
    assert not storage.exists("big.bin")
    write_control(control, 0, [])
    storage.write_bytes("big.bin", payload)
    head = client.head_object(Bucket=BUCKET, Key=f"{prefix}/big.bin")
    assert head["ContentLength"] == len(payload) and head["ETag"].strip('"').endswith("-3")  # a 3-part upload
    storage.close()
