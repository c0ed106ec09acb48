#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, the CPU anchor of benchmarks/serve.py (contender
# `llama-server`), from the llama.cpp tree that the llama-cpp-python sdist carries.
#
#   scripts/build_llama_server.sh                # native build; prints the binary's path
#   scripts/build_llama_server.sh --isa avx512   # AVX-512 (F/CD/VL/DQ/BW, VBMI, VNNI, BF16)
#   scripts/build_llama_server.sh --isa avx2     # AVX2 + FMA + F16C + BMI2, no AVX-512
#   scripts/build_llama_server.sh --isa avxvnni  # the same + AVX-VNNI (Intel client CPUs)
#
# No wheel ships llama-server. The sdist of llama-cpp-python==0.3.36 (PyPI) vendors llama.cpp
# under vendor/llama.cpp; this script downloads that sdist with pip, builds only the server
# target with CMake, statically linked, and keeps the binary outside the repository.
#
# --isa native (the default): -DGGML_NATIVE=ON, every instruction set this CPU has, AVX-512
# and VNNI included, into
#   ${LLAMA_SERVER_DIR:-~/.cache/vllm-unified/llama-server-0.3.36-noamx-<cpu digest>}/llama-server
# Except AMX: on an Intel Xeon with AMX this llama.cpp's AMX matmul (ggml_backend_amx_mul_mat)
# dies with SIGSEGV while loading the default model (seen 2026-12-05), so the compiler is told
# not to use AMX (-mno-amx-*): ggml then uses its AVX-512 kernels with weight repacking, the
# fastest configuration of this version that runs here (the alternative, --no-repack at run
# time, also turns off the repacked AVX-512 kernels). The directory name carries a digest of
# /proc/cpuinfo's flags, since a native build runs only on CPUs with the same instruction sets.
#
# --isa avx512 / --isa avx2: -DGGML_NATIVE=OFF and ggml's own instruction-set switches
# (GGML_AVX512*, GGML_AVX2, GGML_FMA, ...; AMX and AVX-VNNI off), so one machine can measure
# llama.cpp as it runs on a CPU with only that instruction set (benchmarks/serve.py --isa).
# Such a binary runs on every CPU that has the set, into
#   ${LLAMA_SERVER_DIR:-~/.cache/vllm-unified/llama-server-0.3.36-<isa>}/llama-server
#
# The CMake flags used are printed and written next to the binary (build-flags.txt), which the
# benchmarks report. A second run with the binary present prints its path and does nothing
# else. About 15 minutes on 2 cores; MAX_JOBS sets the compile jobs (default: all CPUs). Needs
# a C/C++ compiler and CMake (installed into .venv from PyPI when missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="0.3.36"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'build_llama_server.sh: error: %s\n' "$*" >&2; exit 1; }

ISA="native"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --isa) [[ $# -ge 2 ]] || die "--isa needs a value (native, avx512, avxvnni or avx2)"
               ISA="$2"; shift 2 ;;
        --isa=*) ISA="${1#--isa=}"; shift ;;
        -h|--help) sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (usage: build_llama_server.sh [--isa native|avx512|avxvnni|avx2])" ;;
    esac
done

# ggml's switches for the forced sets (ggml/CMakeLists.txt of this llama.cpp). Each is given
# explicitly so that nothing depends on ggml's defaults.
COMMON_OFF=(-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
AVX2_ON=(-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
         -DGGML_BMI2=ON)
case "$ISA" in
    native)
        if [[ -r /proc/cpuinfo ]]; then
            cpu_digest="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
        else
            cpu_digest="$(uname -m)"
        fi
        DEST="${LLAMA_SERVER_DIR:-$HOME/.cache/vllm-unified/llama-server-$VERSION-noamx-$cpu_digest}"
        NO_AMX=""
        if [[ "$(uname -m)" == x86_64 ]]; then
            NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        fi
        ISA_FLAGS=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
        ;;
    avx512)
        ISA_FLAGS=(-DGGML_NATIVE=OFF "${AVX2_ON[@]}" -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
                   -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "${COMMON_OFF[@]}")
        ;;
    avx2)
        ISA_FLAGS=(-DGGML_NATIVE=OFF "${AVX2_ON[@]}" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                   -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "${COMMON_OFF[@]}")
        ;;
    avxvnni)  # COMMON_OFF's AVX-VNNI switch overridden by the later -D
        ISA_FLAGS=(-DGGML_NATIVE=OFF "${AVX2_ON[@]}" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                   -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "${COMMON_OFF[@]}"
                   -DGGML_AVX_VNNI=ON)
        ;;
    *) die "--isa must be native, avx512, avxvnni or avx2, not '$ISA'" ;;
esac
if [[ "$ISA" != native ]]; then
    [[ "$(uname -m)" == x86_64 ]] || die "--isa $ISA builds for x86-64 only"
    DEST="${LLAMA_SERVER_DIR:-$HOME/.cache/vllm-unified/llama-server-$VERSION-$ISA}"
fi
BIN="$DEST/llama-server"
if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

[[ -x "$PY" ]] || die "$PY not found: run scripts/setup.sh first (or set PYTHON=...)"
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
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON
             -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
             "${ISA_FLAGS[@]}")
FLAGS_LINE="$(printf '%q ' "${CMAKE_FLAGS[@]}")"
FLAGS_LINE="${FLAGS_LINE% }"
say "CMake flags (--isa $ISA): $FLAGS_LINE"
say "building llama-server ($JOBS jobs; about 15 minutes on 2 cores)"
start=$SECONDS
cmake -S "$SRC" -B "$WORK/build" "${CMAKE_FLAGS[@]}" >"$WORK/cmake.log" 2>&1 \
    || { tail -30 "$WORK/cmake.log" >&2; die "CMake configuration failed"; }
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log" >&2; die "the build failed"; }
mkdir -p "$DEST"
printf 'llama-cpp-python==%s (vendor/llama.cpp), --isa %s\n%s\n' "$VERSION" "$ISA" \
    "$FLAGS_LINE" >"$DEST/build-flags.txt"
install -m 0755 "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
say "built in $((SECONDS - start)) s: $BIN (flags in $DEST/build-flags.txt)"
echo "$BIN"
