"""The memory tier's flatten at every step, without DCP once the state's tensors are known.

Why: ``state.flatten`` goes through DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict`` and builds one
``TensorItem`` per tensor (``DTensor.to_local``, placements, offsets). For a small model that is most of what a
memory snapshot blocks for (several ms per step for the toy GPT), so ``every="auto"`` counted it and picked an
interval > 1. The items alias the live tensors, though, and stay valid as long as those tensors are the same
objects with the same storage: ``FlatCache.flatten`` reuses them and rebuilds only what changes between steps
(optimizer hyperparameters and non-tensor state, e.g. a scheduled ``lr``; the other entries: counters, data
cursors, RNG state).

Per top-level entry:

* a model (``nn.Module``): cached when its skeleton names tensors only and every item aliases one of the
  module's parameters or buffers. Valid while the fingerprint of ``named_parameters`` and ``named_buffers``
  (name, object, local storage address, shape, strides, dtype; for a DTensor also its mesh, placements and
  global shape) is unchanged: a parameter replaced by the user, a module added, a model resharded or moved
  is a different fingerprint, and that entry is flattened through DCP again.
* an optimizer (bare, or ``ModelOptimizer``): cached when the skeleton rebuilt from the live optimizer without
  DCP (``_light_state_dict``: each parameter's FQN taken from DCP's own ``param_groups``) equals DCP's, and every
  tensor of its state is the item of that name (same storage). Valid while the fingerprint of its model and of
  the optimizers (param_groups: keys and parameter objects; per parameter, its state's keys and tensors) is
  unchanged: Adam's ``exp_avg`` created at the first step, a param_group added, a state tensor replaced, a
  ``load_state_dict`` is a different fingerprint. Optimizers with state_dict hooks are never cached.
* anything else: flattened as ``state.flatten`` does, every time (it is small: counters, RNG state).

A cached item holds a view of the storage it was built from, so the storage cannot be freed and its address
reused by another tensor while the entry lives: equal addresses mean the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from checkpoint.api import JSON, TensorItem
from checkpoint.state import TENSOR_MARKER, EntryWalker, FlatState, ModelOptimizer, _ModelState, skeleton

logger = logging.getLogger(__name__)

_ModelFingerprint = tuple[Any, ...]


@dataclass(slots=True)
class _Entry:
    """What one top-level entry flattened to, and the fingerprint under which it is still valid."""

    fingerprint: tuple[Any, ...]
    items: list[TensorItem]
    skeleton: JSON
    """A model's skeleton (constant). An optimizer's ``param_groups`` are rebuilt at every use (from ``fqns``),
    and so is its ``state`` unless every leaf there is a tensor."""
    fqns: list[list[str]] | None = None
    """Optimizer: the FQN of every parameter, per param_group (over the optimizers, in order)."""
    state_names: list[str] | None = None
    """Optimizer whose ``state`` skeleton names tensors only (Adam, SGD with momentum): those names (the
    skeleton's ``state`` is then reused as is); None: rebuilt at every use."""
    cacheable: bool = True
    """False: this entry cannot be reused under this fingerprint (flattened through DCP at every call, without
    checking again whether it could be)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        # CHANGE: the local tensor read directly, not through ``to_local()``: that is what ``to_local()`` returns
        # without grad, and a no_grad context per tensor was most of the fingerprint's cost.
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            return local
        with torch.no_grad():
            return t.to_local()
    return t


def _tensor_print(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's identity as an item would see it: object, storage address, shape, strides, dtype (and for a
    DTensor its mesh, placements and global shape)."""
    if isinstance(t, DTensor):
        local = _local(t)
        return (id(t), local.data_ptr(), local.shape, local.stride(), local.dtype,
                id(t.device_mesh), t.placements, t.shape)
    return (id(t), t.data_ptr(), t.shape, t.stride(), t.dtype)


def _model_print(model: nn.Module) -> _ModelFingerprint:
    params = tuple((n, _tensor_print(p)) for n, p in model.named_parameters(remove_duplicate=False))
    buffers = tuple((n, _tensor_print(b)) for n, b in model.named_buffers(remove_duplicate=False))
    return (id(model), params, buffers)


def _optim_print(optims: Sequence[torch.optim.Optimizer]) -> tuple[Any, ...]:
    out: list[Any] = []
    for o in optims:
        groups = tuple((tuple(g), tuple(id(p) for p in g["params"]),
                        tuple(_tensor_print(v) for v in g.values() if isinstance(v, torch.Tensor)))
                       for g in o.param_groups)
        state = tuple(
            (id(p), tuple((k, _tensor_print(v) if isinstance(v, torch.Tensor) else None) for k, v in st.items()))
            for p, st in o.state.items()
        )
        out.append((id(o), groups, state))
    return tuple(out)


def _has_state_dict_hooks(optims: Sequence[torch.optim.Optimizer]) -> bool:
    return any(getattr(o, "_optimizer_state_dict_pre_hooks", None) or getattr(o, "_optimizer_state_dict_post_hooks", None)
               for o in optims)


def _light_groups(optims: Sequence[torch.optim.Optimizer], fqns: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """DCP's ``param_groups`` of these optimizers: each live group's values, its parameters named by FQN."""
    groups = [g for o in optims for g in o.param_groups]
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(groups, fqns, strict=True)]


def _light_state(optims: Sequence[torch.optim.Optimizer], fqns: Sequence[Sequence[str]]) -> dict[str, Any] | None:
    """DCP's ``state`` of these optimizers: each parameter's live state dict under its FQN; None when a
    parameter with state is in no param_group."""
    state: dict[str, Any] = {}
    index = 0
    for o in optims:
        names: dict[int, str] = {}
        for g in o.param_groups:
            names.update(zip((id(p) for p in g["params"]), fqns[index], strict=True))
            index += 1
        for p, st in o.state.items():
            if id(p) not in names:
                return None
            state[names[id(p)]] = st
    return state


def _light_state_dict(optims: Sequence[torch.optim.Optimizer], fqns: Sequence[Sequence[str]]) -> dict[str, Any] | None:
    """What DCP's ``get_optimizer_state_dict`` returns for these optimizers (no FSDP1, no options), built from
    the live optimizers and the parameters' FQNs; None when a parameter with state has no FQN."""
    state = _light_state(optims, fqns)
    return None if state is None else {"state": state, "param_groups": _light_groups(optims, fqns)}


def _tensor_leaves(skel: JSON) -> list[str]:
    """The tensor names of a skeleton."""
    if isinstance(skel, dict):
        if set(skel) == {TENSOR_MARKER}:
            return [str(skel[TENSOR_MARKER])]
        return [n for v in skel.values() for n in _tensor_leaves(v)]
    if isinstance(skel, list):
        return [n for v in skel for n in _tensor_leaves(v)]
    return []


def _tensors_of(value: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a value with the names ``state.flatten`` gives them."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, Mapping):
        return [x for k, v in value.items() for x in _tensors_of(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in _tensors_of(v, f"{path}.{i}")]
    return []


def _only_tensors(skel: JSON) -> bool:
    """True when every leaf of the skeleton is a tensor."""
    if isinstance(skel, dict):
        return set(skel) == {TENSOR_MARKER} or all(_only_tensors(v) for v in skel.values())
    if isinstance(skel, list):
        return all(_only_tensors(v) for v in skel)
    return False


def _same_bytes(item: TensorItem, live: torch.Tensor) -> bool:
    t = item.tensor
    return (t.numel() == 0 and live.numel() == 0) or (
        t.data_ptr() == live.data_ptr() and tuple(t.shape) == tuple(live.shape) and t.stride() == live.stride()
        and t.dtype == live.dtype
    )


class FlatCache:
    """``state.flatten`` for a state flattened at every step (the memory tier's snapshots): models' and
    optimizers' items reused while their fingerprints hold (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self.hits = 0
        """Entries reused (not flattened through their ``state_dict``) since the cache was made."""
        self.misses = 0
        """Model and optimizer entries flattened through DCP since the cache was made."""

    def clear(self) -> None:
        """Forget every entry (and the storages their items keep alive)."""
        self._entries.clear()

    def flatten(self, state: Mapping[str, Any]) -> FlatState:
        """What ``state.flatten(state)`` returns (the same items, in the same order, and the same skeletons),
        reusing the cached entries that are still valid."""
        walker = EntryWalker(state)
        flat = FlatState()
        models: dict[int, _ModelFingerprint] = {}
        live_keys = set()
        for key, adapter in walker.adapters.items():
            live_keys.add(key)
            if isinstance(adapter, (ModelOptimizer, _ModelState)):
                self._add_cacheable(walker, flat, key, adapter, models)
            else:
                walker.add(flat, key, adapter)
        for key in set(self._entries) - live_keys:
            del self._entries[key]
        return flat

    def _fingerprint(self, adapter: Any, models: dict[int, _ModelFingerprint]) -> tuple[Any, ...]:
        model = adapter.model
        if id(model) not in models:
            models[id(model)] = _model_print(model)
        if isinstance(adapter, ModelOptimizer):
            return (models[id(model)], _optim_print(adapter.optimizers))
        return models[id(model)]

    def _add_cacheable(self, walker: EntryWalker, flat: FlatState, key: str, adapter: Any,
                       models: dict[int, _ModelFingerprint]) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.fingerprint == self._fingerprint(adapter, models):
            if not entry.cacheable:
                walker.add(flat, key, adapter)
                self.misses += 1
                return
            skel = entry.skeleton
            if entry.fqns is not None:
                skel = self._optim_skeleton(walker, key, adapter, entry)
            else:
                walker.seen.update(i.key.fqn for i in entry.items)
            if skel is not None:
                flat.items.extend(entry.items)
                flat.objects[key] = skel
                self.hits += 1
                return
        # A miss: flatten through DCP (which may initialise an empty optimizer: fingerprint after it).
        self._entries.pop(key, None)
        start = len(flat.items)
        value = walker.add(flat, key, adapter)
        self.misses += 1
        models.pop(id(adapter.model), None)
        items = flat.items[start:]
        fingerprint = self._fingerprint(adapter, models)
        if isinstance(adapter, ModelOptimizer):
            made = self._optim_entry(key, adapter, value, flat.objects[key], items, fingerprint)
        else:
            made = self._model_entry(key, adapter.model, flat.objects[key], items, fingerprint)
        if made is None:
            logger.debug("flatten cache: entry %r is not cacheable; flattened through its state_dict every time", key)
            made = _Entry(fingerprint, [], None, cacheable=False)
        self._entries[key] = made

    @staticmethod
    def _optim_skeleton(walker: EntryWalker, key: str, adapter: ModelOptimizer, entry: _Entry) -> JSON:
        """The optimizer's skeleton now: hyperparameters (a scheduled lr...) and non-tensor state read again."""
        assert entry.fqns is not None and isinstance(entry.skeleton, dict)
        optims = adapter.optimizers
        if entry.state_names is not None:
            state: JSON = entry.skeleton["state"]
            walker.seen.update(entry.state_names)
        else:
            live = _light_state(optims, entry.fqns)
            if live is None:
                return None
            state = skeleton(live, f"{key}.state", walker.seen)
        return {"state": state, "param_groups": skeleton(_light_groups(optims, entry.fqns), f"{key}.param_groups",
                                                         walker.seen)}

    @staticmethod
    def _model_entry(key: str, model: nn.Module, skel: JSON, items: list[TensorItem],
                     fingerprint: tuple[Any, ...]) -> _Entry | None:
        if not _only_tensors(skel):
            return None  # e.g. get_extra_state: values the fingerprint does not see
        live = [_local(t) for _, t in model.named_parameters(remove_duplicate=False)]
        live += [_local(t) for _, t in model.named_buffers(remove_duplicate=False)]
        by_ptr: dict[int, list[torch.Tensor]] = {}
        for t in live:
            by_ptr.setdefault(t.data_ptr(), []).append(t)
        for item in items:
            if item.tensor.numel() and not any(_same_bytes(item, t) for t in by_ptr.get(item.tensor.data_ptr(), [])):
                return None  # a state_dict value that is not a parameter or buffer as is
        return _Entry(fingerprint, list(items), skel)

    @staticmethod
    def _optim_entry(key: str, adapter: ModelOptimizer, value: Any, skel: JSON, items: list[TensorItem],
                     fingerprint: tuple[Any, ...]) -> _Entry | None:
        optims = adapter.optimizers
        if _has_state_dict_hooks(optims) or not isinstance(value, Mapping):
            return None
        groups = value.get("param_groups")
        live_groups = [g for o in optims for g in o.param_groups]
        if not isinstance(groups, list) or len(groups) != len(live_groups):
            return None
        fqns: list[list[str]] = []
        for g, live in zip(groups, live_groups, strict=True):
            names = g.get("params") if isinstance(g, Mapping) else None
            if not isinstance(names, list) or len(names) != len(live["params"]):
                return None
            fqns.append([str(n) for n in names])
        light = _light_state_dict(optims, fqns)
        if light is None or skeleton(light, key) != skel:
            return None
        by_name = {i.key.fqn: i for i in items}
        leaves = _tensor_leaves(skel)
        if len(leaves) != len(items) or set(leaves) != set(by_name):
            return None
        for name, t in _tensors_of(light, key):
            if name not in by_name or not _same_bytes(by_name[name], _local(t)):
                return None  # DCP gave a copy (an option, a new torch): not the live state
        if not isinstance(skel, dict) or list(skel) != ["state", "param_groups"]:
            return None  # the rebuilt skeleton lists them in this order
        state_skel = skel["state"]
        state_names = _tensor_leaves(state_skel) if _only_tensors(state_skel) else None
        return _Entry(fingerprint, list(items), skel, fqns, state_names)
