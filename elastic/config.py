"""Validated settings of spotrun's launcher and agent (what torchrun's flags do not already cover).

The defaults, flags and ``SPOTRUN_*`` variables are ``elastic.options``'; :func:`resolve` reads a flag's value,
else its variable, else its default."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TypeVar, cast

from elastic import options as opt
from elastic.api import LaunchConfigError, LaunchConfigFormatError, LaunchConfigRangeError
from elastic.hang import HangPolicy
from elastic.options import Option
from elastic.straggler import StragglerPolicy

T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class AgentSettings:
    """Knobs of :class:`~elastic.agent.SpotrunAgent` that change torch's recovery behaviour."""

    stop_grace: float = opt.STOP_GRACE.default
    """Seconds between SIGTERM and SIGKILL when workers are stopped for a restart. torch waits 30 s, but
    workers stuck in a broken collective never answer SIGTERM, so a long grace only delays recovery."""

    peer_loss_grace: float = opt.PEER_LOSS_GRACE.default
    """When a worker group fails with no restarts left, seconds to wait for the rendezvous to report a lost
    peer before giving up: a collective broken by a dead peer fails before the peer's lease expires. The
    launcher raises it to the lease TTL plus a margin (``launcher.peer_loss_window``); 0 turns it off."""

    events_file: str | None = opt.EVENTS_FILE.default
    """JSON-lines file for recovery events. The ``spotrun`` command resolves ``None`` to
    ``elastic.events.default_events_path`` (``<log-dir>/events.jsonl``, else a per-run file under
    ``$XDG_STATE_HOME``); a library caller of ``launcher.launch`` that leaves it ``None`` gets
    ``<log root>/events.jsonl`` (torch's temporary log directory without a ``log_dir``)."""

    warm_workers: bool = opt.WARM_WORKERS.default
    """Run Python script workers in processes forked from a forkserver that pre-imported torch, so a
    restart costs a fork instead of an interpreter start plus ``import torch`` (see ``elastic.workers``)."""

    preempt_grace: float = opt.PREEMPT_GRACE.default
    """Seconds between a SIGTERM to the agent (or a notice without its own deadline) and the node going
    away: Kubernetes' default terminationGracePeriodSeconds is 30."""

    preempt_signal: str | None = opt.PREEMPT_SIGNAL.default
    """An extra notice signal, ``NAME[@SECONDS]`` (Slurm ``--signal=USR2@120``); None: SIGTERM only."""

    preempt_sources: tuple[str, ...] = ()
    """Metadata services polled for notices: ``aws``, ``aws-rebalance``, ``gcp``, ``azure``."""

    preempt_poll_interval: float = opt.PREEMPT_POLL_INTERVAL.default
    """Seconds between two polls of the metadata services."""

    resize_timeout: float = opt.RESIZE_TIMEOUT.default
    """When a node waits to join, seconds the running workers get to reach an agreed step and commit it
    before the group is restarted anyway (losing the steps since the last checkpoint, as before)."""

    planned_leave_exit_code: int = opt.PLANNED_LEAVE_EXIT_CODE.default
    """Exit status of an agent that left the group for its notice with training unfinished (0-255). 0 says
    "done" to the platform; a Kubernetes Indexed Job then never recreates the index. Set e.g. 75 there with a
    podFailurePolicy rule ``action: Ignore`` on that code (deploy/kubernetes/job.yaml)."""

    hang: HangPolicy | None = None
    """Hang detection budgets (``--hang-timeout``, ``--hang-startup-timeout``); None turns it off
    (``--no-hang-detection``). The CLI turns it on by default (see ``elastic.hang``)."""

    metrics_port: int | None = opt.METRICS_PORT.default
    """TCP port of the Prometheus exporter (``elastic.metrics``); None: no exporter. 0 picks a free port."""

    straggler: StragglerPolicy | None = None
    """Straggler detection (``--straggler-factor``, ``--straggler-window``; ``elastic.straggler``); None turns it
    off. The CLI turns it on by default; it reads the hang detection's progress samples, so it needs that on."""

    def __post_init__(self) -> None:
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise LaunchConfigError(f"--metrics-port must be a TCP port from 0 to 65535, got {port!r}; "
                                    f"e.g. --metrics-port 9400 (or leave it out: no exporter)")
        if self.straggler is not None and not isinstance(self.straggler, StragglerPolicy):
            raise LaunchConfigError(f"straggler must be a StragglerPolicy or None, got {type(self.straggler).__name__}")
        if self.hang is not None and not isinstance(self.hang, HangPolicy):
            raise LaunchConfigError(f"hang must be a HangPolicy or None, got {type(self.hang).__name__}")
        for name in ("preempt_grace", "resize_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise LaunchConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}; "
                                        f"pass e.g. --{name.replace('_', '-')} 30")
        if not (math.isfinite(self.preempt_poll_interval) and self.preempt_poll_interval > 0):
            raise LaunchConfigError(f"--preempt-poll-interval must be > 0 seconds, got {self.preempt_poll_interval!r}")
        from elastic.notice import parse_signal_spec, parse_sources

        if self.preempt_signal is not None:
            parse_signal_spec(self.preempt_signal, self.preempt_grace)
        parse_sources(",".join(self.preempt_sources))
        for name in ("stop_grace", "peer_loss_grace"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise LaunchConfigError(
                    f"{name} must be a finite number of seconds >= 0, got {value!r}; "
                    f"pass e.g. --{name.replace('_', '-')} 3"
                )
        code = self.planned_leave_exit_code
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
            raise LaunchConfigError(f"--planned-leave-exit-code must be an integer from 0 to 255 (an exit status), "
                                    f"got {code!r}; e.g. 75 with a Kubernetes podFailurePolicy Ignore rule")
        if self.events_file is not None and not self.events_file.strip():
            raise LaunchConfigError("--events-file must be a path, got an empty string")


def from_env(option: Option[T]) -> T:
    """``option``'s ``SPOTRUN_*`` variable when set (an empty one is unset; a blank one too for an integer), else
    its default; a malformed value is a LaunchConfigError naming the variable."""
    name = option.env
    raw = os.environ.get(name)
    if option.is_switch:
        word = (raw if raw is not None else "1" if option.default else "0").strip().lower()
        if word in opt.SWITCH_ON:
            return cast(T, True)
        if word in opt.SWITCH_OFF:
            return cast(T, False)
        raise LaunchConfigError(f"environment variable {name}={word!r} must be 1 or 0")
    if raw is None or (raw.strip() if option.kind is int else raw) == "":
        return option.default
    if option.kind is float:
        try:
            return cast(T, float(raw))
        except ValueError as exc:
            raise LaunchConfigError(f"environment variable {name}={raw!r} is not a number of seconds") from exc
    if option.kind is int:
        try:
            return cast(T, int(raw))
        except ValueError as exc:
            raise LaunchConfigError(f"environment variable {name}={raw!r} is not an integer") from exc
    return cast(T, raw)


def resolve(option: Option[T], given: T | None) -> T:
    """The flag's value when given (not None), else :func:`from_env`."""
    return from_env(option) if given is None else given


def hang_policy(*, enabled: bool | None, timeout: float | None, startup_timeout: float | None) -> HangPolicy | None:
    """The hang policy from flags, falling back to ``SPOTRUN_HANG_*``; None when detection is off."""
    if not resolve(opt.HANG_DETECTION, enabled):
        return None
    return HangPolicy(timeout=resolve(opt.HANG_TIMEOUT, timeout),
                      startup_timeout=resolve(opt.HANG_STARTUP_TIMEOUT, startup_timeout))


def straggler_policy(*, factor: float | None, window: int | None) -> StragglerPolicy | None:
    """The straggler policy from flags, falling back to ``SPOTRUN_STRAGGLER_*``; None when the factor is 0."""
    factor = resolve(opt.STRAGGLER_FACTOR, factor)
    window = resolve(opt.STRAGGLER_WINDOW, window)
    if factor == 0:
        return None
    return StragglerPolicy(factor=factor, window=window)


_NNODES_FORMS = "use N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4"


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse ``--nnodes`` (``N`` or ``MIN:MAX``) into ``(min, max)`` with an error a user understands (of the
    type torchrun raises for the same text: ``elastic.api.LaunchConfigError``)."""
    parts = text.strip().split(":")
    if len(parts) > 2:
        raise LaunchConfigFormatError(f"--nnodes={text!r} is malformed; {_NNODES_FORMS}")
    if not all(p.strip() for p in parts):
        raise LaunchConfigError(f"--nnodes={text!r} is malformed; {_NNODES_FORMS}")
    try:
        numbers = [int(p) for p in parts]
    except ValueError as exc:
        raise LaunchConfigError(
            f"--nnodes={text!r} is malformed: {text!r} must be integers, N or MIN:MAX (e.g. 1:4)"
        ) from exc
    min_nodes, max_nodes = numbers[0], numbers[-1]
    if min_nodes < 1:
        raise LaunchConfigRangeError(f"--nnodes={text!r}: the minimum number of nodes must be >= 1")
    if min_nodes > max_nodes:
        raise LaunchConfigRangeError(
            f"--nnodes={text!r}: minimum {min_nodes} is greater than maximum {max_nodes}; use MIN:MAX with MIN <= MAX"
        )
    return min_nodes, max_nodes


NPROC_DEVICE_NAMES = frozenset({"auto", "cpu", "gpu", "xpu"})
"""``--nproc-per-node`` values torch counts itself (it also accepts a registered privateuse1 backend name)."""


def check_launch_values(*, nnodes: str, nproc_per_node: str, max_restarts: int, monitor_interval: float,
                        rdzv_conf: str) -> bool:
    """Reject what torchrun rejects only once it built its launch config (or deep in its agent), with one line a
    user understands and the exception type torchrun raises. Torch-free: the command line is checked before
    ``import torch`` (``elastic.boot``) and again by the launcher. Returns whether ``nproc_per_node`` was judged:
    False for a name that is neither a number nor one of ``NPROC_DEVICE_NAMES`` (a privateuse1 backend's name
    needs torch to tell)."""
    parse_nnodes(nnodes)
    parse_rdzv_conf(rdzv_conf)
    if max_restarts < 0:
        raise LaunchConfigRangeError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not monitor_interval > 0:
        raise LaunchConfigRangeError(f"--monitor-interval must be > 0 seconds, got {monitor_interval}")
    if nproc_per_node in NPROC_DEVICE_NAMES:
        return True
    try:
        nproc = int(nproc_per_node)
    except ValueError:
        return False
    if nproc < 1:
        raise LaunchConfigRangeError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    return True


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """Parse ``--rdzv-conf k1=v1,k2=v2`` and reject entries without ``=`` (torch raises a bare ValueError)."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise LaunchConfigError(f"--rdzv-conf entry {item!r} is malformed; use key=value pairs separated by commas")
        conf[key.strip()] = value.strip()
    return conf
