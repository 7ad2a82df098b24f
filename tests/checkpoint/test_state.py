"""flatten/apply round trips (single process) through the real planner and an in-memory store."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from checkpoint.api import IncompatibleCheckpointError
from checkpoint.state import TENSOR_MARKER, FlatState, ModelOptimizer, RNGState, apply, flatten

from .dist_helpers import load_flat, save_flats

pytestmark = pytest.mark.timeout(60)


class Counter:
    """A Stateful object: ints, a tuple, a nested dict and a tensor."""

    def __init__(self) -> None:
        self.step = 0
        self.window = (0, 0)
        self.meta = {"name": "a", "hist": [1.5], "blob": b"\x00\xff", 3: "int key"}
        self.ema = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"step": self.step, "window": self.window, "meta": self.meta, "ema": self.ema}

    def load_state_dict(self, sd: dict) -> None:
        assert isinstance(sd["window"], tuple), "tuples must come back as tuples"
        self.step, self.window, self.meta = sd["step"], sd["window"], sd["meta"]
        self.ema.copy_(sd["ema"])


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.BatchNorm1d(3))


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    optim.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss.item()


def round_trip(src: dict, dst: dict) -> None:
    ckpt = save_flats([flatten(src)])
    json.dumps(ckpt.objects)  # objects are plain JSON
    loaded, _ = load_flat(ckpt, flatten(dst))
    apply(dst, loaded)


def test_model_adamw_counter_rng_round_trip_then_identical_training():
    model = make_model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for s in range(3):
        train_step(model, optim, s)
    counter = Counter()
    counter.step, counter.window, counter.meta = 3, (2, 5), {"name": "b", "hist": [1.0, 2.0], "blob": b"\x01", 3: "x"}
    counter.ema.fill_(0.25)
    random.seed(11)
    torch.manual_seed(12)
    src = {"model": model, "optim": optim, "trainer": counter, "rng": RNGState(), "epoch": 4, "note": {"k": [1, None]}}
    ckpt = save_flats([flatten(src)])
    expected_torch_rng = torch.get_rng_state().clone()
    expected_py = random.random()

    model2 = make_model(1)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=5e-1, betas=(0.5, 0.5))  # fresh: no state yet
    counter2 = Counter()
    random.seed(0)
    torch.manual_seed(0)
    dst = {"model": model2, "optim": optim2, "trainer": counter2, "rng": RNGState(), "epoch": 0, "note": {}}
    loaded, _ = load_flat(ckpt, flatten(dst))
    apply(dst, loaded)

    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    assert optim2.param_groups[0]["lr"] == 1e-2 and optim2.param_groups[0]["betas"] == (0.8, 0.95)
    assert isinstance(optim2.param_groups[0]["betas"], tuple)
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        s1, s2 = optim.state[p1], optim2.state[p2]
        assert set(s1) == set(s2)
        for k in s1:
            assert torch.equal(s1[k], s2[k]), k
    assert (counter2.step, counter2.window, counter2.meta) == (3, (2, 5), {"name": "b", "hist": [1.0, 2.0], "blob": b"\x01", 3: "x"})
    assert torch.equal(counter2.ema, torch.full((3,), 0.25))
    assert dst["epoch"] == 4 and dst["note"] == {"k": [1, None]}
    assert torch.equal(torch.get_rng_state(), expected_torch_rng)
    assert random.random() == expected_py

    # The next training step is identical with and without the round trip.
    assert train_step(model, optim, 99) == train_step(model2, optim2, 99)
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_items_alias_live_tensors_so_reads_land_in_place():
    model = make_model(0)
    flat = flatten({"model": model})
    item = next(i for i in flat.items if i.key.fqn == "model.0.weight")
    item.tensor.fill_(3.0)
    assert torch.equal(model[0].weight.detach(), torch.full((5, 6), 3.0))
    assert all(i.replicated and all(o == 0 for o in i.key.offsets) for i in flat.items)
    assert flat.objects["model"]["0.weight"] == {TENSOR_MARKER: "model.0.weight"}
    assert {i.dtype for i in flat.items} == {"F32", "I64"}  # BatchNorm num_batches_tracked is I64


def test_plain_tensor_is_copied_into_the_live_tensor():
    model = make_model(0)
    src = {"w": torch.arange(5.0), "model": model}
    dst = {"w": torch.zeros(5), "model": make_model(2)}
    live_w = dst["w"]
    round_trip(src, dst)
    assert dst["w"] is live_w and torch.equal(live_w, torch.arange(5.0))


def test_two_models_need_explicit_pairing():
    g, d = make_model(0), make_model(1)
    og, od = torch.optim.SGD(g.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(d.parameters(), lr=0.2)
    with pytest.raises(TypeError, match="optimizer at key 'og' needs its model.*ModelOptimizer"):
        flatten({"g": g, "d": d, "og": og})
    with pytest.raises(TypeError, match="no model"):
        flatten({"og": og})
    train_step(g, og, 0)
    src = {"g": g, "d": d, "og": ModelOptimizer(g, og), "od": ModelOptimizer(d, od)}
    g2, d2 = make_model(5), make_model(6)
    og2, od2 = torch.optim.SGD(g2.parameters(), lr=0.5, momentum=0.9), torch.optim.SGD(d2.parameters(), lr=0.5)
    dst = {"g": g2, "d": d2, "og": ModelOptimizer(g2, og2), "od": ModelOptimizer(d2, od2)}
    round_trip(src, dst)
    assert og2.param_groups[0]["lr"] == 0.1 and od2.param_groups[0]["lr"] == 0.2
    p1, p2 = next(g.parameters()), next(g2.parameters())
    assert torch.equal(og.state[p1]["momentum_buffer"], og2.state[p2]["momentum_buffer"])


def test_lr_scheduler_is_stateful():
    model = make_model(0)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for s in range(5):
        train_step(model, optim, s)
        sched.step()
    model2 = make_model(0)
    optim2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=2, gamma=0.5)
    round_trip({"model": model, "optim": optim, "sched": sched}, {"model": model2, "optim": optim2, "sched": sched2})
    assert sched2.last_epoch == 5 and optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"] == 0.25


def test_unsupported_values_are_type_errors_naming_the_key():
    with pytest.raises(TypeError, match="'cfg.fn'.*function.*no pickle"):
        flatten({"cfg": {"fn": lambda: 1}})
    with pytest.raises(TypeError, match="'obj'.*object"):
        flatten({"obj": object()})
    with pytest.raises(TypeError, match="'x'.*complex64"):
        flatten({"x": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="keys must be non-empty str"):
        flatten({1: 2})  # type: ignore[dict-item]  # the bad input under test
    with pytest.raises(TypeError, match="'meta'.*meta device"):
        flatten({"meta": torch.empty(2, device="meta")})

    class BadStateful:
        def state_dict(self):
            return {"f": {1, 2}}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(TypeError, match="'s.f'.*set.*BadStateful"):
        flatten({"s": BadStateful()})


def test_name_collision_is_rejected():
    with pytest.raises(ValueError, match="same name 'a.b'"):
        flatten({"a": {"b": torch.zeros(1), "b.": 1, 0: torch.zeros(1)}, "a.b": torch.zeros(1)})


def test_apply_errors_on_missing_or_mismatched_entries():
    model = make_model(0)
    flat = flatten({"model": model})
    with pytest.raises(IncompatibleCheckpointError, match="no entry 'extra'"):
        apply({"model": model, "extra": 3}, flat)
    with pytest.raises(IncompatibleCheckpointError, match="'model.0.weight'.*no tensor"):
        apply({"model": model}, FlatState(items=[], objects=flat.objects))


def test_apply_copies_fresh_buffers_into_the_live_objects():
    src_model = make_model(0)
    src_optim = torch.optim.AdamW(src_model.parameters(), lr=1e-2)
    train_step(src_model, src_optim, 0)
    src = flatten({"model": src_model, "optim": src_optim, "t": torch.arange(4.0)})

    model = make_model(3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    live_t = torch.zeros(4)
    state = {"model": model, "optim": optim, "t": live_t}
    params_before = [id(p) for p in model.parameters()]
    dst = flatten(state)
    by_fqn = {i.key.fqn: i.tensor for i in src.items}
    # A reader that fills fresh buffers instead of the aliased live tensors.
    for item in dst.items:
        item.tensor = by_fqn[item.key.fqn].clone()
    apply(state, FlatState(items=dst.items, objects=src.objects))
    assert [id(p) for p in model.parameters()] == params_before
    assert state["t"] is live_t and torch.equal(live_t, torch.arange(4.0))
    for p_src, p in zip(src_model.parameters(), model.parameters()):
        assert torch.equal(p_src, p)
        for k, v in src_optim.state[p_src].items():
            assert torch.equal(v, optim.state[p][k]), k


def test_load_after_backward_still_finds_optimizer_state_and_keeps_grads():
    model = make_model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optim, 0)
    ckpt = save_flats([flatten({"model": model, "optim": optim})])

    model2 = make_model(1)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    nn.functional.mse_loss(model2(torch.ones(2, 6)), torch.zeros(2, 3)).backward()  # grads, no step yet
    grads = [p.grad.clone() for p in model2.parameters()]
    state = {"model": model2, "optim": optim2}
    loaded, _ = load_flat(ckpt, flatten(state))
    apply(state, loaded)
    assert [torch.equal(g, p.grad) for g, p in zip(grads, model2.parameters())] == [True] * len(grads)
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(optim.state[p1]["exp_avg"], optim2.state[p2]["exp_avg"])


class CountingCounter(Counter):
    """A Counter that counts how often its state is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def state_dict(self) -> dict:
        self.asked += 1
        return super().state_dict()


def test_state_dicts_are_kept_on_load_only_and_reused_by_apply():
    """Save never reads ``state_dicts`` (kept, they would pin each state_dict() as long as the FlatState); a
    load's ``apply`` rebuilds into the one ``flatten`` got instead of asking the object a second time."""
    import uuid

    from checkpoint.checkpointer import Checkpointer

    src, dst = CountingCounter(), CountingCounter()
    src.step, src.ema = 7, torch.arange(3.0)
    saved = flatten({"c": src})
    assert saved.state_dicts == {} and src.asked == 1
    assert list(flatten({"c": src}, keep_state_dicts=True).state_dicts) == ["c"]
    with Checkpointer(f"memory://state-dicts-{uuid.uuid4().hex}") as ckpt:
        ckpt.save(1, {"c": src})
        ckpt.wait()
        dst.asked = 0
        assert ckpt.load({"c": dst}) == 1
    assert dst.asked == 1, "the load asks the live object for its state once"
    assert dst.step == 7 and torch.equal(dst.ema, torch.arange(3.0))
