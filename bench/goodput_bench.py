"""Goodput under a seeded fault schedule: spotrun (etcd-v3, async Checkpointer, preemption helper) vs stock
torchrun (c10d rendezvous) + torch.distributed.checkpoint, at the same checkpoint interval, in one run.

    python bench/goodput_bench.py                                   # 10 min per launcher, a fault every 2 min
    python bench/goodput_bench.py --duration 240 --fault-every 60 --seed 1    # a short smoke run

Job: ``examples/train_gpt.py`` (small GPT, DDP, gloo/CPU, ``--step-time`` per step), one worker per agent,
``--nodes`` agents (``--nnodes 1:N``) on one host. spotrun runs it with its Checkpointer; torchrun with
``--ckpt-backend dcp`` (synchronous ``dcp.save`` every ``--ckpt-every`` steps, newest complete directory
loaded at start): what a stock job does. Both get ``--max-restarts 100``.

Fault schedule (:func:`make_schedule`, a pure function of the seed; the same for both launchers): one fault
every ``--fault-every`` s (+-20 % jitter), alternately drawn as

* ``notice``: SIGTERM to one agent (a spot/preemption notice; Kubernetes sends SIGTERM);
* ``kill``: SIGKILL to one agent and its workers (a node vanishing);

and ``--rejoin-after`` s after each, a new agent joins (a replacement node). Node 0 is never hit: it hosts
torchrun's c10d store, whose loss ends a torchrun job outright (spotrun's etcd runs apart) -- this
benchmark would otherwise measure only that.

Reported, per launcher, over the window from the first step at full size to ``--duration`` s later:

* effective training time ratio: productive step time / wall time; a step execution is productive when no
  later execution of the same step number replaced it (a restart from an older checkpoint re-trains steps);
  its time is the gap since the previous step of the same group (the first step of a group, restarted or
  re-formed in place, counts as the median step time: :func:`rank0_segments`);
* steps lost per fault type: steps trained again by the first new group after each fault;
* recovery by stage (spotrun, from ``events.jsonl``): seconds from the fault to each recovery event, and to
  the first step of the new group; torchrun has no events, only the last;
* agreed step -> first step of the new group, per planned change (``notice`` and ``rejoin``; spotrun only),
  median and worst, against the target of 1 s: from the moment the agreed step was committed to the first
  step of the new group (:func:`new_group_step`: a worker that did not train before the fault, one training at
  another world size or rank, the same pid re-formed in place, or any after the first ``workers_started``). The
  moment is the earliest ``committed_at`` of
  the fault's ``planned_leave`` / ``planned_restart`` events (each agent's latest worker acknowledgement,
  written right after the commit), or, in an events file without that field, the earliest of those events'
  ``t_wall`` (a little later: the agent noticed its workers had exited). It excludes the time to reach the
  agreed step (up to ``--preempt-sync-every`` steps plus the save), which the fault -> stage rows include.

Every worker of both launchers runs with ``OMP_NUM_THREADS=--omp-threads`` (1): the simulated nodes share
one host's cores, and with torch's default (one OpenMP thread per core in each of the N workers) any busy
process makes a step stall in OpenMP barriers; a restarted worker's first step, which runs while the old
processes exit, paid 0.3-0.6 s for it on 2 cores (a real node's workers have its cores to themselves).

Timings depend on the host; on a loaded machine they are indicative only. Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the shared process harness
# One way to get an etcd (spotrun) or a c10d port (torchrun) for both benches.
from bench.elastic_bench import rendezvous_endpoint
from elastic.api import ENV_REFORM_IN_PLACE
from tests.harness.procs import (
    EXAMPLES,
    SPOTRUN,
    TORCHRUN,
    Launcher,
    descendants,
    make_env,
    read_jsonl,
    signal_all,
    wait_for,
)

JOB = str(EXAMPLES / "train_gpt.py")
PLANNED = ("planned_leave", "planned_restart")
FAULT_KINDS = ("notice", "kill", "crash")
"""notice: SIGTERM to an agent; kill: SIGKILL of an agent and its workers (a node lost); crash: SIGKILL of one
worker (its node stays)."""
RESUME_TARGET_S = 1.0
"""Issue 8's target: survivors step within 1 s of the agreed (committed) step of a planned change."""
STAGES = ("notice_received", "failure_detected", "planned_leave", "workers_stopped", "rendezvous_completed",
          "workers_started")


# --------------------------------------------------------------------------- schedule (pure)


@dataclass(frozen=True, slots=True)
class Fault:
    at: float
    """Seconds after the measured window opens."""
    kind: str
    """``notice`` (SIGTERM to an agent), ``kill`` (SIGKILL to an agent and its workers), ``rejoin`` (a new agent)."""


def make_schedule(seed: int, duration: float, fault_every: float, rejoin_after: float,
                  kinds: tuple[str, ...] = ("notice", "kill")) -> list[Fault]:
    """Faults at ``fault_every`` +-20 %, one of ``kinds`` drawn from ``seed``, each followed by a rejoin."""
    if not kinds or any(k not in FAULT_KINDS for k in kinds):
        raise ValueError(f"--faults must name some of {', '.join(FAULT_KINDS)}, not {','.join(kinds) or 'nothing'}")
    if fault_every <= 0 or rejoin_after <= 0 or rejoin_after >= fault_every * 0.8:
        raise ValueError("--fault-every and --rejoin-after must be > 0, and the rejoin must come before the next fault "
                         f"(--rejoin-after {rejoin_after} >= 0.8 x --fault-every {fault_every})")
    rng = random.Random(seed)
    out: list[Fault] = []
    t = fault_every
    while t < duration:
        at = t + rng.uniform(-0.2, 0.2) * fault_every
        kind = rng.choice(kinds)
        out.append(Fault(at, kind))
        if kind != "crash" and at + rejoin_after < duration:  # a crashed worker's node stays: nothing rejoins
            out.append(Fault(at + rejoin_after, "rejoin"))
        t += fault_every
    return out


# --------------------------------------------------------------------------- analysis (pure)


def new_group_step(progress: list[dict[str, Any]], at: float, after: float, until: float = float("inf"),
                   events: list[dict[str, Any]] = ()) -> dict[str, Any] | None:
    """The first progress line in ``(after, until)`` of a worker group formed after the fault at ``at``, or None.

    A line is of a new group when its worker did not train before the fault (a restarted or joining worker), when
    the same worker trains at another world size or rank than in its last line before the fault (re-formed in
    place: the same pid), or when it comes after the first ``workers_started`` event after the fault (every path
    emits it once the new group is assigned: a re-form in place with ``in_place: true``)."""
    last: dict[int, tuple[int, int]] = {}
    for x in sorted(progress, key=lambda x: x["t_wall"]):
        if x["t_wall"] <= at:
            last[x["pid"]] = (x["world_size"], x["rank"])
    started = min((e["t_wall"] for e in events if e["event"] == "workers_started" and at < e["t_wall"] < until),
                  default=float("inf"))
    for x in sorted(progress, key=lambda x: x["t_wall"]):
        if not after < x["t_wall"] < until:
            continue
        if last.get(x["pid"]) != (x["world_size"], x["rank"]) or x["t_wall"] > started:
            return x
    return None


def rank0_segments(progress: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rank 0's lines in time order, cut where a new group begins: another worker (a restart), another world size
    (a re-form in place keeps the pid), or a step that is not after the previous one (a restore of an older step)."""
    out: list[list[dict[str, Any]]] = []
    for x in sorted((x for x in progress if x["rank"] == 0), key=lambda x: x["t_wall"]):
        prev = out[-1][-1] if out else None
        if prev is None or x["pid"] != prev["pid"] or x["world_size"] != prev["world_size"] or x["step"] <= prev["step"]:
            out.append([x])
        else:
            out[-1].append(x)
    return out


def productive_time(progress: list[dict[str, Any]], t0: float, t1: float) -> tuple[float, int, int]:
    """(productive seconds, productive steps, re-trained steps) of rank 0's lines in the window [t0, t1]."""
    durations: list[tuple[int, float | None, float]] = []  # (step, seconds or None, t_wall)
    for segment in rank0_segments(progress):  # the first step of each group has no predecessor (median)
        durations += [(x["step"], x["t_wall"] - p["t_wall"] if p else None, x["t_wall"])
                      for p, x in zip([None, *segment], segment)]
    durations.sort(key=lambda d: d[2])
    known = [g for _, g, t in durations if g is not None and t0 <= t <= t1]
    median = statistics.median(known) if known else 0.0
    last_exec: dict[int, int] = {}
    for i, (step, _, _) in enumerate(durations):
        last_exec[step] = i
    seconds, steps, redone = 0.0, 0, 0
    for i, (step, gap, t) in enumerate(durations):
        if not t0 <= t <= t1:
            continue
        if last_exec[step] == i:
            seconds += median if gap is None else gap
            steps += 1
        else:
            redone += 1
    return seconds, steps, redone


def lost_per_fault(progress: list[dict[str, Any]], faults: list[tuple[float, str]], t1: float = float("inf")
                   ) -> dict[str, list[int | None]]:
    """Fault kind -> steps re-trained by the first new worker group after each fault (wall-clock ``faults``);
    None when no new group trained before ``t1`` (the job did not resume in the window)."""
    segments = rank0_segments(progress)
    out: dict[str, list[int | None]] = {}
    for at, kind in faults:
        after = [seg for seg in segments if at < seg[0]["t_wall"] <= t1]
        if not after:
            out.setdefault(kind, []).append(None)
            continue
        t_new, first = after[0][0]["t_wall"], after[0][0]["step"]
        before = max((x["step"] for seg in segments for x in seg if x["t_wall"] < t_new), default=first - 1)
        out.setdefault(kind, []).append(max(0, before - first + 1))
    return out


def stage_times(events: list[dict[str, Any]], progress: list[dict[str, Any]], faults: list[tuple[float, str]],
                t1: float = float("inf")) -> dict[str, dict[str, list[float]]]:
    """Fault kind -> stage -> seconds from the fault to that stage's first event (and to the first new step),
    looking no further than the next fault or the window's end ``t1``."""
    out: dict[str, dict[str, list[float]]] = {}
    for i, (at, kind) in enumerate(faults):
        until = min(faults[i + 1][0] if i + 1 < len(faults) else t1, t1)
        stages = out.setdefault(kind, {})
        for name in STAGES:
            hits = [e["t_wall"] for e in events if e["event"] == name and at <= e["t_wall"] < until]
            if hits:
                stages.setdefault(name, []).append(min(hits) - at)
        new = new_group_step(progress, at, at, until, events)
        if new is not None:
            stages.setdefault("first_step_of_new_group", []).append(new["t_wall"] - at)
    return out


def agreed_step_to_first_step(events: list[dict[str, Any]], progress: list[dict[str, Any]],
                              faults: list[tuple[float, str]], t1: float = float("inf")) -> dict[str, list[float]]:
    """Fault kind -> seconds from the agreed step's commit to the first step of the new group, for each fault
    that ended in a planned change with a committed step (see the module docstring for the timestamps).
    The planned events are looked for up to the next fault; the first step up to the window's end ``t1``
    (on a slow machine the group may resume after the next fault, e.g. a rejoin, was injected)."""
    out: dict[str, list[float]] = {}
    for i, (at, kind) in enumerate(faults):
        until = min(faults[i + 1][0] if i + 1 < len(faults) else t1, t1)
        planned = [e for e in events
                   if e["event"] in PLANNED and e.get("step") is not None and at <= e["t_wall"] < until]
        if not planned:
            continue
        committed = [e["committed_at"] for e in planned if e.get("committed_at") is not None]
        agreed = min(committed) if committed else min(e["t_wall"] for e in planned)
        new = new_group_step(progress, at, agreed, t1 + 1e-9, events)
        if new is not None:
            out.setdefault(kind, []).append(new["t_wall"] - agreed)
    return out


# --------------------------------------------------------------------------- running


@dataclass(kw_only=True)
class Run:
    kind: str
    workdir: Path
    endpoint: str
    args: argparse.Namespace
    agents: list[Launcher] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    notes: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        job = [JOB, "--steps", "1000000000", "--step-time", str(self.args.step_time), "--log-every", "1000000",
               "--ckpt-every", str(self.args.ckpt_every), "--ckpt-dir", str(self.workdir / "ckpt"),
               "--progress-file", str(self.workdir / "progress.jsonl"), "--pg-timeout", "60",
               "--global-batch", "8", "--context", "32", "--d-model", "32", "--corpus-chars", "16384",
               "--parallel", self.args.parallel]
        n = f"1:{self.args.nodes}"
        if self.kind.startswith("spotrun-mem"):  # spotrun with the memory tier (issue 17): unplanned faults redo ~0 steps
            every = self.kind.partition(":")[2] or str(self.args.memory_every)  # spotrun-mem:K pins the interval
            job += ["--memory-snapshot-every", every]
        elif self.kind == "spotrun":  # the durable tier alone (the examples' memory tier is on by default)
            job += ["--no-memory-tier"]
        if self.kind.startswith("spotrun"):
            return [*SPOTRUN, "--nnodes", n, "--nproc-per-node", "1", "--rdzv-endpoint", self.endpoint,
                    "--rdzv-id", "goodput", "--max-restarts", "100", "--rdzv-conf", "lease_ttl=3",
                    "--events-file", str(self.workdir / "events.jsonl"), *job]
        return [*TORCHRUN, "--nnodes", n, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", "goodput", "--max-restarts", "100",
                *job, "--ckpt-backend", "dcp"]

    def start_agent(self) -> Launcher:
        # spotrun-mem-restart: the same job with in-place re-form off (its workers restart on every change)
        restart = {ENV_REFORM_IN_PLACE: "0"} if self.kind.partition(":")[0].endswith("-restart") else {}
        agent = Launcher(self.argv(), self.workdir / f"agent{len(self.agents)}.log",
                         env=make_env(LOGLEVEL=os.environ.get("LOGLEVEL", "WARNING"), **omp_env(self.args.omp_threads),
                                      **restart))
        self.agents.append(agent)
        return agent

    def progress(self) -> list[dict[str, Any]]:
        path = self.workdir / "progress.jsonl"
        return read_jsonl(path) if path.exists() else []

    def live(self) -> list[Launcher]:
        return [a for a in self.agents if a.proc.poll() is None]


def omp_env(threads: int) -> dict[str, str]:
    """OMP_NUM_THREADS for every agent (and so every worker) of both launchers; 0 leaves it unset."""
    return {"OMP_NUM_THREADS": str(threads)} if threads > 0 else {}


def pick_victim(run: Run) -> Launcher | None:
    """The longest-running agent but node 0 whose worker trained in the last 30 s (a member of the group, not a
    replacement still importing torch); else the longest-running agent but node 0."""
    others = run.live()[1:]  # never node 0 (see the module docstring)
    recent = {x["pid"] for x in run.progress() if x["t_wall"] > time.time() - 30}
    training = [a for a in others if recent & set(descendants(a.pid))]
    return (training or others or [None])[0]


def execute(run: Run, schedule: list[Fault]) -> None:
    """Start the agents, wait for full size, apply the schedule, close everything."""
    args = run.args
    try:
        for _ in range(args.nodes):
            run.start_agent()
        wait_for(lambda: len({x["rank"] for x in run.progress() if x["world_size"] == args.nodes}) == args.nodes,
                 args.start_timeout, f"{run.kind}: {args.nodes} agents to train together", interval=0.2)
        t0 = time.time()
        run.window = (t0, t0 + args.duration)
        for fault in schedule:
            time.sleep(max(0.0, t0 + fault.at - time.time()))
            if not run.live():
                run.notes.append(f"no agent left alive at +{fault.at:.0f} s: the job ended")
                break
            run.faults.append((time.time(), fault.kind))
            if fault.kind == "rejoin":
                run.start_agent()
                continue
            victim = pick_victim(run)
            if victim is None:
                run.notes.append(f"+{fault.at:.0f} s {fault.kind}: only node 0 alive, skipped")
                run.faults.pop()
                continue
            if fault.kind == "notice":
                victim.signal(signal.SIGTERM)
            elif fault.kind == "crash":
                workers = sorted({x["pid"] for x in run.progress()} & set(descendants(victim.pid)))
                signal_all(workers[-1:], signal.SIGKILL)  # its newest worker (the one training now)
            else:
                signal_all([*victim.snapshot_tree()], signal.SIGKILL)
        time.sleep(max(0.0, run.window[1] - time.time()))
        ended = [(i, a.proc.returncode) for i, a in enumerate(run.agents) if a.proc.poll() is not None]
        run.notes.append(f"agents ended before the window closed (agent, exit code): {ended}; "
                         f"{len(run.live())} of {len(run.agents)} still running")
    finally:
        for agent in run.agents:
            agent.close(grace=5.0)


def summarize(run: Run) -> dict[str, Any]:
    progress = run.progress()
    t0, t1 = run.window
    seconds, steps, redone = productive_time(progress, t0, t1)
    events = read_jsonl(run.workdir / "events.jsonl") if (run.workdir / "events.jsonl").exists() else []
    return {
        "ratio": seconds / (t1 - t0) if t1 > t0 else 0.0,
        "productive_steps": steps,
        "redone": redone,
        "lost": lost_per_fault(progress, run.faults, t1),
        "stages": stage_times(events, progress, run.faults, t1),
        "resume": agreed_step_to_first_step(events, progress, run.faults, t1),
        "faults": [k for _, k in run.faults],
        "notes": run.notes,
    }


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s (n={len(values)})" if values else "-"


def median_worst(values: list[float]) -> str:
    """``median / worst`` with the count and whether the worst meets :data:`RESUME_TARGET_S`."""
    if not values:
        return "-"
    worst = max(values)
    verdict = "met" if worst <= RESUME_TARGET_S else "missed"
    return f"{statistics.median(values):.2f} / {worst:.2f} s (n={len(values)}, {verdict})"


def print_report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    kinds = list(results)
    print(f"\n### Goodput, {args.duration:.0f} s window, a fault every {args.fault_every:.0f} s, seed {args.seed}, "
          f"checkpoint every {args.ckpt_every} steps, step time +{args.step_time} s, "
          f"OMP_NUM_THREADS={args.omp_threads or 'unset'}, load {os.getloadavg()[0]:.1f}\n")
    print("| | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    print("| effective training time ratio | " + " | ".join(f"{results[k]['ratio']:.3f}" for k in kinds) + " |")
    print("| productive steps | " + " | ".join(str(results[k]["productive_steps"]) for k in kinds) + " |")
    print("| steps trained again | " + " | ".join(str(results[k]["redone"]) for k in kinds) + " |")
    for fault in ("notice", "kill", "crash", "rejoin"):
        cells = []
        for k in kinds:
            lost = results[k]["lost"].get(fault, [])
            resumed = [n for n in lost if n is not None]
            text = f"{sum(resumed)} ({resumed})" if resumed else ("-" if not lost else "")
            if len(resumed) < len(lost):
                text += f" {len(lost) - len(resumed)}x not resumed in the window"
            cells.append(text.strip())
        print(f"| steps lost: {fault} | " + " | ".join(cells) + " |")
    for fault in ("notice", "kill", "crash", "rejoin"):
        names = sorted({s for k in kinds for s in results[k]["stages"].get(fault, {})},
                       key=lambda s: (STAGES + ("first_step_of_new_group",)).index(s))
        for stage in names:
            cells = [_median(results[k]["stages"].get(fault, {}).get(stage, [])) for k in kinds]
            print(f"| {fault}: fault -> {stage} | " + " | ".join(cells) + " |")
    for fault in ("notice", "rejoin"):
        cells = [median_worst(results[k].get("resume", {}).get(fault, [])) for k in kinds]
        print(f"| {fault}: agreed step -> first step of the new group, median / worst "
              f"(target <= {RESUME_TARGET_S:.0f} s) | " + " | ".join(cells) + " |")
    for k in kinds:
        for note in results[k]["notes"]:
            print(f"- {k}: {note}")
    print("\nIndicative only unless measured on a quiet machine (see the load above).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--duration", type=float, default=600.0, help="measured seconds per launcher")
    p.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults (+-20 %% jitter)")
    p.add_argument("--rejoin-after", type=float, default=None, help="seconds from a fault to its rejoin (default: a third of --fault-every)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=3, help="agents at full size (one worker each)")
    p.add_argument("--ckpt-every", type=int, default=50, help="periodic checkpoint interval (both launchers)")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--launchers", default="spotrun,torchrun",
                   help="comma-separated: spotrun, spotrun-mem (spotrun + memory tier every --memory-every steps), "
                        "spotrun-mem:K (every K steps), spotrun-mem-restart[:K] (the same with in-place re-form off: "
                        "SPOTRUN_REFORM_IN_PLACE=0), torchrun")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="train_gpt.py's --parallel: replicate (DDP) or shard (FSDP2; the memory tier keeps buddy copies)")
    p.add_argument("--memory-every", default="auto",
                   help="spotrun-mem: memory snapshot every K steps, or 'auto' (default, the examples' default: every "
                        "step while it costs under 2 %% of the step); a node loss still redoes ~0: just-in-time snapshots")
    p.add_argument("--faults", default="notice,kill",
                   help="fault kinds drawn (comma-separated, of notice, kill, crash); 'kill,crash': unplanned faults only")
    p.add_argument("--omp-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of every worker, both launchers (default 1: the simulated nodes share this "
                        "host's cores; with torch's default each of N workers runs as many OpenMP threads as the "
                        "host has cores and a step stalls in OpenMP barriers whenever another process is busy). "
                        "0 leaves it unset (torchrun sets 1 itself only with --nproc-per-node > 1)")
    p.add_argument("--workdir", default=None, help="keep logs, progress and events here (default: temporary)")
    args = p.parse_args(argv)
    rejoin = args.rejoin_after if args.rejoin_after is not None else args.fault_every / 3
    if args.nodes < 2 or args.duration <= 0:
        p.error("--nodes must be >= 2 and --duration > 0")
    for every in [args.memory_every] + [k.partition(":")[2] for k in args.launchers.split(",") if ":" in k]:
        if every != "auto" and not (every.isdigit() and int(every) >= 1):
            p.error(f"a memory interval must be an integer >= 1 or 'auto', got {every!r}")
    unknown = [k for k in args.launchers.split(",") if k.partition(":")[0] not in ("spotrun", "spotrun-mem", "spotrun-mem-restart",
                                                                                     "torchrun")]
    if unknown:
        p.error(f"unknown launcher(s) {unknown}: use spotrun, spotrun-mem[:K], spotrun-mem-restart[:K], torchrun")
    try:
        schedule = make_schedule(args.seed, args.duration, args.fault_every, rejoin,
                                 tuple(k for k in args.faults.split(",") if k))
    except ValueError as exc:
        p.error(str(exc))
    print("schedule: " + ", ".join(f"+{f.at:.0f}s {f.kind}" for f in schedule), flush=True)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="goodput-"))
    results: dict[str, dict[str, Any]] = {}
    for kind in args.launchers.split(","):
        workdir = root / kind
        workdir.mkdir(parents=True, exist_ok=True)
        with rendezvous_endpoint("spotrun" if kind.startswith("spotrun") else kind) as endpoint:
            run = Run(kind=kind, workdir=workdir, endpoint=endpoint, args=args)
            try:
                execute(run, schedule)
            except AssertionError as exc:  # a harness Timeout: report what happened instead of a traceback
                run.notes.append(f"aborted: {exc}")
        results[kind] = summarize(run)
        print(f"{kind}: done ({results[kind]['productive_steps']} productive steps); files in {workdir}", flush=True)
    print_report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
