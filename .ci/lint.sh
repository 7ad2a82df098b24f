#!/usr/bin/env bash
# Static checks, run by tests/run.sh before pytest (rules and settings: [tool.ruff] and [tool.mypy] in pyproject.toml):
#   ruff check .   lint and import order of the whole tree (never `ruff format`: that is a separate, one-time change)
#   mypy           types of the shipped packages, elastic/ and checkpoint/
# Runs both, prints every finding, exits non-zero if either found something. Caches live in the venv, so a
# fresh clone pays mypy's full analysis once (torch's stubs dominate), later runs take seconds.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPOTRUN_VENV:-$root/.venv}"
py="$venv/bin/python"
cd "$root"
status=0
echo "[lint] ruff check ."
RUFF_CACHE_DIR="$venv/.ruff_cache" "$py" -m ruff check . || status=1
echo "[lint] mypy (elastic checkpoint)"
"$py" -m mypy --cache-dir "$venv/.mypy_cache" || status=1
if [ "$status" -ne 0 ]; then
  echo "[lint] FAILED: fix the findings above (a justified '# noqa: CODE - why' or '# type: ignore[code]  # why' only where the code is right)"
fi
exit "$status"
