"""Fused q/k/v and gate/up projections (models/fused_projections.py): the same outputs as the
separate matmuls, each fused weight counted once, nothing held after a layer's use."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import profile_for
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import make_prompt_cache

from vllm_unified.models.fused_projections import FusedPart, fuse_projections

QWEN3 = qwen3.ModelArgs(
    model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    vocab_size=300, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=True)
LLAMA_BIAS = llama.ModelArgs(
    model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=300,
    attention_bias=True, mlp_bias=True, tie_word_embeddings=False)


def _model(kind: str, quantize: bool) -> nn.Module:
    mx.random.seed(3)
    model = qwen3.Model(QWEN3) if kind == "qwen3" else llama.Model(LLAMA_BIAS)
    if kind == "llama_bias":  # random biases, so that a dropped or misplaced bias shows
        for _, module in model.named_modules():
            if isinstance(module, nn.Linear) and "bias" in module:
                module.bias = mx.random.normal(module.bias.shape)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _params(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "4bit"])
@pytest.mark.parametrize("kind", ["qwen3", "llama_bias"])
def test_fused_model_equals_separate_matmuls(kind: str, quantize: bool) -> None:
    model = _model(kind, quantize)
    tokens = mx.array(np.random.default_rng(0).integers(0, 300, (3, 9)))
    want = model(tokens, cache=make_prompt_cache(model))
    before = _params(model)
    counts = fuse_projections(model)
    assert counts == {"qkv_proj": 2, "gate_up_proj": 2}
    assert _params(model) == before  # every weight once: the parts hold no parameters
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedPart) and not attn.q_proj.parameters()
    got = model(tokens, cache=make_prompt_cache(model))
    assert mx.array_equal(got, want)  # row cuts of one matmul on the CPU: bit for bit
    assert fuse_projections(model) == {}  # idempotent


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "4bit"])
def test_one_row_and_many_rows_paths(quantize: bool) -> None:
    """q/k/v run as one matmul for a one-row input and each alone (on views of the fused
    weight) for more rows; both equal the separate projections; the views cost no memory."""
    model = _model("qwen3", quantize)
    attn = model.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj")
    separate = [attn[n] for n in names]
    x1, x5 = mx.random.normal((1, 1, 128)), mx.random.normal((5, 1, 128))
    want = [[p(x) for p in separate] for x in (x1, x5)]
    mx.eval(want)
    mx.clear_cache()
    before = mx.get_active_memory()
    fuse_projections(model)
    del separate
    added = mx.get_active_memory() - before
    assert added <= 0  # the concatenations replaced the parts; the row views are views
    group = attn.q_proj._group[0]
    assert group.max_rows == 1 and model.layers[0].mlp.gate_proj._group[0].max_rows is None
    for x, w in zip((x1, x5), want, strict=True):
        got = [attn[n](x) for n in names]
        for g, e in zip(got, w, strict=True):
            assert mx.array_equal(g, e)


def test_part_order_and_inputs() -> None:
    """Any call order gives each projection's own output; a sibling called with another
    input computes its own (not the earlier input's columns); nothing is held afterwards."""
    mx.random.seed(1)
    parent = nn.Module()
    for name, out in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
        setattr(parent, name, nn.Linear(16, out, bias=False))
    separate = {n: parent[n].weight for n in ("q_proj", "k_proj", "v_proj")}
    fuse_projections(parent)
    x, y = mx.random.normal((5, 16)), mx.random.normal((5, 16))
    assert mx.allclose(parent.v_proj(x), x @ separate["v_proj"].T)
    assert mx.allclose(parent.k_proj(y), y @ separate["k_proj"].T)  # another input
    assert mx.allclose(parent.q_proj(y), y @ separate["q_proj"].T)
    assert mx.allclose(parent.q_proj(y), y @ separate["q_proj"].T)  # twice: recomputed
    group = parent.q_proj._group[0]
    parent.k_proj(x), parent.q_proj(x), parent.v_proj(x)
    assert group._x is None and group._y is None  # every part took its columns: released


def test_unfusable_siblings_stay_separate() -> None:
    parent = nn.Module()
    parent.gate_proj = nn.Linear(16, 8, bias=False)
    parent.up_proj = nn.QuantizedLinear(32, 8, group_size=32, bits=4)  # another input size
    assert fuse_projections(parent) == {}
    assert isinstance(parent.gate_proj, nn.Linear)
    mixed = nn.Module()
    mixed.gate_proj = nn.Linear(16, 8, bias=False)
    mixed.up_proj = nn.Linear(16, 8, bias=True)  # a bias on one only
    assert fuse_projections(mixed) == {}


def test_profile_fuses_on_gpu_compute_and_the_native_cpu_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU compute fuses; so does the CPU backend where the native kernels run (the runner
    caps its groups at one-row inputs); CPU compute on a GPU build's buffers (no native
    kernels) does not; VLLM_UNIFIED_FUSE_PROJECTIONS=0 turns it off everywhere."""
    assert profile_for("cuda", "cuda").fuse_projections
    assert profile_for("metal", "metal").fuse_projections
    cpu = profile_for("cpu", "cpu")
    assert cpu.fuse_projections == cpu.cpu_kernels
    assert not profile_for("cpu", "cuda").fuse_projections
    monkeypatch.setenv("VLLM_UNIFIED_FUSE_PROJECTIONS", "0")
    assert not profile_for("cuda", "cuda").fuse_projections
    assert not profile_for("cpu", "cpu").fuse_projections


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "4bit"])
def test_cpu_groups_fuse_one_row_inputs_only(quantize: bool) -> None:
    """``max_rows=1`` (the CPU runner's setting) caps gate/up too: more rows run each part
    alone on its rows of the fused weight, so no part's output is a strided column view."""
    model = _model("qwen3", quantize)
    mlp = model.layers[0].mlp
    x1, x5 = mx.random.normal((1, 1, 128)), mx.random.normal((5, 1, 128))
    want = [[mlp[n](x) for n in ("gate_proj", "up_proj")] for x in (x1, x5)]
    assert fuse_projections(model, max_rows=1) == {"qkv_proj": 2, "gate_up_proj": 2}
    assert mlp.gate_proj._group[0].max_rows == 1
    for x, w in zip((x1, x5), want, strict=True):
        for name, e in zip(("gate_proj", "up_proj"), w, strict=True):
            got = mlp[name](x)
            assert mx.array_equal(got, e)
    group = mlp.gate_proj._group[0]
    assert group._outputs(x1) is not None and group._outputs(x5) is None  # alone from 2 rows
