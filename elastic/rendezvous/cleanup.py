"""``EndedRun``: the end of a run in etcd: its ``finished`` marker, and its keys once its job ended.

With ``finished_ttl`` the agents of a run that finished successfully leave a ``P/finished`` marker on a lease of
that many seconds (``mark_finished``: the first of them writes it); a newcomer that finds it exits 0 at once
(``raise_if_finished``) instead of starting the finished job again.

A run id can be used again after its job ended (a Kubernetes Job's name, torchrun's default id). The last agent
of the ended job to leave deletes the run's keys (``reap``); when it could not (etcd away, an agent crashed near
the end), a newcomer that finds ``P/ctl/closed`` waits until no node of the ended job is registered and deletes
them (``clear``). Either way one transaction deletes everything under ``P`` but the ``finished`` marker, and
only while the run is still closed and no node is registered: a running job is never touched, and two
newcomers racing to clear the same run are serialised by the compare.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from .api import EtcdRendezvousConfig, RendezvousError, RendezvousFinishedError
from .etcd_client import EtcdConnection, prefix_end
from .health import EtcdHealth
from .keys import RunKeys
from .mirror import SAFETY_RECHECK_S
from .mirror_watch import MirrorWatch

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""


def describe_finished(value: bytes, config: EtcdRendezvousConfig) -> str:
    """The message of a newcomer that found the run's ``finished`` marker (``value``, JSON; any garbage
    still means finished: only a successful end writes the key)."""
    try:
        data = json.loads(value)
        by, when = str(data["by"]), float(data["time"])
        at = f" by node {by} at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(when))}"
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        at = ""
    return (f"run '{config.run_id}' already finished successfully{at}: nothing to do, exiting 0 (its marker "
            f"{config.run_prefix}finished lasts finished_ttl={config.finished_ttl} s after the end; to start a new "
            f"job before then, use another --rdzv-id)")


class EndedRun:
    """The finished marker (``mark_finished``, ``raise_if_finished``) and an ended run's keys (``reap``: its last
    agent deletes them; ``clear``: a newcomer with the same run id does)."""

    def __init__(self, config: EtcdRendezvousConfig, keys: RunKeys, watch: MirrorWatch, health: EtcdHealth,
                 cond: threading.Condition, *, node_id: str, clock: Callable[[], float], ctx: Callable[[], str]) -> None:
        """Args:
            watch: the handler's mirror, and the view it follows (every key while a newcomer clears the run).
            health: a fatal error ends a newcomer's wait.
            cond: the handler's condition (guards the mirror)."""
        self._config = config
        self._keys = keys
        self._node_id = node_id
        self._watch = watch
        self._health = health
        self._cond = cond
        self._clock = clock
        self._ctx = ctx

    def reap(self, conn: EtcdConnection) -> None:
        """The last agent of an ended job to leave deletes every key of the run (closed marker, last round,
        stores), in one transaction that compares that the run is still closed and that no node is registered.

        Why delete rather than keep ``ctl/closed`` as a tombstone for late agents: once no agent of the
        ended job is registered, a newcomer that finds the closed marker clears it and starts a new job anyway
        (run-id reuse, ``clear``), so the marker would protect nobody and only leave keys behind.
        While another agent is still registered (in its exit barrier, or a spare about to see the job closed)
        the compare fails and nothing is deleted: that agent's own shutdown runs this again, and the last one
        wins. Once a newcomer has cleared the run for a new job there is no closed key: nothing is deleted.
        Left behind only when the last agent cannot reach etcd, or an agent crashed within ``lease_ttl`` of
        the end (its key outlives the others): a newcomer with the run id clears those keys as before."""
        prefix = self._config.run_prefix
        try:
            ok = self._delete(conn, None, within=min(2.0, self._config.etcd_timeout))
        except RendezvousError as exc:
            log.warning("%scould not delete the ended run's keys (the next job with this run id will): %s", self._ctx(), exc)
            return
        if ok:
            log.info("%slast agent of the ended job: deleted the run's keys under %s", self._ctx(), prefix)
        else:
            log.info("%sother agents of the ended job are still registered: the last to leave deletes its keys", self._ctx())

    def clear(self, conn: EtcdConnection) -> bool:
        """If this run id's previous job ended (closed), wait for its agents to leave and clear its keys;
        True when it found the run closed.

        Gives up waiting at join_timeout; ``next_rendezvous`` then reports the run as closed. Mirrors every key
        meanwhile (it counts the registered nodes)."""
        with self._cond:
            if not self._watch.mirror.closed:
                return False
            self._watch.clearing = True
        self._watch.change_view()
        try:
            return self._clear_watching_all(conn)
        finally:
            with self._cond:
                self._watch.clearing = False
            self._watch.change_view()

    def _clear_watching_all(self, conn: EtcdConnection) -> bool:
        deadline = self._clock() + self._config.join_timeout
        self._watch.wait_for(lambda m: m.full, deadline)
        announced = found_closed = False
        while True:
            with self._cond:
                self._health.raise_if_fatal()
                mirror = self._watch.mirror
                if not mirror.closed:
                    return found_closed
                found_closed = True
                closed_mod, live, seen = mirror.closed_mod, len(mirror.nodes), mirror.revision
                if live:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        return True
                    if not announced:
                        log.info("%srun id reused: waiting for %d agent(s) of the ended job to leave", self._ctx(), live)
                        announced = True
                    self._cond.wait(min(remaining, SAFETY_RECHECK_S))
                    continue
            if self._delete(conn, closed_mod):
                log.info("%srun id reused: cleared the keys of the ended job", self._ctx())
                self._watch.wait_for(lambda m: not m.closed, deadline)  # the deletes arrive in one watch response
            else:  # another newcomer cleared it, or a node registered: wait for that change, then look again
                self._watch.wait_revision_after(seen, deadline)

    def _delete(self, conn: EtcdConnection, closed_mod: int | None, *, within: float | None = None) -> bool:
        """Delete every key of the run but its ``finished`` marker (which expires on its own lease) in one
        transaction, if it is still closed (by the marker of revision ``closed_mod``; None: any) and no node
        is registered. False when the compare failed."""
        tx = conn.client.transactions
        prefix = self._config.run_prefix
        closed = tx.version(self._keys.closed_key) > 0 if closed_mod is None else tx.mod(self._keys.closed_key) == closed_mod
        compare = [closed, tx.version(self._keys.nodes_prefix, range_end=prefix_end(self._keys.nodes_prefix)) == 0]
        after_marker = self._keys.finished_key + "\0"  # the first key after it
        success = [tx.delete(prefix, range_end=self._keys.finished_key),
                   tx.delete(after_marker, range_end=prefix_end(prefix))]
        ok, _ = conn.call(
            "delete the ended run's keys",
            lambda: conn.client.transaction(compare=compare, success=success, failure=[]),
            within=within,
        )
        return bool(ok)

    def raise_if_finished(self, conn: EtcdConnection) -> None:
        """``RendezvousFinishedError`` when ``finished_ttl`` is on and the run's ``finished`` marker exists."""
        if self._config.finished_ttl <= 0:
            return
        value, _meta = conn.call("read the finished marker", lambda: conn.client.get(self._keys.finished_key))
        if value is None:
            return
        raise RendezvousFinishedError(f"{self._ctx()}{describe_finished(value, self._config)}")

    def mark_finished(self, conn: EtcdConnection, round_number: int | None) -> None:
        """Leave the ``finished`` marker for ``finished_ttl`` s (> 0) unless another agent of the last round
        (``round_number``) wrote it first: one lease, not one per agent; each call bounded by ``close_timeout``."""
        ttl = self._config.finished_ttl
        within = self._config.close_timeout
        existing, _ = conn.call("read the finished marker", lambda: conn.client.get(self._keys.finished_key), within=within)
        if existing is not None:
            return  # another agent of the round wrote it first
        value = json.dumps({"by": self._node_id, "time": time.time(), "round": round_number})
        lease = conn.call("grant the finished marker's lease", lambda: conn.client.lease(ttl), within=within)
        tx = conn.client.transactions
        written, _ = conn.call(
            "write the finished marker",
            lambda: conn.client.transaction(compare=[tx.version(self._keys.finished_key) == 0],
                                            success=[tx.put(self._keys.finished_key, value, lease=lease.id)], failure=[]),
            within=within,
        )
        if written:
            log.info("%srun finished: marker %s kept for %d s (finished_ttl)", self._ctx(), self._keys.finished_key, ttl)
            return
        try:  # another agent wrote it since we looked
            conn.call("revoke the unused lease", lambda: conn.client.revoke_lease(lease.id), within=min(2.0, within))
        except RendezvousError as exc:
            log.debug("%scould not revoke the unused lease %x (it expires in %d s): %s", self._ctx(), lease.id, ttl, exc)
