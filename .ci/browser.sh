#!/usr/bin/env bash
# Installs Debian's chromium (headless browser for tests/elastic/test_report_browser.py) when it is missing.
# Needs root (apt-get); without it, says what to run and exits 0 so the rest of the suite still runs (the
# browser test then fails, naming this script).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[browser] chromium is missing; run as root: apt-get install -y chromium" >&2
  exit 0
fi
echo "[browser] installing chromium (Debian package)"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null || {
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
}
