"""Tie each worker's life to its agent, even when the agent is SIGKILLed.

torch starts workers with ``start_new_session=True`` so that the agent can signal a worker's whole process
group; the side effect is that a SIGKILLed agent leaves its workers running (orphans holding GPUs, ports and
half-finished collectives). spotrun therefore starts every worker through a tiny exec shim (this file run as a
script, stdlib only; the two first steps are ``checkpoint._sys.procutil.arm_parent_death_signal``) that:

1. sets ``PR_SET_PDEATHSIG = SIGKILL`` (Linux), so the kernel kills the worker when its parent dies;
2. checks ``getppid()`` against the agent PID *after* setting it (belt and braces: if the agent died between
   fork and prctl, the signal would never fire, so the shim exits instead);
3. ``execvp``\\ s the real command, keeping the PID, environment, stdio and session torch set up, so torch's
   monitoring, error files and exit codes are untouched.

PDEATHSIG fires on the death of the parent *thread* that forked, not the process: workers must be spawned
from a thread that lives as long as the agent. ``LocalElasticAgent._start_workers`` runs in the agent's main
thread, which is exactly that.

Function entrypoints (``--run-path``) are started by multiprocessing; :class:`PdeathsigEntrypoint` applies the
same two steps at the top of the child.

Warm workers (spotrun default for Python scripts, ``--no-warm-workers`` to disable): instead of a fresh
interpreter per worker (``python -u script.py``, which imports torch again on every restart: docs/benchmarks.md), the
script runs as a function entrypoint (:class:`ScriptEntrypoint`) in a process forked from a multiprocessing
*forkserver* that imported torch (and torch._dynamo) once, at agent start, in parallel with the first
rendezvous. Each restart then costs a fork. Before the script runs, the child is made indistinguishable from
torchrun's ``python -u script.py`` (``elastic.warm``: start method, ``atexit``, exit codes and tracebacks,
stdin, stdio buffering, environment, ``sys.path``, own session). Where that is impossible (an environment
variable read at ``import torch`` changed since the forkserver imported it) the agent starts plain
subprocesses instead and says so once (:func:`fall_back_to_plain_workers`).
"""

from __future__ import annotations

# multiprocessing and logging are imported where they are used ("on use: keeps the shim light"): the exec
# shim runs this file with ``python -S`` for every worker, and they would double its start-up time.
import importlib.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any


def _load_procutil() -> ModuleType:
    """``checkpoint/_sys/procutil.py`` (standard library only), loaded by its path, never through the package.

    This module runs as the exec shim (``python -S``, where the package may not be importable), is preloaded
    in the warm forkserver and arms every worker's parent-death signal before its script starts. Importing
    ``checkpoint._sys.procutil`` would bind the name ``checkpoint`` there first, and a training script's own
    ``checkpoint`` module would then be ours (``DEFAULT_PRELOAD`` keeps that name out on purpose).
    """
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint", "_sys", "procutil.py")
    spec = importlib.util.spec_from_file_location("_spotrun_procutil", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from checkpoint._sys.procutil import ORPHANED_EXIT_CODE, arm_parent_death_signal
else:
    _procutil = _load_procutil()
    ORPHANED_EXIT_CODE, arm_parent_death_signal = _procutil.ORPHANED_EXIT_CODE, _procutil.arm_parent_death_signal
if __package__:  # not as the exec shim, which needs procutil alone
    from elastic.boot import adopt
    from elastic.warm import (
        DEFAULT_PRELOAD,
        WarmLaunch,
        agent_environ_now,
        become_fresh_interpreter,
        forkserver_environ,
        note_forkserver_environ,
        note_forkserver_failure,
        run_as_fresh_interpreter,
        script_directory,
        shadowed_preloads,
        warm_fallback_reason,
    )
    from elastic.worker.heartbeat import install as observe_progress


def shim_command(entrypoint: str, args: tuple[Any, ...], agent_pid: int | None = None) -> tuple[str, tuple[Any, ...]]:
    """Rewrite ``entrypoint args...`` into ``python -S workers.py AGENT_PID entrypoint args...``.

    ``-S`` skips ``site`` so the shim costs a few milliseconds; it imports only the standard library.
    """
    pid = os.getpid() if agent_pid is None else agent_pid
    return sys.executable, ("-S", os.path.abspath(__file__), str(pid), entrypoint, *args)


class PdeathsigEntrypoint:
    """Picklable wrapper of a function entrypoint that arms the parent-death signal first (``--run-path``)."""

    def __init__(self, fn: Callable[..., Any], agent_pid: int | None = None) -> None:
        self.fn = fn
        self.agent_pid = os.getpid() if agent_pid is None else agent_pid
        # torch names the entrypoint after ``__name__`` in its events and failure summary.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        # The parent is the agent (spawn) or the agent's forkserver (warm workers).
        arm_parent_death_signal(agent_pid=self.agent_pid)
        release_forkserver_alive_fd()
        if not isinstance(self.fn, ScriptEntrypoint):
            # A script must not see an extra thread (threading.enumerate, fork-with-threads warnings); for
            # it the chain suffices: the forkserver exits when the agent does, and PDEATHSIG follows.
            watch_agent(self.agent_pid)
        return self.fn(*args)


def release_forkserver_alive_fd() -> None:
    """Close the forkserver's "alive" pipe end that multiprocessing hands to every forkserver child.

    The forkserver exits when that pipe's write ends are all closed, but each child inherits one (so that
    it could reuse the server), so a forkserver and its children keep each other alive after the agent
    dies. The child never uses it: its own ``ensure_running`` would start a new forkserver anyway."""
    try:
        from multiprocessing import forkserver  # on use: keeps the shim light
    except ImportError:
        return
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is not None and fd is not None and getattr(server, "_forkserver_pid", None) is None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def watch_agent(agent_pid: int) -> None:
    """Belt and braces for workers whose parent is not the agent (forkserver children): a daemon thread
    waits on a pidfd of the agent and SIGKILLs this worker the moment the agent exits."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return
    try:
        pidfd = pidfd_open(agent_pid)
    except ProcessLookupError:
        os._exit(ORPHANED_EXIT_CODE)
    except OSError:  # kernel without pidfd support: PR_SET_PDEATHSIG still applies
        return

    def wait_for_agent_exit() -> None:
        select.select([pidfd], [], [])  # a pidfd becomes readable when the process exits
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_agent_exit, name="spotrun-agent-watch", daemon=True).start()


class ScriptEntrypoint:
    """Run a Python script (or ``-m`` module) as torchrun's ``python -u`` would, inside an already warm
    interpreter (see ``elastic.warm`` for every difference removed)."""

    def __init__(self, target: str, *, module: bool = False, python: str = sys.executable,
                 options: tuple[str, ...] = ("-u",)) -> None:
        self.target = target
        self.module = module
        self.python = python
        self.options = options
        # torch names entrypoints after __name__ (events); the failure summary uses the launcher's name.
        self.__name__ = target if module else os.path.basename(target)

    def cold_command(self, args: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
        """The plain ``python -u [-m] target args...`` torchrun would run."""
        return self.python, (*self.options, *(("-m",) if self.module else ()), self.target, *args)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled in the agent once per worker start: capture what the child must reproduce *now*.
        return dict(self.__dict__, launch=WarmLaunch())

    def __call__(self, *args: str) -> None:
        launch = self.__dict__.get("launch") or WarmLaunch()
        become_fresh_interpreter(launch, self.target, module=self.module)
        observe_progress()  # hang detection: optimizer-step beats and stack dumps, no thread (elastic.progress)
        run_as_fresh_interpreter(self.target, tuple(args), module=self.module)


def warm_entrypoint(cmd: Any, cmd_args: list[str], python: str = sys.executable) -> tuple[ScriptEntrypoint, list[str]] | None:
    """Turn torchrun's ``python -u [-m] target args...`` into a warm entrypoint; None if it is not that shape
    (``--no-python`` binaries, ``--run-path`` functions, other interpreters)."""
    if not isinstance(cmd, str) or os.path.realpath(cmd) != os.path.realpath(python):
        return None
    rest = list(cmd_args)
    options: tuple[str, ...] = ()
    if rest[:1] == ["-u"]:
        rest, options = rest[1:], ("-u",)
    module = rest[:1] == ["-m"]
    if module:
        rest = rest[1:]
    if not rest or rest[0].startswith("-"):
        return None
    return ScriptEntrypoint(rest[0], module=module, python=cmd, options=options), rest[1:]


def _shadow_reason(script: ScriptEntrypoint) -> str | None:
    """Why a warm worker of ``script`` would import one of the preloaded packages from the wrong place."""
    def origin_of(name: str) -> str | None:
        module = sys.modules.get(name)
        if module is not None:
            return getattr(module, "__file__", None)
        spec = importlib.util.find_spec(name)
        return spec.origin if spec is not None else None

    search = [script_directory(script.target, module=script.module), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    tops = sorted({name.split(".")[0] for name in DEFAULT_PRELOAD})
    shadowed = shadowed_preloads(tops, search, origin_of)
    if not shadowed:
        return None
    return (f"the script would import its own {', '.join(shadowed)}, but the warm forkserver already imported "
            f"that name from spotrun's environment")


def fall_back_to_plain_workers(spec: Any) -> str | None:
    """If ``spec`` starts warm script workers and a warm worker started now could be told apart from
    torchrun's, rewrite ``spec`` to the plain (PDEATHSIG-shimmed) ``python -u`` command for good and return
    why; None when warm workers stay."""
    entry = spec.entrypoint
    script = entry.fn if isinstance(entry, PdeathsigEntrypoint) else entry
    if not isinstance(script, ScriptEntrypoint):
        return None
    reason = warm_fallback_reason(forkserver_environ(), agent_environ_now(os.environ)) or _shadow_reason(script)
    if reason is None:
        return None
    command, args = script.cold_command(tuple(spec.args))
    if isinstance(entry, PdeathsigEntrypoint):
        command, args = shim_command(command, args, entry.agent_pid)
    spec.entrypoint, spec.args = command, args
    return reason


class DeathClock:
    """Notes when each worker process of a multiprocessing context dies, as it happens (a daemon thread
    waits on the process sentinels). torch polls every monitor interval and, for multiprocessing workers,
    reports only the first dead process in sentinel order, so the crash that caused the others is often
    not the one reported; exact death times let the agent name the true root cause."""

    def __init__(self, sentinels: dict[int, int], clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self.died_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(dict(sentinels),), name="spotrun-death-clock",
                                        daemon=True)
        self._thread.start()

    def _watch(self, pending: dict[int, int]) -> None:
        from multiprocessing.connection import wait  # on use: keeps the shim light

        by_fd = {fd: rank for rank, fd in pending.items()}
        while by_fd and not self._stop.is_set():
            try:
                ready = wait(list(by_fd), timeout=0.2)
            except (OSError, ValueError):  # torch closed a sentinel after joining its process
                return
            now = self._clock()
            for fd in ready:
                self.died_at.setdefault(by_fd.pop(fd), now)  # type: ignore[arg-type]  # wait() returns the ints it got

    def note(self, ranks: Iterable[int]) -> None:
        """Note ``ranks`` dead now unless noted already: the agent saw them exit before this thread did (it
        runs late on a loaded machine) and is about to stop the rest, which must not count as their cause.
        Ranks noted together tie; the agent then orders them by their error files' timestamps."""
        now = self._clock()
        for rank in ranks:
            self.died_at.setdefault(rank, now)

    def stop(self) -> None:
        self._stop.set()


def wait_for_workers(processes: list[Any] | None, returns: Any, timeout: float) -> bool:
    """Block up to ``timeout`` s until a worker process exits or hands a return value to its agent (torch's
    ``MultiprocessContext._ret_vals`` queues, when given). True when one did; False on timeout or when there
    is nothing to wait on (then it sleeps ``timeout``, as the monitor loop would).

    The agent waits on this while its workers head for an agreed step: it acts the moment they finish,
    instead of at its next monitor tick (up to ``--monitor-interval`` later, on the resume path of every
    planned change)."""
    from multiprocessing.connection import wait  # on use: keeps the shim light

    waitables: list[Any] = [proc.sentinel for proc in processes or [] if proc.is_alive()]
    if isinstance(returns, dict):
        waitables += [getattr(queue, "_reader", None) for queue in returns.values()]
    waitables = [w for w in waitables if w is not None]
    if not waitables:
        time.sleep(max(0.0, timeout))
        return False
    try:
        return bool(wait(waitables, timeout=max(0.0, timeout)))
    except (OSError, ValueError):  # torch closed a sentinel or queue meanwhile: the next poll sees why
        return True


def terminate_processes(processes: list[Any], grace: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to every live ``multiprocessing`` process, wait up to ``grace`` s, then SIGKILL the rest.
    A process that leads its own process group (warm workers, like torchrun's) is signalled as a group, as
    torch's ``SubprocessHandler.close`` does, so its DataLoader workers stop with it."""
    from multiprocessing.connection import wait  # on use: keeps the shim light

    alive = [proc for proc in processes if proc.is_alive()]
    for proc in alive:
        signal_worker(proc.pid, sig)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        wait([proc.sentinel for proc in alive], timeout=max(0.0, deadline - time.monotonic()))
        alive = [proc for proc in alive if proc.is_alive()]
    for proc in alive:
        signal_worker(proc.pid, signal.SIGKILL)


def signal_worker(pid: int, sig: int) -> None:
    """Signal a worker, as a process group when it leads one; quietly if it is gone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_warm_forkserver(preload: tuple[str, ...] | None = None, *, wait_timeout: float = 300.0,
                          shielded: Sequence[int] = ()) -> float:
    """Start multiprocessing's forkserver, importing ``preload`` in it, and wait until it can fork, so that
    every worker (first and restarted) is forked from a warm interpreter (``preload`` None: ``DEFAULT_PRELOAD``).
    Returns the seconds it took.

    ``shielded`` signals are blocked in the forkserver for its life (it is started with them blocked; the
    agent's own mask is restored at once, and a signal that arrived meanwhile is delivered to the agent then):
    a scheduler that signals every process of the job step (Slurm) must not end it, which would make every
    worker's exit status read 255 (multiprocessing's "forkserver gone") and leave nothing to fork the next
    group from. Each warm worker resets its mask to the agent's (``elastic.warm``), as ``python -u`` inherits it.

    Waiting *before* the first rendezvous matters for scale-up: a node that joins a running job only
    interrupts the others once it can start its workers at once, instead of making the whole group wait
    for its ``import torch``. The forkserver exits when the agent dies (its alive pipe hits EOF). The
    environment it started with, and the one its children inherit after its imports, are remembered for
    ``elastic.warm`` (fallback decision and the workers' environment)."""
    import multiprocessing  # on use: keeps the shim light
    from multiprocessing import forkserver, resource_tracker

    preload = DEFAULT_PRELOAD if preload is None else preload
    began = time.monotonic()
    # A forkserver started before the agent's imports (elastic.boot), used when it matches this one exactly.
    early = adopt(preload, [int(s) for s in shielded], os.environ)
    started_with = dict(os.environ) if early is None else early
    if early is None:
        forkserver.set_forkserver_preload(list(preload))
        # The signal mask survives fork and exec: the forkserver starts with these blocked. The resource tracker
        # first: starting it unblocks SIGINT and SIGTERM in the caller (multiprocessing.resource_tracker).
        resource_tracker.ensure_running()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, list(shielded)) if shielded else None
        try:
            forkserver.ensure_running()
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_send_environ, args=(send,), name="spotrun-warmup")
    probe.start()  # returns once the forkserver has finished its imports and forked
    send.close()
    after_imports = started_with
    global _forkserver_cuda
    if receive.poll(wait_timeout):
        try:
            after_imports, _forkserver_cuda = receive.recv()
        except EOFError:
            pass
    receive.close()
    probe.join(wait_timeout)
    note_forkserver_environ(started_with, after_imports)
    why = cuda_fork_problem(_forkserver_cuda)
    if why is not None:
        import logging  # on use: keeps the shim light

        logging.getLogger(__name__).warning("warm workers: %s; starting plain workers instead", why)
        note_forkserver_failure(why)
    return time.monotonic() - began


_forkserver_cuda: bool | None = None
"""Whether the warm forkserver had initialised CUDA when it forked its first child (None: not known yet)."""


def forkserver_cuda_initialized() -> bool | None:
    """Whether the warm forkserver initialised CUDA (its first child inherited a CUDA context it cannot use);
    None before ``start_warm_forkserver`` heard from it."""
    return _forkserver_cuda


def cuda_fork_problem(initialized: bool | None) -> str | None:
    """Why warm workers cannot be used when the forkserver initialised CUDA: a forked child of a process with
    a CUDA context cannot initialise CUDA itself (torch raises "Cannot re-initialize CUDA in forked
    subprocess"), so every GPU worker would fail; None when it did not (or nobody knows)."""
    if not initialized:
        return None
    return ("a module preloaded in the warm forkserver initialised CUDA, and a process forked from it cannot use "
            "CUDA")


def inherited_cuda_context() -> bool:
    """In a forked child: True when the parent had initialised CUDA (torch marks the child a "bad fork").
    Never initialises CUDA itself, and is False where torch was not imported."""
    cuda = sys.modules.get("torch.cuda")
    bad_fork = getattr(cuda, "_is_in_bad_fork", None)
    return bool(bad_fork()) if callable(bad_fork) else False


def _send_environ(conn: Any) -> None:
    try:
        conn.send((dict(os.environ), inherited_cuda_context()))
        conn.close()
    except OSError:  # the launcher was stopped (SIGTERM) while warming up: nobody is listening, nothing to say
        pass


def _shim_main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.stderr.write("usage: python -S workers.py AGENT_PID COMMAND [ARGS...]\n")
        os._exit(2)
    arm_parent_death_signal(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    _shim_main(sys.argv[1:])
