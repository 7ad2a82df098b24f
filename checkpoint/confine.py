"""The checkpoint root is a trust boundary: names read from it stay inside it.

A manifest, a marker or a listing is data anyone with write access to the root can change, so every file name
taken from one is checked before it becomes a path (``check_name``), every relative path handed to storage is
checked for ``..`` and absolute parts (``check_rel``, every backend: S3 and ``memory://`` keys are strings too),
and on local disk the resolved path must stay under the resolved root (``check_local``), so a symlinked step
directory or ``.commit`` cannot make a read, a write or a delete land elsewhere. JSON read from the root is
parsed by ``parse_json``, which turns every way a document can be bad (deep nesting included) into our error.
"""

from __future__ import annotations

import json
import os
from typing import Any

from checkpoint.errors import CorruptCheckpointError, UnsafePathError

MAX_NAME_CHARS = 255
"""Longest file name accepted from a manifest (the usual file-system limit)."""


def check_name(name: object, *, what: str = "file name") -> str:
    """``name`` if it is one plain path component (a file directly in a step directory), else UnsafePathError."""
    if not isinstance(name, str):
        raise UnsafePathError(f"{what} {name!r} is not a string")
    bad = (
        not name
        or name in (".", "..")
        or len(name) > MAX_NAME_CHARS
        or any(c in name for c in "/\\\x00")
        or not name.isprintable()
    )
    if bad:
        raise UnsafePathError(f"{what} {name!r} is not a plain file name inside the step directory", file=name)
    return name


def check_rel(rel: str) -> str:
    """``rel`` if it is a relative path below the root with no ``.``/``..``/empty parts, else UnsafePathError."""
    if not rel:
        return rel
    if rel.startswith(("/", "\\")) or "\x00" in rel or "\\" in rel:
        raise UnsafePathError(f"path {rel!r} is not relative to the checkpoint root", file=rel)
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise UnsafePathError(f"path {rel!r} leaves or bypasses its directory in the checkpoint root", file=rel)
    return rel


def check_local(root: str, path: str, display: str) -> None:
    """UnsafePathError unless ``path`` resolves (symlinks followed) to ``root`` or below it."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise UnsafePathError(
            f"{display} resolves to {real}, outside the checkpoint root {real_root} (a symlink?); "
            f"spotrun neither reads, writes nor deletes outside the root",
            file=path,
        )


def parse_json(raw: bytes | bytearray, display: str, *, file: str | None = None) -> Any:
    """``raw`` parsed as JSON; CorruptCheckpointError naming ``display`` for bad UTF-8, bad JSON or nesting
    too deep for the parser (RecursionError)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        why = "is nested too deeply" if isinstance(exc, RecursionError) else f"is not valid JSON: {exc}"
        raise CorruptCheckpointError(f"{display} {why}", file=file) from None
