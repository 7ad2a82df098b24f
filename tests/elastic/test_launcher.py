"""spotrun on one node: worker environment parity with torchrun, restarts, failure summary, cleanup."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from elastic.events import read_events
from tests.harness.procs import (
    EXAMPLES,
    SPOTRUN,
    TORCHRUN,
    Launcher,
    descendants,
    make_env,
    pid_alive,
    read_jsonl,
    run_cli,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAULT = str(EXAMPLES / "fault_worker.py")
PRINT_ENV = str(EXAMPLES / "print_env.py")


def _envs(out: Path) -> dict[int, dict[str, str]]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_worker_environment_matches_torchrun(tmp_path: Path) -> None:
    ours_dir, theirs_dir = tmp_path / "spotrun", tmp_path / "torchrun"
    ours = run_cli([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                    "--log-dir", str(tmp_path / "logs"), PRINT_ENV, "--out", str(ours_dir)], timeout=90)
    assert ours.returncode == 0, ours.stderr[-3000:]
    theirs = run_cli([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                      PRINT_ENV, "--out", str(theirs_dir)], timeout=90)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours_env, theirs_env = _envs(ours_dir), _envs(theirs_dir)
    assert sorted(ours_env) == sorted(theirs_env) == [0, 1]
    for rank in (0, 1):
        a, b = ours_env[rank], theirs_env[rank]
        assert set(a) == set(b), f"variable names differ: {set(a) ^ set(b)}"
        same = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
        # Like torchrun's c10d backend, the round's rank-0 agent hosts the workers' store (a new server per
        # round: no stale keys); the run id / ports / log paths are per launch.
        assert a["TORCHELASTIC_USE_AGENT_STORE"] == b["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert int(a["MASTER_PORT"]) > 0 and a["MASTER_ADDR"]
        assert a["TORCHELASTIC_ERROR_FILE"].endswith(f"/{rank}/error.json")
        assert a["TORCHELASTIC_ERROR_FILE"].startswith(str(tmp_path / "logs"))
    assert ours_env[0]["TORCHELASTIC_RUN_ID"] == ours_env[1]["TORCHELASTIC_RUN_ID"] != "none"
    assert ours_env[0]["MASTER_PORT"] == ours_env[1]["MASTER_PORT"]


def test_worker_sigkill_is_restarted_within_max_restarts(tmp_path: Path) -> None:
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    result = run_cli([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      "--events-file", str(events), FAULT, "--steps", "6", "--fail-at-step", "2",
                      "--fail-ranks", "1", "--fail-restarts", "0", "--sigkill-self", "--out", str(out)], timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    progress = read_jsonl(out / "progress.jsonl")
    finals = {(p["rank"], p["restart"]) for p in progress if p["step"] == 6}
    assert finals == {(0, 1), (1, 1)}, "both ranks must finish after exactly one restart"
    failures = [e for e in read_events(str(events)) if e["event"] == "failure_detected"]
    assert len(failures) == 1 and failures[0]["cause"] == "worker_failure"
    # The killed rank comes first (root cause); rank 0 may also be listed, having crashed in the collective.
    assert next(iter(failures[0]["failures"].items())) == ("1", -signal.SIGKILL)


def test_failure_past_max_restarts_exits_with_torchrun_summary(tmp_path: Path) -> None:
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    result = run_cli([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      "--peer-loss-grace", "0", "--events-file", str(events), FAULT, "--steps", "50",
                      "--fail-at-step", "1", "--fail-ranks", "1", "--raise", "injected failure 42",
                      "--out", str(out)], timeout=100)
    assert result.returncode == 1, result.stderr[-3000:]
    err = result.stderr
    assert "ChildFailedError" in err and "Root Cause (first observed failure)" in err
    assert "rank      : 1 (local_rank: 1)" in err
    assert "RuntimeError: injected failure 42" in err, "the root cause must come from the worker's error file"
    restarts = {p["restart"] for p in read_jsonl(out / "progress.jsonl")}
    assert restarts == {0, 1}, "one restart, then give up"
    actions = [e["action"] for e in read_events(str(events)) if e["event"] == "failure_detected"]
    assert actions == ["restart_charged", "give_up"]


def test_standalone_cleans_up_etcd_and_workers_on_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "out"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    agent = Launcher([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--stop-grace", "1",
                      "--shutdown-timeout", "2", FAULT, "--steps", "0", "--no-collective", "--out", str(out)],
                     tmp_path / "agent.log", env=make_env(TMPDIR=str(tmpdir)))
    try:
        wait_for(lambda: len({p["rank"] for p in read_jsonl(out / "progress.jsonl")}) == 2, 60, "both workers to step")
        children = descendants(agent.pid)
        assert any("etcd" in cmd for _, cmd in children.values())
        agent.signal(signal.SIGTERM)
        code = agent.wait(30)
    finally:
        agent.close()
    output = agent.output()
    assert code == 1, "torchrun's exit code for a signalled launcher (no Preemption helper: an immediate stop)"
    # --no-collective: a rank whose peer got the SIGTERM first would print gloo's "connection reset" traceback
    # (the worker's own stderr, as under torchrun): this asserts that the *agent* prints none.
    assert "spotrun: stopped by SIGTERM" in output and "Traceback" not in output, output[-3000:]
    wait_for(lambda: not [pid for pid in children if pid_alive(pid)], 10,
             f"workers and etcd to be gone: {[children[p][1][:120] for p in children if pid_alive(p)]}")
    assert not list(tmpdir.glob("spotrun-etcd-*")), "the embedded etcd data dir must be removed"


def test_stuck_worker_is_killed_after_the_stop_grace(tmp_path: Path) -> None:
    """A worker ignoring SIGTERM must not hold up the restart for torch's 30 s."""
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    result = run_cli([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      "--stop-grace", "1", "--events-file", str(events), FAULT, "--steps", "4",
                      "--fail-at-step", "1", "--fail-ranks", "0", "--fail-restarts", "0", "--exit-code", "3",
                      "--no-collective", "--ignore-sigterm", "--out", str(out)], timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    evs = read_events(str(events))
    failure = next(e for e in evs if e["event"] == "failure_detected")
    assert failure["failures"]["0"] == 3
    starts = [e["t_mono"] for e in evs if e["event"] == "workers_started"]
    assert len(starts) == 2
    # torch would wait 30 s for the SIGTERM-ignoring rank 1 before SIGKILL; with a 1 s grace the whole
    # round trip (start, import torch, fail, stop, rendezvous, start) stays well under that.
    timeline = "\n".join(f"{e['t_mono'] - starts[0]:7.2f} {e['event']} {json.dumps(e)[:300]}" for e in evs)
    assert starts[1] - starts[0] < 20, f"restart took {starts[1] - starts[0]:.1f} s; events:\n{timeline}\n" \
        f"agent stderr tail:\n{result.stderr[-3000:]}"


def test_a_survivor_that_exits_0_on_sigterm_does_not_hold_the_agent_for_the_stop_grace(tmp_path: Path) -> None:
    """Rank 0 fails; rank 1 handles the agent's SIGTERM by returning from its script. A warm worker then waits in
    torch's ``_wrap`` for the agent to read its return value, which a stopping agent never does: it sat there
    for the whole stop grace (found with ``--stop-grace 30``: the agent's lease lapsed meanwhile on a loaded
    machine and the job re-formed twice). It must be let go at once."""
    out = tmp_path / "out"
    result = run_cli([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--stop-grace", "60",
                      "--monitor-interval", "0.2", FAULT, "--steps", "0", "--fail-at-step", "5", "--fail-ranks", "0",
                      "--exit-code", "3", "--no-collective", "--exit-0-on-sigterm", "--out", str(out)],
                     timeout=240)
    ended = time.monotonic()
    assert result.returncode == 1, result.stderr[-3000:]
    failed_at = max(p["t_mono"] for p in read_jsonl(out / "progress.jsonl") if p["rank"] == 0)
    assert ended - failed_at < 30, f"the agent ended {ended - failed_at:.1f} s after rank 0 failed (grace 60 s)"
    assert "exitcode  : 3" in result.stderr


@pytest.mark.parametrize("warm", ["--warm-workers", "--no-warm-workers"])
def test_workers_die_with_a_sigkilled_agent(tmp_path: Path, warm: str) -> None:
    """torch starts workers in their own session; without spotrun's parent-death signal they would outlive
    a SIGKILLed agent (forkserver children for warm workers, exec shim for plain subprocesses)."""
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    agent = Launcher([*SPOTRUN, "--standalone", "--nproc-per-node", "2", warm, "--events-file", str(events),
                      FAULT, "--steps", "0", "--out", str(out)], tmp_path / "agent.log")
    try:
        wait_for(lambda: len({p["rank"] for p in read_jsonl(out / "progress.jsonl")}) == 2, 60, "both workers to step")
        workers = {p["pid"] for p in read_jsonl(out / "progress.jsonl")}
        tree = set(descendants(agent.pid))
        assert workers <= tree
        agent.signal(signal.SIGKILL)
        agent.wait(10)
        wait_for(lambda: not [pid for pid in tree if pid_alive(pid)], 15,
                 f"the agent's workers (and etcd) to die with it: {[p for p in tree if pid_alive(p)]}")
    finally:
        agent.close()


@pytest.mark.timeout(60)
def test_a_failed_setup_leaves_no_keeper_mailbox_or_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In process: the agent's constructor fails after the metrics exporter, the mailbox and the keeper exist.
    import socket

    from checkpoint.memory.api import ENV_MEMORY_DIR
    from elastic import launcher
    from elastic.cli import build_parser, config_from_args, settings_from_args
    from elastic.memory_keeper import Keeper
    from elastic.preemption import ENV_NOTICE_DIR, Mailbox
    from tests.harness.procs import free_port

    for name in (ENV_MEMORY_DIR, ENV_NOTICE_DIR, "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        monkeypatch.setenv(name, "")  # restored after the test: launch() sets them
    made: dict[str, object] = {}

    def keeper_create(*args: object, **kwargs: object) -> Keeper:
        made["keeper"] = keeper = real_keeper(*args, **kwargs)  # type: ignore[arg-type]
        return keeper

    def mailbox_create(*args: object, **kwargs: object) -> Mailbox:
        made["mailbox"] = mailbox = real_mailbox(*args, **kwargs)  # type: ignore[arg-type]
        return mailbox

    def broken_agent(*args: object, **kwargs: object) -> None:
        raise RuntimeError("agent constructor failed")

    real_keeper, real_mailbox = Keeper.create, Mailbox.create
    monkeypatch.setattr(launcher.Keeper, "create", keeper_create)
    monkeypatch.setattr(launcher.Mailbox, "create", mailbox_create)
    monkeypatch.setattr(launcher, "SpotrunAgent", broken_agent)
    port = free_port()
    args = build_parser().parse_args([
        "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=static", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", "--rdzv-id=setup-leak", f"--metrics-port={port}", "--no-warm-workers",
        f"--log-dir={tmp_path / 'logs'}", PRINT_ENV,
    ])  # fmt: skip
    config, cmd, cmd_args = config_from_args(args)
    with pytest.raises(RuntimeError, match="agent constructor failed"):
        launcher.launch(config, cmd, cmd_args, settings_from_args(args))
    keeper, mailbox = made["keeper"], made["mailbox"]
    assert isinstance(keeper, Keeper) and isinstance(mailbox, Mailbox)
    assert not Path(keeper.path).exists() and keeper.process is None, "the keeper outlived a failed setup"
    assert not Path(mailbox.path).exists(), "the mailbox outlived a failed setup"
    with socket.socket() as sock:
        sock.bind(("", port))  # the metrics exporter's port is free again


def test_a_tmpdir_too_long_for_the_forkserver_socket_falls_back_to_plain_workers(tmp_path: Path) -> None:
    """multiprocessing's forkserver listens on a Unix socket under TMPDIR (``pymp-*/listener-*``), and a path over
    107 bytes cannot be bound: the agent died with "AF_UNIX path too long" (a TMPDIR of ~80 characters was enough,
    found under pytest's own temporary directories), where torchrun starts plain workers and runs. The job must
    run on plain workers, saying once why."""
    tmpdir = tmp_path / ("t" * max(1, 110 - len(str(tmp_path))))
    tmpdir.mkdir()
    assert len(str(tmpdir)) >= 108
    out = tmp_path / "out"
    result = run_cli([*SPOTRUN, "--standalone", "--nproc-per-node", "2", FAULT, "--steps", "2", "--no-collective",
                      "--out", str(out)], timeout=120, env=make_env(TMPDIR=str(tmpdir)))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert {p["rank"] for p in read_jsonl(out / "progress.jsonl")} == {0, 1}
    fallbacks = [line for line in result.stderr.splitlines() if "warm workers off" in line]
    assert len(fallbacks) == 1 and "AF_UNIX path too long" in fallbacks[0], result.stderr[-3000:]
