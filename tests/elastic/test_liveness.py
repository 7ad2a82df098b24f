"""A dead agent known in under a second when its process dies (``elastic/rendezvous/liveness.py``), with no
false positive for a paused one: the pure verdict, the sockets, and real agent processes on a real etcd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous import peers as peers_module
from elastic.rendezvous.api import RendezvousStateError
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.liveness import (
    LivenessListener,
    Peer,
    PeerWatch,
    Probe,
    SeenAccepting,
    Verdict,
    peer_from_registration,
    probe,
    probe_all,
    verdict,
)
from tests.elastic.test_rendezvous_etcd import make_config
from tests.harness.procs import wait_for

TTL = 5
"""Lease TTL of the agent tests: long enough that a detection within DEATH_BOUND_S cannot be the lease's."""
DEATH_BOUND_S = 1.0
"""Target 0.5 s (issue 18); the bound leaves room for a loaded 2-core machine."""


def test_verdict_only_a_refusal_is_death() -> None:
    assert verdict(Probe.REFUSED, seen_accepting=True) is Verdict.DEAD
    assert verdict(Probe.ACCEPTED, seen_accepting=True) is Verdict.ALIVE
    assert verdict(Probe.ACCEPTED, seen_accepting=False) is Verdict.ALIVE
    # a partition or a powered-off host: the lease decides
    assert verdict(Probe.SILENT, seen_accepting=True) is Verdict.UNKNOWN


def test_a_refusal_from_a_port_never_seen_accepting_proves_nothing() -> None:
    # a firewall REJECT, or an advertised address (getfqdn) that leads elsewhere, refuses for a live peer
    assert verdict(Probe.REFUSED, seen_accepting=False) is Verdict.UNKNOWN


def _refusing_port() -> int:
    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_probe_all_calls_dead_only_a_peer_it_saw_accepting() -> None:
    listener = LivenessListener()
    seen = SeenAccepting()
    was_up = Peer("was-up", "127.0.0.1", listener.port, 1)
    never = Peer("never", "127.0.0.1", _refusing_port(), 2)
    assert probe_all([was_up, never], seen) == {"was-up": Verdict.ALIVE, "never": Verdict.UNKNOWN}
    listener.close()
    assert probe_all([was_up, never], seen) == {"was-up": Verdict.DEAD, "never": Verdict.UNKNOWN}
    assert Peer("was-up", "127.0.0.1", listener.port, 3) not in seen  # another lease: another process


def test_a_watched_port_that_refuses_from_the_start_is_not_reported() -> None:
    reported = threading.Event()
    watch = PeerWatch(lambda peer: reported.set())
    try:
        watch.watch(Peer("firewalled", "127.0.0.1", _refusing_port(), 1))
        assert not reported.wait(2.5), "a peer whose port never accepted was declared dead"  # tried ~3 times
    finally:
        watch.close()


@pytest.mark.parametrize("info", [
    None, [], "x", {"addr": "h", "live_port": 70000, "lease": 1}, {"addr": "h", "live_port": True, "lease": 1},
    {"addr": "", "live_port": 5, "lease": 1}, {"addr": "a b", "live_port": 5, "lease": 1},
    {"addr": "h" * 300, "live_port": 5, "lease": 1}, {"addr": "h", "live_port": "5", "lease": 1}, {"addr": "h"},
])  # fmt: skip
def test_a_malformed_or_missing_liveness_entry_means_lease_only(info: object) -> None:
    assert peer_from_registration("n", info, lease=5) is None


def test_a_registration_names_its_liveness_port_and_etcd_its_lease() -> None:
    # the lease is the registration key's (etcd metadata); the JSON's "lease" is never believed
    info = {"addr": "node-1", "live_port": 4000, "lease": 77}
    assert peer_from_registration("n", info, lease=78) == Peer("n", "node-1", 4000, 78)
    assert peer_from_registration("n", info, lease=0) is None  # a key without a lease: nothing to revoke


def test_the_listener_holds_at_most_max_held_connections() -> None:
    listener = LivenessListener(max_held=4)
    conns = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(12)]
    try:
        conns[-1].sendall(b"")  # the last one is accepted after the others (one accept thread, in order)
        wait_for(lambda: listener.held == 4 and all(_closed_by_peer(c) for c in conns[:8]), timeout=10,
                 what="the listener to drop its oldest connections")
        assert not any(_closed_by_peer(c) for c in conns[8:])
    finally:
        for c in conns:
            c.close()
        listener.close()


def _closed_by_peer(conn: socket.socket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


_EMFILE_CHILD = textwrap.dedent(
    """
    import logging, os, socket, threading, time
    from elastic.rendezvous.liveness import LivenessListener
    failed = threading.Event()
    class Seen(logging.Handler):
        def emit(self, record):
            if "accept failed" in record.getMessage():
                failed.set()
    logging.getLogger("elastic.rendezvous.liveness").addHandler(Seen())
    listener = LivenessListener()
    fillers = []
    try:
        while True:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    os.close(fillers.pop())
    client = socket.create_connection(("127.0.0.1", listener.port))  # queued; accept() gets EMFILE
    assert failed.wait(10), "accept never failed"
    for fd in fillers:
        os.close(fd)
    deadline = time.monotonic() + 10
    while listener.held < 1 and time.monotonic() < deadline:
        failed.wait(0.05)
    print("held", listener.held, flush=True)
    """
)


@pytest.mark.timeout(60)
def test_the_listener_goes_on_accepting_after_running_out_of_descriptors() -> None:
    done = subprocess.run([sys.executable, "-c", _EMFILE_CHILD], capture_output=True, text=True, timeout=40,
                          cwd=os.getcwd())  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "held 1", done.stdout + done.stderr


def test_probe_of_an_address_the_resolver_rejects_is_silent_not_an_error() -> None:
    """Addresses come from etcd (registrations, the round record's ring): one that passes
    ``peer_from_registration`` but that the resolver rejects must not raise into the agent's monitor loop."""
    for addr in ("x..y", "a" * 64):
        assert probe(addr, 1, timeout=0.1) is Probe.SILENT


def test_probe_tells_a_listening_process_from_a_gone_one() -> None:
    listener = LivenessListener()
    assert probe("127.0.0.1", listener.port) is Probe.ACCEPTED
    listener.close()
    assert probe("127.0.0.1", listener.port) is Probe.REFUSED


_CHILD = textwrap.dedent(
    """
    import sys, time
    from elastic.rendezvous.liveness import LivenessListener
    listener = LivenessListener()
    print(listener.port, flush=True)
    time.sleep(600)
    """
)


def _child_listener() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    line = proc.stdout.readline()  # type: ignore[union-attr]  # stdout=PIPE
    return proc, int(line)


@pytest.mark.timeout(60)
def test_a_watched_process_killed_is_reported_at_once_a_paused_one_never() -> None:
    dead: list[tuple[Peer, float]] = []
    reported = threading.Event()

    def on_dead(peer: Peer) -> None:
        dead.append((peer, time.monotonic()))
        reported.set()

    watch = PeerWatch(on_dead)
    proc, port = _child_listener()
    try:
        peer = Peer("child", "127.0.0.1", port, 1)
        watch.watch(peer)
        wait_for(lambda: watch.holding == peer, timeout=10, what="the watcher to connect")
        os.kill(proc.pid, signal.SIGSTOP)
        assert not reported.wait(2.0), "a paused (SIGSTOPped) process was declared dead"
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        killed = time.monotonic()
        assert reported.wait(DEATH_BOUND_S), "a SIGKILLed process was not reported"
        assert dead[0][0] == peer and dead[0][1] - killed < DEATH_BOUND_S
    finally:
        watch.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


_AGENT = textwrap.dedent(
    """
    import sys, time
    from elastic.rendezvous.api import EtcdRendezvousConfig
    from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler
    cfg = EtcdRendezvousConfig(run_id=sys.argv[2], endpoints=(("127.0.0.1", int(sys.argv[1])),), min_nodes=2,
                               max_nodes=2, lease_ttl={ttl}, liveness_probe=sys.argv[3] == "1")
    info = EtcdV3RendezvousHandler(cfg, node_id="child").next_rendezvous()
    print("rank", info.rank, info.world_size, flush=True)
    time.sleep(600)
    """
).format(ttl=TTL)


def _two_agents(etcd: EmbeddedEtcd, handlers, pool, run_id: str, liveness: bool):  # type: ignore[no-untyped-def]
    survivor = handlers(make_config(etcd.endpoint, run_id=run_id, min_nodes=2, max_nodes=2, lease_ttl=TTL,
                                    liveness_probe=liveness), node_id="parent")  # fmt: skip
    fut = pool.submit(survivor.next_rendezvous)
    proc = subprocess.Popen([sys.executable, "-c", _AGENT, str(etcd.client_port), run_id, "1" if liveness else "0"],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())  # fmt: skip
    line = pool.submit(proc.stdout.readline).result(timeout=30)  # type: ignore[union-attr]  # stdout=PIPE
    assert line.startswith("rank "), line
    assert fut.result(timeout=20).world_size == 2
    return survivor, proc


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_sigkilled_agent_is_known_dead_well_within_its_lease(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    survivor, proc = _two_agents(etcd_server, handlers, pool, "live", liveness=True)
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # paused for 2 s (< TTL): alive, and not taken for dead
        assert not survivor.wait_membership_change(2.0), "a paused agent was declared dead"
        os.kill(proc.pid, signal.SIGCONT)
        assert survivor.probe_peers() == set(), "a running agent's probe must be accepted"
        proc.kill()
        killed = time.monotonic()
        assert survivor.wait_membership_change(TTL), "the loss was not seen"
        seen = time.monotonic() - killed
        assert seen < DEATH_BOUND_S, f"death seen after {seen:.2f} s (lease TTL {TTL} s)"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_without_the_probe_the_lease_decides(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    survivor, proc = _two_agents(etcd_server, handlers, pool, "lease-only", liveness=False)
    try:
        proc.kill()
        killed = time.monotonic()
        assert survivor.wait_membership_change(TTL + 3), "the loss was not seen"
        assert time.monotonic() - killed > DEATH_BOUND_S  # the lease TTL (5 s), minus what had run of it
        assert survivor.probe_peers() == set()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _etcd_client(etcd: EmbeddedEtcd):  # type: ignore[no-untyped-def]
    import etcd3

    host, port = etcd.endpoint.rsplit(":", 1)
    return etcd3.client(host=host, port=int(port))


def _lease_left(client, survivor, node: str) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """(lease, seconds it has left) of ``node``'s registration, as etcd says now (-1 s: the lease is gone)."""
    value, meta = client.get(RunKeys(survivor.config.run_prefix).nodes_prefix + node)
    assert value is not None, f"{node} is not registered"
    lease = int(meta.lease_id)
    return lease, float(client.get_lease_info(lease).TTL)


@pytest.mark.slow
@pytest.mark.long  # ~11 s: it must outwait a whole lease TTL after the pause
@pytest.mark.timeout(90)
def test_a_paused_then_resumed_agent_is_never_declared_dead(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """SIGSTOP for less than the lease TTL (a slow or descheduled host): a worker failure makes the survivor
    probe it meanwhile (its kernel still accepts: alive), and once resumed it refreshes its lease in time and
    stays a member for good, past the instant its lease would have run out without a refresh."""
    survivor, proc = _two_agents(etcd_server, handlers, pool, "paused", liveness=True)
    client = _etcd_client(etcd_server)
    pause_s = 2.0  # the lease keeps >= TTL - TTL/3 - 2 = 1.3 s after the pause for the resumed refresh
    try:
        lease, _ = _lease_left(client, survivor, "child")
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert survivor.probe_peers() == set(), "a paused agent's port still accepts: it must not be taken for dead"
        assert not survivor.wait_membership_change(pause_s - (time.monotonic() - stopped)), "declared dead while paused"
        os.kill(proc.pid, signal.SIGCONT)
        # Until a whole TTL after the pause began (its lease's end had it not been refreshed since), and one more
        # refresh period: still the same member, on the same lease, with no loss reported.
        assert not survivor.wait_membership_change(TTL + TTL / 3 - (time.monotonic() - stopped)), \
            "a resumed agent was declared dead"
        assert survivor.lost_peers() == set()
        now_lease, left = _lease_left(client, survivor, "child")
        assert now_lease == lease and left > 0, "the resumed agent's lease was revoked or replaced"
        assert proc.poll() is None
    finally:
        client.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_confirmed_dead_agents_lease_is_revoked_by_its_peer(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """A SIGKILLed agent's lease, with most of its TTL still to run, is gone from etcd within DEATH_BOUND_S:
    only the survivor's revoke (after its probe was refused) can have ended it that early."""
    survivor, proc = _two_agents(etcd_server, handlers, pool, "revoked", liveness=True)
    client = _etcd_client(etcd_server)
    try:
        wait_for(lambda: survivor.peers.watch is not None and survivor.peers.watch.holding is not None, timeout=10,
                 what="the survivor to hold a connection to the child's liveness port")
        lease, left = _lease_left(client, survivor, "child")
        assert left > DEATH_BOUND_S + 1, f"the child's lease has only {left} s left: an expiry would prove nothing"
        proc.kill()
        killed = time.monotonic()
        wait_for(lambda: client.get_lease_info(lease).TTL == -1, timeout=DEATH_BOUND_S,
                 what="the dead agent's lease to be revoked")
        revoked_after = time.monotonic() - killed
        assert revoked_after < left - 0.5, f"lease gone after {revoked_after:.2f} s: it expired, nobody revoked it"
        assert survivor.wait_membership_change(DEATH_BOUND_S), "the survivor did not see the revoked lease's loss"
        assert survivor.lost_peers() == {"child"}
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_the_lease_to_revoke_is_the_registration_keys_not_the_one_it_names(etcd_server: EmbeddedEtcd, handlers) -> None:
    h = handlers(make_config(etcd_server.endpoint, run_id="hostile", min_nodes=1, max_nodes=3))
    h.next_rendezvous()
    client = _etcd_client(etcd_server)
    try:
        own = client.lease(30)
        hostile = {"node_id": "intruder", "addr": "127.0.0.1", "live_port": 9, "lease": h.registration.lease_id, "seq": 1}
        client.put(RunKeys(h.config.run_prefix).nodes_prefix + "intruder", json.dumps(hostile), lease=own)
        peer = wait_for(lambda: h.mirror.peers.get("intruder"), timeout=10, what="the registration to be seen")
        assert peer.lease == own.id != h.registration.lease_id
        client.revoke_lease(own.id)
    finally:
        client.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["[1, 2]", "7", "[" * 100_000 + "]" * 100_000])
def test_an_unusable_registration_value_is_a_state_error(etcd_server: EmbeddedEtcd, handlers, value: str) -> None:
    h = handlers(make_config(etcd_server.endpoint, run_id="garbage", min_nodes=1, max_nodes=3))
    h.next_rendezvous()
    client = _etcd_client(etcd_server)
    try:
        client.put(RunKeys(h.config.run_prefix).nodes_prefix + "garbage", value)
    finally:
        client.close()
    with pytest.raises(RendezvousStateError, match="corrupt rendezvous key"):
        h.wait_membership_change(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loss", ["killed", "paused", "no_answer"])
def test_a_lost_peers_port_says_whether_the_survivors_collectives_break(
        etcd_server: EmbeddedEtcd, handlers, pool, monkeypatch, loss: str) -> None:  # type: ignore[no-untyped-def]
    """The agent waits for its workers' just-in-time snapshots only when a lost peer may have died on a live host
    (its port refuses: its workers' connections were reset too); a paused node (its port still accepts) or a
    silent one (power off, a partition: the probe gets no answer) breaks no collective, so ``lost_peers_refuse``
    is False and the workers are stopped at once. What cannot be probed gets the grace (True)."""
    hs = [handlers(make_config(etcd_server.endpoint, run_id=f"refuse-{loss}", min_nodes=2, max_nodes=2),
                   node_id=f"n{i}") for i in range(2)]  # fmt: skip
    assert all(info.world_size == 2 for info in pool.map(lambda h: h.next_rendezvous(), hs))
    survivor, victim = hs
    assert survivor.lost_peers_refuse() is False  # nobody lost: nothing to wait for
    victim.simulate_crash(silent=loss != "killed")
    assert survivor.wait_membership_change(TTL + 5), "the loss was not seen"
    assert survivor.lost_peers() == {victim.node_id}
    if loss == "no_answer":  # a powered-off host or a partition: the connect times out
        monkeypatch.setattr(peers_module, "probe_each", lambda found, timeout=0.3: [Probe.SILENT] * len(found))
    assert survivor.lost_peers_refuse() is (loss == "killed")
    assert survivor.peers.any_refuses({"not-in-the-ring"}) is True  # no address to probe: unknown


@pytest.mark.timeout(60)
def test_a_node_left_out_of_a_newer_round_has_no_snapshot_to_wait_for(etcd_server: EmbeddedEtcd, handlers,
                                                                      pool) -> None:  # type: ignore[no-untyped-def]
    """A node whose lease lapsed (a partition, a pause) while its peer formed a newer round without it: that
    group restored without this node's state (no newer than theirs), so its workers are stopped at once, not
    left for ``--stop-grace`` in a collective with peers that moved on (the partition test: once the link was
    back they got the old peers' resets and failed with a traceback). Its old peer's port accepts or refuses
    alike: being left out decides. The old code waited (True: the lost peer, itself, is not in any ring)."""
    hs = [handlers(make_config(etcd_server.endpoint, run_id="left-out", min_nodes=1, max_nodes=2), node_id=f"n{i}")
          for i in range(2)]  # fmt: skip
    assert all(info.world_size == 2 for info in pool.map(lambda h: h.next_rendezvous(), hs))
    stayer, left_out = hs
    client = _etcd_client(etcd_server)
    try:
        client.revoke_lease(left_out.registration.lease_id)  # what an expiry during a partition does
    finally:
        client.close()
    assert stayer.wait_membership_change(TTL + 5), "the stayer did not see the lapsed lease"
    assert stayer.next_rendezvous().world_size == 1
    wait_for(lambda: left_out.mirror.committed is not None and left_out.mirror.committed.number == 2, timeout=10,
             what="the left-out node to see round 2")  # fmt: skip
    assert left_out.round == 1 and left_out.node_id not in left_out.mirror.committed.participants
    assert left_out.lost_peers_refuse() is False
