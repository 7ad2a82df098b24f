"""The injector against real processes: workers found under a stand-in agent and signalled, a SIGSTOP undone,
a partition skipped with its reason where it cannot run, the leader of a real 3-member etcd cluster killed
and restarted, and the spotrun-chaos CLI's exit codes and journal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.chaos import targets
from elastic.chaos.api import Fault, FaultKind, Schedule
from elastic.chaos.injector import Injector
from elastic.chaos.journal import Journal
from elastic.events import read_events
from tests.chaos.conftest import leader_or_none
from tests.harness.procs import make_env, pid_alive, reap, signal_all, wait_for

pytestmark = pytest.mark.timeout(60)

# A stand-in agent: two children with the torchelastic worker environment, then waits.
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "TORCHELASTIC_RUN_ID": "r", "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(2)]
    print(" ".join(str(k.pid) for k in kids), flush=True)
    for k in kids:
        k.wait()
""")


@pytest.fixture
def agent() -> Iterator[tuple[int, list[int]]]:
    proc = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    kids = [int(p) for p in proc.stdout.readline().split()]
    try:
        yield proc.pid, kids
    finally:
        signal_all([*kids, proc.pid], signal.SIGCONT)
        signal_all([*kids, proc.pid], signal.SIGKILL)
        proc.wait(10)
        reap(kids, 10)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as handle:
        stat = handle.read()
    return stat[stat.rindex(")") + 2]


def test_workers_are_found_by_rank_and_signalled(tmp_path: Path, agent) -> None:
    agent_pid, kids = agent
    assert targets.workers([agent_pid]) == {0: kids[0], 1: kids[1]}
    clock = [0.0]
    schedule = Schedule(seed=1, faults=(Fault(kind=FaultKind.STOP_WORKER, target="worker:0", at_s=1, duration_s=2),
                                        Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_step=5)))
    journal = Journal(str(tmp_path / "j.jsonl"))
    injector = Injector(schedule, journal, agent_pids=[agent_pid], clock=lambda: clock[0])
    assert injector.tick(step=4) == []
    clock[0] = 1.0
    (stopped,) = injector.tick(step=4)
    assert stopped["record"] == "injected" and stopped["pid"] == kids[0] and stopped["rank"] == 0
    wait_for(lambda: _state(kids[0]) == "T", 5, "worker 0 to stop")
    (killed,) = injector.tick(step=5)
    assert killed["pid"] == kids[1]
    wait_for(lambda: not pid_alive(kids[1]), 5, "worker 1 to die")
    clock[0] = 3.0
    (undone,) = injector.tick(step=5)
    assert undone["record"] == "undone" and undone["pid"] == kids[0]
    wait_for(lambda: _state(kids[0]) != "T", 5, "worker 0 to continue")
    records = [r["record"] for r in read_events(journal.path)]
    assert records == ["injected", "injected", "undone"]
    assert all("t_mono" in r and "t_wall" in r for r in read_events(journal.path))


def test_stop_agent_pauses_the_whole_node_and_continues_it_after_its_duration(tmp_path: Path, agent) -> None:
    """A paused VM: the agent and every process under it stopped at once, all continued after ``duration_s``."""
    agent_pid, kids = agent
    clock = [0.0]
    schedule = Schedule(faults=(Fault(kind=FaultKind.STOP_AGENT, target="agent:0", at_s=1, duration_s=2),))
    journal = Journal(str(tmp_path / "j.jsonl"))
    injector = Injector(schedule, journal, agent_pids=[agent_pid], clock=lambda: clock[0])
    clock[0] = 1.0
    (stopped,) = injector.tick()
    assert stopped["record"] == "injected" and stopped["pid"] == agent_pid
    assert set(stopped["pids"]) == {agent_pid, *kids}, stopped
    for pid in (agent_pid, *kids):
        wait_for(lambda pid=pid: _state(pid) == "T", 5, f"process {pid} of the node to stop")
    clock[0] = 3.0
    (undone,) = injector.tick()
    assert undone["record"] == "undone" and set(undone["pids"]) == {agent_pid, *kids}, undone
    for pid in (agent_pid, *kids):
        wait_for(lambda pid=pid: _state(pid) != "T", 5, f"process {pid} of the node to continue")


def test_missing_targets_and_partitions_are_journaled_not_raised(tmp_path: Path, agent) -> None:
    agent_pid, _ = agent
    schedule = Schedule(faults=(Fault(kind=FaultKind.KILL_WORKER, target="worker:7", at_s=0),
                                Fault(kind=FaultKind.PARTITION, target="netns:spotrun-no-such-ns", at_s=0),
                                Fault(kind=FaultKind.RESTART_ETCD, at_s=0)))
    injector = Injector(schedule, Journal(str(tmp_path / "j.jsonl")), agent_pids=[agent_pid])
    records = injector.tick()
    assert [r["record"] for r in records] == ["failed", "skipped", "failed"]
    assert "no worker with rank 7" in records[0]["reason"]
    assert "spotrun-no-such-ns" in records[1]["reason"] or "root" in records[1]["reason"]
    assert "no etcd endpoints" in records[2]["reason"]
    assert injector.injected == []


# A stand-in agent with a real memory tier keeper (and the watch that replaces it when it dies).
KEEPER_AGENT = textwrap.dedent("""
    import sys, time
    from elastic.memory_keeper import Keeper
    k = Keeper.create("chaos-keeper-test", sys.argv[1])
    print(k.path, flush=True)
    time.sleep(60)
""")


def test_kill_keeper_signals_the_agents_keeper_which_the_agent_replaces(tmp_path: Path, agent) -> None:
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="spotrun-memtier-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; del sys.path[0]\n" + KEEPER_AGENT, root],  # -P, on 3.10 too
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    path = proc.stdout.readline().strip()
    keepers: list[int] = []
    try:
        first = targets.keeper_of(proc.pid)
        assert first is not None and targets.keeper_of(agent[0]) is None
        keepers.append(first)
        faults = (Fault(kind=FaultKind.KILL_KEEPER, target="agent:0", at_s=0),
                  Fault(kind=FaultKind.KILL_KEEPER, target="agent:1", at_s=0),  # the stand-in has none
                  Fault(kind=FaultKind.KILL_KEEPER, target="agent:0", at_s=0, params={"signal": "TERM"}))
        injector = Injector(Schedule(faults=faults), Journal(str(tmp_path / "j.jsonl")), agent_pids=[proc.pid, agent[0]])
        (killed,) = [r for r in injector.tick(limit=2) if r["record"] == "injected"]
        assert killed["pid"] == first and killed["signal"] == "KILL"
        second = wait_for(lambda: (k := targets.keeper_of(proc.pid)) not in (None, first) and k, timeout=30,
                          what="the agent's second keeper")
        keepers.append(second)
        (termed,) = injector.tick()
        assert termed["record"] == "injected" and termed["pid"] == second and termed["signal"] == "TERM"
        keepers.append(wait_for(lambda: (k := targets.keeper_of(proc.pid)) not in (None, second) and k, timeout=30,
                                what="the agent's third keeper"))
        assert os.path.isdir(path)  # the TERMed keeper removed it; the agent made it again
        failed = [r for r in read_events(str(tmp_path / "j.jsonl")) if r["record"] == "failed"]
        assert len(failed) == 1 and "has no memory tier keeper" in failed[0]["reason"], failed
    finally:
        proc.kill()
        proc.wait(10)
        reap(keepers, 30)
        shutil.rmtree(root, ignore_errors=True)
    assert not os.path.exists(path)


# --- a real 3-member etcd cluster -----------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_etcd_leader_restarts_it_and_a_new_leader_is_elected(tmp_path: Path, etcd_cluster) -> None:
    leader = targets.etcd_leader(etcd_cluster)
    schedule = Schedule(faults=(Fault(kind=FaultKind.KILL_ETCD_LEADER, at_s=0, duration_s=0.5),))
    clock = [0.0]
    injector = Injector(schedule, Journal(str(tmp_path / "j.jsonl")), etcd_endpoints=etcd_cluster,
                        clock=lambda: clock[0])
    try:
        (record,) = injector.tick()
        assert record["record"] == "injected" and record["endpoint"] == leader
        wait_for(lambda: not pid_alive(record["pid"]), 5, "the old leader to die")
        others = [e for e in etcd_cluster if e != leader]
        new_leader = wait_for(lambda: leader_or_none(others), 15, "a new leader among the two others")
        assert new_leader in others
        clock[0] = 1.0
        (restarted,) = injector.tick()
        assert restarted["record"] == "undone" and restarted["endpoint"] == leader
        wait_for(lambda: _member_ok(leader), 15, "the killed member to serve again")
    finally:
        for proc in injector.started:
            proc.kill()
            proc.wait(10)


def _member_ok(endpoint: str) -> bool:
    try:
        return bool(targets.member_status(endpoint).leader_id)
    except Exception:  # noqa: BLE001
        return False


# --- CLI --------------------------------------------------------------------------------------------------------


def _cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic.chaos.cli", *args], capture_output=True, text=True,
                          timeout=60, env=make_env(), check=False)


def test_cli_rejects_a_bad_schedule(tmp_path: Path) -> None:
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"faults": [{"kind": "kill_worker"}]}))
    done = _cli(["--schedule", str(bad), "--journal", str(tmp_path / "j.jsonl"), "--", "true"])
    assert done.returncode == 2
    assert "faults[0]" in done.stderr and "exactly one trigger" in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_runs_the_command_passes_storage_control_and_returns_its_exit_code(tmp_path: Path) -> None:
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps({"seed": 3, "faults": [{"kind": "disk_full", "at_s": 0}]}))
    script = ("import json, os, sys, time\n"
              "p = os.environ['SPOTRUN_CHAOS_STORAGE']\n"
              "deadline = time.time() + 20\n"
              "while not os.path.exists(p) and time.time() < deadline: time.sleep(0.02)\n"
              "print(json.load(open(p))['faults'][0]['kind']); sys.exit(3)\n")
    done = _cli(["--schedule", str(schedule), "--journal", str(tmp_path / "j.jsonl"), "--",
                 sys.executable, "-c", script])
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "disk_full"
    records = read_events(str(tmp_path / "j.jsonl"))
    assert [r["record"] for r in records] == ["started", "injected", "finished"]
    assert records[-1]["exit_code"] == 3
    assert not os.path.exists(records[1]["control"])  # its temporary control file is removed


def test_cli_finds_the_events_file_in_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.chaos.cli import events_file_of

    monkeypatch.delenv("SPOTRUN_EVENTS_FILE", raising=False)
    assert events_file_of(["spotrun", "--events-file", "/x/ev.jsonl", "t.py"]) == "/x/ev.jsonl"
    assert events_file_of(["spotrun", "--events_file=/y.jsonl", "t.py"]) == "/y.jsonl"
    assert events_file_of(["spotrun", "t.py"]) is None
    monkeypatch.setenv("SPOTRUN_EVENTS_FILE", "/z.jsonl")
    assert events_file_of(["spotrun", "t.py"]) == "/z.jsonl"


def test_kill_agent_takes_its_workers_and_term_agent_sends_sigterm(tmp_path: Path, agent) -> None:
    agent_pid, kids = agent
    journal = Journal(str(tmp_path / "j.jsonl"))
    term = Injector(Schedule(faults=(Fault(kind=FaultKind.TERM_AGENT, target="agent:0", at_s=0),)), journal,
                    agent_pids=[agent_pid])
    (record,) = term.tick()
    assert record["record"] == "injected" and record["pid"] == agent_pid
    wait_for(lambda: not pid_alive(agent_pid), 5, "the stand-in agent to exit on SIGTERM")
    assert all(pid_alive(k) for k in kids)  # SIGTERM is the agent's to handle: its workers are not signalled


def test_kill_agent_kills_the_whole_tree(tmp_path: Path, agent) -> None:
    agent_pid, kids = agent
    kill = Injector(Schedule(faults=(Fault(kind=FaultKind.KILL_AGENT, at_s=0),)), Journal(str(tmp_path / "j.jsonl")),
                    agent_pids=[agent_pid])
    (record,) = kill.tick()
    assert record["pid"] == agent_pid and sorted(record["pids"]) == sorted([agent_pid, *kids])
    wait_for(lambda: not any(pid_alive(p) for p in [agent_pid, *kids]), 5, "the agent and its workers to die")


@pytest.fixture
def netns() -> Iterator[str]:
    """A network namespace of our own with a veth pair inside (nothing of the host's network is touched)."""
    from tests.deploy.netlab import loopback_reason

    reason = loopback_reason()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    name = f"spotrun-chaos-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=True,
                       timeout=10)
        for link in ("v0", "v1"):
            subprocess.run(["ip", "-n", name, "link", "set", link, "up"], check=True, timeout=10)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=10)


def _link_up(netns: str, link: str) -> bool:
    out = subprocess.run(["ip", "-n", netns, "-o", "link", "show", link], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    return ",UP" in out or "<UP" in out


def test_partition_takes_the_namespace_links_down_then_up(tmp_path: Path, netns: str) -> None:
    clock = [0.0]
    schedule = Schedule(faults=(Fault(kind=FaultKind.PARTITION, target=f"netns:{netns}", at_s=0, duration_s=1),))
    injector = Injector(schedule, Journal(str(tmp_path / "j.jsonl")), clock=lambda: clock[0])
    (cut,) = injector.tick()
    assert cut["record"] == "injected" and sorted(cut["links"]) == ["v0", "v1"]
    assert not _link_up(netns, "v0") and not _link_up(netns, "v1")
    clock[0] = 1.0
    (healed,) = injector.tick()
    assert healed["record"] == "undone"
    assert _link_up(netns, "v0") and _link_up(netns, "v1")


def test_faults_held_back_stay_due_while_those_in_force_still_end(tmp_path: Path) -> None:
    """What the soak does between faults: tick(limit=1) fires one due fault, end_due() ends faults on time
    and fires none."""
    clock = [0.0]
    schedule = Schedule(faults=(Fault(kind=FaultKind.STORAGE_LATENCY, at_s=0, duration_s=1, params={"seconds": 0.1}),
                                Fault(kind=FaultKind.DISK_FULL, at_s=0, duration_s=1)))
    control = tmp_path / "control.json"
    injector = Injector(schedule, Journal(str(tmp_path / "j.jsonl")), storage_control=str(control),
                        clock=lambda: clock[0])
    (first,) = injector.tick(limit=1)
    assert first["record"] == "injected" and first["kind"] == "storage_latency" and injector.pending() == 1
    clock[0] = 1.5
    (ended,) = injector.end_due()
    assert ended["record"] == "undone" and injector.pending() == 1
    assert json.loads(control.read_text())["faults"] == []
    (second,) = injector.tick(limit=1)
    assert second["kind"] == "disk_full" and injector.pending() == 0


def test_restarts_needed_counts_kills_and_stops_found_as_hangs() -> None:
    from elastic.chaos.api import restarts_needed

    faults = [Fault(kind=FaultKind.KILL_WORKER, at_step=3), Fault(kind=FaultKind.KILL_WORKER, at_s=9),
              Fault(kind=FaultKind.STOP_WORKER, at_s=1, duration_s=5), Fault(kind=FaultKind.STOP_WORKER, at_s=2),
              Fault(kind=FaultKind.TERM_AGENT, at_s=4), Fault(kind=FaultKind.KILL_ETCD_LEADER, at_s=5),
              Fault(kind=FaultKind.STORAGE_ERROR, at_s=6, duration_s=1)]
    assert restarts_needed(faults, hang_timeout=60.0) == 3, "2 kills + the stop that never ends"
    assert restarts_needed(faults, hang_timeout=2.0) == 4, "the 5 s stop outlasts a 2 s hang timeout"
    assert restarts_needed(faults, hang_timeout=None) == 2, "no hang detection: a stop is never restarted"


@pytest.mark.parametrize(("command", "max_restarts", "hang_timeout"), [
    (["spotrun", "--nnodes", "1", "train.py", "--max-restarts", "9"], 0, 60.0),  # the script's flag, not ours
    (["/usr/bin/torchrun", "--max_restarts=3", "train.py"], 3, 60.0),
    (["spotrun", "--max-restarts", "2", "--hang-timeout", "2", "train.py"], 2, 2.0),
    (["python3.11", "-m", "torch.distributed.run", "--max-restarts", "4", "--no-hang-detection", "t.py"], 4, None),
    (["python", "-m", "elastic.cli", "--standalone", "--max-restarts=1", "t.py"], 1, 60.0),
])
def test_launch_budget_reads_the_wrapped_launchers_flags(
    command: list[str], max_restarts: int, hang_timeout: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic.chaos.cli import LaunchBudget, launch_budget

    for name in ("PET_MAX_RESTARTS", "SPOTRUN_HANG_TIMEOUT", "SPOTRUN_HANG_DETECTION"):
        monkeypatch.delenv(name, raising=False)
    assert launch_budget(command) == LaunchBudget(max_restarts=max_restarts, hang_timeout=hang_timeout)


@pytest.mark.parametrize("command", [["bash", "job.sh"], ["python", "train.py"], ["spotrun"], []])
def test_launch_budget_is_unknown_for_other_or_broken_commands(command: list[str]) -> None:
    from elastic.chaos.cli import launch_budget

    assert launch_budget(command) is None


def _warning_run(tmp_path: Path, faults: list[dict[str, object]], launcher_flags: list[str]) -> str:
    """spotrun-chaos around a stand-in `spotrun` on PATH (exits 0 at once); returns its stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "spotrun"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps({"seed": 1, "faults": faults}))
    env = make_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PET_MAX_RESTARTS", None)
    done = subprocess.run([sys.executable, "-m", "elastic.chaos.cli", "--schedule", str(schedule), "--journal",
                           str(tmp_path / "j.jsonl"), "--", "spotrun", *launcher_flags, "train.py"],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_cli_warns_once_when_the_job_has_fewer_restarts_than_the_faults_need(tmp_path: Path) -> None:
    kills = [{"kind": "kill_worker", "target": "worker:0", "at_s": 30}, {"kind": "kill_worker", "at_s": 40}]
    stderr = _warning_run(tmp_path, kills, ["--nproc-per-node", "2"])
    warnings = [line for line in stderr.splitlines() if "--max-restarts" in line]
    assert len(warnings) == 1, stderr
    assert "2 fault(s)" in warnings[0] and "--max-restarts 0" in warnings[0] and "--max-restarts 2" in warnings[0]


def test_cli_is_silent_when_the_job_has_restarts_enough(tmp_path: Path) -> None:
    kills = [{"kind": "kill_worker", "at_s": 30}, {"kind": "stop_worker", "at_s": 31, "duration_s": 5}]
    stderr = _warning_run(tmp_path, kills, ["--max-restarts", "1"])
    assert "--max-restarts" not in stderr, stderr


_SEMAPHORE_USER = textwrap.dedent(
    """
    import multiprocessing, time
    # As torch's worker contexts: named semaphores of a spawn/forkserver context, which only their finalizers
    # or the resource tracker unlink
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    print(queue._rlock._semlock.name, queue._wlock._semlock.name, flush=True)
    time.sleep(60)
    """
)


def test_a_killed_node_tree_spares_the_resource_tracker_which_unlinks_the_semaphores() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SEMAPHORE_USER], stdout=subprocess.PIPE, text=True)
    try:
        names = proc.stdout.readline().split()  # type: ignore[union-attr]  # stdout=PIPE
        files = [Path("/dev/shm/sem." + name.lstrip("/")) for name in names]
        assert names and all(f.exists() for f in files), names
        trackers = [pid for pid in targets.descendants(proc.pid) if targets.is_resource_tracker(pid)]
        assert len(trackers) == 1
        tree = targets.node_tree(proc.pid)
        assert proc.pid in tree and trackers[0] not in tree
        signal_all(tree, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: not any(f.exists() for f in files), timeout=30, what="the tracker to unlink the semaphores")
        reap(trackers, timeout=30)  # and then it exits by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A stand-in agent whose two workers each hold a connection to the test (as a worker holds its gloo pairs).
CONNECTED_AGENT = textwrap.dedent("""
    import os, subprocess, sys
    code = ("import os, socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
            "s.sendall(os.environ['RANK'].encode()); time.sleep(60)")
    kids = [subprocess.Popen([sys.executable, "-c", code, sys.argv[1]],
                             env={**os.environ, "TORCHELASTIC_RUN_ID": "r", "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(2)]
    print(" ".join(str(k.pid) for k in kids), flush=True)
    for k in kids:
        k.wait()
""")


def test_a_worker_killed_holding_its_connections_leaves_its_peer_hanging_until_released(tmp_path: Path) -> None:
    """``kill_worker`` with ``hold_connections``: the worker dies, but its peer reads no end of file (as NCCL's
    collectives hang on a crashed peer instead of failing) until the fault's ``duration_s`` ends."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", CONNECTED_AGENT, str(port)], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        assert proc.stdout is not None
        kids = [int(p) for p in proc.stdout.readline().split()]
        accepted = [server.accept()[0] for _ in kids]
        conns = sorted(accepted, key=lambda conn: conn.recv(1))  # by the rank each worker sent
        try:
            clock = [0.0]
            fault = Fault(kind=FaultKind.KILL_WORKER, target="worker:1", at_s=0, duration_s=2,
                          params={"hold_connections": True})
            injector = Injector(Schedule(faults=(fault,)), Journal(str(tmp_path / "j.jsonl")), agent_pids=[proc.pid],
                                clock=lambda: clock[0])
            (killed,) = injector.tick()
            assert killed["record"] == "injected" and killed["pid"] == kids[1] and killed["held"] >= 1, killed
            wait_for(lambda: not pid_alive(kids[1]), 5, "worker 1 to die")
            for conn in conns:
                conn.settimeout(0.5)
            for conn in conns:  # both open: worker 1's held, worker 0's alive
                with pytest.raises(TimeoutError):
                    conn.recv(1)
            clock[0] = 3.0
            (undone,) = injector.tick()
            assert undone["record"] == "undone" and undone["released"] == killed["held"], undone
            assert conns[1].recv(1) == b"", "released: the peer sees the dead worker's connection end"
        finally:
            for conn in conns:
                conn.close()
            signal_all([*kids, proc.pid], signal.SIGKILL)
            proc.wait(10)
            reap(kids, 10)
