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

The keeper ends only when its agent says so (the pipe closes) or dies, never on a notice: Slurm signals every
process of the step (``scancel --signal``, ``--signal=TERM@N`` to the process group), a terminal's Ctrl-C or
hang-up reaches the whole group, and a keeper that left then would take this node's snapshots with it just as the
agent starts a planned leave. So it ignores :data:`NOTICE_SIGNALS` (blocked from before its exec until they are
ignored: no window at start) and learns of its agent's death from :data:`KEEPER_DEATH_SIGNAL`, a real-time signal
nothing sends as a notice.

A keeper that dies while its agent lives (the OOM killer, a stray ``kill -9``) is seen at once by the agent's
watch thread (``Keeper._watch``, waiting on the process), logged once per death, and replaced (at most
:data:`KEEPER_RESTARTS` times), so the guarantee above holds again. The snapshots themselves do not depend on
it: a keeper SIGKILLed leaves them in place and the next restore still reads them. A keeper that was sent its
death signal by hand removed the directory as it left: the watch makes it again (empty), so the workers' next
snapshots have somewhere to go and their next restore falls back to a peer's memory or the durable tier.

The agent's named POSIX semaphores: multiprocessing's forkserver and spawn contexts (torch's worker contexts:
their finished-event and queues) create ``/dev/shm/sem.mp-*`` files that only the agent's own finalizers or its
resource tracker unlink. A node lost whole (the agent, its workers and its resource tracker SIGKILLed) left them
behind. So the keeper reads the agent's ``/proc/PID/maps`` every :data:`SEMAPHORE_SCAN_INTERVAL` seconds and,
when the semaphores mapped there change, keeps their names in :data:`SEMAPHORES`, in the directory; whoever
removes the directory of an agent that died (its keeper, or the next agent's sweep) unlinks those too. ``close``
of a live agent leaves them to the agent's finalizers.

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
import re
import secrets
import select
import signal
import stat
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
NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""Signals a scheduler, a terminal or a user sends to a whole job as a notice: the keeper ignores them (its agent
decides what a notice means, then closes the keeper's pipe)."""
KEEPER_DEATH_SIGNAL = signal.SIGRTMIN
"""What the kernel sends the keeper when its agent dies (``PR_SET_PDEATHSIG``): a signal no notice uses."""
SEMAPHORES = ".semaphores"
"""In a keeper directory: the agent's named semaphores (``sem.*`` names in ``/dev/shm``), one a line."""
SEMAPHORE_SCAN_INTERVAL = 1.0
"""Seconds between the keeper's reads of its agent's mapped semaphores (one small /proc read)."""
_SEM_ROOT = "/dev/shm"
_SEM_NAME = re.compile(r"sem\.[A-Za-z0-9_.-]{1,200}")
_SEMAPHORES_MAX_BYTES = 1 << 16


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
            remove_dir(self.path, semaphores=False)  # this agent lives: its finalizers unlink its semaphores
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

    # Blocked in this thread across the fork and the exec, so inherited blocked: a notice to the whole group
    # while the keeper's interpreter starts stays pending until the keeper ignores it (_serve).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, NOTICE_SIGNALS)
    try:
        proc = subprocess.Popen(
            keeper_command(path, os.getpid()), stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(lock_fd,),
            close_fds=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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


def remove_dir(path: str, *, semaphores: bool = True) -> None:
    """Remove a keeper directory: the semaphores it lists (``semaphores``: its agent is dead), then the
    snapshots, the lock file last, and the directory."""
    if semaphores and os.path.exists(os.path.join(path, SEMAPHORES)):
        unlink_semaphores(os.path.join(path, SEMAPHORES))
    remove_owned_dir(path, OWNER_LOCK)


def mapped_semaphore_inodes(pid: int) -> frozenset[int] | None:
    """Inodes of the named POSIX semaphores process ``pid`` has mapped; None where ``/proc`` cannot tell, and
    for a process without any mapping (one being torn down: its memory goes before its files, the keeper's pipe).
    glibc maps a semaphore under the temporary name it created it by (``sem.XXXXXX``, shown deleted) before
    linking it to its real name: the inode, not the mapped name, finds the real one (:func:`semaphore_names`)."""
    prefix = f"{_SEM_ROOT}/sem."
    found: set[int] = set()
    mapped = False
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                mapped = True
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(prefix) and parts[4].isdigit():
                    found.add(int(parts[4]))
    except OSError:
        return None
    return frozenset(found) if mapped else None


def semaphore_names(inodes: frozenset[int]) -> set[str]:
    """Names (``sem.*`` in ``/dev/shm``) of this user's semaphores with one of these inodes."""
    if not inodes:
        return set()
    names: set[str] = set()
    with contextlib.suppress(OSError), os.scandir(_SEM_ROOT) as entries:
        for entry in entries:
            if entry.name.startswith("sem.") and _SEM_NAME.fullmatch(entry.name) and entry.inode() in inodes:
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                        names.add(entry.name)
    return names


def record_semaphores(path: str, names: set[str]) -> None:
    """Write ``names`` as the directory's :data:`SEMAPHORES` list (replaced whole: a reader never sees half)."""
    tmp = os.path.join(path, f"{SEMAPHORES}.tmp")
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as out:
            out.write("".join(f"{name}\n" for name in sorted(names)))
        os.replace(tmp, os.path.join(path, SEMAPHORES))


def unlink_semaphores(listing: str) -> int:
    """Unlink the semaphores a :data:`SEMAPHORES` file names: only well-formed ``sem.*`` names of regular files
    in ``/dev/shm`` owned by this user (the file is read, not trusted). Returns how many were unlinked."""
    try:
        with open(listing, "rb") as f:
            text = f.read(_SEMAPHORES_MAX_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return 0
    unlinked = 0
    for name in text.splitlines():
        if not _SEM_NAME.fullmatch(name):
            continue
        target = os.path.join(_SEM_ROOT, name)
        try:
            info = os.lstat(target)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                os.unlink(target)
                unlinked += 1
        except OSError:
            continue  # gone already (its agent's finalizer or resource tracker was first)
    return unlinked


def remove_orphaned_keepers(root: str | None = None, *, limit: int = SWEEP_LIMIT) -> int:
    """Remove this user's keeper directories under ``root`` whose agent and keeper are both gone (their lock is
    free); returns how many were removed. Directories without a lock (being created) are left alone."""
    stem = keeper_prefix(root)
    folder = os.path.dirname(stem)
    removed = remove_orphaned_dirs(folder, os.path.basename(stem), OWNER_LOCK, limit=limit,
                                   before_removal=lambda path: unlink_semaphores(os.path.join(path, SEMAPHORES)))
    if removed:
        logger.info("removed %d memory tier director(ies) of dead agents under %s", removed, folder)
    return removed


AGENT_EXIT_WAIT = 3.0
"""How long the keeper, sent its death signal, waits for the agent's pipe to close before taking the agent for alive."""


def _pipe_closed_within(seconds: float) -> bool:
    """Whether the agent's end of the keeper's pipe (fd 0) closes within ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            ready, _, _ = select.select([0], [], [], left)
            if ready and not os.read(0, 4096):
                return True
        except OSError:
            return True
    return False


def _serve(path: str, agent_pid: int) -> None:
    """Keeper process: remove ``path`` when the agent goes (pipe closed, or the agent's death); notices are
    ignored."""
    def leave(*_: Any) -> None:
        # The pipe's end: a closing agent removed the directory, its lock file last, before closing the pipe; a
        # lock file still here is a dead agent's, and so are the semaphores listed beside it.
        remove_dir(path, semaphores=os.path.exists(os.path.join(path, OWNER_LOCK)))
        os._exit(0)

    def on_death_signal(*_: Any) -> None:
        # Sent when the agent's thread that started this keeper ends, which is no proof yet (this process is then
        # the child of another of the agent's threads: getppid() cannot tell), or by hand. A dying agent's last
        # thread closes the pipe; a live agent's semaphores are its own to unlink.
        remove_dir(path, semaphores=_pipe_closed_within(AGENT_EXIT_WAIT))
        os._exit(0)

    for notice in NOTICE_SIGNALS:  # pending ones (sent while this process started blocked) are dropped here
        signal.signal(notice, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, NOTICE_SIGNALS)
    signal.signal(KEEPER_DEATH_SIGNAL, on_death_signal)
    arm_parent_death_signal(sig=KEEPER_DEATH_SIGNAL)
    if os.getppid() != agent_pid:  # the agent died before the signal was armed
        leave()
    with contextlib.suppress(OSError):
        os.write(1, KEEPER_READY)
        os.close(1)
    known: frozenset[int] = frozenset()
    while True:
        inodes = mapped_semaphore_inodes(agent_pid)
        if inodes is not None and inodes != known and os.getppid() == agent_pid:  # our parent's, not a reused PID
            record_semaphores(path, semaphore_names(inodes))
            known = inodes
        try:
            ready, _, _ = select.select([0], [], [], SEMAPHORE_SCAN_INTERVAL)
            if ready and not os.read(0, 4096):
                break  # the agent closed the pipe (or died)
        except OSError:
            break
    leave()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
