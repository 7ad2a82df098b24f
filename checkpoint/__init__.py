"""spotrun's checkpointer: async, sharded safetensors checkpoints through fsspec, restorable at any world size."""

from typing import Any

from checkpoint._version import __version__
from checkpoint.api import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    SaveInProgressError,
)
from checkpoint.config import CheckpointConfig
from checkpoint.memory.config import MemoryTierConfig


def __getattr__(name: str) -> Any:  # lazy: importing the package must not import torch (CLI --help, api users)
    if name == "Checkpointer":
        from checkpoint.checkpointer import Checkpointer

        return Checkpointer
    if name in ("ModelOptimizer", "PerRank", "RNGState"):
        import checkpoint.state

        return getattr(checkpoint.state, name)
    raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")


__all__ = [
    "CheckpointConfig",
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "Checkpointer",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "MemoryTierConfig",
    "ModelOptimizer",
    "PerRank",
    "RNGState",
    "SaveInProgressError",
    "__version__",
]
