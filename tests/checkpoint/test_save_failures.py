"""A storage blip must not cost a restart: background saves retry transient errors until ``retry_timeout``
(on an injected clock here), a save that still fails is reported while training goes on, never commits and
never deletes the last committed step, and only ``max_consecutive_failed_saves`` failures in a row raise."""

from __future__ import annotations

import errno
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint.api import CheckpointConfigError, CheckpointStorageError, SaveFailure
from checkpoint.checkpointer import Checkpointer, tolerate_failed_save
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    """Monotonic time that only the injected sleep moves (shared by the writer threads: locked)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps += 1
            self.now += seconds


class FlakyWrites:
    """The backend's sinks fail their commit with EIO (transient) while ``failing()`` says so."""

    def __init__(self, ckpt: Checkpointer, failing: Any) -> None:
        self.failing = failing
        self.failures = 0
        backend = ckpt.storage.backend
        real = backend.open_sink

        def open_sink(rel: str) -> Any:
            sink = real(rel)
            commit = sink.commit

            def flaky_commit() -> None:
                if self.failing():
                    self.failures += 1
                    raise OSError(errno.EIO, "Input/output error (test)", rel)
                commit()

            sink.commit = flaky_commit  # type: ignore[method-assign]
            return sink

        backend.open_sink = open_sink  # type: ignore[method-assign]


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((32, 32), value)}


def test_a_blip_shorter_than_retry_timeout_costs_nothing(tmp_path: Path) -> None:
    """Writes fail for 20 s of (fake) time: more than 5 attempts, far beyond the old 0.26 s of retries; the
    save retries until the blip ends and commits, nothing is raised or reported."""
    clock = FakeClock()
    reported: list[SaveFailure] = []
    with Checkpointer(str(tmp_path / "ck"), CheckpointConfig(), sleep=clock.sleep, clock=clock,
                      on_save_failure=reported.append) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.wait()
        blip_ends = clock() + 20.0
        flaky = FlakyWrites(ckpt, lambda: clock() < blip_ends)
        ckpt.save(2, _state(2.0))
        ckpt.save(3, _state(3.0))  # waits for step 2, which commits once the blip is over
        ckpt.wait()
        assert flaky.failures > 5
        assert clock() >= blip_ends
        assert reported == [] and ckpt.failed_saves_in_a_row == 0
        assert list_steps(ckpt.storage).committed[-2:] == [2, 3]
        out = _state(0.0)
        assert ckpt.load(out) == 3
    assert torch.equal(out["w"], _state(3.0)["w"])


def test_failed_saves_are_reported_until_the_bound_and_never_touch_the_last_commit(tmp_path: Path) -> None:
    clock = FakeClock()
    reported: list[SaveFailure] = []
    config = CheckpointConfig(retry_timeout=timedelta(seconds=5), max_consecutive_failed_saves=3, keep_last=1)
    with Checkpointer(str(tmp_path / "ck"), config, sleep=clock.sleep, clock=clock,
                      on_save_failure=reported.append) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.wait()
        down = {"on": True}
        FlakyWrites(ckpt, lambda: down["on"])
        ckpt.save(2, _state(2.0))
        ckpt.save(3, _state(3.0))  # step 2 failed: reported, training goes on
        ckpt.save(4, _state(4.0))  # step 3 failed: reported
        assert [(f.step, f.consecutive, f.limit, f.last_committed) for f in reported] == [(2, 1, 3, 1), (3, 2, 3, 1)]
        assert "Input/output error (test)" in reported[0].error and "CheckpointStorageError" in reported[0].error
        assert clock() >= 10.0  # each failed save retried for its whole retry_timeout first
        with pytest.raises(CheckpointStorageError, match="Input/output error"):
            ckpt.save(5, _state(5.0))  # step 4 was the third failure in a row: raised
        assert ckpt.failed_saves_in_a_row == 3
        listing = list_steps(ckpt.storage)
        assert listing.committed == [1]  # no failed save committed, none deleted the last commit
        assert ckpt.latest() == 1
        down["on"] = False  # the storage heals: saving works again and the count starts over
        ckpt.save(6, _state(6.0))
        ckpt.wait()
        assert ckpt.failed_saves_in_a_row == 0
        assert list_steps(ckpt.storage).committed == [6]
        assert list_steps(ckpt.storage).uncommitted == []  # the failed steps' debris went with the commit
        out = _state(0.0)
        assert ckpt.load(out) == 6
    assert torch.equal(out["w"], _state(6.0)["w"])


def test_wait_and_close_raise_the_failure_they_wait_for(tmp_path: Path) -> None:
    clock = FakeClock()
    ckpt = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(retry_timeout=timedelta(seconds=1)),
                        sleep=clock.sleep, clock=clock)
    FlakyWrites(ckpt, lambda: True)
    ckpt.save(1, _state(1.0))
    with pytest.raises(CheckpointStorageError):
        ckpt.wait()  # an explicit wait (a planned save) learns the outcome
    ckpt.save(2, _state(2.0))  # the failure of step 1 was raised already: not reported again
    with pytest.raises(CheckpointStorageError):
        ckpt.close()  # the final save failed: the job must not end as if it were saved


@pytest.mark.parametrize(("field", "value"), [("max_consecutive_failed_saves", 0),
                                              ("max_consecutive_failed_saves", True),
                                              ("max_retries", 0)])
def test_bounds_are_validated(field: str, value: object) -> None:
    with pytest.raises(CheckpointConfigError, match=field):
        CheckpointConfig(**{field: value})
    assert CheckpointConfig().max_retries is None  # retry until retry_timeout
    assert CheckpointConfig().max_consecutive_failed_saves == 3


def test_tolerate_failed_save_is_a_pure_rule() -> None:
    assert [tolerate_failed_save(n, 3, broken=False) for n in (1, 2, 3, 4)] == [True, True, False, False]
    assert not tolerate_failed_save(1, 1, broken=False)  # limit 1: the first failure is raised, as before
    assert not tolerate_failed_save(1, 3, broken=True)  # a broken collective always raises
