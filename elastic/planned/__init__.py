"""Planned membership changes: a preemption notice, a peer's notice or a joining node, turned into an agreed step.

``policy.py`` decides on plain data (re-exported here); ``hook.py`` is the agent's hook (notices in, the stop
posted, leaving); ``inplace.py`` re-forms around waiting workers; ``channel.py`` reads the mailbox
(``elastic.worker.mailbox``), which the workers' side (``elastic.worker``) shares without importing the agent.
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
