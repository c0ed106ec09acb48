"""Route mlx-lm's linears and SwiGLU to the native CPU kernels (MLX's CPU backend, fp32).

Two costs dominate a decode step of a small model on MLX 0.32.4's CPU backend, measured on
SmolLM2-135M (2-core x86_64, ``benchmarks/decode_forward.py``):

* **Linears at decode batch sizes.** MLX calls BLAS ``sgemm`` for ``x @ w.T`` even for one row,
  and OpenBLAS packs the whole weight into its panel layout on every call (``sgemm_incopy``
  was ~30% of a batch-1 step's profile): the weights are read, written and read again. The
  native ``linear`` primitive (``native/src/cpu_math.cpp``) reads each weight row once and
  reuses it from L1 for all rows of ``x``, split over the CPUs: the tied 49,152 x 576 output
  head at 1 row took 8.4 ms with OpenBLAS and 2.4 ms native; at 16 rows 14.7 vs 10.8 ms; from
  ~64 rows OpenBLAS's packed kernels win, so larger inputs (prefill chunks) keep MLX's matmul.
* **SwiGLU.** mlx-lm's ``swiglu`` (``silu(gate) * x``) runs ``exp`` one element at a time on
  the CPU backend: 0.42 ms for 16 x 1,536 elements, 6.5 ms for 256 x 1,536. The native
  ``silu_mul`` takes ``expf`` from glibc's vector math library: 0.017 / 0.27 ms.

Both compute the same functions up to fp32 rounding (tests/test_cpu_kernels.py: relative
error <= 1e-6 against MLX). As with attention (:mod:`vllm_unified.models.paged_cache`), mlx-lm's
model files are untouched: ``swiglu`` names in model modules are replaced, and fp32
``nn.Linear`` / ``nn.Embedding`` instances of the model get a subclass whose call falls back
to MLX's own op for whatever the kernels do not take.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.activations as mlx_activations

from vllm_unified import bridge

_original_swiglu = mlx_activations.swiglu

#: Inputs with more rows than this keep MLX's matmul (OpenBLAS): measured crossover 32-64 rows
#: on a 2-core AVX-512 machine (docs/configuration.md, "Native kernels on the CPU backend").
MAX_NATIVE_ROWS = 32


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``: the native kernel for same-shaped fp32 arrays on the CPU, mlx-lm's
    ``swiglu`` otherwise."""
    native = bridge.native_kernels()
    if (native is None or gate.dtype != mx.float32 or x.dtype != mx.float32
            or gate.shape != x.shape):
        return _original_swiglu(gate, x)
    return native.silu_mul(gate, x)


def _native_matmul_t(x: mx.array, weight: mx.array) -> mx.array | None:
    """``x @ weight.T`` by the native kernel when it applies (fp32, at most
    :data:`MAX_NATIVE_ROWS` rows, CPU), else None."""
    if x.dtype != mx.float32 or weight.dtype != mx.float32 or x.ndim == 0:
        return None
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_NATIVE_ROWS:
        return None
    native = bridge.native_kernels()
    if native is None:
        return None
    out = native.linear(x.reshape(rows, x.shape[-1]), weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class NativeLinear(nn.Linear):
    """``nn.Linear`` whose decode-sized fp32 calls run the native kernel (same parameters)."""

    def __call__(self, x: mx.array) -> mx.array:
        out = _native_matmul_t(x, self["weight"])
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


class NativeEmbedding(nn.Embedding):
    """``nn.Embedding`` whose tied output head (``as_linear``) runs the native kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        out = _native_matmul_t(x, self.weight)
        return super().as_linear(x) if out is None else out


def install_cpu_kernels(model: Any) -> list[str]:
    """Route ``model``'s fp32 linears, tied output head and SwiGLU to the native CPU kernels,
    when they apply (MLX's CPU backend with the extension built).

    Linears and embeddings become :class:`NativeLinear` / :class:`NativeEmbedding` (their
    ``__class__`` is swapped: parameters, freezing and module paths stay as they are); only
    exact ``nn.Linear`` / ``nn.Embedding`` instances with fp32, row-contiguous weights are
    swapped (quantized layers are other classes and keep MLX's kernels). Idempotent.

    Returns:
        What was routed, for the log (empty on other backends).
    """
    native = bridge.native_kernels()
    if native is None:
        return []
    counts = {"linear": 0, "embedding": 0}
    for module in model.modules():
        kind = {nn.Linear: "linear", nn.Embedding: "embedding"}.get(type(module))
        if kind is None or module.weight.dtype != mx.float32:
            continue
        if not native.info(module.weight)["row_contiguous"]:
            continue  # the kernel would refuse it; MLX's matmul reads views as they are
        module.__class__ = NativeLinear if kind == "linear" else NativeEmbedding
        counts[kind] += 1
    routed = [f"{n} {kind} layers" for kind, n in counts.items() if n]
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if getattr(module, "swiglu", None) is _original_swiglu:
            module.swiglu = swiglu
            routed.append(f"swiglu of {name}")
    return routed
