"""The agent's hang watch: samples its workers' progress each monitor tick and acts on the pure verdict.

I/O edge of :mod:`elastic.hang`: reads :class:`~elastic.progress.ProgressBoard` and ``/proc``, asks stalled
workers for their stacks, and on a hang logs every worker's stack, SIGKILLs the hung ranks and writes a
torch-format error file for each, so the failure summary names the rank that hung (with its stack), not a
rank that later timed out waiting for it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing import ProcessFailure

from elastic.agent_hooks import AgentFeature, AgentHost, WorkersStarted, WorkersStarting
from elastic.api import RecoveryCause, RecoveryEvent
from elastic.hang import (
    HangPolicy,
    WorkerTrack,
    judge,
    new_track,
    observe,
    waiting_on_peers,
)
from elastic.progress import ProgressBoard
from elastic.workers import signal_worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HangReport:
    """One hung worker: why, and its Python stack when it could be taken."""

    local_rank: int
    pid: int
    reason: str
    stack: str | None


class HangWatch:
    """Tracks the progress of one worker group (reset on every worker start)."""

    def __init__(self, policy: HangPolicy, board: ProgressBoard, *, ctx: Callable[[], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._board = board
        self._ctx = ctx
        self._clock = clock
        self._tracks: dict[int, WorkerTrack] = {}
        self._stacks: dict[int, str] = {}
        self._waiting_logged: set[int] = set()

    def prepare(self, group_rank: int, local_world_size: int) -> None:
        """Before the workers start: fresh progress files for them."""
        self._board.reset(group_rank, range(local_world_size))
        self._tracks.clear()
        self._stacks.clear()
        self._waiting_logged.clear()

    def started(self, pids: dict[int, int]) -> None:
        now = self._clock()
        self._tracks = {local_rank: new_track(now, self.policy.window) for local_rank in pids}

    def check(self, pids: dict[int, int]) -> list[HangReport]:
        """Sample every worker; the hung ones (empty list: none), after looking at stalled workers' stacks."""
        now = self._clock()
        for local_rank, pid in pids.items():
            track = self._tracks.get(local_rank)
            sample = self._board.sample(local_rank, pid) if track is not None else None
            if sample is not None and track is not None:
                observe(track, sample, now)
                if track.waiting_on_peers is None:
                    self._stacks.pop(local_rank, None)
                    self._waiting_logged.discard(local_rank)
        verdict = judge(self._tracks, self.policy, now)
        if verdict.need_stack:
            stacks = self._board.stacks({r: pids[r] for r in verdict.need_stack if r in pids})
            for local_rank in verdict.need_stack:
                stack = stacks.get(local_rank)
                if stack is not None:
                    self._stacks[local_rank] = stack
                self._tracks[local_rank].waiting_on_peers = stack is not None and waiting_on_peers(
                    stack, self._board.main_thread_id(local_rank))
            verdict = judge(self._tracks, self.policy, now)
        for local_rank in verdict.waiting - self._waiting_logged:
            logger.warning("%s local rank %d made no progress for %.1f s but is waiting in a collective: a peer "
                           "is stalled (its agent decides)", self._ctx(), local_rank,
                           now - self._tracks[local_rank].last_progress_at)
            self._waiting_logged.add(local_rank)
        return [HangReport(local_rank, pids[local_rank], reason, self._stacks.get(local_rank))
                for local_rank, reason in sorted(verdict.hung.items()) if local_rank in pids]

    def beats(self) -> dict[int, int]:
        """Each worker's beat count as last sampled by :meth:`check` (local rank -> beats)."""
        return {local_rank: track.beats for local_rank, track in self._tracks.items()}

    def steps(self) -> dict[int, int | None]:
        """Each worker's reported training step (``elastic.progress.report_step``; None: never reported)."""
        return {local_rank: self._board.step(local_rank) for local_rank in self._tracks}

    def dump_all(self, pids: dict[int, int]) -> dict[int, str]:
        """Every worker's stack into the agent log (taken now for those not already looked at)."""
        fresh = self._board.stacks({r: p for r, p in pids.items() if r not in self._stacks})
        self._stacks.update(fresh)
        for local_rank in sorted(pids):
            stack = self._stacks.get(local_rank)
            logger.warning("%s stack of local rank %d (pid %d):\n%s", self._ctx(), local_rank, pids[local_rank],
                           stack.rstrip() if stack else "(unavailable: stopped, uninstrumented, or py-spy missing)")
        return dict(self._stacks)

    def close(self) -> None:
        self._board.close()


def kill_hung(reports: list[HangReport]) -> None:
    """SIGKILL the hung workers (their process group when they lead one); SIGTERM may never be handled."""
    for report in reports:
        signal_worker(report.pid, signal.SIGKILL)


def write_hang_error_file(path: str, report: HangReport, global_rank: int) -> None:
    """A torch-format error file so ``ChildFailedError``'s summary says this rank hung, with its stack."""
    message = f"HangDetected: rank {global_rank} (local rank {report.local_rank}, pid {report.pid}) {report.reason}"
    if report.stack:
        message += "\nPython stack at detection (most recent call first):\n" + report.stack.rstrip()
    data = {"message": {"message": message,
                        # torch's summary prints py_callstack as the "traceback" of the rank
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError:
        logger.warning("could not write the hang error file %s", path, exc_info=True)


class HangFeature(AgentFeature):
    """The agent's hook of the hang watch: CHANGE: torch notices only workers that exit; a hung worker holds the
    whole job until the process group's own timeout (30 min for gloo by default), and the summary then blames a
    rank that timed out waiting for it. Progress is judged every tick; the hung ranks alone are the failure."""

    def __init__(self, watch: HangWatch, host: AgentHost) -> None:
        self.watch = watch
        self._host = host
        self.hung = False
        """The current failure is a hang this feature detected (until the next worker start)."""

    def on_workers_starting(self, event: WorkersStarting) -> None:
        self.watch.prepare(event.group_rank, event.local_world_size)
        self.hung = False

    def on_workers_started(self, event: WorkersStarted) -> None:
        if not event.in_place:
            self.watch.started(dict(event.pids))

    def on_monitor(self, result: RunResult) -> RunResult | None:
        pcontext = self._host.pcontext
        if result.state != WorkerState.HEALTHY or pcontext is None:
            return None
        reports = self.watch.check(pcontext.pids())
        return self.fail_hung(reports) if reports else None

    def fail_hung(self, reports: list[HangReport]) -> RunResult:
        """Log every worker's stack, kill the hung ones and report them (alone) as the failed ranks."""
        host = self._host
        pcontext = host.pcontext
        assert pcontext is not None, "a hang is judged only while workers run"
        host.begin_recovery(RecoveryCause.HANG)
        hung = {host.worker_group.workers[r.local_rank].global_rank: r for r in reports}
        for global_rank, report in hung.items():
            logger.error("%s rank %d (local rank %d, pid %d) is hung: %s", host.ctx(), global_rank,
                         report.local_rank, report.pid, report.reason)
        host.emit(RecoveryEvent.HANG_DETECTED, hung={str(g): r.reason for g, r in hung.items()},
                  pids={str(g): r.pid for g, r in hung.items()})
        self.watch.dump_all(pcontext.pids())
        kill_hung(reports)
        failures = {}
        for global_rank, report in hung.items():
            error_file = pcontext.error_files[report.local_rank]
            write_hang_error_file(error_file, report, global_rank)
            failures[global_rank] = ProcessFailure(local_rank=report.local_rank, pid=report.pid,
                                                   exitcode=-int(signal.SIGKILL), error_file=error_file)
        self.hung = True
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def close(self) -> None:
        self.watch.close()
