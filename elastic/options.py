"""spotrun's own launcher options, each declared once.

Everything else reads this table: the argparse flags (``elastic.cli.build_parser``), their ``SPOTRUN_*``
environment fallbacks (``elastic.config.resolve``), the settings' defaults (``AgentSettings``, ``HangPolicy``,
``StragglerPolicy``), the boot pre-parser's option sets (``elastic.boot``) and the generated reference
(``docs/gen_reference.py``). torchrun's flags are not here: spotrun's parser is torch's, extended with these.
Standard library only, importing nothing of ``elastic``: boot reads it before ``import torch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

T = TypeVar("T")

SWITCH_ON: Final = frozenset({"1", "true", "yes", "on"})
"""Values of a switch's environment variable that turn it on (case and surrounding blanks ignored)."""
SWITCH_OFF: Final = frozenset({"0", "false", "no", "off"})
"""Values of a switch's environment variable that turn it off."""


@dataclass(frozen=True, slots=True)
class Option(Generic[T]):
    """One spotrun flag: its spellings, value type, default, environment variable and help."""

    flag: str
    """The dash spelling (``--stop-grace``); the underscore one (``--stop_grace``) is accepted too, as torchrun's."""
    kind: type
    """``float``, ``int`` or ``str`` (the argparse ``type``), or ``bool`` for a ``--[no-]`` switch."""
    default: T
    """The value when neither the flag nor the environment variable is given."""
    env: str
    """The ``SPOTRUN_*`` variable read when the flag is not given."""
    help: str
    """What the option does, one sentence without the trailing environment and default."""
    default_text: str | None = None
    """The default in words, when no value says it (an adaptive budget, a path rule, off)."""
    note: str | None = None
    """Said after the default in the help (a range, what 0 means, how it combines with other flags)."""

    @property
    def dest(self) -> str:
        """The argparse destination (``stop_grace``)."""
        return self.flag[2:].replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return self.kind is bool

    @property
    def spellings(self) -> tuple[str, str]:
        """The positive spellings: dash and underscore."""
        return self.flag, "--" + self.dest

    @property
    def negations(self) -> tuple[str, ...]:
        """A switch's ``--no-`` spellings (argparse's ``BooleanOptionalAction``); none for a valued option."""
        return tuple("--no-" + s[2:] for s in self.spellings) if self.is_switch else ()

    @property
    def option_strings(self) -> tuple[str, ...]:
        """Every spelling, in argparse's order."""
        if not self.is_switch:
            return self.spellings
        return tuple(s for pair in zip(self.spellings, self.negations, strict=True) for s in pair)

    @property
    def shown_default(self) -> str | None:
        """The default as the help and the reference say it; None when there is none to say."""
        if self.default_text is not None:
            return self.default_text
        if self.is_switch:
            return "on" if self.default else "off"
        if self.default is None or self.default == "":
            return None
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)

    @property
    def help_text(self) -> str:
        """The ``--help`` line: what it does, its environment variable, its default, the note."""
        default = f", default {self.shown_default}" if self.shown_default is not None else ""
        note = f"; {self.note}" if self.note else ""
        return f"{self.help} (env {self.env}{default}{note})."

    @property
    def env_help(self) -> str:
        """What the environment variable does, for the environment reference."""
        if self.is_switch:
            return f"{self.help} (1 or 0, default {1 if self.default else 0})."
        said = [f"default {self.shown_default}"] if self.shown_default is not None else []
        said += [self.note] if self.note else []
        return f"{self.help} ({'; '.join(said)})." if said else f"{self.help}."


STOP_GRACE: Final[Option[float]] = Option(
    "--stop-grace", float, 3.0, "SPOTRUN_STOP_GRACE",
    "Seconds between SIGTERM and SIGKILL when stopping workers for a restart",
    note="torch waits 30 s, but workers stuck in a broken collective never answer SIGTERM")
PEER_LOSS_GRACE: Final[Option[float]] = Option(
    "--peer-loss-grace", float, 5.0, "SPOTRUN_PEER_LOSS_GRACE",
    "With no restarts left, seconds a failed worker group waits for a lost-peer signal before failing the job",
    note="with etcd-v3 at least the lease_ttl + 2 s, so a peer that died with the failure is seen; 0: no wait")
WARM_WORKERS: Final[Option[bool]] = Option(
    "--warm-workers", bool, True, "SPOTRUN_WARM_WORKERS",
    "Fork Python script workers from a forkserver that pre-imported torch, so restarts skip the interpreter start",
    note="--no-warm-workers: plain `python -u script` subprocesses like torchrun; off too when another "
         "--start-method is asked")
PREEMPT_GRACE: Final[Option[float]] = Option(
    "--preempt-grace", float, 30.0, "SPOTRUN_PREEMPT_GRACE",
    "Seconds a SIGTERM to the agent leaves before the node is gone: workers using elastic.preemption.Preemption "
    "commit an agreed step within it and the agent exits 0")
PREEMPT_SIGNAL: Final[Option[str | None]] = Option(
    "--preempt-signal", str, None, "SPOTRUN_PREEMPT_SIGNAL",
    "An extra notice signal NAME[@SECONDS], like Slurm's --signal=USR2@120")
PREEMPT_NOTICE: Final[Option[str]] = Option(
    "--preempt-notice", str, "", "SPOTRUN_PREEMPT_NOTICE",
    "Poll these metadata services for preemption notices, comma-separated: aws, aws-rebalance, gcp, azure")
PREEMPT_POLL_INTERVAL: Final[Option[float]] = Option(
    "--preempt-poll-interval", float, 2.0, "SPOTRUN_PREEMPT_POLL_INTERVAL",
    "Seconds between metadata polls")
RESIZE_TIMEOUT: Final[Option[float]] = Option(
    "--resize-timeout", float, 60.0, "SPOTRUN_RESIZE_TIMEOUT",
    "When a node joins, seconds the workers get to commit an agreed step before the group restarts anyway")
PLANNED_LEAVE_EXIT_CODE: Final[Option[int]] = Option(
    "--planned-leave-exit-code", int, 0, "SPOTRUN_PLANNED_LEAVE_EXIT_CODE",
    "Exit status (0-255) of an agent that left the group for its preemption notice with training unfinished",
    note="on a Kubernetes Indexed Job use e.g. 75 with a podFailurePolicy Ignore rule, so the index is recreated")
HANG_TIMEOUT: Final[Option[float | None]] = Option(
    "--hang-timeout", float, None, "SPOTRUN_HANG_TIMEOUT",
    "Seconds without progress after start-up before a worker counts as hung and the group restarts",
    default_text="adaptive: 10x the slowest recent step, at least 60 s")
HANG_STARTUP_TIMEOUT: Final[Option[float]] = Option(
    "--hang-startup-timeout", float, 600.0, "SPOTRUN_HANG_STARTUP_TIMEOUT",
    "Seconds without progress allowed during start-up, first steps and checkpoint load")
HANG_DETECTION: Final[Option[bool]] = Option(
    "--hang-detection", bool, True, "SPOTRUN_HANG_DETECTION",
    "Watch every worker's progress and restart the group when one hangs")
EVENTS_FILE: Final[Option[str | None]] = Option(
    "--events-file", str, None, "SPOTRUN_EVENTS_FILE",
    "JSON-lines recovery event log",
    default_text="<log-dir>/events.jsonl, else $XDG_STATE_HOME/spotrun/runs/<run id>/<host>/events.jsonl",
    note="printed at start")
METRICS_PORT: Final[Option[int | None]] = Option(
    "--metrics-port", int, None, "SPOTRUN_METRICS_PORT",
    "Serve Prometheus metrics (restarts, recovery stages, notices, ...) on this TCP port at /metrics",
    default_text="off", note="0 picks a free port")
STRAGGLER_FACTOR: Final[Option[float]] = Option(
    "--straggler-factor", float, 1.5, "SPOTRUN_STRAGGLER_FACTOR",
    "Name a local rank a straggler (straggler_detected event, spotrun_stragglers metric) when its step time "
    "exceeds this many times its local peers' median",
    note="0: off; needs hang detection")
STRAGGLER_WINDOW: Final[Option[int]] = Option(
    "--straggler-window", int, 20, "SPOTRUN_STRAGGLER_WINDOW",
    "Steps a rank's step time is averaged over for straggler detection")

OPTIONS: Final[tuple[Option[Any], ...]] = (
    STOP_GRACE, PEER_LOSS_GRACE, WARM_WORKERS, PREEMPT_GRACE, PREEMPT_SIGNAL, PREEMPT_NOTICE, PREEMPT_POLL_INTERVAL,
    RESIZE_TIMEOUT, PLANNED_LEAVE_EXIT_CODE, HANG_TIMEOUT, HANG_STARTUP_TIMEOUT, HANG_DETECTION, EVENTS_FILE,
    METRICS_PORT, STRAGGLER_FACTOR, STRAGGLER_WINDOW,
)
"""Every spotrun option, in ``--help`` order."""


def switch_spellings() -> frozenset[str]:
    """Every spelling of the options that take no value (the boot pre-parser's part of them)."""
    return frozenset(s for o in OPTIONS if o.is_switch for s in o.option_strings)


def value_spellings() -> frozenset[str]:
    """Every spelling of the options that take a value."""
    return frozenset(s for o in OPTIONS if not o.is_switch for s in o.option_strings)
