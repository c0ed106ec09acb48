"""Decode-sized matmuls (2 to 64 rows) as one small tensor-core kernel on MLX's CUDA backend.

Why: MLX 0.32.4's CUDA matmul of more than one row calls cuBLASLt, and every call, replayed
compiled graphs included, builds its matrix descriptors, asks cuBLASLt's heuristic for an
algorithm and captures the launch into a child CUDA graph (``mlx/backend/cuda/matmul.cpp``,
``gemms/cublas_gemm.cpp``, ``cublas_utils.cpp``); one row takes MLX's own gemv kernel instead.
A decode step is bound by that host work (docs/dev/benchmarks.md, GPU decode), and a
Qwen3-0.6B step at batch 16 holds 169 such matmuls. This kernel is one ``mx.fast.cuda_kernel``
launch per linear, and it writes a fused projection's parts (q/k/v, gate/up) as separate
row-contiguous arrays, so the fused matmul serves every row count (MLX's RMSNorm and the KV
write would copy strided column views).

Arithmetic: ``out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])`` for bf16 or fp16 ``x`` and
``W`` (``W`` as ``nn.Linear`` stores it, ``[N, K]``), products summed in fp32 by
``mma.sync.aligned.m16n8k16`` (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating
point type"; sm_80 and newer), the bias added in fp32, one rounding to the output dtype: the
contract of MLX's matmul (cuBLASLt with fp32 compute), with another summation order.

Layout: the weight is the MMA's A operand (16 output features per block), x the B operand
(8 token rows per tile; every instance computes ``MT = 8`` tiles, i.e. 64 rows, and rows
past ``M`` load zeros and are not stored, so each weight shape is compiled once). Lane
``(g, t) = (lane / 4, lane % 4)`` loads 8 consecutive k of weight rows ``g`` and ``g + 8``
and of token row ``g`` (16 bytes each) per 32 k. The k order inside a 32-k chunk is permuted
identically for both operands (a dot product does not depend on it): the fragment's k pairs
``2t, 2t + 1`` and ``2t + 8, 2t + 9`` of the first MMA are the lane's k ``8t .. 8t + 3``,
those of the second MMA ``8t + 4 .. 8t + 7``. The block's warps split K and sum their
partial tiles in shared memory in warp order (deterministic).

Contract of :func:`gemm`: ``x`` ``[..., K]``, ``weight`` ``[N, K]`` row-contiguous, same
dtype; ``K % 32 == 0``; every part width a multiple of 16; both starting on a 16-byte
boundary (the kernel's 16-byte loads): MLX's buffers do, and so does any row view of them, as
``K % 8 == 0`` (MLX copies a non-row-contiguous input first, at its buffer's start); a view
at another element offset (a flat slice reshaped) would fault. It returns None (the caller uses
MLX's matmul) for anything else: other dtypes, shapes or row counts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_unified import gpu_dialect
from vllm_unified.models.fused_projections import FusedPart

__all__ = ["MAX_ROWS", "MIN_ROWS", "GpuEmbedding", "GpuLinear", "gemm", "install_gpu_gemm",
           "warps_for"]

#: row counts the kernel takes: one row is MLX's own gemv kernel (no cuBLASLt); from 65 rows
#: (prefill chunks) cuBLASLt's tiled kernels are the right tool and its host cost is amortised
MIN_ROWS, MAX_ROWS = 2, 64

#: 8-row token tiles every instance computes (MAX_ROWS / 8)
TILES = MAX_ROWS // 8

#: warps of the block sum partial tiles; aim at about this many warps in flight per launch
_TARGET_WARPS = 2048

#: the kernel's text, CUDA only (PTX MMA): sections of ``kernels/gemm.h`` and ``kernels/gemm.inc``
_HEADER_PARTS = gpu_dialect.kernel_sections(gpu_dialect.kernel_file(__package__, "gemm.h"))
_BODY_PARTS = gpu_dialect.kernel_sections(gpu_dialect.kernel_file(__package__, "gemm.inc"))

#: the header: one warp-wide MMA, D = A * B + D, per 16-bit input type (the PTX type in its name)
_HEADER = gpu_dialect.render(_HEADER_PARTS["HEADER"], MMA="".join(
    gpu_dialect.render(_HEADER_PARTS["MMA"], CTYPE=ctype, PTX=ptx)
    for ctype, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16"))))


def _source(parts: int, has_bias: bool) -> str:
    """The body for ``parts`` outputs (``out0`` .. of widths ``N0`` ..) and an optional bias:
    the store (a lambda: fragment element j of lane ``ln`` of token tile mt, PTX's C fragment:
    rows g and g + 8, columns 2t and 2t + 1) routes each column to its part."""
    routes, start = [], "0"
    for p in range(parts):
        cond = f"n < {start} + N{p}" if p < parts - 1 else "true"
        routes.append(gpu_dialect.render(_BODY_PARTS["ROUTE"], IF="if" if p == 0 else "else if",
                                         COND=cond, P=str(p), START=start))
        start = f"{start} + N{p}"
    return gpu_dialect.render(_BODY_PARTS["BODY"], BIAS=_BODY_PARTS["BIAS"] if has_bias else "",
                              ROUTES="".join(routes))


@functools.cache
def _kernel(parts: int, has_bias: bool):
    """The kernel object for ``parts`` outputs (built once: the body is generated here)."""
    inputs = ("x", "weight", "bias") if has_bias else ("x", "weight")
    outputs = tuple(f"out{p}" for p in range(parts))
    name = f"vllm_unified_gemm{parts}{'b' if has_bias else ''}"
    return gpu_dialect.kernel(name, inputs, outputs, _source(parts, has_bias), dialect="cuda",
                              header=_HEADER)


def warps_for(num_features: int, k: int) -> int:
    """Warps per block (1, 2, 4 or 8) for ``num_features`` outputs over ``k`` inputs: enough
    blocks times warps to keep the GPU's memory system busy, never more warps than 32-k
    chunks."""
    blocks = num_features // 16
    warps = 1
    while warps < 8 and blocks * warps < _TARGET_WARPS and warps * 2 <= k // 32:
        warps *= 2
    return warps


def gemm(x: mx.array, weight: mx.array, sizes: Sequence[int] | None = None,
         bias: mx.array | None = None) -> list[mx.array] | None:
    """``x @ weight.T (+ bias)`` cut into row-contiguous column parts, by the kernel.

    Args:
        x: ``[..., K]`` bf16 or fp16, 2 to 64 rows (``x.size // K``).
        weight: ``[N, K]``, the dtype of ``x``.
        sizes: the parts' widths (sum ``N``; each a multiple of 16); default one part.
        bias: ``[N]`` or None.

    Returns:
        One array ``[..., size]`` per part, or None where the kernel does not apply (the
        caller runs MLX's matmul).
    """
    n, k = weight.shape if weight.ndim == 2 else (0, 0)
    sizes = [n] if sizes is None else list(sizes)
    if (n == 0 or k == 0 or weight.dtype not in (mx.bfloat16, mx.float16) or x.dtype != weight.dtype
            or x.shape[-1] != k or k % 32 or sum(sizes) != n or any(s % 16 for s in sizes)
            or not 1 <= len(sizes) <= 3 or min(sizes) <= 0
            or (bias is not None and (bias.dtype != weight.dtype or bias.shape != (n,)))):
        return None
    rows = x.size // k
    if not MIN_ROWS <= rows <= MAX_ROWS:
        return None
    warps = warps_for(n, k)
    # Always every 8-row tile of MAX_ROWS (rows past M load zeros and are not stored): one
    # compiled instance per weight shape, not one per batch size's tile count (NVRTC compiles
    # each instance at its first call, ~1 s, stalling the step that meets it).
    template: list[tuple[str, Any]] = [("T", weight.dtype), ("K", k), ("MT", TILES),
                                       ("WARPS", warps)]
    template += [(f"N{p}", s) for p, s in enumerate(sizes)]
    inputs = [x.reshape(rows, k), weight] + ([bias] if bias is not None else [])
    outs = _kernel(len(sizes), bias is not None)(
        inputs=inputs, template=template, grid=(n // 16 * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1), output_shapes=[(rows, s) for s in sizes],
        output_dtypes=[weight.dtype] * len(sizes))
    return [o.reshape(*x.shape[:-1], s) for o, s in zip(outs, sizes, strict=True)]


class GpuLinear(nn.Linear):
    """``nn.Linear`` whose decode-sized calls run :func:`gemm` (same parameters)."""

    def __call__(self, x: mx.array) -> mx.array:
        out = gemm(x, self["weight"], bias=self["bias"] if "bias" in self else None)
        return super().__call__(x) if out is None else out[0]


class GpuEmbedding(nn.Embedding):
    """``nn.Embedding`` whose tied output head (``as_linear``) runs :func:`gemm`."""

    def as_linear(self, x: mx.array) -> mx.array:
        out = gemm(x, self.weight)
        return super().as_linear(x) if out is None else out[0]


def install_gpu_gemm(model: Any) -> int:
    """Route ``model``'s bf16/fp16 ``nn.Linear`` layers (fused q/k/v and gate/up included: one
    launch writes every part) and tied output head to :func:`gemm` for decode-sized inputs.

    Call after :func:`vllm_unified.models.fused_projections.fuse_projections`. Only exact
    ``nn.Linear`` / ``nn.Embedding`` instances are swapped (their ``__class__``; parameters
    stay); each call falls back to MLX's matmul where :func:`gemm` does not apply. Idempotent.

    Returns:
        How many layers were routed (fused groups count once), for the log.
    """
    routed = 0
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, FusedPart)}
    fused = {id(group.linear) for group in groups.values()}  # called through their group
    for group in groups.values():
        if group.split is None and _dense(group.linear):
            group.split = _group_split(group)
            routed += 1
    for module in model.modules():
        if (type(module) in (nn.Linear, nn.Embedding) and id(module) not in fused
                and _dense(module)):
            module.__class__ = GpuLinear if type(module) is nn.Linear else GpuEmbedding
            routed += 1
    return routed


def _dense(module: Any) -> bool:
    return (type(module) in (nn.Linear, GpuLinear, nn.Embedding, GpuEmbedding)
            and module.weight.dtype in (mx.bfloat16, mx.float16))


def _group_split(group: Any):
    sizes = [stop - start for start, stop in group.bounds]
    linear = group.linear

    def split(x: mx.array) -> list[mx.array] | None:
        return gemm(x, linear["weight"], sizes, linear["bias"] if "bias" in linear else None)

    return split
