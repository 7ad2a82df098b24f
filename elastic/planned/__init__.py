"""Planned membership changes: a preemption notice, a peer's notice or a joining node, turned into an agreed step.

Instead of killing the workers and rolling back to the last periodic checkpoint, the agent posts a stop to its
workers; workers that use :class:`~elastic.preemption.Preemption` agree on a step, commit it, acknowledge and
exit 0. The leaving agent revokes its lease, the others re-form at once at the new size and resume from that
step; these restarts are not charged against ``--max-restarts``.

One feature, its parts side by side:

* ``policy.py``: the pure decisions (:class:`PlannedChanges`: ``tick(view) -> actions``), re-exported here;
* ``hook.py``: the agent's hook (``PlannedFeature``): notices in, the stop posted, leaving and re-forming;
* ``inplace.py``: re-forming around workers that wait in their processes, and the survivors' snapshots;
* ``channel.py``: the agent's reads of the mailbox. The mailbox itself (``elastic.worker.mailbox``) and the
  workers' side (``elastic.worker.preemption``, ``elastic.worker.reform``) live under ``elastic.worker``, which
  imports nothing of the agent.
"""

from elastic.planned.policy import (
    ENV_PLANNED_LEAVE_EXIT_CODE,
    ENV_RESIZE_TIMEOUT,
    WHY_BEFORE_HELPERS,
    AbandonStop,
    AfterSuccess,
    GroupView,
    HelperOutlook,
    LeaveNow,
    PlannedAction,
    PlannedChanges,
    PlannedDecision,
    PlannedStep,
    PlannedTick,
    PostStop,
    Reform,
    SignalAction,
    Stopped,
    TickView,
    all_stopped,
    helper_outlook,
    leave_exit_code,
    unplanned_loss,
    wait_for_helpers,
    while_posted,
    with_save_by,
    worker_notice,
)

__all__ = [
    "ENV_PLANNED_LEAVE_EXIT_CODE",
    "ENV_RESIZE_TIMEOUT",
    "WHY_BEFORE_HELPERS",
    "AbandonStop",
    "AfterSuccess",
    "GroupView",
    "HelperOutlook",
    "LeaveNow",
    "PlannedAction",
    "PlannedChanges",
    "PlannedDecision",
    "PlannedStep",
    "PlannedTick",
    "PostStop",
    "Reform",
    "SignalAction",
    "Stopped",
    "TickView",
    "all_stopped",
    "helper_outlook",
    "leave_exit_code",
    "unplanned_loss",
    "wait_for_helpers",
    "while_posted",
    "with_save_by",
    "worker_notice",
]
