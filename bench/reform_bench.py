"""Re-form cost: the workers restarted (spotrun, real agents) vs the group re-formed in place inside the
surviving workers (``elastic.inplace.run``), for every membership change, DDP and FSDP2. gloo on CPU.

    python bench/reform_bench.py                  # 2 cycles of each side, interleaved, in one run
    python bench/reform_bench.py --sides restart,agent-inplace --parallel ddp,fsdp --cycles 2
    python bench/reform_bench.py --cycles 1 --sides inplace

Job: ``examples/train_ddp.py`` (DDP), or with ``--parallel fsdp`` a tiny ``examples/train_gpt.py --parallel
fsdp`` (FSDP2), one worker per agent, ``--nnodes 1:N``, the memory tier on, a checkpoint directory for the
preemption helper, ``lease_ttl`` 3 s.

* ``restart``: ``SPOTRUN_REFORM_IN_PLACE=0``: every change stops the workers and starts new ones.
* ``agent-inplace``: the examples' default (``elastic.inplace.run``): the survivors keep their processes where
  the product re-forms in place, and restart where it does not.

Per cycle, ``--nodes`` agents train together, then each of ``--changes`` in turn, agent 0 never hit (its events
are read; before a change the job is brought back to N nodes, or to N-1 for a join, unmeasured):
``notice`` (SIGTERM to the last agent: N -> N-1 with an agreed step), ``join`` (a new agent: N-1 -> N),
``kill`` (SIGKILL of the last agent and its worker: N -> N-1), ``crash`` (SIGKILL of the last agent's worker;
the agent stays and restarts it: N stays N), ``crash-held`` (the same, its connections held open: the
survivors' collectives hang as NCCL's do on a crashed peer), ``silent`` (SIGSTOP of the last agent and its worker: N -> N-1
once its lease lapses; SIGKILLed after the measurement). Measured from agent 0's ``events.jsonl`` and the
progress file (:func:`recovery_row`): the agreed step's commit (``committed_at``; notice, join) or the fault
(kill, crash, crash-held, silent) -> ``rendezvous_completed`` -> ``workers_started`` -> first step of the new group; the steps
redone; whether the survivors' worker pids are the same in the new group (in place). Issue 29's targets: <= 0.3 s
for notice, join, kill (and both crashes), <= lease TTL + 0.5 s for silent, 0 steps redone, the same pids.

* ``inplace``: the rebuild piece by piece, without agents. N processes (started before timing: they stand for
  surviving workers) train ``train_ddp.py``'s model at world N; at the change, the survivors keep model,
  optimizer and cursor in memory and time ``del ddp`` + ``destroy_process_group``, ``init_process_group`` at the
  new size (a fresh TCP store port, as a new round's MASTER_PORT), DDP construction (its parameter broadcast),
  the data re-split and the first step. ``notice``: the last rank leaves after the agreed step. ``join``: N-1
  ranks train, a *pre-started* joiner (imports done, waiting: the best case) joins and gets the optimizer state
  and data cursor by broadcast. ``kill``: the last rank SIGKILLs itself mid-step; the survivors' collective fails
  (gloo: the peer's sockets close), they drop the half-done step and rebuild at N-1; timed from the death.

The rendezvous itself (agents agreeing on the new members) is not part of the in-place side: it is the same
for both paths. Figures on a shared, loaded host are indicative only; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the shared process harness
from bench.elastic_bench import rendezvous_endpoint
from elastic.api import ENV_REFORM_IN_PLACE
from elastic.chaos.hold import hold_sockets, release
from tests.harness.procs import (
    EXAMPLES,
    SPOTRUN,
    Launcher,
    Timeout,
    free_port,
    make_env,
    read_jsonl,
    signal_all,
    wait_for,
)

JOBS = {"ddp": [str(EXAMPLES / "train_ddp.py")],
        "fsdp": [str(EXAMPLES / "train_gpt.py"), "--parallel", "fsdp", "--global-batch", "8", "--context", "32",
                 "--d-model", "32", "--corpus-chars", "16384"]}
JOBS["fsdp-every1"] = [*JOBS["fsdp"], "--memory-snapshot-every", "1"]
JOBS["fsdp-sync"] = [*JOBS["fsdp-every1"], "--memory-sync"]
"""The agent sides' job per ``--parallel``: train_ddp.py (DDP), or a tiny train_gpt.py sharded by FSDP2 (small
enough for a few workers on 2 cores); ``fsdp-every1``: the same with a memory snapshot every step (not ``auto``);
``fsdp-sync``: each of them also published and copied to the buddy node before the next step
(``MemoryTierConfig.synchronous``): a lost node's shards are on its buddy at the last reported step."""
STEP_TIME = 0.05
CHANGES = ("notice", "join", "kill", "crash", "crash-held", "silent")
"""notice: SIGTERM to the last agent (N -> N-1, an agreed step); join: a new agent (N-1 -> N); kill: SIGKILL of
the last agent and its worker (N -> N-1); crash: SIGKILL of the last agent's worker, whose agent restarts it (N
stays N); crash-held: the same with the worker's connections held open (``elastic.chaos.hold``: the survivors'
collectives hang, as NCCL's do on a crashed peer, instead of failing); silent: SIGSTOP of the last agent and its
worker (N -> N-1 at the lease's expiry), killed after."""
CRASHES = ("crash", "crash-held")
LOSSES = ("kill", *CRASHES, "silent")
"""Changes timed from the fault itself (no agreed step)."""
LEASE_TTL = 3
"""The agents' ``lease_ttl`` (spotrun's default, passed explicitly): a silent loss is seen when it lapses."""
TARGETS = {"notice": 0.3, "join": 0.3, "kill": 0.3, "crash": 0.3, "crash-held": 0.3, "silent": LEASE_TTL + 0.5}
"""Issue 29's targets, agreed step (or fault) -> first step of the new group, seconds."""


# --------------------------------------------------------------------------- agent sides (real spotrun agents)


def _agent_argv(endpoint: str, nodes: int, workdir: Path, parallel: str = "ddp") -> list[str]:
    return [*SPOTRUN, "--nnodes", f"1:{nodes}", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "reform", "--max-restarts", "100", "--rdzv-conf", f"lease_ttl={LEASE_TTL}",
            "--events-file", str(workdir / "events.jsonl"),
            *JOBS[parallel], "--steps", "1000000000", "--step-time", str(STEP_TIME), "--log-every", "1000000",
            "--pg-timeout", "60", "--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every", "1000000",
            "--preempt-sync-every", "4", "--progress-file", str(workdir / "progress.jsonl")]


def _first_step_at(workdir: Path, after: float, world: int) -> float | None:
    """The first step at ``world`` after ``after`` (before it the group trained at another size; an in-place
    survivor keeps its pid, so the pid does not tell the new group)."""
    for rec in read_jsonl(workdir / "progress.jsonl"):
        if rec["t_wall"] > after and rec["world_size"] == world:
            return float(rec["t_wall"])
    return None


def node_events(events: list[dict[str, Any]], agent_pid: int, after: float) -> dict[str, float]:
    """First time after ``after`` of each recovery event of one agent (the survivor: its node name holds its
    pid), plus ``committed_at`` (the agreed step's commit) and ``in_place`` (1.0 when its ``workers_started``
    said so)."""
    out: dict[str, float] = {}
    for ev in events:
        if f"-{agent_pid}-" not in ev["node"] or ev["t_wall"] <= after:
            continue
        if ev["event"] == "workers_started" and "workers_started" not in out:
            out["in_place"] = 1.0 if ev.get("in_place") else 0.0
        out.setdefault(ev["event"], float(ev["t_wall"]))
        if ev["event"] == "planned_restart" and ev.get("committed_at") is not None:
            out.setdefault("committed_at", float(ev["committed_at"]))
    return out


def recovery_row(progress: list[dict[str, Any]], events: dict[str, float], change: str, t_fault: float,
                 world: int, victims: set[int]) -> dict[str, float] | None:
    """One change's measurement from the survivor's events (:func:`node_events` after the fault) and the progress
    lines; None while the new group has not stepped.

    The new group's lines are those at ``world`` after the survivor's ``rendezvous_completed`` (its old workers
    were stopped or waiting by then; a crash keeps the size, so the size alone cannot tell); None before it. Keys: seconds from
    the origin (the agreed step's commit for notice and join, else the fault) to ``rendezvous_completed``,
    ``workers_started`` and ``first_step``; ``fault_to_origin``; ``redone`` (steps of the old group trained
    again: its last step - the new group's first + 1, at least 0); ``kept``/``survivors`` (survivors' worker
    pids, those of the old group's last two steps but ``victims``, still training in the new group; all of them kept
    means in place); ``in_place`` (the survivor's ``workers_started`` said so)."""
    if "rendezvous_completed" not in events:
        return None
    gate = events["rendezvous_completed"]
    lines = sorted(progress, key=lambda r: r["t_wall"])
    new = [r for r in lines if r["t_wall"] > gate and r["world_size"] == world]
    if not new:
        return None
    first = new[0]
    old = [r for r in lines if r["t_wall"] <= gate]
    origin = t_fault if change in LOSSES else events.get("committed_at", events.get("planned_restart", t_fault))
    row = {k: events[k] - origin for k in ("rendezvous_completed", "workers_started") if k in events}
    row["first_step"] = float(first["t_wall"]) - origin
    row["fault_to_origin"] = origin - t_fault  # notice/join: reaching and committing the agreed step
    if old:
        last = max(r["step"] for r in old)
        row["redone"] = float(max(0, last - first["step"] + 1))
        survivors = {r["pid"] for r in old if r["step"] >= last - 1} - victims  # a rank may not have logged the last
        new_pids = {r["pid"] for r in new}
        row["survivors"] = float(len(survivors))
        row["kept"] = float(len(survivors & new_pids))
    if "in_place" in events:
        row["in_place"] = events["in_place"]
    return row


def _measure(workdir: Path, survivor_pid: int, change: str, t_fault: float, world: int,
             victims: set[int]) -> dict[str, float] | None:
    """:func:`recovery_row` from the files as they are now."""
    ev = node_events(read_jsonl(workdir / "events.jsonl"), survivor_pid, t_fault)
    return recovery_row(read_jsonl(workdir / "progress.jsonl"), ev, change, t_fault, world, victims)


def restart_side(nodes: int, cycles: int, workdir: Path, timeout: float, *, in_place: bool = False,
                 changes: tuple[str, ...] = CHANGES, parallel: str = "ddp") -> dict[str, list[dict[str, float]]]:
    """change -> list of {stage: seconds from the change's origin (agreed step commit, or the fault)}, see
    :func:`recovery_row`. ``in_place``: the examples' default, ``elastic.inplace.run`` (the survivors re-form
    around their processes where the product does it); otherwise ``SPOTRUN_REFORM_IN_PLACE=0``: every change
    restarts the workers. Agent 0 is never hit: its events are read."""
    results: dict[str, list[dict[str, float]]] = {c: [] for c in changes}
    env = make_env(LOGLEVEL=os.environ.get("LOGLEVEL", "WARNING"), OMP_NUM_THREADS="1")
    if in_place:
        env.pop(ENV_REFORM_IN_PLACE, None)
    else:
        env[ENV_REFORM_IN_PLACE] = "0"
    progress = workdir / "progress.jsonl"
    with rendezvous_endpoint("spotrun") as endpoint:
        agents: list[Launcher] = []

        def start() -> Launcher:
            agent = Launcher(_agent_argv(endpoint, nodes, workdir, parallel), workdir / f"agent{len(agents)}.log",
                             env=env)
            agents.append(agent)
            return agent

        def live() -> list[Launcher]:
            return [a for a in agents[1:] if a.proc.poll() is None]

        def wait_world(world: int, after: float, what: str) -> float:
            return wait_for(lambda: _first_step_at(workdir, after, world), timeout, what, interval=0.05)

        def settle(world: int, what: str) -> None:
            """Bring the job to ``world`` nodes (not measured): a new agent, or a notice to the last one."""
            t = time.time()
            if world > 1 + len(live()):
                start()
            else:
                live()[-1].signal(signal.SIGTERM)
            wait_world(world, t, what)
            time.sleep(1.0)

        try:
            for _ in range(nodes):
                start()
            wait_world(nodes, 0.0, f"{nodes} agents to train together")
            time.sleep(1.0)  # as after settle(): a few steps, the memory tier's first snapshot, before a change
            for cycle in range(cycles):
                for change in changes:
                    size = 1 + len(live())
                    if change == "join" and size == nodes:
                        settle(nodes - 1, f"cycle {cycle}: {nodes - 1} nodes before the join")
                    elif change != "join" and size < nodes:
                        settle(nodes, f"cycle {cycle}: back to {nodes} nodes before {change}")
                    victim = live()[-1]
                    held: list[int] = []
                    tree = set(victim.snapshot_tree())
                    victims = tree
                    t_fault = time.time()
                    if change == "notice":
                        victim.signal(signal.SIGTERM)
                    elif change == "join":
                        victims = set()
                        start()
                    elif change == "kill":
                        signal_all(sorted(tree), signal.SIGKILL)
                    elif change == "silent":
                        signal_all(sorted(tree), signal.SIGSTOP)
                    else:  # crash: the node's training worker (the newest pid of its tree in the progress lines)
                        worker = max((r for r in read_jsonl(progress) if r["pid"] in tree), key=lambda r: r["t_wall"])
                        victims = {worker["pid"]}
                        held = hold_sockets(worker["pid"]) if change == "crash-held" else []
                        t_fault = time.time()
                        signal_all(sorted(victims), signal.SIGKILL)
                    world = nodes if change in ("join", *CRASHES) else nodes - 1

                    measured = partial(_measure, workdir, agents[0].pid, change, t_fault, world, victims)
                    try:
                        wait_for(measured, timeout, f"cycle {cycle}: first step after {change}", interval=0.05)
                        time.sleep(1.0)  # a few steps of the new group (every rank's lines) before the next change
                        row = measured()
                        assert row is not None
                        results[change].append(row)
                    finally:
                        if change == "silent":  # the paused node is gone for the job: end it
                            signal_all(sorted(tree), signal.SIGKILL)
                        release(held)
                        held = []
        finally:
            for agent in agents:
                agent.close(grace=5.0)
    return results


# --------------------------------------------------------------------------- in-place side


def _inplace_worker(rank: int, world: int, ports: list[int], change: str, out: Any, ready: Any) -> None:
    """One surviving (or leaving/dying/joining) worker; puts {piece: seconds} for survivors into ``out``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(EXAMPLES))
    import train_ddp as job

    from elastic.data import BatchConfig, ElasticBatches

    torch.set_num_threads(1)
    timeout = timedelta(seconds=30)
    config = BatchConfig(global_batch=64, dataset_size=4096, seed=1234)
    dataset = job.synthetic_regression(4096, 1234)
    model = job.make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = ElasticBatches(config)
    loss_fn = nn.MSELoss(reduction="sum")
    last = world - 1

    def group(port: int, r: int, w: int) -> nn.Module:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w, timeout=timeout)
        return DistributedDataParallel(model)

    def step(ddp: nn.Module, r: int, w: int) -> None:
        plan = batches.plan(r, w)
        sampler = batches.sampler(r, w, steps=1)  # the re-split: this rank's share of the next global batch
        optim.zero_grad(set_to_none=True)
        for idx in sampler:
            x, y = dataset[idx]
            (loss_fn(ddp(x), y) * plan.loss_scale).backward()
        optim.step()
        batches.advance()
        time.sleep(STEP_TIME)

    joiner = change == "join" and rank == last
    first_world = world - 1 if change == "join" else world
    ddp: nn.Module | None = None
    if not joiner:  # a joiner is a pre-started process that was not in the first group
        ddp = group(ports[0], rank, first_world)
        for _ in range(5):
            step(ddp, rank, first_world)
        if change == "join":
            ready.wait(60)  # the joiner is started and imported before the change (the best case)
        dist.barrier()
    if joiner:
        ready.set()
    if change == "kill" and rank == last:
        out.put({"died_at": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.time()
    if change == "kill":
        try:
            assert ddp is not None
            step(ddp, rank, world)  # the peer is gone: the gradient all-reduce fails
            raise AssertionError("the collective did not fail after a peer's death")
        except RuntimeError:
            pass
    t_detected = time.time()
    if ddp is not None:
        del ddp  # before the group goes (train_ddp.py says why)
        dist.destroy_process_group()
    t_destroyed = time.time()
    if change == "notice" and rank == last:
        return
    new_world = world if change == "join" else world - 1
    if joiner:  # connect once rank 0 listens, as to an agent's store opened before its round commits (a TCPStore
        _wait_listening(ports[1])  # client that finds nothing backs off for up to ~1 s: not what is measured)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=new_world,
                            timeout=timeout)
    t_init = time.time()
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers
    if change == "join":  # the joiner's optimizer state and data cursor come from rank 0
        state = [{"optim": optim.state_dict(), "data": batches.state_dict()}]
        dist.broadcast_object_list(state, src=0)
        optim.load_state_dict(state[0]["optim"])
        batches.load_state_dict(state[0]["data"])
    t_ddp = time.time()
    step(ddp, rank, new_world)
    t_step = time.time()
    dist.barrier()
    out.put({"rank": rank, "joiner": joiner, "t0": t0, "detect": t_detected - t0, "destroy": t_destroyed - t_detected,
             "init_process_group": t_init - t_destroyed, "ddp_and_state": t_ddp - t_init,
             "first_step": t_step - t_ddp, "first_step_at": t_step})
    del ddp
    dist.destroy_process_group()


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.002)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


PIECEWISE = ("notice", "join", "kill")
"""The changes the ``inplace`` side times piece by piece."""


def inplace_side(nodes: int, cycles: int, changes: tuple[str, ...] = PIECEWISE) -> dict[str, list[dict[str, float]]]:
    """change -> per cycle {piece: seconds}, the slowest survivor's (the group steps when the last one does)."""
    import torch.multiprocessing as mp

    results: dict[str, list[dict[str, float]]] = {c: [] for c in changes if c in PIECEWISE}
    ctx = mp.get_context("spawn")
    for _ in range(cycles):
        for change in results:
            out, ready = ctx.Queue(), ctx.Event()
            ports = [free_port(), free_port()]
            procs = [ctx.Process(target=_inplace_worker, args=(r, nodes, ports, change, out, ready)) for r in range(nodes)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
            reports = []
            while not out.empty():
                reports.append(out.get())
            for p in procs:
                if p.is_alive():
                    p.kill()
            survivors = [r for r in reports if "rank" in r]
            expected = nodes if change == "join" else nodes - 1
            if len(survivors) != expected:
                raise RuntimeError(f"in-place {change}: {len(survivors)} survivors reported, expected {expected}")
            died = [r["died_at"] for r in reports if "died_at" in r]
            origin = died[0] if died else min(r["t0"] for r in survivors if not r["joiner"])
            slowest = max((r for r in survivors if not r["joiner"]), key=lambda r: r["first_step_at"])
            row = {k: slowest[k] for k in ("detect", "destroy", "init_process_group", "ddp_and_state", "first_step")}
            row["total"] = slowest["first_step_at"] - origin
            results[change].append(row)
    return results


# --------------------------------------------------------------------------- report


def _med(rows: list[dict[str, float]], key: str) -> str:
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return "-"
    return f"{statistics.median(vals):.3f}" + (f" ({min(vals):.2f}-{max(vals):.2f})" if len(vals) > 1 else "")


def _count(rows: list[dict[str, float]], key: str, total: str) -> str:
    """``kept/total`` summed over the rows that have both (survivors' pids kept), or "-"."""
    have = [r for r in rows if key in r and total in r]
    return f"{sum(r[key] for r in have):.0f}/{sum(r[total] for r in have):.0f}" if have else "-"


def _verdict(change: str, rows: list[dict[str, float]]) -> str:
    vals = [r["first_step"] for r in rows if "first_step" in r]
    if not vals:
        return "-"
    return f"<= {TARGETS[change]:.1f} s: " + ("met" if statistics.median(vals) <= TARGETS[change] else "missed")


def _agent_table(title: str, rows_by_change: dict[str, list[dict[str, float]]]) -> None:
    print(f"\n{title} (seconds from the agreed step's commit for notice/join, from the fault for "
          f"{'/'.join(LOSSES)}; median (min-max)):\n")
    print("| change | fault -> agreed step committed | -> rendezvous_completed | -> workers_started | -> first step "
          "| target (median) | steps redone (max) | survivors' pids kept | workers_started in_place |")
    print("|---|---|---|---|---|---|---|---|---|")
    for change, rows in rows_by_change.items():
        redone = [r["redone"] for r in rows if "redone" in r]
        in_place = [r["in_place"] for r in rows if "in_place" in r]
        print(f"| {change} | {_med(rows, 'fault_to_origin') if change not in LOSSES else '-'} | "
              f"{_med(rows, 'rendezvous_completed')} | {_med(rows, 'workers_started')} | "
              f"{_med(rows, 'first_step')} | {_verdict(change, rows)} | "
              f"{f'{max(redone):.0f}' if redone else '-'} | {_count(rows, 'kept', 'survivors')} | "
              f"{f'{sum(in_place):.0f} of {len(in_place)}' if in_place else '-'} |")


def report(results: dict[str, dict[str, list[dict[str, float]]]], nodes: int) -> None:
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores")
    for label, rows in results.items():
        side, _, parallel = label.partition(" ")
        if side == "restart":
            _agent_table(f"restart ({parallel}): SPOTRUN_REFORM_IN_PLACE=0, {nodes} agents", rows)
        elif side == "agent-inplace":
            _agent_table(f"agent-inplace ({parallel}): the job under elastic.inplace.run (the default), {nodes} agents",
                         rows)
    if "inplace" in results:
        print("\ninplace: the rebuild alone in surviving processes (slowest survivor, seconds):\n")
        print("| change | detect | destroy | init_process_group | DDP (+state) | first step | total |")
        print("|---|---|---|---|---|---|---|")
        for change, rows in results["inplace"].items():
            print(f"| {change} | {_med(rows, 'detect')} | {_med(rows, 'destroy')} | "
                  f"{_med(rows, 'init_process_group')} | {_med(rows, 'ddp_and_state')} | {_med(rows, 'first_step')} "
                  f"| {_med(rows, 'total')} |")
    for parallel in JOBS:
        restart, agent = results.get(f"restart {parallel}", {}), results.get(f"agent-inplace {parallel}", {})
        for change in CHANGES:
            if restart.get(change) and agent.get(change):
                today = statistics.median(r["first_step"] for r in restart[change])
                inplace = statistics.median(r["first_step"] for r in agent[change])
                print(f"{parallel} {change}, -> first step: restart {today:.3f} s, in place {inplace:.3f} s "
                      f"({today / inplace:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3, help="group size before a leave (>= 2; 3: DDP at both sizes)")
    p.add_argument("--cycles", type=int, default=2, help="every change, this many times per side")
    p.add_argument("--sides", default="restart,agent-inplace,inplace",
                   help="comma-separated: restart, agent-inplace, inplace")
    p.add_argument("--changes", default=",".join(CHANGES), help=f"comma-separated, of {', '.join(CHANGES)} "
                   "(the inplace side times notice, join and kill only)")
    p.add_argument("--parallel", default="ddp", help="comma-separated, of ddp (train_ddp.py), fsdp (a tiny "
                   "train_gpt.py --parallel fsdp), fsdp-every1 (a memory snapshot every step), fsdp-sync (synchronous ones): "
                   "the agent sides' job")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any step")
    p.add_argument("--workdir", default=None, help="keep logs, progress and events here (default: temporary)")
    args = p.parse_args(argv)
    sides = [side for side in args.sides.split(",") if side]
    changes = tuple(c for c in args.changes.split(",") if c)
    parallels = [x for x in args.parallel.split(",") if x]
    if args.nodes < 2 or args.cycles < 1 or not set(sides) <= {"restart", "agent-inplace", "inplace"}:
        p.error("--nodes must be >= 2, --cycles >= 1, --sides among restart, agent-inplace, inplace")
    if not changes or not set(changes) <= set(CHANGES) or not parallels or not set(parallels) <= set(JOBS):
        p.error(f"--changes among {', '.join(CHANGES)}; --parallel among {', '.join(JOBS)}")
    if args.nodes < 3 and set(changes) & set(LOSSES):
        p.error("kill, crash, crash-held and silent need --nodes >= 3 (node 0, whose events are read, is never hit, and a "
                "replacement joins before each)")
    labels = [side if side == "inplace" else f"{side} {par}" for par in parallels for side in sides]
    labels = list(dict.fromkeys(labels))
    results: dict[str, dict[str, list[dict[str, float]]]] = {label: {} for label in labels}
    load = os.getloadavg()
    print(f"load average at the start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="reform-bench-") as tmp:
        root = Path(args.workdir or tmp)
        # Interleaved (one cycle of each side in turn, each from a fresh job): on a shared host the load drifts,
        # and running one side after the other would hand the drift to the comparison.
        for cycle in range(args.cycles):
            for label in labels:
                side, _, parallel = label.partition(" ")
                workdir = root / f"{side}-{parallel or 'ddp'}-{cycle}"
                workdir.mkdir(parents=True, exist_ok=True)
                try:
                    rows = inplace_side(args.nodes, 1, changes) if side == "inplace" else restart_side(
                        args.nodes, 1, workdir, args.timeout, in_place=side == "agent-inplace", changes=changes,
                        parallel=parallel)
                except Timeout as exc:
                    print(f"{label} cycle {cycle} timed out: {exc} (logs in {workdir})", file=sys.stderr)
                    continue
                for change, got in rows.items():
                    results[label].setdefault(change, []).extend(got)
                print(f"{label} cycle {cycle} done", file=sys.stderr, flush=True)
    report(results, args.nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
