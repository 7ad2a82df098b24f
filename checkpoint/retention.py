"""Retention: which step directories to delete (pure), and deleting them safely (edge)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from checkpoint.api import COMMIT_FILE, CheckpointError, step_dir
from checkpoint.discover import latest_good_step, list_steps
from checkpoint.faults import crash_point
from checkpoint.storage import Storage

logger = logging.getLogger(__name__)


def steps_to_delete(
    committed: Sequence[int],
    uncommitted: Sequence[int],
    *,
    keep_last: int,
    keep_every: int | None = None,
    in_flight: int | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Steps whose directories can go, ascending.

    Keeps the newest ``keep_last`` committed steps and every step divisible by ``keep_every``; deletes
    uncommitted debris older than the newest commit. Never returns the newest committed step, the in-flight
    one nor any of ``protect`` (the newest step that validates: when the newest commit is damaged, the good
    step before it is what a restart loads), whatever the arguments.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    done = sorted(set(committed))
    keep = set(done[-keep_last:])
    if keep_every:
        keep.update(s for s in done if s % keep_every == 0)
    doomed = {s for s in done if s not in keep}
    if done:
        newest = done[-1]
        doomed.update(s for s in uncommitted if s < newest and s not in set(done))
        doomed.discard(newest)
    doomed.discard(in_flight)
    doomed.difference_update(protect)
    return sorted(doomed)


def delete_step(storage: Storage, step: int) -> None:
    """Remove a step directory, commit marker first: a half-deleted step is uncommitted, never corrupt."""
    rel = step_dir(step)
    storage.rm(f"{rel}/{COMMIT_FILE}")
    crash_point("retention.delete")
    storage.rm(rel, recursive=True)
    logger.info("retention: deleted step %d (%s)", step, storage.display(rel))


def apply_retention(storage: Storage, committed_step: int, *, keep_last: int, keep_every: int | None) -> list[int]:
    """After ``committed_step`` committed (rank 0): delete what ``steps_to_delete`` chooses; returns the deleted
    steps. A failure is logged, not raised: the new step is committed and failing to prune must not undo that."""
    deleted: list[int] = []
    try:
        crash_point("retention.before")
        listing = list_steps(storage)
        good = latest_good_step(storage, listing=listing)  # kept even when the newest commit turns out damaged
        doomed = steps_to_delete(
            listing.committed,
            listing.uncommitted,
            keep_last=keep_last,
            keep_every=keep_every,
            in_flight=committed_step,
            protect=() if good is None else (good,),
        )
        for step in doomed:
            delete_step(storage, step)
            deleted.append(step)
    except CheckpointError as exc:
        logger.warning("[step %d] retention failed (old steps kept): %s", committed_step, exc)
    return deleted
