"""The checkpointer's configuration: one self-validating dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from checkpoint.api import CheckpointConfigError
from checkpoint.memory.config import MemoryTierConfig

_MIB = 1 << 20
_S3_MIN_PART = 5 * _MIB


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """How the :class:`~checkpoint.checkpointer.Checkpointer` saves, keeps and loads steps.

    Every field is keyword-only and checked on construction.

    Raises:
        CheckpointConfigError: a field has a wrong type or is out of range (the message names the field and
            the accepted values).
    """

    keep_last: int = 3
    """Keep the newest ``keep_last`` committed steps; older ones are deleted after each commit (>= 1)."""

    keep_every: int | None = None
    """Also keep forever every step divisible by ``keep_every`` (None: keep only the newest ``keep_last``)."""

    async_mode: bool = True
    """``save`` returns once the state is copied to host memory and writes in the background.
    False: ``save`` returns after the step is committed."""

    when_busy: Literal["wait", "refuse"] = "wait"
    """What ``save`` does while the previous save is still writing: ``"wait"`` for it, or
    ``"refuse"`` by raising :class:`~checkpoint.api.SaveInProgressError` (the caller skips this save)."""

    verify_on_load: bool = True
    """Check the crc32 of every checksum block a load reads (one crc32 pass over the bytes read; fast with the
    ``isal`` wheel, see docs/benchmarks.md)."""

    checksum_block_bytes: int = 1 * _MIB
    """Granularity of the per-chunk crc32 blocks: a ranged read verifies only the blocks it touches, so a
    resharded load reads up to one block too many at each end of every piece it takes from a saved chunk
    (smaller blocks read fewer extra bytes; docs/benchmarks.md gives the figures)."""

    max_retries: int | None = None
    """Attempts per storage operation for transient errors (connection reset, throttling, EIO), first
    included; None (default): no limit, retry until ``retry_timeout``. >= 1 (1 means no retry)."""

    retry_timeout: timedelta = timedelta(seconds=60)
    """Keep retrying one storage operation this long (random exponential back-off from 50 ms, capped at
    ``retry_max_wait``): a storage blip shorter than this costs a background save some time, nothing else."""

    retry_max_wait: timedelta = timedelta(seconds=8)
    """Upper bound of the random exponential back-off between two attempts."""

    max_consecutive_failed_saves: int = 3
    """A background save that fails (storage still failing after ``retry_timeout``, a permanent error such as
    disk full) is not committed, and its own partial step directory is removed at once (so a full disk is not
    filled further by every later attempt; no committed step is ever touched); it is reported (an ERROR log line, the Checkpointer's
    ``on_save_failure`` callback) and training goes on. Once this many saves in a row have failed, the next
    ``save`` raises the last error instead (>= 1; 1: raise at the first failure). ``wait`` and ``close``
    always raise the failure of the save they wait for."""

    collective_timeout: timedelta = timedelta(minutes=30)
    """Timeout of the checkpointer's own gloo groups (torch's default for gloo). A rank that stops
    answering (hung, or its node frozen) makes the other ranks' save fail with a CheckpointError after this
    long instead of hanging; it must exceed the slowest rank's shard write (large S3 uploads)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the fsspec filesystem, e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}`` for S3."""

    writer_threads: int = 4
    """Parallel shard writes / multipart part uploads per rank (>= 1)."""

    read_threads: int | None = None
    """Parallel ranged reads per rank on load. None: for local/POSIX storage one per CPU core (reads from
    the page cache are CPU-bound, so more threads than cores do not help), for remote storage
    ``writer_threads`` (reads wait on the network). A load whose reads span less than
    ``shard.SMALL_LOAD_BYTES`` (4 MiB) reads each file once on the calling thread instead."""

    writer: Literal["thread", "process"] = "thread"
    """Who writes the shards: a background ``"thread"`` of the training process, or a long-lived
    ``"process"`` per rank fed through shared memory (``/dev/shm``), which never competes with training
    for the GIL. ``"process"`` needs JSON-serialisable ``storage_options`` and cannot write ``memory://``."""

    writer_nice: int = 10
    """Background save threads run this many nice steps below the training thread (Linux per-thread
    nice), so on a busy CPU the save yields to training; 0 keeps the same priority (0..19)."""

    multipart_chunk_bytes: int = 64 * _MIB
    """S3 multipart part size (>= 5 MiB, the S3 minimum); files smaller than this are one PUT."""

    max_shard_bytes: int = 2 << 30
    """A rank splits what it writes into shard files of at most this many bytes (a single larger
    tensor gets a file of its own), so big ranks upload several files in parallel."""

    writeback_bytes: int = 32 * _MIB
    """Local/POSIX shards: start the kernel's writeback every this many bytes written
    (``sync_file_range``), so the disk works while the rest of the shard is written and the final
    ``fsync`` has little left to do; 0 leaves everything to ``fsync``. Does not change durability."""

    check_location: bool = True
    """When the Checkpointer is created, every rank writes a small probe file under the root, reads it back and
    removes it (``checkpoint.location``), so a read-only filesystem, a missing permission or a missing S3 bucket
    fails at start with one line naming the location, not at the first save (or silently, in a run shorter than
    the save interval). False skips it (a root that is only ever read)."""

    memory: MemoryTierConfig | None = None
    """The memory tier (``checkpoint.memory``), off when None. With it, under the spotrun agent,
    :meth:`~checkpoint.checkpointer.Checkpointer.snapshot` (which ``elastic.preemption.Preemption.save_and_stop``
    calls at every step) copies the state into the node's host shared memory every ``memory.every`` steps,
    ``load()`` restores the newest snapshot every rank can read before the durable tier, and a failed collective
    leaving the ``with Checkpointer(...)`` block snapshots the last completed step just in time. Outside spotrun
    (no keeper directory) it is off, said once. ``MemoryTierConfig(every="auto")`` is a good start."""

    def __post_init__(self) -> None:
        self._check_int("keep_last", self.keep_last, 1, "keep at least the newest step")
        if self.keep_every is not None:
            self._check_int("keep_every", self.keep_every, 1, "use None to disable, or a step interval >= 1")
        if self.writer not in ("thread", "process"):
            raise CheckpointConfigError(f'writer={self.writer!r} is invalid: use "thread" or "process"')
        if self.when_busy not in ("wait", "refuse"):
            raise CheckpointConfigError(f'when_busy={self.when_busy!r} is invalid: use "wait" or "refuse"')
        for name in ("async_mode", "verify_on_load", "check_location"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        self._check_int("checksum_block_bytes", self.checksum_block_bytes, 4096, "use e.g. 1 MiB (1048576)")
        if self.max_retries is not None:
            self._check_int("max_retries", self.max_retries, 1, "1 means no retry, None retries until retry_timeout")
        self._check_int(
            "max_consecutive_failed_saves", self.max_consecutive_failed_saves, 1,
            "how many failed saves in a row training tolerates; 1 raises at the first",
        )
        self._check_int("writer_threads", self.writer_threads, 1, "use 1 for sequential writes")
        if self.read_threads is not None:
            self._check_int("read_threads", self.read_threads, 1, "use None for the default, 1 for sequential reads")
        self._check_int("writer_nice", self.writer_nice, 0, "0 disables, 19 is the lowest priority")
        if self.writer_nice > 19:
            raise CheckpointConfigError(f"writer_nice={self.writer_nice} is invalid: use 0..19")
        self._check_int(
            "multipart_chunk_bytes", self.multipart_chunk_bytes, _S3_MIN_PART, "S3 rejects parts under 5 MiB"
        )
        self._check_int("writeback_bytes", self.writeback_bytes, 0, "0 disables, e.g. 32 MiB (33554432)")
        self._check_int("max_shard_bytes", self.max_shard_bytes, _MIB, "use at least 1 MiB, e.g. 2 GiB")
        for name in ("retry_timeout", "retry_max_wait", "collective_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value.total_seconds() <= 0:
                raise CheckpointConfigError(f"{name}={value!r} must be a positive datetime.timedelta")
        if self.memory is not None and not isinstance(self.memory, MemoryTierConfig):
            raise CheckpointConfigError(
                f"memory={self.memory!r} is invalid: use None (off) or checkpoint.memory.MemoryTierConfig(...)"
            )
        if not isinstance(self.storage_options, dict):
            raise CheckpointConfigError(
                f"storage_options must be a dict of fsspec options, got {type(self.storage_options).__name__}"
            )

    @staticmethod
    def _check_int(name: str, value: object, minimum: int, hint: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise CheckpointConfigError(f"{name}={value!r} is invalid: it must be an integer >= {minimum} ({hint})")
