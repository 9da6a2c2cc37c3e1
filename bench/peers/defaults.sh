# Sourced by the bench/*.sh scripts that run a peer: where the peers' scripts and virtual environments are.
#   PEERS           this folder (bench/peers of the tree that sources it)
#   VLLM_VENV       vLLM's CPU serving build (setup_vllm_serve.sh), default $PAGEDSERVE_CACHE/peers/vllm-serve
#   VLLM_CORE_VENV  vLLM's V1 core alone (setup_vllm_core.sh), default $PAGEDSERVE_CACHE/peers/vllm-core
# ($PAGEDSERVE_CACHE defaults to ~/.cache/pagedserve, where `pagedserve model pull` keeps models.) A venv that is
# missing is built by the script that needs it; an existing one elsewhere is used by setting the variable.
PEERS=${PEERS:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
peers_cache=${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}/peers
VLLM_VENV=${VLLM_VENV:-$peers_cache/vllm-serve}
VLLM_CORE_VENV=${VLLM_CORE_VENV:-$peers_cache/vllm-core}
