"""A two-rank gloo job for tests/elastic/test_abort.py: trains until its peer stops, then a watcher thread
aborts the group when ``--trigger`` appears, the blocked ``all_reduce`` raises, and the rank snapshots its
state (safetensors) and exits 0, writing what happened to ``--result`` as JSON.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P RANK=r WORLD_SIZE=2 python abort_job.py --dir D
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from elastic.worker.abort import abort_process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    model = torch.nn.Linear(64, 64)
    progress = args.dir / f"progress-{rank}"
    trigger = args.dir / "trigger"
    abort: dict[str, float] = {}

    def watcher() -> None:  # the mailbox's stand-in: the agent would say "a peer is gone"
        while not trigger.exists():
            time.sleep(0.005)
        abort["at"] = time.perf_counter()
        report = abort_process_group()
        abort.update(shut=report.connections_shut, seconds=report.seconds)

    threading.Thread(target=watcher, name="abort-watcher", daemon=True).start()
    step, raised_at, raised_unix, error = 0, 0.0, 0.0, ""
    try:
        while True:
            step += 1
            progress.write_text(str(step))  # before the collective: a stuck rank's file stops changing
            for p in model.parameters():
                dist.all_reduce(p.data)
                p.data.mul_(0.5)
    except RuntimeError as exc:
        raised_at, raised_unix, error = time.perf_counter(), time.time(), str(exc)
    # After the abort: a later collective fails at once, the store still answers, a snapshot can be taken.
    began = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        later = "completed"
    except RuntimeError:
        later = "raised"
    later_seconds = time.perf_counter() - began
    store = dist.distributed_c10d._get_default_store()
    store.set(f"after-abort-{rank}", "ok")
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(args.dir / f"snap-{rank}.safetensors"))
    result = {
        "step": step, "error": error[:300], "later": later, "later_seconds": later_seconds,
        "store": store.get(f"after-abort-{rank}").decode(),
        "abort_to_raise": raised_at - abort["at"] if "at" in abort else None,
        "connections_shut": abort.get("shut"),
        "abort_seconds": abort.get("seconds"),
        "raised_before_abort": "at" not in abort or raised_at < abort["at"],
        "raised_unix": raised_unix,
    }
    (args.dir / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
