"""The agent's reads of its workers' mailbox (``elastic.worker.mailbox``, the protocol both sides import).

A mailbox that cannot be read counts as "not yet": the next look tries again.
"""

from __future__ import annotations

from collections.abc import Callable

from elastic.planned.policy import Stopped, all_stopped
from elastic.worker.mailbox import Mailbox


def every_local_worker(mailbox: Mailbox | None, marks: Callable[[Mailbox], set[int]], local_world_size: int) -> bool:
    """Every local worker left its mark of this kind (``marks``: ``Mailbox.helpers``, ``Mailbox.waiting``,
    ``Mailbox.watchers``); False without a mailbox or when it cannot be read."""
    if mailbox is None:
        return False
    try:
        return len(marks(mailbox)) >= local_world_size
    except OSError:
        return False


def acknowledged_stop(mailbox: Mailbox | None, local_world_size: int) -> Stopped | None:
    """Where every local worker stopped for the planned change, saved or not (None: they did not all)."""
    if mailbox is None:
        return None
    return all_stopped(*mailbox.stops(), local_world_size)


def committed_at(mailbox: Mailbox | None) -> float | None:
    """When the local workers had committed the agreed step (None: unknown)."""
    if mailbox is None:
        return None
    try:
        return mailbox.committed_at()
    except OSError:
        return None
