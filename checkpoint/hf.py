"""Hugging Face directories in and out: tie information from a model's ``config.json``, and ``from_hf`` (a HF
safetensors directory -> state dict) to start a run from a published model.

transformers is optional: without it ties are not known from a config (pass them explicitly) and everything
else works.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from checkpoint.api import IncompatibleCheckpointError

logger = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def read_config(path: str) -> dict[str, Any]:
    """A ``config.json`` as a dict; IncompatibleCheckpointError when it is not a JSON object."""
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise IncompatibleCheckpointError(f"cannot read the model config {path!r}: {exc}") from exc
    if not isinstance(config, dict):
        raise IncompatibleCheckpointError(f"the model config {path!r} is not a JSON object")
    return config


def tied_weights(config: dict[str, Any]) -> dict[str, str]:
    """Tied parameter names (target -> source) of the model ``config`` describes, from its architecture's
    ``_tied_weights_keys`` in transformers; empty when the config unties them, names no known architecture or
    transformers is not installed (then pass ties explicitly)."""
    if config.get("tie_word_embeddings", True) is False:
        return {}
    try:
        import transformers
    except ImportError:
        logger.warning("transformers is not installed: tied weights of %s are not known", config.get("architectures"))
        return {}
    ties: dict[str, str] = {}
    for arch in config.get("architectures") or _classes_of(config.get("model_type")):
        keys = getattr(getattr(transformers, str(arch), None), "_tied_weights_keys", None)
        if isinstance(keys, dict):  # transformers >= 5: {target: source}
            ties.update({str(t): str(s) for t, s in keys.items()})
    return ties


def _classes_of(model_type: Any) -> list[str]:
    """Every model class transformers registers for ``model_type`` (a config saved without ``architectures``):
    their ties are candidates, kept only where both names are exported and the values are equal."""
    from transformers.models.auto import modeling_auto  # optional: tied_weights found transformers installed

    names: list[str] = []
    for attr in dir(modeling_auto):
        mapping = getattr(modeling_auto, attr)
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            found = mapping.get(model_type)
            names.extend([found] if isinstance(found, str) else list(found or ()))
    return sorted(set(names))


def weight_files(directory: str) -> list[str]:
    """The safetensors files of a HF model directory (one ``model.safetensors`` or the index's shards)."""
    index = os.path.join(directory, SAFE_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, "rb") as f:
                weight_map = json.loads(f.read())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IncompatibleCheckpointError(f"{index} is not a safetensors index: {exc}") from exc
        for name in names:
            if os.path.basename(name) != name:
                raise IncompatibleCheckpointError(f"{index} names {name!r}, outside the directory")
        return [os.path.join(directory, n) for n in names]
    single = os.path.join(directory, SAFE_WEIGHTS)
    if os.path.isfile(single):
        return [single]
    raise IncompatibleCheckpointError(f"{directory} has neither {SAFE_WEIGHTS} nor {SAFE_INDEX} (only safetensors is read)")


def from_hf(directory: str, *, ties: dict[str, str] | None = None) -> dict[str, Any]:
    """The state dict stored in a HF safetensors directory (CPU tensors). ``ties`` (target -> source, default:
    from the directory's ``config.json``) re-adds tied weights ``save_pretrained`` wrote once, sharing the
    source's tensor, so the dict matches the model's own ``state_dict()``.

    Args:
        directory: a local directory with ``model.safetensors`` or ``model.safetensors.index.json`` and its
            shards (only safetensors is read: no ``pytorch_model.bin``, no pickle).
        ties: tied weights as target -> source; None: from the directory's ``config.json`` (none without it).

    Returns:
        Tensor name -> CPU tensor, tied targets sharing their source's tensor.

    Raises:
        IncompatibleCheckpointError: the directory has no safetensors weights, or two files hold the same
            tensor.
    """
    from safetensors.torch import load_file  # imports torch: spotrun-ckpt export reads configs without it

    state: dict[str, Any] = {}
    for path in weight_files(directory):
        part = load_file(path)
        clash = state.keys() & part.keys()
        if clash:
            raise IncompatibleCheckpointError(f"{path} repeats tensors of another file: {sorted(clash)[:5]}")
        state.update(part)
    if ties is None:
        config = os.path.join(directory, CONFIG)
        ties = tied_weights(read_config(config)) if os.path.isfile(config) else {}
    for target, source in ties.items():
        if target not in state and source in state:
            state[target] = state[source]
    logger.info("from_hf: %d tensors from %s", len(state), directory)
    return state


def load_hf(model: Any, directory: str) -> None:
    """Load a HF safetensors directory into ``model`` in place; IncompatibleCheckpointError naming missing or
    unexpected keys (a key tied to a loaded one in the live model is not missing).

    Args:
        model: an ``nn.Module`` (e.g. a transformers model) with the directory's architecture.
        directory: a HF safetensors directory (see :func:`from_hf`).

    Raises:
        IncompatibleCheckpointError: keys are missing or unexpected, or the directory has no safetensors
            weights.
    """
    state = from_hf(directory, ties={})
    result = model.load_state_dict(state, strict=False)
    live = model.state_dict()
    loaded_ptrs = {live[k].data_ptr() for k in state if k in live}
    missing = [k for k in result.missing_keys if live[k].data_ptr() not in loaded_ptrs]
    if missing or result.unexpected_keys:
        raise IncompatibleCheckpointError(
            f"{directory} does not match the model: missing {missing[:10]}, unexpected {list(result.unexpected_keys)[:10]}"
        )
