"""``spotrun``: a torchrun drop-in whose agents meet through an etcd v3 rendezvous.

Every torchrun flag of the installed torch is accepted with the same spellings (``--nproc-per-node`` and
``--nproc_per_node``), defaults and ``PET_*`` environment fallbacks, because the parser *is* torch's
(``torch.distributed.run.get_args_parser``) and the launch config is built by torch's ``config_from_args``.
Differences from torchrun:

* ``--rdzv-backend`` defaults to ``etcd-v3`` (``PET_RDZV_BACKEND`` still overrides it) when the command names
  an ``--rdzv-endpoint``; without one spotrun picks what torchrun picks (:func:`rendezvous_mode`).
* ``--standalone`` starts an embedded etcd on a free loopback port with a temporary data directory and a
  random run id; etcd and its data are removed on every exit path (success, failure, SIGINT/SIGTERM).
  A single-node job without ``--rdzv-endpoint`` and without ``--master-port`` runs standalone too, as under
  torchrun (which uses its c10d store there). With a ``--master-port``, or with more than one node (the classic
  ``--nnodes 2 --node-rank 0 --master-addr H --master-port P``), a command that names no backend and no
  endpoint runs on torch's static rendezvous with exactly that address and port, as torchrun; a multi-node one
  says once how to make it elastic (``--rdzv-backend etcd-v3 --rdzv-endpoint HOST:PORT``).
* spotrun-only flags (all optional):

  ``--stop-grace SECONDS``       SIGTERM->SIGKILL grace when workers are stopped for a restart
                                 (env ``SPOTRUN_STOP_GRACE``, default 3; torch uses 30).
  ``--peer-loss-grace SECONDS``  with no restarts left, how long a failed group waits for a lost-peer signal
                                 before giving up (env ``SPOTRUN_PEER_LOSS_GRACE``, default 5; with etcd-v3
                                 at least ``lease_ttl`` + 2 unless 0).
  ``--[no-]warm-workers``        fork Python script workers from a torch-preloaded forkserver (env
                                 ``SPOTRUN_WARM_WORKERS``, default on): a restart skips ``import torch``.
                                 Only when the command asks for no other ``--start-method`` (flag or
                                 ``PET_START_METHOD``): with ``spawn`` or ``fork`` asked, script workers are
                                 torchrun's ``python -u script`` subprocesses (torchrun applies the method
                                 to ``--run-path`` functions only); ``--no-python`` binaries are never warm.
  ``--preempt-grace SECONDS``    a SIGTERM to the agent is a preemption notice with this deadline (env
                                 ``SPOTRUN_PREEMPT_GRACE``, default 30); see ``elastic.planned``.
  ``--preempt-signal SIG[@S]``   an extra notice signal, Slurm style (env ``SPOTRUN_PREEMPT_SIGNAL``).
  ``--preempt-notice LIST``      poll cloud metadata for notices: aws, aws-rebalance, gcp, azure (env
                                 ``SPOTRUN_PREEMPT_NOTICE``), every ``--preempt-poll-interval`` s (default 2).
  ``--resize-timeout SECONDS``   a joining node first lets the workers commit an agreed step (env
                                 ``SPOTRUN_RESIZE_TIMEOUT``, default 60).
  ``--planned-leave-exit-code N`` exit status of an agent that left for its notice with training unfinished
                                 (env ``SPOTRUN_PLANNED_LEAVE_EXIT_CODE``, 0-255, default 0; 75 with a
                                 podFailurePolicy Ignore rule on a Kubernetes Indexed Job).
  ``--hang-timeout SECONDS``     a worker without progress (optimizer steps, ``elastic.progress.heartbeat()``
                                 or main-thread CPU) this long after start-up counts as hung: its stack is
                                 logged, it is killed and the group restarts (env ``SPOTRUN_HANG_TIMEOUT``;
                                 default adaptive: 10x the slowest recent step, at least 60 s).
  ``--hang-startup-timeout S``   the budget for start-up, first steps and checkpoint load (env
                                 ``SPOTRUN_HANG_STARTUP_TIMEOUT``, default 600).
  ``--[no-]hang-detection``      (env ``SPOTRUN_HANG_DETECTION``, default on).
  ``--metrics-port PORT``        Prometheus metrics at ``/metrics`` (env ``SPOTRUN_METRICS_PORT``; default off;
                                 ``elastic.metrics``).
  ``--events-file PATH``         structured recovery events (env ``SPOTRUN_EVENTS_FILE``; default
                                 ``<log-dir>/events.jsonl``, or ``$XDG_STATE_HOME/spotrun/runs/<run id>/<host>/
                                 events.jsonl`` when no ``--log-dir`` is given; printed once at start).

Subcommands (before any flag): ``spotrun status ...`` (``elastic.status``: the job as etcd sees it) and
``spotrun report EVENTS...`` (``elastic.report``: timeline and cost of the faults); also installed as
``spotrun-status`` and ``spotrun-report``. A file named ``status`` or ``report`` in the working directory is
still run as the training script, as torchrun would.

Exit status: 0 on success (also after leaving the group for a preemption notice, unless
``--planned-leave-exit-code`` says otherwise); 1 when workers fail (with torchrun's root-cause summary); 1 for a
bad flag value or rendezvous configuration (as torchrun, with one line instead of its traceback); 2 for a command
line argparse rejects (an unknown option, a value of the wrong type), as torchrun; 1 when the rendezvous backend is
unreachable. Called from Python, ``main(argv)`` raises what torchrun's ``main(argv)`` raises for the same input
(a configuration error is an ``elastic.api.LaunchConfigError``, a ValueError, AssertionError or RuntimeError as
torchrun's) and leaves nothing behind: its forkserver stopped, signal handlers and environment restored.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

if __name__ == "__main__":
    # `python -m elastic.cli` is `python -m elastic` (the console script's entry point, elastic.main.main): this file
    # then runs once, as the module elastic.cli, instead of a second time as __main__ in every warm worker
    # (multiprocessing re-runs a main module by its name in its children, but never a package's __main__).
    import runpy

    runpy.run_module("elastic", run_name="__main__", alter_sys=True)
    sys.exit(0)

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record
from torch.distributed.run import config_from_args, get_args_parser

from elastic import early_notice
from elastic.api import (
    DEFAULT_RDZV_BACKEND,
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
    PlannedLeaveExit,
    RendezvousUnavailableError,
    StandaloneEtcdError,
    TorchInternalsError,
)
from elastic.config import (
    AgentSettings,
    check_launch_values,
    default_events_file,
    default_metrics_port,
    default_peer_loss_grace,
    default_planned_leave_exit_code,
    default_preempt_grace,
    default_preempt_notice,
    default_preempt_poll_interval,
    default_preempt_signal,
    default_resize_timeout,
    default_stop_grace,
    default_warm_workers,
    hang_policy,
    parse_nnodes,
    straggler_policy,
)
from elastic.events import default_events_path
from elastic.notice import notice_signals, parse_sources

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
"""A command line argparse rejects (torchrun's code for it)."""
EXIT_FAILURE = 1
"""Failed workers, a bad flag value or configuration, an unreachable rendezvous (torchrun's code for them)."""
STATIC_BACKEND = "static"
"""torch's static rendezvous (torchrun's default backend)."""
GIVEN = "spotrun_given"
"""Attribute of a parsed command line (:func:`parse_command_line`): the dests the user set, by flag or ``PET_*``."""
_CHOICES_SEEN = {"rdzv_backend": "PET_RDZV_BACKEND", "start_method": "PET_START_METHOD"}
"""The dests whose default spotrun tells from a user's choice, with their torchrun environment fallback."""


def build_parser() -> argparse.ArgumentParser:
    """torch's torchrun parser, retitled, with spotrun's default backend and spotrun-only flags."""
    parser = get_args_parser()
    parser.prog = "spotrun"
    parser.description = "spotrun: fault-tolerant torchrun drop-in on an etcd v3 rendezvous"
    # Keep the PET_RDZV_BACKEND fallback: torch's `env` action read it into the default at definition time.
    parser.set_defaults(rdzv_backend=os.environ.get("PET_RDZV_BACKEND", DEFAULT_RDZV_BACKEND))
    for action in parser._actions:  # argparse has no public way to edit a help text
        if action.dest == "rdzv_backend":
            action.help = f"Rendezvous backend (spotrun default: {DEFAULT_RDZV_BACKEND})."
        elif action.dest == "standalone":
            action.help = (
                "Start an embedded etcd on a free loopback port (temporary data dir, removed at exit) and use "
                "the etcd-v3 backend with a random run id; --rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored."
            )
    group = parser.add_argument_group("spotrun")
    group.add_argument("--stop-grace", "--stop_grace", type=float, default=None,
                       help=f"Seconds between SIGTERM and SIGKILL when stopping workers for a restart "
                            f"(env {ENV_STOP_GRACE}, default 3).")
    group.add_argument("--peer-loss-grace", "--peer_loss_grace", type=float, default=None,
                       help=f"With no restarts left, seconds a failed worker group waits for a lost-peer signal "
                            f"before failing the job (env {ENV_PEER_LOSS_GRACE}, default 5; with etcd-v3 at least the "
                            f"lease_ttl + 2 s, so a peer that died with the failure is seen; 0: no wait).")
    group.add_argument("--warm-workers", "--warm_workers", action=argparse.BooleanOptionalAction, default=None,
                       help=f"Fork Python script workers from a forkserver that pre-imported torch, so restarts skip "
                            f"the interpreter start (env {ENV_WARM_WORKERS}, default on; --no-warm-workers: plain "
                            f"`python -u script` subprocesses like torchrun).")
    group.add_argument("--preempt-grace", "--preempt_grace", type=float, default=None,
                       help=f"Seconds a SIGTERM to the agent leaves before the node is gone: workers using "
                            f"elastic.preemption.Preemption commit an agreed step within it and the agent exits 0 "
                            f"(env {ENV_PREEMPT_GRACE}, default 30).")
    group.add_argument("--preempt-signal", "--preempt_signal", type=str, default=None,
                       help=f"An extra notice signal NAME[@SECONDS], like Slurm's --signal=USR2@120 "
                            f"(env {ENV_PREEMPT_SIGNAL}).")
    group.add_argument("--preempt-notice", "--preempt_notice", type=str, default=None,
                       help=f"Poll these metadata services for preemption notices, comma-separated: aws, "
                            f"aws-rebalance, gcp, azure (env {ENV_PREEMPT_NOTICE}).")
    group.add_argument("--preempt-poll-interval", "--preempt_poll_interval", type=float, default=None,
                       help=f"Seconds between metadata polls (env {ENV_PREEMPT_POLL_INTERVAL}, default 2).")
    group.add_argument("--resize-timeout", "--resize_timeout", type=float, default=None,
                       help=f"When a node joins, seconds the workers get to commit an agreed step before the "
                            f"group restarts anyway (env {ENV_RESIZE_TIMEOUT}, default 60).")
    group.add_argument("--planned-leave-exit-code", "--planned_leave_exit_code", type=int, default=None,
                       help=f"Exit status (0-255) of an agent that left the group for its preemption notice with "
                            f"training unfinished (env {ENV_PLANNED_LEAVE_EXIT_CODE}, default 0). On a Kubernetes "
                            f"Indexed Job use e.g. 75 with a podFailurePolicy Ignore rule, so the index is recreated.")
    group.add_argument("--hang-timeout", "--hang_timeout", type=float, default=None,
                       help=f"Seconds without progress after start-up before a worker counts as hung and the group "
                            f"restarts (env {ENV_HANG_TIMEOUT}; default adaptive: 10x the slowest recent step, "
                            f"at least 60 s).")
    group.add_argument("--hang-startup-timeout", "--hang_startup_timeout", type=float, default=None,
                       help=f"Seconds without progress allowed during start-up, first steps and checkpoint load "
                            f"(env {ENV_HANG_STARTUP_TIMEOUT}, default 600).")
    group.add_argument("--hang-detection", "--hang_detection", action=argparse.BooleanOptionalAction, default=None,
                       help=f"Watch every worker's progress and restart the group when one hangs (env "
                            f"{ENV_HANG_DETECTION}, default on).")
    group.add_argument("--events-file", "--events_file", type=str, default=None,
                       help=f"JSON-lines recovery event log (env {ENV_EVENTS_FILE}; default <log-dir>/events.jsonl, "
                            f"else $XDG_STATE_HOME/spotrun/runs/<run id>/<host>/events.jsonl; printed at start).")
    group.add_argument("--metrics-port", "--metrics_port", type=int, default=None,
                       help=f"Serve Prometheus metrics (restarts, recovery stages, notices, ...) on this TCP port at "
                            f"/metrics (env {ENV_METRICS_PORT}; default: off).")
    group.add_argument("--straggler-factor", "--straggler_factor", type=float, default=None,
                       help=f"Name a local rank a straggler (straggler_detected event, spotrun_stragglers metric) when "
                            f"its step time exceeds this many times its local peers' median (env "
                            f"{ENV_STRAGGLER_FACTOR}, default 1.5; 0: off; needs hang detection).")
    group.add_argument("--straggler-window", "--straggler_window", type=int, default=None,
                       help=f"Steps a rank's step time is averaged over for straggler detection (env "
                            f"{ENV_STRAGGLER_WINDOW}, default 20).")
    _no_abbreviations(parser, group)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> None:
    """spotrun-only flags are matched by their full names only. argparse classifies every argument, also
    those after the training script, against option prefixes: with ``--hang-timeout`` and
    ``--hang-detection`` a script's own ``--hang`` became an "ambiguous option" error (and a script's
    ``--preempt`` likewise). torch's flags keep torchrun's abbreviations."""
    ours = {option for action in group._group_actions for option in action.option_strings}
    original = parser._get_option_tuples

    def option_tuples(option_string: str) -> list[tuple[Any, ...]]:
        return [match for match in original(option_string) if match[1] not in ours]

    parser._get_option_tuples = option_tuples  # type: ignore[method-assign]


def settings_from_args(args: argparse.Namespace) -> AgentSettings:
    return AgentSettings(
        stop_grace=default_stop_grace() if args.stop_grace is None else args.stop_grace,
        peer_loss_grace=default_peer_loss_grace() if args.peer_loss_grace is None else args.peer_loss_grace,
        events_file=args.events_file if args.events_file is not None else default_events_file(),
        warm_workers=default_warm_workers() if (wanted := warm_workers_wanted(args)) is None else wanted,
        preempt_grace=default_preempt_grace() if args.preempt_grace is None else args.preempt_grace,
        # An empty --preempt-signal/--preempt-notice falls back to the environment too (as it always did).
        preempt_signal=args.preempt_signal or default_preempt_signal(),
        preempt_sources=parse_sources(args.preempt_notice or default_preempt_notice()),
        preempt_poll_interval=default_preempt_poll_interval() if args.preempt_poll_interval is None
        else args.preempt_poll_interval,
        resize_timeout=default_resize_timeout() if args.resize_timeout is None else args.resize_timeout,
        planned_leave_exit_code=default_planned_leave_exit_code() if args.planned_leave_exit_code is None
        else args.planned_leave_exit_code,
        hang=hang_policy(enabled=args.hang_detection, timeout=args.hang_timeout,
                         startup_timeout=args.hang_startup_timeout),
        metrics_port=default_metrics_port() if args.metrics_port is None else args.metrics_port,
        straggler=straggler_policy(factor=args.straggler_factor, window=args.straggler_window),
    )


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, also noting (attribute ``spotrun_given``) whether ``--rdzv-backend`` and
    ``--start-method`` were chosen (by flag or ``PET_*``) or are defaults: spotrun decides differently for
    each (:func:`rendezvous_mode`, :func:`warm_workers_wanted`)."""
    seen = argparse.Namespace(**dict.fromkeys(_CHOICES_SEEN))  # argparse leaves an attribute it finds unset
    args = parser.parse_args(argv, namespace=seen)
    given = {dest for dest, env in _CHOICES_SEEN.items() if getattr(args, dest) is not None or env in os.environ}
    for dest in _CHOICES_SEEN:
        if getattr(args, dest) is None:
            setattr(args, dest, parser.get_default(dest))
    setattr(args, GIVEN, frozenset(given))
    return args


def _given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the user chose ``dest``; a namespace parsed without :func:`parse_command_line` tells only by a
    value other than spotrun's default or by the ``PET_*`` variable."""
    given: frozenset[str] | None = getattr(args, GIVEN, None)
    if given is not None:
        return dest in given
    return getattr(args, dest) != build_parser().get_default(dest) or _CHOICES_SEEN[dest] in os.environ


def validate_args(args: argparse.Namespace) -> None:
    """Reject what torch would only catch with a bare ValueError/AssertionError, with a useful message (of the
    type torchrun raises for the same input)."""
    judged = check_launch_values(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                                 max_restarts=args.max_restarts, monitor_interval=args.monitor_interval,
                                 rdzv_conf=args.rdzv_conf)
    if not judged:
        # torch also accepts a registered privateuse1 backend name; let config_from_args judge that.
        from elastic.torch_internals import privateuse1_backend_name

        if args.nproc_per_node != privateuse1_backend_name():
            raise LaunchConfigError(
                f"--nproc-per-node={args.nproc_per_node!r} is not valid; use an integer, cpu, gpu, xpu or auto"
            )


def should_run_standalone(args: argparse.Namespace) -> bool:
    """``--standalone``, or torchrun's implicit standalone: a single-node job without ``--rdzv-endpoint`` on the
    default backend (or torch's static one) and without ``--master-port``; an explicit ``--rdzv-backend
    etcd-v3`` ignores the port (it is only ever the static backend's). torchrun runs standalone only without a
    port: with one it stays on the static backend and its workers get exactly that port (a script may call
    ``init_process_group(init_method="tcp://localhost:PORT")``)."""
    if args.standalone:
        return True
    if args.rdzv_endpoint or parse_nnodes(args.nnodes)[1] != 1:
        return False
    if args.rdzv_backend == STATIC_BACKEND or not _given(args, "rdzv_backend"):
        return args.master_port is None
    return bool(args.rdzv_backend == DEFAULT_RDZV_BACKEND)


def should_run_static(args: argparse.Namespace) -> bool:
    """torchrun's static rendezvous for a command that names no backend and no endpoint and does not run
    standalone: a ``--master-port``, or several nodes (``--nnodes 2 --node-rank 0 --master-addr H --master-port
    P``, torchrun's classic multi-node command)."""
    if args.rdzv_endpoint or _given(args, "rdzv_backend"):
        return False
    return not should_run_standalone(args)


def rendezvous_mode(args: argparse.Namespace) -> str:
    """``standalone`` (an embedded etcd), ``static`` (torch's static rendezvous, as torchrun) or the backend
    the command names (``etcd-v3`` by default with an ``--rdzv-endpoint``)."""
    if should_run_standalone(args):
        return "standalone"
    if should_run_static(args):
        return STATIC_BACKEND
    return str(args.rdzv_backend)


def static_note(args: argparse.Namespace) -> str:
    """The one line a multi-node job on the static rendezvous gets: how to make it elastic."""
    return (f"spotrun: --nnodes {args.nnodes} with no --rdzv-backend or --rdzv-endpoint: torch's static rendezvous "
            f"at {args.master_addr}:{args.master_port or 29500} (as torchrun: a lost node ends the job). For an elastic "
            f"job give every node --rdzv-backend {DEFAULT_RDZV_BACKEND} --rdzv-endpoint HOST:PORT of an etcd v3 server "
            f"(e.g. `python -m elastic.etcd_server --host 0.0.0.0`) and the same --rdzv-id")


def warm_workers_wanted(args: argparse.Namespace) -> bool | None:
    """``--[no-]warm-workers`` when given; False when the command asks for a start method other than the
    forkserver (its workers are then torchrun's, ``python -u script``); else None (the environment decides)."""
    if args.warm_workers is not None:
        return bool(args.warm_workers)
    if _given(args, "start_method") and args.start_method != "forkserver":
        return False
    return None


@contextlib.contextmanager
def standalone_rendezvous(args: argparse.Namespace) -> Iterator[None]:
    """Start an embedded etcd and point ``args`` at it; stop it and delete its data on every exit path."""
    from elastic.etcd_server import EmbeddedEtcd

    try:
        etcd = EmbeddedEtcd().start()
    except Exception as exc:
        raise StandaloneEtcdError(f"--standalone could not start the embedded etcd: {exc}") from exc
    try:
        args.rdzv_backend = DEFAULT_RDZV_BACKEND
        args.rdzv_endpoint = etcd.endpoint
        args.rdzv_id = str(uuid.uuid4())
        logger.info("standalone: embedded etcd at %s, run id %s", etcd.endpoint, args.rdzv_id)
        yield
    finally:
        etcd.close()


def _raise_signal_exception(signum: int, frame: object) -> NoReturn:
    # torch's SignalException, so the agent and the launcher treat it exactly like torch does.
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def install_signal_handlers(preempt_signal: str | None = None) -> None:
    """Turn SIGINT into an exception before workers exist (torch only does so once they start), so ``finally``
    blocks (embedded etcd cleanup) run even if the launcher is interrupted during rendezvous. The notice
    signals (SIGTERM, ``--preempt-signal``) are recorded as a notice instead (``elastic.early_notice``): the
    agent leaves as a planned leave when it can act on them."""
    signal.signal(signal.SIGINT, _raise_signal_exception)
    try:
        signums = [int(sig) for sig in notice_signals(preempt_signal)]
    except LaunchConfigError:
        signums = [int(signal.SIGTERM)]  # a bad --preempt-signal: reported by run() in a moment
    early_notice.arm(signums)


@contextlib.contextmanager
def restored_signal_handlers() -> Iterator[None]:
    """Put back every signal handler the launch replaced (its own, the agent's notice handlers, torch's
    ``PContext`` ones): ``main(argv)`` called in-process leaves the caller's handlers as they were."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal.signal works in the main thread only: nothing here can have been replaced
        return
    catchable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    before = {sig: signal.getsignal(sig) for sig in catchable}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def _torchrun_type(exc: ValueError | AssertionError) -> LaunchConfigError:
    """A torch configuration error as spotrun's, of the same type (ValueError, AssertionError, RuntimeError)."""
    if isinstance(exc, AssertionError):
        return LaunchConfigRangeError(str(exc))
    if isinstance(exc, RuntimeError):
        return LaunchConfigFormatError(str(exc))
    return LaunchConfigError(str(exc))


def run(args: argparse.Namespace) -> None:
    """Launch with parsed arguments (raises ChildFailedError when workers fail, like torchrun's run)."""
    from elastic.launcher import launch
    from elastic.torch_internals import verify_torch_once

    validate_args(args)
    verify_torch_once()  # before the embedded etcd: an unusable torch fails here, never mid-run
    settings = settings_from_args(args)
    with contextlib.ExitStack() as stack:
        mode = rendezvous_mode(args)
        if mode == "standalone":
            stack.enter_context(standalone_rendezvous(args))
        elif mode == STATIC_BACKEND and args.rdzv_backend != STATIC_BACKEND:
            args.rdzv_backend = STATIC_BACKEND
            if parse_nnodes(args.nnodes)[1] > 1:
                print(static_note(args), file=sys.stderr)
        if args.master_port is None:
            args.master_port = 29500  # torchrun's default, used only by the static backend
        try:
            config, cmd, cmd_args = config_from_args(args)
        except (ValueError, AssertionError) as exc:
            raise _torchrun_type(exc) from exc
        if settings.events_file is None:
            settings.events_file = default_events_path(config.run_id, args.log_dir)
        print(f"spotrun: events of run {config.run_id}: {settings.events_file}", file=sys.stderr, flush=True)
        launch(config, cmd, cmd_args, settings)


@record
def _main(argv: Sequence[str] | None) -> None:
    """torchrun's ``main``; ``argv`` None is the command line (errors: one line and torchrun's exit code),
    a list is a call from Python (errors: the exception torchrun's ``main(argv)`` raises)."""
    from elastic.boot import forkserver_scope

    command = argv is None
    parser = build_parser()
    args = parse_command_line(parser, argv)
    with restored_signal_handlers(), forkserver_scope():
        install_signal_handlers(args.preempt_signal or default_preempt_signal())
        try:
            run(args)
        except (LaunchConfigError, RendezvousUnavailableError, StandaloneEtcdError, TorchInternalsError) as exc:
            if not command:
                raise
            parser.exit(EXIT_FAILURE, f"spotrun: error: {exc}\n")
        except PlannedLeaveExit as exc:
            logger.warning("%s", exc)
            if command:
                parser.exit(exc.exit_code)
            if exc.exit_code:
                raise
        except SignalException as exc:
            if not command:
                raise  # as torchrun's main
            # torchrun's exit code (1) and error file for an immediate stop (a signal before the workers could
            # save at an agreed step, or a second SIGTERM); one line instead of the launcher's own traceback.
            get_error_handler().record_exception(exc)
            parser.exit(EXIT_FAILURE, f"spotrun: stopped by {exc.sigval.name} (workers stopped at once; a restart "
                                      "resumes from the last committed checkpoint)\n")
        finally:
            early_notice.disarm()  # a notice recorded and never taken must not outlive the launch


SUBCOMMANDS = {"status": "spotrun-status", "report": "spotrun-report"}
"""``spotrun NAME ...`` -> the tool it runs (also installed under the entry point named here)."""


def subcommand(argv: Sequence[str], is_file: Callable[[str], bool] = os.path.isfile) -> tuple[str | None, str | None]:
    """(subcommand to run, or None; a note to print once, or None) for ``spotrun ARGV``.

    CHANGE: torchrun takes the training script as its first positional argument, so ``spotrun status`` could be
    a script named ``status`` in the working directory: then it stays one (run as torchrun would) and the note
    says how to reach the subcommand."""
    if not argv or argv[0] not in SUBCOMMANDS:
        return None, None
    if is_file(argv[0]):
        return None, (f"spotrun: running ./{argv[0]} as the training script (a file of that name is here); "
                      f"for the subcommand run `{SUBCOMMANDS[argv[0]]}`")
    return argv[0], None


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (``spotrun``); ``main(argv)`` from Python as torchrun's ``main(argv)``."""
    if not logging.getLogger().handlers:
        # The CLI is an application, so it may configure logging; library modules never do.
        logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = list(sys.argv[1:]) if argv is None else list(argv)
    name, note = subcommand(args)
    if note is not None:
        print(note, file=sys.stderr)
    if name == "status":
        from elastic import status

        sys.exit(status.main(args[1:]))
    if name == "report":
        from elastic import report

        sys.exit(report.main(args[1:]))
    _main(None if argv is None else args)
