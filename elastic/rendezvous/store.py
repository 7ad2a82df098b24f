"""``EtcdV3Store``: the agents' c10d store for one round, kept in etcd.

Keys live under ``{run prefix}store/{round}/``: a new round starts from an empty store, a stale agent of
an old round writes only where nobody reads any more, and no node hosts the store (any node may die,
including rank 0). Blocking reads (``get``/``wait``) watch the key from the revision of the failed read,
so they wake on the write instead of polling.

This store serves torch's agent (``_assign_worker_ranks``: set/get/multi_get/multi_set; exit barrier:
``store_util.barrier``: add/set/wait with timeouts). Workers use a TCPStore at MASTER_ADDR/PORT that the
round's rank-0 agent hosts (``worker_store.WorkerStoreHost``), not this one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import grpc
from etcd3.etcdrpc import kv_pb2
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_random
from torch.distributed import DistStoreError, Store

from .etcd_client import EtcdConnection, is_auth_refusal, is_token_expired, is_transient

log = logging.getLogger(__name__)

T = TypeVar("T")


class _CasConflict(Exception):
    """A compare-and-swap lost to a concurrent writer (retried)."""


def _to_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        return bytes(value)
    return bytes(value)


class EtcdV3Store(Store):
    """A ``torch.distributed.Store`` over etcd v3, scoped to one key prefix (one rendezvous round)."""

    def __init__(self, connection: EtcdConnection, prefix: str, timeout: timedelta | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        if not prefix.endswith("/"):
            prefix += "/"
        self._conn = connection
        self.prefix = prefix
        if timeout is not None:
            self.set_timeout(timeout)

    # ------------------------------------------------------------------ helpers
    def _key(self, key: str) -> str:
        return self.prefix + key

    @property
    def _client(self) -> Any:  # python3-etcd3's client is untyped
        return self._conn.client

    def _timeout_s(self, override: timedelta | None = None) -> float:
        timeout = override if override is not None else self.timeout  # type: ignore[attr-defined]  # pybind, not in stubs
        return timeout.total_seconds()

    def _read(self, key: str) -> tuple[bytes | None, int]:
        """(value or None, header revision) of one key."""
        resp = self._conn.call(f"read store key {key!r}", lambda: self._client.get_response(self._key(key)))
        value = resp.kvs[0].value if resp.count >= 1 and resp.kvs else None
        return value, resp.header.revision

    # ------------------------------------------------------------------ Store API
    def set(self, key: str, value: str | bytes) -> None:
        data = _to_bytes(value)
        self._conn.call(f"set store key {key!r}", lambda: self._client.put(self._key(key), data))

    def get(self, key: str) -> bytes:
        self._wait_one(key, time.monotonic() + self._timeout_s())
        value, _ = self._read(key)
        if value is None:  # deleted between the wait and the read
            raise DistStoreError(f"key {key!r} disappeared from store {self.prefix!r}")
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        puts = [self._client.transactions.put(self._key(k), _to_bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._conn.call(
            f"set {len(keys)} store keys", lambda: self._client.transaction(compare=[], success=puts, failure=[])
        )

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing = 0); returns the new value."""
        full = self._key(key)

        def attempt() -> int:
            value, meta = self._conn.call(f"read counter {key!r}", lambda: self._client.get(full))
            current = int(value) if value is not None else 0
            new = current + amount
            compare = (
                [self._client.transactions.mod(full) == meta.mod_revision]
                if meta is not None
                else [self._client.transactions.version(full) == 0]
            )
            ok, _ = self._conn.call(
                f"add to counter {key!r}",
                lambda: self._client.transaction(
                    compare=compare, success=[self._client.transactions.put(full, str(new))], failure=[]
                ),
            )
            if not ok:
                raise _CasConflict(key)
            return new

        return self._cas_loop(attempt)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """c10d semantics: set if current == expected (or missing and expected empty); return the value now."""
        full = self._key(key)
        expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)
        txns = self._client.transactions
        compare = [txns.version(full) == 0] if not expected else [txns.value(full) == expected]
        ok, responses = self._conn.call(
            f"compare_set store key {key!r}",
            lambda: self._client.transaction(
                compare=compare, success=[txns.put(full, desired)], failure=[txns.get(full)]
            ),
        )
        if ok:
            return desired
        kvs = responses[0] if responses else []
        return kvs[0][0] if kvs else expected

    def delete_key(self, key: str) -> bool:
        return bool(self._conn.call(f"delete store key {key!r}", lambda: self._client.delete(self._key(key))))

    def check(self, keys: list[str]) -> bool:
        return all(self._read(key)[0] is not None for key in keys)

    def num_keys(self) -> int:
        resp = self._conn.call(
            "count store keys", lambda: self._client.get_prefix_response(self.prefix, count_only=True)
        )
        return int(resp.count)

    def list_keys(self) -> list[str]:
        resp = self._conn.call("list store keys", lambda: self._client.get_prefix_response(self.prefix, keys_only=True))
        return [kv.key.decode()[len(self.prefix) :] for kv in resp.kvs]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + self._timeout_s(timeout)
        for key in keys:
            self._wait_one(key, deadline)

    # ------------------------------------------------------------------ blocking
    def _wait_one(self, key: str, deadline: float) -> None:
        """Return once ``key`` exists; DistStoreError at ``deadline``. Watches instead of polling."""
        while True:
            value, revision = self._read(key)
            if value is not None:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistStoreError(
                    f"timed out waiting for key {key!r} in etcd store {self.prefix!r} "
                    f"(store timeout {self._timeout_s():.0f} s)"
                )
            if self._watch_for_put(key, revision + 1, remaining):
                return

    def _watch_for_put(self, key: str, start_revision: int, timeout: float) -> bool:
        """True if a PUT of ``key`` at/after ``start_revision`` arrives within ``timeout``; False on timeout."""
        stream = self._conn.watch(self._key(key), range_end=None, start_revision=start_revision, timeout=timeout)
        try:
            for response in stream:
                if response.canceled and is_auth_refusal(response.cancel_reason):
                    # Our token expired or etcd restarted; a user really lacking the permission fails the re-read.
                    self._conn.call("renew the auth token", self._conn.renew_token)
                if response.canceled or response.compact_revision:
                    return False  # re-read decides
                if any(ev.type == kv_pb2.Event.PUT for ev in response.events):
                    return True
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False
            if is_token_expired(exc):
                stale = exc
                self._conn.call("renew the auth token", lambda: self._conn.renew_token(stale))
                return False
            if not is_transient(exc):
                raise
            # etcd blipped: the caller's re-read (retried within etcd_timeout) decides what happens.
            log.debug("store watch on %r broke (%s); re-reading", key, exc.code())
            return False
        finally:
            stream.cancel()
        return False

    def _cas_loop(self, attempt: Callable[[], T]) -> T:
        retrying = Retrying(
            stop=stop_after_delay(self._conn.config.etcd_timeout),
            wait=wait_random(0, 0.02),
            retry=retry_if_exception_type(_CasConflict),
            reraise=True,
        )
        return retrying(attempt)


__all__ = ["EtcdV3Store"]
