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
