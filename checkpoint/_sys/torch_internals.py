"""The torch internals the checkpointer relies on, declared below both packages.

``checkpoint.state`` reads a DTensor's piece through ``DTensor.__create_chunk_list__`` (the hook torch's own
distributed checkpoint plans with), which torch keeps private. It is declared here as an :class:`Internal`;
the launcher's registry (``elastic.torch_internals.INTERNALS``) lists it with the agent's own, so the agent's
start check and the fingerprint test cover it, and the accessor below guards each use. Standard library
only: nothing here imports torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Final


@dataclass(frozen=True, slots=True)
class Internal:
    """A torch function or method spotrun copies, overrides, patches or calls although torch keeps it private."""

    path: str
    """Dotted path: the longest importable module prefix, then attributes (``module.Class.method``)."""
    reliance: str
    """What spotrun relies on: what to re-read when its source changes."""
    params: tuple[str, ...] | None = None
    """Leading parameter names spotrun calls or overrides it with (None: not checked)."""
    mentions: tuple[str, ...] = ()
    """Text its source must contain: the private attributes it sets that spotrun reads."""

    @property
    def name(self) -> str:
        """The short name used in messages: ``Class.method`` or ``module.function``."""
        parts = self.path.split(".")
        return ".".join(parts[-2:])


CHECKPOINT_INTERNALS: Final[tuple[Internal, ...]] = (
    Internal("torch.distributed.tensor.DTensor.__create_chunk_list__",
             ("checkpoint.state reads a DTensor's local piece (sizes, offsets) from it, as torch's distributed "
              "checkpoint planner does: one chunk per rank, _StridedShard included"),
             params=("self",)),
)
"""The torch internals the checkpointer relies on."""


class UnsupportedTorchError(AssertionError):
    """A torch internal the checkpointer relies on changed (a torch release newer than the tested ones)."""


def dtensor_local_chunk(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local piece on this rank: (sizes, global offsets), from ``DTensor.__create_chunk_list__``,
    the hook torch's distributed checkpoint planner reads (``compute_local_shape_and_global_offset``
    underneath, uneven and ``_StridedShard`` placements included).

    Raises:
        UnsupportedTorchError: the hook no longer returns one chunk with sizes and offsets.
    """
    chunks = tensor.__create_chunk_list__()
    if not (len(chunks) == 1 and hasattr(chunks[0], "sizes") and hasattr(chunks[0], "offsets")):
        version = getattr(sys.modules.get("torch"), "__version__", "?")
        raise UnsupportedTorchError(
            f"spotrun relies on the torch internal DTensor.__create_chunk_list__, but the installed torch {version} "
            f"differs: it returned {chunks!r}, not one chunk with sizes and offsets. Re-check it against this torch "
            "release (checkpoint/_sys/torch_internals.py, elastic/torch_internals.py)."
        )
    return tuple(int(s) for s in chunks[0].sizes), tuple(int(o) for o in chunks[0].offsets)
