"""Storage behind a checkpoint root URI: one class over fsspec.

Every path the rest of the package passes here is relative to the root (``step-000000010/manifest.json``);
remote roots stay ``str`` URIs (a ``Path`` collapses ``s3://``). Errors leave this module as
:class:`~checkpoint.api.CheckpointStorageError` naming the full path (``raise ... from exc``), after
transient ones were retried with tenacity.

Atomic visibility:

* POSIX (local disk, FSx/Lustre): write ``.<name>.tmp-<pid>-<rand>``, ``fsync``, ``rename`` over the final
  name, ``fsync`` the directory (never a machine-wide ``os.sync``).
* S3: an object becomes visible only when its PUT / multipart completion succeeds, so no rename;
  large files go up as a multipart upload whose parts are sent in parallel.
* ``memory://`` and any other fsspec filesystem: write through ``fs.open(..., "wb")``.

On every backend a step only counts once its ``.commit`` marker exists, so a half-written file is harmless.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import fsspec
import tenacity
from fsspec.implementations.local import LocalFileSystem

from checkpoint.api import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointStorageError,
    CorruptCheckpointError,
)
from checkpoint.confine import check_local, check_rel

if TYPE_CHECKING:
    from checkpoint.config import CheckpointConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PERMANENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EFBIG,
        errno.ENAMETOOLONG,
        errno.EEXIST,
        errno.EINVAL,
    }
)
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError,  # also NoSuchBucket / NoSuchKey (s3fs translates them)
    PermissionError,  # also S3 AccessDenied
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
)


def _foreign_errors() -> tuple[type[BaseException], ...]:
    """Error types we convert at this edge: the OSError family plus botocore's own once botocore is loaded.
    Only an S3 filesystem raises botocore errors, and it imports botocore before it can; importing it here
    for every root (a local one too) cost each worker start ~50 ms of CPU, on the resume path of a planned
    change. So it is looked up when an error is being classified, not at import."""
    types: list[type[BaseException]] = [OSError]
    exceptions = sys.modules.get("botocore.exceptions")
    if exceptions is not None:
        types += [exceptions.BotoCoreError, exceptions.ClientError]
    return tuple(types)


def _open_errors() -> tuple[type[BaseException], ...]:
    """What opening a root may raise that we convert: bad URIs, missing protocol packages, storage errors."""
    return (ValueError, ImportError, *_foreign_errors())


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying (network, throttling, EIO); False for disk full, permission, missing."""
    if isinstance(exc, CheckpointError):
        return False
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return False
    return isinstance(exc, _foreign_errors())


@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """How storage operations are retried (built from the CheckpointConfig; sleep is injectable for tests)."""

    max_attempts: int = 5
    """Attempts per operation, first included."""
    timeout: timedelta = timedelta(seconds=60)
    """Stop retrying after this long."""
    max_wait: timedelta = timedelta(seconds=8)
    """Cap of the random exponential back-off."""
    sleep: Callable[[float], None] = time.sleep
    """Injected so fault tests do not wait for real."""


@dataclass(kw_only=True, slots=True)
class StorageSpec:
    """Everything needed to open the same Storage again, in this process or in a writer process.

    Plain data that travels as JSON (``to_json``/``from_json``), never pickled; ``from_config`` is the one
    place that maps a CheckpointConfig to storage settings.
    """

    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    max_attempts: int = 5
    retry_timeout_seconds: float = 60.0
    retry_max_wait_seconds: float = 8.0
    upload_threads: int = 4
    multipart_chunk_bytes: int = 64 << 20
    thread_nice: int = 0
    writeback_bytes: int = 32 << 20

    @classmethod
    def from_config(cls, uri: str, config: CheckpointConfig) -> StorageSpec:
        return cls(
            uri=uri,
            storage_options=dict(config.storage_options),
            max_attempts=config.max_retries,
            retry_timeout_seconds=config.retry_timeout.total_seconds(),
            retry_max_wait_seconds=config.retry_max_wait.total_seconds(),
            upload_threads=config.writer_threads,
            multipart_chunk_bytes=config.multipart_chunk_bytes,
            thread_nice=config.writer_nice,
            writeback_bytes=config.writeback_bytes,
        )

    def open(self, *, sleep: Callable[[float], None] = time.sleep) -> Storage:
        """The Storage this spec describes (``sleep`` is the retry back-off's, injectable for tests)."""
        return Storage(
            self.uri,
            storage_options=self.storage_options,
            retry=RetryPolicy(
                max_attempts=self.max_attempts,
                timeout=timedelta(seconds=self.retry_timeout_seconds),
                max_wait=timedelta(seconds=self.retry_max_wait_seconds),
                sleep=sleep,
            ),
            upload_threads=self.upload_threads,
            multipart_chunk_bytes=self.multipart_chunk_bytes,
            thread_nice=self.thread_nice,
            writeback_bytes=self.writeback_bytes,
        )

    def to_json(self) -> str:
        """The spec as one JSON text; CheckpointConfigError when ``storage_options`` is not JSON-serialisable."""
        try:
            return json.dumps({name: getattr(self, name) for name in self.__dataclass_fields__})
        except (TypeError, ValueError) as exc:
            raise CheckpointConfigError(
                f'writer="process" needs JSON-serialisable storage_options ({exc}); use writer="thread"'
            ) from exc

    @classmethod
    def from_json(cls, text: str) -> StorageSpec:
        return cls(**json.loads(text))


class Sink(Protocol):
    """A file being written: it becomes visible at its final name only on ``commit``."""

    def write(self, data: memoryview | bytes) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class Storage:
    """A checkpoint root (local path, ``file://``, ``memory://``, ``s3://``...) reached through fsspec."""

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        upload_threads: int = 4,
        multipart_chunk_bytes: int = 64 << 20,
        thread_nice: int = 0,
        writeback_bytes: int = 32 << 20,
    ) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise CheckpointStorageError(f"checkpoint location must be a non-empty string URI, got {uri!r}")
        self.uri = uri.rstrip("/") if uri not in ("/",) else uri
        self.retry = retry or RetryPolicy()
        self.upload_threads = upload_threads
        self.multipart_chunk_bytes = multipart_chunk_bytes
        self.thread_nice = thread_nice
        self.writeback_bytes = writeback_bytes
        """Local files: start writeback every this many bytes written (0: leave it all to fsync)."""
        self.part_slots = threading.Semaphore(upload_threads + 1)
        """Caps the multipart bytes held in memory across all files: upload_threads + 1 parts."""
        try:
            self.fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        except _open_errors() as exc:
            raise CheckpointStorageError(f"cannot open checkpoint location {uri!r}: {exc}", path=uri) from exc
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.is_local else root.rstrip("/")
        self.is_s3 = type(self.fs).__name__ == "S3FileSystem"
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    # ------------------------------------------------------------------ paths and errors
    def full(self, rel: str = "") -> str:
        """Full path (as the filesystem names it) of ``rel``; UnsafePathError when ``rel`` would leave the root
        (``..``, absolute), on every backend; on local disk also when a symlink resolves outside the root."""
        path = self._join(check_rel(rel))
        if self.is_local:
            check_local(self.root, path, self._join(rel))
        return path

    def _join(self, rel: str) -> str:
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root not in ("", "/") else f"{self.root}{rel}"

    def display(self, rel: str = "") -> str:
        """The path as a user would type it (keeps the protocol of remote roots); never raises."""
        if self.is_local:
            return self._join(rel)
        return f"{self.uri}/{rel}" if rel else self.uri

    def _call(self, op: str, rel: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one storage operation: retry transient errors, convert the rest naming the path."""
        policy = self.retry
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_delay(policy.timeout.total_seconds())
            | tenacity.stop_after_attempt(policy.max_attempts),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=policy.max_wait.total_seconds()),
            retry=tenacity.retry_if_exception(is_transient),
            sleep=policy.sleep,
            reraise=True,
            before_sleep=lambda rs: logger.warning(
                "storage %s %s failed (attempt %d), retrying: %s",
                op,
                self.display(rel),
                rs.attempt_number,
                rs.outcome.exception() if rs.outcome else None,
            ),
        )
        try:
            return retrying(fn, *args, **kwargs)
        except CheckpointError:
            raise
        except _foreign_errors() as exc:
            raise self.error(op, rel, exc) from exc

    def error(self, op: str, rel: str, exc: BaseException) -> CheckpointStorageError:
        """A CheckpointStorageError for ``exc`` that names the operation and the full path."""
        code = getattr(exc, "errno", None)
        reason = os.strerror(code) if isinstance(code, int) and code > 0 else ""
        detail = f"{reason}: {exc}" if reason and reason not in str(exc) else str(exc) or type(exc).__name__
        return CheckpointStorageError(
            f"cannot {op} {self.display(rel)}: {detail}", path=self.display(rel), errno_=code
        )

    # ------------------------------------------------------------------ metadata
    def exists(self, rel: str) -> bool:
        if self.is_local:
            return os.path.exists(self.full(rel))
        self._invalidate(rel)
        return self._call("stat", rel, self.fs.exists, self.full(rel))

    def size(self, rel: str) -> int:
        if self.is_local:
            return self._call("stat", rel, lambda: os.stat(self.full(rel)).st_size)
        self._invalidate(rel)
        return int(self._call("stat", rel, self.fs.size, self.full(rel)))

    def listdir(self, rel: str = "") -> dict[str, tuple[str, int]]:
        """Entries of directory ``rel``: name -> (``"file"`` | ``"directory"``, size). Missing dir: empty."""
        if self.is_local:
            return self._call("list", rel, self._listdir_local, rel)
        self._invalidate(rel)
        try:
            entries = self._call("list", rel, self.fs.ls, self.full(rel), detail=True)
        except CheckpointStorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return {}
            raise
        out: dict[str, tuple[str, int]] = {}
        for e in entries:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            out[name] = ("directory" if e.get("type") == "directory" else "file", int(e.get("size") or 0))
        return out

    def _listdir_local(self, rel: str) -> dict[str, tuple[str, int]]:
        # Symlinks and special files are left out: spotrun never creates them, and following one could lead
        # outside the root (a step directory or a .commit pointing elsewhere, a FIFO that blocks a read).
        try:
            with os.scandir(self.full(rel)) as it:
                out: dict[str, tuple[str, int]] = {}
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        out[e.name] = ("directory", 0)
                    elif e.is_file(follow_symlinks=False):
                        out[e.name] = ("file", e.stat(follow_symlinks=False).st_size)
                return out
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def _invalidate(self, rel: str) -> None:
        # s3fs caches listings; another rank/process may have written since.
        inv = getattr(self.fs, "invalidate_cache", None)
        if inv is not None:
            inv(self.full(rel))
            inv(self.root)

    # ------------------------------------------------------------------ reads
    def read_bytes(self, rel: str, *, limit: int | None = None) -> bytes | bytearray:
        """The whole file; with ``limit``, at most ``limit + 1`` bytes (so a caller that expects at most
        ``limit`` sees that there is more without reading, or allocating, the rest)."""
        if limit is not None:
            return self.read_range(rel, 0, limit + 1)
        if self.is_local:
            return self._call("read", rel, self._read_local, rel, 0, None)
        return self._call("read", rel, self.fs.cat_file, self.full(rel))

    def read_range(self, rel: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of ``rel`` (fewer if the file is shorter: callers check)."""
        if end <= start:
            return b""
        if self.is_local:
            return self._call("read", rel, self._read_local, rel, start, end)
        return self._call("read", rel, self.fs.cat_file, self.full(rel), start=start, end=end)

    def read_into(
        self,
        rel: str,
        start: int,
        out: memoryview,
        *,
        piece_bytes: int = 0,
        on_piece: Callable[[int, int], None] | None = None,
    ) -> int:
        """Read ``len(out)`` bytes of ``rel`` from ``start`` straight into ``out``; returns bytes read.

        With ``on_piece``, ``on_piece(offset, n)`` is called for each completed piece ``out[offset:offset+n]``
        (``piece_bytes`` each, the last one shorter; none for bytes past a short read), so the caller can
        check each piece while it is still in the CPU cache. Remote reads arrive whole: one call.
        """
        if self.is_local:
            return self._call("read", rel, self._read_into_local, rel, start, out, piece_bytes, on_piece)
        data = self.read_range(rel, start, start + len(out))
        out[: len(data)] = data
        if on_piece is not None and len(data) == len(out):
            on_piece(0, len(data))
        return len(data)

    def _read_into_local(
        self,
        rel: str,
        start: int,
        out: memoryview,
        piece_bytes: int = 0,
        on_piece: Callable[[int, int], None] | None = None,
    ) -> int:
        step = piece_bytes if piece_bytes > 0 and on_piece is not None else len(out)
        with self._open_local(rel) as f:
            f.seek(start)
            got = 0
            while got < len(out):
                end = min(got + step, len(out))
                piece_start = got
                while got < end:
                    n = f.readinto(out[got:end])
                    if not n:
                        return got  # short file: the caller reports the truncation
                    got += n
                if on_piece is not None:
                    on_piece(piece_start, got - piece_start)
            return got

    def _open_local(self, rel: str) -> Any:
        """Open a local file of the root for reading; CorruptCheckpointError when it is not a regular file
        (O_NONBLOCK: opening a FIFO must not hang; no effect on regular files)."""
        import stat

        fd = os.open(self.full(rel), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptCheckpointError(f"{self.display(rel)} is not a regular file", file=rel)
        return open(fd, "rb", buffering=0)

    def _read_local(self, rel: str, start: int, end: int | None) -> bytes | bytearray:
        with self._open_local(rel) as f:
            if end is None:
                return f.read()
            f.seek(start)
            # Never allocate more than the file holds: sizes come from the manifest, which may lie.
            end = max(start, min(end, os.fstat(f.fileno()).st_size))
            buf = bytearray(end - start)
            view = memoryview(buf)
            got = 0
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            return buf if got == len(buf) else buf[:got]  # bytearray: no extra copy

    # ------------------------------------------------------------------ writes
    def makedirs(self, rel: str) -> None:
        if self.is_local:
            self._call("create directory", rel, os.makedirs, self.full(rel), exist_ok=True)
        elif not self.is_s3:  # S3 has no directories
            self._call("create directory", rel, self.fs.makedirs, self.full(rel), exist_ok=True)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a small file atomically (whole file visible at once, durable on return)."""

        def attempt() -> None:
            sink = self._open_sink(rel)
            try:
                sink.write(data)
                sink.commit()
            except BaseException:
                sink.abort()
                raise

        self._call("write", rel, attempt)

    def _open_sink(self, rel: str) -> Sink:
        """The backend's Sink for ``rel``; only ``write_bytes`` and ``write_stream`` use it (they retry it)."""
        if self.is_local:
            return _LocalAtomicSink(self.full(rel), self.writeback_bytes)
        if self.is_s3:
            return _S3MultipartSink(self, rel)
        return _FsspecSink(self.fs, self.full(rel))

    def write_stream(self, rel: str, produce: Callable[[Sink], T]) -> T:
        """Write ``rel`` by calling ``produce(sink)``; retried whole on transient errors; atomic."""

        def attempt() -> T:
            sink = self._open_sink(rel)
            try:
                result = produce(sink)
                sink.commit()
                return result
            except BaseException:
                sink.abort()
                raise

        return self._call("write", rel, attempt)

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        """Delete a file (or a directory tree); missing is fine."""
        if self.is_local:
            import shutil

            def rm_local() -> None:
                path = self.full(rel)
                try:
                    if recursive and os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                except FileNotFoundError:
                    pass

            self._call("delete", rel, rm_local)
            return

        def rm_remote() -> None:
            try:
                self.fs.rm(self.full(rel), recursive=recursive)
            except FileNotFoundError:
                pass

        self._invalidate(rel)
        self._call("delete", rel, rm_remote)

    # ------------------------------------------------------------------ upload pool
    def upload_pool(self) -> ThreadPoolExecutor:
        """Threads for multipart part uploads (separate from the writer's per-file threads)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.upload_threads,
                    thread_name_prefix="ckpt-upload",
                    initializer=lower_thread_priority,
                    initargs=(self.thread_nice,),
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer (Linux: per-thread nice), so background checkpoint
    threads yield the CPU to the training thread; a no-op where unsupported or when ``nice`` is 0."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # pragma: no cover - e.g. seccomp; priority is an optimisation only
        logger.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, exc)


def _tmp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (POSIX needs the directory itself synced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait


class _RangeWriteback:
    """``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)`` through libc (Python does not expose it).

    Why: with the default dirty-page thresholds (10 % of RAM) a 1 GiB shard sits in the page cache until
    our ``fsync``, which then writes all of it while we wait. Starting writeback of each 32 MiB as soon
    as it is written overlaps the disk with the rest of the write (figures in the README's benchmarks).
    RocksDB's ``bytes_per_sync`` does the same. It only starts I/O, so durability still comes from ``fsync``.
    Linux only; any failure (other OS, a file system without it) switches it off for the process.
    """

    def __init__(self) -> None:
        self.fn: Any = None
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            self.fn = fn
        except (OSError, AttributeError):
            logger.debug("sync_file_range unavailable; local shard writeback waits for fsync")

    def __call__(self, fd: int, start: int, nbytes: int) -> None:
        if self.fn is None:
            return
        if self.fn(fd, start, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
            import ctypes

            logger.debug("sync_file_range failed (%s); disabled", os.strerror(ctypes.get_errno()))
            self.fn = None


_writeback = _RangeWriteback()


class _LocalAtomicSink:
    """POSIX: temp file, fsync, rename, fsync of the directory; writeback started every ``writeback_bytes``."""

    def __init__(self, path: str, writeback_bytes: int = 0) -> None:
        self.path = path
        self.tmp = _tmp_name(path)
        self.writeback_bytes = writeback_bytes
        self.written = 0
        self.flushed = 0  # bytes [0, flushed) have had writeback started
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def write(self, data: memoryview | bytes) -> None:
        assert self.fd is not None
        view = memoryview(data).cast("B")
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
            self.written += n
        if self.writeback_bytes and self.written - self.flushed >= self.writeback_bytes:
            _writeback(self.fd, self.flushed, self.written - self.flushed)
            self.flushed = self.written

    def commit(self) -> None:
        assert self.fd is not None
        fd, self.fd = self.fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(self.tmp, self.path)
        fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


class _FsspecSink:
    """Generic fsspec (memory://, ...): buffer, then one ``pipe_file`` so the file appears whole or not at all
    (memory://'s ``open("wb")`` would publish a growing file)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path
        self.pieces: list[bytes] = []

    def write(self, data: memoryview | bytes) -> None:
        self.pieces.append(bytes(data))

    def commit(self) -> None:
        self.fs.pipe_file(self.path, b"".join(self.pieces))
        self.pieces = []

    def abort(self) -> None:
        self.pieces = []


class _S3MultipartSink:
    """S3: one PUT for small files, else a multipart upload whose parts go up in parallel."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage = storage
        self.rel = rel
        self.fs = storage.fs
        self.bucket, self.key, _ = self.fs.split_path(storage.full(rel))
        self.part_bytes = storage.multipart_chunk_bytes
        self.pending: list[bytes] = []
        self.pending_len = 0
        self.upload_id: str | None = None
        self.futures: list[Future[dict[str, Any]]] = []
        self.slots = storage.part_slots

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.part_bytes - self.pending_len)
            self.pending.append(bytes(view[:take]))
            self.pending_len += take
            view = view[take:]
            if self.pending_len >= self.part_bytes:
                self._flush_part()

    def _flush_part(self) -> None:
        body = b"".join(self.pending)
        self.pending, self.pending_len = [], 0
        if self.upload_id is None:
            out = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self.upload_id = out["UploadId"]
        number = len(self.futures) + 1
        self.slots.acquire()
        fut = self.storage.upload_pool().submit(self._upload_part, number, body)
        fut.add_done_callback(lambda _f: self.slots.release())
        self.futures.append(fut)

    def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        out = self.storage._call(
            f"upload part {number} of",
            self.rel,
            self.fs.call_s3,
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    def commit(self) -> None:
        if self.upload_id is None:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=b"".join(self.pending))
            self.pending = []
        else:
            if self.pending_len:
                self._flush_part()
            parts = [f.result() for f in self.futures]
            self.fs.call_s3(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
            self.upload_id = None
        self.fs.invalidate_cache(self.storage.full(self.rel))

    def abort(self) -> None:
        for f in self.futures:
            f.cancel()
        if self.upload_id is not None:
            try:
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id
                )
            except Exception:  # noqa: BLE001 - the lifecycle rule cleans up what we cannot
                logger.warning("could not abort multipart upload of %s", self.storage.display(self.rel))
            self.upload_id = None
