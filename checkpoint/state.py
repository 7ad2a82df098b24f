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

Load is ``flat = flatten(live, keep_state_dicts=True)`` (the destination pieces; keeping each entry's
``state_dict()`` lets ``apply`` reuse it instead of asking the object again), fill every ``flat.items[i].tensor`` from the
checkpoint, replace ``flat.objects`` with the checkpoint's objects, then ``apply(live, flat)``, which rebuilds
each value from the loaded skeleton and pushes it back (``set_model_state_dict``,
``set_optimizer_state_dict``, ``load_state_dict``, in-place copy for plain tensors, assignment for JSON
values). Nothing is pickled: a value that is neither tensor, JSON nor one of the above is a TypeError.

Optimizer state is keyed by parameter FQN (``get_optimizer_state_dict``), so it reshards with its model.
An optimizer needs its model: it pairs with the only ``nn.Module`` of the mapping, or is given explicitly
as ``ModelOptimizer(model, optim)``.

A regular tensor is assumed identical on every rank (it is written once). State that differs between
ranks (RNG state, a per-rank data position or counter) goes into a :class:`PerRank` entry: its whole
subtree, tensors included (inlined as base64 with dtype and shape), lands in ``FlatState.rank_objects``
and every rank saves and restores its own copy. :class:`RNGState` is per-rank by default.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import random
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._sys.torch_internals import dtensor_local_chunk
from .api import (
    JSON,
    ON_RESIZE_RULES,
    RANK_OBJECTS_MAX_BYTES,
    CheckpointConfigError,
    ChunkKey,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    TensorItem,
)
from .dtypes import safetensors_name, torch_dtype

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


def _dtensor() -> type[DTensor]:
    """DTensor, imported on first use: torch.distributed.tensor is slow to import, and ``import checkpoint``
    should not pay for it."""
    from torch.distributed.tensor import DTensor

    return DTensor

__all__ = [
    "BYTES_MARKER",
    "INLINE_TENSOR_MARKER",
    "TENSOR_MARKER",
    "EntryWalker",
    "FlatState",
    "ModelOptimizer",
    "PerRank",
    "RNGState",
    "apply",
    "decode_tensor",
    "dtype_to_st",
    "encode_tensor",
    "flatten",
    "per_rank_entries",
    "skeleton",
    "st_to_dtype",
    "total_bytes",
]

TENSOR_MARKER = "__tensor__"
"""Key of the one-entry dict that stands for a tensor leaf inside an ``objects`` skeleton."""
BYTES_MARKER = "__bytes__"
"""Key of the one-entry dict that stands for a ``bytes`` value (base64) inside an ``objects`` skeleton."""
INLINE_TENSOR_MARKER = "__tensor_data__"
"""Key of the one-entry dict that stands for a tensor stored inline in a per-rank skeleton:
``{"__tensor_data__": {"dtype": "U8", "shape": [5056], "data": <base64 of the C-contiguous bytes>}}``."""
_MARKERS = ({TENSOR_MARKER}, {BYTES_MARKER}, {INLINE_TENSOR_MARKER})

dtype_to_st = safetensors_name
"""The safetensors dtype name of a torch dtype (``checkpoint.dtypes.safetensors_name``)."""
st_to_dtype = torch_dtype
"""The torch dtype of a safetensors dtype name (``checkpoint.dtypes.torch_dtype``)."""


@dataclass(slots=True)
class FlatState:
    """A state flattened for the planner and the writer (see the module docstring)."""

    items: list[TensorItem] = field(default_factory=list)
    """One piece per tensor leaf, this rank's local shard (global offsets in ``key``)."""
    objects: dict[str, JSON] = field(default_factory=dict)
    """Per top-level key, the JSON skeleton of the value; tensors appear as ``{"__tensor__": fqn}``."""
    rank_objects: dict[str, JSON] = field(default_factory=dict)
    """Per per-rank top-level key, this rank's JSON skeleton with tensors inline (``__tensor_data__``).
    On load the caller replaces it with the copies to restore; a key it leaves out is kept as is when
    its rule is ``skip`` and an error otherwise."""
    per_rank: dict[str, str] = field(default_factory=dict)
    """The live state's per-rank keys and their ``on_resize`` rule."""
    state_dicts: dict[str, Any] = field(default_factory=dict)
    """Per stateful top-level key, what its ``state_dict()`` returned during ``flatten(keep_state_dicts=True)``
    (a load; empty on save, where nothing reads it): ``apply`` takes it as the live value to rebuild into
    instead of asking again, which for an optimizer is a whole ``get_optimizer_state_dict`` (its tensors alias
    the live state, so it already holds what was read)."""


class PerRank:
    """Marks a top-level state entry whose value differs between ranks; each rank saves and gets back its own.

    ``state = {"model": m, "optim": o, "rng": RNGState(), "loader": PerRank(sampler)}``. The wrapped value is
    a stateful object (``state_dict()``/``load_state_dict()``), a dict or list (restored in place), a tensor
    (copied in place) or a JSON scalar (restored into ``.value``). Its whole subtree, tensors included, is
    written by every rank to its own small JSON file (``objects-00003-of-00004.json``; tensors as base64 with
    dtype and shape). It is meant for KB-MB state: RNG state, sampler positions, counters. A rank's per-rank
    file may hold at most ``RANK_OBJECTS_MAX_BYTES`` (64 MiB); larger tensors belong in the sharded state.

    ``on_resize`` says what a rank loads when the world size differs from the saving one (at the same world
    size each rank always gets its own copy): ``"rank_modulo"`` (default) rank r takes saved rank
    ``r % saved_world_size``'s copy, i.e. its own while r < saved world size; ``"rank0"`` every rank takes
    saved rank 0's copy; ``"skip"`` leaves the live value untouched.
    """

    __slots__ = ("on_resize", "value")

    def __init__(self, value: Any, *, on_resize: str = "rank_modulo"):
        """Args:
            value: the rank's own state: a JSON value, tensors, or an object with ``state_dict()`` /
                ``load_state_dict()`` (not a model or an optimizer: those are sharded state).
            on_resize: ``"rank_modulo"``, ``"rank0"`` or ``"skip"`` (see the class).

        Raises:
            TypeError: ``value`` is a ``PerRank``, a model, an optimizer or a ``ModelOptimizer``.
            CheckpointConfigError: ``on_resize`` is not one of the rules.
        """
        if isinstance(value, PerRank):
            raise TypeError("PerRank(PerRank(...)): wrap the value once")
        if isinstance(value, (nn.Module, torch.optim.Optimizer, ModelOptimizer)):
            raise TypeError(
                f"PerRank cannot hold a {type(value).__name__}: models and optimizers go in the sharded state "
                f"(a top-level entry without PerRank)"
            )
        if on_resize not in ON_RESIZE_RULES:
            raise CheckpointConfigError(f"PerRank(on_resize={on_resize!r}) must be one of {', '.join(ON_RESIZE_RULES)}")
        self.value = value
        self.on_resize = on_resize

    def __repr__(self) -> str:
        return f"PerRank({self.value!r}, on_resize={self.on_resize!r})"


def per_rank_entries(state: Mapping[str, Any]) -> dict[str, PerRank]:
    """The per-rank top-level entries of ``state``: ``PerRank`` values, and bare ``RNGState`` (per-rank by default)."""
    out: dict[str, PerRank] = {}
    for key, value in state.items():
        if isinstance(value, PerRank):
            out[key] = value
        elif isinstance(value, RNGState):
            out[key] = PerRank(value)
    return out


class ModelOptimizer:
    """An optimizer (or several for one model) together with the model whose parameters it updates.

    Needed when the state mapping holds more than one model, e.g.
    ``{"gen": g, "disc": d, "gen_optim": ModelOptimizer(g, opt_g), "disc_optim": ModelOptimizer(d, opt_d)}``.
    Its state is keyed by parameter FQN (``get_optimizer_state_dict``), so it reshards like the model.
    """

    __slots__ = ("model", "optimizers")

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]):
        """Args:
            model: the model (plain, DDP or FSDP2) whose parameters the optimizers update.
            optim: one optimizer, or several for that model.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``, or ``optim`` holds no optimizer or a non-optimizer.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModelOptimizer needs an nn.Module as model, got {type(model).__name__}")
        optims = (optim,) if isinstance(optim, torch.optim.Optimizer) else tuple(optim)
        if not optims or not all(isinstance(o, torch.optim.Optimizer) for o in optims):
            raise TypeError("ModelOptimizer needs a torch.optim.Optimizer (or a non-empty sequence of them)")
        self.model = model
        self.optimizers: tuple[torch.optim.Optimizer, ...] = optims

    def state_dict(self) -> dict[str, Any]:
        """FQN-keyed optimizer state; initialises empty optimizer state (zero-lr step) like DCP does.

        Returns:
            ``get_optimizer_state_dict(model, optimizers)``: state keyed by parameter FQN.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # slow to import: on first use

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
        """Load FQN-keyed optimizer state (DTensor values for FSDP2 parameters).

        Args:
            state_dict: what ``state_dict`` returned (as the Checkpointer restores it).
        """
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict  # slow to import: on first use

        set_optimizer_state_dict(self.model, self.optimizers, state_dict)


# --------------------------------------------------------------------------- kinds of top-level values
class _ModelState:
    """Adapter: an nn.Module through DCP's model state dict (DDP prefix removed, FSDP2 DTensors kept)."""

    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # slow to import: on first use

        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict  # slow to import: on first use

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
        if isinstance(value, PerRank):
            out[key] = value.value
        elif isinstance(value, nn.Module):
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


def uninitialised_optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers in ``state`` (plain or in a ``ModelOptimizer``) whose state is still empty.

    ``flatten`` initialises such an optimizer with a zero-lr step (DCP's ``_init_optim_state``), which leaves the
    parameters alone but not every optimizer: Adam's step counters become 1, so the first real step's bias
    correction differs. A restore that flattens the live state to plan its reads and then finds nothing to load
    must put those optimizers back (:func:`forget_optimizer_state`), or a fresh start with the memory tier on
    trains differently from one without it.
    """
    found: list[torch.optim.Optimizer] = []
    for value in state.values():
        optims = value.optimizers if isinstance(value, ModelOptimizer) else (value,)
        found += [o for o in optims if isinstance(o, torch.optim.Optimizer) and not o.state]
    return found


def forget_optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Empty the state of ``optimizers`` again (after a ``flatten`` initialised it and nothing was loaded)."""
    for optim in optimizers:
        optim.state.clear()


# --------------------------------------------------------------------------- flatten
def _tensor_item(fqn: str, t: torch.Tensor) -> TensorItem:
    if type(t).__name__ == "ShardedTensor":
        raise TypeError(
            f"tensor {fqn!r} is a ShardedTensor (FSDP1/old TP); only DTensor sharding is supported: use fully_shard (FSDP2)"
        )
    if t.layout != torch.strided:
        raise TypeError(f"tensor {fqn!r} has layout {t.layout}; only dense (strided) tensors can be checkpointed")
    if t.is_meta:
        raise TypeError(f"tensor {fqn!r} is on the meta device and has no data to checkpoint")
    if isinstance(t, _dtensor()):
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
    if t.device_mesh.get_coordinate() is None:
        # This rank holds nothing of the tensor: an empty piece it never writes nor reads.
        empty = local.new_empty((0,) * len(global_shape))
        return TensorItem(
            key=ChunkKey(fqn=fqn, offsets=(0,) * len(global_shape), lengths=(0,) * len(global_shape)),
            global_shape=global_shape,
            dtype=st,
            tensor=empty,
            replicated=False,
        )
    local_shape, offsets = dtensor_local_chunk(t)
    if tuple(local.shape) != local_shape:
        raise TypeError(
            f"DTensor {fqn!r}: local tensor has shape {tuple(local.shape)} but its placements {placements} "
            f"give {local_shape} (global {global_shape}, mesh {tuple(t.device_mesh.shape)} at coordinate "
            f"{t.device_mesh.get_coordinate()}); padded local shards are not supported"
        )
    return TensorItem(
        key=ChunkKey(fqn=fqn, offsets=offsets, lengths=local_shape),
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


class _InlineBudget:
    """Running total of the tensor bytes one rank inlines into its per-rank file (fail before encoding)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int = RANK_OBJECTS_MAX_BYTES):
        self.limit = limit
        self.used = 0

    def take(self, path: str, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise ValueError(
                f"per-rank state is too large at {path!r}: {self.used / 2**20:.1f} MiB of tensors, more than the "
                f"{self.limit / 2**20:.0f} MiB a rank's per-rank file may hold (stored as base64 JSON, meant for RNG "
                f"state and sampler positions); put large tensors in the sharded state (a top-level entry without PerRank)"
            )


def encode_tensor(path: str, t: torch.Tensor, budget: _InlineBudget | None = None) -> JSON:
    """A tensor as inline JSON (dtype, shape, base64 of its C-contiguous little-endian bytes)."""
    if isinstance(t, _dtensor()) or t.layout != torch.strided or t.is_meta:
        raise TypeError(
            f"{path!r} inside a per-rank entry is a DTensor, sparse or meta tensor; per-rank entries hold small "
            f"dense tensors only (put sharded tensors in the sharded state)"
        )
    try:
        st = dtype_to_st(t.dtype)
    except TypeError as exc:
        raise TypeError(f"tensor {path!r}: {exc}") from None
    local = t.detach().cpu().contiguous()
    nbytes = local.numel() * local.element_size()
    if budget is not None:
        budget.take(path, nbytes)
    raw = local.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
    data = {"dtype": st, "shape": [int(n) for n in local.shape], "data": base64.b64encode(raw).decode("ascii")}
    return {INLINE_TENSOR_MARKER: data}


def decode_tensor(path: str, spec: Any) -> torch.Tensor:
    """The tensor of an ``encode_tensor`` value; CorruptCheckpointError when it is malformed."""
    try:
        dtype = st_to_dtype(str(spec["dtype"]))
        shape = tuple(int(n) for n in spec["shape"])
        raw = base64.b64decode(spec["data"], validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise CorruptCheckpointError(f"inline tensor {path!r} in the per-rank state is malformed: {exc}", tensor=path) from exc
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected or any(n < 0 for n in shape):
        raise CorruptCheckpointError(
            f"inline tensor {path!r} in the per-rank state has {len(raw)} bytes, its shape {list(shape)} and dtype "
            f"{spec['dtype']} need {expected}",
            tensor=path,
        )
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _walk(
    value: Any, path: str, items: list[TensorItem] | None, seen: set[str], inline: _InlineBudget | None = None
) -> JSON:
    """Return the JSON skeleton of ``value``, appending its tensor leaves to ``items`` (or inlining them
    when ``inline`` is given: a per-rank entry; or only naming them when ``items`` is None: ``skeleton``)."""
    if isinstance(value, torch.Tensor):
        if inline is not None:
            return encode_tensor(path, value, inline)
        if path in seen:
            raise ValueError(f"two entries of the state flatten to the same name {path!r}; rename one")
        seen.add(path)
        if items is not None:
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
            out[str(k)] = _walk(v, f"{path}.{k}", items, seen, inline)
        if set(out) in _MARKERS:
            raise ValueError(f"{path!r} is a dict whose only key is {next(iter(out))!r}, which is reserved")
        return out
    if isinstance(value, (list, tuple)):
        return [_walk(v, f"{path}.{i}", items, seen, inline) for i, v in enumerate(value)]
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


def flatten(state: Mapping[str, Any], *, as_shared: Iterable[str] = (), keep_state_dicts: bool = False) -> FlatState:
    """Flatten ``state`` into this rank's tensor pieces and a JSON skeleton per top-level key.

    Called on the live state it also yields the destination pieces for a load (see the module docstring);
    a load passes ``keep_state_dicts`` so that ``apply`` reuses each ``state_dict()`` (``FlatState.state_dicts``).
    May initialise an optimizer's empty state with a zero-lr step, as DCP's ``get_optimizer_state_dict`` does.
    Per-rank entries go to ``rank_objects`` with their tensors inline, except the keys in ``as_shared``
    (loading a checkpoint that saved them as shared state, before they were per-rank).
    """
    flat = FlatState()
    walker = EntryWalker(state, as_shared=as_shared)
    for key, adapter in walker.adapters.items():
        value = walker.add(flat, key, adapter)
        if keep_state_dicts and _is_stateful(adapter):
            flat.state_dicts[key] = value
    logger.debug(
        "flatten: %d tensor items, %d shared and %d per-rank top-level keys",
        len(flat.items),
        len(flat.objects),
        len(flat.rank_objects),
    )
    return flat


class EntryWalker:
    """``flatten`` one top-level entry at a time (``checkpoint.memory.flatcache`` reuses some entries' items)."""

    __slots__ = ("adapters", "budget", "per_rank", "seen", "shared")

    def __init__(self, state: Mapping[str, Any], *, as_shared: Iterable[str] = ()) -> None:
        self.adapters: dict[str, Any] = _adapters(state)
        """Each top-level key's value, or what stands for it (``_ModelState``, ``ModelOptimizer``)."""
        self.per_rank = per_rank_entries(state)
        self.shared = set(as_shared)
        self.budget = _InlineBudget()
        self.seen: set[str] = set()
        """The tensor names taken so far (two entries may not flatten to the same name)."""

    def add(self, flat: FlatState, key: str, adapter: Any) -> Any:
        """Append ``key``'s items and skeleton to ``flat``; returns the value walked (its ``state_dict()`` for a
        stateful adapter, else the adapter itself)."""
        value = adapter
        if _is_stateful(adapter):
            value = adapter.state_dict()
        try:
            if key in self.per_rank and key not in self.shared:
                flat.rank_objects[key] = _walk(value, key, flat.items, self.seen, self.budget)
                flat.per_rank[key] = self.per_rank[key].on_resize
                return value
            flat.objects[key] = _walk(value, key, flat.items, self.seen)
        except TypeError as exc:
            if not _is_stateful(adapter) or "cannot checkpoint" not in str(exc):
                raise
            raise TypeError(f"{exc} (from {type(adapter).__name__}.state_dict() of key {key!r})") from None
        return value


def skeleton(value: Any, path: str, seen: set[str] | None = None) -> JSON:
    """The JSON skeleton ``flatten`` gives ``value`` at ``path`` (tensors named, not turned into items)."""
    return _walk(value, path, None, set() if seen is None else seen)


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
    if isinstance(skel, dict) and set(skel) == {INLINE_TENSOR_MARKER}:
        return _as_live(path, decode_tensor(path, skel[INLINE_TENSOR_MARKER]), live)
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


def blank_state(objects: Mapping[str, JSON], tensors: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> dict[str, Any]:
    """The plain state the skeletons ``objects`` describe, each tensor (``tensors``: fqn -> full shape, dtype)
    allocated in full and uninitialised: a live state for a template-free load. No live value guides the
    containers, so tuples come back as lists and int dict keys as str."""
    empty = {fqn: torch.empty(tuple(shape), dtype=dtype) for fqn, (shape, dtype) in tensors.items()}
    return {key: _rebuild(skel, None, key, empty) for key, skel in objects.items()}


def _as_live(fqn: str, local: torch.Tensor, live: Any) -> torch.Tensor:
    """The live tensor holding the loaded piece: copied in place unless the reader already wrote there.

    Keeping the live objects (parameters, DTensors, optimizer state) means every reference the caller
    holds sees the loaded values, and a DTensor keeps its mesh and placements.
    """
    if not isinstance(live, torch.Tensor):
        return local  # the live state has no tensor here (e.g. a Stateful that builds its dict lazily)
    target = live.to_local() if isinstance(live, _dtensor()) else live
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


def _assign_per_rank(wrapper: PerRank, value: Any) -> None:
    """Restore a plain per-rank value: containers in place (references held by the caller see it), else ``.value``."""
    live = wrapper.value
    if isinstance(live, dict) and isinstance(value, dict):
        live.clear()
        live.update(value)
    elif isinstance(live, list) and isinstance(value, list):
        live[:] = value
    else:
        wrapper.value = value


class RNGState:
    """Stateful wrapper of the global RNGs (torch CPU, CUDA if present, Python ``random``).

    Put it in the state as ``{"rng": RNGState()}``. It is per-rank by default (as if wrapped in
    ``PerRank``): each rank saves its own generator states and gets them back, so a resumed run draws
    the same numbers on every rank as an uninterrupted one. At another world size rank r gets saved rank
    ``r % saved_world_size``'s state; write ``PerRank(RNGState(), on_resize="rank0" | "skip")`` to change that.
    """

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now.

        Returns:
            ``{"torch": ..., "python": ..., "cuda": [...]}`` (``cuda`` only where CUDA is available).
        """
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the generators to a saved state (CUDA's only where it was saved and CUDA is available).

        Args:
            state_dict: what ``state_dict`` returned.
        """
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
        if key in flat.per_rank:
            if key not in flat.rank_objects:
                if flat.per_rank[key] == "skip":
                    logger.debug("apply: per-rank entry %r kept as is (on_resize='skip')", key)
                    continue
                raise IncompatibleCheckpointError(
                    f"the checkpoint has no per-rank entry {key!r} for this rank (it has {sorted(flat.rank_objects)}); "
                    f"remove the key from the state or wrap it as PerRank(..., on_resize='skip') to load the rest"
                )
            skel = flat.rank_objects[key]
        elif key not in flat.objects:
            raise IncompatibleCheckpointError(
                f"the checkpoint has no entry {key!r} (it has {sorted(flat.objects)}); "
                f"remove the key from the state to load the rest"
            )
        else:
            skel = flat.objects[key]
        if _is_stateful(adapter):
            live = flat.state_dicts[key] if key in flat.state_dicts else adapter.state_dict()
            adapter.load_state_dict(_rebuild(skel, live, key, loaded))
        elif isinstance(adapter, torch.Tensor):
            value = _rebuild(skel, adapter, key, loaded)
            if not isinstance(value, torch.Tensor):
                raise IncompatibleCheckpointError(f"{key!r} is a tensor in the live state but not in the checkpoint")
            if value is not adapter:  # _rebuild copies into the live tensor and returns it
                raise IncompatibleCheckpointError(f"{key!r}: loaded tensor could not be placed into the live tensor")
        elif isinstance(state.get(key), PerRank):
            _assign_per_rank(state[key], _rebuild(skel, adapter, key, loaded))
        else:
            _assign(state, key, adapter, _rebuild(skel, adapter, key, loaded))
    logger.debug("apply: restored %d top-level keys, %d tensors", len(state), len(loaded))


def total_bytes(items: Sequence[TensorItem]) -> int:
    """Bytes held by ``items`` (this rank's local pieces)."""
    return sum(math.prod(i.key.lengths) * i.tensor.element_size() for i in items)
