"""``Follower``: takes this node into the next round by following the coordinator's posts (``state.follow``):
it writes its join key, waits for the round key, commits the proposed round when it is its rank 0, and only at
its join deadline reads every key once to ask ``state.decide`` whether it timed out (or is a spare)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from .api import EtcdRendezvousConfig, RendezvousClosedError, RendezvousTimeoutError
from .etcd_client import EtcdConnection
from .health import EtcdHealth
from .keys import RunKeys
from .mirror import SAFETY_RECHECK_S, Mirror, MirrorUpdater
from .registration import Registration
from .rounds import RoundWriter, snapshot_of, wait_time
from .state import Action, FollowerView, RoundRecord, Snapshot, decide, follow

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""

T = TypeVar("T")


class Follower:
    """This node's way into a round (``next_round``): joins, commits when it is rank 0, checks its deadline."""

    def __init__(
        self,
        config: EtcdRendezvousConfig,
        keys: RunKeys,
        rounds: RoundWriter,
        registration: Registration,
        updater: MirrorUpdater,
        health: EtcdHealth,
        cond: threading.Condition,
        *,
        node_id: str,
        mirror: Callable[[], Mirror],
        require_conn: Callable[[], EtcdConnection],
        clock: Callable[[], float],
        ctx: Callable[[], str],
    ) -> None:
        """Args:
            registration: our lease (joins are written under it; a re-registration re-joins ``joining``).
            cond: the handler's condition: decisions under it, the I/O outside (the watch delivers our writes)."""
        self._config = config
        self._keys = keys
        self._rounds = rounds
        self._registration = registration
        self._updater = updater
        self._health = health
        self._cond = cond
        self._node_id = node_id
        self._mirror = mirror
        self._require_conn = require_conn
        self._clock = clock
        self._ctx = ctx

    def next_round(self, began: float, complete: Callable[[RoundRecord], T]) -> T:
        """Block until a round with this node in it is committed; return ``complete(record)``, called under the
        condition (the round becomes this node's as it is seen). Raises ``RendezvousTimeoutError`` (no round by
        ``join_timeout`` after ``began``) or ``RendezvousClosedError``."""
        join_deadline = began + self._config.join_timeout
        with self._cond:
            committed = self._mirror().committed
        target = (committed.number if committed else 0) + 1
        joined_target: tuple[int, int | None] | None = None  # (round, lease) of our last join write
        committed_mod: int | None = None  # round-key revision our last successful commit replaced
        checked_at: float | None = None
        previous: Action | None = None
        log.info("%sjoining round %d (min=%d max=%d)", self._ctx(), target, self._config.min_nodes, self._config.max_nodes)
        while True:
            with self._cond:
                self._health.raise_if_fatal()
                mirror = self._mirror()
                view = FollowerView(
                    node_id=self._node_id,
                    target=target,
                    committed=mirror.committed,
                    closed=mirror.closed,
                    joined=joined_target == (target, self._registration.lease_id),
                    proposal=mirror.proposal,
                    now=self._clock(),
                    join_deadline=join_deadline,
                    checked_at=checked_at,
                    recheck_s=SAFETY_RECHECK_S,
                )
                seen_mod, proposal, ring = mirror.committed_mod, mirror.proposal, mirror.proposal_ring
                decision = follow(view)
                if decision.action != previous:
                    log.info("%sround %d: %s (%s)", self._ctx(), target, decision.action.value, decision.reason)
                    previous = decision.action
                action = decision.action
                if action is Action.COMMIT and committed_mod == seen_mod:
                    action = Action.WAIT  # our commit is not in the mirror yet
                if action is Action.WAIT:
                    self._cond.wait(wait_time(decision, self._clock))
                    continue
                if action is Action.DONE:
                    assert mirror.committed is not None
                    return complete(mirror.committed)
                if action is Action.REJOIN:
                    assert mirror.committed is not None
                    target = mirror.committed.number + 1
                    joined_target = None
                    continue
                if action is Action.CLOSED:
                    raise RendezvousClosedError(f"{self._ctx()}the rendezvous of run '{self._config.run_id}' is closed")
            # I/O outside the lock (the watch thread needs it to deliver our own writes).
            if action is Action.JOIN:
                if self._write_join(target, seen_mod):
                    joined_target = (target, self._registration.lease_id)
            elif action is Action.COMMIT:
                assert proposal is not None
                if self._rounds.commit(target, decision.participants, seen_mod, proposal.mod_revision, ring):
                    committed_mod = seen_mod
            elif action is Action.CHECK:
                checked_at = self._clock()
                if not self._check_deadline(target, join_deadline):
                    joined_target = None  # our join key is gone: write it again

    def _write_join(self, target: int, seen_mod: int) -> bool:
        """Put our join key for ``target`` unless the round key moved since our snapshot (under our live lease)."""
        registration = self._registration
        seq = registration.seq
        with self._cond:
            registration.joining = (target, seen_mod)
        return registration.with_live_lease(lambda: self._rounds.join(target, seen_mod, seq, registration.lease_id))

    def _check_deadline(self, target: int, join_deadline: float) -> bool:
        """At the join deadline: read every key once and let ``decide`` say whether this node timed out
        (raises ``RendezvousTimeoutError``) or waits on (a spare has no deadline). False when ``decide`` finds
        this node's join key missing."""
        snap = self._full_snapshot(target, join_deadline)
        decision = decide(snap)
        log.info("%sround %d: join deadline check: %s (%s)", self._ctx(), target, decision.action.value, decision.reason)
        if decision.action is Action.TIMEOUT:
            raise RendezvousTimeoutError(
                f"{self._ctx()}no round formed within join_timeout={self._config.join_timeout:.0f} s: "
                f"{decision.reason} (live nodes: {len(snap.live)}, min_nodes={self._config.min_nodes}, "
                f"etcd {self._config.endpoint_str})"
            )
        if decision.action is Action.CLOSED:
            raise RendezvousClosedError(f"{self._ctx()}the rendezvous of run '{self._config.run_id}' is closed")
        return decision.action is not Action.JOIN

    def _full_snapshot(self, target: int, join_deadline: float) -> Snapshot:
        """A ``Snapshot`` of every key: from the mirror when it is full, else from one range read."""
        with self._cond:
            mirror = self._mirror()
            if mirror.full and mirror.loaded:
                return snapshot_of(mirror, node_id=self._node_id, config=self._config, now=self._clock(),
                                   target=target, join_deadline=join_deadline)
        conn = self._require_conn()
        resp = conn.call("read the rendezvous state", lambda: conn.client.get_prefix_response(self._keys.ctl))
        mirror = Mirror(revision=int(resp.header.revision), loaded=True, full=True)
        for kv in resp.kvs:
            self._updater.put(mirror, kv.key.decode(), kv.value, kv.mod_revision)
        with self._cond:
            self._health.raise_if_fatal()
            return snapshot_of(mirror, node_id=self._node_id, config=self._config, now=self._clock(), target=target,
                               join_deadline=join_deadline)
