"""Contracts of the etcd v3 rendezvous: the error tree and the configuration.

The errors reuse torch's ``RendezvousError`` family, so torch's agent and launcher treat ours exactly
like theirs; third-party (etcd3, grpc) errors are converted where they enter with ``raise ... from exc``.

``MembershipAwareHandler`` is the capability the agent's fast recovery relies on, declared as a runtime-checkable
protocol and checked once when the agent starts (a handler without it gets torch's polling path).

``EtcdRendezvousConfig.from_parameters`` turns torch's ``RendezvousParameters`` (``--rdzv-endpoint``,
``--rdzv-id``, ``--nnodes`` and the ``--rdzv-conf`` dict) into a validated config. Unknown
``--rdzv-conf`` keys are rejected with the list of accepted ones: a typo must not silently become a
default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Final, Protocol, runtime_checkable

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

__all__ = [
    "BACKEND_NAME",
    "ConnectableHandler",
    "EtcdRendezvousConfig",
    "FinishMarkingHandler",
    "LeaseHandler",
    "NamedNodeHandler",
    "RoundMembersHandler",
    "MembershipAwareHandler",
    "OutageBoundHandler",
    "PeerProbingHandler",
    "RendezvousClosedError",
    "RendezvousConfigError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousFinishedError",
    "RendezvousGracefulExitError",
    "RendezvousOutageError",
    "RendezvousStateError",
    "RendezvousTLSError",
    "RendezvousTimeoutError",
    "RendezvousWatchError",
    "is_permanent",
]

BACKEND_NAME: Final = "etcd-v3"
"""The ``--rdzv-backend`` name of this rendezvous."""

DEFAULT_ETCD_PORT: Final = 2379

DEFAULT_ETCD_TIMEOUT_S: Final = 30.0
"""Default ``etcd_timeout``; also the agent's outage bound for handlers that declare none."""

MAX_LEASE_TTL_S: Final = 9_000_000_000
"""etcd's longest lease (``MaxLeaseTTL``): bound of ``finished_ttl``."""


class RendezvousConfigError(RendezvousError, ValueError):
    """A rendezvous parameter or ``--rdzv-conf`` key is unknown or has an invalid value."""


class RendezvousFinishedError(RendezvousClosedError):
    """The run already finished successfully (its ``finished`` marker, kept for ``finished_ttl`` s): an agent
    started for it now has nothing to do and exits 0 instead of waiting ``join_timeout`` for peers."""


class RendezvousOutageError(RendezvousConnectionError):
    """The backend stayed unreachable past its bound (``etcd_timeout``): fatal, the handler will not recover."""


class RendezvousWatchError(RendezvousError):
    """The handler's watch of the rendezvous failed for good while etcd answered (it refuses the watch even
    with a fresh token, or an unexpected error): the handler no longer sees the membership and will not recover.

    Not a ``RendezvousConnectionError``: etcd is reachable, so ``shutdown`` still marks the job closed (an etcd
    that stayed away past ``etcd_timeout`` while the watch retried is a ``RendezvousOutageError`` instead)."""


def is_permanent(exc: BaseException) -> bool:
    """True when no later call of the handler can succeed, so waiting out an outage bound is pointless.

    Transient: ``RendezvousConnectionError`` (etcd restarting, a leader election), ``RendezvousTimeoutError``
    (a wait that ran out) and errors outside the ``RendezvousError`` tree (torch's c10d handlers let store
    errors through). Permanent: the rest of the tree (``RendezvousStateError``: a corrupt key;
    ``RendezvousClosedError``; ``RendezvousConfigError``; ``RendezvousWatchError``: a refused watch), and the
    one connection error a handler raises only once it gave up for good (``RendezvousOutageError``)."""
    if isinstance(exc, RendezvousOutageError):
        return True
    return isinstance(exc, RendezvousError) and not isinstance(exc, (RendezvousConnectionError, RendezvousTimeoutError))


@runtime_checkable
class MembershipAwareHandler(Protocol):
    """A torch ``RendezvousHandler`` that reports membership changes as they happen (etcd-v3 does).

    torch's agent learns of a lost or new node only by polling ``num_nodes_waiting()`` every monitor
    interval, and of a lost node only when its workers crash. With this protocol spotrun's agent sleeps
    on ``wait_membership_change`` and restarts the group the moment a peer's lease expires, and a
    preempted node leaves at once. Every method raises only from the ``RendezvousError`` tree (e.g.
    ``RendezvousConnectionError`` once the backend is unreachable for longer than its timeout); the
    agent handles those, and lets anything else propagate.
    """

    @property
    def round(self) -> int | None:
        """Number of the last round this node completed (None before the first); no I/O."""

    def membership_changed(self) -> bool:
        """Non-blocking: True when the current round cannot go on as is (a participant lost, re-joined
        or a waiting node would get a slot); False before the first round."""

    def wait_membership_change(self, timeout: float) -> bool:
        """Block until ``membership_changed()`` is True (True), or ``timeout`` s pass or the handler shuts
        down (False)."""

    def leave(self) -> None:
        """Give up this node's membership at once (peers re-form now) without closing the job; idempotent."""


@runtime_checkable
class NoticeAwareHandler(Protocol):
    """A handler that carries preemption notices between nodes (etcd-v3 does), so that every node of the
    round stops at the same step when one of them is about to be taken away."""

    def publish_notice(self, notice: dict[str, Any]) -> None:
        """Publish this node's notice (``source``, ``deadline`` wall-clock s) to the group; it vanishes with
        the node (raises from the ``RendezvousError`` tree)."""

    def peer_notices(self) -> dict[str, dict[str, Any]]:
        """Notices published by the other participants of this node's round, by node id; no I/O."""

    def lost_peers(self) -> set[str]:
        """Participants of this node's round that are gone (lease expired or revoked); no I/O."""


@runtime_checkable
class RestartAnnouncingHandler(Protocol):
    """A handler that tells the round when a node's workers failed and restart (etcd-v3: ``P/ctl/restart/{node}``),
    so the peers abort their collectives with the dead workers, which NCCL never fails (``elastic.worker.watcher``)."""

    def publish_restart(self) -> None:
        """Announce that this node's workers failed in its round and restart (raises ``RendezvousError``s)."""

    def restarted_peers(self) -> set[str]:
        """Other participants of this node's round that announced a restart of their workers in it; no I/O."""


@runtime_checkable
class HealthReportingHandler(Protocol):
    """A handler that shows each node's health report to ``spotrun status`` (etcd-v3: ``P/health/{node}``)."""

    def publish_health(self, report: dict[str, Any] | None) -> None:
        """Publish this node's report (``stragglers``: global rank -> step time over its local peers' median),
        attached to the node's lease; None removes it (raises from the ``RendezvousError`` tree)."""


@runtime_checkable
class ConnectableHandler(Protocol):
    """A handler that can reach its backend before joining (etcd-v3 can), so the launcher reports an
    unreachable backend within the backend's timeout, before it pays seconds for the warm workers' imports."""

    def connect(self) -> None:
        """Reach the backend now without joining a round (raises ``RendezvousConnectionError`` once it has
        been unreachable for the backend's timeout); idempotent, ``next_rendezvous`` would do it anyway."""


@runtime_checkable
class NamedNodeHandler(Protocol):
    """A handler that registers this agent under a node id (etcd-v3 does: ``elastic.nodes.node_id``): the
    agent's events carry the same id, so ``spotrun status`` and ``spotrun report`` name a node alike."""

    @property
    def node_id(self) -> str: ...


@runtime_checkable
class FinishMarkingHandler(Protocol):
    """A handler that can leave a ``finished`` marker when its run ends successfully (etcd-v3 with
    ``finished_ttl``), which an agent started for the same run later honours by exiting 0 at once (a pod
    recreated after its Indexed Job's run finished), instead of waiting ``join_timeout`` for peers."""

    def mark_finished(self) -> None:
        """Record that the run finished successfully (before ``shutdown``; a no-op when not enabled). Raises
        from the ``RendezvousError`` tree; the launcher only logs it (the run did finish)."""


@runtime_checkable
class OutageBoundHandler(Protocol):
    """A handler that says how long its backend may be unreachable before the job must end (etcd-v3:
    ``etcd_timeout``). The agent tolerates failed membership queries that long, then stops the workers and
    fails the job; for other handlers it uses ``EtcdRendezvousConfig``'s default."""

    @property
    def outage_bound(self) -> float:
        """Seconds of continuous failure that are still transient."""

    @property
    def endpoint(self) -> str:
        """Where the backend is, as the user wrote it (for error messages)."""


@runtime_checkable
class RoundMembersHandler(Protocol):
    """A handler that names the nodes of the round it completed (etcd-v3 does): the agent refunds a charged
    restart when the next round lacks one of them (a dead peer already replaced keeps the count, not the
    nodes). Apart from ``MembershipAwareHandler`` so that handlers written to that protocol keep passing it."""

    @property
    def participants(self) -> tuple[str, ...]:
        """Node ids of the last round this node completed, in rank order (empty before the first); no I/O."""


@runtime_checkable
class LeaseHandler(Protocol):
    """A handler whose members stay registered until a lease expires (etcd-v3): a peer that died without a
    word is still a member for up to ``lease_ttl`` s. The launcher stretches the agent's wait for a lost peer
    over it (``elastic.launcher.peer_loss_window``); handlers without leases keep ``--peer-loss-grace``."""

    @property
    def lease_ttl(self) -> float:
        """Seconds a dead peer stays a member."""


@runtime_checkable
class PeerProbingHandler(Protocol):
    """A handler that can ask its round's peers directly whether their processes are still there (etcd-v3,
    through each agent's liveness port: ``elastic.rendezvous.liveness``), so the agent learns of a peer that
    died on a live host without waiting out its lease. Both methods raise only from the ``RendezvousError``
    tree; the agent then acts as if it could not tell."""

    def probe_peers(self) -> set[str]:
        """Probe every other participant of this node's round now (a worker failed: a dead peer would explain
        it), revoke the lease of each whose process is gone and return those nodes."""

    def lost_peers_refuse(self) -> bool:
        """Whether this node's workers' just-in-time snapshot is worth waiting for after a peer loss: True when a
        lost participant of this node's round may have died on a live host (its liveness port refuses, or it
        cannot be probed), so that the workers' collectives break; False when every lost peer is silent or
        paused (nothing breaks them), and when a newer round formed without this node (its peers restored
        without its state)."""


# Keys torch's launcher or other torch backends put into --rdzv-conf. We accept them so an existing
# torchrun command line keeps working when only --rdzv-backend changes, but they have no effect here:
# ``timeout`` is injected by torch's LaunchConfig (900) and, as in torch's dynamic rendezvous, is not
# the join timeout (use ``join_timeout``); ``rank`` is only meaningful to the static backend; the rest
# configure the c10d/etcd-v2 backends' own stores and heartbeats, which leases replace.
IGNORED_TORCH_KEYS: Final = frozenset(
    {
        "timeout",
        "rank",
        "is_host",
        "read_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "heartbeat_timeout",
        "store_type",
        "use_libuv",
    }
)

# Spellings used by torch's etcd-v2 backend, mapped to ours.
KEY_ALIASES: Final = {"ca_cert": "cacert", "ssl_cert": "cert", "ssl_cert_key": "key"}


class RendezvousTLSError(RendezvousConnectionError):
    """The TLS handshake with etcd failed (wrong CA, missing or rejected client certificate, TLS vs plain)."""


@dataclass(kw_only=True, slots=True)
class EtcdRendezvousConfig:
    """Everything an ``EtcdV3RendezvousHandler`` needs; validates itself on construction."""

    run_id: str
    """Job id (``--rdzv-id``). All keys live under ``{etcd_prefix}/{run_id}/``: two jobs never see each other."""

    endpoints: tuple[tuple[str, int], ...]
    """etcd client endpoints as (host, port); from ``--rdzv-endpoint host[:port][,host[:port]...]``."""

    min_nodes: int
    """Fewest agents a round may have (``--nnodes MIN:MAX``)."""

    max_nodes: int
    """Most agents a round may have; later agents wait as spares and fill in after a loss."""

    local_addr: str | None = None
    """Address other nodes reach this one at (``--local-addr``); default: this host's FQDN."""

    lease_ttl: int = 3
    """Seconds (integer, >= 1) a node stays registered after its agent stops refreshing its lease.
    Upper bound on how long survivors take to learn that a node died without a word."""

    join_timeout: float = 600.0
    """Seconds ``next_rendezvous`` waits for a round with at least ``min_nodes`` (torch's default).
    Spares waiting for a free slot in a full job are not bound by it."""

    last_call_timeout: float = 1.0
    """Seconds the FIRST round stays open, once ``min_nodes`` have joined, for agents nobody knows of yet
    (not even registered). A round closes at once when it is full, or when it re-forms a running job and
    every live registered agent has joined, so recovery from a loss never waits for it. Raise it (torch
    uses 30) if agents of a first start are spread out in time and you want them all in the first round."""

    rejoin_timeout: float = 30.0
    """Seconds a forming round waits for nodes that are registered (alive) but have not joined yet:
    agents of the previous round still stopping their workers (torch's agent gives workers up to 30 s
    after SIGTERM), or agents between registering and joining. Waiting for them avoids a second round
    right after the first; after it they are left out and join the next round. The common recovery
    (every survivor joined within a second) never waits for it."""

    close_timeout: float = 30.0
    """Seconds ``set_closed``/``shutdown`` keep trying to record the closed state in etcd."""

    etcd_prefix: str = "/spotrun/rdzv"
    """Key prefix in etcd; must start with '/'."""

    etcd_timeout: float = DEFAULT_ETCD_TIMEOUT_S
    """Seconds etcd may be unreachable (leader change, restart) before the job fails with a
    ``RendezvousConnectionError`` naming the endpoint. Every etcd call is retried within this bound."""

    cacert: str | None = None
    """PEM CA bundle to verify etcd's TLS certificate; setting it switches to TLS."""

    cert: str | None = None
    """PEM client certificate for mutual TLS (needs ``key`` and ``cacert``)."""

    key: str | None = None
    """PEM private key of ``cert``."""

    liveness_probe: bool = True
    """Know a peer agent's death in under a second when its process dies (its liveness port refuses
    connections: ``liveness.py``), instead of after ``lease_ttl``; ``false`` leaves it to the lease."""

    user: str | None = None
    """etcd user name (etcd auth); needs ``password``."""

    password: str | None = None
    """Password of ``user``."""

    finished_ttl: int = 0
    """Seconds (whole, 0: off) the key ``{etcd_prefix}/{run_id}/finished`` outlives a run that finished
    successfully. An agent started for the run id while it exists (a Kubernetes pod recreated after its
    Indexed Job's run finished) exits 0 at once, naming the marker, instead of waiting ``join_timeout`` per
    attempt for peers that are gone. The run id can be reused for a new job only once it expired (it is a
    lease, so etcd removes it); set it on every node."""

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise RendezvousConfigError(
                f"run id {self.run_id!r} must be a non-empty string without '/'; pass --rdzv-id JOB_ID"
            )
        if not self.endpoints:
            raise RendezvousConfigError("no etcd endpoint: pass --rdzv-endpoint HOST:PORT")
        if self.min_nodes < 1:
            raise RendezvousConfigError(f"min_nodes must be >= 1, got {self.min_nodes} (--nnodes MIN:MAX)")
        if self.max_nodes < self.min_nodes:
            raise RendezvousConfigError(
                f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes}); fix --nnodes MIN:MAX"
            )
        if isinstance(self.lease_ttl, bool) or not isinstance(self.lease_ttl, int) or self.lease_ttl < 1:
            raise RendezvousConfigError(
                f"lease_ttl must be a whole number of seconds >= 1 (etcd leases are integral), got {self.lease_ttl!r}"
            )
        if isinstance(self.finished_ttl, bool) or not isinstance(self.finished_ttl, int) or not (
            0 <= self.finished_ttl <= MAX_LEASE_TTL_S
        ):
            raise RendezvousConfigError(
                f"finished_ttl must be a whole number of seconds from 0 (off) to {MAX_LEASE_TTL_S} (etcd's "
                f"longest lease), got {self.finished_ttl!r}; e.g. finished_ttl=86400 keeps the marker a day"
            )
        for name in ("join_timeout", "close_timeout", "etcd_timeout"):
            _require_positive(name, getattr(self, name))
        for name in ("last_call_timeout", "rejoin_timeout"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise RendezvousConfigError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if not self.etcd_prefix.startswith("/") or self.etcd_prefix.rstrip("/") == "":
            raise RendezvousConfigError(
                f"etcd_prefix must be an absolute key path like '/spotrun/rdzv', got {self.etcd_prefix!r}"
            )
        self.etcd_prefix = self.etcd_prefix.rstrip("/")
        if (self.cert is None) != (self.key is None):
            raise RendezvousConfigError("TLS client auth needs both 'cert' and 'key' in --rdzv-conf")
        if self.cert is not None and self.cacert is None:
            raise RendezvousConfigError("'cert'/'key' need 'cacert' too (the CA that signed etcd's certificate)")
        if not isinstance(self.liveness_probe, bool):
            raise RendezvousConfigError(f"liveness_probe must be true or false, got {self.liveness_probe!r}")
        if (self.user is None) != (self.password is None):
            raise RendezvousConfigError("etcd authentication needs both 'user' and 'password' in --rdzv-conf")

    # ------------------------------------------------------------------ derived
    @property
    def endpoint_str(self) -> str:
        """Endpoints as the user wrote them (for error messages)."""
        return ",".join(format_endpoint(h, p) for h, p in self.endpoints)

    @property
    def run_prefix(self) -> str:
        """Every key of this job starts with this (ends with '/')."""
        return f"{self.etcd_prefix}/{self.run_id}/"

    # ------------------------------------------------------------------ construction
    @classmethod
    def accepted_keys(cls) -> list[str]:
        """``--rdzv-conf`` keys this backend understands (including aliases and ignored torch keys)."""
        own = [f.name for f in fields(cls) if f.name not in _FROM_PARAMS]
        return sorted({*own, *KEY_ALIASES, *IGNORED_TORCH_KEYS, "local_addr"})

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> EtcdRendezvousConfig:
        """Build from torch's launcher parameters; unknown or malformed ``--rdzv-conf`` keys raise."""
        conf: dict[str, Any] = dict(params.config)
        unknown = sorted(k for k in conf if k not in cls.accepted_keys())
        if unknown:
            raise RendezvousConfigError(
                f"unknown --rdzv-conf key(s) {', '.join(repr(k) for k in unknown)} for backend "
                f"'{BACKEND_NAME}'; accepted keys: {', '.join(cls.accepted_keys())}"
            )
        for alias, name in KEY_ALIASES.items():
            if alias in conf:
                if name in conf:
                    raise RendezvousConfigError(f"--rdzv-conf gives both {alias!r} and {name!r}; keep one")
                conf[name] = conf.pop(alias)
        local_addr = conf.pop("local_addr", None) or params.local_addr
        kwargs: dict[str, Any] = {}
        for name, parse in _PARSERS.items():
            if conf.get(name) is not None:
                kwargs[name] = parse(name, conf[name])
        return cls(
            run_id=str(params.run_id),
            endpoints=parse_endpoints(params.endpoint),
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            local_addr=local_addr,
            **kwargs,
        )


_FROM_PARAMS = frozenset({"run_id", "endpoints", "min_nodes", "max_nodes", "local_addr"})


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or math.isinf(value):
        raise RendezvousConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def _parse_float(name: str, raw: object) -> float:
    try:
        value = float(raw)  # type: ignore[arg-type]  # any object: the TypeError is converted below
    except (TypeError, ValueError) as exc:
        raise RendezvousConfigError(f"--rdzv-conf {name}={raw!r} is not a number of seconds") from exc
    if math.isnan(value):
        raise RendezvousConfigError(f"--rdzv-conf {name}={raw!r} is not a number of seconds")
    return value


def _parse_int(name: str, raw: object) -> int:
    value = _parse_float(name, raw)
    if not math.isfinite(value) or value != int(value):
        raise RendezvousConfigError(f"--rdzv-conf {name}={raw!r} must be a whole number of seconds")
    return int(value)


def _parse_bool(name: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise RendezvousConfigError(f"--rdzv-conf {name}={raw!r} must be true or false")


def _parse_str(name: str, raw: object) -> str:
    if not isinstance(raw, str) or not raw:
        raise RendezvousConfigError(f"--rdzv-conf {name}={raw!r} must be a non-empty string")
    return raw


_PARSERS = {
    "lease_ttl": _parse_int,
    "join_timeout": _parse_float,
    "last_call_timeout": _parse_float,
    "rejoin_timeout": _parse_float,
    "close_timeout": _parse_float,
    "etcd_timeout": _parse_float,
    "finished_ttl": _parse_int,
    "etcd_prefix": _parse_str,
    "liveness_probe": _parse_bool,
    "cacert": _parse_str,
    "cert": _parse_str,
    "key": _parse_str,
    "user": _parse_str,
    "password": _parse_str,
}


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[::1]:2379``) as grpc and URLs want it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoints(endpoint: str) -> tuple[tuple[str, int], ...]:
    """``"host[:port][,host[:port]...]"`` (an ``http(s)://`` scheme is tolerated) -> ((host, port), ...).

    IPv6 addresses go in brackets, ``[::1]:2379``; a bare address (``::1``) gets the default port.
    """
    if not endpoint or not endpoint.strip():
        raise RendezvousConfigError("no etcd endpoint: pass --rdzv-endpoint HOST:PORT")
    result = []
    for part in endpoint.split(","):
        item = part.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        item = item.rstrip("/")
        if not item:
            raise RendezvousConfigError(f"empty entry in --rdzv-endpoint {endpoint!r}")
        host, port_s = _split_host_port(item, endpoint)
        if port_s is None:
            port = DEFAULT_ETCD_PORT
        else:
            try:
                port = int(port_s)
            except ValueError as exc:
                raise RendezvousConfigError(f"bad port {port_s!r} in --rdzv-endpoint {endpoint!r}") from exc
            if not 0 < port < 65536:
                raise RendezvousConfigError(f"port {port} out of range in --rdzv-endpoint {endpoint!r}")
        if not host:
            raise RendezvousConfigError(f"missing host in --rdzv-endpoint {endpoint!r}")
        result.append((host, port))
    return tuple(result)


def _split_host_port(item: str, endpoint: str) -> tuple[str, str | None]:
    """``[v6]:port`` / ``[v6]`` / ``v6`` (two or more colons, no port) / ``host:port`` / ``host``."""
    if item.startswith("["):
        host, close, rest = item[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise RendezvousConfigError(
                f"malformed IPv6 endpoint {item!r} in --rdzv-endpoint {endpoint!r}; write it as [ADDRESS]:PORT"
            )
        return host, (rest[1:] if rest else None)
    if item.count(":") > 1:
        return item, None  # a bare IPv6 address: its last group is not a port
    host, sep, port_s = item.rpartition(":")
    return (host, port_s) if sep else (item, None)
