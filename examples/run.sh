#!/usr/bin/env bash
# The main job, from a fresh machine: a small elastic DDP training with async checkpoints,
# two workers under `spotrun --standalone` (embedded etcd on a free loopback port).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/.ci/venv.sh" demo  # torch, spotrun and the etcd binary only (no test extra)
cd "$root"
ckpt="${CKPT_DIR:-$root/runs/ckpt}"
exec "${SPOTRUN_VENV:-$root/.venv}/bin/spotrun" --standalone --nproc-per-node 2 \
  examples/train_ddp.py --steps "${STEPS:-200}" --ckpt-dir "$ckpt" "$@"
