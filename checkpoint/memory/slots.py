"""A rank's snapshot slots: shared-memory files mapped once and reused, with their room checked first.

Two slots per rank: the one holding the last step every rank published is never touched, the other is renamed to
a temporary name (a reader never sees a mix), then overwritten. Before a slot is allocated the filesystem's free
space is checked (``layout.room_for``) and its pages are reserved (``posix_fallocate``), so a full ``/dev/shm`` is
a ``ShmSpaceError``, never a SIGBUS.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from checkpoint.api import TensorItem
from checkpoint.memory.api import ShmSpaceError
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.layout import FOOTER, pick_slot, room_for, size_for, tmp_name
from checkpoint.pinned import CopyFence, PinnedMapping, pin_mappings, release_all
from checkpoint.shard import ShardLayout
from checkpoint.staging import copy_pieces, piece_views

SLOTS = 2
"""Slots per rank: the last complete snapshot, and the one being written."""


def check_room(directory: str, need: int, config: MemoryTierConfig) -> None:
    """Raise ShmSpaceError (sizes and the fix in the message) unless ``need`` more bytes in ``directory``'s
    filesystem leave the free space ``config`` asks for."""
    fs = os.statvfs(directory)
    why = room_for(
        need,
        free=fs.f_bavail * fs.f_frsize,
        total=fs.f_blocks * fs.f_frsize,
        min_free_bytes=config.min_free_bytes,
        min_free_fraction=config.min_free_fraction,
    )
    if why is not None:
        raise ShmSpaceError(f"{why} ({directory})")


def size_problem(directory: str, need: int, config: MemoryTierConfig) -> str | None:
    """Why ``directory``'s filesystem cannot hold ``need`` bytes of snapshots even when empty, else None (also
    None when the directory vanished: the snapshot that follows says so)."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return None
    return size_for(need, total=fs.f_blocks * fs.f_frsize, min_free_bytes=config.min_free_bytes,
                    min_free_fraction=config.min_free_fraction)


@dataclass(slots=True)
class Slot:
    """One reusable shared-memory file: header and data mapped, manifest and footer written by ``pwrite``."""

    fd: int
    mm: mmap.mmap
    path: str
    layout: ShardLayout
    views: list[torch.Tensor | None]
    step: int | None = None
    """The step it holds once published; None while empty or being written."""
    fence: CopyFence = field(default_factory=CopyFence)
    """The end of the device copies into it: waited on before its bytes are read (checksums, publish)."""
    pinned: list[PinnedMapping] = field(default_factory=list)
    """Its mapping registered with CUDA (page-locked) once a snapshot copied from a CUDA device into it."""

    def fill(self, layout: ShardLayout, items: Sequence[TensorItem]) -> None:
        """Copy the pieces of ``items`` into the slot; returns once the sources may be modified (``fence``:
        until the bytes are here). The mapping is page-locked on the first copy from a CUDA device."""
        if not self.pinned and self.layout.size:
            self.pinned = pin_mappings([torch.frombuffer(self.mm, dtype=torch.uint8, count=self.layout.size)],
                                       (item.tensor for item in items))
        self.fence = copy_pieces([layout], [self.views], items)

    def close(self) -> None:
        self.fence.wait()  # no copy may land in a mapping being closed
        release_all(self.pinned)  # unregistered before it is unmapped
        self.views = []
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)


class Slots:
    """This rank's slots in ``directory`` for the current layout (``reset`` on every new plan)."""

    def __init__(self, directory: str, gen: str, rank: int, config: MemoryTierConfig) -> None:
        self.directory, self.gen, self.rank, self.config = directory, gen, rank, config
        self.items: list[Slot | None] = [None] * SLOTS
        self.layout: ShardLayout | None = None

    @property
    def nbytes(self) -> int:
        """Host shared memory the slots hold (header + data each)."""
        return sum(s.layout.size for s in self.items if s is not None)

    def held_paths(self) -> set[str]:
        return {s.path for s in self.items if s is not None}

    def for_round(self, complete: int) -> Slot:
        """The slot a periodic snapshot writes: never the one holding ``complete``. Raises ShmSpaceError or
        OSError when a new one cannot be allocated."""
        index = pick_slot([s.step if s is not None else None for s in self.items], complete if complete >= 0 else None)
        return self._get(index)

    def for_jit(self, keep: set[int], busy: Slot | None) -> Slot:
        """A slot for a just-in-time snapshot holding none of the steps in ``keep`` and not ``busy`` (the one a
        stuck snapshot still writes); a third slot when both are taken."""
        index = next((i for i, s in enumerate(self.items) if s is None or (s.step not in keep and s is not busy)), None)
        if index is None:
            self.items.append(None)
            index = len(self.items) - 1
        return self._get(index)

    def _get(self, index: int) -> Slot:
        slot = self.items[index]
        if slot is None:
            slot = self.items[index] = self.allocate(index)
        return slot

    def allocate(self, index: int) -> Slot:
        """A new slot for the current layout, after checking and reserving the room (ShmSpaceError if none)."""
        assert self.layout is not None
        layout = self.layout
        need = layout.size + FOOTER.size
        check_room(self.directory, need, self.config)
        path = os.path.join(self.directory, tmp_name(self.gen, self.rank, index))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(layout.size, 1))  # pages reserved now: a full tmpfs is ENOSPC here, not SIGBUS later
            mm = mmap.mmap(fd, max(layout.size, 1))
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise ShmSpaceError(f"cannot reserve {need} bytes for a snapshot in {self.directory}: {exc}") from exc
        mm[: len(layout.header)] = layout.header
        data = torch.frombuffer(mm, dtype=torch.uint8, count=layout.size)[len(layout.header) :] if layout.size else None
        views = piece_views(data, layout) if data is not None else []
        return Slot(fd=fd, mm=mm, path=path, layout=layout, views=views)

    def unpublish(self, slot: Slot) -> None:
        """Take the slot's published name away before its bytes change (a reader never sees a mix)."""
        tmp = os.path.join(os.path.dirname(slot.path), tmp_name(self.gen, self.rank, self.items.index(slot)))
        if slot.path != tmp:
            os.rename(slot.path, tmp)
            slot.path = tmp
        slot.step = None

    def release(self) -> None:
        """Drop the slots (their published files stay until superseded); no copy or publish may be in flight."""
        for i, slot in enumerate(self.items):
            if slot is None:
                continue
            if slot.step is None:  # never published: nothing to keep
                with contextlib.suppress(OSError):
                    os.unlink(slot.path)
            slot.close()
            self.items[i] = None

    def reset(self, layout: ShardLayout) -> None:
        """Release the slots of the old layout; the next ones are allocated for ``layout``."""
        self.release()
        self.layout = layout
