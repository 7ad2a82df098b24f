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
bash "$root/.ci/prometheus.sh"  # prometheus and promtool for tests/deploy/test_monitoring.py, only if missing
cd "$root"
if [ "${SPOTRUN_SKIP_LINT:-0}" != "1" ]; then
  bash "$root/.ci/lint.sh"
fi
python="${SPOTRUN_VENV:-$root/.venv}/bin/python"
workers="${SPOTRUN_TEST_WORKERS:-2}"
if [ "$#" -gt 0 ] || [ "$workers" = "1" ]; then
  exec "$python" -m pytest -q "$@"
fi

work="$(mktemp -d)"
child=""
trap 'rm -rf "$work"' EXIT
# The script is no longer pytest itself (no exec): a signal to it goes on to pytest, which stops its workers.
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; exit 143' TERM
trap '[ -n "$child" ] && kill -INT "$child" 2>/dev/null; exit 130' INT
trap '[ -n "$child" ] && kill -HUP "$child" 2>/dev/null; exit 129' HUP
export SPOTRUN_LEFTOVER_FILE="$work/leftovers"  # tests/conftest.py: processes a test left behind
run() {  # run PYTEST-ARGS...: one pytest in the background (so the traps above run), its exit status
  local rc=0
  "$python" -m pytest "$@" &
  child=$!
  wait "$child" || rc=$?
  child=""
  return "$rc"
}
leftovers() {  # a passing rerun must not hide a process left behind in the parallel run
  if [ -s "$SPOTRUN_LEFTOVER_FILE" ]; then
    echo "[tests] FAILED: tests left processes behind (listed above)" >&2
    exit 1
  fi
}

rc=0
run -q -n "$workers" --dist loadfile --cache-clear || rc=$?
[ "$rc" -eq 0 ] && exit 0
# Exit 1 is failed tests (or a collection error, or the leftover check); anything else (interrupted, internal
# or usage error, no tests) ends here.
[ "$rc" -eq 1 ] || exit "$rc"
leftovers
failed="$("$python" - <<'PY'
import json, pathlib
path = pathlib.Path(".pytest_cache/v/cache/lastfailed")
print(len(json.loads(path.read_text())) if path.exists() else 0)
PY
)"
max="${SPOTRUN_RERUN_MAX:-10}"
if [ "$failed" -lt 1 ]; then
  echo "[tests] FAILED: pytest exited 1 without a recorded test failure (see above)" >&2
  exit 1
fi
if [ "$failed" -gt "$max" ]; then
  echo "[tests] FAILED: $failed tests failed in the parallel run (more than $max: not rerun)" >&2
  exit 1
fi
echo "[tests] rerunning alone the $failed tests that failed beside another worker"
rc=0
run -q --lf -rA > "$work/rerun.log" 2>&1 || rc=$?
cat "$work/rerun.log"
leftovers
if [ "$rc" -eq 0 ]; then
  {
    echo "[tests] load-sensitive: these failed beside another worker and passed alone:"
    grep '^PASSED ' "$work/rerun.log" | sed 's/^/[tests]   /' || true
  } >&2
fi
exit "$rc"
