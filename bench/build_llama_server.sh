#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the peer of `python -m bench.engine --peers`) from the llama.cpp
# source vendored in the llama-cpp-python sdist on PyPI. Not run by CI; nothing is downloaded from a model hub.
#
# Usage: bash bench/build_llama_server.sh [OUT_DIR]      (default: bench/.peers, gitignored)
# Prints the path of the built binary on its last line.
#
# Why these flags: on the VM kind this project is measured on, a -march=native build (and the server of
# `pip install llama-cpp-python`) died with SIGILL / a general protection fault (AMX inside a VM). So the
# build is not native: AVX512 (+VNNI, BF16, VBMI) is switched on explicitly when /proc/cpuinfo shows it,
# and AVX2 only otherwise.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/.peers}"
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
mkdir -p "$out"
cd "$out"

sdist="$(ls llama_cpp_python-*.tar.gz 2>/dev/null | tail -1 || true)"
if [[ -z "$sdist" ]]; then
    "$python" -m pip download --no-deps --no-binary :all: llama-cpp-python -d .
    sdist="$(ls llama_cpp_python-*.tar.gz | tail -1)"
fi
src="${sdist%.tar.gz}"
[[ -d "$src" ]] || tar xzf "$sdist"
llama="$src/vendor/llama.cpp"
[[ -f "$llama/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in $sdist" >&2; exit 1; }

flags=(-DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_OPENMP=ON)
cpu_flags="$(grep -m1 '^flags' /proc/cpuinfo || true)"
has() { [[ " $cpu_flags " == *" $1 "* ]]; }
if has avx512f; then
    flags+=(-DGGML_AVX512=ON)
    has avx512_vnni && flags+=(-DGGML_AVX512_VNNI=ON)
    has avx512_bf16 && flags+=(-DGGML_AVX512_BF16=ON)
    has avx512vbmi && flags+=(-DGGML_AVX512_VBMI=ON)
fi
has avx2 && flags+=(-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
echo "cmake flags: ${flags[*]}" >&2

cmake -S "$llama" -B build "${flags[@]}" >&2
cmake --build build --target llama-server -j "$jobs" >&2
bin="$out/build/bin/llama-server"
[[ -x "$bin" ]] || { echo "build finished without $bin" >&2; exit 1; }
echo "$bin"
