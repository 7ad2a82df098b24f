"""The rendezvous round state machine as pure functions of plain data (no etcd, no clock, no threads).

The handler (``etcd_v3.py``) keeps a watched mirror of the job's keys, turns it into a ``Snapshot``
and asks ``decide`` what to do; it then performs the I/O (join, commit transaction, wait) and asks
again. Modelled on torch's ``dynamic_rendezvous.py`` (a pure function of state and deadline returning
an action), with etcd leases instead of heartbeats and a fast path instead of a fixed last call.

Vocabulary
    node        an agent, registered under a lease (its key vanishes when it dies).
    round N     a committed record: the ordered participants (rank = index) and the master address.
    joining     nodes announce themselves for round ``committed + 1`` (the *target*) with a join key.
    open        round N+1 may be formed only once round N is being abandoned: some participant of N
                re-joined or is gone. Before that, joiners are *waiting* (``nodes_waiting`` tells the
                running agents, which restart and re-join: torch's scale-up path).
    spare       a waiter while round N is full and healthy: it fills in after the next loss.

Who looks at what (O(N) etcd traffic per round). Only one node, the *coordinator* (whoever holds the
coordinator key, elected by transaction), mirrors every registration and join key; it runs ``coordinate``
on a full ``Snapshot`` and posts two single keys that every node watches: the *proposal* (the next round's
participants in rank order) and the *reform* notice (the running round is broken, or a node waits for a
slot). The other nodes run ``follow`` on a ``FollowerView`` built from those few keys; the proposal's rank 0
commits the round (it hosts the workers' store). Only at its join deadline does a node read the full state
once and ask ``decide`` whether it timed out or is a spare (``Action.CHECK``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A committed round: who is in it (rank = index) and where the workers' TCPStore is."""

    number: int
    """Round number, 1 for the first round; increases by one per round."""

    participants: tuple[str, ...]
    """Node ids in rank order."""

    master_addr: str = ""
    """Address of the rank-0 node (its agent hosts the workers' TCPStore: MASTER_ADDR)."""

    master_port: int = 0
    """MASTER_PORT: the workers' TCPStore that the rank-0 agent opened for this round before committing it (or,
    with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, a port that was free there for rank 0's worker to host it)."""

    def __post_init__(self) -> None:
        if self.number < 1:
            raise ValueError(f"round number must be >= 1, got {self.number}")
        if not self.participants or len(set(self.participants)) != len(self.participants):
            raise ValueError(f"round {self.number} needs distinct participants, got {self.participants}")

    def rank_of(self, node_id: str) -> int | None:
        try:
            return self.participants.index(node_id)
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything ``decide`` looks at, as seen by one node at one instant."""

    node_id: str
    """The deciding node."""

    target: int
    """The round number this node is trying to join (``committed.number + 1`` when it started)."""

    committed: RoundRecord | None
    """The latest committed round, None before the first."""

    live: frozenset[str]
    """Node ids whose registration (leased key) exists now."""

    joined: Mapping[str, int]
    """Node ids that joined round ``committed + 1`` -> their ordering key (stable across rounds)."""

    closed: bool
    """The job has ended (``set_closed``)."""

    min_nodes: int
    max_nodes: int

    now: float
    """Monotonic seconds."""

    join_deadline: float
    """When a non-spare node gives up waiting for ``min_nodes`` (RendezvousTimeoutError)."""

    last_call_deadline: float | None = None
    """Until when unannounced nodes may still arrive (first round only); set on START_LAST_CALL."""

    rejoin_deadline: float | None = None
    """Until when registered nodes that have not joined yet (stragglers: agents still stopping their
    workers, or between registering and joining) are waited for; set on START_LAST_CALL."""


class Action(enum.Enum):
    JOIN = "join"
    """Write (or re-write, after a lease loss) this node's join key for the target round."""
    WAIT = "wait"
    """Nothing to do until the mirror changes or ``wake_at``."""
    START_LAST_CALL = "start_last_call"
    """``min_nodes`` reached but more may come: set ``last_call_deadline = now + last_call_timeout`` and
    ``rejoin_deadline = now + rejoin_timeout``."""
    COMMIT = "commit"
    """This node is rank 0 of the round to form: commit ``participants`` by transaction."""
    DONE = "done"
    """A committed round includes this node: return it."""
    REJOIN = "rejoin"
    """A round was committed without this node: target the next one."""
    SPARE = "spare"
    """The running round is full and healthy: wait (no join deadline) for a slot."""
    CLOSED = "closed"
    """The job ended: raise RendezvousClosedError."""
    PROPOSE = "propose"
    """Coordinator only: post ``participants`` as the proposal of the round to form (its rank 0 commits it)."""
    CHECK = "check"
    """Follower only: the join deadline passed; read the full state once and ask ``decide`` (timeout, spare)."""
    TIMEOUT = "timeout"
    """The join deadline passed below ``min_nodes``: raise RendezvousTimeoutError."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    participants: tuple[str, ...] = ()
    """For COMMIT: node ids in rank order."""
    wake_at: float | None = None
    """For WAIT/START_LAST_CALL/SPARE: the next instant the decision may change without a mirror change."""
    reason: str = ""
    """Human-readable why (goes into log lines)."""


@dataclass(frozen=True, slots=True)
class Proposal:
    """The coordinator's proposal for round ``number``: its rank 0 commits exactly these participants."""

    number: int
    participants: tuple[str, ...]
    mod_revision: int = 0
    """The proposal key's mod revision (compared by the commit: a superseded proposal is never committed)."""

    def __post_init__(self) -> None:
        if self.number < 1 or not self.participants:
            raise ValueError(f"a proposal needs a round >= 1 and participants, got {self.number}, {self.participants}")


@dataclass(frozen=True, slots=True)
class Reform:
    """The coordinator's notice about committed round ``round``: what the nodes that do not mirror every key
    need to know to leave it (``num_nodes_waiting``, ``lost_peers``)."""

    round: int
    waiting: int
    """``Membership.nodes_waiting`` as the coordinator counts it (> 0: re-rendezvous)."""
    lost: tuple[str, ...] = ()
    """Participants of the round whose registration vanished (sorted)."""

    def news_after(self, posted: Reform | None) -> bool:
        """Whether this notice tells the followers more than ``posted`` did. A changed count alone is no
        news (each re-joining participant would cost one post to every node): only a new round or new
        losses are."""
        return posted is None or posted.round != self.round or not set(self.lost) <= set(posted.lost)


def reform_of(
    committed: RoundRecord | None,
    live: Iterable[str],
    joined: Iterable[str],
    lost: Iterable[str],
    max_nodes: int,
    closed: bool,
) -> Reform | None:
    """The reform notice the coordinator should post now, None when there is nothing to tell (pure).

    ``lost`` are participants seen gone while the round was current (sticky, like ``num_nodes_waiting``).
    Nothing is posted once the job is closed: participants that leave then finished.
    """
    if committed is None or closed:
        return None
    m = membership(committed, live, joined, max_nodes)
    gone = tuple(sorted(m.lost | (frozenset(lost) & frozenset(committed.participants))))
    waiting = max(m.nodes_waiting, len(gone))
    if waiting == 0:
        return None
    return Reform(round=committed.number, waiting=waiting, lost=gone)


def order_nodes(joined: Mapping[str, int]) -> tuple[str, ...]:
    """Rank order: by ordering key (first registration revision), ties by id; survivors keep relative order."""
    return tuple(sorted(joined, key=lambda node: (joined[node], node)))


@dataclass(frozen=True, slots=True)
class Membership:
    """How the live nodes relate to the committed round (what the running agents need to know)."""

    lost: frozenset[str] = field(default_factory=frozenset)
    """Participants whose registration is gone (dead, or cut off longer than a lease)."""
    rejoining: frozenset[str] = field(default_factory=frozenset)
    """Participants that already joined the next round (their workers stopped)."""
    newcomers: frozenset[str] = field(default_factory=frozenset)
    """Non-participants that joined the next round."""
    full: bool = False
    """The committed round has ``max_nodes`` participants."""

    @property
    def broken(self) -> bool:
        """The committed round cannot go on as is: some participant is gone or has left it."""
        return bool(self.lost or self.rejoining)

    @property
    def nodes_waiting(self) -> int:
        """torch's ``num_nodes_waiting``: > 0 tells the running agents to restart and re-rendezvous.

        Newcomers count only when they would get a slot (round not full) or the round is re-forming anyway.
        """
        if self.broken:
            return len(self.lost) + len(self.rejoining) + len(self.newcomers)
        return 0 if self.full else len(self.newcomers)


def membership(
    committed: RoundRecord | None, live: Iterable[str], joined: Iterable[str], max_nodes: int
) -> Membership:
    """Classify nodes against the committed round (pure)."""
    joined_set = frozenset(joined)
    if committed is None:
        return Membership(newcomers=joined_set)
    participants = frozenset(committed.participants)
    return Membership(
        lost=participants - frozenset(live),
        rejoining=participants & joined_set,
        newcomers=joined_set - participants,
        full=len(participants) >= max_nodes,
    )


def is_open(snap: Snapshot) -> bool:
    """May round ``committed + 1`` be formed now? (First round, or the committed one is broken.)"""
    if snap.committed is None:
        return True
    return membership(snap.committed, snap.live, snap.joined, snap.max_nodes).broken


def decide(snap: Snapshot) -> Decision:
    """The next step for ``snap.node_id`` (pure; see module docstring for the vocabulary)."""
    if snap.closed:
        return Decision(Action.CLOSED, reason="the rendezvous is closed")
    committed = snap.committed
    if committed is not None and committed.number >= snap.target:
        if snap.node_id in committed.participants:
            return Decision(Action.DONE, reason=f"round {committed.number} includes this node")
        return Decision(Action.REJOIN, reason=f"round {committed.number} was committed without this node")
    if snap.node_id not in snap.joined:
        return Decision(Action.JOIN, reason="this node's join key is missing")

    if not is_open(snap):
        assert committed is not None
        if len(committed.participants) >= snap.max_nodes:
            return Decision(Action.SPARE, reason=f"round {committed.number} is full and healthy")
        return _wait_or_timeout(snap, f"waiting for round {committed.number}'s agents to re-rendezvous")

    count = len(snap.joined)
    if count < snap.min_nodes:
        return _wait_or_timeout(snap, f"{count}/{snap.min_nodes} nodes joined")

    participants = order_nodes(snap.joined)[: snap.max_nodes]
    wait = _round_still_filling(snap, count)
    if wait is not None:
        return wait
    if participants[0] == snap.node_id:
        return Decision(Action.COMMIT, participants=participants, reason=f"forming round with {len(participants)}")
    # Rank 0 commits; if it dies meanwhile its join key expires with its lease and the next one takes over.
    return Decision(Action.WAIT, reason=f"waiting for {participants[0]} to commit")


def coordinate(snap: Snapshot) -> Decision:
    """What the coordinator does about round ``snap.target`` (pure; ``snap.node_id`` is ignored).

    WAIT (with ``wake_at``) until the round may close, START_LAST_CALL once, then PROPOSE its participants.
    The coordinator never times out for the joiners: each node checks its own join deadline (``follow``).
    """
    if snap.closed:
        return Decision(Action.WAIT, reason="the rendezvous is closed")
    committed = snap.committed
    if committed is not None and committed.number >= snap.target:
        return Decision(Action.WAIT, reason=f"round {committed.number} is committed")
    if not is_open(snap):
        assert committed is not None
        return Decision(Action.WAIT, reason=f"round {committed.number} goes on")
    count = len(snap.joined)
    if count < snap.min_nodes:
        return Decision(Action.WAIT, reason=f"{count}/{snap.min_nodes} nodes joined")
    wait = _round_still_filling(snap, count)
    if wait is not None:
        return wait
    participants = order_nodes(snap.joined)[: snap.max_nodes]
    return Decision(Action.PROPOSE, participants=participants, reason=f"forming round with {len(participants)}")


@dataclass(frozen=True, slots=True)
class FollowerView:
    """What a joining node that does not mirror the registration and join keys sees (``follow``)."""

    node_id: str
    target: int
    committed: RoundRecord | None
    closed: bool
    joined: bool
    """This node's join key for ``target`` was written under its current lease."""
    proposal: Proposal | None
    now: float
    join_deadline: float
    checked_at: float | None = None
    """When this node last read the full state for ``CHECK`` (None: never)."""
    recheck_s: float = 2.0
    """Past the join deadline, how often to check again (a spare waits without a deadline)."""


def follow(view: FollowerView) -> Decision:
    """The next step of a joining node that follows the coordinator's posts (pure)."""
    if view.closed:
        return Decision(Action.CLOSED, reason="the rendezvous is closed")
    committed = view.committed
    if committed is not None and committed.number >= view.target:
        if view.node_id in committed.participants:
            return Decision(Action.DONE, reason=f"round {committed.number} includes this node")
        return Decision(Action.REJOIN, reason=f"round {committed.number} was committed without this node")
    if not view.joined:
        return Decision(Action.JOIN, reason="this node has not joined the round yet")
    proposal = view.proposal
    if proposal is not None and proposal.number == view.target and proposal.participants[0] == view.node_id:
        return Decision(Action.COMMIT, participants=proposal.participants,
                        reason=f"rank 0 of the proposed round of {len(proposal.participants)}")
    check_at = view.join_deadline if view.checked_at is None else max(view.join_deadline, view.checked_at + view.recheck_s)
    if view.now >= check_at:
        return Decision(Action.CHECK, reason="join deadline passed: checking the full state")
    why = "waiting for the coordinator's proposal" if proposal is None or proposal.number != view.target else \
        f"waiting for {proposal.participants[0]} to commit"
    return Decision(Action.WAIT, wake_at=check_at, reason=why)


def _round_still_filling(snap: Snapshot, count: int) -> Decision | None:
    """None when the round should close now; else what to wait for.

    Closes at once when full. Otherwise registered nodes that have not joined (stragglers) are waited
    for until ``rejoin_deadline`` (they are known to be coming); then, for the first round only, nodes
    nobody knows of yet get the last call. Re-forming a running job with every live node joined closes
    at once: that is the fast recovery path.
    """
    if count >= snap.max_nodes:
        return None
    if snap.last_call_deadline is None or snap.rejoin_deadline is None:
        return Decision(Action.START_LAST_CALL, reason=f"{count} >= min {snap.min_nodes}; last call")
    stragglers = snap.live - snap.joined.keys()
    if stragglers and snap.now < snap.rejoin_deadline:
        return Decision(
            Action.WAIT,
            wake_at=snap.rejoin_deadline,
            reason=f"{count} joined, waiting for {len(stragglers)} registered node(s) to join",
        )
    if snap.committed is None and snap.now < snap.last_call_deadline:
        return Decision(Action.WAIT, wake_at=snap.last_call_deadline, reason=f"last call with {count} nodes")
    return None


def _wait_or_timeout(snap: Snapshot, why: str) -> Decision:
    if snap.now >= snap.join_deadline:
        return Decision(Action.TIMEOUT, reason=f"join timeout: {why}")
    return Decision(Action.WAIT, wake_at=snap.join_deadline, reason=why)
