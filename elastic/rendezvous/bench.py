"""Time to a complete round with many agents: ``python -m elastic.rendezvous.bench --agents 64 256``.

Runs N handler threads (each with its own etcd connection, lease and watch, as N agents would) against one
embedded etcd and reports, per N:

* first round: all N call ``next_rendezvous`` at once (``--nnodes 1:N``), until the last one returns;
* loss detection: one agent vanishes without a word (lease not revoked): until every survivor's
  ``wait_membership_change`` returned (about ``lease_ttl``);
* recovery round: the N-1 survivors re-rendezvous, until the last one returns.

All agents share this process (and its GIL) and the machine with etcd, so the figures are an upper
bound for N real machines.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from elastic.etcd_server import EmbeddedEtcd
from elastic.rendezvous.api import EtcdRendezvousConfig
from elastic.rendezvous.etcd_v3 import EtcdV3RendezvousHandler


def _round(pool: ThreadPoolExecutor, handlers: list[EtcdV3RendezvousHandler], desc: str) -> float:
    began = time.monotonic()
    futures = [pool.submit(h.next_rendezvous) for h in handlers]
    sizes = set()
    for fut in tqdm(futures, desc=desc, unit="agent", leave=False, file=sys.stderr):
        sizes.add(fut.result(timeout=300).world_size)
    elapsed = time.monotonic() - began
    if sizes != {len(handlers)}:
        raise RuntimeError(f"{desc}: inconsistent world sizes {sizes} for {len(handlers)} agents")
    return elapsed


def bench(n: int, server: EmbeddedEtcd, lease_ttl: int, last_call: float) -> dict[str, float]:
    host, port = server.endpoint.rsplit(":", 1)
    config = EtcdRendezvousConfig(
        run_id=f"bench-{n}-{time.time_ns()}",
        endpoints=((host, int(port)),),
        min_nodes=1,
        max_nodes=n,
        lease_ttl=lease_ttl,
        last_call_timeout=last_call,
        join_timeout=300,
    )
    handlers = [EtcdV3RendezvousHandler(config, node_id=f"agent{i:04d}") for i in range(n)]
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            first = _round(pool, handlers, f"first round ({n})")
            victim, survivors = handlers[n // 2], handlers[: n // 2] + handlers[n // 2 + 1 :]
            began = time.monotonic()
            victim._simulate_crash()
            seen = [pool.submit(h.wait_membership_change, 60) for h in survivors]
            if not all(f.result(timeout=120) for f in seen):
                raise RuntimeError("some survivor did not notice the loss within 60 s")
            detection = time.monotonic() - began
            recovery = _round(pool, survivors, f"recovery round ({n - 1})") if survivors else 0.0
    finally:
        with ThreadPoolExecutor(max_workers=32) as pool:
            list(pool.map(lambda h: h.shutdown(), handlers))
    return {"first_round_s": first, "loss_detection_s": detection, "recovery_round_s": recovery}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[64, 256], help="agent counts to measure")
    parser.add_argument("--lease-ttl", type=int, default=3)
    parser.add_argument(
        "--last-call",
        type=float,
        default=10.0,
        help="last_call_timeout; the first round closes when all N joined (full), so this only bounds slow starters",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    # Every survivor logs each loss (and shutdown revokes look like losses): keep the table readable.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    with EmbeddedEtcd() as server:
        print(f"etcd {server.endpoint}; lease_ttl={args.lease_ttl}s last_call_timeout={args.last_call}s")
        print(f"{'agents':>7} {'first round':>12} {'loss seen':>10} {'recovery round':>15}")
        for n in args.agents:
            r = bench(n, server, args.lease_ttl, args.last_call)
            print(
                f"{n:>7} {r['first_round_s']:>11.3f}s {r['loss_detection_s']:>9.3f}s {r['recovery_round_s']:>14.3f}s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
