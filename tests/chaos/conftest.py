"""Fixtures of the chaos suite: the elastic suite's real etcd (re-exported) and a real 3-member etcd cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.chaos import targets
from elastic.etcd_server import find_etcd_binary
from tests.elastic.conftest import etcd_server  # noqa: F401 (fixture re-exported)
from tests.harness.procs import free_port, wait_for


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[list[str]]:
    """Three etcd members on free loopback ports (fast elections); yields their client endpoints."""
    binary = find_etcd_binary()
    ports = [(free_port(), free_port()) for _ in range(3)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    procs = []
    logs = [open(tmp_path / f"m{i}.log", "wb") for i in range(3)]  # noqa: SIM115 (closed below)
    for i, (client, peer) in enumerate(ports):
        argv = [binary, "--name", f"m{i}", "--data-dir", str(tmp_path / f"m{i}"),
                "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", tmp_path.name,
                "--heartbeat-interval", "50", "--election-timeout", "500"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=logs[i],
                                      start_new_session=True))
    endpoints = [f"127.0.0.1:{client}" for client, _ in ports]
    try:
        wait_for(lambda: leader_or_none(endpoints), 30, "the etcd cluster to elect a leader")
        yield endpoints
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for log in logs:
            log.close()


def leader_or_none(endpoints: list[str]) -> str | None:
    try:
        return targets.etcd_leader(endpoints)
    except Exception:  # noqa: BLE001 (not elected yet)
        return None


