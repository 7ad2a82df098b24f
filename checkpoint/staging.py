"""Host staging: copy the pieces this rank writes into preallocated buffers laid out like the shard files.

The training loop blocks only for this copy. Each shard file gets one flat ``uint8`` host buffer whose
bytes are exactly the file's data region, so the writer streams it without any further copy or
serialisation. Buffers are kept between saves and reused as long as the layout is unchanged (no memory
growth save after save); they are page-locked when the sources are on a CUDA device, so device-to-host copies
are asynchronous and run at full speed (``checkpoint.pinned``), and the copies end on their own stream's event.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from checkpoint.api import TensorItem
from checkpoint.dtypes import torch_dtype
from checkpoint.faults import crash_point
from checkpoint.pinned import CopyFence, CopyPair, PinnedMapping, copy_to_host, on_cuda, pin_mappings, release_all
from checkpoint.shard import ShardLayout

logger = logging.getLogger(__name__)


def piece_views(buf: torch.Tensor, layout: ShardLayout) -> list[torch.Tensor | None]:
    """Typed views of each entry of ``layout`` into ``buf`` (a flat ``uint8`` buffer holding the layout's data
    region); None for empty entries. Shared by the Stager and the memory tier (``checkpoint.memory``)."""
    views: list[torch.Tensor | None] = []
    for e in layout.entries:
        raw = buf[e.offset : e.offset + e.nbytes]
        views.append(raw.view(torch_dtype(e.dtype)).view(e.key.lengths) if e.nbytes else None)
    return views


def copy_pieces(
    layouts: Sequence[ShardLayout], views: Sequence[Sequence[torch.Tensor | None]], items: Sequence[TensorItem]
) -> CopyFence:
    """Copy ``items`` (indexed by each entry's ``item_index``) into the views. On return the sources may be
    modified: host sources are copied, and device sources are read before any work queued afterwards on their
    device's current stream (``pinned.copy_to_host``). The views of device sources hold their bytes once the
    returned fence's ``wait`` returns: wait before reading them."""
    pairs: list[CopyPair] = []
    for layout, layout_views in zip(layouts, views):
        for entry, view in zip(layout.entries, layout_views):
            if view is not None:
                pairs.append((view, items[entry.item_index].tensor))
    return copy_to_host(pairs)


class Stager:
    """Owns the reusable host buffers; ``stage`` fills them from live tensors."""

    def __init__(self, *, pin_memory: bool | None = None, shared_dir: str | None = None) -> None:
        self.pin_memory = pin_memory
        """Page-lock the buffers; None: when some source is on a CUDA device (a CPU-only state never
        initialises CUDA here)."""
        self.shared_dir = shared_dir
        """When set, buffers are file-backed shared memory in this directory (``/dev/shm``), so a writer
        process can map them; ``shared_paths`` names the files until the caller unlinks them."""
        self.shared_paths: list[tuple[str, int]] = []
        self._mmaps: list[mmap.mmap] = []
        self._signature: tuple[Any, ...] | None = None
        self._buffers: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor | None]] = []
        self._pinned: list[PinnedMapping] = []
        self.page_locked = False
        """Whether the current buffers are page-locked (allocated pinned, or registered with CUDA)."""
        self._fence = CopyFence()
        self.allocations = 0
        """How many times buffers were (re)allocated; a test asserts it stays at 1 across saves."""

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def _new_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        if self.shared_dir is None:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        fd, path = tempfile.mkstemp(prefix="spotrun-ckpt-", dir=self.shared_dir)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._mmaps.append(mm)
        self.shared_paths.append((path, max(nbytes, 1)))
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    def _allocate(self, layouts: Sequence[ShardLayout], items: Sequence[TensorItem]) -> None:
        self.release()  # drop the old buffers before allocating the new
        pin = self.pin_memory if self.pin_memory is not None else on_cuda(item.tensor for item in items)
        for layout in layouts:
            buf = self._new_buffer(layout.data_bytes, pin)
            self._buffers.append(buf)
            self._views.append(piece_views(buf, layout))
        if pin and self.shared_dir is not None:  # torch cannot allocate a shared mapping pinned: register it
            self._pinned = pin_mappings(self._buffers, (item.tensor for item in items))
        self.page_locked = pin and (self.shared_dir is None or any(p.registered for p in self._pinned))
        self.allocations += 1
        logger.debug("staging: allocated %d buffers, %d bytes (pinned=%s)", len(layouts), self.nbytes, pin)

    def stage(self, layouts: Sequence[ShardLayout], items: Sequence[TensorItem]) -> list[memoryview]:
        """Copy ``items`` (indexed by each entry's ``item_index``) into the buffers; returns their bytes."""
        signature = tuple(layout.signature() for layout in layouts)
        if signature != self._signature:
            self._allocate(layouts, items)
            self._signature = signature
        crash_point("stage.begin")
        self._fence = copy_pieces(layouts, self._views, items)
        crash_point("stage.end")
        return [b.numpy().data.cast("B") for b in self._buffers]

    def wait_copies(self) -> None:
        """Block until the last ``stage``'s device copies are in the buffers (the writer's thread calls this
        before it reads them; the training loop never waits for it)."""
        self._fence.wait()

    def release(self) -> None:
        self._fence.wait()  # no copy may land in a buffer being unmapped
        release_all(self._pinned)  # before the mappings close
        self.page_locked = False
        self._buffers, self._views, self._signature = [], [], None
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the mapping goes when it does
                logger.debug("staging buffer still referenced; left to the garbage collector")
        self._mmaps = []
        self.unlink_shared()

    def unlink_shared(self) -> None:
        """Remove the names of the shared buffers (mappings stay valid in every process that has them)."""
        for path, _ in self.shared_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.shared_paths = []
