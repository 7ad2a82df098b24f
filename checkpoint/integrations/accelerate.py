"""accelerate integration: ``save_state``/``load_state`` of everything an ``Accelerator`` prepared, through the
Checkpointer.

::

    model, optim, loader, sched = accelerator.prepare(model, optim, loader, sched)
    progress = {"epoch": 0, "batch": 0}
    start = load_state(accelerator, ckpt, progress=progress)          # None on a fresh start
    for epoch in range(progress["epoch"], epochs):
        batches = skip_batches(accelerator, loader, progress["batch"] if start and epoch == progress["epoch"] else 0)
        for batch in batches:
            ...
            save_state(accelerator, ckpt, step, progress={"epoch": epoch, "batch": i + 1})

Saved: every prepared model (unwrapped, so names carry no ``module.`` prefix), optimizer (FQN-keyed, paired with
its model) and scheduler, the objects given to ``accelerator.register_for_checkpointing``, ``accelerator.step``,
the global RNG states (per rank), and any extra entries passed as keywords (JSON values, tensors, stateful
objects: the data position, counters).

Why not ``Accelerator.register_save_state_pre_hook``: the hooks only let a caller take over the model weights;
``Accelerator.save_state`` still writes the optimizer, scheduler, sampler and RNG states with ``torch.save``
(pickle) into a local directory, which is what the Checkpointer exists to replace.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from checkpoint.checkpointer import Checkpointer
from checkpoint.integrations.common import GlobalRNG
from checkpoint.state import ModelOptimizer, PerRank

logger = logging.getLogger(__name__)


class _AcceleratorCounters:
    """Stateful of the Accelerator's own counters (gradient-accumulation position)."""

    __slots__ = ("accelerator",)

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.accelerator.step = int(state_dict["step"])


def _owner(optimizer: Any, models: list[Any]) -> Any:
    """The model whose parameters ``optimizer`` updates (first parameter decides)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ValueError("an optimizer prepared by the Accelerator updates none of its prepared models' parameters")


def accelerator_state(accelerator: Any, **extra: Any) -> dict[str, Any]:
    """The Checkpointer state of ``accelerator``'s prepared objects plus ``extra`` (see the module docstring)."""
    models = [accelerator.unwrap_model(m) for m in accelerator._models]
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        state[f"model_{i}"] = model
    for i, opt in enumerate(accelerator._optimizers):
        inner = getattr(opt, "optimizer", opt)  # AcceleratedOptimizer wraps the torch optimizer
        state[f"optimizer_{i}"] = ModelOptimizer(_owner(inner, models), inner)
    for i, sched in enumerate(accelerator._schedulers):
        state[f"scheduler_{i}"] = getattr(sched, "scheduler", sched)
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    state["accelerator"] = _AcceleratorCounters(accelerator)
    state["rng"] = PerRank(GlobalRNG())
    clash = sorted(set(extra) & set(state))
    if clash:
        raise ValueError(f"extra state keys {clash} are taken by the Accelerator's own entries; rename them")
    state.update(extra)
    return state


def save_state(accelerator: Any, checkpointer: Checkpointer, step: int, **extra: Any) -> None:
    """Save ``accelerator``'s state and ``extra`` as ``step`` (asynchronously, like ``Checkpointer.save``).

    Args:
        accelerator: the ``accelerate.Accelerator`` whose prepared models, optimizers, schedulers and
            ``register_for_checkpointing`` objects are saved, with ``accelerator.step`` and per-rank RNG.
        checkpointer: where to save (constructed on every rank).
        step: the step number to save as.
        **extra: more top-level entries (e.g. the data position).

    Raises:
        ValueError: an ``extra`` name is taken by the Accelerator's own entries.
        CheckpointError: from ``Checkpointer.save``.
    """
    checkpointer.save(step, accelerator_state(accelerator, **extra))


def load_state(accelerator: Any, checkpointer: Checkpointer, step: int | None = None, **extra: Any) -> int | None:
    """Restore ``accelerator``'s state and ``extra`` in place from ``step`` (default: latest good); the step
    loaded, or None when there is no checkpoint yet.

    Args:
        accelerator: the ``accelerate.Accelerator``, prepared as when the step was saved.
        checkpointer: where to load from.
        step: the step to load; None: the newest good step.
        **extra: the extra entries given to ``save_state``, restored in place.

    Returns:
        The step loaded, or None when there is no checkpoint yet.

    Raises:
        ValueError: an ``extra`` name is taken by the Accelerator's own entries.
        CheckpointError: from ``Checkpointer.load``.
    """
    loaded = checkpointer.load(accelerator_state(accelerator, **extra), step)
    if loaded is not None:
        logger.info("[step %d] Accelerator state restored from %r", loaded, checkpointer)
    return loaded


_END = object()


def skip_batches(accelerator: Any, loader: Any, skip: int) -> Iterator[Any]:
    """The batches of ``loader`` after the first ``skip`` (``accelerator.skip_first_batches``), the global RNG left
    as it was before the first batch.

    Starting a DataLoader's iterator draws its base seed from the global RNG. The interrupted run did that at the
    start of the epoch, before the state it saved; a resumed run that starts the iterator after restoring the RNG
    would draw once more and diverge (the HF Trainer restores its RNG after fast-forwarding for the same reason).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``loader``.
        loader: the prepared DataLoader of the interrupted epoch.
        skip: batches of this epoch already trained (0: the whole epoch).

    Yields:
        The remaining batches of the epoch.
    """
    if skip <= 0:
        yield from loader
        return
    rng = GlobalRNG()
    restored = rng.state_dict()
    batches = iter(accelerator.skip_first_batches(loader, skip))
    first = next(batches, _END)  # the epoch may have ended exactly at the saved position
    rng.load_state_dict(restored)
    if first is _END:
        return
    yield first
    yield from batches
