"""Compile the CUDA kernel instances with nvcc, as MLX's ``mx.fast.cuda_kernel`` wraps them.

No GPU is needed, only nvcc: every CUDA kernel object of :mod:`kernel_instances` (its source
and header exactly as the wrappers hand them to MLX) is wrapped the way MLX 0.32.4's
``build_kernel`` (``mlx/backend/cuda/custom_kernel.cpp``) does: a default header, the kernel's
header, then in ``namespace mlx::core::cu`` a ``__global__`` function per call template, its
parameters (``const T* name``, ``name_shape`` / ``_strides`` / ``_ndim`` when the source
mentions them, the outputs) and the template arguments as ``constexpr`` / ``using`` lines
before the body. MLX's own ``device/utils.cuh`` is not installed with the CPU wheel, so its
``Shape`` / ``Strides`` are replaced by plain arrays of ``MAX_NDIM`` elements. One translation
unit per kernel object, up to ``--per-kernel`` of its call templates each (spread over the
grid), compiled with ``nvcc -c -arch=sm_90`` (NVRTC's default options differ; this checks the
text compiles, not the code NVRTC emits).

    PYTHONPATH=src python tests/cuda_syntax_check.py [--per-kernel N] [--keep DIR]

Prints one line per translation unit and exits 1 if any fails to compile.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from kernel_instances import record  # noqa: E402

_CUDA_TYPES = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.bool_: "bool",
}

#: stand-in for MLX's default header (``mlx/backend/cuda/device/utils.cuh`` and friends)
DEFAULT_HEADER = """
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#define MAX_NDIM 10
namespace mlx::core::cu {
struct Shape { int32_t d[MAX_NDIM]; __device__ int32_t operator[](int i) const { return d[i]; } };
struct Strides {
  int64_t d[MAX_NDIM];
  __device__ int64_t operator[](int i) const { return d[i]; }
};
}
"""


def _template_lines(template) -> str:
    out = []
    for name, arg in template:
        if isinstance(arg, bool):
            out.append(f"  constexpr bool {name} = {'true' if arg else 'false'};\n")
        elif isinstance(arg, int):
            out.append(f"  constexpr int {name} = {arg};\n")
        else:
            out.append(f"  using {name} = {_CUDA_TYPES[arg]};\n")
    return "".join(out) + ("\n" if out else "")


def translation_unit(inst, calls) -> str:
    """The .cu text of one kernel object: its header once, one function per call."""
    parts = [DEFAULT_HEADER, inst.header,
             "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"]
    for n, (ins, out_dtypes, template) in enumerate(calls):
        params = []
        for name, (dtype, ndim) in zip(inst.input_names, ins, strict=True):
            params.append(f"    const {_CUDA_TYPES[dtype]}* {name}")
            if ndim > 0:
                for suffix, decl in (("_shape", "Shape"), ("_strides", "Strides"),
                                     ("_ndim", "int")):
                    if name + suffix in inst.source:
                        params.append(f"    const __grid_constant__ {decl} {name}{suffix}")
        for name, dtype in zip(inst.output_names, out_dtypes, strict=True):
            params.append(f"    {_CUDA_TYPES[dtype]}* {name}")
        parts.append(f"__global__ void custom_kernel_{inst.name}_{n}(\n" + ",\n".join(params)
                     + ") {\n" + _template_lines(template) + inst.source + "\n}\n\n")
    parts.append("} // namespace mlx::core::cu\n")
    return "".join(parts)


def _spread(calls: list, count: int) -> list:
    if len(calls) <= count:
        return calls
    step = (len(calls) - 1) / (count - 1)
    return [calls[round(i * step)] for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-kernel", type=int, default=6)
    parser.add_argument("--keep", type=Path, help="write the .cu files here")
    args = parser.parse_args()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found")
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for inst in record():
            if inst.dialect != "cuda":
                continue
            calls = _spread(inst.cuda_calls, args.per_kernel)
            path = out_dir / f"{inst.name}.cu"
            path.write_text(translation_unit(inst, calls))
            run = subprocess.run([nvcc, "-c", "-std=c++17", "-arch=sm_90", "-o",
                                  str(path.with_suffix(".o")), str(path)],
                                 capture_output=True, text=True)
            ok = run.returncode == 0
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {inst.name}: {len(calls)} templates")
            if not ok:
                print(run.stderr[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
