"""Shared fixtures for the elastic tests.

``etcd_server``: a real etcd on free loopback ports, one per test. Shape (keep stable, other suites use it):
    .endpoint  "127.0.0.1:PORT"
    .stop()    terminate etcd (by PID, reaped); data dir and port are kept
    .start()   start again on the same data dir and port (keys and leases survive)
    .pid       PID of the running etcd, None when stopped
Teardown closes it (process reaped, data dir removed) even if the test failed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic.etcd_server import EmbeddedEtcd


@pytest.fixture
def etcd_server() -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd()
    try:
        server.start()
        yield server
    finally:
        server.close()
