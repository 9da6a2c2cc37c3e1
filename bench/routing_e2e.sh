#!/usr/bin/env bash
# Routing for real: `pagedserve up --workers 3` under each --routing policy, the same `pagedserve bench`
# multi-tenant workload each time; prints each summary, then `completion_s_kv=… completion_s_rr=…` and
# `hit_rate_kv=A hit_rate_rr=B ratio=A/B` (hit rates from the server's own prefix-cache counters).
# CHAT=1: the chat workload instead (every prompt shares the chat template's system prefix) under kv and
# least-loaded, each worker's share of the requests (the scheduler's `request finished` lines), then
# `max_worker_share_kv=S throughput_ratio_kv_ll=R` (output tokens/s, kv over least-loaded).
#   usage: bench/routing_e2e.sh [extra bench args]
#   env:   WORKERS (3; CHAT=1: 2), KV_MEMORY per worker (200MiB: about 2/3 of 12 tenants' system prompts with the
#          default model in float32), UP_ARGS (more `pagedserve up` args), OUT (default bench/out/routing-DATE),
#          PYTHON
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
out=${OUT:-$root/bench/out/routing-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
bench_args=(--workload multi-tenant --num-tenants 12 --num-requests 90 --rate 0.6 --output-len 8:24 --ignore-eos
            --prompt-len 16:48 "$@")
policies=(kv round-robin)
if [ "${CHAT:-}" = 1 ]; then
  bench_args=(--workload chat --num-requests 64 --rate 4 --output-len 32:96 --ignore-eos "$@")
  policies=(kv least-loaded)
  WORKERS=${WORKERS:-2}
fi

# shellcheck source=bench/server_lib.sh
source "$root/bench/server_lib.sh"

for policy in "${policies[@]}"; do
  listen=127.0.0.1:$(free_port) workers=127.0.0.1:$(free_port) metrics=127.0.0.1:$(free_port)
  echo "== pagedserve up --workers ${WORKERS:-3} --routing $policy (log: $out/up-$policy.log)" >&2
  # shellcheck disable=SC2086
  "$py" -m pagedserve_cli.main up --workers "${WORKERS:-3}" --routing "$policy" --dtype float32 \
    --kv-memory "${KV_MEMORY:-200MiB}" --listen "$listen" --worker-listen "$workers" --metrics "$metrics" \
    ${UP_ARGS:-} >"$out/up-$policy.log" 2>&1 &
  pid=$!
  until grep -q "pagedserve is up" "$out/up-$policy.log"; do
    kill -0 "$pid" 2>/dev/null || { tail -20 "$out/up-$policy.log" >&2; exit 1; }
    sleep 1
  done
  "$py" -m pagedserve_cli.main bench --server "$listen" --metrics-url "http://$metrics/metrics" --no-progress \
    --out "$out/$policy" "${bench_args[@]}" | tee "$out/$policy.txt"
  stop_server
done

"$py" - "$out" "${policies[@]}" <<'EOF'
import json, sys
from collections import Counter
out, policies = sys.argv[1], sys.argv[2:]
s = {p: json.load(open(f"{out}/{p}/results.json"))["summary"] for p in policies}
for p, v in s.items():
    assert v["failed"] == 0, f"{p}: {v['failed']} requests failed"
if "least-loaded" in policies:
    def share(p):  # each worker's share of the finished requests, from the scheduler's lines in up's log
        lines = [json.loads(ln) for ln in open(f"{out}/up-{p}.log") if '"request finished"' in ln]
        count = Counter(e.get("worker") for e in lines if e.get("event") == "request finished")
        print(f"{p}: requests per worker {dict(sorted(count.items()))}")
        return max(count.values()) / sum(count.values())
    kv_share, _ = share("kv"), share("least-loaded")
    ratio = s["kv"]["output_tok_s"] / s["least-loaded"]["output_tok_s"]
    print(f"max_worker_share_kv={kv_share:.3f} throughput_ratio_kv_ll={ratio:.3f}")
    sys.exit(0)
kv, rr = (s[p]["server"]["prefix_hit_rate"] for p in ("kv", "round-robin"))
print(f"completion_s_kv={s['kv']['wall_s']:.1f} completion_s_rr={s['round-robin']['wall_s']:.1f}")
print(f"hit_rate_kv={kv:.3f} hit_rate_rr={rr:.3f} ratio={kv / rr:.3f}")
EOF
