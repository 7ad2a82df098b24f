"""The memory tier as a Checkpointer option (``CheckpointConfig(memory=...)``, ``checkpoint.memory.attach``), in one
process: ``snapshot`` feeds the tier (the preemption line calls it), ``load`` restores from memory before the
durable tier, and a failed collective leaving the ``with`` block snapshots the last completed step just in time
only when no optimizer stepped since that step was passed in.

The same under the spotrun agent with two workers and a worker SIGKILL: tests/elastic/test_memtier_restore.py.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from checkpoint import CheckpointConfig, CheckpointConfigError, Checkpointer, MemoryTierConfig
from checkpoint.memory.api import ENV_MEMORY_DIR, RestoreSource
from checkpoint.memory.layout import parse_snapshot_name
from elastic.preemption import Preemption
from tests.checkpoint.test_memtier import SHM, _assert_equal, _snapshots, _state, _tensors, _train
from tests.checkpoint.test_memtier_jit_units import GLOO_ERROR


@pytest.fixture
def keeper_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A keeper directory as the agent gives its workers (``SPOTRUN_MEMORY_DIR``)."""
    path = tempfile.mkdtemp(prefix="spotrun-memtier-test-", dir=SHM)
    monkeypatch.setenv(ENV_MEMORY_DIR, path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _steps(path: str) -> list[int]:
    return sorted(parse_snapshot_name(n)[0].step for n in _snapshots(path))  # type: ignore[index]


def _config(every: int | str = 1) -> CheckpointConfig:
    return CheckpointConfig(async_mode=False, memory=MemoryTierConfig(every=every, jit_peer_wait=0.2))  # type: ignore[arg-type]


def _reference(steps: int) -> dict[str, Any]:
    ref = _state(0)
    for step in range(1, steps + 1):
        _train(ref, step)
    return ref


def test_config_takes_only_a_memory_tier_config() -> None:
    with pytest.raises(CheckpointConfigError, match=r"memory=.*MemoryTierConfig"):
        CheckpointConfig(memory={"every": 1})  # type: ignore[arg-type]
    assert CheckpointConfig().memory is None


def test_load_restores_the_newest_snapshot_before_the_durable_step(keeper_dir: str, tmp_path: Path) -> None:
    state = _state(0)
    with Checkpointer(str(tmp_path / "ckpt"), _config()) as ckpt:
        assert ckpt.load(state) is None and ckpt.last_restore is None  # nothing anywhere yet
        for step in range(1, 8):
            _train(state, step)
            if step == 5:
                ckpt.save(step, state)
            assert ckpt.snapshot(step, state)
    assert _steps(keeper_dir)[-1] == 7
    fresh = _state(1)
    with Checkpointer(str(tmp_path / "ckpt"), _config()) as ckpt:
        assert ckpt.load(fresh) == 7  # memory (step 7) is newer than the durable step 5
        report = ckpt.last_restore
        assert report is not None and report.source is RestoreSource.MEMORY_LOCAL and report.step == 7
        assert ckpt.load_durable(_state(2)) == 5  # the durable tier alone, when asked
        assert ckpt.latest() == 5  # a memory snapshot is never reported as a committed step
    _assert_equal(_tensors(fresh), _tensors(_reference(7)))


def test_without_the_option_snapshot_is_a_no_op_and_load_is_durable(keeper_dir: str, tmp_path: Path) -> None:
    state = _state(0)
    with Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(async_mode=False)) as ckpt:
        _train(state, 1)
        ckpt.save(1, state)
        assert ckpt.snapshot(1, state) is False
        assert ckpt.load(_state(1)) == 1 and ckpt.last_restore is None
    assert _steps(keeper_dir) == []


def test_the_preemption_line_snapshots_every_step(keeper_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    monkeypatch.delenv("SPOTRUN_NOTICE_DIR", raising=False)
    state = _state(0)
    with Checkpointer(str(tmp_path / "ckpt"), _config(every=3)) as ckpt:
        preemption = Preemption(sync_every=4, mailbox_dir=None)
        for step in range(1, 8):
            _train(state, step)
            assert preemption.save_and_stop(ckpt, step, state) is False
    assert _steps(keeper_dir) == [3, 6]


def test_a_failed_collective_leaving_the_block_snapshots_the_last_completed_step(keeper_dir: str, tmp_path: Path
                                                                                ) -> None:
    state = _state(0)
    with pytest.raises(RuntimeError, match="Connection closed by peer"), \
            Checkpointer(str(tmp_path / "ckpt"), _config(every=4)) as ckpt:
        for step in range(1, 8):
            _train(state, step)
            ckpt.snapshot(step, state)
        raise GLOO_ERROR  # step 8's all-reduce: the state is still that of step 7
    assert _steps(keeper_dir) == [4, 7]
    fresh = _state(1)
    with Checkpointer(str(tmp_path / "ckpt"), _config(every=4)) as ckpt:
        assert ckpt.load(fresh) == 7
    _assert_equal(_tensors(fresh), _tensors(_reference(7)))


def test_no_just_in_time_snapshot_once_an_optimizer_stepped_past_the_step(
        keeper_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = _state(0)
    caplog.set_level(logging.WARNING, logger="checkpoint.memory.attach")
    with pytest.raises(RuntimeError), Checkpointer(str(tmp_path / "ckpt"), _config(every=4)) as ckpt:
        for step in range(1, 8):
            _train(state, step)
            ckpt.snapshot(step, state)
        _train(state, 8)  # optimizer.step() of step 8, then its logging all-reduce fails
        raise GLOO_ERROR
    assert _steps(keeper_dir) == [4]  # step 7's number on step 8's weights would be a silent wrong value
    assert "an optimizer stepped after step 7" in caplog.text


def test_other_errors_leave_no_just_in_time_snapshot(keeper_dir: str, tmp_path: Path) -> None:
    state = _state(0)
    with pytest.raises(ValueError), Checkpointer(str(tmp_path / "ckpt"), _config(every=4)) as ckpt:
        for step in range(1, 6):
            _train(state, step)
            ckpt.snapshot(step, state)
        raise ValueError("loss is nan")  # not a broken collective: the state may be half-updated
    assert _steps(keeper_dir) == [4]


def _adam_run(steps: int, ckpt: Checkpointer | None) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    state = {"model": model, "optim": optim}
    if ckpt is not None:
        assert ckpt.load(state) is None  # nothing in memory nor on disk: a fresh start
        assert not optim.state  # planning the memory restore initialised it; a fresh start puts it back
    for step in range(1, steps + 1):
        model(torch.full((3, 4), float(step))).square().sum().backward()
        optim.step()
        optim.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_fresh_start_with_the_tier_trains_exactly_as_without(keeper_dir: str, tmp_path: Path) -> None:
    """Adam counts its steps: the zero-lr step that initialises an empty optimizer to plan a restore must not
    survive a restore that finds nothing, or step 2 onwards differs from a run without the tier."""
    with Checkpointer(str(tmp_path / "ckpt"), _config()) as ckpt:
        with_tier = _adam_run(3, ckpt)
    _assert_equal(with_tier, _adam_run(3, None))
