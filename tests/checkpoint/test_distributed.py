"""Save at world size 4, load at 1, 2, 3 and 5: DDP and FSDP2 (``fully_shard``) models with AdamW state.

One checkpoint holds a DDP model, an FSDP2 model and an HSDP model (FSDP2 on a 2x2 (replicate, shard)
mesh), each with its AdamW paired explicitly by ``ModelOptimizer``, a Stateful of hand-placed DTensors
(column-sharded at save, row-sharded at load; replicated; bf16), a Stateful counter and the RNG state. The save phase also records the full tensors
(rank 0, safetensors) and the losses of the next training step; every load phase checks the loaded
tensors bit for bit against them and that the next step gives the same losses. At world size 3 the two
models swap parallelism (the FSDP2 checkpoint goes into a DDP model and vice versa).

Workers are forked from a forkserver that imported torch once (see ``dist_helpers.run_workers``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness.dist import run_workers

pytestmark = [pytest.mark.slow]

GLOBAL_BATCH = 16
SAVE_WORLD = 4
SAVED_STEP = 2


class Net(nn.Module):
    """Uneven shapes on purpose: 13 rows over 4/5 ranks is uneven, 3 rows leave some ranks empty."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 13)
        self.norm = nn.LayerNorm(13)
        self.out = nn.Linear(13, 3)
        self.register_buffer("calls", torch.tensor(7, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


class Counter:
    def __init__(self) -> None:
        self.step = 0
        self.history: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "history": self.history}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.step, self.history = int(sd["step"]), list(sd["history"])


class DTensorBag:
    """A Stateful holding hand-placed DTensors: column-sharded (TP-like), replicated and bf16 row-sharded."""

    def __init__(self, seed: int, col_sharded: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        g = torch.Generator().manual_seed(seed)
        self.tensors = {
            "cols": distribute_tensor(torch.randn(6, 11, generator=g), mesh, [Shard(1) if col_sharded else Shard(0)]),
            "rep": distribute_tensor(torch.randn(5, generator=g), mesh, [Replicate()]),
            "half": distribute_tensor(torch.randn(7, 3, generator=g).to(torch.bfloat16), mesh, [Shard(0)]),
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tensors)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        assert all(sd[k] is v for k, v in self.tensors.items()), "apply must hand back the live DTensors"


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = Net()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if kind == "hsdp":  # mesh (replicate, shard): each shard is held by two ranks
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in (net.inp, net.norm, net.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 10, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def global_loss(model: nn.Module, step: int, *, backward: bool) -> float:
    """Loss of the global batch split across ranks; gradients equal the full-batch gradient at any world size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step)
    xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
    sse = (model(xs) - ys).square().sum() / GLOBAL_BATCH
    if backward:
        (sse * world).backward()  # DDP and FSDP2 average gradients over ranks
    total = sse.detach().clone()
    dist.all_reduce(total)
    return float(total)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    optim.zero_grad(set_to_none=True)
    loss = global_loss(model, step, backward=True)
    optim.step()
    return loss


MODEL_KEYS = ("ddp", "fsdp", "hsdp")


def make_state(kinds: tuple[str, str, str], seed: int, lr: float = 0.05) -> tuple[dict[str, Any], dict[str, Any]]:
    from checkpoint.state import ModelOptimizer, RNGState

    models = {key: build(kind, seed + i) for i, (key, kind) in enumerate(zip(MODEL_KEYS, kinds))}
    betas = (0.9, 0.99) if lr == 0.05 else (0.5, 0.5)
    optims = {k: torch.optim.AdamW(m.parameters(), lr=lr, betas=betas, weight_decay=0.01) for k, m in models.items()}
    state: dict[str, Any] = {"trainer": Counter(), "rng": RNGState(), "dt": DTensorBag(seed, col_sharded=kinds[2] == "hsdp")}
    for key in MODEL_KEYS:
        state[key] = models[key]
        state[f"{key}_optim"] = ModelOptimizer(models[key], optims[key])
    return state, {"models": models, "optims": optims}


def _full(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded) tensors of a nested state dict; collective for DTensors (same order on all ranks)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        yield prefix, value.full_tensor().detach().clone()
    elif isinstance(value, torch.Tensor):
        yield prefix, value.detach().clone()
    elif isinstance(value, Mapping):
        for k in sorted(value, key=str):
            yield from _full(value[k], f"{prefix}.{k}")


def full_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:

    out: dict[str, torch.Tensor] = dict(_full(state["dt"].state_dict(), "dt"))
    for key in MODEL_KEYS:
        out.update(_full(_model_sd(state[key]), key))
        out.update(_full(state[f"{key}_optim"].state_dict()["state"], f"{key}_optim"))
    return out


def _model_sd(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


# --------------------------------------------------------------------------- worker phases
def save_phase(rank: int, world: int, root: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    from checkpoint import CheckpointConfig, Checkpointer

    state, parts = make_state(("ddp", "fsdp", "hsdp"), seed=0)
    for step in range(1, SAVED_STEP + 1):
        for k in MODEL_KEYS:
            state["trainer"].history.append(train_step(parts["models"][k], parts["optims"][k], step))
        state["trainer"].step = step
    torch.manual_seed(4242)
    with Checkpointer(os.path.join(root, "ckpt"), CheckpointConfig(writer_threads=1)) as ckpt:
        ckpt.save(SAVED_STEP, state)
        reference = full_tensors(state)  # overlaps the background write on purpose
        rng_after_save = torch.get_rng_state().clone()
        ckpt.wait()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in reference.items()}, os.path.join(root, "reference.safetensors"))
    return {"losses": next_step_losses(parts), "rng": rng_after_save.tolist()[:16]}


def next_step_losses(parts: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Loss of the next training step, and the loss right after it (depends on the optimizer state)."""
    losses = {}
    for k in MODEL_KEYS:
        first = train_step(parts["models"][k], parts["optims"][k], SAVED_STEP + 1)
        after = global_loss(parts["models"][k], SAVED_STEP + 2, backward=False)
        losses[k] = (first, after)
    return losses


def load_phase(rank: int, world: int, root: str, swap: bool) -> dict[str, Any]:
    from safetensors.torch import load_file

    from checkpoint import CheckpointConfig, Checkpointer

    # The HSDP checkpoint loads into plain FSDP2; at world 3 the DDP and FSDP2 checkpoints swap parallelism.
    kinds = ("fsdp", "ddp", "fsdp") if swap else ("ddp", "fsdp", "fsdp")
    # Different seed and hyper-parameters: everything must come from the checkpoint.
    state, parts = make_state(kinds, seed=100 + world, lr=0.7)
    with Checkpointer(os.path.join(root, "ckpt"), CheckpointConfig(writer_threads=1)) as ckpt:
        step = ckpt.load(state)
    rng = torch.get_rng_state()[:16].tolist()
    loaded = full_tensors(state)
    mismatched: list[str] = []
    if rank == 0:
        reference = load_file(os.path.join(root, "reference.safetensors"))
        assert sorted(loaded) == sorted(reference), (sorted(loaded), sorted(reference))
        mismatched = [
            k for k, v in reference.items() if v.dtype != loaded[k].dtype or not torch.equal(v, loaded[k])
        ]
    losses = next_step_losses(parts)
    trainer = state["trainer"]
    return {
        "step": step,
        "mismatched": mismatched,
        "losses": losses,
        "trainer": (trainer.step, len(trainer.history)),
        "rng": rng,
        "lr": [parts["optims"][k].param_groups[0]["lr"] for k in MODEL_KEYS],
        "betas": [parts["optims"][k].param_groups[0]["betas"] for k in MODEL_KEYS],
    }


@pytest.mark.timeout(240)
def test_save_at_4_load_at_1_2_3_5(tmp_path):
    root = str(tmp_path)
    saved = run_workers(save_phase, SAVE_WORLD, (root,), tmpdir=root, timeout=90)
    ref_losses = saved[0]["losses"]
    assert all(s["losses"] == ref_losses for s in saved)
    for world in (1, 2, 3, 5):
        results = run_workers(load_phase, world, (root, world == 3), tmpdir=root, timeout=90)
        for rank, res in enumerate(results):
            where = f"world {world} rank {rank}"
            assert res["step"] == SAVED_STEP, where
            assert res["mismatched"] == [], f"{where}: tensors differ after load: {res['mismatched']}"
            assert res["trainer"] == (SAVED_STEP, len(MODEL_KEYS) * SAVED_STEP), where
            assert res["rng"] == saved[0]["rng"], f"{where}: RNG state not restored"
            assert res["lr"] == [0.05] * 3 and res["betas"] == [(0.9, 0.99)] * 3, where
            for k, (first, after) in res["losses"].items():
                ref_first, ref_after = ref_losses[k]
                # Same parameters and optimizer state; only the order of the cross-rank sums differs.
                assert first == pytest.approx(ref_first, rel=1e-6, abs=1e-7), f"{where} {k}: first loss"
                assert after == pytest.approx(ref_after, rel=1e-5, abs=1e-6), f"{where} {k}: loss after one step"
