#!/usr/bin/env bash
# CI's first step: everything the later steps install, three chains side by side (each mostly waits on the
# network or the package manager, so on 2 cores they overlap well; one after the other they took ~8 minutes):
#   1. Debian packages: slurm-wlm and munge (.ci/slurm.sh), prometheus (.ci/prometheus.sh), then chromium
#      (.ci/browser.sh): one apt lock, so in turn;
#   2. the suite's venv (.ci/venv.sh: torch 2.13.0 and spotrun[test]), then the docs extra (.ci/docs.sh installs it);
#   3. the matrix's venvs: Python 3.10 + torch 2.14.1, 3.12 + 2.15.0, 3.13 + 2.15.0 (.ci/torch_matrix.sh --venvs-only).
# Each later step still installs what is missing itself (every script works alone); this only moves the waiting
# to one place. Each chain's output is printed when it ends, prefixed with its name; a failed chain fails the step.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
began=$SECONDS
chain() {  # chain NAME COMMAND...: runs in the background, output to $logs/NAME
  local name="$1"
  shift
  ( "$@" ) > "$logs/$name" 2>&1 &
  echo $! > "$logs/$name.pid"
}
chain apt bash -c "bash '$root/.ci/slurm.sh' && bash '$root/.ci/prometheus.sh' && bash '$root/.ci/browser.sh'"
chain venv bash -c "bash '$root/.ci/venv.sh' && SPOTRUN_DOCS_INSTALL_ONLY=1 bash '$root/.ci/docs.sh'"
chain matrix bash "$root/.ci/torch_matrix.sh" --venvs-only
status=0
for name in apt venv matrix; do
  if wait "$(cat "$logs/$name.pid")"; then
    result="done"
  else
    result="FAILED (rc $?)"
    status=1
  fi
  grep -v "^WARNING: Location 'file:" "$logs/$name" | sed "s/^/[prepare $name] /"
  echo "[prepare] $name $result after $((SECONDS - began)) s"
done
exit $status
