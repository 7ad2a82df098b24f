"""Lightning integration: a ``CheckpointIO`` plugin that writes Lightning's checkpoints through the Checkpointer.

::

    ckpt = Checkpointer("s3://bucket/run1", CheckpointConfig(keep_last=2))
    io = CheckpointerIO(ckpt)
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
    trainer.fit(module, ckpt_path=io.latest_path())   # None on a fresh start

Every checkpoint dict Lightning hands over (model ``state_dict``, optimizer and scheduler states, loop progress,
callback states) becomes step ``global_step`` of the Checkpointer: tensors sharded in safetensors, the rest JSON,
its top-level keys as they are (``spotrun-ckpt export --key state_dict`` exports the model). The plugin adds the
per-rank global RNG states, which Lightning's own checkpoints leave out and an exact resume needs, and restores
them when Lightning loads the checkpoint.

Lightning names a checkpoint by a file path; the path is stored in the step (``lightning_path``) and
``load_checkpoint(path)`` finds the newest step saved under it. Deleting old checkpoints is the Checkpointer's
retention (``keep_last``/``keep_every``), so ``remove_checkpoint`` only logs.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from checkpoint.api import CheckpointNotFoundError
from checkpoint.checkpointer import Checkpointer
from checkpoint.discover import list_steps, read_objects, validate_step
from checkpoint.integrations.common import GlobalRNG, read_step
from checkpoint.state import PerRank

logger = logging.getLogger(__name__)

PATH_KEY = "lightning_path"
"""Top-level key holding the path Lightning saved the checkpoint under."""
RNG_KEY = "rng"


def _int_keys(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict read back from JSON: its per-parameter ``state`` is keyed by int again
    (``torch.optim.Optimizer.load_state_dict`` matches those ints to the param groups' ``params``)."""
    state = optimizer_state.get("state")
    if isinstance(state, dict):
        optimizer_state["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in state.items()}
    return optimizer_state


class CheckpointerIO(CheckpointIO):
    """Lightning ``CheckpointIO`` backed by a spotrun ``Checkpointer`` (see the module docstring)."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        """Args:
            checkpointer: where Lightning's checkpoints go (constructed on every rank).
        """
        super().__init__()
        self.checkpointer = checkpointer
        self._paths: dict[str, int] = {}  # paths saved by this process (two paths may share a step)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save Lightning's checkpoint dict as step ``checkpoint["global_step"]`` (asynchronously), with the
        per-rank RNG states; a second path for the same step (``last.ckpt``) is only remembered.

        Args:
            checkpoint: Lightning's checkpoint dict (its keys become top-level entries of the step).
            path: the path Lightning names the checkpoint by (kept in the step, for ``load_checkpoint``).
            storage_options: ignored (the ``Checkpointer``'s own storage options apply).

        Raises:
            ValueError: the dict already has a ``lightning_path`` or ``rng`` key.
            CheckpointError: from ``Checkpointer.save``.
        """
        step = int(checkpoint["global_step"])
        if step in self._paths.values():  # e.g. ModelCheckpoint's "last" beside the regular one: same state
            logger.debug("[step %d] already saved; %s is another name for it", step, path)
            self._paths[str(path)] = step
            return
        if PATH_KEY in checkpoint or RNG_KEY in checkpoint:
            raise ValueError(f"a Lightning checkpoint with its own {PATH_KEY!r} or {RNG_KEY!r} key cannot be saved by CheckpointerIO")
        state = dict(checkpoint)
        state[PATH_KEY] = str(path)
        state[RNG_KEY] = PerRank(GlobalRNG())
        self.checkpointer.save(step, state)
        self._paths[str(path)] = step
        logger.info("[step %d] Lightning checkpoint %s handed to %r", step, path, self.checkpointer)

    def latest_path(self) -> str | None:
        """The path of the newest committed step (for ``trainer.fit(ckpt_path=...)``), or None when there is none.

        Returns:
            The path Lightning saved the newest good step under, or None.
        """
        step = self.checkpointer.latest()
        if step is None:
            return None
        holder: dict[str, Any] = {PATH_KEY: None}
        self.checkpointer.load(holder, step)
        self._paths[str(holder[PATH_KEY])] = step
        return str(holder[PATH_KEY])

    def _step_of(self, path: str) -> int:
        if path in self._paths:
            return self._paths[path]
        for step in sorted(list_steps(self.checkpointer.storage).committed, reverse=True):
            objects = read_objects(self.checkpointer.storage, validate_step(self.checkpointer.storage, step))
            if objects.get(PATH_KEY) == path:
                return step
        raise CheckpointNotFoundError(
            f"no committed step at {self.checkpointer.storage.display()} was saved as {path!r}; "
            f"use CheckpointerIO.latest_path() for the newest one"
        )

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the step saved under ``path`` back as Lightning's checkpoint dict and restore the RNG states.

        Args:
            path: a path ``save_checkpoint`` was given (e.g. from ``latest_path``).
            map_location: ignored (tensors come back on the CPU).
            weights_only: ignored (nothing is unpickled: the format has no pickle).

        Returns:
            Lightning's checkpoint dict.

        Raises:
            CheckpointNotFoundError: no committed step was saved under ``path``.
        """
        self.checkpointer.wait()
        step, checkpoint = read_step(self.checkpointer, self._step_of(str(path)))
        checkpoint.pop(PATH_KEY, None)
        checkpoint["optimizer_states"] = [_int_keys(o) for o in checkpoint.get("optimizer_states", [])]
        self.checkpointer.load({RNG_KEY: PerRank(GlobalRNG(), on_resize="skip")}, step)
        logger.info("[step %d] Lightning checkpoint %s loaded (RNG restored)", step, path)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Ignored: the ``Checkpointer``'s ``keep_last``/``keep_every`` decide deletions.

        Args:
            path: the checkpoint Lightning would delete.
        """
        logger.debug("remove_checkpoint(%s) ignored: the Checkpointer's keep_last/keep_every decide deletions", path)

    def teardown(self) -> None:
        """Wait for the save in flight to commit (Lightning calls it at the end of ``fit``)."""
        self.checkpointer.wait()
