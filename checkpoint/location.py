"""Checking a checkpoint root before the first save: write a small probe file, read it back, remove it.

A root that cannot take a save (read-only filesystem, no permission, a missing S3 bucket) is otherwise noticed
only when the first background save fails, and a run shorter than its save interval ends having written
nothing. The probe costs three small storage operations per rank at construction.
"""

from __future__ import annotations

import os
import secrets

from checkpoint.api import CheckpointStorageError
from checkpoint.collective import Collective
from checkpoint.storage import Storage

PROBE_PREFIX = ".spotrun-probe-"
"""Probe files are hidden (a leading dot), so step discovery and ``spotrun-ckpt ls`` never list them."""


def probe_name(rank: int) -> str:
    """A name no other rank or process uses at the same time (several jobs may share a root)."""
    return f"{PROBE_PREFIX}{rank}-{os.getpid()}-{secrets.token_hex(4)}"


def check_location(storage: Storage, rank: int) -> None:
    """Write a probe file under the root, read it back and remove it.

    Args:
        storage: the opened checkpoint root.
        rank: this rank, for the probe's name.

    Raises:
        CheckpointStorageError: one of the three operations failed, or the bytes read back differ; the
            message names the location and the cause (``checkpoint location ... is not usable: ...``).
    """
    name = probe_name(rank)
    data = secrets.token_bytes(16)
    try:
        storage.write_bytes(name, data)
        try:
            back = bytes(storage.read_bytes(name))
        finally:
            storage.rm(name)
    except CheckpointStorageError as exc:
        raise CheckpointStorageError(
            f"checkpoint location {storage.display()} is not usable: {exc}", path=exc.path, errno_=exc.errno
        ) from exc
    if back != data:
        raise CheckpointStorageError(
            f"checkpoint location {storage.display()} is not usable: a probe file read back "
            f"{len(back)} bytes that differ from the {len(data)} written",
            path=storage.display(name),
        )


def check_location_on_every_rank(storage: Storage, collective: Collective) -> None:
    """``check_location`` on every rank of ``collective``; when one failed, every rank closes ``storage`` and
    raises, so none is left waiting in a later collective."""
    error: CheckpointStorageError | None = None
    try:
        check_location(storage, collective.rank)
    except CheckpointStorageError as exc:
        error = exc
    (failed,) = collective.any(error is not None)
    if not failed:
        return
    storage.close()
    if error is not None:
        raise error
    raise CheckpointStorageError(
        f"checkpoint location {storage.display()} is not usable on another rank (see its error)",
        path=storage.display(),
    )
