"""Tensor dtypes as the checkpoint stores them: the one table of safetensors dtype names.

Every module that maps a dtype (state: live tensors -> items and inline per-rank tensors; plan: element
sizes of manifest records; shard and staging: typed views of raw bytes) goes through here, so they agree
on the names and on the error. A dtype name this spotrun does not know (a newer writer, another torch)
is an IncompatibleCheckpointError everywhere: the checkpoint may be intact, this reader cannot use it, and
the load fallback must not silently drop to an older step because of it (see ``fallback``).

Importing this module does not import torch (``plan`` uses the element sizes without it).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from checkpoint.api import IncompatibleCheckpointError

if TYPE_CHECKING:
    import torch

_TABLE: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
"""safetensors dtype name -> (torch attribute, bytes per element)."""

NAMES = tuple(sorted(_TABLE))
"""Every dtype name the checkpointer stores."""


def _unknown(name: str) -> IncompatibleCheckpointError:
    return IncompatibleCheckpointError(
        f"checkpoint dtype {name!r} is not supported by this spotrun (supported: {', '.join(NAMES)}); "
        f"load it with the spotrun that saved it"
    )


def element_size(name: str) -> int:
    """Bytes per element of a safetensors dtype name; IncompatibleCheckpointError for an unknown name."""
    try:
        return _TABLE[name][1]
    except KeyError:
        raise _unknown(name) from None


@functools.cache
def _to_torch() -> dict[str, torch.dtype]:
    import torch  # on first use: spotrun-ckpt ls and inspect run without torch

    return {name: getattr(torch, attr) for name, (attr, _) in _TABLE.items() if hasattr(torch, attr)}


@functools.cache
def _to_name() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _to_torch().items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; IncompatibleCheckpointError for an unknown name."""
    try:
        return _to_torch()[name]
    except KeyError:
        raise _unknown(name) from None


def safetensors_name(dtype: torch.dtype) -> str:
    """The safetensors dtype name of a torch dtype ("F32", "BF16", ...); TypeError if it cannot be stored."""
    try:
        return _to_name()[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} cannot be stored in safetensors (supported: {', '.join(NAMES)})") from None
