"""The local memory tier: each rank snapshots its state into its node's keeper directory in host shared memory.

``LocalShmTier`` is a coordinator over small parts, one module each: ``nodeplan`` (who snapshots what), ``slots``
(the reused shared-memory files and their room), ``vote`` (one small all-reduce per round), ``cadence`` (the
interval), ``publish`` (checksums, manifest, rename; the round in flight) and ``jit`` (a snapshot after a failed
collective); through ``hooks`` it calls a ``Replication`` (none here, ``buddy.BuddyCopies`` in ``peer``) and a
``Restorer`` (``localrestore.LocalRestore`` here, ``peerrestore.PeerRestore`` in ``peer``).

A round (``snapshot``, every ``config.every`` steps, on every rank): flatten the state (``flatcache``); read the
vote that ran behind the last round, or vote on the caller's thread when something changed (the first snapshot,
items changed, a rank skipped, ``when_busy="skip"``); replan when the items changed; copy into a slot (the only
time training blocks); then, on the background thread: publish, the replication hook, and with ``when_busy="wait"``
the next round's vote. A local failure is a vote, never a rank out of step; a vote that raises on a rank stops its
periodic snapshots (``stopped``), and the others' next vote fails in turn after at most ``collective_timeout``.
A rank without room makes every rank turn the tier off at the next vote.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed import ProcessGroup

from checkpoint._sys.procutil import process_gone
from checkpoint.api import JSON
from checkpoint.collective import open_collectives
from checkpoint.memory import jit
from checkpoint.memory.api import ENV_MEMORY_DIR, MemoryTierError, RestoreReport, ShmSpaceError, SnapshotId
from checkpoint.memory.cadence import Cadence
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.flatcache import FlatCache
from checkpoint.memory.hooks import NoReplication, Replication, Restorer
from checkpoint.memory.localrestore import GROUPS_LOOKED_AT, READ_PART_BYTES, LocalRestore, read_threads
from checkpoint.memory.nodeplan import NodePlan, Signature, plan_node, signature
from checkpoint.memory.once import WarnOnce
from checkpoint.memory.publish import InFlight, Publisher, remove_superseded
from checkpoint.memory.slots import SLOTS, Slot, Slots, check_room, size_problem
from checkpoint.memory.vote import PUBLISH_FAILURES_TO_STARVE, Vote, Votes
from checkpoint.state import FlatState, forget_optimizer_state, uninitialised_optimizers

logger = logging.getLogger(__name__)


class LocalShmTier:
    """``MemoryTier`` over this node's keeper directory (``SPOTRUN_MEMORY_DIR``, set by the spotrun agent).

    Construct it on every rank after the process group (collective, like the Checkpointer). Without a keeper
    directory on some rank (stock torchrun, a single process without ``directory``) the tier is off on every
    rank, said once: snapshots then cost nothing and ``restore`` returns None.
    """

    def __init__(
        self,
        directory: str | None = None,
        config: MemoryTierConfig | None = None,
        *,
        process_group: ProcessGroup | None = None,
        node: str | None = None,
    ) -> None:
        self.config = config or MemoryTierConfig()
        self.directory = directory if directory is not None else os.environ.get(ENV_MEMORY_DIR)
        self.group, behind = open_collectives(process_group, self.config.collective_timeout, 2)
        """The caller's thread's collectives (votes, plans, restores)."""
        self.votes = Votes(self.group, behind)
        self.rank, self.world_size = self.group.rank, self.group.world_size
        usable = self.directory is not None and os.path.isdir(self.directory) and os.access(self.directory, os.W_OK)
        (missing,) = self.group.any(not usable)
        self.enabled = not missing
        if not self.enabled:
            why = "no keeper directory here" if not usable else "another rank has no keeper directory"
            logger.warning(
                "[rank %d] memory tier off: %s (%s is set by the spotrun agent; under stock torchrun there is none)",
                self.rank, why, ENV_MEMORY_DIR,
            )
        self.gen: str = self.group.rank0_decides(lambda: secrets.token_hex(4))
        """This group of workers' snapshot generation (the same on every rank; new at every start)."""
        self.node = node or f"{socket.gethostname()}:{self.directory}"
        self.warnings = WarnOnce(logger)
        self.flat_cache = FlatCache()
        """The state's items between snapshots: no DCP state dicts while the tensors stay the same."""
        self.cadence = Cadence(self.config)
        self.slots = Slots(self.directory or "", self.gen, self.rank, self.config)
        self.publisher = Publisher(gen=self.gen, rank=self.rank, world_size=self.world_size, node=self.node,
                                   block_bytes=self.config.checksum_block_bytes)
        self.inflight = InFlight()
        self.plan: NodePlan | None = None
        """The last snapshot plan (None before the first snapshot)."""
        self.replication: Replication = NoReplication()
        self.restorer: Restorer = LocalRestore(self.group, self.directory or "", self.config)
        self.last_fallback_reason: str | None = None
        """Why the last ``restore`` returned None (the caller's durable restore reports it), else None."""
        self.stopped: str | None = None
        """Why this rank takes no more periodic snapshots (a vote of the tier raised here: it cannot know what the
        other ranks agreed, so it joins no further vote), else None. Just-in-time snapshots still work."""
        self._signature: Signature | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.directory!r}, rank={self.rank}/{self.world_size}, gen={self.gen})"

    @property
    def interval(self) -> int:
        """The snapshot interval in use, in steps (with ``every="auto"``: the one the ranks last agreed on)."""
        return self.cadence.every

    @property
    def nbytes(self) -> int:
        """Host shared memory this rank's slots hold (header + data each)."""
        return self.slots.nbytes

    @property
    def last_stage_seconds(self) -> float:
        """Seconds the last snapshot blocked the caller: what ``every="auto"`` weighs."""
        return self.cadence.last_stage_seconds

    @property
    def snapshots_published(self) -> int:
        return self.publisher.count

    @property
    def votes_blocking(self) -> int:
        """Votes this rank ran on the caller's thread (the first snapshot, after changes)."""
        return self.votes.blocking

    # ------------------------------------------------------------------ snapshot
    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        # The first call plans even at a step it does not snapshot: a just-in-time snapshot (which has no
        # collective to plan with) is then possible from the first step on. Every rank makes the same calls.
        started = time.perf_counter()
        self.cadence.clock_step(started)
        if not self.enabled or self.stopped is not None or (step % self.cadence.every and self._signature is not None):
            return False
        flat: FlatState | None
        try:
            flat = self.flat_cache.flatten(state)
        except Exception as exc:  # noqa: BLE001 - said in the vote (a skipped round), never a rank out of step
            self.warnings.warn("state", "[rank %d step %d] memory snapshot skipped: %s", self.rank, step, exc)
            flat = None
        if self.votes.due:  # the last round's vote ran behind it (every rank decides this alike)
            self.votes.due = False
            steady = self._steady_snapshot(step, flat, started)
            if steady is not None:
                return self._settled(steady)
        return self._settled(self._voted_snapshot(step, flat, started))

    def _settled(self, started: bool) -> bool:
        """``synchronous``: the snapshot just started is published and copied before training goes on."""
        if started and self.config.synchronous:
            began = time.perf_counter()
            self.wait()
            now = time.perf_counter()
            self.cadence.blocked_more(now - began, now)
        return started

    def _voted_snapshot(self, step: int, flat: FlatState | None, started: float) -> bool:
        """A round decided by a vote on the caller's thread."""
        if self.config.when_busy == "wait":
            self.wait()
        elif self.inflight.future is not None and self.inflight.future.done():
            self.wait()  # read a finished publish's outcome before the vote (skip mode replaces the future)
        busy = self.inflight.busy()
        sig = None if flat is None else signature(flat)
        proposed = self._proposal(step)
        try:
            vote = self.votes.vote_now(bad=flat is None or proposed is None, changed=sig != self._signature,
                                       busy=busy, published=self.publisher.published,
                                       every=proposed if proposed is not None else self.cadence.every)
        except Exception as exc:  # noqa: BLE001 - the other ranks may have an outcome this rank has not
            self._leave(step, f"its snapshot vote failed: {exc}")
            return False
        if not self._apply(step, vote) or vote.skipped or vote.busy or flat is None:
            return False
        if vote.changed:
            self._replan(flat)
        if step % self.cadence.every:
            return False  # the first call, planned only (or "auto" just chose a larger interval)
        return self._take(step, flat, started, vote.waited)

    def _steady_snapshot(self, step: int, flat: FlatState | None, started: float) -> bool | None:
        """A round decided by the vote behind the last one, with no collective on the caller's thread; None when
        that vote calls for one here (a rank skipped its last snapshot)."""
        blocked_at = time.perf_counter()
        self.wait()  # the last round's publish, replication and vote: normally long done
        blocked = time.perf_counter() - blocked_at
        vote = self.votes.take_outcome()
        if vote is None:  # it raised here; another rank may have got its outcome and be snapshotting now
            self._leave(step, "its vote behind the last snapshot failed")
            return False
        if vote.skipped:
            return None
        if not self._apply(step, vote) or step % self.cadence.every:
            return False
        if flat is None or signature(flat) != self._signature:
            # The other ranks go on with this round: take part in its background part without a snapshot, and
            # say so; the next round is then voted on every rank (and replans).
            self._submit(None, step, {}, {}, skipped=True)
            return False
        return self._take(step, flat, started, min(blocked, vote.waited))

    def _apply(self, step: int, vote: Vote) -> bool:
        """Adopt a vote's outcome (the same on every rank); False when the tier turned off."""
        self.votes.complete = vote.complete
        self.cadence.adopt(vote.every, rank=self.rank, step=step)
        if vote.starved:
            self.enabled = False
            self.warnings.warn("starved", "[rank %d step %d] memory tier off: a rank had no room for its snapshot, "
                               "or its publishes kept failing", self.rank, step)
            self.close()
            return False
        return True

    def _leave(self, step: int, why: str) -> None:
        """Join no more votes after one raised here: whether the other ranks got an outcome is unknown, and any
        next collective could meet a different one of theirs. Their next vote then fails in turn and they leave
        too. The slots stay: just-in-time snapshots need no vote."""
        self.stopped = why
        logger.warning("[rank %d step %d] memory snapshots stopped: %s (a just-in-time snapshot is still possible; "
                       "a restart starts them again)", self.rank, step, why)

    def _replan(self, flat: FlatState) -> None:
        plan = plan_node(self.group, flat, self.node)
        self._release_slots()
        self.slots.reset(plan.layout)
        self.plan = plan
        copy_bytes = self.replication.planned(flat, plan)
        self._signature = signature(flat)
        self.cadence.replanned()
        if plan.leader and self.directory is not None:  # the size check at start: once per node
            why = size_problem(self.directory, SLOTS * (plan.node_bytes + copy_bytes), self.config)
            if why is not None:
                self.votes.starved = True
                self.warnings.first("room")  # this error says it all: no second warning when the slot does not fit
                logger.error("[rank %d] memory tier off: %s (%s)", self.rank, why, self.directory)

    def _take(self, step: int, flat: FlatState, started: float, waited: float) -> bool:
        """This rank's part of an agreed round: copy into a slot, publish in the background. No collective here:
        a local failure skips this rank's snapshot only (it still takes part in the round's background part)."""
        complete = self.votes.complete
        slot: Slot | None = None
        try:
            self._housekeep(complete)
            slot = self.slots.for_round(complete)
            self.slots.unpublish(slot)
            assert self.slots.layout is not None
            slot.fill(self.slots.layout, flat.items)
        except ShmSpaceError as exc:
            self._starve(str(exc))
            slot = None
        except OSError as exc:  # the keeper directory vanished, a file was removed under us...
            self.warnings.warn("io", "[rank %d step %d] memory snapshot skipped: %s", self.rank, step, exc)
            self._release_slots()
            slot = None
        except Exception as exc:  # noqa: BLE001 - this rank's snapshot only: it still joins the round's vote
            self.warnings.warn("copy", "[rank %d step %d] memory snapshot skipped: %s", self.rank, step, exc)
            slot = None  # unpublished and step None: rewritten by a later snapshot
        if slot is None:
            self._submit(None, step, {}, {}, skipped=False)
            return False
        now = time.perf_counter()
        self.cadence.staged(now - started - waited, now)
        self._submit(slot, step, flat.objects, flat.rank_objects, skipped=False)
        return True

    def _submit(self, slot: Slot | None, step: int, objects: dict[str, JSON], rank_objects: dict[str, JSON], *,
                skipped: bool) -> None:
        behind = self.config.when_busy == "wait"
        every = self._proposal(step)  # None: this rank still joins the vote behind, saying "skipped"
        self.votes.due = behind
        self.inflight.submit(slot, functools.partial(self._round, slot, step, objects, rank_objects, behind, skipped,
                                                     every))

    def _round(self, slot: Slot | None, step: int, objects: dict[str, JSON], rank_objects: dict[str, JSON],
               behind: bool, skipped: bool, every: int | None) -> int:
        """Background: publish (or take part without a snapshot), replicate, then vote for the next round."""
        error: BaseException | None = None
        published = -1
        try:
            if slot is not None:
                published = self.publisher.publish(slot, step, objects, rank_objects)
        except BaseException as exc:  # noqa: BLE001 - re-raised after the vote: the other ranks wait for it
            error = exc
        try:
            self.replication.published(slot if error is None else None, step)  # always: a peer may wait for it
        except Exception as exc:  # noqa: BLE001 - a failed copy leaves the local snapshot in place
            if error is None:
                error = exc
        if behind:
            self.votes.vote_behind(skipped, error, every, self.publisher.published)
        if error is not None:
            raise error
        return published

    def _housekeep(self, complete: int) -> None:
        leader = self.plan is not None and self.plan.leader
        if self.directory is not None:
            remove_superseded(self.directory, gen=self.gen, rank=self.rank, complete=complete,
                              held=self.slots.held_paths(), leader=leader)
        self.replication.housekeep(complete, leader)

    def _proposal(self, step: int) -> int | None:
        """This rank's proposed interval, or None when choosing it failed here (the vote says so)."""
        try:
            return self.cadence.propose()
        except Exception as exc:  # noqa: BLE001 - a local failure is a vote to skip, never a rank out of step
            self.warnings.warn("every", "[rank %d step %d] memory snapshot interval not chosen: %s", self.rank, step, exc)
            return None

    def _starve(self, why: str) -> None:
        self.votes.starved = True
        self.warnings.warn("room", "[rank %d] memory snapshot skipped, tier turning off: %s", self.rank, why)

    def wait(self) -> None:
        """Block until the snapshot in flight is published; a failure is logged, never raised."""
        future = self.inflight.take()
        if future is None:
            return
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop training
            failures = self.votes.publish_done(failed=True)
            self.warnings.warn("publish", "[rank %d] memory snapshot failed: %s", self.rank, exc)
            if failures >= PUBLISH_FAILURES_TO_STARVE:
                self._starve(f"{failures} snapshots in a row failed to publish (last: {exc})")
        else:
            self.votes.publish_done(failed=False)

    def _release_slots(self) -> None:
        self.wait()
        self.slots.release()

    # ------------------------------------------------------------------ just in time
    def snapshot_on_failure(self, step: int, state: Mapping[str, Any], exc: BaseException | None = None) -> bool:
        """After a collective failed (``exc``; a peer died mid-step), snapshot ``step`` without any collective
        (``checkpoint.memory.jit``); True when this node's ranks all hold ``step`` when it returns.

        Call it from the handler of the exception that the broken collective raised, with the state of the
        last completed ``step``; then re-raise. Does nothing (False) when ``exc`` is not a collective failure,
        when the tier is off or has not planned yet, or when the state's items changed since the last plan.
        SIGTERM/SIGINT are held back while it writes and delivered after. Never raises.
        """
        plan = self.plan
        if not self.enabled or plan is None or self.directory is None:
            return False
        if exc is not None and not jit.is_collective_failure(exc):
            logger.info("[rank %d step %d] no just-in-time memory snapshot: %s is not a failed collective",
                        self.rank, step, type(exc).__name__)
            return False
        started = time.perf_counter()
        with jit.DeferredSignals():
            try:
                wrote = self._snapshot_now(step, state)
            except Exception as e:  # noqa: BLE001 - the worker is failing anyway: say why and go on failing
                logger.warning("[rank %d step %d] just-in-time memory snapshot failed: %s", self.rank, step, e)
                return False
            names = jit.node_group_names(SnapshotId(step, self.gen), plan.node_ranks, self.world_size)
            procs = dict(zip(names, (plan.node_procs.get(r) for r in plan.node_ranks), strict=True))
            missing = jit.wait_for_names(self.directory, names, self.config.jit_peer_wait,
                                         gone=lambda name: process_gone(procs[name]))
        logger.warning(
            "[rank %d] just-in-time memory snapshot of step %d after a failed collective: %s in %.3fs; node copy %s",
            self.rank, step, "written" if wrote else "already held", time.perf_counter() - started,
            "complete" if not missing else f"incomplete ({len(missing)} of {len(names)} rank file(s) missing)",
        )
        return not missing

    def _snapshot_now(self, step: int, state: Mapping[str, Any]) -> bool:
        """This rank's snapshot of ``step`` with the current plan, published before returning; False when it
        already published ``step``. Raises MemoryTierError when the state no longer fits the plan."""
        # A round in flight finishes first (it may be this very step), but not for long: its background thread
        # may be stuck in the replication hook with a peer that just died.
        busy: Slot | None = None
        if not self.inflight.wait_briefly(self.config.jit_peer_wait, self._publish_failed):
            logger.warning("[rank %d] the memory snapshot in flight did not finish within %.1fs: left alone",
                           self.rank, self.config.jit_peer_wait)
            busy = self.inflight.slot
        if self.publisher.published >= step:
            return False
        flat = self.flat_cache.flatten(state)
        if signature(flat) != self._signature:
            raise MemoryTierError("the state's items changed since the last snapshot plan")
        # Keep both the last complete step and this rank's newest one (another rank may hold only that one, so
        # it can still be the newest common step): overwrite neither; when both slots hold them, take a third.
        try:
            slot = self.slots.for_jit({self.votes.complete, self.publisher.published} - {-1}, busy)
        except ShmSpaceError as exc:
            self._starve(str(exc))
            raise MemoryTierError("no room for a snapshot") from exc
        self.slots.unpublish(slot)
        assert self.slots.layout is not None
        slot.fill(self.slots.layout, flat.items)
        self.publisher.publish(slot, step, flat.objects, flat.rank_objects)  # no replication: the group is broken
        return True

    def _publish_failed(self, exc: Exception) -> None:
        self.warnings.warn("publish", "[rank %d] memory snapshot failed: %s", self.rank, exc)

    # ------------------------------------------------------------------ restore and lifecycle
    def restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        # Planning the reads flattens the live state, which initialises an empty optimizer with DCP's zero-lr step
        # (Adam's step count becomes 1): a restore that finds nothing puts it back, or a fresh start with the tier
        # trains differently from one without it.
        fresh = uninitialised_optimizers(state)
        self.flat_cache.clear()  # a restore may replace the optimizers' state tensors
        report = self._restore(state, not_older_than=not_older_than)
        if report is None:
            forget_optimizer_state(fresh)
        return report

    def _restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        if not self.enabled:
            self.last_fallback_reason = "the memory tier is off (no keeper directory on some rank, or no room)"
            return None
        self.last_fallback_reason = None
        self.wait()
        try:
            return self.restorer.restore(state, not_older_than=not_older_than)
        finally:
            self.last_fallback_reason = self.restorer.last_fallback_reason

    def close(self) -> None:
        """Finish the snapshot in flight and unmap the slots; published snapshots stay for the next workers
        (the keeper removes them when the agent exits)."""
        self._release_slots()
        self.flat_cache.clear()
        self.inflight.shutdown()


__all__ = ["GROUPS_LOOKED_AT", "READ_PART_BYTES", "LocalShmTier", "check_room", "read_threads"]
