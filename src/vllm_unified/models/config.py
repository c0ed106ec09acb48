"""The config an mlx-lm ``ModelArgs`` is built from, made from the HF config vLLM has.

transformers 5 moved ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor`` into
``rope_parameters``, and most mlx-lm modules still read the old top-level keys: SmolLM2 would
silently run with rope theta 10000 instead of 100000. :func:`mlx_lm_config` lays them out as
mlx-lm reads them, then applies the model type's own fix-up (:data:`CONFIG_FIXUPS`), which also
refuses config features its mlx-lm module would silently ignore.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mlx.nn as nn

from vllm_unified.models.capability import UnsupportedModel

__all__ = ["CONFIG_FIXUPS", "mlx_lm_config", "model_classes"]

# transformers 5 / vLLM name Granite's hybrid layer kinds like this; mlx-lm as the values.
_GRANITE_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention",
                        "mamba": "mamba", "attention": "attention"}
# keys of a flat rope_parameters that mlx-lm reads at the top level of the config
_ROPE_TOP_LEVEL = ("rope_theta", "partial_rotary_factor")


def mlx_lm_config(hf_config: Mapping[str, Any], *,
                  max_model_len: int | None = None) -> dict[str, Any]:
    """A copy of an HF config dict with the keys mlx-lm's ``ModelArgs`` reads made explicit.

    From a flat transformers-5 ``rope_parameters``: top-level ``rope_theta`` and
    ``partial_rotary_factor`` where absent, and ``rope_scaling`` (None for plain RoPE);
    ``head_dim`` = hidden size / heads where absent (transformers' default). Then the model
    type's fix-up from :data:`CONFIG_FIXUPS`, and LongRoPE's factors as vLLM picks them for
    ``max_model_len`` (:func:`_longrope_factors`; None: vLLM's default, the long ones).

    Raises:
        ValueError: no ``model_type``, or a config feature the mlx-lm module would ignore.
    """
    cfg = dict(hf_config)
    model_type = cfg.get("model_type")
    if not model_type:
        raise ValueError("the model's config has no model_type")
    _lay_out_rope(cfg)
    fixup = CONFIG_FIXUPS.get(model_type)
    if fixup is not None:
        fixup(cfg)
    if model_type == "phi3small":
        _phi3small_context(cfg, max_model_len)
    if model_type in SPARSE_ATTENTION_INDEXED:
        _indexed_context(cfg, max_model_len)
    _longrope_factors(cfg, max_model_len)
    return cfg


def _lay_out_rope(cfg: dict[str, Any]) -> None:
    """The generic part of :func:`mlx_lm_config`, in place: rope keys and ``head_dim``."""
    rope = cfg.get("rope_parameters") or {}
    if _is_flat(rope):
        for key in _ROPE_TOP_LEVEL:
            if cfg.get(key) is None and rope.get(key) is not None:
                cfg[key] = rope[key]
        cfg["rope_scaling"] = cfg.get("rope_scaling") or _non_default(rope)
    if cfg.get("head_dim") is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        # transformers' default where a config leaves it out; some mlx-lm ModelArgs require it
        cfg["head_dim"] = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def _longrope_factors(cfg: dict[str, Any], max_model_len: int | None) -> None:
    """LongRoPE (``longrope`` / ``su``) as vLLM applies it: the short factors for every
    position when ``max_model_len`` fits in ``original_max_position_embeddings``, the long
    ones otherwise. mlx-lm's ``SuScaledRoPE`` always takes ``long_factor`` (and
    ``long_mscale``), so for a short context the short ones are put in their place."""
    scaling = cfg.get("rope_scaling")
    if not isinstance(scaling, Mapping):
        return
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return
    original = scaling.get("original_max_position_embeddings",
                           cfg.get("original_max_position_embeddings"))
    if original is None:  # the family's own default applies (Phi3Config always has one)
        return
    cfg["original_max_position_embeddings"] = int(original)
    if max_model_len is not None and max_model_len <= int(original):
        cfg["rope_scaling"] = {**scaling, "long_factor": scaling["short_factor"],
                               "long_mscale": scaling.get("short_mscale")}


#: model types whose mlx-lm module cannot be used -> what is missing
UNLOADABLE_TYPES = {
    # its module calls sys.exit at import without the ai2-olmo package, which it only probes
    "olmo": "OLMo 1 (mlx-lm's olmo module reads the original hf_olmo checkpoint layout and "
            "needs the ai2-olmo package; Hugging Face's OlmoForCausalLM layout has no mlx-lm "
            "module)",
}


def model_classes(config: Mapping[str, Any]) -> tuple[type[nn.Module], type]:
    """mlx-lm's ``(Model, ModelArgs)`` for ``config`` (its model-type and architecture
    remapping included); for a multimodal model type whose text part the runner drives, that
    part's class (:data:`vllm_unified.models.text_parts.TEXT_MODELS`); for a type whose
    expert tensors mlx-lm cannot read in transformers' layout, a subclass that rewrites them
    (:mod:`vllm_unified.models.expert_layouts`).

    Raises:
        ValueError: naming the model type mlx-lm has no module for.
        UnsupportedModel: a type of :data:`UNLOADABLE_TYPES`, naming what is missing.
    """
    from mlx_lm.utils import _get_classes

    from vllm_unified.models.expert_layouts import with_expert_layout  # lazy: imports MLX
    from vllm_unified.models.text_parts import TEXT_MODELS  # lazy: imports mlx-lm models

    if config.get("model_type") in TEXT_MODELS:
        return TEXT_MODELS[config["model_type"]]
    if config.get("model_type") in UNLOADABLE_TYPES:
        raise UnsupportedModel(config["model_type"], UNLOADABLE_TYPES[config["model_type"]])

    try:
        model_class, args_class = _get_classes(dict(config))
    except ValueError as e:
        raise ValueError(f"model type {config.get('model_type')!r}: mlx-lm has no architecture "
                         "for it, so vllm-unified cannot serve it") from e
    return with_expert_layout(model_class, str(config.get("model_type"))), args_class


def _is_flat(rope_parameters: Mapping[str, Any]) -> bool:
    """A single rope_parameters dict (not one per layer type, as Gemma 3's)."""
    return not any(isinstance(v, Mapping) for v in rope_parameters.values())


def _rope_theta(value: Any, rope_parameters: Mapping[str, Any], what: str) -> float:
    theta = value if value is not None else rope_parameters.get("rope_theta")
    if theta is None:
        raise ValueError(f"{what}: config has no rope_theta (neither top level nor in "
                         "rope_parameters)")
    return float(theta)


def _non_default(rope_parameters: Mapping[str, Any]) -> dict[str, Any] | None:
    """rope_parameters as mlx-lm's rope_scaling, or None for plain RoPE."""
    kind = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if kind == "default":
        return None
    return {k: v for k, v in rope_parameters.items() if k not in _ROPE_TOP_LEVEL}


# ----------------------------------------------------------------------------- fix-ups


def _needs_rope_theta(cfg: dict[str, Any]) -> None:
    """Families whose mlx-lm module defaults rope_theta silently: it must be in the config."""
    cfg["rope_theta"] = _rope_theta(cfg.get("rope_theta"), {}, cfg["model_type"])


def _qwen(cfg: dict[str, Any]) -> None:
    _needs_rope_theta(cfg)
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{cfg['model_type']}: use_sliding_window=True is not supported by "
                         "the mlx-lm model (it would attend over the full context)")


def _no_rope_scaling(cfg: dict[str, Any]) -> None:
    """Families whose mlx-lm module builds plain RoPE whatever the config says."""
    _needs_rope_theta(cfg)
    if cfg.get("rope_scaling") is not None:
        raise ValueError(f"{cfg['model_type']}: RoPE scaling "
                         f"({cfg['rope_scaling']}) is not supported by mlx-lm's module")


def _ministral3(cfg: dict[str, Any]) -> None:
    """mlx-lm's Ministral 3 and Mistral 4 read their RoPE (and Llama 4's query scale) from
    ``rope_parameters`` and require the scale's keys; a config without the scale gets the
    neutral beta 0."""
    rope = dict(cfg.get("rope_parameters") or {})
    if not _is_flat(rope) or rope.get("rope_theta") is None:
        raise ValueError(f"{cfg['model_type']}: rope_parameters without rope_theta")
    rope.setdefault("llama_4_scaling_beta", 0.0)
    rope.setdefault("original_max_position_embeddings",
                    cfg.get("original_max_position_embeddings")
                    or cfg.get("max_position_embeddings"))
    cfg["rope_parameters"] = rope


def _mimo_v2_flash(cfg: dict[str, Any]) -> None:
    """MiMo-V2-Flash's layers and window are ``hybrid_layer_pattern`` (1: sliding window) and
    ``sliding_window_size``, which mlx-lm's and vLLM's models read; transformers' config class
    fills ``layer_types`` and ``sliding_window`` from its own defaults whatever those say, so
    they are rewritten from them. ``attention_chunk_size`` (in released configs) is dropped as
    vLLM drops it: the architecture does not chunk its attention."""
    pattern = cfg.get("hybrid_layer_pattern")
    if pattern is None:
        raise ValueError("mimo_v2_flash: no hybrid_layer_pattern (mlx-lm's module needs it)")
    if len(pattern) != cfg.get("num_hidden_layers") or not set(pattern) <= {0, 1}:
        raise ValueError(f"mimo_v2_flash: hybrid_layer_pattern {pattern} is not one 0 (full "
                         f"attention) or 1 (sliding window) per layer")
    cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    cfg["sliding_window"] = cfg.get("sliding_window_size") if 1 in pattern else None
    cfg.pop("attention_chunk_size", None)


def _phi3(cfg: dict[str, Any]) -> None:
    """mlx-lm's Phi-3 reads the scaling kind as ``type`` (transformers 5 writes
    ``rope_type``) and ignores ``short_mscale`` / ``long_mscale`` (Phi-3-small's)."""
    _needs_rope_theta(cfg)
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        return
    scaling = {**scaling, "type": scaling.get("type", scaling.get("rope_type"))}
    for key in ("short_mscale", "long_mscale"):
        if scaling.get(key) is not None:
            raise ValueError(f"phi3: rope_scaling {key} is not supported by mlx-lm's module")
    cfg["rope_scaling"] = scaling


def _exaone4(cfg: dict[str, Any]) -> None:
    """mlx-lm's EXAONE 4 reads ``sliding_window_pattern`` as a string of ``L`` (local,
    with RoPE) and ``G`` (global, without RoPE) per layer, where transformers writes
    ``layer_types`` (and an int pattern). Without a window every layer is global with RoPE,
    which mlx-lm expresses by no pattern."""
    _needs_rope_theta(cfg)
    if not cfg.get("sliding_window"):
        cfg["sliding_window_pattern"] = None
        return
    n_layers = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or ())
    if len(layer_types) != n_layers:
        raise ValueError(f"exaone4: {len(layer_types)} layer_types for {n_layers} layers")
    kinds = {"sliding_attention": "L", "full_attention": "G"}
    unknown = set(layer_types) - set(kinds)
    if unknown:
        raise ValueError(f"exaone4: layer_types {sorted(unknown)} (known: {', '.join(kinds)})")
    cfg["sliding_window_pattern"] = "".join(kinds[t] for t in layer_types)


def _cohere2(cfg: dict[str, Any]) -> None:
    """mlx-lm's Cohere 2 takes the period of its global layers, transformers writes
    ``layer_types``; plain RoPE only; the window as vLLM applies it (one token more)."""
    _no_rope_scaling(cfg)
    layer_types = cfg.get("layer_types")
    if layer_types:
        cfg["sliding_window_pattern"] = _sliding_pattern(
            list(layer_types), int(cfg["num_hidden_layers"]), "cohere2")
    if not cfg.get("sliding_window"):
        raise ValueError("cohere2: a config without sliding_window is not supported by "
                         "mlx-lm's module")
    # Cohere 2's sliding layers attend to positions [pos - W, pos], W + 1 tokens (Cohere's
    # training convention, as vLLM serves it: commandr.py); mlx-lm's module would keep W
    cfg["sliding_window"] = int(cfg["sliding_window"]) + 1


def _plamo3(cfg: dict[str, Any]) -> None:
    """mlx-lm's PLaMo 3 makes every ``sliding_window_pattern``-th layer global and reads the
    window as ``window_size`` (``sliding_window`` overrides it). The window is handed over as
    ``window_size`` alone, with ``layer_types`` written out, so that the cache slots (sized by
    :mod:`vllm_unified.models.cache_fixes`: the window plus the current token) decide each
    layer's window, not a single config window applied to every layer."""
    window = cfg.get("sliding_window") or cfg.get("window_size")
    if not window:
        raise ValueError("plamo3: config has neither sliding_window nor window_size")
    n_layers = int(cfg["num_hidden_layers"])
    period = int(cfg.get("sliding_window_pattern") or 8)
    layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                   for i in range(n_layers)]
    if cfg.get("layer_types") and list(cfg["layer_types"]) != layer_types:
        raise ValueError(f"plamo3: layer_types {cfg['layer_types']} are not 'every "
                         f"{period}-th layer is global', the only layout mlx-lm builds")
    cfg["layer_types"] = layer_types
    cfg["window_size"] = int(window)
    cfg["sliding_window"] = None


def _phi3small_context(cfg: dict[str, Any], max_model_len: int | None) -> None:
    """Phi-3-small's block-sparse layers (every ``dense_attention_every_n_layers``-th from
    layer 0) attend to their ``blocksparse_num_local_blocks`` latest blocks of
    ``blocksparse_block_size`` tokens plus strided earlier blocks per head; within that span
    it is causal attention over every earlier token, which the paged attention computes.

    Raises:
        ValueError: a context (``max_model_len``, None: the model's maximum) beyond the span.
    """
    span = int(cfg.get("blocksparse_block_size", 64)) * int(
        cfg.get("blocksparse_num_local_blocks", 16))
    _refuse_longer_context(cfg, max_model_len, span, "block-sparse attention (vertical "
                           f"strides beyond {span} tokens of local blocks)", "")


#: model types with DeepSeek sparse attention (DSA: an indexer picks ``index_topk`` keys per
#: query once a sequence holds more), served as dense MLA for contexts up to ``index_topk``
SPARSE_ATTENTION_INDEXED = frozenset({"deepseek_v32", "glm_moe_dsa"})


def _indexed_context(cfg: dict[str, Any], max_model_len: int | None) -> None:
    """DeepSeek sparse attention attends every earlier key while a sequence holds at most
    ``index_topk`` of them (mlx-lm's indexer then selects nothing), which the MLA pages
    compute; beyond, its indexer's selection is not.

    Raises:
        ValueError: a context (``max_model_len``, None: the model's maximum) beyond
            ``index_topk``.
    """
    topk = int(cfg.get("index_topk") or 0)
    _refuse_longer_context(cfg, max_model_len, topk, "DeepSeek sparse attention (an indexer "
                           f"picking {topk} keys per query in longer contexts)",
                           " as dense attention")


def _refuse_longer_context(cfg: dict[str, Any], max_model_len: int | None, span: int,
                           feature: str, served_as: str) -> None:
    """Raise ValueError naming ``feature`` and ``--max-model-len span`` when the context
    (``max_model_len``, None: the config's ``max_position_embeddings``) exceeds ``span``."""
    length = max_model_len or cfg.get("max_position_embeddings")
    if length is None or int(length) > span:
        raise ValueError(f"{cfg['model_type']}: {feature} is not supported by vllm-unified "
                         f"yet; a context of at most {span} tokens (--max-model-len {span}) "
                         f"is served{served_as}")


def _starcoder2(cfg: dict[str, Any]) -> None:
    _no_rope_scaling(cfg)
    # mlx-lm's MLP is exact GELU where checkpoints ask for the tanh approximation:
    # vllm_unified.models.activations gives it the config's


def _granite_hybrid(cfg: dict[str, Any]) -> None:
    # mlx-lm reads layer kinds as "mamba"/"attention" and flattens rope_parameters itself
    unknown = set(cfg.get("layer_types") or ()) - set(_GRANITE_LAYER_TYPES)
    if unknown or not cfg.get("layer_types"):
        raise ValueError(f"granitemoehybrid: layer_types {cfg.get('layer_types')} "
                         f"(known: {', '.join(_GRANITE_LAYER_TYPES)})")
    cfg["layer_types"] = [_GRANITE_LAYER_TYPES[t] for t in cfg["layer_types"]]
    if cfg.get("rope_scaling") is not None:
        raise ValueError("granitemoehybrid: RoPE scaling is not supported by mlx-lm")


def _lfm2(cfg: dict[str, Any]) -> None:
    # mlx-lm sizes the MLP from block_dim / block_ff_dim, which transformers' config names
    # hidden_size / intermediate_size, and always ties the LM head to the embedding
    if cfg.get("tie_word_embeddings") is False:
        raise ValueError("lfm2: an untied LM head (tie_word_embeddings=False) is not supported "
                         "by mlx-lm, which always uses the embedding")
    cfg.setdefault("block_dim", cfg["hidden_size"])
    for key in ("block_dim", "conv_dim"):
        if int(cfg.get(key, cfg["hidden_size"])) != int(cfg["hidden_size"]):
            raise ValueError(f"lfm2: {key} {cfg[key]} != hidden_size {cfg['hidden_size']}, "
                             "which mlx-lm assumes")
    # transformers and vLLM size the MLP from intermediate_size, mlx-lm from block_ff_dim
    ff = cfg.get("intermediate_size")
    if cfg.get("block_ff_dim") is not None and ff is not None and int(
            cfg["block_ff_dim"]) != int(ff):
        raise ValueError(f"lfm2: block_ff_dim {cfg['block_ff_dim']} != intermediate_size {ff}")
    if ff is not None:
        cfg["block_ff_dim"] = ff
    if cfg.get("layer_types") is None and cfg.get("full_attn_idxs") is None:
        raise ValueError("lfm2: config has neither layer_types nor full_attn_idxs")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * int(cfg["num_attention_heads"]) != int(
            cfg["hidden_size"]):
        raise ValueError(f"lfm2: head_dim {head_dim} is not hidden_size / num_attention_heads, "
                         "which mlx-lm assumes")


def _qwen3_5(cfg: dict[str, Any]) -> None:
    """Qwen3.5: transformers' text-only config (``qwen3_5_text``) is mlx-lm's ``qwen3_5``
    without a ``text_config``; its layer kinds must follow mlx-lm's periodic layout."""
    _qwen3_5_layout(cfg, "qwen3_5")


def _qwen3_5_moe(cfg: dict[str, Any]) -> None:
    """Qwen3.5-MoE (Qwen3.6-35B-A3B): as :func:`_qwen3_5` (``qwen3_5_moe_text`` is mlx-lm's
    ``qwen3_5_moe``); every layer's MLP is the sparse block with a gated shared expert, which
    mlx-lm's module builds for every layer."""
    text = _qwen3_5_layout(cfg, "qwen3_5_moe")
    if list(text.get("mlp_only_layers") or ()):
        raise ValueError(f"qwen3_5_moe: mlp_only_layers {text['mlp_only_layers']} (mlx-lm's "
                         "module puts experts on every layer)")


def _qwen3_5_layout(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The shared part of the Qwen3.5 fix-ups: ``model_type`` set, a copy of the text config
    (or ``cfg`` itself) returned with ``full_attention_interval`` from its layer kinds."""
    cfg["model_type"] = model_type
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        text = cfg["text_config"] = dict(text)  # a copy: the caller's config stays as it was
    else:
        text = cfg
    experts = int(text.get("num_experts") or 0)
    if model_type == "qwen3_5" and experts > 0:
        raise ValueError("qwen3_5: experts in a dense qwen3_5 config (mixture-of-experts "
                         "checkpoints are qwen3_5_moe)")
    if model_type == "qwen3_5_moe" and experts <= 0:
        raise ValueError("qwen3_5_moe: num_experts is not set")
    layer_types = text.get("layer_types")
    if layer_types:
        if "full_attention" not in layer_types:
            raise ValueError("qwen3_5: no full_attention layer in layer_types")
        p = list(layer_types).index("full_attention") + 1
        expected = ["full_attention" if (i + 1) % p == 0 else "linear_attention"
                    for i in range(len(layer_types))]
        if list(layer_types) != expected:
            raise ValueError(f"qwen3_5: layer_types {layer_types} are not 'every p-th layer is "
                             "full attention', the only layout mlx-lm builds")
        text["full_attention_interval"] = p
    return text


def _nemotron_h(cfg: dict[str, Any]) -> None:
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types") or []
    pattern = cfg.get("hybrid_override_pattern") or ""
    if "moe" in kinds or "E" in pattern:
        raise ValueError("nemotron_h: mixture-of-experts blocks are not supported yet (dense "
                         "Nemotron-H only: Mamba2, attention and MLP blocks)")
    if cfg.get("sliding_window") is not None:
        raise ValueError(f"nemotron_h: sliding_window={cfg['sliding_window']} is not supported "
                         "by mlx-lm (it would attend over the full context)")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(f"nemotron_h: mlp_hidden_act {cfg['mlp_hidden_act']!r} (mlx-lm "
                         "implements relu2)")


def _mamba_common(cfg: dict[str, Any]) -> None:
    """What mlx-lm's Mamba and Mamba2 modules hard-code: SiLU, and RMSNorm's default epsilon
    (1e-5) on each block's input norm, where vLLM reads ``layer_norm_epsilon``."""
    model_type = cfg["model_type"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type}: hidden_act {cfg['hidden_act']!r} (mlx-lm implements "
                         "silu)")
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    if eps != 1e-5:
        raise ValueError(f"{model_type}: layer_norm_epsilon={eps} (mlx-lm's block norms use "
                         "1e-5)")


def _mamba2(cfg: dict[str, Any]) -> None:
    _mamba_common(cfg)
    if cfg.get("intermediate_size") is None:
        # transformers' Mamba2Config has none: vLLM takes expand x hidden_size
        cfg["intermediate_size"] = int(cfg.get("expand", 2)) * int(cfg["hidden_size"])
    groups = int(cfg.get("n_groups", 1))
    if groups != 1:
        raise ValueError(f"mamba2: n_groups={groups} (mlx-lm's gated RMSNorm normalises over "
                         "all groups at once, vLLM's per group; only n_groups=1 agrees)")
    if cfg.get("norm_before_gate"):
        raise ValueError("mamba2: norm_before_gate (mlx-lm gates before the norm)")


def _falcon_h1(cfg: dict[str, Any]) -> None:
    """Falcon-H1: the Mamba2 width where the config leaves it to ``mamba_expand`` (as
    transformers and vLLM derive it); refuses what mlx-lm's module computes otherwise (the
    multipliers it leaves out are applied by :mod:`vllm_unified.models.multipliers`)."""
    if cfg.get("mamba_d_ssm") is None:
        cfg["mamba_d_ssm"] = int(cfg.get("mamba_expand", 2) * int(cfg["hidden_size"]))
    if cfg.get("mamba_rms_norm") and int(cfg.get("mamba_n_groups", 1)) != 1:
        raise ValueError("falcon_h1: mamba_rms_norm with mamba_n_groups > 1 (mlx-lm's gated "
                         "norm is not per group)")
    limit = cfg.get("time_step_limit")
    if limit is not None and (float(limit[0]), float(limit[1])) != (0.0, float("inf")):
        raise ValueError(f"falcon_h1: time_step_limit {limit} (mlx-lm clips dt to [0, inf))")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"falcon_h1: hidden_act {cfg['hidden_act']!r} (mlx-lm implements "
                         "silu)")


def _recurrent_gemma(cfg: dict[str, Any]) -> None:
    """RecurrentGemma (Griffin): refuses what mlx-lm's module hard-codes otherwise (one KV
    head, rotary on half the head at base 10000, attention without q/k/v biases, the RG-LRU
    as wide as the model, tanh GELU)."""
    rope = cfg.get("rope_parameters") or {}
    width = cfg.get("lru_width")
    checks = [
        (int(cfg.get("num_key_value_heads", 1)) == 1,
         f"num_key_value_heads {cfg.get('num_key_value_heads')} (mlx-lm: one KV head)"),
        (float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5)))
         == 0.5, "partial_rotary_factor other than 0.5"),
        (float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))) == 10000.0,
         "rope_theta other than 10000"),
        (not cfg.get("attention_bias"), "attention_bias"),
        (width is None or int(width) == int(cfg["hidden_size"]),
         f"lru_width {width} != hidden_size"),
        (cfg.get("hidden_activation", "gelu_pytorch_tanh") in ("gelu_pytorch_tanh",
                                                                "gelu_approximate"),
         f"hidden_activation {cfg.get('hidden_activation')!r}"),
    ]
    for ok, what in checks:
        if not ok:
            raise ValueError(f"recurrent_gemma: {what} is not supported by mlx-lm's module")


def _plamo2(cfg: dict[str, Any]) -> None:
    """What mlx-lm's PLaMo 2 does not apply: a sliding window (``attention_window_size``
    below the context, on the layers outside ``full_attention_idx``) and a RoPE base other
    than its fixed 10000."""
    window = cfg.get("attention_window_size")
    context = cfg.get("max_position_embeddings", 2048)
    if window is not None and int(window) < int(context):
        raise ValueError(f"plamo2: attention_window_size={window} below the context "
                         f"({context}): mlx-lm's module attends over the full context")
    theta = cfg.get("rope_theta", 10000)
    if float(theta) != 10000.0:
        raise ValueError(f"plamo2: rope_theta={theta} (mlx-lm's RoPE base is 10000)")


def _gemma3_text(cfg: dict[str, Any]) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"gemma3_text: {key}={cfg[key]} is not supported by mlx-lm")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text: bidirectional attention is not supported")
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    cfg["rope_theta"] = _rope_theta(cfg.get("rope_theta"), full, "gemma3_text")
    cfg["rope_local_base_freq"] = _rope_theta(cfg.get("rope_local_base_freq"), local,
                                              "gemma3_text (sliding layers)")
    cfg["rope_scaling"] = cfg.get("rope_scaling") or _non_default(full)
    if local and _non_default(local) is not None:
        raise ValueError("gemma3_text: RoPE scaling on sliding layers is not supported")

    n_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types:
        pattern = _sliding_pattern(list(layer_types), n_layers, "gemma3_text")
    else:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        if not pattern:
            raise ValueError("gemma3_text: config has neither layer_types nor "
                             "sliding_window_pattern")
    cfg["sliding_window_pattern"] = int(pattern)


def _gemma4_text(cfg: dict[str, Any]) -> None:
    """transformers writes Gemma 4's full-attention head size (and KV heads) as
    ``per_layer_config`` overrides; mlx-lm reads ``global_head_dim`` /
    ``num_global_key_value_heads``. Overrides mlx-lm cannot express are refused."""
    overrides = cfg.get("per_layer_config") or {}
    layer_types = list(cfg.get("layer_types") or ())
    found: dict[str, set[Any]] = {}
    for index, values in overrides.items():
        i = int(index)
        if i >= len(layer_types) or layer_types[i] != "full_attention":
            raise ValueError(f"gemma4_text: per_layer_config overrides layer {i}, which is "
                             "not a full-attention layer (mlx-lm cannot express it)")
        for key, value in values.items():
            if key not in ("head_dim", "num_key_value_heads"):
                raise ValueError(f"gemma4_text: per_layer_config sets {key!r}, which mlx-lm "
                                 "cannot express")
            found.setdefault(key, set()).add(value)
    for key, target in (("head_dim", "global_head_dim"),
                        ("num_key_value_heads", "num_global_key_value_heads")):
        values = found.get(key, set())
        if len(values) > 1:
            raise ValueError(f"gemma4_text: full-attention layers with different {key} "
                             f"({sorted(values)})")
        if values and cfg.get(target) is None:
            cfg[target] = values.pop()
    if cfg.get("global_head_dim") is None:
        cfg["global_head_dim"] = cfg.get("head_dim")


def _llama4(cfg: dict[str, Any]) -> None:
    """Llama 4's text settings live in ``text_config``; mlx-lm's module hard-codes the layer
    layout HF's defaults give (every 4th layer global without RoPE, the others chunked with
    RoPE), so another ``no_rope_layers`` is refused, as is a config without an attention
    chunk (mlx-lm's module needs one) or with more than one routed expert per token."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError("llama4: config has no text_config")
    text = dict(text)
    _lay_out_rope(text)
    n_layers = int(text["num_hidden_layers"])
    expected = [int((i + 1) % 4 != 0) for i in range(n_layers)]
    if text.get("no_rope_layers") and list(text["no_rope_layers"]) != expected:
        raise ValueError(f"llama4: no_rope_layers {text['no_rope_layers']} differ from "
                         f"{expected} (every 4th layer without RoPE), the only layout mlx-lm's "
                         "module computes")
    if not text.get("attention_chunk_size"):
        raise ValueError("llama4: attention_chunk_size is not set; mlx-lm's module needs "
                         "chunked local attention on its RoPE layers")
    if int(text.get("num_experts_per_tok", 1)) != 1:
        raise ValueError(f"llama4: num_experts_per_tok {text['num_experts_per_tok']} (mlx-lm's "
                         "module routes each token to one expert)")
    text.setdefault("rope_scaling", None)
    cfg["text_config"] = text


def _llama4_text(cfg: dict[str, Any]) -> None:
    """mlx-lm's ``llama4_text`` module (MobileLLM-style checkpoints) attends over the whole
    context, applies no temperature tuning, and normalises queries and keys on every layer;
    transformers and vLLM apply the attention chunk, temperature tuning and QK norm per
    layer. Configs where they would differ within ``max_position_embeddings`` are refused."""
    n_layers = int(cfg["num_hidden_layers"])
    no_rope = list(cfg.get("no_rope_layers")
                   or [int((i + 1) % 4 != 0) for i in range(n_layers)])
    cfg["no_rope_layers"] = no_rope
    max_len = int(cfg.get("max_position_embeddings") or 0)
    chunk = cfg.get("attention_chunk_size")
    nope = not all(no_rope)
    why = None
    if chunk and int(chunk) < max_len:
        why = f"chunked local attention (attention_chunk_size {chunk})"
    elif nope and cfg.get("attn_temperature_tuning", True) and \
            int(cfg.get("floor_scale", 8192)) < max_len:
        why = "attention temperature tuning on layers without RoPE"
    elif nope and cfg.get("use_qk_norm"):
        why = "QK norm on RoPE layers only (use_qk_norm with layers without RoPE)"
    if why:
        raise ValueError(f"llama4_text: {why} is not computed by mlx-lm's llama4_text module "
                         "(a model_type 'llama4' checkpoint, with text_config and weights "
                         "under language_model., is served with it)")


def _sliding_pattern(layer_types: list[str], n_layers: int, model_type: str) -> int:
    """The period p of mlx-lm's Gemma 3 / Cohere 2 layout (layer i is global iff
    (i+1) % p == 0)."""
    if len(layer_types) != n_layers:
        raise ValueError(f"{model_type}: {len(layer_types)} layer_types for {n_layers} layers")
    if "full_attention" not in layer_types:
        raise ValueError(f"{model_type}: no full_attention layer in layer_types")
    p = layer_types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % p == 0 else "sliding_attention"
                for i in range(n_layers)]
    if layer_types != expected:
        raise ValueError(f"{model_type}: layer_types {layer_types} do not follow a periodic "
                         "'every p-th layer is global' pattern, which mlx-lm requires")
    return p


def _minicpm3(cfg: dict[str, Any]) -> None:
    """mlx-lm's MiniCPM3 always builds LongRoPE (plain RoPE: no rope_scaling, factors 1) and
    rotates with ``long_factor`` at every position, where transformers and vLLM use
    ``short_factor`` up to ``original_max_position_embeddings``: with no position beyond it
    (MiniCPM3-4B's config) the short factors are the ones to use."""
    _needs_rope_theta(cfg)
    scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "longrope"):
        raise ValueError(f"minicpm3: rope type {kind!r}: mlx-lm's module applies LongRoPE only")
    if "short_factor" in scaling and scaling.get("long_factor") != scaling["short_factor"]:
        original = scaling.get("original_max_position_embeddings")
        if original is None or int(cfg["max_position_embeddings"]) > int(original):
            raise ValueError("minicpm3: LongRoPE switching from short to long factors beyond "
                             "original_max_position_embeddings is not applied by mlx-lm's "
                             "module")
        scaling["long_factor"] = scaling["short_factor"]
    cfg["rope_scaling"] = scaling


def _youtu(cfg: dict[str, Any]) -> None:
    """transformers' ``youtu`` is mlx-lm's ``youtu_llm`` (same weight names); its
    ``rope_interleave`` is mlx-lm's ``rope_traditional``."""
    cfg["model_type"] = "youtu_llm"
    cfg["rope_traditional"] = bool(cfg.get("rope_interleave", True))


def _refuse_unless(model_type: str, checks: list[tuple[bool, str]]) -> None:
    """Raise ``ValueError`` naming the first ``what`` of ``checks`` whose ``ok`` is false:
    a config feature ``model_type``'s mlx-lm module computes otherwise."""
    for ok, what in checks:
        if not ok:
            raise ValueError(f"{model_type}: {what} is not computed by mlx-lm's module")


def _qwen2_moe(cfg: dict[str, Any]) -> None:
    """mlx-lm's Qwen2-MoE puts experts on every layer and weighs the top-k experts by their
    softmax probabilities without renormalising them."""
    _qwen(cfg)
    _refuse_unless("qwen2_moe", [
        (not cfg.get("norm_topk_prob"), "norm_topk_prob (renormalised top-k weights)"),
        (int(cfg.get("decoder_sparse_step", 1)) == 1,
         f"decoder_sparse_step {cfg.get('decoder_sparse_step')} (experts on some layers)"),
        (not list(cfg.get("mlp_only_layers") or ()),
         f"mlp_only_layers {cfg.get('mlp_only_layers')}"),
    ])


def _qwen3_moe(cfg: dict[str, Any]) -> None:
    """Qwen3-MoE: transformers 5 writes the expert count as ``num_local_experts``, mlx-lm
    reads ``num_experts`` (released checkpoints carry that)."""
    _qwen(cfg)
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:
        cfg["num_experts"] = cfg["num_local_experts"]


def _mixtral(cfg: dict[str, Any]) -> None:
    _needs_rope_theta(cfg)


def _gpt_oss(cfg: dict[str, Any]) -> None:
    """gpt-oss: mlx-lm's SwiGLU hard-codes gpt-oss's clamp (``swiglu_limit`` 7) and slope
    (``swiglu_alpha`` 1.702); YaRN without rounding (``truncate: false``, as the checkpoints
    carry it) is applied by :mod:`vllm_unified.models.rope_fixes`."""
    _needs_rope_theta(cfg)
    _refuse_unless("gpt_oss", [
        (float(cfg.get("swiglu_limit", 7.0)) == 7.0, f"swiglu_limit {cfg.get('swiglu_limit')}"),
        (float(cfg.get("swiglu_alpha", 1.702)) == 1.702,
         f"swiglu_alpha {cfg.get('swiglu_alpha')}"),
        (cfg.get("hidden_act", "silu") == "silu", f"hidden_act {cfg.get('hidden_act')!r}"),
    ])


def _deepseek_v3(cfg: dict[str, Any]) -> None:
    """DeepSeek-V3 (and GLM-4.7-Flash, ``glm4_moe_lite``): mlx-lm's router always scores
    by sigmoid with the correction bias (``noaux_tc``); DeepSeek-V3's module normalises the
    query and latent with epsilon 1e-6 whatever ``rms_norm_eps`` says; transformers'
    ``mlp_layer_types`` (dense layers first) become mlx-lm's ``first_k_dense_replace``."""
    model_type = cfg["model_type"]
    checks = [
        (cfg.get("scoring_func", "sigmoid") == "sigmoid",
         f"scoring_func {cfg.get('scoring_func')!r}"),
        (cfg.get("topk_method", "noaux_tc") == "noaux_tc",
         f"topk_method {cfg.get('topk_method')!r}"),
    ]
    if model_type == "deepseek_v3":
        checks.append((float(cfg.get("rms_norm_eps", 1e-6)) == 1e-6,
                       f"rms_norm_eps {cfg.get('rms_norm_eps')} on the latent norms"))
    kinds = list(cfg.get("mlp_layer_types") or ())
    if kinds:  # transformers' GLM-4.7-Flash layout: dense layers first, then sparse ones
        dense = kinds.index("sparse") if "sparse" in kinds else len(kinds)
        checks.append((set(kinds[dense:]) <= {"sparse"},
                       f"mlp_layer_types {kinds} (dense layers after sparse ones)"))
        if cfg.get("first_k_dense_replace") is None:
            cfg["first_k_dense_replace"] = dense
    _refuse_unless(model_type, checks)


def _glm4_moe(cfg: dict[str, Any]) -> None:
    """GLM-4.5 / 4.6 (``glm4_moe``): plain RoPE over a partial rotary share; the router as
    :func:`_deepseek_v3`'s."""
    _no_rope_scaling(cfg)
    _deepseek_v3(cfg)


def _lfm2_moe(cfg: dict[str, Any]) -> None:
    """LFM2-MoE: the attention layers by index (mlx-lm's ``full_attn_idxs``) where the config
    lists ``layer_types``."""
    layer_types = cfg.get("layer_types")
    if cfg.get("full_attn_idxs") is None and layer_types:
        cfg["full_attn_idxs"] = [i for i, t in enumerate(layer_types)
                                 if t in ("full_attention", "attention")]
    if cfg.get("full_attn_idxs") is None:
        raise ValueError("lfm2_moe: config has neither layer_types nor full_attn_idxs")
    if cfg.get("tie_word_embeddings") is False:
        raise ValueError("lfm2_moe: an untied LM head (tie_word_embeddings=False) is not "
                         "supported by mlx-lm, which always uses the embedding")


def _kimi_linear(cfg: dict[str, Any]) -> None:
    """Kimi Linear: mlx-lm's MLA layers rotate nothing (NoPE), which vLLM computes only with
    ``mla_use_nope`` true (its default is false)."""
    _refuse_unless("kimi_linear", [
        (cfg.get("mla_use_nope") is True,
         f"mla_use_nope {cfg.get('mla_use_nope')} (RoPE on the MLA layers)"),
    ])


#: multimodal model type -> the model type whose fix-up its ``text_config`` gets (None: the
#: text config's own ``model_type``); transformers' names of text parts -> mlx-lm's
_TEXT_PART_FIXUPS: dict[str, str | None] = {
    "gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
    "mistral3": None, "pixtral": None, "llava": None, "lfm2-vl": "lfm2", "lfm2_vl": "lfm2",
    "kimi_vl": "deepseek_v3", "kimi_k25": "deepseek_v3",
}
_TEXT_TYPE_NAMES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
                    "qwen3_vl_moe_text": "qwen3_moe", "kimi_k2": "deepseek_v3"}


def _text_part(cfg: dict[str, Any]) -> None:
    """A multimodal wrapper whose ``text_config`` mlx-lm builds its language model from: that
    config laid out as the language model's own type's is (:func:`mlx_lm_config`'s rope
    layout and fix-up), on a copy; its ``model_type`` stays as given (mlx-lm's wrappers pick
    the language model by it).

    Raises:
        ValueError: no ``text_config``, or what the language model's fix-up refuses.
    """
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"{cfg['model_type']}: config has no text_config")
    text = dict(text)
    given = text.get("model_type")
    inner = _TEXT_PART_FIXUPS[cfg["model_type"]] or _TEXT_TYPE_NAMES.get(given, given)
    text["model_type"] = inner
    _lay_out_rope(text)
    fixup = CONFIG_FIXUPS.get(inner)
    if fixup is not None:
        fixup(text)
    if given is not None:
        text["model_type"] = given
    else:
        text.pop("model_type")
    cfg["text_config"] = text


def _gemma3n(cfg: dict[str, Any]) -> None:
    """Gemma 3n's ``text_config``: transformers moves both RoPE bases into per-layer-type
    ``rope_parameters``; mlx-lm requires ``rope_theta`` and ``rope_local_base_freq``."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError("gemma3n: config has no text_config")
    text = dict(text)
    rope = text.get("rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if any(_non_default(r) is not None for r in (full, local) if r):
        raise ValueError("gemma3n: RoPE scaling is not supported by mlx-lm's model")
    text["rope_theta"] = _rope_theta(text.get("rope_theta"), full, "gemma3n")
    text["rope_local_base_freq"] = _rope_theta(text.get("rope_local_base_freq"), local,
                                               "gemma3n (sliding layers)")
    cfg["text_config"] = text


#: model type -> its fix-up of the config (in place), after the generic rope layout
CONFIG_FIXUPS: dict[str, Callable[[dict[str, Any]], None]] = {
    "llama": _needs_rope_theta,
    "qwen2": _qwen,
    "qwen3": _qwen,
    "mistral": _needs_rope_theta,
    "ministral3": _ministral3,
    "mistral4": _ministral3,
    "mimo_v2_flash": _mimo_v2_flash,
    "phi3": _phi3,
    "olmo2": _needs_rope_theta,
    "granite": _needs_rope_theta,
    "smollm3": _needs_rope_theta,
    "glm4": _no_rope_scaling,
    "exaone4": _exaone4,
    "cohere2": _cohere2,
    "plamo3": _plamo3,
    "starcoder2": _starcoder2,
    "gemma3_text": _gemma3_text,
    "gemma4_text": _gemma4_text,
    "llama4": _llama4,
    "llama4_text": _llama4_text,
    "granitemoehybrid": _granite_hybrid,
    "lfm2": _lfm2,
    "qwen3_5": _qwen3_5,
    "qwen3_5_text": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_moe_text": _qwen3_5_moe,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe_lite": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "lfm2_moe": _lfm2_moe,
    "kimi_linear": _kimi_linear,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "recurrent_gemma": _recurrent_gemma,
    "mamba": _mamba_common,
    "mamba2": _mamba2,
    "falcon_mamba": _mamba_common,
    "plamo2": _plamo2,
    "minicpm3": _minicpm3,
    "youtu": _youtu,
    **dict.fromkeys(_TEXT_PART_FIXUPS, _text_part),
    "gemma3n": _gemma3n,
}
