"""The memory tier across nodes: ``PeerShmTier`` is the local tier's coordinator with two parts plugged in through
its hooks, buddy copies of what exists on one node only (``buddy.BuddyCopies``, its ``Replication``) and restores
from the union of the current nodes' keepers (``peerrestore.PeerRestore``, its ``Restorer``); the pure decisions
are in ``peerplan``."""

from __future__ import annotations

import socket

from torch.distributed import ProcessGroup

from checkpoint.collective import open_collectives
from checkpoint.memory.buddy import PIECE_BYTES, BuddyCopies
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.peerplan import PEER_PREFIX
from checkpoint.memory.peerrestore import PeerRestore
from checkpoint.memory.shm import LocalShmTier


class PeerShmTier(LocalShmTier):
    """``MemoryTier`` over this node's keeper, with buddy copies on another node and restores from any node.

    Construct it on every rank after the process group (collective: it opens three gloo groups). ``host``
    (default: this machine's hostname) decides which nodes are on different machines; ``node`` (default
    ``hostname:keeper directory``) is the node identity, as for ``LocalShmTier``.
    """

    def __init__(
        self,
        directory: str | None = None,
        config: MemoryTierConfig | None = None,
        *,
        process_group: ProcessGroup | None = None,
        node: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(directory, config, process_group=process_group, node=node)
        (xfer,) = open_collectives(process_group, self.config.collective_timeout, 1)
        self.host = host or socket.gethostname()
        self.buddies = BuddyCopies(group=self.group, xfer=xfer, directory=self.directory or "", gen=self.gen,
                                   node=self.node, host=self.host, config=self.config, warnings=self.warnings)
        self.peer_restore = PeerRestore(group=self.group, xfer=xfer, directory=self.directory or "", node=self.node,
                                        host=self.host, config=self.config)
        self.replication = self.buddies
        self.restorer = self.peer_restore

    def __repr__(self) -> str:
        return f"PeerShmTier({self.directory!r}, rank={self.rank}/{self.world_size}, gen={self.gen}, node={self.node})"

    @property
    def buddy_bytes_sent(self) -> int:
        return self.buddies.bytes_sent

    @property
    def buddy_copies_received(self) -> int:
        return self.buddies.copies_received

    @property
    def last_plan_seconds(self) -> float:
        """Seconds the last ``restore`` took to agree on a group (offers, plans, votes) before reading it."""
        return self.peer_restore.last_plan_seconds


__all__ = ["PEER_PREFIX", "PIECE_BYTES", "PeerShmTier"]
