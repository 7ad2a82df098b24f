"""The durable load path: rank 0 picks the step -> ``discover.validate_step`` -> ``plan.plan_reads`` ->
``shard.read_requests`` (verified by ``verify``) -> ``state.apply``; per-rank entries come back through
``per_rank``; damage found while reading falls back to an older step as ``fallback`` decides."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from checkpoint.api import JSON, CheckpointNotFoundError, Manifest, step_dir
from checkpoint.collective import Collective
from checkpoint.config import CheckpointConfig
from checkpoint.discover import latest_good_manifest, read_objects, validate_step
from checkpoint.dtypes import torch_dtype
from checkpoint.fallback import LoadOutcome, load_with_fallback
from checkpoint.per_rank import load_rank_entries, saved_as_shared
from checkpoint.plan import plan_reads
from checkpoint.shard import read_requests
from checkpoint.state import apply, blank_state, flatten
from checkpoint.storage import Storage

logger = logging.getLogger(__name__)


class Loader:
    """Loads a step into live state on every rank (``load``), or reads one whole on this process (``read``)."""

    def __init__(self, config: CheckpointConfig, storage: Storage, collective: Collective) -> None:
        self._config = config
        self._storage = storage
        self._fg = collective
        self.rank, self.world_size = collective.rank, collective.world_size
        self.last_load_bytes = 0
        """Bytes this rank read in its last successful ``load``/``read``."""
        self._validated: Manifest | None = None
        """The manifest this rank validated while choosing the step (rank 0, and the fallback's older step),
        taken by ``_validated_manifest`` so a load validates its step once."""

    def load(self, state: Mapping[str, Any], step: int | None) -> int | None:
        """``Checkpointer.load_durable`` once no save is in flight. Collective (foreground group)."""
        self._validated = None  # never one left over from an earlier, failed load
        # rank 0 picks the step, so all ranks load the same one even if a commit lands meanwhile
        chosen = step if step is not None else self._fg.rank0_decides(self._choose_good)
        if chosen is None:
            logger.info("[rank %d] no checkpoint at %s; starting fresh", self.rank, self._storage.display())
            return None
        return load_with_fallback(
            chosen,
            step_named=step is not None,
            attempt=lambda at: self._load_step(state, at),
            worst=lambda mine: LoadOutcome(self._fg.max(mine)),
            older_step=lambda below: self._fg.rank0_decides(lambda: self._choose_good(below)),
            where=self._storage.display(),
            rank=self.rank,
        )

    def read(self, step: int | None) -> tuple[int, dict[str, Any]]:
        """``Checkpointer.read``: the step's shared entries into a state built from its own manifest."""
        self._validated = None
        chosen = self._choose_good() if step is None else step
        if chosen is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {self._storage.display()}")
        manifest = self._validated_manifest(chosen)
        shared = read_objects(self._storage, manifest)
        tensors = {fqn: (rec.shape, torch_dtype(rec.dtype)) for fqn, rec in manifest.tensors.items()}
        state = blank_state(shared, tensors)
        self._read_into(state, manifest, shared)
        return chosen, state

    def _load_step(self, state: Mapping[str, Any], chosen: int) -> None:
        manifest = self._validated_manifest(chosen)
        self._read_into(state, manifest, read_objects(self._storage, manifest))

    def _read_into(self, state: Mapping[str, Any], manifest: Manifest, shared: dict[str, JSON]) -> None:
        started = time.perf_counter()
        chosen = manifest.step
        flat = flatten(state, as_shared=saved_as_shared(manifest, state, shared, rank=self.rank), keep_state_dicts=True)
        requests = plan_reads(manifest, flat.items)
        destinations = {item.key: item.tensor for item in flat.items}
        nbytes = read_requests(
            self._storage,
            step_dir(chosen),
            requests,
            destinations.__getitem__,
            manifest.checksum_block_bytes,
            self._config.verify_on_load,
            self._read_threads(),
        )
        flat.objects = shared
        flat.rank_objects = load_rank_entries(
            self._storage, manifest, flat.per_rank, rank=self.rank, world_size=self.world_size
        )
        apply(state, flat)
        self.last_load_bytes = nbytes
        logger.info(
            "[rank %d] loaded step %d: %d bytes in %d reads, %.2fs",
            self.rank,
            chosen,
            nbytes,
            len(requests),
            time.perf_counter() - started,
        )

    def _read_threads(self) -> int:
        c = self._config
        if c.read_threads is not None:
            return c.read_threads
        if self._storage.is_local:
            return max(1, min(c.writer_threads, os.cpu_count() or 1))
        return c.writer_threads

    def _choose_good(self, below: int | None = None) -> int | None:
        """``latest_good_step`` (below ``below``), keeping the manifest it validated for ``_load_step``."""
        self._validated = latest_good_manifest(self._storage, below=below)
        return None if self._validated is None else self._validated.step

    def _validated_manifest(self, step: int) -> Manifest:
        """The manifest of ``step`` after ``validate_step``'s checks: the one this rank validated while
        choosing the step (taken once: a later load validates again), else validated now."""
        manifest, self._validated = self._validated, None
        if manifest is not None and manifest.step == step:
            return manifest
        return validate_step(self._storage, step)
