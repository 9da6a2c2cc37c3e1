#!/bin/sh
# Drops what no pagedserve process loads from /opt/venv before it is copied into the final image: torch's C++
# headers, its C++ test binaries and test data (about 190 MB); torch_shm_manager stays.
set -eu
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/torch/include" "$site/torch/test"
find "$site/torch/bin" -type f ! -name torch_shm_manager -delete
