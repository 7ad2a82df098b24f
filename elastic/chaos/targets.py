"""Finding fault targets: workers among an agent's descendants (/proc), etcd members by endpoint (the PID
listening on the port, the leader through etcd's JSON status API)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

from elastic.chaos.api import ChaosTargetError
from elastic.events import read_events
from elastic.nodes import node_pid


def _children_table() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        if rest[0] != "Z":
            table.setdefault(int(rest[1]), []).append(int(entry))
    return table


def descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (not zombies), in no particular order."""
    table = _children_table()
    found: list[int] = []
    frontier = [root]
    while frontier:
        for child in table.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


RESOURCE_TRACKER = "multiprocessing.resource_tracker"
"""In the command line of multiprocessing's resource tracker (``python -c 'from multiprocessing.resource_tracker
import main; main(FD)'``)."""


def is_resource_tracker(pid: int) -> bool:
    """True if ``pid`` is a multiprocessing resource tracker (False when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return RESOURCE_TRACKER.encode() in handle.read()
    except OSError:
        return False


def node_tree(root: int) -> list[int]:
    """``root`` and its live descendants, as a node loss would take them, except multiprocessing's resource
    trackers.

    A tracker unlinks the named semaphores (``/dev/shm/sem.mp-*``) of the processes that use it once they are
    all gone (torch's worker contexts create them in the forkserver/spawn context; only their finalizers or the
    tracker remove them). A real node loss also loses the tracker, but the machine, and its /dev/shm, go with
    it; on a test host that stays up, killing the tracker too leaks the semaphores for good. Left alone, it
    exits by itself when the last process holding its pipe dies."""
    return [root, *(pid for pid in descendants(root) if not is_resource_tracker(pid))]


KEEPER_SCRIPT = b"elastic/memory_keeper.py"
"""In the command line of an agent's memory tier keeper (``python -I -S .../elastic/memory_keeper.py DIR PID``)."""


def keeper_of(agent: int) -> int | None:
    """The PID of ``agent``'s memory tier keeper process (a direct child), None when it has none."""
    for pid in descendants(agent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == agent and any(arg.endswith(KEEPER_SCRIPT) for arg in argv):
            return pid
    return None


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def workers(agent_pids: list[int], events_file: str | None = None) -> dict[int, int]:
    """Global rank -> PID of the workers under ``agent_pids``.

    Workers exec'd by the agent carry the torchelastic variables in their initial environment (an embedded
    etcd or a worker's helper processes do not). Workers forked from spotrun's warm-worker forkserver show
    the forkserver's environment instead; for them the agent's last ``workers_started`` event in
    ``events_file`` lists the PIDs (ascending, which is local-rank order: the forkserver forks them in
    turn), and the rank is ``group_rank * nproc + position``."""
    out = _workers_by_environ(agent_pids)
    if out or not events_file:
        return out
    return _workers_by_events(agent_pids, events_file)


def _workers_by_events(agent_pids: list[int], events_file: str) -> dict[int, int]:
    out: dict[int, int] = {}
    events = read_events(events_file)
    for agent in agent_pids:
        started = [e for e in events if e.get("event") == "workers_started"
                   and node_pid(str(e.get("node", ""))) == agent]
        if not started:
            continue
        last = started[-1]
        pids = list(last.get("pids", []))
        alive = set(descendants(agent))
        base = int(last.get("group_rank", 0)) * len(pids)
        out.update({base + i: pid for i, pid in enumerate(pids) if pid in alive})
    return out


def _workers_by_environ(agent_pids: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for agent in agent_pids:
        for pid in descendants(agent):
            env = _environ(pid)
            if "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "LOCAL_RANK" in env:
                parent_env = _environ(_ppid(pid))
                if parent_env.get("RANK") == env["RANK"] and "TORCHELASTIC_RUN_ID" in parent_env:
                    continue  # a worker's own child (e.g. a dataloader process): not a worker
                out.setdefault(int(env["RANK"]), pid)
    return out


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                next(handle)
                for line in handle:
                    cols = line.split()
                    local, state, inode = cols[1], cols[3], cols[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(inode)
        except OSError:
            continue
    return inodes


def pid_listening_on(port: int) -> int:
    """PID of the process listening on TCP ``port`` in this network namespace."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if inodes:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fds = os.listdir(f"/proc/{entry}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                        return int(entry)
                except OSError:
                    continue
    raise ChaosTargetError(f"no process of this machine listens on port {port} (or it is not ours to see)")


def _port(endpoint: str) -> int:
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    try:
        return int(hostport.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        raise ChaosTargetError(f"etcd endpoint {endpoint!r} has no port; use HOST:PORT") from None


def _url(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"http://{endpoint}"


@dataclass(frozen=True, slots=True)
class MemberStatus:
    endpoint: str
    member_id: str
    leader_id: str


def member_status(endpoint: str, timeout: float = 2.0) -> MemberStatus:
    """etcd's ``Maintenance.Status`` through its JSON gateway (no grpc client: nothing to blacklist)."""
    request = urllib.request.Request(f"{_url(endpoint)}/v3/maintenance/status", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read())
    except (OSError, urllib.error.URLError, json.JSONDecodeError) as exc:
        raise ChaosTargetError(f"etcd member {endpoint} does not answer its status API: {exc}") from exc
    return MemberStatus(endpoint, str(body.get("header", {}).get("member_id", "")), str(body.get("leader", "")))


def etcd_leader(endpoints: list[str]) -> str:
    """The endpoint of the member that is leader now, as the members report it."""
    errors = []
    for endpoint in endpoints:
        try:
            status = member_status(endpoint)
        except ChaosTargetError as exc:
            errors.append(str(exc))
            continue
        if status.member_id and status.member_id == status.leader_id:
            return endpoint
    raise ChaosTargetError(f"no etcd member of {endpoints} says it is the leader ({'; '.join(errors) or 'no quorum?'})")


def etcd_member_pid(endpoint: str) -> int:
    """PID of the etcd member serving ``endpoint`` (it must run on this machine)."""
    return pid_listening_on(_port(endpoint))


@dataclass(frozen=True, slots=True)
class ProcessImage:
    """What it takes to start a process again: argv, working directory, environment."""

    argv: list[str]
    cwd: str
    env: dict[str, str]


def process_image(pid: int) -> ProcessImage:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = [a.decode() for a in handle.read().split(b"\0") if a]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError as exc:
        raise ChaosTargetError(f"cannot read the command line of pid {pid}: {exc}") from exc
    return ProcessImage(argv, cwd, _environ(pid))


def last_step(progress_file: str) -> int | None:
    """Highest ``step`` in a --progress-file (train_ddp.py's JSON lines); None before the first step."""
    steps = [int(r["step"]) for r in read_events(progress_file) if isinstance(r.get("step"), int)]
    return max(steps) if steps else None
