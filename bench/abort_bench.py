"""How fast an aborted gloo group ends a blocked collective: ``python bench/abort_bench.py --reps 10``.

Each rep starts two gloo ranks (``tests/elastic/abort_job.py``: a small model, ``all_reduce`` every step), pauses
(SIGSTOP) or kills (SIGKILL) rank 1 mid-training, waits until rank 0 is blocked in its collective (its progress
file unchanged for 0.3 s), then asks rank 0's watcher thread to call ``elastic.worker.abort.abort_process_group``.
Reported per fault, median [min-max] over the reps: abort call -> the blocked ``all_reduce`` raised (paused peer:
only the abort can end it), the abort call's own time, and how long a later collective took to fail; for a killed
peer, whose closed connections end the wait by themselves before any abort, the time from the SIGKILL to the
raise instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "elastic" / "abort_job.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise TimeoutError(what)


def one(fault: signal.Signals, work: Path) -> dict[str, float]:
    port = _port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, str(JOB), "--dir", str(work)], env=env, cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        progress = work / "progress-0"
        _wait(lambda: progress.exists() and int(progress.read_text() or 0) >= 20, 60, "training")
        fault_unix = time.time()
        os.kill(procs[1].pid, fault)

        def stuck() -> bool:
            before = progress.read_text()
            time.sleep(0.3)
            return progress.read_text() == before

        _wait(stuck, 10, "rank 0 blocked")
        (work / "trigger").touch()
        procs[0].wait(30)
        result = json.loads((work / "result-0.json").read_text())
        if result["raised_before_abort"]:
            return {"fault_to_raise": result["raised_unix"] - fault_unix, "later_seconds": result["later_seconds"]}
        return {"abort_to_raise": result["abort_to_raise"], "abort_seconds": result["abort_seconds"],
                "later_seconds": result["later_seconds"]}
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()


def _spread(rows: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in rows if key in r]
    if not values:
        return "-"
    return f"{statistics.median(values):.4f} [{min(values):.4f}-{max(values):.4f}] ({len(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"| peer | abort -> raised, s | the abort call, s | raised without an abort, after the fault, s | "
          f"later collective fails in, s |  ({args.reps} reps, load {os.getloadavg()[0]:.1f})")
    print("|---|---|---|---|---|")
    for fault in (signal.SIGSTOP, signal.SIGKILL):
        rows = []
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory() as work:
                rows.append(one(fault, Path(work)))

        print(f"| {'paused (SIGSTOP)' if fault == signal.SIGSTOP else 'killed (SIGKILL)'} | "
              f"{_spread(rows, 'abort_to_raise')} | {_spread(rows, 'abort_seconds')} | {_spread(rows, 'fault_to_raise')} | "
              f"{_spread(rows, 'later_seconds')} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
