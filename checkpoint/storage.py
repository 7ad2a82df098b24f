"""Storage behind a checkpoint root URI: a backend chosen once from the location, plus retries and errors.

Every path the rest of the package passes here is relative to the root (``step-000000010/manifest.json``);
remote roots stay ``str`` URIs (a ``Path`` collapses ``s3://``). ``open_backend`` picks one
``api.StorageBackend`` (``backends.local``, ``backends.s3``, ``backends.generic``) from the location; a
chained location whose outer layer is an ``api.BackendWrapper`` (``chaos::file:///data``) wraps the backend
its inner location picks, so fault injection runs over the production code of that backend. ``Storage`` is
the facade the package uses: it retries transient errors (tenacity: random exponential back-off, capped,
until ``RetryPolicy.timeout``) and converts the rest to :class:`~checkpoint.api.CheckpointStorageError`
naming the full path (``raise ... from exc``).

Atomic visibility (each backend's sink):

* POSIX (local disk, FSx/Lustre): write ``.<name>.tmp-<pid>-<rand>``, ``fsync``, ``rename`` over the final
  name, ``fsync`` the directory (never a machine-wide ``os.sync``).
* S3: an object becomes visible only when its PUT / multipart completion succeeds, so no rename;
  large files go up as a multipart upload whose parts are sent in parallel.
* ``memory://`` and any other fsspec filesystem: one ``pipe_file`` per file.

On every backend a step only counts once its ``.commit`` marker exists, so a half-written file is harmless.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
import tenacity
from fsspec.implementations.local import LocalFileSystem

from checkpoint.api import (
    BackendWrapper,
    CheckpointConfigError,
    CheckpointError,
    CheckpointStorageError,
    Sink,
    StorageBackend,
)
from checkpoint.backends.generic import FsspecBackend
from checkpoint.backends.local import LocalBackend
from checkpoint.backends.s3 import S3Backend
from checkpoint.threads import lower_thread_priority

if TYPE_CHECKING:
    from checkpoint.config import CheckpointConfig

__all__ = [
    "RetryPolicy",
    "Sink",
    "Storage",
    "StorageSpec",
    "is_transient",
    "lower_thread_priority",
    "open_backend",
]

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
    for every root (a local one too) would slow every worker start, on the resume path of a planned change.
    So it is looked up when an error is being classified, not at import."""
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


# --------------------------------------------------------------------------- retries
FIRST_WAIT_SECONDS = 0.05
"""Scale of the first back-off (random in [0, 0.05 s]); each later one doubles, up to ``max_wait``."""


@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """How storage operations are retried (built from the CheckpointConfig; clock and sleep are injectable
    so tests run on a fake clock)."""

    max_attempts: int | None = None
    """Attempts per operation, first included; None: no limit, retry until ``timeout``."""
    timeout: timedelta = timedelta(seconds=60)
    """Stop retrying after this long (no wait crosses it)."""
    max_wait: timedelta = timedelta(seconds=8)
    """Cap of the random exponential back-off."""
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


class _Deadline(tenacity.stop.stop_base):
    """Stop once ``timeout`` has passed on ``clock`` since construction (tenacity's own ``stop_after_delay``
    reads the real monotonic clock, which a test cannot drive), and never wait past that moment."""

    def __init__(self, clock: Callable[[], float], timeout: float, backoff: tenacity.wait.wait_base) -> None:
        self.clock = clock
        self.end = clock() + timeout
        self.backoff = backoff

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.clock() >= self.end

    def wait(self, retry_state: tenacity.RetryCallState) -> float:
        return max(0.0, min(self.backoff(retry_state), self.end - self.clock()))


def retrying(policy: RetryPolicy, *, before_sleep: Callable[[tenacity.RetryCallState], None]) -> tenacity.Retrying:
    """A tenacity ``Retrying`` for one operation under ``policy``: transient errors only, random exponential
    back-off from ``FIRST_WAIT_SECONDS`` capped at ``max_wait``, until ``timeout`` (and ``max_attempts``)."""
    deadline = _Deadline(
        policy.clock,
        policy.timeout.total_seconds(),
        tenacity.wait_random_exponential(multiplier=FIRST_WAIT_SECONDS, max=policy.max_wait.total_seconds()),
    )
    stop: tenacity.stop.stop_base = deadline
    if policy.max_attempts is not None:
        stop = deadline | tenacity.stop_after_attempt(policy.max_attempts)
    return tenacity.Retrying(
        stop=stop,
        wait=deadline.wait,
        retry=tenacity.retry_if_exception(is_transient),
        sleep=policy.sleep,
        reraise=True,
        before_sleep=before_sleep,
    )


# --------------------------------------------------------------------------- choosing a backend
@dataclass(kw_only=True, slots=True)
class BackendSettings:
    """What the backends take besides the location (each uses its own part)."""

    upload_threads: int = 4
    multipart_chunk_bytes: int = 64 << 20
    thread_nice: int = 0
    writeback_bytes: int = 32 << 20


def _wrapper_for(protocol: str) -> BackendWrapper | None:
    """The fsspec class registered for ``protocol`` when it is a BackendWrapper, else None."""
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError):
        return None
    return cls if isinstance(cls, BackendWrapper) else None


def _is_s3(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("s3", "s3a") for p in protocols)


def open_backend(
    uri: str, storage_options: dict[str, Any], settings: BackendSettings, retry: Any
) -> StorageBackend:
    """The backend for ``uri``, chosen once: a wrapper layer around its inner location's backend, POSIX for
    local paths and ``file://``, S3 for ``s3://``, the generic fsspec backend otherwise. Options of a chained
    location keyed by a layer's protocol go to that layer (fsspec's convention); unkeyed ones go to the
    innermost. Raises what fsspec raises for a bad location (converted by ``Storage``)."""
    if "::" in uri:
        outer, inner = uri.split("::", 1)
        protocol = outer.split("://", 1)[0]
        wrapper = _wrapper_for(protocol)
        if wrapper is not None:
            own = storage_options.get(protocol) or {}
            rest = {k: v for k, v in storage_options.items() if k != protocol}
            if "::" not in inner:  # the innermost layer: its keyed options join the unkeyed ones
                inner_protocol = inner.split("://", 1)[0] if "://" in inner else "file"
                keyed = rest.pop(inner_protocol, None)
                if isinstance(keyed, dict):
                    rest.update(keyed)
            return wrapper.wrap_backend(open_backend(inner, rest, settings, retry), dict(own))
    fs, root = fsspec.core.url_to_fs(uri, **storage_options)
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(root, writeback_bytes=settings.writeback_bytes)
    if _is_s3(fs):
        return S3Backend(
            uri,
            fs,
            root,
            retry=retry,
            upload_threads=settings.upload_threads,
            multipart_chunk_bytes=settings.multipart_chunk_bytes,
            thread_nice=settings.thread_nice,
        )
    return FsspecBackend(uri, fs, root)


# --------------------------------------------------------------------------- spec
@dataclass(kw_only=True, slots=True)
class StorageSpec:
    """Everything needed to open the same Storage again, in this process or in a writer process.

    Plain data that travels as JSON (``to_json``/``from_json``), never pickled; ``from_config`` is the one
    place that maps a CheckpointConfig to storage settings.
    """

    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    max_attempts: int | None = None
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

    def open(
        self, *, sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic
    ) -> Storage:
        """The Storage this spec describes (``sleep``/``clock`` are the retries', injectable for tests)."""
        return Storage(
            self.uri,
            storage_options=self.storage_options,
            retry=RetryPolicy(
                max_attempts=self.max_attempts,
                timeout=timedelta(seconds=self.retry_timeout_seconds),
                max_wait=timedelta(seconds=self.retry_max_wait_seconds),
                sleep=sleep,
                clock=clock,
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


# --------------------------------------------------------------------------- the facade
class Storage:
    """A checkpoint root (local path, ``file://``, ``memory://``, ``s3://``...): its backend, retried.

    Every operation runs on ``backend`` under the retry policy and raises CheckpointStorageError naming the
    path (UnsafePathError for a path that would leave the root, on every backend).
    """

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
        self.settings = BackendSettings(
            upload_threads=upload_threads,
            multipart_chunk_bytes=multipart_chunk_bytes,
            thread_nice=thread_nice,
            writeback_bytes=writeback_bytes,
        )
        try:
            self.backend: StorageBackend = open_backend(uri, dict(storage_options or {}), self.settings, self.call)
        except _open_errors() as exc:
            raise CheckpointStorageError(f"cannot open checkpoint location {uri!r}: {exc}", path=uri) from exc

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    @property
    def is_local(self) -> bool:
        """The backend is a POSIX file system (see ``StorageBackend.is_local``)."""
        return self.backend.is_local

    # ------------------------------------------------------------------ paths and errors
    def full(self, rel: str = "") -> str:
        """Full path (as the backend names it) of ``rel``; UnsafePathError when ``rel`` would leave the root
        (``..``, absolute), on every backend; on local disk also when a symlink resolves outside the root."""
        return self.backend.full(rel)

    def display(self, rel: str = "") -> str:
        """The path as a user would type it (keeps the protocol of remote roots); never raises."""
        return self.backend.display(rel)

    def call(self, op: str, rel: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one storage operation: retry transient errors, convert the rest naming the path."""
        attempts = retrying(
            self.retry,
            before_sleep=lambda rs: logger.warning(
                "storage %s %s failed (attempt %d), retrying in %.2fs: %s",
                op,
                self.display(rel),
                rs.attempt_number,
                rs.upcoming_sleep,
                rs.outcome.exception() if rs.outcome else None,
            ),
        )
        try:
            return attempts(fn, *args, **kwargs)
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
        return self.call("stat", rel, self.backend.exists, rel)

    def size(self, rel: str) -> int:
        return self.call("stat", rel, self.backend.size, rel)

    def listdir(self, rel: str = "") -> dict[str, tuple[str, int]]:
        """Entries of directory ``rel``: name -> (``"file"`` | ``"directory"``, size). Missing dir: empty."""
        return self.call("list", rel, self.backend.listdir, rel)

    # ------------------------------------------------------------------ reads
    def read_bytes(self, rel: str, *, limit: int | None = None) -> bytes | bytearray:
        """The whole file; with ``limit``, at most ``limit + 1`` bytes (so a caller that expects at most
        ``limit`` sees that there is more without reading, or allocating, the rest)."""
        if limit is not None:
            return self.read_range(rel, 0, limit + 1)
        return self.call("read", rel, self.backend.read_range, rel, 0, None)

    def read_range(self, rel: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of ``rel`` (fewer if the file is shorter: callers check)."""
        if end <= start:
            return b""
        return self.call("read", rel, self.backend.read_range, rel, start, end)

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
        return self.call("read", rel, self.backend.read_into, rel, start, out, piece_bytes, on_piece)

    # ------------------------------------------------------------------ writes
    def makedirs(self, rel: str) -> None:
        self.call("create directory", rel, self.backend.makedirs, rel)

    def open_sink(self, rel: str) -> Sink:
        """The backend's Sink for ``rel``, one attempt (``write_bytes`` and ``write_stream`` retry it whole)."""
        return self.backend.open_sink(rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a small file atomically (whole file visible at once, durable on return)."""
        self.write_stream(rel, lambda sink: sink.write(data))

    def write_stream(self, rel: str, produce: Callable[[Sink], T]) -> T:
        """Write ``rel`` by calling ``produce(sink)``; retried whole on transient errors; atomic."""

        def attempt() -> T:
            sink = self.open_sink(rel)
            try:
                result = produce(sink)
                sink.commit()
                return result
            except BaseException:
                sink.abort()
                raise

        return self.call("write", rel, attempt)

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        """Delete a file (or a directory tree); missing is fine."""
        self.call("delete", rel, self.backend.rm, rel, recursive=recursive)

    def close(self) -> None:
        self.backend.close()
