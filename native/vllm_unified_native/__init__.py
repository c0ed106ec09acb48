"""Native half of :mod:`vllm_unified.bridge` (adopt foreign memory into MLX, write rows in place)
and MLX CPU kernels (linear, quantized linear (on AMX tiles where the CPU has them), dequantize, paged attention, SwiGLU, RMSNorm, RoPE).

Use :mod:`vllm_unified.bridge` rather than this module directly. Importing it imports
``mlx.core`` first (the extension's ``mx.array``/``mx.Dtype`` arguments are mlx.core's own
nanobind types) and checks that the running MLX is exactly the one the extension was compiled
against, since the extension inlines MLX's array layout from its headers.
"""

from __future__ import annotations

import importlib.metadata
import os

import mlx.core  # noqa: F401  (registers the types the extension's signatures use)

from ._native import (
    AMX_MIN_ROWS,
    MLX_VERSION,
    NANOBIND_VERSION,
    adopt,
    amx_runs,
    amx_usable,
    dequantize,
    gather_kv,
    info,
    linear,
    paged_attention,
    quantized_linear,
    rms_norm,
    rope,
    silu_mul,
    to_torch,
    write_rows,
)

# Read by the native dispatch once, when a kernel first runs; a typo there would silently run
# the best variant, so it is checked here.
_isa = os.environ.get("VLLM_UNIFIED_CPU_ISA")
if _isa is not None and _isa not in ("amx", "avx512", "avx2", "portable"):
    raise ValueError(f"VLLM_UNIFIED_CPU_ISA={_isa!r}: expected amx, avx512, avx2 or portable")

_running = importlib.metadata.version("mlx")
if _running != MLX_VERSION:
    raise ImportError(
        f"vllm_unified_native was built against MLX {MLX_VERSION} but MLX {_running} is "
        "installed; rebuild it (scripts/setup.sh, or pip install --no-build-isolation ./native)"
    )

__all__ = [
    "AMX_MIN_ROWS", "MLX_VERSION", "NANOBIND_VERSION", "adopt", "amx_runs", "amx_usable", "dequantize", "gather_kv", "info", "linear",
    "paged_attention", "quantized_linear", "rms_norm", "rope", "silu_mul", "to_torch", "write_rows",
]
