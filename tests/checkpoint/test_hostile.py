"""A hostile or damaged checkpoint root (issue 10): each finding of the audit, reproduced.

The root is a trust boundary: names stay in their step directory, sizes are bounded by the real files before
anything is allocated, every parser answers bad input with the checkpoint's own error, one bad step never
stops ``latest()``/``load()`` from using the good ones, every file of a step is checksummed, ``verify``
applies what ``load`` applies, and neither ``rm`` nor retention removes what a restart needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoint.commit
import checkpoint.retention
from checkpoint.api import (
    COMMIT_FILE,
    MANIFEST_FILE,
    OBJECTS_FILE,
    CheckpointError,
    CheckpointNotFoundError,
    ChunkRecord,
    CorruptCheckpointError,
    FileRecord,
    IncompatibleCheckpointError,
    Manifest,
    TensorRecord,
    UnsafePathError,
    parse_step_dir,
    step_dir,
)
from checkpoint.checkpointer import Checkpointer
from checkpoint.cli import main
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps
from checkpoint.plan import validate_tiling
from checkpoint.retention import steps_to_delete
from checkpoint.state import PerRank
from checkpoint.storage import Storage

pytestmark = pytest.mark.timeout(60)
SHARD = "shard-00000-of-00001.safetensors"


def state(epoch: int) -> dict[str, Any]:
    torch.manual_seed(epoch)
    return {"w": torch.randn(64, 32), "b": torch.randn(32), "epoch": epoch}


def zeros() -> dict[str, Any]:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32), "epoch": -1}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Steps 1 and 2 (epoch 1 and 2), both good."""
    root = tmp_path / "run"
    with Checkpointer(str(root), CheckpointConfig(checksum_block_bytes=4096)) as ckpt:
        ckpt.save(1, state(1))
        ckpt.save(2, state(2))
        ckpt.wait()
    return root


def resign(root: Path, step: int, raw: bytes) -> None:
    """Write ``raw`` as the manifest of ``step`` and a marker that commits exactly these bytes (a hostile or
    buggy writer: the marker no longer protects the manifest)."""
    d = root / step_dir(step)
    (d / MANIFEST_FILE).write_bytes(raw)
    marker = json.loads((d / COMMIT_FILE).read_text())
    marker.update(manifest_crc32=zlib.crc32(raw), manifest_size=len(raw))
    (d / COMMIT_FILE).write_text(json.dumps(marker))


def edit_manifest(root: Path, step: int, edit, *, sign: bool = True) -> None:
    path = root / step_dir(step) / MANIFEST_FILE
    data = json.loads(path.read_text())
    edit(data)
    raw = json.dumps(data).encode()
    if sign:
        resign(root, step, raw)
    else:
        path.write_bytes(raw)


def assert_falls_back_to_step_1(root: Path) -> None:
    with Checkpointer(str(root)) as ckpt:
        assert ckpt.latest() == 1
        live = zeros()
        assert ckpt.load(live) == 1
        assert live["epoch"] == 1 and torch.equal(live["w"], state(1)["w"])


def cli(*args: str) -> int:
    return main([*args])


# --------------------------------------------------------------------------- names and listings
def test_step_dir_names_must_be_canonical_ascii(run: Path) -> None:
    assert parse_step_dir("step-²") is None  # str.isdigit() accepts it; int() does not
    assert parse_step_dir("step-1") is None and parse_step_dir("step-000000001") == 1
    (run / "step-²").mkdir()
    (run / "step-²" / COMMIT_FILE).write_text("{}")
    (run / "step-3").mkdir()
    (run / "step-3" / COMMIT_FILE).write_text("{}")
    assert list_steps(Storage(str(run))).committed == [1, 2]
    with Checkpointer(str(run)) as ckpt:
        assert ckpt.latest() == 2
        assert ckpt.load(zeros()) == 2
    assert cli("ls", str(run)) == 0


@pytest.mark.parametrize("name", ["../step-000000001/" + SHARD, "/etc/hostname", "sub/x.safetensors", "..", ""])
def test_manifest_names_outside_the_step_are_refused(run: Path, name: str, capsys) -> None:
    def rename(d: dict[str, Any]) -> None:
        d["files"][name] = d["files"].pop(SHARD)
        for rec in d["tensors"].values():
            for c in rec["chunks"]:
                c["file"] = name

    edit_manifest(run, 2, rename)
    with Checkpointer(str(run)) as ckpt, pytest.raises(UnsafePathError, match="not a plain file name"):
        ckpt.load(zeros(), step=2)
    assert_falls_back_to_step_1(run)
    assert cli("verify", str(run), "--step", "2", "--no-progress") == 4  # was: "OK" after reading ../
    assert "OK" not in capsys.readouterr().out


def test_step_dir_symlinked_outside_is_neither_deleted_nor_written(run: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / COMMIT_FILE).write_text("precious")
    (run / step_dir(3)).symlink_to(outside, target_is_directory=True)
    assert cli("rm", str(run), "--step", "3", "--force") == 3  # not a step of this root
    with pytest.raises(UnsafePathError, match="outside the checkpoint root"):
        Storage(str(run)).rm(f"{step_dir(3)}/{COMMIT_FILE}")
    with Checkpointer(str(run), CheckpointConfig(keep_last=1)) as ckpt:
        ckpt.save(4, state(4))  # retention runs: must not follow step 3 outside
        ckpt.wait()
        (run / step_dir(5)).symlink_to(outside, target_is_directory=True)
        with pytest.raises(UnsafePathError, match="outside the checkpoint root"):
            ckpt.save(5, state(5))
            ckpt.wait()
    assert sorted(p.name for p in outside.iterdir()) == [COMMIT_FILE]
    assert (outside / COMMIT_FILE).read_text() == "precious"


@pytest.mark.parametrize("victim", [COMMIT_FILE, MANIFEST_FILE])
def test_marker_or_manifest_symlinked_to_dev_zero(run: Path, victim: str) -> None:
    path = run / step_dir(2) / victim
    path.unlink()
    path.symlink_to("/dev/zero")
    with Checkpointer(str(run)) as ckpt, pytest.raises(CheckpointError):
        ckpt.load(zeros(), step=2)  # was: an unbounded read of /dev/zero
    assert_falls_back_to_step_1(run)


def test_in_root_marker_larger_than_any_marker_is_not_read_whole(run: Path) -> None:
    (run / step_dir(2) / COMMIT_FILE).write_bytes(b" " * (1 << 20))
    with Checkpointer(str(run)) as ckpt, pytest.raises(CorruptCheckpointError, match="larger than"):
        ckpt.load(zeros(), step=2)
    assert_falls_back_to_step_1(run)


def test_fifo_in_root_does_not_hang_a_read(run: Path) -> None:
    path = run / step_dir(2) / MANIFEST_FILE
    path.unlink()
    os.mkfifo(path)
    with Checkpointer(str(run)) as ckpt, pytest.raises(CorruptCheckpointError):
        ckpt.load(zeros(), step=2)
    assert_falls_back_to_step_1(run)


# --------------------------------------------------------------------------- parsers
@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda d: d.update(files=[]), id="files-list"),
        pytest.param(lambda d: d["tensors"]["w"].update(shape=[64.0, 32]), id="float-shape"),
        pytest.param(lambda d: d["tensors"]["w"].update(chunks={}), id="chunks-dict"),
        pytest.param(lambda d: d.update(world_size=True), id="bool-world"),
        pytest.param(lambda d: d["files"][SHARD].update(size="236"), id="string-size"),
        pytest.param(lambda d: d["tensors"]["w"]["chunks"][0].update(offsets=[2**80, 0]), id="huge-offset"),
        pytest.param(lambda d: d.update(checksum_block_bytes=0), id="zero-block"),
        pytest.param(lambda d: d.update(format="other"), id="format"),
    ],
)
@pytest.mark.parametrize("sign", [False, True], ids=["unsigned", "resigned"])
def test_malformed_manifest_is_corrupt_and_skipped(run: Path, edit, sign: bool, capsys) -> None:
    edit_manifest(run, 2, edit, sign=sign)
    with Checkpointer(str(run)) as ckpt, pytest.raises(CheckpointError):
        ckpt.load(zeros(), step=2)
    assert_falls_back_to_step_1(run)
    for cmd in (["verify", str(run), "--step", "2", "--no-progress"], ["export", str(run), str(run.parent / "x"), "--step", "2", "--no-progress"]):
        assert cli(*cmd) == 4  # corrupt, never a traceback (was: crash on block size 0 and float shapes)


@pytest.mark.parametrize("sign", [False, True], ids=["unsigned", "resigned"])
def test_deeply_nested_json_is_corrupt(run: Path, sign: bool) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    if sign:
        resign(run, 2, deep)
    else:
        (run / step_dir(2) / MANIFEST_FILE).write_bytes(deep)
    with Checkpointer(str(run)) as ckpt, pytest.raises(CorruptCheckpointError):
        ckpt.load(zeros(), step=2)
    assert_falls_back_to_step_1(run)
    (run / step_dir(2) / COMMIT_FILE).write_bytes(b"[" * 50_000)
    assert_falls_back_to_step_1(run)


def test_unknown_dtype_committed_is_incompatible_not_skipped(run: Path) -> None:
    # Like an unknown format version, a dtype this spotrun does not know asks for an upgrade: falling back to an
    # older step would silently lose progress. Edited without re-signing, it is damage like any other edit.
    edit_manifest(run, 2, lambda d: d["tensors"]["w"].update(dtype="X99"))
    with Checkpointer(str(run)) as ckpt, pytest.raises(IncompatibleCheckpointError, match="X99"):
        ckpt.load(zeros())
    assert cli("verify", str(run), "--step", "2", "--no-progress") == 5
    edit_manifest(run, 2, lambda d: d["tensors"]["w"].update(dtype="F32"), sign=False)
    assert_falls_back_to_step_1(run)


# --------------------------------------------------------------------------- sizes before allocation
def test_reads_never_allocate_more_than_the_file_holds(run: Path) -> None:
    storage = Storage(str(run))
    rel = f"{step_dir(2)}/{SHARD}"
    tracemalloc.start()
    try:
        data = storage.read_range(rel, 0, 1 << 40)  # the 1 GB-for-a-small-shard case, 1 TiB here
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(data) == (run / rel).stat().st_size
    assert peak < 1 << 20


def test_claimed_sizes_beyond_the_files_are_corrupt_before_reading(run: Path) -> None:
    def claim_40gb(d: dict[str, Any]) -> None:
        d["checksum_block_bytes"] = 1 << 30
        for other in d["tensors"].values():
            for c in other["chunks"]:
                c["block_crc32"] = c["block_crc32"][:1]
        rec = d["tensors"]["w"]
        rec["shape"] = [10**7, 1000]
        c = rec["chunks"][0]
        c["lengths"] = [10**7, 1000]
        c["byte_range"] = [c["byte_range"][0], c["byte_range"][0] + 4 * 10**10]
        c["block_crc32"] = [0] * (-(-4 * 10**10 // d["checksum_block_bytes"]))
        d["files"][SHARD]["size"] = 4 * 10**10 + 8192

    edit_manifest(run, 2, claim_40gb)
    with Checkpointer(str(run)) as ckpt, pytest.raises(CorruptCheckpointError, match="bytes, the manifest says"):
        ckpt.load(zeros(), step=2)
    assert cli("verify", str(run), "--step", "2", "--no-progress") == 4
    assert cli("export", str(run), str(run.parent / "x"), "--step", "2", "--no-progress") == 4
    assert_falls_back_to_step_1(run)


def test_chunks_sharing_bytes_or_past_their_file_are_corrupt() -> None:
    def manifest(ranges: list[list[int]], size: int) -> Manifest:
        chunks = [ChunkRecord([i * 2], [2], "f", f"k{i}", r, [0]) for i, r in enumerate(ranges)]
        rec = TensorRecord([2 * len(ranges)], "F32", chunks)
        return Manifest(1, 1, 0.0, "t", {"t": rec}, {"f": FileRecord(size, 0, 0)}, checksum_block_bytes=64)

    validate_tiling(manifest([[0, 8], [8, 16]], 16))
    with pytest.raises(CorruptCheckpointError, match="share bytes"):
        validate_tiling(manifest([[0, 8], [4, 12]], 16))
    with pytest.raises(CorruptCheckpointError, match="outside f"):
        validate_tiling(manifest([[0, 8], [8, 16]], 12))


@pytest.mark.timeout(20)
def test_tiling_check_does_not_build_a_huge_grid() -> None:
    # 2000 one-element chunks on the diagonal of a 2000^3 tensor: a coverage grid of 8e9 cells (32 GB).
    n = 2000
    chunks = [ChunkRecord([i, i, i], [1, 1, 1], "f", f"k{i}", [4 * i, 4 * i + 4], [0]) for i in range(n)]
    m = Manifest(1, 1, 0.0, "t", {"t": TensorRecord([n, n, n], "F32", chunks)}, {"f": FileRecord(4 * n, 0, 0)})
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="too many to check"):
            validate_tiling(m)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    # Irregular but valid: each dim-0 slab i cut at i+1 in dims 1 and 2 (4 chunks, fewer at the edge): 250^3
    # grid cells, above the grid limit, so chunks are compared pairwise (~1000 of them) and accepted.
    k = 250
    parts: list[ChunkRecord] = []
    pos = 0
    for i in range(k):
        for lo1, hi1 in ((0, i + 1), (i + 1, k)):
            for lo2, hi2 in ((0, i + 1), (i + 1, k)):
                if hi1 > lo1 and hi2 > lo2:
                    n = (hi1 - lo1) * (hi2 - lo2)
                    parts.append(ChunkRecord([i, lo1, lo2], [1, hi1 - lo1, hi2 - lo2], "f", f"c{len(parts)}", [pos, pos + n], [0]))
                    pos += n
    m = Manifest(1, 1, 0.0, "t", {"t": TensorRecord([k, k, k], "U8", parts)}, {"f": FileRecord(pos, 0, 0)}, checksum_block_bytes=1 << 20)
    validate_tiling(m)
    next(c for c in parts if c.offsets[1] > 1).offsets[1] -= 1  # now two chunks overlap: found pairwise too
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        validate_tiling(m)


# --------------------------------------------------------------------------- every file checksummed
def test_objects_json_edited_after_commit_is_found(run: Path, capsys) -> None:
    path = run / step_dir(2) / OBJECTS_FILE
    path.write_text(path.read_text().replace('"epoch": 2', '"epoch": 9'))
    with Checkpointer(str(run)) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="objects.json fails its check"):
            ckpt.load(zeros(), step=2)
        live = zeros()
        assert ckpt.load(live) == 1 and live["epoch"] == 1  # was: epoch 9, loaded silently
    assert cli("verify", str(run), "--step", "2", "--no-progress") == 4  # was: OK


def test_objects_json_deleted_is_found(run: Path, capsys) -> None:
    (run / step_dir(2) / OBJECTS_FILE).unlink()
    assert_falls_back_to_step_1(run)  # was: ls/verify OK, load failed with no fallback
    assert cli("verify", str(run), "--step", "2", "--no-progress") == 4
    assert cli("ls", str(run)) == 0
    assert "CORRUPT" in capsys.readouterr().out


def test_manifests_without_checksums_still_load(run: Path) -> None:
    edit_manifest(run, 2, lambda d: d.pop("checksums"))
    with Checkpointer(str(run)) as ckpt:
        live = zeros()
        assert ckpt.load(live) == 2 and live["epoch"] == 2


def test_per_rank_file_world_size_and_step_are_checked(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with Checkpointer(str(root)) as ckpt:
        ckpt.save(1, {**state(1), "pos": PerRank({"i": 1})})
        ckpt.save(2, {**state(2), "pos": PerRank({"i": 2})})
        ckpt.wait()
    name = "objects-00000-of-00001.json"
    path = root / step_dir(2) / name
    doc = json.loads(path.read_text())
    doc["step"] = 1  # e.g. copied over from step 1
    raw = json.dumps(doc).encode()
    path.write_bytes(raw)
    edit_manifest(root, 2, lambda d: d["rank_objects"][name].update(size=len(raw), crc32=zlib.crc32(raw)))
    with Checkpointer(str(root)) as ckpt, pytest.raises(CorruptCheckpointError, match="world size, step"):
        ckpt.load({**zeros(), "pos": PerRank({"i": 0})}, step=2)
    assert cli("verify", str(root), "--step", "2", "--no-progress") == 4


def test_verify_checks_the_safetensors_header_against_the_manifest(run: Path, capsys) -> None:
    path = run / step_dir(2) / SHARD
    raw = path.read_bytes()
    swapped = raw.replace(b'"shape":[64,32]', b'"shape":[32,64]', 1)
    assert swapped != raw
    path.write_bytes(swapped)
    edit_manifest(run, 2, lambda d: d["files"][SHARD].update(crc32=zlib.crc32(swapped)))
    assert cli("verify", str(run), "--step", "2", "--no-progress") == 4  # was: OK
    assert "safetensors header" in capsys.readouterr().err


def test_inspect_into_a_closed_pipe_exits_quietly(run: Path) -> None:
    r, w = os.pipe()
    os.close(r)  # the reader (head) is already gone
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "checkpoint.cli", "inspect", str(run), "--verbose"],
            check=False,
            stdout=w,
            stderr=subprocess.PIPE,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(checkpoint.commit.__file__).parents[1])},
        )
    finally:
        os.close(w)
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    assert proc.returncode == 141


# --------------------------------------------------------------------------- rm and retention
def test_rm_during_a_save_fails_the_save_and_keeps_the_good_step(run: Path, monkeypatch, capsys) -> None:
    real = checkpoint.commit.crash_point
    answers: list[int] = []

    def rm_at(point: str) -> None:  # a user runs spotrun-ckpt rm while rank 0 is committing step 3
        if point == "objects.after":
            answers.append(cli("rm", str(run), "--step", "3"))
            answers.append(cli("rm", str(run), "--step", "3", "--force"))
        real(point)

    monkeypatch.setattr(checkpoint.commit, "crash_point", rm_at)
    with (
        Checkpointer(str(run), CheckpointConfig(keep_last=1)) as ckpt,
        pytest.raises(CheckpointError, match="files changed during the save"),
    ):
        ckpt.save(3, state(3))
        ckpt.wait()
    assert answers == [1, 0]  # refused without --force: a job may be writing it
    assert "may be writing it" in capsys.readouterr().err
    assert list_steps(Storage(str(run))).committed == [1, 2]
    with Checkpointer(str(run)) as ckpt:
        live = zeros()
        assert ckpt.load(live) == 2 and live["epoch"] == 2


def test_retention_keeps_the_newest_good_step_when_the_newest_commit_is_damaged(run: Path, monkeypatch) -> None:
    real = checkpoint.retention.crash_point

    def damage_at(point: str) -> None:  # the new step loses a shard between its commit and retention
        if point == "retention.before":
            (run / step_dir(3) / SHARD).unlink()
        real(point)

    monkeypatch.setattr(checkpoint.retention, "crash_point", damage_at)
    with Checkpointer(str(run), CheckpointConfig(keep_last=1)) as ckpt:
        ckpt.save(3, state(3))
        ckpt.wait()
    assert list_steps(Storage(str(run))).committed == [2, 3]  # was: [3], nothing loadable left
    with Checkpointer(str(run)) as ckpt:
        live = zeros()
        assert ckpt.load(live) == 2 and live["epoch"] == 2


def test_steps_to_delete_never_returns_a_protected_step() -> None:
    assert steps_to_delete([1, 2, 3], [], keep_last=1) == [1, 2]
    assert steps_to_delete([1, 2, 3], [], keep_last=1, protect=[2]) == [1]


def test_save_does_not_commit_when_files_are_gone(run: Path) -> None:
    from checkpoint.discover import read_manifest

    storage = Storage(str(run))
    manifest = read_manifest(storage, 2)
    manifest.step = 3  # a step whose shards were never written (or deleted meanwhile)
    storage.makedirs(step_dir(3))
    with pytest.raises(CheckpointError, match="not committed: its files changed"):
        checkpoint.commit.commit_step(storage, manifest, {"epoch": 3})
    assert not (run / step_dir(3) / COMMIT_FILE).exists()
    with pytest.raises(CheckpointNotFoundError):
        Checkpointer(str(run)).load(zeros(), step=3)


# --------------------------------------------------------------------------- every backend
def test_names_are_confined_on_every_backend(backend) -> None:
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        ckpt.save(1, state(1))
        ckpt.save(2, state(2))
        ckpt.wait()
    storage = Storage(backend.uri, storage_options=backend.storage_options)
    for rel in (f"{step_dir(2)}/../{step_dir(1)}/{MANIFEST_FILE}", "/etc/hostname", "../x", f"{step_dir(2)}//x"):
        with pytest.raises(UnsafePathError):
            storage.read_bytes(rel)
        with pytest.raises(UnsafePathError):
            storage.rm(rel, recursive=True)
        with pytest.raises(UnsafePathError):
            storage.write_bytes(rel, b"x")
    rel = f"{step_dir(2)}/{MANIFEST_FILE}"
    doc = json.loads(storage.read_bytes(rel))
    hostile = f"../{step_dir(1)}/{SHARD}"
    doc["files"][hostile] = doc["files"].pop(SHARD)
    for rec in doc["tensors"].values():
        for c in rec["chunks"]:
            c["file"] = hostile
    raw = json.dumps(doc).encode()
    storage.write_bytes(rel, raw)
    marker = json.loads(storage.read_bytes(f"{step_dir(2)}/{COMMIT_FILE}"))
    marker.update(manifest_crc32=zlib.crc32(raw), manifest_size=len(raw))
    storage.write_bytes(f"{step_dir(2)}/{COMMIT_FILE}", json.dumps(marker).encode())
    with Checkpointer(backend.uri, backend.config()) as ckpt:
        with pytest.raises(UnsafePathError):
            ckpt.load(zeros(), step=2)
        assert ckpt.latest() == 1
        live = zeros()
        assert ckpt.load(live) == 1 and live["epoch"] == 1
