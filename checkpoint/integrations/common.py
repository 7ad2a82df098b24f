"""Pieces the trainer integrations share: the global RNG states as a Stateful whose restore can be deferred, and a
template-free read of a whole step (for callers that have no live state to load into, e.g. Lightning's
``CheckpointIO.load_checkpoint``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from checkpoint.api import JSON
from checkpoint.checkpointer import Checkpointer
from checkpoint.state import RNGState

logger = logging.getLogger(__name__)


class GlobalRNG:
    """Stateful of every global RNG a trainer draws from: torch CPU (and CUDA), Python ``random``, numpy.

    Put it in a checkpoint state as ``PerRank(GlobalRNG(defer=...))``. With ``defer=True`` a load only keeps the
    saved states (``pending``) and ``restore()`` sets them later: the HF Trainer restores RNG after it has
    fast-forwarded the data loader, not when the checkpoint is read.
    """

    __slots__ = ("defer", "pending")

    def __init__(self, *, defer: bool = False) -> None:
        self.defer = defer
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        sd = RNGState().state_dict()  # torch CPU, CUDA, Python
        sd["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = dict(state_dict)
        if not self.defer:
            self.restore()

    def restore(self) -> bool:
        """Set the global RNGs to the loaded states (once); False when nothing is pending."""
        sd, self.pending = self.pending, None
        if sd is None:
            return False
        RNGState().load_state_dict(sd)
        npst = sd["numpy"]
        keys = np.asarray(npst["keys"].numpy(), dtype=np.uint32)
        np.random.set_state((str(npst["kind"]), keys, int(npst["pos"]), int(npst["has_gauss"]), float(npst["cached_gaussian"])))
        return True


def read_step(checkpointer: Checkpointer, step: int | None = None) -> tuple[int, dict[str, JSON]]:
    """Every shared top-level entry of ``step`` (default: latest good) as plain values, tensors in full
    (:meth:`Checkpointer.read <checkpoint.checkpointer.Checkpointer.read>`: this process only, no collective)."""
    return checkpointer.read(step)
