"""BitNet's ternary linears held as MLX affine 2-bit linears (models/bitlinear.py): the same
weights exactly, the same outputs as mlx-lm's kernel computes them (its packing, written out
here independently)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.bitlinear_layers import BitLinear

from vllm_unified.models.bitlinear import as_quantized_linear, replace_bitlinears


def _bitlinear(out_features: int, in_features: int, invert: bool, bias: bool, seed: int
               ) -> tuple[BitLinear, np.ndarray, float]:
    """A BitLinear with random ternary codes; returns it, its dense weight and its scale."""
    rng = np.random.default_rng(seed)
    rows = out_features // 4
    codes = rng.integers(0, 3, size=(4, rows, in_features), dtype=np.uint8)
    layer = BitLinear(in_features, out_features, bias=bias, invert_weight_scales=invert)
    layer.weight = mx.array(codes[0] | codes[1] << 2 | codes[2] << 4 | codes[3] << 6)
    layer.weight_scale = mx.array([0.37], dtype=mx.float32)
    if bias:
        layer.bias = mx.array(rng.standard_normal(out_features).astype(np.float32))
    dense = np.zeros((out_features, in_features), np.float32)
    for j in range(4):  # byte bits 2j..2j+1 hold output row r + j * out / 4
        dense[j * rows:(j + 1) * rows] = codes[j].astype(np.float32) - 1
    scale = np.float32(1 / np.float32(0.37)) if invert else np.float32(0.37)
    return layer, dense, float(scale)


@pytest.mark.parametrize("out_features,in_features,invert,bias", [
    (36, 96, False, True), (128, 256, True, False), (64, 160, False, False)])
def test_ternary_weights_are_affine_2bit_exactly(out_features, in_features, invert, bias):
    layer, dense, scale = _bitlinear(out_features, in_features, invert, bias, seed=in_features)
    q = as_quantized_linear(layer)
    assert (q.bits, q.mode) == (2, "affine") and in_features % q.group_size == 0
    got = np.array(mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size,
                                 bits=2))
    np.testing.assert_array_equal(got, dense * np.float32(scale))
    x = np.random.default_rng(1).standard_normal((5, in_features)).astype(np.float32)
    want = (x @ dense.T) * np.float32(scale) + (np.array(layer.bias) if bias else 0)
    np.testing.assert_allclose(np.array(q(mx.array(x))), want, rtol=1e-5, atol=1e-5)


def test_replaced_in_a_model_and_shapes_checked():
    import mlx.nn as nn

    model = nn.Sequential(_bitlinear(36, 96, False, False, 0)[0], nn.ReLU())
    assert replace_bitlinears(model) == 1
    assert isinstance(model.layers[0], nn.QuantizedLinear)
    with pytest.raises(ValueError, match="multiple of 32"):
        as_quantized_linear(_bitlinear(36, 48, False, False, 0)[0])
