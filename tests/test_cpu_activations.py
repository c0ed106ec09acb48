"""The native GeGLU and logit soft-capping kernels against float64 references and MLX's ops,
and their routing into mlx-lm's Gemma 2 / 3 / 4 modules (models/cpu_activations.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gemma2, gemma3_text, gemma4_text

from vllm_unified import bridge
from vllm_unified.models import cpu_activations, cpu_kernels

native = bridge.native_kernels()
pytestmark = pytest.mark.skipif(
    native is None or not hasattr(native, "gelu_tanh_mul"),
    reason="native extension without gelu_tanh_mul / softcap")


def _gelu_tanh64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("shape", [(1, 1536), (16, 4096), (3, 7, 37), (5,)])
def test_gelu_tanh_mul_is_as_close_to_float64_as_mlx(shape):
    rng = np.random.default_rng(0)
    gate = (rng.standard_normal(shape) * 4).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    got = native.gelu_tanh_mul(mx.array(gate), mx.array(up))
    assert got.shape == shape and got.dtype == mx.float32
    want = _gelu_tanh64(gate) * up
    ours = np.abs(np.array(got) - want).max()
    mlx_err = np.abs(np.array(nn.gelu_approx(mx.array(gate)) * mx.array(up)) - want).max()
    # the formula cancels for negative gates in fp32 (both lose the same digits there)
    assert ours <= max(2 * mlx_err, 1e-6)
    assert np.allclose(np.array(got), want, rtol=1e-5, atol=2e-6)


def test_gelu_tanh_mul_at_the_ends_of_the_fp32_range():
    gate = mx.array([-3e38, -1e30, -200.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 200.0, 1e30, 3e38])
    got = np.array(native.gelu_tanh_mul(gate, mx.ones_like(gate)))
    want = np.array(nn.gelu_approx(gate))
    assert np.all(np.isfinite(got))
    assert np.allclose(got, want, rtol=1e-6, atol=1e-9)


def test_softcap_is_as_close_to_float64_as_mlx():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((16, 4099)) * 40).astype(np.float32)
    got = np.array(native.softcap(mx.array(x), 30.0))
    want = 30.0 * np.tanh(x.astype(np.float64) / 30.0)
    mlx_err = np.abs(np.array(mx.tanh(mx.array(x) / 30.0) * 30.0) - want).max()
    assert np.abs(got - want).max() <= max(2 * mlx_err, 1e-5)
    extreme = mx.array([-3e38, -1e6, 0.0, 1e6, 3e38])
    assert np.array_equal(np.array(native.softcap(extreme, 50.0)), [-50, -50, 0, 50, 50])


def test_kernels_reject_bad_input():
    with pytest.raises(TypeError, match="float32"):
        native.gelu_tanh_mul(mx.zeros((2, 3), mx.float16), mx.zeros((2, 3), mx.float16))
    with pytest.raises(ValueError, match="differ in shape"):
        native.gelu_tanh_mul(mx.zeros((2, 3)), mx.zeros((3, 2)))
    with pytest.raises(TypeError, match="float32"):
        native.softcap(mx.zeros((2, 3), mx.bfloat16), 30.0)
    for cap in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="cap"):
            native.softcap(mx.zeros((2, 3)), cap)


def test_python_entries_fall_back_to_mlx_for_what_the_kernels_do_not_take():
    gate = mx.array(np.linspace(-4, 4, 12, dtype=np.float32)).astype(mx.float16)
    got = cpu_activations.geglu(gate, mx.ones_like(gate))
    assert got.dtype == mx.float16
    assert np.allclose(np.array(got), np.array(nn.gelu_approx(gate)), atol=1e-3)
    x = mx.array([1.0, -2.0]).astype(mx.bfloat16)
    assert cpu_activations.logit_softcap(30.0, x).dtype == mx.bfloat16


class _Spy:
    """Counts calls to the native module's kernels, forwarding them."""

    def __init__(self, mod):
        self.mod, self.calls = mod, {}

    def __getattr__(self, name):
        fn = getattr(self.mod, name)

        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call


def _gemma2() -> nn.Module:
    return gemma2.Model(gemma2.ModelArgs(
        model_type="gemma2", hidden_size=48, num_hidden_layers=2, intermediate_size=80,
        num_attention_heads=3, head_dim=16, rms_norm_eps=1e-6, vocab_size=200,
        num_key_value_heads=1, query_pre_attn_scalar=16))


def _gemma3() -> nn.Module:
    return gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=48, num_hidden_layers=2, intermediate_size=80,
        num_attention_heads=3, head_dim=16, vocab_size=200, num_key_value_heads=1,
        sliding_window_pattern=2))


def _gemma4() -> nn.Module:
    return gemma4_text.Model(gemma4_text.ModelArgs(
        hidden_size=48, num_hidden_layers=4, intermediate_size=80, num_attention_heads=3,
        head_dim=16, global_head_dim=32, vocab_size=200, vocab_size_per_layer_input=200,
        num_key_value_heads=1, num_kv_shared_layers=1, hidden_size_per_layer_input=8,
        sliding_window=8, sliding_window_pattern=2))


@pytest.mark.parametrize("build, geglus, softcaps", [
    (_gemma2, 2, 1), (_gemma3, 2, 0), (_gemma4, 4, 1)])
def test_gemma_models_keep_their_function_on_the_native_activations(monkeypatch, build,
                                                                     geglus, softcaps):
    mx.random.seed(5)
    model = build()
    model.update(nn.utils.tree_map(lambda p: p * 4, model.parameters()))  # gates beyond +-3
    mx.eval(model.parameters())
    tokens = mx.array(np.random.default_rng(0).integers(0, 200, (2, 9)))
    want = model(tokens)
    routed = cpu_kernels.install_cpu_kernels(model)
    assert any("GeGLU" in r or "geglu" in r for r in routed), routed
    assert cpu_kernels.install_cpu_kernels(model) == []  # idempotent
    spy = _Spy(native)
    monkeypatch.setattr(cpu_activations, "_native", lambda: spy)
    got = model(tokens)
    assert spy.calls.get("gelu_tanh_mul", 0) == geglus
    assert spy.calls.get("softcap", 0) == softcaps
    scale = float(mx.abs(want).max())
    assert float(mx.abs(got - want).max()) <= 1e-5 * scale
    mlp = model.layers[0].mlp
    assert isinstance(mlp, type(mlp).__mro__[1]) and type(mlp).__name__ == "MLP"
