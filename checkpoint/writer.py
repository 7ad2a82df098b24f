"""Background writer: a rank's staged buffers -> its safetensors shard files, durable, with their records.

The two implementations of ``api.ShardWriter``, chosen once per Checkpointer by ``open_writer``:

* ``ThreadWriter`` (``writer="thread"``): stages into private host buffers; the Checkpointer's background
  thread calls ``write_rank_files`` in this process.
* ``ProcessWriter`` (``writer="process"``): stages into file-backed shared memory and asks a long-lived
  child process (``python -m checkpoint.writer``, ``_serve`` below) to write them, so the writes never
  compete with training for the GIL. Client and child talk JSON lines over pipes; the child opens its
  storage from the same ``StorageSpec`` the Checkpointer opened its own from.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from checkpoint._sys.procutil import arm_parent_death_signal
from checkpoint.api import (
    JSON,
    CheckpointConfigError,
    CheckpointError,
    CheckpointStorageError,
    ChunkKey,
    ChunkRecord,
    FileRecord,
    RankRecords,
    ShardWriter,
    TensorItem,
    TensorRecord,
    shard_file_name,
)
from checkpoint.config import CheckpointConfig
from checkpoint.faults import crash_point
from checkpoint.shard import ShardEntry, ShardLayout, build_layout, write_shard
from checkpoint.staging import Stager
from checkpoint.storage import Sink, Storage, StorageSpec, lower_thread_priority

logger = logging.getLogger(__name__)


def plan_files(
    items: Sequence[TensorItem],
    write_indices: Sequence[int],
    *,
    rank: int,
    world_size: int,
    max_shard_bytes: int,
) -> list[ShardLayout]:
    """Group the items this rank writes into shard files of at most ``max_shard_bytes`` (pure)."""
    parts: list[list[int]] = []
    size = 0
    for index in sorted(write_indices, key=lambda i: (items[i].key.fqn, items[i].key.offsets)):
        nbytes = items[index].nbytes
        if not parts or (size + nbytes > max_shard_bytes and parts[-1]):
            parts.append([])
            size = 0
        parts[-1].append(index)
        size += nbytes
    layouts = []
    for part, indices in enumerate(parts):
        pieces = [
            (i, items[i].key, tuple(items[i].global_shape), items[i].dtype, items[i].nbytes) for i in indices
        ]
        layouts.append(build_layout(shard_file_name(rank, world_size, part), pieces))
    return layouts


def _write_one(
    storage: Storage,
    step_rel: str,
    layout: ShardLayout,
    data: memoryview,
    block_bytes: int,
    rank: int,
    crc_pool: Executor | None,
) -> tuple[FileRecord, list[tuple[ShardEntry, ChunkRecord]]]:
    rel = f"{step_rel}/{layout.file}"

    def produce(sink: Sink) -> tuple[FileRecord, list[tuple[ShardEntry, ChunkRecord]]]:
        crash_point("shard.open")
        result = write_shard(sink, layout, data, block_bytes, rank=rank, crc_pool=crc_pool)
        crash_point("shard.before_commit")
        return result

    result = storage.write_stream(rel, produce)
    crash_point("shard.after_commit")
    logger.debug("rank %d wrote %s (%d bytes)", rank, storage.display(rel), layout.size)
    return result


def write_rank_files(
    storage: Storage,
    step_rel: str,
    layouts: Sequence[ShardLayout],
    buffers: Sequence[memoryview],
    *,
    block_bytes: int,
    rank: int,
    threads: int,
    nice: int = 0,
) -> RankRecords:
    """Write every shard file of this rank (files in parallel); returns the records for the manifest."""
    records = RankRecords(rank=rank)
    if not layouts:
        return records
    # One extra thread computes checksums while the writer threads write (see write_shard).
    with ThreadPoolExecutor(
        1, thread_name_prefix="ckpt-crc", initializer=lower_thread_priority, initargs=(nice,)
    ) as crc_pool:
        if threads <= 1 or len(layouts) == 1:
            results = [
                _write_one(storage, step_rel, lay, buf, block_bytes, rank, crc_pool) for lay, buf in zip(layouts, buffers)
            ]
        else:
            with ThreadPoolExecutor(
                min(threads, len(layouts)),
                thread_name_prefix="ckpt-write",
                initializer=lower_thread_priority,
                initargs=(nice,),
            ) as pool:
                futures = [
                    pool.submit(_write_one, storage, step_rel, lay, buf, block_bytes, rank, crc_pool)
                    for lay, buf in zip(layouts, buffers)
                ]
                results = [f.result() for f in futures]
    for layout, (file_record, chunks) in zip(layouts, results):
        records.files[layout.file] = file_record
        for entry, chunk in chunks:
            rec = records.tensors.setdefault(
                entry.key.fqn, TensorRecord(shape=list(entry.global_shape), dtype=entry.dtype)
            )
            rec.chunks.append(chunk)
    return records


# --------------------------------------------------------------------------- writer process (writer="process")
# The training process stages into file-backed shared memory; a long-lived child process (one per rank) maps
# the same pages and writes the shard files, so the writes never compete with training for the GIL. The two
# talk in JSON lines over pipes (no pickle); the child dies with its parent (PR_SET_PDEATHSIG).


def _pieces_json(layout: ShardLayout) -> list[JSON]:
    return [
        [e.item_index, e.key.fqn, list(e.key.offsets), list(e.key.lengths), list(e.global_shape), e.dtype, e.nbytes]
        for e in layout.entries
    ]


def _layout_from_json(d: dict[str, JSON]) -> ShardLayout:
    pieces = [(i, ChunkKey(f, tuple(o), tuple(n)), tuple(g), dt, nb) for i, f, o, n, g, dt, nb in d["pieces"]]
    return build_layout(str(d["file"]), pieces)


WRITER_MAIN = (
    "import sys; del sys.path[0]; import runpy; "
    "runpy.run_module('checkpoint.writer', run_name='__main__', alter_sys=True)"
)
"""The writer process's ``python -c`` program: ``python -m checkpoint.writer`` would put the working directory
(the user's training repository) first on sys.path, and its own checkpoint.py or checkpoint/ would be imported in
place of ours. ``-c`` puts it there too, as ``sys.path[0]``, which this drops before importing anything (what
``-P`` does, but ``-P`` needs Python 3.11)."""


class WriterProcess:
    """Client of the per-rank writer process (``WRITER_MAIN``: ``checkpoint.writer`` run as ``__main__``)."""

    def __init__(self, spec: StorageSpec) -> None:
        init = spec.to_json()  # before the child starts: a bad option fails here, naming itself
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER_MAIN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            close_fds=True,
        )
        self._send(init)
        logger.info("started checkpoint writer process pid %d", self.proc.pid)

    def _send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise CheckpointError(f"the checkpoint writer process (pid {self.proc.pid}) is gone: {exc}") from exc

    def _request(self, payload: dict[str, JSON]) -> dict[str, JSON]:
        with self._lock:
            self._send(json.dumps(payload))
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise CheckpointError(f"the checkpoint writer process (pid {self.proc.pid}) died with exit code {code}")
        reply = json.loads(line)
        if reply.get("ok"):
            return reply
        message = str(reply.get("message"))
        if reply.get("kind") == "storage":
            raise CheckpointStorageError(message, path=reply.get("path"), errno_=reply.get("errno"))
        raise CheckpointError(f"{reply.get('type')}: {message}")

    def attach(self, buffers: Sequence[tuple[str, int]]) -> None:
        """Make the child map the staging buffers (the caller then unlinks their names)."""
        self._request({"op": "attach", "buffers": [[p, n] for p, n in buffers]})

    def write(self, step_rel: str, layouts: Sequence[ShardLayout], *, block_bytes: int, rank: int, threads: int) -> RankRecords:
        reply = self._request(
            {
                "op": "write",
                "step_rel": step_rel,
                "files": [{"file": lay.file, "pieces": _pieces_json(lay)} for lay in layouts],
                "block_bytes": block_bytes,
                "rank": rank,
                "threads": threads,
            }
        )
        return RankRecords.from_json(reply["records"])

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self._send('{"op": "exit"}')
                self.proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, Exception):  # noqa: BLE001 - make sure it goes away
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # the child is gone; its pipe cannot take our buffered bytes
                    pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class ThreadWriter:
    """``writer="thread"``: private host staging buffers, shards written by the calling (background) thread."""

    def __init__(self, storage: Storage, config: CheckpointConfig, rank: int) -> None:
        self.storage, self.config, self.rank = storage, config, rank
        self.stager = Stager()

    def stage(self, layouts: Sequence[ShardLayout], items: Sequence[TensorItem]) -> list[memoryview]:
        return self.stager.stage(layouts, items)

    def write(self, step_rel: str, layouts: Sequence[ShardLayout], buffers: Sequence[memoryview]) -> RankRecords:
        self.stager.wait_copies()  # device copies end here, on the background thread, not in save()
        return write_rank_files(
            self.storage,
            step_rel,
            layouts,
            buffers,
            block_bytes=self.config.checksum_block_bytes,
            rank=self.rank,
            threads=self.config.writer_threads,
            nice=self.config.writer_nice,
        )

    def close(self) -> None:
        self.stager.release()


class ProcessWriter:
    """``writer="process"``: shared-memory staging buffers, shards written by a per-rank child process
    (restarted on the next save if it died)."""

    def __init__(self, spec: StorageSpec, config: CheckpointConfig, rank: int) -> None:
        if spec.uri.startswith("memory://"):
            raise CheckpointConfigError(
                'writer="process" cannot write to memory:// (that filesystem lives inside this process); '
                'use writer="thread"'
            )
        self.spec, self.config, self.rank = spec, config, rank
        # page-cache-free shared memory where there is some
        self.stager = Stager(shared_dir="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.client = WriterProcess(spec)

    def stage(self, layouts: Sequence[ShardLayout], items: Sequence[TensorItem]) -> list[memoryview]:
        if not self.client.alive:
            logger.warning("[rank %d] checkpoint writer process %d died; starting a new one", self.rank, self.client.proc.pid)
            self.client.close()
            self.client = WriterProcess(self.spec)
            self.stager.release()  # the new process must map fresh buffers
        self.stager.stage(layouts, items)
        if self.stager.shared_paths:
            self.client.attach(self.stager.shared_paths)  # new buffers: let the writer map them,
            self.stager.unlink_shared()  # then drop their names so a crash leaves nothing in /dev/shm
        return []  # the writer process reads its own mapping; keep no views of ours alive

    def write(self, step_rel: str, layouts: Sequence[ShardLayout], buffers: Sequence[memoryview]) -> RankRecords:
        self.stager.wait_copies()  # the writer process reads the buffers: the device copies must be in them
        records = self.client.write(
            step_rel, layouts, block_bytes=self.config.checksum_block_bytes, rank=self.rank,
            threads=self.config.writer_threads,
        )
        if records.error:
            raise CheckpointError(records.error)
        return records

    def close(self) -> None:
        self.client.close()
        self.stager.release()


def open_writer(config: CheckpointConfig, storage: Storage, spec: StorageSpec, rank: int) -> ShardWriter:
    """The ShardWriter for ``config.writer`` (decided once, here)."""
    if config.writer == "process":
        return ProcessWriter(spec, config, rank)
    return ThreadWriter(storage, config, rank)


def _serve() -> None:
    """Child side: map staging buffers, write shard files on request, answer with records or the error."""
    try:  # die with the training process, whatever kills it (one that died before this sees stdin EOF)
        arm_parent_death_signal(sig=signal.SIGKILL)
    except OSError:
        pass
    # Signals meant for the training job are the training process's to act on: a scheduler that signals every
    # process of the job step (Slurm's time limit or preemption notice) must not end the writer of the save
    # the notice asks for. It ends on its exit request, stdin EOF, or with its parent (above).
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    init = json.loads(sys.stdin.readline())
    spec = StorageSpec(**init)
    storage = spec.open()
    lower_thread_priority(spec.thread_nice)
    maps: list[mmap.mmap] = []
    views: list[memoryview] = []
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "exit":
                break
            if req["op"] == "attach":
                for v in views:
                    v.release()
                for m in maps:
                    m.close()
                maps, views = [], []
                for path, size in req["buffers"]:
                    fd = os.open(path, os.O_RDWR)
                    try:
                        maps.append(mmap.mmap(fd, size))
                    finally:
                        os.close(fd)
                views = [memoryview(m) for m in maps]
                reply: dict[str, JSON] = {"ok": True}
            elif req["op"] == "write":
                layouts = [_layout_from_json(f) for f in req["files"]]
                buffers = [v[: lay.data_bytes] for v, lay in zip(views, layouts)]
                records = write_rank_files(
                    storage,
                    req["step_rel"],
                    layouts,
                    buffers,
                    block_bytes=req["block_bytes"],
                    rank=req["rank"],
                    threads=req["threads"],
                    nice=spec.thread_nice,
                )
                del buffers  # views into the maps must not outlive a later re-attach
                reply = {"ok": True, "records": records.to_json()}
            else:
                reply = {"ok": False, "type": "ValueError", "message": f"unknown op {req['op']!r}"}
        except Exception as exc:  # noqa: BLE001 - every error goes back to the training process
            reply = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
            if isinstance(exc, (CheckpointStorageError, OSError)):
                reply.update(kind="storage", path=getattr(exc, "path", None) or getattr(exc, "filename", None),
                             errno=getattr(exc, "errno", None))
        replies.write(json.dumps(reply) + "\n")
    storage.close()


if __name__ == "__main__":
    _serve()
