"""The one-node commands of the quickstart page and the README are run here, as written (the checkpoint
directory moved into a temporary one): the demo (``bash examples/run.sh``) twice, resuming, and the
quickstart's two ``spotrun --standalone`` commands, resuming at another world size. The multi-node and
deployment commands are covered by tests/deploy and tests/elastic (real etcd members, TLS, agents)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.harness.procs import REPO, SPOTRUN, make_env, read_jsonl, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _commands(path: Path, prefix: str, script: str = "examples/quickstart.py") -> list[list[str]]:
    """The lines of ``path``'s bash blocks that start with ``prefix`` and run ``script`` (continuation lines
    joined)."""
    text = path.read_text()
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(prefix) and script in line:
                out.append(shlex.split(line, comments=True))
    return out


def _run(argv: list[str], tmp: Path) -> str:
    argv = [str(tmp / "quickstart") if a == "runs/quickstart" else a for a in argv]
    assert argv[0] == "spotrun"
    result = run_cli([*SPOTRUN, *argv[1:]], timeout=240, env=make_env(LOGLEVEL="WARNING"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def _steps(stdout: str) -> list[tuple[int, int]]:
    """(step, world size) of rank 0's progress lines."""
    return [(int(s), int(w)) for s, w in re.findall(r"^step=(\d+) loss=\S+ world_size=(\d+)$", stdout, re.M)]


def test_quickstart_commands_train_and_resume_at_another_world_size(tmp_path: Path) -> None:
    first, second = _commands(REPO / "docs" / "quickstart.md", "spotrun --standalone")
    steps = _steps(_run(first, tmp_path))
    assert steps[0] == (1, 2) and steps[-1] == (40, 2), steps
    assert (tmp_path / "quickstart" / "step-000000040" / ".commit").is_file()
    # the page says: the second run resumes after step 40 (the last commit) at world size 1
    assert "`step=41 ... world_size=1`" in (REPO / "docs" / "quickstart.md").read_text()
    steps = _steps(_run(second, tmp_path))
    assert steps[0] == (41, 1) and steps[-1] == (60, 1), steps


def test_readme_commands_are_the_quickstart_commands() -> None:
    """The README's one-node command is the quickstart's first, run above (which adds only ``--steps``)."""
    (readme,) = _commands(REPO / "README.md", "spotrun --standalone")
    first, _ = _commands(REPO / "docs" / "quickstart.md", "spotrun --standalone")
    assert [*readme, "--steps", "45"] == first


def test_the_demo_command_trains_then_resumes(tmp_path: Path) -> None:
    """``bash examples/run.sh`` (the README's first command): STEPS and CKPT_DIR as the README says."""
    def demo(steps: int) -> list[dict[str, object]]:
        progress = tmp_path / f"progress-{steps}.jsonl"
        env = make_env(LOGLEVEL="WARNING", STEPS=str(steps), CKPT_DIR=str(tmp_path / "ckpt"))
        result = subprocess.run(["bash", "examples/run.sh", "--progress-file", str(progress)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert f"step={steps} " in result.stdout
        return read_jsonl(progress)

    first = demo(4)
    assert min(r["step"] for r in first) == 1  # type: ignore[type-var]
    second = demo(6)
    assert min(r["step"] for r in second) == 5, "the second run did not resume from the committed step 4"  # type: ignore[type-var]
