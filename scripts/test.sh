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
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q -e '.[test]'
# The model and its training are defined in PyTorch (a dev extra, never needed to serve):
# the CPU build keeps the model's own tests running; without it they skip.
if ! python3 -m pip install -q 'torch==2.13.0'; then
  echo "PyTorch 2.13.0 is not installable here: the model's own tests will skip"
fi
python3 -m ruff check server inference tests benchmarks
mkdir -p out
python3 -m pytest -q -p no:cacheprovider "$@"
