"""Injecting a schedule into a running job: resolve each fault's target, act, journal, undo when it ends.

The decision of what is due is :func:`elastic.chaos.schedule.due` (pure); this module is the I/O edge. Every
action signals only PIDs it resolved from the job it was pointed at (agent PIDs given by the caller, etcd
members found by their endpoints), never processes found by name.
"""

from __future__ import annotations

import heapq
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from checkpoint._sys.procutil import exited
from elastic.chaos import targets
from elastic.chaos.api import ChaosTargetError, Fault, FaultKind, FaultSkipped, Schedule
from elastic.chaos.hold import hold_sockets, release
from elastic.chaos.journal import Journal
from elastic.chaos.schedule import due, next_wake
from elastic.chaos.storage import write_control
from elastic.memory_keeper import KEEPER_DEATH_SIGNAL

logger = logging.getLogger(__name__)

HOLD_S = 30.0
"""Default time a killed worker's connections are held open (``kill_worker`` with ``hold_connections``)."""
ETCD_RESTART_DELAY_S = 1.0
"""Default time an etcd member stays down before it is started again (``duration_s`` overrides it)."""


@dataclass(order=True)
class _Undo:
    at: float
    seq: int
    what: str = field(compare=False)
    action: Callable[[], dict[str, Any]] = field(compare=False)


class Injector:
    """Fires the faults of ``schedule`` against one job. Call :meth:`tick` (or :meth:`run`) and finally
    :meth:`close`, which ends every fault still in force (SIGCONT, links up, members started, storage clean)."""

    def __init__(
        self,
        schedule: Schedule,
        journal: Journal,
        *,
        agent_pids: Callable[[], Sequence[int]] | Sequence[int] = (),
        etcd_endpoints: Sequence[str] = (),
        storage_control: str | None = None,
        events_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.schedule = schedule
        self.journal = journal
        self._agents = agent_pids if callable(agent_pids) else (lambda: list(agent_pids))
        self.etcd_endpoints = list(etcd_endpoints)
        self.storage_control = storage_control
        self.events_file = events_file
        self._clock = clock
        self._sleep = sleep
        self._rng = random.Random(schedule.seed)
        self._t0 = clock()
        self.fired: list[int] = []
        self.fired_at: dict[int, float] = {}
        """Elapsed seconds at which each fired fault fired (``after`` triggers count from it)."""
        self._undo: list[_Undo] = []
        self._seq = 0
        self._storage_faults: dict[int, dict[str, Any]] = {}
        self.started: list[subprocess.Popen[bytes]] = []
        """etcd members this injector started again (the caller owns them afterwards)."""
        self.injected: list[dict[str, Any]] = []
        """Journal records of faults actually injected (not skipped)."""

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def reset_clock(self) -> None:
        """Count ``at_s`` from now (e.g. from the job's first step, not from its start-up)."""
        self._t0 = self._clock()

    # ------------------------------------------------------------------ loop
    def tick(self, step: int | None = None, limit: int | None = None, *, followers_only: bool = False) -> list[dict[str, Any]]:
        """Fire what is due now (at most ``limit`` faults: the rest stay due) and end what has run its
        course; returns the journal records written. ``followers_only``: fire only faults triggered ``after``
        another (a caller that holds new faults back until the job recovered still lets a fault land inside
        the recovery it was scheduled into)."""
        out = self.end_due()
        now = self.elapsed()
        ready = due(self.schedule, self.fired_at, now, step)
        if followers_only:
            ready = [i for i in ready if self.schedule.faults[i].after is not None]
        for index in ready[:limit]:
            self.fired.append(index)
            self.fired_at[index] = self.elapsed()
            out.append(self.fire(index))
        return out

    def end_due(self) -> list[dict[str, Any]]:
        """End the faults that have run their course (and fire nothing): while a caller holds new faults
        back, e.g. until the job has recovered from the last one, what is in force still ends on time."""
        out = []
        now = self.elapsed()
        while self._undo and self._undo[0].at <= now:
            out.append(self._run_undo(heapq.heappop(self._undo)))
        return out

    def run(self, done: Callable[[], bool], step: Callable[[], int | None] = lambda: None,
            poll_s: float = 0.05) -> None:
        """Tick until ``done()`` (e.g. the job exited) or nothing is left to fire or undo."""
        while not done():
            self.tick(step())
            if next_wake(self.schedule, self.fired_at, self.elapsed()) is None and not self._undo \
                    and len(self.fired) == len(self.schedule.faults):
                return
            self._sleep(poll_s)

    def close(self) -> None:
        """End every fault still in force, now."""
        while self._undo:
            self._run_undo(heapq.heappop(self._undo))

    def pending(self) -> int:
        """Faults not fired yet."""
        return len(self.schedule.faults) - len(self.fired)

    # ------------------------------------------------------------------ one fault
    def fire(self, index: int) -> dict[str, Any]:
        fault = self.schedule.faults[index]
        base = {"index": index, **fault.to_json(), "elapsed_s": round(self.elapsed(), 3)}
        try:
            detail = self._act(index, fault)
        except FaultSkipped as exc:
            logger.warning("chaos: %s %s skipped: %s", fault.kind.value, fault.target, exc)
            return self.journal.write("skipped", **base, reason=str(exc))
        except (ChaosTargetError, OSError, subprocess.SubprocessError) as exc:
            logger.warning("chaos: %s %s failed: %s", fault.kind.value, fault.target, exc)
            return self.journal.write("failed", **base, reason=str(exc))
        logger.info("chaos: injected %s on %s %s", fault.kind.value, fault.target, detail)
        record = self.journal.write("injected", **base, **detail)
        self.injected.append(record)
        return record

    def _act(self, index: int, fault: Fault) -> dict[str, Any]:
        kind = fault.kind
        if kind is FaultKind.KILL_WORKER and fault.params.get("hold_connections"):
            rank, pid = self._pick_worker(fault.target)
            try:
                held = hold_sockets(pid)
            except OSError as exc:
                raise FaultSkipped(f"cannot hold worker {pid}'s connections open ({exc}): needs Linux 5.6+ and "
                                   "ptrace rights over it (root, or run the job under the injector)") from exc
            os.kill(pid, signal.SIGKILL)
            self._later(HOLD_S if fault.duration_s is None else fault.duration_s,
                        f"release the connections of worker {pid}", lambda: release(held))
            return {"rank": rank, "pid": pid, "held": len(held)}
        if kind in (FaultKind.KILL_WORKER, FaultKind.STOP_WORKER):
            rank, pid = self._pick_worker(fault.target)
            os.kill(pid, signal.SIGSTOP if kind is FaultKind.STOP_WORKER else signal.SIGKILL)
            if kind is FaultKind.STOP_WORKER and fault.duration_s is not None:
                self._later(fault.duration_s, f"SIGCONT {pid}", lambda: _cont(pid))
            return {"rank": rank, "pid": pid}
        if kind in (FaultKind.KILL_AGENT, FaultKind.TERM_AGENT):
            agent = self._pick(fault.target, list(self._agents()), "agent")
            if kind is FaultKind.TERM_AGENT:
                os.kill(agent, signal.SIGTERM)
                return {"pid": agent}
            tree = targets.node_tree(agent)  # all but the resource tracker, which cleans up after them
            for pid in tree:  # the agent first: it must not see its workers die and restart them
                _kill(pid, signal.SIGKILL)
            return {"pid": agent, "pids": tree}
        if kind is FaultKind.STOP_AGENT:
            agent = self._pick(fault.target, list(self._agents()), "agent")
            tree = targets.node_tree(agent)
            for pid in tree:  # the agent first: it must not see its workers stop and call them hung
                _kill(pid, signal.SIGSTOP)
            if fault.duration_s is not None:
                self._later(fault.duration_s, f"SIGCONT node of agent {agent}", lambda: _cont_all(tree))
            return {"pid": agent, "pids": tree}
        if kind is FaultKind.KILL_KEEPER:
            agent = self._pick(fault.target, list(self._agents()), "agent")
            keeper = targets.keeper_of(agent)
            if keeper is None:
                raise ChaosTargetError(f"{fault.target!r}: agent {agent} has no memory tier keeper process")
            name = str(fault.params.get("signal", "KILL"))  # KILL or TERM (checked by the schedule)
            os.kill(keeper, signal.SIGKILL if name == "KILL" else _keeper_leave_signal())
            return {"pid": keeper, "agent": agent, "signal": name}
        if kind in (FaultKind.RESTART_ETCD, FaultKind.KILL_ETCD_LEADER):
            return self._restart_etcd(fault)
        if kind is FaultKind.PARTITION:
            return self._partition(fault)
        return self._storage(index, fault)

    def _pick(self, target: str, choices: list[int], what: str) -> int:
        if not choices:
            raise ChaosTargetError(f"no {what} to target for {target!r}")
        which = target.split(":", 1)[1]
        if which == "any":
            return self._rng.choice(sorted(choices))
        try:
            return choices[int(which)]
        except (ValueError, IndexError):
            raise ChaosTargetError(f"{target!r}: no such {what} (have {len(choices)})") from None

    def _pick_worker(self, target: str) -> tuple[int, int]:
        by_rank = targets.workers(list(self._agents()), self.events_file)
        if not by_rank:
            raise ChaosTargetError(f"{target!r}: the agents have no workers right now")
        which = target.split(":", 1)[1]
        rank = self._rng.choice(sorted(by_rank)) if which == "any" else _int(which, target)
        if rank not in by_rank:
            raise ChaosTargetError(f"{target!r}: no worker with rank {rank} (ranks {sorted(by_rank)})")
        return rank, by_rank[rank]

    def _restart_etcd(self, fault: Fault) -> dict[str, Any]:
        if not self.etcd_endpoints:
            raise ChaosTargetError(f"{fault.kind.value}: no etcd endpoints given (--etcd-endpoints)")
        which = fault.target.split(":", 1)[1]
        if fault.kind is FaultKind.KILL_ETCD_LEADER or which == "leader":
            endpoint = targets.etcd_leader(self.etcd_endpoints)
        elif which == "any":
            endpoint = self._rng.choice(self.etcd_endpoints)
        else:
            try:
                endpoint = self.etcd_endpoints[int(which)]
            except (ValueError, IndexError):
                endpoint = which  # an endpoint given by address
        pid = targets.etcd_member_pid(endpoint)
        image = targets.process_image(pid)
        os.kill(pid, signal.SIGKILL)
        delay = ETCD_RESTART_DELAY_S if fault.duration_s is None else fault.duration_s

        def restart() -> dict[str, Any]:
            _wait_gone(pid, 10.0, self._sleep)
            proc = subprocess.Popen(image.argv, cwd=image.cwd, env=image.env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            self.started.append(proc)
            return {"endpoint": endpoint, "pid": proc.pid}

        self._later(delay, f"restart etcd {endpoint}", restart)
        return {"endpoint": endpoint, "pid": pid}

    def _partition(self, fault: Fault) -> dict[str, Any]:
        netns = fault.target.split(":", 1)[1]
        if os.geteuid() != 0:
            raise FaultSkipped("cutting a network namespace off needs root (CAP_NET_ADMIN)")
        if shutil.which("ip") is None:
            raise FaultSkipped("no `ip` command (iproute2)")
        links = _netns_links(netns)
        for link in links:
            _ip("-n", netns, "link", "set", link, "down")

        def heal() -> dict[str, Any]:
            for link in links:
                _ip("-n", netns, "link", "set", link, "up")
            return {"netns": netns, "links": links}

        if fault.duration_s is not None:
            self._later(fault.duration_s, f"links up in {netns}", heal)
        return {"netns": netns, "links": links}

    def _storage(self, index: int, fault: Fault) -> dict[str, Any]:
        if not self.storage_control:
            raise ChaosTargetError(f"{fault.kind.value}: no storage control file (--storage-control) to write")
        until = None if fault.duration_s is None else time.time() + fault.duration_s
        self._storage_faults[index] = {"kind": fault.kind.value, "params": dict(fault.params), "until_wall": until}
        self._write_storage()
        if fault.duration_s is not None:
            def clear() -> dict[str, Any]:
                self._storage_faults.pop(index, None)
                self._write_storage()
                return {"kind": fault.kind.value}

            self._later(fault.duration_s, f"end {fault.kind.value}", clear)
        return {"control": self.storage_control, "until_wall": until}

    def _write_storage(self) -> None:
        assert self.storage_control is not None
        write_control(self.storage_control, self.schedule.seed, list(self._storage_faults.values()))

    # ------------------------------------------------------------------ undo
    def _later(self, delay: float, what: str, action: Callable[[], dict[str, Any]]) -> None:
        self._seq += 1
        heapq.heappush(self._undo, _Undo(self.elapsed() + delay, self._seq, what, action))

    def _run_undo(self, undo: _Undo) -> dict[str, Any]:
        try:
            detail = undo.action()
        except (ChaosTargetError, OSError, subprocess.SubprocessError) as exc:
            return self.journal.write("undo_failed", what=undo.what, reason=str(exc))
        return self.journal.write("undone", what=undo.what, elapsed_s=round(self.elapsed(), 3), **detail)


def _int(text: str, target: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ChaosTargetError(f"{target!r}: expected a number or 'any' after the colon") from None


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _cont(pid: int) -> dict[str, Any]:
    _kill(pid, signal.SIGCONT)
    return {"pid": pid}


def _cont_all(pids: list[int]) -> dict[str, Any]:
    for pid in pids:
        _kill(pid, signal.SIGCONT)
    return {"pids": pids}


def _wait_gone(pid: int, timeout: float, sleep: Callable[[float], None]) -> None:
    """Until the killed member's ports are free (its PID gone or a zombie), so the restart can bind them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if exited(pid):
            return
        sleep(0.02)


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        raise FaultSkipped(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _netns_links(netns: str) -> list[str]:
    out = _ip("-n", netns, "-o", "link", "show")
    links = []
    for line in out.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        if name != "lo":
            links.append(name)
    if not links:
        raise FaultSkipped(f"network namespace {netns} has no link besides lo")
    return links


def _keeper_leave_signal() -> signal.Signals:
    """What makes a keeper leave as if its agent had died, removing the node's snapshots: ``kill_keeper``'s
    ``TERM``. Not SIGTERM itself, which a keeper ignores (a notice is its agent's to handle)."""
    return KEEPER_DEATH_SIGNAL
