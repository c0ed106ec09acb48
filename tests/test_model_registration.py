"""vLLM accepts checkpoints of mlx-lm model types that transformers and vLLM do not know
(src/vllm_unified/models/registration.py): a config class per type through transformers'
AutoConfig, the checkpoint's architecture in vLLM's model registry as a class vLLM never
builds. Types transformers or vLLM know keep their own classes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_unified.models import registration


def test_model_types_are_listed_without_importing_mlx():
    code = ("import sys; from vllm_unified.models.registration import mlx_lm_model_types as f;"
            "t = f(); assert 'mlx.core' not in sys.modules and 'mlx_lm' not in sys.modules;"
            "print(len(t), 'llama' in t, 'cache' in t, 'switch_layers' in t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert int(out[0]) > 100 and out[1:] == ["True", "False", "False"]


def test_only_unknown_types_get_a_config_class():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    registration.register_mlx_lm_types()
    for known in ("llama", "phi3", "gemma2", "kimi_k25"):  # transformers' / vLLM's own classes
        assert not issubclass(CONFIG_MAPPING[known], registration.MLXLMConfig), known
    for unknown in ("afm7", "internlm2", "openelm", "plamo", "lfm2-vl"):
        assert issubclass(CONFIG_MAPPING[unknown], registration.MLXLMConfig), unknown
        assert CONFIG_MAPPING[unknown].model_type == unknown
    assert registration.register_mlx_lm_types() == []  # idempotent


def _folder(tmp_path, config):
    folder = tmp_path / config["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_config_keeps_mlx_lm_keys_and_adds_the_standard_names(tmp_path):
    from transformers import AutoConfig

    registration.register_mlx_lm_types()
    cfg = AutoConfig.from_pretrained(_folder(tmp_path, {
        "model_type": "afm7", "architectures": ["Afm7ForCausalLM"], "num_layers": 3,
        "hidden_dim": 96, "num_heads": 3, "num_kv_heads": 1, "num_kv_reuse_layers": 1,
        "vocab_size": 100}))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads) == (3, 96, 3, 1)
    assert (cfg.num_layers, cfg.hidden_dim, cfg.num_kv_reuse_layers) == (3, 96, 1)
    assert cfg.get_text_config() is cfg

    wrapped = AutoConfig.from_pretrained(_folder(tmp_path, {
        "model_type": "lfm2-vl", "architectures": ["Lfm2VlForCausalLM"],
        "text_config": {"model_type": "lfm2", "num_hidden_layers": 2, "hidden_size": 64,
                        "num_attention_heads": 2}}))
    text = wrapped.get_text_config()
    assert isinstance(text, registration.MLXLMConfig) and text.num_hidden_layers == 2


def test_per_layer_head_counts_give_vllm_one_number_and_mlx_lm_the_lists(tmp_path):
    """OpenELM's head counts are per layer: vLLM's ModelConfig takes integers (the largest
    bounds every layer), mlx-lm the lists (what the loader reads through to_dict)."""
    from transformers import AutoConfig

    registration.register_mlx_lm_types()
    cfg = AutoConfig.from_pretrained(_folder(tmp_path, {
        "model_type": "openelm", "architectures": ["OpenELMForCausalLM"],
        "num_transformer_layers": 2, "model_dim": 96, "head_dim": 32,
        "num_query_heads": [3, 4], "num_kv_heads": [1, 2], "vocab_size": 100}))
    assert (cfg.num_attention_heads, cfg.num_kv_heads, cfg.num_key_value_heads) == (4, 2, 2)
    d = cfg.to_dict()
    assert (d["num_query_heads"], d["num_kv_heads"]) == ([3, 4], [1, 2])
    assert "_per_layer_counts" not in d


def test_unknown_architecture_is_registered_as_never_built(tmp_path):
    from transformers import AutoConfig

    from vllm_unified import compat

    registration.register_mlx_lm_types()
    arch = "MatrixTestOnlyForCausalLM"
    assert arch not in compat.ModelRegistry.get_supported_archs()
    AutoConfig.from_pretrained(_folder(tmp_path, {
        "model_type": "openelm", "architectures": [arch], "num_transformer_layers": 2,
        "model_dim": 64, "num_query_heads": [2, 2], "num_kv_heads": [1, 1], "head_dim": 32,
        "vocab_size": 100}))
    registry = compat.ModelRegistry
    assert arch in registry.get_supported_archs()
    info = registry._try_inspect_model_cls(arch)
    assert info.is_text_generation_model and not info.is_hybrid and not info.is_pooling_model
    with pytest.raises(RuntimeError, match="defined only by mlx-lm"):
        registration.MLXLMOnlyModel(vllm_config=None)
    # an architecture vLLM has keeps vLLM's class
    before = registry.models["InternLM2ForCausalLM"]
    AutoConfig.from_pretrained(_folder(tmp_path, {
        "model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"],
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
        "vocab_size": 100}))
    assert registry.models["InternLM2ForCausalLM"] is before
