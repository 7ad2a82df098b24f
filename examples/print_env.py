"""Print the torchrun/spotrun worker environment as one JSON line per worker (used to compare launchers).

Run it:
    python examples/print_env.py --out /tmp/env                  # single process (no launcher variables)
    spotrun --standalone --nproc-per-node 2 examples/print_env.py --out /tmp/env
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/print_env.py --out /tmp/env
Each worker writes ``<out>/rank<RANK>.json`` (and prints the same JSON line) with every variable a launcher
sets plus ``PET_*``/``TORCHELASTIC_*`` ones.
"""

from __future__ import annotations

import argparse
import json
import os

from torch.distributed.elastic.multiprocessing.errors import record

LAUNCHER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE",
)


def launcher_env() -> dict[str, str]:
    keys = set(LAUNCHER_VARS) | {k for k in os.environ if k.startswith(("TORCHELASTIC_", "PET_"))}
    return {k: os.environ[k] for k in sorted(keys) if k in os.environ}


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for rank<RANK>.json files")
    args = parser.parse_args()
    env = launcher_env()
    line = json.dumps(env, sort_keys=True)
    print(line, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"rank{env.get('RANK', '0')}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(line)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
