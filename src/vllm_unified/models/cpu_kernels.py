"""Route mlx-lm's linears and SwiGLU to the native CPU kernels (MLX's CPU backend, fp32).

The costs that dominate a decode step of a small model on MLX 0.32.4's CPU backend (figures:
docs/dev/benchmarks.md, ``benchmarks/engine.py decode``):

* **Linears at decode batch sizes.** MLX calls BLAS ``sgemm`` for ``x @ w.T`` even for one row,
  and OpenBLAS packs the whole weight into its panel layout on every call: the weights are
  read, written and read again. The native ``linear`` primitive (``native/src/cpu_math.cpp``)
  reads each weight row once and reuses it from L1 for all rows of ``x``, split over the CPUs;
  from a few dozen rows OpenBLAS's packed kernels win, so larger inputs (prefill chunks) keep
  MLX's matmul.
* **SwiGLU.** mlx-lm's ``swiglu`` (``silu(gate) * x``) runs ``exp`` one element at a time on
  the CPU backend. The native ``silu_mul`` takes ``expf`` from glibc's vector math library.
* **Quantized weights.** MLX's own quantized matmul runs on one core, so quantized checkpoints
  would have to be dequantized at load: 4x-8x the weight memory, all of it streamed every
  decode step. The native ``quantized_linear`` dequantizes 4 weight rows at a time into a
  scratch and multiplies them like ``linear`` (bit-identical to ``linear`` on
  ``mx.dequantize``'s weights), so a step reads the packed weights.
* **Quantized experts.** mlx-lm's ``QuantizedSwitchLinear`` calls ``mx.gather_qmm``, on one
  core as well. The native ``gather_quantized_linear`` groups the (token, expert) pairs by
  expert and runs each active expert's weight once per call through ``quantized_linear``'s
  kernels, so a decode step reads only the active experts' packed weights.

All compute the same functions up to fp32 rounding (tests/test_cpu_kernels.py: relative
error <= 1e-6 against MLX; the quantized kernels bit-identical to their dense counterparts).
As with attention (:mod:`vllm_unified.models.routing`), mlx-lm's model files are
untouched: ``swiglu`` names in model modules are replaced (:mod:`vllm_unified.patches`), and
linear / embedding instances (fp32, or quantized in a format the kernels take) get a subclass
whose call falls back to MLX's own op for whatever the kernels do not take.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.activations as mlx_activations
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from vllm_unified import bridge, envs, patches
from vllm_unified.models.cpu_activations import install_cpu_activations

_original_swiglu = mlx_activations.swiglu

#: Inputs with more rows than this keep MLX's matmul (OpenBLAS): measured crossover 32-64 rows
#: on a 2-core AVX-512 machine (docs/dev/architecture.md, "Native CPU kernels").
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
    return native.linear(x, weight)  # [..., K] -> [..., N]: no reshape node around it


#: Widths of MLX affine weights the native kernels take (all MLX's affine mode makes).
NATIVE_BITS = (2, 3, 4, 5, 6, 8)
#: Scale/bias dtypes the native kernels take (16-bit ones widened exactly to fp32 as read).
NATIVE_SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _quantized_params(layer: nn.Module) -> tuple[mx.array, mx.array, mx.array] | None:
    """``(weight, scales, biases)`` of a quantized layer the native kernels take (affine mode,
    :data:`NATIVE_BITS`, groups a multiple of 16, scales and biases both of one of
    :data:`NATIVE_SCALE_DTYPES`), else None."""
    biases = layer.get("biases")
    if (getattr(layer, "mode", "affine") != "affine" or layer.bits not in NATIVE_BITS
            or layer.group_size % 16 or biases is None
            or layer.scales.dtype not in NATIVE_SCALE_DTYPES or biases.dtype != layer.scales.dtype):
        return None
    return layer["weight"], layer["scales"], biases


def _native_quantized_matmul_t(x: mx.array, layer: nn.Module) -> mx.array | None:
    """``x @ dequantize(layer.weight).T`` by the native kernels (fp32 ``x`` on the CPU), else
    None. Up to :data:`MAX_NATIVE_ROWS` rows the weight is dequantized inside the kernel, a few
    rows at a time; larger inputs (prefill) get the whole weight dequantized by the native
    kernel, then MLX's matmul (BLAS), the dense copy dropped after the call. Either way the
    result is bit-identical to the same layer dequantized at load (``mx.dequantize``), except
    where :func:`large_input_takes` (from ``AMX_MIN_ROWS`` rows, at any size): on bf16 tiles
    fp32-accurate, not the same bits (docs/features/quantization.md), and where the native
    ``int8_runs`` or ``amx_int8_runs`` (``VLLM_UNIFIED_CPU_ACTIVATIONS`` int16 or int8; the
    latter at any size from 5 rows): x quantized per 32 elements, times the codes by int8 dot
    products (docs/features/quantization.md).

    The layer's format was checked when :func:`install_cpu_kernels` routed it (this runs ~200
    times per decode step); a parameter changed since then gets the kernels' TypeError."""
    native = bridge.native_kernels()
    if native is None or x.dtype != mx.float32 or x.ndim == 0:
        return None
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows == 0:
        return None
    weight, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    if rows <= MAX_NATIVE_ROWS or large_input_takes(rows, x.shape[-1], layer.group_size,
                                                    layer.bits):
        # [..., K] -> [..., N]: no reshape node around it
        return native.quantized_linear(x, weight, scales, biases, layer.group_size, layer.bits)
    return x @ native.dequantize(weight, scales, biases, layer.group_size, layer.bits).T


def large_input_takes(rows: int, in_features: int, group_size: int, bits: int) -> bool:
    """Whether ``quantized_linear`` runs ``rows`` rows (a prefill chunk) through a layer rather
    than dequantize + BLAS: the native integer rules (``VLLM_UNIFIED_CPU_ACTIVATIONS`` int16 or
    int8, from 5 rows, the layer's layout): ``amx_int8_runs`` (AMX-INT8 tiles),
    ``q8_gemm_runs`` (the AVX-512 VNNI GEMM without AMX) or ``q8_avx2_gemm_runs`` (the AVX2
    GEMM without AVX-512 VNNI); or the bf16 tiles' ``amx_runs`` (at
    least ``AMX_MIN_ROWS`` rows, the CPU has AMX and ``VLLM_UNIFIED_CPU_ISA`` allows it, the
    input size and quantization groups are whole 32-element tile rows). Each beats
    dequantize + BLAS at prefill sizes (docs/features/quantization.md)."""
    native = bridge.native_kernels()
    return native is not None and (native.amx_int8_runs(rows, in_features, group_size, bits)
                                   or native.q8_gemm_runs(rows, in_features, group_size, bits)
                                   or native.q8_avx2_gemm_runs(rows, in_features, group_size,
                                                               bits)
                                   or native.amx_runs(rows, in_features, group_size))


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


class NativeQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` run by the native kernels (same parameters; see
    :func:`_native_quantized_matmul_t`)."""

    def __call__(self, x: mx.array) -> mx.array:
        out = _native_quantized_matmul_t(x, self)
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` run by the native kernels: the lookup gathers the looked-up
    rows of weight, scales and biases and dequantizes them with the native ``dequantize``
    (any width and group size the kernels take, groups of 16 included, which MLX's own
    dequantize refuses); the tied output head (``as_linear``) runs
    :func:`_native_quantized_matmul_t`.

    ``__call__(x)``: integer indices of any shape -> float32 ``[*x.shape, dims]``, the rows
    bit-identical to ``mx.dequantize`` of the same rows (where MLX takes the group size)."""

    def __call__(self, x: mx.array) -> mx.array:
        native = bridge.native_kernels()
        if native is None:
            return super().__call__(x)
        flat = x.reshape(-1)
        rows = native.dequantize(self["weight"][flat], self["scales"][flat],
                                 self["biases"][flat], self.group_size, self.bits)
        return rows.reshape(*x.shape, rows.shape[-1])

    def as_linear(self, x: mx.array) -> mx.array:
        out = _native_quantized_matmul_t(x, self)
        return super().as_linear(x) if out is None else out


def _expert_params(layer: nn.Module) -> tuple[mx.array, ...] | None:
    """The packed parameters of a mixture-of-experts switch layer whose format the native
    ``gather_quantized_linear`` takes (``weight, scales`` and, in affine mode, ``biases``), else
    None: affine in :func:`_quantized_params`' formats, or mxfp4 (group 32, uint8 scales, no
    biases); never with a global scale (nvfp4)."""
    if layer.get("global_scale") is not None or getattr(layer, "global_scale", None) is not None:
        return None
    if getattr(layer, "mode", "affine") == "mxfp4":
        if (layer.bits != 4 or layer.group_size != 32 or layer.get("biases") is not None
                or layer.scales.dtype != mx.uint8):
            return None
        return layer["weight"], layer["scales"]
    return _quantized_params(layer)


def _expert_rows(x: mx.array, indices: mx.array) -> bool:
    """Whether ``mx.gather_qmm(x, w, rhs_indices=indices)``'s broadcast of x's batch axes
    against ``indices`` is one the native kernel takes: x's batch shape ``x.shape[:-2]`` is
    ``indices.shape`` with trailing axes (maybe none) set to 1, so each x entry serves
    consecutive indices (mlx-lm's ``SwitchGLU`` / ``SwitchMLP`` call shapes, sorted or not)."""
    batch, shape = x.shape[:-2], indices.shape
    if len(batch) != len(shape):
        return False
    keep = 0
    while keep < len(shape) and batch[keep] == shape[keep]:
        keep += 1
    return all(d == 1 for d in batch[keep:])


class NativeQuantizedSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's ``QuantizedSwitchLinear`` (quantized experts) run by the native
    ``gather_quantized_linear`` for fp32 ``x`` and the call shapes of :func:`_expert_rows`:
    tokens grouped by expert, each active expert's packed weight read once per call, every
    core busy (same parameters; MLX's ``gather_qmm`` for other calls).

    ``__call__(x [..., M, K], indices, sorted_indices=False)`` -> ``[*indices.shape, M, N]``
    fp32, bit-identical per expert to ``quantized_linear`` on that expert's weight and rows
    (affine; to ``linear`` on the dequantized weight where the arithmetic is exact fp32), so
    equal to the layer dequantized at load within fp32 rounding (MLX's ``gather_mm`` sums in
    another order)."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        native = bridge.native_kernels()
        if (native is None or x.dtype != mx.float32 or x.ndim < 2
                or indices.dtype not in (mx.uint32, mx.int32) or not _expert_rows(x, indices)):
            return super().__call__(x, indices, sorted_indices)
        mode = getattr(self, "mode", "affine")
        out = native.gather_quantized_linear(
            x, self["weight"], self["scales"], self.get("biases") if mode == "affine" else None,
            indices, self.group_size, self.bits, mode)
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out


class NativeRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` as one native primitive for fp32 inputs (MLX's CPU backend runs
    ``mx.fast.rms_norm`` as a graph of ~10 primitives)."""

    def __call__(self, x: mx.array) -> mx.array:
        native = bridge.native_kernels()
        weight = self["weight"]
        if native is None or x.dtype != mx.float32 or weight.dtype != mx.float32:
            return super().__call__(x)
        return native.rms_norm(x, weight, self.eps)


class NativeOffsetRMSNorm:
    """Mixin for mlx-lm's Gemma norms: ``mx.fast.rms_norm(x, 1 + weight, eps)`` (Gemma 2 / 3's
    ``RMSNorm``) or without a weight (Gemma 4's ``RMSNormNoScale``) as one native primitive
    for fp32 inputs, the module's own call otherwise."""

    def __call__(self, x: mx.array) -> mx.array:
        native = bridge.native_kernels()
        if "weight" in self:
            weight = 1.0 + self["weight"]
        else:
            weight = _ONES.get(x.shape[-1])
            if weight is None:
                weight = _ONES[x.shape[-1]] = mx.ones((x.shape[-1],), dtype=mx.float32)
        if native is None or x.dtype != mx.float32 or weight.dtype != mx.float32:
            return super().__call__(x)
        return native.rms_norm(x, weight, self.eps)


_ONES: dict[int, mx.array] = {}


def _gemma_norm_routes() -> dict[type, type]:
    from mlx_lm.models import gemma2, gemma3_text, gemma4_text

    return {cls: type(f"Native{cls.__name__}", (NativeOffsetRMSNorm, cls), {"__doc__": (
        f"{cls.__module__}.{cls.__name__} on the native RMSNorm (:class:`NativeOffsetRMSNorm`).")})
        for cls in (gemma2.RMSNorm, gemma3_text.RMSNorm, gemma4_text.RMSNormNoScale)}


_INV_FREQS: dict[tuple[int, float], mx.array] = {}


def _inv_freq(dims: int, base: float) -> mx.array:
    """``base ** (-2i / dims)`` for ``i < dims / 2``, computed as ``mx.fast.rope``'s CPU
    fallback does (MLX 0.32.4 ``fast.cpp``: ``exp(arange(0, -half, -1) * (log(base) / half))``
    with ``base`` a C++ float, the logarithm and the division in fp32), so the rotation angles
    match it; cached."""
    key = (dims, float(base))
    if key not in _INV_FREQS:
        half = dims // 2
        log_base = np.float32(math.log(np.float32(base)))  # logf: correctly rounded here
        step = mx.array(log_base / np.float32(half), dtype=mx.float32)
        inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)
        mx.eval(inv)
        _INV_FREQS[key] = inv
    return _INV_FREQS[key]


class NativeRoPE(nn.RoPE):
    """``nn.RoPE`` as one native primitive for fp32 ``[B, H, L, D]`` inputs with an int offset
    or one offset per batch row (the paged cache's per-token positions); MLX's CPU backend runs
    ``mx.fast.rope`` as a graph of ~30 primitives (sin, cos, slices, concatenation)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        native = bridge.native_kernels()
        offsets = _rope_offsets(offset, x)
        if native is None or x.dtype != mx.float32 or offsets is None:
            return super().__call__(x, offset)
        return native.rope(x, self.dims, self.traditional, _inv_freq(self.dims, self.base),
                           self.scale, offsets)


def _native_freqs_rope(x: mx.array, offset: int | mx.array, dims: int, traditional: bool,
                       freqs: mx.array, x_scale: float = 1.0) -> mx.array | None:
    """``mx.fast.rope(x * x_scale (first dims features), dims, base=None, scale=1.0,
    freqs=freqs)`` by the native primitive (inverse frequencies ``1 / freqs``, computed once
    per ``freqs`` array), or None where it does not apply (see :class:`NativeRoPE`)."""
    native = bridge.native_kernels()
    offsets = _rope_offsets(offset, x)
    if native is None or x.dtype != mx.float32 or freqs.dtype != mx.float32 or offsets is None:
        return None
    inv = _INV_FROM_FREQS.get(id(freqs))
    if inv is None or inv[0] is not freqs:
        inv = (freqs, mx.reciprocal(freqs))
        mx.eval(inv[1])
        _INV_FROM_FREQS[id(freqs)] = inv
    if x_scale != 1.0 and dims == x.shape[-1]:
        x = x * x_scale
    elif x_scale != 1.0:
        x = mx.concatenate([x[..., :dims] * x_scale, x[..., dims:]], axis=-1)
    return native.rope(x, dims, traditional, inv[1], 1.0, offsets)


#: id(freqs) -> (freqs, 1 / freqs): the frequencies are kept so that the id stays theirs
_INV_FROM_FREQS: dict[int, tuple[mx.array, mx.array]] = {}


class NativeFreqsRoPE:
    """Mixin for mlx-lm's RoPE variants that call ``mx.fast.rope`` with their own ``_freqs``
    (Llama 3, LongRoPE (``SuScaledRoPE``, its ``_scale`` on the rotated features),
    proportional): one native primitive where :func:`_native_freqs_rope` applies, the
    variant's own call otherwise."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if hasattr(self, "_scale"):  # SuScaledRoPE: dims in ``dim``, never traditional
            out = _native_freqs_rope(x, offset, self.dim, False, self._freqs, self._scale)
        else:
            out = _native_freqs_rope(x, offset, self.dims, self.traditional, self._freqs)
        return super().__call__(x, offset) if out is None else out


def _freqs_rope_routes() -> dict[type, type]:
    from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE

    return {cls: type(f"Native{cls.__name__}", (NativeFreqsRoPE, cls), {"__doc__": (
        f"mlx-lm's ``{cls.__name__}`` on the native RoPE (:class:`NativeFreqsRoPE`).")})
        for cls in (Llama3RoPE, ProportionalRoPE, SuScaledRoPE)}


_INT32 = np.iinfo(np.int32)


def _rope_offsets(offset: int | mx.array, x: mx.array) -> mx.array | None:
    """``offset`` as the int32 ``[B]`` / ``[1]`` array the native RoPE takes, or None when the
    call is not one it covers, so MLX's own RoPE runs it (and raises what it raises): x not
    ``[B, H, L, D]``; a bool, or an int outside int32; an array that is not int32 (other
    integer types could hold values int32 cannot) or not of ``[B]`` / ``[1]`` elements."""
    if x.ndim != 4 or isinstance(offset, bool):
        return None
    if isinstance(offset, int):
        if not _INT32.min <= offset <= _INT32.max:
            return None
        return mx.array([offset], dtype=mx.int32)
    if (not isinstance(offset, mx.array) or offset.dtype != mx.int32 or offset.ndim > 1
            or offset.size not in (1, x.shape[0])):
        return None
    # the step's positions come as [T] already: a reshape would be a new (lazy) array, and the
    # kernel would add a Contiguous node for it, two nodes per call
    return offset if offset.ndim == 1 else offset.reshape(-1)


#: Exact layer class -> its natively run subclass (subclasses of these are left alone).
_ROUTES: dict[type, type] = {
    nn.Linear: NativeLinear,
    nn.Embedding: NativeEmbedding,
    nn.QuantizedLinear: NativeQuantizedLinear,
    nn.QuantizedEmbedding: NativeQuantizedEmbedding,
}
_DENSE_ROUTES: dict[type, type] = {nn.QuantizedLinear: NativeLinear,
                                   nn.QuantizedEmbedding: NativeEmbedding}
_FREQS_ROPES: dict[type, type] = _freqs_rope_routes()
_GEMMA_NORMS: dict[type, type] = _gemma_norm_routes()
_NAMES = {NativeLinear: "linear", NativeEmbedding: "embedding",
          NativeQuantizedLinear: "quantized linear",
          NativeQuantizedEmbedding: "quantized embedding", NativeRMSNorm: "RMSNorm",
          NativeRoPE: "RoPE", NativeQuantizedSwitchLinear: "quantized expert"}


def keep_quantized_on_cpu(dtype: mx.Dtype) -> bool:
    """Whether a quantized checkpoint stays quantized on MLX's CPU backend.

    Yes when the native kernels run its layers: compute dtype fp32 and the extension built,
    unless ``VLLM_UNIFIED_CPU_QUANTIZED=0`` (any value but 0/1 raises ValueError). Otherwise
    the loader dequantizes the weights once to ``dtype``: MLX 0.32.4's own quantized matmul
    runs on one core (docs/features/quantization.md).
    """
    if not envs.read(envs.CPU_QUANTIZED_ENV):
        return False
    return dtype == mx.float32 and bridge.native_kernels() is not None


def _dequantize_in_place(layer: nn.Module) -> None:
    """Turn a quantized linear / embedding / mixture-of-experts switch layer into the dense fp32
    layer it stands for (same module object: ``mx.dequantize`` of its weight, as mlx-lm's
    ``dequantize_model`` computes it; scales, biases and global scale dropped)."""
    global_scale = layer.get("global_scale")
    if global_scale is None:
        global_scale = getattr(layer, "global_scale", None)
    layer.weight = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"),
                                 group_size=layer.group_size, bits=layer.bits,
                                 mode=getattr(layer, "mode", "affine"),
                                 global_scale=global_scale).astype(mx.float32)
    for key in ("scales", "biases", "global_scale"):
        if key in layer:
            del layer[key]
    mx.eval(layer.weight)


def _quantized_arithmetic(model: Any) -> tuple[str, bool]:
    """The start-up log's account of the quantized layers' arithmetic: how many multiply integer
    codes by x quantized per 32 elements (``VLLM_UNIFIED_CPU_ACTIVATIONS`` int16 or int8 on a
    CPU with AVX-512 VNNI and VBMI: 1-4 rows, and every size from 5 rows, prefill chunks
    included, on AMX-INT8 tiles where the CPU has them, else by the gemv up to 5 rows and the
    VNNI GEMM from 6; on AVX2 without AVX-512 VNNI: 1-4 rows by the AVX2 gemv, from 5 by the
    AVX2 GEMM; expert layers per expert as the others, never on tiles; mxfp4 experts always
    exact) and how many
    compute exactly in fp32; and whether every layer runs 5 rows and more on AMX-INT8 tiles."""
    native = bridge.native_kernels()
    layers = [(m, m["weight"].shape[-1] * 32 // m.bits) for m in model.modules()
              if type(m) in (NativeQuantizedLinear, NativeQuantizedEmbedding,
                             NativeQuantizedSwitchLinear)]
    integer = sum(getattr(m, "mode", "affine") == "affine"
                  and native.int8_runs(1, k, m.group_size, m.bits) for m, k in layers)
    tiles = sum(native.amx_int8_runs(16, k, m.group_size, m.bits) for m, k in layers)
    gemm = sum(native.q8_gemm_runs(16, k, m.group_size, m.bits) for m, k in layers)
    where = ("at every size (1-4 rows, from 5 on AMX-INT8 tiles)" if tiles
             else "at every size (1-5 rows, from 6 by the AVX-512 VNNI GEMM)" if gemm
             else "at 1-4 rows (exact from 5)")
    if integer == 0:  # AVX2 without AVX-512 VNNI: the GEMM at every size, experts included
        integer = sum(getattr(m, "mode", "affine") == "affine"
                      and native.q8_avx2_gemm_runs(16, k, m.group_size, m.bits)
                      for m, k in layers)
        gemm = "the AVX2 GEMM on AVX-VNNI" if native.q8_avx2_vnni_runs() else "the AVX2 GEMM"
        where = f"at every size on AVX2 (1-4 rows, from 5 by {gemm}; no AVX-512 VNNI)"
    if integer == 0:
        return ("exact fp32 arithmetic in the quantized layers (VLLM_UNIFIED_CPU_ACTIVATIONS="
                "fp32, or no AVX2)", False)
    what = f"{envs.CPU_ACTIVATIONS} activations"
    if integer == len(layers):
        return f"{what} in all {integer} quantized layers {where}", tiles == len(layers)
    return (f"{what} in {integer} of {len(layers)} quantized layers {where}, exact fp32 in the "
            "others (a layout the integer kernels do not take)", False)


def install_cpu_kernels(model: Any) -> list[str]:
    """Route ``model``'s linears (fp32 and quantized), tied output head, RMSNorm, RoPE and
    SwiGLU to the native CPU kernels, when they apply (MLX's CPU backend with the extension
    built).

    Linears and embeddings become :class:`NativeLinear` / :class:`NativeEmbedding`, quantized
    ones :class:`NativeQuantizedLinear` / :class:`NativeQuantizedEmbedding` (their
    ``__class__`` is swapped: parameters, freezing and module paths stay as they are). Only
    exact instances of the four MLX classes are swapped: dense ones with fp32 row-contiguous
    weights, quantized ones the kernels take (affine, 2/3/4/5/6/8 bits, fp32, float16 or
    bfloat16 scales). Other
    quantized layers (mxfp4, nvfp4, mxfp8, ...) are dequantized to fp32 here, as the loader
    would have done (MLX's CPU quantized matmul runs on one core), and named in the result.
    mlx-lm's ``QuantizedSwitchLinear`` (quantized experts) becomes
    :class:`NativeQuantizedSwitchLinear` where :func:`_expert_params` takes its format, else it
    is dequantized to fp32 (``SwitchLinear``) and named in the result.
    ``nn.RMSNorm`` / ``nn.RoPE`` instances become :class:`NativeRMSNorm` / :class:`NativeRoPE`,
    mlx-lm's Llama 3 / LongRoPE / proportional RoPE their :class:`NativeFreqsRoPE` subclass,
    Gemma's norms their :class:`NativeOffsetRMSNorm` subclass (each falls back to MLX for
    inputs it does not cover); Gemma's GeGLU and logit soft-capping go to their kernels
    (:mod:`vllm_unified.models.cpu_activations`). Idempotent.

    Returns:
        What was routed (and left), for the log; empty on other backends.
    """
    native = bridge.native_kernels()
    if native is None:
        return []
    counts = dict.fromkeys(_ROUTES.values(), 0)
    left: dict[str, int] = {}
    for module in model.modules():
        route = _ROUTES.get(type(module))
        if route is None:
            continue
        weights: tuple[mx.array, ...] | None
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            weights = _quantized_params(module)
            if weights is None:
                what = f"{getattr(module, 'mode', 'affine')} {module.bits}-bit"
                left[what] = left.get(what, 0) + 1
                _dequantize_in_place(module)
                route = _DENSE_ROUTES[type(module)]
                weights = (module.weight,)
        elif module.weight.dtype != mx.float32:
            continue
        else:
            weights = (module.weight,)
        if not all(native.info(w)["row_contiguous"] for w in weights):
            continue  # the kernel would refuse it; MLX's matmul reads views as they are
        module.__class__ = route
        counts[route] += 1
    experts: dict[str, int] = {}
    for module in model.modules():
        # Mixture-of-experts switch layers: the native kernel where it takes the format; others
        # dense, as the loader made them before quantized checkpoints stayed quantized on the
        # CPU (MLX's CPU gather_qmm runs on one core: 16 experts 512 -> 1,024, top-2, 64
        # tokens: 2.3 s against 0.61 s dense).
        if type(module) is QuantizedSwitchLinear:
            what = f"{getattr(module, 'mode', 'affine')} {module.bits}-bit"
            weights = _expert_params(module)
            if weights is not None and all(native.info(w)["row_contiguous"] for w in weights):
                module.__class__ = NativeQuantizedSwitchLinear
                experts[what] = experts.get(what, 0) + 1
            else:
                _dequantize_in_place(module)
                module.__class__ = SwitchLinear
                left[f"{what} expert"] = left.get(f"{what} expert", 0) + 1
        if type(module) is nn.RMSNorm:
            module.__class__ = NativeRMSNorm
            counts[NativeRMSNorm] = counts.get(NativeRMSNorm, 0) + 1
        elif type(module) is nn.RoPE and module.base is not None:
            module.__class__ = NativeRoPE
            counts[NativeRoPE] = counts.get(NativeRoPE, 0) + 1
        elif type(module) in _GEMMA_NORMS:
            module.__class__ = _GEMMA_NORMS[type(module)]
            counts[NativeRMSNorm] = counts.get(NativeRMSNorm, 0) + 1
        elif type(module) in _FREQS_ROPES:
            module.__class__ = _FREQS_ROPES[type(module)]
            counts[NativeRoPE] = counts.get(NativeRoPE, 0) + 1
    routed = [f"{n} {_NAMES[route]} layers" for route, n in counts.items() if n]
    routed += [f"{n} {what} quantized expert layers (native gather_quantized_linear)"
               for what, n in experts.items()]
    routed += [f"{n} {what} layers dequantized to float32 (no native kernel for them)"
               for what, n in left.items()]
    quantized = (counts[NativeQuantizedLinear] + counts[NativeQuantizedEmbedding]
                 + sum(experts.values()))
    if quantized:
        arithmetic, all_on_int8_tiles = _quantized_arithmetic(model)
        # the bf16 tiles are the exact arithmetic's: named where some layer still takes them
        if native.amx_usable() and not all_on_int8_tiles:
            routed.append(f"quantized linears on AMX tiles from {native.AMX_MIN_ROWS} rows")
        routed.append(arithmetic)
    routed += [f"swiglu of {name}" for name in patches.route_mlx_lm_swiglu(model, swiglu)]
    return routed + install_cpu_activations(model)
