"""Contracts of spotrun's launcher and agent: environment names, recovery events and the error tree.

Data flow: ``cli`` parses torchrun's flags (plus a few spotrun ones) into a torch ``LaunchConfig`` and a
:class:`~elastic.config.AgentSettings`; ``launcher`` builds the rendezvous handler and a
:class:`~elastic.agent.SpotrunAgent`; the agent runs rendezvous rounds and starts workers through
``workers`` (which ties each worker's life to its agent); every recovery stage is appended to an
``events.jsonl`` file by ``events``.
"""

from __future__ import annotations

import enum
from typing import Any, Final, Protocol

from elastic import options

# --- Environment variables read by spotrun (typed module constants, torchft style) ------------------------

# The variables of spotrun's flags are declared with their flags in elastic.options; named here too for callers.
ENV_STOP_GRACE: Final = options.STOP_GRACE.env
ENV_EVENTS_FILE: Final = options.EVENTS_FILE.env
ENV_PEER_LOSS_GRACE: Final = options.PEER_LOSS_GRACE.env
ENV_WARM_WORKERS: Final = options.WARM_WORKERS.env
ENV_HANG_TIMEOUT: Final = options.HANG_TIMEOUT.env
ENV_HANG_STARTUP_TIMEOUT: Final = options.HANG_STARTUP_TIMEOUT.env
ENV_HANG_DETECTION: Final = options.HANG_DETECTION.env
ENV_PREEMPT_NOTICE: Final = options.PREEMPT_NOTICE.env
ENV_PREEMPT_GRACE: Final = options.PREEMPT_GRACE.env
ENV_PREEMPT_SIGNAL: Final = options.PREEMPT_SIGNAL.env
ENV_PREEMPT_POLL_INTERVAL: Final = options.PREEMPT_POLL_INTERVAL.env
ENV_RESIZE_TIMEOUT: Final = options.RESIZE_TIMEOUT.env
ENV_PLANNED_LEAVE_EXIT_CODE: Final = options.PLANNED_LEAVE_EXIT_CODE.env
ENV_METRICS_PORT: Final = options.METRICS_PORT.env
ENV_STRAGGLER_FACTOR: Final = options.STRAGGLER_FACTOR.env
ENV_STRAGGLER_WINDOW: Final = options.STRAGGLER_WINDOW.env

#: Base URLs of the metadata services (tests point them at local servers).
ENV_AWS_METADATA_URL = "SPOTRUN_AWS_METADATA_URL"
ENV_GCP_METADATA_URL = "SPOTRUN_GCP_METADATA_URL"
ENV_AZURE_METADATA_URL = "SPOTRUN_AZURE_METADATA_URL"
#: Directory of the agent<->worker mailbox (set by spotrun for its workers; absent under torchrun).
ENV_NOTICE_DIR = "SPOTRUN_NOTICE_DIR"
#: Deprecated. In-place re-forms are chosen by use: workers whose script runs under ``elastic.inplace.run`` say
#: so in the mailbox and are re-formed in place. ``0`` turns that off (the agent and its workers read it: every
#: change restarts the workers); ``1`` is accepted and changes nothing (docs/concepts/reform-in-place.md).
ENV_REFORM_IN_PLACE = "SPOTRUN_REFORM_IN_PLACE"

#: Rendezvous backend spotrun uses when ``--rdzv-backend`` is not given (torchrun's is ``static``).
DEFAULT_RDZV_BACKEND = "etcd-v3"


class RecoveryEvent(str, enum.Enum):
    """Stages of a recovery, in the order they happen; each is one JSON line in ``events.jsonl``."""

    FAILURE_DETECTED = "failure_detected"
    WORKERS_STOPPED = "workers_stopped"
    RENDEZVOUS_STARTED = "rendezvous_started"
    RENDEZVOUS_COMPLETED = "rendezvous_completed"
    WORKERS_STARTED = "workers_started"
    RUN_FINISHED = "run_finished"
    """The agent's run ended (``state``; after a planned leave also ``exit_code``, the process's exit status)."""
    NOTICE_RECEIVED = "notice_received"
    """This node got a preemption notice (``source``, ``deadline`` wall-clock s, ``published`` to the group)."""
    PLANNED_STOP_POSTED = "planned_stop_posted"
    """Workers were asked to stop at an agreed step (``reason``: preempt/peer_preempt/resize, ``deadline``)."""
    PLANNED_STOP_ABANDONED = "planned_stop_abandoned"
    """No time left (or a peer crashed) before the workers committed: stopped without the save (``why``)."""
    PLANNED_LEAVE = "planned_leave"
    """This node left the group for its notice (``step`` committed, or null when nothing could be saved;
    ``committed_at``: wall-clock s by which its workers had committed it, from their acknowledgements)."""
    PLANNED_RESTART = "planned_restart"
    """The group re-forms at a new size after a planned stop (``step`` committed, ``committed_at`` as for
    ``planned_leave``), not counted as a restart."""
    HANG_DETECTED = "hang_detected"
    """Local workers made no progress past their budget (``hung``: global rank -> reason); they are killed."""
    ETCD_OUTAGE = "etcd_outage"
    """The rendezvous answered again after failing for ``seconds`` (or, ``fatal``: true, the job ends for it)."""
    RESTORE_COMPLETED = "restore_completed"
    """The local workers restored their state through ``checkpoint.memory.restore`` (``restore_source``:
    memory_local, memory_peer or durable, ``mixed`` with ``restore_sources`` when ranks differ; ``restore_step``,
    ``restore_bytes`` summed over ``ranks``, ``restore_seconds`` of the slowest; ``restore_fallback``: why not from
    memory, when the tier was on and the state came from the durable tier); once per node and start."""
    STRAGGLER_DETECTED = "straggler_detected"
    """A local rank's step time over the last ``window`` steps exceeds ``factor`` times its local peers' median
    (``rank``, ``local_rank``, ``step_time`` and ``peers_step_time`` in s, ``ratio``, ``factor``, ``window``);
    once until it is cleared (``elastic.straggler``)."""
    STRAGGLER_CLEARED = "straggler_cleared"
    """A rank named by ``straggler_detected`` is back within the factor (``rank``, ``local_rank``)."""
    IN_PLACE_FALLBACK = "in_place_fallback"
    """Workers that run under ``elastic.inplace.run`` are restarted instead of re-formed in place (``why``: an
    ``InPlaceFallback`` value; ``detail``; ``ranks``: the local ranks that reported it); the restart's events
    follow."""


class FailureCause(str, enum.Enum):
    """Why the agent left the steady state (``cause`` field of ``failure_detected``)."""

    WORKER_FAILURE = "worker_failure"
    """A local worker exited non-zero (counts against ``--max-restarts`` unless a peer was lost too)."""
    MEMBERSHIP_CHANGE = "membership_change"
    """A peer lost its lease or a new node is waiting; never counts against ``--max-restarts``."""
    WORKER_FAILURE_WITH_PEER_LOSS = "worker_failure_with_peer_loss"
    """A local worker failed while the membership changed (e.g. a collective broke because a peer died)."""
    PEERS_LEFT_AT_EXIT = "peers_left_at_exit"
    """The local workers exited 0 but peers left instead of finishing too: not a success, re-form."""
    HANG = "hang"
    """A local worker made no progress past its hang budget and was killed (counts like a worker failure)."""


class RecoveryCause(str, enum.Enum):
    """Why a recovery happens: the ``recovery_cause`` field of every event from the one that starts a
    recovery up to its ``workers_started`` (null on the first start). Coarser than ``cause``, one word per
    kind of fault, for reports (MTTR per fault type)."""

    FAILURE = "failure"
    """A local worker exited non-zero on its own."""
    HANG = "hang"
    """A local worker stopped making progress."""
    PEER_LOST = "peer_lost"
    """A peer node went away unannounced (lease expired), whether or not a local worker crashed with it."""
    PLANNED_LEAVE = "planned_leave"
    """A node leaves after a notice (preemption), this one or a peer."""
    SCALE_UP = "scale_up"
    """A node joins the running job."""
    PEER_FAILURE = "peer_failure"
    """A peer node's worker failed and its agent restarted its workers (the peer stays): this node's workers
    re-formed in place around them."""


class InPlaceFallback(str, enum.Enum):
    """Why an in-place re-form fell back to restarting the workers (``why`` of ``in_place_fallback``)."""

    NEW_NODE = "new_node"
    """The re-formed round admitted a node that was not in the last one (its workers restore collectively)."""
    NOT_WAITING = "not_waiting"
    """After a peer loss, not every local worker waited in place within ``--stop-grace``."""
    WORKER_FAILED = "worker_failed"
    """A local worker failed on its own while the others waited in place."""
    TIMEOUT = "timeout"
    """A waiting worker got no new group within its ``InPlaceConfig.wait_timeout``."""
    REBUILD_FAILED = "rebuild_failed"
    """Releasing the old group's objects or joining the new group raised (e.g. a second fault meanwhile)."""
    STEPS_DIFFER = "steps_differ"
    """After a lost peer the survivors stood at different completed steps (a restart restores one for all)."""
    STEP_UNKNOWN = "step_unknown"
    """After a lost peer the training function told no completed step to check."""
    RESTORE_DIFFERS = "restore_differs"
    """After new workers joined, the ranks restored different steps or nothing (``Generation.restored``): the
    survivors' trained state and the new workers' would differ."""


class EventSink(Protocol):
    """Where the agent reports recovery stages (a JSON-lines file in production, a list in unit tests)."""

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        """Record one stage with its context fields (round, world size, ...)."""


# --- Error tree ------------------------------------------------------------------------------------------------


class SpotrunError(Exception):
    """Base of every error spotrun's launcher raises on purpose."""


class LaunchConfigError(SpotrunError, ValueError):
    """A command-line flag, environment fallback or rendezvous option is malformed or inconsistent.

    ``spotrun`` prints it as one line and exits 1, as torchrun exits on its error; ``elastic.cli.main(argv)``
    called from Python raises it, an instance of the type torchrun raises for the same input (a ValueError,
    or one of the subclasses below)."""


class LaunchConfigRangeError(LaunchConfigError, AssertionError):
    """A launch value out of its range (``--nnodes`` below 1 or MIN > MAX, ``--nproc-per-node`` below 1,
    ``--max-restarts`` below 0, ``--monitor-interval`` not above 0): torchrun raises an AssertionError."""


class LaunchConfigFormatError(LaunchConfigError, RuntimeError):
    """``--nnodes`` with more than one ``:``: torchrun raises a RuntimeError."""


class RendezvousUnavailableError(SpotrunError):
    """The rendezvous backend could not be created or reached (e.g. etcd is down or the endpoint is wrong)."""


class StandaloneEtcdError(SpotrunError):
    """``--standalone`` could not start its embedded etcd."""


class PlannedLeaveExit(SpotrunError):
    """This agent left the group for its notice and exits with ``--planned-leave-exit-code`` (not a failure)."""

    def __init__(self, exit_code: int, run_id: str | None = None) -> None:
        where = f"[run={run_id}] " if run_id else ""
        super().__init__(f"{where}left the group for a preemption notice; exiting with status {exit_code}")
        self.exit_code = exit_code


class PlannedStopVoteError(SpotrunError):
    """The workers' vote on the stop step failed (``elastic.preemption``): a peer rank did not reach it within
    the timeout, or left."""


class TorchInternalsError(SpotrunError, AssertionError):
    """A private torch hook or attribute the agent relies on is missing or changed (torch newer than verified)."""
