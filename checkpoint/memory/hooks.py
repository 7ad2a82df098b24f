"""The hooks through which the memory tier's coordinator (``shm.LocalShmTier``) is extended: what it calls around
each round (``Replication``: buddy copies, ``buddy.BuddyCopies``) and what restores (``Restorer``:
``localrestore.LocalRestore`` or ``peerrestore.PeerRestore``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from checkpoint.memory.api import RestoreReport
from checkpoint.memory.nodeplan import NodePlan
from checkpoint.memory.slots import Slot
from checkpoint.state import FlatState


class Replication(Protocol):
    """Copies of a rank's snapshots kept on other nodes. Every hook is called on every rank alike."""

    def planned(self, flat: FlatState, plan: NodePlan) -> int:
        """After a new snapshot plan (collective, caller's thread): decide the copies; returns the bytes of one
        set of copies this node keeps (counted in the size check at start)."""
        ...

    def published(self, slot: Slot | None, step: int) -> None:
        """Background, after this rank's part of an agreed round: ``slot`` holds the published ``step``, or None
        when this rank has nothing to publish (it still takes part). May raise: the local snapshot stays."""
        ...

    def housekeep(self, complete: int, leader: bool) -> None:
        """Remove the copies that ``complete`` (every rank published it) supersedes (``leader``: this node's)."""
        ...


class NoReplication:
    """No copies: this node's keeper only."""

    def planned(self, flat: FlatState, plan: NodePlan) -> int:
        return 0

    def published(self, slot: Slot | None, step: int) -> None:
        return None

    def housekeep(self, complete: int, leader: bool) -> None:
        return None


class Restorer(Protocol):
    """Restores a tier's snapshots into the live state (collective); the coordinator waits for the round in flight
    first and turns an off tier into a fallback on its own."""

    last_fallback_reason: str | None
    """Why the last ``restore`` returned None, else None."""

    def restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        ...
