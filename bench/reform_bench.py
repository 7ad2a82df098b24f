"""Re-form cost: today's process restart (spotrun, real agents) vs rebuilding the process group in place
inside surviving workers (issue 18 item 4: measured, then decided). gloo on CPU.

    python bench/reform_bench.py                  # 2 cycles of each side, interleaved, in one run
    python bench/reform_bench.py --cycles 1 --sides inplace

Job: ``examples/train_ddp.py``'s model, optimizer (SGD + momentum) and data cursor (``elastic.data``), DDP.

* ``restart`` (what spotrun does today): ``--nodes`` agents (one worker each, ``--nnodes 1:N``, the memory
  tier on, a checkpoint directory for the preemption helper) train together; then per cycle
  ``notice`` (SIGTERM to the last agent: N -> N-1 with an agreed step), ``join`` (a new agent: N-1 -> N)
  and ``kill`` (SIGKILL of the last agent and its worker: N -> N-1). Measured from the agent's
  ``events.jsonl`` and the job's progress file: agreed step committed (``committed_at``) or death ->
  ``rendezvous_completed`` (the part both paths share: the agents must agree on the new group anyway) ->
  ``workers_started`` -> first step of the new group. What the in-place path would remove is
  ``rendezvous_completed -> first step`` (stopping and starting the workers: warm fork, process-group init,
  memory-tier restore, DDP construction, the first step).
* ``agent-inplace``: the same as train_ddp.py runs by default, under ``elastic.inplace.run`` (``restart``
  runs it with ``SPOTRUN_REFORM_IN_PLACE=0``):
  the survivors of a ``notice`` or a ``kill`` keep their processes and rebuild their group when the agent posts
  the new round (for a kill after aborting their group on the agent's word); ``join`` still restarts.
* ``inplace``: N processes (started before timing: they stand for surviving workers) train the same job at
  world N; at the change, the survivors keep model, optimizer and cursor in memory and time
  ``del ddp`` + ``destroy_process_group``, ``init_process_group`` at the new size (a fresh TCP store port,
  as a new round's MASTER_PORT), DDP construction (its parameter broadcast), the data re-split and the
  first step. ``notice``: the last rank leaves after the agreed step. ``join``: N-1 ranks train, a
  *pre-started* joiner (imports done, waiting: the best case; on a real new node it is a fresh process, whose
  start is in the restart side's ``workers_started -> first step``) joins and gets the optimizer state and data
  cursor by broadcast. ``kill``: the
  last rank SIGKILLs itself mid-step; the survivors' collective fails (gloo: the peer's sockets close), they
  drop the half-done step and rebuild at N-1; timed from the death.

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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the shared process harness
from bench.elastic_bench import rendezvous_endpoint
from elastic.api import ENV_REFORM_IN_PLACE
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

JOB = str(EXAMPLES / "train_ddp.py")
STEP_TIME = 0.05
CHANGES = ("notice", "join", "kill")


# --------------------------------------------------------------------------- restart side (real spotrun agents)


def _agent_argv(endpoint: str, nodes: int, workdir: Path) -> list[str]:
    return [*SPOTRUN, "--nnodes", f"1:{nodes}", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "reform", "--max-restarts", "100", "--events-file", str(workdir / "events.jsonl"),
            JOB, "--steps", "1000000000", "--step-time", str(STEP_TIME), "--log-every", "1000000",
            "--pg-timeout", "60", "--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every", "1000000",
            "--preempt-sync-every", "4", "--progress-file", str(workdir / "progress.jsonl")]


def _first_step_at(workdir: Path, after: float, world: int) -> float | None:
    """The first step at ``world`` after ``after`` (before it the group trained at another size; an in-place
    survivor keeps its pid, so the pid does not tell the new group)."""
    for rec in read_jsonl(workdir / "progress.jsonl"):
        if rec["t_wall"] > after and rec["world_size"] == world:
            return float(rec["t_wall"])
    return None


def _node0_events(workdir: Path, node0_pid: int, after: float) -> dict[str, float]:
    """First time after ``after`` of each recovery event of agent 0 (the survivor), plus ``committed_at``."""
    out: dict[str, float] = {}
    for ev in read_jsonl(workdir / "events.jsonl"):
        if f"-{node0_pid}-" not in ev["node"] or ev["t_wall"] <= after:
            continue
        out.setdefault(ev["event"], float(ev["t_wall"]))
        if ev["event"] == "planned_restart" and ev.get("committed_at") is not None:
            out.setdefault("committed_at", float(ev["committed_at"]))
    return out


def restart_side(nodes: int, cycles: int, workdir: Path, timeout: float, *,
                 in_place: bool = False) -> dict[str, list[dict[str, float]]]:
    """change -> list of {stage: seconds from the change's origin (agreed step commit, or the death)}.
    ``in_place``: train_ddp.py's default, ``elastic.inplace.run``: a notice re-forms around the survivors'
    processes, and so does a kill since the workers abort their group on the agent's word and wait in place; a join
    restarts them as before. Otherwise ``SPOTRUN_REFORM_IN_PLACE=0``: every change restarts the workers."""
    results: dict[str, list[dict[str, float]]] = {c: [] for c in CHANGES}
    env = make_env(LOGLEVEL=os.environ.get("LOGLEVEL", "WARNING"), OMP_NUM_THREADS="1")
    if in_place:
        env.pop(ENV_REFORM_IN_PLACE, None)
    else:
        env[ENV_REFORM_IN_PLACE] = "0"
    with rendezvous_endpoint("spotrun") as endpoint:
        agents: list[Launcher] = []

        def start() -> Launcher:
            agent = Launcher(_agent_argv(endpoint, nodes, workdir), workdir / f"agent{len(agents)}.log", env=env)
            agents.append(agent)
            return agent

        def wait_world(world: int, after: float, what: str) -> float:
            return wait_for(lambda: _first_step_at(workdir, after, world), timeout, what, interval=0.05)

        try:
            for _ in range(nodes):
                start()
            wait_world(nodes, 0.0, f"{nodes} agents to train together")
            for cycle in range(cycles):
                if cycle:  # the last cycle's kill left N-1 nodes: a replacement first (not measured)
                    t_join = time.time()
                    start()
                    wait_world(nodes, t_join, f"cycle {cycle}: back to {nodes} nodes")
                    time.sleep(1.0)
                for change in CHANGES:
                    live = [a for a in agents[1:] if a.proc.poll() is None]  # never agent 0, whose events are read
                    t_fault = time.time()
                    if change == "notice":
                        live[-1].signal(signal.SIGTERM)
                    elif change == "join":
                        start()
                    else:
                        signal_all(live[-1].snapshot_tree(), signal.SIGKILL)
                    world = nodes if change == "join" else nodes - 1
                    first = wait_world(world, t_fault, f"cycle {cycle}: first step after {change}")
                    ev = _node0_events(workdir, agents[0].pid, t_fault)
                    origin = t_fault if change == "kill" else ev.get("committed_at", ev.get("planned_restart", t_fault))
                    row = {k: ev[k] - origin for k in ("rendezvous_completed", "workers_started") if k in ev}
                    row["first_step"] = first - origin
                    row["fault_to_origin"] = origin - t_fault  # notice/join: reaching and committing the agreed step
                    results[change].append(row)
                    time.sleep(1.0)  # a few steps of the new group before the next change
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


def inplace_side(nodes: int, cycles: int) -> dict[str, list[dict[str, float]]]:
    """change -> per cycle {piece: seconds}, the slowest survivor's (the group steps when the last one does)."""
    import torch.multiprocessing as mp

    results: dict[str, list[dict[str, float]]] = {c: [] for c in CHANGES}
    ctx = mp.get_context("spawn")
    for _ in range(cycles):
        for change in CHANGES:
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


def _agent_table(title: str, rows_by_change: dict[str, list[dict[str, float]]]) -> None:
    print(f"\n{title} (seconds from the agreed step's commit, or from the death for kill; median (min-max)):\n")
    print("| change | fault -> agreed step committed | -> rendezvous_completed | -> workers_started | -> first step "
          "| rdzv done -> first step |")
    print("|---|---|---|---|---|---|")
    for change, rows in rows_by_change.items():
        part = [{"p": r["first_step"] - r["rendezvous_completed"]} for r in rows if "rendezvous_completed" in r]
        print(f"| {change} | {_med(rows, 'fault_to_origin') if change != 'kill' else '-'} | "
              f"{_med(rows, 'rendezvous_completed')} | {_med(rows, 'workers_started')} | "
              f"{_med(rows, 'first_step')} | {_med(part, 'p')} |")


def report(results: dict[str, dict[str, list[dict[str, float]]]], nodes: int) -> None:
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores")
    if "restart" in results:
        _agent_table(f"restart: spotrun today, {nodes} agents", results["restart"])
    if "agent-inplace" in results:
        _agent_table(f"agent-inplace: spotrun, train_ddp.py under elastic.inplace.run, {nodes} agents (notice in place; "
                     "kill in place too; join restarts as today)", results["agent-inplace"])
    if "inplace" in results:
        print("\ninplace: the rebuild alone in surviving processes (slowest survivor, seconds):\n")
        print("| change | detect | destroy | init_process_group | DDP (+state) | first step | total |")
        print("|---|---|---|---|---|---|---|")
        for change, rows in results["inplace"].items():
            print(f"| {change} | {_med(rows, 'detect')} | {_med(rows, 'destroy')} | "
                  f"{_med(rows, 'init_process_group')} | {_med(rows, 'ddp_and_state')} | {_med(rows, 'first_step')} "
                  f"| {_med(rows, 'total')} |")
    restart, agent = results.get("restart", {}), results.get("agent-inplace", {})
    if restart.get("notice") and agent.get("notice"):
        today = statistics.median(r["first_step"] for r in restart["notice"])
        inplace = statistics.median(r["first_step"] for r in agent["notice"])
        print(f"\nnotice, agreed step -> first step: restart {today:.3f} s, in place {inplace:.3f} s "
              f"({today / inplace:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3, help="group size before a leave (>= 2; 3: DDP at both sizes)")
    p.add_argument("--cycles", type=int, default=2, help="notice, join and kill, this many times per side")
    p.add_argument("--sides", default="restart,agent-inplace,inplace",
                   help="comma-separated: restart, agent-inplace, inplace")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any step")
    p.add_argument("--workdir", default=None, help="keep logs, progress and events here (default: temporary)")
    args = p.parse_args(argv)
    sides = [side for side in args.sides.split(",") if side]
    if args.nodes < 2 or args.cycles < 1 or not set(sides) <= {"restart", "agent-inplace", "inplace"}:
        p.error("--nodes must be >= 2, --cycles >= 1, --sides among restart, agent-inplace, inplace")
    results: dict[str, dict[str, list[dict[str, float]]]] = {side: {c: [] for c in CHANGES} for side in sides}
    load = os.getloadavg()
    print(f"load average at the start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="reform-bench-") as tmp:
        root = Path(args.workdir or tmp)
        # Interleaved (one cycle of each side in turn, each from a fresh job): on a shared host the load drifts,
        # and running one side after the other would hand the drift to the comparison.
        for cycle in range(args.cycles):
            for side in sides:
                workdir = root / f"{side}-{cycle}"
                workdir.mkdir(parents=True, exist_ok=True)
                try:
                    rows = inplace_side(args.nodes, 1) if side == "inplace" else restart_side(
                        args.nodes, 1, workdir, args.timeout, in_place=side == "agent-inplace")
                except Timeout as exc:
                    print(f"{side} cycle {cycle} timed out: {exc} (logs in {workdir})", file=sys.stderr)
                    continue
                for change, changes in rows.items():
                    results[side][change] += changes
    report(results, args.nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
