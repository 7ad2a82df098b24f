"""Exactness across world sizes: examples/train_ddp.py resumed at other world sizes against an uninterrupted run.

Each segment is a real run that stops at a given step (``--steps``, which saves that step) and the next one
resumes from the committed checkpoint at another world size, with the global batch fixed at 64 (3 workers
split it 22/21/21). Normal mode, 2 -> 1 -> 3 workers: every tensor of the final checkpoint and every step's
global loss within 1e-5 relative (to the tensor's largest magnitude) of an uninterrupted 2-worker run.
``--deterministic``, 1 -> 3 -> 2 workers: bit-identical to an uninterrupted run (here a single process, the
strongest contrast: no process group at all). The first segment has the reference's world size, so the
reference's periodic checkpoint at that segment's last step stands for it (the same run from the same seed).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.procs import EXAMPLES, SPOTRUN, make_env, read_jsonl, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN = str(EXAMPLES / "train_ddp.py")
SEGMENTS = [(2, 8), (1, 16), (3, 24)]  # (workers, stop after step): the 2 -> 1 -> 3 sequence
DETERMINISTIC_SEGMENTS = [(1, 8), (3, 16), (2, 24)]
"""Deterministic mode's 1 -> 3 -> 2: its reference is a single process, which stands for the first segment
(see ``first_from``); world sizes 1, 2 and 3, one scale-up and one scale-down, an uneven split (22/21/21) both
resumed from and saved from."""
STEPS = SEGMENTS[-1][1]
COMMON = ["--global-batch", "64", "--ckpt-every", "1000", "--log-every", "1000", "--dataset-size", "1000"]


def _train(workers: int, steps: int, ckpt: Path, progress: Path, *extra: str) -> None:
    """One run to ``steps``; a single worker runs as a plain process (the example's no-launcher mode)."""
    args = [TRAIN, "--steps", str(steps), "--ckpt-dir", str(ckpt), "--progress-file", str(progress), *COMMON, *extra]
    if workers == 1:
        argv = [sys.executable, *args]
    else:
        argv = [*SPOTRUN, "--standalone", "--nproc-per-node", str(workers), "--max-restarts", "0", *args]
    result = run_cli(argv, timeout=240, env=make_env(LOGLEVEL="WARNING"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def _final_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint (weights and optimizer momentum), loaded in this process."""
    spec = importlib.util.spec_from_file_location("train_ddp_example", TRAIN)
    assert spec is not None and spec.loader is not None
    example = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = example  # its dataclasses look their module up while being defined
        spec.loader.exec_module(example)
    from checkpoint import Checkpointer

    model = example.make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # Momentum buffers exist only after a step; make them so the load has a destination for each.
    model(torch.zeros(1, example.FEATURES)).sum().backward()
    optim.step()
    ckpt_ = Checkpointer(str(ckpt))
    try:
        assert ckpt_.load({"model": model, "optim": optim}) == STEPS
    finally:
        ckpt_.close()
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out[f"momentum.{name}"] = optim.state[p]["momentum_buffer"].clone()
    return out


def _losses(progress: Path) -> dict[int, float]:
    """step -> global loss (rank 0's line; the last run of a step wins, there is one per step here)."""
    return {r["step"]: r["loss"] for r in read_jsonl(progress) if r["rank"] == 0}


def _elastic_run(tmp: Path, segments: list[tuple[int, int]], *extra: str, first_from: Path | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[int, float], list[Any]]:
    """One run per segment. ``first_from``: the directory of an uninterrupted run at the first segment's
    world size that committed the first segment's last step; its checkpoint and progress lines up to that
    step stand for the first segment (the same run from the same seed: training it again only costs time)."""
    ckpt, progress = tmp / "elastic-ckpt", tmp / "elastic.jsonl"
    if first_from is not None:
        _reuse_first_segment(first_from, segments[0][1], ckpt, progress)
        segments = segments[1:]
    for workers, steps in segments:
        _train(workers, steps, ckpt, progress, *extra)
    worlds = sorted({(r["step"], r["world_size"]) for r in read_jsonl(progress) if r["rank"] == 0})
    return _final_state(ckpt), _losses(progress), worlds


def _reuse_first_segment(ref: Path, stop: int, ckpt: Path, progress: Path) -> None:
    """Start ``ckpt`` with the reference's committed step ``stop`` only, and ``progress`` with its lines up to
    that step: what a run stopped at that step would have left (a periodic save is the same commit)."""
    from checkpoint.api import COMMIT_FILE, step_dir

    src = ref / "ref-ckpt" / step_dir(stop)
    assert (src / COMMIT_FILE).exists(), f"the reference did not commit step {stop}"
    ckpt.mkdir()
    shutil.copytree(src, ckpt / step_dir(stop))
    lines = [line for line in (ref / "ref.jsonl").read_text().splitlines() if json.loads(line)["step"] <= stop]
    progress.write_text("".join(f"{line}\n" for line in lines))


def _expected_worlds(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, first = [], 1
    for workers, last in segments:
        out += [(s, workers) for s in range(first, last + 1)]
        first = last + 1
    return out


def test_two_one_three_workers_within_1e5_of_uninterrupted(tmp_path: Path) -> None:
    # The reference has the first segment's world size: it also commits that segment's last step, which
    # the elastic run starts from instead of training it again.
    _train(SEGMENTS[0][0], STEPS, tmp_path / "ref-ckpt", tmp_path / "ref.jsonl", "--ckpt-every", str(SEGMENTS[0][1]))
    ref_state, ref_losses = _final_state(tmp_path / "ref-ckpt"), _losses(tmp_path / "ref.jsonl")
    state, losses, worlds = _elastic_run(tmp_path, SEGMENTS, first_from=tmp_path)
    assert worlds == _expected_worlds(SEGMENTS)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, STEPS + 1))
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    assert sorted(state) == sorted(ref_state)
    # Relative to each tensor's magnitude: an element that is a near-cancelled sum (a momentum entry close
    # to 0) keeps the absolute rounding difference of its terms, so its own relative error says nothing.
    rel = {n: ((state[n] - r).abs().max() / r.abs().max()).item() for n, r in ref_state.items()}
    print("max |elastic - uninterrupted| / max |uninterrupted| per tensor:", rel)
    assert max(rel.values()) <= 1e-5, rel
    assert max(rel.values()) > 0  # the grouping of the sums differs, so some bits must: the test can fail


def test_deterministic_mode_is_bit_identical_across_world_sizes(tmp_path: Path) -> None:
    segments = DETERMINISTIC_SEGMENTS
    _train(segments[0][0], STEPS, tmp_path / "ref-ckpt", tmp_path / "ref.jsonl", "--deterministic",
           "--ckpt-every", str(segments[0][1]))
    ref_state, ref_losses = _final_state(tmp_path / "ref-ckpt"), _losses(tmp_path / "ref.jsonl")
    state, losses, worlds = _elastic_run(tmp_path, segments, "--deterministic", first_from=tmp_path)
    assert worlds == _expected_worlds(segments)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == ref_losses  # float equality of every step's loss
    assert sorted(state) == sorted(ref_state)
    for name, ref in ref_state.items():
        assert torch.equal(state[name], ref), f"{name} differs: max {(state[name] - ref).abs().max().item()}"
