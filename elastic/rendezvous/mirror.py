"""The handler's mirror of ``P/ctl/`` (``Mirror``) and how etcd's keys and watch events change it.

``MirrorUpdater`` applies a key's value or deletion to a ``Mirror`` (no I/O, no lock of its own: its caller holds
the handler's condition, or owns a mirror nobody else sees yet). Besides the keys it keeps who left which
round: a participant whose registration vanished while its round was current is ``lost`` (the round must
re-form), one that left after the job was closed ``finished``. A follower, which does not mirror the
registrations, learns of a loss from the coordinator's key and reform post instead. A value that cannot be
parsed is reported (``on_corrupt``): the handler refuses to guess.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from etcd3.etcdrpc import kv_pb2

from .api import RendezvousError, RendezvousStateError
from .liveness import Peer, peer_from_registration
from .state import Proposal, Reform, RoundRecord

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""

LOSS_LINES_PER_ROUND = 3
"""Departures of one round each logged on a line of their own (WARNING for a lost lease, INFO for a notice); the
rest at DEBUG, after one line saying so. Every agent logs what it sees, so a mass loss of N agents was N lines in
every agent's log (N x N in all). Who is gone stays visible in the coordinator's log: its reform post lists every
lost node and its commit every participant of the next round (INFO)."""

SAFETY_RECHECK_S = 2.0
"""Longest a waiting loop sleeps without a mirror change; only a backstop, wake-ups come from the watch."""


@dataclass(slots=True)
class Mirror:
    """Local copy of ``P/ctl/`` as delivered by the watch (guarded by the handler's condition)."""

    nodes: dict[str, int] = field(default_factory=dict)
    """node id -> ordering key (its first registration revision)."""
    joins: dict[int, dict[str, int]] = field(default_factory=dict)
    """round -> {node id -> ordering key}."""
    committed: RoundRecord | None = None
    committed_mod: int = 0
    """mod revision of the round key (0: none yet), compared by the commit transaction."""
    closed_mod: int = 0
    """mod revision of the closed key (0: open), compared when an ended run is cleared for reuse."""
    closed: bool = False
    notices: dict[str, dict[str, Any]] = field(default_factory=dict)
    """node id -> its published preemption notice (``publish_notice``)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """node id -> the committed round in which its workers failed and its agent restarts them
    (``publish_restart``)."""
    peers: dict[str, Peer] = field(default_factory=dict)
    """node id -> its liveness port and lease, from its registration (``liveness.py``; absent: lease only)."""
    revision: int = 0
    """Highest etcd revision applied."""
    loaded: bool = False
    full: bool = False
    """``nodes/`` and ``join/`` are mirrored too (the coordinator, or a newcomer clearing an ended run); else
    ``nodes``, ``joins`` and ``peers`` stay empty and only the closed key, notices, posts and round are."""
    watch_revs: list[int] = field(default_factory=list)
    """Per watcher of the stream (one per watched range), the highest revision it delivered or was loaded at."""
    coordinator: tuple[str, int] | None = None
    """(node id, lease) of the coordinator (``post/coordinator``), None while there is none."""
    proposal: Proposal | None = None
    """The coordinator's proposal for the next round (``post/proposal``)."""
    reform: Reform | None = None
    """The coordinator's last notice that a committed round is broken or a node waits (``post/reform``)."""
    proposal_ring: dict[str, Any] = field(default_factory=dict)
    """The proposal's ``ring``: node -> [addr, liveness port, lease] of its participants, as the coordinator's
    mirror of their registrations had them; its rank 0 copies it into the round record."""
    round_ring: dict[str, Any] = field(default_factory=dict)
    """The committed round's ``ring`` as read (validated per entry when used, ``_ring_peer``): a participant finds
    its ring successor's liveness port there instead of reading its registration (one read per agent per round
    less). Not validated up front: 1,000 agents in one process would each check 1,000 entries."""


class MirrorUpdater:
    """Applies keys (``put``/``delete``, a whole watch response, a loaded range) to a ``Mirror``."""

    def __init__(self, ctl: str, ctx: Callable[[], str], on_corrupt: Callable[[RendezvousError], None]) -> None:
        """Args:
            ctl: the run's ``P/ctl/`` prefix (``RunKeys.ctl``): keys are named relative to it.
            ctx: the handler's log context (``[run=... node=... round=...] ``).
            on_corrupt: told the error when a key's value cannot be parsed (the handler's fatal error)."""
        self._ctl = ctl
        self._ctx = ctx
        self._on_corrupt = on_corrupt
        self.lost: dict[int, set[str]] = {}
        """round number -> participants whose registration was deleted while that round was current."""
        self.finished: dict[int, set[str]] = {}
        """round number -> participants seen leaving after the job was closed (``lost_peers`` only)."""

    def apply_events(self, mirror: Mirror, events: Any, watch_id: int) -> None:
        """Apply one watch response's ``events`` (for the range of ``watch_id``); the caller holds the condition."""
        for ev in events:
            key = ev.kv.key.decode()
            if ev.type == kv_pb2.Event.PUT:
                self.put(mirror, key, ev.kv.value, ev.kv.mod_revision, ev.kv.lease)
            else:
                self.delete(mirror, key)
            mirror.revision = max(mirror.revision, int(ev.kv.mod_revision))
            if 0 <= watch_id < len(mirror.watch_revs):
                mirror.watch_revs[watch_id] = max(mirror.watch_revs[watch_id], int(ev.kv.mod_revision))

    def add_range(self, mirror: Mirror, kvs: Any, revision: int) -> None:
        """Apply the keys of one watched range as read at ``revision`` (a load: the watch goes on after it)."""
        mirror.watch_revs.append(revision)
        mirror.revision = max(mirror.revision, revision)
        for kv in kvs:
            self.put(mirror, kv.key.decode(), kv.value, kv.mod_revision, kv.lease)

    def put(self, mirror: Mirror, key: str, value: bytes, mod_revision: int, lease: int = 0) -> None:
        """Apply one key's value; ``lease``: the lease the key is attached to (etcd's metadata, 0: none)."""
        rel = key[len(self._ctl) :]
        try:
            if rel.startswith("nodes/"):
                info = json.loads(value)
                node = rel[len("nodes/") :]
                mirror.nodes[node] = int(info.get("seq") or mod_revision)
                peer = peer_from_registration(node, info, int(lease))
                if peer is not None:
                    mirror.peers[node] = peer
                else:
                    mirror.peers.pop(node, None)
            elif rel.startswith("join/"):
                number, _, node = rel[len("join/") :].partition("/")
                info = json.loads(value)
                mirror.joins.setdefault(int(number), {})[node] = int(info.get("seq") or mod_revision)
            elif rel == "round":
                data = json.loads(value)
                record = RoundRecord(
                    number=int(data["number"]),
                    participants=tuple(data["participants"]),
                    master_addr=str(data["master_addr"]),
                    master_port=int(data["master_port"]),
                )
                mirror.committed, mirror.committed_mod = record, mod_revision
                ring = data.get("ring")
                mirror.round_ring = ring if isinstance(ring, dict) else {}
                for stale in [n for n in mirror.joins if n <= record.number]:
                    del mirror.joins[stale]
                for gone in [n for n in mirror.notices if n not in mirror.nodes]:  # kept for the last round only
                    del mirror.notices[gone]
            elif rel == "closed":
                mirror.closed_mod = mod_revision
                mirror.closed = True
            elif rel.startswith("notice/"):
                mirror.notices[rel[len("notice/") :]] = dict(json.loads(value))
            elif rel.startswith("restart/"):
                number = json.loads(value)["round"]
                if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                    raise ValueError(f"a restart announcement's round must be a round number, got {number!r}")
                mirror.restarts[rel[len("restart/") :]] = number
            elif rel == "post/coordinator":
                info = json.loads(value)
                mirror.coordinator = (str(info["node"]), int(info["lease"]))
            elif rel == "post/proposal":
                data = json.loads(value)
                mirror.proposal = Proposal(int(data["number"]), tuple(data["participants"]), mod_revision)
                ring = data.get("ring")
                mirror.proposal_ring = ring if isinstance(ring, dict) else {}
            elif rel == "post/reform":
                data = json.loads(value)
                reform = mirror.reform = Reform(int(data["round"]), int(data["waiting"]), tuple(data["lost"]))
                current = mirror.committed
                if not mirror.full and current is not None and reform.round == current.number:
                    for node in reform.lost:  # as the coordinator saw them go
                        if node in current.participants:
                            self._participant_left(mirror, current, node)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            # Someone wrote garbage under our prefix (a value that is JSON but not an object, or nested past
            # the parser's depth): refuse to guess.
            self._on_corrupt(RendezvousStateError(f"{self._ctx()}corrupt rendezvous key {key!r} in etcd: {exc}"))

    def delete(self, mirror: Mirror, key: str) -> None:
        rel = key[len(self._ctl) :]
        if rel.startswith("nodes/"):
            node = rel[len("nodes/") :]
            mirror.nodes.pop(node, None)
            mirror.peers.pop(node, None)
            committed = mirror.committed
            if committed is not None and node in committed.participants:
                self._participant_left(mirror, committed, node)
        elif rel == "round":  # an ended run was cleared for reuse: numbering starts again
            mirror.committed, mirror.committed_mod = None, 0
            for gone in [n for n in mirror.notices if n not in mirror.nodes]:
                del mirror.notices[gone]
        elif rel.startswith("join/"):
            number, _, node = rel[len("join/") :].partition("/")
            joins = mirror.joins.get(int(number))
            if joins is not None:
                joins.pop(node, None)
        elif rel == "closed":
            mirror.closed_mod = 0
            mirror.closed = False
        elif rel.startswith("restart/"):
            mirror.restarts.pop(rel[len("restart/") :], None)
        elif rel.startswith("notice/"):
            node = rel[len("notice/") :]
            committed = mirror.committed
            # The notice goes with its node's lease. A participant of the current round that left for it keeps
            # it here until the next round: a node leaving for its notice revokes its lease just after its
            # workers acknowledged the agreed step, possibly before a peer's agent looked at the notices, and
            # without it that peer would take the planned leave for a crash.
            if committed is None or node not in committed.participants:
                mirror.notices.pop(node, None)
        elif rel == "post/coordinator":
            old_coordinator, mirror.coordinator = mirror.coordinator, None
            round_now = mirror.committed
            # Its lease ended: without the registrations, this is how a follower learns of the coordinator's loss
            # at once (the next coordinator's reform post would tell it too, a little later).
            if not mirror.full and old_coordinator is not None and round_now is not None \
                    and old_coordinator[0] in round_now.participants:
                self._participant_left(mirror, round_now, old_coordinator[0])
        elif rel == "post/proposal":
            mirror.proposal, mirror.proposal_ring = None, {}
        elif rel == "post/reform":
            mirror.reform = None

    def _participant_left(self, mirror: Mirror, committed: RoundRecord, node: str) -> None:
        """A participant of the committed round is gone. After the job was closed (every agent that closes it
        passed the exit barrier or gave up) it finished: not a loss, nothing to re-form for. Otherwise the
        round is broken (``membership_changed``), whether it left for its preemption notice or crashed."""
        if mirror.closed:
            self.finished.setdefault(committed.number, set()).add(node)
            log.info("%sparticipant %s of round %d finished and left", self._ctx(), node, committed.number)
            return
        if node in self.lost.get(committed.number, ()):
            return  # known already (a follower hears of a loss from the coordinator key and the reform post)
        lost = self.lost.setdefault(committed.number, set())
        lost.add(node)
        notice = node in mirror.notices
        level = logging.INFO if notice else logging.WARNING
        if len(lost) > LOSS_LINES_PER_ROUND:
            if len(lost) == LOSS_LINES_PER_ROUND + 1:
                log.log(level, "%smore than %d participants of round %d are gone: the others are logged at DEBUG level",
                        self._ctx(), LOSS_LINES_PER_ROUND, committed.number)
            level = logging.DEBUG
        log.log(level, "%sparticipant %s of round %d %s", self._ctx(), node, committed.number,
                "left for its preemption notice" if notice else "lost its lease")
