"""Stock torchrun (torch.distributed.run) with ``--rdzv-backend etcd-v3``, found through the entry point.

Two agents form a 2-node job; one node dies (its agent and worker SIGKILLed as a process group). The
surviving STOCK agent learns it through ``num_nodes_waiting() > 0`` (no worker crash needed), re-forms a
1-node round and its job finishes successfully.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elastic.etcd_server import EmbeddedEtcd
from tests.harness.procs import descendants, reap, signal_all

WORKER = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"WORKER rank={rank} world={world} sum={t.item():.0f} "
          f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    time.sleep(120 if world == 2 else 0.2)  # the 2-node round waits to be broken; the 1-node one ends
    dist.destroy_process_group()
    """
)


def _kill_node(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL an agent and everything under it (torch puts workers in their own sessions), by PID; reap."""
    victims = list(descendants(proc.pid))
    signal_all([proc.pid, *victims], signal.SIGKILL)
    proc.wait(timeout=10)
    reap(victims, 10)  # orphans are re-parented to pytest (a child subreaper, see tests/conftest.py)


def _wait_for(path: Path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace")
        if text in content:
            return content
        time.sleep(0.1)  # polling a log file with a deadline (no event to wait on across processes)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s:\n{path.read_text(errors='replace')[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_stock_torchrun_survives_a_node_loss(etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "stock",
        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.2",
        "--rdzv-conf", "lease_ttl=1,last_call_timeout=30",
        str(worker),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        for log in logs
    ]
    try:
        first = [_wait_for(log, "world=2 sum=2", 90) for log in logs]
        masters = {line.split("master=")[1].split()[0] for text in first for line in text.splitlines() if "WORKER" in line}
        assert len(masters) == 1, f"workers disagree on MASTER_ADDR/PORT: {masters}"

        # Node b dies: agent and worker at once.
        _kill_node(procs[1])
        # --max-restarts 0: only a membership-change restart (not a failure restart) can get here.
        _wait_for(logs[0], "world=1 sum=1", 90)
        assert procs[0].wait(timeout=60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_node(proc)
