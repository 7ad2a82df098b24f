"""The exit barrier: an agent whose workers finished waits for the peers of its round to finish too.

CHANGE: torch's barrier waits ``exit_barrier_timeout`` (300 s) for every peer, then reports success, even when a
peer has left the group: that peer never arrives, and a run that is not over would end as a success. Here the
barrier returns False at once when a peer of this round is gone (the agent re-forms instead), ends by this
node's notice deadline, and skips the store for a group of one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousError

from elastic.membership import MembershipView, first_line, warn_one_line

logger = logging.getLogger(__name__)

ARRIVED_KEY = "spotrun/exit_barrier/arrived"
"""The store counter each agent of the round increments once when it reaches the barrier."""
PAUSE_S = 0.1


class ExitBarrier:
    """Waits on a round's store for its peers, watching the membership; ``leave_by()``: the wall-clock time
    this node must leave by (its notice's deadline minus the stop grace) or None, asked at every pause."""

    def __init__(self, membership: MembershipView, *, timeout: float, leave_by: Callable[[], float | None],
                 ctx: Callable[[], str]) -> None:
        self.membership = membership
        self.timeout = timeout
        self._leave_by = leave_by
        self._ctx = ctx

    def wait(self, store: Store, size: int) -> bool:
        """True when every peer of the round (``size`` nodes) arrived, on a rendezvous error (the workers
        finished), by this node's notice deadline or after ``timeout``; False when a peer left."""
        if size <= 1:
            return True  # no peer to wait for (torch's barrier of one only touches the store)
        notices = self.membership.notices
        assert notices is not None, "the barrier watches lost peers: only with a NoticeAwareHandler"
        began = time.monotonic()
        try:
            store.add(ARRIVED_KEY, 1)
            while time.monotonic() - began < self.timeout:
                if int(store.add(ARRIVED_KEY, 0)) >= size:
                    return True
                if (leave_by := self._leave_by()) is not None and time.time() >= leave_by:
                    # This node's workers finished; its notice leaves no time to wait for the peers' own finish.
                    logger.warning("%s preemption notice: leaving the exit barrier (this node's workers finished)",
                                   self._ctx())
                    return True
                if notices.lost_peers():
                    logger.warning("%s peers %s left while this node finished: the run is not over", self._ctx(),
                                   sorted(notices.lost_peers()))
                    return False
                self._pause(PAUSE_S)
        except RendezvousError as exc:
            warn_one_line(logger, exc, "%s exit barrier failed (%s); the workers finished, reporting success",
                          self._ctx(), first_line(exc))
            return True
        logger.error("%s peers did not finish within %.0f s", self._ctx(), self.timeout)
        return True

    def _pause(self, seconds: float) -> None:
        """A permanent rendezvous error ends the barrier (raised), since the handler can no longer show a peer
        that left, and waiting out the timeout would only hide it."""
        if not self.membership.wait(seconds, raise_permanent=True):
            return
        time.sleep(seconds)  # a waiting node also counts as a change: do not spin while it waits
