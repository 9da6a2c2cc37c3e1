# Sourced by the bench/*.sh scripts that run a peer (and read by bench/vs_llamacpp.py): where the peers' scripts,
# virtual environments and builds are.
#   PEERS           this folder (bench/peers of the tree that sources it)
#   VLLM_VENV       vLLM's CPU serving build (setup_vllm_serve.sh), default $PAGEDSERVE_CACHE/peers/vllm-serve
#   VLLM_CORE_VENV  vLLM's V1 core alone (setup_vllm_core.sh), default $PAGEDSERVE_CACHE/peers/vllm-core
#   LLAMACPP_DIR    llama.cpp's llama-server and llama-perplexity in bin/ (setup_llamacpp.sh), default
#                   $PAGEDSERVE_CACHE/peers/llamacpp
# ($PAGEDSERVE_CACHE defaults to ~/.cache/pagedserve, where `pagedserve model pull` keeps models.) A peer that is
# missing is built by the script that needs it; an existing one elsewhere is used by setting the variable.
PEERS=${PEERS:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
peers_cache=${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}/peers
VLLM_VENV=${VLLM_VENV:-$peers_cache/vllm-serve}
VLLM_CORE_VENV=${VLLM_CORE_VENV:-$peers_cache/vllm-core}
LLAMACPP_DIR=${LLAMACPP_DIR:-$peers_cache/llamacpp}
