#!/usr/bin/env bash
# Installs what tests/deploy/test_slurm_real.py runs deploy/slurm/spotrun.sbatch under: a real Slurm (Debian's
# slurm-wlm: slurmctld, slurmd, sbatch, ...) and munge, from the distribution's packages, when missing. Only
# the packages: the test starts its own munged, slurmctld and four slurmd with configuration, keys and state in
# a temporary directory (tests/deploy/slurmlab.py), and the package's own services are not started here.
# Needs root and apt-get; without them it says so and exits 0: the Slurm tests then fail with the reason
# (SPOTRUN_TEST_SKIP_SLURM=1 skips them on purpose).
set -uo pipefail
need=(slurmctld slurmd munged sbatch scontrol squeue sinfo scancel)
missing=()
for cmd in "${need[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
echo "[slurm] missing: ${missing[*]}; installing slurm-wlm munge"
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[slurm] cannot install: needs root and apt-get (tests/deploy/test_slurm_real.py will fail, naming what is missing)"
  exit 0
fi
# policy-rc.d 101: the packages' services must not start (nor fail to start) in a container; the test runs its own.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && created_policy=1
fi
status=0
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null || status=$?
[ "$created_policy" -eq 1 ] && rm -f "$policy"
if [ "$status" -ne 0 ]; then
  echo "[slurm] apt-get install slurm-wlm munge failed (exit $status)"
fi
exit 0
