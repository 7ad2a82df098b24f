"""One dtype table: every module maps names the same way and rejects an unknown name the same way."""

from __future__ import annotations

import pytest
import torch

from checkpoint import dtypes
from checkpoint.api import IncompatibleCheckpointError
from checkpoint.fallback import LoadOutcome, classify
from checkpoint.shard import bytes_as_tensor

pytestmark = pytest.mark.timeout(30)


def test_every_name_round_trips_with_its_element_size() -> None:
    for name in dtypes.NAMES:
        dtype = dtypes.torch_dtype(name)
        assert dtypes.safetensors_name(dtype) == name
        assert dtypes.element_size(name) == dtype.itemsize
    with pytest.raises(TypeError, match="complex64 cannot be stored"):
        dtypes.safetensors_name(torch.complex64)


def test_unknown_name_is_incompatible_everywhere_so_load_does_not_fall_back() -> None:
    from checkpoint.plan import chunk_view
    from checkpoint.state import st_to_dtype

    calls = [
        lambda: dtypes.element_size("F4"),
        lambda: dtypes.torch_dtype("F4"),
        lambda: st_to_dtype("F4"),
        lambda: bytes_as_tensor(b"\0" * 4, "F4"),
        lambda: chunk_view(torch.zeros(4, dtype=torch.uint8), "F4", (4,), 0, (0, 4), ((0, 4),)),
    ]
    for call in calls:
        with pytest.raises(IncompatibleCheckpointError, match="checkpoint dtype 'F4' is not supported") as exc:
            call()
        assert classify(exc.value) == LoadOutcome.FAILED
