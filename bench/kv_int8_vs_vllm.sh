#!/usr/bin/env bash
# The KV cache under memory pressure, ours and vLLM's (its CPU build, a measurement peer only), one server at a time
# so that none shares the CPU: `pagedserve bench --compare kv-int8` (a float32 cache, then an int8 one; its default
# workload, whose float32 pool bounds the batch, and its perplexity line), then vLLM with its default cache (float32,
# as --dtype float32) and with `--kv-cache-dtype fp8`, on the same requests (the comparison's workload.jsonl, EOS
# ignored), the same KV bytes (--kv-cache-memory-bytes exactly: VLLM_CPU_KVCACHE_SPACE counts whole GiB only),
# the same --max-num-seqs and --max-model-len, benched with `pagedserve bench --openai-url`. vLLM's sequences
# running are sampled from its /metrics (vllm:num_requests_running) every 0.25 s. If vLLM refuses fp8 on the CPU,
# its error line is printed and the script goes on.
#   usage: bench/kv_int8_vs_vllm.sh [MODEL_DIR] [VLLM_VENV] [more `pagedserve bench --compare kv-int8` args]
#          (MODEL_DIR default: the default model's; VLLM_VENV: bench/peers/defaults.sh's)
#   env:   KV_BYTES (134217728 = the comparison's default 128MiB), MAX_NUM_SEQS (256), MAX_MODEL_LEN (512),
#          VLLM_ARGS more vLLM api_server args; VLLM_PORT (8100); OUT (bench/out/kv_int8_vs_vllm-DATE); PYTHON;
#          PAGEDSERVE_OUT: the --out of a finished `pagedserve bench --compare kv-int8` at the same KV bytes, reused
#          (its compare.json and workload.jsonl) instead of running ours again
set -euo pipefail
py=${PYTHON:-python}
model=""
if [ $# -gt 0 ] && [[ $1 != -* ]]; then model=$1; shift; fi
model=${model:-$("$py" -c 'from pagedserve_cli.serve_cmd import model_dir; from pagedserve_common.defaults import DEFAULT_MODEL; print(model_dir(DEFAULT_MODEL))')}
source "$(dirname "$0")/peers/defaults.sh"  # PEERS, VLLM_VENV
venv=$VLLM_VENV
if [ $# -gt 0 ] && [[ $1 != -* ]]; then venv=$1; shift; fi
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/bench/out/kv_int8_vs_vllm-$(date +%Y%m%d-%H%M%S)}
port=${VLLM_PORT:-8100}
kv_bytes=${KV_BYTES:-134217728}
max_num_seqs=${MAX_NUM_SEQS:-256}
max_model_len=${MAX_MODEL_LEN:-512}
mkdir -p "$out"
# shellcheck source=bench/server_lib.sh
source "$root/bench/server_lib.sh"

# --- ours: float32 cache, then int8 (each its own `pagedserve up`, stopped before the next) ---
if [ -n "${PAGEDSERVE_OUT:-}" ]; then
  ln -sfn "$(cd "$PAGEDSERVE_OUT" && pwd)" "$out/pagedserve"
  echo "reusing $PAGEDSERVE_OUT"
else
  "$py" -m pagedserve_cli.main bench --compare kv-int8 --model "$model" --kv-memory "$kv_bytes" \
    --max-num-seqs "$max_num_seqs" --max-model-len "$max_model_len" --no-progress --out "$out/pagedserve" "$@" \
    | tee "$out/pagedserve.txt"
fi
got=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["config"]["spawn"]["kv_memory"])' \
  "$out/pagedserve/compare.json")
"$py" -c 'import sys; from pagedserve_common.units import parse_bytes; a, b = sys.argv[1:]
sys.exit(0 if parse_bytes(a) == int(b) else f"ours ran with --kv-memory {a}, not KV_BYTES={b}")' "$got" "$kv_bytes"

# --- vLLM: its default cache, then fp8, on the same requests and KV bytes ---
poll_running() {  # "running waiting" from vLLM's /metrics every 0.25 s, until killed
  while :; do
    curl -s "http://127.0.0.1:$port/metrics" | awk '/^vllm:num_requests_running/ {r = $NF}
      /^vllm:num_requests_waiting/ {w = $NF} END {if (r != "") print r, w}' || true
    sleep 0.25
  done
}
export VLLM_KV_CACHE_BYTES=$kv_bytes VLLM_MAY_FAIL=1
base_args=${VLLM_ARGS:-}
for cache in auto fp8; do
  VLLM_ARGS="--max-num-seqs $max_num_seqs --max-model-len $max_model_len --kv-cache-dtype $cache $base_args"
  if start_vllm; then
    poll_running >"$out/vllm-$cache.running" &
    poller=$!
    "$py" -m pagedserve_cli.main bench --openai-url "http://127.0.0.1:$port/v1" --model smollm2 --metrics-url "" \
      --tokenizer "$model" --workload "$out/pagedserve/workload.jsonl" --ignore-eos --no-progress \
      --out "$out/vllm-$cache" | tee "$out/vllm-$cache.txt"
    kill "$poller" 2>/dev/null || true
    wait "$poller" 2>/dev/null || true
    stop_server
  else
    echo "vLLM --kv-cache-dtype $cache refused to start: $(grep -E 'Error|error' "$out/vllm.log" | tail -1)"
  fi
  mv "$out/vllm.log" "$out/vllm-$cache.log"
done

# --- side by side ---
echo
"$py" - "$out" <<'PY'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
doc = json.loads((out / "pagedserve" / "compare.json").read_text())
rows = []
for s in doc["sides"]:
    slots = sum(w["num_blocks"] * w.get("block_size", 16) for w in s["workers"])
    rows.append((f"pagedserve {s['name']}", slots, s["usage"]["mean_running"],
                 s["summary"]["output_tok_s"], s["summary"]["completed"]))
for cache in ("auto", "fp8"):
    log = (out / f"vllm-{cache}.log").read_text(errors="replace")
    if not (out / f"vllm-{cache}" / "results.json").exists():
        rows.append((f"vLLM {cache}", None, None, None, 0))
        continue
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    samples = [tuple(map(float, line.split())) for line in (out / f"vllm-{cache}.running").read_text().splitlines()
               if len(line.split()) == 2]
    busy = [r for r, w in samples if r + w > 0]
    summary = json.loads((out / f"vllm-{cache}" / "results.json").read_text())["summary"]
    rows.append((f"vLLM {cache}", int(m[1].replace(",", "")) if m else None,
                 sum(busy) / len(busy) if busy else None, summary["output_tok_s"], summary["completed"]))
fmt = lambda v, f: "n/a" if v is None else format(v, f)
print(f"KV bytes {doc['config']['spawn']['kv_memory']} on every side; {doc['config']['num_requests']} requests")
print("| server, KV cache | KV token slots | mean running | output tok/s | completed |")
print("| --- | --- | --- | --- | --- |")
for name, slots, running, tok_s, done in rows:
    print(f"| {name} | {fmt(slots, ',')} | {fmt(running, '.1f')} | {fmt(tok_s, '.1f')} | {done} |")
ratio = lambda a, b: "nan" if a is None or not b else f"{a / b:.2f}"
(_, s_a, r_a, t_a, _), (_, s_f, r_f, t_f, _) = rows[2], rows[3]
print(f"vllm_fp8_over_auto: kv_tokens_ratio={ratio(s_f, s_a)} concurrency_ratio={ratio(r_f, r_a)} "
      f"throughput_ratio={ratio(t_f, t_a)}")
print(doc["last_line"])
PY
