"""The start-up log's parameter counts (models/parameters.py): total, active per token for
mixture-of-experts layers, and bytes per storage format, on a tiny mlx-lm Qwen3-MoE."""

from __future__ import annotations

import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_moe

from vllm_unified.models.parameters import parameter_summary

# hidden 64, 2 layers, 5 experts of width 64, top-2; the first layer dense
CONFIG = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
              intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              rms_norm_eps=1e-5, vocab_size=100, num_experts=5, num_experts_per_tok=2,
              decoder_sparse_step=1, mlp_only_layers=[0], moe_intermediate_size=64,
              rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=512,
              norm_topk_prob=True)
EXPERT_PARAMS = 3 * 5 * 64 * 64  # one MoE layer: gate, up, down of 5 experts


def _model() -> qwen3_moe.Model:
    return qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(CONFIG))


def test_dense_weights_counted_and_experts_active_by_top_k():
    model = _model()
    s = parameter_summary(model, CONFIG)
    assert s.total == sum(v.size for _, v in tree_flatten(model.parameters()))
    assert s.active == s.total - EXPERT_PARAMS + EXPERT_PARAMS * 2 // 5
    assert s.by_format == {"float32": [s.total, 4 * s.total]}
    assert "active per token" in s.describe()


def test_quantized_weights_counted_as_the_values_they_hold():
    dense = parameter_summary(_model(), CONFIG)
    model = _model()
    nn.quantize(model, group_size=32, bits=4)
    s = parameter_summary(model, CONFIG)
    assert (s.total, s.active) == (dense.total, dense.active)
    params, nbytes = s.by_format["4-bit affine"]
    # 4 bits a value plus an fp32 scale and bias per group of 32
    assert nbytes == params // 2 + params // 32 * 8


def test_expert_layer_without_top_k_is_an_error():
    model = _model()
    for _, m in model.named_modules():
        if hasattr(m, "top_k"):
            del m.top_k
    with pytest.raises(ValueError, match="top_k"):
        parameter_summary(model, {})


def test_top_k_from_kimis_config_name():
    """Kimi Linear's MoE block keeps no top_k; its config spells it num_experts_per_token."""
    model = _model()
    want = parameter_summary(model, {}).active
    for _, m in model.named_modules():
        if hasattr(m, "top_k"):
            k = m.top_k
            del m.top_k
    assert parameter_summary(model, {"num_experts_per_token": k}).active == want
    assert parameter_summary(model, {"text_config": {"num_experts_per_token": k}}).active == want
