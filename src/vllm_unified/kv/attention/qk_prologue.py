"""The per-head steps between the q/k projections and paged attention, done inside the kernels.

Between its projections and its attention, a llama-style attention layer normalises each query
and key head (Qwen3's ``q_norm`` / ``k_norm``, RMSNorm over the head) and rotates it by its
position (RoPE): in mlx-lm four MLX primitives per layer and step (two ``rms_norm``, two
``rope``), each a kernel launch that MLX encodes on the host. In a pure-decode step on a GPU
backend these four are what the host spends its time on next to the matmuls
(docs/dev/benchmarks.md), so there they are folded into the two kernels that run anyway: the KV
write normalises and rotates each key head before it stores it
(:func:`vllm_unified.kv.gpu.write.write_kv_qk_gpu`), and the paged attention kernel each query
head as it loads it (:mod:`vllm_unified.kv.gpu.paged`). Values pass unchanged.

:data:`SNIPPET` (``kernels/qk_prologue.inc``) is the shared body text (one source, both
dialects; :mod:`vllm_unified.gpu_dialect`), spliced into both kernels. It works on one head
held by one SIMD group of 32 lanes, lane ``l`` holding channels ``l * EPL ... l * EPL + EPL -
1`` (``EPL = D / 32``) in fp32, and computes, as MLX 0.32.4's ``mx.fast.rms_norm`` and
``mx.fast.rope`` do (``mlx/backend/cuda/rms_norm.cu``, ``rope.cu``):

* RMSNorm: ``x * rsqrt(mean(x^2) + eps) * w`` (the sum of squares over the 32 lanes by a SIMD
  reduction; the mean as that sum divided by D);
* RoPE at position ``p``: ``theta_i = scale * p * inv_freq_i``; pair ``(a, b)`` becomes
  ``(a cos - b sin, a sin + b cos)``, the pairs being channels ``(i, i + D/2)`` (``ROPE=1``,
  mlx-lm's ``traditional=False``; the partner is lane ``l ^ 16``, same element) or
  ``(2i, 2i + 1)`` (``ROPE=2``, ``traditional=True``; within a lane, or lane ``l ^ 1`` when
  ``EPL == 1``).

Unlike mlx-lm's separate ops, nothing is rounded to the model's dtype between the norm and the
rotation (a key is rounded once, when it is stored; a query stays fp32 into the dot products).

Parameters travel in one fp32 array per layer (:attr:`QKPrologue.params`), made once at
start-up: ``[eps, scale, inv_freq (D/2), q weight (D), k weight (D)]`` (weights of 1 when the
layer has no norm; ``NORM=0`` skips the norm altogether).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_unified import gpu_dialect

__all__ = ["SNIPPET", "QKPrologue", "prologue_code", "prologue_of", "reference"]

#: Template arguments the snippet reads (besides ``D``, and ``EPL = D / 32`` and ``lane``
#: declared by the kernel): NORM (0/1), ROPE (0: none, 1: pairs (i, i + D/2), 2: pairs
#: (2i, 2i + 1)). ``@X@``: the lane's ``float[EPL]``; ``@W@``: 0 for a query, 1 for a key;
#: ``@POS@``: the head's token position (an int expression). Every lane of the SIMD group must
#: run it (SIMD reductions and shuffles).
SNIPPET = gpu_dialect.kernel_file(__package__, "qk_prologue.inc")


def prologue_code(values: str, which: int, position: str) -> str:
    """:data:`SNIPPET` for the lane array ``values``, the query (``which=0``) or key (1)
    weights, at token position ``position``."""
    return gpu_dialect.render(SNIPPET, X=values, W=str(which), POS=position)


@dataclass(frozen=True)
class QKPrologue:
    """One attention layer's per-head norm and rotation, as the kernels take them.

    Attributes:
        params: fp32 ``[2 + D/2 + 2D]``: eps, RoPE position scale, inverse frequencies, the
            query and key norm weights (module docstring).
        head_dim: D.
        norm: the layer normalises its query and key heads.
        rope: 0 (no rotation), 1 (pairs ``(i, i + D/2)``) or 2 (pairs ``(2i, 2i + 1)``).
    """

    params: mx.array
    head_dim: int
    norm: bool
    rope: int

    def template(self) -> list[tuple[str, int]]:
        """The kernels' template arguments of this prologue."""
        return [("NORM", int(self.norm)), ("ROPE", self.rope)]

    @classmethod
    def build(cls, head_dim: int, inv_freq: np.ndarray | None, scale: float = 1.0,
              traditional: bool = False,
              norm: tuple[np.ndarray, np.ndarray, float] | None = None) -> QKPrologue:
        """A prologue from its values.

        Args:
            head_dim: D: 32, 64, 128 or 256.
            inv_freq: ``[D/2]`` inverse frequencies, or None for no rotation.
            scale: the RoPE position scale.
            traditional: rotate pairs ``(2i, 2i + 1)`` instead of ``(i, i + D/2)``.
            norm: ``(query weight [D], key weight [D], eps)``, or None for no norm.

        Raises:
            ValueError: a head size the kernels do not take, or arrays of the wrong size.
        """
        if head_dim not in (32, 64, 128, 256):
            raise ValueError(f"head size {head_dim}: the kernels take 32, 64, 128 or 256")
        half = head_dim // 2
        freqs = np.zeros(half, np.float32) if inv_freq is None else np.asarray(inv_freq)
        wq, wk, eps = norm if norm is not None else (np.ones(head_dim), np.ones(head_dim), 0.0)
        if freqs.shape != (half,) or np.shape(wq) != (head_dim,) or np.shape(wk) != (head_dim,):
            raise ValueError(f"expected inv_freq [{half}] and norm weights [{head_dim}]")
        params = np.concatenate([np.array([eps, scale], np.float32), freqs.astype(np.float32),
                                 np.asarray(wq, np.float32), np.asarray(wk, np.float32)])
        rope = 0 if inv_freq is None else 2 if traditional else 1
        return cls(mx.array(params), head_dim, norm is not None, rope)


def _inv_freq(rope: Any, head_dim: int) -> tuple[np.ndarray, float, bool] | None:
    """``(inv_freq [D/2] fp32, position scale, traditional)`` of an mlx-lm RoPE module that
    rotates the whole head, as ``mx.fast.rope`` computes them (``inv_freq_i =
    2^(-(i / (D/2)) log2(base))``, or ``1 / freqs_i`` for a module with explicit
    frequencies); None for any other module (partial rotary, YaRN's pre-scaling, ...)."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    half = head_dim // 2
    if type(rope) is nn.RoPE and rope.dims == head_dim:
        d = np.arange(half, dtype=np.float32) / np.float32(half)
        inv = np.exp2(-d * np.float32(np.log2(rope.base))).astype(np.float32)
        return inv, float(rope.scale), bool(rope.traditional)
    if type(rope) is Llama3RoPE and rope.dims == head_dim:
        freqs = np.array(rope._freqs.astype(mx.float32), dtype=np.float64)
        return (1.0 / freqs).astype(np.float32), 1.0, bool(rope.traditional)
    return None


def _norm_weight(norm: Any, head_dim: int) -> tuple[np.ndarray, float] | None:
    """``(weight [D] fp32, eps)`` of an ``nn.RMSNorm`` over one head; None otherwise."""
    if type(norm) is not nn.RMSNorm or norm.weight.shape != (head_dim,):
        return None
    return np.array(norm.weight.astype(mx.float32)), float(norm.eps)


def prologue_of(attention: nn.Module, head_dim: int) -> QKPrologue | None:
    """The prologue of an mlx-lm attention module with ``rope`` and optionally ``q_norm`` and
    ``k_norm`` (both or neither), or None when it has a part the kernels do not compute (a
    rope other than ``nn.RoPE`` / ``Llama3RoPE`` over the whole head, norms other than
    ``nn.RMSNorm`` over one head, one norm without the other, different eps) or a head size
    the kernels do not take (32, 64, 128 or 256)."""
    if head_dim not in (32, 64, 128, 256):
        return None
    rope = _inv_freq(getattr(attention, "rope", None), head_dim)
    if rope is None:
        return None
    inv_freq, scale, traditional = rope
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    norm = None
    if q_norm is not None or k_norm is not None:
        q, k = _norm_weight(q_norm, head_dim), _norm_weight(k_norm, head_dim)
        if q is None or k is None or q[1] != k[1]:
            return None
        norm = (q[0], k[0], q[1])
    return QKPrologue.build(head_dim, inv_freq, scale, traditional, norm)


def reference(x: mx.array, prologue: QKPrologue, which: int, positions: mx.array) -> mx.array:
    """The prologue by plain MLX ops in fp32, in the kernels' order of operations (the oracle
    the kernels are tested against; ``tests/test_qk_prologue.py`` also checks it against
    mlx-lm's modules).

    Args:
        x: ``[T, heads, D]`` or ``[T, heads, 1, D]`` raw projections (any float dtype).
        which: 0 for queries (the query norm weight), 1 for keys.
        positions: int ``[T]`` token positions.

    Returns:
        fp32, ``x``'s shape.
    """
    d = prologue.head_dim
    half = d // 2
    p = prologue.params
    shape = x.shape
    y = x.reshape(shape[0], -1, d).astype(mx.float32)
    if prologue.norm:
        w = p[2 + half + which * d: 2 + half + (which + 1) * d]
        y = y * mx.rsqrt(mx.mean(y * y, axis=-1, keepdims=True) + p[0]) * w
    if prologue.rope:
        theta = (p[1] * positions.astype(mx.float32))[:, None, None] * p[2: 2 + half]
        cos, sin = mx.cos(theta), mx.sin(theta)  # [T, 1, D/2]
        if prologue.rope == 1:
            a, b = y[..., :half], y[..., half:]
        else:
            a, b = y[..., 0::2], y[..., 1::2]
        ra, rb = a * cos - b * sin, a * sin + b * cos
        y = (mx.concatenate([ra, rb], axis=-1) if prologue.rope == 1
             else mx.stack([ra, rb], axis=-1).reshape(y.shape))
    return y.reshape(shape)
