"""The load-time capability check (models/capability.py): every cache slot of a loaded mlx-lm
model is classified, and a model the paged cache cannot drive is refused with a message naming
the model type, the slot and the missing feature. No engine: tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from vllm_unified.models.capability import UnsupportedModel, route_model
from vllm_unified.models.loader import load_model

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _load(tmp_path: Path, config):
    import transformers

    folder = tmp_path / config.model_type
    folder.mkdir()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return load_model(folder, hf_config=None, dtype=mx.float32, keep_quantized=False)


def _route(loaded, config_window=None, kv_shape=None):
    return route_model(loaded.model, loaded.config, kv_shape=kv_shape,
                       config_window=config_window)


def test_windows_come_from_mlx_lm_caches_and_the_config(tmp_path):
    import transformers

    cohere2 = _load(tmp_path, transformers.Cohere2Config(**COMMON, sliding_window=8))
    layout, patched = _route(cohere2)
    # Cohere 2's sliding layers see W + 1 tokens as vLLM serves them (models/config.py)
    assert layout.windows == {0: 9, 1: 9, 2: 9, 3: None}
    assert "mlx_lm.models.cohere2" in patched or patched == []
    assert [s.num_kv_heads for s in layout.attention.values()] == [2] * 4
    # Mistral: one window for every layer in the config (vLLM applies it), mlx-lm ignores it
    mistral = _load(tmp_path, transformers.MistralConfig(**COMMON, head_dim=32,
                                                         sliding_window=16))
    layout, _ = _route(mistral, config_window=16)
    assert layout.windows == dict.fromkeys(range(4), 16)
    assert layout.notes and "config" in layout.notes[0]


def test_attention_outside_sdpa_is_refused_by_name(tmp_path, monkeypatch):
    """A module computing attention its own way (here: llama's module with its SDPA name
    bound to a private function, so routing cannot reach it) is refused by the probe."""
    import mlx_lm.models.llama as llama_module
    import transformers

    from vllm_unified import patches

    llama = _load(tmp_path, transformers.LlamaConfig(**COMMON, head_dim=32))
    own = patches.original_mlx_lm_sdpa()
    monkeypatch.setattr(llama_module, "scaled_dot_product_attention",
                        lambda *a, **k: own(*a, **k))
    with pytest.raises(UnsupportedModel, match=r"'llama' \(cache slot 0\): attention computed "
                                               "outside mlx-lm's scaled_dot_product_attention"):
        _route(llama)


def test_gemma2_attention_is_adapted_with_config_windows(tmp_path):
    """Gemma 2 computes soft-capped attention itself: its adapter
    (models/attention_adapters.py) gives mlx-lm's own results on mlx-lm's caches, and the
    config's sliding windows (which mlx-lm's Gemma 2 does not apply) are the layers'."""
    import transformers
    from mlx_lm.models.cache import make_prompt_cache

    gemma2 = _load(tmp_path, transformers.Gemma2Config(**COMMON, head_dim=32, sliding_window=8))
    model = gemma2.model
    prompt = mx.array([[3, 4, 5, 6, 7, 8]])
    before = model(prompt, cache=make_prompt_cache(model))
    from vllm_unified.models.attention_adapters import ADAPTERS

    layout, _ = _route(gemma2)
    attention_class = type(model.model.layers[0].self_attn)
    assert attention_class.__call__ is ADAPTERS[("mlx_lm.models.gemma2", "Attention")]
    assert layout.windows == {0: 8, 1: None, 2: 8, 3: None}
    after = model(prompt, cache=make_prompt_cache(model))
    assert mx.allclose(before, after, atol=1e-5)


def test_each_slot_keeps_the_shape_it_writes(tmp_path):
    """Slots record the KV shape the probe saw; one other than vLLM's config is kept (per-layer
    shapes) and said in the start-up notes."""
    import transformers

    llama = _load(tmp_path, transformers.LlamaConfig(**COMMON, head_dim=32))
    layout, _ = _route(llama, kv_shape=(2, 32))
    assert {(s.num_kv_heads, s.head_dim) for s in layout.attention.values()} == {(2, 32)}
    assert not layout.notes
    layout, _ = _route(llama, kv_shape=(4, 32))
    assert {(s.num_kv_heads, s.head_dim) for s in layout.attention.values()} == {(2, 32)}
    assert any("per-layer KV shapes" in n for n in layout.notes)


def test_a_head_other_than_mlx_lms_is_refused(tmp_path, monkeypatch):
    """The runner's logits are the inner model then Model.__call__'s head; a model that does
    more before its inner model (here: scales the embeddings) must not load."""
    import transformers

    llama = _load(tmp_path, transformers.LlamaConfig(**COMMON, head_dim=32))
    cls = type(llama.model)
    original = cls.__call__

    def scaled_inputs(self, inputs, cache=None, input_embeddings=None):
        if input_embeddings is None and isinstance(self.model, type(llama.model.model)):
            h = self.model.embed_tokens(inputs) * 2.0
            return original(self, inputs, cache, input_embeddings=h)
        return original(self, inputs, cache, input_embeddings)

    monkeypatch.setattr(cls, "__call__", scaled_inputs)
    with pytest.raises(UnsupportedModel, match="not its inner model followed by its output head"):
        _route(llama)


def test_granite_logit_scaling_is_kept(tmp_path):
    """Granite divides its logits by logits_scaling in Model.__call__: the runner's head
    (models/output_head.py) runs that code, so the probe's logits agree."""
    import transformers

    from vllm_unified.models.output_head import lm_head

    granite = _load(tmp_path, transformers.GraniteConfig(**COMMON, logits_scaling=4.0))
    _route(granite)
    model = granite.model
    hidden = model.model(mx.array([[3, 4, 5]]))[0]
    plain = model.model.embed_tokens.as_linear(hidden) if "lm_head" not in model else \
        model.lm_head(hidden)
    assert mx.allclose(lm_head(model, hidden), plain / 4.0, atol=1e-5)


def test_latent_attention_and_bidirectional_are_refused(tmp_path):
    from vllm_unified.models.capability import _check_config_features

    with pytest.raises(UnsupportedModel, match="multi-head latent attention"):
        _check_config_features("minicpm3", {"kv_lora_rank": 256})
    with pytest.raises(UnsupportedModel, match="bidirectional"):
        _check_config_features("gemma3_text", {"use_bidirectional_attention": True})
    with pytest.raises(UnsupportedModel, match="another cache slot's keys"):
        _check_config_features("iquestloopcoder", {})


def test_a_config_window_beside_mixed_mlx_lm_windows_is_left_to_the_caches():
    """A config with one ``sliding_window`` and no layer types, where mlx-lm's caches window
    only some layers with it (Baichuan-M1 lists them in ``sliding_window_layers``): the caches
    carry the windows, the full-attention layers stay full. Where no cache windows (Mistral)
    the config's window applies to every layer."""
    from vllm_unified.models.capability import _declared_windows

    assert _declared_windows({"sliding_window": 8}, 4, 8, [8, 8, None, 8]) is None
    assert _declared_windows({"sliding_window": 8}, 3, 8, [None] * 3) == dict.fromkeys(
        range(3), 8)
    # a cache window other than the config's is not taken silently (_window refuses it)
    assert _declared_windows({"sliding_window": 8}, 2, 8, [16, None]) == {0: 8, 1: 8}


def test_a_state_ahead_of_the_layers_is_refused_by_name():
    """LongCat-Flash n-gram's first mlx-lm cache holds each sequence's last token ids for its
    n-gram embeddings, a state of no decoder layer: refused naming that feature rather than
    as a recurrent layer."""
    import model_matrix as mm

    from vllm_unified.kv.hybrid import HYBRID_FAMILIES
    from vllm_unified.models.capability import check_model

    model_class, args_class = mm.model_classes("longcat_flash_ngram")
    cfg = mm.tiny_config("longcat_flash_ngram") | {"vocab_size": 64}  # small n-gram tables
    model = model_class(args_class.from_dict(cfg))
    with pytest.raises(UnsupportedModel, match=r"'longcat_flash_ngram' \(cache slot 0\): "
                       "n-gram embeddings over each sequence's previous tokens"):
        check_model(model, cfg, recurrent_families=HYBRID_FAMILIES, kv_shape=None,
                    config_window=None)


def _matrix_model(model_type: str):
    import model_matrix as mm

    config = mm.tiny_config(model_type)
    model_class, args_class = mm.model_classes(model_type)
    return model_class(args_class.from_dict(config)), config


@pytest.mark.parametrize(("model_type", "feature"), [
    ("minimax_m3_vl", r"'minimax_m3_vl' \(cache slot 0\): MiniMax-M3's attention, whose cache "
                      r"is a per-layer CacheList"),
])
def test_a_refused_layer_names_the_feature_its_mixer_computes(model_type, feature):
    """A slot refused for its cache names the mlx-lm mixer's feature (LAYER_FEATURES)."""
    model, config = _matrix_model(model_type)
    with pytest.raises(UnsupportedModel, match=feature):
        route_model(model, config, kv_shape=None, config_window=None)


@pytest.mark.skipif(mx.metal.is_available(), reason="Metal runs mlx-lm's Metal kernels")
def test_metal_only_kernels_are_refused_by_name():
    """Muse Spark's mlx-lm module computes with mx.fast.metal_kernel: refused on a backend
    without Metal, naming it, rather than failing at the first request."""
    model, config = _matrix_model("muse_spark")
    with pytest.raises(UnsupportedModel, match=r"'muse_spark': Metal-only kernels of mlx-lm's "
                                               r"module \(mx.fast.metal_kernel\)"):
        route_model(model, config, kv_shape=None, config_window=None)
