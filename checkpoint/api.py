"""Contracts of the checkpoint subsystem: on-disk format records, the item records the
planner and the writer exchange, and the error tree (defined in ``checkpoint.errors``, a leaf; re-exported here).

Data flow (one module each): state dict -> ``state`` (flatten into items) -> ``plan``
(who writes what; who reads which byte ranges) -> ``staging`` (host copy) -> ``writer``
(safetensors shards through ``storage``) -> ``commit`` (manifest, marker, ``latest``).
Load runs it backwards: ``discover`` (latest committed step) -> ``plan`` -> ranged reads ->
``state`` (copy into the live tensors / DTensor shards).

Everything here is plain data: it is JSON-serialisable through ``to_json``/``from_json``
and never pickled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from checkpoint.confine import check_name
from checkpoint.errors import CheckpointConfigError as CheckpointConfigError
from checkpoint.errors import CheckpointError as CheckpointError
from checkpoint.errors import CheckpointNotFoundError as CheckpointNotFoundError
from checkpoint.errors import CheckpointStorageError as CheckpointStorageError
from checkpoint.errors import CorruptCheckpointError as CorruptCheckpointError
from checkpoint.errors import IncompatibleCheckpointError as IncompatibleCheckpointError
from checkpoint.errors import SaveInProgressError as SaveInProgressError
from checkpoint.errors import UnsafePathError as UnsafePathError

FORMAT_NAME = "spotrun-checkpoint"
FORMAT_VERSION = 1

MANIFEST_FILE = "manifest.json"
"""Per step directory: the manifest (written after every shard is durable)."""
COMMIT_FILE = ".commit"
"""Per step directory: the commit marker, written last. A step without it does not exist."""
INDEX_FILE = "model.safetensors.index.json"
"""Per step directory: Hugging Face-style ``{"metadata": ..., "weight_map": {fqn: file}}``."""
OBJECTS_FILE = "objects.json"
"""Per step directory: rank 0's non-tensor state (shared step counters, hyperparameters) as JSON."""
RANK_OBJECTS_FORMAT = "spotrun-rank-objects"
"""``format`` field of a per-rank objects file (``objects-00003-of-00004.json``)."""
RANK_OBJECTS_MAX_BYTES = 64 << 20
"""Largest per-rank objects file a save accepts: per-rank state is for small values (RNG, sampler)."""
LATEST_FILE = "latest"
"""At the checkpoint root: the name of the newest committed step directory."""

STEP_DIR_FORMAT = "step-{step:09d}"

JSON = Any


# --------------------------------------------------------------------------- items (state -> plan -> writer)
@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Identifies one rectangular piece of a global tensor."""

    fqn: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(slots=True)
class ShardEntry:
    """One tensor piece in a shard file; ``offset`` is relative to the start of the data region."""

    name: str
    key: ChunkKey
    global_shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    item_index: int  # index into the rank's written-items list (the staging source)


@dataclass(slots=True)
class ShardLayout:
    """A shard file fully planned before writing: header bytes and every entry's place."""

    file: str
    entries: list[ShardEntry]
    header: bytes  # the 8-byte length prefix plus the padded JSON header
    data_bytes: int

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes

    def signature(self) -> tuple[Any, ...]:
        return (self.file, self.data_bytes, tuple((e.name, e.dtype, e.offset, e.nbytes) for e in self.entries))


@dataclass(slots=True)
class TensorItem:
    """One local piece of a tensor as held by this rank.

    ``tensor`` is the live local data (``shape == key.lengths``). ``replicated`` is True when every
    rank holds an identical copy of this piece (DDP parameters, plain tensors): the planner then
    has exactly one rank write it, spreading replicated bytes evenly across ranks.
    """

    key: ChunkKey
    global_shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "F32", "BF16", "I64", ...
    tensor: Any  # torch.Tensor (kept Any so this module imports without torch)
    replicated: bool

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel() * self.tensor.element_size())


# --------------------------------------------------------------------------- strict JSON fields
# Records are read from files anyone with write access to the root can change: every field is checked for
# its JSON type and range here (TypeError/ValueError, which the readers turn into CorruptCheckpointError),
# so no later step sees a float shape, a bool size, a list where a mapping belongs or a 2**70 offset.
_MAX_INT = (1 << 63) - 1


def _obj(v: JSON, what: str) -> dict[str, JSON]:
    if not isinstance(v, dict):
        raise TypeError(f"{what} must be a JSON object, not {type(v).__name__}")
    return v


def _int(v: JSON, what: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(v) is not int:  # bool is an int subclass: excluded, as are floats and strings
        raise TypeError(f"{what}={v!r} must be an integer")
    if not lo <= v <= hi:
        raise ValueError(f"{what}={v} is out of range [{lo}, {hi}]")
    return v


def _list(v: JSON, what: str) -> list[JSON]:
    if not isinstance(v, list):
        raise TypeError(f"{what} must be a list, not {type(v).__name__}")
    return v


def _ints(v: JSON, what: str, lo: int = 0) -> list[int]:
    return [_int(x, what, lo) for x in _list(v, what)]


def _str(v: JSON, what: str) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{what}={v!r} must be a string")
    return v


def _num(v: JSON, what: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise TypeError(f"{what}={v!r} must be a finite number")
    return float(v)


def _crc(v: JSON, what: str) -> int:
    return _int(v, what, 0, 0xFFFFFFFF)


def _file_name(v: JSON, what: str) -> str:
    return check_name(v, what=what)


# --------------------------------------------------------------------------- on-disk records
@dataclass(slots=True)
class ChunkRecord:
    """Where one piece of a tensor lives: file, tensor name inside it, absolute byte range."""

    offsets: list[int]
    lengths: list[int]
    file: str
    key: str  # tensor name inside the safetensors file
    byte_range: list[int]  # [start, end) absolute in the file
    block_crc32: list[int]
    """zlib.crc32 of each ``Manifest.checksum_block_bytes`` block of the chunk's bytes (blocks counted
    from the chunk's start, last one short): a ranged read verifies only the blocks it touches."""

    def to_json(self) -> dict[str, JSON]:
        return {
            "offsets": self.offsets,
            "lengths": self.lengths,
            "file": self.file,
            "key": self.key,
            "byte_range": self.byte_range,
            "block_crc32": self.block_crc32,
        }

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> ChunkRecord:
        d = _obj(d, "chunk")
        rec = cls(
            offsets=_ints(d["offsets"], "chunk offsets"),
            lengths=_ints(d["lengths"], "chunk lengths"),
            file=_file_name(d["file"], "chunk file"),
            key=_str(d["key"], "chunk key"),
            byte_range=_ints(d["byte_range"], "chunk byte_range"),
            block_crc32=[_crc(x, "chunk block_crc32") for x in _ints(d["block_crc32"], "chunk block_crc32")],
        )
        if len(rec.offsets) != len(rec.lengths) or len(rec.byte_range) != 2 or rec.byte_range[0] > rec.byte_range[1]:
            raise ValueError(f"chunk of {rec.file}: offsets/lengths of different rank or bad byte_range {rec.byte_range}")
        return rec


@dataclass(slots=True)
class TensorRecord:
    """A global tensor: shape, dtype and the chunks that tile it (no overlaps, full cover)."""

    shape: list[int]
    dtype: str
    chunks: list[ChunkRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, JSON]:
        return {"shape": self.shape, "dtype": self.dtype, "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> TensorRecord:
        d = _obj(d, "tensor")
        return cls(
            shape=_ints(d["shape"], "tensor shape"),
            dtype=_str(d["dtype"], "tensor dtype"),
            chunks=[ChunkRecord.from_json(c) for c in _list(d["chunks"], "tensor chunks")],
        )


@dataclass(slots=True)
class FileRecord:
    """One shard file: its size, whole-file checksum and the rank that wrote it."""

    size: int
    crc32: int
    rank: int

    def to_json(self) -> dict[str, JSON]:
        return {"size": self.size, "crc32": self.crc32, "rank": self.rank}

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> FileRecord:
        d = _obj(d, "file record")
        return cls(size=_int(d["size"], "file size"), crc32=_crc(d["crc32"], "file crc32"), rank=_int(d["rank"], "file rank"))


@dataclass(slots=True)
class ChecksumRecord:
    """Size and whole-file crc32 of one JSON file of a step (``objects.json``, the index): in ``Manifest.checksums``."""

    size: int
    crc32: int

    def to_json(self) -> dict[str, JSON]:
        return {"size": self.size, "crc32": self.crc32}

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> ChecksumRecord:
        d = _obj(d, "checksum record")
        return cls(size=_int(d["size"], "checksum size"), crc32=_crc(d["crc32"], "checksum crc32"))


@dataclass(slots=True)
class RankObjectsRecord:
    """One rank's per-rank objects file (``PerRank`` entries): size, whole-file crc32, rank, top-level keys."""

    size: int
    crc32: int
    rank: int
    keys: list[str]

    def to_json(self) -> dict[str, JSON]:
        return {"size": self.size, "crc32": self.crc32, "rank": self.rank, "keys": sorted(self.keys)}

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> RankObjectsRecord:
        d = _obj(d, "per-rank objects record")
        return cls(
            size=_int(d["size"], "per-rank size"),
            crc32=_crc(d["crc32"], "per-rank crc32"),
            rank=_int(d["rank"], "per-rank rank"),
            keys=[_str(k, "per-rank key") for k in _list(d["keys"], "per-rank keys")],
        )


@dataclass(slots=True)
class Manifest:
    """The whole description of one committed step (``manifest.json``)."""

    step: int
    world_size: int
    created_unix: float
    library_version: str
    tensors: dict[str, TensorRecord]
    files: dict[str, FileRecord]
    has_objects: bool = False
    checksum_block_bytes: int = 1 << 20
    rank_objects: dict[str, RankObjectsRecord] = field(default_factory=dict)
    """Per-rank objects files by name (one per saving rank, or none); absent in manifests written before
    per-rank state existed, which still load (the field defaults to empty)."""
    checksums: dict[str, ChecksumRecord] = field(default_factory=dict)
    """Size and crc32 of the step's other JSON files (``objects.json``, ``model.safetensors.index.json``), so
    every file of a step is covered by a checksum; absent in older manifests, which still load unchecked."""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, JSON]:
        return {
            "format": self.format,
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "library_version": self.library_version,
            "has_objects": self.has_objects,
            "checksum_block_bytes": self.checksum_block_bytes,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            "rank_objects": {k: v.to_json() for k, v in sorted(self.rank_objects.items())},
            **({"checksums": {k: v.to_json() for k, v in sorted(self.checksums.items())}} if self.checksums else {}),
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
        }

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> Manifest:
        d = _obj(d, "manifest")
        if d.get("format") != FORMAT_NAME:
            # Committed by a marker yet not ours: damage (the step is skipped), unlike a newer version below.
            raise ValueError(f"not a spotrun checkpoint manifest (format={d.get('format')!r})")
        if d.get("version") != FORMAT_VERSION:
            raise IncompatibleCheckpointError(
                f"checkpoint format version {d.get('version')!r} is not supported by this spotrun "
                f"(supports {FORMAT_VERSION}); upgrade spotrun to read it"
            )
        has_objects = d.get("has_objects", False)
        if not isinstance(has_objects, bool):
            raise TypeError(f"has_objects={has_objects!r} must be true or false")
        manifest = cls(
            step=_int(d["step"], "step"),
            world_size=_int(d["world_size"], "world_size", 1),
            created_unix=_num(d["created_unix"], "created_unix"),
            library_version=_str(d["library_version"], "library_version"),
            has_objects=has_objects,
            checksum_block_bytes=_int(d["checksum_block_bytes"], "checksum_block_bytes", 1),
            files={_file_name(k, "shard file"): FileRecord.from_json(v) for k, v in _obj(d["files"], "files").items()},
            tensors={k: TensorRecord.from_json(v) for k, v in _obj(d["tensors"], "tensors").items()},
            rank_objects={
                _file_name(k, "per-rank objects file"): RankObjectsRecord.from_json(v)
                for k, v in _obj(d.get("rank_objects", {}), "rank_objects").items()
            },
            checksums={
                _file_name(k, "checksummed file"): ChecksumRecord.from_json(v)
                for k, v in _obj(d.get("checksums", {}), "checksums").items()
            },
        )
        ranks = [r.rank for r in manifest.files.values()] + [r.rank for r in manifest.rank_objects.values()]
        if any(rank >= manifest.world_size for rank in ranks):
            raise ValueError(f"a file of rank {max(ranks)} in a step saved by {manifest.world_size} ranks")
        return manifest

    def rank_objects_of(self, rank: int) -> tuple[str, RankObjectsRecord] | None:
        """The per-rank objects file saved by ``rank`` (name, record), or None."""
        for name, rec in self.rank_objects.items():
            if rec.rank == rank:
                return name, rec
        return None


@dataclass(slots=True)
class RankRecords:
    """What one rank wrote for a step (sent to rank 0 as JSON for the manifest)."""

    rank: int
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    error: str | None = None
    rank_objects: dict[str, RankObjectsRecord] = field(default_factory=dict)
    """This rank's per-rank objects file (at most one), written before the records are gathered."""

    def to_json(self) -> dict[str, JSON]:
        return {
            "rank": self.rank,
            "error": self.error,
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "files": {k: v.to_json() for k, v in self.files.items()},
            "rank_objects": {k: v.to_json() for k, v in self.rank_objects.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> RankRecords:
        return cls(
            rank=int(d["rank"]),
            error=d.get("error"),
            tensors={k: TensorRecord.from_json(v) for k, v in d["tensors"].items()},
            files={k: FileRecord.from_json(v) for k, v in d["files"].items()},
            rank_objects={k: RankObjectsRecord.from_json(v) for k, v in d.get("rank_objects", {}).items()},
        )


# --------------------------------------------------------------------------- writer protocol
@runtime_checkable
class ShardWriter(Protocol):
    """Writes one rank's shard files for a step; one implementation per ``CheckpointConfig.writer`` mode
    (``writer.ThreadWriter``, ``writer.ProcessWriter``), chosen once by ``writer.open_writer``.

    ``stage`` runs on the training thread (the only part of a save that blocks it); ``write`` runs on the
    Checkpointer's background thread, one step at a time.
    """

    def stage(self, layouts: Sequence[ShardLayout], items: Sequence[TensorItem]) -> list[memoryview]:
        """Copy ``items`` into the host buffers this writer reads; returns what ``write`` takes as ``buffers``."""
        ...

    def write(self, step_rel: str, layouts: Sequence[ShardLayout], buffers: Sequence[memoryview]) -> RankRecords:
        """Write the staged shard files under ``step_rel``, durable on return; raises on failure."""
        ...

    def close(self) -> None:
        """Release buffers, threads and processes (idempotent)."""
        ...


# --------------------------------------------------------------------------- save failures
@dataclass(frozen=True, slots=True)
class SaveFailure:
    """A background save that failed and was not committed, as the Checkpointer reports it (log line,
    ``on_save_failure``) while training goes on."""

    step: int
    """The step that was not saved (its directory stays uncommitted; retention removes it later)."""
    error: str
    """``Type: message`` of the error, the same on every rank for a failed commit."""
    consecutive: int
    """Saves failed in a row, this one included."""
    limit: int
    """``max_consecutive_failed_saves``: the save that finds ``consecutive >= limit`` raises instead."""
    last_committed: int | None
    """The newest step this Checkpointer committed (what a restart would load), None before the first."""

    def to_json(self) -> dict[str, JSON]:
        return {
            "step": self.step,
            "error": self.error,
            "consecutive": self.consecutive,
            "limit": self.limit,
            "last_committed": self.last_committed,
        }


# --------------------------------------------------------------------------- storage protocol
class Sink(Protocol):
    """A file being written: it becomes visible at its final name only on ``commit`` (nothing on ``abort``)."""

    def write(self, data: memoryview | bytes) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


@runtime_checkable
class StorageBackend(Protocol):
    """One kind of storage under a checkpoint root: ``backends.local`` (POSIX: local disk, FSx/Lustre),
    ``backends.s3`` (multipart), ``backends.generic`` (any other fsspec filesystem), chosen once from the
    location by ``storage.open_backend``; a wrapper (fault injection) is a backend around another one.

    Paths are relative to the root (``step-000000010/manifest.json``). Operations are single attempts:
    they raise the built-in ``OSError`` family as fsspec backends do (``FileNotFoundError``, EIO, ENOSPC) or
    botocore's errors, and :class:`UnsafePathError` for a path that would leave the root; the
    ``storage.Storage`` facade retries the transient ones and converts the rest.
    """

    is_local: bool
    """A POSIX file system read through the page cache: reads are CPU-bound (one read thread per core, no
    prefetch) and ``read_into`` reports pieces as they arrive. False for object stores and other fsspec."""

    def full(self, rel: str = "") -> str:
        """The path of ``rel`` as this backend names it; UnsafePathError when ``rel`` would leave the root."""
        ...

    def display(self, rel: str = "") -> str:
        """``rel`` as a user would type it (keeps the protocol of remote roots); never raises."""
        ...

    def exists(self, rel: str) -> bool: ...
    def size(self, rel: str) -> int: ...

    def listdir(self, rel: str) -> dict[str, tuple[str, int]]:
        """Entries of directory ``rel``: name -> (``"file"`` | ``"directory"``, size); a missing one is empty.
        Local backends leave out symlinks and special files."""
        ...

    def read_range(self, rel: str, start: int, end: int | None) -> bytes | bytearray:
        """Bytes ``[start, end)`` of ``rel`` (``end`` None: to the end); fewer when the file is shorter."""
        ...

    def read_into(
        self, rel: str, start: int, out: memoryview, piece_bytes: int, on_piece: Callable[[int, int], None] | None
    ) -> int:
        """Read ``len(out)`` bytes from ``start`` into ``out``, calling ``on_piece(offset, n)`` per completed
        piece (see ``Storage.read_into``); returns the bytes read."""
        ...

    def makedirs(self, rel: str) -> None: ...

    def open_sink(self, rel: str) -> Sink:
        """A Sink for ``rel``: atomic (whole file visible on ``commit``, durable where the medium allows)."""
        ...

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        """Delete a file or a directory tree; missing is fine."""
        ...

    def close(self) -> None:
        """Release threads (idempotent)."""
        ...


@runtime_checkable
class BackendWrapper(Protocol):
    """An fsspec filesystem class that, as the outer layer of a chained location (``chaos::file:///data``),
    wraps the backend the inner location chooses instead of being reached through fsspec, so the inner
    backend's own code (atomic local sink, S3 multipart) runs underneath (``elastic.chaos.storage``)."""

    @classmethod
    def wrap_backend(cls, inner: StorageBackend, options: dict[str, Any]) -> StorageBackend:
        """``inner`` wrapped; ``options`` are the storage options keyed by this layer's protocol."""
        ...


# --------------------------------------------------------------------------- read plan
@dataclass(frozen=True, slots=True)
class ReadRequest:
    """One ranged read and where its bytes go.

    ``read_range`` is the smallest contiguous absolute byte range of ``file`` that holds every element of
    ``src_slices`` of the stored chunk (the chunk occupies ``chunk_byte_range`` and is C-contiguous of shape
    ``chunk_lengths``). The reader widens it to checksum-block boundaries when verifying, views the bytes
    with the chunk's strides (``torch.as_strided``), takes ``src_slices`` and copies them into
    ``dst_slices`` of the destination local piece ``dst``.
    """

    file: str
    fqn: str
    dtype: str
    chunk_byte_range: tuple[int, int]
    chunk_lengths: tuple[int, ...]
    block_crc32: tuple[int, ...]
    read_range: tuple[int, int]
    src_slices: tuple[tuple[int, int], ...]  # per dim [start, stop) within the stored chunk
    dst: ChunkKey
    dst_slices: tuple[tuple[int, int], ...]  # per dim [start, stop) within the destination piece


# --------------------------------------------------------------------------- names (additive)
STEP_DIR_PREFIX = "step-"


def step_dir(step: int) -> str:
    """Directory name of ``step`` under the checkpoint root (``step-000001000``)."""
    return STEP_DIR_FORMAT.format(step=step)


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory."""
    if not name.startswith(STEP_DIR_PREFIX):
        return None
    digits = name[len(STEP_DIR_PREFIX) :]
    if not (digits.isascii() and digits.isdigit()):  # str.isdigit alone accepts "²" and other non-ASCII digits
        return None
    step = int(digits)
    return step if name == step_dir(step) else None  # only the canonical spelling names a step


def shard_file_name(rank: int, world_size: int, part: int = 0) -> str:
    """Name of a rank's shard file: ``shard-00003-of-00004.safetensors`` (``...-part-001`` for extra parts)."""
    base = f"shard-{rank:05d}-of-{world_size:05d}"
    return f"{base}.safetensors" if part == 0 else f"{base}-part-{part:03d}.safetensors"


def rank_objects_file_name(rank: int, world_size: int) -> str:
    """Name of a rank's per-rank objects file: ``objects-00003-of-00004.json`` (like its shard files)."""
    return f"objects-{rank:05d}-of-{world_size:05d}.json"


ON_RESIZE_RULES = ("rank_modulo", "rank0", "skip")
"""What a ``PerRank`` entry loads when the world size changed since the save (see ``per_rank_source``)."""


@dataclass(slots=True)
class CommitMarker:
    """Content of ``.commit``: written last; ties the step to the exact manifest bytes it commits."""

    step: int
    manifest_crc32: int
    manifest_size: int
    created_unix: float

    def to_json(self) -> dict[str, JSON]:
        return {
            "step": self.step,
            "manifest_crc32": self.manifest_crc32,
            "manifest_size": self.manifest_size,
            "created_unix": self.created_unix,
        }

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> CommitMarker:
        d = _obj(d, "commit marker")
        return cls(
            step=_int(d["step"], "step"),
            manifest_crc32=_crc(d["manifest_crc32"], "manifest_crc32"),
            manifest_size=_int(d["manifest_size"], "manifest_size"),
            created_unix=_num(d["created_unix"], "created_unix"),
        )
