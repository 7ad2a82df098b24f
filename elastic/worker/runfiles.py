"""Per-user, per-run files in a shared ``/dev/shm`` or ``/tmp``: their names, their owner lock, their orphan sweep.

The names are those an agent and its workers both derive from what torch gives every worker
(``TORCHELASTIC_RUN_ID``, ``GROUP_RANK``, ``LOCAL_RANK``): the progress files (``elastic.worker.heartbeat``),
the links to the mailboxes (``elastic.worker.mailbox``) and the memory tier's keeper directories. The agent's
lock-owned run files and directories (mailboxes, keeper directories, progress files) are created with their
owner lock and swept when their owner died with the helpers below, one way for all three. Standard library
only: the memory tier's keeper process (``python -I -S``) loads this file by its path."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import re
import stat
import tempfile
from collections.abc import Callable


def _root() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def run_scoped_path(kind: str, run_id: str, *ranks: int | str, root: str | None = None) -> str:
    """A per-user file name an agent and its workers both derive from what torch gives every worker
    (``TORCHELASTIC_RUN_ID``, ``GROUP_RANK``, ``LOCAL_RANK``): no environment variable of ours needed."""
    # Readable part cut and sanitised; the digest of the whole id keeps two jobs whose ids differ only past
    # 80 characters or in sanitised characters apart (one host may run several jobs of one user).
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:80] + "." + hashlib.sha256(run_id.encode()).hexdigest()[:8]
    name = "-".join(["spotrun", kind, str(os.getuid()), safe, *(str(rank) for rank in ranks)])
    return os.path.join(root or _root(), name)


def run_scoped_prefix(kind: str, root: str | None = None) -> str:
    """The common start of every ``run_scoped_path(kind, ...)`` of this user (for sweeping them)."""
    return os.path.join(root or _root(), "-".join(["spotrun", kind, str(os.getuid()), ""]))


# --------------------------------------------------------------------------- lock-owned run files and directories
# The agent's run files live in a shared /dev/shm (or /tmp): the mailboxes (elastic.worker.mailbox), the memory
# tier's keeper directories (elastic.memory_keeper) and the progress files (elastic.progress). Each is owned
# through an flock held by its agent (and by whatever inherits the descriptor) for its whole life: the kernel
# drops it when the owner dies, even by SIGKILL, so the next agent on the host removes what a dead one left.

SWEEP_LIMIT = 256
"""Most candidates one sweep looks at (bounded work at agent start); the next agent goes on."""
SWEEP_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
"""How a sweeper opens a lock: the names are guessable in a shared directory, so a symlink planted there is never
followed and a FIFO never blocks the agent's start."""


def hold_owner_lock(lock_path: str, tmp_path: str | None = None,
                    prepare: Callable[[int], None] | None = None) -> int:
    """Create ``lock_path`` (mode 0600) holding its ``flock``; the descriptor holds it until closed.

    Locked under a temporary name (``tmp_path``, default ``LOCK_PATH.PID``), given its content by
    ``prepare(fd)``, and only then renamed: a sweeper that sees the name can never take the lock of a live
    owner, nor see the file half made. ``O_EXCL | O_NOFOLLOW``: a name planted by another user makes this fail
    instead of writing through it (a symlink to another file, a FIFO).
    """
    tmp = tmp_path or f"{lock_path}.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if prepare is not None:
            prepare(fd)
        os.rename(tmp, lock_path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def create_owned_dir(path: str, lock_name: str, *, exist_ok: bool = False) -> int:
    """Make the directory ``path`` (mode 0700, ``exist_ok``: it may exist already) and its owner lock
    ``lock_name`` in it; returns the descriptor holding the lock."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not exist_ok:
            raise
    return hold_owner_lock(os.path.join(path, lock_name))


def lock_if_orphaned(lock_path: str, check: Callable[[int], bool] | None = None) -> int | None:
    """A descriptor now holding the lock at ``lock_path`` when its owner is gone, else None (its owner lives,
    there is no lock yet, or ``check(fd)`` refused what was opened before the lock was tried)."""
    try:
        fd = os.open(lock_path, SWEEP_OPEN_FLAGS)
    except OSError:
        return None
    try:
        if check is not None and not check(fd):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_owned_dir(path: str, lock_name: str) -> None:
    """Remove an owned directory: its files, the lock file last, then the directory (whatever is gone already
    is skipped)."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    for name in sorted(names, key=lambda n: n == lock_name):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


def sweep_candidates(folder: str, prefix: str, *, limit: int = SWEEP_LIMIT,
                     skip: Callable[[str], bool] | None = None) -> list[str]:
    """Paths in ``folder`` whose name starts with ``prefix`` (less those ``skip`` names), at most ``limit``: a
    random sample when there are more, since entries that are never removed (live ones) could otherwise keep
    every sweep on the same first names."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix) and not (skip and skip(n))]
    except OSError:
        return []
    if len(names) > limit:
        names = random.sample(names, limit)
    return [os.path.join(folder, name) for name in names]


def remove_orphaned_dirs(folder: str, prefix: str, lock_name: str, *, limit: int = SWEEP_LIMIT) -> int:
    """Remove this user's directories ``folder/prefix*`` whose owner lock is free; returns how many. A directory
    without its lock (being created) is left alone, and so is anything of another user or not a directory."""
    removed = 0
    for path in sweep_candidates(folder, prefix, limit=limit):
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        fd = lock_if_orphaned(os.path.join(path, lock_name))
        if fd is None:
            continue
        try:
            remove_owned_dir(path, lock_name)
            removed += 1
        finally:
            os.close(fd)
    return removed
