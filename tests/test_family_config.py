"""The mlx-lm config of each plain attention family, laid out from the HF config
(:mod:`vllm_unified.models.config`), gives the family's own transformers forward: the loaded
mlx-lm model's logits equal transformers' on the same tiny checkpoint. No engine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import (
    ATTENTION_FAMILIES,
    COHERE2_WINDOW,
    PHI3_ORIGINAL_CONTEXT,
    make_tiny_checkpoint,
)

from vllm_unified.models.config import mlx_lm_config
from vllm_unified.models.loader import load_model

#: longer than the windowed families' window (12), shorter than Mistral's (40, which mlx-lm's
#: module does not apply) and than Phi-3's original context (transformers then takes the
#: short LongRoPE factors)
PROMPT = [(21 + 13 * j) % 40000 + 100 for j in range(30)]


#: and Falcon-H1, whose muP multipliers mlx-lm's module applies only in part
#: (:mod:`vllm_unified.models.multipliers` adds the rest)
@pytest.mark.parametrize("family", ATTENTION_FAMILIES + ("falcon_h1",))
def test_mlx_lm_forward_equals_transformers(family, tmp_path):
    import torch
    import transformers

    folder = make_tiny_checkpoint(tmp_path, family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    # vLLM's choice of LongRoPE factors for a context that fits the original one
    loaded = load_model(str(folder), hf_config=None, dtype=mx.float32, keep_quantized=False,
                        max_model_len=PHI3_ORIGINAL_CONTEXT)
    from mlx_lm.models.cache import make_prompt_cache

    got = np.array(loaded.model(mx.array([PROMPT]), cache=make_prompt_cache(loaded.model))[0])
    if family == "cohere2":  # vLLM's window, one token more than transformers': the same
        got, want = got[:COHERE2_WINDOW], want[:COHERE2_WINDOW]  # up to the window
    np.testing.assert_allclose(got, want, atol=2e-5 * float(np.abs(want).max()))


def test_longrope_factors_follow_vllms_choice():
    """vLLM takes LongRoPE's short factors when max_model_len fits the original context, the
    long ones otherwise; mlx-lm always reads long_factor."""
    base = {"model_type": "phi3", "max_position_embeddings": 4096,
            "original_max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}}
    short = mlx_lm_config(base, max_model_len=64)["rope_scaling"]
    assert short["type"] == "longrope" and short["long_factor"] == [1.0, 2.0]
    assert mlx_lm_config(base, max_model_len=65)["rope_scaling"]["long_factor"] == [3.0, 4.0]
    assert mlx_lm_config(base)["rope_scaling"]["long_factor"] == [3.0, 4.0]
    with pytest.raises(ValueError, match="long_mscale"):
        mlx_lm_config({**base, "rope_parameters": {**base["rope_parameters"],
                                                   "long_mscale": 1.2}})


def test_layer_patterns_and_refusals():
    exaone = {"model_type": "exaone4", "num_hidden_layers": 4, "rope_theta": 1e6,
              "sliding_window": 8, "sliding_window_pattern": 4,
              "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    assert mlx_lm_config(exaone)["sliding_window_pattern"] == "LLLG"
    assert mlx_lm_config({**exaone, "sliding_window": None})["sliding_window_pattern"] is None
    cohere = {"model_type": "cohere2", "num_hidden_layers": 4, "rope_theta": 5e4,
              "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert mlx_lm_config(cohere)["sliding_window_pattern"] == 2
    with pytest.raises(ValueError, match="periodic"):
        mlx_lm_config({**cohere, "layer_types": ["full_attention"] + ["sliding_attention"] * 3})
    for model_type in ("cohere2", "glm4", "starcoder2"):
        with pytest.raises(ValueError, match="RoPE scaling"):
            mlx_lm_config({**cohere, "model_type": model_type, "rope_parameters": {
                "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}})


def test_cohere2_windows_are_vllms(tmp_path):
    """Cohere 2's sliding layers see W + 1 tokens as vLLM serves them (transformers and
    mlx-lm's own layout: W): the config is laid out with vLLM's window."""
    from vllm_unified.models.capability import check_model

    loaded = load_model(str(make_tiny_checkpoint(tmp_path, "cohere2")), hf_config=None,
                        dtype=mx.float32, keep_quantized=False)
    layout = check_model(loaded.model, loaded.config, recurrent_families=(), kv_shape=None,
                         config_window=None, probe=False)
    w = COHERE2_WINDOW + 1
    assert layout.windows == {0: w, 1: w, 2: w, 3: None}


def test_plamo3_sliding_layers_see_the_window_and_the_current_token(tmp_path):
    """PLaMo 3's mask attends to the current token and window_size before it; mlx-lm's cache
    keeps one fewer, so the loaded model's caches (the paged windows) are made window_size + 1
    and the config's layer_types are written out, the global layers without a window."""
    import json

    import model_matrix as mm

    from vllm_unified.models.capability import check_model

    mm.build_checkpoint("plamo3", tmp_path)
    folder = tmp_path / "plamo3"
    loaded = load_model(str(folder), hf_config=json.loads((folder / "config.json").read_text()),
                        dtype=mx.float32, keep_quantized=False)
    assert loaded.config["layer_types"] == ["sliding_attention", "full_attention"]
    layout = check_model(loaded.model, loaded.config, recurrent_families=(), kv_shape=None,
                         config_window=mm.WINDOW, probe=False)
    assert layout.windows == {0: mm.WINDOW + 1, 1: None}
    with pytest.raises(ValueError, match="every 2-th layer"):
        mlx_lm_config({"model_type": "plamo3", "num_hidden_layers": 2, "window_size": 8,
                       "sliding_window_pattern": 2,
                       "layer_types": ["full_attention", "sliding_attention"]})


def test_phi3small_context_must_fit_the_local_blocks():
    """Phi-3-small's block-sparse layers are causal attention within their local blocks
    (block size x local blocks tokens); a longer context is refused by name."""
    cfg = {"model_type": "phi3small", "blocksparse_block_size": 64,
           "blocksparse_num_local_blocks": 16, "max_position_embeddings": 8192}
    assert mlx_lm_config(cfg, max_model_len=1024)["model_type"] == "phi3small"
    for length in (1025, None):
        with pytest.raises(ValueError, match="block-sparse attention .* 1024"):
            mlx_lm_config(cfg, max_model_len=length)


@pytest.mark.parametrize("act", [None, "gelu_pytorch_tanh", "gelu"])
def test_gpt_bigcode_mlp_computes_the_configs_activation(act):
    """mlx-lm's GPT-BigCode MLP computes exact GELU; checkpoints (transformers' default,
    vLLM) use the tanh approximation unless activation_function says otherwise."""
    import mlx.nn as nn
    import model_matrix as mm

    from vllm_unified.models.activations import match_config_activations

    cfg = {k: v for k, v in mm.tiny_config("gpt_bigcode").items()
           if k != "activation_function"}
    if act is not None:
        cfg["activation_function"] = act
    model_class, args_class = mm.model_classes("gpt_bigcode")
    model = model_class(args_class.from_dict(cfg))
    changed = match_config_activations(model, cfg)
    assert changed == (0 if act == "gelu" else cfg["n_layer"])
    mlp = model.transformer.h[0].mlp
    x = mx.random.normal((2, cfg["n_embd"]), key=mx.random.key(0)) * 3
    gelu = nn.gelu if act == "gelu" else nn.gelu_approx
    assert mx.allclose(mlp(x), mlp.c_proj(gelu(mlp.c_fc(x))), atol=1e-6)
    with pytest.raises(ValueError, match="activation_function 'relu'"):
        match_config_activations(model, {**cfg, "activation_function": "relu"})
