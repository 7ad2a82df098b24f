"""The memory tier as a ``Checkpointer`` option: ``CheckpointConfig(memory=MemoryTierConfig(...))``.

A user's loop that already has the preemption line gets the memory tier from that one option::

    with Checkpointer(uri, CheckpointConfig(memory=MemoryTierConfig(every="auto"))) as ckpt:
        start = (ckpt.load(state) or 0) + 1          # memory first (local, then a peer's), then durable
        preemption = Preemption()
        for step in range(start, steps + 1):
            train_step(step)
            if preemption.save_and_stop(ckpt, step, state):   # also ckpt.snapshot(step, state)
                break

(a loop without ``Preemption`` calls ``ckpt.snapshot(step, state)`` after each step instead).

Just in time: when a collective fails inside the ``with`` block (a peer died mid-step), ``Checkpointer.__exit__``
snapshots the last step passed to ``snapshot`` -- but only when it can tell that the state is still that step's:
every ``torch.optim.Optimizer`` in the state is watched with a step post-hook, and one that stepped since the
last ``snapshot`` call (the failure came after ``optimizer.step()``, e.g. in a logging all-reduce) means the live
state is newer than the step number it would be saved as; the just-in-time snapshot is then skipped, said once,
and the restore uses the last periodic snapshot. A state with no optimizer is never snapshotted just in time
(nothing tells whether it moved). The examples, which manage the tier themselves, keep the step counter exact
by construction (``checkpoint.memory.jit``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from checkpoint.memory.api import MemoryTier, RestoreReport
from checkpoint.memory.config import MemoryTierConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)


class AttachedMemory:
    """The memory tier a ``Checkpointer`` owns: the tier itself, the last step it was given, and whether the
    state moved since (optimizer step hooks), for the just-in-time snapshot at ``__exit__``."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier
        self.last_restore: RestoreReport | None = None
        """What the last ``Checkpointer.load`` restored, and from where (None: nothing restored yet)."""
        self._step: int | None = None
        self._state: Mapping[str, Any] | None = None
        self._watched: tuple[int, ...] = ()
        self._hooks: list[RemovableHandle] = []
        self._stepped = False
        """An optimizer of the state stepped after the last ``snapshot`` call: the state is past ``_step``."""
        self._said_skip = False

    @classmethod
    def open(cls, config: MemoryTierConfig, process_group: ProcessGroup | None) -> AttachedMemory:
        """The node's tier with buddy copies and peer restores (``PeerShmTier``). Collective: after the process
        group, on every rank; off on every rank (said once) when one has no keeper directory."""
        from checkpoint.memory.peer import PeerShmTier

        return cls(PeerShmTier(config=config, process_group=process_group))

    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Remember ``state`` as that of ``step`` (for a just-in-time snapshot) and snapshot it when due."""
        self._watch(state)
        self._step, self._state, self._stepped = step, state, False
        return self.tier.snapshot(step, state)

    def on_failure(self, exc: BaseException) -> bool:
        """After ``exc`` left the ``with`` block: snapshot the last completed step if ``exc`` is a failed
        collective and the state is still that step's; True when this node holds it. Never raises."""
        if self._step is None or self._state is None:
            return False
        if not self._hooks or self._stepped:
            if not self._said_skip:
                self._said_skip = True
                why = ("no torch.optim.Optimizer in the state to tell whether it moved" if not self._hooks else
                       f"an optimizer stepped after step {self._step} was passed to snapshot()")
                logger.warning("no just-in-time memory snapshot after %s: %s; a restart uses the last periodic "
                               "snapshot", type(exc).__name__, why)
            return False
        return self.tier.snapshot_on_failure(self._step, self._state, exc)

    def close(self) -> None:
        """Remove the optimizer hooks and close the tier (its published snapshots stay for a restart)."""
        self._unwatch()
        self.tier.close()

    # ------------------------------------------------------------------ optimizer watch
    def _watch(self, state: Mapping[str, Any]) -> None:
        import torch

        optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        key = tuple(id(o) for o in optimizers)
        if key == self._watched:
            return
        self._unwatch()
        self._hooks = [o.register_step_post_hook(self._on_optimizer_step) for o in optimizers]
        self._watched = key

    def _unwatch(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._watched = [], ()

    def _on_optimizer_step(self, *_: Any) -> None:
        self._stepped = True
