"""Deterministic mode: gradients that are bit-identical at every world size.

Within 1e-5 is the best a normal DDP step can promise across a world-size change: the global-batch
gradient is the same mathematical sum, but floating-point addition is not associative and the grouping
follows the world size (per-rank sums inside the backward pass, then the all-reduce's ring order).

Here the grouping is fixed by the job instead of the world size. The global batch is cut into
``num_shards`` virtual shards (``BatchConfig.num_shards``; shard s is always the same samples). Each rank
computes the gradient of each of its shards *alone* (one forward/backward per shard, nothing accumulated
across shards), writes it into its own row of a ``[num_shards, n_params + 2]`` buffer (then the shard's
summed loss and a "computed" flag), and one ``all_reduce`` fills in the other ranks' rows: every row is non-zero on
exactly one rank, so the all-reduce adds only zeros and is exact. Every rank then sums the rows in shard
order 0, 1, ... and divides by the global batch. A shard's gradient does not depend on which rank or how
many ranks computed it (same weights, same samples, same kernels), so neither does the sum.

Conditions: the same kernels everywhere (same device type and torch build; a fixed intra-op thread count,
e.g. ``torch.set_num_threads(1)``, since a GEMM may split its reduction by thread; deterministic algorithms
on GPU), and no cross-sample coupling inside the model except through the shard (BatchNorm statistics are
per shard, the same at any world size).

Cost: the all-reduce carries ``num_shards`` times the gradient instead of once, and a shard's backward
cannot overlap with communication as DDP's buckets do; ``bench/deterministic_bench.py`` measures it.
torch's DDP cannot do this (it reduces whatever each rank accumulated, in bucket order), hence our own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from elastic.data import ElasticDataError

logger = logging.getLogger(__name__)

__all__ = ["ShardGradReducer"]


class ShardGradReducer:
    """Collects per-shard gradients and reduces them in fixed shard order (see the module docstring).

    One step::

        plan = batches.plan(rank, world)          # BatchConfig(num_shards=S): micro-batches are shards
        reducer.begin()
        for shard, idx in zip(plan.shard_ids, plan.micro_batches):
            reducer.add_shard(shard, loss_fn(model(x[idx]), y[idx], reduction="sum"))
        loss = reducer.finish()                   # p.grad set on every rank; the global-batch mean loss
        optim.step()

    The model is the bare module (not wrapped in DDP: this replaces DDP's reduction). ``process_group``
    None is the default group when one is initialised, else a single process.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        num_shards: int,
        global_batch: int,
        process_group: Any = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ElasticDataError("ShardGradReducer needs at least one parameter that requires grad")
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ElasticDataError(
                f"ShardGradReducer needs parameters of one dtype on one device, got {sorted(map(str, dtypes))} "
                f"on {sorted(map(str, devices))}"
            )
        if num_shards < 1 or global_batch < num_shards:
            raise ElasticDataError(f"need 1 <= num_shards <= global_batch, got {num_shards} and {global_batch}")
        self.num_shards, self.global_batch = num_shards, global_batch
        self.group = process_group
        self._numel = sum(p.numel() for p in self.params)
        self._buffer = torch.zeros(num_shards, self._numel + 2, dtype=dtypes.pop(), device=devices.pop())
        self._filled: set[int] = set()

    def begin(self) -> None:
        """Start a step: forget the previous step's shard gradients."""
        self._buffer.zero_()
        self._filled.clear()

    def add_shard(self, shard: int, loss_sum: torch.Tensor) -> None:
        """Backpropagate one shard's *summed* loss alone and keep its gradient in the shard's row."""
        if not 0 <= shard < self.num_shards:
            raise ElasticDataError(f"shard {shard} is outside 0..{self.num_shards - 1}")
        if shard in self._filled:
            raise ElasticDataError(f"shard {shard} was already added this step (call begin() per step)")
        grads = torch.autograd.grad(loss_sum, self.params, allow_unused=True)
        row = self._buffer[shard]
        offset = 0
        for p, g in zip(self.params, grads):
            n = p.numel()
            if g is not None:
                row[offset : offset + n].copy_(g.reshape(-1))
            offset += n
        row[-2] = loss_sum.detach()
        row[-1] = 1  # "this shard was computed": checked after the exchange
        self._filled.add(shard)

    def finish(self) -> torch.Tensor:
        """Exchange the rows, sum them in shard order, set every parameter's ``.grad`` to the global-batch
        mean gradient; returns the global-batch mean loss (a 0-d tensor, bit-identical at any world size)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            # Each row is written by one rank and zero elsewhere: the sum adds zeros only, exactly.
            dist.all_reduce(self._buffer, group=self.group)
        counts = self._buffer[:, -1]
        if not bool((counts == 1).all()):
            missing = [s for s in range(self.num_shards) if counts[s].item() != 1]
            raise ElasticDataError(f"shards {missing} were computed by no rank or by several this step")
        total = self._buffer[0, :-1].clone()
        for shard in range(1, self.num_shards):  # fixed order, whatever the world size
            total += self._buffer[shard, :-1]
        total /= self.global_batch
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).clone()
            offset += n
        return total[-1]
