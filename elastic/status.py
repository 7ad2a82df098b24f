"""``spotrun status``: the job as etcd sees it, in one screen (read-only: it never writes a key).

    spotrun status --rdzv-endpoint etcd:2379 --rdzv-id JOB [--rdzv-conf cacert=...,user=...,password=...]
    spotrun status ... --watch [--interval 2]     # refresh in place
    spotrun status ... --json                     # one JSON object (one per line with --watch)
    spotrun-status ...                            # the same, always (a script named ``status`` can't shadow it)

What it reads (the key layout of ``elastic.rendezvous.etcd_v3``; ``P = {etcd_prefix}/{run_id}/``): everything
under ``P/ctl/`` (node registrations, join keys, the committed round, the closed marker, notices) and under
``P/health/`` (each node's stragglers, ``elastic.straggler``), the TTL left
on each node's lease, and from the agents' store of the committed round ``P/store/{R}/torchelastic/`` the
local world size each agent announced (torch's ``_assign_worker_ranks``). Reads only: a user with a read-only
role on the job's prefix is enough. Every value is validated; a corrupt key becomes one line under
"problems", never a traceback.

The decoding (:func:`job_status`) is a pure function of the raw keys, the lease TTLs and the time; the I/O is
:func:`read_raw`; the CLI (:func:`main`) turns errors into one line and an exit status (0 read, 1 etcd
unreachable or refused, 2 bad command line).
"""

from __future__ import annotations

import argparse
import enum
import functools
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.api import LaunchConfigError
from elastic.config import parse_rdzv_conf
from elastic.rendezvous.api import BACKEND_NAME, EtcdRendezvousConfig, RendezvousConfigError, RendezvousError
from elastic.rendezvous.etcd_client import EtcdConnection

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE = 0, 1, 2
STATUS_ETCD_TIMEOUT_S = 5
"""Seconds ``spotrun status`` retries an unreachable etcd before saying so (``etcd_timeout`` in --rdzv-conf
overrides it)."""
_ROLE_INFO = "torchelastic/role_info/"
_ASSIGNED = "torchelastic/assigned_ranks/"


class RunState(str, enum.Enum):
    """The job's state as the keys show it."""

    ABSENT = "absent"
    """No key under the run's prefix: never started, or ended cleanly (its last agent deletes its keys)."""
    FORMING = "forming"
    """Nodes are registered, no round is committed yet, or the committed one is broken and a new one forms."""
    RUNNING = "running"
    """A committed round with every participant registered and none re-joining."""
    CLOSED = "closed"
    """The job ended (the closed key is present until its last agent left)."""


class NodeRole(str, enum.Enum):
    RUNNING = "running"
    """A participant of the committed round, registered."""
    LOST = "lost"
    """A participant whose registration is gone (dead, or cut off longer than its lease)."""
    REJOINING = "rejoining"
    """A participant that joined the next round: its workers stopped, a new round forms."""
    WAITING = "waiting"
    """Not in the committed round, joined the next one: it gets a slot when the round re-forms."""
    SPARE = "spare"
    """Waiting while the committed round is full and healthy: it fills in after the next loss."""
    REGISTERED = "registered"
    """Registered, not in the round, no join key (between registering and joining)."""


@dataclass(frozen=True, slots=True)
class RawKey:
    """One etcd key as read (the I/O's output, :func:`job_status`'s input)."""

    key: str
    value: bytes
    lease: int = 0
    mod_revision: int = 0


@dataclass(frozen=True, slots=True)
class NoticeStatus:
    source: str
    deadline: float
    """Wall-clock seconds (Unix time)."""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node_id: str
    role: NodeRole
    group_rank: int | None = None
    host: str = ""
    addr: str = ""
    pid: int | None = None
    local_world_size: int | None = None
    lease_ttl_left: float | None = None
    """Seconds left on the node's lease (None when unknown; a live agent keeps it near ``lease_ttl``)."""
    notice: NoticeStatus | None = None
    stragglers: dict[int, float] = field(default_factory=dict)
    """Global rank -> its step time over its local peers' median, for this node's ranks named stragglers."""


@dataclass(frozen=True, slots=True)
class JobStatus:
    """The job at one instant, decoded and validated."""

    run_id: str
    endpoint: str
    state: RunState
    round: int | None = None
    """The committed round (None before the first)."""
    group_world_size: int | None = None
    """Nodes in the committed round."""
    world_size: int | None = None
    """Workers in the committed round (the agents' announced local world sizes), None when not known."""
    master: str = ""
    round_started_at: float | None = None
    """Wall-clock seconds the round was committed."""
    nodes: tuple[NodeStatus, ...] = ()
    pending_joins: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """round number -> node ids that joined it (the round being formed)."""
    problems: tuple[str, ...] = ()
    """One line per key that could not be decoded."""
    read_at: float = 0.0
    """Wall-clock seconds of the read."""

    def round_age(self) -> float | None:
        """Seconds the committed round has been running at ``read_at``."""
        return None if self.round_started_at is None else max(0.0, self.read_at - self.round_started_at)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as their values, ``round_age_s`` added)."""
        out = asdict(self)
        out["state"] = self.state.value
        out["round_age_s"] = self.round_age()
        out["pending_joins"] = {str(k): list(v) for k, v in self.pending_joins.items()}
        for node in out["nodes"]:
            node["role"] = node["role"].value
        return out


# --- pure decoding ----------------------------------------------------------------------------------------------


class _Corrupt(ValueError):
    """A key's value is not what the rendezvous writes there."""


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Corrupt(f"not JSON ({exc})") from exc
    except RecursionError as exc:
        raise _Corrupt("JSON nested too deeply") from exc
    if not isinstance(data, dict):
        raise _Corrupt(f"expected a JSON object, got {type(data).__name__}")
    return data


def _int(data: Mapping[str, Any], name: str, *, minimum: int = 0) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _Corrupt(f"{name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(data: Mapping[str, Any], name: str) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Corrupt(f"{name!r} must be a number, got {value!r}")
    return float(value)


def _str(data: Mapping[str, Any], name: str, default: str = "") -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise _Corrupt(f"{name!r} must be a string, got {value!r}")
    return value


@dataclass(slots=True)
class _Decoded:
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    leases: dict[str, int] = field(default_factory=dict)
    joins: dict[int, set[str]] = field(default_factory=dict)
    round: dict[str, Any] | None = None
    closed: bool = False
    notices: dict[str, NoticeStatus] = field(default_factory=dict)
    stragglers: dict[str, dict[int, float]] = field(default_factory=dict)
    local_sizes: dict[int, int] = field(default_factory=dict)
    world_size: int | None = None
    problems: list[str] = field(default_factory=list)


def _decode_ctl(d: _Decoded, rel: str, kv: RawKey) -> None:
    if rel.startswith("nodes/"):
        info = _json_object(kv.value)
        if "pid" in info and info["pid"] is not None:
            _int(info, "pid")
        _str(info, "host")
        _str(info, "addr")
        d.nodes[rel[len("nodes/"):]] = info
        d.leases[rel[len("nodes/"):]] = kv.lease
    elif rel.startswith("join/"):
        number, _, node = rel[len("join/"):].partition("/")
        if not number.isdigit() or not node:
            raise _Corrupt("expected join/<round>/<node>")
        _json_object(kv.value)
        d.joins.setdefault(int(number), set()).add(node)
    elif rel == "round":
        data = _json_object(kv.value)
        _int(data, "number", minimum=1)
        participants = data.get("participants")
        if (not isinstance(participants, list) or not participants
                or not all(isinstance(p, str) and p for p in participants) or len(set(participants)) != len(participants)):
            raise _Corrupt(f"'participants' must be a non-empty list of distinct node ids, got {participants!r}")
        _str(data, "master_addr")
        _int(data, "master_port")
        if "time" in data:
            _float(data, "time")
        d.round = data
    elif rel == "closed":
        d.closed = True
    elif rel.startswith("notice/"):
        data = _json_object(kv.value)
        d.notices[rel[len("notice/"):]] = NoticeStatus(source=_str(data, "source", "?"),
                                                       deadline=_float(data, "deadline"),
                                                       detail=_str(data, "detail") if data.get("detail") else "")
    # other keys (a newer spotrun's) are not ours to judge


MAX_STRAGGLERS = 4096
"""Most straggler entries one node's health report may hold (one per local rank)."""


def _decode_health(d: _Decoded, node: str, kv: RawKey) -> None:
    """``P/health/{node}``: ``{"stragglers": {global rank: ratio}}``, every entry checked."""
    data = _json_object(kv.value)
    raw = data.get("stragglers", {})
    if not isinstance(raw, dict) or len(raw) > MAX_STRAGGLERS:
        raise _Corrupt(f"'stragglers' must be an object of at most {MAX_STRAGGLERS} ranks")
    out: dict[int, float] = {}
    for rank, ratio in raw.items():
        if not (isinstance(rank, str) and rank.isdigit() and len(rank) <= 9) or isinstance(ratio, bool) \
                or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
            raise _Corrupt(f"straggler entry {rank!r}: {ratio!r} is not a rank and a positive ratio")
        out[int(rank)] = float(ratio)
    d.stragglers[node] = out


def _decode_store(d: _Decoded, rel: str, kv: RawKey) -> None:
    try:
        if rel.startswith(_ROLE_INFO):
            data = _json_object(kv.value)
            d.local_sizes[_int(data, "rank")] = _int(data, "local_world_size", minimum=1)
        elif rel == _ASSIGNED + "0":
            try:
                ranks = json.loads(kv.value)
            except RecursionError as exc:
                raise _Corrupt("JSON nested too deeply") from exc
            if not (isinstance(ranks, list) and len(ranks) == 4 and all(isinstance(r, int) for r in ranks)):
                raise _Corrupt(f"expected [base_rank, world_size, role_rank, role_world_size], got {ranks!r}")
            d.world_size = int(ranks[1])
    except (_Corrupt, UnicodeDecodeError, json.JSONDecodeError) as exc:
        d.problems.append(f"corrupt key {kv.key}: {exc}")


def job_status(config: EtcdRendezvousConfig, ctl: Sequence[RawKey], store: Sequence[RawKey],
               ttl_left: Mapping[int, float], now: float, *, health: Sequence[RawKey] = ()) -> JobStatus:
    """Decode the job's keys into a :class:`JobStatus` (pure; corrupt keys become ``problems``).

    Args:
        config: the job's rendezvous config (its run prefix and ``max_nodes``, from ``--nnodes``, unknown here:
            a spare is a waiter while the round is healthy).
        ctl: the keys under ``P/ctl/``.
        store: the keys under ``P/store/{R}/torchelastic/`` of the committed round R (may be empty).
        ttl_left: lease id -> seconds left (absent: unknown).
        now: wall-clock seconds of the read.
        health: the keys under ``P/health/`` (the nodes' straggler reports).
    """
    prefix = config.run_prefix
    d = _Decoded()
    for kv in health:
        node = kv.key[len(prefix) + len("health/"):] if kv.key.startswith(prefix + "health/") else ""
        try:
            if node:
                _decode_health(d, node, kv)
        except (_Corrupt, UnicodeDecodeError) as exc:
            d.problems.append(f"corrupt key {kv.key}: {exc}")
    for kv in ctl:
        rel = kv.key[len(prefix) + len("ctl/"):] if kv.key.startswith(prefix + "ctl/") else None
        if rel is None:
            continue
        try:
            _decode_ctl(d, rel, kv)
        except _Corrupt as exc:
            d.problems.append(f"corrupt key {kv.key}: {exc}")
    rnd = d.round
    if rnd is not None:
        store_prefix = f"{prefix}store/{rnd['number']}/"
        for kv in store:
            if kv.key.startswith(store_prefix):
                _decode_store(d, kv.key[len(store_prefix):], kv)
    return _assemble(config, d, ttl_left, now)


def _assemble(config: EtcdRendezvousConfig, d: _Decoded, ttl_left: Mapping[int, float], now: float) -> JobStatus:
    rnd = d.round
    participants: tuple[str, ...] = tuple(rnd["participants"]) if rnd is not None else ()
    number: int | None = rnd["number"] if rnd is not None else None
    next_joins = d.joins.get(number + 1, set()) if number is not None else set().union(*d.joins.values())
    lost = [p for p in participants if p not in d.nodes]
    rejoining = [p for p in participants if p in next_joins]
    if d.closed:
        state = RunState.CLOSED
    elif rnd is None:
        state = RunState.FORMING if d.nodes or d.joins else RunState.ABSENT
    else:
        state = RunState.FORMING if lost or rejoining else RunState.RUNNING
    healthy_full = rnd is not None and not lost and not rejoining
    nodes: list[NodeStatus] = []
    for rank, node in enumerate(participants):
        role = NodeRole.LOST if node in lost else NodeRole.REJOINING if node in rejoining else NodeRole.RUNNING
        nodes.append(_node(node, role, d, ttl_left, rank=rank))
    for node in sorted(n for n in d.nodes if n not in participants):
        waiting = NodeRole.SPARE if healthy_full else NodeRole.WAITING
        role = waiting if node in next_joins else NodeRole.REGISTERED
        nodes.append(_node(node, role, d, ttl_left))
    local_total = (sum(d.local_sizes[r] for r in range(len(participants)))
                   if participants and all(r in d.local_sizes for r in range(len(participants))) else None)
    master = f"{rnd['master_addr']}:{rnd['master_port']}" if rnd is not None else ""
    return JobStatus(
        run_id=config.run_id, endpoint=config.endpoint_str, state=state, round=number,
        group_world_size=len(participants) or None, world_size=d.world_size or local_total, master=master,
        round_started_at=float(rnd["time"]) if rnd is not None and "time" in rnd else None,
        nodes=tuple(nodes), pending_joins={k: tuple(sorted(v)) for k, v in sorted(d.joins.items()) if v},
        problems=tuple(d.problems), read_at=now,
    )


def _node(node: str, role: NodeRole, d: _Decoded, ttl_left: Mapping[int, float], *, rank: int | None = None
          ) -> NodeStatus:
    info = d.nodes.get(node, {})
    lease = d.leases.get(node, 0)
    pid = info.get("pid")
    return NodeStatus(node_id=node, role=role, group_rank=rank, host=str(info.get("host", "")),
                      addr=str(info.get("addr", "")), pid=pid if isinstance(pid, int) else None,
                      local_world_size=d.local_sizes.get(rank) if rank is not None else None,
                      lease_ttl_left=ttl_left.get(lease) if lease else None, notice=d.notices.get(node),
                      stragglers=d.stragglers.get(node, {}))


# --- text -----------------------------------------------------------------------------------------------------


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{sec:02d}s"


def _printable(text: str) -> str:
    """``text`` with its non-printable characters escaped (``\\x1b``): node ids, hosts and notices come from
    etcd, where a terminal escape sequence could otherwise clear or rewrite the screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def render(status: JobStatus) -> str:
    """One screen of text (every string read from etcd with its non-printable characters escaped)."""
    when = time.strftime("%H:%M:%S", time.localtime(status.read_at))
    head = _printable(f"spotrun job {status.run_id} at {status.endpoint} ({when})")
    if status.state is RunState.RUNNING:
        state = f"running round {status.round} for {_duration(status.round_age())}"
    elif status.state is RunState.FORMING and status.round is not None:
        state = f"forming round {status.round + 1} (round {status.round} broken after {_duration(status.round_age())})"
    elif status.state is RunState.FORMING:
        state = "forming the first round"
    elif status.state is RunState.CLOSED:
        state = "closed (the job ended; its agents are leaving)"
    else:
        state = "no keys: not started, or ended cleanly"
    lines = [head, f"state:  {state}"]
    if status.round is not None:
        world = "?" if status.world_size is None else str(status.world_size)
        lines.append(f"world:  {status.group_world_size} nodes, {world} workers; master {_printable(status.master)}")
    if status.nodes:
        lines.append("")
        lines.append(f"{'rank':>4}  {'node':<30} {'host':<16} {'local':>5} {'lease':>6}  {'role':<10} notice")
        for n in status.nodes:
            rank = "-" if n.group_rank is None else str(n.group_rank)
            local = "-" if n.local_world_size is None else str(n.local_world_size)
            ttl = "-" if n.lease_ttl_left is None else f"{n.lease_ttl_left:.0f}s"
            notice = ""
            if n.notice is not None:
                source = _printable(n.notice.source)
                notice = f"{source}, deadline in {_duration(n.notice.deadline - status.read_at)}"
                if n.notice.deadline <= status.read_at:
                    notice = f"{source}, deadline passed {_duration(status.read_at - n.notice.deadline)} ago"
            node_id, host = _printable(n.node_id), _printable(n.host)
            lines.append(f"{rank:>4}  {node_id[:30]:<30} {host[:16]:<16} {local:>5} {ttl:>6}  {n.role.value:<10} {notice}")
    slow = [(slow_rank, ratio, n) for n in status.nodes for slow_rank, ratio in sorted(n.stragglers.items())]
    if slow:
        lines.append("")
        for slow_rank, ratio, n in slow:
            lines.append(f"straggler: rank {slow_rank} on {_printable(n.node_id)} ({_printable(n.host) or '?'}), "
                         f"{ratio:.2f}x its local peers' step time")
    if status.pending_joins:
        lines.append("")
        for number, nodes in status.pending_joins.items():
            lines.append(f"joined round {number}: {_printable(', '.join(nodes))}")
    for problem in status.problems:
        lines.append(f"problem: {_printable(problem)}")
    return "\n".join(lines)


# --- I/O ------------------------------------------------------------------------------------------------------


def read_raw(conn: Any, config: EtcdRendezvousConfig) -> tuple[list[RawKey], list[RawKey], dict[int, float]]:
    """Read the job's keys, the agents' store of the committed round and the node leases' TTLs (read-only).

    ``conn`` is an ``EtcdConnection`` (typed Any: python3-etcd3 is untyped). Raises ``RendezvousError`` (its
    ``RendezvousConnectionError``) when etcd is unreachable or refuses the read."""
    prefix = config.run_prefix
    resp = conn.call("read the job's keys", lambda: conn.client.get_prefix_response(prefix + "ctl/"))
    ctl = [RawKey(kv.key.decode(errors="replace"), bytes(kv.value), int(kv.lease), int(kv.mod_revision))
           for kv in resp.kvs]
    store: list[RawKey] = []
    round_kv = next((kv for kv in ctl if kv.key == prefix + "ctl/round"), None)
    number = round_number(round_kv.value) if round_kv is not None else None
    if number is not None:
        sp = f"{prefix}store/{number}/torchelastic/"
        sresp = conn.call("read the agents' store", lambda: conn.client.get_prefix_response(sp))
        store = [RawKey(kv.key.decode(errors="replace"), bytes(kv.value)) for kv in sresp.kvs]
    ttl: dict[int, float] = {}
    for kv in ctl:
        if kv.key.startswith(prefix + "ctl/nodes/") and kv.lease and kv.lease not in ttl:
            info = conn.call("read a lease's TTL", functools.partial(conn.client.get_lease_info, kv.lease))
            if int(info.TTL) >= 0:
                ttl[kv.lease] = float(info.TTL)
    return ctl, store, ttl


def round_number(raw: bytes) -> int | None:
    """The number in a round key's value; None when it holds none (not JSON, not an object, not a positive
    integer)."""
    try:
        number = json.loads(raw).get("number")
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested too deeply
        return None
    return number if isinstance(number, int) and not isinstance(number, bool) and number >= 1 else None


def read_status(config: EtcdRendezvousConfig, conn: Any, *, wall_clock: Callable[[], float] = time.time
                ) -> JobStatus:
    ctl, store, ttl = read_raw(conn, config)
    return job_status(config, ctl, store, ttl, wall_clock(), health=read_health(conn, config))


def read_health(conn: Any, config: EtcdRendezvousConfig) -> list[RawKey]:
    """The nodes' health reports (``P/health/``; read-only, one key per node)."""
    prefix = config.run_prefix + "health/"
    resp = conn.call("read the nodes' health reports", lambda: conn.client.get_prefix_response(prefix))
    return [RawKey(kv.key.decode(errors="replace"), bytes(kv.value), int(kv.lease)) for kv in resp.kvs]


# --- command line ---------------------------------------------------------------------------------------------


def build_parser(prog: str = "spotrun status") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="The job as etcd sees it (read-only).")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True,
                   help="etcd endpoint(s), host:port[,host:port...] (as given to spotrun)")
    p.add_argument("--rdzv-id", "--rdzv_id", required=True, help="the job's run id (as given to spotrun)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="the job's --rdzv-conf: TLS (cacert, cert, key), auth (user, password), etcd_prefix, "
                        "etcd_timeout; the other keys are accepted and unused")
    p.add_argument("--watch", action="store_true", help="refresh in place until interrupted (Ctrl-C)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per line with --watch)")
    p.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)  # --watch: stop after N (tests)
    return p


def config_from_args(args: argparse.Namespace) -> EtcdRendezvousConfig:
    """The job's rendezvous config, parsed by the same code the agents use (same keys, same errors)."""
    conf = parse_rdzv_conf(args.rdzv_conf)
    # A look should fail fast: the agents ride out etcd_timeout (default 30 s), a person waits for this.
    conf.setdefault("etcd_timeout", str(STATUS_ETCD_TIMEOUT_S))
    params = RendezvousParameters(backend=BACKEND_NAME, endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                                  min_nodes=1, max_nodes=1, **conf)
    return EtcdRendezvousConfig.from_parameters(params)


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """``spotrun status`` / ``spotrun-status``; returns the exit status."""
    if prog is None:
        prog = "spotrun-status" if argv is None and sys.argv[0].endswith("spotrun-status") else "spotrun status"
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not (math.isfinite(args.interval) and args.interval > 0):
        parser.error(f"--interval must be > 0 seconds, got {args.interval}")
    try:
        config = config_from_args(args)
    except (RendezvousConfigError, LaunchConfigError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        conn = EtcdConnection(config)
    except RendezvousError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        return _loop(args, config, conn, prog)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        conn.close()


def _loop(args: argparse.Namespace, config: EtcdRendezvousConfig, conn: Any, prog: str) -> int:
    shown = 0
    interactive = sys.stdout.isatty()
    while True:
        try:
            status = read_status(config, conn)
        except RendezvousError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            if not args.watch:
                return EXIT_UNREACHABLE
            status = None
        if status is not None:
            if args.json:
                print(json.dumps(status.to_json()), flush=True)
            else:
                # In place: home the cursor and clear the screen (only on a terminal; a pipe gets frames).
                prefix = "\x1b[H\x1b[2J" if args.watch and interactive else ("\n" if shown else "")
                print(prefix + render(status), flush=True)
        shown += 1
        if not args.watch or (args.count is not None and shown >= args.count):
            return EXIT_OK
        time.sleep(args.interval)
