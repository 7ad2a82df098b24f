"""Worker side of a planned stop: one line in the training loop saves the step every rank agrees on.

    from elastic.preemption import Preemption
    preemption = Preemption()                 # after init_process_group, on every rank (collective)
    for ...:
        train_step(); step += 1
        if preemption.save_and_stop(ckpt, step, state):   # a notice: step is committed, leave the loop
            break

How the agent talks to its workers (the *mailbox*, a private directory the agent creates and names in
``SPOTRUN_NOTICE_DIR``; a worker whose environment a wrapper rebuilt without it, e.g. ``accelerate launch`` or
``srun`` inside spotrun, finds it like the hang-detection files, through a link named after
``TORCHELASTIC_RUN_ID`` and ``GROUP_RANK`` that the agent publishes at every worker start, see :func:`find_mailbox`):

* ``notice.json``  written (atomically) by the agent when its node got a preemption notice, a peer's
  notice arrived through etcd, or the group is about to change size (a node joins): ``{"reason",
  "deadline", "source", "save_by"}`` (``save_by``: when the agent gives up waiting, the deadline minus its
  stop grace; absent in older notices). Workers only ``stat`` it: a poll costs a few microseconds.
* ``helper-{local_rank}``  written by :class:`Preemption` at construction: the agent then knows its workers
  will stop by themselves at an agreed step, and waits for them instead of killing them.
* ``ack-{local_rank}.json``  written after the agreed step is committed: ``{"step", "time"}``; or, when the
  save could not commit before ``save_by`` and was not started, ``{"step", "time", "saved": false, "why"}``
  (a record without ``saved`` is a committed one). Workers that all acknowledged and exited 0 ended for a
  planned change, not because training finished.
* ``.agent.lock``  held (``flock``) by the agent for its whole life: the kernel releases it when the agent dies,
  even by SIGKILL, so the next agent on the host removes the orphaned mailbox (:func:`remove_orphaned_mailboxes`)
  and a worker never follows a link to a dead agent's mailbox.
* ``.signals``  written by the agent at creation: the signal numbers that are a preemption notice to it
  (SIGTERM and ``--preempt-signal``). A scheduler that signals every process of the job step (Slurm's
  ``--signal``, its time limit and preemption, with proctrack/linuxproc or cgroup) delivers the notice to the
  workers too: a worker running :class:`Preemption` takes it as its node's notice and stops at the agreed
  step like one told through ``notice.json``.
* ``stopping``  written by the agent just before it signals its workers to stop them (a restart, a failed
  group, its own shutdown, a second SIGTERM): a notice signal that arrives then is that stop, and the helper
  lets it end the worker as an unhandled signal would, so recovery is not slowed by a save nobody waits for.

Agreement (every rank stops at the same step): notices reach nodes at different times, so the local view
alone would split the group. Every ``sync_every`` steps (the same step numbers on every rank, so the calls
pair up) the ranks all-reduce one int (MAX of "my node has a notice") on a dedicated gloo group (a
``checkpoint.collective.Collective``, bounded by ``timeout``); the first such step at which any rank saw a
notice is the agreed step on every rank. One 8-byte gloo all-reduce
costs ~0.1 ms on a LAN; at the default ``sync_every=8`` that is negligible, and the notice is acted on at
most 8 steps late (deadlines are 30-120 s, steps well under a second). Between sync steps the call is an
integer modulo: no I/O, no collective.

Deadline-aware save: at the agreed step every rank reports how long its last saves took
(``Checkpointer.save_seconds_estimate``) and how long is left before ``save_by``, in one all-gather on the
same group; every rank then decides from the same numbers (:func:`decide_planned_save`): the slowest
estimate times ``save_margin`` (plus :data:`SAVE_SLACK_SECONDS`) against the least time left. When it does
not fit, no rank starts the save (none waits in the checkpointer's collectives for one that skipped): each
acknowledges the step as not saved, with the numbers in ``why``, and leaves the loop at once, so the node is
gone before its deadline instead of being killed mid-save, and the peers re-form without waiting out the
grace; the new group resumes from the last committed step. No estimate (no save yet in this process) or no
``save_by``: the save is tried, as before.

Under stock torchrun (no mailbox) the helper turns SIGTERM to the worker (what torchrun forwards when its
agent is stopped) into the same local notice, so the same loop saves the agreed step there too. Under spotrun
it does the same for the agent's notice signals (``.signals``) unless the agent marked the group ``stopping``.
A script that does not construct the helper keeps its own signal dispositions, as under torchrun.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from datetime import timedelta
from typing import Any

from elastic.api import ENV_NOTICE_DIR as ENV_NOTICE_DIR  # re-exported: first defined here
from elastic.api import PlannedStopVoteError  # re-exported: raised by Preemption.save_and_stop
from elastic.progress import run_scoped_path, run_scoped_prefix

logger = logging.getLogger(__name__)

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
DEFAULT_SYNC_EVERY = 8
#: How long a rank waits in the vote for its peers. The same as torch's default for gloo groups (what the
#: training's own CPU collectives wait) and the checkpointer's ``collective_timeout``: a shorter bound would
#: fail runs the training tolerates (rank 0 evaluating for minutes between two sync steps), a longer one
#: only delays the error when a peer is gone without its connection closing.
DEFAULT_VOTE_TIMEOUT = timedelta(minutes=30)
DEFAULT_SAVE_MARGIN = 1.5
"""A planned save is started only when the slowest recent save times this fits before ``save_by``: storage
and the host are slower at preemption time (the node is draining) than during steady training."""
MAX_MESSAGE_BYTES = 64 * 1024
"""Largest mailbox file parsed (an acknowledgement or a notice is under 200 bytes): a bigger one, a deeply nested
one or anything but a regular file is malformed, so a worker's stray write cannot stall the agent's 10 ms poll."""

SAVE_SLACK_SECONDS = 0.5
"""Added to every estimate: the acknowledgement, the workers' exit and the agent's tick after the commit."""


@dataclass(frozen=True, slots=True)
class WorkerNotice:
    """What the agent tells its workers: why they must stop and by when (wall-clock seconds)."""

    reason: str
    """``preempt`` (this node goes away), ``peer_preempt`` (another node does), ``resize`` (a node joins)."""
    deadline: float | None
    source: str = ""
    save_by: float | None = None
    """Wall-clock time the agent stops waiting for the save (``deadline - stop_grace``); None: no bound."""


_HELPER_FILE = re.compile(r"helper-(\d+)")
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
        box._lock_fd = _hold_lock(box.path)
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

    def _read_acks(self) -> dict[int, _Ack]:
        """local rank -> its acknowledgement (unreadable or malformed files are skipped: workers write them,
        and nothing they write may crash the agent, which polls this every 10 ms while its node leaves)."""
        out: dict[int, _Ack] = {}
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
        read = self._read_acks()
        return ({rank: ack.step for rank, ack in read.items() if ack.saved},
                {rank: (ack.step, ack.why) for rank, ack in read.items() if not ack.saved})

    def committed_at(self) -> float | None:
        """Wall-clock time by which every worker that acknowledged had its step committed (the latest
        acknowledgement: each is written right after its commit), or None without a timed acknowledgement
        of a committed step."""
        times = [ack.time for ack in self._read_acks().values() if ack.saved and ack.time is not None]
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
        return WorkerNotice(str(data.get("reason", "preempt")), data.get("deadline"), str(data.get("source", "")),
                            _seconds_or_none(data.get("save_by")))

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

    def register_helper(self, local_rank: int) -> None:
        _write_atomic(os.path.join(self.path, f"helper-{local_rank}"), {"pid": os.getpid()})

    def acknowledge(self, local_rank: int, step: int, *, saved: bool = True, why: str | None = None) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time()}
        if not saved:  # a committed step keeps the old record: older agents read it unchanged
            record.update(saved=False, why=why or "not saved")
        _write_atomic(os.path.join(self.path, f"ack-{local_rank}.json"), record)


def _version(path: str) -> tuple[str, int, int, int]:
    """Which write of a mailbox file this is (workers replace files atomically: a new inode each time)."""
    info = os.lstat(path)
    return os.path.basename(path), info.st_ino, info.st_mtime_ns, info.st_size


@dataclass(frozen=True, slots=True)
class _Ack:
    """One worker's acknowledgement, validated."""

    step: int
    time: float | None
    saved: bool
    why: str


def _parse_ack(record: Any) -> _Ack | None:
    """An ``ack-N.json`` record, or None when it is not one (wrong types, a bool or non-finite number, ...)."""
    if not isinstance(record, dict):
        return None
    step, when = record.get("step"), record.get("time")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        when = None
    saved = _saved(record)
    return _Ack(step, None if when is None else float(when), saved, "" if saved else str(record.get("why") or "not saved"))


def _saved(record: dict[str, Any]) -> bool:
    """An acknowledgement of a committed step (records written before ``saved`` existed all are)."""
    return record.get("saved", True) is not False


def _seconds_or_none(value: Any) -> float | None:
    """A wall-clock time from a mailbox file, or None when absent or not a finite number (a bad ``save_by``
    only costs the deadline check: the save is tried, as without one)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _hold_lock(path: str) -> int:
    """Create and lock the mailbox's lock file. Locked before it gets its name: a sweeper that sees the
    name can never take the lock of a live agent."""
    tmp = os.path.join(path, f"{LOCK_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp, os.path.join(path, LOCK_FILE))
    return fd


def _lock_if_orphaned(path: str) -> int | None:
    """The lock of a mailbox whose agent is gone (a descriptor now holding it), or None: its agent lives, or
    the directory has no lock (being created, or made by an older spotrun: left alone)."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _agent_alive(path: str) -> bool:
    """The mailbox has a lock and its agent holds it."""
    fd = _lock_if_orphaned(path)
    if fd is not None:
        os.close(fd)
        return False
    return os.path.exists(os.path.join(path, LOCK_FILE))


def remove_orphaned_mailboxes(root: str) -> int:
    """Remove this user's mailboxes under ``root`` whose agent died without cleaning up (SIGKILL, or killed
    after a SIGTERM grace ran out), and dangling links to them; returns how many mailboxes were removed."""
    removed = 0
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(MAILBOX_PREFIX):
            continue
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        fd = _lock_if_orphaned(path)
        if fd is None:
            continue
        try:
            for entry in os.listdir(path):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, entry))
            os.rmdir(path)
            removed += 1
        except OSError as exc:
            logger.debug("cannot remove orphaned mailbox %s: %s", path, exc)
        finally:
            os.close(fd)
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


def _load_json(path: str, limit: int = MAX_MESSAGE_BYTES) -> Any:
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


def _write_atomic(path: str, data: dict[str, Any] | list[Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def is_sync_step(step: int, sync_every: int) -> bool:
    """Ranks exchange their notice flags at these steps only (the same on every rank)."""
    return step % sync_every == 0


@dataclass(frozen=True, slots=True)
class SaveDecision:
    """Whether the ranks start the planned save (the same on every rank: made from the same numbers)."""

    save: bool
    why: str = ""
    """Why not, with the numbers (empty when saving)."""


def decide_planned_save(step: int, reports: Sequence[Sequence[float | None]], *,
                        margin: float = DEFAULT_SAVE_MARGIN) -> SaveDecision:
    """Start the planned save of ``step``, or not, from every rank's ``[estimate, seconds_left]`` (either None:
    unknown). The slowest estimate must fit, times ``margin`` plus :data:`SAVE_SLACK_SECONDS`, in the least
    time left; without an estimate or without a bound the save is tried (nothing better to go on)."""
    estimates = [e for e, _ in reports if e is not None]
    lefts = [left for _, left in reports if left is not None]
    if not estimates or not lefts:
        return SaveDecision(True)
    needed = max(estimates) * margin + SAVE_SLACK_SECONDS
    left = min(lefts)
    if needed <= left:
        return SaveDecision(True)
    return SaveDecision(False, f"save of step {step} needs ~{needed:.1f} s (estimate "
                               f"{max(estimates):.2f} s x {margin:g} + {SAVE_SLACK_SECONDS:g} s), "
                               f"{max(left, 0.0):.1f} s left before the deadline (less the stop grace)")


def _report(value: Any) -> float | None:
    """A rank's number for the all-gather (JSON: a float or None)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class Preemption:
    """Answers "stop here?" identically on every rank (see the module docstring for the protocol).

    Construct it on every rank after ``init_process_group`` (it creates a gloo group: collective).
    ``timeout`` bounds each vote (see :data:`DEFAULT_VOTE_TIMEOUT`); ``save_margin`` multiplies the save-time
    estimate when deciding whether the planned save fits before the agent's ``save_by``
    (see :data:`DEFAULT_SAVE_MARGIN`).
    """

    def __init__(self, *, sync_every: int = DEFAULT_SYNC_EVERY, process_group: Any = None,
                 mailbox_dir: str | None = None, timeout: timedelta = DEFAULT_VOTE_TIMEOUT,
                 save_margin: float = DEFAULT_SAVE_MARGIN) -> None:
        """Args:
            sync_every: check for a notice every this many steps (one small all-reduce then; between those
                ``should_stop`` is an integer modulo).
            process_group: the training's group (default: the world); the votes run on a gloo group of its
                own made from it.
            mailbox_dir: the agent's mailbox (default: ``SPOTRUN_NOTICE_DIR``, or found through its link;
                none under stock torchrun, where a SIGTERM to the worker is the notice).
            timeout: how long a vote waits for the peer ranks.
            save_margin: how many times the slowest recent save a planned save may take before the deadline.

        Raises:
            ValueError: ``sync_every`` < 1, ``timeout`` not a positive ``timedelta``, ``save_margin`` < 1.
        """
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1 (steps between notice checks), got {sync_every!r}")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout must be a positive datetime.timedelta (how long a vote waits for the "
                             f"peers), got {timeout!r}")
        if isinstance(save_margin, bool) or not isinstance(save_margin, int | float) or not (
                math.isfinite(save_margin) and save_margin >= 1):
            raise ValueError(f"save_margin must be a number >= 1 (how many times the slowest recent save a "
                             f"planned save is allowed before the deadline), got {save_margin!r}")
        self.sync_every = sync_every
        self.timeout = timeout
        self.save_margin = float(save_margin)
        self.skipped: SaveDecision | None = None
        """Set when the agreed step's save was not started (it could not commit before ``save_by``)."""
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        path = mailbox_dir if mailbox_dir is not None else find_mailbox()
        self.mailbox = Mailbox(path) if path else None
        self.stop_step: int | None = None
        self.notice: WorkerNotice | None = None
        self._signalled: signal.Signals | None = None
        """The notice signal this worker received itself (the first one), if any."""
        from checkpoint.collective import open_collectives  # imports torch; the agent imports this module for Mailbox

        # Our own gloo group (a local identity in a world of one): the vote never interleaves with the
        # training's collectives, and it is gloo whatever the training's backend is.
        (self._vote,) = open_collectives(process_group, timeout, 1)
        # A notice signal to the worker itself is the notice: under stock torchrun (or no launcher) SIGTERM,
        # what torchrun forwards when its agent is stopped; under spotrun the agent's notice signals, which a
        # scheduler that signals the whole job step (Slurm) delivers to the workers too. Under spotrun the
        # agent also stops workers with SIGTERM (restarts, where waiting would only slow recovery): it marks
        # the mailbox `stopping` first, and such a signal ends the worker at once (_on_notice_signal).
        notice_signals = self.mailbox.notice_signals() if self.mailbox is not None else {int(signal.SIGTERM)}
        try:
            for signum in sorted(notice_signals):
                signal.signal(signum, self._on_notice_signal)
        except ValueError:  # not the main thread: Python delivers signals to the main thread only
            logger.warning("[rank %s] Preemption constructed outside the main thread: a notice signal to this "
                           "worker is not taken as the notice", os.environ.get("RANK", "0"))
        if self.mailbox is not None:
            self.mailbox.register_helper(self.local_rank)

    def _on_notice_signal(self, signum: int, frame: Any) -> None:
        if self._signalled is not None or self._agent_stopping():
            # A second notice signal (the launcher insists), or the agent is stopping this worker group: end
            # now, as the unhandled signal would have.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signalled = signal.Signals(signum)

    def _agent_stopping(self) -> bool:
        if self.mailbox is None:
            return False
        try:
            return self.mailbox.stopping()
        except OSError:
            return False

    def _local_notice(self) -> WorkerNotice | None:
        # The agent's notice first: it carries the deadline and save_by that the save decision needs.
        posted = self.mailbox.read_notice() if self.mailbox is not None else None
        if posted is not None:
            return posted
        if self._signalled is not None:
            return WorkerNotice("preempt", None, self._signalled.name)
        return None

    def should_stop(self, step: int) -> bool:
        """True from the agreed step on (same answer on every rank at the same step). Call once per step.

        Collective at every ``sync_every``-th step (a one-int all-reduce): call it on every rank.

        Args:
            step: the step just completed (the same number on every rank).

        Returns:
            True when the group stops at ``step`` (and from then on), False otherwise.

        Raises:
            PlannedStopVoteError: a peer rank did not reach the vote within ``timeout``, or left.
        """
        if self.stop_step is not None:
            return True
        if not is_sync_step(step, self.sync_every):
            return False
        self.notice = self._local_notice()
        if not self._any_rank(step, self.notice is not None):
            return False
        self.stop_step = step
        logger.warning("[rank %s step %d] stopping at the agreed step for a planned change (%s)",
                       os.environ.get("RANK", "0"), step, self.notice or "another rank's notice")
        return True

    def _any_rank(self, step: int, flag: bool) -> bool:
        (anyone,) = self._collective(step, self._vote.any, flag)
        return anyone

    def _collective(self, step: int, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:  # gloo's timeout and closed-connection errors (DistBackendError)
            raise PlannedStopVoteError(
                f"[rank {os.environ.get('RANK', '0')} step {step}] the planned-stop vote failed: a peer rank did "
                f"not reach step {step} within {self.timeout.total_seconds():.0f} s, or left: {exc}"
            ) from exc

    def _decide_save(self, ckpt: Any, step: int) -> SaveDecision:
        """The same decision on every rank: one all-gather of (estimate, seconds left) on the vote's group."""
        # Any object with save/wait is accepted; the estimate is optional (None: try the save).
        estimate = _report(getattr(ckpt, "save_seconds_estimate", None))
        save_by = self.notice.save_by if self.notice is not None else None
        left = None if save_by is None else save_by - time.time()
        reports = self._collective(step, self._vote.all_gather, [estimate, left])
        return decide_planned_save(step, reports, margin=self.save_margin)

    def acknowledge(self, step: int, *, saved: bool = True, why: str | None = None) -> None:
        """Tell the agent this worker committed ``step`` (or, ``saved=False``, stopped at it without a save,
        because of ``why``) and is leaving for the planned change. No-op without a mailbox (stock torchrun).

        Args:
            step: the agreed step.
            saved: whether ``step`` was committed.
            why: why it was not (shown in the agent's ``planned_leave`` event).
        """
        if self.mailbox is not None:
            self.mailbox.acknowledge(self.local_rank, step, saved=saved, why=why)

    def save_and_stop(self, ckpt: Any, step: int, state: Any) -> bool:
        """If this is the agreed step: save ``state`` as ``step`` with ``ckpt`` (a ``Checkpointer``), wait for
        the commit, acknowledge, and return True (leave the training loop). Otherwise False (microseconds).

        When the save cannot commit before the agent's ``save_by`` (see the module docstring), no rank starts
        it: the step is acknowledged as not saved (``skipped`` says why) and True is returned all the same.

        Args:
            ckpt: the ``Checkpointer`` (any object with ``save(step, state)`` and ``wait()``; None: stop
                without saving).
            step: the step just completed (the same number on every rank).
            state: what to save (as for ``Checkpointer.save``).

        Returns:
            True: leave the training loop (the step is committed, or ``skipped`` says why not); False: go on.

        Raises:
            PlannedStopVoteError: a peer rank did not reach the vote within ``timeout``, or left.
            CheckpointError: the planned save failed (from ``ckpt.save``/``ckpt.wait``).
        """
        if not self.should_stop(step):
            return False
        if ckpt is not None:
            decision = self._decide_save(ckpt, step)
            if not decision.save:
                self.skipped = decision
                logger.warning("[rank %s] step %d not saved for the planned change: %s",
                               os.environ.get("RANK", "0"), step, decision.why)
                self.acknowledge(step, saved=False, why=decision.why)
                return True
            began = time.monotonic()
            ckpt.save(step, state)
            ckpt.wait()
            logger.warning("[rank %s] step %d committed for the planned change in %.2f s",
                           os.environ.get("RANK", "0"), step, time.monotonic() - began)
        self.acknowledge(step)
        return True
