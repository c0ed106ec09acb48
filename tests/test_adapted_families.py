"""mlx-lm families whose modules compute attention, positions or caches in a way the paged
cache needs adapted (models/attention_adapters.py, models/cache_fixes.py): each loads, routes
and passes the load-time probe with the layout the runner will drive. No engine: the model
matrix's tiny checkpoints (tests/model_matrix.py); their serving is the matrix's."""

from __future__ import annotations

import json

import mlx.core as mx
import model_matrix as mm
import pytest

from vllm_unified.models.capability import route_model
from vllm_unified.models.loader import load_model


def _route(model_type, tmp_path):
    mm.build_checkpoint(model_type, tmp_path)
    folder = tmp_path / model_type
    config = json.loads((folder / "config.json").read_text())
    loaded = load_model(str(folder), hf_config=config, dtype=mx.float32, keep_quantized=False,
                        max_model_len=256)
    return route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)


def test_afm7_reuse_layers_read_the_last_cached_layers_pages(tmp_path):
    layout, patched = _route("afm7", tmp_path)
    assert layout.num_slots == 2 and sorted(layout.attention) == [0, 1]
    assert layout.shared == {2: 1, 3: 1}
    assert {"mlx_lm.models.afm7.AFMModel", "mlx_lm.models.afm7.KVReuseAttention"} <= set(patched)


@pytest.mark.parametrize("model_type, adapted", [
    ("gear", "mlx_lm.models.gear.Attention"),
    ("phi3small", "mlx_lm.models.phi3small.Attention"),
    ("gpt_bigcode", "mlx_lm.models.gpt_bigcode.GPTBigCodeModel"),
])
def test_adapted_attention_passes_the_probe(model_type, adapted, tmp_path):
    """Every attention slot attends through the paged path (the probe refuses a slot whose
    attention bypasses it), and the runner's head gives mlx-lm's logits."""
    layout, patched = _route(model_type, tmp_path)
    assert adapted in patched
    assert layout.attention and all(s.num_kv_heads == 1 for s in layout.attention.values())


def test_phixtral_decoder_is_called_without_a_mask(tmp_path):
    """Phixtral's decoder takes the mask from mlx-lm's ``Model.__call__``: adapted, the runner
    calls it with the caches only and its head gives mlx-lm's logits (the probe checks)."""
    layout, patched = _route("phixtral", tmp_path)
    assert "mlx_lm.models.phixtral.TransformerDecoder" in patched
    assert sorted(layout.attention) == list(range(layout.num_slots))


def test_mimo_v2_flash_windows_follow_its_hybrid_layer_pattern(tmp_path):
    """With the HF config as vLLM has it (transformers' MiMoV2FlashConfig fills
    ``layer_types`` and ``sliding_window`` from its defaults), the window sits on the layers
    ``hybrid_layer_pattern`` marks, ``sliding_window_size`` wide, as mlx-lm's caches and
    vLLM's model put it; the full-attention layer has its own head shape."""
    from transformers import AutoConfig

    mm.build_checkpoint("mimo_v2_flash", tmp_path)
    folder = tmp_path / "mimo_v2_flash"
    hf_config = AutoConfig.from_pretrained(str(folder))
    assert hf_config.layer_types[0] == "full_attention"  # transformers' default, not the model's
    loaded = load_model(str(folder), hf_config=hf_config, dtype=mx.float32,
                        keep_quantized=False, max_model_len=256)
    assert loaded.config["attention_value_scale"] == hf_config.attention_value_scale
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None,
                            config_window=hf_config.sliding_window)
    assert [layout.attention[i].window for i in (0, 1)] == [mm.WINDOW, None]


def test_deepseek_v41_window_only_equals_mlx_lm_layer_cache(tmp_path):
    """A DeepSeek-V4.1 without compressed layers gets rotating caches of its window; through
    the adapted decoder and attention (one key/value head, sinks, the output rotated back)
    its logits equal mlx-lm's own code over its ``LayerCache``, past the window (8) in the
    prompt and at decode."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
    from mlx_lm.models.deepseek_v41 import LayerCache

    layout, patched = _route("deepseek_v41", tmp_path)
    assert {"mlx_lm.models.deepseek_v41.TextModel",
            "mlx_lm.models.deepseek_v41.Attention"} <= set(patched)
    assert {(s.window, s.num_kv_heads) for s in layout.attention.values()} == {(mm.WINDOW, 1)}
    folder = tmp_path / "deepseek_v41"
    model = load_model(str(folder), hf_config=json.loads((folder / "config.json").read_text()),
                       dtype=mx.float32, keep_quantized=False, max_model_len=256).model
    ours = make_prompt_cache(model)
    assert all(isinstance(c, RotatingKVCache) for c in ours)
    theirs = [LayerCache(mm.WINDOW) for _ in ours]
    steps = [mx.array([[5, 9, 11, 2, 40, 7, 3, 8, 12, 90, 4, 6]]), mx.array([[3]]),
             mx.array([[60]])]
    got = mx.concatenate([model(x, cache=ours) for x in steps], axis=1)
    expected = mx.concatenate([model(x, cache=theirs) for x in steps], axis=1)
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_deepseek_v41_compressed_layers_are_refused():
    """Compressed layers keep mlx-lm's LayerCache: refused at load, naming the feature."""
    from mlx_lm.models import deepseek_v41

    from vllm_unified.models.cache_fixes import match_cache_windows
    from vllm_unified.models.capability import UnsupportedModel

    args = deepseek_v41.ModelArgs(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, hc_mult=2,
        compress_ratios=(4, 0), kv_source_layer_ids=(0,))
    model = deepseek_v41.Model(args)
    config = {"model_type": "deepseek_v41", "compress_ratios": [4, 0]}
    assert not match_cache_windows(model, config)
    with pytest.raises(UnsupportedModel, match="compressed sparse attention"):
        route_model(model, config, kv_shape=None, config_window=None)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_within_index_topk_is_served_as_mla(model_type, tmp_path):
    """DeepSeek sparse attention with a context within ``index_topk`` (256 here): one MLA
    slot per layer (mlx-lm's CacheList of the latent and the indexer's keys replaced), the
    probe's absorbed logits equal mlx-lm's; a longer context is refused naming the feature."""
    from mlx_lm.models.deepseek_v32 import DeepseekV32Model

    from vllm_unified.models.attention_adapters import ADAPTERS

    layout, _ = _route(model_type, tmp_path)
    assert DeepseekV32Model.__call__ is ADAPTERS[("mlx_lm.models.deepseek_v32",
                                                  "DeepseekV32Model")]
    assert layout.latent is not None and sorted(layout.attention) == [0, 1]
    folder = tmp_path / model_type
    with pytest.raises(ValueError, match="DeepSeek sparse attention .*--max-model-len 256"):
        load_model(str(folder), hf_config=json.loads((folder / "config.json").read_text()),
                   dtype=mx.float32, keep_quantized=False, max_model_len=257)


def test_longcat_flash_sublayers_get_an_mla_slot_each(tmp_path):
    """LongCat-Flash's two MLA sublayers per decoder layer: one cache slot each (layer i:
    slots 2i, 2i + 1, the adapter of ``self_attn[0]`` / ``[1]``), and the probe's absorbed
    logits (its q / kv LoRA scales included) equal mlx-lm's over its CacheLists."""
    from vllm_unified.models.latent_attention import latent_layers

    mm.build_checkpoint("longcat_flash", tmp_path)
    folder = tmp_path / "longcat_flash"
    loaded = load_model(str(folder), hf_config=json.loads((folder / "config.json").read_text()),
                        dtype=mx.float32, keep_quantized=False, max_model_len=256)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)
    layers = loaded.model.layers
    assert layout.num_slots == 2 * len(layers) and layout.latent is not None
    slots = latent_layers(loaded.model)
    assert all(slots[2 * i + j] is layer.self_attn[j]
               for i, layer in enumerate(layers) for j in (0, 1))
    assert slots[0].inner.mla_scale_q_lora is not None  # the scales the adapter applies
