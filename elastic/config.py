"""Validated settings of spotrun's launcher and agent (what torchrun's flags do not already cover)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from elastic.api import (
    ENV_EVENTS_FILE,
    ENV_HANG_DETECTION,
    ENV_HANG_STARTUP_TIMEOUT,
    ENV_HANG_TIMEOUT,
    ENV_METRICS_PORT,
    ENV_PEER_LOSS_GRACE,
    ENV_PLANNED_LEAVE_EXIT_CODE,
    ENV_PREEMPT_GRACE,
    ENV_PREEMPT_NOTICE,
    ENV_PREEMPT_POLL_INTERVAL,
    ENV_PREEMPT_SIGNAL,
    ENV_RESIZE_TIMEOUT,
    ENV_STOP_GRACE,
    ENV_STRAGGLER_FACTOR,
    ENV_STRAGGLER_WINDOW,
    ENV_WARM_WORKERS,
    LaunchConfigError,
    LaunchConfigFormatError,
    LaunchConfigRangeError,
)
from elastic.hang import HangPolicy
from elastic.straggler import DEFAULT_FACTOR, DEFAULT_WINDOW, StragglerPolicy


@dataclass(kw_only=True, slots=True)
class AgentSettings:
    """Knobs of :class:`~elastic.agent.SpotrunAgent` that change torch's recovery behaviour."""

    stop_grace: float = 3.0
    """Seconds between SIGTERM and SIGKILL when workers are stopped for a restart. torch waits 30 s, but
    workers stuck in a broken collective never answer SIGTERM, so a long grace only delays recovery."""

    peer_loss_grace: float = 5.0
    """When a worker group fails with no restarts left, seconds to wait for the rendezvous to report a lost
    peer before giving up: a collective broken by a dead peer fails before the peer's lease expires. The
    launcher raises it to the lease TTL plus a margin (``launcher.peer_loss_window``); 0 turns it off."""

    events_file: str | None = None
    """JSON-lines file for recovery events. The ``spotrun`` command resolves ``None`` to
    ``elastic.events.default_events_path`` (``<log-dir>/events.jsonl``, else a per-run file under
    ``$XDG_STATE_HOME``); a library caller of ``launcher.launch`` that leaves it ``None`` gets
    ``<log root>/events.jsonl`` (torch's temporary log directory without a ``log_dir``)."""

    warm_workers: bool = True
    """Run Python script workers in processes forked from a forkserver that pre-imported torch, so a
    restart costs a fork instead of an interpreter start plus ``import torch`` (see ``elastic.workers``)."""

    preempt_grace: float = 30.0
    """Seconds between a SIGTERM to the agent (or a notice without its own deadline) and the node going
    away: Kubernetes' default terminationGracePeriodSeconds is 30."""

    preempt_signal: str | None = None
    """An extra notice signal, ``NAME[@SECONDS]`` (Slurm ``--signal=USR2@120``); None: SIGTERM only."""

    preempt_sources: tuple[str, ...] = ()
    """Metadata services polled for notices: ``aws``, ``aws-rebalance``, ``gcp``, ``azure``."""

    preempt_poll_interval: float = 2.0
    """Seconds between two polls of the metadata services."""

    resize_timeout: float = 60.0
    """When a node waits to join, seconds the running workers get to reach an agreed step and commit it
    before the group is restarted anyway (losing the steps since the last checkpoint, as before)."""

    planned_leave_exit_code: int = 0
    """Exit status of an agent that left the group for its notice with training unfinished (0-255). 0 says
    "done" to the platform; a Kubernetes Indexed Job then never recreates the index. Set e.g. 75 there with a
    podFailurePolicy rule ``action: Ignore`` on that code (deploy/kubernetes/job.yaml)."""

    hang: HangPolicy | None = None
    """Hang detection budgets (``--hang-timeout``, ``--hang-startup-timeout``); None turns it off
    (``--no-hang-detection``). The CLI turns it on by default (see ``elastic.hang``)."""

    metrics_port: int | None = None
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


_DEFAULTS = AgentSettings()
"""Every setting's default in one place (the field defaults above); the ``default_*`` functions below are
what the CLI uses when a flag is not given: the ``SPOTRUN_*`` variable if set, else this."""


def env_float(name: str, default: float) -> float:
    """Read a float from the environment, naming the variable when it does not parse."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise LaunchConfigError(f"environment variable {name}={raw!r} is not a number of seconds") from exc


def env_int(name: str, default: int) -> int:
    """Read an integer from the environment, naming the variable when it does not parse."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise LaunchConfigError(f"environment variable {name}={raw!r} is not an integer") from exc


def default_stop_grace() -> float:
    return env_float(ENV_STOP_GRACE, _DEFAULTS.stop_grace)


def default_peer_loss_grace() -> float:
    return env_float(ENV_PEER_LOSS_GRACE, _DEFAULTS.peer_loss_grace)


def default_preempt_grace() -> float:
    return env_float(ENV_PREEMPT_GRACE, _DEFAULTS.preempt_grace)


def default_preempt_poll_interval() -> float:
    return env_float(ENV_PREEMPT_POLL_INTERVAL, _DEFAULTS.preempt_poll_interval)


def default_resize_timeout() -> float:
    return env_float(ENV_RESIZE_TIMEOUT, _DEFAULTS.resize_timeout)


def default_planned_leave_exit_code() -> int:
    return env_int(ENV_PLANNED_LEAVE_EXIT_CODE, _DEFAULTS.planned_leave_exit_code)


def default_preempt_signal() -> str | None:
    return os.environ.get(ENV_PREEMPT_SIGNAL) or _DEFAULTS.preempt_signal


def default_preempt_notice() -> str:
    """The comma-separated metadata sources (``--preempt-notice``'s syntax); empty: none."""
    return os.environ.get(ENV_PREEMPT_NOTICE) or ",".join(_DEFAULTS.preempt_sources)


def env_flag(name: str, default: bool) -> bool:
    """Read a boolean (1/0, true/false, yes/no, on/off) from the environment, naming the variable when bad."""
    raw = os.environ.get(name, "1" if default else "0").strip().lower()
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise LaunchConfigError(f"environment variable {name}={raw!r} must be 1 or 0")


def default_warm_workers() -> bool:
    return env_flag(ENV_WARM_WORKERS, _DEFAULTS.warm_workers)


def hang_policy(*, enabled: bool | None, timeout: float | None, startup_timeout: float | None) -> HangPolicy | None:
    """The hang policy from flags, falling back to ``SPOTRUN_HANG_*``; None when detection is off."""
    if not (env_flag(ENV_HANG_DETECTION, True) if enabled is None else enabled):
        return None
    if timeout is None and os.environ.get(ENV_HANG_TIMEOUT):
        timeout = env_float(ENV_HANG_TIMEOUT, 0.0)
    startup = env_float(ENV_HANG_STARTUP_TIMEOUT, HangPolicy().startup_timeout) if startup_timeout is None \
        else startup_timeout
    return HangPolicy(timeout=timeout, startup_timeout=startup)


def default_metrics_port() -> int | None:
    """``SPOTRUN_METRICS_PORT`` when set, else None (no exporter)."""
    raw = os.environ.get(ENV_METRICS_PORT, "").strip()
    return env_int(ENV_METRICS_PORT, 0) if raw else _DEFAULTS.metrics_port


def default_straggler_factor() -> float:
    return env_float(ENV_STRAGGLER_FACTOR, DEFAULT_FACTOR)


def default_straggler_window() -> int:
    return env_int(ENV_STRAGGLER_WINDOW, DEFAULT_WINDOW)


def straggler_policy(*, factor: float | None, window: int | None) -> StragglerPolicy | None:
    """The straggler policy from flags, falling back to ``SPOTRUN_STRAGGLER_*``; None when the factor is 0."""
    factor = default_straggler_factor() if factor is None else factor
    window = default_straggler_window() if window is None else window
    if factor == 0:
        return None
    return StragglerPolicy(factor=factor, window=window)


def default_events_file() -> str | None:
    return os.environ.get(ENV_EVENTS_FILE) or _DEFAULTS.events_file


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
