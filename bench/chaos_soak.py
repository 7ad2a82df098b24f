"""Chaos soak: one long seeded run of examples/train_ddp.py under spotrun with random survivable faults.

    python bench/chaos_soak.py --duration 300 --seed 1      # ~5 min of faults, then the job's end
    python bench/chaos_soak.py --duration 30 --seed 1 --gap 8

One agent with two workers on a real etcd (loopback), checkpointing behind ``chaos::file://``. Faults, drawn
with the seed, at least ``--gap`` s apart: kill_worker (one restart each), restart_etcd (the member down
1 s: 0 restarts), storage_latency and storage_error (transient, 2 s: 0 restarts). The job trains until a
step count long enough to outlast the schedule; then the run is compared with an uninterrupted reference.

Prints the figures of the README's chaos section: faults injected by type, survived, steps lost per fault,
MTTR per type (median, worst; see bench/mttr_report.py), corrupt checkpoints (every committed step must
load), leftover processes, and whether the final weights are bit-identical to the reference. The numbers
are only comparable between runs on a quiet machine: the host load is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.mttr_report import Fault as ReportFault
from bench.mttr_report import breakdown, render, resume_times, summarize
from elastic.chaos.api import Fault, FaultKind, Schedule
from elastic.chaos.schedule import random_schedule
from elastic.etcd_server import EmbeddedEtcd
from elastic.events import read_events
from tests.chaos.jobs import Job, committed_steps, final_state
from tests.harness.procs import Timeout, pid_alive, wait_for

KINDS = (FaultKind.KILL_WORKER, FaultKind.RESTART_ETCD, FaultKind.STORAGE_LATENCY, FaultKind.STORAGE_ERROR)
PARAMS = {FaultKind.STORAGE_LATENCY: {"seconds": 0.5}, FaultKind.STORAGE_ERROR: {"rate": 0.2, "ops": "all"}}
STEP_TIME = 0.05


def soak_schedule(seed: int, duration: float, gap: float) -> Schedule:
    """The seeded random schedule, each fault given its soak target, duration and parameters."""
    raw = random_schedule(seed, duration_s=duration, count=max(1, int(duration // gap)), kinds=KINDS, min_gap_s=gap)
    faults = []
    for f in raw.faults:
        duration_s = {FaultKind.KILL_WORKER: None, FaultKind.RESTART_ETCD: 1.0}.get(f.kind, 2.0)
        target = "etcd:0" if f.kind is FaultKind.RESTART_ETCD else ""
        faults.append(Fault(kind=f.kind, target=target, at_s=f.at_s, duration_s=duration_s, params=PARAMS.get(f.kind, {})))
    return Schedule(seed=seed, faults=tuple(faults))


def corrupt_steps(ckpt_uri: str) -> list[int]:
    """Committed steps whose files fail their checksums (target: none); spotrun-ckpt verify's checks."""
    from checkpoint.cli import verify_manifest, verify_rank_objects
    from checkpoint.discover import read_manifest
    from checkpoint.storage import Storage

    storage = Storage(ckpt_uri)
    bad = []
    for step in committed_steps(ckpt_uri):
        try:
            manifest = read_manifest(storage, step)
            problems = verify_manifest(storage, manifest, progress=False) + verify_rank_objects(storage, manifest)
        except Exception as exc:  # noqa: BLE001 (any failure to read a committed step counts as corrupt)
            problems = [str(exc)]
        if problems:
            bad.append(step)
    return bad


def leftover(pids: set[int], timeout: float = 15.0) -> list[int]:
    """The job's processes still alive (not zombies) ``timeout`` s after it ended (the forkserver and its
    helpers exit a moment after the agent)."""
    try:
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout, "the job's processes to exit")
    except Timeout:
        pass
    return sorted(p for p in pids if pid_alive(p))


def _fired_records(injector: object) -> list[str]:
    """The journal record (injected/skipped/failed) of each fired fault, in firing order."""
    from elastic.events import read_events as read

    journal = getattr(injector, "journal").path  # noqa: B009
    return [r["record"] for r in read(journal) if r.get("record") in ("injected", "skipped", "failed")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, required=True, help="seconds over which faults are injected")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap", type=float, default=15.0, help="minimum seconds between two faults")
    p.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    args = p.parse_args(argv)
    schedule = soak_schedule(args.seed, args.duration, args.gap)
    # Enough steps that the job outlives the schedule even with no time lost to recoveries.
    steps = int(args.duration / STEP_TIME) + 100
    root = Path(tempfile.mkdtemp(prefix="spotrun-soak-"))
    print(f"soak: seed {args.seed}, {len(schedule.faults)} faults over {args.duration} s, {steps} steps, "
          f"load average {os.getloadavg()}, run dir {root}")
    with EmbeddedEtcd() as etcd:
        ref = Job(root / "reference", etcd.endpoint, "soak-ref", steps=steps, step_time=0.0)
        code, _ = ref.run(Schedule(), timeout=args.duration * 4 + 600)
        if code != 0:
            print(f"reference run failed with exit code {code}:\n{ref.output()[-3000:]}")
            return 1
        job = Job(root / "chaos", etcd.endpoint, "soak", steps=steps, step_time=STEP_TIME, max_restarts=1000)
        code, injector = job.run(schedule, timeout=args.duration * 4 + 600, endpoints=(etcd.endpoint,),
                                 clock_from_first_step=True)
        for proc in injector.started:  # etcd members the injector restarted: stop them before the fixture's
            proc.terminate()
            proc.wait(30)
    injected = injector.injected
    by_kind: dict[str, int] = {}
    for r in injected:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    restarts = len(job.restarts())
    kills = by_kind.get(FaultKind.KILL_WORKER.value, 0)
    step, tensors = final_state(job.ckpt)
    _, reference = final_state(ref.ckpt)
    identical = tensors.keys() == reference.keys() and all(torch.equal(tensors[k], reference[k]) for k in tensors)
    resumed = job.resumed_steps()
    # Each injected kill costs one restart, which resumes once (the "resumed from step" line of rank 0).
    killed_at = [step for (kind, step), rec in zip(job.step_at_fault, _fired_records(injector))
                 if kind == FaultKind.KILL_WORKER.value and rec == "injected"]
    lost = [max(0, at - r) for at, r in zip(killed_at, resumed)]
    alive = leftover(job.seen_pids)
    print(f"exit code {code}; final step {step} of {steps}; final weights identical to the reference: {identical}")
    print(f"faults injected by type: {by_kind} (not fired: {injector.pending()})")
    print(f"restarts {restarts}, worker kills {kills} (expected equal; etcd and storage faults cost none)")
    print(f"steps lost per kill (median, worst): {statistics.median(lost) if lost else 'n/a'}, {max(lost, default='n/a')}")
    print(f"corrupt checkpoints: {corrupt_steps(job.ckpt)}; leftover processes: {alive}")
    faults = [ReportFault(r["kind"], float(r["t_wall"])) for r in injected]
    recoveries = breakdown(faults, read_events(str(job.root / "events.jsonl")),
                           read_events(str(job.root / "progress.jsonl")), resume_times(job.output()))
    counts = {k: sum(1 for r in recoveries if r.fault.kind == k) for k in by_kind}
    print("MTTR, seconds from injection (median / worst):")
    print(render(summarize(recoveries), counts))
    ok = code == 0 and step == steps and identical and restarts == kills and not alive
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
