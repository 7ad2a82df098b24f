#!/usr/bin/env bash
# Creates .venv (if missing) with torch 2.13.0 (CPU) and this project with its test extra.
# Idempotent: re-running it installs only what is missing or what pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPOTRUN_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[venv] creating $venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "[venv] installing torch==2.13.0"
  "$venv/bin/python" -m pip install -q torch==2.13.0
fi
stamp="$venv/.spotrun-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "[venv] installing spotrun[test] (editable)"
  "$venv/bin/python" -m pip install -q -e "$root[test]"
  touch "$stamp"
fi
