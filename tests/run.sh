#!/usr/bin/env bash
# The test suite, from a fresh machine: builds .venv if needed, runs the static checks (.ci/lint.sh), then pytest.
# Arguments go to pytest. SPOTRUN_SKIP_LINT=1 skips the static checks (a quick local rerun of some tests).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/.ci/venv.sh"
bash "$root/.ci/browser.sh"  # chromium for the report page's render test, only if missing
cd "$root"
if [ "${SPOTRUN_SKIP_LINT:-0}" != "1" ]; then
  bash "$root/.ci/lint.sh"
fi
exec "${SPOTRUN_VENV:-$root/.venv}/bin/python" -m pytest -q "$@"
