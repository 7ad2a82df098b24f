#!/usr/bin/env bash
# The elastic and checkpoint core on every tested Python and torch release besides the suite's own (Python 3.11,
# torch 2.13.0 CPU build): one cell per Python, each paired with a torch release pyproject.toml declares, so that
# every supported Python and every tested torch is run without a cell per pair (docs/supported-versions.md):
#   Python 3.10 + torch 2.14.1 (torch 2.15 has no wheel for 3.10), Python 3.12 + torch 2.15.0 (what
#   `pip install` brings on Ubuntu 24.04's Python today), Python 3.13 + torch 2.15.0.
# Each cell gets its own venv, built only if missing (`.ci/venv.sh core`: that Python, that torch, then spotrun
# with `pip install -e`, which must keep it), then `pip install` of spotrun's wheel is resolved against that venv
# (--dry-run: it must not touch torch), then CORE below runs; each step is timed, and all of them share one
# budget so that all of CI stays within its time. Called by .ci/run after the main suite and its long cases.
#
# SPOTRUN_MATRIX: the cells, PYTHON:TORCH separated by spaces (default below); SPOTRUN_TORCH_MATRIX (older
# form, still read): torch releases only, each on the default python3. SPOTRUN_MATRIX_DIR: where the venvs
# live (default the repository root, .venv-py<python>-torch-<release>). Each Python is found as python<X.Y> on
# PATH, else under pyenv ($PYENV_ROOT/versions/<X.Y>.*, default ~/.pyenv). Our machines cap pip at
# torch<=2.14.1 (/etc/xdg/pip): PIP_CONSTRAINT=/dev/null lifts it for these venvs only. Only 2.14.1's cp311
# wheel lies on our machines' disk: every cell downloads its torch (a CUDA build that runs on CPU, ~5 GB with
# its CUDA libraries). Measured (2-core VM, 2026-11-28): 3.10 + 2.14.1 built in 169 s, 3.12 + 2.15.0 and
# 3.13 + 2.15.0 in 206 s each side by side (.ci/prepare.sh builds all of them at once).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -n "${SPOTRUN_MATRIX:-}" ]; then
  cells="$SPOTRUN_MATRIX"
elif [ -n "${SPOTRUN_TORCH_MATRIX:-}" ]; then
  cells="$(for release in $SPOTRUN_TORCH_MATRIX; do printf 'default:%s ' "$release"; done)"
else
  cells="3.10:2.14.1 3.12:2.15.0 3.13:2.15.0"
fi
venvs="${SPOTRUN_MATRIX_DIR:-$root}"
# One time budget for the whole matrix (installs and tests): the main suite and its long cases take about 17
# minutes of CI's 45 on a quiet machine. Each step gets what is left; past it the matrix fails, naming the step.
budget="${SPOTRUN_MATRIX_BUDGET:-1200}"
deadline=$((SECONDS + budget))
left() { echo $((deadline - SECONDS > 0 ? deadline - SECONDS : 1)); }

python_for() {  # python_for X.Y: that interpreter's path ("default": python3), or nothing
  local version="$1" candidate
  if [ "$version" = default ]; then command -v python3; return; fi
  if candidate="$(command -v "python$version" 2>/dev/null)" && "$candidate" -c '' 2>/dev/null; then
    echo "$candidate"
    return
  fi
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}/versions/$version".*/bin/python; do
    if [ -x "$candidate" ]; then echo "$candidate"; return; fi
  done
}

venv_of() {  # venv_of PYTHON RELEASE
  if [ "$1" = default ]; then echo "$venvs/.venv-torch-$2"; else echo "$venvs/.venv-py$1-torch-$2"; fi
}

# What depends on torch: the launcher (torchrun's environment and summary, restarts, the close patch, SIGTERM
# cleanup), stock torchrun on the etcd-v3 rendezvous, planned changes (agent units and one SIGTERMed agent that
# loses no step), fidelity against that release's torchrun, exactness across world sizes, the torch internals'
# fingerprints and start-up check; checkpoint save/load on local disk and memory:// (S3 is the same code on
# every torch), DTensor state, DDP/FSDP2/HSDP saved at 4 and resharded to 1, 2, 3, 5. The slowest launcher and
# exactness cases (agent SIGKILL, 2->1->3 workers: 4 of the 9 minutes on a loaded machine) run on 2.13.0 only.
CORE=(
  tests/elastic/test_torch_internals.py
  tests/elastic/test_launcher.py::test_worker_environment_matches_torchrun
  tests/elastic/test_launcher.py::test_worker_sigkill_is_restarted_within_max_restarts
  tests/elastic/test_launcher.py::test_failure_past_max_restarts_exits_with_torchrun_summary
  tests/elastic/test_launcher.py::test_stuck_worker_is_killed_after_the_stop_grace
  tests/elastic/test_launcher.py::test_standalone_cleans_up_etcd_and_workers_on_sigterm
  tests/elastic/test_rendezvous_torchrun.py
  tests/elastic/test_agent_planned.py
  tests/elastic/test_planned.py::test_sigterm_to_one_agent_loses_no_step
  tests/elastic/test_fidelity.py
  tests/elastic/test_exactness.py::test_deterministic_mode_is_bit_identical_across_world_sizes
  tests/checkpoint/test_checkpointer.py
  tests/checkpoint/test_state.py
  tests/checkpoint/test_checkpointer_dist.py
  tests/checkpoint/test_distributed.py
)

build() {  # build PYTHON RELEASE VENV: that cell's venv, if missing (venv.sh core)
  local interpreter
  interpreter="$(python_for "$1")"
  if [ -z "$interpreter" ]; then
    echo "[py $1 torch $2] no Python $1 here (python$1 on PATH, or pyenv's versions/$1.*)" >&2
    return 1
  fi
  PIP_CONSTRAINT=/dev/null PYTHON="$interpreter" SPOTRUN_VENV="$3" SPOTRUN_TORCH="$2" \
    timeout "$(left)" bash "$root/.ci/venv.sh" core
}

if [ "${1:-}" = "--venvs-only" ]; then
  # .ci/prepare.sh: only build the venvs (all cells in parallel: downloads, not CPU, dominate), so that the
  # run after the main suite finds them ready.
  logs="$(mktemp -d)"
  trap 'rm -rf "$logs"' EXIT
  pids=()
  for cell in $cells; do
    build "${cell%%:*}" "${cell##*:}" "$(venv_of "${cell%%:*}" "${cell##*:}")" > "$logs/$cell.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for cell in $cells; do sed "s/^/[py ${cell%%:*} torch ${cell##*:}] /" "$logs/$cell.log"; done
  echo "[torch matrix] venvs for $cells built in $SECONDS s (status $status)"
  exit $status
fi

status=0
for cell in $cells; do
  python="${cell%%:*}"
  release="${cell##*:}"
  name="py $python torch $release"
  venv="$(venv_of "$python" "$release")"
  began=$SECONDS
  if ! build "$python" "$release" "$venv"; then
    echo "[$name] FAILED: building $venv ($((SECONDS - began)) s; matrix budget ${budget} s)" >&2
    status=1
    continue
  fi
  installed="$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  if [[ "$installed" != "$release"* ]]; then
    echo "[$name] FAILED: installing spotrun changed torch to $installed" >&2
    status=1
    continue
  fi
  echo "[$name] venv ready in $((SECONDS - began)) s ($("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'))"
  if ! timeout "$(left)" bash "$root/.ci/wheel_keeps_torch.sh" "$venv" "$release"; then
    echo "[$name] FAILED: pip install of spotrun's wheel would not keep torch $release" >&2
    status=1
  fi
  began=$SECONDS
  # SIGINT first: pytest then prints what failed so far before it stops.
  if timeout -s INT -k 30 "$(left)" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
      -k "not s3" "${CORE[@]}"; then
    echo "[$name] core passed in $((SECONDS - began)) s"
  else
    echo "[$name] FAILED: core (rc $?, $((SECONDS - began)) s; matrix budget ${budget} s)" >&2
    status=1
  fi
done
echo "[torch matrix] $cells: $((SECONDS)) s"
exit $status
