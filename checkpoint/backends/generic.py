"""Any fsspec filesystem that has no backend of its own (``memory://``, gcs, azure, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from checkpoint.api import Sink
from checkpoint.confine import check_rel


class FsspecBackend:
    """A checkpoint root on an fsspec filesystem; each file is written in one piece (``pipe_file``)."""

    is_local = False

    def __init__(self, uri: str, fs: Any, root: str) -> None:
        self.uri = uri.rstrip("/")
        self.fs = fs
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def full(self, rel: str = "") -> str:
        rel = check_rel(rel)
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root else rel

    def display(self, rel: str = "") -> str:
        return f"{self.uri}/{rel}" if rel else self.uri

    def invalidate(self, rel: str) -> None:
        """Forget cached listings (s3fs caches them; another rank or process may have written since)."""
        inv = getattr(self.fs, "invalidate_cache", None)
        if inv is not None:
            inv(self.full(rel))
            inv(self.root)

    # ------------------------------------------------------------------ metadata
    def exists(self, rel: str) -> bool:
        self.invalidate(rel)
        return bool(self.fs.exists(self.full(rel)))

    def size(self, rel: str) -> int:
        self.invalidate(rel)
        return int(self.fs.size(self.full(rel)))

    def listdir(self, rel: str) -> dict[str, tuple[str, int]]:
        self.invalidate(rel)
        try:
            entries = self.fs.ls(self.full(rel), detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, tuple[str, int]] = {}
        for e in entries:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            out[name] = ("directory" if e.get("type") == "directory" else "file", int(e.get("size") or 0))
        return out

    # ------------------------------------------------------------------ reads
    def read_range(self, rel: str, start: int, end: int | None) -> bytes | bytearray:
        if end is None and start == 0:
            return bytes(self.fs.cat_file(self.full(rel)))
        return bytes(self.fs.cat_file(self.full(rel), start=start, end=end))

    def read_into(
        self, rel: str, start: int, out: memoryview, piece_bytes: int, on_piece: Callable[[int, int], None] | None
    ) -> int:
        # Remote reads arrive whole: one piece.
        data = self.read_range(rel, start, start + len(out))
        out[: len(data)] = data
        if on_piece is not None and len(data) == len(out):
            on_piece(0, len(data))
        return len(data)

    # ------------------------------------------------------------------ writes
    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self.full(rel), exist_ok=True)

    def open_sink(self, rel: str) -> Sink:
        return PipeSink(self.fs, self.full(rel))

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        self.invalidate(rel)
        try:
            self.fs.rm(self.full(rel), recursive=recursive)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        pass


class PipeSink:
    """Buffer, then one ``pipe_file`` so the file appears whole or not at all (memory://'s ``open("wb")``
    would publish a growing file)."""

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
