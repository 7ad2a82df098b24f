#!/usr/bin/env bash
# The documentation site, built as CI builds it: installs the docs extra into the venv (only what is missing),
# checks that the generated reference pages are current (docs/gen_reference.py --check: every flag,
# environment variable, --rdzv-conf key, event and exit code comes from the code), then builds mkdocs.yml in
# strict mode into a temporary directory (a broken link, a missing anchor or a page left out of nav fails).
# Called by .ci/run after the test suite (SPOTRUN_DOCS_INSTALL_ONLY=1: only the install, for .ci/prepare.sh).
# About 15 s with the packages installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPOTRUN_VENV:-$root/.venv}"
bash "$root/.ci/venv.sh"
stamp="$venv/.spotrun-installed-docs"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "[docs] installing spotrun[docs]"
  # the extra's requirements only: the project itself is already installed (editable) by venv.sh
  mapfile -t reqs < <("$venv/bin/python" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["docs"]))' "$root/pyproject.toml")
  "$venv/bin/python" -m pip install -q "${reqs[@]}"
  touch "$stamp"
fi
if [ "${SPOTRUN_DOCS_INSTALL_ONLY:-0}" = "1" ]; then
  exit 0  # .ci/prepare.sh: install only
fi
cd "$root"
"$venv/bin/python" docs/gen_reference.py --check
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
NO_MKDOCS_2_WARNING=1 "$venv/bin/python" -m mkdocs build --strict --quiet --site-dir "$out"
echo "[docs] built $(find "$out" -name '*.html' | wc -l) pages in strict mode"
