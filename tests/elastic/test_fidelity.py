"""Warm workers (spotrun's default) are indistinguishable from stock torchrun's: one torchrun-style script
(``fidelity_worker.py``) runs under ``torchrun --standalone`` and ``spotrun --standalone`` and everything it
and its launcher can observe is compared. The four launches (2 launchers x 2 modes) run at once to keep the
suite short."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.procs import REPO, SPOTRUN, TORCHRUN, make_env, pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("fidelity_worker.py")
STDIN_TEXT = "fidelity-stdin-line\n"
#: Variables that legitimately differ between the two launches: ports and run ids are per run, and the
#: error file lives in each launcher's own temporary log directory. SPOTRUN_NOTICE_DIR and SPOTRUN_MEMORY_DIR
#: are spotrun's two additions: the preemption mailbox that elastic.preemption reads (torchrun has no notices)
#: and the memory tier's directory that checkpoint.memory reads; docs/concepts/launcher.md lists them among
#: what a script can see. (TORCHELASTIC_USE_AGENT_STORE is the same: both agents host the workers' store.)
VOLATILE_ENV = {"MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
                "SPOTRUN_NOTICE_DIR", "SPOTRUN_MEMORY_DIR"}
"""Per-run values, and spotrun's own additions (the notice mailbox, the memory tier's directory): names a
torchrun script never reads."""
NPROC = {"observe": 2, "fail": 5}


@dataclass
class Run:
    launcher: str
    mode: str
    out: Path
    returncode: int
    stdout: str
    stderr: str

    def observed(self, rank: int) -> dict:
        """What rank ``rank`` observed, with this run's output directory (an argument) written as OUT."""
        return json.loads((self.out / f"observed.{rank}.json").read_text().replace(str(self.out), "OUT"))

    def marker(self, name: str, rank: int) -> str | None:
        path = self.out / f"{name}.{rank}"
        return path.read_text() if path.exists() else None

    def loader_pids(self) -> list[int]:
        return [int(path.read_text()) for path in self.out.glob("loaderpid*") if path.read_text()]


def _ignore_hangup_and_quit() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def _start(launcher: str, mode: str, root: Path) -> tuple[subprocess.Popen, Path, tuple]:
    out = root / f"{launcher}-{mode}"
    out.mkdir()
    base = TORCHRUN if launcher == "torchrun" else SPOTRUN
    # spotrun waits --stop-grace (3 s) between SIGTERM and SIGKILL where torchrun waits 30 s, a documented
    # default (docs/concepts/launcher.md) that only shows when a worker takes longer to get out: rank 0's
    # SIGTERM handler, DataLoader shutdown and atexit took over 3 s on a loaded CI machine. With torchrun's
    # 30 s both must behave the same.
    grace = ["--stop-grace", "30"] if launcher == "spotrun" else []
    argv = [*base, "--standalone", "--nproc-per-node", str(NPROC[mode]), "--monitor-interval", "1", *grace,
            str(SCRIPT), "--out", str(out), "--mode", mode]
    env = make_env(FIDELITY_MARK="from-launcher-env")
    env.pop("OMP_NUM_THREADS", None)
    stdin = open(root / "stdin.txt")  # noqa: SIM115 (closed with the run)
    stdout = open(out / "launcher.stdout", "wb")  # noqa: SIM115 (closed with the run)
    stderr = open(out / "launcher.stderr", "wb")  # noqa: SIM115 (closed with the run)
    # Both launchers start with SIGHUP and SIGQUIT ignored, as under `nohup` or as a shell's background job
    # (CI runs that way): what each worker inherits from its launcher is part of what is compared.
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                            start_new_session=True, preexec_fn=_ignore_hangup_and_quit)
    return proc, out, (stdin, stdout, stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Run]]:
    root = tmp_path_factory.mktemp("fidelity")
    (root / "stdin.txt").write_text(STDIN_TEXT + "second line\n")
    started = {(launcher, mode): _start(launcher, mode, root)
               for launcher in ("torchrun", "spotrun") for mode in ("observe", "fail")}
    results: dict[tuple[str, str], Run] = {}
    try:
        for (launcher, mode), (proc, out, _handles) in started.items():
            try:
                returncode = proc.wait(240)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{launcher} --mode {mode} still running after 240 s") from None
            results[launcher, mode] = Run(launcher, mode, out, returncode,
                                          (out / "launcher.stdout").read_text(errors="replace"),
                                          (out / "launcher.stderr").read_text(errors="replace"))
        yield results
    finally:
        for proc, _, handles in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for handle in handles:
                handle.close()


def _pair(runs: dict[tuple[str, str], Run], mode: str) -> tuple[Run, Run]:
    return runs["torchrun", mode], runs["spotrun", mode]


def _context(run: Run) -> str:
    return f"{run.launcher} --mode {run.mode} exited {run.returncode}; stderr tail:\n{run.stderr[-4000:]}"


# --- a clean run ----------------------------------------------------------------------------------------


def test_spotrun_really_ran_warm_workers(runs: dict[tuple[str, str], Run]) -> None:
    """Otherwise the comparisons below would compare two plain subprocess launches."""
    for mode in NPROC:
        spotrun = runs["spotrun", mode]
        assert "warm workers: forkserver ready" in spotrun.stderr, _context(spotrun)
        assert "warm workers off" not in spotrun.stderr, _context(spotrun)


def test_clean_run_observes_the_same_worker(runs: dict[tuple[str, str], Run]) -> None:
    torchrun, spotrun = _pair(runs, "observe")
    assert torchrun.returncode == 0, _context(torchrun)
    assert spotrun.returncode == 0, _context(spotrun)
    for rank in range(NPROC["observe"]):
        expected, actual = torchrun.observed(rank), spotrun.observed(rank)
        for env in (expected, actual):
            env["env"] = {k: v for k, v in env["env"].items() if k not in VOLATILE_ENV}
        assert expected["start_method"] is None and expected["default_context"] == "fork"
        assert expected["env"]["FIDELITY_MARK"] == "from-launcher-env"
        assert sorted(expected) == sorted(actual)
        differing = {key: (expected[key], actual[key]) for key in expected if expected[key] != actual[key]}
        assert differing == {}, f"rank {rank}: torchrun vs spotrun"
    # The DataLoader with a lambda collate_fn and worker processes ran (it cannot be pickled: fork only).
    assert spotrun.observed(1)["batches"] == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert spotrun.observed(0)["stdin_line"] == STDIN_TEXT


def test_unseeded_generators_differ_between_workers_as_in_fresh_interpreters(runs: dict[tuple[str, str], Run]) -> None:
    for run in _pair(runs, "observe"):
        draws = [json.loads((run.out / f"draws.{rank}.json").read_text()) for rank in range(NPROC["observe"])]
        for generator in ("numpy", "random", "torch", "torch_seed"):
            assert draws[0][generator] != draws[1][generator], f"{run.launcher}: {generator} draws equal across ranks"


def test_clean_run_atexit_and_stdio(runs: dict[tuple[str, str], Run]) -> None:
    for run in _pair(runs, "observe"):
        for rank in range(NPROC["observe"]):
            assert run.marker("atexit", rank) == "ran", f"{run.launcher}: rank {rank}'s atexit handler did not run"
            assert f"fidelity-stdout rank={rank}" in run.stdout.splitlines(), _context(run)
            assert f"fidelity-stderr rank={rank}" in run.stderr.splitlines(), _context(run)
            assert f"fidelity-stderr rank={rank}" not in run.stdout


def test_no_process_is_left_behind(runs: dict[tuple[str, str], Run]) -> None:
    for run in runs.values():
        pids = run.loader_pids()
        assert pids, f"{run.launcher} --mode {run.mode}: no DataLoader worker started"
        assert [pid for pid in pids if pid_alive(pid)] == [], f"{run.launcher} --mode {run.mode} left processes"


# --- failures --------------------------------------------------------------------------------------------


def _failures(stderr: str) -> dict[int, dict[str, str]]:
    """rank -> {exitcode, error_file, traceback} from torch's ChildFailedError summary."""
    failures: dict[int, dict[str, str]] = {}
    for block in re.split(r"\n\s*\[\d+\]:\n", stderr)[1:]:
        fields = dict(re.findall(r"^\s*(rank|exitcode|error_file|traceback)\s*:\s*(.*)$", block, re.M))
        if "rank" in fields:
            rank = int(fields["rank"].split()[0])
            failures[rank] = {"exitcode": fields.get("exitcode", "").split()[0],
                              "error_file": "N/A" if "<N/A>" in fields.get("error_file", "") else "file",
                              "traceback": fields.get("traceback", "")[:60]}
    return failures


def test_failures_exit_codes_and_error_files_match(runs: dict[tuple[str, str], Run]) -> None:
    torchrun, spotrun = _pair(runs, "fail")
    assert torchrun.returncode == spotrun.returncode == 1, (_context(torchrun), _context(spotrun))
    expected = _failures(torchrun.stderr)
    assert {rank: f["exitcode"] for rank, f in expected.items()} == {1: "3", 2: "1", 3: "1", 4: "1"}, \
        _context(torchrun)
    assert _failures(spotrun.stderr) == expected, _context(spotrun)


def _without_agent_log(text: str) -> str:
    """Drop the agents' own glog-style lines (``E1122 23:14:54.533000 PID file:line] ...``): torch's
    multiprocessing context logs a worker's exception there, its subprocess context does not."""
    return "\n".join(line for line in text.splitlines() if not re.match(r"[IWEF]\d{4} \d\d:\d\d:", line))


#: torch's DataLoader SIGCHLD handler in rank 0 raises when a loader worker dies of the group's SIGTERM while
#: rank 0 still runs Python code on its way out (its atexit handlers and finalizers): whether it prints depends on
#: which of the two processes the kernel runs first, under either launcher (seen with both, torch 2.13 and 2.15).
_LOADER_SIGCHLD_RACE = re.compile(r"^RuntimeError: DataLoader worker \(pid \d+\) is killed by signal", re.M)


def _script_tracebacks(stderr: str) -> int:
    """Tracebacks the script's own failures printed: all of them but the DataLoader SIGCHLD race's."""
    return stderr.count("Traceback (most recent call last):") - len(_LOADER_SIGCHLD_RACE.findall(stderr))


def test_failures_print_what_the_interpreter_prints(runs: dict[tuple[str, str], Run]) -> None:
    torchrun, spotrun = _pair(runs, "fail")
    expected, actual = _without_agent_log(torchrun.stderr), _without_agent_log(spotrun.stderr)
    for line in ("fidelity-exit-message", "RuntimeError: fidelity-unrecorded", "ValueError: fidelity-recorded"):
        assert actual.count(line) == expected.count(line), (line, _context(spotrun))
    # rank 2's message is no traceback; rank 3's prints twice (the worker, then torchrun's root-cause summary
    # quoting its error file), rank 4's once, and the launcher's own ChildFailedError once.
    assert _script_tracebacks(actual) == _script_tracebacks(expected) == 4, (_context(torchrun), _context(spotrun))
    assert "Process ForkServerProcess" not in spotrun.stderr


def test_sigterm_handler_and_atexit_run_when_the_agent_stops_a_worker(runs: dict[tuple[str, str], Run]) -> None:
    for run in _pair(runs, "fail"):
        assert run.marker("sigterm", 0) == "handled", _context(run)
        for rank in range(NPROC["fail"]):
            assert run.marker("atexit", rank) == "ran", f"{run.launcher}: rank {rank}'s atexit handler did not run"


def test_the_readme_names_every_variable_spotrun_adds_for_the_workers() -> None:
    docs = [Path(__file__).parents[2] / "README.md", *sorted((Path(__file__).parents[2] / "docs").rglob("*.md"))]
    text = " ".join(" ".join(p.read_text().split()) for p in docs if p.is_file())
    added = sorted(v for v in VOLATILE_ENV if v.startswith("SPOTRUN_"))
    match = re.search(r"(\w+) added variables?,?(.{0,400})", text)
    assert match is not None, "the README no longer says which variables spotrun adds"
    assert all(name in match.group(2) for name in added), (added, match.group(0))
    assert match.group(1) == {1: "one", 2: "two", 3: "three"}.get(len(added)), match.group(0)
