"""spotrun's checkpointer: async, sharded safetensors checkpoints through fsspec, restorable at any world size."""

__version__ = "0.1.0"

from checkpoint.api import (  # noqa: E402
    CheckpointConfigError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    SaveInProgressError,
)
from checkpoint.config import CheckpointConfig  # noqa: E402


def __getattr__(name: str):  # lazy: importing the package must not import torch (CLI --help, api users)
    if name == "Checkpointer":
        from checkpoint.checkpointer import Checkpointer

        return Checkpointer
    if name == "ModelOptimizer":
        from checkpoint.state import ModelOptimizer

        return ModelOptimizer
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
    "ModelOptimizer",
    "SaveInProgressError",
    "__version__",
]
