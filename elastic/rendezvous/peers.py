"""``PeerLiveness``: a dead agent known in under a second when its process dies, instead of after its lease TTL.

The mechanism is ``liveness.py``'s (a listening port whose held connections end when the process dies). This is
the handler's use of it: with ``liveness_probe`` each agent listens on a port it names in its registration, and
after each round holds a connection to its ring successor's (the next participant; the last one watches the
first), found in the round record's ``ring`` or else in the successor's registration. When a successor's
process is gone (its port refuses) the agent revokes that successor's lease, if it is still the one the
successor is registered with, so every agent's watch sees the loss at once. ``probe`` asks every other
participant of the round the same question on demand (a worker failed).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .api import EtcdRendezvousConfig, RendezvousError
from .etcd_client import EtcdConnection
from .health import is_lease_not_found
from .keys import RunKeys
from .liveness import LivenessListener, Peer, PeerWatch, Probe, Verdict, peer_from_registration, probe_all, probe_each
from .mirror import Mirror
from .state import RoundRecord

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""


class PeerLiveness:
    """This node's liveness port (``listener``) and its watch on the ring successor's (``watch``)."""

    def __init__(
        self,
        config: EtcdRendezvousConfig,
        keys: RunKeys,
        cond: threading.Condition,
        *,
        node_id: str,
        mirror: Callable[[], Mirror],
        my_round: Callable[[], RoundRecord | None],
        conn: Callable[[], EtcdConnection | None],
        require_conn: Callable[[], EtcdConnection],
        released: Callable[[], bool],
        ctx: Callable[[], str],
    ) -> None:
        """Args:
            cond: the handler's condition (guards the mirror).
            mirror: the mirror the watch keeps now: the round's ring, and every registration when it is full.
            my_round: the round this node completed last (``probe`` asks its participants).
            conn, require_conn: the handler's connection (None / an error before it connected).
            released: the handler left (it revokes nothing any more).
            ctx: the handler's log context."""
        self._config = config
        self._keys = keys
        self._cond = cond
        self._node_id = node_id
        self._mirror = mirror
        self._my_round = my_round
        self._conn = conn
        self._require_conn = require_conn
        self._released = released
        self._ctx = ctx
        self.listener: LivenessListener | None = None
        """Our liveness port (``liveness_probe``): held connections end the moment this process dies."""
        self.watch: PeerWatch | None = None
        """Our connection to the next participant's liveness port (a ring over the round)."""

    def start(self) -> None:
        """Open our liveness port and the watch on a successor (with ``liveness_probe``; idempotent)."""
        if not self._config.liveness_probe or self.listener is not None:
            return
        try:
            self.listener = LivenessListener(max_held=4 * self._config.max_nodes + 16)
        except OSError as exc:  # no port to listen on: the lease alone tells of this node's death
            log.warning("%sno liveness port (%s): peers learn of this node's death from its lease only", self._ctx(), exc)
            return
        self.watch = PeerWatch(self._revoke_dead_peer)

    def stop(self) -> None:
        """Close both (idempotent)."""
        watch, listener = self.watch, self.listener
        self.watch = self.listener = None
        if watch is not None:
            watch.close()
        if listener is not None:
            listener.close()

    def watch_successor(self, record: RoundRecord, rank: int) -> None:
        """Hold a connection to the next participant's liveness port (the last one watches the first): from the
        round record's ``ring`` when it has the successor, else from its registration (one read)."""
        watch = self.watch
        if watch is None:
            return
        successor = record.participants[(rank + 1) % len(record.participants)]
        if successor == self._node_id:
            watch.watch(None)
            return
        with self._cond:
            mirror = self._mirror()
            peer = self._ring_peer(successor, mirror.round_ring) if mirror.committed == record else None
        watch.watch(peer if peer is not None else self._current_peer(successor))

    @staticmethod
    def _ring_peer(node: str, ring: dict[str, Any]) -> Peer | None:
        """``node``'s entry of the round record's ``ring`` as a peer; None when absent or not well-formed (its
        predecessor then reads its registration). A revoke always checks the registration first."""
        entry = ring.get(node)
        if not isinstance(entry, list) or len(entry) != 3:
            return None
        return peer_from_registration(node, {"addr": entry[0], "live_port": entry[1]}, entry[2])

    def _current_peer(self, node: str) -> Peer | None:
        """``node``'s liveness port and lease from its registration now: from the full mirror, else one read."""
        with self._cond:
            mirror = self._mirror()
            if mirror.full and mirror.loaded:
                return mirror.peers.get(node)
        conn = self._conn()
        if conn is None:
            return None
        try:
            value, meta = conn.call(f"read {node}'s registration", lambda: conn.client.get(self._keys.nodes_prefix + node),
                                    within=min(5.0, self._config.etcd_timeout))
        except RendezvousError as exc:
            log.warning("%scould not read the registration of %s: %s", self._ctx(), node, exc)
            return None
        return self._peer_of(node, value, int(getattr(meta, "lease_id", 0) or 0))

    def _peer_of(self, node: str, value: bytes | None, lease: int) -> Peer | None:
        """``node``'s peer from its registration's value and the lease etcd attached the key to (never the
        lease the value names: a hostile value could name another node's)."""
        if value is None:
            return None
        try:
            return peer_from_registration(node, json.loads(value), lease)
        except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            log.warning("%scorrupt registration of %s: %s", self._ctx(), node, exc)
            return None

    def _current_peers(self, nodes: list[str]) -> list[Peer]:
        """The registered ``nodes``' liveness ports: from the full mirror, else one range read of ``nodes/``."""
        with self._cond:
            mirror = self._mirror()
            if mirror.full and mirror.loaded:
                return [mirror.peers[n] for n in nodes if n in mirror.peers]
        conn = self._require_conn()
        resp = conn.call("read the registrations", lambda: conn.client.get_prefix_response(self._keys.nodes_prefix),
                         within=min(5.0, self._config.etcd_timeout))
        wanted = set(nodes)
        found = {kv.key.decode()[len(self._keys.nodes_prefix):]: (kv.value, int(kv.lease)) for kv in resp.kvs}
        return [p for n, (v, lease) in found.items() if n in wanted and (p := self._peer_of(n, v, lease)) is not None]

    def _revoke_dead_peer(self, peer: Peer) -> bool:
        """``peer``'s process is gone (its liveness port refuses): revoke its lease so that every agent's watch
        sees its registration go now, not after ``lease_ttl``. Only the lease it is registered with now (a
        peer that re-registered since is someone we know nothing bad about)."""
        with self._cond:
            closed = self._mirror().closed
        current = self._current_peer(peer.node)
        conn = self._conn()
        if current is None or current.lease != peer.lease or conn is None or self._released():
            return False
        if closed:  # the job ended: a peer that exits is one that finished (its shutdown revokes its own lease)
            log.debug("%speer %s exited after the job was closed", self._ctx(), peer.node)
            return False
        try:
            conn.call("revoke a dead peer's lease", lambda: conn.client.revoke_lease(peer.lease), within=2.0)
        except RendezvousError as exc:
            if is_lease_not_found(exc.__cause__):  # it went on its own meanwhile (revoked or expired)
                log.debug("%speer %s's lease was already gone", self._ctx(), peer.node)
                return False
            log.warning("%scould not revoke the lease of dead peer %s (it expires in <= %d s): %s", self._ctx(),
                        peer.node, self._config.lease_ttl, exc)
            return False
        log.warning("%speer %s's agent process is gone (its liveness port %s:%d refuses connections): revoked its "
                    "lease", self._ctx(), peer.node, peer.addr, peer.port)
        return True

    def any_refuses(self, nodes: Iterable[str]) -> bool:
        """Whether any of ``nodes`` (lost participants of this node's round) might have died on a live host: its
        liveness port (from the round record's ring) refuses now, or it cannot be probed (no ring entry, no
        liveness port). Then that host's kernel also reset its workers' connections and this node's workers'
        collectives break (a just-in-time snapshot is worth waiting for). False when every one is silent (power
        off, a partition) or accepts (a paused node): nothing breaks those collectives. Probes only; revokes
        nothing (a refusal here is no proof of death: see ``SeenAccepting``)."""
        wanted = sorted(set(nodes))
        if not wanted or not self._config.liveness_probe:
            return bool(wanted)
        with self._cond:
            mirror, mine = self._mirror(), self._my_round()
            ring = mirror.round_ring if mine is not None and mirror.committed == mine else {}
            peers = [self._ring_peer(node, ring) for node in wanted]
        known = [p for p in peers if p is not None]
        if len(known) < len(peers):
            return True
        return any(found is Probe.REFUSED for found in probe_each(known))

    def probe(self) -> set[str]:
        """Probe every other participant of this node's round now (a worker failed: a dead peer would explain
        it) and revoke the lease of each whose process is gone; returns those nodes. Silent peers (a partition,
        a powered-off host) are left to their lease. One read of the registrations unless this node coordinates
        (then none), and a revoke per dead peer."""
        mine = self._my_round()
        watch = self.watch
        if mine is None or self._released() or not self._config.liveness_probe or watch is None:
            return set()
        try:
            peers = self._current_peers([n for n in mine.participants if n != self._node_id])
        except RendezvousError as exc:
            log.warning("%scould not read the peers' registrations to probe them: %s", self._ctx(), exc)
            return set()
        if not peers:
            return set()
        dead = {node for node, found in probe_all(peers, watch.seen).items() if found is Verdict.DEAD}
        return {p.node for p in peers if p.node in dead and self._revoke_dead_peer(p)}
