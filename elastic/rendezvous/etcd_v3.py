"""``EtcdV3RendezvousHandler``: torch's RendezvousHandler on etcd v3 leases, watches and transactions.

Keys (``P = {etcd_prefix}/{run_id}/``; two jobs on one etcd never share a key)::

    P/ctl/nodes/{node}         registration, attached to the node's lease (vanishes <= lease_ttl after death)
    P/ctl/join/{round}/{node}  "I want to be in round N", attached to the node's lease
    P/ctl/round                the committed round record (JSON: number, participants, master addr/port:
                               the workers' TCPStore, hosted by the round's rank-0 agent: ``worker_store``;
                               ring: each participant's [addr, liveness port, lease], copied from the proposal)
    P/ctl/closed               present once the job ended (set_closed/shutdown), until its last agent left
    P/ctl/notice/{node}        the node's preemption deadline (JSON), attached to its lease (publish_notice)
    P/ctl/post/coordinator     the coordinator (JSON: node, lease), on its lease; created by transaction when absent
    P/ctl/post/proposal        the coordinator's proposal for the next round (JSON: number, participants in rank
                               order, ring), on its lease; deleted by the commit
    P/ctl/post/reform          the coordinator's notice that committed round N must re-form (JSON: round, waiting,
                               lost participants)
    P/ctl/restart/{node}       the node's workers failed in committed round N and its agent restarts them (JSON:
                               round, node, time), on its lease (publish_restart): its peers' workers, whose
                               collectives with the dead ones may hang (NCCL), abort their groups
    P/store/{round}/...        the agents' c10d store of that round (EtcdV3Store)
    P/health/{node}            the node's health report for ``spotrun status`` (JSON: stragglers, global rank ->
                               step time ratio), attached to its lease; written only when it changes
                               (publish_health), read by nobody in the rendezvous
    P/finished                 only with ``finished_ttl``: the run finished successfully (JSON: by, time,
                               round), on a lease of ``finished_ttl`` s; a newcomer exits 0 at once

After a clean end (every agent's ``shutdown()``) nothing is left under ``P`` but the opt-in ``finished``
marker: the last agent to leave deletes the run's other keys (``EndedRun.reap``). A run id can be used again after its job ended (a Kubernetes
Job's name, torchrun's default id); when keys of the ended job are still there (its agents are still
leaving, or the last one could not reach etcd), a new agent that finds ``P/ctl/closed`` waits until no node
of the ended job is registered any more, then deletes everything under ``P`` in one transaction that
compares the closed key's revision and that no node key exists. A running job always has registered nodes
(their leases) and no closed key, so it is never touched; two newcomers racing to clear the same ended run
are serialised by the compare.

O(N) traffic per round: one node, the coordinator, mirrors all of ``P/ctl/`` through its watch stream (no
polling) and runs the pure ``state.coordinate`` on it; when a round may close it posts the proposal, and when
the committed round breaks (a participant lost or re-joining, a newcomer with a free slot) the reform notice.
Every other node's stream watches only ``P/ctl/closed`` and ``[P/ctl/notice/, P/ctl/round]`` (notices, posts,
round): the N registrations and N joins of a round reach one watcher, not N. Handlers that share a ``ClientPool``
(many simulated agents in one process) share that follower stream too (``watch_mux.py``). A joining node runs the pure
``state.follow``: it writes its join key and waits for the round key; the proposal's rank 0 commits it with one
transaction that compares the round key's and the proposal's mod revisions (a stale agent, or a superseded
proposal, fails) and that the job is not closed, then writes the record, clears the round's join keys and the
proposal and drops the store of two rounds ago. At its join deadline a node reads every key once and asks
``state.decide`` whether it timed out or is a spare. When the coordinator's lease ends its key goes with it: the
others see it (a lost participant, if it was one) and one of them wins the election transaction, loads every
key and carries on (deadlines restart). A node that clears an ended run mirrors every key while it does (it
counts the registered nodes). A lease keeper (``lease_keeper.py``) keeps the registration
alive, re-registers after an expiry (e.g. etcd unreachable longer than the TTL) and turns an etcd outage
longer than ``etcd_timeout`` into a ``RendezvousOutageError`` (a ``RendezvousConnectionError``).

Loss detection: when a participant's registration disappears, the coordinator's watch sees it and posts the
reform notice (a follower sees the coordinator's own loss from its key), ``membership_changed()`` becomes True and ``num_nodes_waiting()`` >= 1, so torch's stock agent (which
re-rendezvous when ``num_nodes_waiting() > 0`` while healthy) and ours restart into a new round. That
round closes as soon as every live node has joined: no last-call wait on recovery. A node whose lease was gone at
that instant (expired, its keeper re-registering it) is not waited for: like any newcomer it joins the next
round, which the others re-form for (``num_nodes_waiting``), so a mass lease expiry can cost more than one round.

The handler is the face torch sees (this module); each of its parts owns one thing, around the pure ``state``
functions that decide (``follow``, ``decide``, ``coordinate``, ``reform_of``), and they share the handler's
condition::

    keys.py          RunKeys: the key names above
    health.py        EtcdHealth: the outage clock and the fatal error every public method raises
    mirror.py        Mirror (the local copy of P/ctl/), MirrorUpdater (keys and events -> mirror; who left)
    mirror_watch.py  MirrorWatch: the watch thread that keeps the mirror current (own stream or WatchMux)
    registration.py  Registration: this node's lease and node key, kept by a LeaseKeeper, renewed when lost
    rounds.py        RoundWriter: join, commit, elect, propose, reform transactions; the Snapshot decided on
    follower.py      Follower: ``next_rendezvous``'s way into a round (join, commit as rank 0, deadline check)
    own_round.py     OwnRound: the round this node completed and the membership it reports (waiting, lost peers)
    coordinator.py   Coordinator: the coordinator thread (election, proposals, reform notices)
    peers.py         PeerLiveness: the liveness port, the ring successor's watch, dead peers' revokes
    cleanup.py       EndedRun: the finished marker; an ended run's keys, deleted by its last agent or a newcomer

What stays here: torch's interface and the extra API, delegated to the parts; connecting, registering and
teardown, which start and stop the parts' threads in order.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from elastic.nodes import node_id as new_node_id

from .api import (
    BACKEND_NAME,
    EtcdRendezvousConfig,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)
from .cleanup import EndedRun, describe_finished
from .coordinator import ELECT_SPREAD_MAX_S, ELECT_SPREAD_PER_NODE_S, Coordinator, election_spread
from .etcd_client import ClientPool, EtcdConnection
from .follower import Follower
from .health import EtcdHealth, unreachable_at_shutdown
from .keys import RunKeys
from .mirror import SAFETY_RECHECK_S, Mirror, MirrorUpdater
from .mirror_watch import MirrorWatch, watch_failure
from .own_round import OwnRound
from .peers import PeerLiveness
from .registration import Registration
from .rounds import RoundWriter
from .state import RoundRecord
from .store import EtcdV3Store
from .worker_store import WorkerStoreHost, agent_hosts_store

log = logging.getLogger(__name__)

__all__ = [
    "ELECT_SPREAD_MAX_S",
    "ELECT_SPREAD_PER_NODE_S",
    "STORE_TIMEOUT",
    "EtcdV3RendezvousHandler",
    "describe_finished",
    "election_spread",
    "unreachable_at_shutdown",
    "watch_failure",
]

STORE_TIMEOUT = timedelta(seconds=60)
"""Default timeout of the agents' store (torch's c10d backend uses 60 s too); barriers set their own."""


class EtcdV3RendezvousHandler(RendezvousHandler):
    """torch ``RendezvousHandler`` over etcd v3 (backend name ``etcd-v3``): a coordinator of its parts.

    Beyond torch's interface it implements the protocols of ``api.py`` the agent checks for
    (``MembershipAwareHandler``, ``NoticeAwareHandler``, ``PeerProbingHandler``, ...), and for fault injection
    ``simulate_crash``. ``mirror``, ``keys``, ``registration``, ``peers``, ``rounds``, ``connection`` and
    ``registered`` are its parts and state, for diagnostics and tests to read (never to replace).

    Raises from every public method: ``RendezvousConnectionError`` once etcd has been unreachable for
    longer than ``etcd_timeout``.
    """

    def __init__(
        self,
        config: EtcdRendezvousConfig,
        *,
        node_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        pool: ClientPool | None = None,
    ) -> None:
        """Args:
            config: the rendezvous configuration (``--rdzv-conf``).
            node_id: this agent's id (default: host, pid and a random suffix); no '/'.
            clock: monotonic seconds (injected by tests).
            pool: share one etcd client (gRPC channel) with the other handlers of this process that pass the
                same pool and configuration (a simulation of many agents in one process; None: its own).
        Raises:
            ValueError: a bad ``node_id``."""
        if node_id is not None and (not node_id or "/" in node_id):
            raise ValueError(f"node_id {node_id!r} must be non-empty and contain no '/'")
        self._config = config
        self._node_id = node_id = node_id or new_node_id()
        self._clock = clock
        self._addr = config.local_addr or socket.getfqdn()
        self._worker_store = WorkerStoreHost(self._addr, enabled=agent_hosts_store())

        self.keys = RunKeys(config.run_prefix)
        """The run's key names."""
        self._cond = threading.Condition()
        """Guards the mirror and this node's round state; notified on every change (waiting loops wake on it)."""
        self._stop = threading.Event()
        self.connection: EtcdConnection | None = None
        """The etcd connection (None before ``connect()``)."""
        self.registered = False
        """Whether this node registered (lease, node key, coordinator thread)."""
        self._released = False
        self._start_lock = threading.Lock()

        # The parts, each owning one thing; they share the condition, and reach the handler's state through the
        # callables they are given.
        self._health = EtcdHealth(config, self._cond, clock, self._ctx)
        """Whether etcd answers; the fatal error every public method raises once the handler cannot go on."""
        self._updater = MirrorUpdater(self.keys.ctl, self._ctx, self._health.corrupt)
        """Applies keys and events to the mirror; knows which participants left which round."""
        self._own = OwnRound(self._updater, node_id=node_id, max_nodes=config.max_nodes, mirror=lambda: self._watch.mirror)
        self._watch = MirrorWatch(config, self.keys, self._updater, self._health, self._cond, self._stop,
                                  node_id=node_id, lease=lambda: self.registration.lease_id,
                                  require_conn=self._require_conn, clock=clock, ctx=self._ctx, pool=pool)
        """Keeps ``mirror`` current from etcd's watch (its thread starts at connect)."""
        self.peers = PeerLiveness(config, self.keys, self._cond, node_id=node_id, mirror=lambda: self._watch.mirror,
                                  my_round=lambda: self._own.record, conn=lambda: self.connection,
                                  require_conn=self._require_conn, released=lambda: self._released, ctx=self._ctx)
        """Our liveness port and our watch on the ring successor's; revokes a dead peer's lease."""
        self.registration = Registration(
            config, self.keys, self._health, self._cond, self._stop, node_id=node_id, addr=self._addr,
            live_port=lambda: self.peers.listener.port if self.peers.listener is not None else None,
            require_conn=self._require_conn, ctx=self._ctx, pool=pool)
        """Our lease and node key (registered again when the lease is gone), kept alive by a ``LeaseKeeper``."""
        self.rounds = RoundWriter(self.keys, node_id=node_id, addr=self._addr, store_port=self._worker_store.port_for,
                                  require_conn=self._require_conn, ctx=self._ctx)
        """The transactions that form rounds (join, commit; the coordinator's election, proposal, reform)."""
        self._coordinator = Coordinator(
            config, self.rounds, self._updater, self._health, self._cond, self._stop, node_id=node_id,
            mirror=lambda: self._watch.mirror, lease=lambda: self.registration.lease_id,
            renewing=self.registration.renewing, released=lambda: self._released, clock=clock, ctx=self._ctx)
        """The coordinator role: tries the election while none holds it, and runs it while this node does."""
        self._follower = Follower(config, self.keys, self.rounds, self.registration, self._updater, self._health,
                                  self._cond, node_id=node_id, mirror=lambda: self._watch.mirror,
                                  require_conn=self._require_conn, clock=clock, ctx=self._ctx)
        self._ended_run = EndedRun(config, self.keys, self._watch, self._health, self._cond, node_id=node_id,
                                   clock=clock, ctx=self._ctx)
        """The finished marker, and the run's keys once its job ended (deleted by its last agent, or by a
        newcomer reusing the run id)."""

    @property
    def mirror(self) -> Mirror:
        """The mirror of ``P/ctl/`` that the watch keeps (read it under the condition)."""
        return self._watch.mirror

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        """True, as torchrun's c10d backend: the round's rank-0 agent hosts the workers' TCPStore
        (``worker_store``); False with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (rank 0's worker hosts it)."""
        return self._worker_store.enabled

    def get_run_id(self) -> str:
        return self._config.run_id

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def round(self) -> int | None:
        record = self._own.record
        return record.number if record is not None else None

    @property
    def participants(self) -> tuple[str, ...]:
        record = self._own.record
        return record.participants if record is not None else ()

    @property
    def config(self) -> EtcdRendezvousConfig:
        return self._config

    @property
    def outage_bound(self) -> float:
        """``etcd_timeout``: past it a failing etcd ends the job (``OutageBoundHandler``)."""
        return self._config.etcd_timeout

    @property
    def endpoint(self) -> str:
        return self._config.endpoint_str

    @property
    def lease_ttl(self) -> float:
        """Seconds a dead peer stays a member (``LeaseHandler``)."""
        return float(self._config.lease_ttl)

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; block until it is committed with this node in it (``Follower``)."""
        self.register()
        began = self._clock()
        info, record, rank = self._follower.next_round(began, lambda record: self._complete_round(record, began))
        self.peers.watch_successor(record, rank)
        return info

    def is_closed(self) -> bool:
        if not self._released:  # after leave()/shutdown(): the last state seen, without I/O
            self._ensure_connected()
        with self._cond:
            self._health.raise_if_fatal()
            return self.mirror.closed

    def set_closed(self) -> None:
        """Mark the job's rendezvous closed (eventually seen by every node; next_rendezvous then raises)."""
        conn = self._ensure_connected()
        conn.call(
            "mark the rendezvous closed",
            lambda: conn.client.put(self.keys.closed_key, json.dumps({"by": self._node_id, "time": time.time()})),
            within=self._config.close_timeout,
        )
        with self._cond:
            self.mirror.closed = True
            self._cond.notify_all()
        log.info("%sclosed the rendezvous", self._ctx())

    def num_nodes_waiting(self) -> int:
        """Nodes that would join a new round now (> 0 tells the running agent to re-rendezvous)."""
        if not self._released:
            self._ensure_connected()
        with self._cond:
            self._health.raise_if_fatal()
            return self._own.nodes_waiting()

    def shutdown(self) -> bool:
        """torch semantics: close the rendezvous (the job is over), then release this node. Idempotent."""
        ok = closed_here = True
        if self._health.unreachable():
            log.warning("%snot marking the rendezvous closed: etcd is unreachable", self._ctx())
            ok = closed_here = False
        elif not self._released:
            try:
                self.set_closed()
            except RendezvousError as exc:
                ok = closed_here = False
                log.warning("%scould not mark the rendezvous closed: %s", self._ctx(), exc)
        else:
            closed_here = False  # left already (a preempted node): the job goes on without it
        self._release(reap=closed_here)
        return ok

    # ================================================================== extra API
    def connect(self) -> None:
        """Reach etcd (``ConnectableHandler``); raises ``RendezvousFinishedError`` when the run already finished
        (its ``finished`` marker, with ``finished_ttl``), so the launcher exits 0 before it starts anything."""
        self._ended_run.raise_if_finished(self._ensure_connected())

    def mark_finished(self) -> None:
        """Leave the ``finished`` marker for ``finished_ttl`` s (``FinishMarkingHandler``; no-op when 0): the run
        finished successfully. Called by every agent of the last round before ``shutdown``: the first one writes
        it, the others find it there (one lease, not one per agent). Each call is bounded by ``close_timeout``,
        and none is made when etcd is known to be away (as ``shutdown``)."""
        ttl = self._config.finished_ttl
        if ttl <= 0:
            return
        if self._health.unreachable():
            raise RendezvousConnectionError(f"{self._ctx()}etcd at {self._config.endpoint_str} is unreachable")
        self._ended_run.mark_finished(self._ensure_connected(), self.round)

    def membership_changed(self) -> bool:
        with self._cond:
            self._health.raise_if_fatal()
            return self._own.changed()

    def wait_membership_change(self, timeout: float) -> bool:
        deadline = self._clock() + max(0.0, timeout)
        with self._cond:
            while True:
                self._health.raise_if_fatal()
                if self._own.changed():
                    return True
                remaining = deadline - self._clock()
                if remaining <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(min(remaining, SAFETY_RECHECK_S))

    def publish_notice(self, notice: dict[str, Any]) -> None:
        conn = self._ensure_connected()
        value = json.dumps({**notice, "node": self._node_id})
        self.registration.put_on_lease(conn, "publish a preemption notice", self.keys.notice_prefix + self._node_id, value)
        log.info("%spublished preemption notice %s", self._ctx(), value)

    def publish_restart(self) -> None:
        """``RestartAnnouncingHandler.publish_restart``: ``P/ctl/restart/{node}`` names this node's round, on its
        lease (a no-op before the first round)."""
        number = self.round
        if number is None:
            return
        conn = self._ensure_connected()
        value = json.dumps({"round": number, "node": self._node_id, "time": time.time()})
        self.registration.put_on_lease(conn, "announce the workers' restart", self.keys.restart_prefix + self._node_id,
                                       value)
        log.info("%sannounced the restart of this node's workers in round %d", self._ctx(), number)

    def restarted_peers(self) -> set[str]:
        """``RestartAnnouncingHandler.restarted_peers``: from the mirror, no I/O."""
        with self._cond:
            return self._own.restarted_peers()

    def publish_health(self, report: dict[str, Any] | None) -> None:
        conn = self._ensure_connected()
        key = self.keys.health_prefix + self._node_id
        if report is None:
            conn.call("remove the health report", lambda: conn.client.delete(key))
            return
        self.registration.put_on_lease(conn, "publish the health report", key, json.dumps({**report, "node": self._node_id}))

    def peer_notices(self) -> dict[str, dict[str, Any]]:
        with self._cond:
            return self._own.peer_notices()

    def lost_peers(self) -> set[str]:
        with self._cond:
            return self._own.lost_peers()

    def leave(self) -> None:
        """Revoke the lease (peers notice at once) and release threads and the connection; job stays open.

        The workers' store (when this node hosts it) stays up until ``shutdown()`` or the agent's exit: a
        node that leaves for its notice revokes its lease as soon as its workers committed the agreed step,
        while they (and the peers' workers) may still be tearing down their process groups."""
        self._release(reap=False, close_worker_store=False)

    def _release(self, *, reap: bool, close_worker_store: bool = True) -> None:
        """``leave()``; when the job ended (``reap``: closed by this call, or seen closed: a signalled agent
        leaves without closing) the last agent to go also deletes the run's keys."""
        if close_worker_store:
            self._worker_store.close()  # our workers are stopped by now (shutdown comes after them)
        if self._released:
            self.peers.stop()  # after a silent ``simulate_crash``: its port was left open until now
            return
        self._released = True
        with self._cond:
            reap = reap or self.mirror.closed
        self._stop_threads()
        self.peers.stop()
        conn = self.connection
        if conn is not None:
            self.registration.revoke(conn)
            if reap:
                self._ended_run.reap(conn)
            conn.close()
        log.info("%sleft the rendezvous", self._ctx())

    def lost_peers_refuse(self) -> bool:
        """``PeerProbingHandler.lost_peers_refuse``: False at once when a newer round formed without this node
        (its lease lapsed: a partition, a pause), else whether a lost peer's liveness port refuses or cannot be
        probed (``PeerLiveness.any_refuses``)."""
        with self._cond:
            if self._own.left_behind():
                return False
        return self.peers.any_refuses(self.lost_peers())

    def probe_peers(self) -> set[str]:
        """Probe every other participant of this node's round now (a worker failed: a dead peer would explain
        it) and revoke the lease of each whose process is gone; returns those nodes (``PeerLiveness.probe``)."""
        return self.peers.probe()

    # ================================================================== fault injection
    def simulate_crash(self, *, silent: bool = False) -> None:
        """Vanish like a SIGKILLed agent (no revoke of its own: the lease expires after lease_ttl,
        unless a peer's probe of its closed liveness port revokes it first). ``silent``: like a host that lost
        power or its network instead, its liveness port neither refuses nor ends connections (a probe proves
        nothing): only the lease tells; ``leave()`` closes the port later."""
        self._released = True
        self._stop_threads()
        if not silent:
            self.peers.stop()
        if self.connection is not None:
            self.connection.close()

    # ================================================================== this node's round
    def _complete_round(self, record: RoundRecord, began: float) -> tuple[RendezvousInfo, RoundRecord, int]:
        """Make ``record`` this node's round (under the condition) and open its store."""
        rank = record.rank_of(self._node_id)
        assert rank is not None
        self._own.record = record
        self.registration.joining = None
        self._worker_store.round_completed(record.number, record.master_port, rank)
        store = EtcdV3Store(self._require_conn(), f"{self.keys.store_prefix}{record.number}/", STORE_TIMEOUT)
        log.info("%sround %d complete in %.3f s: rank %d of %d, master %s:%d", self._ctx(), record.number,
                 self._clock() - began, rank, len(record.participants), record.master_addr, record.master_port)
        info = RendezvousInfo(store=store, rank=rank, world_size=len(record.participants),
                              bootstrap_store_info=RendezvousStoreInfo(record.master_addr, record.master_port))
        return info, record, rank

    # ================================================================== start-up
    def _require_conn(self) -> EtcdConnection:
        if self.connection is None:
            raise RendezvousStateError(f"{self._ctx()}handler is not connected")
        return self.connection

    def _ensure_connected(self) -> EtcdConnection:
        if self._released:
            raise RendezvousClosedError(f"{self._ctx()}this handler was shut down")
        with self._start_lock:
            if self.connection is None:
                self.connection = self._watch.connect()
                self._watch.start()
            return self.connection

    def register(self) -> None:
        """Connect and register this node (lease, node key, coordinator thread) without joining a round;
        idempotent. ``next_rendezvous`` does it first."""
        conn = self._ensure_connected()
        with self._start_lock:
            if self.registered:
                return
            self._ended_run.raise_if_finished(conn)
            if self._ended_run.clear(conn):  # the ended job's agents may have left a marker since
                self._ended_run.raise_if_finished(conn)
            self.peers.start()
            self.registration.register(conn)
            self.registered = True
            self.registration.keep(conn)
            self._coordinator.start()

    # ================================================================== teardown
    def _stop_threads(self) -> None:
        self._stop.set()
        self.registration.release_keeper()
        self._watch.cancel()
        with self._cond:
            self._cond.notify_all()
        for thread in (self._watch.thread, self._coordinator.thread, self.registration.renewer):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2.0)  # a stuck thread must not hold up a signal-driven leave()
        self._watch.release_mux()

    def _ctx(self) -> str:
        record = self._own.record
        number = record.number if record is not None else "-"
        return f"[run={self._config.run_id} node={self._node_id} round={number}] "

    def __repr__(self) -> str:
        return f"EtcdV3RendezvousHandler(run_id={self._config.run_id!r}, node_id={self._node_id!r}, round={self.round})"
