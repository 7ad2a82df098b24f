"""Checkpointer contract suite, run against every backend (local disk, memory://, S3 via moto over HTTP)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import checkpoint.writer as writer_mod
from checkpoint.api import (
    COMMIT_FILE,
    INDEX_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    OBJECTS_FILE,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    SaveInProgressError,
    step_dir,
)
from checkpoint.checkpointer import Checkpointer
from checkpoint.discover import list_steps
from checkpoint.state import flatten

pytestmark = pytest.mark.timeout(60)


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "extra": {
            "bf16": torch.randn(5, 7).to(torch.bfloat16),
            "mask": torch.rand(9) > 0.5,
            "ids": torch.randint(-(2**40), 2**40, (3, 3), dtype=torch.int64),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
        },
        "epoch": seed,
        "sampler": {"position": seed * 10, "name": f"s{seed}"},
    }


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for pid, s in state["optim"].state_dict()["state"].items():
        for k, v in s.items():
            out[f"optim.{pid}.{k}"] = v
    out.update({f"extra.{k}": v for k, v in state["extra"].items()})
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype, k
        assert torch.equal(ta[k], tb[k]), k
    assert a["epoch"] == b["epoch"] and a["sampler"] == b["sampler"]


def test_round_trip_bit_exact(backend) -> None:
    src, dst = make_state(1), make_state(2)
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        assert ckpt.latest() is None
        assert ckpt.load(dst) is None  # nothing to load yet: a fresh start, not an error
        with pytest.raises(CheckpointNotFoundError):
            ckpt.read()
        ckpt.save(10, src)
        ckpt.wait()
        assert ckpt.latest() == 10
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        assert ckpt.load(dst) == 10
        step, plain = ckpt.read()  # no live state: the same read path into one built from the manifest
    assert_same(src, dst)
    assert step == 10 and plain["epoch"] == 1 and plain["sampler"] == src["sampler"]
    read_tensors = {item.key.fqn: item.tensor for item in flatten(plain).items}
    expected = {item.key.fqn: item.tensor for item in flatten(src).items}
    assert read_tensors.keys() == expected.keys() and len(expected) > 20
    for fqn, tensor in expected.items():
        assert read_tensors[fqn].dtype == tensor.dtype and torch.equal(read_tensors[fqn], tensor), fqn


def test_step_layout_and_safetensors_compatibility(backend) -> None:
    state = make_state(3)
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        ckpt.save(7, state)
        storage = ckpt.storage
        ckpt.wait()
        rel = step_dir(7)
        names = set(storage.listdir(rel))
        assert {MANIFEST_FILE, INDEX_FILE, OBJECTS_FILE, COMMIT_FILE, "shard-00000-of-00001.safetensors"} <= names
        assert storage.read_bytes(LATEST_FILE).decode().strip() == rel
        loaded = safetensors.torch.load(storage.read_bytes(f"{rel}/shard-00000-of-00001.safetensors"))
        index = json.loads(storage.read_bytes(f"{rel}/{INDEX_FILE}"))
        manifest = json.loads(storage.read_bytes(f"{rel}/{MANIFEST_FILE}"))
    assert torch.equal(loaded["model.0.weight"], state["model"][0].weight.detach())
    assert torch.equal(loaded["extra.bf16"], state["extra"]["bf16"])
    assert index["weight_map"]["model.2.bias"] == "shard-00000-of-00001.safetensors"
    assert manifest["world_size"] == 1 and manifest["step"] == 7 and manifest["version"] == 1
    chunk = manifest["tensors"]["model.0.weight"]["chunks"][0]
    assert chunk["byte_range"][1] - chunk["byte_range"][0] == 32 * 16 * 4


def gate_shard_writes(monkeypatch) -> threading.Event:
    """Hold every background shard write until the returned event is set."""
    release = threading.Event()
    real = writer_mod.write_rank_files

    def gated(*args: Any, **kwargs: Any):
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "write_rank_files", gated)
    return release


def test_save_returns_after_staging_and_snapshot_is_isolated(backend, monkeypatch) -> None:
    """Mutating the state after save() returns must not change what gets written."""
    release = gate_shard_writes(monkeypatch)
    state, expected = make_state(4), make_state(4)
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        ckpt.save(1, state)  # returns although the writer is blocked
        with torch.no_grad():
            for p in state["model"].parameters():
                p.add_(100.0)
        state["extra"]["ids"].zero_()
        release.set()
        ckpt.wait()
        fresh = make_state(9)
        assert ckpt.load(fresh) == 1
    assert_same(expected, fresh)


def test_staging_buffers_are_reused(backend) -> None:
    state = make_state(5)
    with Checkpointer(backend.uri, backend.config(keep_last=1)) as ckpt:
        for step in range(1, 5):
            state["extra"]["scalar"].fill_(step)
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.writer.stager.allocations == 1
        assert list_steps(ckpt.storage).committed == [4]


def test_retention_keeps_last_and_every(backend) -> None:
    state = make_state(6)
    with Checkpointer(backend.uri, backend.config(keep_last=2, keep_every=4)) as ckpt:
        for step in range(1, 10):
            ckpt.save(step, state)
        ckpt.wait()
        assert list_steps(ckpt.storage).committed == [4, 8, 9]
        assert ckpt.latest() == 9


def test_uncommitted_step_is_never_loaded(backend) -> None:
    good, newer = make_state(7), make_state(8)
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        ckpt.save(1, good)
        ckpt.save(2, newer)
        ckpt.wait()
        ckpt.storage.rm(f"{step_dir(2)}/{COMMIT_FILE}")  # as if the commit never happened
        assert ckpt.latest() == 1
        dst = make_state(0)
        assert ckpt.load(dst) == 1
        assert_same(good, dst)
        with pytest.raises(CheckpointNotFoundError, match="not committed"):
            ckpt.load(make_state(0), step=2)


def test_debris_older_than_newest_commit_is_cleaned(backend) -> None:
    state = make_state(9)
    with Checkpointer(backend.uri, backend.config(keep_last=5)) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        ckpt.storage.write_bytes(f"{step_dir(2)}/shard-00000-of-00001.safetensors", b"half written")
        ckpt.storage.write_bytes(f"{step_dir(50)}/shard-00000-of-00001.safetensors", b"newer, maybe in flight")
        ckpt.save(3, state)
        ckpt.wait()
        listing = list_steps(ckpt.storage)
    assert listing.committed == [1, 3]
    assert listing.uncommitted == [50]  # newer than the newest commit: not ours to judge


def test_committed_step_is_never_overwritten(backend) -> None:
    state = make_state(10)
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        ckpt.save(5, state)
        ckpt.wait()
        ckpt.save(5, make_state(11))
        with pytest.raises(CheckpointError, match="already committed"):
            ckpt.wait()
        dst = make_state(0)
        assert ckpt.load(dst) == 5
    assert_same(state, dst)


def test_background_error_surfaces_and_previous_checkpoint_survives(backend, monkeypatch) -> None:
    """With ``max_consecutive_failed_saves=1`` the first failure is raised by the next save (the tolerant
    default is tests/checkpoint/test_save_failures.py)."""
    state = make_state(12)
    with Checkpointer(backend.uri, backend.config(max_consecutive_failed_saves=1)) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()

        def broken(*args: Any, **kwargs: Any):
            raise CheckpointStorageError("cannot write x/shard-00000-of-00001.safetensors: boom", path="x")

        monkeypatch.setattr(writer_mod, "write_rank_files", broken)
        ckpt.save(2, state)
        with pytest.raises(CheckpointStorageError, match="shard-00000-of-00001"):
            ckpt.save(3, state)  # the failure of step 2 surfaces on the next save
        monkeypatch.undo()
        assert ckpt.latest() == 1
        ckpt.save(4, state)  # the error was reported once; saving works again
        ckpt.wait()
        assert ckpt.latest() == 4
        assert 2 not in list_steps(ckpt.storage).committed


def test_when_busy_refuse(backend, monkeypatch) -> None:
    release = gate_shard_writes(monkeypatch)
    state = make_state(13)
    with Checkpointer(backend.uri, backend.config(when_busy="refuse")) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(SaveInProgressError, match="step 1 is still writing"):
            ckpt.save(2, state)
        release.set()
        ckpt.wait()
        ckpt.save(3, state)
        ckpt.wait()
        assert list_steps(ckpt.storage).committed == [1, 3]


def test_save_seconds_estimate_is_the_slowest_recent_committed_save(backend, monkeypatch) -> None:
    """What a planned save is measured against (elastic.preemption): save() to commit, failures not counted."""
    from checkpoint.checkpointer import SAVE_TIMES_KEPT

    state = make_state(15)
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        assert ckpt.save_seconds_estimate is None and ckpt.recent_save_seconds == (), "no guess before a save"
        release = gate_shard_writes(monkeypatch)
        ckpt.save(1, state)
        threading.Timer(0.6, release.set).start()  # a slow write: the commit comes >= 0.6 s after save()
        ckpt.wait()
        monkeypatch.undo()
        slow = ckpt.save_seconds_estimate
        assert slow is not None and slow >= 0.6, "the write time counts, not only the staging copy"
        for step in range(2, 2 + SAVE_TIMES_KEPT - 1):
            ckpt.save(step, state)
            ckpt.wait()
        assert len(ckpt.recent_save_seconds) == SAVE_TIMES_KEPT and ckpt.save_seconds_estimate == slow
        ckpt.save(2, state)  # already committed: fails, and is not timed
        with pytest.raises(CheckpointError, match="already committed"):
            ckpt.wait()
        assert ckpt.save_seconds_estimate == slow
        release = gate_shard_writes(monkeypatch)
        ckpt.save(10, state)
        assert ckpt.save_seconds_estimate == 2 * slow, "a save in flight: the next one waits for it first"
        release.set()
        ckpt.wait()
        monkeypatch.undo()
        assert len(ckpt.recent_save_seconds) == SAVE_TIMES_KEPT, "only the last few"
        assert ckpt.save_seconds_estimate is not None and ckpt.save_seconds_estimate < slow, "the slow one aged out"


def test_sync_mode_commits_before_returning(backend) -> None:
    with Checkpointer(backend.uri, backend.config(async_mode=False)) as ckpt:
        ckpt.save(1, make_state(14))
        assert not ckpt.save_pending and ckpt.latest() == 1


def test_large_tensors_split_files_and_multipart(backend) -> None:
    """12 MiB tensors, 5 MiB parts and 8 MiB shard limit: several files, multipart uploads on S3."""
    big = {"a": torch.randn(3 << 20), "b": torch.randn(3 << 20), "c": torch.arange(1000)}
    cfg = backend.config(multipart_chunk_bytes=5 << 20, max_shard_bytes=8 << 20, checksum_block_bytes=1 << 20)
    with Checkpointer(backend.uri, cfg) as ckpt:
        ckpt.save(1, big)
        ckpt.wait()
        files = {n for n in ckpt.storage.listdir(step_dir(1)) if n.endswith(".safetensors")}
        assert len(files) == 3
        dst = {"a": torch.zeros(3 << 20), "b": torch.zeros(3 << 20), "c": torch.zeros(1000, dtype=torch.int64)}
        assert ckpt.load(dst) == 1
    for k in big:
        assert torch.equal(big[k], dst[k]), k
