"""Several spotrun agents on loopback with a real etcd: node loss, scale-up, orphans, etcd outage, torchrun."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import etcd3
import pytest

from elastic.events import read_events
from elastic.failures import FailureAction, decide_on_failure, should_refund
from elastic.launcher import LEASE_EXPIRY_MARGIN, lease_ttl_of, peer_loss_window
from elastic.rendezvous.api import EtcdRendezvousConfig
from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler
from tests.harness.procs import (
    EXAMPLES,
    SPOTRUN,
    TORCHRUN,
    Launcher,
    pid_alive,
    read_jsonl,
    signal_all,
    wait_for,
)

FAULT = str(EXAMPLES / "fault_worker.py")
RDZV_CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"


# --- pure decisions ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remaining", "peer_lost", "action"),
    [(3, False, FailureAction.RESTART_CHARGED), (0, False, FailureAction.GIVE_UP),
     (0, True, FailureAction.RESTART_FREE), (2, True, FailureAction.RESTART_FREE)],
)
def test_decide_on_failure(remaining: int, peer_lost: bool, action: FailureAction) -> None:
    assert decide_on_failure(remaining_restarts=remaining, peer_lost=peer_lost) is action


def test_should_refund_only_charged_restarts_that_changed_the_group() -> None:
    assert should_refund(charged=True, previous_group_world_size=2, new_group_world_size=1)
    assert not should_refund(charged=True, previous_group_world_size=2, new_group_world_size=2)
    assert not should_refund(charged=False, previous_group_world_size=2, new_group_world_size=1)
    assert not should_refund(charged=True, previous_group_world_size=None, new_group_world_size=1)
    # A SIGKILLed peer replaced before the next round: same count, not the same nodes.
    ab, ac = frozenset({"a", "b"}), frozenset({"a", "c"})
    assert should_refund(charged=True, previous_group_world_size=2, new_group_world_size=2,
                         previous_members=ab, new_members=ac)
    assert not should_refund(charged=True, previous_group_world_size=2, new_group_world_size=2,
                             previous_members=ab, new_members=ab), "a genuine crash: same nodes, charged"
    assert not should_refund(charged=False, previous_group_world_size=2, new_group_world_size=2,
                             previous_members=ab, new_members=ac)


def test_peer_loss_window_covers_the_lease_ttl() -> None:
    # A SIGKILLed peer stays a member until its lease expires: the last-chance wait must outlast it.
    assert peer_loss_window(5.0, 3.0) == 5.0
    assert peer_loss_window(0.5, 2.0) == 2.0 + LEASE_EXPIRY_MARGIN
    assert peer_loss_window(5.0, 10.0) == 10.0 + LEASE_EXPIRY_MARGIN
    assert peer_loss_window(0.0, 10.0) == 0.0, "0 keeps the wait off"
    assert peer_loss_window(5.0, None) == 5.0, "backends without leases keep the grace"


def test_lease_ttl_comes_from_the_lease_handler_protocol() -> None:
    config = EtcdRendezvousConfig(run_id="r", endpoints=(("127.0.0.1", 1),), min_nodes=1, max_nodes=2, lease_ttl=7)
    assert lease_ttl_of(EtcdV3RendezvousHandler(config, node_id="n")) == 7.0  # no I/O before next_rendezvous

    class OtherLeasedBackend:  # any backend declaring the capability, not only etcd-v3's class
        lease_ttl = 4

    assert lease_ttl_of(OtherLeasedBackend()) == 4.0  # type: ignore[arg-type]
    assert lease_ttl_of(object()) is None  # type: ignore[arg-type]  # e.g. torch's c10d: no leases


# --- processes ---------------------------------------------------------------------------------------------


def _agent(tmp_path: Path, name: str, endpoint: str, run_id: str, *extra: str, nnodes: str = "1:3",
           rdzv_conf: str = RDZV_CONF, agent_flags: tuple[str, ...] = ()) -> Launcher:
    return Launcher(
        [*SPOTRUN, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
         "--rdzv-conf", rdzv_conf, "--max-restarts", "0", "--stop-grace", "1", "--shutdown-timeout", "2", *agent_flags,
         "--log-dir", str(tmp_path / f"logs-{name}"), "--events-file", str(tmp_path / "events.jsonl"),
         FAULT, "--steps", "0", "--step-time", "0.1", "--out", str(tmp_path / "out"), *extra],
        tmp_path / f"{name}.log",
    )


def _progress(tmp_path: Path) -> list[dict]:
    return read_jsonl(tmp_path / "out" / "progress.jsonl")


def _steps_at_world(tmp_path: Path, world: int, since: float) -> set[int]:
    """Ranks that completed a step at ``world`` size after wall time ``since``."""
    return {p["rank"] for p in _progress(tmp_path) if p["world_size"] == world and p["t_wall"] > since}


def _worker_pids(tmp_path: Path, agent: Launcher) -> list[int]:
    node_part = f"-{agent.pid}-"  # elastic.nodes.node_id: host-pid-suffix
    started = [e for e in read_events(str(tmp_path / "events.jsonl"))
               if e["event"] == "workers_started" and node_part in e["node"]]
    return started[-1]["pids"] if started else []


def _dump(*agents: Launcher) -> str:
    return "\n".join(f"--- {a.log.name}\n{a.output()[-2500:]}" for a in agents)


@contextlib.contextmanager
def _running(agents: list[Launcher]) -> Iterator[list[Launcher]]:
    """Closes every agent in ``agents`` (also ones appended inside); a failed assertion carries their logs."""
    try:
        yield agents
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_dump(*agents)}") from None
    finally:
        for agent in agents:
            agent.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_node_loss_shrinks_the_group_and_a_new_node_grows_it_back(tmp_path: Path, etcd_server) -> None:
    # a's --peer-loss-grace (0.5 s) is shorter than b's lease (2 s): when b's node dies, a's worker fails in
    # the collective at once, and only a wait stretched over the lease TTL sees b gone instead of charging a
    # (--max-restarts 0: giving up) with a failure of its own.
    agents = [_agent(tmp_path, "a", etcd_server.endpoint, "grow-shrink", agent_flags=("--peer-loss-grace", "0.5")),
              _agent(tmp_path, "b", etcd_server.endpoint, "grow-shrink")]
    a, b = agents
    with _running(agents):
        began = time.time()
        wait_for(lambda: _steps_at_world(tmp_path, 2, began) == {0, 1}, 90, "two agents to train at world size 2")
        b_workers = _worker_pids(tmp_path, b)
        assert b_workers and all(pid_alive(p) for p in b_workers)

        # Node loss: SIGKILL b's worker, then agent b (a node losing power; the worker first, so that a's
        # collective breaks before b's lease expires). a must go on alone. (Workers dying with a SIGKILLed
        # agent: tests/elastic/test_launcher.py.)
        signal_all([*b_workers, b.pid], signal.SIGKILL)
        b.wait(10)
        killed_at = time.time()
        wait_for(lambda: not any(pid_alive(p) for p in b_workers), 10, f"b's workers {b_workers} to die with b")
        wait_for(lambda: _steps_at_world(tmp_path, 1, killed_at), 60, "the survivor to train at world size 1")
        assert a.proc.poll() is None, "with --max-restarts 0 a peer loss must not end the survivor"

        # Scale-up: a new agent joins the running job at the next round.
        agents.append(_agent(tmp_path, "c", etcd_server.endpoint, "grow-shrink"))
        joined_at = time.time()
        wait_for(lambda: _steps_at_world(tmp_path, 2, joined_at) == {0, 1}, 90, "the group to grow back to 2")

        events = read_events(str(tmp_path / "events.jsonl"))
        a_node = f"-{a.pid}-"
        causes = [e["cause"] for e in events if e["event"] == "failure_detected" and a_node in e["node"]]
        assert causes and all(c in {"membership_change", "worker_failure_with_peer_loss"} for c in causes), causes
        a_rounds = [e for e in events if e["event"] == "rendezvous_completed" and a_node in e["node"]]
        assert [e["group_world_size"] for e in a_rounds][-2:] == [1, 2]
        # pytorch#135712: rounds forced by membership changes keep TORCHELASTIC_RESTART_COUNT, so with a
        # shared agent store new workers would read the previous workers' gloo addresses under the same
        # prefix. The regrown group trains (its all_reduce checks the world size) at the first round's count.
        regrown = [p for p in _progress(tmp_path) if p["world_size"] == 2 and p["t_wall"] > joined_at]
        assert regrown and {p["restart"] for p in regrown} == {0}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_job_survives_a_short_etcd_outage(tmp_path: Path, etcd_server) -> None:
    # A lease longer than the outage: under CPU starvation (shared CI box) keep-alives that resume right
    # after the restart must still find the lease; lease expiry itself is covered by the node-loss test.
    conf = "lease_ttl=6,last_call_timeout=0.5,join_timeout=60"
    agents = [_agent(tmp_path, "a", etcd_server.endpoint, "outage", nnodes="2", rdzv_conf=conf),
              _agent(tmp_path, "b", etcd_server.endpoint, "outage", nnodes="2", rdzv_conf=conf)]
    with _running(agents):
        began = time.time()
        wait_for(lambda: _steps_at_world(tmp_path, 2, began) == {0, 1}, 90, "two agents to train")
        etcd_server.stop()
        stopped_at = time.monotonic()
        down_since = time.time()
        # Training must not need etcd: both ranks keep stepping while it is down (~3 s outage).
        wait_for(lambda: _steps_at_world(tmp_path, 2, down_since + 2.0) == {0, 1} and
                 time.monotonic() - stopped_at >= 3.0, 30, "training to continue during the outage")
        etcd_server.start()
        up_since = time.time()
        wait_for(lambda: _steps_at_world(tmp_path, 2, up_since + 3.0) == {0, 1}, 30, "training after etcd is back")
        assert all(agent.proc.poll() is None for agent in agents)
        failures = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "failure_detected"]
        assert not failures, f"an etcd outage must not restart the workers: {failures}"

        # A corrupt key is no outage: the job ends at once with one clear line, not after etcd_timeout (30 s).
        _put_key(etcd_server.endpoint, "/spotrun/rdzv/outage/ctl/notice/intruder", "not json")
        corrupted = time.monotonic()
        assert [agent.wait(20) for agent in agents] == [1, 1]
        assert time.monotonic() - corrupted < 20
        for agent in agents:
            errors = [line for line in agent.output().splitlines() if line.startswith("spotrun: error:")]
            assert len(errors) == 1 and "corrupt rendezvous key '/spotrun/rdzv/outage/ctl/notice/intruder'" in errors[0]
            assert "Traceback" not in agent.output()


def _put_key(endpoint: str, key: str, value: str) -> None:
    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        client.put(key, value)
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_stock_torchrun_uses_the_etcd_v3_entry_point(tmp_path: Path, etcd_server) -> None:
    out = tmp_path / "out"
    runs = [
        Launcher([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
                  "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "stock", "--rdzv-conf", RDZV_CONF,
                  FAULT, "--steps", "5", "--out", str(out)], tmp_path / f"torchrun{i}.log")
        for i in range(2)
    ]
    try:
        codes = [run.wait(120) for run in runs]
        assert codes == [0, 0], _dump(*runs)
    finally:
        for run in runs:
            run.close()
    finals = {(p["rank"], p["world_size"]) for p in read_jsonl(out / "progress.jsonl") if p["step"] == 5}
    assert finals == {(0, 2), (1, 2)}

