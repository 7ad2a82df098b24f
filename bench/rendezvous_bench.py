"""Time to a complete round with many agents: ``python -m bench.rendezvous_bench --agents 64 256`` (repo root).

Runs N handlers (each with its own lease, watch and threads, as N agents would; see ``--channels`` for
their etcd connections) against
one embedded etcd. They are spread over ``--procs`` worker processes (default: one per 32 agents) so
that one Python GIL does not serialise them all; all processes share this machine with etcd, so the
figures are an upper bound for N agents on N machines. Per N it reports:

* first round: all N call ``next_rendezvous`` at the same instant (``--nnodes 1:N``) until the last
  one returns (the round closes when it is full);
* loss seen: one agent vanishes without a word (lease not revoked) until every survivor's
  ``wait_membership_change`` returned. ``--loss killed`` (default): like a SIGKILLed agent, its liveness port
  closes and its ring neighbour's probe revokes its lease; ``--loss silent``: like a host that lost power or
  its network, its port stays open and only the lease tells (bounded below by ``--lease-ttl``);
* recovery round: from the last survivor noticing the loss until the last of the N-1 survivors has
  completed the round that has all N-1 of them (each survivor re-rendezvous as soon as it noticed, and again
  whenever its round's membership changed, like an agent: a survivor whose lease expired while the recovery
  round formed is left out of it and joins the next one, which the others re-form for); loss to recovered:
  from the loss until then (both parts); rounds: how many rounds formed from the loss until then (1 unless
  leases expired meanwhile);
* etcd's own counters for the first round and for the loss plus recovery (from its ``/metrics``): watch
  events it sent (``etcd_debugging_mvcc_events_total``) and requests it started (``grpc_server_started_total``,
  lease keepalive streams left out: they are per second, not per round).

The handlers of one worker process share one etcd client (gRPC channel), as ``--channels shared`` (the
default) says, and with it one lease keeper and one follower watch stream (``watch_mux.py``); ``--channels
per-agent`` gives each its own client, as N agents on N machines have. The shared client caps the calls in
flight per process (``--pool-in-flight``, default 32; in a burst each call waits for its slot after a random
pause of up to 10 ms). ``--profile PREFIX`` writes a cProfile of every thread of the first worker process and its
CPU seconds by thread kind (where the agents' CPU goes); ``kill -USR1`` of a worker prints every thread's stack.
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import logging
import math
import multiprocessing as mp
import os
import pstats
import queue
import re
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from elastic.etcd_server import EmbeddedEtcd

_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class _Plan:
    endpoint: str
    run_id: str
    agents: int
    lease_ttl: int
    last_call: float
    rejoin: float
    victim: int
    shared_channels: bool
    silent_loss: bool = False
    log_dir: str | None = None
    profile: str | None = None
    pool_in_flight: int | None = None


class _ThreadProfiles:
    """cProfile in every thread of this process started after ``start`` (``threading.setprofile``), merged and
    written by ``dump``: where the agents' CPU goes (``--profile``), without py-spy."""

    def __init__(self) -> None:
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()
        self._cpu_at_start: dict[str, float] = {}

    def _hook(self, *_args: Any) -> None:
        prof = cProfile.Profile(time.thread_time)  # CPU seconds of this thread, not wall time
        with self._lock:
            self._profiles.append(prof)
        prof.enable()  # replaces this hook for the rest of the thread

    def start(self) -> None:
        self._cpu_at_start = thread_cpu()
        threading.setprofile(self._hook)
        self._hook()

    def dump(self, path: str) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]  # None removes the hook
        with self._lock:
            profiles = list(self._profiles)
        stats: pstats.Stats | None = None
        for prof in profiles:
            prof.create_stats()
            if not getattr(prof, "stats", None):
                continue
            if stats is None:
                stats = pstats.Stats(prof)
            else:
                stats.add(prof)
        if stats is not None:
            stats.dump_stats(path)
        with open(path.replace(".pstats", ".threads"), "w") as f:
            now = thread_cpu()
            rows = sorted(((kind, seconds - self._cpu_at_start.get(kind, 0.0)) for kind, seconds in now.items()),
                          key=lambda kv: -kv[1])
            f.write("".join(f"{seconds:9.2f} s  {kind}\n" for kind, seconds in rows))


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by kind (Python thread names without their agent id;
    threads that are not Python's, grpc's C core among them, and ended ones under "other"), and "total"."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(tid: int | str) -> float:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick

    by_kind: dict[str, float] = {}
    named = 0.0
    for thread in threading.enumerate():
        if thread.native_id is None:
            continue
        kind = re.sub(r"agent\d+|\d+", "#", thread.name)
        seconds = cpu(thread.native_id)
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        named += seconds
    total = time.process_time()
    by_kind["other (C threads, ended threads)"] = total - named
    by_kind["total"] = total
    return by_kind


def _agent_process(plan: _Plan, ids: list[int], go: Any, crash: Any, settled: Any, results: Any) -> None:
    """One worker process: its share of the agents, driven by the parent's events."""
    faulthandler.enable()  # a hard crash (grpc's C core) still says where on stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: every thread's stack on stderr
    if plan.log_dir is None:
        logging.basicConfig(level=logging.ERROR)
    else:  # every handler's INFO lines, one file per worker process
        logging.basicConfig(level=logging.INFO, filename=f"{plan.log_dir}/agents-{ids[0]:05d}.log",
                            format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    from elastic.rendezvous.api import EtcdRendezvousConfig
    from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler

    host, port = plan.endpoint.rsplit(":", 1)
    config = EtcdRendezvousConfig(
        run_id=plan.run_id,
        endpoints=((host, int(port)),),
        min_nodes=1,
        max_nodes=plan.agents,
        lease_ttl=plan.lease_ttl,
        last_call_timeout=plan.last_call,
        rejoin_timeout=plan.rejoin,
        join_timeout=_TIMEOUT_S,
        etcd_timeout=120,
    )
    kwargs: dict[str, Any] = {}
    if plan.shared_channels:
        from elastic.rendezvous.etcd_client import ClientPool

        kwargs["pool"] = ClientPool() if plan.pool_in_flight is None else ClientPool(max_in_flight=plan.pool_in_flight)
    handlers = {i: EtcdV3RendezvousHandler(config, node_id=f"agent{i:05d}", **kwargs) for i in ids}

    def reported(fn: Callable[[int], None]) -> Callable[[int], None]:
        """``fn``, whose error the parent hears of at once (not when the futures before it are done: a survivor
        waiting for the others would hide it until the bench's timeout)."""
        def run(i: int) -> None:
            try:
                fn(i)
            except Exception as exc:
                results.put(("error", i, time.time(), repr(exc)))
                raise
        return run

    @reported
    def first_round(i: int) -> None:
        info = handlers[i].next_rendezvous()
        results.put(("first", i, time.time(), (info.world_size, handlers[i].round or 0)))

    @reported
    def survive(i: int) -> None:
        handler = handlers[i]
        if not handler.wait_membership_change(_TIMEOUT_S):
            results.put(("error", i, time.time(), "no membership change seen"))
            return
        results.put(("seen", i, time.time(), 0))
        # Like an agent: re-rendezvous whenever the round's membership changes (a survivor left out of a round
        # joins the next one, which the others re-form for), until the parent saw all survivors in one round.
        while not settled.is_set():
            info = handler.next_rendezvous()
            results.put(("recovered", i, time.time(), (handler.round, info.world_size)))
            while not settled.is_set() and not handler.wait_membership_change(0.5):
                pass
        handler.leave()  # not a straggler of a round the others may still be forming

    profiles = _ThreadProfiles() if plan.profile is not None and 0 in ids else None
    try:
        with ThreadPoolExecutor(max_workers=len(ids)) as pool:
            results.put(("ready", -1, time.time(), time.process_time()))
            go.wait()
            if profiles is not None:
                profiles.start()
            for fut in [pool.submit(first_round, i) for i in ids]:
                fut.result()
            results.put(("cpu-first", -1, time.time(), time.process_time()))
            if profiles is not None:
                profiles.dump(f"{plan.profile}-first.pstats")
                profiles.start()
            crash.wait()
            if plan.victim in handlers:
                handlers[plan.victim].simulate_crash(silent=plan.silent_loss)
            for fut in [pool.submit(survive, i) for i in ids if i != plan.victim]:
                fut.result()
            results.put(("cpu-recovery", -1, time.time(), time.process_time()))
            if profiles is not None:
                profiles.dump(f"{plan.profile}-recovery.pstats")
    except Exception as exc:  # noqa: BLE001 (report to the parent instead of dying silently)
        results.put(("error", -1, time.time(), repr(exc)))
    finally:
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda h: h.leave(), handlers.values()))


def _collect(results: Any, kind: str, count: int, desc: str,
             stash: dict[str, list[tuple[int, float, Any]]], workers: list[Any],
             done: Callable[[list[tuple[int, float, Any]]], bool] | None = None,
             status: Callable[[list[tuple[int, float, Any]]], str] | None = None) -> list[tuple[int, float, Any]]:
    """``count`` messages of ``kind`` (from ``stash`` first), or with ``done`` as many as it takes to make it
    true; other kinds that arrive meanwhile go to ``stash``; ``status`` says where they stand (on the progress
    bar). Raises when a worker process died (its agents would never answer) or nothing came for ``_TIMEOUT_S``."""
    got = stash.pop(kind, [])
    finished = done if done is not None else (lambda messages: len(messages) >= count)
    quiet_since = time.monotonic()
    with tqdm(total=count, initial=len(got), desc=desc, unit="agent", leave=False, file=sys.stderr) as bar:
        while not finished(got):
            try:
                what, i, when, extra = results.get(timeout=5.0)
            except queue.Empty:
                dead = [f"pid {w.pid}: exit code {w.exitcode}" for w in workers if w.exitcode is not None]
                if dead:
                    raise RuntimeError(f"worker process(es) died during '{desc}': {', '.join(dead)}") from None
                if time.monotonic() - quiet_since > _TIMEOUT_S:
                    raise
                continue
            quiet_since = time.monotonic()
            if what == "error":
                raise RuntimeError(f"agent {i}: {extra}")
            if what == kind:
                got.append((i, when, extra))
                bar.update(1)
                if status is not None:
                    bar.set_postfix_str(status(got), refresh=False)
            else:
                stash.setdefault(what, []).append((i, when, extra))
    return got


def _all_in_one_round(recovered: list[tuple[int, float, Any]], survivors: int) -> int | None:
    """The round every survivor completed last, when that is one round of all ``survivors`` (else None)."""
    latest: dict[int, tuple[int, int]] = {}
    for i, _when, (number, world_size) in recovered:
        if number >= latest.get(i, (0, 0))[0]:
            latest[i] = (number, world_size)
    if len(latest) < survivors or len(set(latest.values())) != 1:
        return None
    number, world_size = next(iter(latest.values()))
    return number if world_size == survivors else None


def _latest_round(recovered: list[tuple[int, float, Any]]) -> str:
    """The newest round survivors completed, and how many of them are in it (the recovery's progress)."""
    number = max(extra[0] for _, _, extra in recovered)
    return f"round {number}: {len({i for i, _, extra in recovered if extra[0] == number})} survivors"


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds process ``pid`` used so far (0 when unknown), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_METRIC = re.compile(r'^(etcd_debugging_mvcc_events_total|grpc_server_started_total)(\{[^}]*\})? ([0-9.e+]+)$')


def etcd_counters(server: EmbeddedEtcd) -> tuple[float, float]:
    """(watch events sent, requests started but lease keepalive streams) so far, from etcd's /metrics."""
    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    events = requests = 0.0
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m is None:
            continue
        if m.group(1) == "etcd_debugging_mvcc_events_total":
            events += float(m.group(3))
        elif 'grpc_method="LeaseKeepAlive"' not in (m.group(2) or ""):
            requests += float(m.group(3))
    return events, requests


def bench(n: int, server: EmbeddedEtcd, lease_ttl: int, last_call: float, rejoin: float, procs: int,
          shared_channels: bool = True, silent_loss: bool = False, log_dir: str | None = None,
          profile: str | None = None, pool_in_flight: int | None = None) -> dict[str, float]:
    plan = _Plan(server.endpoint, f"bench-{n}-{time.time_ns()}", n, lease_ttl, last_call, rejoin, victim=n // 2,
                 shared_channels=shared_channels, silent_loss=silent_loss, log_dir=log_dir,
                 profile=None if profile is None else f"{profile}-{n}", pool_in_flight=pool_in_flight)
    ctx = mp.get_context("spawn")
    go, crash, settled, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    shares = [list(range(n))[k::procs] for k in range(procs)]
    workers = [ctx.Process(target=_agent_process, args=(plan, ids, go, crash, settled, results))
               for ids in shares if ids]
    for w in workers:
        w.start()
    stash: dict[str, list[tuple[int, float, Any]]] = {}
    try:
        ready = _collect(results, "ready", len(workers), f"starting {len(workers)} processes", stash, workers)
        agents_cpu_ready = sum(extra for _, _, extra in ready)
        before = etcd_counters(server)
        etcd_cpu_before = cpu_seconds(server.pid)
        start = time.time()
        go.set()
        first = _collect(results, "first", n, f"first round ({n})", stash, workers)
        if {extra[0] for _, _, extra in first} != {n}:
            raise RuntimeError(f"inconsistent first round world sizes: {sorted({e[0] for _, _, e in first})}")
        first_round = max(extra[1] for _, _, extra in first)  # 1 unless leases expired while it formed
        after_first = etcd_counters(server)
        etcd_cpu_first = cpu_seconds(server.pid)
        agents_cpu_first = sum(extra for _, _, extra in _collect(results, "cpu-first", len(workers), "cpu", stash, workers))
        crashed = time.time()
        crash.set()
        seen = _collect(results, "seen", n - 1, "loss detection", stash, workers)
        try:
            recovered = _collect(results, "recovered", n - 1, f"recovery round ({n - 1})", stash, workers,
                                 done=lambda got: _all_in_one_round(got, n - 1) is not None, status=_latest_round)
        finally:
            settled.set()
        final_round = _all_in_one_round(recovered, n - 1)
        assert final_round is not None
        recovered = [(i, when, extra) for i, when, extra in recovered if extra[0] == final_round]
        after_recovery = etcd_counters(server)
        etcd_cpu_recovery = cpu_seconds(server.pid)
        agents_cpu_recovery = sum(extra for _, _, extra in _collect(results, "cpu-recovery", len(workers), "cpu", stash, workers))
        last_seen = max(when for _, when, _ in seen)
        last_recovered = max(when for _, when, _ in recovered)
        return {
            "recovery_rounds": final_round - first_round,
            "first_round_s": max(when for _, when, _ in first) - start,
            "loss_detection_s": last_seen - crashed,
            "recovery_round_s": last_recovered - last_seen,
            "loss_to_recovered_s": last_recovered - crashed,
            "first_events": after_first[0] - before[0],
            "first_requests": after_first[1] - before[1],
            "recovery_events": after_recovery[0] - after_first[0],
            "recovery_requests": after_recovery[1] - after_first[1],
            "first_cpu_agents": agents_cpu_first - agents_cpu_ready,
            "first_cpu_etcd": etcd_cpu_first - etcd_cpu_before,
            "recovery_cpu_agents": agents_cpu_recovery - agents_cpu_first,
            "recovery_cpu_etcd": etcd_cpu_recovery - etcd_cpu_first,
        }
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
                w.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[64, 256], help="agent counts to measure")
    parser.add_argument("--lease-ttl", type=int, default=3)
    # Both long by default so the first round waits for all N even on a starved machine (it closes as
    # soon as it is full); the recovery round does not wait for either (every live agent joins).
    parser.add_argument("--last-call", type=float, default=_TIMEOUT_S, help="last_call_timeout")
    parser.add_argument("--rejoin", type=float, default=_TIMEOUT_S, help="rejoin_timeout")
    parser.add_argument("--procs", type=int, default=0, help="worker processes (default: one per 32 agents)")
    parser.add_argument("--channels", choices=("shared", "per-agent"), default="shared",
                        help="one etcd client per worker process (shared) or per agent")
    parser.add_argument("--pool-in-flight", type=int, default=None, metavar="N",
                        help="calls one worker process's shared etcd client may have in flight at once "
                             "(ClientPool max_in_flight; default: the pool's own, 32)")
    parser.add_argument("--reps", type=int, default=1, help="measure each agent count this many times")
    parser.add_argument("--loss", choices=("killed", "silent"), default="killed",
                        help="the lost agent's liveness port closes (killed) or stays open, silent (power off)")
    parser.add_argument("--log-dir", default=None,
                        help="write every agent's INFO log lines there (one file per worker process)")
    parser.add_argument("--profile", default=None, metavar="PREFIX",
                        help="cProfile every thread of the first worker process: PREFIX-N-first.pstats and "
                             "PREFIX-N-recovery.pstats (first round included; read with python -m pstats)")
    args = parser.parse_args(argv)
    # A SIGTERM (timeout, Ctrl-C's cousin) still stops etcd and removes its data directory.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    logging.basicConfig(level=logging.ERROR)
    with EmbeddedEtcd() as server:
        print(
            f"etcd {server.endpoint}; lease_ttl={args.lease_ttl}s last_call_timeout={args.last_call}s "
            f"rejoin_timeout={args.rejoin}s loss={args.loss} channels={args.channels}",
            flush=True,
        )
        print(f"{'agents':>7} {'procs':>6} {'first round':>12} {'loss seen':>10} {'recovery round':>15} "
              f"{'loss to rec':>12} {'rounds':>6} {'events 1st':>11} {'reqs 1st':>9} {'events rec':>11} {'reqs rec':>9} "
              f"{'cpu 1st agents/etcd':>20} {'cpu rec agents/etcd':>20}", flush=True)
        for _rep in range(args.reps):
            for n in args.agents:
                procs = args.procs or max(1, math.ceil(n / 32))
                r = bench(n, server, args.lease_ttl, args.last_call, args.rejoin, min(procs, n),
                          shared_channels=args.channels == "shared", silent_loss=args.loss == "silent",
                          log_dir=args.log_dir, profile=args.profile, pool_in_flight=args.pool_in_flight)
                print(
                    f"{n:>7} {procs:>6} {r['first_round_s']:>11.3f}s {r['loss_detection_s']:>9.3f}s "
                    f"{r['recovery_round_s']:>14.3f}s {r['loss_to_recovered_s']:>11.3f}s {r['recovery_rounds']:>6.0f} "
                    f"{r['first_events']:>11.0f} {r['first_requests']:>9.0f} "
                    f"{r['recovery_events']:>11.0f} {r['recovery_requests']:>9.0f} "
                    f"{r['first_cpu_agents']:>11.1f}/{r['first_cpu_etcd']:<4.1f}s "
                    f"{r['recovery_cpu_agents']:>11.1f}/{r['recovery_cpu_etcd']:<4.1f}s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
