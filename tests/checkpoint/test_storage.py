"""Storage contract, run against every backend; retries and error conversion with injected faults."""

from __future__ import annotations

import errno
from datetime import timedelta

import pytest

from checkpoint.api import CheckpointStorageError
from checkpoint.storage import RetryPolicy, Storage, is_transient

pytestmark = pytest.mark.timeout(60)


def open_storage(backend, **kw) -> Storage:
    return Storage(backend.uri, storage_options=backend.storage_options, multipart_chunk_bytes=5 << 20, **kw)


def test_write_read_list_delete(backend) -> None:
    s = open_storage(backend)
    assert s.listdir("") == {}
    s.write_bytes("a/b.bin", b"0123456789")
    s.write_bytes("top", b"x")
    assert s.exists("a/b.bin") and not s.exists("a/c.bin")
    assert s.read_bytes("a/b.bin") == b"0123456789"
    assert s.read_range("a/b.bin", 2, 5) == b"234"
    assert s.read_range("a/b.bin", 8, 20) == b"89"  # short read at EOF: callers detect truncation
    assert s.size("a/b.bin") == 10
    assert s.listdir("") == {"a": ("directory", 0), "top": ("file", 1)}
    assert s.listdir("a") == {"b.bin": ("file", 10)}
    s.write_bytes("a/b.bin", b"new")  # replace is atomic
    assert s.read_bytes("a/b.bin") == b"new"
    s.rm("a", recursive=True)
    s.rm("a/missing")  # missing is fine
    assert not s.exists("a/b.bin")
    assert list(s.listdir("")) == ["top"]


def test_streamed_write_is_invisible_until_commit(backend) -> None:
    s = open_storage(backend)
    payload = bytes(range(256)) * (48 * 1024)  # 12 MiB: multipart (3 parts) on S3
    sink = s._open_sink("big.bin")
    for i in range(0, len(payload), 1 << 20):
        sink.write(memoryview(payload)[i : i + (1 << 20)])
    assert not s.exists("big.bin")
    sink.commit()
    assert s.size("big.bin") == len(payload)
    assert s.read_range("big.bin", 5 << 20, (5 << 20) + 7) == payload[5 << 20 : (5 << 20) + 7]
    aborted = s._open_sink("gone.bin")
    aborted.write(payload)
    aborted.abort()
    assert not s.exists("gone.bin")
    assert set(s.listdir("")) == {"big.bin"}  # no temp files left behind
    s.close()


def test_missing_file_error_names_path(backend) -> None:
    s = open_storage(backend)
    with pytest.raises(CheckpointStorageError, match=r"cannot read .*nope/missing\.bin") as exc:
        s.read_bytes("nope/missing.bin")
    assert "nope/missing.bin" in exc.value.path
    assert isinstance(exc.value.__cause__, FileNotFoundError)


def test_transient_errors_are_retried_with_injected_sleep(backend, monkeypatch) -> None:
    slept: list[float] = []
    s = open_storage(backend, retry=RetryPolicy(max_attempts=4, sleep=slept.append))
    s.write_bytes("f", b"data")
    calls = {"n": 0}
    real = s._read_local if s.is_local else s.fs.cat_file

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(s, "_read_local", flaky) if s.is_local else monkeypatch.setattr(s.fs, "cat_file", flaky)
    assert s.read_bytes("f") == b"data"
    assert calls["n"] == 3 and len(slept) == 2


def test_retries_stop_after_attempts_and_name_the_path(backend, monkeypatch) -> None:
    slept: list[float] = []
    s = open_storage(backend, retry=RetryPolicy(max_attempts=3, timeout=timedelta(seconds=30), sleep=slept.append))
    calls = {"n": 0}

    def down(*args, **kwargs):
        calls["n"] += 1
        raise TimeoutError("read timed out")

    monkeypatch.setattr(s, "_read_local", down) if s.is_local else monkeypatch.setattr(s.fs, "cat_file", down)
    with pytest.raises(CheckpointStorageError, match="cannot read .*/f: read timed out"):
        s.read_bytes("f")
    assert calls["n"] == 3 and len(slept) == 2


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
    from tests.checkpoint.conftest import s3_options

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
    import checkpoint.storage as storage_mod

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(storage_mod, "_writeback", lambda fd, start, n: calls.append((start, n)))
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

    from checkpoint.storage import _RangeWriteback

    wb = _RangeWriteback()
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
