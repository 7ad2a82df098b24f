#!/usr/bin/env bash
# The test suite, from a fresh machine: builds .venv if needed, then runs pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/.ci/venv.sh"
cd "$root"
exec "${SPOTRUN_VENV:-$root/.venv}/bin/python" -m pytest -q "$@"
