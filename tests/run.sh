#!/usr/bin/env bash
# The test suite, from a fresh machine: builds .venv if needed, runs the static checks (.ci/lint.sh), then pytest.
# Arguments go to pytest (one process, as given). SPOTRUN_SKIP_LINT=1 skips the static checks (a quick rerun).
#
# With no arguments (the whole suite, the long cases left out: tests/conftest.py) it runs in two pytest worker
# processes (pytest-xdist, a test file per worker at a time: its module fixtures stay in one process), then reruns
# alone whatever failed there, if that is at most SPOTRUN_RERUN_MAX tests (default 10). Most tests are end to
# end (agents, etcd, workers) and wait on each other more than they compute: one process kept one of the two cores
# ~70 % busy, and two take ~9 minutes instead of ~14. A test that failed beside another and passed alone is named
# in the summary (it is load-sensitive: a finding, not noise); one that fails alone fails the run.
# SPOTRUN_TEST_WORKERS=1 runs the whole suite in one process as before.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/.ci/venv.sh"
bash "$root/.ci/browser.sh"  # chromium for the report page's render test, only if missing
cd "$root"
if [ "${SPOTRUN_SKIP_LINT:-0}" != "1" ]; then
  bash "$root/.ci/lint.sh"
fi
python="${SPOTRUN_VENV:-$root/.venv}/bin/python"
workers="${SPOTRUN_TEST_WORKERS:-2}"
if [ "$#" -gt 0 ] || [ "$workers" = "1" ]; then
  exec "$python" -m pytest -q "$@"
fi

rc=0
"$python" -m pytest -q -n "$workers" --dist loadfile --cache-clear || rc=$?
[ "$rc" -eq 0 ] && exit 0
[ "$rc" -eq 1 ] || exit "$rc"  # interrupted, internal or usage error, no tests: nothing to rerun
failed="$("$python" - <<'PY'
import json, pathlib
path = pathlib.Path(".pytest_cache/v/cache/lastfailed")
print(len(json.loads(path.read_text())) if path.exists() else -1)
PY
)"
max="${SPOTRUN_RERUN_MAX:-10}"
if [ "$failed" -lt 1 ] || [ "$failed" -gt "$max" ]; then
  echo "[tests] $failed tests failed in the parallel run (rerun alone only up to $max): failing" >&2
  exit 1
fi
echo "[tests] rerunning alone the $failed tests that failed beside another worker"
rerun_log="$(mktemp)"
trap 'rm -f "$rerun_log"' EXIT
rc=0
"$python" -m pytest -q --lf -rA 2>&1 | tee "$rerun_log" || rc=$?
if [ "$rc" -eq 0 ]; then
  echo "[tests] load-sensitive: these failed beside another worker and passed alone:"
  grep '^PASSED ' "$rerun_log" | sed 's/^/[tests]   /' || true
fi
exit "$rc"
