#!/usr/bin/env bash
# Sets up everything the tests need on a fresh Debian machine (as root), then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v espeak-ng >/dev/null || need+=(espeak-ng)
command -v chromium >/dev/null || need+=(chromium chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
python3 -m pip install -q -e '.[test]' 2>&1 | grep -v "Running pip as the 'root' user" || true
python3 -m ruff check server inference tests benchmarks
mkdir -p out
python3 -m pytest -q -p no:cacheprovider "$@"
