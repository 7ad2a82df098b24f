"""Collectives of the checkpointer: one object that runs over a gloo group, or locally without one.

Modelled on DCP's ``_DistWrapper`` (``torch/distributed/checkpoint/utils.py``): every collective the
Checkpointer needs is a method here that is an identity when there is no process group (one process, or a
world of one), so the Checkpointer has no ``if group is None`` branches. We do not reuse ``_DistWrapper``
itself because it is private torch API, its object collectives unpickle whatever a peer sends (we send JSON
text only), it has no cheap tensor vote (one ``all_reduce`` of a few int64 flags), and its error-robust
variants raise DCP's ``CheckpointException`` instead of our error tree.

Each group is the checkpointer's own (``dist.new_group(backend="gloo", timeout=collective_timeout)``),
never the training's default group, so a collective run by the background writer thread cannot interleave
with the training's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from checkpoint.api import JSON

T = TypeVar("T")

_aborted_world: object = None
"""The default group that was aborted (compared by identity: a re-formed process has another one)."""


class GroupsAbortedError(RuntimeError):
    """This process's process groups were aborted (a peer was lost): no collective is started on them. A
    collective or a send started on an aborted gloo group can wait forever instead of failing."""


def mark_groups_aborted(world: object) -> None:
    """The groups of the default group ``world`` were aborted (``elastic.worker.abort``): until the process
    joins another default group, the checkpointer's and the memory tier's collectives raise at once."""
    global _aborted_world
    _aborted_world = world


def clear_groups_aborted() -> None:
    """The process joins new groups (an in-place re-form): collectives run again."""
    global _aborted_world
    _aborted_world = None


def groups_aborted() -> bool:
    """This process's current default group was aborted."""
    return _aborted_world is not None and dist.is_initialized() and dist.group.WORLD is _aborted_world


def check_groups_alive() -> None:
    """Raise :class:`GroupsAbortedError` when this process's current default group was aborted."""
    if groups_aborted():
        raise GroupsAbortedError("the process groups were aborted after a lost peer: no collective started")


class Collective:
    """Collectives over ``group`` (rank 0 of the group coordinates); local identities when ``group`` is None."""

    def __init__(self, group: ProcessGroup | None = None, *, rank: int = 0, world_size: int = 1) -> None:
        if group is None and world_size != 1:
            raise ValueError(f"a Collective without a process group has world size 1, got {world_size}")
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def __repr__(self) -> str:
        return f"Collective(rank={self.rank}/{self.world_size}, {'gloo' if self.group is not None else 'local'})"

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """Per position: True when the flag is set on any rank (one small all_reduce)."""
        if self.group is None:
            return tuple(bool(f) for f in flags)
        check_groups_alive()
        box = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(bool(v) for v in box.tolist())

    def max(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        if self.group is None:
            return value
        check_groups_alive()
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return int(box.item())

    def max_each(self, *values: int) -> tuple[int, ...]:
        """Per position, the largest value over ranks (one small all_reduce; ``-max(-x)`` is the min)."""
        if self.group is None:
            return tuple(int(v) for v in values)
        check_groups_alive()
        box = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in box.tolist())

    def all_gather(self, value: JSON) -> list[JSON]:
        """Every rank's ``value`` (JSON-serialisable), in rank order, on every rank."""
        if self.group is None:
            return [value]
        check_groups_alive()
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, json.dumps(value), group=self.group)
        return [json.loads(g) for g in gathered]

    def gather(self, value: JSON) -> list[JSON] | None:
        """Every rank's ``value`` in rank order on rank 0; None on the other ranks."""
        if self.group is None:
            return [value]
        check_groups_alive()
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(json.dumps(value), gathered, group=self.group, group_dst=0)
        return None if gathered is None else [json.loads(g) for g in gathered]

    def broadcast(self, value: JSON) -> JSON:
        """Rank 0's ``value`` on every rank (the other ranks' argument is ignored)."""
        if self.group is None:
            return value
        check_groups_alive()
        box: list[Any] = [json.dumps(value) if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return json.loads(box[0])

    def rank0_decides(self, pick: Callable[[], T]) -> T:
        """``pick()`` run on rank 0 only; its (JSON-serialisable) result on every rank."""
        return self.broadcast(pick() if self.rank == 0 else None)


def open_collectives(process_group: ProcessGroup | None, timeout: timedelta, count: int) -> list[Collective]:
    """``count`` Collectives over new gloo groups with the members of ``process_group`` (default: the world).

    Collective itself (same order on every rank) when torch.distributed is initialised and the group has
    more than one rank; local Collectives otherwise.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [Collective() for _ in range(count)]
    rank = dist.get_rank(process_group)
    world_size = dist.get_world_size(process_group)
    if world_size == 1:
        return [Collective(rank=rank) for _ in range(count)]
    ranks: Sequence[int] | None = dist.get_process_group_ranks(process_group) if process_group is not None else None
    return [
        Collective(dist.new_group(ranks=ranks, backend="gloo", timeout=timeout), rank=rank, world_size=world_size)
        for _ in range(count)
    ]
