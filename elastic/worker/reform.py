"""In-place re-form (prototype, opt-in with ``SPOTRUN_REFORM_IN_PLACE=1``): surviving workers keep their
process, model, optimizer and data cursor, and rebuild their process group at the new world size when a peer
node leaves with a notice, instead of exiting and being restarted by their agent.

    reform = InPlaceReform()                 # None of its methods is collective
    while True:
        ...train until preemption.save_and_stop(ckpt, step, state) returns True...
        assignment = reform.wait()           # acknowledged: wait for the re-formed group (None: exit as today)
        if assignment is None:
            break
        ... close what holds the old group (DDP, Preemption, Checkpointer) ...
        reform.rebuild(assignment, backend)  # destroy the old group, init the new one
        ... re-wrap DDP, new Preemption and Checkpointer, re-split the data at the new rank and size ...

Protocol (``elastic.worker.mailbox``): after its acknowledgement the worker writes ``waiting-{local_rank}``;
the agent, once every local worker waits, re-forms the group (the same rendezvous round as a restart) and
writes each one's ``group-{local_rank}.json`` (:class:`~elastic.worker.mailbox.GroupAssignment`). A worker
gives up after ``timeout`` seconds or when the agent marks the group ``stopping`` and exits as today: the
agent then restarts it. Only a peer's planned leave (``peer_preempt``) re-forms in place; this node's own
notice and a joining node (``resize``) keep today's path (the worker is told ``None`` at once).

bench/reform_bench.py measures what it saves; docs/concepts/reform-in-place.md has the numbers and limits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastic.api import ENV_REFORM_IN_PLACE
from elastic.worker.mailbox import GroupAssignment, Mailbox, find_mailbox

logger = logging.getLogger(__name__)

IN_PLACE_REASONS = frozenset({"peer_preempt"})
"""The planned changes that re-form in place: a peer leaves with a notice (scale-down)."""
POLL_INTERVAL = 0.005
LOSS_NOTICE_WAIT = 10.0
"""Seconds a worker whose collective broke waits for its agent to say a peer is gone (a probe of a dead peer's
port answers within a second; a silent peer's lease lapses within its TTL, 3 s by default)."""
"""Seconds between two looks at the mailbox while waiting (a ``stat``)."""


def in_place_enabled(environ: dict[str, str] | None = None) -> bool:
    """``SPOTRUN_REFORM_IN_PLACE=1`` (read by the agent and its workers)."""
    return (environ if environ is not None else os.environ).get(ENV_REFORM_IN_PLACE, "") == "1"


@dataclass(frozen=True, slots=True)
class ReformConfig:
    timeout: float = 120.0
    """Seconds a worker waits for its new group before it gives up and exits (the agent restarts it)."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")


class InPlaceReform:
    """The worker's side of the in-place re-form; inert (``wait`` returns None) when not enabled or not under
    spotrun (no mailbox)."""

    def __init__(self, config: ReformConfig | None = None, *, mailbox_dir: str | None = None) -> None:
        self.config = config or ReformConfig()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        path = mailbox_dir if mailbox_dir is not None else find_mailbox()
        self.mailbox = Mailbox(path) if path and in_place_enabled() else None

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
        is seen gone), this worker's place in the re-formed group; else None (exit as today: not enabled, no
        peer loss, the agent stopping the group, or no assignment within the timeout)."""
        if self.mailbox is None:
            return None
        deadline = time.monotonic() + notice_wait
        try:
            while not self.mailbox.peer_lost_posted():
                if self.mailbox.stopping() or time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_INTERVAL)
        except OSError:
            return None
        return self._wait_for_assignment(lambda: True)

    def _wait_for_assignment(self, still_in_place: Callable[[], bool]) -> GroupAssignment | None:
        """Mark this worker waiting and poll for its assignment; None when the agent stops the group, the change
        stops being one re-formed in place, or the timeout passes."""
        assert self.mailbox is not None
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
        return None

    def _in_place_change(self) -> bool:
        """The agent's posted notice, if any yet, is one that re-forms in place (this node's own notice or a
        joining node: exit as today). No notice yet: another node's rank saw it first; the agent's follows."""
        assert self.mailbox is not None
        notice = self.mailbox.read_notice()
        return notice is None or notice.reason in IN_PLACE_REASONS

    def rebuild(self, assignment: GroupAssignment, backend: str, timeout: timedelta | None = None) -> None:
        """Destroy this process's default group and join the re-formed one (``env://`` with the new
        environment, as a restarted worker would). Free everything that holds the old group first (DDP's
        reducer, ``Preemption``, a ``Checkpointer``): they keep its communicators."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.update(assignment.to_env())
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, **kwargs)
