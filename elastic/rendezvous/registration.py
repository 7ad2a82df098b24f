"""``Registration``: this node's lease and its node key under it, kept alive and renewed when lost.

A node registers (``P/ctl/nodes/{node}``, with its address and liveness port) under a lease of ``lease_ttl``
seconds; a ``LeaseKeeper`` (``lease_keeper.py``: its own, or the one a ``ClientPool``'s handlers share) refreshes
it. When etcd says the lease is gone (an expiry while etcd was unreachable longer than the TTL, a revoke) the
node registers again on a fresh lease, keeping its ordering ``seq`` and its place in the round being formed
(its join key is written again): from the keeper's answer (on a thread of its own: the keeper serves every
lease) or from a write under the lease that etcd refused (``with_live_lease``). etcd's answers and failures to
the keeper count towards the handler's outage bound (``EtcdHealth``).

A re-registration writes the node key and the join key in one transaction, guarded like the join itself by the
round key's revision the join saw: the coordinator never sees the node registered without its join (a recovery
round closes at once only when every registered node has joined, so under a mass lease expiry the two separate
writes kept some node "registered, not joined" at almost every instant and the round waited out
``rejoin_timeout``), and a round committed meanwhile gets no stale join key.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt

from .api import EtcdRendezvousConfig, RendezvousConnectionError, RendezvousError
from .etcd_client import ClientPool, EtcdConnection
from .health import EtcdHealth, is_lease_not_found
from .keys import RunKeys, join_value
from .lease_keeper import LeaseKeeper, refresh_interval

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""

T = TypeVar("T")


class Registration:
    """This node's registration (``lease_id``, ``seq``); the ``LeaseOwner`` its keeper refreshes."""

    def __init__(
        self,
        config: EtcdRendezvousConfig,
        keys: RunKeys,
        health: EtcdHealth,
        cond: threading.Condition,
        stop: threading.Event,
        *,
        node_id: str,
        addr: str,
        live_port: Callable[[], int | None],
        require_conn: Callable[[], EtcdConnection],
        ctx: Callable[[], str],
        pool: ClientPool | None,
    ) -> None:
        """Args:
            health: told of the keeper's answers and failures.
            cond: the handler's condition (guards ``lease_id``, ``seq`` and ``joining`` as they change).
            stop: set when the handler stops (no more refreshes or renewals).
            addr: this node's address (in its registration and join key).
            live_port: this node's liveness port (None: none; ``PeerLiveness``).
            require_conn: the handler's connection (once connected).
            pool: with a pool, the lease is refreshed by the keeper its handlers share."""
        self._config = config
        self._keys = keys
        self._health = health
        self._cond = cond
        self._stop = stop
        self._node_id = node_id
        self._addr = addr
        self._live_port = live_port
        self._require_conn = require_conn
        self._ctx = ctx
        self._pool = pool
        self.lease_id: int | None = None
        """Our lease now (None: not registered yet)."""
        self.seq: int | None = None
        """Our ordering key: the revision of our first registration (kept across re-registrations)."""
        self.joining: tuple[int, int] | None = None
        """(round, round-key revision its join saw) of this node's join key: written again with the node key after
        a lease loss, unless the round key moved since."""
        self._lease_lock = threading.Lock()
        self._keeper: LeaseKeeper | None = None
        """Refreshes our lease: our own, or the one the pool's handlers share (``lease_keeper.py``)."""
        self.renewer: threading.Thread | None = None
        """Re-registers after our lease was found gone (off the keeper's thread, which serves every lease)."""

    def register(self, conn: EtcdConnection) -> None:
        """Grant a lease and write our node key under it (again after an expiry; ``seq`` is kept).

        Under heavy load the fresh lease itself can expire before we use it: then start over.
        """
        retrying = Retrying(
            stop=stop_after_attempt(3),
            retry=retry_if_exception(lambda exc: isinstance(exc, RendezvousConnectionError) and is_lease_not_found(exc.__cause__)),
            reraise=True,
        )
        retrying(self._register_once, conn)

    def _register_once(self, conn: EtcdConnection) -> None:
        lease = conn.call("grant a lease", lambda: conn.client.lease(self._config.lease_ttl))
        registration: dict[str, Any] = {"node_id": self._node_id, "host": socket.gethostname(), "addr": self._addr,
                                        "pid": os.getpid(), "seq": self.seq}
        live_port = self._live_port()
        if live_port is not None:
            registration.update(live_port=live_port, lease=lease.id)
        node_key, value = self._keys.nodes_prefix + self._node_id, json.dumps(registration)
        with self._cond:
            joining = self.joining
        revision: int | None = None
        if joining is None:
            resp = conn.call("register this node", lambda: conn.client.put(node_key, value, lease=lease.id))
            revision = int(resp.header.revision)
        else:  # keep our place in the round being formed (``seq`` is set: we joined after registering)
            self._register_joined(conn, lease.id, node_key, value, joining)
        with self._cond:
            self.lease_id = lease.id
            if self.seq is None:
                self.seq = revision
        log.info("%sregistered (lease %x, ttl %d s)", self._ctx(), lease.id, self._config.lease_ttl)

    def _register_joined(self, conn: EtcdConnection, lease: int, node_key: str, value: str,
                         joining: tuple[int, int]) -> None:
        """Put our node key and, unless the round key moved since our join saw it, our join key, in one
        transaction on ``lease``."""
        target, seen_mod = joining
        tx = conn.client.transactions
        put_node = tx.put(node_key, value, lease=lease)
        put_join = tx.put(self._keys.join_key(target, self._node_id), join_value(self.seq, self._addr), lease=lease)
        ok, _ = conn.call(f"register this node and re-join round {target}", lambda: conn.client.transaction(
            compare=[tx.mod(self._keys.round_key) == seen_mod], success=[put_node, put_join], failure=[put_node]))
        if not ok:
            log.info("%sround %d moved on since our join: registered without re-joining it", self._ctx(), target)

    def with_live_lease(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which writes under our lease); if etcd says the lease is gone, re-register and rerun."""

        def attempt() -> T:
            lease = self.lease_id
            try:
                return fn()
            except RendezvousConnectionError as exc:
                if is_lease_not_found(exc.__cause__):
                    log.warning("%slease %x is gone (expired or revoked); re-registering", self._ctx(), lease or 0)
                    self.renew(lease)
                raise

        retrying = Retrying(
            stop=stop_after_attempt(4),
            retry=retry_if_exception(lambda exc: isinstance(exc, RendezvousConnectionError) and is_lease_not_found(exc.__cause__)),
            reraise=True,
        )
        return retrying(attempt)

    def revoke(self, conn: EtcdConnection) -> None:
        """Revoke our lease (peers see this node gone at once); a failure is logged: it expires in ``lease_ttl``."""
        lease = self.lease_id
        if lease is None:
            return
        try:
            conn.call("revoke this node's lease", lambda: conn.client.revoke_lease(lease), within=min(2.0, self._config.etcd_timeout))
        except RendezvousError as exc:
            log.warning("%scould not revoke lease %x (it expires in <= %d s): %s", self._ctx(), lease, self._config.lease_ttl, exc)

    def put_on_lease(self, conn: EtcdConnection, what: str, key: str, value: str) -> None:
        """Put ``key`` under our lease (it vanishes with this node), re-registering if the lease is gone."""
        self.with_live_lease(lambda: conn.call(what, lambda: conn.client.put(key, value, lease=self.lease_id)))

    def renew(self, stale_lease: int | None) -> None:
        """Re-register unless another thread already replaced ``stale_lease``."""
        with self._lease_lock:
            if self.lease_id == stale_lease:
                self.register(self._require_conn())

    def _keeper_key(self) -> tuple[Any, ...]:
        return ("lease-keeper", *ClientPool.key(self._config), self._config.lease_ttl)

    def _acquire_keeper(self, conn: EtcdConnection) -> LeaseKeeper:
        """Our own keeper on our connection, or (with a pool) the one every handler of the pool shares."""
        interval = refresh_interval(self._config.lease_ttl)
        pool = self._pool
        if pool is None:
            return LeaseKeeper(conn, interval, name=f"rdzv-lease-{self._node_id}")
        config = self._config
        return pool.acquire_shared(self._keeper_key(), lambda: LeaseKeeper(
            EtcdConnection(config, pool=pool), interval, name="rdzv-lease-shared"))

    def keep(self, conn: EtcdConnection) -> None:
        """Hand our lease to a keeper (ours on ``conn``, or the pool's) from now until ``release_keeper``."""
        self._keeper = self._acquire_keeper(conn)
        self._keeper.add(self)

    def release_keeper(self) -> None:
        """Stop the refreshes (the last handler of a pool to let go closes the shared keeper)."""
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return
        keeper.remove(self)
        if self._pool is None:
            keeper.close()
            return
        last = self._pool.release_shared(self._keeper_key())
        if last is not None:
            last.close()
            last.connection.close()

    def renewing(self) -> bool:
        """A re-registration is replacing our lease (the coordinator elects on the new one)."""
        renewer = self.renewer
        return renewer is not None and renewer.is_alive()

    # LeaseOwner (lease_keeper.py), called from the keeper's thread: never block here.
    def lease_to_keep(self) -> int | None:
        return None if self._stop.is_set() else self.lease_id

    def lease_refreshed(self, lease: int, ttl: int) -> None:
        self._health.ok()
        if ttl > 0 or self._stop.is_set() or lease != self.lease_id:  # a lease already replaced is no news
            return
        renewer = self.renewer
        if renewer is not None and renewer.is_alive():
            return  # already re-registering
        log.warning("%slease %x expired (etcd unreachable for > %d s?); re-registering", self._ctx(), lease, self._config.lease_ttl)
        self.renewer = threading.Thread(target=self._renew_expired_lease, args=(lease,),
                                        name=f"rdzv-renew-{self._node_id}", daemon=True)
        self.renewer.start()

    def lease_refresh_failed(self, exc: BaseException) -> None:
        if not self._stop.is_set():
            self._health.failed(exc)

    def _renew_expired_lease(self, lease: int) -> None:
        try:
            self.renew(lease)
        except RendezvousConnectionError as exc:
            if not self._stop.is_set():  # stopping: its connection was closed under it
                self._health.failed(exc)
        except Exception:  # the next refresh finds the lease still gone and tries again
            if not self._stop.is_set():
                log.exception("%sre-registering after the lease expired failed", self._ctx())
