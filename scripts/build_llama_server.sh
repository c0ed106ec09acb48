#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, the CPU anchor of benchmarks/serve.py (contender
# `llama-server`), from the llama.cpp tree that the llama-cpp-python sdist carries.
#
#   scripts/build_llama_server.sh          # prints the binary's path (builds it once)
#
# No wheel ships llama-server. The sdist of llama-cpp-python==0.3.36 (PyPI) vendors llama.cpp
# under vendor/llama.cpp; this script downloads that sdist with pip, builds only the server
# target with CMake for this CPU (-DGGML_NATIVE=ON: every instruction set the CPU has, AVX-512
# and VNNI included), statically linked, and keeps the binary outside the repository:
#   ${LLAMA_SERVER_DIR:-~/.cache/vllm-unified/llama-server-0.3.36-noamx-<cpu digest>}/llama-server
# Except AMX: on an Intel Xeon with AMX this llama.cpp's AMX matmul (ggml_backend_amx_mul_mat)
# dies with SIGSEGV while loading the default model (seen 2026-12-05), so the compiler is told
# not to use AMX (-mno-amx-*): ggml then uses its AVX-512 kernels with weight repacking, the
# fastest configuration of this version that runs here (the alternative, --no-repack at run
# time, also turns off the repacked AVX-512 kernels).
# The directory name carries a digest of /proc/cpuinfo's flags, since a native build runs only
# on CPUs with the same instruction sets. A second run with the binary present prints its path
# and does nothing else. About 15 minutes on 2 cores; MAX_JOBS sets the compile jobs (default:
# all CPUs). Needs a C/C++ compiler and CMake (installed into .venv from PyPI when missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="0.3.36"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'build_llama_server.sh: error: %s\n' "$*" >&2; exit 1; }

[[ -x "$PY" ]] || die "$PY not found: run scripts/setup.sh first (or set PYTHON=...)"
if [[ -r /proc/cpuinfo ]]; then
    cpu_digest="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
else
    cpu_digest="$(uname -m)"
fi
DEST="${LLAMA_SERVER_DIR:-$HOME/.cache/vllm-unified/llama-server-$VERSION-noamx-$cpu_digest}"
BIN="$DEST/llama-server"
if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

command -v c++ >/dev/null 2>&1 || die "no C++ compiler (c++) on the PATH"
if ! command -v cmake >/dev/null 2>&1; then
    say "installing CMake from PyPI into $(dirname "$PY")"
    "$PY" -m pip install --quiet cmake ninja
    export PATH="$(dirname "$PY"):$PATH"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
say "downloading the llama-cpp-python==$VERSION sdist"
"$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$WORK" \
    "llama-cpp-python==$VERSION"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || die "the sdist has no vendor/llama.cpp"

JOBS="${MAX_JOBS:-$(getconf _NPROCESSORS_ONLN)}"
NO_AMX=""
if [[ "$(uname -m)" == x86_64 ]]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
say "building llama-server ($JOBS jobs; about 15 minutes on 2 cores)"
start=$SECONDS
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    >"$WORK/cmake.log" 2>&1 \
    || { tail -30 "$WORK/cmake.log" >&2; die "CMake configuration failed"; }
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log" >&2; die "the build failed"; }
mkdir -p "$DEST"
install -m 0755 "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
say "built in $((SECONDS - start)) s: $BIN"
echo "$BIN"
