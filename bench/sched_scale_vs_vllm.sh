#!/usr/bin/env bash
# Our Scheduler (bench/sched_trace.py) and vLLM's V1 Scheduler (bench/peers/vllm_sched.py) on the same trace,
# back to back per batch size; per-step time = median wall / steps (both time from building their requests,
# hashing included, to the last step; ours also converts and serialises each plan to protobuf).
# usage: bench/sched_scale_vs_vllm.sh [VLLM_VENV] [REQUESTS] [BATCH_SIZES] [NUM_BLOCKS] [RUNS]
#   defaults: $VLLM_CORE_VENV (bench/peers/defaults.sh; built by bench/peers/setup_vllm_core.sh when missing),
#             6000, "64 256 1024", 1000000, 3
#   env:      PEERS (bench/peers), PYTHON (python)
# Last line: `sched_vs_vllm B=ratio ...` (ours/vLLM per-step time; < 1: ours is faster).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/peers/defaults.sh
source "$here/bench/peers/defaults.sh"
peers=$PEERS
venv=${1:-$VLLM_CORE_VENV}
requests=${2:-6000}
batch_sizes=${3:-64 256 1024}
num_blocks=${4:-1000000}
runs=${5:-3}
py=${PYTHON:-python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! "$venv/bin/python" -c "import vllm.v1.core.sched.scheduler" 2>/dev/null; then
  bash "$peers/setup_vllm_core.sh" "$venv"
fi
python3 "$peers/trace.py" "$tmp/trace.jsonl" --requests "$requests"
echo "trace: $requests requests (trace.py defaults otherwise), num_blocks=$num_blocks, runs=$runs"
printf '%6s %8s %10s %10s %8s %10s %10s %7s\n' B steps ours_s vllm_s v_steps ours_ms vllm_ms ratio
summary="sched_vs_vllm"
for b in $batch_sizes; do
  args=(--max-num-seqs "$b" --num-blocks "$num_blocks" --runs "$runs")
  VLLM_TARGET_DEVICE=cpu "$venv/bin/python" "$peers/vllm_sched.py" "$tmp/trace.jsonl" "${args[@]}" \
    > "$tmp/vllm.out" 2> "$tmp/vllm.err" || { cat "$tmp/vllm.err" >&2; exit 1; }
  (cd "$here" && "$py" bench/sched_trace.py "$tmp/trace.jsonl" "${args[@]}") > "$tmp/ours.out"
  read -r v_wall v_steps < <(awk -F'[= ]' '/steps=/{for(i=1;i<=NF;i++) if($i=="steps") s=$(i+1)}
                                           /^median_wall_s=/{w=$2} END{print w, s}' "$tmp/vllm.out")
  read -r o_wall o_steps < <(awk -F'[= ]' '/steps=/{for(i=1;i<=NF;i++) if($i=="steps") s=$(i+1)}
                                           /^median_wall_s=/{w=$2} END{print w, s}' "$tmp/ours.out")
  line=$(awk -v b="$b" -v ow="$o_wall" -v os="$o_steps" -v vw="$v_wall" -v vs="$v_steps" 'BEGIN{
    om = 1e3 * ow / os; vm = 1e3 * vw / vs
    printf "%6d %8d %10.3f %10.3f %8d %10.3f %10.3f %7.2f", b, os, ow, vw, vs, om, vm, om / vm}')
  echo "$line"
  summary="$summary $b=$(awk '{print $NF}' <<< "$line")"
done
echo "$summary"
