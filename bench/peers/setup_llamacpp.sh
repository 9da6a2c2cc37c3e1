#!/usr/bin/env bash
# llama.cpp's own server (llama-server: continuous batching over parallel slots, the OpenAI-compatible API) and its
# llama-perplexity, built from source, the peer of bench/vs_llamacpp.py (which runs this when they are missing). The
# source is the llama.cpp tree that the PyPI sdist llama-cpp-python 0.3.36 vendors (vendor/llama.cpp, ggml 0.25.3),
# pinned by version and sha256 below; only the C++ programs are built, not the Python wrapper (whose own server
# runs one request at a time). A measurement peer only, never a dependency of pagedserve. GGML_NATIVE=ON: the
# binaries are built for THIS CPU (-march=native, less AMX: see the NOTE below) and may not run on another; llama.cpp's
# own libraries are linked in statically, so DIR/bin holds all they need beyond the system's C++ and OpenMP
# runtimes. Needs a C and C++ compiler; cmake and ninja from PATH, else pip installs them into DIR/tools.
# About 20 minutes on a 2-core machine (18 measured beside a test suite; the download is 77 MB; DIR keeps the sdist
# and bin/, ~100 MB; the build tree is removed); idempotent.
#   usage: bench/peers/setup_llamacpp.sh DIR
#   env:   PYTHON (python3, for pip)   JOBS (build jobs, default: the cores)
# See docs/benchmarks.md ("Peers").
set -eu
dir=${1:?usage: setup_llamacpp.sh DIR}
ready() { "$dir/bin/llama-server" --version >/dev/null 2>&1 && "$dir/bin/llama-perplexity" --version >/dev/null 2>&1; }
if [ -x "$dir/bin/llama-server" ] && [ -x "$dir/bin/llama-perplexity" ] && ready; then
  exit 0
fi
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
py=${PYTHON:-python3}
sdist=$dir/sdist/llama_cpp_python-$version.tar.gz
mkdir -p "$dir/sdist" "$dir/bin"
if ! echo "$sha256  $sdist" | sha256sum -c --status 2>/dev/null; then
  rm -f "$sdist"
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir/sdist"
fi
echo "$sha256  $sdist" | sha256sum -c --quiet || { echo "$sdist: not the pinned sdist (sha256)" >&2; exit 1; }

work=$(mktemp -d "$dir/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  "$py" -m venv "$dir/tools"
  "$dir/tools/bin/pip" install -q cmake ninja
  PATH=$dir/tools/bin:$PATH
fi
# NOTE: no git metadata in an sdist: the commit is named after the pin, which `--version` then prints.
# NOTE: AMX off (-mno-amx-*: explicit, so -march=native, which comes later, does not turn it back on). This
# tree's AMX matmul (ggml-cpu/amx/mmq.cpp, used for Q4_0/Q4_1/Q8_0/K-quant weights on a CPU with AMX) dies with
# SIGILL at its first tile instruction (`tilezero` in tinygemm_kernel_amx, seen on a Xeon with amx_int8 at the
# warm-up of llama-server and in llama-perplexity): the tile configuration it loads is not what the kernel needs
# (llama.cpp PR #26954, open). Without it those weights take the AVX512-VNNI/AVX2 dot products; on a CPU without
# AMX the flags change nothing.
nix_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_C_FLAGS="$nix_amx" -DCMAKE_CXX_FLAGS="$nix_amx" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_COMMIT="llama-cpp-python-$version" >"$work/cmake.log" 2>&1 \
  || { tail -30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" -j "${JOBS:-$(nproc)}" --target llama-server llama-perplexity
install -m 755 "$work/build/bin/llama-server" "$work/build/bin/llama-perplexity" "$dir/bin/"
ready || { echo "the built binaries do not run" >&2; exit 1; }
"$dir/bin/llama-server" --version 2>&1 | head -2
