"""S3 backend (s3fs): objects appear only when their PUT or multipart completion succeeds; large files go up
as a multipart upload whose parts are sent in parallel."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol, TypeVar

import tenacity

from checkpoint.api import Sink
from checkpoint.backends.generic import FsspecBackend
from checkpoint.threads import lower_thread_priority

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Retry(Protocol):
    """How one part upload is retried: ``Storage.call`` (op and path name it in errors and logs)."""

    def __call__(self, op: str, rel: str, fn: Any, *args: Any, **kwargs: Any) -> Any: ...


class S3Backend(FsspecBackend):
    """A checkpoint root in an S3 bucket (no directories; multipart for files over one part)."""

    def __init__(
        self,
        uri: str,
        fs: Any,
        root: str,
        *,
        retry: Retry,
        upload_threads: int = 4,
        multipart_chunk_bytes: int = 64 << 20,
        thread_nice: int = 0,
    ) -> None:
        super().__init__(uri, fs, root)
        self.retry = retry
        self.upload_threads = upload_threads
        self.multipart_chunk_bytes = multipart_chunk_bytes
        self.thread_nice = thread_nice
        self.part_slots = threading.Semaphore(upload_threads + 1)
        """Caps the multipart bytes held in memory across all files: upload_threads + 1 parts."""
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def makedirs(self, rel: str) -> None:
        pass  # S3 has no directories

    def open_sink(self, rel: str) -> Sink:
        return MultipartSink(self, rel)

    def upload_pool(self) -> ThreadPoolExecutor:
        """Threads for multipart part uploads (separate from the writer's per-file threads)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.upload_threads,
                    thread_name_prefix="ckpt-upload",
                    initializer=lower_thread_priority,
                    initargs=(self.thread_nice,),
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


ABORT_PART_WAIT_S = 60.0
"""How long an abort waits for the parts still uploading before it aborts the multipart upload."""


class MultipartSink:
    """One PUT for small files, else a multipart upload whose parts go up in parallel."""

    def __init__(self, backend: S3Backend, rel: str) -> None:
        self.backend = backend
        self.rel = rel
        self.fs = backend.fs
        self.bucket, self.key, _ = self.fs.split_path(backend.full(rel))
        self.part_bytes = backend.multipart_chunk_bytes
        self.pending: list[bytes] = []
        self.pending_len = 0
        self.upload_id: str | None = None
        self.futures: list[Future[dict[str, Any]]] = []
        self.slots = backend.part_slots

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.part_bytes - self.pending_len)
            self.pending.append(bytes(view[:take]))
            self.pending_len += take
            view = view[take:]
            if self.pending_len >= self.part_bytes:
                self._flush_part()

    def _flush_part(self) -> None:
        body = b"".join(self.pending)
        self.pending, self.pending_len = [], 0
        if self.upload_id is None:
            out = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self.upload_id = out["UploadId"]
        number = len(self.futures) + 1
        self.slots.acquire()
        fut = self.backend.upload_pool().submit(self.upload_part, number, body)
        fut.add_done_callback(lambda _f: self.slots.release())
        self.futures.append(fut)

    def upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        """Upload part ``number`` with retries (what the upload pool runs); returns its ``PartNumber``/``ETag``."""
        out = self.backend.retry(
            f"upload part {number} of",
            self.rel,
            self.fs.call_s3,
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    def commit(self) -> None:
        if self.upload_id is None:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=b"".join(self.pending))
            self.pending = []
        else:
            if self.pending_len:
                self._flush_part()
            parts = [f.result() for f in self.futures]
            self.fs.call_s3(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
            self.upload_id = None
        self.fs.invalidate_cache(self.backend.full(self.rel))

    def abort(self) -> None:
        for f in self.futures:
            f.cancel()
        # A part still uploading when the upload is aborted may be stored after the abort (S3 says to abort
        # again in that case): wait for the parts in flight first, bounded, then abort (retried once).
        _, running = wait_futures([f for f in self.futures if not f.cancelled()], timeout=ABORT_PART_WAIT_S)
        if running:
            logger.warning("%d part(s) of %s still uploading after %.0f s: aborting its multipart upload anyway",
                           len(running), self.backend.display(self.rel), ABORT_PART_WAIT_S)
        if self.upload_id is not None:
            upload_id = self.upload_id
            try:
                for attempt in tenacity.Retrying(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_fixed(0.5),
                                                 reraise=True):
                    with attempt:
                        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)
            except Exception as exc:  # noqa: BLE001 - the lifecycle rule cleans up what we cannot
                logger.warning("could not abort multipart upload of %s: %s", self.backend.display(self.rel), exc)
            self.upload_id = None
