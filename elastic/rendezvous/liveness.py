"""A dead agent known in under a second when its process dies, instead of after its lease TTL.

etcd learns of a SIGKILLed, OOM-killed or crashed agent only when its lease expires (``lease_ttl``, 3 s by
default; etcd's floor is about 2 s), although the kernel closes a dead process's sockets at once. So every
agent also listens on a small TCP port (``LivenessListener``: it accepts connections and holds them, nothing
is ever sent) and publishes that port and its lease id in its registration. Each agent of a round holds one
connection to the next participant in rank order (``PeerWatch``; a ring: N connections for N agents, O(1) per
agent). When that connection ends, the watcher probes the port once: a refused connection means the host is up
and nothing listens there any more, i.e. the process is gone, and the watcher revokes the dead agent's lease
(the lease its registration key is held by, from etcd's key metadata: never an id the registration claims);
every peer's etcd watch then sees the registration go at once and the next round starts without waiting for
the TTL. On worker failure the agent can also probe every participant (``probe_all``): a collective broken
by a dead peer is confirmed in milliseconds (and two dead neighbours of the ring are both found).

A refusal proves a death only from a port this agent has seen accept, at the same address and for the same
lease (:class:`SeenAccepting`): a firewall that rejects, or a registration whose address (``getfqdn()``) leads
elsewhere, also refuses, for a peer that is alive. A peer never seen accepting is left to its lease TTL.

No false positives: a paused process (SIGSTOP, a long GC) keeps its sockets, and the kernel still completes
connections to its listening port, so nothing closes and a probe is accepted. A silent loss (power off, a
partition: no RST, no FIN) closes nothing and a probe times out; that stays bounded by the lease TTL, as before.
The decision is the pure :func:`verdict`; the sockets are at the edges.
"""

from __future__ import annotations

import enum
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.3
"""How long a probe waits for a connection: a live host refuses at once; a silent one settles nothing."""

MAX_PROBES_IN_FLIGHT = 16
"""``probe_all`` connects to at most this many peers at once."""


class Probe(enum.Enum):
    """What connecting to a peer's liveness port found."""

    ACCEPTED = "accepted"
    """Something listens there: the process is alive (maybe paused)."""
    REFUSED = "refused"
    """The host answered with a reset: nothing listens, the process is gone."""
    SILENT = "silent"
    """No answer (timeout, unreachable host or network): nothing can be concluded."""


class Verdict(enum.Enum):
    DEAD = "dead"
    ALIVE = "alive"
    UNKNOWN = "unknown"


def verdict(probe: Probe, *, seen_accepting: bool) -> Verdict:
    """A peer whose liveness port refuses connections is dead if that port was seen accepting before (else a
    firewall or a wrong address may refuse for a live peer); one that accepts is alive; silence proves nothing
    (the lease TTL decides). Pure."""
    if probe is Probe.REFUSED:
        return Verdict.DEAD if seen_accepting else Verdict.UNKNOWN
    return Verdict.ALIVE if probe is Probe.ACCEPTED else Verdict.UNKNOWN


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer agent as its registration describes it (validated by :func:`peer_from_registration`)."""

    node: str
    addr: str
    port: int
    lease: int


def peer_from_registration(node: str, info: object, lease: int) -> Peer | None:
    """The peer's liveness endpoint from its registration JSON, or None when it has none or it is malformed
    (an agent without the feature, or a damaged key: its death is then known by its lease only).

    ``lease`` is the lease the registration key is attached to, from etcd's key metadata (``kv.lease``): the
    ``lease`` field inside the JSON is ignored, since a registration naming another node's lease would make
    its peers revoke that live node's lease."""
    if not isinstance(info, dict):
        return None
    addr, port = info.get("addr"), info.get("live_port")
    if not isinstance(addr, str) or not 0 < len(addr) <= 255 or any(c.isspace() for c in addr):
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    if isinstance(lease, bool) or not isinstance(lease, int) or not 0 < lease < 2**63:
        return None
    return Peer(node=node, addr=addr, port=port, lease=lease)


def probe(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Probe:
    """Connect once to ``addr:port`` and close at once."""
    found = _connect(addr, port, timeout)
    if isinstance(found, Probe):
        return found
    found.close()
    return Probe.ACCEPTED


def _connect(addr: str, port: int, timeout: float) -> socket.socket | Probe:
    """A connection to ``addr:port``, or what the attempt found (refused, or nothing to conclude)."""
    try:
        return socket.create_connection((addr, port), timeout=timeout)
    except ConnectionRefusedError:
        return Probe.REFUSED
    # ValueError: an address (read from etcd) the resolver rejects ("x..y", a label over 63 characters raise
    # UnicodeError): like one that does not resolve, never an exception in the agent's monitor loop.
    except (OSError, ValueError):
        return Probe.SILENT


class SeenAccepting:
    """The liveness endpoints (address, port, lease) this agent has seen accept a connection; thread-safe,
    bounded (the oldest are forgotten first)."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, int], None] = {}

    @staticmethod
    def _key(peer: Peer) -> tuple[str, int, int]:
        return (peer.addr, peer.port, peer.lease)

    def add(self, peer: Peer) -> None:
        with self._lock:
            self._seen.pop(self._key(peer), None)
            self._seen[self._key(peer)] = None
            while len(self._seen) > self._limit:
                del self._seen[next(iter(self._seen))]

    def __contains__(self, peer: object) -> bool:
        with self._lock:
            return isinstance(peer, Peer) and self._key(peer) in self._seen


def probe_each(peers: Sequence[Peer], timeout: float = PROBE_TIMEOUT_S) -> list[Probe]:
    """Probe every peer at once (at most ``MAX_PROBES_IN_FLIGHT`` in flight); the results in ``peers``' order."""
    if not peers:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PROBES_IN_FLIGHT, len(peers)), thread_name_prefix="rdzv-probe") as pool:
        return list(pool.map(lambda p: probe(p.addr, p.port, timeout), peers))


def probe_all(peers: Sequence[Peer], seen: SeenAccepting, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Verdict]:
    """Probe every peer at once (bounded); node -> the verdict (a refusal is death only for a peer in ``seen``;
    those that accept are added to it)."""
    out = {}
    for peer, result in zip(peers, probe_each(peers, timeout)):
        if result is Probe.ACCEPTED:
            seen.add(peer)
        out[peer.node] = verdict(result, seen_accepting=peer in seen)
    return out


DEFAULT_MAX_HELD = 256
"""Most connections a listener holds at once (the port listens on every interface: anyone can connect)."""
ACCEPT_ERROR_PAUSE_S = 0.1
"""Pause after a failed accept (EMFILE, ENOBUFS...) before the next one."""


class LivenessListener:
    """This agent's liveness port: accepts connections and holds them until :meth:`close` or the process dies.

    At most ``max_held`` connections are held (the oldest is closed first: its watcher, if it is one, sees it
    end, probes, is accepted and connects again), so strangers connecting cannot exhaust this process's file
    descriptors; an accept that fails is retried after a short pause, never the end of the listener."""

    def __init__(self, max_held: int = DEFAULT_MAX_HELD) -> None:
        if max_held < 1:
            raise ValueError(f"max_held must be >= 1, got {max_held}")
        self._max_held = max_held
        self._sock = _listening_socket()
        self.port: int = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="rdzv-liveness", daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """How many connections are held now."""
        return len(self._held)

    def _accept_loop(self) -> None:
        failures = 0
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                failures += 1
                if failures == 1:
                    log.warning("liveness port %d: accept failed (%s); retrying", self.port, exc)
                self._closed.wait(ACCEPT_ERROR_PAUSE_S)
                continue
            failures = 0
            if self._closed.is_set():
                conn.close()
                return
            # Held, never read: a watcher's connection ends only when this process does. Connections whose
            # watcher went away are dropped from the list at the next accept; past the cap, the oldest go.
            held = []
            for c in self._held:
                if _still_open(c):
                    held.append(c)
                else:
                    c.close()
            held.append(conn)
            for old in held[: -self._max_held]:
                old.close()
            self._held = held[-self._max_held :]

    def close(self) -> None:
        self._closed.set()
        try:
            # Wakes the accept() of the listening thread: a socket closed while a thread blocks in accept()
            # stays listening (the syscall holds it) until that accept returns.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        for sock in [self._sock, *self._held]:
            try:
                sock.close()
            except OSError:
                pass
        self._held = []


class PeerWatch:
    """Holds one connection to one peer's liveness port; when it ends and a probe is refused, calls
    ``on_dead(peer)`` (once per watched peer). :meth:`watch` switches peers; :meth:`close` stops. A peer whose
    port refuses before it was ever seen accepting (``seen``) is not reported: it is tried again later."""

    def __init__(self, on_dead: Callable[[Peer], object], *, probe_timeout: float = PROBE_TIMEOUT_S,
                 seen: SeenAccepting | None = None) -> None:
        self._on_dead = on_dead
        self._probe_timeout = probe_timeout
        self.seen = SeenAccepting() if seen is None else seen
        self._lock = threading.Lock()
        self._holding: Peer | None = None
        self._target: Peer | None = None
        self._generation = 0
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, name="rdzv-peer-watch", daemon=True)
        self._thread.start()

    @property
    def target(self) -> Peer | None:
        return self._target

    @property
    def holding(self) -> Peer | None:
        """The peer whose liveness port this watcher holds a connection to now, if any."""
        return self._holding

    def watch(self, peer: Peer | None) -> None:
        with self._lock:
            if peer == self._target:
                return
            self._target = peer
            self._generation += 1
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._target = None
            self._generation += 1
        self._wake()
        self._thread.join(timeout=2.0)
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    peer, generation = self._target, self._generation
                if peer is None:
                    selector.select()
                    self._drain_wake()
                    continue
                self._watch_one(selector, peer, generation)
        finally:
            selector.close()

    def _current(self, generation: int) -> bool:
        with self._lock:
            return not self._closed and generation == self._generation

    def _watch_one(self, selector: selectors.BaseSelector, peer: Peer, generation: int) -> None:
        """Connect, wait for the connection to end (or a new target), then decide. Returns when done with
        ``peer``: dead and reported, replaced, or unreachable (the lease decides; retried after a pause)."""
        first = probe_connect(peer, self._probe_timeout)
        if isinstance(first, Probe):
            if verdict(first, seen_accepting=peer in self.seen) is Verdict.DEAD and self._current(generation):
                self._report(peer, generation)
            else:  # silent, or refused by a port never seen accepting: try again a little later
                if first is Probe.REFUSED:
                    log.debug("%s's liveness port %s:%d refuses before it was ever seen accepting: its lease "
                              "decides", peer.node, peer.addr, peer.port)
                selector.select(timeout=1.0)
                self._drain_wake()
            return
        conn = first
        self.seen.add(peer)
        selector.register(conn, selectors.EVENT_READ)
        self._holding = peer
        try:
            while self._current(generation):
                ready = selector.select()
                if any(key.fileobj is self._wake_r for key, _ in ready):
                    self._drain_wake()
                    continue
                if not _ended(conn):
                    continue
                # The connection ended: a dead process, or (rarely) a listener that closed it. Ask once.
                found = probe(peer.addr, peer.port, self._probe_timeout)
                if verdict(found, seen_accepting=True) is Verdict.DEAD and self._current(generation):
                    self._report(peer, generation)
                return
        finally:
            self._holding = None
            selector.unregister(conn)
            conn.close()

    def _report(self, peer: Peer, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                return
            self._target = None  # once per peer: a new round (or watch()) sets the next one
            self._generation += 1
        try:
            self._on_dead(peer)
        except Exception:  # the watcher must outlive a failed revoke (the lease TTL still bounds the loss)
            log.warning("reporting the death of %s failed", peer.node, exc_info=True)


def probe_connect(peer: Peer, timeout: float) -> socket.socket | Probe:
    """An open connection to the peer's liveness port, or what the attempt found."""
    conn = _connect(peer.addr, peer.port, timeout)
    if isinstance(conn, Probe):
        return conn
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return conn


def _ended(conn: socket.socket) -> bool:
    """A readable held connection has ended (the listener never sends): EOF or a reset."""
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _still_open(conn: socket.socket) -> bool:
    try:
        conn.setblocking(False)
        return conn.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _listening_socket() -> socket.socket:
    """An ephemeral port on every address (IPv6 dual-stack where available: peers dial our advertised name)."""
    if socket.has_ipv6:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
            sock.listen(128)
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(128)
    return sock
