"""A speculative warm forkserver, started from the command line before the agent imports torch.

Why: warm workers fork from a forkserver that imported torch, and the agent needs its own ``import torch`` to
parse torchrun's flags (torch's parser lives in ``torch.distributed.run``). Started here, from argv alone, the
two imports overlap instead of running one after the other, so a node that joins a running job starts sooner.

What the forkserver must have at its start is what its preloaded modules and children inherit: the import-time
environment (``OMP_NUM_THREADS``, ``TORCHELASTIC_SIGNALS_TO_HANDLE``) and the blocked notice signals
(``--preempt-signal``). A small pre-parser guesses them from argv (:func:`guess`); the launcher compares the
guess with what it decided (:func:`adopt`) and uses the early forkserver only when everything matches, else
restarts it. A wrong guess costs CPU, never behaviour.

The same pre-parser rejects a command line that is surely bad (:func:`reject_early`: an unknown option, a
``--nnodes``, ``--nproc-per-node``, ``--max-restarts``, ``--monitor-interval`` or ``--rdzv-conf`` torchrun would
refuse) with torchrun's exit status and one line, without waiting for ``import torch``; what it cannot judge
for certain goes on to the real parser.

Its option sets are torchrun's (listed here, for ``TABLE_TORCH_RELEASE``) and spotrun's (``elastic.options``).
This module must not import torch (nor anything that does): it runs before the agent's imports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from elastic import options

logger = logging.getLogger(__name__)

TORCHRUN_FLAG_OPTIONS: Final = frozenset({
    "-h", "--help", "--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
    "--virtual-local-rank", "--virtual_local_rank",
})
"""torchrun's options that take no value (under ``TABLE_TORCH_RELEASE``)."""
TORCHRUN_VALUE_OPTIONS: Final = frozenset({
    "--duplicate-stderr-filters", "--duplicate-stdout-filters", "--duplicate_stderr_filters",
    "--duplicate_stdout_filters", "--event-log-handler", "--event_log_handler", "--local-addr",
    "--local-ranks-filter", "--local_addr", "--local_ranks_filter", "--log-dir", "--log_dir", "--logs-specs",
    "--logs_specs", "--master-addr", "--master-port", "--master_addr", "--master_port", "--max-restarts",
    "--max_restarts", "--monitor-interval", "--monitor_interval", "--nnodes", "--node-rank", "--node_rank",
    "--nproc-per-node", "--nproc_per_node", "--numa-binding", "--numa_binding", "--rdzv-backend", "--rdzv-conf",
    "--rdzv-endpoint", "--rdzv-id", "--rdzv_backend", "--rdzv_conf", "--rdzv_endpoint", "--rdzv_id", "--redirects",
    "--role", "--shutdown-timeout", "--shutdown_timeout", "--signals-to-handle", "--signals_to_handle",
    "--start-method", "--start_method", "--tee", "-r", "-t",
})
"""torchrun's options that take a value (under ``TABLE_TORCH_RELEASE``)."""
FLAG_OPTIONS: Final = TORCHRUN_FLAG_OPTIONS | options.switch_spellings()
"""Options of ``spotrun`` that take no value (``tests/elastic/test_boot.py`` keeps this equal to the parser)."""
VALUE_OPTIONS: Final = TORCHRUN_VALUE_OPTIONS | options.value_spellings()
"""Options of ``spotrun`` that take a value (``tests/elastic/test_boot.py`` keeps this equal to the parser)."""
DEFAULT_SIGNALS_TO_HANDLE: Final = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun's ``--signals-to-handle`` default."""
TABLE_TORCH_RELEASE: Final = "2.13"
"""The torch release whose torchrun options the two torchrun sets above list: an option missing from them is
rejected before ``import torch`` only under that release (a newer torchrun may have added it)."""
EXIT_BAD_VALUE: Final = 1
"""torchrun's exit status for a flag value its launch config refuses (its exception ends the process)."""
EXIT_USAGE: Final = 2
"""argparse's exit status for an unknown option (torchrun's too)."""
ENV_EARLY_FORKSERVER: Final = "SPOTRUN_EARLY_FORKSERVER"
"""``0`` turns the speculative forkserver off (the forkserver then starts after the agent's imports)."""


@dataclass(frozen=True, slots=True)
class WarmGuess:
    """What the launcher will most likely decide for the workers' forkserver, from argv and the environment."""

    env: dict[str, str]
    """Environment variables the launcher sets before it starts the forkserver (name -> value)."""
    shielded: tuple[int, ...]
    """Signal numbers blocked in the forkserver (the agent's notice signals)."""


@dataclass(frozen=True, slots=True)
class _Parsed:
    options: dict[str, str | None]
    script: str | None
    module: bool


def _canonical(token: str, known: Sequence[str]) -> str | None:
    """``token``'s option as argparse (``allow_abbrev``) would read it; None when unknown or ambiguous."""
    if token in known:
        return token
    matches = [k for k in known if k.startswith(token) and k.startswith("--")]
    return matches[0] if len(matches) == 1 else None


def pre_parse(argv: Sequence[str], value_options: frozenset[str]) -> _Parsed | None:
    """The options before the script and the script itself; None when argv cannot be read with certainty
    (an unknown or ambiguous option: the guess is then not made). Pure."""
    known = sorted(FLAG_OPTIONS | value_options)
    options: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return _Parsed(options, argv[i + 1] if i + 1 < len(argv) else None, "--module" in options)
        if not token.startswith("-") or token == "-":
            return _Parsed(options, token, "--module" in options or "-m" in options)
        name, eq, value = token.partition("=")
        if not name.startswith("--") and len(name) > 2 and name[:2] in known:  # -r3, -t3
            name, eq, value = name[:2], "=", name[2:]
        canon = _canonical(name, known)
        if canon is None:
            return None
        if canon in FLAG_OPTIONS:
            if eq:
                return None
            options[canon] = None
        elif eq:
            options[canon] = value
        else:
            if i + 1 >= len(argv):
                return None
            options[canon] = argv[i + 1]
            i += 1
        i += 1
    return _Parsed(options, None, False)


def _last(options: Mapping[str, str | None], *names: str) -> str | None:
    for name in names:
        if name in options:
            return options[name]
    return None


def guess(argv: Sequence[str], environ: Mapping[str, str], value_options: frozenset[str]) -> WarmGuess | None:
    """The forkserver the launcher will start, or None when it will start none or argv leaves doubt. Pure."""
    from elastic.notice import notice_signals

    parsed = pre_parse(argv, value_options)
    if parsed is None or parsed.script is None:
        return None
    opts = parsed.options
    if any(k in opts for k in ("-h", "--help", "--no-python", "--no_python", "--run-path", "--run_path")):
        return None
    if any(k in opts for k in options.WARM_WORKERS.negations):
        return None
    if not any(k in opts for k in options.WARM_WORKERS.spellings):
        if environ.get(options.WARM_WORKERS.env, "").strip().lower() in options.SWITCH_OFF:
            return None
        method = _last(opts, "--start-method", "--start_method") or environ.get("PET_START_METHOD")
        if method is not None and method != "forkserver":
            return None  # a start method asked for: torchrun's workers (elastic.cli.warm_workers_wanted)
    if not parsed.module and not os.path.isfile(parsed.script):
        return None  # the launcher starts no forkserver for a missing script
    nproc_text = _last(opts, "--nproc-per-node", "--nproc_per_node") or environ.get("PET_NPROC_PER_NODE", "1")
    try:
        nproc = int(nproc_text)
    except ValueError:
        return None  # "auto", "gpu"...: torch decides with devices it must import to count
    env: dict[str, str] = {}
    if nproc > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = "1"
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = (_last(opts, "--signals-to-handle", "--signals_to_handle")
                                             or environ.get("PET_SIGNALS_TO_HANDLE") or DEFAULT_SIGNALS_TO_HANDLE)
    preempt = _last(opts, *options.PREEMPT_SIGNAL.spellings) or environ.get(options.PREEMPT_SIGNAL.env) or None
    try:
        shielded = tuple(int(s) for s in notice_signals(preempt))
    except Exception:  # noqa: BLE001 - a bad --preempt-signal: the launcher reports it; no guess
        return None
    return WarmGuess(env, shielded)


SUBCOMMANDS: Final = ("status", "report")
"""``spotrun NAME ...`` that run a tool, not the launcher (``elastic.cli.SUBCOMMANDS``)."""


def launch_notice_signals(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[int, ...]:
    """The signals the launcher will take as a preemption notice (SIGTERM, ``--preempt-signal``), guessed from
    argv before its imports; none for a subcommand (``spotrun status`` must stay killable). Never raises: a
    bad ``--preempt-signal`` falls back to SIGTERM alone (the launcher reports it)."""
    from elastic.notice import notice_signals

    if argv and argv[0] in SUBCOMMANDS and not os.path.isfile(argv[0]):
        return ()
    parsed = pre_parse(argv, VALUE_OPTIONS)
    preempt = (_last(parsed.options, *options.PREEMPT_SIGNAL.spellings) if parsed is not None else None) \
        or environ.get(options.PREEMPT_SIGNAL.env) or None
    try:
        return tuple(int(sig) for sig in notice_signals(preempt))
    except Exception:  # noqa: BLE001 - a bad --preempt-signal: SIGTERM is a notice whatever else is asked
        return (int(signal.SIGTERM),)


_BAD_VALUE_CHECKS: Final = (
    # (the options' spellings, their torchrun environment fallback, the keyword of check_launch_values, its type)
    (("--nnodes",), "PET_NNODES", "nnodes", str),
    (("--nproc-per-node", "--nproc_per_node"), "PET_NPROC_PER_NODE", "nproc_per_node", str),
    (("--max-restarts", "--max_restarts"), "PET_MAX_RESTARTS", "max_restarts", int),
    (("--monitor-interval", "--monitor_interval"), "PET_MONITOR_INTERVAL", "monitor_interval", float),
    (("--rdzv-conf", "--rdzv_conf"), "PET_RDZV_CONF", "rdzv_conf", str),
)
_VALID_DEFAULTS: Final = {"nnodes": "1", "nproc_per_node": "1", "max_restarts": 0, "monitor_interval": 1.0,
                          "rdzv_conf": ""}
"""Stand-ins for what the command does not set: valid by construction (torchrun's defaults are)."""


def unknown_options(argv: Sequence[str]) -> list[str]:
    """The options before the training script that are no option of spotrun's, nor an abbreviation of one:
    argparse's "unrecognized arguments" (valid only under ``TABLE_TORCH_RELEASE``). Pure."""
    known = FLAG_OPTIONS | VALUE_OPTIONS
    unknown: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("--"):
            break  # the script (or a short option, left to argparse)
        name, eq, _ = token.partition("=")
        if not any(option.startswith(name) for option in known):
            unknown.append(token)
        elif not eq and name in VALUE_OPTIONS:
            i += 1
        i += 1
    return unknown


def reject_early(argv: Sequence[str], environ: Mapping[str, str], torch_release: str | None) -> tuple[int, str] | None:
    """(exit status, message) for a command line torchrun surely refuses, judged without torch; None when it
    is valid or only the real parser can tell. ``torch_release``: the installed torch's ``MAJOR.MINOR``. Pure."""
    from elastic.api import LaunchConfigError
    from elastic.config import check_launch_values

    if torch_release == TABLE_TORCH_RELEASE and (unknown := unknown_options(argv)):
        return EXIT_USAGE, f"unrecognized arguments: {' '.join(unknown)} (spotrun --help lists the options)"
    parsed = pre_parse(argv, VALUE_OPTIONS)
    if parsed is None or parsed.script is None or "-h" in parsed.options or "--help" in parsed.options:
        return None
    values: dict[str, object] = dict(_VALID_DEFAULTS)
    for spellings, env, keyword, kind in _BAD_VALUE_CHECKS:
        given = [parsed.options[s] for s in spellings if s in parsed.options]
        if len(given) > 1:
            return None  # both spellings: argparse keeps the later one, which the pre-parser cannot tell
        text = given[0] if given else environ.get(env)
        if text is None:
            continue
        try:
            values[keyword] = kind(text)
        except ValueError:
            return None  # argparse's own "invalid int value" (exit 2)
    try:
        check_launch_values(**values)  # type: ignore[arg-type]  # each value converted to its keyword's type above
    except LaunchConfigError as exc:
        return EXIT_BAD_VALUE, str(exc)
    return None


def installed_torch_release() -> str | None:
    """The installed torch's ``MAJOR.MINOR`` from its package metadata (no import); None when unknown."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    return ".".join(version.split(".")[:2])


@dataclass(slots=True)
class _Early:
    guess: WarmGuess
    environ: dict[str, str]
    """The forkserver's environment at its start."""
    preload: tuple[str, ...]


_early: _Early | None = None


def start_early(argv: Sequence[str]) -> bool:
    """Start the forkserver now if argv says the launcher will want one (never raises; True when started)."""
    global _early
    if os.environ.get(ENV_EARLY_FORKSERVER, "1").strip() == "0" or _early is not None:
        return False
    try:
        from elastic.warm import DEFAULT_PRELOAD

        wanted = guess(argv, os.environ, VALUE_OPTIONS)
        if wanted is None:
            return False
        import multiprocessing.forkserver as forkserver
        from multiprocessing import resource_tracker

        forkserver.set_forkserver_preload(list(DEFAULT_PRELOAD))
        resource_tracker.ensure_running()  # first: starting it unblocks SIGINT/SIGTERM in the caller
        saved = {k: os.environ.get(k) for k in wanted.env}
        os.environ.update(wanted.env)
        environ = dict(os.environ)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, list(wanted.shielded))
        try:
            forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            for k, v in saved.items():  # the launcher sets them itself, as before (torchrun's own messages)
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _early = _Early(wanted, environ, tuple(DEFAULT_PRELOAD))
        return True
    except Exception as exc:  # noqa: BLE001 - an optimisation: the launcher starts one as before
        logger.debug("no early forkserver: %s", exc)
        return False


def adopt(preload: Sequence[str], shielded: Sequence[int], environ: Mapping[str, str]) -> dict[str, str] | None:
    """Launcher side, where it starts the forkserver: the early forkserver's start environment when it was
    started exactly as the launcher would now (preloads, blocked signals, import-time environment); else stop
    it (when there is one) and return None: the caller starts one as before."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    why = mismatch(early, preload, shielded, environ)
    if why is None:
        logger.info("warm workers: using the forkserver started before the agent's imports")
        return early.environ
    logger.info("warm workers: the forkserver started before the agent's imports does not match (%s): restarting it",
                why)
    stop_forkserver()
    return None


def mismatch(early: _Early, preload: Sequence[str], shielded: Sequence[int], environ: Mapping[str, str]) -> str | None:
    """Why the early forkserver differs from the one the launcher wants (None: it does not). Pure."""
    from elastic.warm import IMPORT_TIME_ENV_PREFIXES, PER_WORKER_ENV

    if tuple(preload) != early.preload:
        return "preloaded modules"
    if sorted(set(shielded)) != sorted(set(early.guess.shielded)):
        return "blocked signals"

    def relevant(env: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES) and k not in PER_WORKER_ENV}

    now, then = relevant(environ), relevant(early.environ)
    if now != then:
        changed = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
        return "environment " + ", ".join(changed)
    return None


def stop_forkserver() -> None:
    """Stop multiprocessing's forkserver of this process, if one runs (CPython's own test hook)."""
    import multiprocessing.forkserver as forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if callable(stop):
        try:
            stop()
        except OSError as exc:
            logger.debug("stopping the early forkserver: %s", exc)


def early_forkserver_started() -> bool:
    """Whether :func:`start_early` started the forkserver this process runs (the launcher adopts or stops it)."""
    return _early is not None


def forkserver_running() -> bool:
    """Whether this process has multiprocessing's forkserver (a copy forked from a process that has one
    believes it has one too: multiprocessing's own state, reset by :func:`stop_forkserver`)."""
    import multiprocessing.forkserver as forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) is not None


@contextlib.contextmanager
def forkserver_scope() -> Iterator[None]:
    """Stop, on the way out, the forkserver the body started (none ran before it): a launch called
    in-process leaves no forkserver behind, and a process its caller forks afterwards starts its own
    (multiprocessing's state copied by the fork names a forkserver that is not the child's). multiprocessing's
    resource tracker stays, as after torchrun's ``main(argv)``: it may hold the caller's live semaphores."""
    ran_before = forkserver_running()
    try:
        yield
    finally:
        if not ran_before and forkserver_running():
            stop_forkserver()


def discard() -> None:
    """The launcher starts no forkserver after all (cold workers): stop the early one."""
    global _early
    if _early is not None:
        _early = None
        logger.info("warm workers off: stopping the forkserver started before the agent's imports")
        stop_forkserver()
