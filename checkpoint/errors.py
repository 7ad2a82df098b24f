"""The checkpoint package's error tree: a leaf, so that every module (the name checks of ``confine`` included)
can raise these without importing the contracts of ``checkpoint.api``, which re-exports them."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error the checkpoint package raises."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) exists at the location."""


class CorruptCheckpointError(CheckpointError):
    """A shard, manifest or marker is truncated, fails its checksum, or disagrees with the manifest."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.file = file
        self.tensor = tensor


class UnsafePathError(CorruptCheckpointError):
    """A name read from the checkpoint root (manifest, marker, listing) would reach outside its step directory."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint is valid but cannot be loaded into this state (unknown format version, shape or key mismatch)."""


class CheckpointStorageError(CheckpointError, OSError):
    """Storage refused an operation after retries (disk full, permission, S3 error); names the path."""

    def __init__(self, message: str, *, path: str | None = None, errno_: int | None = None):
        CheckpointError.__init__(self, message)
        self.path = path
        self.errno = errno_


class SaveInProgressError(CheckpointError):
    """``save`` was called while a previous save is in flight and the config says to refuse."""


class CheckpointConfigError(CheckpointError, ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""
