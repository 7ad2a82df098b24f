"""The speculative warm forkserver (``elastic.boot``): the pre-parser reads argv as the real parser does, the guess
is what the launcher decides, a mismatch is refused, and a launch adopts the early forkserver.

The drop-in behaviour of warm workers as a whole is tests/elastic/test_fidelity.py's (which runs with the early
forkserver, as every ``python -m elastic.cli`` test does).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from elastic import boot
from elastic.boot import FLAG_OPTIONS, VALUE_OPTIONS, WarmGuess, guess, mismatch, pre_parse
from elastic.cli import build_parser
from tests.harness.procs import EXAMPLES, make_env, run_cli

SCRIPT = str(EXAMPLES / "train_ddp.py")


def test_option_tables_equal_the_real_parser() -> None:
    flags, values = set(), set()
    for action in build_parser()._actions:
        if action.option_strings:
            (flags if action.nargs == 0 else values).update(action.option_strings)
    assert flags == FLAG_OPTIONS, "update elastic/boot.py's TORCHRUN_FLAG_OPTIONS (spotrun's: elastic/options.py)"
    assert values == VALUE_OPTIONS, "update elastic/boot.py's TORCHRUN_VALUE_OPTIONS (spotrun's: elastic/options.py)"


@pytest.mark.parametrize(
    "argv",
    [
        ["--nproc-per-node", "2", "--rdzv-endpoint", "h:1", SCRIPT, "--nproc-per-node", "9"],
        ["--nproc_per_node=2", "--standalone", SCRIPT],
        ["--nproc-per", "2", "--max-restarts=3", "-r3", SCRIPT, "--x"],  # abbreviations, like argparse
        ["--nnodes", "1:2", "--", SCRIPT],
    ],
)
def test_pre_parse_finds_the_script_as_the_parser_does(argv: list[str]) -> None:
    parsed = pre_parse(argv, VALUE_OPTIONS)
    real = build_parser().parse_args(argv)
    assert parsed is not None and parsed.script == real.training_script


def test_pre_parse_gives_up_when_in_doubt() -> None:
    assert pre_parse(["--unknown-flag", SCRIPT], VALUE_OPTIONS) is None
    assert pre_parse(["--no", SCRIPT], VALUE_OPTIONS) is None  # ambiguous abbreviation
    assert pre_parse(["--nproc-per-node"], VALUE_OPTIONS) is None  # value missing


def test_guess_matches_the_launchers_decisions(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    g = guess(["--nproc-per-node", "2", SCRIPT], env, VALUE_OPTIONS)
    assert g == WarmGuess({"OMP_NUM_THREADS": "1", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"},
                          (int(signal.SIGTERM),))  # fmt: skip
    g = guess(["--nproc-per-node", "2", "--preempt-signal", "USR2@60", "--signals-to-handle", "SIGTERM", SCRIPT],
              {"OMP_NUM_THREADS": "4"}, VALUE_OPTIONS)  # fmt: skip
    assert g is not None and "OMP_NUM_THREADS" not in g.env
    assert g.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM"
    assert g.shielded == (int(signal.SIGTERM), int(signal.SIGUSR2))
    # no forkserver: binaries, --run-path, warm workers off, a missing script, help, a device-counted nproc
    assert guess(["--no-python", "echo"], env, VALUE_OPTIONS) is None
    assert guess(["--no-warm-workers", SCRIPT], env, VALUE_OPTIONS) is None
    assert guess([SCRIPT], {"SPOTRUN_WARM_WORKERS": "0"}, VALUE_OPTIONS) is None
    assert guess([str(tmp_path / "missing.py")], env, VALUE_OPTIONS) is None
    assert guess(["-h"], env, VALUE_OPTIONS) is None
    assert guess(["--nproc-per-node", "auto", SCRIPT], env, VALUE_OPTIONS) is None
    assert guess(["--preempt-signal", "KILL", SCRIPT], env, VALUE_OPTIONS) is None  # the launcher reports it


def test_a_forkserver_started_otherwise_is_refused() -> None:
    from elastic.warm import DEFAULT_PRELOAD

    g = WarmGuess({"OMP_NUM_THREADS": "1"}, (int(signal.SIGTERM),))
    early = boot._Early(g, {"OMP_NUM_THREADS": "1", "HOME": "/x"}, tuple(DEFAULT_PRELOAD))
    same = {"OMP_NUM_THREADS": "1", "HOME": "/y", "SPOTRUN_NOTICE_DIR": "/d", "RANK": "3"}
    assert mismatch(early, DEFAULT_PRELOAD, [int(signal.SIGTERM)], same) is None  # only import-time variables count
    assert mismatch(early, DEFAULT_PRELOAD, [int(signal.SIGTERM)], {"OMP_NUM_THREADS": "2"}) == "environment OMP_NUM_THREADS"
    assert mismatch(early, DEFAULT_PRELOAD, [int(signal.SIGTERM), int(signal.SIGUSR1)], same) == "blocked signals"
    assert mismatch(early, ("torch",), [int(signal.SIGTERM)], same) == "preloaded modules"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("early", ["1", "0"])
def test_a_launch_uses_the_early_forkserver_only_when_on(tmp_path: Path, early: str) -> None:
    result = run_cli([sys.executable, "-m", "elastic.cli", "--standalone", "--nproc-per-node", "2", SCRIPT, "--steps",
                      "2", "--log-every", "1"], timeout=280,
                     env=make_env(LOGLEVEL="INFO", SPOTRUN_EARLY_FORKSERVER=early))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "step=2 " in result.stdout
    used = "using the forkserver started before the agent's imports" in result.stderr
    assert used == (early == "1"), result.stderr[-3000:]
    assert "warm workers off" not in result.stderr
