"""Elastic data position: one global cursor, each rank's share of the next global batch at any world size.

A job that changes world size between steps (a node lost, a node joining) must go on with the sample that
follows the last committed step, neither skipping nor repeating any. torch's ``DistributedSampler`` cannot:
its shards depend on the world size (rank r takes every W-th sample of the epoch), so the position of a
half-consumed epoch means nothing at another W. Here the position is global:

* the data is one stream of epochs; epoch e is a permutation of ``range(dataset_size)`` drawn from
  ``(seed, e)`` alone, never from the world size (:func:`epoch_permutation`);
* :class:`DataCursor` ``(epoch, consumed, seed)`` says where the stream stands after the last optimizer step;
  it is plain JSON, identical on every rank, and is committed with the step by the ``Checkpointer``
  (a top-level state entry: ``{"model": m, "optim": o, "data": batches}``);
* the global batch is fixed by :class:`BatchConfig`; the next ``global_batch`` positions of the stream are
  cut into contiguous per-rank shares (sizes differ by at most one when W does not divide the batch,
  :func:`rank_shares`), each share into the same number of micro-batches on every rank (gradient
  accumulation, so DDP's collectives stay matched) of at most ``max_micro_batch`` samples;
* uneven shares need weights: DDP averages the ranks' gradients, so a rank backpropagates its *summed*
  loss times :func:`loss_scale` ``= world_size / global_batch`` and the update is the global-batch mean,
  whatever W is (averaging per-rank means instead is off by the share imbalance, 22/21/21 of 64 at W=3).

Typical loop (see ``examples/train_ddp.py``)::

    batches = ElasticBatches(BatchConfig(global_batch=64, max_micro_batch=16, dataset_size=len(ds), seed=0))
    state = {"model": model, "optim": optim, "data": batches}
    ckpt.load(state)                                    # restores the cursor with the step
    loader = DataLoader(ds, batch_sampler=batches.sampler(rank, world), num_workers=2)
    micro = iter(loader)
    while step < steps:
        plan = batches.plan(rank, world)
        for i in range(plan.accumulation_steps):
            x, y = next(micro)
            with ddp.no_sync() if i < plan.accumulation_steps - 1 else nullcontext():
                (loss_fn(ddp(x), y, reduction="sum") * plan.loss_scale).backward()
        optim.step(); optim.zero_grad()
        batches.advance()                               # the cursor moves only after the step
        step += 1

Everything here is a pure function of plain data except the sampler's iteration; nothing depends on the
launcher, so it works the same under spotrun, torchrun or a single process.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import torch
from torch.utils.data import Sampler

from elastic.api import SpotrunError

logger = logging.getLogger(__name__)

__all__ = [
    "BatchConfig",
    "DataCursor",
    "ElasticBatchSampler",
    "ElasticBatches",
    "ElasticDataError",
    "StepPlan",
    "accumulation_steps",
    "epoch_permutation",
    "global_batch_indices",
    "loss_scale",
    "micro_batch_sizes",
    "plan_step",
    "rank_bounds",
    "rank_shares",
]


class ElasticDataError(SpotrunError, ValueError):
    """A data-position setting or a saved cursor is invalid or does not fit this dataset/world size."""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ElasticDataError(f"{name} must be an int >= {minimum}, got {value!r}")


# --------------------------------------------------------------------------- config and cursor
@dataclass(kw_only=True, slots=True, frozen=True)
class BatchConfig:
    """How the data is batched; fixed for the whole job, whatever the world size.

    Raises:
        ElasticDataError: a field is not a whole number in range, ``num_shards`` exceeds ``global_batch``, or
            both ``num_shards`` and ``max_micro_batch`` are set.
    """

    global_batch: int
    """Samples per optimizer step across all ranks (the batch the update is the mean of)."""
    dataset_size: int
    """Number of samples in one epoch (indices ``0 .. dataset_size - 1``)."""
    max_micro_batch: int | None = None
    """Most samples one rank feeds forward at once; the share of a step is split into that many
    accumulation micro-batches as needed. None: the whole share in one micro-batch."""
    seed: int = 0
    """Seed of the per-epoch permutations (epoch e's order depends on (seed, e) only)."""
    num_shards: int | None = None
    """Deterministic mode (see ``elastic.deterministic``): the global batch is cut into this many fixed
    virtual shards (contiguous, sizes differ by at most one), whole shards are dealt to ranks, and each shard
    is one micro-batch whose gradient is computed alone. Keep it fixed for the job; the micro-batch size is
    then ``global_batch / num_shards`` (``max_micro_batch`` must stay None). None: normal mode."""

    def __post_init__(self) -> None:
        _check_int("BatchConfig.global_batch", self.global_batch, 1)
        _check_int("BatchConfig.dataset_size", self.dataset_size, 1)
        _check_int("BatchConfig.seed", self.seed, 0)
        if self.max_micro_batch is not None:
            _check_int("BatchConfig.max_micro_batch (or None for no limit)", self.max_micro_batch, 1)
        if self.num_shards is not None:
            _check_int("BatchConfig.num_shards (or None for normal mode)", self.num_shards, 1)
            if self.num_shards > self.global_batch:
                raise ElasticDataError(
                    f"BatchConfig.num_shards={self.num_shards} exceeds global_batch={self.global_batch}: "
                    f"a shard needs at least one sample"
                )
            if self.max_micro_batch is not None:
                raise ElasticDataError(
                    "BatchConfig.max_micro_batch must be None with num_shards: in deterministic mode each "
                    "shard is one micro-batch (raise num_shards for smaller micro-batches)"
                )


@dataclass(slots=True)
class DataCursor:
    """Where the sample stream stands after the last completed optimizer step (identical on every rank)."""

    epoch: int = 0
    """Current epoch (0-based)."""
    consumed: int = 0
    """Samples of ``epoch`` already consumed (its permutation positions ``0 .. consumed - 1``)."""
    seed: int = 0
    """Seed of the per-epoch permutations; saved so a resume with another seed is caught, not silently mixed."""

    def position(self, dataset_size: int) -> int:
        """Samples consumed since the start of the job.

        Args:
            dataset_size: samples per epoch.

        Returns:
            ``epoch * dataset_size + consumed``.
        """
        return self.epoch * dataset_size + self.consumed

    def advanced(self, samples: int, dataset_size: int) -> DataCursor:
        """The cursor after ``samples`` more samples of the stream (crossing epoch boundaries as needed).

        Args:
            samples: how many samples to move past (>= 0).
            dataset_size: samples per epoch.

        Returns:
            A new cursor (this one is unchanged).

        Raises:
            ElasticDataError: ``samples`` is negative or not an int.
        """
        _check_int("samples", samples, 0)
        epochs, consumed = divmod(self.consumed + samples, dataset_size)
        return replace(self, epoch=self.epoch + epochs, consumed=consumed)

    def to_json(self) -> dict[str, int]:
        """Returns:
            ``{"epoch", "consumed", "seed"}``: what a checkpoint stores.
        """
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], dataset_size: int) -> DataCursor:
        """Parse a saved cursor.

        Args:
            d: what ``to_json`` wrote.
            dataset_size: this run's samples per epoch.

        Returns:
            The cursor.

        Raises:
            ElasticDataError: naming the field when it is missing or out of range, or when ``consumed`` does
                not fit in an epoch of ``dataset_size`` (another dataset).
        """
        try:
            epoch, consumed, seed = d["epoch"], d["consumed"], d["seed"]
        except (KeyError, TypeError):
            raise ElasticDataError(f"saved data cursor {d!r} lacks one of epoch, consumed, seed") from None
        _check_int("saved cursor epoch", epoch, 0)
        _check_int("saved cursor seed", seed, 0)
        _check_int("saved cursor consumed", consumed, 0)
        if consumed >= dataset_size:
            raise ElasticDataError(
                f"saved cursor consumed={consumed} is not inside an epoch of {dataset_size} samples: "
                f"the checkpoint was written for another dataset"
            )
        return cls(epoch=epoch, consumed=consumed, seed=seed)


# --------------------------------------------------------------------------- pure functions
def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash, not seed + epoch: (seed=1, epoch=0) and (seed=0, epoch=1) must not share a permutation.
    digest = hashlib.blake2b(f"spotrun-data:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@lru_cache(maxsize=4)
def _cached_permutation(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    return torch.randperm(dataset_size, generator=gen)


def epoch_permutation(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    """The sample order of ``epoch`` (int64 tensor, a permutation of ``range(dataset_size)``); never depends on
    the world size. Cached for the last few epochs, so a step costs a slice, not a permutation."""
    return _cached_permutation(seed, epoch, dataset_size).clone()


def global_batch_indices(cursor: DataCursor, global_batch: int, dataset_size: int) -> torch.Tensor:
    """Dataset indices of the next ``global_batch`` samples of the stream after ``cursor``, in stream order.

    A batch that reaches the end of an epoch continues with the start of the next epoch's permutation, so
    every sample of every epoch is consumed exactly once and every step has the same global batch.
    """
    parts: list[torch.Tensor] = []
    epoch, offset, left = cursor.epoch, cursor.consumed, global_batch
    while left > 0:
        take = min(left, dataset_size - offset)
        parts.append(_cached_permutation(cursor.seed, epoch, dataset_size)[offset : offset + take])
        left -= take
        epoch, offset = epoch + 1, 0
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def rank_shares(global_batch: int, world_size: int) -> list[int]:
    """Samples each rank takes of a global batch: as even as possible, the first ``global_batch % W`` ranks one more."""
    _check_int("world_size", world_size, 1)
    base, extra = divmod(global_batch, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def rank_bounds(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s contiguous share within the global batch."""
    if not 0 <= rank < world_size:
        raise ElasticDataError(f"rank {rank} is outside world size {world_size}")
    base, extra = divmod(global_batch, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def accumulation_steps(global_batch: int, world_size: int, max_micro_batch: int | None) -> int:
    """Micro-batches per step, the same on every rank (so DDP's gradient all-reduces pair up): enough for
    the largest share to fit in ``max_micro_batch``."""
    largest = -(-global_batch // world_size)
    return 1 if max_micro_batch is None else max(1, -(-largest // max_micro_batch))


def micro_batch_sizes(share: int, steps: int) -> list[int]:
    """Split a share into ``steps`` micro-batches as evenly as possible (largest first); some may be 0 when
    ``share < steps``."""
    base, extra = divmod(share, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def loss_scale(global_batch: int, world_size: int) -> float:
    """Factor for a rank's *summed* (not averaged) loss so that DDP's gradient average is the global-batch mean.

    DDP divides the sum of the ranks' gradients by W; ``sum_r (W / B) * g_r / W = (1 / B) * sum_samples g``.
    """
    return world_size / global_batch


# --------------------------------------------------------------------------- the step plan
@dataclass(frozen=True, slots=True)
class StepPlan:
    """One rank's part of the next optimizer step."""

    rank: int
    world_size: int
    global_batch: int
    indices: tuple[int, ...]
    """This rank's dataset indices (its contiguous share of the global batch, in stream order)."""
    micro_batches: tuple[tuple[int, ...], ...]
    """``indices`` cut into ``accumulation_steps`` micro-batches (same count on every rank; may hold an empty
    one when the share is smaller than the count)."""
    loss_scale: float
    """Multiply the *summed* loss of each micro-batch by this before ``backward`` (see :func:`loss_scale`).
    1.0 in deterministic mode, where the ``ShardGradReducer`` scales the fixed-order sum itself."""
    share_start: int = 0
    """Offset of ``indices[0]`` within the global batch."""
    shard_ids: tuple[int, ...] = ()
    """Deterministic mode: the virtual shard each micro-batch is (empty in normal mode)."""

    @property
    def accumulation_steps(self) -> int:
        return len(self.micro_batches)

    @property
    def sample_weight(self) -> float:
        """Weight of one sample in the global mean: ``1 / global_batch``."""
        return 1.0 / self.global_batch


def plan_step(config: BatchConfig, cursor: DataCursor, rank: int, world_size: int) -> StepPlan:
    """Rank ``rank``'s share of the global batch that follows ``cursor`` at world size ``world_size``."""
    batch = global_batch_indices(cursor, config.global_batch, config.dataset_size)
    if config.num_shards is not None:
        return _plan_shards(config, batch, rank, world_size, config.num_shards)
    start, end = rank_bounds(config.global_batch, world_size, rank)
    indices = tuple(batch[start:end].tolist())
    steps = accumulation_steps(config.global_batch, world_size, config.max_micro_batch)
    micro: list[tuple[int, ...]] = []
    offset = 0
    for size in micro_batch_sizes(len(indices), steps):
        micro.append(indices[offset : offset + size])
        offset += size
    return StepPlan(
        rank=rank,
        world_size=world_size,
        global_batch=config.global_batch,
        indices=indices,
        micro_batches=tuple(micro),
        loss_scale=loss_scale(config.global_batch, world_size),
        share_start=start,
    )


def _plan_shards(config: BatchConfig, batch: torch.Tensor, rank: int, world_size: int, num_shards: int) -> StepPlan:
    """Deterministic mode: rank ``rank`` takes a contiguous block of whole shards; shard s is always the same
    samples (global-batch positions ``rank_bounds(global_batch, num_shards, s)``) at every world size."""
    first, last = rank_bounds(num_shards, world_size, rank)
    shard_ids = tuple(range(first, last))
    micro = tuple(
        tuple(batch[slice(*rank_bounds(config.global_batch, num_shards, s))].tolist()) for s in shard_ids
    )
    start = rank_bounds(config.global_batch, num_shards, first)[0] if shard_ids else 0
    return StepPlan(
        rank=rank,
        world_size=world_size,
        global_batch=config.global_batch,
        indices=tuple(i for m in micro for i in m),
        micro_batches=micro,
        loss_scale=1.0,  # the ShardGradReducer divides the fixed-order sum by global_batch itself
        share_start=start,
        shard_ids=shard_ids,
    )


# --------------------------------------------------------------------------- stateful holder and sampler
@dataclass(slots=True)
class ElasticBatches:
    """The job's batching config and its cursor; put it in the checkpoint state (saved as JSON, same on all ranks)."""

    config: BatchConfig
    cursor: DataCursor = field(default_factory=DataCursor)

    def __post_init__(self) -> None:
        if self.cursor == DataCursor():
            self.cursor = DataCursor(seed=self.config.seed)
        elif self.cursor.seed != self.config.seed:
            raise ElasticDataError(f"cursor seed {self.cursor.seed} differs from BatchConfig.seed {self.config.seed}")

    def plan(self, rank: int, world_size: int) -> StepPlan:
        """This rank's part of the next step (call once per step, before ``advance``).

        Args:
            rank: this rank (``RANK``).
            world_size: the current world size (``WORLD_SIZE``).

        Returns:
            The step plan: this rank's indices, its micro-batches and the loss scale.
        """
        return plan_step(self.config, self.cursor, rank, world_size)

    def advance(self) -> None:
        """Move the cursor past one global batch: call after the optimizer step, before saving."""
        self.cursor = self.cursor.advanced(self.config.global_batch, self.config.dataset_size)

    def sampler(self, rank: int, world_size: int, steps: int | None = None) -> ElasticBatchSampler:
        """A batch sampler yielding this rank's micro-batches from the current cursor on (see the class).

        Args:
            rank: this rank.
            world_size: the current world size.
            steps: how many steps to yield (None: an endless stream).

        Returns:
            An ``ElasticBatchSampler`` for ``DataLoader(ds, batch_sampler=...)``.

        Raises:
            ElasticDataError: the global batch is too small for the world size and ``max_micro_batch``.
        """
        return ElasticBatchSampler(self, rank, world_size, steps=steps)

    def state_dict(self) -> dict[str, Any]:
        """Returns:
            The cursor and the dataset size, as JSON (the same on every rank).
        """
        return {**self.cursor.to_json(), "dataset_size": self.config.dataset_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor (the ``Checkpointer`` calls it on ``load``).

        Args:
            state: what ``state_dict`` returned.

        Raises:
            ElasticDataError: the saved cursor is for another dataset size or seed, or is malformed.
        """
        saved_size = state.get("dataset_size", self.config.dataset_size)
        if saved_size != self.config.dataset_size:
            raise ElasticDataError(
                f"the checkpoint's data cursor is for a dataset of {saved_size} samples, this run has "
                f"{self.config.dataset_size}: resume with the same dataset"
            )
        cursor = DataCursor.from_json(state, self.config.dataset_size)
        if cursor.seed != self.config.seed:
            raise ElasticDataError(
                f"the checkpoint's data cursor has seed {cursor.seed}, this run's BatchConfig.seed is "
                f"{self.config.seed}: resume with the same seed (the epoch order depends on it)"
            )
        self.cursor = cursor
        logger.info("data cursor restored: epoch %d, %d/%d samples consumed", cursor.epoch, cursor.consumed,
                    self.config.dataset_size)


class ElasticBatchSampler(Sampler[list[int]]):
    """Batch sampler for ``DataLoader(ds, batch_sampler=...)``: this rank's micro-batches, step after step.

    Iteration starts at the cursor as it is when ``iter()`` is called (so create the loader's iterator after
    ``Checkpointer.load``) and walks its own copy: a ``DataLoader`` with ``num_workers > 0`` prefetches
    ahead of training, and the job's cursor must move only when a step completes (``ElasticBatches.advance``).
    Each step yields ``accumulation_steps`` lists of indices; ``steps`` bounds the iteration (None: endless
    stream, epochs follow one another). An empty micro-batch is refused here (``DataLoader`` cannot collate
    one): with a global batch that small for the world size, lower the accumulation (``max_micro_batch``).
    """

    def __init__(self, batches: ElasticBatches, rank: int, world_size: int, *, steps: int | None = None) -> None:
        """Args:
            batches: the job's batches; iteration starts at its cursor as it is when ``iter()`` is called.
            rank: this rank.
            world_size: the current world size.
            steps: how many steps to yield (None: an endless stream).

        Raises:
            ElasticDataError: ``steps`` is negative, ``rank`` is out of range, or a rank's share is smaller
                than the number of micro-batches (raise ``max_micro_batch`` or the global batch).
        """
        if steps is not None:
            _check_int("steps (or None for an endless stream)", steps, 0)
        cfg = batches.config
        accum = accumulation_steps(cfg.global_batch, world_size, cfg.max_micro_batch)
        smallest = min(rank_shares(cfg.global_batch, world_size))
        if cfg.num_shards is not None:  # whole shards per rank, never empty ones (num_shards <= global_batch)
            accum = len(range(*rank_bounds(cfg.num_shards, world_size, rank)))
        elif smallest < accum:
            raise ElasticDataError(
                f"global batch {cfg.global_batch} at world size {world_size} gives a rank {smallest} samples "
                f"for {accum} micro-batches: raise max_micro_batch or the global batch"
            )
        rank_bounds(cfg.global_batch, world_size, rank)  # validates rank
        self.batches, self.rank, self.world_size, self.steps = batches, rank, world_size, steps
        self._accum = accum

    def __iter__(self) -> Iterator[list[int]]:
        cfg = self.batches.config
        cursor = self.batches.cursor
        done = 0
        while self.steps is None or done < self.steps:
            for micro in plan_step(cfg, cursor, self.rank, self.world_size).micro_batches:
                yield list(micro)
            cursor = cursor.advanced(cfg.global_batch, cfg.dataset_size)
            done += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("an endless ElasticBatchSampler has no len(); give steps=N")
        return self.steps * self._accum

