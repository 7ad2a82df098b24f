"""Background threads of the checkpointer yield the CPU to training (a leaf module: no package imports)."""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer (Linux: per-thread nice), so background checkpoint
    threads yield the CPU to the training thread; a no-op where unsupported or when ``nice`` is 0."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # pragma: no cover - e.g. seccomp; priority is an optimisation only
        logger.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, exc)
