#!/usr/bin/env bash
# A change's figures against an earlier commit, measured back to back on this machine: each benchmark runs on the
# old tree, then at once on this one (a git worktree of BASE; the same venv, each tree first on PYTHONPATH).
#   usage: bench/before_after.sh BASE_REV [FIGURES]      FIGURES: any of sched_scale sched_vs_vllm vs_vllm
#                                                                  plan_codec suite (default: all of them)
#   env:   VLLM_CORE_VENV, VLLM_VENV, PEERS: the peers (bench/peers/defaults.sh; this tree's bench/peers for both);
#          MODEL_DIR (default: `pagedserve model pull`'s); OUT (bench/out/before_after-YYYYmmdd-HHMMSS); PYTHON;
#          ROUNDS (1): sched_scale runs before, after, before, after, ... ROUNDS times each and reports the medians
#          (a noisy shared machine slows whole minutes down: alternating puts both sides in the same minutes)
# Every line it prints that starts with `before_after` names a figure and its two values: `before=X after=Y`.
set -euo pipefail
base_rev=${1:?usage: bench/before_after.sh BASE_REV [FIGURES]}
shift
figures=${*:-sched_scale sched_vs_vllm vs_vllm plan_codec suite}
new=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
# NOTE: both trees run this tree's peers (BASE's may predate bench/peers, or pin another vLLM): the same peer on
# both sides
# shellcheck source=bench/peers/defaults.sh
source "$new/bench/peers/defaults.sh"
export PEERS VLLM_VENV VLLM_CORE_VENV
out=${OUT:-$new/bench/out/before_after-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
base=$(mktemp -d)/base
git -C "$new" worktree add -q --detach "$base" "$base_rev"
trap 'git -C "$new" worktree remove --force "$base"' EXIT
echo "before: $base_rev ($(git -C "$base" log -1 --format=%h)), after: $(git -C "$new" log -1 --format=%h)" \
     "+ uncommitted: $(git -C "$new" status --porcelain | wc -l) files; out: $out"

in_tree() {  # in_tree TREE CMD...: runs CMD in TREE with TREE's packages first on the path
  local tree=$1
  shift
  (cd "$tree" && PYTHONPATH="$tree:$tree/protos" "$@")
}

median_mean() {  # median_mean SIDE B: sched_scale's mean ms per step at batch B, the median over the rounds
  # NOTE: the table's row `batch B 0 16 mean_ms ...`, as both versions print it
  cat "$out"/sched_scale_"$1"_*.txt | awk -v b="$2" '$1 == "batch" && $2 == b {print $5}' | sort -g |
    awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'
}

field() {  # field FILE NAME: the last NAME=value in FILE
  grep -o "$2=[^ ]*" "$1" | tail -1 | cut -d= -f2
}

for figure in $figures; do
  case $figure in
  sched_scale)  # mean ms per step at B = 64, 256, 1,024 (100,000 queued) and the longest pause
    for round in $(seq "${ROUNDS:-1}"); do
      for side in before after; do
        tree=$([ $side = before ] && echo "$base" || echo "$new")
        in_tree "$tree" "$py" bench/sched_scale.py --batch-sizes 64,256,1024 --cached-blocks "" --block-sizes "" \
          --out "$out/sched_scale_${side}_$round" > "$out/sched_scale_${side}_$round.txt"
      done
    done
    for b in 64 256 1024; do
      echo "before_after sched_scale_mean_ms_B$b before=$(median_mean before $b) after=$(median_mean after $b)"
    done
    # The longest pause at B=1,024: after, the longest step whole (max_step_ms); before (which timed full
    # collections apart), the mean full-collection pause it reported (full_gc_ms) at the largest batch. The largest
    # over the rounds.
    echo "before_after sched_scale_longest_pause_ms" \
         "before=$(cat "$out"/sched_scale_before_*.txt | grep -o 'pause_ms=[^ ]*' | cut -d= -f2 | sort -g | tail -1)" \
         "after=$(cat "$out"/sched_scale_after_*.txt | grep -o 'max_step_ms=[^ ]*' | cut -d= -f2 | sort -g | tail -1)"
    ;;
  sched_vs_vllm)
    bash "$PEERS/setup_vllm_core.sh" "$VLLM_CORE_VENV"  # idempotent; BASE's script may not build it
    for side in before after; do
      tree=$([ $side = before ] && echo "$base" || echo "$new")
      PYTHONPATH="$tree:$tree/protos" bash "$tree/bench/sched_scale_vs_vllm.sh" "$VLLM_CORE_VENV" \
        > "$out/sched_vs_vllm_$side.txt"
    done
    echo "before_after sched_vs_vllm before=\"$(tail -1 "$out/sched_vs_vllm_before.txt")\"" \
         "after=\"$(tail -1 "$out/sched_vs_vllm_after.txt")\""
    ;;
  vs_vllm)
    model=${MODEL_DIR:-$(cd "$new" && "$py" -m pagedserve_cli.main model pull | tail -1)}
    bash "$PEERS/setup_vllm_serve.sh" "$VLLM_VENV"  # idempotent; BASE's scripts may look for it elsewhere
    for side in before after; do
      tree=$([ $side = before ] && echo "$base" || echo "$new")
      # NOTE: from inside TREE: `python -m` puts the working directory ahead of PYTHONPATH
      in_tree "$tree" env OUT="$out/vs_vllm_$side" bash bench/vs_vllm.sh "$model" \
        "$VLLM_VENV" > "$out/vs_vllm_$side.txt" 2> "$out/vs_vllm_$side.err"
    done
    echo "before_after ratio_vs_vllm before=$(field "$out/vs_vllm_before.txt" ratio_vs_vllm)" \
         "after=$(field "$out/vs_vllm_after.txt" ratio_vs_vllm)"
    ;;
  plan_codec)  # one step's plan and result through the worker protocol at batch 256: ms per step
    # NOTE: the old layout had a plan type on each side and two converters; the same shapes, timed its way
    # (its scheduler also read the raw result's logprobs, in Engine.dispatch: counted here too).
    cat > "$out/plan_codec_base.py" <<'PY'
import statistics, time
from pagedserve.v1 import worker_pb2
from scheduler_svc.convert import plan_to_pb, result_from_pb
from scheduler_svc.core.plan import NewSeqPlan, RunningSeqPlan, StepPlan
from scheduler_svc.core.request import SamplingConfig
from worker_svc.convert import plan_from_pb, result_to_pb
from worker_svc.plan import StepOutput
B, PROMPT, SP = 256, 512, SamplingConfig(max_tokens=128, temperature=0.8, seed=7)
def decode(step):
    return StepPlan(step, running=[RunningSeqPlan(i, [B * 8 + i] if step % 16 == 0 else [], 1) for i in range(B)])
def admit(step):
    nb = -(-PROMPT // 16)
    return StepPlan(step, new=[NewSeqPlan(i, list(range(i, i + PROMPT)), list(range(i * nb, (i + 1) * nb)), 0,
                                          PROMPT, SP, 1000 + i) for i in range(B)])
for name, make, steps in (("decode", decode, 200), ("admit", admit, 10)):
    totals = []
    for _ in range(5):
        t0 = time.perf_counter()
        plans = [make(s) for s in range(steps)]
        for plan in plans:
            plan_from_pb(worker_pb2.StepPlan.FromString(plan_to_pb(plan).SerializeToString()))
            out = StepOutput(plan.step_id, list(range(B)), [100 + i for i in range(B)], [None] * B, 0.0)
            res = worker_pb2.StepResult.FromString(result_to_pb(out).SerializeToString())
            result_from_pb(res), {t.seq_id: t.logprobs for t in res.tokens if t.HasField("logprobs")}
        totals.append(1e3 * (time.perf_counter() - t0) / steps)
    print(f"plan_codec shape={name} batch={B} dataclass_total_ms={statistics.median(totals):.3f}")
PY
    in_tree "$base" "$py" "$out/plan_codec_base.py" > "$out/plan_codec_before.txt"
    in_tree "$new" "$py" bench/plan_codec.py > "$out/plan_codec_after.txt"
    for shape in decode admit; do
      echo "before_after plan_codec_${shape}_ms_B256" \
        "before=$(grep "shape=$shape" "$out/plan_codec_before.txt" | grep -o 'dataclass_total_ms=[^ ]*' | cut -d= -f2)" \
        "after=$(grep "shape=$shape" "$out/plan_codec_after.txt" | grep -o 'dataclass_total_ms=[^ ]*' | cut -d= -f2)"
    done
    ;;
  suite)  # the README's test command, wall seconds
    for side in before after; do
      tree=$([ $side = before ] && echo "$base" || echo "$new")
      t0=$(date +%s)
      in_tree "$tree" "$py" -m pytest -q -p no:cacheprovider > "$out/suite_$side.txt" 2>&1 || true
      echo "$(( $(date +%s) - t0 ))" > "$out/suite_$side.seconds"
      tail -1 "$out/suite_$side.txt"
    done
    echo "before_after suite_wall_s before=$(cat "$out/suite_before.seconds") after=$(cat "$out/suite_after.seconds")"
    ;;
  *) echo "unknown figure: $figure" >&2; exit 2 ;;
  esac
done
