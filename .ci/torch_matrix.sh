#!/usr/bin/env bash
# The elastic and checkpoint core on every tested torch release besides the suite's own 2.13.0 (CPU build):
# torch 2.14.1 and 2.15.0 (pyproject.toml declares exactly these three). Each release gets its own venv,
# built only if missing (`.ci/venv.sh core`: that torch, then spotrun with `pip install -e`, which must keep
# it), then `pip install` of spotrun's wheel is resolved against that venv (--dry-run: it must not touch torch),
# then CORE below runs; each step is timed, and all of them share one budget so that all of CI stays under 30
# minutes on 2 cores. Called by .ci/run after the main suite and its long cases.
#
# SPOTRUN_TORCH_MATRIX: the releases (default "2.14.1 2.15.0"); SPOTRUN_MATRIX_DIR: where the venvs live
# (default the repository root, .venv-torch-<release>). Our machines cap pip at torch<=2.14.1 (/etc/xdg/pip):
# PIP_CONSTRAINT=/dev/null lifts it for these venvs only. 2.14.1's wheels lie on our machines' disk; 2.15.0's
# (539 MB, and about 3 GB of CUDA libraries it shares almost none of with 2.14.1) come from the index: its venv
# took 231 s to build with a cold cache on a loaded machine, 2.14.1's 83 s. pip keeps no cache of these downloads
# here (the index's answers are not cacheable), so nothing is shared between the two venvs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
releases="${SPOTRUN_TORCH_MATRIX:-2.14.1 2.15.0}"
venvs="${SPOTRUN_MATRIX_DIR:-$root}"
# One time budget for the whole matrix (installs and tests): the main suite and its long cases take about 17
# minutes of CI's 30 on a quiet machine. Each step gets what is left; past it the matrix fails, naming the step.
budget="${SPOTRUN_MATRIX_BUDGET:-900}"
deadline=$((SECONDS + budget))
left() { echo $((deadline - SECONDS > 0 ? deadline - SECONDS : 1)); }

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

build() {  # build() RELEASE VENV: that release's venv, if missing (venv.sh core)
  PIP_CONSTRAINT=/dev/null SPOTRUN_VENV="$2" SPOTRUN_TORCH="$1" timeout "$(left)" bash "$root/.ci/venv.sh" core
}

if [ "${1:-}" = "--venvs-only" ]; then
  # .ci/prepare.sh: only build the venvs (each release's in parallel: downloads, not CPU, dominate), so that
  # the run after the main suite finds them ready.
  logs="$(mktemp -d)"
  trap 'rm -rf "$logs"' EXIT
  pids=()
  for release in $releases; do
    build "$release" "$venvs/.venv-torch-$release" > "$logs/$release.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for release in $releases; do sed "s/^/[torch $release] /" "$logs/$release.log"; done
  echo "[torch matrix] venvs for $releases built in $SECONDS s (status $status)"
  exit $status
fi

status=0
for release in $releases; do
  venv="$venvs/.venv-torch-$release"
  began=$SECONDS
  if ! build "$release" "$venv"; then
    echo "[torch $release] FAILED: building $venv ($((SECONDS - began)) s; matrix budget ${budget} s)" >&2
    status=1
    continue
  fi
  installed="$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  if [[ "$installed" != "$release"* ]]; then
    echo "[torch $release] FAILED: installing spotrun changed torch to $installed" >&2
    status=1
    continue
  fi
  echo "[torch $release] venv ready in $((SECONDS - began)) s"
  began=$SECONDS
  if ! timeout "$(left)" bash "$root/.ci/wheel_keeps_torch.sh" "$venv" "$release"; then
    echo "[torch $release] FAILED: pip install of spotrun's wheel would not keep torch $release" >&2
    status=1
  fi
  began=$SECONDS
  # SIGINT first: pytest then prints what failed so far before it stops.
  if timeout -s INT -k 30 "$(left)" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
      -k "not s3" "${CORE[@]}"; then
    echo "[torch $release] core passed in $((SECONDS - began)) s"
  else
    echo "[torch $release] FAILED: core (rc $?, $((SECONDS - began)) s; matrix budget ${budget} s)" >&2
    status=1
  fi
done
echo "[torch matrix] $releases: $((SECONDS)) s"
exit $status
