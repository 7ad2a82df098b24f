"""``WatchMux`` against a real etcd: one stream, every subscriber hears every change of the watched ranges, an
unsubscribed one hears nothing more, and a broken or compacted watch is re-established without losing events
(``elastic/rendezvous/watch_mux.py``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from etcd3.etcdrpc import kv_pb2

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.etcd_client import EtcdConnection, prefix_end
from elastic.rendezvous.watch_mux import WatchMux
from tests.elastic.test_rendezvous_etcd import make_config
from tests.harness.procs import wait_for

PREFIX = "/mux-test/"


class _Subscriber:
    """Keeps the keys it was told about (reset, then puts and deletes), and counts resets and failures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[str, bytes] = {}
        self.resets = 0
        self.events = 0
        self.failures: list[BaseException] = []
        self.fatal: BaseException | None = None

    def watch_reset(self, kvs: Any, revisions: Any) -> None:
        with self.lock:
            self.keys = {kv.key.decode(): bytes(kv.value) for range_kvs in kvs for kv in range_kvs}
            self.resets += 1

    def watch_events(self, events: Any, watch_id: int) -> None:
        with self.lock:
            for ev in events:
                self.events += 1
                if ev.type == kv_pb2.Event.PUT:
                    self.keys[ev.kv.key.decode()] = bytes(ev.kv.value)
                else:
                    self.keys.pop(ev.kv.key.decode(), None)

    def watch_failed(self, exc: BaseException) -> None:
        with self.lock:
            self.failures.append(exc)

    def watch_fatal(self, exc: BaseException) -> None:
        self.fatal = exc

    def has(self, key: str, value: bytes | None) -> bool:
        with self.lock:
            return self.keys.get(key) == value


@pytest.fixture
def conn(etcd_server: EmbeddedEtcd) -> Iterator[EtcdConnection]:
    connection = EtcdConnection(make_config(etcd_server.endpoint, etcd_timeout=30.0))
    try:
        yield connection
    finally:
        connection.close()


@pytest.fixture
def mux(conn: EtcdConnection) -> Iterator[WatchMux]:
    watcher = WatchMux(conn, [(PREFIX + "one", None), (PREFIX + "range/", prefix_end(PREFIX + "range/"))])
    try:
        yield watcher
    finally:
        watcher.close()


@pytest.mark.timeout(60)
def test_every_subscriber_gets_the_keys_then_every_change_and_a_late_one_the_current_keys(
        conn: EtcdConnection, mux: WatchMux) -> None:
    conn.client.put(PREFIX + "range/a", "1")
    conn.client.put(PREFIX + "elsewhere", "x")  # outside the watched ranges
    early = [_Subscriber(), _Subscriber()]
    for sub in early:
        mux.subscribe(sub)
    wait_for(lambda: all(s.has(PREFIX + "range/a", b"1") for s in early), 10, "the subscribers got the existing key")
    conn.client.put(PREFIX + "one", "2")
    conn.client.put(PREFIX + "range/b", "3")
    conn.client.delete(PREFIX + "range/a")
    wait_for(lambda: all(s.has(PREFIX + "range/b", b"3") and s.has(PREFIX + "one", b"2") for s in early), 10,
             "every subscriber got the puts")
    wait_for(lambda: all(s.has(PREFIX + "range/a", None) for s in early), 10, "every subscriber got the delete")
    late = _Subscriber()
    mux.subscribe(late)
    assert late.resets == 1
    assert late.keys == {PREFIX + "one": b"2", PREFIX + "range/b": b"3"}, "a late subscriber starts from the keys now"
    assert all(PREFIX + "elsewhere" not in s.keys for s in [*early, late]), "only the watched ranges"
    assert mux.subscribers == 3


@pytest.mark.timeout(60)
def test_an_unsubscribed_handler_hears_nothing_more(conn: EtcdConnection, mux: WatchMux) -> None:
    stays, goes = _Subscriber(), _Subscriber()
    mux.subscribe(stays)
    mux.subscribe(goes)
    conn.client.put(PREFIX + "one", "1")
    wait_for(lambda: stays.has(PREFIX + "one", b"1") and goes.has(PREFIX + "one", b"1"), 10, "both heard the put")
    assert mux.unsubscribe(goes) == 1
    heard = goes.events
    conn.client.put(PREFIX + "one", "2")
    conn.client.put(PREFIX + "range/x", "3")
    wait_for(lambda: stays.has(PREFIX + "range/x", b"3"), 10, "the one still subscribed heard both puts")
    assert goes.events == heard and goes.has(PREFIX + "one", b"1"), "the unsubscribed one heard nothing more"


@pytest.mark.timeout(90)
def test_a_broken_watch_resumes_from_its_revision_and_a_compacted_one_resets_the_subscribers(
        etcd_server: EmbeddedEtcd, conn: EtcdConnection, mux: WatchMux) -> None:
    sub = _Subscriber()
    mux.subscribe(sub)
    conn.client.put(PREFIX + "one", "1")
    wait_for(lambda: sub.has(PREFIX + "one", b"1"), 10, "the first put")
    resets = sub.resets

    # etcd restarts: the stream breaks, the subscriber hears of the outage, and the watch resumes from the
    # revision it had reached (the put made right after the restart arrives as an event, not a reset).
    etcd_server.stop()
    wait_for(lambda: bool(sub.failures), 20, "the subscriber was told etcd is unreachable")
    etcd_server.start()
    writer = EtcdConnection(make_config(etcd_server.endpoint, etcd_timeout=30.0))
    try:
        writer.call("put", lambda: writer.client.put(PREFIX + "range/after-restart", "2"))
        wait_for(lambda: sub.has(PREFIX + "range/after-restart", b"2"), 30, "the put after the restart")
        assert sub.resets == resets, "resumed from its revision: no reset"

        # Compaction past the mux's position (revisions that only keys outside its ranges used), then a broken
        # stream: etcd refuses to resume there, the mux reads the ranges again and resets every subscriber.
        writer.client.delete(PREFIX + "one")
        wait_for(lambda: sub.has(PREFIX + "one", None), 10, "the delete")
        for i in range(5):
            writer.client.put(PREFIX + f"elsewhere/{i}", "x")
        revision = int(writer.client.get_response(PREFIX + "one").header.revision)
        writer.client.compact(revision, physical=True)
        etcd_server.stop()
        etcd_server.start()
        wait_for(lambda: sub.resets > resets, 30, "the subscriber was reset after the compaction")
        assert sub.has(PREFIX + "one", None) and sub.has(PREFIX + "range/after-restart", b"2"), "the keys as they are"
        writer.call("put", lambda: writer.client.put(PREFIX + "range/last", "3"))
        wait_for(lambda: sub.has(PREFIX + "range/last", b"3"), 30, "events flow again after the reset")
        assert sub.fatal is None
    finally:
        writer.close()
