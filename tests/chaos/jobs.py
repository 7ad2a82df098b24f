"""One spotrun job under the fault injector, and the checks every chaos case makes on its outcome."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps, read_manifest, read_objects
from checkpoint.export import assemble
from checkpoint.storage import Storage
from elastic.api import ENV_REFORM_IN_PLACE
from elastic.chaos.api import STORAGE_CONTROL_ENV, FaultKind, Schedule
from elastic.chaos.injector import Injector
from elastic.chaos.journal import Journal
from elastic.chaos.storage import register
from elastic.chaos.targets import descendants, last_step
from elastic.etcd_server import find_etcd_binary
from elastic.events import read_events
from tests.harness.procs import SPOTRUN, Launcher, free_port, make_env, reap, wait_for

TRAIN = str(Path(__file__).with_name("chaos_train.py"))
RDZV_CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"
NODES_RDZV_CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=300"
"""A survivor waits in the rendezvous for a replacement agent, whose start-up (torch import) took 60-90 s on
a loaded 2-core machine: past 60 s the survivor would give up (join timeout) and close the run."""
STEPS = 30
CKPT_EVERY = 10


def final_state(ckpt_uri: str) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, every tensor) of the newest committed checkpoint, read from the files (checksums verified), so
    the comparison covers whatever the script saves (model, optimizer, data position) without knowing it."""
    register()
    storage = Storage(ckpt_uri)
    step = max(list_steps(storage).committed)
    manifest = read_manifest(storage, step)
    return manifest.step, {fqn: assemble(storage, manifest, fqn) for fqn in manifest.tensors}


def final_objects(ckpt_uri: str) -> dict[str, Any]:
    """The JSON objects of the newest committed checkpoint (the data cursor, the trainer's step and samples
    seen, the optimizer's hyperparameters): what :func:`final_state` leaves out."""
    register()
    storage = Storage(ckpt_uri)
    return read_objects(storage, read_manifest(storage, max(list_steps(storage).committed)))


def committed_steps(ckpt_uri: str) -> list[int]:
    register()
    with Checkpointer(ckpt_uri, CheckpointConfig()) as ckpt:
        return list_steps(ckpt.storage).committed


class _RunFiles:
    """Where a job keeps its files, and the training script's arguments (shared by :class:`Job` and
    :class:`Nodes`)."""

    root: Path
    steps: int
    step_time: float
    ckpt_every: int
    memory_every: int

    @property
    def ckpt(self) -> str:
        return f"chaos::file://{self.root}/ckpt"

    @property
    def control(self) -> str:
        return str(self.root / "storage-control.json")

    @property
    def events_file(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def progress_file(self) -> Path:
        return self.root / "progress.jsonl"

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_events(str(self.events_file))

    def train_args(self) -> list[str]:
        return [TRAIN, "--steps", str(self.steps), "--ckpt-every", str(self.ckpt_every), "--step-time",
                str(self.step_time), "--log-every", "10", "--progress-file", str(self.progress_file),
                "--ckpt-dir", self.ckpt, "--pg-timeout", "20",
                "--memory-snapshot-every", str(self.memory_every)]  # 0: off (the examples' default is auto)

    def restores(self) -> list[dict[str, Any]]:
        """The ``restore_completed`` events (one per node and workers' start that restored something)."""
        return [e for e in self.events if e["event"] == "restore_completed"]


@dataclass
class Job(_RunFiles):
    """One agent (``--nproc-per-node 2``) on an external etcd, checkpointing behind ``chaos::``."""

    root: Path
    endpoint: str
    run_id: str
    max_restarts: int = 3
    rdzv_conf: str = RDZV_CONF
    extra: tuple[str, ...] = ()
    steps: int = STEPS
    step_time: float = 0.05
    ckpt_every: int = CKPT_EVERY
    memory_every: int = 0
    """``--memory-snapshot-every`` of the training script (0: the memory tier off, restores are durable)."""
    hang_timeout: float | None = None
    """``--hang-timeout`` of the agent (None: spotrun's adaptive default)."""
    launcher: Launcher | None = None
    seen_pids: set[int] = field(default_factory=set)
    committed_at_fault: list[int] = field(default_factory=list)
    step_at_fault: list[tuple[str, int]] = field(default_factory=list)
    """(kind, last step reported) of each fault when it fired."""

    def start(self) -> Launcher:
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [*SPOTRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id, "--rdzv-conf", self.rdzv_conf, "--max-restarts", str(self.max_restarts),
                "--stop-grace", "2", "--events-file", str(self.root / "events.jsonl"),
                *(("--hang-timeout", str(self.hang_timeout)) if self.hang_timeout is not None else ()),
                *self.train_args(), *self.extra]
        env = make_env(**{STORAGE_CONTROL_ENV: self.control})
        self.launcher = Launcher(argv, self.root / "agent.log", env)
        return self.launcher

    def run(self, schedule: Schedule, timeout: float, endpoints: tuple[str, ...] = (),
            clock_from_first_step: bool = False) -> tuple[int, Injector]:
        """Start, inject ``schedule`` by step/time while it runs, wait for the exit; returns (code, injector).
        With ``clock_from_first_step``, ``at_s`` counts from the first training step, not from the launch."""
        launcher = self.start()
        injector = Injector(schedule, Journal(str(self.root / "journal.jsonl")), agent_pids=[launcher.pid],
                            etcd_endpoints=endpoints, storage_control=self.control,
                            events_file=str(self.root / "events.jsonl"))
        deadline = time.monotonic() + timeout
        waiting_for_first_step = clock_from_first_step
        try:
            while launcher.proc.poll() is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"job {self.run_id} still running after {timeout} s:\n{self.output()[-3000:]}")
                self.seen_pids.update(descendants(launcher.pid))
                before = len(injector.fired)
                if waiting_for_first_step:
                    if last_step(str(self.root / "progress.jsonl")) is not None:
                        injector.reset_clock()
                        waiting_for_first_step = False
                elif injector.pending():
                    steps = committed_steps(self.ckpt) if Path(self.root / "ckpt").exists() else []
                    step = last_step(str(self.root / "progress.jsonl"))
                    injector.tick(step)
                    if len(injector.fired) > before:
                        self.committed_at_fault.append(max(steps, default=0))
                        fired = schedule.faults[injector.fired[-1]]
                        self.step_at_fault.append((fired.kind.value, step or 0))
                else:
                    injector.tick(None)
                time.sleep(0.05)
        finally:
            injector.close()
            launcher.close()
        return launcher.proc.returncode, injector

    def output(self) -> str:
        return self.launcher.output() if self.launcher else ""

    def resumed_steps(self) -> list[int]:
        return [int(s) for s in re.findall(r"rank 0/\d+ restart \d+\] resumed from step (\d+)", self.output())]

    def assert_no_process_left(self, timeout: float = 15.0) -> None:
        """Every process the job ever had exits within ``timeout`` s of the launcher's exit (the forkserver and
        its helpers end a moment after the agent); orphans re-parented to this subreaper are reaped."""
        assert self.launcher is not None
        reap(self.seen_pids, timeout)

    def restarts(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "failure_detected"]


class ProgressTail:
    """The ``--progress-file`` read incrementally (a soak writes thousands of lines; re-reading them all every
    poll would load the machine it measures): the newest step and the time of the newest line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self.step: int | None = None
        self.t_wall: float | None = None

    def poll(self) -> int | None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return self.step
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being appended is read next time
        self._offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record.get("step"), int):
                self.step = max(self.step or 0, record["step"])
                self.t_wall = float(record.get("t_wall", time.time()))
        return self.step


@dataclass
class Nodes(_RunFiles):
    """``nodes`` agents of one worker each on one etcd, ``--nnodes`` fixed: world size ``nodes`` (2: the
    world size of :class:`Job`, so both match one reference). An agent a fault takes away (SIGKILL: a node
    lost; SIGTERM: a preemption) is replaced by a new agent once it has exited, as a cluster would; the
    survivor waits for it in the rendezvous. All agents append to one events file (``node`` tells them
    apart) and one progress file."""

    root: Path
    endpoint: str
    run_id: str
    nodes: int = 2
    max_restarts: int = 0
    rdzv_conf: str = NODES_RDZV_CONF
    steps: int = STEPS
    step_time: float = 0.05
    ckpt_every: int = CKPT_EVERY
    memory_every: int = 0
    min_nodes: int | None = None
    """``--nnodes MIN:nodes`` (None: ``--nnodes nodes``, fixed): with a minimum the group goes on smaller."""
    replace: bool = True
    """Start a new agent for each one a fault took away (False: a node lost for good)."""
    hang_timeout: float | None = None
    script_extra: tuple[str, ...] = ("--preempt-sync-every", "2")
    in_place: bool = False
    """Let the survivors re-form in place (train_ddp.py's default); False: ``SPOTRUN_REFORM_IN_PLACE=0``, every
    change restarts the workers, the restore path these cases check."""
    agents: list[Launcher] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)
    step_at_fault: list[tuple[str, int]] = field(default_factory=list)
    """(kind, newest step reported) of each fault when it fired."""
    injector: Injector | None = None
    """The injector of the last :meth:`run` (set as it starts: its restarted etcd members are the caller's)."""

    def events_of(self, agent: Launcher) -> list[dict[str, Any]]:
        return [e for e in self.events if f"-{agent.pid}-" in str(e.get("node", ""))]  # elastic.nodes.node_id

    def start_agent(self) -> Launcher:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"agent{len(self.agents)}"
        nnodes = str(self.nodes) if self.min_nodes is None else f"{self.min_nodes}:{self.nodes}"
        argv = [*SPOTRUN, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id, "--rdzv-conf", self.rdzv_conf, "--max-restarts", str(self.max_restarts),
                "--stop-grace", "2", "--monitor-interval", "0.1", "--events-file", str(self.events_file),
                "--log-dir", str(self.root / f"logs-{name}"),
                *(("--hang-timeout", str(self.hang_timeout)) if self.hang_timeout is not None else ()),
                *self.train_args(), *self.script_extra]
        env = make_env(**{STORAGE_CONTROL_ENV: self.control})
        if not self.in_place:
            env[ENV_REFORM_IN_PLACE] = "0"
        launcher = Launcher(argv, self.root / f"{name}.log", env)
        self.agents.append(launcher)
        return launcher

    def live(self) -> list[int]:
        """PIDs of the running agents in start order: ``agent:N`` of a schedule is the N-th of these."""
        return [a.pid for a in self.agents if a.proc.poll() is None]

    def run(self, schedule: Schedule, timeout: float, endpoints: tuple[str, ...] = (),
            clock_from_first_step: bool = False, one_at_a_time: bool = False) -> Injector:
        """Start the agents, inject ``schedule`` while they run, replace the agents it takes away, wait until
        every agent exited. ``one_at_a_time``: a due fault waits until the job is healthy again (every node
        up and a step made since the last workers started), so each fault meets a recovered job."""
        for _ in range(self.nodes):
            self.start_agent()
        injector = self.injector = Injector(schedule, Journal(str(self.root / "journal.jsonl")), agent_pids=self.live,
                                            etcd_endpoints=endpoints, storage_control=self.control,
                                            events_file=str(self.events_file))
        progress = ProgressTail(self.progress_file)
        to_replace: list[Launcher] = []
        deadline = time.monotonic() + timeout
        waiting_for_first_step = clock_from_first_step
        try:
            while any(a.proc.poll() is None for a in self.agents) or to_replace:
                if time.monotonic() > deadline:
                    raise AssertionError(f"job {self.run_id} still running after {timeout} s:\n{self.output()[-3000:]}")
                for agent in self.agents:
                    if agent.proc.poll() is None:
                        self.seen_pids.update(descendants(agent.pid))
                for gone in [a for a in to_replace if a.proc.poll() is not None]:
                    to_replace.remove(gone)
                    self.start_agent()
                step = progress.poll()
                if waiting_for_first_step:
                    if step is not None:
                        injector.reset_clock()
                        waiting_for_first_step = False
                elif one_at_a_time and (to_replace or not self._healthy(progress)):
                    # Held back until the job recovered, except a fault scheduled into the recovery (after=).
                    for record in injector.tick(step, followers_only=True):
                        self._note_fault(record, step, to_replace)
                else:
                    for record in injector.tick(step, limit=1 if one_at_a_time else None):
                        self._note_fault(record, step, to_replace)
                time.sleep(0.05)
        finally:
            injector.close()
            for agent in self.agents:
                agent.close()
        return injector

    def _note_fault(self, record: dict[str, Any], step: int | None, to_replace: list[Launcher]) -> None:
        if record.get("record") not in ("injected", "skipped", "failed"):
            return
        self.step_at_fault.append((record["kind"], step or 0))
        if self.replace and record["record"] == "injected" and record["kind"] in (FaultKind.KILL_AGENT.value,
                                                                                 FaultKind.TERM_AGENT.value):
            to_replace.extend(a for a in self.agents if a.pid == record["pid"])

    def _healthy(self, progress: ProgressTail, fresh_s: float = 2.0) -> bool:
        """Every node up, a step made within ``fresh_s`` (no recovery is under way: none makes steps) and
        since the last workers started (the steps seen are the recovered group's)."""
        if len(self.live()) < self.nodes or progress.t_wall is None or time.time() - progress.t_wall > fresh_s:
            return False
        started = [e["t_wall"] for e in self.events if e.get("event") == "workers_started"]
        return not started or progress.t_wall > max(started)

    def output(self) -> str:
        return "\n".join(f"--- {a.log.name}\n{a.output()[-3000:]}" for a in self.agents)

    def assert_no_process_left(self, timeout: float = 15.0) -> None:
        reap(self.seen_pids, timeout)


@contextlib.contextmanager
def etcd_cluster_at(root: Path) -> Iterator[list[str]]:
    """Three etcd members on free loopback ports (fast elections), data and logs under ``root``; yields
    their client endpoints once a leader is elected, kills them on exit."""
    from elastic.chaos.targets import etcd_leader

    binary = find_etcd_binary()
    root.mkdir(parents=True, exist_ok=True)
    ports = [(free_port(), free_port()) for _ in range(3)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    procs = []
    logs = [open(root / f"m{i}.log", "wb") for i in range(3)]  # noqa: SIM115 (closed below)
    for i, (client, peer) in enumerate(ports):
        argv = [binary, "--name", f"m{i}", "--data-dir", str(root / f"m{i}"),
                "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", root.name,
                "--heartbeat-interval", "50", "--election-timeout", "500"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=logs[i], start_new_session=True))
    endpoints = [f"127.0.0.1:{client}" for client, _ in ports]

    def elected() -> bool:
        try:
            return bool(etcd_leader(endpoints))
        except Exception:  # noqa: BLE001 (not elected yet)
            return False

    try:
        wait_for(elected, 30, "the etcd cluster to elect a leader")
        yield endpoints
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for log in logs:
            log.close()
