"""Host staging: copy the pieces this rank writes into preallocated buffers laid out like the shard files.

The training loop blocks only for this copy. Each shard file gets one flat ``uint8`` host buffer whose
bytes are exactly the file's data region, so the writer streams it without any further copy or
serialisation. Buffers are kept between saves and reused as long as the layout is unchanged (no memory
growth save after save); they are pinned when CUDA is available so device-to-host copies run at full speed.
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
) -> None:
    """Copy ``items`` (indexed by each entry's ``item_index``) into the views; returns once the sources may be
    modified again (device copies are synchronised)."""
    on_device = False
    with torch.no_grad():
        for layout, layout_views in zip(layouts, views):
            for entry, view in zip(layout.entries, layout_views):
                if view is None:
                    continue
                src = items[entry.item_index].tensor
                if src.device.type != "cpu":
                    on_device = True
                    view.copy_(src, non_blocking=True)
                else:
                    view.copy_(src)
    if on_device:
        torch.cuda.synchronize()  # the copies above were async; the caller may now modify the sources


class Stager:
    """Owns the reusable host buffers; ``stage`` fills them from live tensors."""

    def __init__(self, *, pin_memory: bool | None = None, shared_dir: str | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.shared_dir = shared_dir
        """When set, buffers are file-backed shared memory in this directory (``/dev/shm``), so a writer
        process can map them; ``shared_paths`` names the files until the caller unlinks them."""
        self.shared_paths: list[tuple[str, int]] = []
        self._mmaps: list[mmap.mmap] = []
        self._signature: tuple[Any, ...] | None = None
        self._buffers: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor | None]] = []
        self.allocations = 0
        """How many times buffers were (re)allocated; a test asserts it stays at 1 across saves."""

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if self.shared_dir is None:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        fd, path = tempfile.mkstemp(prefix="spotrun-ckpt-", dir=self.shared_dir)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._mmaps.append(mm)
        self.shared_paths.append((path, max(nbytes, 1)))
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    def _allocate(self, layouts: Sequence[ShardLayout]) -> None:
        self.release()  # drop the old buffers before allocating the new
        for layout in layouts:
            buf = self._new_buffer(layout.data_bytes)
            self._buffers.append(buf)
            self._views.append(piece_views(buf, layout))
        self.allocations += 1
        logger.debug("staging: allocated %d buffers, %d bytes (pinned=%s)", len(layouts), self.nbytes, self.pin_memory)

    def stage(self, layouts: Sequence[ShardLayout], items: Sequence[TensorItem]) -> list[memoryview]:
        """Copy ``items`` (indexed by each entry's ``item_index``) into the buffers; returns their bytes."""
        signature = tuple(layout.signature() for layout in layouts)
        if signature != self._signature:
            self._allocate(layouts)
            self._signature = signature
        crash_point("stage.begin")
        copy_pieces(layouts, self._views, items)
        crash_point("stage.end")
        return [b.numpy().data.cast("B") for b in self._buffers]

    def release(self) -> None:
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
