"""POSIX backend (local disk, ``file://``, FSx/Lustre): atomic fsync-rename writes, symlink confinement,
ranged reads straight into the caller's buffer."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from typing import Any

from checkpoint.api import CorruptCheckpointError, Sink
from checkpoint.confine import check_local, check_rel

logger = logging.getLogger(__name__)


class LocalBackend:
    """A checkpoint root on a POSIX file system."""

    is_local = True

    def __init__(self, root: str, *, writeback_bytes: int = 32 << 20) -> None:
        self.root = os.path.abspath(root)
        self.writeback_bytes = writeback_bytes
        """Start writeback every this many bytes written (0: leave it all to fsync)."""

    def __repr__(self) -> str:
        return f"LocalBackend({self.root!r})"

    def _join(self, rel: str) -> str:
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root != "/" else f"/{rel}"

    def full(self, rel: str = "") -> str:
        path = self._join(check_rel(rel))
        check_local(self.root, path, path)
        return path

    def display(self, rel: str = "") -> str:
        return self._join(rel)

    # ------------------------------------------------------------------ metadata
    def exists(self, rel: str) -> bool:
        return os.path.exists(self.full(rel))

    def size(self, rel: str) -> int:
        return os.stat(self.full(rel)).st_size

    def listdir(self, rel: str) -> dict[str, tuple[str, int]]:
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

    # ------------------------------------------------------------------ reads
    def _open(self, rel: str) -> Any:
        """Open a file of the root for reading; CorruptCheckpointError when it is not a regular file
        (O_NONBLOCK: opening a FIFO must not hang; no effect on regular files)."""
        fd = os.open(self.full(rel), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptCheckpointError(f"{self.display(rel)} is not a regular file", file=rel)
        return open(fd, "rb", buffering=0)

    def read_range(self, rel: str, start: int, end: int | None) -> bytes | bytearray:
        with self._open(rel) as f:
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

    def read_into(
        self, rel: str, start: int, out: memoryview, piece_bytes: int, on_piece: Callable[[int, int], None] | None
    ) -> int:
        step = piece_bytes if piece_bytes > 0 and on_piece is not None else len(out)
        with self._open(rel) as f:
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

    # ------------------------------------------------------------------ writes
    def makedirs(self, rel: str) -> None:
        os.makedirs(self.full(rel), exist_ok=True)

    def open_sink(self, rel: str) -> Sink:
        return LocalAtomicSink(self.full(rel), self.writeback_bytes)

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        path = self.full(rel)
        try:
            if recursive and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        pass


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


class RangeWriteback:
    """``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)`` through libc (Python does not expose it).

    Why: with the default dirty-page thresholds (10 % of RAM) a 1 GiB shard sits in the page cache until
    our ``fsync``, which then writes all of it while we wait. Starting writeback of each 32 MiB as soon
    as it is written overlaps the disk with the rest of the write (figures in docs/benchmarks.md).
    RocksDB's ``bytes_per_sync`` does the same. It only starts I/O, so durability still comes from ``fsync``.
    Linux only; any failure (other OS, a file system without it) switches it off for the process.
    """

    def __init__(self) -> None:
        self.fn: Any = None
        try:
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
            logger.debug("sync_file_range failed (%s); disabled", os.strerror(ctypes.get_errno()))
            self.fn = None


writeback = RangeWriteback()


class LocalAtomicSink:
    """Temp file, fsync, rename, fsync of the directory; writeback started every ``writeback_bytes``."""

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
            writeback(self.fd, self.flushed, self.written - self.flushed)
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
