"""The memory tier: per-step snapshots in host shared memory, restored before the durable tier.

See ``checkpoint.memory.api`` for the layout and the contracts. Importing the package does not import torch.
The directory's owner on each node, the keeper, is the agent's (``elastic.memory_keeper``).
"""

from typing import Any

from checkpoint.memory.api import (
    ENV_MEMORY_DIR,
    CorruptSnapshotError,
    MemoryTier,
    MemoryTierError,
    PartialRestoreError,
    RestoreReport,
    RestoreSource,
    ShmSpaceError,
)
from checkpoint.memory.config import MemoryTierConfig


def __getattr__(name: str) -> Any:  # lazy: the tier and the restore import torch
    if name == "LocalShmTier":
        from checkpoint.memory.shm import LocalShmTier

        return LocalShmTier
    if name == "PeerShmTier":
        from checkpoint.memory.peer import PeerShmTier

        return PeerShmTier
    if name == "restore":
        from checkpoint.memory.resume import restore

        return restore
    raise AttributeError(f"module 'checkpoint.memory' has no attribute {name!r}")


__all__ = [
    "ENV_MEMORY_DIR",
    "CorruptSnapshotError",
    "LocalShmTier",
    "MemoryTier",
    "MemoryTierConfig",
    "MemoryTierError",
    "PartialRestoreError",
    "PeerShmTier",
    "RestoreReport",
    "RestoreSource",
    "ShmSpaceError",
    "restore",
]
