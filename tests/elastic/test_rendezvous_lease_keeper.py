"""``LeaseKeeper`` against a real etcd: one thread and one stream per tick keep many leases alive, and each
owner hears what happened to its own lease (``elastic/rendezvous/lease_keeper.py``)."""

from __future__ import annotations

import threading

import pytest

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.etcd_client import EtcdConnection
from elastic.rendezvous.lease_keeper import LeaseKeeper, refresh_interval
from tests.elastic.test_rendezvous_etcd import make_config
from tests.harness.procs import wait_for

TTL = 1


class _Owner:
    """A lease holder that records what the keeper told it."""

    def __init__(self, lease: int | None) -> None:
        self.lease = lease
        self.ttls: list[int] = []
        self.failures: list[BaseException] = []
        self.gone = threading.Event()
        self.failed = threading.Event()

    def lease_to_keep(self) -> int | None:
        return self.lease

    def lease_refreshed(self, lease: int, ttl: int) -> None:
        assert lease == self.lease
        self.ttls.append(ttl)
        if ttl <= 0:
            self.gone.set()

    def lease_refresh_failed(self, exc: BaseException) -> None:
        self.failures.append(exc)
        self.failed.set()


@pytest.mark.timeout(60)
def test_one_keeper_keeps_many_leases_and_tells_each_owner_its_own_news(etcd_server: EmbeddedEtcd) -> None:
    conn = EtcdConnection(make_config(etcd_server.endpoint, etcd_timeout=3.0))
    owners = [_Owner(conn.client.lease(TTL).id) for _ in range(20)]
    idle = _Owner(None)  # no lease yet: asks for nothing
    keeper = LeaseKeeper(conn, refresh_interval(TTL), name="rdzv-lease-test")
    try:
        for owner in [*owners, idle]:
            keeper.add(owner)
        # Four TTLs later every lease is still alive (unrefreshed, each would have expired after one).
        wait_for(lambda: all(len(o.ttls) >= 4 * 3 for o in owners), timeout=30, what="12 refreshes of each lease")
        assert all(t > 0 for o in owners for t in o.ttls), "etcd answered that a kept lease was gone"
        assert all(conn.client.get_lease_info(o.lease).TTL != -1 for o in owners)  # -1: expired
        assert not any(o.failures for o in owners) and not idle.ttls and not idle.failures
        assert [t.name for t in threading.enumerate()].count("rdzv-lease-test") == 1

        victim = owners[3]
        conn.client.revoke_lease(victim.lease)
        assert victim.gone.wait(10), "the owner of a revoked lease was not told it is gone"
        assert not any(o.gone.is_set() for o in owners if o is not victim)

        assert keeper.remove(victim) == len(owners)  # the others and the idle one
        etcd_server.stop()
        assert owners[0].failed.wait(10), "an unreachable etcd was not reported to the owners"
        assert all(o.failures for o in owners if o is not victim)
    finally:
        keeper.close()
        conn.close()
    assert "rdzv-lease-test" not in [t.name for t in threading.enumerate()]


def test_a_keeper_needs_a_positive_interval(etcd_server: EmbeddedEtcd) -> None:
    conn = EtcdConnection(make_config(etcd_server.endpoint))
    try:
        with pytest.raises(ValueError, match="interval must be > 0"):
            LeaseKeeper(conn, 0.0)
    finally:
        conn.close()
