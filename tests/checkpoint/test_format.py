"""The on-disk format, pure parts: safetensors layout, block checksums, crc combination, manifest merge."""

from __future__ import annotations

import io
import json
import os
import struct
import zlib

import pytest
import safetensors.torch
import torch

from checkpoint import checksum
from checkpoint.api import CheckpointError, ChunkKey, Manifest, TensorItem, shard_file_name
from checkpoint.checksum import crc32_combine
from checkpoint.commit import build_index, merge_records
from checkpoint.shard import build_layout, write_shard
from checkpoint.writer import RankRecords, plan_files

pytestmark = pytest.mark.timeout(30)


class BytesSink:
    def __init__(self) -> None:
        self.buf = io.BytesIO()

    def write(self, data) -> None:
        self.buf.write(bytes(data))

    def commit(self) -> None: ...
    def abort(self) -> None: ...


def item(fqn: str, t: torch.Tensor, offsets=None, gshape=None, replicated=True) -> TensorItem:
    offsets = offsets or (0,) * t.dim()
    return TensorItem(
        key=ChunkKey(fqn, tuple(offsets), tuple(t.shape)),
        global_shape=tuple(gshape or t.shape),
        dtype={torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.bool: "BOOL", torch.uint8: "U8"}[t.dtype],
        tensor=t,
        replicated=replicated,
    )


def serialise(items: list[TensorItem], block: int = 64) -> tuple[bytes, object, list]:
    layout = plan_files(items, range(len(items)), rank=0, world_size=1, max_shard_bytes=1 << 30)[0]
    data = bytearray(layout.data_bytes)
    for e in layout.entries:
        data[e.offset : e.offset + e.nbytes] = items[e.item_index].tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    sink = BytesSink()
    frec, chunks = write_shard(sink, layout, memoryview(data), block, rank=0)
    return sink.buf.getvalue(), frec, chunks


@pytest.mark.parametrize(("n1", "n2"), [(0, 5), (5, 0), (1, 1), (100, 3), (1 << 20, 12345), (7, (1 << 22) + 3)])
def test_crc32_combine_matches_zlib(n1: int, n2: int) -> None:
    a, b = os.urandom(n1), os.urandom(n2)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 4095, 1 << 20, (1 << 20) + 7])
def test_fast_crc32_equals_zlib(n: int) -> None:
    """The manifest promises zlib's crc32: the accelerated implementation must give the same values,
    from any seed value and on memoryviews of tensor memory."""
    data = os.urandom(n)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)
    view = memoryview(torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()) if n else memoryview(b"")
    assert checksum.crc32(view) == zlib.crc32(data)


def test_fast_crc32_is_in_use() -> None:
    """isal is a dependency: if the accelerated crc is not picked, verified loads silently get ~7x slower."""
    pytest.importorskip("isal", reason="isal wheel not installed on this platform; zlib fallback in use")
    assert checksum.IMPLEMENTATION == "isal"


def test_shard_is_valid_safetensors_with_exact_records() -> None:
    torch.manual_seed(0)
    items = [
        item("u8", torch.randint(0, 255, (3,), dtype=torch.uint8)),  # odd size first by name: must not misalign
        item("w", torch.randn(10, 7)),
        item("bf", torch.randn(13).to(torch.bfloat16)),
        item("ids", torch.arange(9)),
        item("mask", torch.rand(5) > 0.5),
        item("piece", torch.randn(4, 7), offsets=(4, 0), gshape=(12, 7), replicated=False),
        item("scalar", torch.tensor(2.0)),
        item("empty", torch.empty(0, 3)),
    ]
    raw, frec, chunks = serialise(items)
    assert frec.size == len(raw) and frec.crc32 == zlib.crc32(raw)
    loaded = safetensors.torch.load(raw)
    names = {e.name for e, _ in chunks}
    assert "piece#4,0" in names and "w" in names
    for e, chunk in chunks:
        src = items[e.item_index].tensor
        assert torch.equal(loaded[e.name], src)
        start, end = chunk.byte_range
        assert raw[start:end] == src.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        blocks = [zlib.crc32(raw[s : min(s + 64, end)]) for s in range(start, end, 64)]
        assert chunk.block_crc32 == blocks
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_len) % 8 == 0
    # every tensor is aligned to its element size (sorted largest element first)
    header = json.loads(raw[8 : 8 + header_len])
    for name, meta in header.items():
        if name != "__metadata__":
            itemsize = {"F32": 4, "BF16": 2, "I64": 8, "BOOL": 1, "U8": 1}[meta["dtype"]]
            assert meta["data_offsets"][0] % itemsize == 0, name


def test_plan_files_splits_by_size() -> None:
    items = [item(f"t{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    layouts = plan_files(items, [0, 1, 2, 3, 4], rank=2, world_size=4, max_shard_bytes=2048)
    assert [lay.file for lay in layouts] == [
        shard_file_name(2, 4, 0),
        shard_file_name(2, 4, 1),
        shard_file_name(2, 4, 2),
    ] == ["shard-00002-of-00004.safetensors", "shard-00002-of-00004-part-001.safetensors", "shard-00002-of-00004-part-002.safetensors"]
    assert [len(lay.entries) for lay in layouts] == [2, 2, 1]
    big = [item("huge", torch.zeros(4096)), item("small", torch.zeros(1))]
    assert [len(lay.entries) for lay in plan_files(big, [0, 1], rank=0, world_size=1, max_shard_bytes=1024)] == [1, 1]


def test_merge_records_builds_a_tiling_manifest_and_index() -> None:
    full = torch.randn(12, 7)
    r0 = RankRecords(rank=0)
    r1 = RankRecords(rank=1)
    for rec, rows, rank in ((r0, (0, 6), 0), (r1, (6, 12), 1)):
        it = item("w", full[rows[0] : rows[1]], offsets=(rows[0], 0), gshape=(12, 7), replicated=False)
        layout = build_layout(shard_file_name(rank, 2), [(0, it.key, it.global_shape, it.dtype, it.nbytes)])
        frec, chunks = write_shard(BytesSink(), layout, memoryview(it.tensor.numpy().tobytes()), 64, rank=rank)
        rec.files[layout.file] = frec
        from checkpoint.api import TensorRecord

        rec.tensors["w"] = TensorRecord(shape=[12, 7], dtype="F32", chunks=[c for _, c in chunks])
    manifest = merge_records([r1, r0], step=5, world_size=2, block_bytes=64, has_objects=True, created_unix=1.0)
    assert [c.offsets for c in manifest.tensors["w"].chunks] == [[0, 0], [6, 0]]
    again = Manifest.from_json(json.loads(json.dumps(manifest.to_json())))
    assert again.to_json() == manifest.to_json()
    index = build_index(manifest)
    assert index["weight_map"] == {"w": "shard-00000-of-00002.safetensors"} and index["metadata"]["chunked"] == ["w"]
    with pytest.raises(CheckpointError, match="rank 1: OSError: disk full"):
        merge_records([r0, RankRecords(rank=1, error="OSError: disk full")], step=5, world_size=2, block_bytes=64, has_objects=False, created_unix=1.0)
    from checkpoint.api import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError):  # a missing half is caught before anything is committed
        merge_records([r0], step=5, world_size=2, block_bytes=64, has_objects=False, created_unix=1.0)
