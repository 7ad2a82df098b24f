"""Device-to-host copies that do not stall the device: page-locked host buffers and a side stream per device.

A save or a memory snapshot copies the state's device tensors into host buffers (``staging.Stager``'s, or the
memory tier's shared-memory slots). Two things decide what that costs on a GPU:

* **Page-locked destinations.** A copy into pageable memory goes through a driver bounce buffer and blocks the
  host; into page-locked memory it is one asynchronous DMA at full bus bandwidth. The buffers are
  shared-memory mappings (a writer process or the node's keeper maps them too), which ``torch.empty(...,
  pin_memory=True)`` cannot make, so :class:`PinnedMapping` registers the mapping with CUDA
  (``cudaHostRegister``) and unregisters it before it is unmapped.
* **Ordering by events, not by a device-wide synchronize.** :func:`copy_to_host` issues the copies on a side
  stream that first waits for the current stream (the work that produced the sources), records an event when
  they are done, and makes the current stream wait for that event: work queued afterwards on the current stream
  (the optimizer step that modifies the sources) runs after the copies, while the host goes on at once. The
  returned :class:`CopyFence` is waited on by whoever reads the host bytes (the background checksum or writer),
  never by the training loop. ``torch.cuda.synchronize()`` would instead wait for every stream's queued work
  (a prefetch, the next bucket's all-reduce) on the caller's thread.

The decisions (which copies go where, which buffers to register, the registered span) are plain functions;
the CUDA calls are the thin edges, run only where sources are on a CUDA device: a CPU-only state never
initialises CUDA here.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the pages count as page-locked for every CUDA context of the process."""

CopyPair = tuple[torch.Tensor, torch.Tensor]
"""(host destination, source) of one copy."""


@dataclass(slots=True)
class CopyBatches:
    """The copies of one save, split by how they run (:func:`split_copies`)."""

    host: list[CopyPair] = field(default_factory=list)
    """Sources in host memory: copied at once, on the caller's thread."""
    cuda: dict[torch.device, list[CopyPair]] = field(default_factory=dict)
    """Sources on each CUDA device: copied on that device's side stream."""
    other: list[CopyPair] = field(default_factory=list)
    """Sources on another accelerator: a blocking copy (correct everywhere, overlapped nowhere)."""


def split_copies(pairs: Iterable[CopyPair]) -> CopyBatches:
    """Group the copies by their source's device (order kept within each group)."""
    batches = CopyBatches()
    for dst, src in pairs:
        kind = src.device.type
        if kind == "cpu":
            batches.host.append((dst, src))
        elif kind == "cuda":
            batches.cuda.setdefault(src.device, []).append((dst, src))
        else:
            batches.other.append((dst, src))
    return batches


def on_cuda(tensors: Iterable[torch.Tensor]) -> bool:
    """True when some tensor lives on a CUDA device: only then are host buffers worth registering (and CUDA is
    then initialised already, so registering starts no context)."""
    return any(t.device.type == "cuda" for t in tensors)


def page_span(address: int, nbytes: int, page: int = mmap.PAGESIZE) -> tuple[int, int]:
    """The whole pages covering ``[address, address + nbytes)``: (first page's address, bytes), what
    ``cudaHostRegister`` locks."""
    if nbytes <= 0:
        return address, 0
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    return start, end - start


@dataclass(slots=True)
class CopyFence:
    """The end of the device copies of one save; complete at once when there were none."""

    events: list[torch.cuda.Event] = field(default_factory=list)

    def wait(self) -> None:
        """Block until the copies are in host memory (each device's event, not the whole device)."""
        for event in self.events:
            event.synchronize()
        self.events = []

    def done(self) -> bool:
        return all(event.query() for event in self.events)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device=device)
    return stream


def copy_to_host(pairs: Iterable[CopyPair]) -> CopyFence:
    """Copy each source into its host destination. Host sources are copied before this returns; device
    sources are ordered after the work already queued on their device's current stream, and the current
    stream then waits for them, so the caller may queue work that modifies the sources at once. Read the
    destinations of device sources only after the returned fence's ``wait``."""
    batches = split_copies(pairs)
    with torch.no_grad():
        for dst, src in batches.host:
            dst.copy_(src)
        for dst, src in batches.other:
            dst.copy_(src)  # synchronous: the bytes are there on return
        events: list[torch.cuda.Event] = []
        for device, batch in batches.cuda.items():
            current = torch.cuda.current_stream(device)
            side = _side_stream(device)
            side.wait_stream(current)  # an event on the current stream: the sources' producers come first
            with torch.cuda.stream(side):
                for dst, src in batch:
                    dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            current.wait_event(done)  # the optimizer step queued next runs after the copies read its inputs
            events.append(done)
    return CopyFence(events)


class PinnedMapping:
    """A host buffer (a CPU tensor over a shared-memory mapping) registered with CUDA as page-locked, until
    :meth:`release`, which must come before the mapping is closed. Registration that fails (a locked-memory
    limit, a driver without it) leaves the buffer pageable, said once: the copies stay correct, only slower."""

    _warned = False

    def __init__(self, buffer: torch.Tensor) -> None:
        self.address, self.nbytes = page_span(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        self.registered = False
        if self.nbytes == 0:
            return
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(self.address, self.nbytes, CUDA_HOST_REGISTER_PORTABLE)
        if int(error) != 0:
            if not PinnedMapping._warned:
                PinnedMapping._warned = True
                logger.warning("cudaHostRegister of %d bytes failed (error %s): host buffers stay pageable, "
                               "device-to-host copies into them are slower and block", self.nbytes, int(error))
            return
        self.registered = True

    def release(self) -> None:
        """Unregister (before the mapping goes away); safe to call twice."""
        if self.registered:
            self.registered = False
            error = torch.cuda.cudart().cudaHostUnregister(self.address)
            if int(error) != 0:
                logger.warning("cudaHostUnregister failed (error %s)", int(error))


def pin_mappings(buffers: Sequence[torch.Tensor], sources: Iterable[torch.Tensor]) -> list[PinnedMapping]:
    """Register ``buffers`` when some source is on a CUDA device; nothing (and no CUDA call) otherwise."""
    if not on_cuda(sources):
        return []
    return [PinnedMapping(b) for b in buffers if b.numel()]


def release_all(pinned: list[PinnedMapping]) -> None:
    for p in pinned:
        p.release()
    pinned.clear()
