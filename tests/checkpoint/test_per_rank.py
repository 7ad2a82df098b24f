"""Per-rank state (``PerRank``, ``RNGState``): every rank saves and gets back its own copy, checked against
the manifest; documented rules at another world size; damaged per-rank files are named and skipped by
``latest()``; the CLI shows and verifies them; checkpoints that saved RNG state as shared still load."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import PerRank, RNGState
from checkpoint.api import (
    MANIFEST_FILE,
    CheckpointConfigError,
    CheckpointError,
    ChunkRecord,
    CorruptCheckpointError,
    FileRecord,
    IncompatibleCheckpointError,
    Manifest,
    TensorRecord,
    rank_objects_file_name,
    step_dir,
)
from checkpoint.checkpointer import Checkpointer
from checkpoint.cli import main
from checkpoint.discover import validate_step
from checkpoint.per_rank import per_rank_source
from checkpoint.plan import validate_tiling
from checkpoint.storage import Storage
from tests.harness.dist import run_workers

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize(
    ("rank", "world", "saved", "rule", "expected"),
    [
        (1, 2, 2, "skip", 1),  # same world size: always its own copy
        (0, 3, 2, "rank_modulo", 0),
        (1, 3, 2, "rank_modulo", 1),
        (2, 3, 2, "rank_modulo", 0),
        (5, 8, 4, "rank_modulo", 1),
        (0, 1, 2, "rank_modulo", 0),
        (2, 3, 2, "rank0", 0),
        (1, 3, 2, "rank0", 0),
        (2, 3, 2, "skip", None),
    ],
)
def test_resize_rule(rank: int, world: int, saved: int, rule: str, expected: int | None) -> None:
    assert per_rank_source(rank, world, saved, rule) == expected


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),
        torch.zeros(0, 3),
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # non-contiguous
        torch.get_rng_state(),
    ],
)
def test_inline_tensor_round_trip(tensor: torch.Tensor) -> None:
    from checkpoint.state import INLINE_TENSOR_MARKER, decode_tensor, encode_tensor

    spec = json.loads(json.dumps(encode_tensor("x", tensor)))[INLINE_TENSOR_MARKER]
    back = decode_tensor("x", spec)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    spec["shape"] = [99]
    with pytest.raises(CorruptCheckpointError, match="inline tensor 'x' .* has .* bytes, its shape \\[99\\]"):
        decode_tensor("x", spec)


def test_per_rank_wrapper_rejects_bad_arguments() -> None:
    with pytest.raises(CheckpointConfigError, match=r"PerRank\(on_resize='modulo'\) must be one of rank_modulo, rank0, skip"):
        PerRank({}, on_resize="modulo")
    with pytest.raises(TypeError, match="models and optimizers go in the sharded state"):
        PerRank(torch.nn.Linear(2, 2))


def test_too_large_per_rank_state_is_refused(tmp_path: Path) -> None:
    big = torch.zeros(65 << 20, dtype=torch.uint8)
    with Checkpointer(str(tmp_path / "run")) as ckpt:
        with pytest.raises(ValueError, match="per-rank state is too large at 'buf'.*put large tensors in the sharded state"):
            ckpt.save(1, {"buf": PerRank(big)})
        with pytest.raises(ValueError, match="64 MiB limit of a per-rank file"):
            ckpt.save(1, {"log": PerRank(["x" * 1000] * 70_000)})
        assert ckpt.latest() is None


def test_tiling_check_of_a_1000_tensor_manifest_is_cheap() -> None:
    tensors = {}
    for i in range(1000):
        chunks = [
            ChunkRecord(offsets=[64 * r, 0], lengths=[64, 256], file="f", key=f"t{i}#{r}",
                        byte_range=[(4 * i + r) * 65536, (4 * i + r + 1) * 65536], block_crc32=[0])
            for r in range(4)
        ]
        tensors[f"t{i}"] = TensorRecord(shape=[256, 256], dtype="F32", chunks=chunks)
    files = {"f": FileRecord(size=4000 * 65536, crc32=0, rank=0)}  # chunks lie inside their file, sharing no byte
    manifest = Manifest(step=1, world_size=4, created_unix=0.0, library_version="t", tensors=tensors, files=files)
    started = time.perf_counter()
    validate_tiling(manifest)
    elapsed = time.perf_counter() - started
    print(f"validate_tiling, 1000 tensors x 4 chunks: {elapsed * 1e3:.1f} ms")
    assert elapsed < 1.0  # ~10-30 ms on a busy 2-core machine; generous against scheduler noise
    tensors["t7"].chunks[2].offsets = [96, 0]  # overlaps its neighbour: must still be caught
    with pytest.raises(CorruptCheckpointError, match="'t7' do not tile.*overlap"):
        validate_tiling(manifest)


# --------------------------------------------------------------------------- one process
def _state(counter: int) -> dict[str, Any]:
    return {
        "w": torch.arange(6.0),
        "rng": RNGState(),
        "counter": PerRank(counter),
        "loader": PerRank({"pos": counter * 10, "order": torch.arange(4) + counter}),
        "epoch": 3,
    }


def _draws() -> tuple[list[float], float]:
    return torch.rand(4).tolist(), random.random()


def test_single_process_round_trip_and_format(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    torch.manual_seed(1)
    random.seed(2)
    with Checkpointer(uri) as ckpt:
        ckpt.save(5, _state(7))
    expected = _draws()
    torch.manual_seed(99)
    random.seed(99)
    live = _state(0)
    loader = live["loader"].value
    with Checkpointer(uri) as ckpt:
        assert ckpt.load(live) == 5
    assert _draws() == expected
    assert live["counter"].value == 7 and loader["pos"] == 70 and torch.equal(loader["order"], torch.arange(4) + 7)
    assert live["loader"].value is loader  # containers are restored in place
    names = set(Storage(uri).listdir(step_dir(5)))
    assert {"objects.json", "objects-00000-of-00001.json"} <= names
    manifest = validate_step(Storage(uri), 5)
    (name, rec), = manifest.rank_objects.items()
    assert name == rank_objects_file_name(0, 1) and rec.rank == 0 and rec.keys == ["counter", "loader", "rng"]
    shared = json.loads(Path(uri, step_dir(5), "objects.json").read_text())
    assert set(shared) == {"w", "epoch"}  # per-rank entries live only in the per-rank file
    assert not any("rng" in fqn or "loader" in fqn for fqn in manifest.tensors)


def test_damaged_per_rank_file_is_named_and_latest_falls_back(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        ckpt.wait()
    path = Path(uri, step_dir(2), rank_objects_file_name(0, 1))
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    path.write_bytes(bytes(flipped))  # same size: only the crc32 tells
    with Checkpointer(uri) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"objects-00000-of-00001\.json fails its check") as info:
            ckpt.load(_state(0), step=2)
        assert info.value.file == "objects-00000-of-00001.json"
    assert main(["verify", uri, "--step", "2", "--no-progress"]) == 4
    path.write_bytes(good[:-5])  # truncated: the step is no longer loadable
    with Checkpointer(uri) as ckpt:
        assert ckpt.latest() == 1
        live = _state(0)
        assert ckpt.load(live) == 1 and live["counter"].value == 1
    path.unlink()
    with Checkpointer(uri) as ckpt:
        assert ckpt.latest() == 1
        with pytest.raises(CorruptCheckpointError, match="per-rank objects file .*objects-00000-of-00001.json is missing"):
            ckpt.load(_state(0), step=2)


def test_cli_inspect_verify_export(tmp_path: Path, capsys) -> None:
    uri = str(tmp_path / "run")
    with Checkpointer(uri) as ckpt:
        ckpt.save(3, _state(3))
    assert main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert "per-rank entries: counter, loader, rng (1 files" in out
    assert "rank 0: objects-00000-of-00001.json" in out and "keys counter, loader, rng" in out
    assert main(["verify", uri, "--no-progress"]) == 0
    assert "1 per-rank files" in capsys.readouterr().out
    assert main(["export", uri, str(tmp_path / "hf"), "--no-progress"]) == 0
    import safetensors.torch

    exported = safetensors.torch.load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert set(exported) == {"w"}  # model weights only: per-rank state is not exported


def test_missing_per_rank_entry_and_skip(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.ones(2), "counter": PerRank(4)})
        ckpt.wait()
        with (
            Checkpointer(uri) as again,
            pytest.raises(IncompatibleCheckpointError, match="no per-rank entry 'other'.*on_resize='skip'"),
        ):
            again.load({"w": torch.zeros(2), "counter": PerRank(0), "other": PerRank(1)})
        ckpt.save(2, {"w": torch.ones(2)})
        ckpt.wait()
        with pytest.raises(IncompatibleCheckpointError, match="step 2 holds no per-rank state of rank 0 .*saved without per-rank"):
            ckpt.load({"w": torch.zeros(2), "counter": PerRank(0)}, step=2)


class _SharedRNG:
    """What an ``RNGState`` was before per-rank state: a plain stateful entry, saved once (rank 0's copy)."""

    def state_dict(self) -> dict[str, Any]:
        return RNGState().state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        RNGState().load_state_dict(sd)


def test_rng_saved_as_shared_state_still_loads(tmp_path: Path, caplog) -> None:
    uri = str(tmp_path / "run")
    torch.manual_seed(5)
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.ones(2), "rng": _SharedRNG()})
    expected = torch.rand(3)
    torch.manual_seed(6)
    with caplog.at_level(logging.WARNING, logger="checkpoint"), Checkpointer(uri) as ckpt:
        assert ckpt.load({"w": torch.zeros(2), "rng": RNGState()}) == 1
    assert torch.equal(torch.rand(3), expected)
    assert "['rng'] saved as shared state (before per-rank entries)" in caplog.text


# --------------------------------------------------------------------------- several ranks (gloo)
def _rank_state(rank: int) -> dict[str, Any]:
    return {
        "w": torch.arange(8.0),
        "rng": RNGState(),
        "counter": PerRank({"n": 100 + rank}),
        "seen": PerRank(0, on_resize="rank0"),
        "cache": PerRank([-1], on_resize="skip"),
    }


def _scrambled() -> dict[str, Any]:
    torch.manual_seed(12345)
    random.seed(12345)
    return {
        "w": torch.zeros(8),
        "rng": RNGState(),
        "counter": PerRank({"n": -1}),
        "seen": PerRank(-1, on_resize="rank0"),
        "cache": PerRank([-1], on_resize="skip"),
    }


def _loaded(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "draws": _draws(),
        "counter": state["counter"].value["n"],
        "seen": state["seen"].value,
        "cache": state["cache"].value,
        "w": bool(torch.equal(state["w"], torch.arange(8.0))),
    }


def _save_then_load(rank: int, world: int, uri: str) -> dict[str, Any]:
    """Save with a per-rank RNG stream, draw, scramble, load: the same draws come back on this rank."""
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    state = _rank_state(rank)
    state["seen"].value = 10 + rank
    state["cache"].value = [rank]
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        after_save = _draws()
        live = _scrambled()
        assert ckpt.load(live) == 1
    return {"after_save": after_save, **_loaded(live)}


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _load_only(rank: int, world: int, uri: str) -> dict[str, Any]:
    handler = _Messages()
    log = logging.getLogger("checkpoint")
    log.addHandler(handler)
    try:
        live = _scrambled()
        with Checkpointer(uri) as ckpt:
            assert ckpt.load(live) == 1
    finally:
        log.removeHandler(handler)
    return {**_loaded(live), "warnings": handler.lines}


@pytest.mark.slow
def test_two_ranks_each_get_their_own_state_then_resize_to_three_and_one(tmp_path: Path, caplog) -> None:
    uri = str(tmp_path / "run")
    saved = run_workers(_save_then_load, 2, (uri,), tmpdir=str(tmp_path), timeout=50)
    for rank, r in enumerate(saved):
        assert r["draws"] == r["after_save"], f"rank {rank} did not get its own RNG state back"
        assert (r["counter"], r["seen"], r["cache"], r["w"]) == (100 + rank, 10 + rank, [rank], True), r
    assert saved[0]["draws"] != saved[1]["draws"]  # per-rank, not rank 0's copy everywhere

    resized = run_workers(_load_only, 3, (uri,), tmpdir=str(tmp_path), timeout=50)
    modulo = [0, 1, 0]
    for rank, r in enumerate(resized):
        src = modulo[rank]
        assert r["draws"] == saved[src]["after_save"], f"rank {rank} should get saved rank {src}'s RNG"
        assert r["counter"] == 100 + src and r["seen"] == 10 and r["cache"] == [-1] and r["w"], (rank, r)
    warning = " ".join(resized[0]["warnings"])
    assert "saved at world size 2, loading at 3" in warning and "rank r takes saved rank r % 2's copy" in warning
    assert "cache=skip" in warning and "seen=rank0" in warning

    live = _scrambled()  # world size 1, this process
    with caplog.at_level(logging.WARNING, logger="checkpoint"), Checkpointer(uri) as ckpt:
        assert ckpt.load(live) == 1
    assert _loaded(live)["draws"] == saved[0]["after_save"]
    assert live["counter"].value == {"n": 100} and live["seen"].value == 10 and live["cache"].value == [-1]
    assert "saved at world size 2, loading at 1" in caplog.text


def _save_too_large_on_rank1(rank: int, world: int, uri: str) -> str:
    """One rank's per-rank state is too large: every rank raises (none waits in the commit), nothing commits."""
    size = (65 << 20) if rank == 1 else 8
    with Checkpointer(uri) as ckpt:
        try:
            ckpt.save(1, {"w": torch.ones(4), "buf": PerRank(torch.zeros(size, dtype=torch.uint8))})
        except (CheckpointError, ValueError) as exc:
            message = str(exc)
        else:
            message = "saved"
        ckpt.save(2, {"w": torch.ones(4), "buf": PerRank(torch.zeros(8, dtype=torch.uint8))})
        ckpt.wait()
        return f"{message} | latest={ckpt.latest()}"


@pytest.mark.slow
def test_a_rank_with_oversized_per_rank_state_fails_the_save_everywhere(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    out = run_workers(_save_too_large_on_rank1, 2, (uri,), tmpdir=str(tmp_path), timeout=50)
    assert "another rank's state was rejected" in out[0] and out[0].endswith("latest=2"), out
    assert "per-rank state is too large" in out[1] and out[1].endswith("latest=2"), out
    manifest = validate_step(Storage(uri), 2)
    assert sorted(r.rank for r in manifest.rank_objects.values()) == [0, 1]
    assert json.loads(Path(uri, step_dir(2), MANIFEST_FILE).read_text())["rank_objects"]
