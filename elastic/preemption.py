"""Old import path of the worker-side preemption helper and the mailbox: ``from elastic.preemption import
Preemption`` keeps working. The code lives in ``elastic.worker.preemption`` (the helper) and
``elastic.worker.mailbox`` (the agent<->worker protocol)."""

from elastic.api import ENV_NOTICE_DIR as ENV_NOTICE_DIR
from elastic.api import PlannedStopVoteError as PlannedStopVoteError
from elastic.worker.mailbox import LINK_KIND as LINK_KIND
from elastic.worker.mailbox import LOCK_FILE as LOCK_FILE
from elastic.worker.mailbox import MAILBOX_PREFIX as MAILBOX_PREFIX
from elastic.worker.mailbox import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from elastic.worker.mailbox import NOTICE_FILE as NOTICE_FILE
from elastic.worker.mailbox import SIGNALS_FILE as SIGNALS_FILE
from elastic.worker.mailbox import STOPPING_FILE as STOPPING_FILE
from elastic.worker.mailbox import Acknowledgement as Acknowledgement
from elastic.worker.mailbox import Mailbox as Mailbox
from elastic.worker.mailbox import WorkerNotice as WorkerNotice
from elastic.worker.mailbox import find_mailbox as find_mailbox
from elastic.worker.mailbox import remove_orphaned_mailboxes as remove_orphaned_mailboxes
from elastic.worker.preemption import DEFAULT_SAVE_MARGIN as DEFAULT_SAVE_MARGIN
from elastic.worker.preemption import DEFAULT_SYNC_EVERY as DEFAULT_SYNC_EVERY
from elastic.worker.preemption import DEFAULT_VOTE_TIMEOUT as DEFAULT_VOTE_TIMEOUT
from elastic.worker.preemption import SAVE_SLACK_SECONDS as SAVE_SLACK_SECONDS
from elastic.worker.preemption import Preemption as Preemption
from elastic.worker.preemption import SaveDecision as SaveDecision
from elastic.worker.preemption import SnapshotsEachStep as SnapshotsEachStep
from elastic.worker.preemption import decide_planned_save as decide_planned_save
from elastic.worker.preemption import is_sync_step as is_sync_step
