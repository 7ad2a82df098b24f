"""spotrun's command line: torchrun's flags and spellings, spotrun defaults, clear errors on bad input."""

from __future__ import annotations

import os
import time

import pytest
from torch.distributed.run import get_args_parser

from elastic.api import LaunchConfigError
from elastic.cli import build_parser, settings_from_args, should_run_standalone, validate_args
from elastic.config import AgentSettings, parse_nnodes, parse_rdzv_conf
from tests.harness.deadline import scaled
from tests.harness.procs import EXAMPLES, SPOTRUN, descendants, run_cli

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(EXAMPLES / "print_env.py")


def _option_strings(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def test_every_torchrun_flag_is_accepted_with_the_same_spellings() -> None:
    missing = _option_strings(get_args_parser()) - _option_strings(build_parser())
    assert not missing, f"torchrun flags spotrun does not accept: {sorted(missing)}"


def test_dash_and_underscore_forms_parse_the_same() -> None:
    dash = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j",
            "--rdzv-conf", "lease_ttl=2", "--max-restarts", "3", "--monitor-interval", "0.5", "--start-method",
            "fork", "--no-python", "--log-dir", "/tmp/x", "--local-ranks-filter", "0", "--node-rank", "1",
            "--master-addr", "a", "--master-port", "5", "--local-addr", "b", "--stop-grace", "1",
            "--peer-loss-grace", "2", "--events-file", "/tmp/e", SCRIPT, "--flag", "v"]
    underscore = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in dash]
    assert underscore != dash
    parser = build_parser()
    assert vars(parser.parse_args(dash)) == vars(parser.parse_args(underscore))


def test_defaults_match_torchrun_except_the_rendezvous_backend() -> None:
    ours = vars(build_parser().parse_args([SCRIPT]))
    theirs = vars(get_args_parser().parse_args([SCRIPT]))
    different = {k for k in theirs if ours[k] != theirs[k]}
    assert different == {"rdzv_backend"}
    assert ours["rdzv_backend"] == "etcd-v3"
    assert theirs["rdzv_backend"] == "static"


def test_pet_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    args = build_parser().parse_args([SCRIPT])
    assert (args.nproc_per_node, args.rdzv_backend, args.max_restarts) == ("3", "c10d", 7)


def test_spotrun_settings_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRUN_STOP_GRACE", "1.5")
    args = build_parser().parse_args([SCRIPT])
    assert settings_from_args(args).stop_grace == 1.5
    args = build_parser().parse_args(["--stop-grace", "0.5", SCRIPT])
    assert settings_from_args(args).stop_grace == 0.5
    with pytest.raises(LaunchConfigError, match="stop_grace"):
        AgentSettings(stop_grace=-1)


# (flag, env var, env value, flag value, settings field, from env, from flag): the flag wins over the env
# var, the env var over the default, each read the same way (elastic.config.resolve).
SETTINGS = [
    ("--stop-grace", "SPOTRUN_STOP_GRACE", "1.5", "0.5", "stop_grace", 1.5, 0.5),
    ("--peer-loss-grace", "SPOTRUN_PEER_LOSS_GRACE", "7", "8", "peer_loss_grace", 7.0, 8.0),
    ("--events-file", "SPOTRUN_EVENTS_FILE", "/tmp/env.jsonl", "/tmp/flag.jsonl", "events_file",
     "/tmp/env.jsonl", "/tmp/flag.jsonl"),
    ("--preempt-grace", "SPOTRUN_PREEMPT_GRACE", "90", "45", "preempt_grace", 90.0, 45.0),
    ("--preempt-signal", "SPOTRUN_PREEMPT_SIGNAL", "USR2@120", "USR1", "preempt_signal", "USR2@120", "USR1"),
    ("--preempt-notice", "SPOTRUN_PREEMPT_NOTICE", "aws,gcp", "azure", "preempt_sources", ("aws", "gcp"),
     ("azure",)),
    ("--preempt-poll-interval", "SPOTRUN_PREEMPT_POLL_INTERVAL", "5", "0.5", "preempt_poll_interval", 5.0, 0.5),
    ("--resize-timeout", "SPOTRUN_RESIZE_TIMEOUT", "120", "10", "resize_timeout", 120.0, 10.0),
]


@pytest.mark.parametrize(("flag", "env", "env_value", "flag_value", "field", "from_env", "from_flag"), SETTINGS)
def test_each_spotrun_setting_reads_flag_then_env_then_default(
    monkeypatch: pytest.MonkeyPatch, flag: str, env: str, env_value: str, flag_value: str, field: str,
    from_env: object, from_flag: object,
) -> None:
    monkeypatch.delenv(env, raising=False)
    assert getattr(settings_from_args(build_parser().parse_args([SCRIPT])), field) == getattr(AgentSettings(), field)
    monkeypatch.setenv(env, env_value)
    assert getattr(settings_from_args(build_parser().parse_args([SCRIPT])), field) == from_env
    args = build_parser().parse_args([flag, flag_value, SCRIPT])
    assert getattr(settings_from_args(args), field) == from_flag


@pytest.mark.parametrize("env", ["SPOTRUN_PREEMPT_GRACE", "SPOTRUN_RESIZE_TIMEOUT", "SPOTRUN_PREEMPT_POLL_INTERVAL"])
def test_a_malformed_env_default_names_the_variable(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv(env, "soon")
    with pytest.raises(LaunchConfigError, match=f"{env}='soon' is not a number"):
        settings_from_args(build_parser().parse_args([SCRIPT]))


def test_planned_leave_exit_code_from_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from_args(build_parser().parse_args([SCRIPT])).planned_leave_exit_code == 0
    monkeypatch.setenv("SPOTRUN_PLANNED_LEAVE_EXIT_CODE", "75")
    assert settings_from_args(build_parser().parse_args([SCRIPT])).planned_leave_exit_code == 75
    args = build_parser().parse_args(["--planned-leave-exit-code", "3", SCRIPT])
    assert settings_from_args(args).planned_leave_exit_code == 3, "the flag wins over the environment"
    for bad in ("256", "-1"):
        with pytest.raises(LaunchConfigError, match="from 0 to 255"):
            settings_from_args(build_parser().parse_args(["--planned-leave-exit-code", bad, SCRIPT]))
    monkeypatch.setenv("SPOTRUN_PLANNED_LEAVE_EXIT_CODE", "seventy")
    with pytest.raises(LaunchConfigError, match="SPOTRUN_PLANNED_LEAVE_EXIT_CODE"):
        settings_from_args(build_parser().parse_args([SCRIPT]))
    with pytest.raises(LaunchConfigError, match="from 0 to 255"):
        AgentSettings(planned_leave_exit_code=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"), [("1", (1, 1)), ("2:4", (2, 4)), (" 3:3 ", (3, 3))]
)
def test_parse_nnodes(text: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("2:x", "malformed"), ("1:2:3", "malformed"), ("", "malformed"), ("3:2", "greater than maximum"),
     ("0:2", ">= 1"), (":", "malformed")],
)
def test_parse_nnodes_rejects(text: str, message: str) -> None:
    with pytest.raises(LaunchConfigError, match=message):
        parse_nnodes(text)


def test_parse_rdzv_conf() -> None:
    assert parse_rdzv_conf("lease_ttl=2, join_timeout=5") == {"lease_ttl": "2", "join_timeout": "5"}
    with pytest.raises(LaunchConfigError, match="lease_ttl"):
        parse_rdzv_conf("lease_ttl")


def test_validate_args_rejects_bad_nproc_and_restarts() -> None:
    parser = build_parser()
    with pytest.raises(LaunchConfigError, match="nproc-per-node"):
        validate_args(parser.parse_args(["--nproc-per-node", "many", SCRIPT]))
    with pytest.raises(LaunchConfigError, match="max-restarts"):
        validate_args(parser.parse_args(["--max-restarts", "-1", SCRIPT]))


def test_single_node_without_endpoint_runs_standalone() -> None:
    parser = build_parser()
    assert should_run_standalone(parser.parse_args([SCRIPT]))
    assert not should_run_standalone(parser.parse_args(["--nnodes", "2", "--rdzv-endpoint", "h:1", SCRIPT]))
    assert not should_run_standalone(parser.parse_args(["--rdzv-backend", "c10d", SCRIPT]))


@pytest.fixture(autouse=True)
def _children_before_test() -> None:
    """Processes already alive before the test (session-scoped servers such as moto_server) are not strays."""
    global _BASELINE
    _BASELINE = set(descendants(os.getpid()))


_BASELINE: set[int] = set()


def _assert_no_children(allowed: set[int | None] = frozenset()) -> None:
    """No process of the test's left alive. One still in its exit path (state R or D, its command line already
    gone: an orphan re-parented to pytest, the subreaper, as it dies) gets 5 s to finish; a stray never does."""
    def strays() -> dict[int, tuple[str, str]]:
        return {pid: v for pid, v in descendants(os.getpid()).items() if pid not in allowed and pid not in _BASELINE}

    deadline = time.monotonic() + 5.0
    left = strays()
    while left and all(cmd == "" for _, cmd in left.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = strays()
    assert not left, f"stray processes: {left}"


@pytest.mark.parametrize(
    ("argv", "message", "status"),  # torchrun's exit status: 1 for a value its launch config refuses, 2 argparse's
    [
        (["--nnodes", "2:x"], "--nnodes='2:x' is malformed", 1),
        (["--nnodes", "4:2"], "greater than maximum", 1),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag", 2),
        (["--rdzv-conf", "novalue"], "--rdzv-conf entry 'novalue' is malformed", 1),
        (["--nnodes", "2", "--max-restarts", "-2"], "--max-restarts must be >= 0", 1),
    ],
)
def test_bad_command_lines_exit_2_with_a_clear_message(argv: list[str], message: str, status: int) -> None:
    began = time.monotonic()
    result = run_cli([*SPOTRUN, *argv, SCRIPT], timeout=30)
    assert result.returncode == status, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - began < scaled(45), "a bad command line must be rejected before any rendezvous"
    _assert_no_children()


@pytest.mark.slow
def test_unknown_rdzv_conf_key_is_rejected(etcd_server) -> None:
    result = run_cli([*SPOTRUN, "--nnodes", "2", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-conf",
                      "lease_tll=2", SCRIPT], timeout=30)
    assert result.returncode == 1, result.stderr  # torchrun's exit status for a configuration error
    assert "lease_tll" in result.stderr
    assert "Traceback" not in result.stderr
    _assert_no_children({etcd_server.pid})


@pytest.mark.slow
def test_unreachable_etcd_fails_quickly_with_a_clear_message() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on (bound, not listening)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        began = time.monotonic()
        result = run_cli([*SPOTRUN, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-conf", "etcd_timeout=3", SCRIPT], timeout=60)
        elapsed = time.monotonic() - began
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr
    assert "spotrun: error:" in result.stderr, result.stderr[-2000:]
    assert elapsed < 25, f"took {elapsed:.1f} s to report an unreachable etcd"
    _assert_no_children()
