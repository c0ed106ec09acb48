"""BitNet b1.58's ternary linears (mlx-lm's ``BitLinear``) as MLX affine 2-bit linears.

mlx-lm computes ``BitLinear`` with a Metal kernel (``mx.fast.metal_kernel``), which MLX's CPU
and CUDA backends do not have. Its weights are exactly affine 2-bit weights: code ``q`` in
{0, 1, 2} stands for ``s * (q - 1)`` with one scale ``s`` per layer, which is
``scale * q + bias`` with ``scale = s`` and ``bias = -s`` in every group. So each layer becomes
an ``nn.QuantizedLinear`` holding the same codes (2 bits a weight, plus a scale and a bias per
group), which MLX's quantized ops and the native CPU kernels run; no weight is dequantized.

``BitLinear``'s layout (``mlx_lm/models/bitlinear_layers.py``): ``weight`` is uint8 of shape
``(ceil(out / 4), in)``; bits ``2j..2j+1`` of byte ``[r, c]`` hold the code of output row
``r + j * out / 4``; the output is ``(x @ (q - 1).T) * s`` with ``s = weight_scale`` (its
reciprocal where ``invert_weight_scales``), plus the bias if any.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

__all__ = ["as_quantized_linear", "replace_bitlinears", "ternary_codes"]

logger = logging.getLogger("vllm.vllm_unified.models.bitlinear")

_BITS = 2


def ternary_codes(layer: nn.Module) -> np.ndarray:
    """The codes of a ``BitLinear`` as uint8 ``(out_features, in_features)``, each in {0, 1, 2}
    (the weight is ``code - 1`` times the layer's scale)."""
    packed = np.array(layer.weight, copy=False)
    rows = packed.shape[0]
    codes = np.concatenate([(packed >> (2 * j)) & 3 for j in range(4)], axis=0)
    if layer.out_features != 4 * rows:
        raise ValueError(f"BitLinear with {layer.out_features} output features: the packed "
                         f"layout needs a multiple of 4 (weight rows {rows})")
    return codes.astype(np.uint8)


def _group_size(in_features: int) -> int:
    for g in (128, 64, 32):
        if in_features % g == 0:
            return g
    raise ValueError(f"BitLinear with {in_features} input features: affine 2-bit groups need "
                     "a multiple of 32")


def as_quantized_linear(layer: nn.Module) -> nn.QuantizedLinear:
    """The ``nn.QuantizedLinear`` (affine, 2 bits, groups of 128, 64 or 32) that computes what
    ``layer`` (an mlx-lm ``BitLinear``) computes; its dequantized weight is exactly
    ``(code - 1) * scale``.

    Raises:
        ValueError: output features not a multiple of 4, input features not of 32.
    """
    codes = ternary_codes(layer)
    out_features, in_features = codes.shape
    group = _group_size(in_features)
    # 16 codes a uint32, code k of a word at bits 2k (MLX's affine packing)
    words = codes.astype(np.uint32).reshape(out_features, in_features // 16, 16)
    packed = np.bitwise_or.reduce(words << (np.arange(16, dtype=np.uint32) * _BITS), axis=-1)
    scale = layer.weight_scale.reshape(-1)[0]
    if layer.invert_weight_scales:
        scale = 1 / scale
    out = nn.QuantizedLinear(in_features, out_features, bias=layer.bias is not None,
                             group_size=group, bits=_BITS)
    shape = (out_features, in_features // group)
    out.weight = mx.array(packed)
    out.scales = mx.full(shape, scale, dtype=layer.weight_scale.dtype)
    out.biases = mx.full(shape, -scale, dtype=layer.weight_scale.dtype)
    if layer.bias is not None:
        out.bias = layer.bias
    return out


def replace_bitlinears(model: nn.Module) -> int:
    """Replace every ``BitLinear`` of ``model`` by :func:`as_quantized_linear`'s layer.

    Returns:
        How many were replaced.
    """
    from mlx_lm.models.bitlinear_layers import BitLinear

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, BitLinear)]
    if not found:
        return 0
    model.update_modules(tree_unflatten([(name, as_quantized_linear(m)) for name, m in found]))
    logger.info("%d BitNet ternary linears held as affine 2-bit linears (mlx-lm computes "
                "them with a Metal-only kernel)", len(found))
    return len(found)
