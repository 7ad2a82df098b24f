"""A small checkpoint's load does each piece of work once: the step validated once, every stateful entry's
``state_dict()`` asked once, each shard file read once on the calling thread (below ``SMALL_LOAD_BYTES``).

Storage reads are counted by a real fsspec memory filesystem that counts its calls (no mock of the storage
layer); the corruption and bad-input suites check that no check was lost on the way.
"""

from __future__ import annotations

import collections
import threading
import uuid
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

import checkpoint.shard as shard_mod
from checkpoint.api import COMMIT_FILE, MANIFEST_FILE, ReadRequest, step_dir
from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.storage import Storage

pytestmark = pytest.mark.timeout(60)


class CountingMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under ``countmem://``, counting whole-file and ranged reads per path."""

    protocol = "countmem"
    store: dict[str, Any] = {}  # its own store and directories, not memory://'s
    pseudo_dirs = [""]
    reads: collections.Counter[str] = collections.Counter()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return super()._strip_protocol(path.removeprefix("countmem://") if isinstance(path, str) else path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self.reads[self._strip_protocol(path)] += 1
        return super().cat_file(path, start=start, end=end, **kwargs)


fsspec.register_implementation("countmem", CountingMemoryFileSystem, clobber=True)


class Counter:
    """A stateful entry that counts its ``state_dict()`` calls."""

    def __init__(self, value: int) -> None:
        self.value, self.asked = value, 0

    def state_dict(self) -> dict[str, Any]:
        self.asked += 1
        return {"value": self.value, "weights": torch.full((3,), float(self.value))}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["value"]
        assert torch.equal(sd["weights"], torch.full((3,), float(self.value)))


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "counter": Counter(seed)}


def reads_of(root: str, step: int, name: str) -> int:
    return CountingMemoryFileSystem.reads[f"/{root}/{step_dir(step)}/{name}"]


@pytest.fixture
def root() -> Any:
    name = f"small-{uuid.uuid4().hex[:8]}"
    yield name
    CountingMemoryFileSystem().rm(f"/{name}", recursive=True)


def save_steps(root: str, steps: list[int]) -> dict[int, dict[str, Any]]:
    saved = {}
    with Checkpointer(f"countmem://{root}", CheckpointConfig(keep_last=10)) as ckpt:
        for step in steps:
            saved[step] = make_state(step)
            ckpt.save(step, saved[step])
    CountingMemoryFileSystem.reads.clear()
    return saved


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for (ka, va), (kb, vb) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    for sa, sb in zip(a["optim"].state_dict()["state"].values(), b["optim"].state_dict()["state"].values()):
        assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)
    assert a["counter"].value == b["counter"].value


def test_latest_step_is_validated_once(root: str) -> None:
    saved = save_steps(root, [1, 2])
    live = make_state(99)
    with Checkpointer(f"countmem://{root}") as ckpt:
        assert ckpt.load(live) == 2
    assert reads_of(root, 2, COMMIT_FILE) == 1  # rank 0 validated it while choosing; the load reused that
    assert reads_of(root, 2, MANIFEST_FILE) == 1
    assert reads_of(root, 1, COMMIT_FILE) == 0
    assert_same(live, saved[2])
    assert live["counter"].asked == 1  # flatten's state_dict() is the live value apply rebuilds into


def test_named_step_and_a_second_load_validate_again(root: str) -> None:
    save_steps(root, [1, 2])
    with Checkpointer(f"countmem://{root}") as ckpt:
        assert ckpt.load(make_state(99), step=1) == 1
        assert ckpt.load(make_state(98)) == 2
        assert ckpt.load(make_state(97)) == 2  # the handed-over manifest is taken once: validated anew
    assert reads_of(root, 1, MANIFEST_FILE) == 1
    assert reads_of(root, 2, MANIFEST_FILE) == 2


def test_fallback_validates_the_older_step_once(root: str) -> None:
    saved = save_steps(root, [1, 2])
    fs = CountingMemoryFileSystem()
    shard = next(p for p in fs.find(f"/{root}/{step_dir(2)}") if p.endswith(".safetensors"))
    data = bytearray(fs.cat_file(shard))
    data[-1] ^= 0xFF  # same size: only the checksum finds it, while reading
    fs.pipe_file(shard, bytes(data))
    CountingMemoryFileSystem.reads.clear()
    live = make_state(99)
    with Checkpointer(f"countmem://{root}") as ckpt:
        assert ckpt.load(live) == 1
    assert reads_of(root, 2, MANIFEST_FILE) == 1
    assert reads_of(root, 1, MANIFEST_FILE) == 1  # chosen below step 2 by rank 0, then loaded
    assert reads_of(root, 1, COMMIT_FILE) == 1
    assert_same(live, saved[1])


def test_small_load_reads_each_file_once(root: str) -> None:
    save_steps(root, [1])
    with Checkpointer(f"countmem://{root}", CheckpointConfig(read_threads=4)) as ckpt:
        ckpt.load(make_state(99))
    shards = {p: n for p, n in CountingMemoryFileSystem.reads.items() if p.endswith(".safetensors")}
    assert shards and set(shards.values()) == {1}, shards


def request(file: str, start: int, end: int) -> ReadRequest:
    return ReadRequest(
        file=file, fqn="t", dtype="F32", chunk_byte_range=(start, end), chunk_lengths=((end - start) // 4,),
        block_crc32=(0,), read_range=(start, end), src_slices=(), dst=None, dst_slices=(),  # type: ignore[arg-type]
    )


def test_small_load_spans_decision() -> None:
    reqs = [request("a", 100, 200), request("a", 300, 340), request("b", 8, 16)]
    assert shard_mod.small_load_spans(reqs, 1 << 20, False) == {"a": (100, 340), "b": (8, 16)}
    assert shard_mod.small_load_spans(reqs, 1 << 20, False, limit=248) is None  # spans total 248 bytes
    assert shard_mod.small_load_spans(reqs, 1 << 20, False, limit=249) is not None
    assert shard_mod.small_load_spans(reqs[:1], 1 << 20, False) is None  # one read: nothing to gather


@pytest.mark.parametrize("verify", [True, False])
def test_small_load_stays_on_the_calling_thread_with_the_same_result(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """Below the threshold no read runs in the pool; forced above it the pool reads the same bytes."""
    saved = make_state(3)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(3, saved)
    threads: list[str] = []
    real_apply_read = shard_mod.apply_read

    def recording_apply_read(*args: Any, **kwargs: Any) -> int:
        threads.append(threading.current_thread().name)
        return real_apply_read(*args, **kwargs)

    monkeypatch.setattr(shard_mod, "apply_read", recording_apply_read)
    config = CheckpointConfig(read_threads=4, verify_on_load=verify)
    small = make_state(99)
    with Checkpointer(str(tmp_path), config) as ckpt:
        ckpt.load(small)
    assert threads and set(threads) == {threading.current_thread().name}
    threads.clear()
    monkeypatch.setattr(shard_mod, "SMALL_LOAD_BYTES", 0)
    pooled = make_state(98)
    with Checkpointer(str(tmp_path), config) as ckpt:
        ckpt.load(pooled)
    assert threads and all(name.startswith("ckpt-read") for name in threads)
    assert_same(small, saved)
    assert_same(pooled, saved)


def test_remote_small_load_fetches_the_files_spans_in_parallel() -> None:
    """On remote storage the spans are read up front in the pool (one round trip per file, not one after
    another); each fetch is then served from them, the same bytes as the files'."""
    import uuid

    storage = Storage(f"memory://spans-{uuid.uuid4().hex}")
    files = {f"shard-{i}.safetensors": bytes(range(i, i + 64)) for i in range(3)}
    for name, data in files.items():
        storage.write_bytes(f"step/{name}", data)
    assert not storage.is_local
    reader = shard_mod.SpanReader(storage, "step", {name: (8, 40) for name in files})
    threads: list[str] = []
    real = reader.read_span

    def recording(file: str) -> memoryview:
        threads.append(threading.current_thread().name)
        return real(file)

    reader.read_span = recording  # type: ignore[method-assign]  # records where each span is read
    reader.prefetch(4)
    assert len(threads) == 3 and all(name.startswith("ckpt-read") for name in threads)
    for name, data in files.items():
        assert bytes(reader.fetch(name, 10, 20)) == data[10:20]
    assert len(threads) == 3, "fetch serves from the prefetched spans"
