# Sourced by the bench/*.sh scripts: a free loopback port, starting vLLM (start_vllm), and stopping the one server a
# script started. Needs $py (the Python to run) and $root (the repository); sets $pid to "" and traps EXIT so the server never outlives the script.

# shellcheck source=bench/peers/defaults.sh
source "$root/bench/peers/defaults.sh"

free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

pid=""
stop_server() {  # only the server this script started, by its pid; it stops its own children
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 90); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  pid=""
}
trap stop_server EXIT

# vLLM's OpenAI server (its CPU build, set up in $venv by bench/peers/setup_vllm_serve.sh if missing) for $model as "smollm2" on 127.0.0.1:$port,
# $peer_dtype (float32), plus $VLLM_ARGS; its log in $out/vllm.log. Sets $pid; returns once it is healthy (exits if it dies first).
# Its KV cache: $VLLM_KV_CACHE_BYTES bytes exactly when set (--kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE, whole
# GiB only, is then unset, since vLLM lets it override the bytes), else VLLM_CPU_KVCACHE_SPACE GiB (default 1).
# With VLLM_MAY_FAIL=1 a vLLM that exits before it is healthy makes start_vllm return 1 (log kept) instead of exiting.
start_vllm() {
  if ! "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
    bash "$PEERS/setup_vllm_serve.sh" "$venv"
  fi
  echo "== vLLM on 127.0.0.1:$port (log: $out/vllm.log)" >&2
  local kv_env=(env "VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}") kv_args=()
  if [ -n "${VLLM_KV_CACHE_BYTES:-}" ]; then
    kv_env=(env -u VLLM_CPU_KVCACHE_SPACE) kv_args=(--kv-cache-memory-bytes "$VLLM_KV_CACHE_BYTES")
  fi
  # $peer_dtype (default float32): its --dtype; "auto" passes none (vLLM's own default: bfloat16 on a CPU with
  # AVX512-BF16 or AMX, where it logs the downcast).
  local vllm_dtype_args=(--dtype "${peer_dtype:-float32}")
  [ "${peer_dtype:-float32}" = auto ] && vllm_dtype_args=()
  # shellcheck disable=SC2086  # VLLM_ARGS is a list of words on purpose
  "${kv_env[@]}" "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$model" --served-model-name smollm2 "${vllm_dtype_args[@]}" --host 127.0.0.1 --port "$port" "${kv_args[@]}" \
    ${VLLM_ARGS:-} >"$out/vllm.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -20 "$out/vllm.log" >&2
      echo "vLLM exited" >&2
      if [ -n "${VLLM_MAY_FAIL:-}" ]; then wait "$pid" 2>/dev/null || true; pid=""; return 1; fi
      exit 1
    fi
    sleep 2
  done
}
