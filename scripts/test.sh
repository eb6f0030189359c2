#!/usr/bin/env bash
# Sets up everything the tests need on a fresh Debian machine (as root), then runs them:
# Debian's packages, and the project with its test extras in the virtual environment .venv
# (made here if it is not there; Debian's own Python installs nothing outside one).
# Arguments go to pytest: `bash scripts/test.sh -m unit` runs the fast layer alone.
set -euo pipefail
cd "$(dirname "$0")/.."

# Chromium drives the web page; espeak-ng speaks the test speech; festival's kal_diphone
# voice and flite are the training corpus's other synthesizers (their own tests need them).
need=()
command -v espeak-ng >/dev/null || need+=(espeak-ng)
command -v chromium >/dev/null || need+=(chromium chromium-driver)
command -v flite >/dev/null || need+=(flite)
command -v festival >/dev/null || need+=(festival)
command -v turnserver >/dev/null || need+=(coturn)  # the TURN test's relay
command -v janus >/dev/null || need+=(janus)  # the meeting-room test's SFU
command -v redis-server >/dev/null || need+=(redis-server redis-tools)  # the cluster tests' meeting place
[ -d /usr/share/festival/voices/english/kal_diphone ] || need+=(festvox-kallpc16k)
# The container test builds the CPU image on a debootstrapped base and runs it (podman).
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)  # to make .venv
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  # Packages such as janus start their daemon on install (on every interface): the tests
  # start their own, on loopback, so no service may start here.
  policy=/usr/sbin/policy-rc.d
  [ -e $policy ] || { printf '#!/bin/sh\nexit 101\n' > $policy; chmod +x $policy; made_policy=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  [ -z "${made_policy:-}" ] || rm -f $policy
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q -e '.[test,examples]'
# The model and its training are defined in PyTorch (a dev extra, never needed to serve):
# the CPU build (about 1.5 GB installed) keeps the model's own tests running.
if ! python3 -m pip install -q 'torch==2.13.0'; then
  echo "PyTorch 2.13.0 is not installable here: the model's own tests will skip"
fi
python3 -m ruff check server inference tests benchmarks examples
# The CPU image is also built and run (tests/test_container.py); the GPU image only linted.
hadolint Dockerfile Dockerfile.gpu
mkdir -p out
# Every skip prints its reason (pyproject's addopts: -rs).
python3 -m pytest -q -p no:cacheprovider "$@"
