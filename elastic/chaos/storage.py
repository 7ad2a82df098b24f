"""``chaos://``: an fsspec filesystem over another one that injects storage errors, latency and disk full.

Use it as a chained URL wherever a checkpoint location goes: ``chaos::file:///data/ckpt`` (or
``chaos::s3://bucket/run``). Which faults are active is read from a JSON control file named by
``SPOTRUN_CHAOS_STORAGE`` (written by the injector, re-read when it changes), so faults switch on and off
at the schedule's times in every worker process, across restarts. Without the variable it passes through.

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
from typing import Any

import fsspec
from fsspec.implementations.chained import ChainedFileSystem

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


class ChaosFileSystem(ChainedFileSystem):
    """Delegates to ``target_protocol``'s filesystem; before each operation applies the active faults."""

    protocol = "chaos"
    cachable = False  # the control file changes; one instance per Storage is cheap

    def __init__(self, target_protocol: str = "file", target_options: dict[str, Any] | None = None,
                 fo: str | None = None, control: str | None = None, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fs = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.target_protocol = target_protocol
        self._control = _Control(control or os.environ.get(STORAGE_CONTROL_ENV), seed)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        # Empty for a bare ``chaos::`` layer: fsspec then hands this layer the inner URL's path.
        path = path.removeprefix("chaos://")
        return path.rstrip("/")

    # ------------------------------------------------------------------ faults
    def _inject(self, op: str, path: str) -> None:
        for fault in self._control.active():
            kind = fault.get("kind")
            params = fault.get("params", {})
            if kind == FaultKind.STORAGE_LATENCY.value:
                time.sleep(float(params.get("seconds", 0.0)))
            elif kind == FaultKind.DISK_FULL.value and op == "write":
                raise OSError(errno.ENOSPC, "No space left on device (injected by chaos://)", path)
            elif (kind == FaultKind.STORAGE_ERROR.value and self._applies(params.get("ops", "all"), op)
                  and self._control.draw() < float(params.get("rate", 1.0))):
                raise OSError(errno.EIO, f"Input/output error (injected by chaos://, {op})", path)

    @staticmethod
    def _applies(ops: str, op: str) -> bool:
        return ops == "all" or (ops == "read" and op in _READ_OPS) or (ops == "write" and op in _WRITE_OPS)

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
