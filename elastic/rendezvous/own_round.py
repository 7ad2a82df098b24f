"""``OwnRound``: the round this node completed last, and the membership it reports from the mirror (no I/O;
the caller holds the handler's condition)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .mirror import Mirror, MirrorUpdater
from .state import RoundRecord, membership


class OwnRound:
    """This node's round (``record``) and what changed around it: nodes waiting, lost peers, their notices."""

    def __init__(self, updater: MirrorUpdater, *, node_id: str, max_nodes: int, mirror: Callable[[], Mirror]) -> None:
        self._updater = updater
        self._node_id = node_id
        self._max_nodes = max_nodes
        self._mirror = mirror
        self.record: RoundRecord | None = None
        """The round this node completed last (None before its first)."""

    def nodes_waiting(self) -> int:
        """Nodes that would join a new round now: from the full mirror (the coordinator), else its reform post."""
        mirror = self._mirror()
        committed = mirror.committed
        if committed is None:
            return len(mirror.joins.get(1, {}))
        if mirror.full:
            m = membership(committed, mirror.nodes, mirror.joins.get(committed.number + 1, {}), self._max_nodes)
            waiting = m.nodes_waiting
        else:
            reform = mirror.reform
            waiting = reform.waiting if reform is not None and reform.round == committed.number else 0
        waiting = max(waiting, len(self._updater.lost.get(committed.number, ())))
        mine = self.record
        if mine is not None and mine.number < committed.number:
            waiting = max(waiting, 1)  # a newer round formed without us: we must re-rendezvous
        return waiting

    def changed(self) -> bool:
        """This node's round can no longer go on as is (False before its first round)."""
        return self.record is not None and self.nodes_waiting() > 0

    def peer_notices(self) -> dict[str, dict[str, Any]]:
        """The preemption notices of the other participants of this node's round."""
        mine = self.record
        peers = set(mine.participants) - {self._node_id} if mine is not None else set()
        return {node: dict(n) for node, n in self._mirror().notices.items() if node in peers}

    def restarted_peers(self) -> set[str]:
        """Participants of this node's round whose workers failed in it and whose agents restart them
        (``restart/{node}`` names this round)."""
        mine = self.record
        if mine is None:
            return set()
        peers = set(mine.participants) - {self._node_id}
        return {node for node, number in self._mirror().restarts.items() if node in peers and number == mine.number}

    def lost_peers(self) -> set[str]:
        """Participants of this node's round whose registration vanished (crashed, left or finished)."""
        mine = self.record
        if mine is None:
            return set()
        lost = set(self._updater.lost.get(mine.number, ())) | self._updater.finished.get(mine.number, set())
        mirror = self._mirror()
        if mirror.full:
            lost |= set(mine.participants) - set(mirror.nodes)
        elif mirror.reform is not None and mirror.reform.round == mine.number:
            lost |= set(mirror.reform.lost)
        return lost

    def left_behind(self) -> bool:
        """A newer round formed without this node (its lease lapsed: a partition, a pause)."""
        mine, committed = self.record, self._mirror().committed
        return (mine is not None and committed is not None and committed.number > mine.number
                and self._node_id not in committed.participants)
