"""checkpoint.pinned: how device-to-host copies are split, fenced and page-locked. The decisions run on plain
tensors here; the CUDA edges (side stream, events, cudaHostRegister) run in bench/device_check.py on a GPU."""

from __future__ import annotations

import mmap

import pytest
import torch

from checkpoint.pinned import copy_to_host, on_cuda, page_span, pin_mappings, split_copies
from checkpoint.shard import build_layout
from checkpoint.staging import Stager
from checkpoint.state import flatten


def test_copies_are_split_by_the_sources_device_in_order() -> None:
    host = [torch.empty(2) for _ in range(3)]
    cpu_a, cpu_b, meta = torch.ones(2), torch.zeros(2), torch.empty(2, device="meta")
    batches = split_copies([(host[0], cpu_a), (host[1], meta), (host[2], cpu_b)])
    assert [src for _, src in batches.host] == [cpu_a, cpu_b]
    assert [src for _, src in batches.other] == [meta]  # another accelerator: a blocking copy
    assert batches.cuda == {}


def test_host_sources_are_copied_before_return_and_the_fence_is_already_complete() -> None:
    src = [torch.arange(6, dtype=torch.float32), torch.arange(4, dtype=torch.int64)]
    dst = [torch.empty_like(t) for t in src]
    fence = copy_to_host(list(zip(dst, src)))
    assert fence.done() and fence.events == []
    fence.wait()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    src[0].add_(1)  # the sources may be modified: the copies are independent of them
    assert torch.equal(dst[0], torch.arange(6, dtype=torch.float32))


def test_registration_covers_whole_pages() -> None:
    page = 4096
    assert page_span(8192, 10, page) == (8192, 4096)
    assert page_span(8192 + 100, 4096, page) == (8192, 8192)  # straddles two pages
    assert page_span(8192, 8192, page) == (8192, 8192)
    assert page_span(8192, 0, page) == (8192, 0)


def test_a_cpu_only_state_registers_nothing_and_never_initialises_cuda() -> None:
    assert not on_cuda([torch.ones(1), torch.ones(1, dtype=torch.int8)])
    buffer = torch.frombuffer(mmap.mmap(-1, 4096), dtype=torch.uint8)
    assert pin_mappings([buffer], [torch.ones(1)]) == []
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared-memory"])
def test_the_stager_pins_only_for_device_sources_and_its_copies_are_the_sources(tmp_path, shared: bool) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100), "b": torch.ones(7, dtype=torch.float64)}
    flat = flatten(state)
    layout = build_layout("f.safetensors", [(n, i.key, i.global_shape, i.dtype, i.nbytes) for n, i in enumerate(flat.items)])
    stager = Stager(shared_dir=str(tmp_path) if shared else None)
    try:
        buffers = stager.stage([layout], flat.items)
        stager.wait_copies()
        assert not stager.page_locked and not torch.cuda.is_initialized()
        for entry in layout.entries:
            src = flat.items[entry.item_index].tensor.contiguous()
            assert bytes(buffers[0][entry.offset : entry.offset + entry.nbytes]) == src.view(torch.uint8).numpy().tobytes()
        for view in buffers:
            view.release()  # no view may outlive the mapping
    finally:
        stager.release()
