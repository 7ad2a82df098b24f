"""How a feature plugs into :class:`~elastic.agent.SpotrunAgent`: the hooks it implements and what it may ask.

The agent core runs torch's overrides and the monitor loop; each feature (planned changes, the membership
view, hang detection, restore reports, vitals) is an :class:`AgentFeature` that the agent calls at fixed
points, in the order it lists them. A feature acts on the agent only through :class:`AgentHost` and the
:data:`Verdict` it returns, so a test drives a feature with a fake host and plain events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.multiprocessing import PContext

from elastic.api import RecoveryCause, RecoveryEvent

# --- events the agent passes to its features ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkersStarting:
    """A worker group is about to start (after its rendezvous)."""

    group_rank: int
    local_world_size: int


@dataclass(frozen=True, slots=True)
class WorkersStarted:
    """The local workers run: local rank -> pid and -> global rank; ``in_place``: re-formed, not restarted."""

    pids: Mapping[int, int]
    global_ranks: Mapping[int, int]
    in_place: bool = False


@dataclass(frozen=True, slots=True)
class Tick:
    """One monitor tick: what torch's monitor (and the features' ``on_monitor``) saw of the local workers."""

    result: RunResult


@dataclass(frozen=True, slots=True)
class WorkersStopping:
    """The agent is about to stop its local workers (a restart, a leave, the end of the run)."""


@dataclass(frozen=True, slots=True)
class WorkersStopped:
    """The local workers are stopped: none runs until the next start."""


# --- verdicts a feature returns from on_tick ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proceed:
    """Nothing for this feature to do: the next feature, then the agent's own handling of the tick."""


@dataclass(frozen=True, slots=True)
class NextTick:
    """The feature acted on this tick (posted a stop, re-formed the group): go on with the next tick."""


@dataclass(frozen=True, slots=True)
class EndRun:
    """The run ends here with ``result`` (this node left the group)."""

    result: RunResult


Verdict = Proceed | NextTick | EndRun
PROCEED = Proceed()
NEXT_TICK = NextTick()


# --- what a feature may ask of the agent --------------------------------------------------------------------


class AgentHost(Protocol):
    """The agent as its features see it."""

    @property
    def worker_group(self) -> WorkerGroup:
        """The local worker group (torch's; ``spec``, ranks, ``state``)."""
        ...

    @property
    def pcontext(self) -> PContext | None:
        """The running workers' process context (None between rounds)."""
        ...

    def ctx(self) -> str:
        """The log prefix of this agent: role, round, group rank."""
        ...

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        """Record a recovery event with the agent's context fields."""
        ...

    def begin_recovery(self, cause: RecoveryCause) -> None:
        """Label the recovery starting now (the first cause wins until workers start again)."""
        ...

    def monitor(self) -> RunResult:
        """Look at the local workers once (torch's monitor with the features' ``on_monitor``)."""
        ...

    def stop_workers(self) -> None:
        """Stop the local workers with the short grace (``--stop-grace``)."""
        ...

    def restart_workers(self) -> None:
        """Stop the workers, run a rendezvous round and start new ones (not charged)."""
        ...

    def wait_for_workers(self, timeout: float, done: Callable[[], bool], poll: float) -> None:
        """Up to ``timeout`` s, returning as soon as a local worker returns or exits, or ``done()`` (asked
        every ``poll`` s)."""
        ...

    def reform_in_place(self, assign: Callable[[WorkerGroup, int], None]) -> None:
        """A rendezvous round around the running workers: ``assign(group, restart_count)`` tells each its
        place in the new group instead of replacing it (a round that admitted a new node restarts them)."""
        ...


# --- the hooks ------------------------------------------------------------------------------------------------


class AgentFeature:
    """A feature of the agent; every hook does nothing unless overridden.

    Called on the agent's main thread, in the order the agent lists its features.
    """

    def on_workers_starting(self, event: WorkersStarting) -> None:
        """Before torch starts the local workers."""

    def on_workers_started(self, event: WorkersStarted) -> None:
        """After the local workers started (or re-formed in place)."""

    def on_monitor(self, result: RunResult) -> RunResult | None:
        """Judge the workers after torch's look at them: a different result (a failed group) or None."""
        return None

    def on_tick(self, tick: Tick) -> Verdict:
        """Once per monitor tick, before the agent's own handling of the group's state."""
        return PROCEED

    def on_workers_stopping(self, event: WorkersStopping) -> None:
        """Before the agent stops its local workers."""

    def on_workers_stopped(self, event: WorkersStopped) -> None:
        """After the agent stopped its local workers."""

    def close(self) -> None:
        """Release what the feature keeps outside the process (at agent exit)."""
