#!/usr/bin/env bash
# The one prepared run for a lent GPU (at most 590 s: each step has its own cap, to fit one 600 s device call): GPU
# kernel and token tests (float and 8-bit caches, quantised weights, batch invariance of attention and of the dense
# matmul and norm), then bench/gpu_kernels.py (float16/bfloat16 decode and prefill vs SDPA, the 8-bit caches'
# quantising write, decode at 4k/32k contexts and prefill, each with its achieved bandwidth; the decode split sweep
# with batch invariance's one split), then bench/gpu_quant_gemm.py (the quantised-weight matmul against a bfloat16
# matmul of the dequantised weight), then bench/gpu_invariant.py (cuda/dense_gemm.cu's batch-invariant matmul and
# RMSNorm against cuBLAS and torch's).
# Run on the device machine from the repo root: `bash bench/device_check.sh` (its output lands in $OUT).
# That machine has python3 with torch, cupy, transformers and pytest but no registry: carry anything missing
# as wheels in .whl/ (protobuf >= 7.35 for pagedserve.v1 when its own is older); they are installed first.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pagedserve-device}
mkdir -p "$OUT"
site=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && site=/tmp/site
fi
export PYTHONPATH="${site:+$site:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, cupy, google.protobuf as p; print('torch', torch.__version__, 'cupy', cupy.__version__, 'protobuf', p.__version__)"
} 2>&1 | tee "$OUT/env.txt"
timeout 200 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 200 python3 bench/gpu_kernels.py 2>&1 | tee "$OUT/kernels.txt"
timeout 90 python3 bench/gpu_quant_gemm.py 2>&1 | tee "$OUT/quant_gemm.txt"
timeout 100 python3 bench/gpu_invariant.py 2>&1 | tee "$OUT/invariant.txt"
