"""Recovery-time benchmark: stock torchrun (c10d rendezvous) vs spotrun (etcd-v3), side by side.

    python bench/elastic_bench.py                 # default repetitions (a few minutes on 2 cores)
    python bench/elastic_bench.py --reps 1 --sigstop-reps 0 --scenarios worker_crash

Job: ``examples/train_ddp.py`` (a small DDP MLP, gloo, ``--step-time 0.05``) with ``--progress-file``, one
worker per agent for node scenarios, two workers on one agent for the worker-crash scenario. All launchers
use their defaults, except ``--max-restarts 100`` (torchrun would give up otherwise) and the same
``--pg-timeout 60`` for the job's collectives. Scenarios, each time measured with wall clocks on one host:

* node_loss_sigkill: two agents (``--nnodes 1:2``, started together) train at world size 2; the second
  agent *and its workers* are SIGKILLed (a machine vanishing) -> the survivor's next completed step.
* node_loss_sigstop: same, but SIGSTOPped (silent vanish, e.g. a network partition).
* scale_up: one agent trains alone; a second agent process is started -> first completed step at world size
  2 (for spotrun also from the moment the new agent starts its rendezvous, i.e. without its own interpreter
  start and ``import torch``; a running group is only interrupted from then on).
Each repetition is a fresh job (fresh run id), so one launcher's failure cannot poison the next repetition.
* worker_crash: one of two workers of a single agent is SIGKILLed -> next completed step by a new worker.

``--launchers spotrun,spotrun-nomem`` runs spotrun twice, the second time with the examples' memory tier off
(``--no-memory-tier``): what its just-in-time snapshots and memory restore add to a recovery, in one run.
``--launchers spotrun,spotrun-restart`` runs it with re-form in place (the examples' default, ``elastic.inplace.run``)
and then with it off (``SPOTRUN_REFORM_IN_PLACE=0``: every change restarts the workers), in one run; a second
table says whether the survivors' worker pids were kept (in place) and the most steps any recovery redid.
``--job-ckpt`` gives the job a checkpoint directory: ``train_ddp.py`` builds its Preemption helper only with one,
and in place needs it for a join (the agreed step) and a silent loss (its watcher aborts the blocked collective);
without it a join restarts the workers and a silent loss falls back (``in_place_fallback``, ``not_waiting``).

Prints a Markdown table (median and min-max over the repetitions), the host load, and spotrun's recovery
breakdown from its ``events.jsonl``. Timings on a loaded machine are not comparable with another run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the shared process harness
from elastic.api import ENV_REFORM_IN_PLACE
from tests.harness.procs import (
    EXAMPLES,
    SPOTRUN,
    TORCHRUN,
    Launcher,
    Timeout,
    free_port,
    make_env,
    read_jsonl,
    signal_all,
    wait_for,
)

JOB = str(EXAMPLES / "train_ddp.py")
JOB_ARGS = ["--steps", "1000000000", "--step-time", "0.05", "--log-every", "1000000", "--pg-timeout", "60"]


@dataclass(kw_only=True, slots=True)
class Samples:
    """Seconds per repetition; ``None`` marks a repetition that timed out."""

    values: list[float | None] = field(default_factory=list)
    limit: float = 0.0
    recoveries: list[tuple[Path, float, float, float, frozenset[int]]] = field(default_factory=list)
    """(progress file, the job's start, fault time, first step of the new group, the victims' pids) per recovered
    repetition (the repetitions of a scenario share one progress file): read by :meth:`kept_cell` once the jobs
    are over."""

    def kept_cell(self) -> str:
        """Survivors' worker pids kept in the new group (all: re-formed in place) and the most steps redone."""
        if not self.recoveries:
            return "-"
        kept = survivors = redone = 0
        for progress, since, fault_at, new_at, victims in self.recoveries:
            k, n, r = survivor_stats(read_jsonl(progress), fault_at, new_at, victims, since=since)
            kept, survivors, redone = kept + k, survivors + n, max(redone, r)
        return f"{kept}/{survivors} kept, {redone} redone"

    def cell(self) -> str:
        done = [v for v in self.values if v is not None]
        failed = len(self.values) - len(done)
        if not self.values:
            return "-"
        if not done:
            return f"failed/>{self.limit:.0f} s (x{failed})"
        text = f"{statistics.median(done):.2f} s ({min(done):.2f}-{max(done):.2f}, n={len(done)})"
        return text + (f", {failed} failed/>{self.limit:.0f} s" if failed else "")


class Agent(Launcher):
    """One launcher process with the agents' own log level (``LOGLEVEL``, spotrun's default WARNING), not the
    tests' INFO, so that logging costs what it costs in production."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(argv, log, env=make_env(LOGLEVEL=os.environ.get("LOGLEVEL", "WARNING"), **(env or {})))

    def close(self, grace: float = 20.0) -> None:
        super().close(grace)


@dataclass(kw_only=True)
class LauncherKind:
    """How to start one agent of a launcher for a given rendezvous endpoint."""

    name: str
    argv: Callable[[str, str, str, int, Path], list[str]]
    """(endpoint, run_id, nnodes, nproc, workdir) -> argv."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the agents' environment (``spotrun-restart``: ``SPOTRUN_REFORM_IN_PLACE=0``)."""
    job_extra: list[str] = field(default_factory=list)
    """Appended to the job's arguments, ``{workdir}`` and ``{run_id}`` filled in (``--job-ckpt``: a checkpoint
    directory per job)."""

    def agent(self, endpoint: str, run_id: str, nnodes: str, nproc: int, workdir: Path, log: Path) -> Agent:
        extra = [arg.replace("{workdir}", str(workdir)).replace("{run_id}", run_id) for arg in self.job_extra]
        return Agent([*self.argv(endpoint, run_id, nnodes, nproc, workdir), *extra], log, self.env)


def torchrun_argv(endpoint: str, run_id: str, nnodes: str, nproc: int, workdir: Path) -> list[str]:
    return [*TORCHRUN, "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "100",
            JOB, *JOB_ARGS, "--progress-file", str(workdir / "progress.jsonl")]


def spotrun_argv(endpoint: str, run_id: str, nnodes: str, nproc: int, workdir: Path) -> list[str]:
    return [*SPOTRUN, "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "100",
            "--events-file", str(workdir / "events.jsonl"), JOB, *JOB_ARGS,
            "--progress-file", str(workdir / "progress.jsonl")]


def spotrun_nomem_argv(endpoint: str, run_id: str, nnodes: str, nproc: int, workdir: Path) -> list[str]:
    """spotrun with the examples' memory tier off (``--no-memory-tier``): what the tier's just-in-time snapshots
    and memory restore add to a recovery, measured beside the default in one run."""
    return [*spotrun_argv(endpoint, run_id, nnodes, nproc, workdir), "--no-memory-tier"]


@contextlib.contextmanager
def rendezvous_endpoint(kind: str) -> Iterator[str]:
    if kind.startswith("spotrun"):
        from elastic.etcd_server import EmbeddedEtcd

        with EmbeddedEtcd() as etcd:
            yield etcd.endpoint
    else:
        yield f"127.0.0.1:{free_port()}"  # the first torchrun agent hosts the c10d TCPStore


def first_step(progress: Path, *, after: float, world: int, exclude_pids: set[int] = frozenset(),
               new_pids_only: set[int] | None = None) -> float | None:
    for rec in read_jsonl(progress):
        if rec["t_wall"] <= after or rec["world_size"] != world or rec["pid"] in exclude_pids:
            continue
        if new_pids_only is not None and rec["pid"] in new_pids_only:
            continue
        return rec["t_wall"]
    return None


def survivor_stats(progress: list[dict], fault_at: float, new_at: float, victims: frozenset[int] | set[int],
                   window: float = 1.0, since: float = 0.0) -> tuple[int, int, int]:
    """(survivors' worker pids still training in the new group, survivors, steps redone) for one recovery.
    Survivors: the pids of the old group's last step (lines in ``(since, fault_at]``: this job's) but ``victims``; the new group:
    the pids of the lines in ``[new_at, new_at + window]``; redone: the old group's last step - the new group's
    first + 1, at least 0."""
    old = [r for r in progress if since < r["t_wall"] <= fault_at]
    new = sorted((r for r in progress if new_at <= r["t_wall"] <= new_at + window), key=lambda r: r["t_wall"])
    if not old or not new:
        return 0, 0, 0
    last = max(r["step"] for r in old)
    survivors = {r["pid"] for r in old if r["step"] == last} - set(victims)
    return len(survivors & {r["pid"] for r in new}), len(survivors), max(0, last - new[0]["step"] + 1)


def first_join_time(events: Path, agent_pid: int, after: float) -> float | None:
    """Wall time the new spotrun agent started its first rendezvous (its interpreter start excluded)."""
    for rec in read_jsonl(events):
        if rec["event"] == "rendezvous_started" and f"-{agent_pid}-" in rec["node"] and rec["t_wall"] > after:
            return rec["t_wall"]
    return None


def wait_listening(endpoint: str, timeout: float) -> None:
    """torchrun's c10d store is hosted by the first agent: the second must start after it listens."""
    host, port = endpoint.rsplit(":", 1)

    def listening() -> bool:
        with socket.socket() as sock:
            sock.settimeout(0.2)
            return sock.connect_ex((host, int(port))) == 0

    wait_for(listening, timeout, "the first agent to host the c10d store")


def wait_for_step(step_time: Callable[[], float | None], agents: list[Agent], timeout: float, what: str) -> float | None:
    """Wall time of the awaited training step, or None if one of ``agents`` died first; :class:`Timeout` if
    neither happened within ``timeout`` s."""
    at = wait_for(lambda: step_time() or any(agent.proc.poll() is not None for agent in agents), timeout, what,
                  interval=0.02)
    return at if isinstance(at, float) else None


def start_pair(kind: LauncherKind, endpoint: str, run_id: str, workdir: Path, tag: str) -> list[Agent]:
    first = kind.agent(endpoint, run_id, "1:2", 1, workdir, workdir / f"{tag}-a.log")
    if kind.name == "torchrun":
        wait_listening(endpoint, 60)
    return [first, kind.agent(endpoint, run_id, "1:2", 1, workdir, workdir / f"{tag}-b.log")]


@contextlib.contextmanager
def repetition(kind: LauncherKind, bar: tqdm, samples: Samples) -> Iterator[tuple[str, list[Agent]]]:
    """One repetition as a fresh job: a fresh rendezvous endpoint, every agent added to the list closed at the
    end, and a :class:`Timeout` counted as a failed repetition (``None`` in ``samples``) instead of raised."""
    with rendezvous_endpoint(kind.name) as endpoint:
        agents: list[Agent] = []
        try:
            yield endpoint, agents
        except Timeout:
            samples.values.append(None)
        finally:
            for agent in agents:
                agent.close()
            bar.update(1)


def node_loss(kind: LauncherKind, workdir: Path, mode: str, reps: int, timeout: float, bar: tqdm) -> Samples:
    """Two agents train at world size 2; the second one and its workers are SIGKILLed/SIGSTOPped."""
    samples = Samples(limit=timeout)
    progress = workdir / "progress.jsonl"
    for rep in range(reps):
        with repetition(kind, bar, samples) as (endpoint, agents):
            agents += start_pair(kind, endpoint, f"loss-{mode}-{rep}", workdir, f"{mode}{rep}")
            began = agents[0].started_at
            wait_for(lambda: first_step(progress, after=began, world=2), 150, f"{kind.name}: two nodes to train")  # noqa: B023 - polled before the loop moves on
            time.sleep(1.0)  # steady state: the workers' helpers (Preemption, the in-place watcher) are up
            victims = agents[1].snapshot_tree()
            lost_at = time.time()
            signal_all(victims, signal.SIGKILL if mode == "sigkill" else signal.SIGSTOP)
            try:
                at = wait_for_step(lambda: first_step(progress, after=lost_at, world=1, exclude_pids=set(victims)),  # noqa: B023 - polled before the loop moves on
                                   agents[:1], timeout, f"{mode} recovery")
                samples.values.append(None if at is None else at - lost_at)
                if at is not None:
                    samples.recoveries.append((progress, began, lost_at, at, frozenset(victims)))
            finally:
                signal_all(victims, signal.SIGKILL)
    return samples


def scale_up(kind: LauncherKind, workdir: Path, reps: int, timeout: float, bar: tqdm) -> tuple[Samples, Samples, int]:
    """One agent trains alone; a second agent process starts -> first step at world size 2.
    Returns (from process start, from the new agent's rendezvous start, repetitions where an agent died)."""
    total, from_join, deaths = Samples(limit=timeout), Samples(limit=timeout), 0
    progress = workdir / "progress.jsonl"
    for rep in range(reps):
        with repetition(kind, bar, total) as (endpoint, agents):
            agents.append(kind.agent(endpoint, f"grow-{rep}", "1:2", 1, workdir, workdir / f"grow{rep}-a.log"))
            began = agents[0].started_at
            wait_for(lambda: first_step(progress, after=began, world=1), 150, f"{kind.name}: first agent to train")  # noqa: B023 - polled before the loop moves on
            second = kind.agent(endpoint, f"grow-{rep}", "1:2", 1, workdir, workdir / f"grow{rep}-b.log")
            agents.append(second)
            at = wait_for_step(lambda: first_step(progress, after=second.started_at, world=2), agents, timeout,  # noqa: B023 - polled before the loop moves on
                               "scale-up")
            if at is None:
                total.values.append(None)
                deaths += 1
            else:
                total.values.append(at - second.started_at)
                total.recoveries.append((progress, began, second.started_at, at, frozenset()))
                joined = first_join_time(workdir / "events.jsonl", second.pid, second.started_at)
                if joined is not None:
                    from_join.values.append(at - joined)
    return total, from_join, deaths


def worker_crash(kind: LauncherKind, workdir: Path, reps: int, timeout: float, bar: tqdm) -> Samples:
    samples = Samples(limit=timeout)
    progress = workdir / "progress.jsonl"
    with rendezvous_endpoint(kind.name) as endpoint:
        agent = kind.agent(endpoint, "bench-crash", "1", 2, workdir, workdir / "agent.log")
        try:
            wait_for(lambda: first_step(progress, after=0, world=2), 120, f"{kind.name}: workers to train")
            for _ in range(reps):
                time.sleep(0.5)  # let the group settle into steady state; not a synchronisation
                records = read_jsonl(progress)
                old_pids = {r["pid"] for r in records}
                victim = max((r for r in records if r["rank"] == 1), key=lambda r: r["t_wall"])["pid"]
                crashed_at = time.time()
                signal_all([victim], signal.SIGKILL)
                try:
                    at = wait_for(lambda: first_step(progress, after=crashed_at, world=2, new_pids_only=old_pids),  # noqa: B023 - polled before the loop moves on
                                  timeout, "worker crash recovery", interval=0.02)
                    samples.values.append(at - crashed_at)
                    samples.recoveries.append((progress, agent.started_at, crashed_at, at, frozenset({victim})))
                except Timeout:
                    samples.values.append(None)
                    break
                finally:
                    bar.update(1)
        finally:
            agent.close()
    return samples


def spotrun_breakdown(events_file: Path) -> list[tuple[str, float]]:
    """Median seconds per recovery stage over every recovery in the events file."""
    events = read_jsonl(events_file)
    stages: dict[str, list[float]] = {}
    by_node: dict[str, list[dict]] = {}
    for ev in events:
        by_node.setdefault(ev["node"], []).append(ev)
    order = ["failure_detected", "workers_stopped", "rendezvous_started", "rendezvous_completed", "workers_started"]
    for evs in by_node.values():
        for i, ev in enumerate(evs):
            if ev["event"] != "failure_detected":
                continue
            seq = evs[i:i + len(order)]
            if [e["event"] for e in seq] != order:
                continue
            for a, b in zip(seq, seq[1:]):
                stages.setdefault(f"{a['event']} -> {b['event']}", []).append(b["t_mono"] - a["t_mono"])
    return [(name, statistics.median(vals)) for name, vals in stages.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="repetitions of scale-up, node loss and worker crash")
    parser.add_argument("--sigstop-reps", type=int, default=1, help="repetitions of the SIGSTOP node loss")
    parser.add_argument("--timeout", type=float, default=90.0, help="give up on one recovery after this many s")
    parser.add_argument("--launchers", default="torchrun,spotrun",
                        help="comma-separated: torchrun, spotrun, spotrun-nomem (spotrun, the memory tier off), "
                             "spotrun-restart (spotrun, in-place re-form off: SPOTRUN_REFORM_IN_PLACE=0)")
    parser.add_argument("--scenarios", default="nodes,worker_crash")
    parser.add_argument("--job-ckpt", action="store_true",
                        help="give the job a checkpoint directory (--ckpt-dir, never saved periodically): its "
                             "Preemption helper exists only then, and with it the agreed step of a join and the "
                             "watcher that aborts a collective blocked on a silent peer (in place needs both)")
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.sigstop_reps < 0 or args.timeout <= 0:
        parser.error("--reps must be >= 1, --sigstop-reps >= 0 and --timeout > 0")
    kinds = {"torchrun": LauncherKind(name="torchrun", argv=torchrun_argv),
             "spotrun": LauncherKind(name="spotrun", argv=spotrun_argv),
             "spotrun-nomem": LauncherKind(name="spotrun-nomem", argv=spotrun_nomem_argv),
             "spotrun-restart": LauncherKind(name="spotrun-restart", argv=spotrun_argv, env={ENV_REFORM_IN_PLACE: "0"})}
    unknown = sorted(set(args.launchers.split(",")) - set(kinds))
    if unknown:
        parser.error(f"--launchers: unknown {', '.join(unknown)} (choose from {', '.join(kinds)})")
    chosen = [kinds[name] for name in args.launchers.split(",")]
    if args.job_ckpt:
        for kind in chosen:
            kind.job_extra = ["--ckpt-dir", "{workdir}/ckpt-{run_id}", "--ckpt-every", "1000000"]
    scenarios = set(args.scenarios.split(","))
    root = Path(args.workdir or tempfile.mkdtemp(prefix="spotrun-bench-"))
    load_before = os.getloadavg()
    total = len(chosen) * ((2 * args.reps + args.sigstop_reps if "nodes" in scenarios else 0) +
                           (args.reps if "worker_crash" in scenarios else 0))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the finally blocks
    results: dict[str, dict[str, Samples]] = {}
    breakdowns: dict[str, list[tuple[str, float]]] = {}
    notes: list[str] = []
    with tqdm(total=total, desc="recoveries", unit="rep", file=sys.stderr) as bar:
        for kind in chosen:
            results[kind.name] = {}
            if "nodes" in scenarios:
                workdir = root / kind.name / "nodes"
                workdir.mkdir(parents=True, exist_ok=True)
                results[kind.name]["node_loss_sigkill"] = node_loss(kind, workdir, "sigkill", args.reps, args.timeout, bar)
                if args.sigstop_reps:
                    results[kind.name]["node_loss_sigstop"] = node_loss(kind, workdir, "sigstop", args.sigstop_reps,
                                                                        args.timeout, bar)
                if kind.name.startswith("spotrun"):
                    breakdowns[f"{kind.name}, node loss"] = spotrun_breakdown(workdir / "events.jsonl")
                grow_dir = root / kind.name / "grow"
                grow_dir.mkdir(parents=True, exist_ok=True)
                total_s, join_s, deaths = scale_up(kind, grow_dir, args.reps, args.timeout, bar)
                results[kind.name]["scale_up"] = total_s
                if kind.name.startswith("spotrun"):
                    results[kind.name]["scale_up_from_join"] = join_s
                if deaths:
                    notes.append(f"{kind.name}: scale-up failed in {deaths}/{args.reps} repetitions "
                                 f"(an agent died; see {grow_dir}/grow*-*.log)")
            if "worker_crash" in scenarios:
                workdir = root / kind.name / "crash"
                workdir.mkdir(parents=True, exist_ok=True)
                results[kind.name]["worker_crash"] = worker_crash(kind, workdir, args.reps, args.timeout, bar)
                if kind.name.startswith("spotrun"):
                    breakdowns[f"{kind.name}, worker crash"] = spotrun_breakdown(workdir / "events.jsonl")
    load_after = os.getloadavg()

    targets = {"node_loss_sigkill": "<= 3 s", "node_loss_sigstop": "-", "worker_crash": "<= torchrun / 2",
               "scale_up": "<= 3 s", "scale_up_from_join": "-"}
    rows = [r for r in ["node_loss_sigkill", "node_loss_sigstop", "worker_crash", "scale_up", "scale_up_from_join"]
            if any(r in results[k.name] for k in chosen)]
    print(f"\n### Recovery time to the next completed training step ({os.cpu_count()} CPUs, "
          f"load avg {load_before[0]:.2f} before / {load_after[0]:.2f} after)\n")
    print("| scenario | " + " | ".join(k.name for k in chosen) + " | target |")
    print("|---|" + "---|" * len(chosen) + "---|")
    for row in rows:
        cells = [results[k.name].get(row, Samples()).cell() for k in chosen]
        print(f"| {row} | " + " | ".join(cells) + f" | {targets[row]} |")
    print("\nSurvivors' worker pids kept in the new group (all kept: re-formed in place) and the most steps redone:\n")
    print("| scenario | " + " | ".join(k.name for k in chosen) + " |")
    print("|---|" + "---|" * len(chosen))
    for row in rows:
        if row != "scale_up_from_join":
            print(f"| {row} | " + " | ".join(results[k.name].get(row, Samples()).kept_cell() for k in chosen) + " |")
    for name, stages in breakdowns.items():
        if stages:
            print(f"\nrecovery breakdown, {name} (median s): "
                  + ", ".join(f"{stage} {secs:.2f}" for stage, secs in stages))
    for note in notes:
        print(f"\nnote: {note}")
    print(f"\nlogs: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
