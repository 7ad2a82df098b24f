"""The memory tier's configuration: one self-validating dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from checkpoint.api import CheckpointConfigError

_MIB = 1 << 20


@dataclass(kw_only=True, slots=True)
class MemoryTierConfig:
    """How a rank snapshots its state into host shared memory (``checkpoint.memory``)."""

    every: int | Literal["auto"] = 1
    """Snapshot every ``every`` steps (the steps divisible by it); 1: every step (>= 1). ``"auto"``: every step
    while staging costs at most ``overhead_target`` of the step time, else the smallest interval that does
    (measured on every rank, the slowest decides; settles after the first snapshots)."""

    overhead_target: float = 0.02
    """``every="auto"``: the fraction of training time snapshots may block (0 < x < 1)."""

    max_every: int = 100
    """``every="auto"``: the largest interval it picks (>= 1)."""

    when_busy: Literal["wait", "skip"] = "wait"
    """What a snapshot does while the previous one is still being checksummed: ``"wait"`` for it (every
    ``every``-th step is snapshotted, so at most ``every`` steps are redone), or ``"skip"`` this step on every
    rank (never blocks training for the checksums; a fault may then redo up to ``2 * every`` steps)."""

    synchronous: bool = False
    """``snapshot`` returns once its snapshot is published and its buddy copies landed (``wait``), not behind the
    next step: a node lost after it redoes none of the step, at the cost of the whole snapshot's time in every
    snapshotted step. With ``every=1`` a loss redoes at most the step whose snapshot it interrupted."""

    min_free_bytes: int = 64 * _MIB
    """Free space a snapshot always leaves in the shared-memory filesystem (with ``min_free_fraction``, the
    larger wins): other users of ``/dev/shm`` (DataLoader workers, NCCL) need some."""

    min_free_fraction: float = 0.05
    """Fraction of the shared-memory filesystem's size a snapshot always leaves free (0 <= x < 1)."""

    checksum_block_bytes: int = 1 * _MIB
    """Granularity of the per-chunk crc32 blocks, as ``CheckpointConfig.checksum_block_bytes``."""

    verify_on_restore: bool = True
    """Check the crc32 of every block a restore reads (a damaged snapshot is skipped like a corrupt step)."""

    read_threads: int | None = None
    """Parallel ranged reads per rank on restore (>= 1). None: one per CPU core, at most 4 (reads from shared
    memory are CPU-bound: more threads than cores only contend)."""

    jit_peer_wait: float = 2.0
    """Seconds a just-in-time snapshot (``snapshot_on_failure``) waits for the node's other ranks to publish the
    same step before the worker goes on failing (>= 0). Keep it below the agent's ``--stop-grace`` (3 s)."""

    collective_timeout: timedelta = timedelta(minutes=30)
    """Timeout of the tier's own gloo group (votes, restore agreement), like ``CheckpointConfig``'s."""

    def __post_init__(self) -> None:
        if self.every != "auto":
            _check_int("every", self.every, 1, '1 snapshots every step, "auto" picks it')
        target = self.overhead_target
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
            raise CheckpointConfigError(f"overhead_target={target!r} is invalid: use a fraction in (0, 1), e.g. 0.02")
        _check_int("max_every", self.max_every, 1, "e.g. 100")
        if self.when_busy not in ("wait", "skip"):
            raise CheckpointConfigError(f'when_busy={self.when_busy!r} is invalid: use "wait" or "skip"')
        _check_int("min_free_bytes", self.min_free_bytes, 0, "e.g. 64 MiB (67108864)")
        fraction = self.min_free_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
            raise CheckpointConfigError(f"min_free_fraction={fraction!r} is invalid: use a number in [0, 1), e.g. 0.05")
        _check_int("checksum_block_bytes", self.checksum_block_bytes, 4096, "use e.g. 1 MiB (1048576)")
        if not isinstance(self.synchronous, bool):
            raise CheckpointConfigError(f"synchronous={self.synchronous!r} must be True or False")
        if not isinstance(self.verify_on_restore, bool):
            raise CheckpointConfigError(f"verify_on_restore={self.verify_on_restore!r} must be True or False")
        if self.read_threads is not None:
            _check_int("read_threads", self.read_threads, 1, "use None for the default, 1 reads sequentially")
        wait = self.jit_peer_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 3600:
            raise CheckpointConfigError(f"jit_peer_wait={wait!r} is invalid: use seconds in [0, 3600), e.g. 2.0")
        value = self.collective_timeout
        if not isinstance(value, timedelta) or value.total_seconds() <= 0:
            raise CheckpointConfigError(f"collective_timeout={value!r} must be a positive datetime.timedelta")


def _check_int(name: str, value: object, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointConfigError(f"{name}={value!r} is invalid: it must be an integer >= {minimum} ({hint})")
