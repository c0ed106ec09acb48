"""Native half of :mod:`vllm_unified.bridge` (adopt foreign memory into MLX, write rows in place)
and MLX CPU kernels (linear, quantized linear (on AMX tiles where the CPU has them), dequantize,
quantized mixture-of-experts linear, paged attention, SwiGLU, GeGLU, logit soft-capping,
RMSNorm, RoPE).

Use :mod:`vllm_unified.bridge` rather than this module directly. Importing it imports
``mlx.core`` first (the extension's ``mx.array``/``mx.Dtype`` arguments are mlx.core's own
nanobind types) and checks that the running MLX is exactly the one the extension was compiled
against, since the extension inlines MLX's array layout from its headers. It then sets the
kernels' instruction-set and thread caps from :mod:`vllm_unified.envs` (``configure``) and
the quantized layers' arithmetic (``quantized_gemv_mode``, from ``VLLM_UNIFIED_CPU_ACTIVATIONS``):
the native code reads no environment variable.
"""

from __future__ import annotations

import importlib.metadata

import mlx.core  # noqa: F401  (registers the types the extension's signatures use)

from vllm_unified import envs

from ._native import (
    AMX_MIN_ROWS,
    MLX_VERSION,
    NANOBIND_VERSION,
    adopt,
    amx_int8_runs,
    amx_runs,
    amx_usable,
    attention_tile_isa,
    attention_tile_runs,
    configure,
    dequantize,
    gather_kv,
    gather_quantized_linear,
    gelu,
    gelu_tanh_mul,
    info,
    int8_runs,
    linear,
    lora_update,
    paged_attention,
    q8_avx2_gemm_runs,
    q8_avx2_vnni_runs,
    q8_avx2_gemv_runs,
    q8_gemm_runs,
    quantized_gemv_mode,
    quantized_linear,
    rms_norm,
    rope,
    silu_mul,
    softcap,
    softmax,
    to_torch,
    write_kv,
    write_kv_quant,
    write_rows,
)

_running = importlib.metadata.version("mlx")
if _running != MLX_VERSION:
    raise ImportError(
        f"vllm_unified_native was built against MLX {MLX_VERSION} but MLX {_running} is "
        "installed; rebuild it (scripts/setup.sh, or pip install --no-build-isolation ./native)"
    )

# The kernels' caps, before any kernel can run (each is decided when a kernel first uses it and
# then fixed). envs validates them: a typo is a ValueError naming the variable. Any thread count
# >= the CPUs means all of them, so a huge one is clamped to what a C long holds.
_threads = envs.CPU_THREADS
configure(envs.CPU_ISA, None if _threads is None else min(_threads, 2**31 - 1))
# Quantized layers' arithmetic on decode-sized x: 4 = x in two int8 terms, 3 = one, 1 = exact.
quantized_gemv_mode({"int16": 4, "int8": 3, "fp32": 1}[envs.CPU_ACTIVATIONS])

__all__ = [
    "AMX_MIN_ROWS", "MLX_VERSION", "NANOBIND_VERSION", "adopt", "amx_int8_runs", "amx_runs",
    "amx_usable",
    "attention_tile_isa",
    "attention_tile_runs",
    "configure", "dequantize", "gather_kv", "gather_quantized_linear", "gelu", "gelu_tanh_mul",
    "info",
    "int8_runs", "linear", "lora_update",
    "paged_attention", "q8_avx2_gemm_runs", "q8_avx2_gemv_runs", "q8_avx2_vnni_runs", "q8_gemm_runs", "quantized_gemv_mode", "quantized_linear", "rms_norm", "rope", "silu_mul",
    "softcap", "softmax", "to_torch", "write_kv", "write_kv_quant", "write_rows",
]
