"""Contracts of the fault toolkit: fault kinds, the schedule dataclasses, the error tree."""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass, field
from typing import Any

STORAGE_CONTROL_ENV = "SPOTRUN_CHAOS_STORAGE"
"""Path of the JSON control file the ``chaos://`` filesystem reads its active storage faults from."""


class FaultKind(str, enum.Enum):
    """What one fault does; the value is its name in a schedule file and in the journal."""

    KILL_WORKER = "kill_worker"
    """SIGKILL one worker (a crash). ``hold_connections: true``: its sockets are held open (``duration_s``,
    default 30 s), so its peers' collectives hang as NCCL's do on a crashed peer instead of failing at once."""
    STOP_WORKER = "stop_worker"
    """SIGSTOP one worker (a hang: deadlock, stuck collective); SIGCONT after ``duration_s`` if given."""
    KILL_AGENT = "kill_agent"
    """SIGKILL an agent and its workers (a node lost)."""
    TERM_AGENT = "term_agent"
    """SIGTERM an agent (a preemption notice)."""
    STOP_AGENT = "stop_agent"
    """SIGSTOP an agent with its workers and keeper (a paused VM: a silent loss, seen when its lease lapses);
    SIGCONT after ``duration_s`` if given."""
    KILL_KEEPER = "kill_keeper"
    """SIGKILL an agent's memory tier keeper process (the agent, workers and snapshots live on); ``signal``:
    ``"TERM"`` instead makes the keeper leave as if its agent had died, removing the node's snapshots (the
    keeper's own death signal: a SIGTERM, a notice, it ignores)."""
    RESTART_ETCD = "restart_etcd"
    """SIGKILL one etcd member, start it again with the same command line after ``duration_s``."""
    KILL_ETCD_LEADER = "kill_etcd_leader"
    """SIGKILL the current etcd leader (found through the status API), restarted like ``restart_etcd``."""
    PARTITION = "partition"
    """Cut one network namespace off (its links down) for ``duration_s``; needs root, else skipped."""
    STORAGE_ERROR = "storage_error"
    """Storage operations fail with EIO (``rate``: fraction of operations, ``ops``: read/write/all;
    ``errno``: another error name such as ``EACCES``; ``path``: only paths containing this text)."""
    STORAGE_LATENCY = "storage_latency"
    """Storage operations take ``seconds`` longer."""
    DISK_FULL = "disk_full"
    """Storage writes fail with ENOSPC."""

    @property
    def is_storage(self) -> bool:
        return self in (FaultKind.STORAGE_ERROR, FaultKind.STORAGE_LATENCY, FaultKind.DISK_FULL)


# --- Error tree ------------------------------------------------------------------------------------------------


class ChaosError(Exception):
    """Base of every fault-toolkit error."""


class ChaosScheduleError(ChaosError, ValueError):
    """A schedule (file or dataclass) is invalid; the message says which fault and how to fix it."""


class ChaosTargetError(ChaosError):
    """The target of a fault cannot be found (no such worker, agent gone, no etcd leader)."""


class FaultSkipped(ChaosError):
    """A fault cannot be injected here (e.g. no root for network namespaces); journaled with its reason."""


# --- Schedule --------------------------------------------------------------------------------------------------

_TARGET_PREFIXES = {
    FaultKind.KILL_WORKER: ("worker",),
    FaultKind.STOP_WORKER: ("worker",),
    FaultKind.KILL_AGENT: ("agent",),
    FaultKind.TERM_AGENT: ("agent",),
    FaultKind.STOP_AGENT: ("agent",),
    FaultKind.KILL_KEEPER: ("agent",),
    FaultKind.RESTART_ETCD: ("etcd",),
    FaultKind.KILL_ETCD_LEADER: ("etcd",),
    FaultKind.PARTITION: ("netns",),
    FaultKind.STORAGE_ERROR: ("storage",),
    FaultKind.STORAGE_LATENCY: ("storage",),
    FaultKind.DISK_FULL: ("storage",),
}


@dataclass(kw_only=True, slots=True, frozen=True)
class Fault:
    """One fault of a schedule: a kind, a target, and a trigger (a time or a training step)."""

    kind: FaultKind
    """What to inject (see :class:`FaultKind`)."""
    target: str = ""
    """``worker:N`` (the worker of global rank N; ``worker:any`` seeded pick), ``agent:N`` /
    ``agent:any``, ``etcd:N`` / ``etcd:any`` / ``etcd:leader``, ``netns:NAME``, ``storage``. Empty: the
    kind's default (``any`` of its prefix; ``storage``)."""
    at_s: float | None = None
    """Seconds after the injector started; exactly one of ``at_s`` and ``at_step``."""
    at_step: int | None = None
    """Inject once the job's progress file reports this step (needs ``--progress-file``)."""
    after: int | None = None
    """Inject ``after_s`` seconds after the schedule's fault number ``after`` (an earlier one) fired: a fault
    inside another's recovery window (overlapping faults)."""
    after_s: float = 0.0
    """Delay of an ``after`` trigger, seconds."""
    duration_s: float | None = None
    """How long the fault lasts (stop, partition, etcd down, storage faults); None: permanent for storage
    faults and partitions, the default restart delay (1 s) for etcd members, forever for SIGSTOP (a worker's or
    a whole node's)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Kind-specific: ``rate`` (0..1], ``ops`` (``read``/``write``/``all``), ``errno`` (an errno name,
    default ``EIO``) and ``path`` (only paths containing it, e.g. ``step-000000020``) for storage_error,
    ``seconds`` for storage_latency, ``signal`` for kill_keeper, ``hold_connections`` for kill_worker."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            try:
                object.__setattr__(self, "kind", FaultKind(self.kind))
            except ValueError:
                raise ChaosScheduleError(
                    f"unknown fault kind {self.kind!r}; use one of {', '.join(k.value for k in FaultKind)}"
                ) from None
        if sum(t is not None for t in (self.at_s, self.at_step, self.after)) != 1:
            raise ChaosScheduleError(f"{self.kind.value}: give exactly one trigger, at_s, at_step or after")
        if self.after is not None and (isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 0):
            raise ChaosScheduleError(f"{self.kind.value}: after must be the index of an earlier fault, got {self.after!r}")
        if not isinstance(self.after_s, (int, float)) or isinstance(self.after_s, bool) or not 0 <= self.after_s < 1e6:
            raise ChaosScheduleError(f"{self.kind.value}: after_s must be a number of seconds >= 0, got {self.after_s!r}")
        if self.after_s and self.after is None:
            raise ChaosScheduleError(f"{self.kind.value}: after_s needs after (the fault it follows)")
        if self.at_s is not None and self.at_s < 0:
            raise ChaosScheduleError(f"{self.kind.value}: at_s must be >= 0, got {self.at_s}")
        if self.at_step is not None and self.at_step < 0:
            raise ChaosScheduleError(f"{self.kind.value}: at_step must be >= 0, got {self.at_step}")
        if self.duration_s is not None and self.duration_s < 0:
            raise ChaosScheduleError(f"{self.kind.value}: duration_s must be >= 0, got {self.duration_s}")
        prefixes = _TARGET_PREFIXES[self.kind]
        target = self.target or (prefixes[0] if prefixes[0] == "storage" else f"{prefixes[0]}:any")
        if target.split(":", 1)[0] not in prefixes:
            raise ChaosScheduleError(
                f"{self.kind.value}: target {self.target!r} does not fit; use {prefixes[0]}:... "
                f"(e.g. {prefixes[0]}:0 or {prefixes[0]}:any)"
            )
        if self.kind is FaultKind.PARTITION and target == "netns:any":
            raise ChaosScheduleError("partition: name the network namespace, e.g. target netns:node-1")
        object.__setattr__(self, "target", target)
        self._check_params()

    def _check_params(self) -> None:
        allowed = {FaultKind.STORAGE_ERROR: {"rate", "ops", "errno", "path"},
                   FaultKind.STORAGE_LATENCY: {"seconds"},
                   FaultKind.KILL_KEEPER: {"signal"},
                   FaultKind.KILL_WORKER: {"hold_connections"}}.get(self.kind, set())
        unknown = set(self.params) - allowed
        if unknown:
            raise ChaosScheduleError(
                f"{self.kind.value}: unknown params {sorted(unknown)}; accepted: {sorted(allowed) or 'none'}"
            )
        if not isinstance(self.params.get("hold_connections", False), bool):
            raise ChaosScheduleError(f"{self.kind.value}: hold_connections must be true or false, got "
                                     f"{self.params['hold_connections']!r}")
        if self.params.get("signal", "KILL") not in ("KILL", "TERM"):
            raise ChaosScheduleError(f"{self.kind.value}: signal must be KILL or TERM, got {self.params['signal']!r}")
        rate = self.params.get("rate", 1.0)
        if not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ChaosScheduleError(f"{self.kind.value}: rate must be in (0, 1], got {rate!r}")
        if self.params.get("ops", "all") not in ("read", "write", "all"):
            raise ChaosScheduleError(f"{self.kind.value}: ops must be read, write or all, got {self.params['ops']!r}")
        code = self.params.get("errno", "EIO")
        if not (isinstance(code, str) and code.startswith("E") and isinstance(getattr(errno, code, None), int)):
            raise ChaosScheduleError(f"{self.kind.value}: errno must be an errno name such as EIO or EACCES, got {code!r}")
        path = self.params.get("path", "x")
        if not isinstance(path, str) or not path:
            raise ChaosScheduleError(f"{self.kind.value}: path must be a non-empty string, got {path!r}")
        seconds = self.params.get("seconds", 0.0)
        if not isinstance(seconds, (int, float)) or seconds < 0:
            raise ChaosScheduleError(f"{self.kind.value}: seconds must be >= 0, got {seconds!r}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "target": self.target}
        for name in ("at_s", "at_step", "after", "duration_s"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.after is not None:
            out["after_s"] = self.after_s
        if self.params:
            out["params"] = dict(self.params)
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class Schedule:
    """A seeded list of faults. The seed makes every ``any`` target pick (and storage error draws) repeatable."""

    seed: int = 0
    """Seed of every random choice the injector makes."""
    faults: tuple[Fault, ...] = ()
    """The faults, in any order (the injector fires each once, when its trigger is reached)."""

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ChaosScheduleError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "faults", tuple(self.faults))
        for i, fault in enumerate(self.faults):
            if fault.after is not None and fault.after >= i:
                raise ChaosScheduleError(
                    f"faults[{i}]: after={fault.after} must name an earlier fault of the schedule (0..{i - 1})"
                )

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "faults": [f.to_json() for f in self.faults]}


def restarts_needed(faults: tuple[Fault, ...] | list[Fault], *, hang_timeout: float | None) -> int:
    """How many restarts charged against ``--max-restarts`` a job needs to survive ``faults``.

    A ``kill_worker`` costs one. A ``stop_worker`` costs one when hang detection finds it (``hang_timeout``:
    the seconds it takes, None when detection is off): stopped for good, or for longer than that. Node losses
    and notices (``kill_agent``, ``term_agent``), etcd and storage faults are not charged."""
    return sum(1 for fault in faults if _costs_a_restart(fault, hang_timeout))


def _costs_a_restart(fault: Fault, hang_timeout: float | None) -> bool:
    if fault.kind is FaultKind.KILL_WORKER:
        return True
    return fault.kind is FaultKind.STOP_WORKER and hang_timeout is not None and (
        fault.duration_s is None or fault.duration_s > hang_timeout)
