"""The agent<->worker mailbox: the one protocol between a spotrun agent and its training processes.

Both sides import this module (the agent: ``elastic.agent``, ``elastic.launcher``; the workers:
``elastic.worker.preemption``); what crosses the process boundary is typed here, at its edges:
:class:`WorkerNotice` (agent -> workers) and :class:`Acknowledgement` (workers -> agent).

The files (the *mailbox* is a private directory the agent creates and names in
``SPOTRUN_NOTICE_DIR``; a worker whose environment a wrapper rebuilt without it, e.g. ``accelerate launch`` or
``srun`` inside spotrun, finds it like the hang-detection files, through a link named after
``TORCHELASTIC_RUN_ID`` and ``GROUP_RANK`` that the agent publishes at every worker start, see :func:`find_mailbox`):

* ``notice.json``  written (atomically) by the agent when its node got a preemption notice, a peer's
  notice arrived through etcd, or the group is about to change size (a node joins): ``{"reason",
  "deadline", "source", "save_by"}`` (``save_by``: when the agent gives up waiting, the deadline minus its
  stop grace; absent in older notices). Workers only ``stat`` it: a poll costs a few microseconds.
* ``helper-{local_rank}``  written by :class:`~elastic.worker.preemption.Preemption` at construction: the agent then knows its workers
  will stop by themselves at an agreed step, and waits for them instead of killing them.
* ``coming-{local_rank}``  written when a worker imports ``elastic.worker.preemption`` (also through
  ``elastic.preemption``): the script will build a helper, it has not yet (imports, the restore). A notice that
  arrives before the helpers exist then finds workers that trained nothing since their restore: the node
  leaves as a planned leave instead of taking torch's immediate shutdown (``elastic.planned.helper_outlook``).
* ``watching-{local_rank}``  written by a worker whose peer-loss watcher runs (:mod:`elastic.worker.watcher`,
  started with its ``Preemption`` helper): it aborts the training's process group when told a peer is gone.
* ``peer-lost.json``  written by the agent the moment it knows a peer of the round is gone (its lease, a probe):
  ``{"lost": "node,...", "time", "restarted"}``. A watching worker aborts its group, so a collective blocked on
  the lost peer (NCCL never fails on a dead peer; gloo waits on a paused or cut-off one) raises now, and the
  just-in-time snapshot of the last completed step runs before the worker exits. ``restarted: true``: the
  peers are not gone, their workers failed and their agents restart them (the round announced it, a
  collective with the dead workers may hang just the same); they will join, so only joinable workers wait.
* ``ack-{local_rank}.json``  written after the agreed step is committed: ``{"step", "time"}``; or, when the
  save could not commit before ``save_by`` and was not started, ``{"step", "time", "saved": false, "why"}``
  (a record without ``saved`` is a committed one). Workers that all acknowledged and exited 0 ended for a
  planned change, not because training finished.
* ``waiting-{local_rank}``  written by a worker that acknowledged the agreed step and, instead of exiting,
  waits in place for its new group (:mod:`elastic.worker.inplace`, :mod:`elastic.worker.reform`).
* ``inplace-{local_rank}``  written by a worker that runs its training under :func:`elastic.inplace.run` (at
  every entry of its training function): it can re-form in place. The agent re-forms in place only when every
  local worker wrote it (and ``SPOTRUN_REFORM_IN_PLACE`` is not ``0``); otherwise it restarts them.
* ``fallback-{local_rank}.json``  written by such a worker that gave up re-forming in place and is about to exit
  for a restart: ``{"why", "detail"}`` (``elastic.api.InPlaceFallback``); the agent reports it in its
  ``in_place_fallback`` event and restarts the group without charging ``--max-restarts``.
* ``group-{local_rank}.json``  written by the agent for such a worker once the survivors re-formed: its new
  ``rank``, ``world_size``, ``group_rank``, ``group_world_size``, ``master_addr``, ``master_port``,
  ``restart_count``; the worker removes it when read.
* ``.agent.lock``  held (``flock``) by the agent for its whole life: the kernel releases it when the agent dies,
  even by SIGKILL, so the next agent on the host removes the orphaned mailbox (:func:`remove_orphaned_mailboxes`)
  and a worker never follows a link to a dead agent's mailbox.
* ``.signals``  written by the agent at creation: the signal numbers that are a preemption notice to it
  (SIGTERM and ``--preempt-signal``). A scheduler that signals every process of the job step (Slurm's
  ``--signal``, its time limit and preemption, with proctrack/linuxproc or cgroup) delivers the notice to the
  workers too: a worker running :class:`~elastic.worker.preemption.Preemption` takes it as its node's notice and stops at the agreed
  step like one told through ``notice.json``.
* ``stopping``  written by the agent just before it signals its workers to stop them (a restart, a failed
  group, its own shutdown, a second SIGTERM): a notice signal that arrives then is that stop, and the helper
  lets it end the worker as an unhandled signal would, so recovery is not slowed by a save nobody waits for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import stat
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.api import ENV_NOTICE_DIR, InPlaceFallback
from elastic.worker.runfiles import (
    SWEEP_LIMIT,
    hold_owner_lock,
    lock_if_orphaned,
    remove_orphaned_dirs,
    run_scoped_path,
    run_scoped_prefix,
)

logger = logging.getLogger(__name__)

JsonScalar = str | int | float | bool | None
"""What a mailbox record holds: flat JSON objects of scalars (and ``.signals``, a list of ints)."""

NOTICE_FILE = "notice.json"
MAILBOX_PREFIX = "spotrun-mailbox-"
LOCK_FILE = ".agent.lock"
"""Held by the agent while it lives; names starting with a dot are not messages (``clear`` keeps them)."""
SIGNALS_FILE = ".signals"
"""The agent's notice signals (a JSON list of numbers), for the whole life of the mailbox."""
STOPPING_FILE = "stopping"
"""Present while the agent stops the current worker group (removed by ``clear`` at the next start)."""
LINK_KIND = "notice-dir"
"""``spotrun-notice-dir-{uid}-{run}-{group_rank}`` beside the progress files: a link to the agent's mailbox."""
MAX_MESSAGE_BYTES = 64 * 1024
"""Largest mailbox file parsed (an acknowledgement or a notice is under 200 bytes): a bigger one, a deeply nested
one or anything but a regular file is malformed, so a worker's stray write cannot stall the agent's 10 ms poll."""
MAX_FALLBACK_DETAIL = 2000
"""Characters of a fallback's detail kept (written and read: it goes into the agent's ``in_place_fallback`` event)."""
_FALLBACK_REASONS = frozenset(reason.value for reason in InPlaceFallback)


@dataclass(frozen=True, slots=True)
class WorkerNotice:
    """What the agent tells its workers: why they must stop and by when (wall-clock seconds)."""

    reason: str
    """``preempt`` (this node goes away), ``peer_preempt`` (another node does), ``resize`` (a node joins)."""
    deadline: float | None
    source: str = ""
    save_by: float | None = None
    """Wall-clock time the agent stops waiting for the save (``deadline - stop_grace``); None: no bound."""


@dataclass(frozen=True, slots=True)
class Acknowledgement:
    """One worker's ``ack-{local_rank}.json``, validated: it stopped at ``step`` for the planned change."""

    step: int
    """The agreed step."""
    time: float | None
    """Wall-clock time it was written (right after the commit); None in a record without a valid one."""
    saved: bool
    """The step was committed (records written before ``saved`` existed all were)."""
    why: str
    """Why it was not saved (empty when saved)."""


@dataclass(frozen=True, slots=True)
class GroupAssignment:
    """What the agent tells a worker waiting in place (``group-{local_rank}.json``): its place in the
    re-formed group, as the environment torch's agent gives a new worker."""

    rank: int
    world_size: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    restart_count: int

    def __post_init__(self) -> None:
        problems = [
            f"{name} {value} not in [0, {bound})" for name, value, bound in (
                ("rank", self.rank, self.world_size), ("group_rank", self.group_rank, self.group_world_size))
            if not 0 <= value < bound
        ]
        if not 0 < self.master_port < 65536:
            problems.append(f"master_port {self.master_port} not in [1, 65535]")
        if not self.master_addr or any(c.isspace() for c in self.master_addr):
            problems.append(f"master_addr {self.master_addr!r} is not a host name")
        if self.restart_count < 0:
            problems.append(f"restart_count {self.restart_count} < 0")
        if problems:
            raise ValueError("; ".join(problems))

    def to_env(self) -> dict[str, str]:
        """The worker environment variables that change with the group (what ``env://`` reads)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "GROUP_RANK": str(self.group_rank),
                "GROUP_WORLD_SIZE": str(self.group_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port), "TORCHELASTIC_RESTART_COUNT": str(self.restart_count)}


_HELPER_FILE = re.compile(r"helper-(\d+)")
_COMING_FILE = re.compile(r"coming-(\d+)")
_WATCHING_FILE = re.compile(r"watching-(\d+)")
PEER_LOST_FILE = "peer-lost.json"
_WAITING_FILE = re.compile(r"waiting-(\d+)")
_IN_PLACE_FILE = re.compile(r"inplace-(\d+)")
_JOINABLE_FILE = re.compile(r"joinable-(\d+)")
_FALLBACK_FILE = re.compile(r"fallback-(\d+)\.json")
_ACK_FILE = re.compile(r"ack-(\d+)\.json")


class Mailbox:
    """The files of one agent's mailbox; both the agent and its workers use this class (one protocol)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._link: str | None = None
        self._reported: set[tuple[str, int, int, int]] = set()
        """Malformed acknowledgements already warned about, by version (name, inode, mtime_ns, size): each is
        said once and not parsed again (a 64 KiB nest costs milliseconds, the agent polls every 10 ms)."""

    @classmethod
    def create(cls, root: str | None = None, *,
               notice_signals: Sequence[int] = (signal.SIGTERM,)) -> Mailbox:
        """A fresh mailbox for this agent, locked for its life; orphans of dead agents are removed first.
        ``notice_signals``: the signals that are a preemption notice to the agent (its workers' helpers take
        them as the notice too, see ``.signals``)."""
        root = root or tempfile.gettempdir()
        remove_orphaned_mailboxes(root)
        box = cls(tempfile.mkdtemp(prefix=MAILBOX_PREFIX, dir=root))
        box._lock_fd = hold_owner_lock(os.path.join(box.path, LOCK_FILE))
        _write_atomic(os.path.join(box.path, SIGNALS_FILE), [int(sig) for sig in notice_signals])
        return box

    @property
    def notice_path(self) -> str:
        return os.path.join(self.path, NOTICE_FILE)

    # --- agent side
    def post(self, notice: WorkerNotice) -> None:
        _write_atomic(os.path.join(self.path, NOTICE_FILE),
                      {"reason": notice.reason, "deadline": notice.deadline, "source": notice.source,
                       "save_by": notice.save_by})

    def mark_stopping(self) -> None:
        """The agent is about to signal its workers to stop them: a notice signal now means "stop at once"."""
        with open(os.path.join(self.path, STOPPING_FILE), "w"):
            pass

    def clear(self) -> None:
        """Empty the mailbox before a new worker group starts (its notice and acks were for the old one)."""
        self._reported.clear()
        for name in os.listdir(self.path):
            if name.startswith("."):
                continue  # the agent's lock, not a message
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass

    def helpers(self) -> set[int]:
        # Only finished files: a worker's atomic write first creates "helper-N.tmpPID" beside its target.
        return {int(m.group(1)) for n in os.listdir(self.path) if (m := _HELPER_FILE.fullmatch(n))}

    def post_peer_lost(self, nodes: Sequence[str], *, restarted: bool = False) -> None:
        """A peer of the round is gone, or (``restarted``) its workers failed and its agent restarts them:
        watching workers abort their process group (``peer-lost.json``)."""
        _write_atomic(os.path.join(self.path, PEER_LOST_FILE),
                      {"lost": ",".join(sorted(nodes)), "time": time.time(), "restarted": restarted})

    def peer_restarted(self) -> bool:
        """``peer-lost.json`` says the peers' workers restart (they will join), not that the peers are gone."""
        try:
            data = _load_json(os.path.join(self.path, PEER_LOST_FILE))
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and data.get("restarted") is True

    def watchers(self) -> set[int]:
        """Local ranks whose peer-loss watcher runs (``watching-{local_rank}``)."""
        return {int(m.group(1)) for n in os.listdir(self.path) if (m := _WATCHING_FILE.fullmatch(n))}

    def helpers_coming(self) -> set[int]:
        """Local ranks whose script imported the helper's module (``coming-{local_rank}``), built or not."""
        return {int(m.group(1)) for n in os.listdir(self.path) if (m := _COMING_FILE.fullmatch(n))}

    def waiting(self) -> set[int]:
        """Local ranks that acknowledged and wait in place for their new group (``waiting-{local_rank}``)."""
        return {int(m.group(1)) for n in os.listdir(self.path) if (m := _WAITING_FILE.fullmatch(n))}

    def in_place_capable(self) -> set[int]:
        """Local ranks that can re-form in place (``inplace-{local_rank}``: their script runs under
        ``elastic.inplace.run``)."""
        return {int(m.group(1)) for n in os.listdir(self.path) if (m := _IN_PLACE_FILE.fullmatch(n))}

    def joinable(self) -> set[int]:
        """Local ranks whose training function asks whether to restore (``joinable-{local_rank}``:
        ``Generation.needs_restore``): new workers can join their group in place."""
        return {int(m.group(1)) for n in os.listdir(self.path) if (m := _JOINABLE_FILE.fullmatch(n))}

    def fallbacks(self) -> dict[int, tuple[str, str]]:
        """local rank -> (why, detail) of the workers that gave up re-forming in place (``fallback-N.json``);
        unreadable or malformed records are skipped (workers write them)."""
        out: dict[int, tuple[str, str]] = {}
        for name in os.listdir(self.path):
            if (match := _FALLBACK_FILE.fullmatch(name)) is None:
                continue
            try:
                record = _load_json(os.path.join(self.path, name))
            except (OSError, ValueError):
                continue
            # Only the reasons a worker can give (they become the event's ``why``); the detail bounded as written.
            if isinstance(record, dict) and isinstance(why := record.get("why"), str) and why in _FALLBACK_REASONS:
                out[int(match.group(1))] = (why, str(record.get("detail", ""))[:MAX_FALLBACK_DETAIL])
        return out

    def assign(self, local_rank: int, assignment: GroupAssignment) -> None:
        """Tell a worker waiting in place its new group (it removes the file when read)."""
        _write_atomic(os.path.join(self.path, f"group-{local_rank}.json"), {
            "rank": assignment.rank, "world_size": assignment.world_size, "group_rank": assignment.group_rank,
            "group_world_size": assignment.group_world_size, "master_addr": assignment.master_addr,
            "master_port": assignment.master_port, "restart_count": assignment.restart_count})

    def acknowledgements(self) -> dict[int, Acknowledgement]:
        """local rank -> its acknowledgement (unreadable or malformed files are skipped: workers write them,
        and nothing they write may crash the agent, which polls this every 10 ms while its node leaves)."""
        out: dict[int, Acknowledgement] = {}
        for name in os.listdir(self.path):
            if (match := _ACK_FILE.fullmatch(name)) is None:
                continue  # also a worker's half-written "ack-N.json.tmpPID"
            path = os.path.join(self.path, name)
            try:
                if _version(path) in self._reported:
                    continue
                ack = _parse_ack(_load_json(path))
            except FileNotFoundError:
                continue  # cleared meanwhile
            except (OSError, ValueError) as exc:
                self._report_malformed(path, str(exc))
                continue
            if ack is None:
                self._report_malformed(path, "not an acknowledgement record (a step >= 0)")
                continue
            out[int(match.group(1))] = ack
        return out

    def _report_malformed(self, path: str, why: str) -> None:
        """One WARNING line per version of a malformed acknowledgement (the agent polls every 10 ms)."""
        try:
            version = _version(path)
        except OSError:
            return
        if version in self._reported:
            return
        self._reported.add(version)
        logger.warning("ignoring the malformed worker acknowledgement %s (%s): that rank has not stopped yet", path,
                       why.removeprefix(f"{path}: "))

    def acks(self) -> dict[int, int]:
        """local rank -> step it committed and stopped at (acknowledgements of unsaved steps excluded: see
        :meth:`unsaved`)."""
        return self.stops()[0]

    def unsaved(self) -> dict[int, tuple[int, str]]:
        """local rank -> (step it stopped at without saving, why): the save could not commit before
        ``save_by``."""
        return self.stops()[1]

    def stops(self) -> tuple[dict[int, int], dict[int, tuple[int, str]]]:
        """``(acks(), unsaved())`` from one read of the files (the agent polls this every 10 ms while leaving)."""
        read = self.acknowledgements()
        return ({rank: ack.step for rank, ack in read.items() if ack.saved},
                {rank: (ack.step, ack.why) for rank, ack in read.items() if not ack.saved})

    def committed_at(self) -> float | None:
        """Wall-clock time by which every worker that acknowledged had its step committed (the latest
        acknowledgement: each is written right after its commit), or None without a timed acknowledgement
        of a committed step."""
        times = [ack.time for ack in self.acknowledgements().values() if ack.saved and ack.time is not None]
        return max(times) if times else None

    def publish_link(self, run_id: str, group_rank: int) -> None:
        """Point ``spotrun-notice-dir-{uid}-{run_id}-{group_rank}`` at this mailbox (atomically), for workers
        whose environment lost ``SPOTRUN_NOTICE_DIR``; called at every worker start (the group rank can change
        between rounds). A failure only costs those workers the mailbox: they fall back to SIGTERM."""
        link = run_scoped_path(LINK_KIND, run_id, group_rank)
        if link == self._link:
            return
        self._drop_link()
        tmp = f"{link}.tmp{os.getpid()}"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.symlink(self.path, tmp)
            os.replace(tmp, link)
        except OSError as exc:
            logger.warning("cannot link the workers' mailbox at %s (%s); workers without %s in their environment "
                           "treat SIGTERM as the notice", link, exc, ENV_NOTICE_DIR)
            return
        self._link = link

    def _drop_link(self) -> None:
        link, self._link = self._link, None
        if link is None:
            return
        with contextlib.suppress(OSError):
            if os.readlink(link) == self.path:  # another agent of the run may own the name by now
                os.unlink(link)

    def remove(self) -> None:
        self._drop_link()
        self.clear()
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.path, SIGNALS_FILE))
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.path, LOCK_FILE))
            os.close(self._lock_fd)
            self._lock_fd = None
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    # --- worker side
    def read_notice(self) -> WorkerNotice | None:
        if not os.path.exists(self.notice_path):  # the common case, without raising an exception
            return None
        try:
            data = _load_json(self.notice_path)
            if not isinstance(data, dict):
                raise ValueError(f"{self.notice_path}: not a JSON object")
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return WorkerNotice("preempt", None, "unreadable notice")  # a half-seen notice is still a notice
        return WorkerNotice(str(data.get("reason", "preempt")), _seconds_or_none(data.get("deadline")),
                            str(data.get("source", "")), _seconds_or_none(data.get("save_by")))

    def stopping(self) -> bool:
        """The agent marked the current group as being stopped (:meth:`mark_stopping`)."""
        return os.path.exists(os.path.join(self.path, STOPPING_FILE))

    def notice_signals(self) -> frozenset[int]:
        """The agent's notice signals (``.signals``); SIGTERM alone when the file is missing or unreadable (a
        mailbox of an older agent)."""
        try:
            numbers = _load_json(os.path.join(self.path, SIGNALS_FILE))
        except (OSError, ValueError):
            return frozenset({int(signal.SIGTERM)})
        valid = {int(sig) for sig in signal.valid_signals()} - {int(signal.SIGKILL), int(signal.SIGSTOP)}
        found = {n for n in numbers if isinstance(n, int) and not isinstance(n, bool) and n in valid} \
            if isinstance(numbers, list) else set()
        return frozenset(found or {int(signal.SIGTERM)})

    def peer_lost_posted(self) -> bool:
        """The agent posted ``peer-lost.json`` for the current group (one ``stat``: cheap to poll)."""
        return os.path.exists(os.path.join(self.path, PEER_LOST_FILE))

    def register_watcher(self, local_rank: int) -> None:
        _write_atomic(os.path.join(self.path, f"watching-{local_rank}"), {"pid": os.getpid()})

    def announce_helper(self, local_rank: int) -> None:
        """This worker's script will build a ``Preemption`` helper (it imported its module)."""
        _write_atomic(os.path.join(self.path, f"coming-{local_rank}"), {"pid": os.getpid()})

    def register_helper(self, local_rank: int) -> None:
        _write_atomic(os.path.join(self.path, f"helper-{local_rank}"), {"pid": os.getpid()})

    def mark_waiting(self, local_rank: int) -> None:
        _write_atomic(os.path.join(self.path, f"waiting-{local_rank}"), {"pid": os.getpid()})

    def mark_in_place(self, local_rank: int) -> None:
        """This worker can re-form in place (it runs under ``elastic.inplace.run``)."""
        _write_atomic(os.path.join(self.path, f"inplace-{local_rank}"), {"pid": os.getpid()})

    def mark_joinable(self, local_rank: int) -> None:
        """This worker's training function takes part in the restore of workers that join its group."""
        _write_atomic(os.path.join(self.path, f"joinable-{local_rank}"), {"pid": os.getpid()})

    def report_fallback(self, local_rank: int, why: str, detail: str = "") -> None:
        """This worker gives up re-forming in place and exits for a restart, because of ``why``."""
        _write_atomic(os.path.join(self.path, f"fallback-{local_rank}.json"),
                      {"why": why, "detail": detail[:MAX_FALLBACK_DETAIL]})

    def take_assignment(self, local_rank: int) -> GroupAssignment | None:
        """This worker's new group, removed from the mailbox once read (None: not posted yet).

        Raises:
            ValueError: the file is not a valid assignment (the agent wrote it: a bug, not a worker's stray write).
        """
        path = os.path.join(self.path, f"group-{local_rank}.json")
        if not os.path.exists(path):
            return None
        try:
            data = _load_json(path)
        except FileNotFoundError:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON object")
        try:
            assignment = GroupAssignment(
                rank=int(data["rank"]), world_size=int(data["world_size"]), group_rank=int(data["group_rank"]),
                group_world_size=int(data["group_world_size"]), master_addr=str(data["master_addr"]),
                master_port=int(data["master_port"]), restart_count=int(data["restart_count"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a group assignment: {exc}") from exc
        os.unlink(path)
        return assignment

    def acknowledge(self, local_rank: int, step: int, *, saved: bool = True, why: str | None = None) -> None:
        record: dict[str, JsonScalar] = {"step": step, "time": time.time()}
        if not saved:  # a committed step keeps the old record: older agents read it unchanged
            record.update(saved=False, why=why or "not saved")
        _write_atomic(os.path.join(self.path, f"ack-{local_rank}.json"), record)


def _version(path: str) -> tuple[str, int, int, int]:
    """Which write of a mailbox file this is (workers replace files atomically: a new inode each time)."""
    info = os.lstat(path)
    return os.path.basename(path), info.st_ino, info.st_mtime_ns, info.st_size


def _parse_ack(record: object) -> Acknowledgement | None:
    """An ``ack-N.json`` record, or None when it is not one (wrong types, a bool or non-finite number, ...)."""
    if not isinstance(record, dict):
        return None
    step, when = record.get("step"), record.get("time")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        when = None
    saved = _saved(record)
    return Acknowledgement(step, None if when is None else float(when), saved,
                           "" if saved else str(record.get("why") or "not saved"))


def _saved(record: dict[str, object]) -> bool:
    """An acknowledgement of a committed step (records written before ``saved`` existed all are)."""
    return record.get("saved", True) is not False


def _seconds_or_none(value: object) -> float | None:
    """A wall-clock time from a mailbox file, or None when absent or not a finite number (a bad ``save_by``
    only costs the deadline check: the save is tried, as without one; a bad ``deadline`` only its mention in
    the worker's log)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _agent_alive(path: str) -> bool:
    """The mailbox has a lock and its agent holds it."""
    fd = lock_if_orphaned(os.path.join(path, LOCK_FILE))
    if fd is not None:
        os.close(fd)
        return False
    return os.path.exists(os.path.join(path, LOCK_FILE))


def remove_orphaned_mailboxes(root: str, *, limit: int = SWEEP_LIMIT) -> int:
    """Remove this user's mailboxes under ``root`` whose agent died without cleaning up (SIGKILL, or killed
    after a SIGTERM grace ran out), and dangling links to them; returns how many mailboxes were removed."""
    removed = remove_orphaned_dirs(root, MAILBOX_PREFIX, LOCK_FILE, limit=limit)
    _remove_dangling_links()
    if removed:
        logger.info("removed %d orphaned worker mailbox(es) of dead agents under %s", removed, root)
    return removed


def _remove_dangling_links() -> None:
    """This user's mailbox links whose mailbox is gone (their agent was killed)."""
    stem = run_scoped_prefix(LINK_KIND)  # ".../spotrun-notice-dir-{uid}-"
    folder, prefix = os.path.dirname(stem), os.path.basename(stem)
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(prefix) and os.path.islink(path) and not os.path.exists(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def find_mailbox(environ: Mapping[str, str] | None = None) -> str | None:
    """The mailbox of this worker's agent: ``SPOTRUN_NOTICE_DIR``, else the link the agent published for
    ``TORCHELASTIC_RUN_ID``/``GROUP_RANK`` (what torch sets for every worker, kept by wrappers that rebuild
    the rest of the environment), if it is ours and its agent is alive. None under stock torchrun."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_NOTICE_DIR)
    if path:
        return path
    run_id, group_rank = env.get("TORCHELASTIC_RUN_ID"), env.get("GROUP_RANK")
    if not run_id or group_rank is None:
        return None
    link = run_scoped_path(LINK_KIND, run_id, group_rank)
    try:
        if os.lstat(link).st_uid != os.getuid():
            return None  # /dev/shm is shared: never follow another user's link
        target = os.path.realpath(link)
        if os.stat(target).st_uid != os.getuid():
            return None
    except OSError:
        return None
    return target if _agent_alive(target) else None


def _load_json(path: str, limit: int = MAX_MESSAGE_BYTES) -> object:
    """One mailbox file, parsed. Bounded: a file larger than ``limit`` bytes, not a regular file (a FIFO would
    block the poll), or nested too deeply for the parser (a hostile or corrupt one) is a ``ValueError`` like any
    other malformed file, never a ``RecursionError`` escaping into the agent's loop."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError(f"{path}: JSON nested too deeply") from exc


def _write_atomic(path: str, data: Mapping[str, JsonScalar] | Sequence[int]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


