"""The encoders' native GELU and softmax (MLX's CPU erf and exp are scalar) against float64
references and MLX's ops; the encoder attention built on them against MLX's fused attention;
the encoder runner's length groups."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vllm_unified import bridge
from vllm_unified.models.cpu_activations import Gelu
from vllm_unified.models.encoder_attention import encoder_attention
from vllm_unified.worker.encoder_runner import length_groups

native = bridge.native_kernels()
needs_native = pytest.mark.skipif(native is None or not hasattr(native, "softmax"),
                                  reason="native extension without gelu / softmax")


def _gelu64(x: np.ndarray, approximate: bool) -> np.ndarray:
    x = x.astype(np.float64)
    if approximate:
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / np.sqrt(2.0)))


@needs_native
@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("shape", [(7,), (3, 1536), (2, 5, 130)])
def test_gelu_is_as_close_to_float64_as_mlx(shape, approximate):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    got = native.gelu(mx.array(x), approximate=approximate)
    assert got.shape == shape and got.dtype == mx.float32
    want = _gelu64(x, approximate)
    mlx = nn.gelu_approx(mx.array(x)) if approximate else nn.gelu(mx.array(x))
    mlx_err = np.abs(np.array(mlx) - want).max()
    assert np.abs(np.array(got) - want).max() <= max(2 * mlx_err, 1e-6)
    # the module: native on fp32, MLX's op for other dtypes
    assert np.array_equal(np.array(Gelu(approximate)(mx.array(x))), np.array(got))
    half = mx.array(x).astype(mx.bfloat16)
    assert Gelu(approximate)(half).dtype == mx.bfloat16


@needs_native
def test_gelu_at_the_ends_of_the_fp32_range():
    """Finite everywhere (MLX's own ``nn.gelu`` overflows to inf at 3e38)."""
    x = np.array([-3e38, -1e30, -200.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 200.0, 1e30, 3e38],
                 dtype=np.float32)
    for approximate in (False, True):
        got = np.array(native.gelu(mx.array(x), approximate=approximate))
        assert np.all(np.isfinite(got))
        assert np.allclose(got, _gelu64(x, approximate), rtol=1e-6, atol=1e-9)


@needs_native
@pytest.mark.parametrize("shape", [(1, 1), (4, 12, 9, 9), (3, 1000)])
def test_softmax_is_as_close_to_float64_as_mlx(shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 8).astype(np.float32)
    if len(shape) == 4:  # an encoder mask: the lowest fp32 on padded keys
        x[..., -3:] += np.finfo(np.float32).min
    got = np.array(native.softmax(mx.array(x)))
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    want = e / e.sum(axis=-1, keepdims=True)
    mlx_err = np.abs(np.array(mx.softmax(mx.array(x), axis=-1)) - want).max()
    assert np.abs(got - want).max() <= max(2 * mlx_err, 1e-7)
    with pytest.raises(TypeError, match="float32"):
        native.softmax(mx.array(x).astype(mx.float16))


@needs_native
def test_encoder_attention_matches_mlx_fused_attention():
    """Padded sequences with an additive mask (mlx-vlm's), within fp32 rounding."""
    rng = np.random.default_rng(2)
    q, k, v = (mx.array(rng.standard_normal((3, 4, 11, 32)).astype(np.float32))
               for _ in range(3))
    lengths = np.array([11, 6, 1])
    mask = np.where(np.arange(11)[None, :] < lengths[:, None], 0.0,
                    np.finfo(np.float32).min).astype(np.float32)[:, None, None, :]
    got = encoder_attention(q, k, v, None, 0.125, mx.array(mask))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mx.array(mask))
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no cache"):
        encoder_attention(q, k, v, object(), 0.125, None)


def test_length_groups_bound_padding_and_cover_every_sequence():
    rng = np.random.default_rng(3)
    lengths = rng.integers(3, 120, size=200)
    groups = length_groups(lengths, slack=1.1, max_tokens=2048)
    assert sorted(np.concatenate(groups).tolist()) == list(range(200))
    for g in groups:
        padded = len(g) * lengths[g].max()
        assert len(g) == 1 or (padded <= 1.1 * lengths[g].sum() and padded <= 2048)
    assert len(length_groups(np.array([5000, 3]), max_tokens=64)) == 2
