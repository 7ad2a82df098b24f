"""EmbeddedEtcd: a real etcd child process, started/stopped/restarted by PID on free loopback ports."""

from __future__ import annotations

import os
import socket
import time

import etcd3
import pytest

from elastic.etcd_server import EmbeddedEtcd, EtcdServerError, find_etcd_binary
from tests.harness.procs import pid_alive

pytestmark = pytest.mark.timeout(60)


def _client(endpoint: str) -> etcd3.Etcd3Client:
    host, port = endpoint.rsplit(":", 1)
    return etcd3.client(host=host, port=int(port), timeout=5)


def test_start_put_get_stop_restart_same_data_and_port() -> None:
    server = EmbeddedEtcd()
    try:
        began = time.monotonic()
        server.start()
        startup = time.monotonic() - began
        endpoint, first_pid, data_dir = server.endpoint, server.pid, server.data_dir
        assert endpoint.startswith("127.0.0.1:")
        assert first_pid is not None and pid_alive(first_pid)
        # Generous bound (shared 2-core machine); typically ~0.2 s alone.
        assert startup < 5.0, f"etcd took {startup:.2f} s to become healthy"

        client = _client(endpoint)
        client.put("/k", "v1")
        server.stop()
        assert server.pid is None
        assert not pid_alive(first_pid), "stop() must terminate and reap etcd"
        assert os.path.isdir(data_dir), "stop() keeps the data dir for a restart"

        server.start()
        assert server.endpoint == endpoint, "restart must reuse the client port"
        assert server.pid != first_pid
        value, _ = _client(endpoint).get("/k")
        assert value == b"v1", "restart must reuse the data dir"
        client.close()
    finally:
        last_pid = server.pid
        server.close()
    assert last_pid is not None and not pid_alive(last_pid)
    assert not os.path.exists(data_dir), "close() removes the data dir"
    server.close()  # idempotent


def test_context_manager_cleans_up_and_refuses_reuse() -> None:
    with EmbeddedEtcd() as server:
        pid, root = server.pid, os.path.dirname(server.data_dir)
        assert pid is not None and pid_alive(pid)
    assert not pid_alive(pid)
    assert not os.path.exists(root)
    with pytest.raises(EtcdServerError, match="closed"):
        server.start()


def test_port_taken_between_probe_and_bind_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first probed client port is already held by someone else: start() must move on."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    import elastic.etcd_server as mod

    real_free_port = mod.free_port
    calls = {"n": 0}

    def fake_free_port(host: str) -> int:
        calls["n"] += 1
        return taken if calls["n"] == 1 else real_free_port(host)

    monkeypatch.setattr(mod, "free_port", fake_free_port)
    try:
        with EmbeddedEtcd() as server:
            assert server.client_port != taken
            assert _client(server.endpoint).status().version
    finally:
        holder.close()


def test_missing_binary_error_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRUN_ETCD_BINARY", "/nonexistent/etcd")
    with pytest.raises(EtcdServerError, match="SPOTRUN_ETCD_BINARY"):
        find_etcd_binary()


def test_fixture_shape(etcd_server: EmbeddedEtcd) -> None:
    """The shared fixture other suites rely on: endpoint, stop(), start() on the same port."""
    endpoint = etcd_server.endpoint
    _client(endpoint).put("/shape", "1")
    etcd_server.stop()
    etcd_server.start()
    assert etcd_server.endpoint == endpoint
    assert _client(endpoint).get("/shape")[0] == b"1"
