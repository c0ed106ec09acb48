"""Bidirectional attention of the encoder models (mlx-vlm's BERT, XLM-RoBERTa, ModernBERT) on
MLX's CPU backend: MLX 0.32.4's CPU ``scaled_dot_product_attention`` falls back to matmuls and
a softmax whose ``exp`` runs one element at a time; the native ``softmax`` is vectorized. On
other backends, or without the native kernels, MLX's own fused attention runs.

mlx-vlm's encoder layers call the name ``scaled_dot_product_attention`` of their own module;
:func:`route_encoder_attention` points it here (:func:`vllm_unified.patches.
route_mlx_lm_functions`, the one place other packages' functions are replaced).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_unified import bridge, patches

__all__ = ["ENCODER_MODULES", "encoder_attention", "route_encoder_attention"]

#: the mlx-vlm modules whose layers call ``scaled_dot_product_attention``
ENCODER_MODULES = ("mlx_vlm.models.bert.bert", "mlx_vlm.models.xlm_roberta.xlm_roberta",
                   "mlx_vlm.models.modernbert.modernbert")


def encoder_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                      scale: float, mask: mx.array | None, sinks: mx.array | None = None
                      ) -> mx.array:
    """``softmax(scale q k^T + mask) v`` over ``[B, H, L, D]`` inputs, ``mask`` additive and
    broadcastable to ``[B, H, L, L]`` (mlx-vlm's signature; encoders have no cache).

    Raises:
        ValueError: a cache or attention sinks (no encoder has them).
    """
    if cache is not None or sinks is not None:
        raise ValueError("encoder attention takes no cache and no sinks")
    native = bridge.native_kernels()
    if native is None or queries.dtype != mx.float32 or not hasattr(native, "softmax"):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    if mask is not None:
        scores = scores + mask
    return native.softmax(scores) @ values


def route_encoder_attention(model: nn.Module) -> list[tuple[str, str]]:
    """Point the attention of ``model``'s mlx-vlm encoder modules at :func:`encoder_attention`;
    returns ``(module, name)`` of each name patched now."""
    return patches.route_mlx_lm_functions(model, {
        m: {"scaled_dot_product_attention": encoder_attention} for m in ENCODER_MODULES})
