"""The worker's peer-loss watcher: when the agent says a peer is gone, abort the training's process group.

A collective on a lost peer does not always fail by itself: NCCL hangs until its watchdog's timeout (or the
watchdog ends the process), gloo waits as long as the peer's connections stay open (a paused or cut-off node).
The main thread is then stuck in C++: no signal handler runs, no just-in-time snapshot is taken, and the agent
can only kill the worker after its stop grace. The agent knows of the loss first (the peer's lease, a probe of
its liveness port); it posts ``peer-lost.json`` to its workers' mailbox, and this thread, polling for it (one
``stat`` every :data:`POLL_INTERVAL`), aborts the group (:func:`elastic.worker.abort.abort_process_group`).
The blocked collective raises a broken-connection error, which the training loop handles as a peer's death
(``checkpoint.memory.jit``: snapshot the last completed step, then exit).

Started by :class:`~elastic.worker.preemption.Preemption` under spotrun (a mailbox) and announced to the agent
(``watching-{local_rank}``), which then waits for its workers' snapshots after any peer loss, silent ones too.
Under stock torchrun there is no mailbox and no watcher.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic.worker.mailbox import Mailbox

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.02
"""Seconds between two looks at the mailbox (a ``stat``: microseconds)."""

_wrapper_watching = False


def set_wrapper_watching(on: bool) -> None:
    """``elastic.inplace.run`` watches this process's default group for the entry in progress (on), or no longer."""
    global _wrapper_watching
    _wrapper_watching = on


def wrapper_watching() -> bool:
    """The in-place wrapper already watches: a ``Preemption`` helper built in its entry starts no watcher."""
    return _wrapper_watching


class PeerLossWatcher:
    """A daemon thread that calls ``abort`` once, when the agent posts a peer loss for this worker group."""

    def __init__(self, mailbox: Mailbox, local_rank: int, abort: Callable[[], object], *,
                 interval: float = POLL_INTERVAL) -> None:
        """Args:
            mailbox: the agent's mailbox.
            local_rank: this worker's local rank (for its ``watching-{local_rank}`` mark).
            abort: what to call on a peer loss (aborts the training's group; may raise).
            interval: seconds between two polls.
        """
        self._mailbox = mailbox
        self._local_rank = local_rank
        self._abort = abort
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spotrun-peer-loss-watcher", daemon=True)
        self.fired = threading.Event()
        """Set once ``abort`` was called."""

    def start(self) -> PeerLossWatcher:
        """Start polling, then tell the agent this worker watches (so it waits for the snapshot it enables)."""
        self._thread.start()
        try:
            self._mailbox.register_watcher(self._local_rank)
        except OSError as exc:
            logger.debug("could not register the peer-loss watcher: %s", exc)
        return self

    def stop(self) -> None:
        """Stop polling (the group is being replaced or the training ended)."""
        self._stopped.set()

    def _posted(self) -> bool:
        try:
            return self._mailbox.peer_lost_posted()
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if not self._posted():
                continue
            self.fired.set()
            try:
                self._abort()
            except Exception as exc:  # noqa: BLE001 - a watcher thread must not die with a traceback
                logger.warning("a peer is gone but the process group could not be aborted: %s", exc)
            return
