"""No-false-positive soak of straggler detection: an even job under a real agent for a long time, with the
Prometheus exporter on, counting ``straggler_detected`` events and the largest step time ratio it saw.

Workers step at their own pace (tests/elastic/pace_worker.py: a tiny model and optimizer, ``--step-time`` s of
sleep per step, no collective), every rank at the same pace, so any straggler named is a false positive; the
machine's own load (other jobs, other tests) is the noise. ``--slow-factor`` > 1 slows rank ``--slow-rank``
instead (a check that the soak can fail). Prints one JSON line: seconds, steps per rank, events, the largest
``spotrun_step_time_ratio`` scraped (once a second) and the run's exit status.

    python bench/straggler_soak.py --seconds 600 [--nproc 4] [--step-time 0.05] [--factor 1.5] [--window 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
SPOTRUN = [sys.executable, "-m", "elastic.cli"]
WORKER = ROOT / "tests" / "elastic" / "pace_worker.py"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ratios(port: int) -> list[float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return []
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "spotrun_step_time_ratio"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="straggler-soak-") as work:
        port = free_port()
        events = Path(work) / "events.jsonl"
        cmd = [*SPOTRUN, "--standalone", "--nproc-per-node", str(args.nproc), "--metrics-port", str(port),
               "--straggler-factor", str(args.factor), "--straggler-window", str(args.window),
               "--events-file", str(events), str(WORKER), "--seconds", str(args.seconds),
               "--step-time", str(args.step_time), "--slow-rank", str(args.slow_rank),
               "--slow-factor", str(args.slow_factor), "--out", str(Path(work) / "out")]
        began = time.monotonic()
        with open(Path(work) / "agent.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            worst = 0.0
            try:
                while proc.poll() is None:
                    worst = max([worst, *ratios(port)])
                    time.sleep(1.0)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(30)
        lines = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
        detected = [e for e in lines if e.get("event") == "straggler_detected"]
        steps = {f.name: len(f.read_text().splitlines()) for f in sorted((Path(work) / "out").glob("rank-*.steps"))}
        print(json.dumps({"seconds": round(time.monotonic() - began, 1), "nproc": args.nproc,
                          "step_time": args.step_time, "factor": args.factor, "window": args.window,
                          "slow_factor": args.slow_factor, "exit": proc.returncode, "steps": steps,
                          "straggler_detected": len(detected),
                          "detected": [{k: e.get(k) for k in ("rank", "ratio", "step_time", "peers_step_time")}
                                       for e in detected[:10]],
                          "max_step_time_ratio": round(worst, 3)}))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
