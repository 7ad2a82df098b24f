"""What the agent does after its local worker group failed: pure decisions on plain data.

torch charges every restart against ``--max-restarts``; spotrun does not charge a failure that came with a
membership change (a peer lost: the local crash is its consequence), and refunds a charged one when the next
round shows the group changed.
"""

from __future__ import annotations

import enum

from elastic.api import RecoveryCause


class FailureAction(enum.Enum):
    """What to do after the local worker group failed."""

    RESTART_FREE = "restart_free"
    """Restart without using up a restart (the failure came with a membership change)."""
    RESTART_CHARGED = "restart_charged"
    """Restart and use up one of ``--max-restarts`` (refunded if the next round shows a peer was lost)."""
    GIVE_UP = "give_up"
    """Stop the workers and report the failure."""


def decide_on_failure(*, remaining_restarts: int, peer_lost: bool) -> FailureAction:
    """Pure decision for a failed worker group (torch always charges; spotrun forgives peer loss)."""
    if peer_lost:
        return FailureAction.RESTART_FREE
    if remaining_restarts > 0:
        return FailureAction.RESTART_CHARGED
    return FailureAction.GIVE_UP


def should_refund(*, charged: bool, previous_group_world_size: int | None, new_group_world_size: int,
                  previous_members: frozenset[str] | None = None, new_members: frozenset[str] | None = None) -> bool:
    """A charged restart is refunded when the round it led to has a different node count, or (when the backend
    names the round's nodes) lacks a node of the previous round: the failure coincided with a peer leaving
    (workers crash in a collective before the dead peer's lease expires, so the loss is only visible in the
    next round; a replacement that arrived meanwhile keeps the count but not the membership) or joining."""
    if not charged or previous_group_world_size is None:
        return False
    if previous_group_world_size != new_group_world_size:
        return True
    return previous_members is not None and new_members is not None and not previous_members <= new_members


def recovery_cause_of_failure(*, hung: bool, peer: RecoveryCause | None) -> RecoveryCause:
    """The ``recovery_cause`` of a failed local group: a hang we detected, the peer cause that explains it
    (``PEER_LOST``, ``PEER_FAILURE``: the local crash is then a consequence), or a failure of its own."""
    if hung:
        return RecoveryCause.HANG
    return RecoveryCause.FAILURE if peer is None else peer
