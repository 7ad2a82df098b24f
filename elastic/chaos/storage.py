"""``chaos://``: storage errors, latency and disk full injected around a checkpoint location.

Use it as a chained URL wherever a checkpoint location goes: ``chaos::file:///data/ckpt`` (or
``chaos::s3://bucket/run``). Which faults are active is read from a JSON control file named by
``SPOTRUN_CHAOS_STORAGE`` (written by the injector, re-read when it changes), so faults switch on and off
at the schedule's times in every worker process, across restarts. Without the variable it passes through.

The checkpointer does not reach ``chaos::`` through fsspec: ``ChaosFileSystem`` is a
``checkpoint.api.BackendWrapper``, so ``checkpoint.storage.open_backend`` opens the inner location's own
backend (POSIX with its fsync-rename sink and symlink confinement for ``chaos::file://``, multipart for
``chaos::s3://``) and wraps it in a :class:`ChaosBackend`: faults are injected on exactly the code
production runs. Other fsspec users get ``ChaosFileSystem`` itself, a filesystem over the target one.

Errors are the built-in ``OSError`` family, as fsspec backends raise them (EIO, ENOSPC), so the checkpointer
treats them like real ones: EIO is retried as transient, ENOSPC is not.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.implementations.chained import ChainedFileSystem

from checkpoint.api import Sink, StorageBackend
from elastic.chaos.api import STORAGE_CONTROL_ENV, FaultKind

logger = logging.getLogger(__name__)

_READ_OPS = {"read"}
_WRITE_OPS = {"write", "delete", "mkdir"}


class _Control:
    """The active storage faults, re-read from the control file when its mtime changes."""

    def __init__(self, path: str | None, seed: int) -> None:
        self.path = path
        self._mtime: float | None = None
        self._faults: list[dict[str, Any]] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def active(self) -> list[dict[str, Any]]:
        if not self.path:
            return []
        with self._lock:
            try:
                mtime = os.stat(self.path).st_mtime_ns
            except FileNotFoundError:
                self._faults, self._mtime = [], None
                return []
            if mtime != self._mtime:
                try:
                    with open(self.path, encoding="utf-8") as handle:
                        data = json.load(handle)
                    self._faults = list(data.get("faults", []))
                    # Seeded per rank: repeatable, yet ranks do not all fail the same operation.
                    self._rng.seed(f"{data.get('seed', 0)}/{os.environ.get('RANK', '0')}")
                    self._mtime = mtime
                except (OSError, json.JSONDecodeError):
                    pass  # being replaced: keep the previous faults until the new file is whole
            now = time.time()
            return [f for f in self._faults if f.get("until_wall") is None or now < f["until_wall"]]

    def draw(self) -> float:
        with self._lock:
            return self._rng.random()


class StorageFaults:
    """The active faults of one control file, applied before an operation (``op``: read, write, delete,
    mkdir): latency sleeps, disk full raises ENOSPC on writes, storage errors raise EIO at their rate."""

    def __init__(self, control: str | None = None, seed: int = 0) -> None:
        self._control = _Control(control or os.environ.get(STORAGE_CONTROL_ENV), seed)

    def inject(self, op: str, path: str) -> None:
        for fault in self._control.active():
            kind = fault.get("kind")
            params = fault.get("params", {})
            if kind == FaultKind.STORAGE_LATENCY.value:
                time.sleep(float(params.get("seconds", 0.0)))
            elif kind == FaultKind.DISK_FULL.value and op == "write":
                raise OSError(errno.ENOSPC, "No space left on device (injected by chaos://)", path)
            elif (kind == FaultKind.STORAGE_ERROR.value and self._applies(params.get("ops", "all"), op)
                  and str(params.get("path", "")) in path
                  and self._control.draw() < float(params.get("rate", 1.0))):
                code = int(getattr(errno, str(params.get("errno", "EIO")), errno.EIO))
                # OSError(code, ...) is the matching subclass (EACCES: PermissionError), as a real one is.
                raise OSError(code, f"{os.strerror(code)} (injected by chaos://, {op})", path)

    @staticmethod
    def _applies(ops: str, op: str) -> bool:
        return ops == "all" or (ops == "read" and op in _READ_OPS) or (ops == "write" and op in _WRITE_OPS)


class ChaosBackend:
    """A ``checkpoint.api.StorageBackend`` around another one: each operation first meets the active faults,
    then runs on ``inner``, whose own code (atomic sink, confinement, ranged reads, multipart) is unchanged.
    A write meets them at its sink's commit, after the inner sink wrote its data, so a fault exercises the
    inner sink's abort (temp file removed, multipart upload aborted)."""

    def __init__(self, inner: StorageBackend, faults: StorageFaults) -> None:
        self.inner = inner
        self.faults = faults
        self.is_local = inner.is_local

    def __repr__(self) -> str:
        return f"ChaosBackend({self.inner!r})"

    def full(self, rel: str = "") -> str:
        return self.inner.full(rel)

    def display(self, rel: str = "") -> str:
        return self.inner.display(rel)

    def exists(self, rel: str) -> bool:
        self.faults.inject("read", self.display(rel))
        return self.inner.exists(rel)

    def size(self, rel: str) -> int:
        self.faults.inject("read", self.display(rel))
        return self.inner.size(rel)

    def listdir(self, rel: str) -> dict[str, tuple[str, int]]:
        self.faults.inject("read", self.display(rel))
        return self.inner.listdir(rel)

    def read_range(self, rel: str, start: int, end: int | None) -> bytes | bytearray:
        self.faults.inject("read", self.display(rel))
        return self.inner.read_range(rel, start, end)

    def read_into(
        self, rel: str, start: int, out: memoryview, piece_bytes: int, on_piece: Callable[[int, int], None] | None
    ) -> int:
        self.faults.inject("read", self.display(rel))
        return self.inner.read_into(rel, start, out, piece_bytes, on_piece)

    def makedirs(self, rel: str) -> None:
        self.faults.inject("mkdir", self.display(rel))
        self.inner.makedirs(rel)

    def open_sink(self, rel: str) -> Sink:
        return _ChaosSink(self.inner.open_sink(rel), self.faults, self.display(rel))

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        self.faults.inject("delete", self.display(rel))
        self.inner.rm(rel, recursive=recursive)

    def close(self) -> None:
        self.inner.close()


class _ChaosSink:
    """The inner backend's sink; the faults are met at ``commit``, before the inner sink publishes."""

    def __init__(self, inner: Sink, faults: StorageFaults, display: str) -> None:
        self.inner, self.faults, self.display = inner, faults, display

    def write(self, data: memoryview | bytes) -> None:
        self.inner.write(data)

    def commit(self) -> None:
        self.faults.inject("write", self.display)
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class ChaosFileSystem(ChainedFileSystem):
    """Delegates to ``target_protocol``'s filesystem; before each operation applies the active faults."""

    protocol = "chaos"
    cachable = False  # the control file changes; one instance per Storage is cheap

    def __init__(self, target_protocol: str = "file", target_options: dict[str, Any] | None = None,
                 fo: str | None = None, control: str | None = None, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fs = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.target_protocol = target_protocol
        self._faults = StorageFaults(control, seed)

    @classmethod
    def wrap_backend(cls, inner: StorageBackend, options: dict[str, Any]) -> StorageBackend:
        """``checkpoint.api.BackendWrapper``: ``inner`` behind the faults of the control file
        (``options``: ``control``, a path instead of SPOTRUN_CHAOS_STORAGE; ``seed``)."""
        return ChaosBackend(inner, StorageFaults(options.get("control"), int(options.get("seed", 0))))

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        # Empty for a bare ``chaos::`` layer: fsspec then hands this layer the inner URL's path.
        path = path.removeprefix("chaos://")
        return path.rstrip("/")

    def _inject(self, op: str, path: str) -> None:
        self._faults.inject(op, path)

    # ------------------------------------------------------------------ delegated operations
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._inject("read", path)
        return self.fs.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._inject("read", path)
        return self.fs.info(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._inject("read", path)
        return bool(self.fs.exists(path, **kwargs))

    def size(self, path: str) -> int:
        self._inject("read", path)
        return int(self.fs.size(path))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self._inject("read", path)
        return bytes(self.fs.cat_file(path, start=start, end=end, **kwargs))

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        """Whole file or nothing: written beside, then renamed (local pipe_file writes in place)."""
        self._inject("write", path)
        tmp = f"{path}.chaos-tmp-{os.getpid()}-{threading.get_ident()}"
        self.fs.pipe_file(tmp, value, **kwargs)
        try:
            self.fs.mv(tmp, path)
        except BaseException:
            self.fs.rm(tmp)
            raise

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._inject("mkdir", path)
        self.fs.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._inject("mkdir", path)
        self.fs.mkdir(path, create_parents=create_parents, **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._inject("delete", str(path))
        self.fs.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self._inject("delete", path)
        self.fs.rm_file(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._inject("write" if any(c in mode for c in "wax+") else "read", path)
        return self.fs.open(path, mode, **kwargs)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path)


def register() -> None:
    """Make ``chaos://`` known to fsspec in this process (an installed spotrun registers it through its
    ``fsspec.specs`` entry point; this is for processes that run from a source tree)."""
    fsspec.register_implementation("chaos", ChaosFileSystem, clobber=True)


def write_control(path: str, seed: int, faults: list[dict[str, Any]]) -> None:
    """Atomically replace the control file (readers never see half of it)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump({"seed": seed, "faults": faults}, handle)
    os.replace(tmp, path)
    logger.info("storage faults now active: %s", [f["kind"] for f in faults] or "none")
