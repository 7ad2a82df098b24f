"""examples/train_gpt.py: DDP and FSDP2 under ``spotrun --standalone``, resumed from each other's checkpoints.

One run trains 3 steps with DDP on 2 workers and commits step 3; a second resumes it under FSDP2 (the
checkpoint is world-size and parallelism independent) to step 5. Every step's global-batch loss must match
an uninterrupted single-process run to 1e-4 relative (the reduction order differs, so not bit for bit).
The stock-DCP variant (``--ckpt-backend dcp``) resumes the same way in a single process, bit-identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.harness.procs import EXAMPLES, SPOTRUN, make_env, read_jsonl, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TRAIN = str(EXAMPLES / "train_gpt.py")
SMALL = ["--global-batch", "8", "--context", "32", "--corpus-chars", "8192", "--log-every", "1000", "--ckpt-every", "1000"]


def _run(argv: list[str]) -> None:
    result = run_cli(argv, timeout=240, env=make_env(LOGLEVEL="WARNING"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def _train(tmp: Path, name: str, steps: int, *extra: str, workers: int = 1) -> list[str]:
    args = [TRAIN, "--steps", str(steps), "--ckpt-dir", str(tmp / name), "--progress-file", str(tmp / f"{name}.jsonl"),
            *SMALL, *extra]
    if workers == 1:
        return [sys.executable, *args]
    return [*SPOTRUN, "--standalone", "--nproc-per-node", str(workers), "--max-restarts", "0", *args]


def _losses(path: Path) -> dict[int, float]:
    """step -> global-batch loss (rank 0's line; every rank prints the same all-reduced value)."""
    return {r["step"]: r["loss"] for r in read_jsonl(path) if r["rank"] == 0}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Losses of an uninterrupted single-process run of 5 steps."""
    out = tmp_path_factory.mktemp("reference")
    _run(_train(out, "ref", 5))
    return _losses(out / "ref.jsonl")


def test_ddp_then_fsdp2_resume_matches_an_uninterrupted_run(tmp_path: Path, reference: dict[int, float]) -> None:
    _run(_train(tmp_path, "elastic", 3, "--parallel", "ddp", workers=2))
    assert (tmp_path / "elastic" / "step-000000003").is_dir()
    _run(_train(tmp_path, "elastic", 5, "--parallel", "fsdp", workers=2))
    got, want = _losses(tmp_path / "elastic.jsonl"), reference
    assert sorted(got) == [1, 2, 3, 4, 5], got  # the FSDP2 run started at step 4: nothing repeated or skipped
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-4 * abs(loss), (step, got[step], loss)
    assert want[5] < want[1]  # it learns


def test_dcp_backend_resumes_bit_identical(tmp_path: Path, reference: dict[int, float]) -> None:
    """The stock anchor of bench/goodput_bench.py resumes exactly too (same process count, same losses)."""
    _run(_train(tmp_path, "dcp", 2, "--ckpt-backend", "dcp"))
    _run(_train(tmp_path, "dcp", 5, "--ckpt-backend", "dcp"))
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == ["step_00000002", "step_00000005"]
    assert _losses(tmp_path / "dcp.jsonl") == reference


def test_bad_model_shape_is_a_clear_error() -> None:
    result = run_cli([sys.executable, TRAIN, "--d-model", "30", "--heads", "4"], timeout=120)
    assert result.returncode == 2 and "--d-model 30 must be a multiple of --heads 4" in result.stderr, result.stderr
