"""Chaos soak: one long seeded run of examples/train_ddp.py under spotrun, faults of every kind, the figures of docs/guides/chaos.md.

    python bench/chaos_soak.py --duration 300 --seed 1      # the docs figures (~10 min on a quiet machine)
    python bench/chaos_soak.py --duration 40 --seed 1       # a smoke run (every kind once)

Two agents of one worker each (``--nnodes 2``: world size 2) on a real 3-member etcd cluster (loopback),
checkpointing behind ``chaos::file://``. An agent a fault takes away is replaced by a new one, as a cluster
would, so the world size, and with it the bit-exact result, stays that of an uninterrupted reference run.
Faults, one every ``--gap`` s or more, each kind in turn in a seeded order (every kind at least once, so a
short run may last longer than ``--duration``): stop_worker (SIGSTOP: a hang, found by ``--hang-timeout``),
kill_worker, kill_agent (a node lost), term_agent (a preemption: planned leave), kill_etcd_leader,
storage_latency and storage_error (transient). A fault waits until the job has recovered from the last one
(every node up, a step made), so each one meets a healthy job.

Prints a markdown table for docs/guides/chaos.md (faults injected by type, survived, restarts, steps lost per fault,
detection and MTTR to the first step: median / worst), the stage breakdown of bench/mttr_report.py,
corrupt checkpoints and leftover processes, then checks the targets and prints PASS or FAIL (exit 0/1):
final weights bit-identical to the reference, restarts == faults (one recovery for each worker or agent
fault, none for etcd and storage faults), a hang found within its timeout + 1 s, a node loss within the
lease TTL + 1 s, 0 corrupt checkpoints, 0 leftover processes. The numbers are only comparable between runs
on a quiet machine: the host load is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.mttr_report import NO_RECOVERY, Recovery, recoveries, render, resume_times, summarize
from elastic.chaos.api import Fault, FaultKind, Schedule
from elastic.events import read_events
from tests.chaos.jobs import Job, Nodes, committed_steps, etcd_cluster_at, final_state
from tests.harness.procs import Timeout, pid_alive, wait_for

KINDS = (FaultKind.STOP_WORKER, FaultKind.KILL_WORKER, FaultKind.KILL_AGENT, FaultKind.TERM_AGENT,
         FaultKind.KILL_ETCD_LEADER, FaultKind.STORAGE_LATENCY, FaultKind.STORAGE_ERROR)
RESTARTING = {FaultKind.STOP_WORKER.value: ("hang",), FaultKind.KILL_WORKER.value: ("failure", "peer_lost"),
              FaultKind.KILL_AGENT.value: ("peer_lost", "failure"), FaultKind.TERM_AGENT.value: ("planned_leave",)}
"""Fault kinds that cost exactly one recovery of the job, and the causes it may carry (a worker whose peer was
SIGKILLed fails at once, before the lost lease shows: 'failure'); every other kind costs none."""
DURATIONS = {FaultKind.KILL_ETCD_LEADER: 1.0, FaultKind.STORAGE_LATENCY: 2.0, FaultKind.STORAGE_ERROR: 2.0}
PARAMS: dict[FaultKind, dict[str, Any]] = {FaultKind.STORAGE_LATENCY: {"seconds": 0.5}, FaultKind.STORAGE_ERROR: {"rate": 0.2, "ops": "all"}}
STEP_TIME = 0.05
CKPT_EVERY = 50
HANG_TIMEOUT = 3.0
LEASE_TTL = 2.0
RDZV_CONF = f"lease_ttl={LEASE_TTL:g},last_call_timeout=0.5,join_timeout=300"


FOLLOWERS = (FaultKind.KILL_WORKER, FaultKind.KILL_AGENT, FaultKind.TERM_AGENT)
"""``--overlap``: the kinds of the second fault of a pair, fired inside the first one's recovery window."""
FOLLOW_AFTER_S = (0.2, 2.0)
"""``--overlap``: the second fault lands this many seconds (uniform, seeded) after the first: a recovery here
takes 1-10 s (detection within the lease TTL, the replacement agent's start), so it is always inside it."""
PAIR_WINDOW_S = FOLLOW_AFTER_S[1] + 0.5
"""Two faults this close are one pair (the follower fires ``after_s`` after its first, to the injector's 50 ms
tick; two pairs are at least ``--gap`` apart): one may have no recovery of its own, the other's covers both."""


def soak_schedule(seed: int, duration: float, gap: float, overlap: bool = False) -> Schedule:
    """At least one fault of each kind, one per ``gap`` s over ``duration`` s; kinds in seeded rounds (each
    round every kind once, shuffled), times jittered within the gap's first quarter. ``overlap``: every fault
    that costs a recovery is followed by a second one (a worker or node lost, or a notice) inside its recovery
    window (``after``: seeded delay in FOLLOW_AFTER_S)."""
    rng = random.Random(seed)
    count = max(len(KINDS), int(duration // gap))
    kinds: list[FaultKind] = []
    while len(kinds) < count:
        kinds.extend(rng.sample(KINDS, len(KINDS)))
    faults: list[Fault] = []
    for i, kind in enumerate(kinds[:count]):
        target = {FaultKind.KILL_ETCD_LEADER: "etcd:leader"}.get(kind, "")
        faults.append(Fault(kind=kind, target=target, at_s=round((i + 1) * gap + rng.uniform(0, gap / 4), 3),
                            duration_s=DURATIONS.get(kind), params=PARAMS.get(kind, {})))
        if overlap and kind.value in RESTARTING:
            faults.append(Fault(kind=rng.choice(FOLLOWERS), after=len(faults) - 1,
                                after_s=round(rng.uniform(*FOLLOW_AFTER_S), 3)))
    return Schedule(seed=seed, faults=tuple(faults))


def absorbed(recs: list[Recovery]) -> list[Recovery]:
    """``--overlap``: restarting faults without a recovery of their own because another fault of their pair
    (within PAIR_WINDOW_S) got the recovery both caused: one re-form for two faults is the point. Pure."""
    recovered = [r.fault.t_wall for r in recs if r.fault is not None and r.cause != NO_RECOVERY]
    return [r for r in recs if r.cause == NO_RECOVERY and r.kind in RESTARTING and r.fault is not None
            and any(abs(t - r.fault.t_wall) <= PAIR_WINDOW_S for t in recovered)]


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


def leaked_keys(endpoints: Sequence[str], run_id: str, timeout: float = 10.0) -> list[str]:
    """The run's etcd keys still there ``timeout`` s after the job ended (target: none; the last agent to
    leave deletes them, leases take the rest)."""
    import etcd3  # only the soak's final check needs a client of its own

    def keys() -> list[str]:
        for endpoint in endpoints:
            host, port = endpoint.rsplit(":", 1)
            client = etcd3.client(host=host, port=int(port), timeout=5)
            try:
                return sorted(m.key.decode() for _, m in client.get_prefix(f"/spotrun/rdzv/{run_id}/"))
            except Exception:  # noqa: BLE001 (a member the injector left down: ask the next)
                continue
            finally:
                client.close()
        return ["<no etcd member answered>"]

    try:
        wait_for(lambda: not keys(), timeout, "the run's etcd keys to go")
    except Timeout:
        pass
    return keys()


def _stat(values: Sequence[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} / {max(values):{fmt}}" if values else "n/a"


def readme_table(injected: list[dict], recs: list[Recovery], survived: dict[str, int]) -> str:
    """Per fault kind: injected, survived, restarts, steps lost per fault, detection, MTTR (first step)."""
    lines = ["| fault | injected | survived | restarts | steps lost per fault | detection s | MTTR s (first step) |",
             "|---|---|---|---|---|---|---|"]
    for kind in [k.value for k in KINDS]:
        n = sum(1 for r in injected if r["kind"] == kind)
        if not n:
            continue
        mine = [r for r in recs if r.kind == kind and r.cause != NO_RECOVERY]
        lost = [float(r.steps_lost) for r in mine if r.steps_lost is not None]
        detect = [v for r in mine if (v := r.stages.get("detection")) is not None]
        mttr = [v for r in mine if (v := r.stages.get("first_step")) is not None]
        lines.append(f"| {kind} | {n} | {survived.get(kind, 0)} | {len(mine)} | {_stat(lost, '.0f') if mine else '0'} "
                     f"| {_stat(detect)} | {_stat(mttr) if mine else 'no restart'} |")
    return "\n".join(lines)


def check_targets(injected: list[dict], recs: list[Recovery], *, identical: bool, final_ok: bool,
                  corrupt: list[int], alive: list[int], codes_ok: bool, overlap: bool = False,
                  leaked: Sequence[str] = ()) -> list[str]:
    """The targets that failed (empty: PASS). Pure. ``overlap``: a restarting fault may share its pair's
    recovery (see :func:`absorbed`), and a cause is any restarting one (two faults, one re-form)."""
    failed = []
    shared = {id(r) for r in absorbed(recs)} if overlap else set()
    any_cause = tuple(sorted({c for causes in RESTARTING.values() for c in causes}))
    if not final_ok:
        failed.append("the job did not reach its final step with exit code 0")
    if not codes_ok:
        failed.append("an agent exited with an unexpected code (survivors and preempted agents: 0, killed: -9)")
    if not identical:
        failed.append("final weights differ from the uninterrupted reference")
    for r in recs:
        if r.fault is None:
            failed.append(f"a recovery ({r.cause}) no fault caused")
        elif id(r) in shared:
            continue
        elif overlap and r.kind in RESTARTING and r.cause in any_cause:
            pass
        elif r.kind in RESTARTING and r.cause not in RESTARTING[r.kind]:
            failed.append(f"{r.kind}: {'no recovery' if r.cause == NO_RECOVERY else f'recovery cause {r.cause}'}, "
                          f"expected {'/'.join(RESTARTING[r.kind])}")
        elif r.kind not in RESTARTING and r.cause != NO_RECOVERY:
            failed.append(f"{r.kind} cost a restart ({r.cause}); target 0")
        detect = r.stages.get("detection")
        if overlap:
            continue  # detection is measured from the pair's newer fault: the lease and hang bounds do not apply
        if r.kind == FaultKind.STOP_WORKER.value and detect is not None and detect > HANG_TIMEOUT + 1:
            failed.append(f"a hang found {detect:.2f} s after the SIGSTOP; target <= {HANG_TIMEOUT + 1:g} s")
        if r.kind == FaultKind.KILL_AGENT.value and detect is not None and detect > LEASE_TTL + 1:
            failed.append(f"a node loss found {detect:.2f} s after the SIGKILL; target <= {LEASE_TTL + 1:g} s")
    # Pairing needs no separate check: attribute() gives each injected fault exactly one entry (a recovery or
    # NO_RECOVERY), so a restarting fault without its recovery and a recovery without a fault fail above.
    if corrupt:
        failed.append(f"corrupt checkpoints at steps {corrupt}")
    if alive:
        failed.append(f"processes left: {alive}")
    if leaked:
        failed.append(f"etcd keys left: {leaked[:5]}{' ...' if len(leaked) > 5 else ''}")
    return failed


def _survived(injected: list[dict], recs: list[Recovery], progress: list[dict]) -> dict[str, int]:
    """Per kind, the faults after which training went on (a step reported after the fault's recovery ended,
    or after the fault itself when it needed none)."""
    last = max((float(p["t_wall"]) for p in progress), default=0.0)
    out: dict[str, int] = {}
    for r in recs:
        if r.fault is None:
            continue
        ok = r.stages.get("first_step") is not None if r.cause != NO_RECOVERY else last > r.fault.t_wall
        out[r.kind] = out.get(r.kind, 0) + int(ok)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, required=True, help="seconds over which faults are injected")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap", type=float, default=12.0, help="minimum seconds between two faults")
    p.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    p.add_argument("--overlap", action="store_true",
                   help="overlapping faults: each fault that costs a recovery is followed, 0.2-2 s later (seeded), by "
                        "a worker or node loss or a notice inside that recovery")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.gap <= 0:
        p.error("--duration and --gap must be > 0")
    schedule = soak_schedule(args.seed, args.duration, args.gap, overlap=args.overlap)
    span = max(f.at_s or 0.0 for f in schedule.faults) + args.gap
    # Enough steps that the job outlives the schedule even with no time lost to recoveries.
    steps = int(span / STEP_TIME) + 100
    root = Path(tempfile.mkdtemp(prefix="spotrun-soak-"))
    began = time.monotonic()
    print(f"soak: seed {args.seed}, {len(schedule.faults)} faults{' (overlapping pairs)' if args.overlap else ''} "
          f"over {span:.0f} s, {steps} steps, "
          f"load average {os.getloadavg()}, run dir {root}", flush=True)
    with etcd_cluster_at(root / "etcd") as endpoints:
        ref = Job(root / "reference", ",".join(endpoints), "soak-ref", steps=steps, step_time=0.0, ckpt_every=CKPT_EVERY)
        code, _ = ref.run(Schedule(), timeout=steps * 0.2 + 600)
        if code != 0:
            print(f"reference run failed with exit code {code}:\n{ref.output()[-3000:]}")
            return 1
        job = Nodes(root / "chaos", ",".join(endpoints), "soak", steps=steps, step_time=STEP_TIME,
                    ckpt_every=CKPT_EVERY, max_restarts=1000, hang_timeout=HANG_TIMEOUT, rdzv_conf=RDZV_CONF)
        try:
            injector = job.run(schedule, timeout=span * 6 + 900, endpoints=tuple(endpoints),
                               clock_from_first_step=True, one_at_a_time=True)
            leaked = leaked_keys(endpoints, "soak")
        finally:
            for proc in job.injector.started if job.injector else ():  # members it started again: ours to stop
                proc.kill()
                proc.wait(30)
    injected = injector.injected
    progress = read_events(str(job.progress_file))
    resumes = [t for a in job.agents for t in resume_times(a.output())]
    recs = recoveries(job.events, read_events(str(job.root / "journal.jsonl")), progress, resumes)
    step, tensors = final_state(job.ckpt)
    _, reference = final_state(ref.ckpt)
    identical = tensors.keys() == reference.keys() and all(torch.equal(tensors[k], reference[k]) for k in tensors)
    killed = {r["pid"] for r in injected if r["kind"] == FaultKind.KILL_AGENT.value}
    codes = {a.pid: a.proc.returncode for a in job.agents}
    codes_ok = all(c == (-9 if pid in killed else 0) for pid, c in codes.items())
    corrupt = corrupt_steps(job.ckpt)
    alive = leftover(job.seen_pids)
    survived = _survived(injected, recs, progress)
    restarts = sum(1 for r in recs if r.cause != NO_RECOVERY)
    print(f"\nfinal step {step} of {steps}; agents {len(job.agents)} (exit codes {sorted(codes.values())}); "
          f"final weights identical to the reference: {identical}; wall time {time.monotonic() - began:.0f} s; "
          f"load average {os.getloadavg()}")
    print(f"faults injected {len(injected)} (not fired: {injector.pending()}), recoveries {restarts}, "
          f"corrupt checkpoints {len(corrupt)}, leftover processes {len(alive)}, leaked etcd keys {len(leaked)}")
    print(f"hang timeout {HANG_TIMEOUT:g} s, lease TTL {LEASE_TTL:g} s, step time {STEP_TIME} s, checkpoint every "
          f"{CKPT_EVERY} steps\n")
    print(readme_table(injected, recs, survived))
    print("\nrecovery stages, seconds from the fault (median / worst; bench/mttr_report.py):")
    print(render(summarize(recs)))
    failed = check_targets(injected, recs, identical=identical, final_ok=step == steps, corrupt=corrupt,
                           alive=alive, codes_ok=codes_ok, overlap=args.overlap, leaked=leaked)
    if injector.pending():
        failed.append(f"{injector.pending()} faults never fired (the job ended first)")
    for line in failed:
        print(f"target missed: {line}")
    if not args.keep and not failed:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"run dir kept: {root}")
    print("PASS" if not failed else "FAIL")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
