"""The etcd v3 rendezvous against a hostile or unusual etcd (issue 10), each with a real etcd:
expiring auth tokens, a reused run id, IPv6, TLS failures, an unreachable endpoint."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator

import etcd3
import pytest

from elastic.etcd_server import EmbeddedEtcd, ServerTLS
from elastic.rendezvous.api import (
    EtcdRendezvousConfig,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousFinishedError,
    RendezvousTLSError,
    RendezvousWatchError,
    is_permanent,
    parse_endpoints,
)
from elastic.rendezvous.etcd_client import WARN_EVERY_S, probe_protocol
from tests.elastic.etcd_security import PASSWORD, USER, Certs, enable_auth, etcdctl_path, make_certs
from tests.elastic.test_rendezvous_etcd import LOSS_BOUND_S, make_config, rendezvous_all
from tests.harness.procs import wait_for

TOKEN_TTL = 3
"""etcd's --auth-token-ttl in these tests (etcd's default is 300 s): a simple token unused this long dies."""


def _config(endpoint: str, **kw: object) -> EtcdRendezvousConfig:
    return make_config(endpoint, **kw)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    made = make_certs(tmp_path_factory.mktemp("certs"))
    if made is None:
        pytest.skip("openssl is not installed; it makes the test certificates")
    return made


@pytest.fixture
def etcdctl() -> str:
    path = etcdctl_path()
    if path is None:
        pytest.skip("etcdctl not found next to the etcd binary nor on PATH; it enables etcd auth")
    return path


@pytest.fixture
def auth_etcd(etcdctl: str) -> Iterator[EmbeddedEtcd]:
    """etcd with auth enabled, simple tokens living TOKEN_TTL seconds, and the non-root user USER."""
    server = EmbeddedEtcd(extra_args=["--auth-token=simple", f"--auth-token-ttl={TOKEN_TTL}"])
    try:
        server.start()
        enable_auth(etcdctl, server.endpoint)
        yield server
    finally:
        server.close()


@pytest.fixture
def tls_etcd(certs: Certs) -> Iterator[EmbeddedEtcd]:
    """etcd serving TLS and demanding client certificates signed by the test CA."""
    with EmbeddedEtcd(tls=ServerTLS(certs.server_cert, certs.server_key, certs.ca)) as server:
        yield server


# ------------------------------------------------------------------ auth tokens
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_job_outliving_the_auth_token_survives_a_node_loss_and_an_etcd_restart(
    auth_etcd: EmbeddedEtcd, handlers, pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elastic.rendezvous")
    conf: dict[str, object] = {"min_nodes": 1, "max_nodes": 3, "user": USER, "password": PASSWORD}
    hs = [handlers(_config(auth_etcd.endpoint, **conf), node_id=f"n{i}") for i in range(2)]
    infos = rendezvous_all(pool, hs)
    infos[0].store.set("before", "1")

    # The condition under test is the passage of time: every token the handlers hold expires unused.
    time.sleep(TOKEN_TTL + 1.5)
    hs[1].simulate_crash()
    assert hs[0].wait_membership_change(LOSS_BOUND_S + 5), "the survivor must see the loss"
    (info,) = rendezvous_all(pool, [hs[0]])
    assert (hs[0].round, info.world_size) == (2, 1)
    info.store.set("after", "2")  # the new round's store, with a renewed token
    assert info.store.get("after") == b"2"
    assert "re-authenticated to etcd" in caplog.text

    # A restarted etcd forgets every simple token: the watch and the lease keepalive renew theirs.
    auth_etcd.stop()
    auth_etcd.start()
    newcomer = handlers(_config(auth_etcd.endpoint, **conf), node_id="n2")
    joined = pool.submit(newcomer.next_rendezvous)
    assert hs[0].wait_membership_change(20), "the survivor's renewed watch must see the newcomer"
    infos = rendezvous_all(pool, [hs[0]]) + [joined.result(timeout=20)]
    assert sorted(i.rank for i in infos) == [0, 1]
    infos[1].store.set("k", "v")
    assert infos[0].store.get("k") == b"v"  # a blocking store read (a watch) with a renewed token

    # A real permission problem is not mistaken for an expired token: named at once, not retried.
    outsider = handlers(_config(auth_etcd.endpoint, etcd_prefix="/not-granted", **conf))
    began = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="permission denied"):
        outsider.next_rendezvous()
    assert time.monotonic() - began < 5.0


@pytest.mark.timeout(90)
def test_a_refused_watch_is_permanent_and_named_within_seconds(
    auth_etcd: EmbeddedEtcd, etcdctl: str, handlers, pool
) -> None:
    """The user's role loses the prefix while the job trains; etcd restarts, so the watch must be opened again
    and is refused. That is no outage: the handler says so at once (the agent then ends the job with this
    message), not after etcd_timeout as "failing for N s"."""
    conf: dict[str, object] = {"min_nodes": 2, "max_nodes": 2, "user": USER, "password": PASSWORD,
                               "etcd_timeout": 30.0}
    hs = [handlers(_config(auth_etcd.endpoint, **conf), node_id=f"n{i}") for i in range(2)]
    rendezvous_all(pool, hs)
    subprocess.run([etcdctl, f"--endpoints=http://{auth_etcd.endpoint}", "--user=root:r00t-pw", "role",
                    "revoke-permission", "spotrun", "--prefix=true", "/spotrun/"],
                   env=dict(os.environ, ETCDCTL_API="3"), check=True, capture_output=True, timeout=30)
    auth_etcd.stop()
    auth_etcd.start()
    began = time.monotonic()
    with pytest.raises(RendezvousWatchError, match=r"etcd refuses to let user 'trainer' watch .*permission denied"
                       r".*grant its role readwrite") as raised:
        while time.monotonic() - began < 25.0:
            hs[0].wait_membership_change(1.0)
    assert is_permanent(raised.value), "the agent ends the job at once, without its outage clock"
    assert time.monotonic() - began < 10.0, "named within seconds, not after etcd_timeout (30 s)"


# ------------------------------------------------------------------ run id reuse
def _run_keys(endpoint: str, prefix: str) -> list[str]:
    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        return sorted(meta.key.decode() for _, meta in client.get_prefix(prefix))
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_same_run_id_works_again_after_a_clean_end(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    cfg = _config(etcd_server.endpoint, run_id="k8s-job", min_nodes=2, max_nodes=2)
    first = [handlers(cfg, node_id=f"a{i}") for i in range(2)]
    infos = rendezvous_all(pool, first)
    infos[0].store.set("stale", "from the first job")
    assert first[0].shutdown() is True  # the job ended: closed for everyone
    # a1 is still registered (as in its exit barrier): a0 leaving first deletes nothing a1 may still read.
    assert infos[1].store.get("stale") == b"from the first job" and first[1].is_closed()
    first[1].shutdown()  # the last agent of the ended job leaves: no key of the run is left
    wait_for(lambda: _run_keys(etcd_server.endpoint, cfg.run_prefix) == [], 5, "the ended run's keys to go")

    second = [handlers(cfg, node_id=f"b{i}") for i in range(2)]
    infos = rendezvous_all(pool, second)
    assert [h.round for h in second] == [1, 1], "the second job starts its own numbering"
    assert sorted(i.rank for i in infos) == [0, 1]
    assert not infos[0].store.check(["stale"]), "the first job's store was cleared"
    assert not any(h.is_closed() for h in second)

    # A newcomer to the second (running) job never clears it: it waits as a spare; the job goes on.
    spare = handlers(cfg, node_id="spare")
    waiting = pool.submit(spare.next_rendezvous)
    wait_for(lambda: second[0].num_nodes_waiting() == 0 and spare.registered, 10, "the spare to register")
    assert not waiting.done() and not any(h.membership_changed() for h in second)
    infos[0].store.set("live", "1")
    assert infos[1].store.get("live") == b"1"
    second[0].set_closed()  # ends the second job; the spare learns it from its watch
    with pytest.raises(RendezvousClosedError):
        waiting.result(timeout=10)


@pytest.mark.timeout(90)
def test_a_closed_run_with_live_agents_is_not_cleared_until_they_leave(
    etcd_server: EmbeddedEtcd, handlers, pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elastic.rendezvous")
    cfg = _config(etcd_server.endpoint, run_id="reuse", min_nodes=2, max_nodes=2)
    old = [handlers(cfg, node_id=f"old{i}") for i in range(2)]
    rendezvous_all(pool, old)
    old[0].set_closed()  # the job ended, but both agents are still winding down (registered)

    newcomer = handlers(_config(etcd_server.endpoint, run_id="reuse", min_nodes=1, max_nodes=1), node_id="new")
    fut = pool.submit(newcomer.next_rendezvous)
    wait_for(lambda: "waiting for 2 agent(s) of the ended job" in caplog.text, 10, "the newcomer to wait")
    assert not fut.done()
    with pytest.raises(RendezvousClosedError):  # the old agents still see their job closed
        old[1].next_rendezvous()
    old[0].leave()
    old[1].simulate_crash()  # the last old agent vanishes (SIGKILL): nobody of the ended job deletes its keys
    info = fut.result(timeout=LOSS_BOUND_S + 10)
    assert (newcomer.round, info.world_size) == (1, 1)
    assert "cleared the keys of the ended job" in caplog.text, "the newcomer cleared the ended run itself"


# ------------------------------------------------------------------ finished marker (finished_ttl)
def _lease_ttl_of(endpoint: str, key: str) -> int:
    """Seconds left on the lease of ``key`` (etcd's TTL; -1 without a lease)."""
    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        _, meta = client.get(key)
        assert meta is not None, f"{key} is not in etcd"
        return int(client.get_lease_info(meta.lease_id).TTL) if meta.lease_id else -1
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_a_finished_run_keeps_only_its_marker_and_a_newcomer_exits_at_once(
    etcd_server: EmbeddedEtcd, handlers, pool
) -> None:
    """A pod recreated after its Indexed Job's run finished: it must not wait join_timeout for peers."""
    cfg = _config(etcd_server.endpoint, run_id="done-job", min_nodes=2, max_nodes=2, finished_ttl=600,
                  join_timeout=60.0)
    first = [handlers(cfg, node_id=f"a{i}") for i in range(2)]
    rendezvous_all(pool, first)
    for handler in first:  # every agent of the last round, as the launcher does after the exit barrier
        handler.mark_finished()
    for handler in first:
        handler.shutdown()
    marker = f"{cfg.run_prefix}finished"
    wait_for(lambda: _run_keys(etcd_server.endpoint, cfg.run_prefix) == [marker], 5, "only the marker to stay")
    assert 590 <= _lease_ttl_of(etcd_server.endpoint, marker) <= 600, "the marker goes with its own lease"

    newcomer = handlers(_config(etcd_server.endpoint, run_id="done-job", min_nodes=2, max_nodes=2,
                                finished_ttl=600, join_timeout=60.0), node_id="recreated")
    began = time.monotonic()
    with pytest.raises(RendezvousFinishedError, match=r"run 'done-job' already finished successfully by node a\d "
                       r"at .*UTC: nothing to do, exiting 0 .*finished_ttl=600 s.*another --rdzv-id"):
        newcomer.connect()
    with pytest.raises(RendezvousFinishedError):  # also for a caller that goes straight to the rendezvous
        newcomer.next_rendezvous()
    assert time.monotonic() - began < 5.0, "at once, not after join_timeout"
    assert _run_keys(etcd_server.endpoint, f"{cfg.run_prefix}ctl/nodes/") == [], "it never registered"


@pytest.mark.timeout(60)
def test_the_finished_marker_gives_up_within_close_timeout_when_etcd_is_gone(
    etcd_server: EmbeddedEtcd, handlers, pool
) -> None:
    cfg = _config(etcd_server.endpoint, run_id="gone", min_nodes=1, max_nodes=1, finished_ttl=600,
                  close_timeout=2.0, etcd_timeout=20.0)
    (only,) = [handlers(cfg, node_id="g0")]
    rendezvous_all(pool, [only])
    etcd_server.stop()
    began = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="finished marker"):
        only.mark_finished()
    assert time.monotonic() - began < 2.0 + 5.0, "bounded by close_timeout, not etcd_timeout (20 s)"


@pytest.mark.timeout(90)
def test_without_finished_ttl_the_run_id_is_reused_as_before(etcd_server: EmbeddedEtcd, handlers, pool) -> None:
    """The marker is opt-in on both sides: a job without finished_ttl leaves none, and a newcomer without it
    starts a new job even where an opted-in job's marker lasts (run-id reuse)."""
    plain = _config(etcd_server.endpoint, run_id="plain", min_nodes=1, max_nodes=1)
    (only,) = [handlers(plain, node_id="p0")]
    rendezvous_all(pool, [only])
    only.mark_finished()
    only.shutdown()
    wait_for(lambda: _run_keys(etcd_server.endpoint, plain.run_prefix) == [], 5, "no key, no marker")

    marked = _config(etcd_server.endpoint, run_id="marked", min_nodes=1, max_nodes=1, finished_ttl=600)
    (done,) = [handlers(marked, node_id="m0")]
    rendezvous_all(pool, [done])
    done.mark_finished()
    done.shutdown()
    reuse = handlers(_config(etcd_server.endpoint, run_id="marked", min_nodes=1, max_nodes=1), node_id="m1")
    (info,) = rendezvous_all(pool, [reuse])
    assert (reuse.round, info.world_size) == (1, 1), "a new job with the run id, as before the marker existed"


@pytest.mark.timeout(90)
def test_a_newcomer_waiting_for_the_ended_jobs_agents_honours_the_marker_they_leave(
    etcd_server: EmbeddedEtcd, handlers, pool, caplog: pytest.LogCaptureFixture
) -> None:
    """The recreated pod arrives while the finished job's agents are still leaving (closed, registered)."""
    caplog.set_level(logging.INFO, logger="elastic.rendezvous")
    cfg = _config(etcd_server.endpoint, run_id="ending", min_nodes=2, max_nodes=2, finished_ttl=600)
    old = [handlers(cfg, node_id=f"old{i}") for i in range(2)]
    rendezvous_all(pool, old)
    old[0].set_closed()  # the job ended; its agents are winding down and have not written the marker yet

    newcomer = handlers(cfg, node_id="new")
    fut = pool.submit(newcomer.next_rendezvous)
    wait_for(lambda: "waiting for 2 agent(s) of the ended job" in caplog.text, 10, "the newcomer to wait")
    for handler in old:
        handler.mark_finished()
        handler.shutdown()
    with pytest.raises(RendezvousFinishedError):
        fut.result(timeout=LOSS_BOUND_S + 10)


# ------------------------------------------------------------------ IPv6
def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_ipv6_endpoint(handlers, pool) -> None:
    if not _ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1 cannot be bound)")
    with EmbeddedEtcd(host="::1") as server:
        assert server.endpoint.startswith("[::1]:")
        endpoints = parse_endpoints(server.endpoint)
        assert endpoints == (("::1", server.client_port),)
        cfg = EtcdRendezvousConfig(run_id="v6", endpoints=endpoints, min_nodes=2, max_nodes=2, lease_ttl=1,
                                   last_call_timeout=0.3, etcd_timeout=10)  # fmt: skip
        assert cfg.endpoint_str == server.endpoint
        infos = rendezvous_all(pool, [handlers(cfg), handlers(cfg)])
        infos[0].store.set("k", "v6")
        assert infos[1].store.get("k") == b"v6"


# ------------------------------------------------------------------ TLS
@pytest.mark.timeout(60)
def test_tls_with_client_certificate_forms_a_round(tls_etcd: EmbeddedEtcd, certs: Certs, handlers, pool) -> None:
    cfg = _config(tls_etcd.endpoint, min_nodes=2, max_nodes=2, cacert=certs.ca, cert=certs.client_cert,
                  key=certs.client_key)  # fmt: skip
    infos = rendezvous_all(pool, [handlers(cfg), handlers(cfg)])
    infos[0].store.set("k", "tls")
    assert infos[1].store.get("k") == b"tls"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "match"),
    [("wrong CA", "CERTIFICATE_VERIFY_FAILED"), ("no client certificate", "BAD_CERTIFICATE|CERTIFICATE_REQUIRED")],
)
def test_tls_failures_are_named_at_once(tls_etcd: EmbeddedEtcd, certs: Certs, handlers, case: str, match: str) -> None:
    tls = {"cacert": certs.other_ca, "cert": certs.client_cert, "key": certs.client_key}
    if case == "no client certificate":
        tls = {"cacert": certs.ca}
    handler = handlers(_config(tls_etcd.endpoint, etcd_timeout=20, **tls))
    began = time.monotonic()
    with pytest.raises(RendezvousTLSError, match=f"TLS handshake with etcd at {tls_etcd.endpoint} failed") as info:
        handler.next_rendezvous()
    assert time.monotonic() - began < 3.0, "a TLS failure must not be retried for etcd_timeout (20 s)"
    assert info.match(match)
    began = time.monotonic()
    handler.shutdown()  # nothing to close: must not retry for close_timeout either
    assert time.monotonic() - began < 3.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["plaintext client, TLS etcd", "TLS client, plaintext etcd"])
def test_a_tls_mismatch_is_named_at_once(
    tls_etcd: EmbeddedEtcd, etcd_server: EmbeddedEtcd, certs: Certs, handlers, case: str
) -> None:
    """grpc says only "Socket closed" / "Handshake read failed" for these: the server is asked what it speaks."""
    if case == "plaintext client, TLS etcd":
        endpoint, tls, match = tls_etcd.endpoint, {}, "speaks TLS but the rendezvous connects without it"
    else:
        endpoint, tls, match = etcd_server.endpoint, {"cacert": certs.ca}, "speaks plaintext but the rendezvous connects with TLS"
    handler = handlers(_config(endpoint, etcd_timeout=20, **tls))
    began = time.monotonic()
    with pytest.raises(RendezvousTLSError, match=match):
        handler.next_rendezvous()
    assert time.monotonic() - began < 3.0, "a TLS mismatch must not be retried for etcd_timeout (20 s)"


def test_probe_tells_what_a_server_speaks(tls_etcd: EmbeddedEtcd, etcd_server: EmbeddedEtcd) -> None:
    def host_port(server: EmbeddedEtcd) -> tuple[str, int]:
        host, port = server.endpoint.rsplit(":", 1)
        return host, int(port)

    assert probe_protocol(*host_port(tls_etcd)) == "tls"  # demands client certificates: answers with an alert
    assert probe_protocol(*host_port(etcd_server)) == "plaintext"
    with socket.socket() as sock:  # nobody listens: nothing is settled
        sock.bind(("127.0.0.1", 0))
        assert probe_protocol("127.0.0.1", sock.getsockname()[1]) is None


# ------------------------------------------------------------------ unreachable
@pytest.mark.timeout(60)
def test_unreachable_endpoint_fails_within_etcd_timeout_with_few_warnings(
    handlers, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:  # a port nobody listens on (a mistyped endpoint)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    etcd_timeout = 6.0
    caplog.set_level(logging.DEBUG, logger="elastic.rendezvous")
    handler = handlers(_config(f"127.0.0.1:{port}", etcd_timeout=etcd_timeout))
    began = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port} unreachable for 6 s"):
        handler.next_rendezvous()
    handler.shutdown()  # as the launcher does on the way out: no second etcd_timeout
    elapsed = time.monotonic() - began
    assert etcd_timeout - 0.5 < elapsed < etcd_timeout + 2.0, f"took {elapsed:.1f} s for etcd_timeout={etcd_timeout}"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("elastic.rendezvous")]
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) > 5, "the endpoint is retried throughout etcd_timeout"
    # One retry warning per WARN_EVERY_S, plus the "not marking closed" one.
    assert len(warnings) <= etcd_timeout / WARN_EVERY_S + 2, [r.getMessage() for r in warnings]


def test_ipv6_endpoint_forms() -> None:
    """Config only: a bare IPv6 address gets the default port, a malformed one is rejected by name."""
    assert parse_endpoints("::1") == (("::1", 2379),)
    assert parse_endpoints("https://[fe80::1]:2380/") == (("fe80::1", 2380),)
    with pytest.raises(ValueError, match="malformed IPv6"):
        parse_endpoints("[::1:2379")
