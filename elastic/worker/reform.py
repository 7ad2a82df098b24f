"""The worker's side of an in-place re-form: wait in the process for the re-formed group, then join it.

:func:`elastic.inplace.run` drives :class:`InPlaceReform`. Protocol (``elastic.worker.mailbox``): the worker marks
itself capable (``inplace-{local_rank}``); after its acknowledgement (or a broken collective and the agent's
``peer-lost.json``) it writes ``waiting-{local_rank}``; the agent re-forms the group and writes each waiting worker's
``group-{local_rank}.json`` (:class:`~elastic.worker.mailbox.GroupAssignment`). A worker gives up after ``timeout``
seconds (:attr:`InPlaceReform.timed_out`) or when the agent marks the group ``stopping``. A peer's planned leave
(``peer_preempt``) and a lost peer re-form in place; so do a joining node (``resize``) and a peer's restarted workers
when the training function takes part in their restore (:attr:`InPlaceReform.joinable`, ``joinable-{local_rank}``).
``SPOTRUN_REFORM_IN_PLACE=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.api import ENV_REFORM_IN_PLACE
from elastic.worker.mailbox import GroupAssignment, Mailbox, find_mailbox

logger = logging.getLogger(__name__)

IN_PLACE_REASONS = frozenset({"peer_preempt"})
"""The planned changes that re-form in place: a peer leaves with a notice (scale-down)."""
JOIN_REASONS = frozenset({"resize"})
"""The planned changes that re-form in place only for joinable workers: a node waits to join (new workers, whose
restore is collective: the survivors take part in it)."""
POLL_INTERVAL = 0.005
"""Seconds between two looks at the mailbox while waiting (a ``stat``)."""
LOSS_NOTICE_WAIT = 10.0
"""Seconds a worker whose collective broke waits for its agent to say a peer is gone (a probe of a dead peer's
port answers within a second; a silent peer's lease lapses within its TTL, 3 s by default)."""


def in_place_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """In-place re-forms are allowed: ``SPOTRUN_REFORM_IN_PLACE`` (deprecated, read by the agent and its workers)
    is not ``0``. Whether one happens depends on use: every local worker must run under ``elastic.inplace.run``."""
    return (environ if environ is not None else os.environ).get(ENV_REFORM_IN_PLACE, "").strip() != "0"


@dataclass(frozen=True, slots=True)
class ReformConfig:
    timeout: float = 120.0
    """Seconds a worker waits for its new group before it gives up and exits (the agent restarts it)."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")


class InPlaceReform:
    """The worker's side of the in-place re-form; inert (``wait`` returns None) when turned off
    (``SPOTRUN_REFORM_IN_PLACE=0``) or not under spotrun (no mailbox). Constructing it tells the agent this
    worker can re-form in place (``inplace-{local_rank}``)."""

    def __init__(self, config: ReformConfig | None = None, *, mailbox_dir: str | None = None,
                 enabled: bool = True) -> None:
        """``enabled=False``: inert, as outside spotrun (the script cannot re-form in place as configured)."""
        self.config = config or ReformConfig()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        path = mailbox_dir if mailbox_dir is not None else find_mailbox()
        self.mailbox = Mailbox(path) if path and enabled and in_place_enabled() else None
        self.timed_out = False
        """The last wait ended because no assignment came within ``config.timeout`` (a fallback to a restart)."""
        self.joinable = False
        """The training function takes part in the restore of workers that join (it asks
        ``Generation.needs_restore``): a joining node or a peer's restarted workers re-form in place too."""
        self.mark_capable()

    def mark_capable(self) -> None:
        """Tell the agent (again: its re-form clears the mailbox) that this worker can re-form in place."""
        if self.mailbox is None:
            return
        try:
            self.mailbox.mark_in_place(self.local_rank)
        except OSError as exc:
            logger.warning("[local rank %d] cannot mark the worker in-place capable (%s): the agent restarts it "
                           "at the next change", self.local_rank, exc)

    def mark_joinable(self) -> None:
        """Tell the agent (again after each re-form) that new workers can join this worker's group in place."""
        if self.mailbox is None:
            self.joinable = True
            return
        try:
            self.mailbox.mark_joinable(self.local_rank)
        except OSError as exc:  # not joinable then: the agent, which did not see the mark, restarts it
            self.joinable = False
            logger.warning("[local rank %d] cannot mark the worker joinable (%s): a joining node restarts it",
                           self.local_rank, exc)
            return
        self.joinable = True

    @property
    def enabled(self) -> bool:
        return self.mailbox is not None

    def wait(self) -> GroupAssignment | None:
        """After the acknowledgement of an agreed step: this worker's place in the re-formed group, or None
        (exit as today: not enabled, a change that is not re-formed in place, the agent stopping the group, or
        no assignment within the timeout)."""
        if self.mailbox is None or not self._in_place_change():
            return None
        return self._wait_for_assignment(self._in_place_change)

    def wait_after_loss(self, notice_wait: float = LOSS_NOTICE_WAIT) -> GroupAssignment | None:
        """After a collective broke (the state is that of the last completed step): once the agent says a peer
        was lost (``peer-lost.json``, within ``notice_wait`` s: a killed peer's sockets close before its agent
        is seen gone) or, for a joinable worker, that a node waits to join or a peer's workers restart
        (``peer-lost.json`` with ``restarted``: its workers failed and its agent restarts them), this worker's
        place in the re-formed group; else None (exit as today: not enabled, no peer loss, a join this worker
        cannot take part in, the agent stopping the group, or no assignment within the timeout)."""
        if self.mailbox is None:
            return None
        deadline = time.monotonic() + notice_wait
        try:
            while not self.mailbox.peer_lost_posted():
                if (notice := self.mailbox.read_notice()) is not None and notice.reason in JOIN_REASONS:
                    if not self.joinable:
                        return None  # the peer's new workers restore collectively: restart to take part
                    break
                if self.mailbox.stopping() or time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_INTERVAL)
            if self.mailbox.peer_restarted() and not self.joinable:
                return None  # the peers' restarted workers will join and restore: restart to take part
        except OSError:
            return None
        return self._wait_for_assignment(lambda: True)

    def _wait_for_assignment(self, still_in_place: Callable[[], bool]) -> GroupAssignment | None:
        """Mark this worker waiting and poll for its assignment; None when the agent stops the group, the change
        stops being one re-formed in place, or the timeout passes."""
        assert self.mailbox is not None
        self.timed_out = False
        self.mailbox.mark_waiting(self.local_rank)
        deadline = time.monotonic() + self.config.timeout
        while time.monotonic() < deadline:
            assignment = self.mailbox.take_assignment(self.local_rank)
            if assignment is not None:
                return assignment
            if self.mailbox.stopping() or not still_in_place():
                return None
            time.sleep(POLL_INTERVAL)
        logger.warning("[local rank %d] no re-formed group within %.0f s; exiting for a restart", self.local_rank,
                       self.config.timeout)
        self.timed_out = True
        return None

    def _in_place_change(self) -> bool:
        """The agent's posted notice, if any yet, is one that re-forms in place (this node's own notice, or a
        joining node when this worker is not joinable: exit as today). No notice yet: another node's rank saw it
        first; the agent's follows."""
        assert self.mailbox is not None
        notice = self.mailbox.read_notice()
        return notice is None or notice.reason in IN_PLACE_REASONS or (self.joinable and notice.reason in JOIN_REASONS)

    def rebuild(self, assignment: GroupAssignment, backend: str, timeout: timedelta | None = None) -> None:
        """Destroy this process's default group and join the re-formed one (``env://`` with the new
        environment, as a restarted worker would). Free everything that holds the old group first (DDP's
        reducer, ``Preemption``, a ``Checkpointer``): they keep its communicators."""
        if dist.is_initialized():
            dist.destroy_process_group()
        clear_dtensor_caches()
        os.environ.update(assignment.to_env())
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, **kwargs)


def clear_dtensor_caches() -> list[str]:
    """Empty DTensor's sharding caches before the process joins a new group; returns the caches cleared.

    torch keys them by ``DTensorSpec``, whose equality compares a device mesh's ranks and layout but not this
    process's place in it. After a re-form at the same world size with this process at another rank, a new
    mesh equals the old one, a cached spec hands back the old mesh object (its old coordinate), and FSDP2's
    shards disagree with their placements (``to_local()`` is another rank's piece). Each cache is cleared
    if this torch has it (torch 2.13: the C++ sharding propagator's, the Python propagator's, the
    redistribute planner's); none of them is public API, so what is missing is skipped, not an error."""
    cleared: list[str] = []
    cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if callable(cpp):
        cpp()
        cleared.append("torch._C._clear_DTensor_sharding_propagator_cache")
    try:  # here: the agent imports this module too, and never needs DTensor
        from torch.distributed.tensor import DTensor, _redistribute
    except ImportError:
        return cleared
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for name, cache in (("propagate_op_sharding", getattr(propagator, "propagate_op_sharding", None)),
                        ("_propagate_tensor_meta_cached",
                         getattr(type(propagator), "_propagate_tensor_meta_cached", None)),
                        ("_gen_transform_infos", getattr(_redistribute, "_gen_transform_infos", None))):
        if callable(getattr(cache, "cache_clear", None)):
            cache.cache_clear()  # type: ignore[union-attr]  # checked just above
            cleared.append(name)
    return cleared
