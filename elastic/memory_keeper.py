"""The per-node owner of the memory tier's shared memory: a directory in ``/dev/shm`` per agent, and its keeper.

The agent creates the directory at start (``Keeper.create``), names it to its workers in
``SPOTRUN_MEMORY_DIR`` and removes it at exit (``Keeper.close``). Snapshots are tmpfs files: they hold host
RAM without any process holding them, so what must be guaranteed is only that somebody deletes them.

Why a keeper process beside the agent, not the agent alone: an agent killed by SIGKILL (the OOM killer, a
``kill -9`` of the launcher) runs no cleanup, and on a node that is not reused for spotrun there is no next
agent start to sweep it, so the snapshots (a whole model and optimizer per node) would hold RAM until reboot.
The keeper (``python -I -S .../elastic/memory_keeper.py DIR AGENT_PID``, standard library only, a few MB)
waits on a pipe from the agent and on ``PR_SET_PDEATHSIG``; when the agent dies, however it dies, it removes the
directory and exits. It is started by file path in isolated mode, never with ``-m``: ``-m`` puts the agent's
working directory (the user's training repository) first on ``sys.path``, and a repository with its own
``checkpoint.py`` or ``elastic/`` would have its module imported in place of ours (the keeper would die at
start, and nothing would free the shared memory after a SIGKILL). It is also the seam for what comes next: serving this node's snapshots to a peer (issue 17, peer
replication) belongs in this process, which outlives the workers.

A keeper that dies while its agent lives (the OOM killer, a stray ``kill``) is seen at once by the agent's
watch thread (``Keeper._watch``, waiting on the process), logged once per death, and replaced (at most
:data:`KEEPER_RESTARTS` times), so the guarantee above holds again. The snapshots themselves do not depend on
it: a keeper SIGKILLed leaves them in place and the next restore still reads them. A keeper that got a SIGTERM
removed the directory as it left: the watch makes it again (empty), so the workers' next snapshots have
somewhere to go and their next restore falls back to a peer's memory or the durable tier.

Orphans (agent and keeper both killed, e.g. a process-group SIGKILL): the directory holds ``.owner.lock``,
``flock``-ed from before the directory is used until after it is removed, by the agent, and inherited by the
keeper (one open file description: the lock is held while either lives). The next agent on the host removes
every directory of this user whose lock is free (:func:`remove_orphaned_keepers`), as
``elastic.progress`` and ``elastic.worker.mailbox`` do for theirs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from types import ModuleType
from typing import Any


def _load_file(*parts: str) -> ModuleType:
    """A standard-library-only file of this tree (``parts`` from its root) loaded by its path: the keeper
    process runs without the packages on ``sys.path``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(f"_spotrun_keeper_{parts[-1][:-3]}", os.path.join(root, *parts))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __package__:
    from checkpoint._sys.procutil import arm_parent_death_signal
    from checkpoint.memory.api import MEMORY_KIND, OWNER_LOCK
    from elastic.worker.runfiles import (
        SWEEP_LIMIT,
        create_owned_dir,
        remove_orphaned_dirs,
        remove_owned_dir,
        run_scoped_path,
        run_scoped_prefix,
    )
else:
    # The keeper process (``python -I -S memory_keeper.py``): sys.path holds the standard library only, so nothing
    # of the user's working directory, PYTHONPATH or site-packages can be imported in place of ours. The two
    # names are checked against checkpoint.memory.api by a test.
    MEMORY_KIND, OWNER_LOCK = "memtier", ".owner.lock"  # type: ignore[misc]  # the keeper process's copy
    arm_parent_death_signal = _load_file("checkpoint", "_sys", "procutil.py").arm_parent_death_signal
    _runfiles = _load_file("elastic", "worker", "runfiles.py")
    SWEEP_LIMIT, remove_owned_dir = _runfiles.SWEEP_LIMIT, _runfiles.remove_owned_dir

logger = logging.getLogger(__name__)

KEEPER_EXIT_TIMEOUT = 10.0
KEEPER_START_TIMEOUT = 10.0
"""How long the agent waits for the keeper to say it is armed (an isolated interpreter starts in ~20 ms)."""
KEEPER_READY = b"armed\n"
KEEPER_RESTARTS = 3
"""Most times an agent starts its keeper again after it died (a keeper that keeps dying is not worth more)."""


def _default_root() -> str:
    import tempfile

    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def keeper_prefix(root: str | None = None) -> str:
    """The common start of this user's keeper directories under ``root``."""
    return run_scoped_prefix(MEMORY_KIND, root or _default_root())


class Keeper:
    """This agent's keeper directory (and, with ``process``, its keeper process)."""

    def __init__(self, path: str, lock_fd: int, process: subprocess.Popen[bytes] | None) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd
        self.process = process
        self.restarts = 0
        """Keepers started again after one died while this agent lived."""
        self._mutex = threading.Lock()
        """Held while the process or the lock descriptor change (the watch thread replacing a dead keeper)."""
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        if process is not None and process.poll() is None:  # one that died at start was logged: not retried
            # Must outlive every keeper it starts: PR_SET_PDEATHSIG fires when the *thread* that forked the
            # keeper exits, and the keeper would then remove the directory of a live agent.
            self._watcher = threading.Thread(target=self._watch, name="memtier-keeper-watch", daemon=True)
            self._watcher.start()

    @classmethod
    def create(cls, run_id: str, root: str | None = None, *, process: bool = True) -> Keeper:
        """Sweep orphans of dead agents under ``root``, then make and lock this agent's directory
        (``spotrun-memtier-{uid}-{run}.{hash}-{pid}-{token}``) and start its keeper process."""
        root = root or _default_root()
        remove_orphaned_keepers(root)
        path = run_scoped_path(MEMORY_KIND, run_id, os.getpid(), secrets.token_hex(4), root=root)
        lock_fd = create_owned_dir(path, OWNER_LOCK)
        proc = _start_keeper(path, lock_fd) if process else None
        logger.info("memory tier keeper directory %s (keeper pid %s)", path, proc.pid if proc else None)
        return cls(path, lock_fd, proc)

    def close(self) -> None:
        """Remove the directory and stop the keeper (idempotent)."""
        self._closing.set()  # before anything dies: the watch must not take the keeper's exit for a death
        with self._mutex:
            remove_dir(self.path)
            if self.process is not None:
                if self.process.stdin is not None:
                    with contextlib.suppress(OSError):
                        self.process.stdin.close()
                try:
                    self.process.wait(timeout=KEEPER_EXIT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=KEEPER_EXIT_TIMEOUT)
                self.process = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # last: a sweep never sees the directory of a live agent unlocked
                self._lock_fd = None
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=KEEPER_EXIT_TIMEOUT)
            self._watcher = None

    def _watch(self) -> None:
        """Watch thread: wait on the keeper process; when it dies while this agent lives, replace it."""
        while True:
            with self._mutex:
                proc = self.process
            if proc is None:
                return
            code = proc.wait()
            with self._mutex:
                if self._closing.is_set() or self.process is not proc:
                    return
                self._replace(proc.pid, code)

    def _replace(self, pid: int, code: int) -> None:
        """A keeper died while its agent lives: say so (once per death), make the directory again if it took it
        with it, and start another, at most KEEPER_RESTARTS times. Called with ``_mutex`` held."""
        assert self.process is not None
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        gone = not os.path.isdir(self.path)
        if self.restarts >= KEEPER_RESTARTS:
            logger.error("memory tier keeper (pid %d) for %s died (exit code %s), %d times now: not starting another; "
                         "if this agent is SIGKILLed its snapshots stay in host memory until the next agent start on "
                         "this host sweeps them", pid, self.path, code, self.restarts + 1)
            self.process = None
            return
        logger.error("memory tier keeper (pid %d) for %s died (exit code %s) while its agent lives: starting another "
                     "(%d of %d)%s", pid, self.path, code, self.restarts + 1, KEEPER_RESTARTS,
                     "; it removed the directory and the snapshots in it: the next restore on this node comes from a "
                     "peer's memory or the durable tier" if gone else "; the snapshots are intact")
        if gone:
            self._remake_dir()
        assert self._lock_fd is not None
        self.process = _start_keeper(self.path, self._lock_fd)
        self.restarts += 1

    def _remake_dir(self) -> None:
        """Make the directory again, locked before it is used (the old lock file went with the old directory)."""
        old, self._lock_fd = self._lock_fd, create_owned_dir(self.path, OWNER_LOCK, exist_ok=True)
        if old is not None:
            os.close(old)


def keeper_command(path: str, agent_pid: int) -> list[str]:
    """The keeper's command line: this file run in isolated mode (``-I``: no working directory, script
    directory, PYTHONPATH or user site on ``sys.path``; ``-S``: no site-packages)."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), path, str(agent_pid)]


def _start_keeper(path: str, lock_fd: int) -> subprocess.Popen[bytes]:
    """Start the keeper and wait (bounded) for it to say it is armed; a keeper that died is logged as an error
    (the tier still works, but a SIGKILLed agent would leave its snapshots until the next agent's sweep)."""
    import selectors

    proc = subprocess.Popen(
        keeper_command(path, os.getpid()), stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(lock_fd,),
        close_fds=True,
    )
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=KEEPER_START_TIMEOUT)
    line = proc.stdout.readline() if ready else b""
    proc.stdout.close()
    proc.stdout = None
    if line == KEEPER_READY:
        return proc
    try:
        code: int | None = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        code = proc.poll()
    if code is None:
        logger.warning("memory tier keeper (pid %d) for %s did not report ready within %.0f s; going on with it",
                       proc.pid, path, KEEPER_START_TIMEOUT)
    else:
        logger.error("memory tier keeper for %s exited at start with code %s (see its stderr above): the "
                     "snapshots will not be freed if this agent is SIGKILLed (the next agent start on this host "
                     "sweeps them)", path, code)
    return proc


def remove_dir(path: str) -> None:
    """Remove a keeper directory: the snapshots, then the lock file, then the directory."""
    remove_owned_dir(path, OWNER_LOCK)


def remove_orphaned_keepers(root: str | None = None, *, limit: int = SWEEP_LIMIT) -> int:
    """Remove this user's keeper directories under ``root`` whose agent and keeper are both gone (their lock is
    free); returns how many were removed. Directories without a lock (being created) are left alone."""
    stem = keeper_prefix(root)
    folder = os.path.dirname(stem)
    removed = remove_orphaned_dirs(folder, os.path.basename(stem), OWNER_LOCK, limit=limit)
    if removed:
        logger.info("removed %d memory tier director(ies) of dead agents under %s", removed, folder)
    return removed


def _serve(path: str, agent_pid: int) -> None:
    """Keeper process: remove ``path`` when the agent goes (pipe closed, SIGTERM, or the agent's death)."""
    def leave(*_: Any) -> None:
        remove_dir(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the agent decides
    arm_parent_death_signal(sig=signal.SIGTERM)
    if os.getppid() != agent_pid:  # the agent died before the signal was armed
        leave()
    with contextlib.suppress(OSError):
        os.write(1, KEEPER_READY)
        os.close(1)
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    leave()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
