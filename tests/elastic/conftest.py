"""Shared fixtures for the elastic tests.

``etcd_server``: a real etcd on free loopback ports, one per test. Shape (keep stable, other suites use it):
    .endpoint  "127.0.0.1:PORT"
    .stop()    terminate etcd (by PID, reaped); data dir and port are kept
    .start()   start again on the same data dir and port (keys and leases survive)
    .pid       PID of the running etcd, None when stopped
Teardown closes it (process reaped, data dir removed) even if the test failed.

``handlers`` (a factory of rendezvous handlers, all released at teardown) and ``pool`` (threads): shared by the
rendezvous suites, which take them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.api import EtcdRendezvousConfig
from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler


@pytest.fixture
def etcd_server() -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def handlers() -> Iterator[Callable[..., EtcdV3RendezvousHandler]]:
    """Factory of handlers that are all released at teardown (leave(): the etcd may already be gone)."""
    made: list[EtcdV3RendezvousHandler] = []

    def make(config: EtcdRendezvousConfig, node_id: str | None = None, **kwargs: Any) -> EtcdV3RendezvousHandler:
        handler = EtcdV3RendezvousHandler(config, node_id=node_id, **kwargs)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler.simulate_crash()  # no etcd calls: fast teardown even when etcd was stopped


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor
