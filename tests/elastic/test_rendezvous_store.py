"""EtcdV3Store contract: the c10d Store operations torch's agent and store_util use, on a real etcd."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils import store as store_util

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.api import EtcdRendezvousConfig
from elastic.rendezvous.etcd_client import EtcdConnection
from elastic.rendezvous.store import EtcdV3Store

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def connection(etcd_server: EmbeddedEtcd) -> Iterator[EtcdConnection]:
    host, port = etcd_server.endpoint.rsplit(":", 1)
    cfg = EtcdRendezvousConfig(run_id="s", endpoints=((host, int(port)),), min_nodes=1, max_nodes=1, etcd_timeout=5)
    conn = EtcdConnection(cfg)
    yield conn
    conn.close()


@pytest.fixture
def store(connection: EtcdConnection) -> EtcdV3Store:
    return EtcdV3Store(connection, "/t/store/1/", timedelta(seconds=5))


def test_is_a_torch_store(store: EtcdV3Store) -> None:
    assert isinstance(store, dist.Store)
    assert store.timeout == timedelta(seconds=5)


def test_set_get_str_and_bytes(store: EtcdV3Store) -> None:
    store.set("a", "x")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"x"
    assert store.get("b") == b"\x00\xff"


def test_add_is_atomic_under_concurrency(store: EtcdV3Store) -> None:
    assert store.add("n", 5) == 5
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: store.add("n", 1), range(40)))
    assert sorted(results) == list(range(6, 46))
    assert store.get("n") == b"45"


def test_get_blocks_until_set(store: EtcdV3Store) -> None:
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(store.get, "late")
        time.sleep(0.2)  # make sure the getter is already waiting (asserting it has not returned)
        assert not fut.done()
        began = time.monotonic()
        store.set("late", "v")
        assert fut.result(timeout=5) == b"v"
        assert time.monotonic() - began < 1.0, "a watch wakes the getter, not a slow poll"


def test_wait_times_out_with_dist_store_error(store: EtcdV3Store) -> None:
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.wait(["missing"], timedelta(milliseconds=300))
    assert 0.25 < time.monotonic() - began < 3
    store.set_timeout(timedelta(milliseconds=200))
    with pytest.raises(dist.DistStoreError):
        store.get("missing")


def test_check_delete_num_keys_list(store: EtcdV3Store) -> None:
    store.set("k1", "1")
    store.set("k2", "2")
    assert store.check(["k1", "k2"]) and not store.check(["k1", "nope"])
    assert store.num_keys() == 2
    assert sorted(store.list_keys()) == ["k1", "k2"]
    assert store.delete_key("k1") is True
    assert store.delete_key("k1") is False
    assert store.num_keys() == 1


def test_compare_set_semantics(store: EtcdV3Store) -> None:
    # missing key + empty expected: set
    assert store.compare_set("c", "", "first") == b"first"
    # mismatch: current value returned, unchanged
    assert store.compare_set("c", "wrong", "second") == b"first"
    # match: swapped
    assert store.compare_set("c", "first", "second") == b"second"
    # missing key + non-empty expected: expected returned, nothing set
    assert store.compare_set("absent", "e", "d") == b"e"
    assert not store.check(["absent"])


def test_multi_get_multi_set(store: EtcdV3Store) -> None:
    store.multi_set(["m1", "m2"], ["a", b"b"])
    assert store.multi_get(["m1", "m2"]) == [b"a", b"b"]


def test_prefixes_isolate_rounds(connection: EtcdConnection) -> None:
    r1 = EtcdV3Store(connection, "/t/store/1/", timedelta(seconds=1))
    r2 = EtcdV3Store(connection, "/t/store/2/", timedelta(seconds=1))
    r1.set("k", "old")
    assert not r2.check(["k"])


def test_store_util_barrier_and_synchronize(connection: EtcdConnection) -> None:
    stores = [EtcdV3Store(connection, "/t/store/9/", timedelta(seconds=10)) for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda s: store_util.barrier(s, 3, key_prefix="b/", barrier_timeout=10), stores))
        gathered = list(
            pool.map(
                lambda args: store_util.synchronize(args[1], f"d{args[0]}".encode(), args[0], 3, "sync/", timeout=10),
                enumerate(stores),
            )
        )
    assert all(g == [b"d0", b"d1", b"d2"] for g in gathered)


def test_barrier_times_out_when_a_member_is_missing(connection: EtcdConnection) -> None:
    s = EtcdV3Store(connection, "/t/store/10/", timedelta(seconds=10))
    with pytest.raises(dist.DistStoreError):
        store_util.barrier(s, 2, key_prefix="lonely/", barrier_timeout=0.5)
