"""Agent side of hang detection: the workers' progress files, sampled with ``/proc``, and on-demand stack dumps.

The worker side (the beat counter a worker bumps, its stack dump on a signal, and the file's layout) is
``elastic.worker.heartbeat``; its public names are re-exported here, where they were first defined
(``from elastic.progress import heartbeat`` keeps working).

:class:`ProgressBoard` creates the files before the workers start, samples them together with the main
thread's CPU ticks and run state from ``/proc``, asks for stack dumps and removes the files. The agent holds
an ``flock`` on each of its files (taken before the file gets its name) for as long as it uses it: the kernel
drops it when the agent dies, even by SIGKILL, so the next agent on the host removes the files a killed agent
left behind (:func:`remove_orphaned_progress_files`), as ``elastic.worker.mailbox`` does for the mailboxes.
Workers only ``open`` and ``mmap`` the file: the advisory lock does not concern them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import shutil
import stat
import struct
import subprocess
import time
from collections.abc import Iterable

from elastic.hang import ProgressSample
from elastic.worker.heartbeat import DUMP_SIGNAL as DUMP_SIGNAL
from elastic.worker.heartbeat import MAGIC as MAGIC
from elastic.worker.heartbeat import OFFSET_AGENT as _AGENT
from elastic.worker.heartbeat import OFFSET_BEATS as _BEATS
from elastic.worker.heartbeat import OFFSET_MAGIC as _MAGIC
from elastic.worker.heartbeat import OFFSET_MAIN_THREAD as _MAIN_THREAD
from elastic.worker.heartbeat import OFFSET_PID as _PID
from elastic.worker.heartbeat import OFFSET_STEP as _STEP
from elastic.worker.heartbeat import PROGRESS_KIND as PROGRESS_KIND
from elastic.worker.heartbeat import SIZE as SIZE
from elastic.worker.heartbeat import dump_path as dump_path
from elastic.worker.heartbeat import heartbeat as heartbeat
from elastic.worker.heartbeat import install as install
from elastic.worker.heartbeat import progress_path as progress_path
from elastic.worker.heartbeat import report_step as report_step
from elastic.worker.runfiles import SWEEP_LIMIT, hold_owner_lock, lock_if_orphaned, sweep_candidates
from elastic.worker.runfiles import run_scoped_path as run_scoped_path
from elastic.worker.runfiles import run_scoped_prefix as run_scoped_prefix

logger = logging.getLogger(__name__)


def read_main_thread(pid: int) -> tuple[str, int] | None:
    """(run state, activity) of ``pid``'s main thread from /proc, None if it is gone. Activity is the
    thread's CPU time in ns (``schedstat``), which every wake-up advances, so a loop that sleeps between
    cheap steps still shows progress; the coarse ``stat`` ticks (10 ms) are the fallback."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as handle:
            activity = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        activity = (int(fields[11]) + int(fields[12])) * 10_000_000
    return fields[0], activity


class ProgressBoard:
    """The agent's view of its workers' progress files (one per local rank, recreated per worker start)."""

    def __init__(self, run_id: str, root: str | None = None) -> None:
        self._run_id = run_id
        self._root = root
        self._maps: dict[int, mmap.mmap] = {}
        self._paths: dict[int, str] = {}
        self._inodes: dict[str, int] = {}
        self._locks: dict[str, int] = {}
        """path -> descriptor holding the file's flock (see the module docstring)."""

    def reset(self, group_rank: int, local_ranks: Iterable[int]) -> None:
        """Fresh zeroed files for workers about to start (a new inode: old workers cannot write into it)."""
        self.close()
        for local_rank in local_ranks:
            path = progress_path(self._run_id, group_rank, local_rank, self._root)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dump_path(path))
            fd, mm = _create_locked(path)
            self._maps[local_rank] = mm
            self._paths[local_rank] = path
            self._inodes[path] = os.fstat(fd).st_ino
            self._locks[path] = fd

    def sample(self, local_rank: int, pid: int) -> ProgressSample | None:
        """Beats, main-thread activity and stopped state of one worker; None when its process is gone."""
        proc = read_main_thread(pid)
        if proc is None:
            return None
        mm = self._maps.get(local_rank)
        beats = struct.unpack_from("<Q", mm, _BEATS)[0] if mm is not None else 0
        state, activity = proc
        return ProgressSample(beats=beats, activity=activity, stopped=state in ("T", "t"))

    def step(self, local_rank: int) -> int | None:
        """The training step the worker last reported (``report_step``), None when it never did."""
        mm = self._maps.get(local_rank)
        value = struct.unpack_from("<Q", mm, _STEP)[0] if mm is not None else 0
        return value - 1 if value else None

    def main_thread_id(self, local_rank: int) -> int | None:
        mm = self._maps.get(local_rank)
        value = struct.unpack_from("<Q", mm, _MAIN_THREAD)[0] if mm is not None else 0
        return value or None

    def _instrumented(self, local_rank: int, pid: int) -> bool:
        mm = self._maps.get(local_rank)
        return mm is not None and struct.unpack_from("<Q", mm, _PID)[0] == pid

    def stacks(self, pids: dict[int, int], timeout: float = 1.0) -> dict[int, str]:
        """Python stacks of the given workers (local rank -> pid): faulthandler dumps from instrumented
        workers, else ``py-spy dump`` when py-spy is installed; workers that cannot answer are left out."""
        asked: dict[int, str] = {}
        for local_rank, pid in pids.items():
            path = self._paths.get(local_rank)
            if path is None or not self._instrumented(local_rank, pid):
                continue
            try:
                os.truncate(dump_path(path), 0)
                os.kill(pid, DUMP_SIGNAL)
            except OSError:
                continue
            asked[local_rank] = dump_path(path)
        dumps = _collect_dumps(asked, timeout)
        for local_rank, pid in pids.items():
            if local_rank not in dumps and local_rank not in asked:
                text = py_spy_dump(pid)
                if text:
                    dumps[local_rank] = text
        return dumps

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        for path in self._paths.values():
            try:
                if os.stat(path).st_ino != self._inodes.get(path):
                    continue  # another agent of this run (on this host) now owns the name: leave it be
            except FileNotFoundError:
                continue
            for name in (path, dump_path(path)):
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass
        for fd in self._locks.values():  # after the unlinks: a sweep never sees a live agent's file unlocked
            os.close(fd)
        self._maps.clear()
        self._paths.clear()
        self._inodes.clear()
        self._locks.clear()


def _create_locked(path: str) -> tuple[int, mmap.mmap]:
    """A zeroed progress file at ``path`` (replacing a stale one), locked before it gets its name so that a
    sweep that sees the name can never take the lock of a live agent; returns (lock descriptor, mapping)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # our own leftover; another user's name here makes the O_EXCL below fail instead
    # Sized and marked under the temporary name, locked (hold_owner_lock) before the rename: a sweep that sees
    # the name finds the agent's pid in it and can never take the lock of a live agent.
    fd = hold_owner_lock(path, tmp, prepare=_zeroed_progress_file)
    try:
        mm = mmap.mmap(fd, SIZE)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd, mm


def _zeroed_progress_file(fd: int) -> None:
    """A fresh progress file: ``SIZE`` zero bytes but the agent's pid and the magic number."""
    os.ftruncate(fd, SIZE)
    os.pwrite(fd, struct.pack("<Q", os.getpid()), _AGENT)
    os.pwrite(fd, struct.pack("<Q", MAGIC), _MAGIC)


def remove_orphaned_progress_files(root: str | None = None, *, limit: int = SWEEP_LIMIT) -> int:
    """Remove this user's progress files (and their stack dumps) under ``root`` whose agent died without
    removing them (SIGKILL, or killed after a SIGTERM grace ran out); returns how many were removed.

    A file counts as orphaned only when it carries an agent pid (made by a spotrun that locks it) and its
    lock is free: a live agent holds it from before the name exists until after it unlinks the name. Looks at
    most at ``limit`` candidates. Half-created ``.tmpPID`` files are never touched (unlocked for an instant)."""
    stem = run_scoped_prefix(PROGRESS_KIND, root)  # ".../spotrun-progress-{uid}-"
    folder = os.path.dirname(stem)
    names = sweep_candidates(folder, os.path.basename(stem), limit=limit, skip=_is_aux_name)
    removed = sum(_remove_if_orphaned(path) for path in names)
    if removed:
        logger.info("removed %d progress file(s) of dead agents under %s", removed, folder)
    return removed


def _is_aux_name(name: str) -> bool:
    """A stack dump (removed with its progress file) or a file being created (``.tmpPID``)."""
    return name.endswith(".stack") or re.search(r"\.tmp\d+$", name) is not None


def _remove_if_orphaned(path: str) -> bool:
    opened: list[os.stat_result] = []

    def made_by_a_locking_agent(fd: int) -> bool:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size < SIZE:
            return False  # /dev/shm is shared: never another user's file, nor something else by that name
        if struct.unpack("<Q", os.pread(fd, 8, _AGENT))[0] == 0:
            return False  # no lock to prove its agent dead
        opened.append(info)
        return True

    fd = lock_if_orphaned(path, made_by_a_locking_agent)
    if fd is None:
        return False  # not ours, unreadable, or its agent lives
    try:
        if os.stat(path, follow_symlinks=False).st_ino != opened[0].st_ino:
            return False  # replaced since we opened it (a new agent of that run): not ours to judge
        # Left: a new agent of the same run and ranks on this host renaming its file onto this name between
        # the check above and the unlink below (a third agent sweeping at that instant) loses that file: a
        # worker that had not attached yet then cannot, and is judged by its /proc activity alone.
        for name in (path, dump_path(path)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        return True
    except OSError as exc:
        logger.debug("cannot check progress file %s: %s", path, exc)
        return False
    finally:
        os.close(fd)


def _collect_dumps(asked: dict[int, str], timeout: float) -> dict[int, str]:
    """Wait (bounded) until each asked worker's dump file stops growing; a stopped worker never writes."""
    deadline = time.monotonic() + timeout
    sizes: dict[int, int] = {}
    done: dict[int, str] = {}
    while len(done) < len(asked) and time.monotonic() < deadline:
        time.sleep(0.05)  # faulthandler writes from a signal handler: nothing to wait on but the file
        for local_rank, path in asked.items():
            if local_rank in done:
                continue
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            if size and sizes.get(local_rank) == size:
                with open(path, errors="replace") as handle:
                    done[local_rank] = handle.read()
            sizes[local_rank] = size
    return done


def py_spy_dump(pid: int, timeout: float = 10.0) -> str | None:
    """``py-spy dump --pid`` output when py-spy is installed (works on uninstrumented workers)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 and out.stdout else None
