"""Make a warm worker (forked from the torch-preloaded forkserver) indistinguishable from torchrun's.

torchrun starts each worker as ``python -u script.py`` in a new session. A warm worker is instead a
multiprocessing forkserver child running the script as a function, which by itself differs in ways a script
can see: multiprocessing's start method is ``forkserver`` (so a ``DataLoader`` pickles its ``collate_fn`` and
re-imports the script in every loader worker), ``atexit`` handlers never run, an uncaught exception is
reported by multiprocessing instead of printed, stdin is ``/dev/null``, the environment is the forkserver's,
``sys.path`` is the agent's, and the worker shares the agent's session. :func:`run_as_fresh_interpreter`
removes each of those differences in the child before the script runs and ends the process the way CPython's
``Py_FinalizeEx`` does. What cannot be removed in the child (environment variables that the preloaded modules
read at import time and that changed since) is detected in the agent by :func:`warm_fallback_reason`, and the
agent then starts plain subprocesses instead (torchrun's way).

multiprocessing is imported where it is used: ``elastic.boot`` imports this module before it knows whether the
launcher will start a forkserver, on the path that must stay fast. A warm worker gains no module from the
imports at the top: the forkserver it is forked from preloaded torch, which imports them all.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import os
import runpy
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from importlib.machinery import SourceFileLoader
from typing import Any

#: Prefixes of environment variables that torch, its BLAS/OpenMP runtimes, the dynamic loader or the
#: interpreter read when a module is imported (``import torch`` fixes the OpenMP pool, the allocator, CUDA
#: lazy loading, logging). A forkserver that imported torch saw their values at agent start.
IMPORT_TIME_ENV_PREFIXES = (
    "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "BLIS_", "GOTO_", "DNNL_", "ONEDNN_",
    "TORCH", "PYTORCH_", "CUDA_", "CUBLAS", "CUDNN_", "NVIDIA_", "HIP_", "ROCM_", "HSA_", "XLA_", "TRITON_",
    "LD_", "MALLOC_", "GLIBC_TUNABLES", "PYTHON",
)
#: Variables torch's agent sets per worker (``LocalElasticAgent._start_workers`` and ``PContext``): torch
#: itself reads them only when the process group starts, never at import, so their values do not matter to
#: the preloaded modules.
PER_WORKER_ENV = frozenset({
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_HEALTH_CHECK_PORT", "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT",
})

#: The environment the warm forkserver was started with and the one its children inherit (after its
#: imports); set once by ``note_forkserver_environ``, None while no forkserver runs.
_forkserver_environ: tuple[dict[str, str], dict[str, str]] | None = None


DEFAULT_PRELOAD = (
    "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
    # What every warm worker imported after the fork, before its script ran: torch's worker wrapper (``_wrap``),
    # the agent's main module that multiprocessing re-runs in each child as ``__mp_main__`` (``elastic.cli``,
    # with ``torch.distributed.run``), and the warm entrypoint's own modules. Imported once here; the script sees
    # the same modules (and ``elastic.cli`` under its own name, not only as ``__mp_main__``).
    "torch.distributed.elastic.multiprocessing", "torch.distributed.run", "elastic.cli", "elastic.workers",
    "elastic.warm", "elastic.progress",
    # torch's checkpoint package, which spotrun's Checkpointer (and DCP users) import at every (re)start,
    # on the resume path of a planned change; torch's own, like _dynamo.
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    # The third-party half of spotrun's Checkpointer import. spotrun's own `checkpoint` package is not
    # preloaded: a script's own top-level `checkpoint` module is a common name, and would make every such job
    # fall back to plain workers.
    "fsspec", "fsspec.implementations.local", "tenacity",
    # spotrun's elastic data cursor; its top-level name, ``elastic``, is preloaded above anyway, so no new name
    # can be shadowed. Not the preemption helper: its import in the
    # script tells the agent the script will build one (``coming-{local_rank}``, elastic.worker.preemption).
    "elastic.data",
)
"""What the warm forkserver imports before it forks a worker (``elastic.workers.start_warm_forkserver``; started
early by ``elastic.boot``, before the agent's own imports). None of it may import spotrun's ``checkpoint``."""


def note_forkserver_environ(started: Mapping[str, str], after_imports: Mapping[str, str]) -> None:
    """Remember the environment the warm forkserver's preloaded modules saw, and the one it hands its children."""
    global _forkserver_environ
    _forkserver_environ = (dict(started), dict(after_imports))


_forkserver_failure: str | None = None
"""Why the warm forkserver could not start (``note_forkserver_failure``), None when it did or was not tried."""


def note_forkserver_failure(why: str) -> None:
    """Remember why the warm forkserver could not start: the agent then starts plain workers, saying why."""
    global _forkserver_failure
    _forkserver_failure = why


def forkserver_environ() -> tuple[dict[str, str], dict[str, str]] | None:
    """(environment at forkserver start, environment of its children before torch's per-worker variables)."""
    return _forkserver_environ


#: Variables the agent's own background imports set and then removed again (``launcher``'s pre-import of
#: ``torch._dynamo`` sets ``TORCHINDUCTOR_CACHE_DIR``); whether the forkserver started before or after that
#: passing change says nothing about the user's environment.
_agent_import_env: set[str] = set()


def note_agent_import_env(names: set[str]) -> None:
    _agent_import_env.update(names)


#: The agent's environment before its background imports began, and the prefixes of the variables those imports
#: may set for a while (``launcher``'s pre-import of ``torch._dynamo``): a worker started meanwhile must not get them.
_agent_import_baseline: tuple[dict[str, str], tuple[str, ...]] | None = None


def note_agent_import_start(before: Mapping[str, str], prefixes: tuple[str, ...]) -> None:
    global _agent_import_baseline
    _agent_import_baseline = (dict(before), prefixes)


def agent_environ_now(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` (the agent's, now) without what its own background imports set and have not removed yet: the
    worker environment torchrun's agent would have (it makes no such imports)."""
    env = dict(environ)
    if _agent_import_baseline is not None:
        before, prefixes = _agent_import_baseline
        for name in [n for n in env if n.startswith(prefixes) and n not in before]:
            del env[name]
    for name in _agent_import_env:
        env.pop(name, None)
    return env


# --- decisions (pure, agent side) ------------------------------------------------------------------------


def import_time_env_changes(
    started: Mapping[str, str], after_imports: Mapping[str, str], current: Mapping[str, str]
) -> list[str]:
    """Names of import-time variables whose current value is neither the one the forkserver's preloaded
    modules saw nor the one they set themselves (``import torch._dynamo`` sets ``TORCHINDUCTOR_CACHE_DIR``:
    a worker given that same value behaves the same), sorted."""
    def relevant(name: str) -> bool:
        return name.startswith(IMPORT_TIME_ENV_PREFIXES) and name not in PER_WORKER_ENV

    names = {name for name in (*started, *after_imports, *current) if relevant(name)}
    return sorted(name for name in names if current.get(name) not in (started.get(name), after_imports.get(name)))


def interpreter_flags_differ(flags: Any, environ: Mapping[str, str]) -> list[str]:
    """Command-line-only interpreter options of the agent that a fresh ``python -u`` worker would not have
    (the forkserver inherits the agent's options; torchrun's worker gets only those implied by the env)."""
    checks = (
        ("-I", bool(flags.isolated)),
        ("-E", bool(flags.ignore_environment) and not flags.isolated),
        ("-S", bool(flags.no_site)),
        ("-s", bool(flags.no_user_site) and not flags.isolated and not environ.get("PYTHONNOUSERSITE")),
        ("-P", bool(getattr(flags, "safe_path", False)) and not flags.isolated and not environ.get("PYTHONSAFEPATH")),
    )
    return [option for option, differs in checks if differs]


def warm_fallback_reason(
    forkserver: tuple[Mapping[str, str], Mapping[str, str]] | None, current: Mapping[str, str], flags: Any = None
) -> str | None:
    """Why a warm worker started now could be told apart from torchrun's, or None when it cannot.
    ``forkserver``: the environments at forkserver start and after its imports (None: no forkserver)."""
    if forkserver is None:
        failure = _forkserver_failure
        return "the warm forkserver was not started" + (f" ({failure})" if failure else "")
    changed = [name for name in import_time_env_changes(forkserver[0], forkserver[1], current)
               if name not in _agent_import_env]
    if changed:
        return (f"environment variables read at import time changed since the forkserver imported torch: "
                f"{', '.join(changed)}")
    options = interpreter_flags_differ(sys.flags if flags is None else flags, current)
    if options:
        return f"the agent runs with interpreter options a fresh worker would not have: {' '.join(options)}"
    return None


def shadowed_preloads(names: Iterable[str], search_dirs: Iterable[str],
                      origin_of: Callable[[str], str | None]) -> list[str]:
    """Top-level modules the forkserver imported that a fresh ``python -u`` worker would import from elsewhere:
    ``NAME.py``, ``NAME/__init__.py`` or an extension ``NAME.*.so`` in a directory that comes before
    site-packages on its ``sys.path`` (the script's directory, PYTHONPATH), and not the file ``origin_of(NAME)``
    (where the forkserver's copy comes from). A warm worker would silently get the preloaded module instead
    of the user's own ``elastic.py`` or ``fsspec/`` vendored next to the script."""
    pending = list(names)
    found: dict[str, str] = {}
    for directory in search_dirs:  # each directory listed once, whatever the number of names
        try:
            entries = os.listdir(directory or ".")
        except OSError:
            continue
        for name in list(pending):
            path = _module_file(directory or ".", name, entries)
            if path is not None:  # the first directory that has the name is where `import` takes it from
                found[name] = path
                pending.remove(name)
    shadowed = []
    for name, path in found.items():
        origin = origin_of(name)
        if origin is None or os.path.realpath(path) != os.path.realpath(origin):
            shadowed.append(f"{name} ({path})")
    return shadowed


def _module_file(directory: str, name: str, entries: list[str]) -> str | None:
    """The file ``import name`` would load from ``directory``, in importlib's order: a package, then an
    extension module, then a source module (a directory without ``__init__.py`` is no match)."""
    package = os.path.join(directory, name, "__init__.py")
    if name in entries and os.path.isfile(package):
        return package
    for entry in entries:
        if entry.startswith(name + ".") and entry.endswith((".so", ".pyd")):
            return os.path.join(directory, entry)
    return os.path.join(directory, name + ".py") if name + ".py" in entries else None


def script_directory(target: str, *, module: bool) -> str:
    """``sys.path[0]`` of ``python -u [-m] target``: the script's directory, or the cwd for ``-m``."""
    return os.getcwd() if module else os.path.dirname(os.path.realpath(target))


def worker_environ(agent: Mapping[str, str], forkserver: Mapping[str, str], inherited: Mapping[str, str]) -> dict[str, str]:
    """The environment torchrun would give this worker: the agent's at worker start plus torch's per-worker
    variables. ``inherited`` is the child's (the forkserver's, after its imports, with torch's per-worker
    variables set on top); what differs from ``forkserver`` there, or is a known per-worker name, is torch's.
    What the forkserver's own imports added (``TORCHINDUCTOR_CACHE_DIR``) is dropped."""
    env = dict(agent)
    for name, value in inherited.items():
        if name in PER_WORKER_ENV or forkserver.get(name) != value:
            env[name] = value
    return env


def fresh_sys_path(agent_path: list[str], agent_argv0: str, cwd: str, first: str, safe_path: bool) -> list[str]:
    """``sys.path`` of ``python -u TARGET``: the agent's without its own first entry (its script's directory,
    or the cwd for ``-m``/``-c``), with ``first`` (the script's directory, or the cwd for ``-m``) in front."""
    rest = list(agent_path)
    if rest and not safe_path:
        own = rest[0]
        candidates = {"", os.path.realpath(cwd)}
        if agent_argv0:
            candidates.add(os.path.dirname(os.path.realpath(agent_argv0)))
        if own == "" or os.path.realpath(own) in candidates:
            rest = rest[1:]
    return rest if safe_path else [first, *rest]


def exit_status(exc: BaseException | None) -> tuple[int, str | None]:
    """Exit code and stderr text of a script that ended with ``exc``, as CPython's ``handle_system_exit``
    decides (None: ran to the end). An uncaught exception other than SystemExit is 1 (traceback printed by
    the caller)."""
    if exc is None:
        return 0, None
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0, None
        if isinstance(code, int):  # bool too: sys.exit(True) is 1
            return int(code) & 0xFF, None
        return 1, f"{code}\n"
    return 1, None


# --- the worker side ---------------------------------------------------------------------------------------


class WarmLaunch:
    """What the agent knows at worker start that the child must reproduce (picklable, made per start)."""

    def __init__(self) -> None:
        self.agent_environ = agent_environ_now(os.environ)
        known = forkserver_environ()
        self.forkserver_environ = dict(os.environ) if known is None else known[1]
        self.agent_path = list(sys.path)
        self.agent_argv0 = sys.argv[0] if sys.argv else ""
        self.stdin: Any = _share_stdin()
        self.ignored_signals = ignored_signals()
        self.blocked_signals = blocked_signals()


def ignored_signals() -> frozenset[int]:
    """Signals this process ignores now: an ``exec`` keeps them ignored (every caught one goes back to its
    default action), so they are what a worker torch starts at this moment inherits."""
    out = set()
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(sig) == signal.SIG_IGN:
                out.add(int(sig))
    return frozenset(out)


def blocked_signals() -> frozenset[int]:
    """Signals blocked in this thread now: an ``exec`` keeps the mask, so they are what a worker torch starts at
    this moment inherits blocked."""
    return frozenset(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, []))


def reset_signal_mask(blocked: frozenset[int]) -> None:
    """The agent's signal mask instead of the forkserver's, which blocks the agent's notice signals for its own
    protection (``elastic.workers.start_warm_forkserver``); a forked child inherits that mask."""
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def reset_signal_dispositions(ignored: frozenset[int]) -> None:
    """Every signal as ``python -u`` exec'd from the agent would start with: what the agent ignored stays
    ignored, every other signal has its default action, then CPython's own start-up choices (SIGINT raises
    KeyboardInterrupt unless ignored; SIGPIPE and SIGXFSZ ignored). A forked child would keep the forkserver's,
    which it inherited when the agent started it, before torch's agent replaced its handlers: under ``nohup``
    or as a shell's background job a warm worker kept SIGHUP/SIGQUIT ignored where torchrun's has them default."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        target: Any = signal.SIG_IGN if int(sig) in ignored else signal.SIG_DFL
        if sig in (signal.SIGPIPE, signal.SIGXFSZ):
            target = signal.SIG_IGN
        elif sig == signal.SIGINT and target is signal.SIG_DFL:
            target = signal.default_int_handler
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, target)


def _share_stdin() -> Any:
    """A handle on the agent's fd 0 that multiprocessing passes to the forkserver child (torchrun's
    workers inherit the agent's stdin; multiprocessing gives its children /dev/null)."""
    try:
        os.fstat(0)
    except OSError:
        return None
    from multiprocessing import context, reduction  # on use: see the module docstring

    if context.get_spawning_popen() is None:  # not being pickled for a child (e.g. a test calls it directly)
        return None
    return reduction.DupFd(0)


def become_fresh_interpreter(launch: WarmLaunch, target: str, *, module: bool) -> None:
    """Undo, in the forkserver child, everything that differs from a fresh ``python -u`` started by torch."""
    try:
        os.setsid()  # torch starts workers with start_new_session=True: own session and process group
    except OSError:
        pass
    _reset_multiprocessing()
    reset_signal_dispositions(launch.ignored_signals)
    reset_signal_mask(launch.blocked_signals)  # after the handlers: a pending blocked signal meets the new ones
    _reseed_inherited_random_state()
    env = worker_environ(launch.agent_environ, launch.forkserver_environ, dict(os.environ))
    os.environ.clear()
    os.environ.update(env)
    _restore_stdio(launch.stdin)
    first = script_directory(target, module=module)
    sys.path[:] = fresh_sys_path(launch.agent_path, launch.agent_argv0, os.getcwd(), first,
                                 bool(getattr(sys.flags, "safe_path", False)))
    defer_dynamo_import_effects()


#: ``torch.distributed.nn.functional``'s functions whose ``group`` default is ``group.WORLD`` as it was when the
#: module was imported (torch evaluates ``def all_reduce(tensor, op=ReduceOp.SUM, group=group.WORLD)`` once).
_WORLD_DEFAULT_PARAMETER = "group"


def defer_dynamo_import_effects() -> None:
    """Give ``torch.distributed.nn.functional`` the ``group`` defaults a fresh interpreter would give it.

    Under torchrun that module is first imported when the script first touches ``torch._dynamo`` (a lazy
    attribute of ``torch``; ``DistributedDataParallel.__init__`` does, after ``init_process_group``), so its ten
    ``group=group.WORLD`` defaults hold the default process group and keep it alive until the interpreter exits.
    The forkserver imported it (through ``torch._dynamo`` and ``torch.distributed.checkpoint``) before any group
    existed, so in a warm worker they hold None: a script that destroys the group while its DDP module is alive
    then frees the gloo group with the module, with the GIL held, and can deadlock at exit (torch's destructor
    deadlock, pytorch/pytorch#56297 class: a gloo thread waits for the GIL to free the backward pass's
    ``contextvars`` context held by its last allreduce, while the main thread joins it), where torchrun's worker
    exits. CHANGE: ``torch._dynamo`` is made lazy again in the child (the attribute is removed, the module stays
    imported); on the first touch once a default group exists, ``torch``'s own lazy ``__getattr__`` is restored,
    the attribute set back, and those defaults take that group, as the import would have given them. Known
    difference left: a script that touches ``torch._dynamo`` (or imports ``torch.distributed.checkpoint``) before
    ``init_process_group`` gets None under torchrun, the group here (kept alive until exit: no deadlock)."""
    torch = sys.modules.get("torch")
    functional = sys.modules.get("torch.distributed.nn.functional")
    dynamo = sys.modules.get("torch._dynamo")
    if torch is None or functional is None or dynamo is None or torch.__dict__.get("_dynamo") is not dynamo:
        return
    lazy = torch.__dict__.get("__getattr__")
    if not callable(lazy):
        return
    slots = _world_default_slots(functional)

    def first_dynamo_touch(name: str) -> Any:
        if name != "_dynamo":
            return lazy(name)
        world = _default_group()
        if world is None:
            # No group yet: the import would have captured None, which the defaults hold already. Stay armed:
            # torch touches torch._dynamo where it is already imported (init_process_group clears dynamo's trace
            # rule caches "if 'torch._dynamo' in sys.modules"), which under torchrun imports nothing.
            return dynamo
        namespace["__getattr__"] = lazy
        namespace["_dynamo"] = dynamo
        _set_world_defaults(slots, world)
        return dynamo

    namespace = vars(torch)
    namespace["__getattr__"] = first_dynamo_touch
    del namespace["_dynamo"]


def _world_default_slots(module: Any) -> list[tuple[Any, int]]:
    """``(function, index in __defaults__)`` of each function defined in ``module`` whose ``group`` parameter
    defaults to None (what ``group.WORLD`` was when the forkserver imported it)."""
    slots = []
    for value in vars(module).values():
        code = getattr(value, "__code__", None)
        defaults = getattr(value, "__defaults__", None)
        if code is None or not defaults or getattr(value, "__module__", None) != module.__name__:
            continue
        positional = code.co_varnames[:code.co_argcount]
        if _WORLD_DEFAULT_PARAMETER not in positional:
            continue
        index = positional.index(_WORLD_DEFAULT_PARAMETER) - (len(positional) - len(defaults))
        if index >= 0 and defaults[index] is None:
            slots.append((value, index))
    return slots


def _set_world_defaults(slots: list[tuple[Any, int]], world: Any) -> None:
    for function, index in slots:
        defaults = list(function.__defaults__)
        defaults[index] = world
        function.__defaults__ = tuple(defaults)


def _default_group() -> Any:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    member = getattr(c10d, "GroupMember", None)
    return getattr(member, "WORLD", None)


def _reset_multiprocessing() -> None:
    """Fresh-interpreter multiprocessing state: no start method chosen yet (so ``fork`` is the default on
    Linux, as torchrun's workers see), this process is ``MainProcess`` with no parent, its own authkey, and
    its own resource tracker when it needs one (the inherited one is the agent's)."""
    from multiprocessing import context, process, resource_tracker  # on use: see the module docstring

    context._default_context._actual_context = None  # type: ignore[attr-defined]  # private CPython state: a fresh interpreter's
    process._current_process = _main_process()  # type: ignore[attr-defined]  # private CPython state: a fresh interpreter's
    process._parent_process = None  # type: ignore[attr-defined]  # private CPython state: a fresh interpreter's
    process._children = set()  # type: ignore[attr-defined]  # private CPython state: a fresh interpreter's
    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_pid", None) is None and getattr(tracker, "_fd", None) is not None:  # inherited fd
        try:
            os.close(tracker._fd)  # type: ignore[attr-defined]  # private CPython state: a fresh interpreter's
        except OSError:
            pass
        tracker._fd = None  # type: ignore[attr-defined]  # private CPython state: a fresh interpreter's


def _reseed_inherited_random_state() -> None:
    """A fresh interpreter seeds torch's default CPU generator and numpy's global one from OS entropy when
    it imports them; a forked worker would inherit the forkserver's, so every rank of every restart would
    draw the same "random" numbers (initial weights, dropout masks, shuffles). ``random`` reseeds itself
    after a fork; CUDA generators are created fresh (CUDA is never initialised in the forkserver)."""
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    seed = getattr(numpy_random, "seed", None)
    if callable(seed):
        seed()


def _main_process() -> Any:
    """A new ``multiprocessing.process._MainProcess`` (the module deletes that class after using it once)."""
    from multiprocessing import process  # on use: see the module docstring

    class _MainProcess(process.BaseProcess):
        def __init__(self) -> None:
            self._identity = ()
            self._name = "MainProcess"
            self._parent_pid = None
            self._popen = None
            self._closed = False
            authkey = process.AuthenticationString(os.urandom(32))  # type: ignore[attr-defined]  # private CPython class, not in typeshed
            self._config = {"authkey": authkey, "semprefix": "/mp"}

        def close(self) -> None:
            pass

    return _MainProcess()


def _restore_stdio(stdin_handle: Any) -> None:
    """stdin as the agent's fd 0; stdout/stderr as ``python -u`` makes them (unbuffered binary layer,
    write-through text layer), so output interleaves exactly as under torchrun."""
    stdin_fd = None
    if stdin_handle is not None:
        try:
            stdin_fd = stdin_handle.detach()
        except Exception:  # noqa: BLE001 - the handle could not be passed: keep /dev/null
            stdin_fd = None
    if stdin_fd is not None and stdin_fd != 0:
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
    old_in = sys.stdin
    encoding = getattr(sys.__stdout__, "encoding", None) or "utf-8"
    errors = getattr(sys.__stdout__, "errors", None) or "strict"
    buffered = open(0, "rb", closefd=False)  # noqa: SIM115 - the script's stdin, open for its lifetime
    _named(buffered.raw, "<stdin>")
    # `python -u` leaves stdin buffered and never line-buffered; newlines split at "\n" (POSIX).
    new_in = io.TextIOWrapper(buffered, encoding=encoding, errors=errors, newline="\n", line_buffering=False)
    sys.stdin = new_in
    sys.__stdin__ = new_in  # type: ignore[misc]  # a fresh interpreter's original stdin is this one
    if old_in is not None:
        try:
            # multiprocessing's /dev/null wrapper does not own its descriptor (closefd=False): close both.
            old_fd = old_in.fileno()
            old_in.close()
            if old_fd > 2:
                os.close(old_fd)
        except (OSError, ValueError):
            pass
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        if old is None:
            continue
        try:
            old.flush()
        except (OSError, ValueError):
            pass
        raw = _named(io.FileIO(fd, "wb", closefd=False), f"<{name}>")
        text = io.TextIOWrapper(raw, encoding=getattr(old, "encoding", None) or encoding,
                                errors="backslashreplace" if fd == 2 else errors, newline="\n",
                                line_buffering=False, write_through=True)
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


def _named(stream: Any, name: str) -> Any:
    try:
        stream.name = name
    except (AttributeError, TypeError):
        pass
    return stream


def run_as_fresh_interpreter(target: str, args: tuple[str, ...], *, module: bool) -> None:
    """Run ``target`` as ``__main__`` and end as CPython does: on a clean exit (code 0) return normally (torch
    collects the return value); otherwise print like the interpreter, run exit handlers and ``os._exit``."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=sys.modules["builtins"], __annotations__={}, __spec__=None, __package__=None)
    sys.modules["__main__"] = main
    exc: BaseException | None = None
    try:
        if module:
            sys.argv = ["-m", *args]
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]  # what `python -m` calls
        else:
            sys.argv = [target, *args]
            _run_script(main, target)
    except BaseException as caught:  # noqa: BLE001 - the interpreter's top level sees everything
        exc = caught
    if exc is not None and not isinstance(exc, SystemExit):
        tb = _script_traceback(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    code, message = exit_status(exc)
    if message:
        _write_stderr(message)
    interrupted = isinstance(exc, KeyboardInterrupt)
    exc = None  # drop the frames (and their locals) before the exit handlers, as the interpreter does
    code = finalize(code)
    if code == 0 and not interrupted:
        return
    _flush_c_stdio()
    if interrupted:
        # CPython >= 3.8 ends on an uncaught KeyboardInterrupt by re-raising SIGINT with the default action.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _script_traceback(tb: Any) -> Any:
    """The traceback without this module's frames, so it starts where the interpreter's would."""
    here = os.path.normcase(os.path.abspath(__file__))
    while tb is not None and os.path.normcase(os.path.abspath(tb.tb_frame.f_code.co_filename)) == here:
        tb = tb.tb_next
    return tb


def _run_script(main: Any, target: str) -> None:
    path = os.path.abspath(target)
    try:
        with io.open_code(path) as handle:
            source = handle.read()
    except OSError as exc:
        _write_stderr(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n")
        raise SystemExit(2) from None
    main.__file__ = path
    main.__cached__ = None
    main.__loader__ = SourceFileLoader("__main__", path)
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def finalize(code: int) -> int:
    """CPython's ``Py_FinalizeEx`` order: wait for non-daemon threads, run ``atexit`` handlers, flush stdio
    (a failed flush turns exit code 0 into 120)."""
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            if code == 0:
                code = 120
    return code


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _flush_c_stdio() -> None:
    """``os._exit`` skips libc's exit-time flush; C extensions that printf would lose their last lines."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
