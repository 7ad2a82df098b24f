"""Planned membership changes with real agents on a real etcd: notices lose no step, and interrupted runs end
with the same weights as an uninterrupted one."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elastic import planned
from elastic.events import read_events
from elastic.notice import Notice
from elastic.planned import GroupView, PlannedStep, Stopped, all_stopped, unplanned_loss, while_posted, worker_notice
from elastic.preemption import WorkerNotice
from tests.harness.procs import (
    EXAMPLES,
    SPOTRUN,
    Launcher,
    descendants,
    make_env,
    pid_alive,
    read_jsonl,
    wait_for,
)

TRAIN = str(EXAMPLES / "train_ddp.py")
RDZV_CONF = "lease_ttl=2,last_call_timeout=0.3,join_timeout=60"
NOW = 1000.0


# --- pure decisions ------------------------------------------------------------------------------------------


def test_the_earliest_notice_is_posted_and_a_join_is_a_resize() -> None:
    own = Notice("sigterm", NOW + 30)
    assert worker_notice(GroupView(now=NOW, own=own, peer_deadlines={"b": NOW + 5}), 60) == \
        WorkerNotice("preempt", NOW + 30, "sigterm")
    assert worker_notice(GroupView(now=NOW, peer_deadlines={"b": NOW + 9, "c": NOW + 5}), 60) == \
        WorkerNotice("peer_preempt", NOW + 5, "node c")
    assert worker_notice(GroupView(now=NOW, membership_changed=True), 60) == \
        WorkerNotice("resize", NOW + 60, "a node is waiting to join")
    assert worker_notice(GroupView(now=NOW, membership_changed=True, lost=frozenset({"b"})), 60) is None
    assert worker_notice(GroupView(now=NOW), 60) is None


def test_waiting_for_the_agreed_step_is_abandoned_on_a_crash_or_the_deadline() -> None:
    posted = WorkerNotice("peer_preempt", NOW + 10, "node b")
    left = GroupView(now=NOW, peer_deadlines={"b": NOW + 10}, lost=frozenset({"b"}))
    assert not unplanned_loss(left) and while_posted(left, posted, stop_grace=3) is PlannedStep.WAIT
    crashed = GroupView(now=NOW, peer_deadlines={"b": NOW + 10}, lost=frozenset({"b", "c"}))
    assert unplanned_loss(crashed) == {"c"} and while_posted(crashed, posted, stop_grace=3) is PlannedStep.ABANDON
    late = GroupView(now=NOW + 7.5)
    assert while_posted(late, posted, stop_grace=3) is PlannedStep.ABANDON


def test_a_leave_with_training_unfinished_exits_with_the_configured_code() -> None:
    assert planned.leave_exit_code(workers_finished=False, configured=75) == 75
    assert planned.leave_exit_code(workers_finished=False, configured=0) == 0
    assert planned.leave_exit_code(workers_finished=True, configured=75) == 0, "a finished run is a success"


def test_only_workers_that_used_the_helper_are_waited_for_and_only_while_time_is_left() -> None:
    assert planned.wait_for_helpers(seen_before=True, now=NOW, deadline=NOW + 30, stop_grace=3)
    assert not planned.wait_for_helpers(seen_before=False, now=NOW, deadline=NOW + 30, stop_grace=3)
    assert not planned.wait_for_helpers(seen_before=True, now=NOW, deadline=NOW + 2, stop_grace=3)


def test_all_local_workers_must_acknowledge_the_same_step() -> None:
    assert all_stopped({0: 12, 1: 12}, {}, 2) == Stopped(12, saved=True)
    assert all_stopped({0: 12}, {}, 2) is None
    assert all_stopped({0: 12, 1: 16}, {}, 2) is None
    assert all_stopped({0: 12, 99: 12}, {}, 2) is None, "a stray ack-99.json is not rank 1's acknowledgement"


# --- real agents ---------------------------------------------------------------------------------------------


def _agent(tmp_path: Path, name: str, endpoint: str, run_id: str, *, steps: int, nnodes: str = "1:2",
           nproc: int = 1, step_time: float = 0.05, ckpt_every: int = 1000, extra: tuple[str, ...] = (),
           rdzv: tuple[str, ...] | None = None, env: dict[str, str] | None = None,
           wrapper: tuple[str, ...] = (), script: tuple[str, ...] = ()) -> Launcher:
    rdzv = rdzv if rdzv is not None else ("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", RDZV_CONF)
    return Launcher(
        [*SPOTRUN, "--nnodes", nnodes, "--nproc-per-node", str(nproc), *rdzv, "--max-restarts", "0", "--stop-grace", "1",
         "--monitor-interval", "0.1", "--log-dir", str(tmp_path / f"logs-{name}"),
         "--events-file", str(tmp_path / "events.jsonl"), *extra,
         *wrapper, TRAIN, "--steps", str(steps), "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", str(ckpt_every),
         "--step-time", str(step_time), "--preempt-sync-every", "2", "--log-every", "1000",
         "--progress-file", str(tmp_path / "progress.jsonl"), *script],
        tmp_path / f"{name}.log",
        env,
    )


def _progress(tmp_path: Path) -> list[dict]:
    path = tmp_path / "progress.jsonl"
    return read_jsonl(path) if path.exists() else []


def _events(tmp_path: Path, name: str) -> list[dict]:
    return [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == name]


def _training_at(tmp_path: Path, world: int, ranks: int) -> bool:
    return len({p["rank"] for p in _progress(tmp_path) if p["world_size"] == world}) == ranks


@contextlib.contextmanager
def _running(agents: list[Launcher]) -> Iterator[list[Launcher]]:
    try:
        yield agents
    except AssertionError as exc:
        logs = "\n".join(f"--- {a.log.name}\n{a.output()[-3000:]}" for a in agents)
        raise AssertionError(f"{exc}\n{logs}") from None
    finally:
        for agent in agents:
            agent.close()


def _assert_resumed_exactly(progress: list[dict], agreed: int, before: int, after: int) -> None:
    """Steps trained at world ``before`` end at ``agreed``; at world ``after`` they start at ``agreed + 1``.

    Only the group formed after the last ``before`` step counts as "new": the first agent may train alone at
    world ``after`` for a few steps before its peer arrives (a planned scale-up that loses no step either).
    """
    last_old = max((i for i, p in enumerate(progress) if p["world_size"] == before), default=-1)
    old = [p["step"] for p in progress if p["world_size"] == before]
    new = [p["step"] for p in progress[last_old + 1:] if p["world_size"] == after]
    assert old and max(old) == agreed, f"the old group stopped at {max(old, default=None)}, agreed {agreed}"
    assert new and min(new) == agreed + 1, f"the new group started at {min(new, default=None)}, agreed {agreed}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_to_one_agent_loses_no_step(tmp_path: Path, etcd_server) -> None:
    # Both with --planned-leave-exit-code 75 (a Kubernetes Indexed Job recreates the leaver's pod); the survivor
    # that finishes the run still exits 0.
    exit_code = ("--planned-leave-exit-code", "75")
    tmp = tmp_path / "tmp"  # where the agents make their workers' mailboxes
    tmp.mkdir()
    # b's worker runs under a wrapper that drops SPOTRUN_NOTICE_DIR (like accelerate launch or srun rebuilding
    # the environment): it must still find its agent's mailbox (by run id and group rank) to save for the leave.
    wrapper = ("--no-python", "env", "-u", "SPOTRUN_NOTICE_DIR", sys.executable, "-u")
    agents = [_agent(tmp_path, name, etcd_server.endpoint, "leave", steps=100, extra=exit_code,
                     env=make_env(TMPDIR=str(tmp)), wrapper=wrapper if name == "b" else ()) for name in ("a", "b")]
    a, b = agents
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "two agents to train at world size 2")
        b.signal(signal.SIGTERM)
        assert b.wait(30) == 75, "the preempted agent exits with --planned-leave-exit-code"
        leave = _events(tmp_path, "planned_leave")
        assert len(leave) == 1 and leave[0]["saved"] and not leave[0]["late"], leave
        agreed = leave[0]["step"]
        assert a.wait(60) == 0, "the survivor finishes the run at world size 1"
        finished = {e["node"]: e for e in _events(tmp_path, "run_finished")}
        assert finished[leave[0]["node"]].get("exit_code") == 75, finished
        assert not list(tmp.glob("spotrun-mailbox-*")), "a planned leave and a normal end both remove the mailbox"
    _assert_resumed_exactly(_progress(tmp_path), agreed, 2, 1)
    restarts = _events(tmp_path, "planned_restart")
    # a first planned resize when the second agent arrived after the first had started alone is fine
    assert restarts and restarts[-1]["step"] == agreed and [e["reason"] for e in restarts[:-1]] in ([], ["resize"])
    assert all(e["restarts_left"] == 0 for e in restarts), "a planned restart does not use up --max-restarts 0"
    noticed = _events(tmp_path, "notice_received")[0]["t_wall"]
    assert not [e for e in _events(tmp_path, "failure_detected") if e["t_wall"] > noticed], "nothing failed"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2])
def test_a_notice_signal_to_every_process_of_the_node_saves_the_agreed_step(tmp_path: Path, etcd_server,
                                                                            sig: signal.Signals) -> None:
    """What Slurm does at a time-limit warning (``--signal=TERM@120``, or ``USR2@120`` with ``--preempt-signal
    USR2``) and a preemption: the signal reaches every process of the job step, the agent, its warm forkserver,
    its workers and their checkpoint writers. The forkserver used to die of it (every worker then read exit 255)
    and the workers too: the node left with nothing saved and exited 1 with a ChildFailedError."""
    extra = ("--preempt-signal", "USR2") if sig == signal.SIGUSR2 else ()
    agents = [_agent(tmp_path, "a", etcd_server.endpoint, "step-signal", steps=100_000, nnodes="1", nproc=2,
                     extra=extra)]
    a = agents[0]
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "two workers to train")
        tree = a.snapshot_tree()
        assert len(tree) >= 4, f"agent, forkserver and two workers at least: {descendants(a.pid)}"
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        assert a.wait(60) == 0, "the node left for its notice: exit 0"
        leaves = _events(tmp_path, "planned_leave")
        assert len(leaves) == 1 and leaves[0]["saved"] and leaves[0]["step"] is not None, leaves
        assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{leaves[0]['step']:09d}"
        assert not _events(tmp_path, "failure_detected"), "no worker died of the signal"
        assert [e["exit_code"] for e in _events(tmp_path, "run_finished")] == [0]
        assert "exitcode: 255" not in a.output()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scale_up_loses_no_step_and_sigterm_to_every_agent_saves_for_a_restart(tmp_path: Path, etcd_server) -> None:
    """One run for two cases: a second agent joins a training one (a planned resize: no step lost), then every
    agent gets a SIGTERM (all save at one agreed step and exit 0) and a restarted node resumes there."""
    agents = [_agent(tmp_path, "a", etcd_server.endpoint, "grow", steps=5000)]
    with _running(agents):
        wait_for(lambda: _training_at(tmp_path, 1, 1), 120, "one agent to train")
        agents.append(_agent(tmp_path, "b", etcd_server.endpoint, "grow", steps=5000))
        wait_for(lambda: _training_at(tmp_path, 2, 2), 120, "the group to grow to 2")
        restarts = _events(tmp_path, "planned_restart")
        assert [e["reason"] for e in restarts] == ["resize"], restarts
        for agent in agents:  # end the run the way a scheduler would: both get a notice
            agent.signal(signal.SIGTERM)
        assert [agent.wait(30) for agent in agents] == [0, 0], "every preempted agent exits 0"
        leaves = _events(tmp_path, "planned_leave")
        assert len(leaves) == 2 and len({e["step"] for e in leaves}) == 1 and all(e["saved"] for e in leaves)
        agreed = leaves[0]["step"]
        began = time.time()
        agents.append(_agent(tmp_path, "c", etcd_server.endpoint, "grow", steps=agreed + 6, nnodes="1"))
        assert agents[-1].wait(60) == 0
    progress = _progress(tmp_path)
    _assert_resumed_exactly([p for p in progress if p["t_wall"] <= began], restarts[0]["step"], 1, 2)
    resumed = [p["step"] for p in progress if p["t_wall"] > began]
    assert min(resumed) == agreed + 1 and max(resumed) == agreed + 6


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_that_exits_0_on_sigterm_does_not_hold_its_agent(tmp_path: Path, etcd_server) -> None:
    """torch's shutdown waited its whole 30 s timeout for a worker that had already returned."""
    agent = Launcher(
        [*SPOTRUN, "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", etcd_server.endpoint,
         "--rdzv-id", "exit0", "--rdzv-conf", RDZV_CONF, "--log-dir", str(tmp_path / "logs"),
         "--events-file", str(tmp_path / "events.jsonl"), str(EXAMPLES / "fault_worker.py"), "--steps", "0",
         "--no-collective", "--exit-0-on-sigterm", "--out", str(tmp_path)],
        tmp_path / "agent.log",
    )
    with _running([agent]):
        wait_for(lambda: _progress(tmp_path), 120, "the worker to step")
        worker = _events(tmp_path, "workers_started")[-1]["pids"][0]
        helpers = set(descendants(agent.pid))  # the worker, its forkserver, the embedded etcd's none
        began = time.monotonic()
        agent.signal(signal.SIGTERM)
        agent.wait(60)
        assert time.monotonic() - began < 15, "the agent waited for a worker that had returned"
        assert not pid_alive(worker)
        # A forkserver with torch loaded takes seconds to exit on a loaded machine: wait, bounded.
        wait_for(lambda: not any(pid_alive(pid) for pid in helpers), 60, f"the agent's processes {helpers} to exit")


# --- exactness at the same world size ----------------------------------------------------------------------------


def _final_state(ckpt_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor saved at the committed ``step`` (model and optimizer), read from its safetensors files, so
    the comparison does not depend on how the example builds its state."""
    from safetensors.torch import load_file

    from checkpoint.api import COMMIT_FILE
    from checkpoint.api import step_dir as step_name

    step_dir = ckpt_dir / step_name(step)
    assert (step_dir / COMMIT_FILE).exists(), f"step {step} was not committed: {sorted(ckpt_dir.iterdir())}"
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(step_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    assert tensors
    return tensors


STEPS = 80
CKPT_EVERY = 16


def _single_node(name: str, endpoint: str, out: Path, rdzv: tuple[str, ...] | None = None) -> Launcher:
    """One node, two workers (world size 2), a periodic checkpoint every CKPT_EVERY steps."""
    return _agent(out, name, endpoint, "exact", steps=STEPS, nnodes="1", nproc=2, step_time=0.02,
                  ckpt_every=CKPT_EVERY, extra=("--max-restarts", "3"), rdzv=rdzv)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted run (embedded etcd: nothing shared with the runs under test)."""
    out = tmp_path_factory.mktemp("reference")
    agent = _single_node("ref", "", out, rdzv=("--standalone",))
    try:
        assert agent.wait(150) == 0, agent.output()[-3000:]
    finally:
        agent.close()
    return _final_state(out / "ckpt", STEPS)


def _past_a_checkpoint(tmp_path: Path, after_step: int, since: float = 0.0) -> int:
    """Wait until a step 4 past the first periodic checkpoint after ``after_step`` is trained (by a process
    started after ``since``); returns that checkpoint's step. A SIGKILL there loses the steps after the
    checkpoint, which the resumed run trains again."""
    ckpt = (after_step // CKPT_EVERY + 1) * CKPT_EVERY
    assert ckpt + 4 < STEPS, f"no periodic checkpoint left after step {after_step}"
    wait_for(lambda: any(p["step"] >= ckpt + 4 and p["t_wall"] > since for p in _progress(tmp_path)), 120,
             f"the run to reach step {ckpt + 4}")
    return ckpt


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_interrupted_run_ends_bit_identical_to_an_uninterrupted_one(
    tmp_path: Path, etcd_server, reference: dict[str, torch.Tensor]
) -> None:
    """Three faults in one run (each resumes from what the previous one left): a worker SIGKILLed (its agent
    restarts the workers from the periodic checkpoint), then an agent SIGTERMed (a planned leave: it saves at
    an agreed step and exits 0), then the next agent SIGKILLed past a periodic checkpoint (steps lost and
    trained again). The final weights are bit-identical to the uninterrupted run's."""
    agents = [_single_node("run1", etcd_server.endpoint, tmp_path)]
    with _running(agents):
        first = agents[0]
        # worker_sigkill: past the periodic checkpoint at 16 and before the next one, steps 17.. are redone.
        _past_a_checkpoint(tmp_path, 0)
        os.kill(_events(tmp_path, "workers_started")[-1]["pids"][0], signal.SIGKILL)
        wait_for(lambda: len(_events(tmp_path, "workers_started")) == 2, 120, "the agent to restart its workers")
        restarted = _events(tmp_path, "workers_started")[-1]["t_wall"]
        # agent_sigterm: the restarted workers train past the next checkpoint, then the agent gets its notice.
        _past_a_checkpoint(tmp_path, 2 * CKPT_EVERY - 1, since=restarted)
        first.signal(signal.SIGTERM)
        assert first.wait(60) == 0, "agent_sigterm: the agent saves at the agreed step and exits 0"
        (leave,) = _events(tmp_path, "planned_leave")
        assert leave["saved"], leave
        assert len(_events(tmp_path, "workers_started")) == 2, "worker_sigkill: one restart, then the leave"
        # agent_sigkill: the next agent resumes at the agreed step, passes a checkpoint and is SIGKILLed.
        agents.append(_single_node("run2", etcd_server.endpoint, tmp_path))
        _past_a_checkpoint(tmp_path, leave["step"], since=agents[-1].started_at)
        agents[-1].signal(signal.SIGKILL)
        assert agents[-1].wait(60) == -signal.SIGKILL
        agents.append(_single_node("run3", etcd_server.endpoint, tmp_path))
        assert agents[-1].wait(120) == 0
    got = _final_state(tmp_path / "ckpt", STEPS)
    assert reference.keys() == got.keys()
    for key, expected in reference.items():
        assert torch.equal(expected, got[key]), f"{key} differs after a worker SIGKILL, an agent SIGTERM and an agent SIGKILL"
