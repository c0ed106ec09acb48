"""Mixture-of-experts families (issue 40) on tiny random checkpoints with awkward shapes
(tests/tiny_models.py ``MOE_FAMILIES``: 5 or 6 experts, top-2 or top-3, dense first layers and
shared experts where the family has them), through mlx-lm's own expert modules.

Fast tier: the loaded model's logits equal transformers' own forward on the checkpoint (the
config translation, the expert layouts, YaRN's rounding). Engine tiers: greedy ids of 4
concurrent requests of different lengths (16-token chunks, prefix caching with a second round
from the cache) equal vLLM's own CPU backend in fp32 (transformers' generation where vLLM's CPU
backend cannot serve the family) and mlx-lm's own generation.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_llm
from tiny_models import MOE_FAMILIES, make_tiny_checkpoint, mlx_lm_generate_step_ids

NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 20, 45, 70)
#: served in the CI tier: the most downloaded family (qwen3_moe: a dense first layer,
#: renormalised top-3 of 6). gpt_oss (attention sinks, alternating sliding windows, biased
#: experts with a clamped SwiGLU) is served in the CI tier from its MXFP4 GGUF
#: (tests/test_gguf_moe.py); the rest are in the slow tier.
CI_FAMILIES = ("qwen3_moe",)
#: families with recurrent layers: vLLM's prefix caching for them ("align" mode) is off
_RECURRENT = ("qwen3_5_moe", "lfm2_moe")
#: families vLLM 0.32's CPU backend cannot serve unquantized -> why; compared with
#: transformers' own greedy generation instead
NO_VLLM_CPU = {
    "gpt_oss": "vLLM 0.32's CPU backend has no unquantized MoE kernel for gpt-oss "
               "(NotImplementedError: No Unquantized MoE backend supports the deployment "
               "configuration)",
    "qwen3_5_moe": "vLLM's CPU gated delta-net runs in bf16 only (no fp32 reference)",
}


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
            for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_logits_equal_transformers(family, tmp_path):
    """Our loader's model (mlx-lm's module, our config translation and expert layouts) gives
    transformers' logits on the checkpoint transformers wrote."""
    import mlx.core as mx
    import torch
    import transformers

    from vllm_unified.models.loader import load_model

    folder = make_tiny_checkpoint(tmp_path, family)
    ids = _prompts()[2]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    model = load_model(str(folder), hf_config=None, dtype=mx.float32,
                       keep_quantized=False).model
    got = np.array(model(mx.array([ids]))[0])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def _transformers_greedy(folder: str, prompt: list[int], n: int) -> list[int]:
    """transformers' own model of the checkpoint, a full fp32 forward per token."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _spec(folder: str, prompts: list[list[int]], prefix_caching: bool) -> dict:
    requests = [{"prompt_token_ids": p,
                 "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}}
                for p in prompts]
    return {
        "model": folder,
        "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
                   "kv_cache_memory_bytes": 64 * 2**20, "seed": 0,
                   "enable_prefix_caching": prefix_caching, "disable_log_stats": False},
        # the second batch reads the first one's full prompt blocks from the prefix cache
        "batches": [requests, requests],
        "metrics": True,
    }


@pytest.mark.engine
@pytest.mark.parametrize("family", [f if f in CI_FAMILIES else
                                    pytest.param(f, marks=pytest.mark.slow)
                                    for f in MOE_FAMILIES])
def test_moe_family_matches_vllm_and_mlx_lm(family, tmp_path):
    """Greedy ids equal vLLM's CPU backend (fp32; transformers' generation where vLLM cannot
    serve the family: :data:`NO_VLLM_CPU`) and mlx-lm's ``generate_step`` on the same
    weights; the second round comes from the prefix cache where the family allows it."""
    folder = str(make_tiny_checkpoint(tmp_path / "ckpt", family))
    prompts = _prompts()
    caching = family not in _RECURRENT
    ours = run_llm({**_spec(folder, prompts, caching), "rpc": ["runner_stats"]}, tmp_path)
    got = [o["completions"][0]["token_ids"] for o in ours["outputs"]]
    if family in NO_VLLM_CPU:
        assert got == [_transformers_greedy(folder, p, NEW_TOKENS) for p in prompts] * 2
    else:
        native = run_llm(_spec(folder, prompts, caching), tmp_path, native=True)
        assert got == [o["completions"][0]["token_ids"] for o in native["outputs"]]
    assert got == mlx_lm_generate_step_ids(folder, prompts, NEW_TOKENS) * 2
    if caching:
        assert ours["metrics"]["vllm:prefix_cache_hits"] >= 16 * 3
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(prompts)


@pytest.mark.parametrize("config, named", [
    ({"model_type": "qwen2_moe", "rope_theta": 1e4, "norm_topk_prob": True}, "norm_topk_prob"),
    ({"model_type": "qwen2_moe", "rope_theta": 1e4, "decoder_sparse_step": 2},
     "decoder_sparse_step"),
    ({"model_type": "gpt_oss", "rope_theta": 1e4, "swiglu_limit": 10.0}, "swiglu_limit"),
    ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "scoring_func"),
    ({"model_type": "deepseek_v3", "rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"model_type": "glm4_moe_lite", "topk_method": "greedy"}, "topk_method"),
    ({"model_type": "qwen3_5_moe_text", "num_experts": 4, "mlp_only_layers": [0]},
     "mlp_only_layers"),
    ({"model_type": "lfm2_moe", "layer_types": ["conv"], "tie_word_embeddings": False},
     "tie_word_embeddings"),
    ({"model_type": "llama4", "text_config": {"num_hidden_layers": 4, "hidden_size": 8,
                                              "num_attention_heads": 1,
                                              "attention_chunk_size": 8,
                                              "num_experts_per_tok": 2}},
     "num_experts_per_tok"),
])
def test_router_settings_mlx_lm_ignores_are_refused(config, named):
    from vllm_unified.models.config import mlx_lm_config

    with pytest.raises(ValueError, match=named):
        mlx_lm_config(config)


def test_moe_config_translation():
    """transformers 5's Qwen3-MoE expert count and qwen3_5_moe_text become mlx-lm's keys;
    LFM2-MoE's layer kinds its attention indices."""
    from vllm_unified.models.config import mlx_lm_config

    assert mlx_lm_config({"model_type": "qwen3_moe", "rope_theta": 1e4,
                          "num_local_experts": 6})["num_experts"] == 6
    cfg = mlx_lm_config({"model_type": "qwen3_5_moe_text", "num_experts": 4,
                         "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["full_attention_interval"] == 4
    assert mlx_lm_config({"model_type": "glm4_moe_lite", "mlp_layer_types": [
        "dense", "dense", "sparse"]})["first_k_dense_replace"] == 2
    with pytest.raises(ValueError, match="mlp_layer_types"):
        mlx_lm_config({"model_type": "glm4_moe_lite", "mlp_layer_types": ["sparse", "dense"]})
    assert mlx_lm_config({"model_type": "lfm2_moe", "layer_types": [
        "conv", "full_attention", "conv"]})["full_attn_idxs"] == [1]
    # MiMo-V2-Flash: the pattern and window mlx-lm and vLLM read, over transformers' defaults
    cfg = mlx_lm_config({"model_type": "mimo_v2_flash", "num_hidden_layers": 3,
                         "hybrid_layer_pattern": [0, 1, 1], "sliding_window_size": 16,
                         "layer_types": ["full_attention", "sliding_attention",
                                         "full_attention"], "sliding_window": 128,
                         "attention_chunk_size": 128})
    assert cfg["layer_types"] == ["full_attention"] + ["sliding_attention"] * 2
    assert cfg["sliding_window"] == 16 and "attention_chunk_size" not in cfg
    with pytest.raises(ValueError, match="hybrid_layer_pattern"):
        mlx_lm_config({"model_type": "mimo_v2_flash", "num_hidden_layers": 3,
                       "hybrid_layer_pattern": [0, 1]})


def test_yarn_frequencies_round_as_mlx_lm_and_not_when_asked():
    """Rounded, the frequencies are mlx-lm's ``YarnRoPE``'s; unrounded (gpt-oss's
    ``truncate: false``) they differ; :func:`match_yarn_truncation` swaps them in."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import YarnRoPE

    from vllm_unified.models.rope_fixes import match_yarn_truncation, yarn_frequencies

    scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
               "original_max_position_embeddings": 4096}
    rope = YarnRoPE(64, base=150000.0, scaling_factor=32.0,
                    original_max_position_embeddings=4096)
    rounded = yarn_frequencies(64, 150000.0, scaling, truncate=True)
    assert mx.allclose(rope._freqs, rounded, rtol=1e-6).item()
    exact = yarn_frequencies(64, 150000.0, scaling, truncate=False)
    assert not mx.allclose(exact, rounded, rtol=1e-3).item()
    model = nn.Sequential(rope)
    config = {"rope_theta": 150000.0, "rope_scaling": {**scaling, "truncate": False}}
    assert match_yarn_truncation(model, config) == 1
    assert mx.array_equal(rope._freqs, exact).item()
    assert match_yarn_truncation(model, {**config, "rope_scaling": scaling}) == 0
