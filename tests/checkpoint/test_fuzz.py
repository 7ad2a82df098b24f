"""Property-based fuzzing of everything the checkpoint reads from its root (hypothesis).

Two families:

* the parsers alone (step directory names, commit marker, manifest, per-rank and ``objects.json`` files,
  safetensors header) fed arbitrary bytes and arbitrary JSON: only errors of the checkpoint's own tree;
* a real checkpoint (two steps) copied per example and then damaged: bit flips, truncations, JSON values
  replaced (the marker re-signed, as a buggy or hostile writer would), hostile file names and symlinks.
  ``load()`` must then return exactly what one of the steps saved, or raise a CheckpointError; ``verify``
  must finish without a traceback and fail whenever bytes of the step changed; and nothing outside the
  root is opened, listed or deleted (watched with an audit hook).

Profiles: ``ci`` (default, small, a few seconds) and ``thorough`` (``--hypothesis-profile=thorough``), both
registered in ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from checkpoint.api import (
    COMMIT_FILE,
    MANIFEST_FILE,
    CheckpointError,
    Manifest,
    parse_step_dir,
    step_dir,
)
from checkpoint.checkpointer import Checkpointer
from checkpoint.cli import main as cli
from checkpoint.config import CheckpointConfig
from checkpoint.discover import (
    read_objects,
    read_rank_objects,
    resolve_step,
    validate_step,
)
from checkpoint.shard import read_header
from checkpoint.state import PerRank
from checkpoint.storage import Storage

pytestmark = pytest.mark.timeout(300)

TRIED = {"inputs": 0}
"""Inputs tried in this session (every example of every test here); printed at the end of the module."""


def state(epoch: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(epoch)
    return {
        "w": torch.randn(64, 32, generator=g),
        "h": torch.randn(8, generator=g).to(torch.bfloat16),
        "i": torch.arange(6) * epoch,
        "epoch": epoch,
        "pos": PerRank({"i": epoch}),
    }


def zeros() -> dict[str, Any]:
    return {
        "w": torch.zeros(64, 32),
        "h": torch.zeros(8, dtype=torch.bfloat16),
        "i": torch.zeros(6, dtype=torch.int64),
        "epoch": -1,
        "pos": PerRank({"i": -1}),
    }


def same(live: dict[str, Any], epoch: int) -> bool:
    want = state(epoch)
    return (
        all(torch.equal(live[k], want[k]) for k in ("w", "h", "i"))
        and live["epoch"] == epoch
        and live["pos"].value == {"i": epoch}
    )


# --------------------------------------------------------------------------- out-of-root watch
_WATCH: dict[str, Any] = {"forbidden": None, "seen": []}
_EVENTS = {"open", "os.remove", "os.unlink", "os.rmdir", "shutil.rmtree", "os.rename", "os.scandir", "os.listdir"}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    forbidden = _WATCH["forbidden"]
    if forbidden is None or event not in _EVENTS or not args:
        return
    path = args[0]
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if isinstance(path, str) and os.path.realpath(path).startswith(forbidden):
        _WATCH["seen"].append((event, path))


sys.addaudithook(_audit)  # permanent by design (PEP 578); inert unless a test sets _WATCH["forbidden"]


class watch_outside:
    """Record every open/list/delete of a path under ``outside`` while active."""

    def __init__(self, outside: Path):
        self.outside = os.path.realpath(outside) + os.sep

    def __enter__(self) -> list[tuple[str, str]]:
        _WATCH["seen"] = []
        _WATCH["forbidden"] = self.outside
        return _WATCH["seen"]

    def __exit__(self, *exc: object) -> None:
        _WATCH["forbidden"] = None


# --------------------------------------------------------------------------- the real checkpoint
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("fuzz-base") / "run"
    with Checkpointer(str(root), CheckpointConfig(checksum_block_bytes=4096)) as ckpt:
        ckpt.save(1, state(1))
        ckpt.save(2, state(2))
        ckpt.wait()
    yield root
    print(f"\nfuzz: {TRIED['inputs']} inputs tried", file=sys.stderr)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sandbox/outside`` holds a decoy a hostile name could point at; examples use ``sandbox/root``."""
    box = tmp_path_factory.mktemp("fuzz-sandbox")
    (box / "outside").mkdir()
    (box / "outside" / "secret.safetensors").write_bytes(b"\0" * 4096)
    (box / "outside" / COMMIT_FILE).write_text("{}")
    return box


def fresh_copy(base: Path, sandbox: Path) -> Path:
    root = sandbox / "root"
    if root.exists() or root.is_symlink():
        shutil.rmtree(root)
    shutil.copytree(base, root, symlinks=True)
    return root


def step_files(root: Path, step: int = 2) -> list[str]:
    return sorted(p.name for p in (root / step_dir(step)).iterdir())


def resign(root: Path, step: int, raw: bytes) -> None:
    d = root / step_dir(step)
    (d / MANIFEST_FILE).write_bytes(raw)
    marker = json.loads((d / COMMIT_FILE).read_text())
    marker.update(manifest_crc32=zlib.crc32(raw), manifest_size=len(raw))
    (d / COMMIT_FILE).write_text(json.dumps(marker))


def exercise(root: Path, outside: Path, *, damaged_bytes: bool) -> None:
    """load / latest / verify / inspect on a damaged root: checkpoint errors only, exact values when it loads,
    nothing outside the root touched."""
    TRIED["inputs"] += 1
    with watch_outside(outside) as seen:
        live = zeros()
        try:
            with Checkpointer(str(root)) as ckpt:
                got = ckpt.load(live)
        except CheckpointError as exc:
            note(f"load: {type(exc).__name__}: {exc}")
            got = "error"
        if got in (1, 2) and damaged_bytes:
            assert same(live, got), f"load returned step {got} with values that step did not save"
        codes = [cli(["verify", str(root), "--step", "2", "--no-progress"]), cli(["ls", str(root)])]
        codes.append(cli(["inspect", str(root), "--step", "2"]))
    assert not seen, f"accessed outside the root: {seen}"
    assert all(isinstance(c, int) for c in codes)
    if damaged_bytes:
        assert codes[0] != 0, "verify said OK for a step whose bytes changed"


FUZZ = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)


# --------------------------------------------------------------------------- mutated real checkpoints
@FUZZ
@given(data=st.data())
def test_bit_flips(base: Path, sandbox: Path, data: st.DataObject, capsys) -> None:
    root = fresh_copy(base, sandbox)
    names = [n for n in step_files(root) if n != COMMIT_FILE]  # the marker's created_unix is not checked data
    name = data.draw(st.sampled_from(names), label="file")
    path = root / step_dir(2) / name
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1), label="byte")
    raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    path.write_bytes(bytes(raw))
    exercise(root, sandbox / "outside", damaged_bytes=True)
    capsys.readouterr()


@FUZZ
@given(data=st.data())
def test_truncations(base: Path, sandbox: Path, data: st.DataObject, capsys) -> None:
    root = fresh_copy(base, sandbox)
    name = data.draw(st.sampled_from(step_files(root)), label="file")
    path = root / step_dir(2) / name
    raw = path.read_bytes()
    keep = data.draw(st.integers(0, len(raw) - 1), label="keep")
    path.write_bytes(raw[:keep])
    exercise(root, sandbox / "outside", damaged_bytes=True)
    capsys.readouterr()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


HOSTILE_NAMES = [
    "../step-000000001/shard-00000-of-00001.safetensors",
    "../../outside/secret.safetensors",
    "/etc/hostname",
    "..",
    ".",
    "",
    "a/b",
    "a\\b",
    "x\x00y",
    "manifest.json",
    ".commit",
    "step-²",
    "s" * 300,
]


@FUZZ
@given(data=st.data())
def test_json_value_mutations_resigned(base: Path, sandbox: Path, data: st.DataObject, capsys) -> None:
    root = fresh_copy(base, sandbox)
    path = root / step_dir(2) / MANIFEST_FILE
    doc = json.loads(path.read_text())
    where = data.draw(st.sampled_from(list(_paths(doc))), label="path")
    value = data.draw(json_values | st.sampled_from(HOSTILE_NAMES) | st.sampled_from([0, -1, 2**63, 2**40, 1.5]), label="value")
    doc = _set(doc, where, value)
    resign(root, 2, json.dumps(doc).encode())
    exercise(root, sandbox / "outside", damaged_bytes=False)  # a consistent rewrite may load: no traceback, no escape
    capsys.readouterr()


@FUZZ
@given(data=st.data())
def test_hostile_names_and_symlinks(base: Path, sandbox: Path, data: st.DataObject, capsys) -> None:
    root = fresh_copy(base, sandbox)
    outside = sandbox / "outside"
    kind = data.draw(st.sampled_from(["rename", "symlink-file", "symlink-step"]), label="kind")
    if kind == "rename":
        name = data.draw(st.sampled_from(HOSTILE_NAMES + [str(outside / "secret.safetensors")]), label="name")
        doc = json.loads((root / step_dir(2) / MANIFEST_FILE).read_text())
        old = data.draw(st.sampled_from(sorted(doc["files"]) + sorted(doc.get("rank_objects", {}))), label="old")
        table = "files" if old in doc["files"] else "rank_objects"
        doc[table][name] = doc[table].pop(old)
        for rec in doc["tensors"].values():
            for c in rec["chunks"]:
                if c["file"] == old:
                    c["file"] = name
        resign(root, 2, json.dumps(doc).encode())
    elif kind == "symlink-file":
        name = data.draw(st.sampled_from(step_files(root)), label="file")
        target = data.draw(st.sampled_from([outside / "secret.safetensors", outside / COMMIT_FILE, Path("/dev/zero")]))
        (root / step_dir(2) / name).unlink()
        (root / step_dir(2) / name).symlink_to(target)
    else:
        shutil.rmtree(root / step_dir(2))
        (root / step_dir(2)).symlink_to(outside, target_is_directory=True)
    exercise(root, outside, damaged_bytes=False)
    with watch_outside(outside) as seen:  # deleting and saving must not follow them either
        assert cli(["rm", str(root), "--step", "2", "--force"]) in (0, 3, 4, 6)
        with Checkpointer(str(root), CheckpointConfig(keep_last=1)) as ckpt:
            try:
                ckpt.save(3, state(3))
                ckpt.wait()
            except CheckpointError as exc:
                note(f"save: {exc}")
    assert not seen, f"accessed outside the root: {seen}"
    assert sorted(p.name for p in outside.iterdir()) == [COMMIT_FILE, "secret.safetensors"]
    capsys.readouterr()


# --------------------------------------------------------------------------- parsers alone
@FUZZ
@given(name=st.text(max_size=20) | st.from_regex(r"step-[0-9]{1,12}", fullmatch=True))
def test_step_dir_names(name: str) -> None:
    TRIED["inputs"] += 1
    step = parse_step_dir(name)
    assert step is None or (step >= 0 and step_dir(step) == name)


@pytest.fixture(scope="module")
def mem() -> Iterator[Storage]:
    storage = Storage("memory://fuzz-parsers")
    yield storage
    storage.rm("", recursive=True)


@FUZZ
@given(marker=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()), manifest=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()), sign=st.booleans())
def test_marker_and_manifest_parsers(mem: Storage, marker: bytes, manifest: bytes, sign: bool) -> None:
    TRIED["inputs"] += 1
    rel = step_dir(7)
    mem.makedirs(rel)
    if sign:
        marker = json.dumps({"step": 7, "manifest_crc32": zlib.crc32(manifest), "manifest_size": len(manifest), "created_unix": 0}).encode()
    mem.write_bytes(f"{rel}/{COMMIT_FILE}", marker)
    mem.write_bytes(f"{rel}/{MANIFEST_FILE}", manifest)
    try:
        m = validate_step(mem, 7)
    except CheckpointError:
        return
    assert isinstance(m, Manifest)
    resolve_step(mem, 7)


@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()), prefix=st.integers(0, 2**64 - 1))
def test_safetensors_header_parser(mem: Storage, raw: bytes, prefix: int) -> None:
    TRIED["inputs"] += 1
    mem.write_bytes("h.safetensors", prefix.to_bytes(8, "little") + raw)
    try:
        start, header = read_header(mem, "h.safetensors")
    except CheckpointError:
        return
    assert isinstance(header, dict) and start >= 8


@FUZZ
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_objects_and_per_rank_parsers(mem: Storage, raw: bytes) -> None:
    TRIED["inputs"] += 1
    from checkpoint.api import RankObjectsRecord

    rel = step_dir(8)
    mem.makedirs(rel)
    mem.write_bytes(f"{rel}/objects.json", raw)
    mem.write_bytes(f"{rel}/objects-00000-of-00001.json", raw)
    m = Manifest(8, 1, 0.0, "t", {}, {}, has_objects=True)
    m.rank_objects["objects-00000-of-00001.json"] = RankObjectsRecord(len(raw), zlib.crc32(raw), 0, ["x"])
    for read in (lambda: read_objects(mem, m), lambda: read_rank_objects(mem, m, 0)):
        try:
            assert isinstance(read(), dict)
        except CheckpointError:
            pass
