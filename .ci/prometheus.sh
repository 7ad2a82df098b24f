#!/usr/bin/env bash
# Installs what tests/deploy/test_monitoring.py runs deploy/monitoring under: Debian's prometheus package
# (prometheus and promtool), when missing. Only the package: the test starts its own server on a free loopback
# port with temporary storage, and the package's own service is not started here.
# Needs root and apt-get; without them it says so and exits 0: the monitoring tests then fail with the reason
# (SPOTRUN_TEST_SKIP_PROMETHEUS=1 skips them on purpose).
set -uo pipefail
missing=()
for cmd in prometheus promtool; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
echo "[prometheus] missing: ${missing[*]}; installing prometheus"
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[prometheus] cannot install: needs root and apt-get (tests/deploy/test_monitoring.py will fail, naming what is missing)"
  exit 0
fi
# policy-rc.d 101: the package's service must not start (nor fail to start) in a container; the test runs its own.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && created_policy=1
fi
status=0
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null || status=$?
[ "$created_policy" -eq 1 ] && rm -f "$policy"
if [ "$status" -ne 0 ]; then
  echo "[prometheus] apt-get install prometheus failed (exit $status)"
fi
exit 0
