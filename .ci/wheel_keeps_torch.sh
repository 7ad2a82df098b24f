#!/usr/bin/env bash
# `pip install spotrun` (its wheel, as a user gets it) into a venv that already has torch RELEASE must keep that
# torch: pip's own plan (--dry-run --report, so the venv is not touched) may not install any torch. The wheel is
# built without isolation from the venv's setuptools (torch needs >= 77, as spotrun's build does).
# PIP_CONSTRAINT=/dev/null: a user's pip has no cap on torch (ours caps it at 2.14.1, /etc/xdg/pip).
# Usage: wheel_keeps_torch.sh VENV RELEASE (.ci/torch_matrix.sh runs it for every release of the matrix).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$1"
release="$2"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
if ! "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$root" >"$dir/build.log" 2>&1; then
  cat "$dir/build.log" >&2
  exit 1
fi
PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --dry-run --report "$dir/report.json" \
  "$dir"/spotrun-*.whl 2>"$dir/install.log" || { grep -v "is ignored" "$dir/install.log" >&2; exit 1; }
"$venv/bin/python" - "$dir/report.json" "$release" <<'PY'
import json
import sys

report, release = sys.argv[1], sys.argv[2]
with open(report) as f:
    plan = [f"{item['metadata']['name']} {item['metadata']['version']}" for item in json.load(f)["install"]]
torch = [what for what in plan if what.split()[0].lower() == "torch"]
print(f"[py {sys.version_info.major}.{sys.version_info.minor} torch {release}] `pip install` of spotrun's wheel would install: {', '.join(plan) or 'nothing'}; "
      + (f"it would replace torch {release} with {torch[0]}" if torch else f"torch {release} kept"))
sys.exit(1 if torch else 0)
PY
