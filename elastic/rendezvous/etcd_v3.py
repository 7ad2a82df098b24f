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
    P/store/{round}/...        the agents' c10d store of that round (EtcdV3Store)
    P/finished                 only with ``finished_ttl``: the run finished successfully (JSON: by, time,
                               round), on a lease of ``finished_ttl`` s; a newcomer exits 0 at once

After a clean end (every agent's ``shutdown()``) nothing is left under ``P`` but the opt-in ``finished``
marker: the last agent to leave deletes the run's other keys (``_reap_ended_run``). A run id can be used again after its job ended (a Kubernetes
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
round closes as soon as every live node has joined: no last-call wait on recovery.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import grpc
from etcd3.etcdrpc import kv_pb2
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from .api import (
    BACKEND_NAME,
    EtcdRendezvousConfig,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousFinishedError,
    RendezvousOutageError,
    RendezvousStateError,
    RendezvousTimeoutError,
    RendezvousWatchError,
)
from .etcd_client import (
    ClientPool,
    EtcdConnection,
    WatchCanceledError,
    describe,
    is_auth_refusal,
    is_overloaded,
    is_token_expired,
    is_transient,
    overload_aware_wait,
    prefix_end,
)
from .lease_keeper import LeaseKeeper, refresh_interval
from .liveness import LivenessListener, Peer, PeerWatch, Verdict, peer_from_registration, probe_all
from .state import (
    Action,
    Decision,
    FollowerView,
    Proposal,
    Reform,
    RoundRecord,
    Snapshot,
    coordinate,
    decide,
    follow,
    membership,
    reform_of,
)
from .store import EtcdV3Store
from .watch_mux import WatchMux
from .worker_store import WorkerStoreHost, agent_hosts_store

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_TIMEOUT = timedelta(seconds=60)
"""Default timeout of the agents' store (torch's c10d backend uses 60 s too); barriers set their own."""

_SAFETY_RECHECK_S = 2.0
"""Longest a waiting loop sleeps without a mirror change; only a backstop, wake-ups come from the watch."""

ELECT_SPREAD_PER_NODE_S = 0.0005
"""Without a coordinator, a node waits a random delay of up to this many seconds per ``max_nodes`` (at most
``ELECT_SPREAD_MAX_S``) before it tries the election, and only tries when none won meanwhile: at 1,000 agents
that starting together, the first winner's key reaches most of them before their turn, instead of 1,000
election transactions (which, retried after a mass lease loss, kept an overloaded etcd answering "too many
requests"). Below 10 ms (max_nodes < 20) there is no wait."""

ELECT_SPREAD_MAX_S = 1.0


def election_spread(max_nodes: int) -> float:
    """The longest random wait before an election try (0: try at once)."""
    spread = min(ELECT_SPREAD_MAX_S, ELECT_SPREAD_PER_NODE_S * max_nodes)
    return spread if spread >= 0.01 else 0.0


def _is_lease_not_found(exc: BaseException | None) -> bool:
    return (
        isinstance(exc, grpc.RpcError)
        and hasattr(exc, "code")
        and exc.code() == grpc.StatusCode.NOT_FOUND
        and "lease not found" in (exc.details() or "")
    )


def watch_failure(exc: BaseException, context: str) -> RendezvousError:
    """The handler's fatal error once its watch gave up with ``exc``.

    A connection error caused by a transient one is ``EtcdConnection.call`` giving up on an etcd that stayed
    unreachable for its bound (the watch reloads and renews its token through it): an outage, as the lease
    thread would report it. Anything else (etcd refused the watch, an unexpected error) happened while etcd
    answered: a failed watch, after which ``shutdown`` still marks the job closed."""
    if isinstance(exc, RendezvousOutageError) or (
        isinstance(exc, RendezvousConnectionError) and exc.__cause__ is not None and is_transient(exc.__cause__)
    ):
        return RendezvousOutageError(f"{context}the etcd watch gave up: {exc}")
    return RendezvousWatchError(f"{context}the etcd watch failed: {exc}")


def describe_finished(value: bytes, config: EtcdRendezvousConfig) -> str:
    """The message of a newcomer that found the run's ``finished`` marker (``value``, JSON; any garbage
    still means finished: only a successful end writes the key)."""
    try:
        data = json.loads(value)
        by, when = str(data["by"]), float(data["time"])
        at = f" by node {by} at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(when))}"
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        at = ""
    return (f"run '{config.run_id}' already finished successfully{at}: nothing to do, exiting 0 (its marker "
            f"{config.run_prefix}finished lasts finished_ttl={config.finished_ttl} s after the end; to start a new "
            f"job before then, use another --rdzv-id)")


def unreachable_at_shutdown(*, connect_failed: bool, fatal: RendezvousError | None) -> bool:
    """True when ``shutdown`` must not try to mark the job closed: etcd was already unreachable for
    ``etcd_timeout`` (or never reached), so ``close_timeout`` more would only double the wait. A failed watch
    (``RendezvousWatchError``) or a corrupt key does not say etcd is away: closing is still tried."""
    return connect_failed or isinstance(fatal, RendezvousConnectionError)


def _default_node_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname().split(".")[0]) or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class _Mirror:
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


@dataclass(slots=True)
class _CoordinatorDuty:
    """What the coordinator thread remembers between its decisions (its own writes not yet mirrored)."""

    target: tuple[int, int] | None = None
    """(round to form, round-key revision) the deadlines below belong to."""
    last_call: float | None = None
    rejoin: float | None = None
    proposed: tuple[int, tuple[str, ...], int, int] | None = None
    """(round, participants, round-key revision, proposal revision) of our last proposal."""
    reform: Reform | None = None
    reason: str = ""
    elect_tried_at: int | None = None
    """Mirror revision when this node last tried to become the coordinator."""
    elect_after: float | None = None
    """When (clock) this node may try the election (``election_spread``); None: not drawn yet."""

    def reset(self) -> None:
        self.target = self.proposed = self.reform = self.elect_tried_at = None
        self.last_call = self.rejoin = self.elect_after = None


class _WatchTokenRenewed(WatchCanceledError):
    """etcd refused the watch for its auth token, which has been renewed: watch again at once."""


class EtcdV3RendezvousHandler(RendezvousHandler):
    """torch ``RendezvousHandler`` over etcd v3 (backend name ``etcd-v3``).

    Extra public API (beyond torch's interface):

    ``membership_changed() -> bool``
        Non-blocking. True when the round this node is in can no longer go on as is: a participant lost
        its lease (sticky until the next round), a participant re-joined, a newer round exists, or a
        waiting node would get a slot (round below ``max_nodes``). Same as ``num_nodes_waiting() > 0``
        once a round completed; False before the first round.
    ``wait_membership_change(timeout: float) -> bool``
        Blocks (event-driven) until ``membership_changed()`` is True (returns True), or ``timeout``
        seconds pass or the handler shuts down (returns False).
    ``leave() -> None``
        Revoke this node's lease and release resources WITHOUT closing the job: peers see the loss at
        once instead of after ``lease_ttl`` (for preemption notices). Idempotent.
    ``publish_notice(notice: dict) -> None`` / ``peer_notices() -> dict[str, dict]``
        Publish this node's preemption deadline to the group (a key under the node's lease, so it vanishes
        with the node) / the notices the other participants of this node's round published (no I/O).
    ``lost_peers() -> set[str]``
        Participants of this node's round whose registration vanished (crashed or left), no I/O.
    ``connect() -> None``
        Reach etcd and load the run's state without joining (bounded by ``etcd_timeout``); idempotent.
    ``node_id`` / ``round`` properties
        This agent's id (stable across rounds) / the number of the last round it completed (None before).

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
        self._node_id = node_id or _default_node_id()
        self._clock = clock
        self._pool = pool
        self._addr = config.local_addr or socket.getfqdn()
        self._worker_store = WorkerStoreHost(self._addr, enabled=agent_hosts_store())

        prefix = config.run_prefix
        self._ctl = prefix + "ctl/"
        self._nodes_prefix = self._ctl + "nodes/"
        self._join_prefix = self._ctl + "join/"
        self._round_key = self._ctl + "round"
        self._closed_key = self._ctl + "closed"
        self._notice_prefix = self._ctl + "notice/"
        self._post_prefix = self._ctl + "post/"
        self._coordinator_key = self._post_prefix + "coordinator"
        self._proposal_key = self._post_prefix + "proposal"
        self._reform_key = self._post_prefix + "reform"
        self._store_prefix = prefix + "store/"
        self._finished_key = prefix + "finished"

        self._cond = threading.Condition()
        self._mirror = _Mirror()
        self._lost: dict[int, set[str]] = {}
        """round number -> participants whose registration was deleted while that round was current."""
        self._finished: dict[int, set[str]] = {}
        """round number -> participants seen leaving after the job was closed (``lost_peers`` only)."""
        self._my_round: RoundRecord | None = None
        self._joining: int | None = None
        """Round this node has a join key for (re-written after a lease loss)."""

        self._conn: EtcdConnection | None = None
        self._lease_id: int | None = None
        self._seq: int | None = None
        self._registered = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_stream: Any = None
        self._fatal: RendezvousError | None = None
        self._unreachable_since: float | None = None
        self._released = False
        self._connect_failed = False
        self._watch_token_renewed = False
        """The watch was refused and the token renewed; a second refusal in a row is fatal."""
        self._clearing = False
        """A newcomer is clearing an ended run: it mirrors every key (``_clear_ended_run``)."""
        self._view_epoch = 0
        """Bumped (under the condition) when the wanted view changes from outside the watch thread."""
        self._start_lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._liveness: LivenessListener | None = None
        """Our liveness port (``liveness_probe``): held connections end the moment this process dies."""
        self._peer_watch: PeerWatch | None = None
        """Our connection to the next participant's liveness port (a ring over the round)."""
        self._keeper: LeaseKeeper | None = None
        """Refreshes our lease: our own, or the one the pool's handlers share (``lease_keeper.py``)."""
        self._renewer: threading.Thread | None = None
        """Re-registers after our lease was found gone (off the keeper's thread, which serves every lease)."""
        self._mux: WatchMux | None = None
        """With a pool: the watch its handlers share (``watch_mux.py``), held from connect to release."""
        self._mux_fatal: BaseException | None = None
        """The pool's shared watch (``watch_mux``) gave up with this error."""

    # ================================================================== torch interface
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
        record = self._my_round
        return record.number if record is not None else None

    @property
    def participants(self) -> tuple[str, ...]:
        record = self._my_round
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
        """Join the next round; block until it is committed with this node in it (see class doc).

        This node follows the coordinator's posts (``state.follow``): it writes its join key, waits for the
        round key, and commits the proposed round when the proposal makes it rank 0. Only at its join deadline
        does it read every key once and ask ``state.decide`` whether it timed out (or is a spare)."""
        self._ensure_registered()
        began = self._clock()
        join_deadline = began + self._config.join_timeout
        with self._cond:
            committed = self._mirror.committed
        target = (committed.number if committed else 0) + 1
        joined_target: tuple[int, int | None] | None = None  # (round, lease) of our last join write
        committed_mod: int | None = None  # round-key revision our last successful commit replaced
        checked_at: float | None = None
        previous: Action | None = None
        log.info("%sjoining round %d (min=%d max=%d)", self._ctx(), target, self._config.min_nodes, self._config.max_nodes)
        while True:
            with self._cond:
                self._raise_if_fatal()
                mirror = self._mirror
                view = FollowerView(
                    node_id=self._node_id,
                    target=target,
                    committed=mirror.committed,
                    closed=mirror.closed,
                    joined=joined_target == (target, self._lease_id),
                    proposal=mirror.proposal,
                    now=self._clock(),
                    join_deadline=join_deadline,
                    checked_at=checked_at,
                    recheck_s=_SAFETY_RECHECK_S,
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
                    self._cond.wait(self._wait_time(decision))
                    continue
                if action is Action.DONE:
                    info, record, rank = self._complete_round(began)
                    break
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
                    joined_target = (target, self._lease_id)
            elif action is Action.COMMIT:
                assert proposal is not None
                if self._commit(target, decision.participants, seen_mod, proposal.mod_revision, ring):
                    committed_mod = seen_mod
            elif action is Action.CHECK:
                checked_at = self._clock()
                if not self._check_deadline(target, join_deadline):
                    joined_target = None  # our join key is gone: write it again
        self._watch_ring_successor(record, rank)
        return info

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
            if self._mirror.full and self._mirror.loaded:
                return self._snapshot(self._mirror, target, join_deadline, None, None)
        conn = self._require_conn()
        resp = conn.call("read the rendezvous state", lambda: conn.client.get_prefix_response(self._ctl))
        mirror = _Mirror(revision=int(resp.header.revision), loaded=True, full=True)
        for kv in resp.kvs:
            self._apply_put(mirror, kv.key.decode(), kv.value, kv.mod_revision)
        with self._cond:
            self._raise_if_fatal()
            return self._snapshot(mirror, target, join_deadline, None, None)

    def is_closed(self) -> bool:
        if not self._released:  # after leave()/shutdown(): the last state seen, without I/O
            self._ensure_connected()
        with self._cond:
            self._raise_if_fatal()
            return self._mirror.closed

    def set_closed(self) -> None:
        """Mark the job's rendezvous closed (eventually seen by every node; next_rendezvous then raises)."""
        conn = self._ensure_connected()
        conn.call(
            "mark the rendezvous closed",
            lambda: conn.client.put(self._closed_key, json.dumps({"by": self._node_id, "time": time.time()})),
            within=self._config.close_timeout,
        )
        with self._cond:
            self._mirror.closed = True
            self._cond.notify_all()
        log.info("%sclosed the rendezvous", self._ctx())

    def num_nodes_waiting(self) -> int:
        """Nodes that would join a new round now (> 0 tells the running agent to re-rendezvous)."""
        if not self._released:
            self._ensure_connected()
        with self._cond:
            self._raise_if_fatal()
            return self._nodes_waiting_locked()

    def shutdown(self) -> bool:
        """torch semantics: close the rendezvous (the job is over), then release this node. Idempotent."""
        ok = closed_here = True
        if unreachable_at_shutdown(connect_failed=self._connect_failed, fatal=self._fatal):
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
        self._raise_if_run_finished(self._ensure_connected())

    def mark_finished(self) -> None:
        """Leave the ``finished`` marker for ``finished_ttl`` s (``FinishMarkingHandler``; no-op when 0): the run
        finished successfully. Called by every agent of the last round before ``shutdown``: the first one writes
        it, the others find it there (one lease, not one per agent). Each call is bounded by ``close_timeout``,
        and none is made when etcd is known to be away (as ``shutdown``)."""
        ttl = self._config.finished_ttl
        if ttl <= 0:
            return
        if unreachable_at_shutdown(connect_failed=self._connect_failed, fatal=self._fatal):
            raise RendezvousConnectionError(f"{self._ctx()}etcd at {self._config.endpoint_str} is unreachable")
        conn = self._ensure_connected()
        within = self._config.close_timeout
        existing, _ = conn.call("read the finished marker", lambda: conn.client.get(self._finished_key), within=within)
        if existing is not None:
            return  # another agent of the round wrote it first
        value = json.dumps({"by": self._node_id, "time": time.time(), "round": self.round})
        lease = conn.call("grant the finished marker's lease", lambda: conn.client.lease(ttl), within=within)
        tx = conn.client.transactions
        written, _ = conn.call(
            "write the finished marker",
            lambda: conn.client.transaction(compare=[tx.version(self._finished_key) == 0],
                                            success=[tx.put(self._finished_key, value, lease=lease.id)], failure=[]),
            within=within,
        )
        if written:
            log.info("%srun finished: marker %s kept for %d s (finished_ttl)", self._ctx(), self._finished_key, ttl)
            return
        try:  # another agent wrote it since we looked
            conn.call("revoke the unused lease", lambda: conn.client.revoke_lease(lease.id), within=min(2.0, within))
        except RendezvousError as exc:
            log.debug("%scould not revoke the unused lease %x (it expires in %d s): %s", self._ctx(), lease.id, ttl, exc)

    def membership_changed(self) -> bool:
        with self._cond:
            self._raise_if_fatal()
            return self._membership_changed_locked()

    def wait_membership_change(self, timeout: float) -> bool:
        deadline = self._clock() + max(0.0, timeout)
        with self._cond:
            while True:
                self._raise_if_fatal()
                if self._membership_changed_locked():
                    return True
                remaining = deadline - self._clock()
                if remaining <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(min(remaining, _SAFETY_RECHECK_S))

    def publish_notice(self, notice: dict[str, Any]) -> None:
        conn = self._ensure_connected()
        key = f"{self._ctl}notice/{self._node_id}"
        value = json.dumps({**notice, "node": self._node_id})
        self._with_live_lease(lambda: conn.call("publish a preemption notice", lambda: conn.client.put(key, value, lease=self._lease_id)))
        log.info("%spublished preemption notice %s", self._ctx(), value)

    def peer_notices(self) -> dict[str, dict[str, Any]]:
        with self._cond:
            mine = self._my_round
            peers = set(mine.participants) - {self._node_id} if mine is not None else set()
            return {node: dict(n) for node, n in self._mirror.notices.items() if node in peers}

    def lost_peers(self) -> set[str]:
        with self._cond:
            mine = self._my_round
            if mine is None:
                return set()
            lost = set(self._lost.get(mine.number, ())) | self._finished.get(mine.number, set())
            mirror = self._mirror
            if mirror.full:
                lost |= set(mine.participants) - set(mirror.nodes)
            elif mirror.reform is not None and mirror.reform.round == mine.number:
                lost |= set(mirror.reform.lost)
            return lost

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
            self._stop_liveness()  # after a silent ``_simulate_crash``: its port was left open until now
            return
        self._released = True
        with self._cond:
            reap = reap or self._mirror.closed
        self._stop_threads()
        self._stop_liveness()
        conn, lease = self._conn, self._lease_id
        if conn is not None and lease is not None:
            try:
                conn.call("revoke this node's lease", lambda: conn.client.revoke_lease(lease), within=min(2.0, self._config.etcd_timeout))
            except RendezvousError as exc:
                log.warning("%scould not revoke lease %x (it expires in <= %d s): %s", self._ctx(), lease, self._config.lease_ttl, exc)
        if conn is not None and reap:
            self._reap_ended_run(conn)
        if conn is not None:
            conn.close()
        log.info("%sleft the rendezvous", self._ctx())

    def _reap_ended_run(self, conn: EtcdConnection) -> None:
        """The last agent of an ended job to leave deletes every key of the run (closed marker, last round,
        stores), in one transaction that compares that the run is still closed and that no node is registered.

        Why delete rather than keep ``ctl/closed`` as a tombstone for late agents: once no agent of the
        ended job is registered, a newcomer that finds the closed marker clears it and starts a new job anyway
        (run-id reuse, ``_clear_ended_run``), so the marker would protect nobody and only leave keys behind.
        While another agent is still registered (in its exit barrier, or a spare about to see the job closed)
        the compare fails and nothing is deleted: that agent's own shutdown runs this again, and the last one
        wins. Once a newcomer has cleared the run for a new job there is no closed key: nothing is deleted.
        Left behind only when the last agent cannot reach etcd, or an agent crashed within ``lease_ttl`` of
        the end (its key outlives the others): a newcomer with the run id clears those keys as before."""
        prefix = self._config.run_prefix
        try:
            ok = self._delete_ended_run(conn, None, within=min(2.0, self._config.etcd_timeout))
        except RendezvousError as exc:
            log.warning("%scould not delete the ended run's keys (the next job with this run id will): %s", self._ctx(), exc)
            return
        if ok:
            log.info("%slast agent of the ended job: deleted the run's keys under %s", self._ctx(), prefix)
        else:
            log.info("%sother agents of the ended job are still registered: the last to leave deletes its keys", self._ctx())

    # ================================================================== liveness (liveness.py)
    def _start_liveness(self) -> None:
        if not self._config.liveness_probe or self._liveness is not None:
            return
        try:
            self._liveness = LivenessListener(max_held=4 * self._config.max_nodes + 16)
        except OSError as exc:  # no port to listen on: the lease alone tells of this node's death
            log.warning("%sno liveness port (%s): peers learn of this node's death from its lease only", self._ctx(), exc)
            return
        self._peer_watch = PeerWatch(self._revoke_dead_peer)

    def _stop_liveness(self) -> None:
        watch, listener = self._peer_watch, self._liveness
        self._peer_watch = self._liveness = None
        if watch is not None:
            watch.close()
        if listener is not None:
            listener.close()

    def _watch_ring_successor(self, record: RoundRecord, rank: int) -> None:
        """Hold a connection to the next participant's liveness port (the last one watches the first): from the
        round record's ``ring`` when it has the successor, else from its registration (one read)."""
        watch = self._peer_watch
        if watch is None:
            return
        successor = record.participants[(rank + 1) % len(record.participants)]
        if successor == self._node_id:
            watch.watch(None)
            return
        with self._cond:
            peer = self._ring_peer(successor, self._mirror.round_ring) if self._mirror.committed == record else None
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
            if self._mirror.full and self._mirror.loaded:
                return self._mirror.peers.get(node)
        conn = self._conn
        if conn is None:
            return None
        try:
            value, meta = conn.call(f"read {node}'s registration", lambda: conn.client.get(self._nodes_prefix + node),
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
            if self._mirror.full and self._mirror.loaded:
                return [self._mirror.peers[n] for n in nodes if n in self._mirror.peers]
        conn = self._require_conn()
        resp = conn.call("read the registrations", lambda: conn.client.get_prefix_response(self._nodes_prefix),
                         within=min(5.0, self._config.etcd_timeout))
        wanted = set(nodes)
        found = {kv.key.decode()[len(self._nodes_prefix):]: (kv.value, int(kv.lease)) for kv in resp.kvs}
        return [p for n, (v, lease) in found.items() if n in wanted and (p := self._peer_of(n, v, lease)) is not None]

    def _revoke_dead_peer(self, peer: Peer) -> bool:
        """``peer``'s process is gone (its liveness port refuses): revoke its lease so that every agent's watch
        sees its registration go now, not after ``lease_ttl``. Only the lease it is registered with now (a
        peer that re-registered since is someone we know nothing bad about)."""
        with self._cond:
            closed = self._mirror.closed
        current = self._current_peer(peer.node)
        conn = self._conn
        if current is None or current.lease != peer.lease or conn is None or self._released:
            return False
        if closed:  # the job ended: a peer that exits is one that finished (its shutdown revokes its own lease)
            log.debug("%speer %s exited after the job was closed", self._ctx(), peer.node)
            return False
        try:
            conn.call("revoke a dead peer's lease", lambda: conn.client.revoke_lease(peer.lease), within=2.0)
        except RendezvousError as exc:
            if _is_lease_not_found(exc.__cause__):  # it went on its own meanwhile (revoked or expired)
                log.debug("%speer %s's lease was already gone", self._ctx(), peer.node)
                return False
            log.warning("%scould not revoke the lease of dead peer %s (it expires in <= %d s): %s", self._ctx(),
                        peer.node, self._config.lease_ttl, exc)
            return False
        log.warning("%speer %s's agent process is gone (its liveness port %s:%d refuses connections): revoked its "
                    "lease", self._ctx(), peer.node, peer.addr, peer.port)
        return True

    def probe_peers(self) -> set[str]:
        """Probe every other participant of this node's round now (a worker failed: a dead peer would explain
        it) and revoke the lease of each whose process is gone; returns those nodes. Silent peers (a partition,
        a powered-off host) are left to their lease. One read of the registrations unless this node coordinates
        (then none), and a revoke per dead peer."""
        mine = self._my_round
        watch = self._peer_watch
        if mine is None or self._released or not self._config.liveness_probe or watch is None:
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

    # ================================================================== test hooks
    def _simulate_crash(self, *, silent: bool = False) -> None:
        """Test hook: vanish like a SIGKILLed agent (no revoke of its own: the lease expires after lease_ttl,
        unless a peer's probe of its closed liveness port revokes it first). ``silent``: like a host that lost
        power or its network instead, its liveness port neither refuses nor ends connections (a probe proves
        nothing): only the lease tells; ``leave()`` closes the port later."""
        self._released = True
        self._stop_threads()
        if not silent:
            self._stop_liveness()
        if self._conn is not None:
            self._conn.close()

    # ================================================================== snapshot / decisions
    def _snapshot(
        self, mirror: _Mirror, target: int, join_deadline: float, last_call: float | None, rejoin: float | None
    ) -> Snapshot:
        """``mirror`` (a full one) as ``decide``/``coordinate`` see it."""
        committed = mirror.committed
        pending = (committed.number if committed else 0) + 1
        return Snapshot(
            node_id=self._node_id,
            target=target,
            committed=committed,
            live=frozenset(mirror.nodes),
            joined=dict(mirror.joins.get(pending, {})),
            closed=mirror.closed,
            min_nodes=self._config.min_nodes,
            max_nodes=self._config.max_nodes,
            now=self._clock(),
            join_deadline=join_deadline,
            last_call_deadline=last_call,
            rejoin_deadline=rejoin,
        )

    def _wait_time(self, decision: Decision) -> float:
        if decision.wake_at is None:
            return _SAFETY_RECHECK_S
        return max(0.0, min(decision.wake_at - self._clock(), _SAFETY_RECHECK_S))

    def _nodes_waiting_locked(self) -> int:
        """From the full mirror (the coordinator), else from the coordinator's reform post."""
        mirror = self._mirror
        committed = mirror.committed
        if committed is None:
            return len(mirror.joins.get(1, {}))
        if mirror.full:
            m = membership(committed, mirror.nodes, mirror.joins.get(committed.number + 1, {}), self._config.max_nodes)
            waiting = m.nodes_waiting
        else:
            reform = mirror.reform
            waiting = reform.waiting if reform is not None and reform.round == committed.number else 0
        waiting = max(waiting, len(self._lost.get(committed.number, ())))
        mine = self._my_round
        if mine is not None and mine.number < committed.number:
            waiting = max(waiting, 1)  # a newer round formed without us: we must re-rendezvous
        return waiting

    def _membership_changed_locked(self) -> bool:
        return self._my_round is not None and self._nodes_waiting_locked() > 0

    def _complete_round(self, began: float) -> tuple[RendezvousInfo, RoundRecord, int]:
        record = self._mirror.committed
        assert record is not None
        rank = record.rank_of(self._node_id)
        assert rank is not None
        self._my_round = record
        self._joining = None
        self._worker_store.round_completed(record.number, record.master_port, rank)
        store = EtcdV3Store(self._require_conn(), f"{self._store_prefix}{record.number}/", STORE_TIMEOUT)
        log.info(
            "%sround %d complete in %.3f s: rank %d of %d, master %s:%d",
            self._ctx(),
            record.number,
            self._clock() - began,
            rank,
            len(record.participants),
            record.master_addr,
            record.master_port,
        )
        info = RendezvousInfo(
            store=store,
            rank=rank,
            world_size=len(record.participants),
            bootstrap_store_info=RendezvousStoreInfo(record.master_addr, record.master_port),
        )
        return info, record, rank

    # ================================================================== writes
    def _write_join(self, target: int, seen_mod: int) -> bool:
        """Put our join key for ``target`` unless the round key moved since our snapshot."""
        conn = self._require_conn()
        tx = conn.client.transactions
        key = f"{self._join_prefix}{target}/{self._node_id}"
        value = json.dumps({"seq": self._seq, "addr": self._addr})
        with self._cond:
            self._joining = target

        def put_join() -> bool:
            lease = self._lease_id
            ok, _ = conn.call(
                f"join round {target}",
                lambda: conn.client.transaction(
                    compare=[tx.mod(self._round_key) == seen_mod], success=[tx.put(key, value, lease=lease)], failure=[]
                ),
            )
            return bool(ok)

        return self._with_live_lease(put_join)

    def _with_live_lease(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which writes under our lease); if etcd says the lease is gone, re-register and rerun."""

        def attempt() -> T:
            lease = self._lease_id
            try:
                return fn()
            except RendezvousConnectionError as exc:
                if _is_lease_not_found(exc.__cause__):
                    log.warning("%slease %x is gone (expired or revoked); re-registering", self._ctx(), lease or 0)
                    self._renew_lease(lease)
                raise

        retrying = Retrying(
            stop=stop_after_attempt(4),
            retry=retry_if_exception(lambda exc: isinstance(exc, RendezvousConnectionError) and _is_lease_not_found(exc.__cause__)),
            reraise=True,
        )
        return retrying(attempt)

    def _renew_lease(self, stale_lease: int | None) -> None:
        """Re-register unless another thread already replaced ``stale_lease``."""
        with self._lease_lock:
            if self._lease_id == stale_lease:
                self._register(self._require_conn())

    def _commit(self, target: int, participants: tuple[str, ...], seen_mod: int, proposal_mod: int,
                ring: dict[str, Any] | None = None) -> bool:
        """Commit the coordinator's proposal (of revision ``proposal_mod``) as round ``target``; this node is its
        rank 0 and hosts the workers' store. False when the round key, the proposal or the closed key moved."""
        conn = self._require_conn()
        tx = conn.client.transactions
        record = {
            "number": target,
            "participants": list(participants),
            "master_addr": self._addr,
            "master_port": self._worker_store.port_for(target),
            "committed_by": self._node_id,
            "time": time.time(),
        }
        if ring:  # add-only field: an older agent ignores it and reads its successor's registration
            record["ring"] = {node: ring[node] for node in participants if node in ring}
        join_dir = f"{self._join_prefix}{target}/"
        # (Not compared: that each participant's join key still exists. etcd caps a txn at 128 ops, and a
        # participant that died since our snapshot is caught by the watch right after: the round breaks.)
        compare = [tx.mod(self._round_key) == seen_mod, tx.version(self._closed_key) == 0,
                   tx.mod(self._proposal_key) == proposal_mod]
        success = [
            tx.put(self._round_key, json.dumps(record)),
            tx.delete(join_dir, range_end=prefix_end(join_dir)),
            tx.delete(self._proposal_key),
        ]
        if target > 2:
            old_store = f"{self._store_prefix}{target - 2}/"
            success.append(tx.delete(old_store, range_end=prefix_end(old_store)))
        ok, _ = conn.call(
            f"commit round {target}", lambda: conn.client.transaction(compare=compare, success=success, failure=[])
        )
        if ok:
            log.info("%scommitted round %d with %d nodes: %s", self._ctx(), target, len(participants), ", ".join(participants))
        else:
            log.info("%scommit of round %d lost a race (state moved); re-deciding", self._ctx(), target)
        return bool(ok)

    # ================================================================== start-up
    def _require_conn(self) -> EtcdConnection:
        if self._conn is None:
            raise RendezvousStateError(f"{self._ctx()}handler is not connected")
        return self._conn

    def _ensure_connected(self) -> EtcdConnection:
        if self._released:
            raise RendezvousClosedError(f"{self._ctx()}this handler was shut down")
        with self._start_lock:
            if self._conn is None:
                try:
                    conn = EtcdConnection(self._config, context=self._ctx, pool=self._pool)
                except RendezvousConnectionError:
                    self._connect_failed = True
                    raise
                try:
                    if self._pool is None:
                        self._load(conn)
                    else:
                        self._load_shared()
                except BaseException as exc:
                    self._connect_failed = isinstance(exc, RendezvousConnectionError)
                    self._release_mux()
                    conn.close()
                    raise
                self._conn = conn
                watcher = threading.Thread(target=self._watch_loop, name=f"rdzv-watch-{self._node_id}", daemon=True)
                watcher.start()
                self._threads.append(watcher)
            return self._conn

    def _ensure_registered(self) -> None:
        conn = self._ensure_connected()
        with self._start_lock:
            if self._registered:
                return
            self._raise_if_run_finished(conn)
            if self._clear_ended_run(conn):  # the ended job's agents may have left a marker since
                self._raise_if_run_finished(conn)
            self._start_liveness()
            self._register(conn)
            self._registered = True
            self._keeper = self._acquire_keeper(conn)
            self._keeper.add(self)
            coordinator = threading.Thread(target=self._coordinate_loop, name=f"rdzv-coord-{self._node_id}", daemon=True)
            coordinator.start()
            self._threads.append(coordinator)

    def _raise_if_run_finished(self, conn: EtcdConnection) -> None:
        """``RendezvousFinishedError`` when ``finished_ttl`` is on and the run's ``finished`` marker exists."""
        if self._config.finished_ttl <= 0:
            return
        value, _meta = conn.call("read the finished marker", lambda: conn.client.get(self._finished_key))
        if value is None:
            return
        raise RendezvousFinishedError(f"{self._ctx()}{describe_finished(value, self._config)}")

    def _clear_ended_run(self, conn: EtcdConnection) -> bool:
        """If this run id's previous job ended (closed), wait for its agents to leave and clear its keys;
        True when it found the run closed.

        Gives up waiting at join_timeout; ``next_rendezvous`` then reports the run as closed. Mirrors every key
        meanwhile (it counts the registered nodes)."""
        with self._cond:
            if not self._mirror.closed:
                return False
            self._clearing = True
        self._change_view()
        try:
            return self._clear_ended_run_watching_all(conn)
        finally:
            with self._cond:
                self._clearing = False
            self._change_view()

    def _clear_ended_run_watching_all(self, conn: EtcdConnection) -> bool:
        deadline = self._clock() + self._config.join_timeout
        self._wait_mirror(lambda m: m.full, deadline)
        announced = found_closed = False
        while True:
            with self._cond:
                self._raise_if_fatal()
                mirror = self._mirror
                if not mirror.closed:
                    return found_closed
                found_closed = True
                closed_mod, live, seen = mirror.closed_mod, len(mirror.nodes), mirror.revision
                if live:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        return True
                    if not announced:
                        log.info("%srun id reused: waiting for %d agent(s) of the ended job to leave", self._ctx(), live)
                        announced = True
                    self._cond.wait(min(remaining, _SAFETY_RECHECK_S))
                    continue
            if self._delete_ended_run(conn, closed_mod):
                log.info("%srun id reused: cleared the keys of the ended job", self._ctx())
                self._wait_mirror(lambda m: not m.closed, deadline)  # the deletes arrive in one watch response
            else:  # another newcomer cleared it, or a node registered: wait for that change, then look again
                self._wait_revision_after(seen, deadline)

    def _delete_ended_run(self, conn: EtcdConnection, closed_mod: int | None, *, within: float | None = None) -> bool:
        """Delete every key of the run but its ``finished`` marker (which expires on its own lease) in one
        transaction, if it is still closed (by the marker of revision ``closed_mod``; None: any) and no node
        is registered. False when the compare failed."""
        tx = conn.client.transactions
        prefix = self._config.run_prefix
        closed = tx.version(self._closed_key) > 0 if closed_mod is None else tx.mod(self._closed_key) == closed_mod
        compare = [closed, tx.version(self._nodes_prefix, range_end=prefix_end(self._nodes_prefix)) == 0]
        after_marker = self._finished_key + "\0"  # the first key after it
        success = [tx.delete(prefix, range_end=self._finished_key),
                   tx.delete(after_marker, range_end=prefix_end(prefix))]
        ok, _ = conn.call(
            "delete the ended run's keys",
            lambda: conn.client.transaction(compare=compare, success=success, failure=[]),
            within=within,
        )
        return bool(ok)

    def _wait_revision_after(self, revision: int, deadline: float) -> None:
        self._wait_mirror(lambda m: m.revision > revision, deadline)

    def _wait_mirror(self, ready: Callable[[_Mirror], bool], deadline: float) -> None:
        """Block until the watch delivered a state with ``ready(mirror)`` (or ``deadline`` passed)."""
        with self._cond:
            while not ready(self._mirror):
                self._raise_if_fatal()
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return
                self._cond.wait(min(remaining, _SAFETY_RECHECK_S))

    def _register(self, conn: EtcdConnection) -> None:
        """Grant a lease and write our node key under it (again after an expiry; ``seq`` is kept).

        Under heavy load the fresh lease itself can expire before we use it: then start over.
        """
        retrying = Retrying(
            stop=stop_after_attempt(3),
            retry=retry_if_exception(lambda exc: isinstance(exc, RendezvousConnectionError) and _is_lease_not_found(exc.__cause__)),
            reraise=True,
        )
        retrying(self._register_once, conn)

    def _register_once(self, conn: EtcdConnection) -> None:
        lease = conn.call("grant a lease", lambda: conn.client.lease(self._config.lease_ttl))
        registration: dict[str, Any] = {"node_id": self._node_id, "host": socket.gethostname(), "addr": self._addr,
                                        "pid": os.getpid(), "seq": self._seq}
        if self._liveness is not None:
            registration.update(live_port=self._liveness.port, lease=lease.id)
        value = json.dumps(registration)
        resp = conn.call("register this node", lambda: conn.client.put(self._nodes_prefix + self._node_id, value, lease=lease.id))
        with self._cond:
            self._lease_id = lease.id
            if self._seq is None:
                self._seq = int(resp.header.revision)
            joining = self._joining
        if joining is not None:  # keep our place in the round being formed
            conn.call(
                f"re-join round {joining}",
                lambda: conn.client.put(
                    f"{self._join_prefix}{joining}/{self._node_id}",
                    json.dumps({"seq": self._seq, "addr": self._addr}),
                    lease=lease.id,
                ),
            )
        log.info("%sregistered (lease %x, ttl %d s)", self._ctx(), lease.id, self._config.lease_ttl)

    # ================================================================== mirror maintenance
    def _watched_ranges(self, full: bool) -> list[tuple[str, bytes | None]]:
        """The key ranges the mirror follows: all of ``P/ctl/`` (full view), else the closed key and
        ``[notice/, round]``, which holds the notices, the coordinator's posts and the round key, not the
        registrations or joins (``ctl/nodes/`` sorts before ``ctl/notice/``)."""
        if full:
            return [(self._ctl, prefix_end(self._ctl))]
        return [(self._closed_key, None), (self._notice_prefix, (self._round_key + "\0").encode())]

    def _want_full(self) -> bool:
        """Whether this node should mirror every key now (called under the condition)."""
        coordinator = self._mirror.coordinator
        leading = coordinator is not None and coordinator == (self._node_id, self._lease_id)
        return leading or self._clearing

    @staticmethod
    def _read_range(conn: EtcdConnection, key: str, range_end: bytes | None) -> Any:
        if range_end is None:
            return conn.client.get_response(key)
        return conn.client.get_range_response(key, range_end)

    def _load(self, conn: EtcdConnection, full: bool = False) -> None:
        """Read the watched ranges (start, a change of view, or after the watch fell behind a compaction)."""
        mirror = _Mirror(loaded=True, full=full)
        for key, range_end in self._watched_ranges(full):
            resp = conn.call("read the rendezvous state", functools.partial(self._read_range, conn, key, range_end))
            revision = int(resp.header.revision)
            mirror.watch_revs.append(revision)
            mirror.revision = max(mirror.revision, revision)
            for kv in resp.kvs:
                self._apply_put(mirror, kv.key.decode(), kv.value, kv.mod_revision, kv.lease)
        with self._cond:
            self._mirror = mirror
            self._cond.notify_all()

    def _apply_put(self, mirror: _Mirror, key: str, value: bytes, mod_revision: int, lease: int = 0) -> None:
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
            self._fatal = RendezvousStateError(f"{self._ctx()}corrupt rendezvous key {key!r} in etcd: {exc}")

    def _apply_delete(self, mirror: _Mirror, key: str) -> None:
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
        elif rel.startswith("notice/"):
            node = rel[len("notice/") :]
            committed = mirror.committed
            # The notice goes with its node's lease. A participant of the current round that left for it keeps
            # it here until the next round: a node leaving for its notice revokes its lease ~10 ms after its
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

    def _participant_left(self, mirror: _Mirror, committed: RoundRecord, node: str) -> None:
        """A participant of the committed round is gone. After the job was closed (every agent that closes it
        passed the exit barrier or gave up) it finished: not a loss, nothing to re-form for. Otherwise the
        round is broken (``membership_changed``), whether it left for its preemption notice or crashed."""
        if mirror.closed:
            self._finished.setdefault(committed.number, set()).add(node)
            log.info("%sparticipant %s of round %d finished and left", self._ctx(), node, committed.number)
            return
        if node in self._lost.get(committed.number, ()):
            return  # known already (a follower hears of a loss from the coordinator key and the reform post)
        self._lost.setdefault(committed.number, set()).add(node)
        if node in mirror.notices:
            log.info("%sparticipant %s of round %d left for its preemption notice", self._ctx(), node,
                     committed.number)
        else:
            log.warning("%sparticipant %s of round %d lost its lease", self._ctx(), node, committed.number)

    def _sleep_unless_stopped(self, seconds: float) -> None:
        """The watch loop's retry backoff: cut short by shutdown."""
        self._stop.wait(seconds)

    def _watch_loop(self) -> None:
        retrying = Retrying(
            stop=lambda _state: self._stop.is_set(),
            wait=overload_aware_wait(wait_random_exponential(multiplier=0.05, max=1.0)),
            retry=retry_if_exception(lambda exc: not self._stop.is_set() and (is_transient(exc) or isinstance(exc, WatchCanceledError))),
            sleep=self._sleep_unless_stopped,
            reraise=True,
        )
        try:
            retrying(self._watch_once)
        except Exception as exc:  # the thread must report, not die silently
            if not self._stop.is_set():
                # Our own errors carry a clear message; an unexpected one (a bug) keeps its traceback.
                log.error("%sthe rendezvous watch failed: %s", self._ctx(), exc, exc_info=not isinstance(exc, RendezvousError))
                with self._cond:
                    if self._fatal is None:  # the first cause (an outage the lease thread measured) explains the rest
                        self._fatal = watch_failure(exc, self._ctx())
                    self._cond.notify_all()

    def _watch_once(self) -> None:
        """Load the view this node wants and follow it; when the wanted view changes (this node became or
        stopped being the coordinator, or clears an ended run), load the other view and follow that."""
        while not self._stop.is_set():
            if not self._follow_view():
                return

    def _follow_view(self) -> bool:
        """One watch stream over the wanted view; True when it ended because the wanted view changed."""
        conn = self._require_conn()
        stream = None
        with self._cond:
            shared = self._pool is not None and not self._want_full()
        if shared:
            return self._follow_shared()
        try:
            with self._cond:
                full = self._want_full()
                needs_load = not self._mirror.loaded or self._mirror.full != full
                epoch = self._view_epoch
            if needs_load:
                self._load(conn, full)
            with self._cond:
                starts = [rev + 1 for rev in self._mirror.watch_revs]
            ranges = self._watched_ranges(full)
            stream = conn.watch_ranges([(key, end, start) for (key, end), start in zip(ranges, starts, strict=True)])
            self._watch_stream = stream
            if self._stop.is_set() or self._view_epoch != epoch:
                stream.cancel()
                return not self._stop.is_set()
            for response in stream:
                if response.canceled and is_auth_refusal(response.cancel_reason):
                    self._renew_token_for_watch(conn, response.cancel_reason)
                    raise _WatchTokenRenewed(response.cancel_reason)
                self._watch_token_renewed = False  # a fresh token got the watch through
                self._note_etcd_ok()
                if response.compact_revision:
                    with self._cond:
                        self._mirror.loaded = False  # resync on the next attempt
                    raise WatchCanceledError(f"watch fell behind compaction at {response.compact_revision}")
                if response.canceled:
                    raise WatchCanceledError(f"watch canceled by etcd: {response.cancel_reason}")
                if response.events:
                    self._apply_events(response.events, int(response.watch_id))
                with self._cond:
                    if self._want_full() != full:
                        stream.cancel()
                        return True
        except RendezvousConnectionError:
            raise
        except Exception as exc:
            if self._stop.is_set():
                return False
            with self._cond:
                if self._view_epoch != epoch or self._want_full() != full:
                    return True  # canceled from outside for a change of view
            if isinstance(exc, _WatchTokenRenewed):
                raise
            if is_token_expired(exc):
                self._renew_token_for_watch(conn, describe(exc))
                raise _WatchTokenRenewed(describe(exc)) from exc
            if not is_overloaded(exc):  # "too many requests": a busy etcd answered, backed off from, no outage
                self._note_etcd_failure(exc)
            raise
        if not self._stop.is_set():
            raise WatchCanceledError("watch stream ended")
        return False

    # ------------------------------------------------------------------ the pool's shared watch (watch_mux.py)
    def _follow_shared(self) -> bool:
        """Follow the followers' view through the watch every handler of the pool shares (one stream per
        process instead of one per handler); True when it ended because the wanted view changed.

        CHANGE (vs one stream per handler): only with a ``ClientPool``, i.e. many agents in one process (the
        bench, tests); a real agent (no pool) keeps its own stream."""
        mux = self._mux
        assert mux is not None  # held from connect to release
        with self._cond:
            epoch = self._view_epoch
        mux.subscribe(self)  # never under our condition: the mux's callbacks take it
        try:
            with self._cond:
                while True:
                    if self._stop.is_set():
                        return False
                    fatal = self._mux_fatal
                    if isinstance(fatal, RendezvousError):  # a copy: every handler of the pool raises it
                        raise type(fatal)(str(fatal)) from fatal
                    if fatal is not None:
                        raise RendezvousWatchError(f"the shared etcd watch failed: {describe(fatal)}") from fatal
                    if self._view_epoch != epoch or self._want_full():
                        return True
                    self._cond.wait(_SAFETY_RECHECK_S)
        finally:
            mux.unsubscribe(self)

    def _load_shared(self) -> None:
        """``_load`` from the pool's shared watch: its keys, without a read of our own (bounded by etcd_timeout)."""
        self._mux = mux = self._acquire_mux()
        try:
            state = mux.state(self._config.etcd_timeout)
        except RendezvousError:
            raise
        except Exception as exc:
            raise RendezvousWatchError(f"{self._ctx()}the shared etcd watch failed: {describe(exc)}") from exc
        if state is None:
            raise RendezvousConnectionError(
                f"{self._ctx()}etcd at {self._config.endpoint_str} unreachable for {self._config.etcd_timeout:.0f} s "
                f"while trying to read the rendezvous state (shared watch)")
        self.watch_reset(*state)

    def _mux_key(self) -> tuple[Any, ...]:
        return ("watch-mux", *ClientPool.key(self._config), self._config.run_prefix)

    def _acquire_mux(self) -> WatchMux:
        pool, config = self._pool, self._config
        assert pool is not None
        ranges = self._watched_ranges(False)
        return pool.acquire_shared(self._mux_key(), lambda: WatchMux(
            EtcdConnection(config, pool=pool), ranges, name=f"rdzv-watch-mux-{config.run_id}"))

    def _release_mux(self) -> None:
        mux, self._mux = self._mux, None
        if mux is None or self._pool is None:
            return
        mux.unsubscribe(self)
        last = self._pool.release_shared(self._mux_key())
        if last is not None:
            last.close()
            last.connection.close()

    # WatchSubscriber (watch_mux.py), called from the mux's thread under its lock: never block here.
    def watch_reset(self, kvs: Any, revisions: Any) -> None:
        mirror = _Mirror(loaded=True, full=False)
        for range_kvs, revision in zip(kvs, revisions, strict=True):
            mirror.watch_revs.append(int(revision))
            mirror.revision = max(mirror.revision, int(revision))
            for kv in range_kvs:
                self._apply_put(mirror, kv.key.decode(), kv.value, kv.mod_revision, kv.lease)
        with self._cond:
            self._mirror = mirror
            self._cond.notify_all()
        self._note_etcd_ok()

    def watch_events(self, events: Any, watch_id: int) -> None:
        self._apply_events(events, watch_id)
        self._note_etcd_ok()

    def watch_failed(self, exc: BaseException) -> None:
        if not self._stop.is_set():
            self._note_etcd_failure(exc)

    def watch_fatal(self, exc: BaseException) -> None:
        with self._cond:
            self._mux_fatal = exc
            self._cond.notify_all()

    def _change_view(self) -> None:
        """The wanted view changed outside the watch thread: make it reload (call after the change)."""
        with self._cond:
            self._view_epoch += 1
            self._cond.notify_all()  # a follower on the shared watch waits on the condition, not a stream
        stream = self._watch_stream
        if stream is not None:
            stream.cancel()

    def _renew_token_for_watch(self, conn: EtcdConnection, reason: str) -> None:
        """etcd refused the watch for its token (after a restart it says "permission denied"): renew once;
        refused again with a fresh token, the user really lacks the permission and the job cannot go on."""
        if self._watch_token_renewed:
            raise RendezvousConnectionError(
                f"{self._ctx()}etcd refuses to let user {self._config.user!r} watch {self._ctl!r} ({reason}), "
                f"even with a fresh token: grant its role readwrite on the prefix {self._config.etcd_prefix!r}/"
            )
        conn.call("renew the auth token", conn.renew_token)
        self._watch_token_renewed = True

    def _apply_events(self, events: Any, watch_id: int) -> None:
        with self._cond:
            mirror = self._mirror
            for ev in events:
                key = ev.kv.key.decode()
                if ev.type == kv_pb2.Event.PUT:
                    self._apply_put(mirror, key, ev.kv.value, ev.kv.mod_revision, ev.kv.lease)
                else:
                    self._apply_delete(mirror, key)
                mirror.revision = max(mirror.revision, int(ev.kv.mod_revision))
                if 0 <= watch_id < len(mirror.watch_revs):
                    mirror.watch_revs[watch_id] = max(mirror.watch_revs[watch_id], int(ev.kv.mod_revision))
            self._cond.notify_all()

    # ================================================================== coordination
    def _coordinate_loop(self) -> None:
        """While no node coordinates, try to; while this node does, post proposals and reform notices.

        The coordinator mirrors every key (``_want_full``); everything else it learns is posted as one key
        each node watches, so a round costs O(N) watch events instead of every join reaching every node."""
        duty = _CoordinatorDuty()
        while not self._stop.is_set():
            try:
                step = self._coordinator_step(duty)
                if step is not None:
                    step()
            except RendezvousError as exc:
                if self._stop.is_set():
                    return
                # A lease that just ended (the lease thread re-registers) is no news; anything else is.
                level = logging.INFO if _is_lease_not_found(exc.__cause__) else logging.WARNING
                log.log(level, "%scoordinator: %s; trying again", self._ctx(), exc)
                duty.reset()
                self._stop.wait(0.5)
            except Exception:  # a bug: say so, do not die silently; the followers' deadline checks still work
                log.exception("%scoordinator step failed", self._ctx())
                duty.reset()
                self._stop.wait(_SAFETY_RECHECK_S)

    def _coordinator_step(self, duty: _CoordinatorDuty) -> Callable[[], None] | None:
        """Decide under the lock what the coordinator role asks for now; return the I/O to do (or wait)."""
        with self._cond:
            if self._stop.is_set():
                return None
            if self._fatal is not None:
                self._cond.wait(_SAFETY_RECHECK_S)
                return None
            mirror, lease = self._mirror, self._lease_id
            if not mirror.loaded or mirror.closed or lease is None or self._released:
                self._cond.wait(_SAFETY_RECHECK_S)
                return None
            if mirror.coordinator is None:
                if duty.elect_tried_at == mirror.revision:  # our try's outcome is not in the mirror yet
                    self._cond.wait(_SAFETY_RECHECK_S)
                    if self._mirror.revision == duty.elect_tried_at:
                        duty.elect_tried_at = None  # nothing came: try again
                    return None
                renewer = self._renewer
                if renewer is not None and renewer.is_alive():  # our lease is being replaced: elect on the new one
                    self._cond.wait(_SAFETY_RECHECK_S)
                    return None
                now = self._clock()
                if duty.elect_after is None:
                    duty.elect_after = now + random.uniform(0.0, election_spread(self._config.max_nodes))
                if now < duty.elect_after:
                    self._cond.wait(duty.elect_after - now)  # a winner's key wakes us (and we do not try)
                    return None
                duty.elect_after = None
                duty.elect_tried_at = mirror.revision
                return lambda: self._elect(lease)
            if mirror.coordinator != (self._node_id, lease) or not mirror.full:
                duty.reset()
                self._cond.wait(_SAFETY_RECHECK_S)
                return None
            committed = mirror.committed
            reform = reform_of(committed, mirror.nodes, mirror.joins.get(committed.number + 1, {}) if committed else (),
                               self._lost.get(committed.number, ()) if committed else (), self._config.max_nodes,
                               mirror.closed)
            posted = duty.reform if duty.reform is not None else mirror.reform
            if reform is not None and reform.news_after(posted):
                duty.reform = reform
                return lambda: self._post_reform(reform)
            target = (committed.number if committed else 0) + 1
            if duty.target != (target, mirror.committed_mod):
                duty.target, duty.last_call, duty.rejoin = (target, mirror.committed_mod), None, None
            snap = self._snapshot(mirror, target, float("inf"), duty.last_call, duty.rejoin)
            decision = coordinate(snap)
            if decision.reason != duty.reason:
                log.debug("%scoordinator, round %d: %s (%s)", self._ctx(), target, decision.action.value, decision.reason)
                duty.reason = decision.reason
            if decision.action is Action.START_LAST_CALL:
                duty.last_call = snap.now + self._config.last_call_timeout
                duty.rejoin = snap.now + self._config.rejoin_timeout
                return None
            current = mirror.proposal
            seen_mod, proposal_mod = mirror.committed_mod, current.mod_revision if current is not None else 0
            proposal = (target, decision.participants, seen_mod, proposal_mod)
            if decision.action is Action.PROPOSE and duty.proposed != proposal and not (
                current is not None and current.number == target and current.participants == decision.participants
            ):
                duty.proposed = proposal
                ring = {n: [p.addr, p.port, p.lease] for n in decision.participants if (p := mirror.peers.get(n)) is not None}
                return lambda: self._propose(target, decision.participants, seen_mod, proposal_mod, lease, ring)
            self._cond.wait(self._wait_time(decision))
            return None

    def _elect(self, lease: int) -> None:
        """Become the coordinator if there is none (the key lives on our lease: it ends with us)."""
        conn = self._require_conn()
        tx = conn.client.transactions
        value = json.dumps({"node": self._node_id, "lease": lease})
        won, _ = conn.call("elect a coordinator", lambda: conn.client.transaction(
            compare=[tx.version(self._coordinator_key) == 0],
            success=[tx.put(self._coordinator_key, value, lease=lease)], failure=[]))
        if won:
            log.info("%scoordinating the rendezvous (mirrors every registration and join)", self._ctx())

    def _post_reform(self, reform: Reform) -> None:
        conn = self._require_conn()
        value = json.dumps({"round": reform.round, "waiting": reform.waiting, "lost": list(reform.lost),
                            "by": self._node_id})
        conn.call("post a reform notice", lambda: conn.client.put(self._reform_key, value))
        log.info("%scoordinator: round %d must re-form (%d waiting, lost: %s)", self._ctx(), reform.round,
                 reform.waiting, ", ".join(reform.lost) or "none")

    def _propose(self, target: int, participants: tuple[str, ...], seen_mod: int, proposal_mod: int, lease: int,
                 ring: dict[str, list[Any]] | None = None) -> None:
        """Post the proposal unless the round key or the proposal moved since the decision (on our lease: a dead
        coordinator's proposal vanishes with it)."""
        conn = self._require_conn()
        tx = conn.client.transactions
        value = json.dumps({"number": target, "participants": list(participants), "by": self._node_id,
                            "ring": ring or {}})
        ok, _ = conn.call(f"propose round {target}", lambda: conn.client.transaction(
            compare=[tx.mod(self._round_key) == seen_mod, tx.mod(self._proposal_key) == proposal_mod],
            success=[tx.put(self._proposal_key, value, lease=lease)], failure=[]))
        if ok:
            log.info("%scoordinator: proposed round %d with %d nodes (rank 0: %s)", self._ctx(), target,
                     len(participants), participants[0])

    # ================================================================== lease keepalive
    def _keeper_key(self) -> tuple[Any, ...]:
        return ("lease-keeper", *ClientPool.key(self._config), self._config.lease_ttl)

    def _acquire_keeper(self, conn: EtcdConnection) -> LeaseKeeper:
        """Our own keeper on our connection, or (with a pool) the one every handler of the pool shares."""
        interval = refresh_interval(self._config.lease_ttl)
        pool = self._pool
        if pool is None:
            return LeaseKeeper(conn, interval, name=f"rdzv-lease-{self._node_id}")
        config = self._config
        return pool.acquire_shared(self._keeper_key(), lambda: LeaseKeeper(
            EtcdConnection(config, pool=pool), interval, name="rdzv-lease-shared"))

    def _release_keeper(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return
        keeper.remove(self)
        if self._pool is None:
            keeper.close()
            return
        last = self._pool.release_shared(self._keeper_key())
        if last is not None:
            last.close()
            last.connection.close()

    # LeaseOwner (lease_keeper.py), called from the keeper's thread: never block here.
    def lease_to_keep(self) -> int | None:
        return None if self._stop.is_set() else self._lease_id

    def lease_refreshed(self, lease: int, ttl: int) -> None:
        self._note_etcd_ok()
        if ttl > 0 or self._stop.is_set() or lease != self._lease_id:  # a lease already replaced is no news
            return
        renewer = self._renewer
        if renewer is not None and renewer.is_alive():
            return  # already re-registering
        log.warning("%slease %x expired (etcd unreachable for > %d s?); re-registering", self._ctx(), lease, self._config.lease_ttl)
        self._renewer = threading.Thread(target=self._renew_expired_lease, args=(lease,),
                                         name=f"rdzv-renew-{self._node_id}", daemon=True)
        self._renewer.start()

    def lease_refresh_failed(self, exc: BaseException) -> None:
        if not self._stop.is_set():
            self._note_etcd_failure(exc)

    def _renew_expired_lease(self, lease: int) -> None:
        try:
            self._renew_lease(lease)
        except RendezvousConnectionError as exc:
            if not self._stop.is_set():  # stopping: its connection was closed under it
                self._note_etcd_failure(exc)
        except Exception:  # the next refresh finds the lease still gone and tries again
            if not self._stop.is_set():
                log.exception("%sre-registering after the lease expired failed", self._ctx())

    # ================================================================== etcd health
    def _note_etcd_ok(self) -> None:
        if self._unreachable_since is not None:
            log.info("%setcd reachable again after %.1f s", self._ctx(), self._clock() - self._unreachable_since)
            self._unreachable_since = None

    def _note_etcd_failure(self, exc: BaseException) -> None:
        now, since = self._clock(), self._unreachable_since  # read once: another thread may note etcd ok meanwhile
        if since is None:
            self._unreachable_since = now
            log.warning("%setcd at %s unreachable: %s", self._ctx(), self._config.endpoint_str, describe(exc))
            return
        if now - since > self._config.etcd_timeout and self._fatal is None:
            with self._cond:
                self._fatal = RendezvousOutageError(
                    f"{self._ctx()}etcd at {self._config.endpoint_str} unreachable for "
                    f"{now - since:.1f} s, more than etcd_timeout="
                    f"{self._config.etcd_timeout:g} s (last error: {describe(exc)}); giving up"
                )
                self._cond.notify_all()
            log.error("%s", self._fatal)  # the message starts with the context

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise type(self._fatal)(str(self._fatal)) from self._fatal

    # ================================================================== teardown
    def _stop_threads(self) -> None:
        self._stop.set()
        self._release_keeper()
        stream = self._watch_stream
        if stream is not None:
            stream.cancel()
        with self._cond:
            self._cond.notify_all()
        renewer = self._renewer
        for thread in [*self._threads, *([renewer] if renewer is not None else [])]:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)  # a stuck thread must not hold up a signal-driven leave()
        self._threads.clear()
        self._release_mux()

    def _ctx(self) -> str:
        record = self._my_round
        number = record.number if record is not None else "-"
        return f"[run={self._config.run_id} node={self._node_id} round={number}] "

    def __repr__(self) -> str:
        return f"EtcdV3RendezvousHandler(run_id={self._config.run_id!r}, node_id={self._node_id!r}, round={self.round})"
