"""Drop-in details a torchrun user meets on a first command (PyTorch's own launcher tests run in
tests/elastic/torch_launcher): torchrun's backend choice without ``--rdzv-backend``, torchrun's exit codes and
exception types for a bad configuration, a bad command line rejected before ``import torch``, ``main(argv)``
in-process leaving nothing behind, the start method asked for, ``python -m elastic.cli`` starting cleanly.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path
from unittest.mock import Mock

import pytest

from elastic import boot, cli
from elastic.api import ENV_NOTICE_DIR, LaunchConfigError
from elastic.launcher import lease_ttl_of
from tests.harness.procs import EXAMPLES, SPOTRUN, Launcher, free_port, make_env, run_cli, wait_for

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(EXAMPLES / "print_env.py")


def _parse(*argv: str) -> object:
    return cli.parse_command_line(cli.build_parser(), [*argv, SCRIPT])


# --- which rendezvous: torchrun's choice when the command names no backend ----------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "mode"),
    [
        ([], {}, "standalone"),  # torchrun: its c10d store on a free port
        (["--master-port", "29555"], {}, "static"),  # torchrun: static, the workers get exactly that port
        (["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--master-port", "1"], {}, "static"),
        (["--nnodes", "2"], {}, "static"),
        (["--rdzv-backend", "static"], {}, "standalone"),  # torchrun too: static, one node, no port
        (["--rdzv-backend", "static", "--master-port", "29555"], {}, "static"),
        (["--rdzv-backend", "etcd-v3", "--master-port", "29555"], {}, "standalone"),  # the port is static's only
        (["--master-port", "29555"], {"PET_RDZV_BACKEND": "etcd-v3"}, "standalone"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1"], {}, "etcd-v3"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"], {}, "c10d"),
        (["--standalone", "--master-port", "29555"], {}, "standalone"),
    ],
)
def test_the_rendezvous_is_torchruns_choice_unless_one_is_named(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], mode: str
) -> None:
    monkeypatch.delenv("PET_RDZV_BACKEND", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.rendezvous_mode(_parse(*argv)) == mode  # type: ignore[arg-type]  # a Namespace


def test_the_static_note_says_how_to_make_the_job_elastic() -> None:
    note = cli.static_note(_parse("--nnodes", "2", "--master-addr", "h", "--master-port", "7"))  # type: ignore[arg-type]
    assert "h:7" in note and "--rdzv-backend etcd-v3 --rdzv-endpoint HOST:PORT" in note
    assert "\n" not in note


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_classic_multi_node_static_command_runs_as_under_torchrun(tmp_path: Path) -> None:
    """Two agents, ``--nnodes 2 --node-rank R --master-addr --master-port`` and no backend: torchrun's static
    rendezvous, the workers see exactly that master, each agent says once how to make the job elastic."""
    port = free_port()
    agents = [
        Launcher([*SPOTRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr",
                  "127.0.0.1", "--master-port", str(port), SCRIPT, "--out", str(tmp_path / "env")],
                 tmp_path / f"agent{rank}.log")
        for rank in (0, 1)
    ]
    try:
        for agent in agents:
            assert agent.wait(200) == 0, agent.output()[-3000:]
    finally:
        for agent in agents:
            agent.close()
    for agent in agents:
        assert agent.output().count("torch's static rendezvous at 127.0.0.1:") == 1, agent.output()[-3000:]
    envs = [json.loads((tmp_path / "env" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["RANK"] for e in envs} == {"0", "1"}


# --- a configuration error: torchrun's exit status and, from Python, torchrun's exception type ---------------


@pytest.mark.parametrize(
    ("argv", "torch_type"),
    [
        (["--nnodes", "3:2"], AssertionError),
        (["--nnodes", "0"], AssertionError),
        (["--nnodes", "1:2:3"], RuntimeError),
        (["--nnodes", "x"], ValueError),
        (["--nproc-per-node", "0"], AssertionError),
        (["--nproc-per-node", "many"], ValueError),
        (["--max-restarts", "-1"], AssertionError),
        (["--monitor-interval", "0"], AssertionError),
        (["--rdzv-conf", "novalue"], ValueError),
        (["--no-python", "--module"], ValueError),
        (["--logs-specs", "DOES_NOT_EXIST"], ValueError),
    ],
)
def test_main_from_python_raises_torchruns_exception_type(argv: list[str], torch_type: type[Exception]) -> None:
    from torch.distributed.run import main as torchrun_main

    with pytest.raises(torch_type):
        torchrun_main([*argv, SCRIPT])  # what torchrun raises, so that the table above stays true
    with pytest.raises(torch_type) as raised:
        cli.main([*argv, SCRIPT])
    assert isinstance(raised.value, LaunchConfigError)


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--nnodes", "3:2"], 1, "minimum 3 is greater than maximum 2"),
        (["--nproc-per-node", "0"], 1, "--nproc-per-node must be >= 1, got 0"),
        (["--nnodes", "1:2:3"], 1, "--nnodes='1:2:3' is malformed"),
        (["--max-restarts", "-1"], 1, "--max-restarts must be >= 0"),
        (["--rdzv-conf", "a=1,novalue"], 1, "--rdzv-conf entry 'novalue' is malformed"),
        (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
        (["--no-such-flag=3", "--nnodes", "2"], 2, "unrecognized arguments: --no-such-flag=3"),
    ],
)
def test_a_bad_command_line_is_rejected_before_import_torch(tmp_path: Path, argv: list[str], status: int,
                                                          message: str) -> None:
    """A ``torch`` that fails to import stands in for the real one: a command line rejected before the import
    gets its one line, else the traceback names the stand-in. Independent of the machine's load."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = make_env(PYTHONPATH=os.pathsep.join([str(fake), make_env().get("PYTHONPATH", "")]))
    result = run_cli([sys.executable, "-c", "from elastic.main import main; main()", *argv, SCRIPT], timeout=60, env=env)
    assert result.returncode == status, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotrun: error: ") and message in lines[0], result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--nproc-per-node", "many"],  # a privateuse1 backend's name: torch tells
        ["--max-restarts", "x"],  # argparse's own message
        ["--nproc-per-node", "0", "--nproc_per_node", "2"],  # two spellings: the parser keeps the later one
        ["-h", "--nnodes", "3:2"],  # help wins
        ["--nproc", "0"],  # an abbreviation of two spellings: argparse's call
    ],
)
def test_what_the_pre_parser_cannot_judge_goes_to_the_real_parser(argv: list[str]) -> None:
    assert boot.reject_early([*argv, SCRIPT], {}, boot.TABLE_TORCH_RELEASE) is None


def test_the_pre_parser_reads_the_pet_fallbacks_and_leaves_the_script_alone() -> None:
    assert boot.reject_early([SCRIPT], {"PET_NNODES": "3:2"}, boot.TABLE_TORCH_RELEASE) == (
        1, "--nnodes='3:2': minimum 3 is greater than maximum 2; use MIN:MAX with MIN <= MAX")
    assert boot.reject_early([SCRIPT, "--nnodes", "3:2", "--bogus"], {}, boot.TABLE_TORCH_RELEASE) is None
    # an option torch's next release may have added is left to its parser
    assert boot.reject_early(["--log-line-prefix-template", "x", SCRIPT], {}, "2.14") is None
    assert boot.reject_early(["--log-line-prefix-template", "x", SCRIPT], {}, boot.TABLE_TORCH_RELEASE) is not None


def test_the_option_tables_are_the_installed_torchs() -> None:
    assert boot.installed_torch_release() == boot.TABLE_TORCH_RELEASE, "recheck boot's tables for this torch"


def test_the_command_exits_1_with_one_line_for_a_configuration_error_only_torch_can_judge() -> None:
    result = run_cli([*SPOTRUN, "--nproc-per-node", "many", SCRIPT], timeout=90)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "spotrun: error: --nproc-per-node='many' is not valid; use an integer, cpu, gpu, xpu or auto")
    assert "Traceback" not in result.stderr


# --- main(argv) in-process ---------------------------------------------------------------------------------


def _ensure_forkserver() -> None:
    from multiprocessing import forkserver

    forkserver.ensure_running()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_main_in_process_leaves_nothing_behind(tmp_path: Path) -> None:
    """accelerate and elastic_launch users call the launcher in their own process: after it, no forkserver,
    the caller's signal handlers and environment, no thread of the launch; a process forked afterwards can
    start its own forkserver."""
    def on_usr1(signum: int, frame: object) -> None:
        pass

    previous_usr1 = signal.signal(signal.SIGUSR1, on_usr1)
    try:
        handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}}
        threads = set(threading.enumerate())
        notice_dir = os.environ.get(ENV_NOTICE_DIR)
        assert not boot.forkserver_running()
        cli.main(["--nproc-per-node", "1", "--preempt-signal", "USR1", "--log-dir", str(tmp_path / "logs"), SCRIPT,
                  "--out", str(tmp_path / "env")])  # warm workers: the default start method
        assert (tmp_path / "env" / "rank0.json").is_file()
        assert not boot.forkserver_running(), "main() left its warm forkserver running"
        after = {sig: signal.getsignal(sig) for sig in handlers}
        assert after == handlers, {sig: (handlers[sig], after[sig]) for sig in handlers if after[sig] != handlers[sig]}
        assert os.environ.get(ENV_NOTICE_DIR) == notice_dir
        wait_for(lambda: not set(threading.enumerate()) - threads, 30, "the launch's threads to end")
        child = multiprocessing.get_context("fork").Process(target=_ensure_forkserver)
        child.start()
        child.join(60)
        assert child.exitcode == 0, "a process forked after main() could not start its forkserver"
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        boot.stop_forkserver()
        # multiprocessing's resource tracker outlives main(argv), as it outlives torchrun's: stop it here (the
        # suite fails on a process left behind), as tests/harness/dist.py does.
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._stop()


@pytest.mark.parametrize(
    ("argv", "env", "warm"),
    [
        ([], {}, True),
        (["--start-method", "spawn"], {}, False),
        (["--start_method=fork"], {}, False),
        (["--start-method", "forkserver"], {}, True),
        ([], {"PET_START_METHOD": "spawn"}, False),
        (["--start-method", "spawn", "--warm-workers"], {}, True),  # asked for by name
    ],
)
def test_warm_workers_only_when_no_other_start_method_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], warm: bool
) -> None:
    monkeypatch.delenv("PET_START_METHOD", raising=False)
    monkeypatch.delenv("SPOTRUN_WARM_WORKERS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.settings_from_args(_parse(*argv)).warm_workers is warm  # type: ignore[arg-type]  # a Namespace
    guessed = boot.guess([*argv, SCRIPT], dict(os.environ), boot.VALUE_OPTIONS)
    assert (guessed is not None) is warm, "elastic.boot must guess what the launcher decides"


# --- the rendezvous handler's lease ------------------------------------------------------------------------


def test_lease_ttl_is_a_number_not_an_attribute() -> None:
    class Leased:
        def __init__(self, ttl: object) -> None:
            self.lease_ttl = ttl

    assert lease_ttl_of(Mock()) is None  # every attribute of a Mock exists
    assert lease_ttl_of(Leased(3)) == 3.0  # type: ignore[arg-type]  # a stand-in handler
    for bad in (True, float("nan"), float("inf"), 0, -1.0, "3", None):
        assert lease_ttl_of(Leased(bad)) is None, bad  # type: ignore[arg-type]  # a stand-in handler


# --- python -m elastic.cli ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_python_m_elastic_cli_starts_without_a_runtime_warning(tmp_path: Path) -> None:
    """Warm workers run no second copy of the launcher's module (multiprocessing re-runs a main module by name
    in its children; ``python -m elastic.cli`` hands over to ``python -m elastic``)."""
    result = run_cli([*SPOTRUN, "--nproc-per-node", "1", SCRIPT, "--out", str(tmp_path / "env")], timeout=100,
                     env=make_env(PYTHONWARNINGS="default"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "env" / "rank0.json").is_file()
    assert "RuntimeWarning" not in result.stderr and "found in sys.modules" not in result.stderr, result.stderr
