"""Storage contract as a mixin, run against every backend (``StorageContract``: local disk, ``memory://``
through the generic fsspec backend, S3 through a real S3 API, and the chaos wrapper around local and
``memory://``); retries on an injected clock; error conversion; the local backend's own mechanics."""

from __future__ import annotations

import errno
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from checkpoint.api import CheckpointStorageError, UnsafePathError
from checkpoint.backends.generic import FsspecBackend
from checkpoint.backends.local import LocalBackend
from checkpoint.backends.s3 import S3Backend
from checkpoint.storage import RetryPolicy, Storage, is_transient
from tests.checkpoint.conftest import BUCKET, s3_options

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    """A monotonic clock that only the injected sleep moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class StorageContract:
    """What every backend promises; a subclass provides ``uri``/``options`` (fixture) and ``backend_type``."""

    backend_type: type

    @pytest.fixture
    def where(self) -> Iterator[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def open(self, where: tuple[str, dict[str, Any]], **kw: Any) -> Storage:
        uri, options = where
        return Storage(uri, storage_options=options, multipart_chunk_bytes=5 << 20, **kw)

    def inner(self, s: Storage) -> Any:
        return s.backend

    def test_the_location_picks_this_backend(self, where) -> None:
        assert type(self.inner(self.open(where))) is self.backend_type

    def test_write_read_list_delete(self, where) -> None:
        s = self.open(where)
        assert s.listdir("") == {}
        s.write_bytes("a/b.bin", b"0123456789")
        s.write_bytes("top", b"x")
        assert s.exists("a/b.bin") and not s.exists("a/c.bin")
        assert s.read_bytes("a/b.bin") == b"0123456789"
        assert s.read_range("a/b.bin", 2, 5) == b"234"
        assert s.read_range("a/b.bin", 8, 20) == b"89"  # short read at EOF: callers detect truncation
        assert s.read_bytes("a/b.bin", limit=4) == b"01234"  # limit + 1: the caller sees there is more
        assert s.size("a/b.bin") == 10
        assert s.listdir("") == {"a": ("directory", 0), "top": ("file", 1)}
        assert s.listdir("a") == {"b.bin": ("file", 10)}
        assert s.listdir("no/such/dir") == {}
        s.write_bytes("a/b.bin", b"new")  # replace is atomic
        assert s.read_bytes("a/b.bin") == b"new"
        s.rm("a", recursive=True)
        s.rm("a/missing")  # missing is fine
        assert not s.exists("a/b.bin")
        assert list(s.listdir("")) == ["top"]
        s.close()

    def test_read_into_fills_the_buffer_and_reports_whole_pieces(self, where) -> None:
        s = self.open(where)
        payload = bytes(range(256)) * 40
        s.write_bytes("f.bin", payload)
        out = bytearray(8000)
        pieces: list[tuple[int, int]] = []
        got = s.read_into("f.bin", 100, memoryview(out), piece_bytes=3000, on_piece=lambda o, n: pieces.append((o, n)))
        assert got == 8000 and bytes(out) == payload[100:8100]
        assert sum(n for _, n in pieces) == 8000 and pieces[0][0] == 0

    def test_streamed_write_is_invisible_until_commit(self, where) -> None:
        s = self.open(where)
        payload = bytes(range(256)) * (48 * 1024)  # 12 MiB: multipart (3 parts) on S3
        sink = s.open_sink("big.bin")
        for i in range(0, len(payload), 1 << 20):
            sink.write(memoryview(payload)[i : i + (1 << 20)])
        assert not s.exists("big.bin")
        sink.commit()
        assert s.size("big.bin") == len(payload)
        assert s.read_range("big.bin", 5 << 20, (5 << 20) + 7) == payload[5 << 20 : (5 << 20) + 7]
        aborted = s.open_sink("gone.bin")
        aborted.write(payload)
        aborted.abort()
        assert not s.exists("gone.bin")
        assert set(s.listdir("")) == {"big.bin"}  # no temp files left behind
        s.close()

    @pytest.mark.parametrize("rel", ["../outside", "/etc/passwd", "a/../../x", "a//b"])
    def test_paths_leaving_the_root_are_refused(self, where, rel: str) -> None:
        s = self.open(where)
        with pytest.raises(UnsafePathError):
            s.write_bytes(rel, b"x")
        with pytest.raises(UnsafePathError):
            s.read_bytes(rel)

    def test_missing_file_error_names_path(self, where) -> None:
        s = self.open(where)
        with pytest.raises(CheckpointStorageError, match=r"cannot read .*nope/missing\.bin") as exc:
            s.read_bytes("nope/missing.bin")
        assert "nope/missing.bin" in exc.value.path
        assert isinstance(exc.value.__cause__, FileNotFoundError)

    def test_transient_errors_are_retried_with_injected_sleep(self, where, monkeypatch) -> None:
        clock = FakeClock()
        s = self.open(where, retry=RetryPolicy(max_attempts=4, sleep=clock.sleep, clock=clock))
        s.write_bytes("f", b"data")
        calls = {"n": 0}
        real = s.backend.read_range

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] < 3:
                raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
            return real(*args, **kwargs)

        monkeypatch.setattr(s.backend, "read_range", flaky)
        assert s.read_bytes("f") == b"data"
        assert calls["n"] == 3 and len(clock.slept) == 2

    def test_retries_stop_after_attempts_and_name_the_path(self, where, monkeypatch) -> None:
        clock = FakeClock()
        s = self.open(where, retry=RetryPolicy(max_attempts=3, timeout=timedelta(seconds=30), sleep=clock.sleep, clock=clock))
        calls = {"n": 0}

        def down(*args, **kwargs):
            calls["n"] += 1
            raise TimeoutError("read timed out")

        monkeypatch.setattr(s.backend, "read_range", down)
        with pytest.raises(CheckpointStorageError, match="cannot read .*/f: read timed out"):
            s.read_bytes("f")
        assert calls["n"] == 3 and len(clock.slept) == 2


class TestLocal(StorageContract):
    backend_type = LocalBackend

    @pytest.fixture
    def where(self, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
        yield str(tmp_path / "ckpt"), {}


class TestMemory(StorageContract):
    backend_type = FsspecBackend

    @pytest.fixture
    def where(self) -> Iterator[tuple[str, dict[str, Any]]]:
        import fsspec

        unique = f"ckpt-{uuid.uuid4().hex[:10]}"
        yield f"memory://{unique}", {}
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{unique}"):
            fs.rm(f"/{unique}", recursive=True)


class TestS3(StorageContract):
    backend_type = S3Backend

    @pytest.fixture
    def where(self, moto_endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
        yield f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}", s3_options(moto_endpoint)


class _ChaosOver:
    """The contract through the ``chaos::`` wrapper (no fault active): it must hold exactly as without it."""

    @pytest.fixture(autouse=True)
    def _chaos(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from elastic.chaos.storage import register

        register()
        monkeypatch.setenv("SPOTRUN_CHAOS_STORAGE", str(tmp_path / "no-control.json"))

    def inner(self, s: Storage) -> Any:
        from elastic.chaos.storage import ChaosBackend

        assert isinstance(s.backend, ChaosBackend)
        return s.backend.inner


class TestChaosLocal(_ChaosOver, StorageContract):
    backend_type = LocalBackend

    @pytest.fixture
    def where(self, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
        yield f"chaos::file://{tmp_path}/ckpt", {}


class TestChaosMemory(_ChaosOver, StorageContract):
    backend_type = FsspecBackend

    @pytest.fixture
    def where(self) -> Iterator[tuple[str, dict[str, Any]]]:
        yield f"chaos::memory://ckpt-{uuid.uuid4().hex[:10]}", {}


# --------------------------------------------------------------------------- retry policy (fake clock)
def _flaky_for(clock: FakeClock, seconds: float) -> tuple[dict[str, int], Any]:
    calls = {"n": 0}

    def op() -> str:
        calls["n"] += 1
        if clock.now < seconds:
            raise OSError(errno.EIO, "Input/output error")
        return "ok"

    return calls, op


def test_a_blip_shorter_than_retry_timeout_is_ridden_out_whatever_the_attempts(tmp_path) -> None:
    """The default policy has no attempt limit: a 20 s outage (S3 503 SlowDown, an FSx hiccup) is retried
    with capped, jittered exponential back-off until it ends, well within retry_timeout (60 s)."""
    clock = FakeClock()
    s = Storage(str(tmp_path), retry=RetryPolicy(sleep=clock.sleep, clock=clock))
    calls, op = _flaky_for(clock, 20.0)
    assert s.call("write", "f", op) == "ok"
    assert calls["n"] > 5  # the old policy gave up after 5 attempts (0.26 s)
    assert max(clock.slept) <= 8.0  # capped at retry_max_wait
    assert len(set(clock.slept)) == len(clock.slept)  # jitter: random waits
    assert 20.0 <= clock.now < 20.0 + 8.0


def test_retries_end_at_retry_timeout_and_no_wait_crosses_it(tmp_path) -> None:
    clock = FakeClock()
    s = Storage(str(tmp_path), retry=RetryPolicy(timeout=timedelta(seconds=30), sleep=clock.sleep, clock=clock))
    calls, op = _flaky_for(clock, 1e9)
    with pytest.raises(CheckpointStorageError, match=r"cannot write .*/f: .*Input/output error"):
        s.call("write", "f", op)
    assert clock.now == pytest.approx(30.0)  # the last wait is cut to end exactly at the deadline
    assert calls["n"] >= 10


def test_permanent_errors_are_not_retried_on_the_fake_clock(tmp_path) -> None:
    clock = FakeClock()
    s = Storage(str(tmp_path), retry=RetryPolicy(sleep=clock.sleep, clock=clock))

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointStorageError, match="No space left"):
        s.call("write", "f", full)
    assert clock.slept == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_permanent_errors_are_not_retried(code) -> None:
    assert not is_transient(OSError(code, "x"))
    assert not is_transient(PermissionError(errno.EACCES, "denied"))
    assert not is_transient(FileNotFoundError("NoSuchBucket"))
    assert is_transient(ConnectionError("reset"))
    assert is_transient(OSError(errno.EIO, "io"))


def test_botocore_errors_are_retried_though_botocore_is_looked_up_only_when_loaded() -> None:
    """checkpoint.storage no longer imports botocore for every root (worker start-up cost); an S3 filesystem
    loads it before it can raise, and from then on its errors are classified as before."""
    exceptions = pytest.importorskip("botocore.exceptions", reason="the s3 extra is not installed")
    assert is_transient(exceptions.EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(exceptions.ClientError({"Error": {"Code": "SlowDown"}}, "PutObject"))


def test_no_such_bucket_is_a_clear_storage_error(moto_endpoint) -> None:
    slept: list[float] = []
    s = Storage(
        "s3://no-such-bucket-spotrun/run",
        storage_options=s3_options(moto_endpoint),
        retry=RetryPolicy(sleep=slept.append),
    )
    with pytest.raises(CheckpointStorageError, match="cannot write s3://no-such-bucket-spotrun/run/x"):
        s.write_bytes("x", b"data")
    assert slept == []  # permanent: not retried


def test_local_permission_denied_names_the_file(tmp_path) -> None:
    import os

    if os.geteuid() == 0:
        # root ignores directory permissions; a read-only bind is not available in every sandbox
        s = Storage(str(tmp_path))
        (tmp_path / "dir").write_text("a file where a directory should be")
        with pytest.raises(CheckpointStorageError, match=r"cannot write .*dir/x"):
            s.write_bytes("dir/x", b"data")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(CheckpointStorageError, match="Permission denied"):
        Storage(str(ro)).write_bytes("x", b"data")


def test_background_threads_can_be_made_nicer() -> None:
    import os
    import threading

    from checkpoint.storage import lower_thread_priority

    seen: dict[str, int] = {}

    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(5)
        seen["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["delta"] == min(5, 19 - main_nice)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice  # the caller is untouched


def test_local_sink_starts_writeback_of_contiguous_ranges(tmp_path, monkeypatch) -> None:
    """Every ``writeback_bytes`` written, the sink asks the kernel to start writing back exactly the bytes
    not yet handed over (contiguous, no gaps or overlaps), and the file still commits whole."""
    import checkpoint.backends.local as local_mod

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(local_mod, "writeback", lambda fd, start, n: calls.append((start, n)))
    s = Storage(str(tmp_path), writeback_bytes=4096)
    payload = bytes(range(256)) * 400  # 102400 bytes in 1000-byte writes

    def produce(sink) -> None:
        for i in range(0, len(payload), 1000):
            sink.write(payload[i : i + 1000])

    s.write_stream("f.bin", produce)
    assert (tmp_path / "f.bin").read_bytes() == payload
    assert calls and calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))
    assert all(n >= 4096 for _, n in calls)
    assert calls[-1][0] + calls[-1][1] > len(payload) - 4096  # the tail is left to fsync


def test_range_writeback_is_real_on_linux_and_switches_itself_off_on_error(tmp_path) -> None:
    import sys

    from checkpoint.backends.local import RangeWriteback

    wb = RangeWriteback()
    if not sys.platform.startswith("linux"):
        pytest.skip(f"sync_file_range is Linux-only; this is {sys.platform}")
    assert wb.fn is not None
    f = tmp_path / "x"
    f.write_bytes(b"x" * 8192)
    with open(f, "rb+") as fh:
        wb(fh.fileno(), 0, 8192)
    assert wb.fn is not None  # a valid call keeps it on
    wb(-1, 0, 4096)  # EBADF
    assert wb.fn is None
    wb(-1, 0, 4096)  # and it is a no-op from then on


def test_writeback_bytes_is_validated() -> None:
    from checkpoint import CheckpointConfig
    from checkpoint.api import CheckpointConfigError

    with pytest.raises(CheckpointConfigError, match="writeback_bytes"):
        CheckpointConfig(writeback_bytes=-1)
    assert CheckpointConfig(writeback_bytes=0).writeback_bytes == 0
    with pytest.raises(CheckpointConfigError, match="collective_timeout"):
        CheckpointConfig(collective_timeout=timedelta(seconds=0))


def test_read_into_reports_each_completed_piece_and_stops_at_a_short_file(tmp_path) -> None:
    s = Storage(str(tmp_path))
    payload = bytes(range(256)) * 40  # 10240 bytes
    s.write_bytes("f.bin", payload)
    out = bytearray(8000)
    pieces: list[tuple[int, int, bytes]] = []
    got = s.read_into("f.bin", 100, memoryview(out), piece_bytes=3000,
                      on_piece=lambda off, n: pieces.append((off, n, bytes(out[off : off + n]))))
    assert got == 8000 and bytes(out) == payload[100:8100]
    assert [(o, n) for o, n, _ in pieces] == [(0, 3000), (3000, 3000), (6000, 2000)]
    assert all(data == payload[100 + o : 100 + o + n] for o, n, data in pieces)  # filled when reported
    pieces.clear()
    short = bytearray(8000)
    got = s.read_into("f.bin", 5000, memoryview(short), piece_bytes=3000, on_piece=lambda o, n: pieces.append((o, n, b"")))
    assert got == 5240 and [(o, n) for o, n, _ in pieces] == [(0, 3000)]  # the partial piece is not reported


class _RecordingS3:
    """The sink's s3fs, recording each ``abort_multipart_upload`` with the parts in flight at that moment."""

    def __init__(self, fs: Any, in_flight: list[int], fail_first_abort: bool = False) -> None:
        self._fs, self._in_flight, self._fail = fs, in_flight, fail_first_abort
        self.aborts: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "abort_multipart_upload":
            self.aborts.append(self._in_flight[0])
            if self._fail and len(self.aborts) == 1:
                raise ConnectionResetError("injected: the abort request was lost")
        return self._fs.call_s3(method, *args, **kwargs)


def _uploads(moto_endpoint: str, prefix: str) -> list[Any]:
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return list(client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []))


@pytest.mark.parametrize("fail_first_abort", [False, True])
def test_s3_abort_waits_for_parts_in_flight_and_retries_once(moto_endpoint: str, fail_first_abort: bool) -> None:
    import threading

    prefix = uuid.uuid4().hex[:10]
    storage = Storage(f"s3://{BUCKET}/{prefix}", storage_options=s3_options(moto_endpoint),
                      multipart_chunk_bytes=5 << 20, upload_threads=4)
    backend = storage.backend
    assert isinstance(backend, S3Backend)
    sink = backend.open_sink("big.bin")
    in_flight = [0]
    lock, release = threading.Lock(), threading.Event()
    real_upload = sink.upload_part  # type: ignore[attr-defined]

    def slow_upload(number: int, body: bytes) -> dict[str, Any]:
        with lock:
            in_flight[0] += 1
        try:
            release.wait(30)
            return real_upload(number, body)  # type: ignore[no-any-return]
        finally:
            with lock:
                in_flight[0] -= 1

    sink.upload_part = slow_upload  # type: ignore[attr-defined]
    s3 = _RecordingS3(sink.fs, in_flight, fail_first_abort)  # type: ignore[attr-defined]
    sink.fs = s3  # type: ignore[attr-defined]
    try:
        sink.write(bytes(11 << 20))  # two parts in flight, 1 MiB pending
        assert len(_uploads(moto_endpoint, prefix)) == 1
        releaser = threading.Timer(0.5, release.set)  # the parts finish a while after the abort started
        releaser.start()
        sink.abort()
        releaser.join()
        assert s3.aborts[0] == 0, "the upload was aborted while parts were still uploading"
        assert len(s3.aborts) == (2 if fail_first_abort else 1)
        assert _uploads(moto_endpoint, prefix) == []
    finally:
        release.set()
        storage.close()
