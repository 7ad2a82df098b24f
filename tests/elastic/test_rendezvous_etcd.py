"""EtcdV3RendezvousHandler against a real etcd: rounds, loss, growth, spares, isolation, outages."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousInfo

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.api import (
    ConnectableHandler,
    EtcdRendezvousConfig,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler
from tests.harness.procs import wait_for

LEASE_TTL = 1
# Loss is seen when etcd expires the lease: TTL plus etcd's expiry scan (<= 0.5 s) plus slack for a
# shared 2-core machine.
LOSS_BOUND_S = LEASE_TTL + 2.5


def make_config(endpoint: str, *, run_id: str = "job", min_nodes: int = 1, max_nodes: int = 3, **kw: Any) -> EtcdRendezvousConfig:
    host, port = endpoint.rsplit(":", 1)
    kw.setdefault("lease_ttl", LEASE_TTL)
    kw.setdefault("join_timeout", 30.0)
    kw.setdefault("last_call_timeout", 0.3)
    kw.setdefault("etcd_timeout", 10.0)
    return EtcdRendezvousConfig(
        run_id=run_id, endpoints=((host, int(port)),), min_nodes=min_nodes, max_nodes=max_nodes, **kw
    )


def rendezvous_all(pool: ThreadPoolExecutor, hs: list[EtcdV3RendezvousHandler], timeout: float = 20.0) -> list[RendezvousInfo]:
    futures = [pool.submit(h.next_rendezvous) for h in hs]
    return [f.result(timeout=timeout) for f in futures]


def assert_consistent(infos: list[RendezvousInfo], world_size: int) -> None:
    assert sorted(i.rank for i in infos) == list(range(world_size))
    assert {i.world_size for i in infos} == {world_size}
    masters = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(masters) == 1, f"nodes disagree on MASTER_ADDR/PORT: {masters}"
    assert next(iter(masters))[1] > 0


def workers_store(info: RendezvousInfo) -> TCPStore:
    """A worker's client of the round's store: rank 0's agent already serves it (no connect retry)."""
    port = info.bootstrap_store_info.master_port
    assert not refuses(port), "the workers' store must be listening when the round completes"
    return TCPStore(info.bootstrap_store_info.master_addr, port, None, False, timedelta(seconds=5))


def refuses(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


# ------------------------------------------------------------------ forming rounds
@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_handlers_form_a_round(etcd_server: EmbeddedEtcd, handlers, pool, n: int) -> None:
    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=n, max_nodes=n)) for _ in range(n)]
    began = time.monotonic()
    infos = rendezvous_all(pool, hs)
    assert_consistent(infos, n)
    assert time.monotonic() - began < 5.0
    assert all(h.round == 1 for h in hs)
    assert all(h.get_backend() == "etcd-v3" and h.use_agent_store for h in hs)
    assert not any(h.membership_changed() for h in hs)
    assert all(h.num_nodes_waiting() == 0 for h in hs)


@pytest.mark.timeout(60)
def test_lost_participant_is_seen_within_a_lease_and_next_round_is_fast(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=3), node_id=f"n{i}") for i in range(3)]
    first = rendezvous_all(pool, hs)
    assert_consistent(first, 3)
    rank_of = {h.node_id: info.rank for h, info in zip(hs, first, strict=True)}
    victim, survivors = hs[1], [hs[0], hs[2]]

    began = time.monotonic()
    victim.simulate_crash()
    seen = [pool.submit(h.wait_membership_change, LOSS_BOUND_S) for h in survivors]
    assert all(f.result(timeout=LOSS_BOUND_S + 5) for f in seen), "survivors must notice the loss"
    detected = time.monotonic() - began
    assert detected < LOSS_BOUND_S
    assert all(h.membership_changed() and h.num_nodes_waiting() >= 1 for h in survivors)

    began = time.monotonic()
    second = rendezvous_all(pool, survivors)
    recovery = time.monotonic() - began
    assert_consistent(second, 2)
    # No last call on recovery (0.3 s here): every live node joined, the round closes at once.
    assert recovery < 1.5, f"recovery round took {recovery:.2f} s"
    # Survivors keep their relative order.
    new_rank = {h.node_id: info.rank for h, info in zip(survivors, second, strict=True)}
    assert sorted(new_rank, key=new_rank.get) == sorted(new_rank, key=rank_of.get)
    assert all(h.round == 2 and not h.membership_changed() for h in survivors)


def coordinator_of(hs: list[EtcdV3RendezvousHandler]) -> EtcdV3RendezvousHandler:
    """The handler that holds the coordinator key (as the others' mirrors say), once they agree."""
    deadline = time.monotonic() + 10
    while True:
        seen = {h.mirror.coordinator[0] for h in hs if h.mirror.coordinator is not None}
        if len(seen) == 1 and all(h.mirror.coordinator is not None for h in hs):
            return next(h for h in hs if h.node_id in seen)
        assert time.monotonic() < deadline, f"no agreed coordinator: {seen}"
        time.sleep(0.02)


def etcd_events_sent(server: EmbeddedEtcd) -> int:
    """Watch events etcd has sent to all watchers so far (its own counter, from /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_events_total "):
                return int(float(line.split()[1]))
    raise AssertionError("etcd's /metrics has no etcd_debugging_mvcc_events_total")


@pytest.mark.timeout(90)
def test_a_round_costs_o_n_watch_events_and_only_the_coordinator_mirrors_joins(
        etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """Before, every agent watched every key: N registrations and N joins reached N watchers (3N^2 events per
    round, 300 for 10 agents). Now only the coordinator sees them; the others watch the posts and the round."""
    n = 10
    config = make_config(etcd_server.endpoint, run_id="o-of-n", min_nodes=1, max_nodes=n, last_call_timeout=30.0)
    hs = [handlers(config, node_id=f"n{i}") for i in range(n)]  # the first round closes when all 10 joined
    for h in hs:
        h.connect()
    before = etcd_events_sent(etcd_server)
    assert_consistent(rendezvous_all(pool, hs, timeout=60), n)
    first = etcd_events_sent(etcd_server) - before
    coordinator = coordinator_of(hs)
    followers = [h for h in hs if h is not coordinator]
    assert coordinator.mirror.full and len(coordinator.mirror.nodes) == n
    assert all(not h.mirror.full and not h.mirror.nodes and not h.mirror.joins for h in followers)
    assert first <= 10 * n, f"the first round of {n} agents cost {first} watch events (O(N^2) would be ~{3 * n * n})"

    victim = followers[0]
    before = etcd_events_sent(etcd_server)
    victim.leave()  # its lease is revoked: the loss is seen at once
    survivors = [h for h in hs if h is not victim]
    assert all(pool.map(lambda h: h.wait_membership_change(LOSS_BOUND_S), survivors))
    assert all(h.lost_peers() == {victim.node_id} for h in survivors)
    assert_consistent(rendezvous_all(pool, survivors, timeout=60), n - 1)
    recovery = etcd_events_sent(etcd_server) - before
    assert recovery <= 10 * n, f"a recovery round of {n - 1} agents cost {recovery} watch events"


@pytest.mark.timeout(60)
def test_handlers_sharing_one_client_form_rounds_and_outlive_a_leaver(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """Many agents in one process (the bench) share one etcd client; one leaving must not close it for the rest."""
    from elastic.rendezvous.etcd_client import ClientPool

    shared = ClientPool()
    config = make_config(etcd_server.endpoint, run_id="shared", min_nodes=1, max_nodes=3)
    hs = [handlers(config, node_id=f"n{i}", pool=shared) for i in range(3)]
    assert_consistent(rendezvous_all(pool, hs), 3)
    assert len({id(h.connection.client) for h in hs if h.connection is not None}) == 1, "one client for the three"
    names = [t.name for t in threading.enumerate()]
    assert names.count("rdzv-lease-shared") == 1, "one lease keeper thread for the three"
    assert not any(n.startswith("rdzv-lease-n") for n in names), "no lease thread of their own"
    assert sum(n.startswith("rdzv-watch-mux-") for n in names) == 1, "the followers share one watch stream"
    leases = [h.registration.lease_id for h in hs]
    assert not any(pool.map(lambda h: h.wait_membership_change(3 * LEASE_TTL), hs)), "the shared keeper let a lease go"
    assert [h.registration.lease_id for h in hs] == leases
    hs[2].leave()
    rest = hs[:2]
    assert all(pool.map(lambda h: h.wait_membership_change(LOSS_BOUND_S), rest))
    assert_consistent(rendezvous_all(pool, rest), 2)
    for h in rest:
        h.leave()
    assert not shared.open_count, "the last one to leave closes the shared client"


@pytest.mark.timeout(60)
def test_the_coordinators_loss_is_seen_by_all_and_another_takes_over(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=4), node_id=f"n{i}") for i in range(4)]
    assert_consistent(rendezvous_all(pool, hs), 4)
    victim = coordinator_of(hs)
    survivors = [h for h in hs if h is not victim]
    victim.simulate_crash()  # no revoke: its lease expires (or a ring neighbour's probe revokes it)
    assert all(pool.map(lambda h: h.wait_membership_change(LOSS_BOUND_S + 2), survivors))
    assert all(victim.node_id in h.lost_peers() for h in survivors)
    infos = rendezvous_all(pool, survivors)
    assert_consistent(infos, 3)
    successor = coordinator_of(survivors)
    assert successor is not victim and successor.mirror.full
    # The new coordinator tells the others of the next loss (it mirrors the registrations now).
    follower = next(h for h in survivors if h is not successor)
    follower.leave()
    rest = [h for h in survivors if h is not follower]
    assert all(pool.map(lambda h: h.wait_membership_change(LOSS_BOUND_S), rest))
    assert_consistent(rendezvous_all(pool, rest), 2)


@pytest.mark.timeout(60)
def test_sigkilled_agent_process_is_detected(etcd_server: EmbeddedEtcd, handlers, pool, tmp_path) -> None:
    """A real agent process (not a thread) is SIGKILLed: its lease expires and the survivor re-forms."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from elastic.rendezvous.api import EtcdRendezvousConfig
        from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler
        cfg = EtcdRendezvousConfig(run_id="job", endpoints=(("127.0.0.1", {etcd_server.client_port}),),
                                   min_nodes=1, max_nodes=2, lease_ttl={LEASE_TTL}, last_call_timeout=10)
        info = EtcdV3RendezvousHandler(cfg, node_id="child").next_rendezvous()
        print("rank", info.rank, info.world_size, flush=True)
        time.sleep(600)
        """
    )
    # A long last call: the first round closes because it is full, the recovery because all live nodes joined.
    survivor = handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=2, last_call_timeout=10), node_id="parent")
    fut = pool.submit(survivor.next_rendezvous)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        line = pool.submit(proc.stdout.readline).result(timeout=30)  # type: ignore[union-attr]  # stdout=PIPE
        assert line.startswith("rank "), line
        assert fut.result(timeout=20).world_size == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        began = time.monotonic()
        assert survivor.wait_membership_change(LOSS_BOUND_S)
        assert time.monotonic() - began < LOSS_BOUND_S
        began = time.monotonic()
        info = survivor.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert time.monotonic() - began < 2.0, "recovery must not wait for the 10 s last call"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_new_node_below_max_triggers_waiting_then_larger_round(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=2, max_nodes=3)) for _ in range(2)]
    first = rendezvous_all(pool, hs)
    assert_consistent(first, 2)
    workers_store(first[0]).set("round1", "stale")
    old_port = first[0].bootstrap_store_info.master_port

    newcomer = handlers(make_config(etcd_server.endpoint, min_nodes=2, max_nodes=3))
    pending: Future[RendezvousInfo] = pool.submit(newcomer.next_rendezvous)
    assert all(h.wait_membership_change(10) for h in hs)
    assert all(h.num_nodes_waiting() >= 1 for h in hs)
    assert not pending.done(), "the newcomer must wait until the running agents re-rendezvous"

    infos = rendezvous_all(pool, hs) + [pending.result(timeout=20)]
    assert_consistent(infos, 3)
    assert pending.result().rank == 2, "the newcomer is ranked after the existing nodes"
    order = newcomer.participants
    assert set(order) == {h.node_id for h in [*hs, newcomer]} and order[2] == newcomer.node_id
    assert all(h.participants == order for h in hs)
    # A new round's workers start from an empty store (pytorch#135712) and the old round's server is gone.
    assert not workers_store(infos[0]).check(["round1"])
    if infos[0].bootstrap_store_info.master_port != old_port:  # (the OS may hand the freed port out again)
        assert refuses(old_port)


@pytest.mark.timeout(30)
def test_opting_out_of_the_agent_store_like_torchrun(etcd_server: EmbeddedEtcd, handlers, pool, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=2, max_nodes=2)) for _ in range(2)]
    infos = rendezvous_all(pool, hs)
    assert_consistent(infos, 2)
    assert not any(h.use_agent_store for h in hs)
    assert refuses(infos[0].bootstrap_store_info.master_port), "rank 0's worker hosts it: nobody listens yet"


@pytest.mark.timeout(60)
def test_node_beyond_max_is_a_spare_until_a_loss(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    def cfg() -> EtcdRendezvousConfig:
        return make_config(etcd_server.endpoint, min_nodes=1, max_nodes=2, join_timeout=1.0)

    hs = [handlers(cfg()) for _ in range(2)]
    assert_consistent(rendezvous_all(pool, hs), 2)

    spare = handlers(cfg())
    pending = pool.submit(spare.next_rendezvous)
    # Longer than join_timeout: a spare of a full, healthy job does not time out, nor disturb it.
    time.sleep(1.5)  # (asserting an absence: nothing to wait on)
    assert not pending.done()
    assert all(h.num_nodes_waiting() == 0 and not h.membership_changed() for h in hs)

    hs[0].simulate_crash()
    assert hs[1].wait_membership_change(LOSS_BOUND_S)
    infos = [hs[1].next_rendezvous(), pending.result(timeout=20)]
    assert_consistent(infos, 2)


@pytest.mark.timeout(60)
def test_two_run_ids_on_one_etcd_are_isolated(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    a = [handlers(make_config(etcd_server.endpoint, run_id="A", min_nodes=2, max_nodes=2)) for _ in range(2)]
    b = [handlers(make_config(etcd_server.endpoint, run_id="B", min_nodes=1, max_nodes=2)) for _ in range(1)]
    infos_a = rendezvous_all(pool, a)
    infos_b = rendezvous_all(pool, b)
    assert_consistent(infos_a, 2)
    assert_consistent(infos_b, 1)
    # A newcomer of B is invisible to A; closing B leaves A open.
    late_b = handlers(make_config(etcd_server.endpoint, run_id="B", min_nodes=1, max_nodes=2))
    pending = pool.submit(late_b.next_rendezvous)
    assert b[0].wait_membership_change(10)
    assert all(h.num_nodes_waiting() == 0 for h in a)
    b[0].set_closed()
    with pytest.raises(RendezvousClosedError):
        pending.result(timeout=10)
    assert not any(h.is_closed() for h in a)


@pytest.mark.timeout(60)
def test_set_closed_propagates_and_blocks_new_rounds(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=2, max_nodes=2)) for _ in range(2)]
    rendezvous_all(pool, hs)
    assert hs[0].shutdown() is True  # torch semantics: shutdown closes the rendezvous
    deadline = time.monotonic() + 5
    while not hs[1].is_closed():  # eventual propagation through the watch
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(RendezvousClosedError):
        hs[1].next_rendezvous()


@pytest.mark.timeout(60)
def test_a_peer_that_finished_is_not_reported_lost(etcd_server: EmbeddedEtcd, handlers, pool,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """At a clean end every agent shuts down (closes the run, then revokes its lease); the later ones saw the
    earlier ones' leases go and logged a WARNING "participant ... lost its lease" for each. A crash still is."""
    config = make_config(etcd_server.endpoint, run_id="finish", min_nodes=2, max_nodes=3)
    a, b, c = (handlers(config, name) for name in "abc")
    rendezvous_all(pool, [a, b, c])
    caplog.set_level(logging.INFO, logger="elastic.rendezvous.etcd_v3")
    c.simulate_crash()  # before the end: a loss, and said so
    assert a.wait_membership_change(LOSS_BOUND_S) and b.wait_membership_change(LOSS_BOUND_S)
    lost = [r for r in caplog.records if "lost its lease" in r.getMessage()]
    assert {r.levelno for r in lost} == {logging.WARNING} and len(lost) == 2
    rendezvous_all(pool, [a, b])  # the survivors' round
    caplog.clear()
    assert a.shutdown() is True  # a finished first: the run is closed, then its lease goes
    deadline = time.monotonic() + LOSS_BOUND_S
    while "a" not in b.lost_peers():
        assert time.monotonic() < deadline, "b must still see a's key go"
        b.wait_membership_change(0.05)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if "participant a " in r.getMessage()]
    assert messages and all(level == logging.INFO and "finished and left" in text for level, text in messages)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "a finished peer is not a lost one"
    assert b.shutdown() is True


@pytest.mark.timeout(30)
def test_join_timeout_below_min(etcd_server: EmbeddedEtcd, handlers) -> None:
    h = handlers(make_config(etcd_server.endpoint, min_nodes=2, max_nodes=2, join_timeout=1.0))
    began = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="1/2 nodes joined"):
        h.next_rendezvous()
    assert 0.9 < time.monotonic() - began < 5


# ------------------------------------------------------------------ etcd trouble
@pytest.mark.timeout(60)
def test_etcd_restart_keeps_membership(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    def cfg() -> EtcdRendezvousConfig:
        return make_config(etcd_server.endpoint, min_nodes=1, max_nodes=2, lease_ttl=2, last_call_timeout=10)

    hs = [handlers(cfg()) for _ in range(2)]
    assert_consistent(rendezvous_all(pool, hs), 2)

    etcd_server.stop()
    time.sleep(3.0)  # the outage itself (nothing to wait on: etcd is down on purpose)
    etcd_server.start()
    # Leases survive an etcd restart (etcd renews them on leader election): no loss, no error.
    changed = [pool.submit(h.wait_membership_change, 3.0) for h in hs]
    assert not any(f.result(timeout=10) for f in changed)
    assert all(h.num_nodes_waiting() == 0 for h in hs)
    # And the handlers still work: a re-rendezvous forms round 2.
    hs[0].simulate_crash()
    assert hs[1].wait_membership_change(2 + 3)
    info = hs[1].next_rendezvous()
    assert info.world_size == 1 and hs[1].round == 2


@pytest.mark.timeout(30)
def test_unreachable_endpoint_fails_fast_and_clearly(handlers) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h = handlers(make_config(f"127.0.0.1:{port}", etcd_timeout=1.5))
    assert isinstance(h, ConnectableHandler), "the launcher checks reachability through connect()"
    for attempt in (h.connect, h.next_rendezvous):
        began = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
            attempt()
        assert time.monotonic() - began < 6


@pytest.mark.timeout(30)
def test_connect_reaches_etcd_without_joining(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    connected = handlers(make_config(etcd_server.endpoint, run_id="connect", min_nodes=1, max_nodes=2))
    connected.connect()
    connected.connect()  # idempotent
    joiner = handlers(make_config(etcd_server.endpoint, run_id="connect", min_nodes=1, max_nodes=2))
    [info] = rendezvous_all(pool, [joiner])
    assert info.world_size == 1, "a connected handler is not a participant until next_rendezvous"
    assert connected.round is None


@pytest.mark.timeout(30)
def test_etcd_gone_longer_than_etcd_timeout_ends_the_job(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    h = handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=1, etcd_timeout=1.5))
    h.next_rendezvous()
    etcd_server.stop()
    with pytest.raises(RendezvousConnectionError, match="etcd_timeout"):
        h.wait_membership_change(10)
    with pytest.raises(RendezvousConnectionError):
        h.num_nodes_waiting()


@pytest.mark.timeout(30)
def test_lease_expiry_during_outage_reregisters_and_breaks_round(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """If a node's lease did expire (its refresher stalled), it re-registers and the round is re-formed."""
    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=2), node_id=f"n{i}") for i in range(2)]
    rendezvous_all(pool, hs)
    import etcd3

    host, port = etcd_server.endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    client.revoke_lease(hs[1].registration.lease_id)  # as if the lease had expired
    client.close()
    assert hs[0].wait_membership_change(LOSS_BOUND_S)
    # n1 re-registers (on its next write or its refresher seeing TTL <= 0) and both end up in one round:
    # at once if n1 is back before n0 commits, else one round later because n0 sees n1 waiting.
    pending = pool.submit(hs[1].next_rendezvous)
    info0 = hs[0].next_rendezvous()
    if info0.world_size == 1:
        assert hs[0].wait_membership_change(10)
        info0 = hs[0].next_rendezvous()
    assert_consistent([info0, pending.result(timeout=20)], 2)


def _registered_without_join(client: Any, h: EtcdV3RendezvousHandler, target: int, since: int) -> list[int]:
    """The revisions after ``since``, up to now, at which ``h`` was registered without its join key for ``target``
    (read back from etcd's history: the coordinator's watch sees the state at each of them)."""
    node_key = h.keys.nodes_prefix + h.node_id
    join_key = f"{h.keys.join_prefix}{target}/{h.node_id}"
    now = int(client.get_response(node_key).header.revision)
    return [rev for rev in range(since + 1, now + 1)
            if client.get_response(node_key, revision=rev).kvs and not client.get_response(join_key, revision=rev).kvs]


@pytest.mark.timeout(60)
def test_a_node_whose_lease_expired_is_never_registered_without_its_join(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """Issue 18 (1,000 agents, mass lease expiry): a recovery round closes once every registered node has joined;
    a node re-registering after its lease expired wrote its node key, then its join key, so under hundreds of
    expiries some node was "registered, not joined" at almost every instant and the round did not close. The
    re-registration writes both in one transaction: no revision shows the node without its join."""
    import etcd3

    hs = [handlers(make_config(etcd_server.endpoint, min_nodes=3, max_nodes=3, rejoin_timeout=600), node_id=f"n{i}")
          for i in range(2)]
    waiting = [pool.submit(h.next_rendezvous) for h in hs]  # 2 of 3: the round stays open until the third joins
    host, port = etcd_server.endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    try:
        n1 = hs[1]
        join_key = f"{n1.keys.join_prefix}1/{n1.node_id}"
        wait_for(lambda: client.get(join_key)[0] is not None, 10, "n1's join key")
        for _ in range(3):  # each revoke: a lease expiry, as the starved keepers saw them
            old = n1.registration.lease_id
            since = int(client.get_prefix_response(n1.keys.ctl).header.revision)
            client.revoke_lease(old)
            wait_for(lambda old=old: n1.registration.lease_id not in (None, old)
                     and client.get(join_key)[1] is not None
                     and client.get(join_key)[1].lease_id == n1.registration.lease_id, 10, "n1 re-registered and re-joined")
            assert _registered_without_join(client, n1, 1, since) == []
        assert not any(f.done() for f in waiting)
    finally:
        client.close()
    third = handlers(make_config(etcd_server.endpoint, min_nodes=3, max_nodes=3, rejoin_timeout=600), node_id="n2")
    assert_consistent([third.next_rendezvous(), *(f.result(timeout=20) for f in waiting)], 3)


@pytest.mark.timeout(60)
def test_a_re_registration_does_not_re_join_a_round_that_moved_on(etcd_server: EmbeddedEtcd, handlers) -> None:
    """The re-join is guarded like the join: once the round key moved since the join saw it, only the node key is
    written again (a stale agent never writes a join key for a round that was committed meanwhile)."""
    import etcd3

    h = handlers(make_config(etcd_server.endpoint, min_nodes=2, max_nodes=2), node_id="n0")
    h.connect()
    h.register()
    h.registration.joining = (1, 12345)  # as if our join saw a round key the round has moved on from since
    host, port = etcd_server.endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    try:
        old = h.registration.lease_id
        client.revoke_lease(old)
        node_key = h.keys.nodes_prefix + "n0"
        wait_for(lambda: h.registration.lease_id not in (None, old) and client.get(node_key)[0] is not None, 10,
                 "n0 re-registered")
        assert client.get(f"{h.keys.join_prefix}1/n0")[0] is None
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_agents_end_in_one_round_after_mass_lease_expiries_during_the_recovery(etcd_server: EmbeddedEtcd, handlers,
                                                                               pool) -> None:
    """Issue 18 at small scale (1,000 simulated agents starved their lease keepers): half the survivors' leases
    are revoked every 0.2 s from the loss on, while the recovery round forms. A round closes without a node
    whose lease was gone at that instant; that node joins the next round and the others, like agents, re-form
    for it (``membership_changed``). Only the fast path closes rounds here (``rejoin_timeout`` 600 s): once
    the expiries stop, every survivor ends in one round of all of them within seconds."""
    import random

    import etcd3
    import grpc

    from elastic.rendezvous.etcd_client import ClientPool

    n = 10
    config = make_config(etcd_server.endpoint, min_nodes=1, max_nodes=n, last_call_timeout=600, rejoin_timeout=600,
                         join_timeout=20)
    shared = ClientPool()  # as the bench's simulated agents: one client, keeper and follower watch per process
    hs = [handlers(config, node_id=f"a{i:02d}", pool=shared) for i in range(n)]
    assert_consistent(rendezvous_all(pool, hs), n)
    victim = hs[n // 2]
    survivors = [h for h in hs if h is not victim]
    latest: dict[str, tuple[int, int]] = {}
    settled = threading.Event()

    def agent(h: EtcdV3RendezvousHandler) -> None:
        assert h.wait_membership_change(LOSS_BOUND_S + 5)
        while not settled.is_set():
            info = h.next_rendezvous()
            latest[h.node_id] = (h.round or 0, info.world_size)
            while not settled.is_set() and not h.wait_membership_change(0.1):
                pass
        h.leave()  # not a straggler of a round the others may still be forming

    host, port = etcd_server.endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    victim.simulate_crash(silent=True)
    agents = [pool.submit(agent, h) for h in survivors]
    try:
        rng = random.Random(18)
        until = time.monotonic() + LEASE_TTL + 1.5  # through the loss and the first recovery rounds
        while time.monotonic() < until:
            for h in rng.sample(survivors, len(survivors) // 2):
                lease = h.registration.lease_id
                if lease is not None:
                    try:
                        client.revoke_lease(lease)
                    except grpc.RpcError as exc:  # revoked already, its node re-registering
                        if exc.code() is not grpc.StatusCode.NOT_FOUND:
                            raise
            time.sleep(0.2)

        def one_round() -> bool:
            rounds = {latest.get(h.node_id) for h in survivors}
            return rounds == {(max(r for r, _ in latest.values()), n - 1)} and not any(
                h.membership_changed() for h in survivors)

        wait_for(one_round, 15, "every survivor in one round of all survivors")
    finally:
        settled.set()
        client.close()
    for f in agents:
        f.result(timeout=25)


def test_handler_threads_are_released(etcd_server: EmbeddedEtcd) -> None:
    before = {t.ident for t in threading.enumerate()}
    h = EtcdV3RendezvousHandler(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=1))
    h.next_rendezvous()
    h.shutdown()
    h.shutdown()  # idempotent
    leftover = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("rdzv-")]
    assert leftover == []


def test_queries_after_leave_answer_from_last_state(etcd_server: EmbeddedEtcd) -> None:
    h = EtcdV3RendezvousHandler(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=1))
    h.next_rendezvous()
    h.leave()
    assert h.is_closed() is False  # leave() does not close the job
    assert h.num_nodes_waiting() == 0
    with pytest.raises(RendezvousClosedError, match="shut down"):
        h.next_rendezvous()


@pytest.mark.timeout(60)
def test_user_password_auth(etcd_server: EmbeddedEtcd, handlers) -> None:
    """etcd with auth enabled: right credentials work (rendezvous and store), wrong ones fail clearly."""
    from elastic.etcd_server import find_etcd_binary

    etcdctl = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    if not os.access(etcdctl, os.X_OK):
        pytest.skip(f"etcdctl not found next to the etcd binary ({etcdctl}); needed to enable auth")

    def ctl(*args: str) -> None:
        subprocess.run(
            [etcdctl, f"--endpoints={etcd_server.endpoint}", *args],
            env=dict(os.environ, ETCDCTL_API="3"), check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    ctl("user", "add", "root:s3cret", "--interactive=false")
    ctl("user", "grant-role", "root", "root")
    ctl("auth", "enable")

    ok = handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=1, user="root", password="s3cret"))
    info = ok.next_rendezvous()
    info.store.set("k", "v")
    assert info.store.get("k") == b"v"
    with pytest.raises(RendezvousConnectionError, match="authentication failed"):
        handlers(make_config(etcd_server.endpoint, user="root", password="wrong", etcd_timeout=2)).next_rendezvous()
    with pytest.raises(RendezvousConnectionError, match="user name is empty"):
        handlers(make_config(etcd_server.endpoint, etcd_timeout=2)).next_rendezvous()


@pytest.mark.timeout(60)
def test_stale_commit_is_rejected_and_old_stores_are_dropped(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """A commit based on an old view of the round key fails (txn on its mod revision); stores are per round."""
    h = handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=1), node_id="solo")
    info1 = h.next_rendezvous()
    info1.store.set("k", "round1")
    stale_mod = h.mirror.committed_mod
    info2 = h.next_rendezvous()
    assert h.round == 2
    assert not info2.store.check(["k"]), "a new round starts from an empty store"
    # An agent still acting on round 1's view tries to commit "its" round 2: etcd refuses.
    assert h.rounds.commit(2, ("ghost",), stale_mod, 0) is False
    assert h.mirror.committed is not None and h.mirror.committed.participants == ("solo",)
    # A commit of a proposal the coordinator has replaced since (its revision moved) fails too.
    assert h.rounds.commit(3, ("ghost",), h.mirror.committed_mod, stale_mod) is False
    assert h.mirror.committed.number == 2
    h.next_rendezvous()  # round 3 drops round 1's store
    assert not info1.store.check(["k"])


@pytest.mark.timeout(30)
def test_a_node_that_leaves_keeps_serving_its_workers_store_until_shutdown(etcd_server: EmbeddedEtcd, handlers) -> None:
    """A node leaving for its notice revokes its lease while its workers still tear down their process groups:
    the store they bootstrapped from stays up until the agent shuts down (or exits)."""
    h = handlers(make_config(etcd_server.endpoint, min_nodes=1, max_nodes=1), node_id="leaver")
    info = h.next_rendezvous()
    client = workers_store(info)
    client.set("k", "v")
    h.leave()
    assert client.get("k") == b"v", "the workers' store must outlive the lease"
    h.shutdown()
    assert refuses(info.bootstrap_store_info.master_port), "closed at shutdown"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_published_notice_reaches_peers_and_outlives_the_leaver_for_its_round(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    config = make_config(etcd_server.endpoint, run_id="notice", min_nodes=2, max_nodes=2)
    a, b = handlers(config, "a"), handlers(config, "b")
    rendezvous_all(pool, [a, b])
    a.publish_notice({"source": "sigterm", "deadline": 123.5})
    deadline = time.monotonic() + 10
    while "a" not in b.peer_notices() and time.monotonic() < deadline:
        b.wait_membership_change(0.05)
    assert b.peer_notices() == {"a": {"source": "sigterm", "deadline": 123.5, "node": "a"}}
    assert not b.membership_changed(), "a notice alone is not a membership change"
    a.leave()
    assert b.wait_membership_change(LOSS_BOUND_S), "a revoked lease is seen at once"
    assert b.lost_peers() == {"a"}
    # The key went with a's lease, but b keeps a's notice for the rest of the round: a node leaving for its
    # notice revokes its lease right after its workers' acknowledgement, possibly before b's agent looked.
    assert b.peer_notices() == {"a": {"source": "sigterm", "deadline": 123.5, "node": "a"}}
    rendezvous_all(pool, [b, handlers(config, "c")])  # the next round, without a
    assert b.peer_notices() == {}, "gone with the round the leaver belonged to"


@pytest.mark.timeout(60)
def test_an_announced_restart_reaches_the_peers_of_that_round_only(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """``publish_restart``: a node whose workers failed tells its round (a follower's watch sees it; not a
    membership change by itself); the next round is not told of it."""
    config = make_config(etcd_server.endpoint, run_id="restart", min_nodes=2, max_nodes=2)
    a, b = handlers(config, "a"), handlers(config, "b")
    rendezvous_all(pool, [a, b])
    b.publish_restart()
    deadline = time.monotonic() + 10
    while "b" not in a.restarted_peers() and time.monotonic() < deadline:
        a.wait_membership_change(0.05)
    assert a.restarted_peers() == {"b"} and b.restarted_peers() == set(), "the peers', not its own"
    assert not a.membership_changed(), "announced before the node re-joins: no change yet"
    rendezvous_all(pool, [a, b])  # b re-joins with its new workers
    assert a.round == 2
    assert a.restarted_peers() == set(), "the announcement named the round before"


def test_an_address_this_host_cannot_serve_is_a_clear_config_error() -> None:
    from elastic.rendezvous.api import RendezvousConfigError
    from elastic.rendezvous.worker_store import WorkerStoreHost

    host = WorkerStoreHost("no-such-host.invalid", enabled=True)
    with pytest.raises(RendezvousConfigError, match=r"workers' store of round 3 at no-such-host\.invalid"):
        host.port_for(3)


def test_a_resolver_that_fails_for_now_is_left_to_the_stores_own_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """EAI_AGAIN (a DNS server that did not answer) is not "no such host": the store is still tried, and only
    the name that does not exist is refused at once."""
    import socket

    from elastic.rendezvous import worker_store
    from elastic.rendezvous.api import RendezvousConfigError

    tried: list[str] = []

    def fake_store(addr: str, *args: object, **kwargs: object) -> object:
        tried.append(addr)
        raise RuntimeError("store reached")

    def no_answer(*args: object, **kwargs: object) -> object:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(worker_store, "TCPStore", fake_store)
    monkeypatch.setattr(worker_store.socket, "getaddrinfo", no_answer)
    host = worker_store.WorkerStoreHost("flaky-dns.example", enabled=True)
    with pytest.raises(RendezvousConfigError, match="store reached"):
        host.port_for(1)
    assert tried == ["flaky-dns.example"]


@pytest.mark.timeout(60)
def test_the_round_record_names_each_participants_liveness_port_and_the_ring_uses_it(
        etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """The coordinator's proposal carries every participant's liveness port and lease (from its mirror of the
    registrations) and the commit copies them into the round record: each agent holds a connection to its ring
    successor without reading that successor's registration (one read per agent per round less)."""
    import json

    config = make_config(etcd_server.endpoint, run_id="ring", min_nodes=3, max_nodes=3)
    hs = [handlers(config, node_id=f"n{i}") for i in range(3)]
    assert_consistent(rendezvous_all(pool, hs), 3)
    conn = hs[0].connection
    assert conn is not None
    value, _ = conn.client.get(config.run_prefix + "ctl/round")
    record = json.loads(value)
    by_node = {h.node_id: h for h in hs}
    for node, (addr, port, lease) in record["ring"].items():
        h = by_node[node]
        assert h.peers.listener is not None and (port, lease) == (h.peers.listener.port, h.registration.lease_id), f"{node}'s ring entry"
        assert isinstance(addr, str) and addr
    assert set(record["ring"]) == set(by_node)
    for rank, node in enumerate(record["participants"]):
        successor = record["participants"][(rank + 1) % 3]
        watch = by_node[node].peers.watch
        assert watch is not None and watch.target is not None and watch.target.node == successor
        assert watch.target.port == by_node[successor].peers.listener.port  # type: ignore[union-attr]


def test_the_election_wait_grows_with_max_nodes_and_is_capped() -> None:
    """A small job elects at once; 1,000 agents spread their tries over ~0.5 s (see ``election_spread``)."""
    from elastic.rendezvous.etcd_v3 import ELECT_SPREAD_MAX_S, election_spread

    assert election_spread(3) == 0.0 and election_spread(19) == 0.0
    assert 0.4 <= election_spread(1000) <= 0.6
    assert election_spread(100_000) == ELECT_SPREAD_MAX_S
