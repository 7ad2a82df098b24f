"""Deterministic mode: gradients that are bit-identical at every world size.

Within 1e-5 is the best a normal DDP step can promise across a world-size change: the global-batch
gradient is the same mathematical sum, but floating-point addition is not associative and the grouping
follows the world size (per-rank sums inside the backward pass, then the all-reduce's ring order).

Here the grouping is fixed by the job instead of the world size. The global batch is cut into
``num_shards`` virtual shards (``BatchConfig.num_shards``; shard s is always the same samples), and the
gradient is the sum of the shards' gradients along one fixed binary tree over the shards (the segment tree
of ``[0, num_shards)``: a node is its left child plus its right child). Each rank computes the gradient of
each of its shards *alone* (one forward/backward per shard, nothing accumulated across shards), sums them
up to the largest tree nodes that lie within its contiguous block of shards (:func:`dyadic_blocks`), and
one ``all_gather`` gives every rank every rank's node sums; each rank then finishes the same tree
(:func:`tree_sum`) and divides by the global batch. A shard's gradient does not depend on which rank or
how many ranks computed it (same weights, same samples, same kernels), and every node of the tree is the
same two values added in the same order, so the result does not depend on the world size either.

Conditions: the same kernels everywhere (same device type and torch build; a fixed intra-op thread count,
e.g. ``torch.set_num_threads(1)``, since a GEMM may split its reduction by thread; deterministic algorithms
on GPU), and no cross-sample coupling inside the model except through the shard (BatchNorm statistics are
per shard, the same at any world size).

Cost: a rank sends at most ``2 log2(num_shards)`` node sums instead of DDP's one (one each when the world
size divides a power-of-two shard count), a shard's backward cannot overlap with communication as DDP's
buckets do, and small shards run small kernels; ``bench/deterministic_bench.py`` measures it. torch's DDP
cannot do this (it reduces whatever each rank accumulated, in bucket order), hence our own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastic.worker.data import ElasticDataError, rank_bounds

logger = logging.getLogger(__name__)

__all__ = ["Node", "ShardGradReducer", "dyadic_blocks", "tree_sum"]


Node = tuple[int, int]
"""A node of the shard tree: ``(first shard, span)``, span a power of two; it covers the shards
``[first, min(first + span, num_shards))``."""


def _root_span(num_shards: int) -> int:
    return 1 << max(0, (num_shards - 1).bit_length())


def dyadic_blocks(num_shards: int, start: int, end: int) -> list[Node]:
    """The largest tree nodes whose shards all lie in ``[start, end)``, left to right (they tile the range)."""
    out: list[Node] = []

    def visit(first: int, span: int) -> None:
        last = min(first + span, num_shards)
        if first >= end or last <= start or first >= num_shards:
            return
        if start <= first and last <= end:
            out.append((first, span))
            return
        visit(first, span // 2)
        visit(first + span // 2, span // 2)

    if start < end:
        visit(0, _root_span(num_shards))
    return out


def tree_sum(num_shards: int, known: Mapping[Node, torch.Tensor], node: Node | None = None) -> torch.Tensor:
    """The value of ``node`` (default: the root) of the shard tree: a known value, else left + right child.

    ``known`` holds leaves ``(s, 1)`` or larger nodes; the nodes needed must tile the shards under ``node``.
    The same node always adds the same two children in the same order, whoever evaluates it.
    """
    first, span = node if node is not None else (0, _root_span(num_shards))
    if (first, span) in known:
        return known[(first, span)]
    if span == 1:
        raise ElasticDataError(f"shard {first} has no gradient: no rank computed it")
    left = tree_sum(num_shards, known, (first, span // 2))
    if first + span // 2 >= num_shards:  # the padded right half holds no shard
        return left
    return left + tree_sum(num_shards, known, (first + span // 2, span // 2))


class ShardGradReducer:
    """Collects per-shard gradients and reduces them in fixed shard order (see the module docstring).

    The rank takes shards ``rank_bounds(num_shards, world_size, rank)``, as ``ElasticBatches.plan`` deals them.
    One step::

        plan = batches.plan(rank, world)          # BatchConfig(num_shards=S): micro-batches are shards
        reducer.begin()
        for shard, idx in zip(plan.shard_ids, plan.micro_batches):
            reducer.add_shard(shard, loss_fn(model(x[idx]), y[idx], reduction="sum"))
        loss = reducer.finish()                   # p.grad set on every rank; the global-batch mean loss
        optim.step()

    The model is the bare module (not wrapped in DDP: this replaces DDP's reduction); like DDP, the
    constructor broadcasts rank 0's parameters (buffers such as BatchNorm statistics are not synchronised).
    ``process_group`` None is the default group when one is initialised, else a single process.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        num_shards: int,
        global_batch: int,
        process_group: Any = None,
    ) -> None:
        """Args:
            params: the bare model's parameters (those without ``requires_grad`` are left out).
            num_shards: virtual shards per global batch (``BatchConfig.num_shards``; fixed for the job).
            global_batch: samples per optimizer step across all ranks (``BatchConfig.global_batch``).
            process_group: the group to reduce over (None: the default group, or a single process).

        Raises:
            ElasticDataError: no trainable parameter, parameters of several dtypes or devices, or not
                ``1 <= num_shards <= global_batch``.
        """
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
        self._dtype, self._device = dtypes.pop(), devices.pop()
        self._leaves: dict[Node, torch.Tensor] = {}
        """This step's shards: ``(shard, 1)`` -> flat gradient followed by the shard's summed loss."""
        # One row per shard, allocated once: fresh multi-MB tensors every step cost page faults (2x the copy).
        self._rows = torch.empty(num_shards, self._numel + 1, dtype=self._dtype, device=self._device)
        self._broadcast_params()

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Start every rank from rank 0's weights, as DDP's constructor does (the reducer replaces DDP)."""
        if self._world()[1] > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for p in self.params:
                dist.broadcast(p.data, src=src, group=self.group)

    def begin(self) -> None:
        """Start a step: forget the previous step's shard gradients."""
        self._leaves.clear()

    def add_shard(self, shard: int, loss_sum: torch.Tensor) -> None:
        """Backpropagate one shard's *summed* loss alone and keep its gradient as the shard's leaf.

        Args:
            shard: the shard's id (``StepPlan.shard_ids``).
            loss_sum: the shard's loss summed over its samples (``reduction="sum"``).

        Raises:
            ElasticDataError: ``shard`` is out of range or was already added this step.
        """
        if not 0 <= shard < self.num_shards:
            raise ElasticDataError(f"shard {shard} is outside 0..{self.num_shards - 1}")
        if (shard, 1) in self._leaves:
            raise ElasticDataError(f"shard {shard} was already added this step (call begin() per step)")
        grads = torch.autograd.grad(loss_sum, self.params, allow_unused=True)
        row = self._rows[shard]
        offset = 0
        for p, g in zip(self.params, grads):
            n = p.numel()
            if g is None:
                row[offset : offset + n].zero_()
            else:
                row[offset : offset + n].copy_(g.reshape(-1))
            offset += n
        row[-1] = loss_sum.detach()
        self._leaves[(shard, 1)] = row

    @property
    def leaves(self) -> Mapping[Node, torch.Tensor]:
        """This step's shards so far: ``(shard, 1)`` -> flat gradient followed by the shard's summed loss (what
        ``finish`` sums along the tree)."""
        return self._leaves

    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group), dist.get_world_size(self.group)
        return 0, 1

    def finish(self) -> torch.Tensor:
        """Sum the shards along the fixed tree across ranks, set every parameter's ``.grad`` to the
        global-batch mean gradient.

        Collective: call it on every rank once per step, after its ``add_shard`` calls.

        Returns:
            The global-batch mean loss (a 0-d tensor, bit-identical at any world size).

        Raises:
            ElasticDataError: this rank did not add exactly its shards of the step.
        """
        rank, world = self._world()
        start, end = rank_bounds(self.num_shards, world, rank)
        added = sorted(first for first, _ in self._leaves)
        if added != list(range(start, end)):
            raise ElasticDataError(
                f"rank {rank}/{world} must add exactly shards {start}..{end - 1} this step, got {added}"
            )
        mine = dyadic_blocks(self.num_shards, start, end)
        sums = [tree_sum(self.num_shards, self._leaves, node) for node in mine]
        known = dict(zip(mine, sums)) if world == 1 else self._exchange(sums, world)
        total = tree_sum(self.num_shards, known) / self.global_batch  # a new tensor: the grads may view it
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p)
            offset += n
        return total[-1]

    def _exchange(self, sums: list[torch.Tensor], world: int) -> dict[Node, torch.Tensor]:
        """Every rank's node sums, by node: each rank's nodes follow from (num_shards, world) alone."""
        blocks = [dyadic_blocks(self.num_shards, *rank_bounds(self.num_shards, world, r)) for r in range(world)]
        rows = max(len(b) for b in blocks)
        send = torch.zeros(rows, self._numel + 1, dtype=self._dtype, device=self._device)
        for i, value in enumerate(sums):
            send[i].copy_(value)
        received = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(received, send, group=self.group)
        return {node: received[r][i] for r in range(world) for i, node in enumerate(blocks[r])}
