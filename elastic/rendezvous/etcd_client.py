"""The edge between the rendezvous and etcd: one connection, every call retried, errors converted.

Everything that touches etcd3/grpc goes through ``EtcdConnection``:

* ``call(what, fn)`` runs one etcd call under tenacity (exponential backoff, ``stop_after_delay(etcd_timeout)``)
  and turns the final failure into ``RendezvousConnectionError`` naming the endpoint;
* ``watch(...)`` opens a raw watch stream (python3-etcd3 0.13's own watcher thread dies with a NameError
  when its stream breaks, so we drive ``WatchStub`` ourselves and can resume from a revision).

Two python3-etcd3 quirks are handled here: a failed endpoint is blacklisted for 300 s by default (we set
``time_retry`` low so a restarted etcd is used again at once), and grpc's reconnect backoff (up to
120 s) is capped at 1 s so an etcd restart of a few seconds is noticed within a second.

Three more things python3-etcd3 does not do: it authenticates once, in its constructor, so its token dies
after etcd's ``--auth-token-ttl`` (300 s by default) of disuse and every later call fails with
``UNAUTHENTICATED: invalid auth token``; ``call`` re-authenticates and retries (``renew_token``, also used by
the watch and lease threads). A TLS handshake failure looks like any UNAVAILABLE error; ``classify`` tells
the kinds apart from grpc's status code and the words of grpc's own TLS layer (never a bare "handshake": a TCP
connect to an unreachable host says "tcp handshaker shutdown"), so a wrong CA or a missing client certificate
fails at once as ``RendezvousTLSError`` instead of being retried for ``etcd_timeout``, while a partition is
retried like any outage. The two failures grpc cannot name (a plaintext client of a TLS etcd sees "Socket
closed", a TLS client of a plaintext etcd "Handshake read failed") are settled by asking the server itself
(``probe_protocol``). Retry warnings are rate-limited to one per
``WARN_EVERY_S`` per call (the rest go to DEBUG), so an unreachable endpoint does not print dozens.

etcd's "too many requests" (``RESOURCE_EXHAUSTED``, ``is_overloaded``) is an answer, not an outage: ``call`` backs
off longer from it (jittered exponential up to ``OVERLOAD_MAX_WAIT_S``) and logs it at INFO. A process that
hosts many agents (``ClientPool``) also caps the requests its connections have in flight at once
(``max_in_flight``; in a burst each waits for its slot after a random pause of up to ``jitter_s``), so that a
thousand simultaneous lease grants and joins do not all hit etcd at once; a real agent has no pool: not capped.

A closed connection refuses new calls with ``ConnectionClosedError`` (its handler is stopping), and a pooled one
releases its share of the client only when its last call in flight has ended, so the pool never closes a
channel under a call that is still running.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import etcd3
import grpc
from etcd3 import etcdrpc, utils
from etcd3.client import EtcdTokenCallCredentials
from etcd3.exceptions import Etcd3Exception
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

from .api import EtcdRendezvousConfig, RendezvousConnectionError, RendezvousTLSError

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Detect a silently dead server on long-lived watch streams (etcd allows pings every >= 5 s).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

PER_CALL_TIMEOUT = 5.0
"""Seconds one etcd RPC may take before it counts as a failed attempt (and is retried)."""

WARN_EVERY_S = 5.0
"""Fewest seconds between two WARNING lines about the retries of one etcd call."""

OVERLOAD_MULTIPLIER_S = 0.2
OVERLOAD_MAX_WAIT_S = 4.0
"""Backoff after etcd's "too many requests": random up to 0.2, 0.4, 0.8 ... s, at most 4 s (full jitter)."""

POOL_MAX_IN_FLIGHT = 32
"""Requests the connections of one ``ClientPool`` may have in flight at once (``call``, not streams)."""

POOL_JITTER_S = 0.01
"""Longest random pause before a pooled request asks for its slot (spreads a burst of many agents)."""

# grpc reports a failed TLS handshake as UNAVAILABLE, with its TLS layer's (TSI) and OpenSSL's words in the
# details, e.g. "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: ...: CERTIFICATE_VERIFY_FAILED".
# Only words that no TCP-level failure contains: "tcp handshaker shutdown" (a connect that timed out or a
# dropped link) must stay an outage.
_TLS_MARKERS = (
    "tls handshake failed",
    "tsi_protocol_failure",
    "ssl_error_ssl",
    "certificate_verify_failed",
    "bad_certificate",
    "certificate_required",
    "wrong_version_number",
)
# A security mismatch grpc reports in words that a transient failure may use too: settled by a probe.
_PLAINTEXT_CLIENT_OF_TLS = "socket closed"
"""A plaintext client of a TLS etcd: the server closes the connection after the client's HTTP/2 preface."""
_TLS_CLIENT_OF_PLAINTEXT = "handshake read failed"
"""A TLS client of a plaintext etcd: the server closes the connection after the ClientHello."""

# etcd's answers to an expired token (simple tokens die after --auth-token-ttl of disuse) or a token minted
# before an auth change; both are cured by authenticating again.
_TOKEN_MARKERS = ("invalid auth token", "revision of auth store is old", "auth token is expired")


def grpc_error(exc: BaseException | None) -> grpc.RpcError | None:
    """The grpc error behind ``exc``: python3-etcd3 replaces UNAVAILABLE & co. by its own detail-less
    exceptions (``ConnectionFailedError``), raised while handling the grpc one."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _grpc_code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None


def _grpc_details(exc: BaseException) -> str:
    return (exc.details() or "") if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else ""


def is_token_expired(exc: BaseException | None) -> bool:
    """etcd rejected our auth token (expired or stale): authenticate again and retry."""
    if exc is None or _grpc_code(exc) not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
        return False
    details = _grpc_details(exc).lower()
    return any(marker in details for marker in _TOKEN_MARKERS)


def is_auth_refusal(cancel_reason: str) -> bool:
    """A watch canceled for its token: etcd says "invalid auth token", or, for a token it no longer knows
    (a restarted etcd forgets simple tokens), "permission denied"."""
    reason = cancel_reason.lower()
    return "permission denied" in reason or any(marker in reason for marker in _TOKEN_MARKERS)


class Failure(enum.Enum):
    """What a failed etcd RPC means for the caller."""

    TLS = "tls"
    """The TLS handshake failed (certificates, CA): permanent, the configuration must change."""
    MAYBE_TLS_MISMATCH = "maybe-tls-mismatch"
    """Plaintext against TLS or the reverse, or an ordinary broken connection: ``probe_protocol`` decides."""
    TRANSIENT = "transient"
    """etcd unreachable, restarting, electing a leader, overloaded: retry within etcd_timeout."""
    PERMANENT = "permanent"
    """etcd answered and refused (permission, bad request, not found): retrying cannot help."""


def classify(code: grpc.StatusCode | None, details: str) -> Failure:
    """Classify one grpc failure by its status code first, then, for UNAVAILABLE only, by the unambiguous
    words of grpc's TLS layer. Pure: unit-tested with the exact details of each kind of failure."""
    if code not in _TRANSIENT_CODES:
        return Failure.PERMANENT
    if code != grpc.StatusCode.UNAVAILABLE:
        return Failure.TRANSIENT
    words = details.lower()
    if any(marker in words for marker in _TLS_MARKERS):
        return Failure.TLS
    if _PLAINTEXT_CLIENT_OF_TLS in words or _TLS_CLIENT_OF_PLAINTEXT in words:
        return Failure.MAYBE_TLS_MISMATCH
    return Failure.TRANSIENT


def is_tls_failure(exc: BaseException | None) -> bool:
    """The connection failed in the TLS handshake: retrying cannot help, the certificates must change."""
    exc = grpc_error(exc)
    return exc is not None and classify(_grpc_code(exc), _grpc_details(exc)) is Failure.TLS


def is_overloaded(exc: BaseException | None) -> bool:
    """etcd answered "too many requests" (``RESOURCE_EXHAUSTED``): it is reachable but busy; back off longer."""
    behind = grpc_error(exc)
    return behind is not None and _grpc_code(behind) == grpc.StatusCode.RESOURCE_EXHAUSTED


def overload_aware_wait(normal: Callable[[Any], float]) -> Callable[[Any], float]:
    """A tenacity wait: ``normal`` after a failure, a longer jittered exponential after "too many requests"."""
    overloaded = wait_random_exponential(multiplier=OVERLOAD_MULTIPLIER_S, max=OVERLOAD_MAX_WAIT_S)

    def wait(state: Any) -> float:
        exc = state.outcome.exception() if state.outcome else None
        return overloaded(state) if is_overloaded(exc) else normal(state)

    return wait


def is_closed_channel(exc: BaseException | None) -> bool:
    """grpc refused to start a call because its channel was closed (``ValueError``: "... closed channel!")."""
    return isinstance(exc, ValueError) and "closed channel" in str(exc)


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: etcd unreachable, restarting, electing a leader, or overloaded."""
    if is_tls_failure(exc):
        return False
    if isinstance(exc, grpc.RpcError):
        return classify(_grpc_code(exc), _grpc_details(exc)) in (Failure.TRANSIENT, Failure.MAYBE_TLS_MISMATCH)
    if isinstance(exc, Etcd3Exception):
        return True  # ConnectionFailed/Timeout/InternalServerError/NoServerAvailable
    # python3-etcd3 raises ValueError('Trying to use a failed node') while an endpoint is blacklisted.
    return isinstance(exc, ValueError) and "failed node" in str(exc)


PROBE_TIMEOUT = 1.0
"""Seconds ``probe_protocol`` waits to connect and for the server's first answer."""

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
_H2_SETTINGS = 0x04


def probe_protocol(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """What the server at ``host:port`` speaks, asked directly: ``"tls"`` when it completes a TLS handshake or
    answers one with a TLS alert, ``"plaintext"`` when it answers an HTTP/2 preface with a SETTINGS frame (as
    etcd does without TLS), None when it cannot be told (unreachable, closed on both, or slow). Only a positive
    answer counts: a server that merely closed the connection (a restarting etcd) never settles anything."""
    if _answers_tls(host, port, timeout):
        return "tls"
    if _answers_h2c(host, port, timeout):
        return "plaintext"
    return None


def _answers_tls(host: str, port: int, timeout: float) -> bool:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # asks what the server speaks, not whether to trust it
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, context.wrap_socket(raw):
            return True
    except ssl.SSLError as exc:
        # A TLS server that wants a client certificate (TLS 1.2) ends the handshake with an alert: TLS all the same.
        return "alert" in str(exc).lower() and not isinstance(exc, ssl.SSLEOFError)
    except OSError:
        return False


def _answers_h2c(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_H2_PREFACE)
            header = b""
            while len(header) < 9:
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    return False
                header += chunk
            return header[3] == _H2_SETTINGS
    except OSError:
        return False


def tls_mismatch(config: EtcdRendezvousConfig, spoken: str | None) -> bool:
    """The client's TLS setting contradicts what the server was found to speak (pure)."""
    if spoken is None:
        return False
    return (spoken == "tls") != (config.cacert is not None)


def prefix_end(prefix: str) -> bytes:
    """The etcd range end covering every key that starts with ``prefix``."""
    return utils.prefix_range_end(utils.to_bytes(prefix))


class ClientPool:
    """etcd clients (one gRPC channel each) shared by the connections of one process that use the same
    endpoints and credentials: a simulation or a test hosting many agents in one process opens one channel
    instead of one per agent. A real agent has one connection and needs none. Thread-safe.

    It shares other per-process helpers the same way (``acquire_shared``: the lease keeper, one thread and
    one stream per tick for every agent's lease), and bounds the load its connections put on etcd: at most
    ``max_in_flight`` of their calls have a request in flight at once (``slot``); a call that finds none free waits
    for one after a random pause of up to ``jitter_s`` s (the lease keeper's and the watches' streams are not
    counted)."""

    def __init__(self, max_in_flight: int = POOL_MAX_IN_FLIGHT, jitter_s: float = POOL_JITTER_S) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        if jitter_s < 0:
            raise ValueError(f"jitter_s must be >= 0, got {jitter_s!r}")
        self._lock = threading.RLock()  # reentrant: a shared helper's ``make`` acquires the shared client
        self._clients: dict[tuple[Any, ...], list[Any]] = {}
        """key -> [client or helper, references]."""
        self.max_in_flight = max_in_flight
        self.jitter_s = jitter_s
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._held = threading.local()
        """Per thread: how deep it is in ``slot`` (a call made within a call does not take a second slot)."""

    @property
    def open_count(self) -> int:
        """How many shared clients and helpers are open now (the last user to release one closes it)."""
        with self._lock:
            return len(self._clients)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one of the pool's ``max_in_flight`` request slots; when none is free (a burst), wait for one after a
        random pause of up to ``jitter_s`` s, so that the calls of a burst do not all go in the same instant."""
        depth = getattr(self._held, "depth", 0)
        if depth:
            self._held.depth = depth + 1
            try:
                yield
            finally:
                self._held.depth = depth
            return
        if not self._slots.acquire(blocking=False):  # a burst: spread its calls, then wait for a slot
            if self.jitter_s > 0:
                time.sleep(random.uniform(0.0, self.jitter_s))
            self._slots.acquire()
        self._held.depth = 1
        try:
            yield
        finally:
            self._held.depth = 0
            self._slots.release()

    @staticmethod
    def key(config: EtcdRendezvousConfig) -> tuple[Any, ...]:
        return (config.endpoints, config.cacert, config.cert, config.key, config.user, config.password,
                config.etcd_timeout)

    def acquire(self, config: EtcdRendezvousConfig, make: Callable[[], T]) -> T:
        """The shared client for ``config`` (made by ``make`` the first time); pair with ``release``."""
        return self.acquire_shared(("client", *self.key(config)), make)

    def release(self, config: EtcdRendezvousConfig) -> Any | None:
        """Drop one reference; returns the client to close when it was the last one (else None)."""
        return self.release_shared(("client", *self.key(config)))

    def acquire_shared(self, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """The object shared under ``key`` (made by ``make`` the first time); pair with ``release_shared``."""
        with self._lock:
            entry = self._clients.get(key)
            if entry is None:
                entry = self._clients[key] = [make(), 0]
            entry[1] += 1
            return entry[0]

    def release_shared(self, key: tuple[Any, ...]) -> Any | None:
        """Drop one reference to ``key``'s object; returns it when that was the last one (else None)."""
        with self._lock:
            entry = self._clients.get(key)
            if entry is None:
                return None
            entry[1] -= 1
            if entry[1] > 0:
                return None
            del self._clients[key]
            return entry[0]


class EtcdConnection:
    """A client for the configured endpoint(s) plus the retry/conversion policy."""

    def __init__(
        self,
        config: EtcdRendezvousConfig,
        *,
        context: Callable[[], str] = lambda: "",
        sleep: Callable[[float], None] | None = None,
        pool: ClientPool | None = None,
    ) -> None:
        self.config = config
        self._context = context
        self._sleep = sleep
        self._pool = pool
        self.per_call_timeout = min(PER_CALL_TIMEOUT, config.etcd_timeout)
        self._auth_lock = threading.Lock()
        self._protocol_agrees = False
        """A probe found the server speaking what we speak: "Socket closed" & co. are outages from then on."""
        self._use_lock = threading.Lock()
        self._in_use = 0
        """Calls (``in_use``) running now: a pooled connection releases its client once the last one ended."""
        self._closed = False
        self._release_pending = False
        if pool is None:
            self.client = self.call("connect", self._make_client)
        else:
            self.client = self.call("connect", lambda: pool.acquire(config, self._make_client))

    def _make_client(self) -> etcd3.MultiEndpointEtcd3Client:
        cfg = self.config
        creds = None
        if cfg.cacert is not None:
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(cfg.cacert, cfg.key, cfg.cert)
        many = len(cfg.endpoints) > 1
        endpoints = [
            etcd3.Endpoint(
                f"[{host}]" if ":" in host else host,  # python3-etcd3 builds "host:port" for grpc
                port,
                secure=creds is not None,
                creds=creds,
                # Blacklist a failed endpoint only if there is another one to fail over to.
                time_retry=1.0 if many else 0.0,
                opts=_GRPC_OPTIONS,  # grpc wants a list of pairs
            )
            for host, port in cfg.endpoints
        ]
        # The constructor authenticates (one RPC) when user/password are set.
        client = etcd3.MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=self.per_call_timeout,
            user=cfg.user,
            password=cfg.password,
            failover=many,
        )
        if creds is None:
            # grpc refuses call credentials on a plaintext channel ("insufficient security level");
            # the auth token also travels as plain metadata, which etcd accepts.
            client.call_credentials = None
        return client

    # ------------------------------------------------------------------ auth
    def renew_token(self, stale: BaseException | None = None) -> None:
        """Authenticate again and give the client the new token (python3-etcd3 only does it once).

        Thread-safe; a no-op without user/password. Raises grpc/etcd3 errors like any call."""
        cfg = self.config
        if cfg.user is None or cfg.password is None:
            return
        with self._auth_lock:
            client = self.client
            request = etcdrpc.AuthenticateRequest(name=cfg.user, password=cfg.password)
            resp = client.authstub.Authenticate(request, self.per_call_timeout)
            client.metadata = (("token", resp.token),)
            if client.call_credentials is not None:  # TLS channels carry the token as call credentials
                client.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(resp.token))
        log.info("%sre-authenticated to etcd as %r (%s)", self._context(), cfg.user, describe(stale))

    def _renewing_token(self, fn: Callable[[], T]) -> Callable[[], T]:
        def attempt() -> T:
            try:
                return fn()
            except grpc.RpcError as exc:
                if not is_token_expired(exc):
                    self._check_protocol(exc)
                    raise
                self.renew_token(exc)
                raise _TokenRenewed(describe(exc)) from exc
            except Etcd3Exception as exc:  # python3-etcd3's stand-in for UNAVAILABLE & co.
                self._check_protocol(exc)
                raise

        return attempt

    def _check_protocol(self, exc: BaseException) -> None:
        """Raise ``RendezvousTLSError`` when a failure that may be a TLS mismatch is one (asked of the server)."""
        behind = grpc_error(exc)
        if self._protocol_agrees or behind is None:
            return
        if classify(_grpc_code(behind), _grpc_details(behind)) is not Failure.MAYBE_TLS_MISMATCH:
            return
        for host, port in self.config.endpoints:
            spoken = probe_protocol(host, port)
            if tls_mismatch(self.config, spoken):
                raise RendezvousTLSError(mismatch_advice(self.config, self._context(), host, port, spoken))
            if spoken is not None:
                self._protocol_agrees = True
                return

    # ------------------------------------------------------------------ calls
    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def in_use(self, what: str) -> Iterator[None]:
        """Mark a use of the client (a call, a stream): ``close`` lets a pooled client go only after the last
        one ended. Raises ``ConnectionClosedError`` once the connection is closed."""
        with self._use_lock:
            self._raise_if_closed_now(what)
            self._in_use += 1
        try:
            yield
        finally:
            with self._use_lock:
                self._in_use -= 1
                release = self._release_pending and self._in_use == 0
                if release:
                    self._release_pending = False
            if release:
                self._release_client()

    def read_range(self, key: str, range_end: bytes | None) -> Any:
        """One Range request: ``key`` alone (``range_end`` None) or ``[key, range_end)``; the raw response (its
        ``kvs`` and ``header.revision``). Not retried: callers wrap it in ``call``."""
        if range_end is None:
            return self.client.get_response(key)
        return self.client.get_range_response(key, range_end)

    def call(self, what: str, fn: Callable[[], T], *, within: float | None = None) -> T:
        """Run ``fn`` with retries on transient errors for ``within`` (default etcd_timeout) seconds.

        An expired auth token is renewed and the call retried; a TLS handshake failure raises
        ``RendezvousTLSError`` at once; etcd's "too many requests" is retried after a longer backoff. With a
        pool, each attempt holds one of the pool's request slots. Once the connection is closed the call
        raises ``ConnectionClosedError`` (at once, or after the attempt in flight)."""
        with self.in_use(what):
            return self._call(what, fn, within)

    def _call(self, what: str, fn: Callable[[], T], within: float | None) -> T:
        limit = self.config.etcd_timeout if within is None else within
        kwargs: dict[str, Any] = {}
        if self._sleep is not None:
            kwargs["sleep"] = self._sleep
        retrying = Retrying(
            stop=stop_after_delay(limit),
            wait=overload_aware_wait(wait_random_exponential(multiplier=0.05, max=1.0)),
            retry=retry_if_exception(
                lambda exc: not self._closed and (isinstance(exc, _TokenRenewed) or is_transient(exc))),
            before_sleep=self._log_retry(what),
            **kwargs,
        )
        attempt = self._renewing_token(fn)
        pool = self._pool
        if pool is not None and hasattr(self, "client"):  # connected: each attempt holds one of the pool's slots
            attempt = self._in_slot(pool, attempt)
        try:
            return retrying(attempt)
        except ConnectionClosedError:
            raise
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            self._raise_if_closed(what, cause)
            if is_overloaded(cause):
                raise RendezvousConnectionError(
                    f"{self._context()}etcd at {self.config.endpoint_str} answered \"too many requests\" for "
                    f"{limit:.0f} s while trying to {what}: {describe(cause)}. etcd is overloaded: fewer agents per "
                    f"etcd, a faster etcd, or a higher etcd_timeout in --rdzv-conf."
                ) from cause
            raise RendezvousConnectionError(
                f"{self._context()}etcd at {self.config.endpoint_str} unreachable for {limit:.0f} s "
                f"while trying to {what}: {describe(cause)}. Check that etcd is running and "
                f"reachable, or raise etcd_timeout in --rdzv-conf."
            ) from cause
        except (grpc.RpcError, Etcd3Exception, ValueError) as exc:
            self._raise_if_closed(what, exc)
            if is_tls_failure(exc):
                raise RendezvousTLSError(tls_advice(self.config, self._context(), grpc_error(exc))) from exc
            if isinstance(exc, ValueError) and not is_transient(exc):
                raise
            raise RendezvousConnectionError(
                f"{self._context()}etcd at {self.config.endpoint_str} refused to {what}: {describe(exc)}"
            ) from exc
        except OSError as exc:  # unreadable TLS files
            raise RendezvousConnectionError(
                f"{self._context()}cannot set up the etcd connection to {self.config.endpoint_str}: {exc}"
            ) from exc

    def _raise_if_closed(self, what: str, exc: BaseException | None) -> None:
        """The connection was closed under the call (its handler is stopping): whatever failed, say that."""
        if self._closed or is_closed_channel(exc):
            raise ConnectionClosedError(
                f"{self._context()}the etcd connection was closed while trying to {what} (stopping): "
                f"{describe(exc)}") from exc

    def _raise_if_closed_now(self, what: str) -> None:
        if self._closed:
            raise ConnectionClosedError(f"{self._context()}the etcd connection is closed (stopping): did not {what}")

    @staticmethod
    def _in_slot(pool: ClientPool, fn: Callable[[], T]) -> Callable[[], T]:
        def attempt() -> T:
            with pool.slot():
                return fn()

        return attempt

    def _log_retry(self, what: str) -> Callable[[Any], None]:
        last_warning: list[float] = []  # seconds_since_start of the last WARNING of this call

        def before_sleep(state: Any) -> None:
            exc = state.outcome.exception() if state.outcome else None
            level = logging.DEBUG  # a renewed token, or a repeat within WARN_EVERY_S of the last warning
            if isinstance(exc, _TokenRenewed):
                pass
            elif is_overloaded(exc):  # an answer from a busy etcd, not an outage: INFO, every WARN_EVERY_S
                if not last_warning or state.seconds_since_start - last_warning[0] >= WARN_EVERY_S:
                    level = logging.INFO
                    last_warning[:] = [state.seconds_since_start]
                log.log(level, "%setcd is overloaded (%s) while trying to %s (attempt %d, %.1f s so far); backing off",
                        self._context(), describe(exc), what, state.attempt_number, state.seconds_since_start)
                return
            elif state.attempt_number < 3:
                level = logging.INFO
            elif not last_warning or state.seconds_since_start - last_warning[0] >= WARN_EVERY_S:
                level = logging.WARNING
                last_warning[:] = [state.seconds_since_start]
            log.log(
                level,
                "%setcd %s failed (attempt %d, %.1f s so far): %s; retrying",
                self._context(),
                what,
                state.attempt_number,
                state.seconds_since_start,
                describe(exc),
            )

        return before_sleep

    def close(self) -> None:
        """Refuse new calls; give the client back (pooled: once the calls in flight ended) or close it. Idempotent."""
        with self._use_lock:
            if self._closed:
                return
            self._closed = True
            if self._pool is not None and self._in_use:
                self._release_pending = True  # the last call in flight releases it (``in_use``)
                return
        self._release_client()

    def _release_client(self) -> None:
        if self._pool is not None:
            client = self._pool.release(self.config)
            if client is None:
                return  # other connections still use it
        else:
            client = getattr(self, "client", None)
            if client is None:
                return
        try:
            client.close()
        except Exception:  # best effort on the way out
            log.debug("%sclosing the etcd client failed", self._context(), exc_info=True)

    # ------------------------------------------------------------------ watch streams
    def watch(
        self,
        key: str,
        *,
        range_end: bytes | None,
        start_revision: int,
        timeout: float | None = None,
        progress_notify: bool = False,
    ) -> WatchStream:
        """Open a watch on ``[key, range_end)`` from ``start_revision``; iterate it for responses."""
        self._raise_if_closed_now("watch")
        create = etcdrpc.WatchCreateRequest(
            key=utils.to_bytes(key), start_revision=start_revision, progress_notify=progress_notify
        )
        if range_end is not None:
            create.range_end = range_end
        stub = etcdrpc.WatchStub(self.client.channel)
        return WatchStream(stub, [etcdrpc.WatchRequest(create_request=create)], self.client, timeout)

    def watch_ranges(self, ranges: list[tuple[str, bytes | None, int]]) -> WatchStream:
        """Open one watch stream with a watcher per ``(key, range_end, start_revision)``.

        etcd numbers the watchers of a stream in creation order (0, 1, ...): a response's ``watch_id`` is the
        index of its range in ``ranges``. Each watcher keeps its own revision order, not the others'."""
        self._raise_if_closed_now("watch")
        requests = []
        for key, range_end, start_revision in ranges:
            create = etcdrpc.WatchCreateRequest(key=utils.to_bytes(key), start_revision=start_revision)
            if range_end is not None:
                create.range_end = range_end
            requests.append(etcdrpc.WatchRequest(create_request=create))
        stub = etcdrpc.WatchStub(self.client.channel)
        return WatchStream(stub, requests, self.client, None)


class WatchStream:
    """One etcd watch RPC (one or more watchers); ``cancel()`` from any thread ends the iteration."""

    def __init__(self, stub: Any, creates: list[Any], client: Any, timeout: float | None) -> None:
        self._done = threading.Event()

        def requests() -> Iterator[Any]:
            yield from creates
            # Keep the request side open: half-closing could end the watch on some servers.
            self._done.wait()

        self._call = stub.Watch(
            requests(), timeout=timeout, metadata=client.metadata, credentials=client.call_credentials
        )

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._call
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._done.set()
        self._call.cancel()


class WatchCanceledError(Etcd3Exception):
    """etcd canceled the watch (compaction or server-side cancel); resync from a fresh read."""


class ConnectionClosedError(RendezvousConnectionError):
    """The connection was closed (its handler is stopping) before or while a call ran: a thread that gets it
    while stopping ends quietly."""


class _TokenRenewed(Exception):
    """The auth token had expired and was renewed: retry the call at once."""


def tls_advice(config: EtcdRendezvousConfig, context: str, exc: BaseException | None) -> str:
    """What a failed TLS handshake means for this configuration, and what to check."""
    if config.cacert is None:
        hint = "etcd seems to speak TLS: pass cacert (and cert/key if etcd checks client certificates) in --rdzv-conf"
    elif config.cert is None:
        hint = (
            "check that cacert is the CA that signed etcd's server certificate (and that the certificate names "
            "the endpoint's host), and pass cert/key if etcd runs with --client-cert-auth"
        )
    else:
        hint = "check that cacert signed etcd's certificate and that etcd trusts the CA of cert"
    return f"{context}TLS handshake with etcd at {config.endpoint_str} failed: {describe(exc)}. Hint: {hint}"


def mismatch_advice(config: EtcdRendezvousConfig, context: str, host: str, port: int, spoken: str | None) -> str:
    """A client and an etcd that disagree on TLS: which side speaks what, and what to pass."""
    where = f"{host}:{port}"
    if spoken == "tls":
        return (f"{context}etcd at {where} speaks TLS but the rendezvous connects without it. Hint: pass cacert "
                "(and cert/key if etcd checks client certificates) in --rdzv-conf")
    return (f"{context}etcd at {where} speaks plaintext but the rendezvous connects with TLS (cacert is set). "
            "Hint: remove cacert/cert/key from --rdzv-conf, or start etcd with TLS (--cert-file/--key-file)")


def describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    behind = grpc_error(exc)
    if behind is not None:
        return f"{type(exc).__name__} ({describe(behind)})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
