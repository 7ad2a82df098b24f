"""One spotrun job under the fault injector, and the checks every chaos case makes on its outcome."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint.checkpointer import Checkpointer
from checkpoint.config import CheckpointConfig
from checkpoint.discover import list_steps, read_manifest
from checkpoint.export import assemble
from checkpoint.storage import Storage
from elastic.chaos.api import STORAGE_CONTROL_ENV, Schedule
from elastic.chaos.injector import Injector
from elastic.chaos.journal import Journal
from elastic.chaos.storage import register
from elastic.chaos.targets import descendants, last_step
from elastic.events import read_events
from tests.harness.procs import SPOTRUN, Launcher, make_env, reap

TRAIN = str(Path(__file__).with_name("chaos_train.py"))
RDZV_CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"
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


def committed_steps(ckpt_uri: str) -> list[int]:
    register()
    with Checkpointer(ckpt_uri, CheckpointConfig()) as ckpt:
        return list_steps(ckpt.storage).committed


@dataclass
class Job:
    """One agent (``--nproc-per-node 2``) on an external etcd, checkpointing behind ``chaos::``."""

    root: Path
    endpoint: str
    run_id: str
    max_restarts: int = 3
    rdzv_conf: str = RDZV_CONF
    extra: tuple[str, ...] = ()
    steps: int = STEPS
    step_time: float = 0.05
    launcher: Launcher | None = None
    seen_pids: set[int] = field(default_factory=set)
    committed_at_fault: list[int] = field(default_factory=list)
    step_at_fault: list[tuple[str, int]] = field(default_factory=list)
    """(kind, last step reported) of each fault when it fired."""

    @property
    def ckpt(self) -> str:
        return f"chaos::file://{self.root}/ckpt"

    @property
    def control(self) -> str:
        return str(self.root / "storage-control.json")

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_events(str(self.root / "events.jsonl"))

    def start(self) -> Launcher:
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [*SPOTRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id, "--rdzv-conf", self.rdzv_conf, "--max-restarts", str(self.max_restarts),
                "--stop-grace", "2", "--events-file", str(self.root / "events.jsonl"),
                TRAIN, "--steps", str(self.steps), "--ckpt-every", str(CKPT_EVERY), "--step-time", str(self.step_time),
                "--log-every", "10", "--progress-file", str(self.root / "progress.jsonl"), "--ckpt-dir", self.ckpt,
                "--pg-timeout", "20", *self.extra]
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
