#!/usr/bin/env bash
# The whole server on a GPU host, end to end, in one command (issue 8; benchmarks/README.md):
# where aiortc and PyAV do not import, installs the wheelhouse parts found in .wheelhouse
# (scripts/gpu_wheelhouse.py builds them, as docs/gpu.md says); then runs
# the load generator once per SIZExSESSIONS argument ("motion" for motion-only sessions at
# 256), one after another on one server started once (it compiles for minutes), with the
# server on the first three quarters of the cores (SERVER_CORES of them, if set) and its
# peers on the rest. Each run's JSON line goes to stdout and to ${OUT:-.}/gpu_bench.jsonl,
# the server's output to ${OUT:-.}/logs.
#
#   bash scripts/gpu_bench.sh 512x64 256x128 motionx256
#
# WAV (default .gpudata/speech.wav), SECONDS_PER_RUN (40: the server's delay percentiles
# cover each session's last 500 frames, which then fall after the connections' start),
# RUNTIME (torch-cuda) and SERVER_SETTINGS (more server arguments, e.g.
# "--set session.max_host_load=0.95") change it.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import aiortc, av" 2> /dev/null; then
    mkdir -p .sonic-site
    for part in .wheelhouse/site-*.tar.xz; do tar -xJf "$part" -C .sonic-site; done
    export PYTHONPATH="$PWD/.sonic-site:$PWD"
fi
cores=$(nproc)
server_last=$(( ${SERVER_CORES:-$(( cores * 3 / 4 ))} - 1 ))
wav=${WAV:-.gpudata/speech.wav}
mkdir -p "${OUT:-.}"
out=${OUT:-.}/gpu_bench.jsonl
settings=(--runtime "${RUNTIME:-torch-cuda}" ${SERVER_SETTINGS:-})
python3 -m benchmarks.sessions --wav "$wav" --points "$@" --seconds "${SECONDS_PER_RUN:-40}" \
    --json --server-cpus "0-$server_last" --client-cpus "$(( server_last + 1 ))-$(( cores - 1 ))" \
    --server-logs "${OUT:-.}/logs" -- "${settings[@]}" | tee -a "$out"
