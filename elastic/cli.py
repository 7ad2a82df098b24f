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
* spotrun's own flags (all optional, each with a ``SPOTRUN_*`` environment fallback) are declared in
  ``elastic.options``; they are spelled in full only, so a script's ``--hang`` or ``--preempt`` reaches the script.

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
from elastic import options as opt
from elastic.api import (
    DEFAULT_RDZV_BACKEND,
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
    hang_policy,
    parse_nnodes,
    resolve,
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
    for option in opt.OPTIONS:
        # default None: the flag not given, so the environment decides (elastic.config.resolve)
        if option.is_switch:
            group.add_argument(*option.spellings, action=argparse.BooleanOptionalAction, default=None,
                               help=option.help_text.replace("%", "%%"))
        else:
            group.add_argument(*option.spellings, type=option.kind, default=None,
                               help=option.help_text.replace("%", "%%"))
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """spotrun's flags are matched by their full names only: argparse classifies every argument, also those
    after the training script, against option prefixes, so a script's own ``--hang`` would be an "ambiguous
    option" between ``--hang-timeout`` and ``--hang-detection``. torch's flags keep torchrun's abbreviations."""
    ours = {spelling for option in opt.OPTIONS for spelling in option.option_strings}
    original = parser._get_option_tuples

    def option_tuples(option_string: str) -> list[tuple[Any, ...]]:
        return [match for match in original(option_string) if match[1] not in ours]

    parser._get_option_tuples = option_tuples  # type: ignore[method-assign]


def settings_from_args(args: argparse.Namespace) -> AgentSettings:
    """The agent's settings: each flag's value, else its ``SPOTRUN_*`` variable, else its default."""
    return AgentSettings(
        stop_grace=resolve(opt.STOP_GRACE, args.stop_grace),
        peer_loss_grace=resolve(opt.PEER_LOSS_GRACE, args.peer_loss_grace),
        events_file=resolve(opt.EVENTS_FILE, args.events_file),
        warm_workers=resolve(opt.WARM_WORKERS, warm_workers_wanted(args)),
        preempt_grace=resolve(opt.PREEMPT_GRACE, args.preempt_grace),
        # An empty --preempt-signal/--preempt-notice falls back to the environment too.
        preempt_signal=resolve(opt.PREEMPT_SIGNAL, args.preempt_signal or None),
        preempt_sources=parse_sources(resolve(opt.PREEMPT_NOTICE, args.preempt_notice or None)),
        preempt_poll_interval=resolve(opt.PREEMPT_POLL_INTERVAL, args.preempt_poll_interval),
        resize_timeout=resolve(opt.RESIZE_TIMEOUT, args.resize_timeout),
        planned_leave_exit_code=resolve(opt.PLANNED_LEAVE_EXIT_CODE, args.planned_leave_exit_code),
        hang=hang_policy(enabled=args.hang_detection, timeout=args.hang_timeout,
                         startup_timeout=args.hang_startup_timeout),
        metrics_port=resolve(opt.METRICS_PORT, args.metrics_port),
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
        install_signal_handlers(resolve(opt.PREEMPT_SIGNAL, args.preempt_signal or None))
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
