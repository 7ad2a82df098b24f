"""Hang detection: pure decisions over progress samples (no I/O; the agent samples and acts).

A worker makes *progress* when its beat counter moves (optimizer steps seen by a global
``torch.optim`` post-step hook, or explicit :func:`elastic.progress.heartbeat` calls) or when its main
thread ran at all since the previous sample (a thread blocked for good in a lock, a collective or a
sleep does not; a frozen process neither). A worker whose progress stopped for longer than its budget is
*stalled*. A stalled worker is not necessarily the culprit: in a collective with a hung peer every other
rank stalls too. So the agent looks at a stalled worker's Python stack (:func:`waiting_on_peers`): a worker
blocked inside ``torch.distributed`` (or DDP's backward) is waiting for someone else and is not blamed; a
stopped worker (SIGSTOP, ``T`` state) or one stalled anywhere else is *hung*. A job whose ranks all wait in
collectives (a true distributed deadlock, or a hung rank on a node whose agent already acted) is left to
that node's agent and to the process group's own timeout, as under torchrun.

Budgets: ``startup_timeout`` until a worker's ``warmup_beats``-th beat (start-up, checkpoint load, first
step) but never longer than ``startup_timeout`` after the worker started; afterwards ``timeout`` when fixed,
else adaptive: ``multiplier`` x the slowest of the recent step intervals (beats), at least ``floor``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from elastic import options
from elastic.api import LaunchConfigError


@dataclass(kw_only=True, slots=True)
class HangPolicy:
    """How long a worker may go without progress before it counts as hung."""

    timeout: float | None = options.HANG_TIMEOUT.default
    """Fixed budget in seconds after start-up (``--hang-timeout``); None adapts to the observed step time."""

    startup_timeout: float = options.HANG_STARTUP_TIMEOUT.default
    """Budget for start-up, the first steps and checkpoint load (``--hang-startup-timeout``)."""

    multiplier: float = 10.0
    """Adaptive budget: this many times the slowest recent step interval."""

    floor: float = 60.0
    """Adaptive budget: never below this many seconds (eval loops and checkpoint saves pause steps)."""

    warmup_beats: int = 3
    """Beats (optimizer steps, heartbeats) after which start-up is over and the step budget applies."""

    window: int = 32
    """Recent step intervals the adaptive budget looks at."""

    def __post_init__(self) -> None:
        for name in ("timeout", "startup_timeout", "multiplier", "floor"):
            value = getattr(self, name)
            if value is None and name == "timeout":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise LaunchConfigError(
                    f"hang detection: {name} must be a finite number > 0, got {value!r}; "
                    f"e.g. --{'hang-timeout' if name == 'timeout' else 'hang-startup-timeout'} 60"
                )
        if self.warmup_beats < 1 or self.window < 1:
            raise LaunchConfigError("hang detection: warmup_beats and window must be >= 1")


@dataclass(frozen=True, slots=True)
class ProgressSample:
    """One observation of one worker, taken by the agent."""

    beats: int
    """The worker's beat counter (monotonic within one worker process)."""
    activity: int | None
    """Grows whenever the worker's main thread runs at all (its CPU time in ns from ``/proc``, which a wake-up
    from a sleep or a poll also advances); None when unreadable."""
    stopped: bool = False
    """The process is stopped (``T``: SIGSTOP or a tracer) and cannot make progress."""


@dataclass(slots=True)
class WorkerTrack:
    """What the agent knows about one worker's progress (folded from samples by :func:`observe`)."""

    started_at: float
    last_progress_at: float
    beats: int = 0
    activity: int | None = None
    stopped: bool = False
    last_beat_at: float | None = None
    step_intervals: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    waiting_on_peers: bool | None = None
    """For the current stall: True if its stack shows it waiting in a collective, None if not looked at."""


def new_track(now: float, window: int = 32) -> WorkerTrack:
    return WorkerTrack(started_at=now, last_progress_at=now, step_intervals=deque(maxlen=window))


def observe(track: WorkerTrack, sample: ProgressSample, now: float) -> None:
    """Fold one sample into ``track``: any beat or main-thread activity is progress and ends a stall."""
    progressed = False
    if sample.beats > track.beats:
        if track.last_beat_at is not None:
            # Several beats between two samples: the mean interval is the best estimate of a step.
            track.step_intervals.append((now - track.last_beat_at) / (sample.beats - track.beats))
        track.beats = sample.beats
        track.last_beat_at = now
        progressed = True
    if sample.activity is not None and track.activity is not None and sample.activity > track.activity:
        progressed = True
    if sample.activity is not None:
        track.activity = sample.activity
    track.stopped = sample.stopped
    if progressed and not sample.stopped:
        track.last_progress_at = now
        track.waiting_on_peers = None


def budget(track: WorkerTrack, policy: HangPolicy, now: float) -> float:
    """Seconds of no progress this worker is allowed at ``now``."""
    in_startup = track.beats < policy.warmup_beats and now - track.started_at < policy.startup_timeout
    if in_startup:
        return policy.startup_timeout
    if policy.timeout is not None:
        return policy.timeout
    slowest = max(track.step_intervals, default=0.0)
    return max(policy.floor, policy.multiplier * slowest)


@dataclass(frozen=True, slots=True)
class HangVerdict:
    """The decision for one sampling tick."""

    hung: dict[int, str]
    """Local rank -> why it counts as hung (empty: no hang)."""
    need_stack: frozenset[int]
    """Stalled workers whose stack must be looked at before they can be judged."""
    waiting: frozenset[int]
    """Stalled workers waiting on peers in a collective (not blamed)."""


def judge(tracks: dict[int, WorkerTrack], policy: HangPolicy, now: float) -> HangVerdict:
    """Which workers are hung, which stalled ones need a stack look first, which wait on peers."""
    hung: dict[int, str] = {}
    need_stack: set[int] = set()
    waiting: set[int] = set()
    for rank, track in tracks.items():
        allowed = budget(track, policy, now)
        stalled_for = now - track.last_progress_at
        if stalled_for <= allowed:
            continue
        what = f"no progress for {stalled_for:.1f} s (budget {allowed:.1f} s"
        what += ", start-up)" if allowed == policy.startup_timeout and track.beats < policy.warmup_beats else ")"
        if track.stopped:
            hung[rank] = f"{what}; process is stopped (SIGSTOP or traced)"
        elif track.waiting_on_peers is None:
            need_stack.add(rank)
        elif track.waiting_on_peers:
            waiting.add(rank)
        else:
            hung[rank] = what
    return HangVerdict(hung=hung, need_stack=frozenset(need_stack), waiting=frozenset(waiting))


#: Where a stalled main thread's innermost frame is when it waits for other ranks, not stuck itself: a c10d
#: collective or barrier, DDP, or autograd's engine (where DDP's gradient all-reduce blocks).
PEER_WAIT_FRAMES = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py",
                    "torch/distributed/_functional_collectives", "torch/distributed/device_mesh.py",
                    "torch/nn/parallel/distributed.py", "torch/autograd/")


def waiting_on_peers(stack_dump: str, main_thread_id: int | None = None) -> bool:
    """True if the innermost frame of the main thread in a ``faulthandler`` dump is in a collective (see
    :data:`PEER_WAIT_FRAMES`). The main thread is the block headed by ``main_thread_id`` (as the worker
    reported it); without it, the last block (faulthandler lists the oldest thread last). Only the innermost
    frame counts: every worker runs under torch.distributed.elastic's entrypoint wrappers."""
    blocks = [block for block in stack_dump.split("\n\n") if "File " in block]
    if not blocks:
        return False
    main = blocks[-1]
    if main_thread_id is not None:
        header = f"0x{main_thread_id:016x}"
        main = next((block for block in blocks if header in block.split("\n", 1)[0]), main)
    frames = [line for line in main.splitlines() if line.strip().startswith("File ")]
    return bool(frames) and any(fragment in frames[0] for fragment in PEER_WAIT_FRAMES)
