"""A storage error that belongs to one step (EACCES on its directory or on one of its files) makes discovery
skip that step with a warning naming it and the error, and go on to the next older committed step.

The errors come from the ``chaos::`` wrapper (``errno: EACCES``, ``path``: one step), raised by the real
local backend's operations: tests may run as root, where ``chmod 000`` denies nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from checkpoint.api import CheckpointStorageError
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import latest_good_step, list_steps
from checkpoint.storage import Storage
from elastic.chaos.storage import register, write_control

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """A root with committed steps 1 and 2, behind chaos::; returns (uri, control file)."""
    register()
    control = str(tmp_path / "control.json")
    monkeypatch.setenv("SPOTRUN_CHAOS_STORAGE", control)
    uri = f"chaos::file://{tmp_path}/ck"
    with Checkpointer(uri, CheckpointConfig()) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((8,), float(step))})
            ckpt.wait()
    return uri, control


def _deny(control: str, path: str, ops: str = "all") -> None:
    write_control(control, 0, [{"kind": "storage_error", "params": {"errno": "EACCES", "path": path, "ops": ops},
                                "until_wall": None}])


@pytest.mark.parametrize("denied", ["step-000000002", "step-000000002/manifest.json"],
                         ids=["step-directory", "manifest"])
def test_a_step_denied_is_skipped_and_the_older_one_loads(root: tuple[str, str], denied: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    uri, control = root
    _deny(control, denied)
    caplog.set_level(logging.WARNING, logger="checkpoint.discover")
    assert latest_good_step(Storage(uri)) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 2" in w and "Permission denied" in w for w in warnings), warnings
    with Checkpointer(uri, CheckpointConfig()) as ckpt:
        out = {"w": torch.zeros(8)}
        assert ckpt.load(out) == 1
    assert torch.equal(out["w"], torch.full((8,), 1.0))


def test_a_denied_step_directory_is_listed_as_unreadable_and_never_deleted(root: tuple[str, str]) -> None:
    uri, control = root
    _deny(control, "step-000000001")
    listing = list_steps(Storage(uri))
    assert listing.committed == [2] and 1 in listing.unreadable and "Permission denied" in listing.unreadable[1]
    with Checkpointer(uri, CheckpointConfig(keep_last=1)) as ckpt:  # retention never touches what it cannot read
        ckpt.save(3, {"w": torch.full((8,), 3.0)})
        ckpt.wait()
    write_control(control, 0, [])
    assert list_steps(Storage(uri)).committed == [1, 3]


def test_when_no_step_can_be_read_discovery_raises_instead_of_starting_fresh(root: tuple[str, str]) -> None:
    uri, control = root
    _deny(control, "step-00000000")  # both steps
    with pytest.raises(CheckpointStorageError, match=r"no readable committed checkpoint.*step 1: .*Permission denied"):
        latest_good_step(Storage(uri))


def test_a_storage_outage_is_raised_not_skipped(root: tuple[str, str]) -> None:
    """EIO on every read, still failing after the retries, is the storage being down: raised, so a
    restarting job does not load an older step (or start over) during an outage."""
    from datetime import timedelta

    from checkpoint.storage import RetryPolicy

    uri, control = root
    write_control(control, 0, [{"kind": "storage_error", "params": {"path": "step-000000002", "ops": "read"},
                                "until_wall": None}])
    now = [0.0]
    storage = Storage(uri, retry=RetryPolicy(timeout=timedelta(seconds=30), sleep=lambda s: now.__setitem__(0, now[0] + s),
                                             clock=lambda: now[0]))
    with pytest.raises(CheckpointStorageError, match="Input/output error"):
        latest_good_step(storage)
    assert now[0] == pytest.approx(30.0)  # retried for the whole retry_timeout first
