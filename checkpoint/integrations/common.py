"""Pieces the trainer integrations share: the global RNG states as a Stateful whose restore can be deferred, and a
template-free read of a whole step (for callers that have no live state to load into, e.g. Lightning's
``CheckpointIO.load_checkpoint``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from checkpoint.api import JSON, CheckpointNotFoundError
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
    """Every shared top-level entry of ``step`` (default: latest good) as plain values, tensors assembled in full.

    For callers with no live state to load into. Reads on this process only (no collective): every rank of a
    job that calls it reads the whole step. Per-rank entries are not included.
    """
    from checkpoint.discover import read_objects, validate_step
    from checkpoint.export import assemble
    from checkpoint.state import _rebuild

    chosen = checkpointer.latest() if step is None else step
    if chosen is None:
        raise CheckpointNotFoundError(f"no committed checkpoint at {checkpointer.storage.display()}")
    manifest = validate_step(checkpointer.storage, chosen)
    objects = read_objects(checkpointer.storage, manifest)
    verify = checkpointer.config.verify_on_load
    loaded = {fqn: assemble(checkpointer.storage, manifest, fqn, verify=verify) for fqn in manifest.tensors}
    # no live value guides the containers: tuples come back as lists and int dict keys as str
    return chosen, {key: _rebuild(value, None, key, loaded) for key, value in objects.items()}
