"""How rounds are formed in etcd: the transactions of a joining node and of the coordinator, and the
``Snapshot`` the pure ``state`` functions decide on.

``RoundWriter`` holds every write that moves a round on (key layout in ``etcd_v3``'s module doc): a node's join
key (guarded by the round key's revision), the coordinator's election (by the coordinator key's absence), its
proposal and reform notice, and rank 0's commit of the proposal (guarded by the round key's, the proposal's and
the closed key's revisions). Deciding when to write is not its business: the handler follows ``state.follow``
and the coordinator ``state.coordinate``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from .api import EtcdRendezvousConfig
from .etcd_client import EtcdConnection, prefix_end
from .keys import RunKeys, join_value
from .mirror import SAFETY_RECHECK_S, Mirror
from .state import Decision, Reform, Snapshot

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""


def snapshot_of(mirror: Mirror, *, node_id: str, config: EtcdRendezvousConfig, now: float, target: int,
                join_deadline: float, last_call: float | None = None, rejoin: float | None = None) -> Snapshot:
    """``mirror`` (a full one) as ``decide``/``coordinate`` see it."""
    committed = mirror.committed
    pending = (committed.number if committed else 0) + 1
    return Snapshot(
        node_id=node_id,
        target=target,
        committed=committed,
        live=frozenset(mirror.nodes),
        joined=dict(mirror.joins.get(pending, {})),
        closed=mirror.closed,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        now=now,
        join_deadline=join_deadline,
        last_call_deadline=last_call,
        rejoin_deadline=rejoin,
    )


def wait_time(decision: Decision, clock: Callable[[], float]) -> float:
    """How long to wait for ``decision``: until its ``wake_at``, at most ``SAFETY_RECHECK_S``."""
    if decision.wake_at is None:
        return SAFETY_RECHECK_S
    return max(0.0, min(decision.wake_at - clock(), SAFETY_RECHECK_S))


class RoundWriter:
    """This node's writes that form rounds, each one transaction (or put) on the handler's connection."""

    def __init__(self, keys: RunKeys, *, node_id: str, addr: str, store_port: Callable[[int], int],
                 require_conn: Callable[[], EtcdConnection], ctx: Callable[[], str]) -> None:
        """Args:
            addr: this node's address: the workers' store's, when it commits a round (its rank 0).
            store_port: the port of the workers' store this node hosts for a round (``WorkerStoreHost.port_for``).
            require_conn: the handler's connection (once connected).
            ctx: the handler's log context."""
        self._keys = keys
        self._node_id = node_id
        self._addr = addr
        self._store_port = store_port
        self._require_conn = require_conn
        self._ctx = ctx

    def join(self, target: int, seen_mod: int, seq: int | None, lease: int | None) -> bool:
        """Put this node's join key for ``target`` on ``lease`` unless the round key moved since ``seen_mod``."""
        conn = self._require_conn()
        tx = conn.client.transactions
        key, value = self._keys.join_key(target, self._node_id), join_value(seq, self._addr)
        ok, _ = conn.call(
            f"join round {target}",
            lambda: conn.client.transaction(
                compare=[tx.mod(self._keys.round_key) == seen_mod], success=[tx.put(key, value, lease=lease)], failure=[]
            ),
        )
        return bool(ok)

    def commit(self, target: int, participants: tuple[str, ...], seen_mod: int, proposal_mod: int,
                ring: dict[str, Any] | None = None) -> bool:
        """Commit the coordinator's proposal (of revision ``proposal_mod``) as round ``target``; this node is its
        rank 0 and hosts the workers' store. False when the round key, the proposal or the closed key moved."""
        conn = self._require_conn()
        tx = conn.client.transactions
        record = {
            "number": target,
            "participants": list(participants),
            "master_addr": self._addr,
            "master_port": self._store_port(target),
            "committed_by": self._node_id,
            "time": time.time(),
        }
        if ring:  # add-only field: an older agent ignores it and reads its successor's registration
            record["ring"] = {node: ring[node] for node in participants if node in ring}
        join_dir = f"{self._keys.join_prefix}{target}/"
        # (Not compared: that each participant's join key still exists. etcd caps a txn at 128 ops, and a
        # participant that died since our snapshot is caught by the watch right after: the round breaks.)
        compare = [tx.mod(self._keys.round_key) == seen_mod, tx.version(self._keys.closed_key) == 0,
                   tx.mod(self._keys.proposal_key) == proposal_mod]
        success = [
            tx.put(self._keys.round_key, json.dumps(record)),
            tx.delete(join_dir, range_end=prefix_end(join_dir)),
            tx.delete(self._keys.proposal_key),
        ]
        if target > 2:
            old_store = f"{self._keys.store_prefix}{target - 2}/"
            success.append(tx.delete(old_store, range_end=prefix_end(old_store)))
        ok, _ = conn.call(
            f"commit round {target}", lambda: conn.client.transaction(compare=compare, success=success, failure=[])
        )
        if ok:
            log.info("%scommitted round %d with %d nodes: %s", self._ctx(), target, len(participants), ", ".join(participants))
        else:
            log.info("%scommit of round %d lost a race (state moved); re-deciding", self._ctx(), target)
        return bool(ok)

    def elect(self, lease: int) -> None:
        """Become the coordinator if there is none (the key lives on our lease: it ends with us)."""
        conn = self._require_conn()
        tx = conn.client.transactions
        value = json.dumps({"node": self._node_id, "lease": lease})
        won, _ = conn.call("elect a coordinator", lambda: conn.client.transaction(
            compare=[tx.version(self._keys.coordinator_key) == 0],
            success=[tx.put(self._keys.coordinator_key, value, lease=lease)], failure=[]))
        if won:
            log.info("%scoordinating the rendezvous (mirrors every registration and join)", self._ctx())

    def post_reform(self, reform: Reform) -> None:
        """Tell every node that committed round ``reform.round`` must re-form (the coordinator's notice)."""
        conn = self._require_conn()
        value = json.dumps({"round": reform.round, "waiting": reform.waiting, "lost": list(reform.lost),
                            "by": self._node_id})
        conn.call("post a reform notice", lambda: conn.client.put(self._keys.reform_key, value))
        log.info("%scoordinator: round %d must re-form (%d waiting, lost: %s)", self._ctx(), reform.round,
                 reform.waiting, ", ".join(reform.lost) or "none")

    def propose(self, target: int, participants: tuple[str, ...], seen_mod: int, proposal_mod: int, lease: int,
                ring: dict[str, list[Any]] | None = None) -> None:
        """Post the proposal unless the round key or the proposal moved since the decision (on our lease: a dead
        coordinator's proposal vanishes with it)."""
        conn = self._require_conn()
        tx = conn.client.transactions
        value = json.dumps({"number": target, "participants": list(participants), "by": self._node_id,
                            "ring": ring or {}})
        ok, _ = conn.call(f"propose round {target}", lambda: conn.client.transaction(
            compare=[tx.mod(self._keys.round_key) == seen_mod, tx.mod(self._keys.proposal_key) == proposal_mod],
            success=[tx.put(self._keys.proposal_key, value, lease=lease)], failure=[]))
        if ok:
            log.info("%scoordinator: proposed round %d with %d nodes (rank 0: %s)", self._ctx(), target,
                     len(participants), participants[0])
