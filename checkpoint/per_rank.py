"""Per-rank entries (``state.PerRank``): which saved rank's copy each rank loads, and reading them back.

Each saving rank writes its own per-rank objects file; on load at the saving world size every rank takes
its own copy, at another world size ``per_rank_source`` picks one by the entry's ``on_resize`` rule.
Steps saved before per-rank entries existed kept such keys in the shared objects: ``saved_as_shared``
finds them so they load as they were saved.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from checkpoint.api import JSON, ON_RESIZE_RULES, IncompatibleCheckpointError, Manifest
from checkpoint.discover import read_rank_objects
from checkpoint.state import per_rank_entries
from checkpoint.storage import Storage

logger = logging.getLogger(__name__)


def per_rank_source(rank: int, world_size: int, saved_world_size: int, on_resize: str) -> int | None:
    """The saved rank whose copy of a per-rank entry ``rank`` loads, or None to leave the live value as is.

    At the saving world size every rank gets its own copy whatever the rule. Otherwise ``rank_modulo``
    (default) gives rank r the copy of saved rank ``r % saved_world_size`` (its own while r < saved world
    size; when shrinking, the copies of saved ranks >= world size are dropped), ``rank0`` gives every rank
    saved rank 0's copy, ``skip`` keeps the live value.
    """
    if on_resize not in ON_RESIZE_RULES:
        raise ValueError(f"on_resize={on_resize!r} is not one of {ON_RESIZE_RULES}")
    if saved_world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank/world sizes: rank={rank} world_size={world_size} saved_world_size={saved_world_size}")
    if world_size == saved_world_size:
        return rank
    if on_resize == "skip":
        return None
    if on_resize == "rank0":
        return 0
    return rank % saved_world_size


def saved_as_shared(manifest: Manifest, state: Mapping[str, Any], shared: dict[str, JSON], *, rank: int) -> set[str]:
    """Per-rank keys of the live state that ``manifest``'s step saved as shared state (it predates per-rank
    entries, e.g. an ``RNGState`` saved by an older spotrun): they load rank 0's copy, as they were saved."""
    saved_per_rank = {k for rec in manifest.rank_objects.values() for k in rec.keys}
    legacy = {k for k in per_rank_entries(state) if k not in saved_per_rank and k in shared}
    if legacy and rank == 0:
        logger.warning(
            "[rank %d step %d] %s saved as shared state (before per-rank entries): every rank loads rank 0's copy",
            rank,
            manifest.step,
            sorted(legacy),
        )
    return legacy


def load_rank_entries(
    storage: Storage, manifest: Manifest, per_rank: dict[str, str], *, rank: int, world_size: int
) -> dict[str, JSON]:
    """This rank's copies of the per-rank entries, chosen by ``per_rank_source`` (each file read once,
    checked against the manifest). Entries whose rule is ``skip`` at a new world size are left out."""
    if not per_rank:
        return {}
    saved = manifest.world_size
    sources = {key: per_rank_source(rank, world_size, saved, rule) for key, rule in per_rank.items()}
    if saved != world_size and rank == 0:
        logger.warning(
            "[rank %d step %d] per-rank state saved at world size %d, loading at %d: %s "
            "(rank_modulo: rank r takes saved rank r %% %d's copy; rank0: saved rank 0's; skip: kept as is)",
            rank,
            manifest.step,
            saved,
            world_size,
            ", ".join(f"{k}={rule}" for k, rule in sorted(per_rank.items())),
            saved,
        )
    files: dict[int, dict[str, JSON]] = {}
    out: dict[str, JSON] = {}
    for key, src in sorted(sources.items()):
        if src is None:
            continue
        if src not in files:
            files[src] = read_rank_objects(storage, manifest, src)
        if key not in files[src]:
            raise IncompatibleCheckpointError(
                f"step {manifest.step} has no per-rank entry {key!r} (saved per-rank entries: {sorted(files[src])}); "
                f"remove the key from the state or wrap it as PerRank(..., on_resize='skip')"
            )
        out[key] = files[src][key]
        if src != rank:
            logger.info("[rank %d step %d] per-rank entry %r from saved rank %d", rank, manifest.step, key, src)
    return out
