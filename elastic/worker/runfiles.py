"""Per-user, per-run file names that an agent and its workers both derive from what torch gives every worker
(``TORCHELASTIC_RUN_ID``, ``GROUP_RANK``, ``LOCAL_RANK``): the progress files (``elastic.worker.heartbeat``),
the links to the mailboxes (``elastic.worker.mailbox``) and the memory tier's keeper directories."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile


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
