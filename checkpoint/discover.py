"""Find steps under a checkpoint root and tell good committed steps from debris and corruption.

Truth is the ``.commit`` marker of each step directory, not the ``latest`` hint: ``latest`` can lag
behind a commit (crash between the two) and is ignored when it disagrees with the markers.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

from checkpoint.api import (
    COMMIT_FILE,
    INDEX_FILE,
    JSON,
    MANIFEST_FILE,
    OBJECTS_FILE,
    RANK_OBJECTS_FORMAT,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CommitMarker,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    Manifest,
    parse_step_dir,
    step_dir,
)
from checkpoint.confine import parse_json
from checkpoint.plan import validate_tiling
from checkpoint.storage import Storage, is_transient

logger = logging.getLogger(__name__)

MARKER_MAX_BYTES = 64 << 10
"""Largest ``.commit`` marker read (ours are about 120 bytes): a marker is never read unbounded."""
CHECKSUMMED_JSON_FILES = (OBJECTS_FILE, INDEX_FILE)
"""The step's JSON files that the manifest's ``checksums`` cover (the per-rank files have their own records)."""


@dataclass(slots=True)
class StepListing:
    """Step directories under a root, split by whether their commit marker exists (ascending)."""

    committed: list[int]
    uncommitted: list[int]
    sizes: dict[int, int]
    """Total bytes of the files directly in each step directory."""
    unreadable: dict[int, str] = field(default_factory=dict)
    """Step directories that could not be listed (permission denied...): step -> the error. Neither committed
    nor uncommitted: never loaded, never deleted."""


def step_storage_error(exc: BaseException) -> bool:
    """True for a storage error that belongs to one step (permission denied on its directory or a file),
    which discovery skips; False for a transient one still failing after the retries (the storage itself
    is down: raised, so a job does not start over from an older step, or from scratch, during an outage)."""
    return isinstance(exc, CheckpointStorageError) and (exc.__cause__ is None or not is_transient(exc.__cause__))


def list_steps(storage: Storage) -> StepListing:
    committed: list[int] = []
    uncommitted: list[int] = []
    sizes: dict[int, int] = {}
    unreadable: dict[int, str] = {}
    for name, (kind, _) in storage.listdir("").items():
        step = parse_step_dir(name)
        if step is None or kind != "directory":
            continue
        try:
            entries = storage.listdir(name)
        except CheckpointStorageError as exc:
            if not step_storage_error(exc):
                raise
            logger.warning("skipping checkpoint step %d: its directory cannot be listed: %s", step, exc)
            unreadable[step] = str(exc)
            continue
        sizes[step] = sum(size for kind2, size in entries.values() if kind2 == "file")
        marker = entries.get(COMMIT_FILE)
        (committed if marker is not None and marker[0] == "file" else uncommitted).append(step)
    return StepListing(sorted(committed), sorted(uncommitted), sizes, unreadable)


def read_step_file(storage: Storage, rel: str, *, limit: int, what: str) -> bytes | bytearray:
    """Bytes of one small file of a step, at most ``limit`` of them; CorruptCheckpointError when it is missing,
    not a file or larger than ``limit`` (what names it in the message)."""
    try:
        raw = storage.read_bytes(rel, limit=limit)
    except CheckpointStorageError as exc:
        if isinstance(exc.__cause__, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            raise CorruptCheckpointError(f"{what} {storage.display(rel)} is missing or not a file", file=rel) from exc
        raise
    if len(raw) > limit:
        raise CorruptCheckpointError(f"{what} {storage.display(rel)} is larger than the {limit} bytes expected", file=rel)
    return raw


def read_commit_marker(storage: Storage, step: int) -> CommitMarker:
    rel = f"{step_dir(step)}/{COMMIT_FILE}"
    if not storage.exists(rel):
        raise CheckpointNotFoundError(
            f"step {step} is not committed at {storage.display(step_dir(step))} (no {COMMIT_FILE} marker)"
        )
    raw = read_step_file(storage, rel, limit=MARKER_MAX_BYTES, what="commit marker")
    data = parse_json(raw, f"commit marker {storage.display(rel)}", file=rel)
    try:
        marker = CommitMarker.from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"commit marker {storage.display(rel)} is unreadable: {exc!r}", file=rel) from exc
    if marker.step != step:
        raise CorruptCheckpointError(f"commit marker {storage.display(rel)} says step {marker.step}, expected {step}", file=rel)
    return marker


def read_manifest(storage: Storage, step: int, *, marker: CommitMarker | None = None) -> Manifest:
    """The manifest of a committed step, checked against its commit marker.

    Raises CheckpointNotFoundError (not committed), CorruptCheckpointError (unreadable or changed since
    the commit), IncompatibleCheckpointError (another format or version).
    """
    marker = marker or read_commit_marker(storage, step)
    rel = f"{step_dir(step)}/{MANIFEST_FILE}"
    if not storage.exists(rel):
        raise CorruptCheckpointError(f"step {step} is committed but {storage.display(rel)} is missing", file=rel)
    raw = read_step_file(storage, rel, limit=marker.manifest_size, what="manifest")  # the marker bounds the read
    data = parse_json(raw, f"manifest {storage.display(rel)}", file=rel)
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"manifest {storage.display(rel)} is not a JSON object", file=rel)
    if zlib.crc32(raw) != marker.manifest_crc32 or len(raw) != marker.manifest_size:
        raise CorruptCheckpointError(
            f"manifest {storage.display(rel)} does not match its commit marker (crc32/size differ): "
            f"it was modified or damaged after the commit",
            file=rel,
        )
    manifest = _parse_manifest(storage, rel, data)  # a version error (committed by a newer spotrun) says what to do
    if manifest.step != step:
        raise CorruptCheckpointError(f"manifest {storage.display(rel)} says step {manifest.step}, expected {step}", file=rel)
    return manifest


def _parse_manifest(storage: Storage, rel: str, data: dict[str, JSON]) -> Manifest:
    try:
        return Manifest.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"manifest {storage.display(rel)} is malformed: missing or bad field {exc!r}", file=rel) from exc


def check_files(storage: Storage, manifest: Manifest) -> None:
    """Every shard file and per-rank objects file of the manifest exists with the recorded size (cheap: one listing)."""
    rel = step_dir(manifest.step)
    present = storage.listdir(rel)
    expected = dict(manifest.checksums)
    for name, crec in sorted(expected.items()):
        entry = present.get(name)
        if entry is None or entry[0] != "file" or entry[1] != crec.size:
            problem = "is missing" if entry is None else f"has {entry[1]} bytes, the manifest says {crec.size}"
            raise CorruptCheckpointError(f"{storage.display(f'{rel}/{name}')} {problem} (step {manifest.step})", file=name)
    if manifest.has_objects and OBJECTS_FILE not in present:
        raise CorruptCheckpointError(
            f"{storage.display(f'{rel}/{OBJECTS_FILE}')} is missing (step {manifest.step} was saved with objects)",
            file=OBJECTS_FILE,
        )
    for name, rrec in sorted(manifest.rank_objects.items()):
        entry = present.get(name)
        if entry is None or entry[1] != rrec.size:
            problem = "is missing" if entry is None else f"has {entry[1]} bytes, the manifest says {rrec.size}"
            raise CorruptCheckpointError(
                f"per-rank objects file {storage.display(f'{rel}/{name}')} {problem} (step {manifest.step}, "
                f"written by rank {rrec.rank})",
                file=name,
            )
    for name, frec in sorted(manifest.files.items()):
        entry = present.get(name)
        if entry is None or entry[0] != "file":
            raise CorruptCheckpointError(
                f"shard {storage.display(f'{rel}/{name}')} is missing (step {manifest.step}, written by rank {frec.rank})",
                file=name,
            )
        if entry[1] != frec.size:
            raise CorruptCheckpointError(
                f"shard {storage.display(f'{rel}/{name}')} has {entry[1]} bytes, the manifest says {frec.size} "
                f"(truncated or overwritten)",
                file=name,
            )


def read_objects(storage: Storage, manifest: Manifest) -> dict[str, JSON]:
    if not manifest.has_objects:
        return {}
    rel = f"{step_dir(manifest.step)}/{OBJECTS_FILE}"
    raw = read_checksummed(storage, manifest, OBJECTS_FILE)
    data = parse_json(raw, storage.display(rel), file=rel)
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{storage.display(rel)} is not a JSON object", file=rel)
    return data


def read_checksummed(storage: Storage, manifest: Manifest, name: str) -> bytes | bytearray:
    """A JSON file of the step, checked against its size and crc32 in ``manifest.checksums`` (read whole and
    unchecked for manifests older than that field). CorruptCheckpointError when missing or different."""
    rel = f"{step_dir(manifest.step)}/{name}"
    rec = manifest.checksums.get(name)
    if rec is None:
        return read_step_file(storage, rel, limit=storage.size(rel) if storage.exists(rel) else 0, what="file")
    return read_checked(storage, rel, size=rec.size, crc32=rec.crc32, what="file", file=name)


def read_checked(storage: Storage, rel: str, *, size: int, crc32: int, what: str, file: str) -> bytes | bytearray:
    """Bytes of ``rel`` (at most ``size`` read); CorruptCheckpointError unless they have that size and crc32."""
    raw = read_step_file(storage, rel, limit=size, what=what)
    if len(raw) != size or zlib.crc32(raw) != crc32:
        raise CorruptCheckpointError(
            f"{what} {storage.display(rel)} fails its check: {len(raw)} bytes / crc32 {zlib.crc32(raw):08x}, the "
            f"manifest says {size} bytes / crc32 {crc32:08x} (changed after the commit)",
            file=file,
        )
    return raw


def read_rank_objects(storage: Storage, manifest: Manifest, saved_rank: int) -> dict[str, JSON]:
    """The per-rank entries saved by ``saved_rank``, read whole and checked against the manifest (size, crc32).

    CorruptCheckpointError (naming the file) when the file is missing, damaged or not what the manifest says;
    IncompatibleCheckpointError when the step has no per-rank state of that rank.
    """
    found = manifest.rank_objects_of(saved_rank)
    if found is None:
        have = sorted(r.rank for r in manifest.rank_objects.values())
        raise IncompatibleCheckpointError(
            f"step {manifest.step} holds no per-rank state of rank {saved_rank} "
            + (f"(per-rank files of ranks {have})" if have else "(it was saved without per-rank entries)")
            + "; remove the per-rank keys from the state or wrap them as PerRank(..., on_resize='skip')"
        )
    name, rec = found
    rel = f"{step_dir(manifest.step)}/{name}"
    raw = read_checked(storage, rel, size=rec.size, crc32=rec.crc32, what="per-rank objects file", file=name)
    doc = parse_json(raw, f"per-rank objects file {storage.display(rel)}", file=name)
    try:
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")
        got = (doc["format"], doc["rank"], doc["world_size"], doc["step"])
        want = (RANK_OBJECTS_FORMAT, saved_rank, manifest.world_size, manifest.step)
        if got != want or type(doc["rank"]) is not int or not isinstance(doc["objects"], dict):
            raise ValueError(
                f"(format, rank, world size, step) are {got}, expected {want}"
                if got != want
                else "bad rank or objects"
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"per-rank objects file {storage.display(rel)} is malformed: {exc}", file=name) from exc
    return doc["objects"]


def validate_step(storage: Storage, step: int) -> Manifest:
    """Manifest of ``step`` after the cheap checks (marker, manifest, chunks tile every tensor, files
    present with their sizes)."""
    manifest = read_manifest(storage, step)
    try:
        validate_tiling(manifest)
    except CorruptCheckpointError as exc:
        rel = f"{step_dir(step)}/{MANIFEST_FILE}"
        raise CorruptCheckpointError(
            f"manifest {storage.display(rel)} is inconsistent: {exc}", file=rel, tensor=exc.tensor
        ) from exc
    check_files(storage, manifest)
    return manifest


def latest_good_step(storage: Storage, *, listing: StepListing | None = None, below: int | None = None) -> int | None:
    """Newest committed step (older than ``below`` if given) that passes ``validate_step``; corrupt ones
    are skipped with a warning."""
    manifest = latest_good_manifest(storage, listing=listing, below=below)
    return None if manifest is None else manifest.step


def latest_good_manifest(
    storage: Storage, *, listing: StepListing | None = None, below: int | None = None
) -> Manifest | None:
    """``latest_good_step``'s choice as the manifest ``validate_step`` returned for it (a loader that goes on
    to read that step reuses it instead of validating the step twice)."""
    listing = listing or list_steps(storage)
    unreadable = {s: e for s, e in listing.unreadable.items() if below is None or s < below}
    for step in reversed(listing.committed):
        if below is not None and step >= below:
            continue
        try:
            return validate_step(storage, step)
        except CorruptCheckpointError as exc:
            logger.warning("skipping corrupt checkpoint step %d: %s", step, exc)
        except CheckpointNotFoundError as exc:  # deleted between the listing and now
            logger.warning("skipping vanished checkpoint step %d: %s", step, exc)
        except CheckpointStorageError as exc:  # one step's files refused (EACCES): an older step may load
            if not step_storage_error(exc):
                raise
            logger.warning("skipping unreadable checkpoint step %d: %s", step, exc)
            unreadable[step] = str(exc)
    if unreadable:
        # Starting from scratch (or an older run's state) over steps we could not read would silently lose
        # them: the user fixes the permissions, or removes those steps, instead.
        raise CheckpointStorageError(
            f"no readable committed checkpoint at {storage.display()}; steps that could not be read: "
            + "; ".join(f"step {s}: {e}" for s, e in sorted(unreadable.items()))
        )
    return None


def require_checkpoint(storage: Storage, listing: StepListing) -> None:
    """Raise CheckpointNotFoundError when the root holds no checkpoint at all (a clear first error)."""
    if not listing.committed and not listing.uncommitted:
        raise CheckpointNotFoundError(f"no checkpoint at {storage.display()}: no step-* directories found")
    if not listing.committed:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {storage.display()}: steps {listing.uncommitted} were never committed"
        )


def resolve_step(storage: Storage, step: int | None) -> Manifest:
    """Manifest of ``step`` (validated), or of the newest good step when None; errors name the location."""
    if step is not None:
        return validate_step(storage, step)
    listing = list_steps(storage)
    require_checkpoint(storage, listing)
    good = latest_good_manifest(storage, listing=listing)
    if good is None:
        raise CorruptCheckpointError(f"every committed step at {storage.display()} is corrupt: {listing.committed}")
    return good
