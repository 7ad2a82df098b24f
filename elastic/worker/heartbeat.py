"""Worker side of hang detection: a 64-byte progress file per worker, beaten by the optimizer or by hand.

Before the script runs (warm workers, spotrun's default: no code in the script needed), :func:`install` maps
this worker's progress file, registers a global ``torch.optim`` post-step hook that bumps the beat counter
(one ``struct.pack_into`` per optimizer step, about a microsecond) and registers a ``faulthandler`` dump of
every thread's Python stack on :data:`DUMP_SIGNAL`, written to a file the agent reads. Loops without an
optimizer (or cold workers, which run the script in a fresh interpreter spotrun cannot reach into) call
:func:`heartbeat`; under stock torchrun, or when the file is absent, it is a no-op.

Drop-in trade-off (documented in docs/concepts/launcher.md): the worker has one extra handler for a real-time signal
(``SIGRTMIN+6``; ``signal.getsignal`` still reports the default, as faulthandler installs it below Python's
signal table), one global optimizer hook (``torch.optim.optimizer._global_optimizer_post_hooks``) and one
open file descriptor. No thread is started and no environment variable is added: the file is found from
``TORCHELASTIC_RUN_ID``, ``GROUP_RANK`` and ``LOCAL_RANK``, which torch sets for every worker.

The file's layout is defined here, where it is beaten; the agent's side (``elastic.progress.ProgressBoard``)
creates the files, samples them and removes them.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import struct
from typing import Any, Final

from elastic.worker.runfiles import run_scoped_path

logger = logging.getLogger(__name__)

SIZE: Final = 64
"""Bytes per progress file: little-endian u64 words (magic, beats, worker pid, main thread id, agent pid, step)."""
MAGIC: Final = 0x3147525054505053  # b"SPPTPRG1"
OFFSET_MAGIC, OFFSET_BEATS, OFFSET_PID, OFFSET_MAIN_THREAD, OFFSET_AGENT = 0, 8, 16, 24, 32
"""Byte offsets of the words. ``OFFSET_AGENT``: pid of the agent that holds the file's lock; 0 in files of a
spotrun from before the lock, which the sweep leaves alone (their agent's death cannot be proven)."""
OFFSET_STEP: Final = 40
"""The training step the worker last completed, plus one (0: never reported; :func:`report_step`)."""
PROGRESS_KIND: Final = "progress"

DUMP_SIGNAL: Final = signal.SIGRTMIN + 6
"""Signal on which an instrumented worker writes all its threads' Python stacks to its dump file."""


def progress_path(run_id: str, group_rank: int | str, local_rank: int | str, root: str | None = None) -> str:
    """Where the worker ``local_rank`` of node ``group_rank`` of run ``run_id`` keeps its beat counter."""
    return run_scoped_path(PROGRESS_KIND, run_id, group_rank, local_rank, root=root)


def dump_path(progress_file: str) -> str:
    return progress_file + ".stack"


class _Worker:
    mm: mmap.mmap | None = None
    attached: bool = False
    dump_file: Any = None


def _attach() -> mmap.mmap | None:
    """Map this worker's progress file once (None, and never again, when spotrun did not create one)."""
    if _Worker.attached:
        return _Worker.mm
    _Worker.attached = True
    run_id, group, local = (os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_RANK"))
    if run_id is None or group is None or local is None:
        return None
    path = progress_path(run_id, group, local)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # not under a spotrun agent (stock torchrun), or hang detection is off
    try:
        mm = mmap.mmap(fd, SIZE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if struct.unpack_from("<Q", mm, OFFSET_MAGIC)[0] != MAGIC:
        mm.close()
        return None
    _register_stack_dump(dump_path(path))
    import threading

    struct.pack_into("<Q", mm, OFFSET_MAIN_THREAD, threading.main_thread().ident or 0)
    struct.pack_into("<Q", mm, OFFSET_PID, os.getpid())  # last: the agent signals only a pid that registered
    _Worker.mm = mm
    return mm


def _register_stack_dump(path: str) -> None:
    import faulthandler

    try:
        _Worker.dump_file = open(path, "w")  # noqa: SIM115 (kept open: faulthandler writes to its fd)
        faulthandler.register(DUMP_SIGNAL, file=_Worker.dump_file, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        logger.debug("stack dumps unavailable", exc_info=True)


def heartbeat() -> None:
    """Report progress (for loops without a ``torch.optim`` optimizer step). Cheap; a no-op outside spotrun.

    Under spotrun the agent's hang detection counts these beats (and optimizer steps, which beat on their
    own in warm workers): a worker without beats or CPU time past its budget is hung. Call it where real
    progress is made, not in a loop that polls while stuck. Never raises: without the agent's progress file
    (torchrun, a single process) it does nothing.
    """
    mm = _Worker.mm if _Worker.attached else _attach()
    if mm is not None:
        struct.pack_into("<Q", mm, OFFSET_BEATS, struct.unpack_from("<Q", mm, OFFSET_BEATS)[0] + 1)


def report_step(step: int) -> None:
    """Tell the agent the training step this worker just completed (``spotrun_training_step``). Cheap; a no-op
    outside spotrun. ``elastic.preemption.Preemption.save_and_stop`` calls it every step; call it yourself in a
    loop without one. Never raises; a negative or non-integer step is ignored."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63 - 1:
        return
    mm = _Worker.mm if _Worker.attached else _attach()
    if mm is not None:
        struct.pack_into("<Q", mm, OFFSET_STEP, step + 1)


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    heartbeat()


def install() -> bool:
    """Instrument this worker (called by spotrun's warm-worker entrypoint before the script runs)."""
    if _attach() is None:
        return False
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:  # no torch: heartbeat() still works
        return True
    register_optimizer_step_post_hook(_on_optimizer_step)
    return True
