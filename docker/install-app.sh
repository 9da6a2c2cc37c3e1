#!/bin/sh
# Installs pagedserve from /src into /opt/venv (its dependencies are there already), prebuilds the CPU attention
# kernel for portable targets (the final image has no compiler), keeps the CUDA sources, drops what no process loads.
set -eu
here=$(dirname "$0")
"$here/pip-install.sh" --no-deps /src
# NOTE: from /, so that python imports the installed package, not /src's copy.
cd / && python -m worker_svc.attention.cpu_backend --prebuild
mkdir -p /opt/venv/share/pagedserve && cp -r /src/cuda /opt/venv/share/pagedserve/cuda
"$here/slim-venv.sh"
