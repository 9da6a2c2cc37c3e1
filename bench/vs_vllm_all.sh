#!/usr/bin/env bash
# Issue 27's four comparisons against vLLM's CPU build, one after another in one script (bench/vs_vllm.sh each, our
# gRPC front, the headline workload): --dtype float32 on both; the same beside a one-core busy loop; out of the box
# (no --dtype on either side: each server's own choice, printed); --dtype bfloat16 on both.
#   usage: bench/vs_vllm_all.sh MODEL_DIR [VLLM_VENV]     (VLLM_VENV: bench/peers/defaults.sh's when not given)
#   env:   OUT (default bench/out/vs_vllm_all-TIMESTAMP),
#          RUNS ("float32 float32_busy auto bfloat16", any subset, in that order)
# Last line: `vs_vllm_all float32=R1 float32_busy=R2 auto=R3 bfloat16=R4` (ratio_vs_vllm of each run).
set -euo pipefail
model=${1:?usage: bench/vs_vllm_all.sh MODEL_DIR [VLLM_VENV]}
source "$(dirname "$0")/peers/defaults.sh"  # PEERS, VLLM_VENV
venv=${2:-$VLLM_VENV}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/bench/out/vs_vllm_all-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
summary="vs_vllm_all"
for run in ${RUNS:-float32 float32_busy auto bfloat16}; do
  dtype=${run%_busy}
  busy=0
  [ "$run" != "$dtype" ] && busy=1
  echo "=== $run: DTYPE=$dtype BUSY=$busy" >&2
  DTYPE=$dtype BUSY=$busy HTTP=0 OUT="$out/$run" bash "$root/bench/vs_vllm.sh" "$model" "$venv" >"$out/$run.txt" 2>"$out/$run.err"
  ratio=$(sed -n 's/^ratio_vs_vllm=//p' "$out/$run.txt")
  grep -E "^(dtype_pagedserve|pagedserve_output_tok_s)" "$out/$run.txt" | sed "s/^/$run: /"
  summary="$summary $run=$ratio"
done
echo "$summary"
