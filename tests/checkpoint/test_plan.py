"""Unit tests of the pure planner: assign_writers, validate_tiling, plan_reads and chunk_view."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from checkpoint.api import (
    ChunkKey,
    ChunkRecord,
    CorruptCheckpointError,
    FileRecord,
    IncompatibleCheckpointError,
    Manifest,
    TensorItem,
    TensorRecord,
)
from checkpoint.plan import assign_writers, c_strides, chunk_view, plan_reads, validate_tiling
from checkpoint.state import dtype_to_st, st_to_dtype

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- helpers
def split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk-style split of range(n) into ``parts`` pieces: (offset, length), trailing ones may be empty."""
    size = -(-n // parts) if parts else 0
    return [(min(i * size, n), max(0, min(size, n - i * size))) for i in range(parts)]


def key(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ChunkKey:
    return ChunkKey(fqn=fqn, offsets=offsets, lengths=lengths)


def sharded_manifest(full: dict[str, torch.Tensor], parts: int, dim: int = 0, block: int = 16) -> tuple[Manifest, dict[str, bytes]]:
    """Store each tensor split into ``parts`` chunks along ``dim``, chunk i in file i."""
    files: dict[str, bytearray] = {f"f{i}": bytearray() for i in range(parts)}
    tensors: dict[str, TensorRecord] = {}
    for fqn, t in full.items():
        rec = TensorRecord(shape=list(t.shape), dtype=dtype_to_st(t.dtype))
        pieces = split(t.shape[dim], parts) if t.dim() else [(0, 1)] + [(0, 0)] * (parts - 1)
        for i, (off, n) in enumerate(pieces):
            if n == 0:
                continue
            piece = t.narrow(dim, off, n) if t.dim() else t
            data = piece.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            blob = files[f"f{i}"]
            offsets = [0] * t.dim()
            lengths = list(t.shape)
            if t.dim():
                offsets[dim], lengths[dim] = off, n
            rec.chunks.append(
                ChunkRecord(
                    offsets=offsets,
                    lengths=lengths,
                    file=f"f{i}",
                    key=fqn,
                    byte_range=[len(blob), len(blob) + len(data)],
                    block_crc32=[0] * (-(-len(data) // block)),
                )
            )
            blob += data
        tensors[fqn] = rec
    manifest = Manifest(
        step=1,
        world_size=parts,
        created_unix=0.0,
        library_version="test",
        tensors=tensors,
        files={k: FileRecord(size=len(v), crc32=0, rank=i) for i, (k, v) in enumerate(files.items())},
        checksum_block_bytes=block,
    )
    return manifest, {k: bytes(v) for k, v in files.items()}


def wanted_piece(fqn: str, full: torch.Tensor, dim: int, off: int, n: int) -> TensorItem:
    offsets = [0] * full.dim()
    lengths = list(full.shape)
    offsets[dim], lengths[dim] = off, n
    return TensorItem(
        key=key(fqn, tuple(offsets), tuple(lengths)),
        global_shape=tuple(full.shape),
        dtype=dtype_to_st(full.dtype),
        tensor=torch.full(lengths, -7, dtype=full.dtype),
        replicated=False,
    )


def execute(manifest: Manifest, files: dict[str, bytes], wanted: list[TensorItem]) -> int:
    """Run the read plan against in-memory files; returns the bytes read."""
    by_key = {w.key: w for w in wanted}
    nread = 0
    for req in plan_reads(manifest, wanted):
        lo, hi = req.read_range
        assert req.chunk_byte_range[0] <= lo < hi <= req.chunk_byte_range[1]
        buf = torch.frombuffer(bytearray(files[req.file][lo:hi]), dtype=torch.uint8)
        nread += hi - lo
        src = chunk_view(buf, req.dtype, req.chunk_lengths, req.chunk_byte_range[0], req.read_range, req.src_slices)
        by_key[req.dst].tensor[tuple(slice(a, b) for a, b in req.dst_slices)].copy_(src)
    return nread


# --------------------------------------------------------------------------- dtype names
def test_dtype_names_round_trip_and_reject_unknown():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64):
        assert st_to_dtype(dtype_to_st(dt)) is dt
    assert dtype_to_st(torch.bfloat16) == "BF16" and dtype_to_st(torch.bool) == "BOOL"
    with pytest.raises(TypeError, match="complex64"):
        dtype_to_st(torch.complex64)
    with pytest.raises(IncompatibleCheckpointError, match="C99"):
        st_to_dtype("C99")


# --------------------------------------------------------------------------- assign_writers
def test_assign_writers_nonreplicated_stays_with_owner():
    ranks = [[(key("w", (r * 2, 0), (2, 4)), 32, False)] for r in range(3)]
    assert assign_writers(ranks) == [[key("w", (0, 0), (2, 4))], [key("w", (2, 0), (2, 4))], [key("w", (4, 0), (2, 4))]]


def test_assign_writers_each_replicated_piece_once_and_balanced():
    rng = random.Random(1)
    sizes = [rng.randint(1, 1000) for _ in range(60)]
    items = [(key(f"p{i}", (0,), (s,)), s, True) for i, s in enumerate(sizes)]
    for world in (1, 2, 3, 4, 7):
        plan = assign_writers([list(items) for _ in range(world)])
        written = list(itertools.chain.from_iterable(plan))
        assert sorted(written, key=lambda k: k.fqn) == sorted((k for k, _, _ in items), key=lambda k: k.fqn)
        assert len(written) == len(set(written))
        loads = [sum(k.lengths[0] for k in mine) for mine in plan]
        ideal = sum(sizes) / world
        assert max(loads) <= ideal + max(sizes), (world, loads)
        assert min(loads) >= ideal - max(sizes), (world, loads)


def test_assign_writers_is_deterministic_under_input_order():
    items = [(key(f"p{i}", (0,), (i + 1,)), (i + 1) * 4, True) for i in range(20)]
    a = assign_writers([items, items, items])
    shuffled = list(items)
    random.Random(3).shuffle(shuffled)
    b = assign_writers([shuffled, shuffled, shuffled])
    assert [set(x) for x in a] == [set(x) for x in b]
    assert a == assign_writers([items, items, items])


def test_assign_writers_replicated_only_to_holders_and_accounts_owned_bytes():
    # Rank 0 already owns a large shard; the replicated piece held by ranks 0 and 1 must go to rank 1.
    big = key("shard", (0,), (100,))
    rep = key("bias", (0,), (10,))
    plan = assign_writers([[(big, 400, False), (rep, 40, True)], [(rep, 40, True)], [(key("x", (0,), (1,)), 4, False)]])
    assert plan == [[big], [rep], [key("x", (0,), (1,))]]


def test_assign_writers_hsdp_like_duplicates_written_once():
    # Mesh (replicate=2, shard=2): ranks 0/2 hold shard 0, ranks 1/3 hold shard 1 (replicated=True).
    s0, s1 = key("w", (0,), (4,)), key("w", (4,), (4,))
    plan = assign_writers([[(s0, 16, True)], [(s1, 16, True)], [(s0, 16, True)], [(s1, 16, True)]])
    assert sorted(itertools.chain.from_iterable(plan), key=lambda k: k.offsets) == [s0, s1]
    assert sum(len(p) for p in plan) == 2


def test_assign_writers_empty_pieces():
    # Uneven split of 2 rows over 4 ranks: ranks 2 and 3 hold the same empty key; nobody writes it.
    e = key("w", (2, 0), (0, 3))
    plan = assign_writers([[(key("w", (0, 0), (1, 3)), 12, False)], [(key("w", (1, 0), (1, 3)), 12, False)], [(e, 0, False)], [(e, 0, False)]])
    assert plan[2] == [] and plan[3] == []
    # A tensor with zero elements still gets exactly one (empty) piece so it appears in the manifest.
    z = key("z", (0,), (0,))
    plan = assign_writers([[(z, 0, False)], [(z, 0, False)]])
    assert sum(len(p) for p in plan) == 1


def test_assign_writers_rejects_inconsistent_ranks():
    k = key("w", (0,), (4,))
    with pytest.raises(ValueError, match="claimed"):
        assign_writers([[(k, 16, False)], [(k, 16, False)]])
    with pytest.raises(ValueError, match="replicated"):
        assign_writers([[(k, 16, False)], [(k, 16, True)]])
    with pytest.raises(ValueError, match="bytes"):
        assign_writers([[(k, 16, True)], [(k, 8, True)]])


# --------------------------------------------------------------------------- validate_tiling
def test_validate_tiling_accepts_good_and_rejects_overlap_hole_bounds_bytes():
    full = {"w": torch.arange(30, dtype=torch.float32).reshape(10, 3)}
    manifest, _ = sharded_manifest(full, 4)
    validate_tiling(manifest)

    chunks = manifest.tensors["w"].chunks
    orig = [ChunkRecord.from_json(c.to_json()) for c in chunks]

    chunks[1].offsets = [2, 0]  # overlaps chunk 0 and leaves a hole
    with pytest.raises(CorruptCheckpointError, match="'w'.*overlap"):
        validate_tiling(manifest)
    manifest.tensors["w"].chunks = [orig[0], orig[1], orig[3]]
    with pytest.raises(CorruptCheckpointError, match="no chunk covers element \\(6, 0\\)"):
        validate_tiling(manifest)
    bad = ChunkRecord.from_json(orig[3].to_json())
    bad.lengths = [5, 3]
    manifest.tensors["w"].chunks = [orig[0], orig[1], orig[2], bad]
    with pytest.raises(CorruptCheckpointError, match="outside"):
        validate_tiling(manifest)
    bad = ChunkRecord.from_json(orig[3].to_json())
    bad.byte_range = [bad.byte_range[0], bad.byte_range[1] - 4]
    manifest.tensors["w"].chunks = [orig[0], orig[1], orig[2], bad]
    with pytest.raises(CorruptCheckpointError, match="byte_range"):
        validate_tiling(manifest)
    bad = ChunkRecord.from_json(orig[3].to_json())
    bad.block_crc32 = []
    manifest.tensors["w"].chunks = [orig[0], orig[1], orig[2], bad]
    with pytest.raises(CorruptCheckpointError, match="block checksums"):
        validate_tiling(manifest)


def test_validate_tiling_2d_grid():
    t = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    rec = TensorRecord(shape=[6, 8], dtype="F32")
    pos = 0
    for (r0, rn), (c0, cn) in itertools.product([(0, 4), (4, 2)], [(0, 3), (3, 5)]):
        rec.chunks.append(ChunkRecord(offsets=[r0, c0], lengths=[rn, cn], file="f", key="t", byte_range=[pos, pos + rn * cn * 4], block_crc32=[0] * (-(-rn * cn * 4 // 16))))
        pos += rn * cn * 4
    m = Manifest(step=1, world_size=4, created_unix=0, library_version="t", tensors={"t": rec}, files={"f": FileRecord(size=pos, crc32=0, rank=0)}, checksum_block_bytes=16)
    validate_tiling(m)
    assert t.numel() == 48


# --------------------------------------------------------------------------- plan_reads
@pytest.mark.parametrize("saved,loaded", [(4, 3), (3, 4), (4, 1), (1, 5), (2, 5), (5, 2), (4, 4), (3, 7)])
@pytest.mark.parametrize("dim", [0, 1])
def test_plan_reads_n_to_m_resharding_is_exact(saved, loaded, dim):
    full = {
        "w": torch.randn(11, 6, generator=torch.Generator().manual_seed(0)),
        "b": torch.arange(11, dtype=torch.int64),
        "h": torch.randn(5, 7, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    }
    manifest, files = sharded_manifest(full, saved, dim=0)
    for r in range(loaded):
        wanted = []
        for fqn, t in full.items():
            d = dim if t.dim() > dim else 0
            off, n = split(t.shape[d], loaded)[r]
            wanted.append(wanted_piece(fqn, t, d, off, n))
        execute(manifest, files, wanted)
        for w in wanted:
            expect = full[w.key.fqn][tuple(slice(o, o + n) for o, n in zip(w.key.offsets, w.key.lengths))]
            assert torch.equal(w.tensor, expect), (w.key, saved, loaded, dim)


def test_plan_reads_row_reshard_reads_only_owned_bytes():
    full = {"w": torch.randn(1000, 64)}
    manifest, files = sharded_manifest(full, 4)
    for off, n in split(1000, 3):
        w = wanted_piece("w", full["w"], 0, off, n)
        nread = execute(manifest, files, [w])
        assert nread == w.nbytes  # exactly 1.0x for a row reshard
        assert torch.equal(w.tensor, full["w"][off : off + n])


def test_plan_reads_column_piece_reads_minimal_span():
    full = {"w": torch.arange(40, dtype=torch.float32).reshape(4, 10)}
    manifest, files = sharded_manifest(full, 1)
    w = wanted_piece("w", full["w"], 1, 3, 2)
    (req,) = plan_reads(manifest, [w])
    assert req.src_slices == ((0, 4), (3, 5)) and req.dst_slices == ((0, 4), (0, 2))
    assert req.read_range == (3 * 4, (3 * 10 + 4 + 1) * 4)
    execute(manifest, files, [w])
    assert torch.equal(w.tensor, full["w"][:, 3:5])


def test_plan_reads_scalar_and_empty_pieces():
    full = {"step": torch.tensor(7.0), "w": torch.arange(6, dtype=torch.float32)}
    manifest, files = sharded_manifest(full, 2)
    scalar = TensorItem(key=key("step", (), ()), global_shape=(), dtype="F32", tensor=torch.tensor(0.0), replicated=True)
    empty = wanted_piece("w", full["w"], 0, 6, 0)
    reqs = plan_reads(manifest, [scalar, empty])
    assert [r.fqn for r in reqs] == ["step"]
    execute(manifest, files, [scalar, empty])
    assert scalar.tensor.item() == 7.0


def test_plan_reads_errors_name_the_tensor():
    full = {"w": torch.zeros(4, 2)}
    manifest, _ = sharded_manifest(full, 2)
    missing = TensorItem(key=key("nope", (0,), (2,)), global_shape=(2,), dtype="F32", tensor=torch.zeros(2), replicated=True)
    with pytest.raises(IncompatibleCheckpointError, match="'nope' is not in the checkpoint"):
        plan_reads(manifest, [missing])
    shape = TensorItem(key=key("w", (0, 0), (4, 3)), global_shape=(4, 3), dtype="F32", tensor=torch.zeros(4, 3), replicated=True)
    with pytest.raises(IncompatibleCheckpointError, match="'w' has shape \\(4, 2\\).*\\(4, 3\\)"):
        plan_reads(manifest, [shape])
    dtype = TensorItem(key=key("w", (0, 0), (4, 2)), global_shape=(4, 2), dtype="BF16", tensor=torch.zeros(4, 2, dtype=torch.bfloat16), replicated=True)
    with pytest.raises(IncompatibleCheckpointError, match="'w' has dtype F32.*BF16"):
        plan_reads(manifest, [dtype])
    # A hole in the stored chunks is corruption, reported for the piece that needs it.
    manifest.tensors["w"].chunks.pop()
    whole = TensorItem(key=key("w", (0, 0), (4, 2)), global_shape=(4, 2), dtype="F32", tensor=torch.zeros(4, 2), replicated=True)
    with pytest.raises(CorruptCheckpointError, match="'w' do not cover"):
        plan_reads(manifest, [whole])


# --------------------------------------------------------------------------- chunk_view
def test_c_strides():
    assert c_strides((4, 5, 6)) == (30, 6, 1)
    assert c_strides(()) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
def test_chunk_view_3d_subbox(dtype):
    chunk = (torch.arange(4 * 5 * 6) % 7).to(dtype).reshape(4, 5, 6)
    esz = chunk.element_size()
    base = 128  # chunk starts at byte 128 of the file
    file = bytes(base) + chunk.reshape(-1).view(torch.uint8).numpy().tobytes()
    src = ((1, 3), (2, 5), (1, 4))
    from checkpoint.plan import min_byte_range

    rr = min_byte_range(base, chunk.shape, src, esz)
    buf = torch.frombuffer(bytearray(file[rr[0] : rr[1]]), dtype=torch.uint8)
    view = chunk_view(buf, dtype, chunk.shape, base, rr, src)
    assert torch.equal(view, chunk[1:3, 2:5, 1:4])
    assert view.data_ptr() >= buf.data_ptr()  # a view into the buffer, not a copy
    assert rr[1] - rr[0] < chunk.numel() * esz


def test_chunk_view_scalar_and_misaligned_buffer():
    t = torch.tensor(3.5, dtype=torch.float64)
    raw = bytearray(1) + bytearray(t.reshape(1).view(torch.uint8).numpy().tobytes())
    buf = torch.frombuffer(raw, dtype=torch.uint8)[1:]  # storage offset 1: not 8-byte aligned
    v = chunk_view(buf, "F64", (), 0, (0, 8), ())
    assert v.shape == () and v.item() == 3.5


def test_chunk_view_rejects_bad_ranges():
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="spans"):
        chunk_view(buf, torch.float32, (4,), 0, (0, 16), ((0, 4),))
    with pytest.raises(ValueError, match="aligned"):
        chunk_view(buf, torch.float32, (4,), 0, (2, 10), ((1, 3),))
    with pytest.raises(ValueError, match="end after"):
        chunk_view(buf, torch.float32, (4,), 0, (0, 8), ((1, 3),))


def grid_manifest(t: torch.Tensor, row_parts: int, col_parts: int) -> tuple[Manifest, dict[str, bytes]]:
    """Store a 2-D tensor as a row_parts x col_parts grid of chunks (2-D sharding, e.g. FSDP x TP)."""
    blob = bytearray()
    rec = TensorRecord(shape=list(t.shape), dtype=dtype_to_st(t.dtype))
    for (r0, rn), (c0, cn) in itertools.product(split(t.shape[0], row_parts), split(t.shape[1], col_parts)):
        if rn == 0 or cn == 0:
            continue
        data = t[r0 : r0 + rn, c0 : c0 + cn].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        rec.chunks.append(ChunkRecord(offsets=[r0, c0], lengths=[rn, cn], file="g", key="t", byte_range=[len(blob), len(blob) + len(data)], block_crc32=[0] * (-(-len(data) // 16))))
        blob += data
    m = Manifest(step=1, world_size=row_parts * col_parts, created_unix=0, library_version="t", tensors={"t": rec}, files={"g": FileRecord(size=len(blob), crc32=0, rank=0)}, checksum_block_bytes=16)
    return m, {"g": bytes(blob)}


@pytest.mark.parametrize("rows,cols", [(3, 2), (1, 4), (4, 3)])
def test_plan_reads_from_2d_grid_chunks(rows, cols):
    t = torch.randn(13, 9, generator=torch.Generator().manual_seed(2))
    manifest, files = grid_manifest(t, rows, cols)
    validate_tiling(manifest)
    for dim, parts in ((0, 5), (1, 2), (0, 1)):
        for off, n in split(t.shape[dim], parts):
            w = wanted_piece("t", t, dim, off, n)
            execute(manifest, files, [w])
            assert torch.equal(w.tensor, t.narrow(dim, off, n))


def test_plan_reads_rejects_bad_byte_range_without_validate_tiling():
    manifest, _ = sharded_manifest({"w": torch.zeros(4, 2)}, 2)
    manifest.tensors["w"].chunks[1].byte_range = [0, 4]
    whole = TensorItem(key=key("w", (0, 0), (4, 2)), global_shape=(4, 2), dtype="F32", tensor=torch.zeros(4, 2), replicated=True)
    with pytest.raises(CorruptCheckpointError, match="'w'.*byte_range"):
        plan_reads(manifest, [whole])


@pytest.mark.timeout(30)
def test_planner_scales_to_many_ranks_and_tensors():
    # 512 ranks x 60 tensors row-sharded, loaded at 384 ranks: one rank's plan must stay cheap.
    saved, loaded, rows = 512, 384, 4096
    tensors = {}
    for i in range(60):
        rec = TensorRecord(shape=[rows, 8], dtype="BF16")
        for r, (off, n) in enumerate(split(rows, saved)):
            rec.chunks.append(ChunkRecord(offsets=[off, 0], lengths=[n, 8], file=f"f{r}", key=f"t{i}", byte_range=[i * n * 16, (i + 1) * n * 16], block_crc32=[0]))
        tensors[f"t{i}"] = rec
    files = {f"f{r}": FileRecord(size=60 * n * 16, crc32=0, rank=r) for r, (_, n) in enumerate(split(rows, saved))}
    m = Manifest(step=1, world_size=saved, created_unix=0, library_version="t", tensors=tensors, files=files, checksum_block_bytes=1 << 20)
    validate_tiling(m)
    off, n = split(rows, loaded)[100]
    wanted = [TensorItem(key=key(f"t{i}", (off, 0), (n, 8)), global_shape=(rows, 8), dtype="BF16", tensor=torch.zeros(n, 8, dtype=torch.bfloat16), replicated=False) for i in range(60)]
    reqs = plan_reads(m, wanted)
    assert sum(r.read_range[1] - r.read_range[0] for r in reqs) == n * 16 * 60
    items = [[(key(f"t{i}", (o, 0), (k, 8)), k * 16, False) for i in range(60)] for o, k in split(rows, saved)]
    plan = assign_writers(items)
    assert all(len(p) == 60 for p in plan)
