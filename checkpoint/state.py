"""Turn a user's state (models, optimizers, stateful objects, tensors, JSON values) into flat items, and back.

``flatten(state)`` walks a mapping such as ``{"model": model, "optim": optim, "trainer": counter, "epoch": 3}``
and returns a :class:`FlatState`:

* ``items``: one :class:`~checkpoint.api.TensorItem` per tensor leaf, named by its path
  (``"model.layer.weight"``, ``"optim.state.layer.weight.exp_avg"``). A DTensor contributes its local shard
  with global offsets (FSDP2 ``fully_shard`` parameters and their optimizer state); a regular tensor is a
  replicated piece (DDP, plain tensors). ``item.tensor`` aliases the live tensor whenever the source allows,
  so no copy is made on save and reads on load land in the live state directly.
* ``objects``: per top-level key, a JSON skeleton of the value: non-tensor leaves as JSON (``lr``,
  ``betas``, step counters, sampler positions), each tensor leaf as ``{"__tensor__": fqn}`` and ``bytes``
  as ``{"__bytes__": base64}``. Tuples are stored as lists and come back as tuples where the live value
  has a tuple; int dict keys come back as ints where the live dict has them.

Load is ``flat = flatten(live)`` (the destination pieces), fill every ``flat.items[i].tensor`` from the
checkpoint, replace ``flat.objects`` with the checkpoint's objects, then ``apply(live, flat)``, which rebuilds
each value from the loaded skeleton and pushes it back (``set_model_state_dict``,
``set_optimizer_state_dict``, ``load_state_dict``, in-place copy for plain tensors, assignment for JSON
values). Nothing is pickled: a value that is neither tensor, JSON nor one of the above is a TypeError.

Optimizer state is keyed by parameter FQN (``get_optimizer_state_dict``), so it reshards with its model.
An optimizer needs its model: it pairs with the only ``nn.Module`` of the mapping, or is given explicitly
as ``ModelOptimizer(model, optim)``.

A regular tensor is assumed identical on every rank (it is written once). Per-rank values such as each
rank's RNG state are therefore restored from one rank's copy; keep them per rank under rank-specific keys
if that matters.
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .api import JSON, ChunkKey, IncompatibleCheckpointError, TensorItem

logger = logging.getLogger(__name__)

__all__ = [
    "BYTES_MARKER",
    "TENSOR_MARKER",
    "FlatState",
    "ModelOptimizer",
    "RNGState",
    "apply",
    "dtype_to_st",
    "flatten",
    "st_to_dtype",
    "total_bytes",
]

TENSOR_MARKER = "__tensor__"
"""Key of the one-entry dict that stands for a tensor leaf inside an ``objects`` skeleton."""
BYTES_MARKER = "__bytes__"
"""Key of the one-entry dict that stands for a ``bytes`` value (base64) inside an ``objects`` skeleton."""

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _name):
        _DTYPE_TO_ST[getattr(torch, _name)] = _st
_ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_TO_ST.items()}


def dtype_to_st(dtype: torch.dtype) -> str:
    """The safetensors dtype name of a torch dtype ("F32", "BF16", "I64", ...); TypeError if it has none."""
    try:
        return _DTYPE_TO_ST[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} cannot be stored in safetensors (supported: {sorted(_ST_TO_DTYPE)})") from None


def st_to_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; IncompatibleCheckpointError for an unknown name."""
    try:
        return _ST_TO_DTYPE[name]
    except KeyError:
        raise IncompatibleCheckpointError(
            f"checkpoint dtype {name!r} is not supported by this torch (supported: {sorted(_ST_TO_DTYPE)})"
        ) from None


@dataclass(slots=True)
class FlatState:
    """A state flattened for the planner and the writer (see the module docstring)."""

    items: list[TensorItem] = field(default_factory=list)
    """One piece per tensor leaf, this rank's local shard (global offsets in ``key``)."""
    objects: dict[str, JSON] = field(default_factory=dict)
    """Per top-level key, the JSON skeleton of the value; tensors appear as ``{"__tensor__": fqn}``."""


class ModelOptimizer:
    """An optimizer (or several for one model) together with the model whose parameters it updates.

    Needed when the state mapping holds more than one model, e.g.
    ``{"gen": g, "disc": d, "gen_optim": ModelOptimizer(g, opt_g), "disc_optim": ModelOptimizer(d, opt_d)}``.
    Its state is keyed by parameter FQN (``get_optimizer_state_dict``), so it reshards like the model.
    """

    __slots__ = ("model", "optimizers")

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]):
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModelOptimizer needs an nn.Module as model, got {type(model).__name__}")
        optims = (optim,) if isinstance(optim, torch.optim.Optimizer) else tuple(optim)
        if not optims or not all(isinstance(o, torch.optim.Optimizer) for o in optims):
            raise TypeError("ModelOptimizer needs a torch.optim.Optimizer (or a non-empty sequence of them)")
        self.model = model
        self.optimizers: tuple[torch.optim.Optimizer, ...] = optims

    def state_dict(self) -> dict[str, Any]:
        """FQN-keyed optimizer state; initialises empty optimizer state (zero-lr step) like DCP does."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # DCP skips the initialisation when gradients exist (load after a backward, save before the
        # first step), which would leave no destination for the saved state: hide them meanwhile.
        stashed: list[tuple[torch.Tensor, torch.Tensor]] = []
        if any(not o.state for o in self.optimizers):
            for o in self.optimizers:
                for group in o.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            stashed.append((p, p.grad))
                            p.grad = None
        try:
            return get_optimizer_state_dict(self.model, self.optimizers)
        finally:
            for p, g in stashed:
                p.grad = g

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load FQN-keyed optimizer state (DTensor values for FSDP2 parameters)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizers, state_dict)


# --------------------------------------------------------------------------- kinds of top-level values
class _ModelState:
    """Adapter: an nn.Module through DCP's model state dict (DDP prefix removed, FSDP2 DTensors kept)."""

    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _adapters(state: Mapping[str, Any]) -> dict[str, Any]:
    """Map each top-level key to something with state_dict()/load_state_dict(), or to the raw value."""
    if not isinstance(state, Mapping):
        raise TypeError(f"checkpoint state must be a mapping of str keys, got {type(state).__name__}")
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"checkpoint state keys must be non-empty str, got {key!r}")
        if isinstance(value, nn.Module):
            out[key] = _ModelState(value)
        elif isinstance(value, torch.optim.Optimizer):
            if len(modules) != 1:
                found = f"models at keys {modules}" if modules else "no model"
                raise TypeError(
                    f"optimizer at key {key!r} needs its model but the state has {found}; "
                    f"pass it as checkpoint.state.ModelOptimizer(model, optimizer)"
                )
            out[key] = ModelOptimizer(state[modules[0]], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- flatten
def _tensor_item(fqn: str, t: torch.Tensor) -> TensorItem:
    from torch.distributed.tensor import DTensor

    if type(t).__name__ == "ShardedTensor":
        raise TypeError(
            f"tensor {fqn!r} is a ShardedTensor (FSDP1/old TP); only DTensor sharding is supported: use fully_shard (FSDP2)"
        )
    if t.layout != torch.strided:
        raise TypeError(f"tensor {fqn!r} has layout {t.layout}; only dense (strided) tensors can be checkpointed")
    if t.is_meta:
        raise TypeError(f"tensor {fqn!r} is on the meta device and has no data to checkpoint")
    if isinstance(t, DTensor):
        return _dtensor_item(fqn, t)
    try:
        st = dtype_to_st(t.dtype)
    except TypeError as exc:
        raise TypeError(f"tensor {fqn!r}: {exc}") from None
    local = t.detach()
    shape = tuple(int(s) for s in local.shape)
    return TensorItem(
        key=ChunkKey(fqn=fqn, offsets=(0,) * len(shape), lengths=shape),
        global_shape=shape,
        dtype=st,
        tensor=local,
        replicated=True,
    )


def _dtensor_item(fqn: str, t: Any) -> TensorItem:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(t.placements)
    if any(p.is_partial() for p in placements):
        raise TypeError(
            f"DTensor {fqn!r} has a Partial placement {placements}; reduce it (redistribute to Shard/Replicate) before checkpointing"
        )
    try:
        st = dtype_to_st(t.dtype)
    except TypeError as exc:
        raise TypeError(f"tensor {fqn!r}: {exc}") from None
    global_shape = tuple(int(s) for s in t.shape)
    local = t.to_local().detach()
    if not t.device_mesh._is_current_rank_part_of_mesh():
        # This rank holds nothing of the tensor: an empty piece it never writes nor reads.
        empty = local.new_empty((0,) * len(global_shape))
        return TensorItem(
            key=ChunkKey(fqn=fqn, offsets=(0,) * len(global_shape), lengths=(0,) * len(global_shape)),
            global_shape=global_shape,
            dtype=st,
            tensor=empty,
            replicated=False,
        )
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, t.device_mesh, placements)
    local_shape = tuple(int(s) for s in local_shape)
    if tuple(local.shape) != local_shape:
        raise TypeError(
            f"DTensor {fqn!r}: local tensor has shape {tuple(local.shape)} but its placements {placements} "
            f"give {local_shape}; padded local shards are not supported"
        )
    return TensorItem(
        key=ChunkKey(fqn=fqn, offsets=tuple(int(o) for o in offsets), lengths=local_shape),
        global_shape=global_shape,
        dtype=st,
        tensor=local,
        # Any Replicate mesh dim means other ranks hold this identical piece (DDP-like, HSDP replicas):
        # the planner lets exactly one of them write it.
        replicated=any(p.is_replicate() for p in placements),
    )


def _json_scalar(value: Any) -> tuple[bool, Any]:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item) and getattr(value, "ndim", None) == 0:
        return True, item()  # numpy scalar -> Python scalar
    return False, None


def _walk(value: Any, path: str, items: list[TensorItem], seen: set[str]) -> JSON:
    """Return the JSON skeleton of ``value``, appending its tensor leaves to ``items``."""
    if isinstance(value, torch.Tensor):
        if path in seen:
            raise ValueError(f"two entries of the state flatten to the same name {path!r}; rename one")
        seen.add(path)
        items.append(_tensor_item(path, value))
        return {TENSOR_MARKER: path}
    ok, scalar = _json_scalar(value)
    if ok:
        return scalar
    if isinstance(value, (bytes, bytearray)):
        return {BYTES_MARKER: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        out: dict[str, JSON] = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"key {k!r} under {path!r} is a {type(k).__name__}; only str and int keys can be stored as JSON")
            if str(k) in out:
                raise ValueError(f"keys under {path!r} collide when written as JSON strings: {k!r}")
            out[str(k)] = _walk(v, f"{path}.{k}", items, seen)
        if set(out) in ({TENSOR_MARKER}, {BYTES_MARKER}):
            raise ValueError(f"{path!r} is a dict whose only key is {next(iter(out))!r}, which is reserved")
        return out
    if isinstance(value, (list, tuple)):
        return [_walk(v, f"{path}.{i}", items, seen) for i, v in enumerate(value)]
    if isinstance(value, (nn.Module, torch.optim.Optimizer)) or _is_stateful(value):
        raise TypeError(
            f"{path!r} is a {type(value).__name__} nested inside another value; put models, optimizers and "
            f"stateful objects at the top level of the checkpoint state"
        )
    raise TypeError(
        f"cannot checkpoint {path!r}: values must be tensors, JSON (None/bool/int/float/str, lists, dicts), "
        f"nn.Module, optimizers or objects with state_dict()/load_state_dict(); got {type(value).__name__} "
        f"(no pickle fallback by design)"
    )


def flatten(state: Mapping[str, Any]) -> FlatState:
    """Flatten ``state`` into this rank's tensor pieces and a JSON skeleton per top-level key.

    Called on the live state it also yields the destination pieces for a load (see the module docstring).
    May initialise an optimizer's empty state with a zero-lr step, as DCP's ``get_optimizer_state_dict`` does.
    """
    flat = FlatState()
    seen: set[str] = set()
    for key, adapter in _adapters(state).items():
        value = adapter.state_dict() if _is_stateful(adapter) else adapter
        try:
            flat.objects[key] = _walk(value, key, flat.items, seen)
        except TypeError as exc:
            if not _is_stateful(adapter) or "cannot checkpoint" not in str(exc):
                raise
            raise TypeError(f"{exc} (from {type(adapter).__name__}.state_dict() of key {key!r})") from None
    logger.debug("flatten: %d tensor items, %d top-level keys", len(flat.items), len(flat.objects))
    return flat


# --------------------------------------------------------------------------- apply
def _live_key(live: Any, k: str) -> Any:
    """The key of the live mapping that the JSON string key ``k`` stands for (int keys come back as str)."""
    if isinstance(live, Mapping):
        if k in live:
            return k
        for lk in live:
            if not isinstance(lk, str) and str(lk) == k:
                return lk
    return k


def _rebuild(skel: JSON, live: Any, path: str, loaded: Mapping[str, torch.Tensor]) -> Any:
    """Value of the loaded skeleton, with tensors from ``loaded`` and container types guided by ``live``."""
    if isinstance(skel, dict) and set(skel) == {TENSOR_MARKER}:
        fqn = skel[TENSOR_MARKER]
        if fqn not in loaded:
            raise IncompatibleCheckpointError(
                f"the checkpoint holds tensor {fqn!r} but the live state has no tensor there to load it into"
            )
        return _as_live(fqn, loaded[fqn], live)
    if isinstance(skel, dict) and set(skel) == {BYTES_MARKER}:
        raw = base64.b64decode(skel[BYTES_MARKER])
        return bytearray(raw) if isinstance(live, bytearray) else raw
    if isinstance(skel, dict):
        out = {}
        for k, v in skel.items():
            lk = _live_key(live, k)
            sub = live.get(lk) if isinstance(live, Mapping) else None
            out[lk] = _rebuild(v, sub, f"{path}.{k}", loaded)
        return out
    if isinstance(skel, list):
        seq = live if isinstance(live, (list, tuple)) else ()
        vals = [_rebuild(v, seq[i] if i < len(seq) else None, f"{path}.{i}", loaded) for i, v in enumerate(skel)]
        return tuple(vals) if isinstance(live, tuple) else vals
    return skel


def _as_live(fqn: str, local: torch.Tensor, live: Any) -> torch.Tensor:
    """The live tensor holding the loaded piece: copied in place unless the reader already wrote there.

    Keeping the live objects (parameters, DTensors, optimizer state) means every reference the caller
    holds sees the loaded values, and a DTensor keeps its mesh and placements.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(live, torch.Tensor):
        return local  # the live state has no tensor here (e.g. a Stateful that builds its dict lazily)
    target = live.to_local() if isinstance(live, DTensor) else live
    if tuple(target.shape) != tuple(local.shape):
        raise IncompatibleCheckpointError(
            f"tensor {fqn!r} was loaded with shape {tuple(local.shape)} but the live piece has {tuple(target.shape)}"
        )
    if target.numel() and (target.data_ptr() != local.data_ptr() or target.stride() != local.stride()):
        target.detach().copy_(local)
    return live


def _loaded_tensors(flat: FlatState) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for item in flat.items:
        if item.key.fqn in out:
            raise ValueError(f"FlatState has two pieces for tensor {item.key.fqn!r}; apply expects one local piece each")
        if tuple(item.tensor.shape) != tuple(item.key.lengths):
            raise ValueError(
                f"piece of {item.key.fqn!r} has shape {tuple(item.tensor.shape)}, expected {tuple(item.key.lengths)}"
            )
        out[item.key.fqn] = item.tensor
    return out


def _assign(state: Mapping[str, Any], key: str, live: Any, value: Any) -> None:
    """Restore a plain (non-stateful) top-level value; containers are updated in place so references held
    by the caller see the loaded values too."""
    if isinstance(live, dict) and isinstance(value, dict):
        live.clear()
        live.update(value)
    elif isinstance(live, list) and isinstance(value, list):
        live[:] = value
    elif isinstance(state, MutableMapping):
        state[key] = value
    elif type(live) is not type(value) or live != value:
        raise TypeError(f"cannot restore {key!r}: the state is a read-only {type(state).__name__}; pass a dict")


class RNGState:
    """Stateful wrapper of the global RNGs (torch CPU, CUDA if present, Python ``random``).

    Put it in the state as ``{"rng": RNGState()}``. The generators are restored from one rank's copy
    (regular tensors are written once), which is what a single-seed data-parallel run wants.
    """

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        import random

        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        import random

        torch.set_rng_state(state_dict["torch"])
        version, internal, gauss = state_dict["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state_dict["cuda"]))


@torch.no_grad()
def apply(state: Mapping[str, Any], flat: FlatState) -> None:
    """Push loaded values into the live ``state`` in place.

    ``flat.items`` are the filled destination pieces (from ``flatten(state)``), ``flat.objects`` the
    checkpoint's skeletons. Keys of the checkpoint that the live state lacks are ignored (partial loads);
    a live key missing from the checkpoint is an IncompatibleCheckpointError.
    """
    loaded = _loaded_tensors(flat)
    for key, adapter in _adapters(state).items():
        if key not in flat.objects:
            raise IncompatibleCheckpointError(
                f"the checkpoint has no entry {key!r} (it has {sorted(flat.objects)}); "
                f"remove the key from the state to load the rest"
            )
        skel = flat.objects[key]
        if _is_stateful(adapter):
            value = _rebuild(skel, adapter.state_dict(), key, loaded)
            adapter.load_state_dict(value)
        elif isinstance(adapter, torch.Tensor):
            value = _rebuild(skel, adapter, key, loaded)
            if not isinstance(value, torch.Tensor):
                raise IncompatibleCheckpointError(f"{key!r} is a tensor in the live state but not in the checkpoint")
            if value is not adapter:  # _rebuild copies into the live tensor and returns it
                raise IncompatibleCheckpointError(f"{key!r}: loaded tensor could not be placed into the live tensor")
        else:
            _assign(state, key, adapter, _rebuild(skel, adapter, key, loaded))
    logger.debug("apply: restored %d top-level keys, %d tensors", len(state), len(loaded))


def total_bytes(items: Sequence[TensorItem]) -> int:
    """Bytes held by ``items`` (this rank's local pieces)."""
    return sum(math.prod(i.key.lengths) * i.tensor.element_size() for i in items)
