#!/usr/bin/env bash
# pagedserve and vLLM (its CPU build, a measurement peer only), one after the other, under the same
# `pagedserve bench` workload; prints the summaries, then `ratio_http_vs_vllm=Y ratio_http_vs_grpc=Z` (our
# OpenAI-compatible front, benched like vLLM's) and last `ratio_vs_vllm=X` (our gRPC output tok/s over vLLM's).
#   usage: bench/vs_vllm.sh MODEL_DIR [VLLM_VENV] [extra bench args]      (VLLM_VENV: see bench/peers/defaults.sh)
#   env:   PAGEDSERVE_UP_ARGS  more `pagedserve up` args (e.g. "--kv-memory 2GiB --threads 2")
#          VLLM_ARGS           more vLLM api_server args;  VLLM_PORT (8100)
#          BENCH_ARGS          more bench args for both runs (as are the extra args on the command line)
#          OUT                 output dir (default bench/out/vs_vllm-YYYYmmdd-HHMMSS); PYTHON (python)
#          DTYPE               float32 (default), bfloat16, or auto: no --dtype flag on either side (out of the box);
#                              the dtype each server chose is printed (`dtype_pagedserve=… dtype_vllm=…`)
#          BUSY=1              a one-core busy loop (a plain Python `while True`) runs beside both servers throughout
#          HTTP=0              skip the run through our OpenAI-compatible front (its ratios then print nan)
set -euo pipefail
model=${1:?usage: bench/vs_vllm.sh MODEL_DIR [VLLM_VENV] [extra bench args]}
shift
source "$(dirname "$0")/peers/defaults.sh"  # PEERS, VLLM_VENV
venv=$VLLM_VENV
if [ $# -gt 0 ] && [[ $1 != -* ]]; then venv=$1; shift; fi
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
out=${OUT:-$root/bench/out/vs_vllm-$(date +%Y%m%d-%H%M%S)}
port=${VLLM_PORT:-8100}
mkdir -p "$out"
# The headline comparison: 64 requests at once, prompts 32-256 tokens, 16-128 output tokens, EOS ignored.
bench_args=(--tokenizer "$model" --ignore-eos --num-requests 64 --prompt-len 32:256 --output-len 16:128
            ${BENCH_ARGS:-} "$@")

# shellcheck source=bench/server_lib.sh
source "$root/bench/server_lib.sh"
dtype=${DTYPE:-float32}
case $dtype in float32|bfloat16|auto) ;; *) echo "DTYPE must be float32, bfloat16 or auto, not $dtype" >&2; exit 2;; esac
peer_dtype=$dtype  # NOTE: not exported: vLLM warns about unknown VLLM_* variables
ps_dtype_args=(--dtype "$dtype")
[ "$dtype" = auto ] && ps_dtype_args=()
busy=""
stop_busy() { if [ -n "$busy" ]; then kill "$busy" 2>/dev/null || true; wait "$busy" 2>/dev/null || true; fi; }
trap 'stop_server; stop_busy' EXIT
if [ "${BUSY:-0}" = 1 ]; then
  "$py" -c 'while True: pass' &
  busy=$!
  echo "== a one-core busy loop beside both servers (pid $busy)" >&2
fi

# --- pagedserve: over gRPC, then (restarted, so its prefix cache starts cold again) its OpenAI-compatible front ---
start_pagedserve() {
  listen=127.0.0.1:$(free_port) workers=127.0.0.1:$(free_port) metrics=127.0.0.1:$(free_port)
  http=127.0.0.1:$(free_port) log=$out/pagedserve_up_$1.log
  echo "== pagedserve up --model $model ${ps_dtype_args[*]} on $listen, HTTP $http (log: $log)" >&2
  # shellcheck disable=SC2086  # PAGEDSERVE_UP_ARGS is a list of words on purpose
  "$py" -m pagedserve_cli.main up --model "$model" "${ps_dtype_args[@]}" --listen "$listen" --worker-listen "$workers" \
    --metrics "$metrics" --http "$http" ${PAGEDSERVE_UP_ARGS:-} >"$log" 2>&1 &
  pid=$!
  until grep -q "pagedserve is up" "$log"; do
    kill -0 "$pid" 2>/dev/null || { tail -20 "$log" >&2; echo "pagedserve up exited" >&2; exit 1; }
    sleep 1
  done
}
start_pagedserve grpc
"$py" -m pagedserve_cli.main bench --server "$listen" --metrics-url "http://$metrics/metrics" \
  --out "$out/pagedserve" "${bench_args[@]}" | tee "$out/pagedserve.txt"
ours_dtype=$(grep '"event": "worker ready"' "$log" | sed -n 's/.*"dtype": "\([a-z0-9]*\)".*/\1/p' | head -1)
stop_server
if [ "${HTTP:-1}" != 0 ]; then
  start_pagedserve http
  # The client vLLM gets below (POST /completions, SSE), against our own front.
  "$py" -m pagedserve_cli.main bench --openai-url "http://$http/v1" --metrics-url "http://$metrics/metrics" \
    --out "$out/pagedserve_http" "${bench_args[@]}" | tee "$out/pagedserve_http.txt"
  stop_server
else
  mkdir -p "$out/pagedserve_http"; echo "(skipped: HTTP=0)" >"$out/pagedserve_http/summary.md"
  echo "output_tok_s=0" >"$out/pagedserve_http.txt"
fi

# --- vLLM ---
start_vllm
"$py" -m pagedserve_cli.main bench --openai-url "http://127.0.0.1:$port/v1" --model smollm2 --metrics-url "" \
  --out "$out/vllm" "${bench_args[@]}" | tee "$out/vllm.txt"
# No match is an answer too ("?" below), not a failure under pipefail.
theirs_dtype=$(grep -o "Downcasting torch.float32 to torch.[a-z0-9]*" "$out/vllm.log" | head -1 | sed 's/.*torch\.//' || true)
theirs_dtype=${theirs_dtype:-$(grep -o "dtype=torch.[a-z0-9]*" "$out/vllm.log" | head -1 | sed 's/.*torch\.//' || true)}
stop_server

# --- side by side ---
echo
cat "$out/pagedserve/summary.md"
echo
cat "$out/pagedserve_http/summary.md"
echo
cat "$out/vllm/summary.md"
echo
if cmp -s "$out/pagedserve/workload.jsonl" "$out/vllm/workload.jsonl"; then
  echo "same workload: yes ($out/pagedserve/workload.jsonl)"
else
  echo "same workload: NO (the two workload.jsonl differ)"
fi
ours=$(tail -1 "$out/pagedserve.txt" | sed -n 's/^output_tok_s=\([0-9.]*\).*/\1/p')
theirs=$(tail -1 "$out/vllm.txt" | sed -n 's/^output_tok_s=\([0-9.]*\).*/\1/p')
http_ours=$(tail -1 "$out/pagedserve_http.txt" | sed -n 's/^output_tok_s=\([0-9.]*\).*/\1/p')
echo "pagedserve_http_output_tok_s=$http_ours"
"$py" -c "import sys; h, g, v = map(float, sys.argv[1:]); print(f'ratio_http_vs_vllm={h / v:.2f} ' if v else \
  'ratio_http_vs_vllm=nan ', f'ratio_http_vs_grpc={h / g:.2f}' if g else 'ratio_http_vs_grpc=nan', sep='')" \
  "$http_ours" "$ours" "$theirs"
echo "dtype_pagedserve=${ours_dtype:-?} dtype_vllm=${theirs_dtype:-?} busy_loop=${BUSY:-0}"
echo "pagedserve_output_tok_s=$ours vllm_output_tok_s=$theirs"
"$py" -c "import sys; a, b = map(float, sys.argv[1:]); print(f'ratio_vs_vllm={a / b:.2f}' if b else \
  'ratio_vs_vllm=nan')" "$ours" "$theirs"
