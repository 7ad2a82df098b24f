"""Hugging Face ``Trainer`` integration: its whole training state saved and restored through the Checkpointer.

::

    ckpt = Checkpointer("s3://bucket/run1", CheckpointConfig(keep_last=2))
    callback = CheckpointerCallback(ckpt)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])   # args.save_steps sets the cadence
    trainer.train(resume_from_checkpoint=callback.resume_from(trainer))      # None on a fresh start

Where the Trainer would write ``checkpoint-N/`` (pickled optimizer, scheduler and RNG files), the callback saves
step N through the Checkpointer instead: model, optimizer (FQN-keyed, reshardable), LR scheduler, every global
RNG (per rank) and the ``TrainerState`` (global step, epoch, log history, callback states) as JSON.

Resume: ``resume_from`` loads the model and the trainer state and returns a small local directory holding
``trainer_state.json`` and the loaded weights; passed as ``resume_from_checkpoint`` it makes the Trainer do
what it does for its own checkpoints (epoch and data position from the global step, skipping the batches
already trained on). The callback then loads the optimizer and scheduler once the Trainer has built them
(``on_train_begin``) and restores the RNGs at the moment the Trainer would restore its own ``rng_state.pth``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from safetensors.torch import save_model
from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from checkpoint.api import CheckpointError
from checkpoint.checkpointer import Checkpointer
from checkpoint.integrations.common import GlobalRNG
from checkpoint.state import ModelOptimizer, PerRank

logger = logging.getLogger(__name__)

TRAINER_STATE_KEY = "trainer_state"
"""Top-level key of the ``TrainerState`` (as its JSON text) in the checkpoint."""


def _unwrap(obj: Any, attr: str) -> Any:
    """accelerate wraps the optimizer and scheduler (``AcceleratedOptimizer.optimizer``, ``.scheduler``)."""
    return getattr(obj, attr, obj)


class CheckpointerCallback(TrainerCallback):
    """Saves the Trainer's state through ``checkpointer`` at every step the Trainer would save, and resumes it.

    ``keep_trainer_checkpoints=True`` lets the Trainer also write its own ``checkpoint-N/`` directories.
    Saves happen after the step's logging and evaluation (as the Trainer's own save does), so the saved log
    history and RNG states are those of the end of the step.
    """

    def __init__(self, checkpointer: Checkpointer, *, keep_trainer_checkpoints: bool = False) -> None:
        """Args:
            checkpointer: where the Trainer's state goes (constructed on every rank).
            keep_trainer_checkpoints: also let the Trainer write its own (pickled) ``checkpoint-N/``
                directories.
        """
        self.checkpointer = checkpointer
        self.keep_trainer_checkpoints = keep_trainer_checkpoints
        self._due: str | None = None  # event after which the step's save runs: "log" or "evaluate"
        self._resume_step: int | None = None
        self._resume_dir: str | None = None
        self._rng = GlobalRNG(defer=True)
        self._rng_at_epoch_begin = False

    # ------------------------------------------------------------------ save
    def _state(self, model: Any, optimizer: Any = None, scheduler: Any = None, trainer_state: Any = None) -> dict[str, Any]:
        state: dict[str, Any] = {"model": model, "rng": PerRank(self._rng)}
        if optimizer is not None:
            state["optim"] = ModelOptimizer(model, _unwrap(optimizer, "optimizer"))
        if scheduler is not None:
            state["sched"] = _unwrap(scheduler, "scheduler")
        if trainer_state is not None:
            state[TRAINER_STATE_KEY] = {"json": trainer_state}
        return state

    def _save(self, state: TrainerState, **kwargs: Any) -> None:
        text = json.dumps(dataclasses.asdict(state), sort_keys=True)
        self.checkpointer.save(
            state.global_step,
            self._state(kwargs["model"], kwargs.get("optimizer"), kwargs.get("lr_scheduler"), text),
        )
        logger.info("[step %d] Trainer state handed to %r", state.global_step, self.checkpointer)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """TrainerCallback event: takes over the save the Trainer would make at this step (``save_steps``)."""
        if not control.should_save:
            return
        if not self.keep_trainer_checkpoints:
            control.should_save = False
        # The Trainer logs, then evaluates, then saves, all after this event: save after the last of them
        # that will run, so the log history and RNG are those its own checkpoint would hold.
        if control.should_evaluate:
            self._due = "evaluate"
        elif control.should_log:
            self._due = "log"
        else:
            self._save(state, **kwargs)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """TrainerCallback event: runs a save that waited for the step's logging."""
        if self._due == "log":
            self._due = None
            self._save(state, **kwargs)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """TrainerCallback event: runs a save that waited for the step's evaluation."""
        if self._due == "evaluate":
            self._due = None
            self._save(state, **kwargs)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """TrainerCallback event: waits for the last save to commit; removes the resume directory."""
        self.checkpointer.wait()
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None

    # ------------------------------------------------------------------ resume
    def resume_from(self, trainer: Any, step: int | None = None) -> str | None:
        """Load ``step`` (default: latest good) into ``trainer.model``; the directory to pass to
        ``trainer.train(resume_from_checkpoint=...)``, or None when there is no checkpoint yet.

        The optimizer, scheduler and RNG are restored where the Trainer restores its own (its
        ``on_train_begin``, ``on_epoch_begin``, ``on_step_begin`` events).

        Args:
            trainer: the ``transformers.Trainer`` this callback is registered with.
            step: the step to resume from; None: the newest good step.

        Returns:
            A temporary directory with the Trainer's ``trainer_state.json`` and the loaded weights (removed at
            ``on_train_end``), or None when there is no checkpoint yet.

        Raises:
            CheckpointError: the step was not saved by a ``CheckpointerCallback``, or loading it failed.
        """
        holder: dict[str, Any] = {}
        state = {"model": trainer.model, "rng": PerRank(self._rng), TRAINER_STATE_KEY: holder}
        loaded = self.checkpointer.load(state, step)
        if loaded is None:
            return None
        if "json" not in holder:
            raise CheckpointError(f"step {loaded} was not saved by CheckpointerCallback (it has no {TRAINER_STATE_KEY!r})")
        trainer_state = json.loads(holder["json"])
        # The Trainer restores RNG before the epoch's data loader starts when it resumes on an epoch boundary,
        # after fast-forwarding the loader otherwise (trainer.py _run_epoch); the epoch is integral only on a boundary.
        self._rng_at_epoch_begin = float(trainer_state.get("epoch") or 0).is_integer()
        self._resume_step = loaded
        directory = tempfile.mkdtemp(prefix=f"spotrun-hf-resume-{loaded}-")
        with open(os.path.join(directory, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f)
        # The Trainer insists on weights in a resume directory and reloads them: give it the ones just loaded.
        save_model(trainer.model, os.path.join(directory, "model.safetensors"))
        self._resume_dir = directory
        logger.info("resuming the Trainer from step %d of %r (via %s)", loaded, self.checkpointer, directory)
        return directory

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """TrainerCallback event: restores the optimizer and scheduler of the step ``resume_from`` loaded."""
        if self._resume_step is None:
            return
        restore = self._state(kwargs["model"], kwargs.get("optimizer"), kwargs.get("lr_scheduler"))
        for loaded_already in ("model", "rng"):  # read by resume_from (the RNG is pending in self._rng)
            del restore[loaded_already]
        if restore:
            self.checkpointer.load(restore, self._resume_step)
        logger.info("[step %d] optimizer and scheduler restored", self._resume_step)
        self._resume_step = None

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """TrainerCallback event: restores the RNG here when resuming on an epoch boundary."""
        if self._rng_at_epoch_begin and self._rng.restore():
            logger.debug("[step %d] RNG restored at the epoch boundary", state.global_step)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """TrainerCallback event: restores the RNG after the Trainer fast-forwarded the data loader."""
        if self._rng.restore():
            logger.debug("[step %d] RNG restored after fast-forwarding the data loader", state.global_step)
