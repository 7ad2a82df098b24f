"""The local memory tier: each rank snapshots its state into its node's keeper directory in host shared memory.

Snapshot (``LocalShmTier.snapshot``, every ``config.every`` steps, on every rank):

1. ``flatten`` the state (``flatcache.FlatCache``: the items of the last snapshot while the tensors are the
   same, without DCP's state dicts); one vote (``Collective.max_each``: state rejected, items changed, busy, a rank short
   of room, and the newest step every rank published, ``complete``). With ``when_busy="wait"`` (the default) the
   vote of a round runs *behind* it, on the background thread right after the publish (step 4), over the tier's own
   vote group, so in steady state the caller blocks for no collective: the next snapshot waits for that round
   (as it waited for the publish before) and reads the vote's outcome. A rank whose items changed (or could not be
   flattened) since the plan skips that round on its own (it still takes part in its exchange and vote, saying
   so), and the next round votes on the caller's thread and replans; so does the first snapshot, every round
   with ``when_busy="skip"``, and the round after a rank failed to build its ballot (it still joins the vote,
   saying "skipped": a local failure is a vote, never a rank out of step). ``complete`` is the same value either
   way (every rank's newest publish, after waiting for its own), so the slot choice and what a restore may use
   do not change. A vote that *raises* on a rank (a broken group, a timeout there only) leaves that rank without
   the outcome the others may have got, so it joins no further vote: its periodic snapshots stop (``stopped``,
   ``_leave``), and the others' next vote fails in turn, after at most ``collective_timeout`` (30 min by default), and stops theirs
   (just-in-time snapshots still work: they need no collective).
2. On the first snapshot or when the items changed: every rank's item metadata is gathered and
   ``layout.node_writers`` decides who snapshots what, so each node holds a whole copy of the replicated
   state; this rank's pieces become one ``ShardLayout`` (one shm object per rank per step).
3. The rank copies its pieces into a *slot* (``staging.copy_pieces``): a shared-memory file, mapped once and
   reused, holding the safetensors header and data. Two slots per rank: the one with ``complete`` is never
   touched, the other is renamed to a temporary name, then overwritten. This copy is the only time training
   blocks.
4. A background thread checksums the bytes (``shard.block_crcs``, the durable tier's 1 MiB blocks), appends
   the JSON manifest and the footer, and renames the slot to its published name
   (``snap-{step}-{gen}-{rank}-of-{world}.safetensors``): a reader sees a whole snapshot or none.

Room: before a slot is allocated the free space of the filesystem is checked (``layout.room_for``) and the
slot's pages are reserved (``posix_fallocate``), so a full ``/dev/shm`` is a warning and a skipped snapshot,
never a SIGBUS. A rank that could not allocate makes every rank turn the tier off at the next vote.

Restore (``LocalShmTier.restore``): each rank lists its keeper directory, merges the manifests of each
snapshot group into a durable-style ``Manifest`` (``commit.merge_records``: the chunks must tile every tensor)
and keeps the groups it can restore from alone; the ranks agree on the newest group all of them can read
(``layout.choose_snapshot``) and load it with the durable read path (``plan.plan_reads``,
``shard.read_requests`` with crc32 checks, ``state.apply``), at any world size. A group that fails on any rank
is removed and the next one tried; when none is left the caller falls back to the durable tier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import secrets
import socket
import statistics
import time
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpoint._sys.procutil import process_gone, process_identity
from checkpoint.api import JSON, ChunkKey, Manifest, RankRecords, TensorItem, TensorRecord
from checkpoint.collective import open_collectives
from checkpoint.commit import merge_records
from checkpoint.config import CheckpointConfig
from checkpoint.fallback import LoadOutcome
from checkpoint.memory import jit
from checkpoint.memory.api import (
    ENV_MEMORY_DIR,
    CorruptSnapshotError,
    MemoryTierError,
    PartialRestoreError,
    RestoreReport,
    RestoreSource,
    ShmSpaceError,
    SnapshotId,
    SnapshotManifest,
)
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.flatcache import FlatCache
from checkpoint.memory.layout import (
    FOOTER,
    choose_every,
    choose_snapshot,
    decode_footer,
    encode_footer,
    gen_of_tmp,
    node_writers,
    parse_snapshot_name,
    pick_slot,
    room_for,
    size_for,
    snapshot_name,
    tmp_name,
)
from checkpoint.per_rank import per_rank_source
from checkpoint.pinned import CopyFence, PinnedMapping, pin_mappings, release_all
from checkpoint.plan import plan_reads
from checkpoint.shard import ShardLayout, block_crcs, build_layout, read_requests, shard_records
from checkpoint.staging import copy_pieces, piece_views
from checkpoint.state import FlatState, apply, flatten, forget_optimizer_state, uninitialised_optimizers
from checkpoint.storage import StorageSpec

logger = logging.getLogger(__name__)

SLOTS = 2
"""Slots per rank: the last complete snapshot, and the one being written."""
MANIFEST_MAX_BYTES = 256 << 20
"""Largest snapshot manifest a restore reads (block crc32s of a huge rank, per-rank objects)."""
GROUPS_LOOKED_AT = 4
"""Newest snapshot groups a restore examines (normally there are one or two)."""
STEP_SAMPLES = 16
"""Recent step times ``every="auto"`` takes the median of."""
STAGE_SAMPLES = 5
"""Recent snapshots' staging times ``every="auto"`` takes the median of (one slow vote on a loaded host must not
set the interval for the next hundred steps)."""


READ_PART_BYTES = 8 << 20
"""A restore cuts a tensor's read larger than this into parts its read threads share (``shard.direct_parts``):
reading shared memory is CPU-bound (a copy and a crc32 pass), so one large tensor read by one thread would
leave the other cores idle."""


def read_threads(config: MemoryTierConfig) -> int:
    """Threads a restore reads this node's snapshot files with (``MemoryTierConfig.read_threads``)."""
    return config.read_threads or max(1, min(4, os.cpu_count() or 1))


PUBLISH_FAILURES_TO_STARVE = 3
"""Consecutive failed publishes after which a rank turns the tier off at the next vote (as when it has no room)."""
SKIP_BALLOT = (1, 0, 1, 1, 0)
"""A rank's part of a vote behind a round when it could not build its own (``LocalShmTier._ballot``): "skipped",
so the next snapshot votes on the caller's thread on every rank, which reads nothing else of this vote."""


def _signature(flat: FlatState) -> tuple[Any, ...]:
    """What a snapshot plan depends on: each item's key, dtype, global shape and whether it is replicated."""
    return tuple((i.key, i.dtype, i.global_shape, i.replicated) for i in flat.items)


def check_room(directory: str, need: int, config: MemoryTierConfig) -> None:
    """Raise ShmSpaceError (sizes and the fix in the message) unless ``need`` more bytes in ``directory``'s
    filesystem leave the free space ``config`` asks for."""
    fs = os.statvfs(directory)
    why = room_for(
        need,
        free=fs.f_bavail * fs.f_frsize,
        total=fs.f_blocks * fs.f_frsize,
        min_free_bytes=config.min_free_bytes,
        min_free_fraction=config.min_free_fraction,
    )
    if why is not None:
        raise ShmSpaceError(f"{why} ({directory})")


@dataclass(slots=True)
class _Slot:
    """One reusable shared-memory file: header and data mapped, manifest and footer written by ``pwrite``."""

    fd: int
    mm: mmap.mmap
    path: str
    layout: ShardLayout
    views: list[torch.Tensor | None]
    step: int | None = None
    """The step it holds once published; None while empty or being written."""
    fence: CopyFence = field(default_factory=CopyFence)
    """The end of the device copies into it: waited on before its bytes are read (checksums, publish)."""
    pinned: list[PinnedMapping] = field(default_factory=list)
    """Its mapping registered with CUDA (page-locked) once a snapshot copied from a CUDA device into it."""

    def fill(self, layout: ShardLayout, items: Sequence[TensorItem]) -> None:
        """Copy the pieces of ``items`` into the slot; returns once the sources may be modified (``fence``:
        until the bytes are here). The mapping is page-locked on the first copy from a CUDA device."""
        if not self.pinned and self.layout.size:
            self.pinned = pin_mappings([torch.frombuffer(self.mm, dtype=torch.uint8, count=self.layout.size)],
                                       (item.tensor for item in items))
        self.fence = copy_pieces([layout], [self.views], items)

    def close(self) -> None:
        self.fence.wait()  # no copy may land in a mapping being closed
        release_all(self.pinned)  # unregistered before it is unmapped
        self.views = []
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)


@dataclass(frozen=True, slots=True)
class _Vote:
    """What the vote behind a round agreed (``LocalShmTier._vote_behind``), the same on every rank."""

    skipped: bool
    """A rank skipped the round because its items changed or could not be flattened: the next round votes first."""
    starved: bool
    complete: int
    """The newest step every rank had published (its slot is never overwritten)."""
    every: int
    waited: float
    """Seconds this rank's vote waited for slower ranks (not snapshot cost, as for the caller's vote)."""


@dataclass(slots=True)
class _Group:
    """A snapshot group this rank can restore from alone (its node's keeper holds every piece it needs)."""

    snap: SnapshotId
    manifest: Manifest
    objects: dict[str, JSON]
    rank_objects: dict[int, dict[str, JSON]] = field(default_factory=dict)


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
        process_group: Any = None,
        node: str | None = None,
    ) -> None:
        self.config = config or MemoryTierConfig()
        self.directory = directory if directory is not None else os.environ.get(ENV_MEMORY_DIR)
        self._fg, self._bg = open_collectives(process_group, self.config.collective_timeout, 2)
        """``_fg``: the caller's thread's collectives; ``_bg``: the votes that run behind a snapshot (``_vote_behind``)."""
        self.rank, self.world_size = self._fg.rank, self._fg.world_size
        usable = self.directory is not None and os.path.isdir(self.directory) and os.access(self.directory, os.W_OK)
        (missing,) = self._fg.any(not usable)
        self.enabled = not missing
        if not self.enabled:
            why = "no keeper directory here" if not usable else "another rank has no keeper directory"
            logger.warning(
                "[rank %d] memory tier off: %s (%s is set by the spotrun agent; under stock torchrun there is none)",
                self.rank, why, ENV_MEMORY_DIR,
            )
        self.gen: str = self._fg.rank0_decides(lambda: secrets.token_hex(4))
        """This group of workers' snapshot generation (the same on every rank; new at every start)."""
        self.node = node or f"{socket.gethostname()}:{self.directory}"
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="memtier")
        self._future: Future[int] | None = None
        self._inflight: _Slot | None = None
        """The slot the snapshot in flight (``_future``) writes."""
        self._slots: list[_Slot | None] = [None] * SLOTS
        self._layout: ShardLayout | None = None
        self._signature: tuple[Any, ...] | None = None
        self._flat_cache = FlatCache()
        """The state's items between snapshots: no DCP state dicts while the tensors stay the same."""
        self._is_node_leader = False
        self._node_ranks: list[int] = []
        self._node_procs: dict[int, str | None] = {}
        """Per rank of this node, its process (``checkpoint._sys.procutil.process_identity``): a just-in-time snapshot does not wait for
        the file of a rank whose process has exited (a crashed worker never publishes)."""
        self._snapshot_bytes: list[dict[ChunkKey, int]] = []
        """Per rank, the bytes of each piece it snapshots (from the last plan)."""
        self._node_bytes = 0
        """Bytes of one snapshot of every rank of this node; ``_node_copy_bytes``: of the buddy copies it keeps."""
        self._node_copy_bytes = 0
        """The ranks of this rank's node (from the last plan): a just-in-time snapshot waits for their files."""
        self._complete = -1
        """The newest step every rank had published at the last vote (its slot is never overwritten)."""
        self._published = -1
        """The newest step this rank published in this generation (-1: none yet)."""
        self._every = 1 if self.config.every == "auto" else int(self.config.every)
        """The interval in use (``"auto"`` starts at 1 and settles once step and staging times are measured)."""
        self._last_call: float | None = None
        self._staged_at: float | None = None
        self._intervals: list[float] = []
        self._stages: list[float] = []
        """Staging seconds of the recent snapshots (not the first ``SLOTS`` of a plan: they map new slots)."""
        self._stages_to_skip = SLOTS
        self._starved = False
        self._publish_failures = 0
        """Consecutive failed publishes of this rank (PUBLISH_FAILURES_TO_STARVE turn the tier off)."""
        self._warned: set[str] = set()
        self.last_fallback_reason: str | None = None
        """Why the last ``restore`` returned None (the caller's durable restore reports it), else None."""
        self._last_vote_us = 0
        """Microseconds this rank's last snapshot vote took (its wait for slower ranks included)."""
        self.last_stage_seconds = 0.0
        """Seconds the last snapshot blocked the caller (flatten, the vote's own latency, copy; not the vote's wait for
        slower ranks, which the next gradient all-reduce would wait instead): what ``every="auto"`` weighs."""
        self.snapshots_published = 0
        self._vote_due = False
        """The last round ran a vote behind its publish: the next snapshot reads it (same on every rank)."""
        self._behind: _Vote | None = None
        """That vote's outcome, set by the background thread (None: it raised on this rank)."""
        self.stopped: str | None = None
        """Why this rank takes no more periodic snapshots (a vote of the tier raised here: it cannot know what the
        other ranks agreed, so it joins no further vote), else None. Just-in-time snapshots still work."""
        self._behind_vote_us = 0
        self.votes_blocking = 0
        """Votes this rank ran on the caller's thread (the first snapshot, after changes; tests count them)."""

    def __repr__(self) -> str:
        return f"LocalShmTier({self.directory!r}, rank={self.rank}/{self.world_size}, gen={self.gen})"

    @property
    def interval(self) -> int:
        """The snapshot interval in use, in steps (with ``every="auto"``: the one the ranks last agreed on)."""
        return self._every

    @property
    def nbytes(self) -> int:
        """Host shared memory this rank's slots hold (header + data each)."""
        return sum(s.layout.size for s in self._slots if s is not None)

    # ------------------------------------------------------------------ snapshot
    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        # The first call plans even at a step it does not snapshot: a just-in-time snapshot (which has no
        # collective to plan with) is then possible from the first step on. Every rank makes the same calls.
        started = time.perf_counter()
        self._clock_step(started)
        if not self.enabled or self.stopped is not None or (step % self._every and self._signature is not None):
            return False
        flat: FlatState | None
        try:
            flat = self._flat_cache.flatten(state)
        except Exception as exc:  # noqa: BLE001 - said in the vote (a skipped round), never a rank out of step
            self._warn_once("state", "[rank %d step %d] memory snapshot skipped: %s", self.rank, step, exc)
            flat = None
        if self._vote_due:  # the last round's vote ran behind it (every rank decides this alike)
            self._vote_due = False
            steady = self._steady_snapshot(step, flat, started)
            if steady is not None:
                return steady
        return self._voted_snapshot(step, flat, started)

    def _voted_snapshot(self, step: int, flat: FlatState | None, started: float) -> bool:
        """A snapshot decided by a vote on the caller's thread: the first one, after a change of the items, a
        skipped round or a failed vote, and every one with ``when_busy="skip"``."""
        if self.config.when_busy == "wait":
            self.wait()
        elif self._future is not None and self._future.done():
            self.wait()  # read a finished publish's outcome before the vote (skip mode replaces the future)
        busy = self._future is not None and not self._future.done()
        signature = None if flat is None else _signature(flat)
        proposed = self._proposed_every_or_none(step)
        voting = time.perf_counter()
        try:
            bad, changed, any_busy, starved, neg_complete, every, neg_vote_us = self._fg.max_each(
                flat is None or proposed is None, signature != self._signature, busy, self._starved,
                -self._published, proposed if proposed is not None else self._every, -self._last_vote_us,
            )
        except Exception as exc:  # noqa: BLE001 - the other ranks may have an outcome this rank has not
            self._leave(step, f"its snapshot vote failed: {exc}")
            return False
        self.votes_blocking += 1
        self._last_vote_us = int(1e6 * (time.perf_counter() - voting))
        # The vote's cost is its own latency (the last rank to arrive waits for nothing: the smallest of the ranks'
        # previous votes), not the wait for a slower rank, which its next gradient all-reduce would wait anyway.
        waited = max(0.0, self._last_vote_us - (-neg_vote_us)) / 1e6
        if not self._apply_vote(step, -neg_complete, every, bool(starved)):
            return False
        if bad or any_busy or flat is None:
            return False
        if changed:
            self._replan(flat)
            self._signature = signature
            self._stages, self._stages_to_skip = [], SLOTS
            if self._is_node_leader:  # the size check at start: once per node, for all of its ranks' slots
                self._check_size(SLOTS * (self._node_bytes + self._node_copy_bytes))
        if step % self._every:
            return False  # the first call, planned only (or "auto" just chose a larger interval)
        return self._take(step, flat, started, waited)

    def _steady_snapshot(self, step: int, flat: FlatState | None, started: float) -> bool | None:
        """A snapshot decided by the vote that ran behind the last one (``_vote_behind``), with no collective on
        the caller's thread; None when that vote calls for one here (a rank skipped its last snapshot, or the
        vote failed)."""
        blocked_at = time.perf_counter()
        self.wait()  # the last round's publish, buddy exchange and vote: normally long done
        blocked = time.perf_counter() - blocked_at
        vote, self._behind = self._behind, None
        if vote is None:  # it raised here; another rank may have got its outcome and be snapshotting now
            self._leave(step, "its vote behind the last snapshot failed")
            return False
        if vote.skipped:
            return None
        if not self._apply_vote(step, vote.complete, vote.every, vote.starved):
            return False
        if step % self._every:
            return False  # "auto" just chose a larger interval
        if flat is None or _signature(flat) != self._signature:
            # The other ranks go on with this round: take part in its exchange and vote without a snapshot, and
            # say so; the next round is then voted on every rank (and replans).
            self._submit(None, step, {}, {}, skipped=True)
            return False
        return self._take(step, flat, started, min(blocked, vote.waited))

    def _apply_vote(self, step: int, complete: int, every: int, starved: bool) -> bool:
        """Adopt a vote's outcome (the same on every rank); False when the tier turned off."""
        self._complete = complete
        if every != self._every:  # "auto": the slowest rank's choice, the same on every rank from the next step
            logger.info("[rank %d step %d] memory snapshot every %d step(s) (was %d): %.4fs staging per snapshot, "
                        "%.4fs per step, overhead target %.1f%%", self.rank, step, every, self._every,
                        self._stage_seconds(), self._step_seconds(), 100 * self.config.overhead_target)
            self._every = int(every)
        if starved:
            self.enabled = False
            self._warn_once("starved", "[rank %d step %d] memory tier off: a rank had no room for its snapshot, or "
                            "its publishes kept failing", self.rank, step)
            self.close()
            return False
        return True

    def _leave(self, step: int, why: str) -> None:
        """Take no more periodic snapshots, and so join no more votes, after a vote raised on this rank: whether
        the other ranks got an outcome is unknown here, and any next collective could meet a different one of
        theirs (a vote on the caller's thread against their vote behind). Their next vote then fails in turn, after
        at most ``collective_timeout``, and they leave too. The slots stay: just-in-time snapshots need no vote."""
        self.stopped = why
        logger.warning("[rank %d step %d] memory snapshots stopped: %s (a just-in-time snapshot is still possible; "
                       "a restart starts them again)", self.rank, step, why)

    def _take(self, step: int, flat: FlatState, started: float, waited: float) -> bool:
        """This rank's part of a round every rank agreed on: copy into a slot and publish in the background.
        No collective here: a local failure skips this rank's snapshot only (it still takes part in the round's
        background exchange and vote)."""
        complete = self._complete
        slot: _Slot | None = None
        try:
            self._housekeep(complete)
            slot = self._slot_for(complete)
            if slot is not None:
                self._unpublish(slot)
                assert self._layout is not None
                slot.fill(self._layout, flat.items)
        except OSError as exc:  # the keeper directory vanished, a file was removed under us...
            self._warn_once("io", "[rank %d step %d] memory snapshot skipped: %s", self.rank, step, exc)
            self._release_slots()
            slot = None
        except Exception as exc:  # noqa: BLE001 - this rank's snapshot only: it still joins the round's vote
            self._warn_once("copy", "[rank %d step %d] memory snapshot skipped: %s", self.rank, step, exc)
            slot = None  # unpublished and step None: rewritten by a later snapshot
        if slot is None:
            self._submit(None, step, {}, {}, skipped=False)
            return False
        self.last_stage_seconds = time.perf_counter() - started - waited
        self._sample_stage(self.last_stage_seconds)
        self._staged_at = time.perf_counter()
        self._inflight = slot
        self._submit(slot, step, flat.objects, flat.rank_objects, skipped=False)
        return True

    def _submit(self, slot: _Slot | None, step: int, objects: dict[str, JSON], rank_objects: dict[str, JSON], *,
                skipped: bool) -> None:
        """Run the round's background part: publish ``slot`` (None: this rank has nothing to publish), then,
        with ``when_busy="wait"``, the next round's vote (``_vote_behind``)."""
        behind = self.config.when_busy == "wait"
        every = self._proposed_every_or_none(step)  # None: this rank still joins the vote behind, saying "skipped"
        self._vote_due = behind
        self._future = self._executor.submit(self._round, slot, step, objects, rank_objects, behind, skipped, every)

    def _round(self, slot: _Slot | None, step: int, objects: dict[str, JSON], rank_objects: dict[str, JSON],
               behind: bool, skipped: bool, every: int | None) -> int:
        """Background: publish (or take part in the round without a snapshot), then vote for the next round."""
        error: BaseException | None = None
        published = -1
        try:
            published = self._publish(slot, step, objects, rank_objects) if slot is not None else self._publish_none(step)
        except BaseException as exc:  # noqa: BLE001 - re-raised after the vote: the other ranks wait for it
            error = exc
        if behind:
            self._vote_behind(skipped, error, every)
        if error is not None:
            raise error
        return published

    def _publish_none(self, step: int) -> int:
        """Background: this rank's part of an agreed round it has no snapshot for (``PeerShmTier``: its buddy
        exchange); -1."""
        return -1

    def _vote_behind(self, skipped: bool, error: BaseException | None, every: int | None) -> None:
        """Background, after a round's publish: the next round's vote (on the tier's own vote group, so it never
        meets a collective of the caller's thread). It carries what the caller's vote would (whether a rank
        skipped for a change of its items, no room or failed publishes, the newest step every rank published,
        the interval), so the next snapshot needs no collective when nothing changed (``_steady_snapshot``).

        Every rank enters it: a rank that cannot build its ballot votes ``SKIP_BALLOT`` (the next snapshot then
        votes on the caller's thread on every rank). A vote that raises leaves ``_behind`` None: the next
        snapshot stops this rank's snapshots (``_leave``)."""
        try:
            ballot = self._ballot(skipped, error, every)
        except Exception as exc:  # noqa: BLE001 - still a vote, or the other ranks would wait for this one
            logger.warning("[rank %d] memory snapshot ballot failed, voting to skip the next round: %s", self.rank, exc)
            ballot = SKIP_BALLOT
        voting = time.perf_counter()
        try:
            any_skipped, starved, neg_complete, chosen, neg_vote_us = self._bg.max_each(*ballot)
        except Exception as exc:  # noqa: BLE001 - whether the others got an outcome is unknown: see _leave
            logger.warning("[rank %d] memory snapshot vote failed: %s", self.rank, exc)
            self._behind = None
            return
        self._behind_vote_us = int(1e6 * (time.perf_counter() - voting))
        waited = max(0.0, self._behind_vote_us - (-neg_vote_us)) / 1e6
        self._behind = _Vote(bool(any_skipped), bool(starved), -neg_complete, int(chosen), waited)

    def _ballot(self, skipped: bool, error: BaseException | None, every: int | None) -> tuple[int, ...]:
        """This rank's part of the vote behind a round (``_vote_behind``); "skipped" without an interval to propose."""
        if every is None:
            return SKIP_BALLOT
        failing = error is not None and self._publish_failures + 1 >= PUBLISH_FAILURES_TO_STARVE
        return int(skipped), int(self._starved or failing), -self._published, every, -self._behind_vote_us

    def wait(self) -> None:
        """Block until the snapshot in flight is published; a failure is logged, never raised."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop training
            self._publish_failures += 1
            self._warn_once("publish", "[rank %d] memory snapshot failed: %s", self.rank, exc)
            if self._publish_failures >= PUBLISH_FAILURES_TO_STARVE:
                self._starve(f"{self._publish_failures} snapshots in a row failed to publish (last: {exc})")
        else:
            self._publish_failures = 0

    def _clock_step(self, now: float) -> None:
        """Time the step since the previous call (without the staging it blocked for): ``every="auto"``."""
        if self._last_call is not None:
            staged = self.last_stage_seconds if self._staged_at is not None and self._staged_at > self._last_call else 0.0
            self._intervals.append(max(0.0, now - self._last_call - staged))
            del self._intervals[:-STEP_SAMPLES]
        self._last_call = now

    def _step_seconds(self) -> float:
        return statistics.median(self._intervals) if self._intervals else 0.0

    def _sample_stage(self, seconds: float) -> None:
        """Keep a periodic snapshot's staging time for ``every="auto"`` (the first ones of a plan map their slots:
        a one-off cost, left out)."""
        if self._stages_to_skip > 0:
            self._stages_to_skip -= 1
            return
        self._stages.append(seconds)
        del self._stages[:-STAGE_SAMPLES]

    def _stage_seconds(self) -> float:
        return statistics.median(self._stages) if self._stages else self.last_stage_seconds

    def _proposed_every(self) -> int:
        """This rank's interval for the next snapshots: the configured one, or with ``"auto"`` the smallest
        that keeps staging under ``overhead_target`` of the training time (``layout.choose_every``)."""
        if self.config.every != "auto":
            return int(self.config.every)
        if len(self._intervals) < 2 or not self._stages:
            return self._every  # nothing measured yet: keep snapshotting to measure
        return choose_every(self._step_seconds(), self._stage_seconds(), self.config.overhead_target,
                            self.config.max_every)

    def _proposed_every_or_none(self, step: int) -> int | None:
        """``_proposed_every``, or None when it failed here (the vote says so instead of this rank missing it)."""
        try:
            return self._proposed_every()
        except Exception as exc:  # noqa: BLE001 - a local failure is a vote to skip, never a rank out of step
            self._warn_once("every", "[rank %d step %d] memory snapshot interval not chosen: %s", self.rank, step, exc)
            return None

    def snapshot_on_failure(self, step: int, state: Mapping[str, Any], exc: BaseException | None = None) -> bool:
        """After a collective failed (``exc``; a peer died mid-step), snapshot ``step`` without any collective
        (``checkpoint.memory.jit``); True when this node's ranks all hold ``step`` when it returns.

        Call it from the handler of the exception that the broken collective raised, with the state of the
        last completed ``step``; then re-raise. Does nothing (False) when ``exc`` is not a collective failure,
        when the tier is off or has not planned yet, or when the state's items changed since the last plan.
        SIGTERM/SIGINT are held back while it writes and delivered after. Never raises.
        """
        if not self.enabled or self._layout is None or self.directory is None:
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
            names = jit.node_group_names(SnapshotId(step, self.gen), self._node_ranks, self.world_size)
            procs = dict(zip(names, (self._node_procs.get(r) for r in self._node_ranks), strict=True))
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
        # A periodic snapshot in flight finishes first (it may be this very step), but not for long: its
        # background thread may be stuck exchanging with a buddy that just died (``peer.PeerShmTier``).
        busy_slot = self._wait_briefly(self.config.jit_peer_wait)
        if self._published >= step:
            return False
        flat = self._flat_cache.flatten(state)
        if _signature(flat) != self._signature:
            raise MemoryTierError("the state's items changed since the last snapshot plan")
        # Keep both the last complete step and this rank's newest one (another rank may hold only that one, so
        # it can still be the newest common step): overwrite neither; when both slots hold them, take a third.
        keep = {self._complete, self._published} - {-1}
        index = next((i for i, s in enumerate(self._slots)
                      if s is None or (s.step not in keep and s is not busy_slot)), None)
        if index is None:
            self._slots.append(None)
            index = len(self._slots) - 1
        slot = self._slots[index]
        if slot is None:
            slot = self._slots[index] = self._allocate(index)
        if slot is None:
            raise MemoryTierError("no room for a snapshot")
        self._unpublish(slot)
        assert self._layout is not None
        slot.fill(self._layout, flat.items)
        # This node's copy only: a subclass's _publish may also talk to other ranks, whose group is broken.
        LocalShmTier._publish(self, slot, step, flat.objects, flat.rank_objects)
        return True

    def _wait_briefly(self, timeout: float) -> _Slot | None:
        """Wait up to ``timeout`` s for the snapshot in flight; the slot it still writes, if it did not finish."""
        future = self._future
        if future is None:
            return None
        try:
            future.result(timeout=timeout)
        except FutureTimeout:
            logger.warning("[rank %d] the memory snapshot in flight did not finish within %.1fs: left alone",
                           self.rank, timeout)
            return self._inflight
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop this one
            self._warn_once("publish", "[rank %d] memory snapshot failed: %s", self.rank, exc)
        self._future = None
        return None

    def _replan(self, flat: FlatState) -> None:
        """Gather every rank's item metadata and node once; lay out the pieces this rank snapshots."""
        mine = [[i.key.fqn, list(i.key.offsets), list(i.key.lengths), i.nbytes, i.replicated] for i in flat.items]
        gathered = self._fg.all_gather({"node": self.node, "items": mine, "proc": process_identity(os.getpid())})
        nodes = [str(g["node"]) for g in gathered]
        everyone = [
            [(ChunkKey(f, tuple(o), tuple(ln)), int(n), bool(r)) for f, o, ln, n, r in g["items"]] for g in gathered
        ]
        writers = node_writers(everyone, nodes)
        writes = set(writers[self.rank])
        pieces = [
            (index, item.key, tuple(item.global_shape), item.dtype, item.nbytes)
            for index, item in enumerate(flat.items)
            if item.key in writes
        ]
        self._layout = build_layout("snapshot", pieces)
        self._node_ranks = [r for r, n in enumerate(nodes) if n == self.node]
        self._node_procs = {r: p if isinstance(p := g.get("proc"), str) else None  # another rank's: only a str
                            for r, g in enumerate(gathered) if r in self._node_ranks}
        self._is_node_leader = self.rank == min(self._node_ranks)
        self._release_slots()
        self._snapshot_bytes = [{key: n for key, n, _ in everyone[r] if key in set(writers[r])} for r in range(len(nodes))]
        self._node_bytes = sum(sum(self._snapshot_bytes[r].values()) for r in self._node_ranks)
        logger.info(
            "[rank %d] memory snapshot plan: %d of %d local pieces, %d bytes per snapshot (node %s, %d rank(s))",
            self.rank, len(pieces), len(flat.items), self._layout.size, self.node, nodes.count(self.node),
        )

    def _slot_for(self, complete: int) -> _Slot | None:
        index = pick_slot([s.step if s is not None else None for s in self._slots], complete if complete >= 0 else None)
        slot = self._slots[index]
        if slot is None:
            slot = self._slots[index] = self._allocate(index)
        return slot

    def _allocate(self, index: int) -> _Slot | None:
        """A new slot for the current layout, after checking and reserving the room; None (and the tier off
        after the next vote) when there is none."""
        assert self._layout is not None and self.directory is not None
        layout = self._layout
        need = layout.size + FOOTER.size
        try:
            check_room(self.directory, need, self.config)
        except ShmSpaceError as exc:
            self._starve(str(exc))
            return None
        path = os.path.join(self.directory, tmp_name(self.gen, self.rank, index))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(layout.size, 1))  # pages reserved now: a full tmpfs is ENOSPC here, not SIGBUS later
            mm = mmap.mmap(fd, max(layout.size, 1))
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            self._starve(f"cannot reserve {need} bytes for a snapshot in {self.directory}: {exc}")
            return None
        mm[: len(layout.header)] = layout.header
        data = torch.frombuffer(mm, dtype=torch.uint8, count=layout.size)[len(layout.header) :] if layout.size else None
        views = piece_views(data, layout) if data is not None else []
        return _Slot(fd=fd, mm=mm, path=path, layout=layout, views=views)

    def _check_size(self, need: int) -> None:
        """Turn the tier off (every rank, at the next vote) with one error naming the size needed when this
        node's shared-memory filesystem cannot hold ``need`` bytes of snapshots even when empty."""
        assert self.directory is not None
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return  # the keeper directory vanished: the snapshot that follows says so
        why = size_for(need, total=fs.f_blocks * fs.f_frsize, min_free_bytes=self.config.min_free_bytes,
                       min_free_fraction=self.config.min_free_fraction)
        if why is not None:
            self._starved = True
            self._warned.add("room")  # this error says it all: no second warning when the slot does not fit
            logger.error("[rank %d] memory tier off: %s (%s)", self.rank, why, self.directory)

    def _starve(self, why: str) -> None:
        self._starved = True
        self._warn_once("room", "[rank %d] memory snapshot skipped, tier turning off: %s", self.rank, why)

    def _unpublish(self, slot: _Slot) -> None:
        """Take the slot's published name away before its bytes change (a reader never sees a mix)."""
        tmp = os.path.join(os.path.dirname(slot.path), tmp_name(self.gen, self.rank, self._slots.index(slot)))
        if slot.path != tmp:
            os.rename(slot.path, tmp)
            slot.path = tmp
        slot.step = None

    def _publish(self, slot: _Slot, step: int, objects: dict[str, JSON], rank_objects: dict[str, JSON]) -> int:
        """Background: checksum the staged bytes, append manifest and footer, publish under the step's name."""
        slot.fence.wait()  # the device copies end here, off the training loop's thread
        layout = slot.layout
        name = snapshot_name(SnapshotId(step, self.gen), self.rank, self.world_size)
        block = self.config.checksum_block_bytes
        data = memoryview(slot.mm)[len(layout.header) : layout.size]
        try:
            crcs = block_crcs(layout, data, block)
        finally:
            data.release()
        file_record, chunks = shard_records(dataclasses.replace(layout, file=name), crcs, block, rank=self.rank)
        records = RankRecords(rank=self.rank, files={name: file_record})
        for entry, chunk in chunks:
            rec = records.tensors.setdefault(entry.key.fqn, TensorRecord(shape=list(entry.global_shape), dtype=entry.dtype))
            rec.chunks.append(chunk)
        manifest = SnapshotManifest(
            step=step,
            gen=self.gen,
            rank=self.rank,
            world_size=self.world_size,
            node=self.node,
            created_unix=time.time(),
            checksum_block_bytes=block,
            records=records,
            objects=objects,
            rank_objects=rank_objects,
        )
        raw = json.dumps(manifest.to_json(), separators=(",", ":")).encode()
        tail = raw + encode_footer(layout.size, len(raw), zlib.crc32(raw))
        os.ftruncate(slot.fd, layout.size + len(tail))
        if os.pwrite(slot.fd, tail, layout.size) != len(tail):
            raise MemoryTierError(f"short write of the snapshot manifest of step {step} ({slot.path})")
        final = os.path.join(os.path.dirname(slot.path), name)
        os.rename(slot.path, final)
        slot.path, slot.step = final, step
        self._published = step
        self.snapshots_published += 1
        logger.debug("[rank %d step %d] memory snapshot published: %s (%d bytes)", self.rank, step, final, layout.size)
        return step

    def _housekeep(self, complete: int) -> None:
        """Remove what ``complete`` (every rank published it) supersedes: this rank's older snapshots that no
        slot holds, and, on the node's leader, every file of earlier generations (workers before a restart)."""
        if complete < 0 or self.directory is None:
            return
        held = {s.path for s in self._slots if s is not None}
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            parsed = parse_snapshot_name(name)
            path = os.path.join(self.directory, name)
            if parsed is not None:
                snap, rank, _ = parsed
                mine_old = snap.gen == self.gen and rank == self.rank and snap.step < complete and path not in held
                foreign = snap.gen != self.gen and self._is_node_leader
                if not (mine_old or foreign):
                    continue
            elif not (self._is_node_leader and gen_of_tmp(name) not in (None, self.gen)):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _release_slots(self) -> None:
        """Drop the slots of an old layout (their published files stay until superseded)."""
        self.wait()
        for i, slot in enumerate(self._slots):
            if slot is None:
                continue
            if slot.step is None:  # never published: nothing to keep
                with contextlib.suppress(OSError):
                    os.unlink(slot.path)
            slot.close()
            self._slots[i] = None

    # ------------------------------------------------------------------ restore
    def restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        # Planning the reads flattens the live state, which initialises an empty optimizer with DCP's zero-lr step
        # (Adam's step count becomes 1): a restore that finds nothing puts it back, or a fresh start with the tier
        # trains differently from one without it.
        fresh = uninitialised_optimizers(state)
        self._flat_cache.clear()  # a restore may replace the optimizers' state tensors
        report = self._restore(state, not_older_than=not_older_than)
        if report is None:
            forget_optimizer_state(fresh)
        return report

    def _restore(self, state: Mapping[str, Any], *, not_older_than: int | None) -> RestoreReport | None:
        self.last_fallback_reason = "the memory tier is off (no keeper directory on some rank, or no room)"
        if not self.enabled:
            return None
        self.last_fallback_reason = None
        self.wait()
        started = time.perf_counter()
        per_rank = flatten(state).per_rank
        groups = self._readable_groups(per_rank)
        gathered = self._fg.all_gather(
            {"groups": [[g.snap.step, g.snap.gen] for g in groups], "not_older_than": not_older_than}
        )
        floors = [g["not_older_than"] for g in gathered if g["not_older_than"] is not None]
        floor = max(floors) if floors else None
        lists = [{SnapshotId(int(s), str(gen)) for s, gen in g["groups"]} for g in gathered]
        by_id = {g.snap: g for g in groups}
        touched = False
        while True:
            choice = choose_snapshot([sorted(x, key=lambda s: s.step) for x in lists], not_older_than=floor)
            if choice is None:
                if touched:
                    raise PartialRestoreError(
                        f"rank {self.rank}: every memory snapshot failed while being restored and the live state "
                        f"was partly overwritten; restore it from the durable tier or restart"
                    )
                logger.info("[rank %d] no memory snapshot every rank can read (durable floor %s)", self.rank, floor)
                self.last_fallback_reason = f"no memory snapshot every rank can read (durable floor {floor})"
                return None
            error: BaseException | None = None
            nbytes = 0
            try:
                touched = True
                nbytes = self._load_group(by_id[choice], state)
            except Exception as exc:  # noqa: BLE001 - voted on below; every failure falls back
                error = exc
            worst = self._fg.max(LoadOutcome.OK if error is None else LoadOutcome.DAMAGED)
            if worst == LoadOutcome.OK:
                seconds = time.perf_counter() - started
                logger.info(
                    "[rank %d] restored step %d from memory (gen %s): %d bytes in %.3fs",
                    self.rank, choice.step, choice.gen, nbytes, seconds,
                )
                return RestoreReport(RestoreSource.MEMORY_LOCAL, choice.step, nbytes, seconds)
            logger.warning(
                "[rank %d] memory snapshot of step %d (gen %s) not restored: %s; trying the next source",
                self.rank, choice.step, choice.gen, error if error is not None else "failed on another rank",
            )
            if error is not None:
                self._quarantine(choice)
            for x in lists:
                x.discard(choice)

    def _readable_groups(self, per_rank: dict[str, str]) -> list[_Group]:
        """The snapshot groups in this node's keeper this rank can restore from alone, newest first."""
        assert self.directory is not None
        found: dict[SnapshotId, dict[int, tuple[str, int]]] = {}
        try:
            names = os.listdir(self.directory)
        except OSError as exc:  # the keeper directory is gone: nothing in memory
            logger.warning("[rank %d] memory tier directory unreadable: %s", self.rank, exc)
            return []
        for name in names:
            parsed = parse_snapshot_name(name)
            if parsed is not None:
                snap, rank, world = parsed
                found.setdefault(snap, {})[rank] = (name, world)
        out: list[_Group] = []
        for snap in sorted(found, key=lambda s: s.step, reverse=True)[:GROUPS_LOOKED_AT]:
            try:
                out.append(self._group(snap, found[snap], per_rank))
            except Exception as exc:  # noqa: BLE001 - an unreadable group is skipped, like a corrupt step
                logger.warning("[rank %d] skipping memory snapshot of step %d (gen %s): %s", self.rank, snap.step, snap.gen, exc)
        return out

    def _group(self, snap: SnapshotId, files: dict[int, tuple[str, int]], per_rank: dict[str, str]) -> _Group:
        worlds = {world for _, world in files.values()}
        if len(worlds) != 1:
            raise CorruptSnapshotError(f"files of world sizes {sorted(worlds)}")
        (world,) = worlds
        manifests = {rank: self._read_manifest(name) for rank, (name, _) in files.items()}
        for rank, m in manifests.items():
            if (m.step, m.gen, m.rank, m.world_size) != (snap.step, snap.gen, rank, world):
                raise CorruptSnapshotError(f"the manifest of {files[rank][0]} names step {m.step} gen {m.gen} rank {m.rank}")
        blocks = {m.checksum_block_bytes for m in manifests.values()}
        if len(blocks) != 1:
            raise CorruptSnapshotError(f"ranks used different checksum blocks {sorted(blocks)}")
        manifest = merge_records(
            [m.records for _, m in sorted(manifests.items())],
            step=snap.step,
            world_size=world,
            block_bytes=blocks.pop(),
            has_objects=True,
            created_unix=max(m.created_unix for m in manifests.values()),
        )  # CheckpointError / CorruptCheckpointError when the pieces here do not tile every tensor
        group = _Group(snap, manifest, manifests[min(manifests)].objects)
        for key, rule in per_rank.items():
            src = per_rank_source(self.rank, self.world_size, world, rule)
            if src is None:
                continue
            if src not in manifests or key not in manifests[src].rank_objects:
                raise MemoryTierError(f"per-rank entry {key!r} of saved rank {src} is not in this node's memory")
            group.rank_objects[src] = manifests[src].rank_objects
        return group

    def _read_manifest(self, name: str) -> SnapshotManifest:
        assert self.directory is not None
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < FOOTER.size:
                raise CorruptSnapshotError(f"{path} is truncated ({size} bytes)")
            try:
                offset, length, crc = decode_footer(os.pread(fd, FOOTER.size, size - FOOTER.size), size)
            except ValueError as exc:
                raise CorruptSnapshotError(f"{path}: {exc}") from exc
            if length > MANIFEST_MAX_BYTES:
                raise CorruptSnapshotError(f"{path}: manifest of {length} bytes is implausible")
            raw = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(raw) != length or zlib.crc32(raw) != crc:
            raise CorruptSnapshotError(f"{path}: the manifest fails its crc32")
        try:
            return SnapshotManifest.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise CorruptSnapshotError(f"{path}: malformed manifest: {exc!r}") from exc

    def _load_group(self, group: _Group, state: Mapping[str, Any]) -> int:
        """Read the group into ``state`` with the durable read path; returns the bytes read."""
        assert self.directory is not None
        flat = flatten(state, keep_state_dicts=True)
        requests = plan_reads(group.manifest, flat.items)
        destinations = {item.key: item.tensor for item in flat.items}
        storage = StorageSpec.from_config(os.path.dirname(self.directory), CheckpointConfig(max_retries=1)).open()
        try:
            nbytes = read_requests(
                storage,
                os.path.basename(self.directory),
                requests,
                destinations.__getitem__,
                group.manifest.checksum_block_bytes,
                self.config.verify_on_restore,
                read_threads(self.config),
                part_bytes=READ_PART_BYTES,
            )
        finally:
            storage.close()
        flat.objects = group.objects
        saved_world = group.manifest.world_size
        rank_objects: dict[str, JSON] = {}
        for key, rule in flat.per_rank.items():
            src = per_rank_source(self.rank, self.world_size, saved_world, rule)
            if src is not None:
                rank_objects[key] = group.rank_objects[src][key]
        flat.rank_objects = rank_objects
        apply(state, flat)
        return nbytes

    def _quarantine(self, snap: SnapshotId) -> None:
        """Remove a group this rank failed to read, so a restart does not pick it again."""
        assert self.directory is not None
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                parsed = parse_snapshot_name(name)
                if parsed is not None and parsed[0] == snap:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.directory, name))

    # ------------------------------------------------------------------ lifecycle
    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def close(self) -> None:
        """Finish the snapshot in flight and unmap the slots; published snapshots stay for the next workers
        (the keeper removes them when the agent exits)."""
        self.wait()
        self._release_slots()
        self._flat_cache.clear()
        self._executor.shutdown(wait=True)
