#!/usr/bin/env bash
# Structured output's cost here, then the same twenty schemas against vLLM (its CPU build, a measurement peer only),
# one after the other in one script so that the two never share the CPU: bench/structured.py's lines for us
# (`mask ...`, `throughput ...`, `stall ...`, `schemas server=pagedserve ...`, `ratio_structured=X`), then vLLM's
# `schemas server=peer ...` line.
#   usage: bench/structured_vs_vllm.sh MODEL_DIR [VLLM_VENV] [bench/structured.py args]   (VLLM_VENV: bench/peers/defaults.sh)
#   env:   VLLM_ARGS more vLLM api_server args; VLLM_PORT (8100); OUT (bench/out/structured-DATE); PYTHON (python)
set -euo pipefail
model=${1:?usage: bench/structured_vs_vllm.sh MODEL_DIR [VLLM_VENV] [bench/structured.py args]}
shift
source "$(dirname "$0")/peers/defaults.sh"  # PEERS, VLLM_VENV
venv=$VLLM_VENV
if [ $# -gt 0 ] && [[ $1 != -* ]]; then venv=$1; shift; fi
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
out=${OUT:-$root/bench/out/structured-$(date +%Y%m%d-%H%M%S)}
port=${VLLM_PORT:-8100}
mkdir -p "$out"
# shellcheck source=bench/server_lib.sh
source "$root/bench/server_lib.sh"

"$py" "$root/bench/structured.py" --model "$model" "$@" | tee "$out/pagedserve.txt"

start_vllm
"$py" "$root/bench/structured.py" --peer-only --peer "http://127.0.0.1:$port/v1" --peer-model smollm2 \
  | tee "$out/vllm.txt"
stop_server
echo
grep -h '^schemas ' "$out/pagedserve.txt" "$out/vllm.txt"
grep -h '^ratio_structured=' "$out/pagedserve.txt"
