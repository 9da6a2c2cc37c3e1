#!/usr/bin/env bash
# A CPU-only virtual environment holding vLLM's V1 KV-cache manager and scheduler (vLLM 0.33.0, torch 2.13.0), for
# side-by-side figures on a machine without a GPU: bench/peers/vllm_kv.py and vllm_sched.py import them. Nothing
# here runs a model. About 70 s and 2.2 GB; idempotent (a venv that already imports them is left as it is).
#   usage: bench/peers/setup_vllm_core.sh VENV_DIR
#   env:   TORCH_INDEX_URL  an index for torch's CPU wheel (e.g. https://download.pytorch.org/whl/cpu; unset: pip's
#                           own configuration, which on PyPI's Linux x86 wheel index gives the larger CUDA build)
# See docs/benchmarks.md ("Peers").
set -euo pipefail
venv=${1:?usage: setup_vllm_core.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm.v1.core.kv_cache_manager" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
"$venv/bin/pip" install -q --no-deps vllm==0.33.0
# vLLM's pure-Python needs, pinned; torch stays the build installed above, triton is not needed.
"$venv/bin/pip" install -q --no-deps -r "$here/vllm-core-requirements.txt"
# NOTE: vllm._C (its compiled ops) is absent from this install and vLLM warns about it on import: the scheduler and
# the KV-cache manager never call it.
"$venv/bin/python" -c "import vllm.v1.core.kv_cache_manager, vllm.v1.core.sched.scheduler" 2>&1 | grep -v "vllm._C" || true
echo "vLLM V1 core ready in $venv"
