"""The model matrix: every text model type mlx-lm defines, as a tiny random checkpoint, served
by our engine and compared with mlx-lm's own greedy generation on the same weights.

Importable (tests/test_model_matrix.py) and a command line::

    python tests/model_matrix.py [--types a,b] [--out results.json] [--work DIR] [--moe]
    python tests/model_matrix.py --docs results.json      # rewrite docs/models.md's table

Per model type:

1. :func:`tiny_config` derives a config from mlx-lm's ``ModelArgs`` dataclass: every field
   whose name is a known size, count or switch gets a tiny value (:data:`NAME_DEFAULTS`), then
   the type's own overrides (:data:`OVERRIDES`). Hidden 96, 3 query heads of 32 over 1 KV head
   (GQA 3:1, head_dim 32 because vLLM's CPU attention has no smaller head size), vocab 49152
   for SmolLM2's tokenizer, sliding windows of 8 tokens.
2. :func:`build_checkpoint` instantiates mlx-lm's ``Model``, classifies it (routed experts =
   MoE, recurrent layers, sliding windows, ...), gives it random weights with O(1) activations
   (:func:`randomize`), saves an MLX/HF folder and reloads it with ``mlx_lm.utils.load``.
3. :func:`mlx_lm_reference` runs ``mlx_lm.generate.generate_step`` greedily on the reloaded
   model for :data:`PROMPT_LENGTHS` (one longer than any window).
4. :func:`serve` runs tests/llm_harness.py (a fresh process) on the folder: float32, 16-token
   prefill chunks, the 4 prompts at once, prefix caching where vLLM allows it.

The outcome of a type is one of :data:`OUTCOMES`; :func:`write_docs_table` turns a results file
into docs/models.md's family table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "llm_harness.py"
DOCS = ROOT / "docs" / "models.md"

#: modules of mlx_lm/models that are building blocks, not model types
HELPER_MODULES = frozenset({
    "base", "cache", "rope_utils", "switch_layers", "activations", "gated_delta", "mla", "ssm",
    "pipeline", "bitlinear_layers",
})
#: prompt lengths of the comparison; 70 is longer than every sliding window the configs set
PROMPT_LENGTHS = (3, 20, 45, 70)
NEW_TOKENS = 12
WINDOW = 8
VOCAB = 49152

#: built / not_built (no checkpoint) / match / match_vllm (a :data:`VLLM_OVER_MLX_LM` type:
#: tokens differ from mlx-lm's, equal those of vLLM's CPU backend in fp32 on the same
#: checkpoint) / mismatch (served, tokens differ from the reference) / refused (the engine
#: refused the model at start-up, with or without a reference) / crashed (a traceback
#: elsewhere) / reference_failed (mlx-lm itself cannot generate; the engine serves it or was
#: not run) / not_run (absent from the results)
#: types whose mlx-lm ``sanitize`` rewrites saved weights by design (Baichuan-M1's NormHead
#: normalises the LM head's rows): their reload is compared with what sanitize makes of them
SANITIZE_REWRITES = frozenset({"baichuan_m1"})
OUTCOMES = ("not_built", "match", "match_vllm", "mismatch", "refused", "crashed",
            "reference_failed", "not_run")

_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _FFN, _LAYERS = 96, 3, 1, 32, 128, 2

#: field name -> tiny value, applied to every ModelArgs field of that name (defaults included:
#: mlx-lm's defaults are often a real model's sizes)
NAME_DEFAULTS: dict[str, Any] = {
    # widths
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "hidden_dim", "model_dim", "dim",
                     "block_dim"), _HIDDEN),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_hidden_size", "ff_intermediate_size",
                     "intermediate_size_mlp", "block_ff_dim", "ffn_dim"), _FFN),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size",
                     "shared_expert_intermediate_size", "shared_intermediate_size"), 64),
    # depth
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers",
                     "num_transformer_layers"), _LAYERS),
    # heads
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads",
                     "swa_num_attention_heads"), _HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                     "swa_num_key_value_heads", "num_attention_groups"), _KV_HEADS),
    **dict.fromkeys(("head_dim", "swa_head_dim", "v_head_dim", "swa_v_head_dim",
                     "kv_channels"), _HEAD_DIM),
    # vocabulary, positions
    **dict.fromkeys(("vocab_size", "padded_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "block_size",
                     "model_max_length", "seq_length", "original_max_position_embeddings"),
                    512),
    # norms
    **dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon",
                     "layernorm_epsilon", "norm_epsilon"), 1e-5),
    # rope
    **dict.fromkeys(("rope_theta", "rotary_emb_base", "swa_rope_theta"), 10000.0),
    # windows
    **dict.fromkeys(("sliding_window", "attention_window_size", "sliding_window_size"),
                    WINDOW),
    "tie_word_embeddings": False,
    # mixture of experts (small, so MoE types build too)
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"),
                    4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "num_shared_expert"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    # multi-head latent attention
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
    # linear attention / state space
    **dict.fromkeys(("linear_num_key_heads",), 1),
    **dict.fromkeys(("linear_num_value_heads",), 2),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim"), 32),
    **dict.fromkeys(("linear_conv_kernel_dim", "conv_kernel", "mamba_d_conv", "conv_L_cache",
                     "conv1d_width", "conv_window"), 4),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 16),
    **dict.fromkeys(("mamba_num_heads", "mamba_n_heads"), 4),
    **dict.fromkeys(("mamba_head_dim", "mamba_d_head"), 32),
    "mamba_expand": 2,
    "n_groups": 1, "mamba_n_groups": 1,
    "time_step_rank": 8,
    "time_step_limit": [0.001, 100.0],
    "a_low_rank_dim": 16, "v_low_rank_dim": 16, "gate_low_rank_dim": 16,
    "decay_low_rank_dim": 16,
    "linear_allow_neg_eigval": False,
    # switches: biases where a family may have them, norms where it may have them
    **dict.fromkeys(("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias",
                     "post_norm", "use_cla", "use_mixed_mlp_moe", "use_expert_bias",
                     "block_auto_adjust_ff_dim"), False),
    **dict.fromkeys(("use_qkv_bias", "use_conv_bias", "conv_bias", "mamba_conv_bias",
                     "use_qk_norm", "qk_norm", "mla_scale_q_lora", "mla_scale_kv_lora"),
                    True),
    # positions
    **dict.fromkeys(("partial_rotary_factor", "rotary_pct"), 0.5),
    "rotary_dim": 16,
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    # scales away from 1 so each is exercised
    "logits_scaling": 2.0, "attention_multiplier": 0.1, "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5, "dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 2.0,
    "logits_soft_cap": 30.0, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    "gegelu_limit": 20.0,
    # layer patterns (two layers: one of each kind where a period is asked)
    "sliding_window_pattern": 2, "dense_attention_every_n_layers": 2,
    "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
    "expert_layer_period": 2, "interleave_moe_layer_step": 2, "moe_layer_freq": 1,
    "layer_group_size": 2, "group_norm_size": 1, "cla_share_factor": 1,
    "num_kv_reuse_layers": 1, "num_dense_layers": 1,
    "hidden_act": "silu",
    "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
    "ffn_dim_divisor": 32,
    "zero_expert_num": 0, "zero_expert_type": "identity",
    "index_head_dim": 32, "index_n_heads": 2, "index_topk": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid",
}

#: model type -> overrides on top of the name defaults (a callable gets the config and returns
#: the updated one).
_SLIDING_FULL = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
_ROPE_BY_LAYER_TYPE = {"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# as Gemma 4 checkpoints carry it: proportional partial RoPE on the global layers
_GEMMA4_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                      "rope_type": "default"}}
_GEMMA4 = {"rope_parameters": _GEMMA4_ROPE, "num_hidden_layers": 4, "sliding_window_pattern": 2,
           "layer_types": ["sliding_attention", "full_attention"] * 2,
           # explicit, as in checkpoints: transformers' default (False) is not mlx-lm's
           "use_double_wide_mlp": True,
           "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
           "vocab_size_per_layer_input": VOCAB, "global_head_dim": 64,
           "num_global_key_value_heads": 1}
OVERRIDES: dict[str, dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]] = {
    # layer stacks: 4 layers where a family mixes kinds, the windowed layers first
    "exaone4": {"num_hidden_layers": 4, "sliding_window_pattern": "LLLG",
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    "olmo3": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL},
    "gear": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL},
    "mellum": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL,
               "rope_parameters": _ROPE_BY_LAYER_TYPE},
    "baichuan_m1": {"num_hidden_layers": 4, "sliding_window_layers": [0, 1, 3],
                    "conv_window": 2},
    "cohere2": {"num_hidden_layers": 4},
    "afm7": {"num_layers": 4, "num_kv_reuse_layers": 2},  # two layers read the last KV
    "gemma2": {"num_hidden_layers": 4},
    "gemma3_text": {"num_hidden_layers": 4},
    "gemma3": {"text_config": {"num_hidden_layers": 4}},
    "gemma4_text": _GEMMA4,
    "gemma4": {"text_config": _GEMMA4},
    "gemma3n": {"text_config": {
        "num_hidden_layers": 4, "layer_types": _SLIDING_FULL, "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
        "rope_local_base_freq": 10000.0, "activation_sparsity_pattern": [0.0] * 4,
        "altup_num_inputs": 2, "altup_coef_clip": 120.0, "altup_correct_scale": True,
        "altup_active_idx": 0, "laurel_rank": 16}},
    "granitemoehybrid": {"num_hidden_layers": 4, "num_local_experts": 0, "mamba_n_heads": 6,
                         "shared_intermediate_size": 128,
                         "layer_types": ["mamba", "mamba", "attention", "mamba"]},
    # conv_dim / block_dim: vLLM reads them (released LFM2 configs carry them)
    "lfm2": {"num_hidden_layers": 4, "conv_dim": 96, "block_dim": 96,
             "layer_types": ["conv", "full_attention", "conv", "conv"]},
    "lfm2-vl": {"text_config": {"num_hidden_layers": 4, "model_type": "lfm2", "conv_dim": 96,
                                "block_dim": 96,
                                "layer_types": ["conv", "full_attention", "conv", "conv"]}},
    "lfm2_moe": {"num_hidden_layers": 4,
                 "layer_types": ["conv", "full_attention", "conv", "conv"]},
    "llama4_text": {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0],
                    "attention_chunk_size": WINDOW},
    "llama4": {"text_config": {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0],
                               "num_experts_per_tok": 1, "attention_bias": False,
                               "attention_chunk_size": WINDOW,
                               "use_qk_norm": True, "rope_scaling": None}},
    "nemotron_h": {"num_hidden_layers": 4, "hybrid_override_pattern": ["M", "*", "M", "-"]},
    # written out, as checkpoints carry them: transformers' default layout (which vLLM and our
    # engine build) is not mlx-lm's
    "olmo_hybrid": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3
                    + ["full_attention"]},
    "recurrent_gemma": {"num_hidden_layers": 3,
                        "block_types": ["recurrent", "attention", "recurrent"]},
    "openelm": {"num_query_heads": [3, 4], "num_kv_heads": [1, 2],
                "ffn_multipliers": [0.5, 1.0]},
    "mamba2": {"num_heads": 6, "hidden_size": 96, "intermediate_size": 192},
    # Mamba / attention alternating (mlx-lm's mamba_step 2), heads of 32; no sliding window
    # (mlx-lm's module applies none, so the window is the context)
    "plamo2": {"num_hidden_layers": 4, "hidden_size_per_head": 32,
               "attention_window_size": 512},
    "falcon_h1": {"num_hidden_layers": 2, "mamba_d_ssm": 192, "mamba_n_heads": 6},
    # DeciLM's heterogeneous blocks: GQA 3:1, no attention, full MHA without an MLP, linear
    # stand-ins for both (the first block attends: mlx-lm builds the mask from cache 0)
    "nemotron-nas": {"num_hidden_layers": 4, "block_configs": [
        {"attention": {"n_heads_in_group": 3}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 0.5}},
        {"attention": {"n_heads_in_group": 1}, "ffn": {"no_op": True}},
        {"attention": {"replace_with_linear": True}, "ffn": {"replace_with_linear": True}}]},
    # RoPE variants the families are built with
    "deepseek_v2": {"n_routed_experts": 4, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                     "original_max_position_embeddings": 256,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                     "mscale_all_dim": 1.0}},
    # no position beyond original_max_position_embeddings (MiniCPM3-4B's case: the short
    # factors); long = short, since mlx-lm's own module rotates with the long ones everywhere
    "minicpm3": {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16,
                                  "long_factor": [1.0] * 16,
                                  "original_max_position_embeddings": 512}},
    "ministral3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                       "factor": 2.0, "original_max_position_embeddings": 256,
                                       "llama_4_scaling_beta": 0.1, "beta_fast": 32,
                                       "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    # every real checkpoint of these has routed experts (the MoE issue), which their
    # ModelArgs leave off by default
    "deepseek": {"n_routed_experts": 4},
    # DeepSeek sparse attention within index_topk (every key selected: served dense, as
    # DeepSeek-V3.2's 2048 within a context of at most 2048): the matrix's context
    "deepseek_v32": {"n_routed_experts": 4, "index_topk": 256},
    "glm_moe_dsa": {"index_topk": 256},
    # DeepSeek-V3's epsilon (mlx-lm's module hard-codes it on the latent norms)
    "deepseek_v3": {"n_routed_experts": 4, "rms_norm_eps": 1e-6},
    # mixture of experts: the layer stacks the families' own layouts need
    # 4 layers: mlx-lm's qwen3_next / qwen3_5 put full attention on every 4th layer
    "qwen3_next": {"num_hidden_layers": 4},
    "qwen3_5_moe": {"text_config": {"num_hidden_layers": 4, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}},
    # top-k within the 4 experts (mlx-lm's default is 8)
    "step3p5": {"moe_top_k": 2, "share_expert_dim": 64,
                # written out: transformers' Step3p5Config defaults differ from mlx-lm's
                "use_head_wise_attn_gate": True, "moe_layers_enum": "1",
                "moe_router_scaling_factor": 3.0,
                "layer_types": ["sliding_attention", "full_attention"]},
    # YaRN written out: transformers' GptOssConfig defaults to it where the config is silent,
    # mlx-lm's module to plain RoPE
    "gpt_oss": {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 4096}},
    # Llama 4's position-dependent query scale, which mlx-lm's mistral4 reads from its RoPE
    "mistral4": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                     "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 512}},
    # mup_enabled, route_scale written out: transformers' AfmoeConfig defaults both off,
    # mlx-lm's module on (released checkpoints carry them)
    # written out: transformers' Ernie4_5_MoeConfig defaults (experts from layer 1, top-6, two
    # shared experts) differ from mlx-lm's
    "ernie4_5_moe": {"moe_k": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 1,
                     "moe_layer_interval": 1, "moe_num_shared_experts": 1},
    "afmoe": {"layer_types": ["sliding_attention", "full_attention"], "num_dense_layers": 1,
              "sliding_window": WINDOW, "mup_enabled": True, "route_scale": 2.826},
    "exaone_moe": {"layer_types": ["sliding_attention", "full_attention"],
                   "is_moe_layer": [False, True], "num_shared_experts": 1},
    # layer 0 sliding with sinks and dense, layer 1 global MoE; the value scale written out
    # (transformers' MiMoV2FlashConfig defaults it to 0.707, mlx-lm's module to none)
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1],
                      "attention_value_scale": 0.707, "add_swa_attention_sink_bias": True,
                      "add_full_attention_sink_bias": False, "sliding_window_size": WINDOW},
    # window-only layers (no compress_ratios), a window the prompts exceed
    "deepseek_v41": {"sliding_window": WINDOW},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity",
                      "zero_expert_num": 1},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 1, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "hunyuan": {"rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
    "phi3": {"partial_rotary_factor": 0.5},
    # as transformers' class always has them; the activation mlx-lm's module computes (the
    # engine computes the config's: transformers' default is the tanh approximation)
    # 2 KV heads, each read by 2 query heads in mlx-lm's tiled order (head h: KV h % 2)
    "plamo": {"hidden_size": 128, "num_attention_heads": 4, "n_shared_head": 2},
    "gpt_bigcode": {"attention_bias": True, "mlp_bias": True, "activation_function": "gelu"},
    # mlx-lm's module masks tokenizer ids up to 100351 in the logits (out of bounds below)
    "phi3small": {"vocab_size": 100352},
    # multi-head attention only: their ModelArgs read but do not implement fewer KV heads
    **dict.fromkeys(("gpt2", "gpt_neox"), {"num_key_value_heads": _HEADS}),
    # gated delta-net x3, attention; the rotary share inside rope_parameters, as Qwen3.5
    # checkpoints carry it (mlx-lm reads it only there, transformers also at the top level)
    "qwen3_5": {"text_config": {"num_hidden_layers": 4, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}},
    "prism_hadamard_qwen35": lambda cfg: _hadamard_pack(cfg),
    # the convolution width written out, as Bailing V3 checkpoints carry it (vLLM's class
    # sizes the state pages from it; mlx-lm's module defaults it)
    "bailing_moe_v3": {"short_conv_kernel_size": 4},
    # Kimi delta attention (KDA) on layers 1 and 2 (1-based kda_layers), NoPE MLA on layer 3
    "kimi_linear": {"num_hidden_layers": 3, "mla_use_nope": True, "num_experts_per_token": 2,
                    "linear_attn_config": {"num_heads": 3, "head_dim": 32,
                                           "short_conv_kernel_size": 4, "kda_layers": [1, 2],
                                           "full_attn_layers": [3]}},
    # Kimi K3: KDA (one fused convolution state) and gated NoPE MLA, SiTU activations,
    # attention residuals
    "kimi_k3": {"text_config": {
        "num_hidden_layers": 3, "hidden_act": "situ", "activation_situ_beta": 2.0,
        "num_experts": 5, "num_experts_per_token": 2, "num_shared_experts": 1,
        "mla_use_nope": True, "mla_use_output_gate": True, "attn_res_block_size": 2,
        "linear_attn_config": {"num_heads": 3, "head_dim": 32, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2], "full_attn_layers": [3]}}},
    # MiniMax-M3's language model: a dense first layer with full attention, then experts with
    # block-sparse attention (an indexer picks 2 key blocks of 4)
    "minimax_m3_vl": {"text_config": {
        "num_hidden_layers": 2, "moe_layer_freq": [0, 1], "num_local_experts": 5,
        "dense_intermediate_size": 128, "rotary_dim": 16,
        "layer_types": ["full_attention", "minimax_m3_sparse"],
        "sparse_attention_config": {"sparse_num_index_heads": 1, "sparse_index_dim": 32,
                                    "sparse_block_size": 4, "sparse_topk_blocks": 2,
                                    "sparse_local_block": 1}}},
    # Muse Spark's language model: a sliding layer with RoPE, a global one without
    "muse_spark": {"text_config": {
        "num_hidden_layers": 2, "post_norm_eps": 1e-5, "layer_rope_theta": [10000.0, 0],
        "layer_types": ["sliding_attention", "full_attention"], "output_multiplier": 2.0,
        "moe_hidden_size": 64, "num_local_experts": 5, "num_shared_experts": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    # written out: vLLM's config class and mlx-lm default both differently when absent
    "muse_glimmer": {"num_hidden_layers": 4, "qk_scale_factor": 3.87,
                     "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    "spark2_5": {"num_hidden_layers": 4, "layer_types": _SLIDING_FULL, "hidden_act": "gelu",
                 "rope_parameters": _ROPE_BY_LAYER_TYPE},
}

def _hadamard_pack(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Hadamard-rotated 2-bit pack of the tiny Qwen3.5 text model: packed input widths are
    multiples of 128 and rotation blocks 512 or more, so hidden 128 and MLP width 512; the
    embedding and one MLP packed, its down projection rotated (:func:`randomize_packs`)."""
    text = tiny_config("qwen3_5")["text_config"]
    text.update(hidden_size=128, intermediate_size=512, model_type="qwen3_5")
    modules = [{"path": f"model.{path}", "embedding": path == "embed_tokens",
                "dtype": "float16", "block": block}
               for path, block in (("embed_tokens", 0), ("layers.3.mlp.gate_proj", 0),
                                   ("layers.3.mlp.up_proj", 0),
                                   ("layers.3.mlp.down_proj", 512))]
    return {"model_type": cfg["model_type"], "schema_version": 1,
            "tensor_namespace": "mlx-lm-text",
            "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
            "modules": modules, "text_config": text}


#: model type -> HF architecture name where it is not transformers' causal-LM class for it:
#: the name real checkpoints carry (vLLM knows most of them)
ARCHITECTURES: dict[str, str] = {
    "internlm2": "InternLM2ForCausalLM", "internlm3": "InternLM3ForCausalLM",
    "minicpm": "MiniCPMForCausalLM", "minicpm3": "MiniCPM3ForCausalLM",
    "mimo": "MiMoForCausalLM", "qwen": "QWenLMHeadModel", "openelm": "OpenELMForCausalLM",
    "phi3small": "Phi3SmallForCausalLM", "plamo": "PlamoForCausalLM",
    "plamo2": "Plamo2ForCausalLM", "plamo3": "Plamo3ForCausalLM",
    "hunyuan": "HunYuanMoEV1ForCausalLM", "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "iquestloopcoder": "IQuestLoopCoderForCausalLM", "telechat3": "TeleChat3ForCausalLM",
    "nemotron-nas": "DeciLMForCausalLM", "exaone": "ExaoneForCausalLM",
    "baichuan_m1": "BaichuanM1ForCausalLM", "rwkv7": "RWKV7ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM", "mimo_v2_flash": "MiMoV2FlashForCausalLM",
    "nanbeige": "NanbeigeForCausalLM", "deepseek": "DeepseekForCausalLM",
    # multimodal checkpoints: the image-text class HF writes (their language model is served)
    "gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration",
    "gemma3n": "Gemma3nForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration", "pixtral": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration", "lfm2-vl": "Lfm2VlForConditionalGeneration",
    "muse_glimmer": "MuseGlimmerForConditionalGeneration",
    "kimi_vl": "KimiVLForConditionalGeneration", "kimi_k25": "KimiK25ForConditionalGeneration",
    "kimi_k3": "KimiK3ForConditionalGeneration",
    "minimax_m3_vl": "MiniMaxM3SparseForConditionalGeneration",
}

#: multimodal model type -> (the mlx-lm type of its language model, whose tiny config is the
#: ``text_config``; the ``model_type`` HF writes in ``text_config``), as released checkpoints
#: carry them; their architecture is transformers' image-text class (:func:`architecture`)
WRAPPED_TEXT: dict[str, tuple[str, str]] = {
    "gemma3": ("gemma3_text", "gemma3_text"),
    "gemma4": ("gemma4_text", "gemma4_text"),
    "mistral3": ("llama", "mistral"),
    "pixtral": ("llama", "mistral"),
    "qwen2_vl": ("qwen2", "qwen2_vl_text"),
    "qwen3_vl": ("qwen3", "qwen3_vl_text"),
    "qwen3_vl_moe": ("qwen3_moe", "qwen3_vl_moe_text"),
    "lfm2-vl": ("lfm2", "lfm2"),
    # DeepSeek-V3 language models (Kimi K2.5's config names its text part kimi_k2)
    "kimi_vl": ("deepseek_v3", "deepseek_v3"),
    "kimi_k25": ("deepseek_v3", "kimi_k2"),
}

#: types mlx-lm cannot build here, as the checkpoints people have: the transformers config and
#: model class that write them (tiny sizes as :func:`tiny_config`'s). Their reference is vLLM's
#: CPU backend (fp32): a served one is ``match_vllm`` or ``mismatch``
TRANSFORMERS_BUILT: dict[str, tuple[str, str]] = {
    # mlx-lm's olmo module exits at import without the ai2-olmo package (hf_olmo's layout)
    "olmo": ("OlmoConfig", "OlmoForCausalLM"),
}

#: model type -> why the matrix has no checkpoint for it (the build error is recorded too)
KNOWN_UNBUILT: dict[str, str] = {}

#: expert counts: set only where the family has no dense default
_EXPERT_COUNTS = frozenset({"num_experts", "n_routed_experts", "num_local_experts",
                            "moe_num_experts"})
#: ModelArgs fields that mark routed experts, for types that could not be built
_MOE_FIELDS = frozenset({"num_experts", "n_routed_experts", "num_local_experts",
                         "moe_num_experts", "moe_intermediate_size", "moe_hidden_size",
                         "ffn_config", "moe_topk"})


@dataclasses.dataclass
class TypeResult:
    """What happened to one model type (JSON-ready through :func:`dataclasses.asdict`)."""

    model_type: str
    architecture: str | None = None
    moe: bool = False
    features: list[str] = dataclasses.field(default_factory=list)
    built: bool = False
    build_error: str | None = None
    reload_identical: bool | None = None
    reference: list[list[int]] | None = None
    outcome: str | None = None
    served: list[list[int]] | None = None
    vllm_reference: list[list[int]] | None = None
    message: str | None = None
    seconds: float | None = None


# ----------------------------------------------------------------------------- the types


def model_types() -> list[str]:
    """mlx-lm's model types: the modules of ``mlx_lm/models`` except building blocks."""
    import pkgutil

    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
                  if m.name not in HELPER_MODULES)


def model_classes(model_type: str) -> tuple[type, type]:
    """``(Model, ModelArgs)`` of mlx-lm's module for ``model_type`` (ImportError as is)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model, module.ModelArgs


# ----------------------------------------------------------------------------- configs


def _fields(args_class: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(args_class)}


def _fill(args_class: type, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with every field of ``args_class`` named in :data:`NAME_DEFAULTS` set."""
    for name, f in _fields(args_class).items():
        if name in NAME_DEFAULTS and name not in cfg:
            if name in _EXPERT_COUNTS and f.default in (0, None, False):
                continue  # a family that is dense unless asked (qwen3_5, ...) stays dense
            cfg[name] = copy.deepcopy(NAME_DEFAULTS[name])
    return cfg


def tiny_config(model_type: str) -> dict[str, Any]:
    """The config dict (config.json) of ``model_type``'s tiny checkpoint.

    Raises:
        ImportError: mlx-lm's module cannot be imported (a missing optional dependency).
    """
    _, args_class = model_classes(model_type)
    cfg: dict[str, Any] = {"model_type": model_type}
    fields = _fields(args_class)
    if model_type in WRAPPED_TEXT:
        inner_type, hf_text_type = WRAPPED_TEXT[model_type]
        cfg["text_config"] = tiny_config(inner_type)
        cfg["text_config"]["model_type"] = hf_text_type
    elif "text_config" in fields:
        inner = _text_config_class(model_type)
        cfg["text_config"] = (_fill(inner, {}) if inner is not None
                              else copy.deepcopy(NAME_DEFAULTS))
        cfg["text_config"].setdefault("model_type", model_type)
    _fill(args_class, cfg)
    override = OVERRIDES.get(model_type)
    if callable(override):
        cfg = override(cfg)
    elif override:
        _merge(cfg, override)
    return cfg


def _merge(cfg: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            _merge(cfg[key], value)
        else:
            cfg[key] = copy.deepcopy(value)


def _text_config_class(model_type: str) -> type | None:
    """The dataclass a wrapper's ``text_config`` is read into, where the module names one."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    for name in ("TextModelArgs", "TextArgs", "TextConfig"):
        if dataclasses.is_dataclass(getattr(module, name, None)):
            return getattr(module, name)
    return None


def architecture(model_type: str) -> str:
    """The HF ``architectures`` entry: :data:`ARCHITECTURES`, else transformers' causal-LM
    class for the type, else ``<CamelCase>ForCausalLM``."""
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if isinstance(name, str):
        return name
    camel = "".join(p[:1].upper() + p[1:] for p in re.split(r"[_\-]", model_type))
    return f"{camel}ForCausalLM"


# ----------------------------------------------------------------------------- checkpoints


def randomize(model: Any, seed: int) -> None:
    """Deterministic weights with O(1) activations, so that mistakes show in the logits.

    Weights of linear, embedding and expert layers become N(0, 1/fan_in) (embeddings N(0,
    0.25)); every other parameter (norm scales, biases, convolutions, state-space constants)
    keeps mlx-lm's initial value plus N(0, 0.01) noise, so structural values (norms at 1 or at
    0 for ``1 + w`` norms, ``A_log``) stay meaningful while mix-ups remain visible.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.switch_layers import SwitchLinear

    matrices = {}
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            matrices[f"{prefix}.weight" if prefix else "weight"] = "embedding"
        elif isinstance(module, nn.Linear | SwitchLinear):
            matrices[f"{prefix}.weight" if prefix else "weight"] = "linear"
    new = []
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        if not mx.issubdtype(value.dtype, mx.floating):
            new.append((name, value))
            continue
        noise = mx.random.normal(value.shape, key=mx.random.key(seed * 1000 + i))
        kind = matrices.get(name)
        if kind == "embedding":
            value = 0.5 * noise
        elif kind == "linear":
            value = noise / math.sqrt(value.shape[-1])
        else:
            value = value.astype(mx.float32) + 0.1 * noise
        new.append((name, value.astype(mx.float32)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def randomize_packs(model: Any, seed: int) -> None:
    """Hadamard-rotated packs (mlx-lm's ``HadamardQuantizedLinear``): random 2-bit codes,
    sign vectors of +-1 (mlx-lm's sanitize checks them) and 16-bit scales, as packs hold
    them; :func:`randomize` leaves integer codes at zero and makes signs noise."""
    import mlx.core as mx

    try:
        from mlx_lm.models.prism_hadamard_qwen35 import HadamardQuantizedLinear
    except ImportError:
        return
    for i, (_, m) in enumerate(model.named_modules()):
        if not isinstance(m, HadamardQuantizedLinear):
            continue
        key = mx.random.key(seed * 7919 + i)
        m.weight = mx.random.randint(0, 2**32 - 1, m.weight.shape, key=key).astype(mx.uint32)
        rows, groups = m.scales.shape
        m.scales = (mx.random.uniform(0.5, 1.5, (rows, groups), key=key)
                    * 2 / math.sqrt(m.weight.shape[1] * 16)).astype(mx.float16)
        m.biases = (-1.5 * m.scales).astype(mx.float16)
        if m.block:
            m.signs = mx.where(mx.random.bernoulli(0.5, m.signs.shape, key=key), 1.0, -1.0)
    mx.eval(model.parameters())


def classify(model: Any, cfg: dict[str, Any]) -> tuple[bool, list[str]]:
    """``(moe, features)`` of an instantiated mlx-lm model: routed experts (SwitchGLU /
    SwitchMLP, or a list of expert modules), and the attention / recurrent features
    docs/models.md lists."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import cache as cache_mod
    from mlx_lm.models.switch_layers import SwitchLinear

    modules = list(model.named_modules())
    # routed experts: switch layers, or a list of expert modules (DBRX's per-expert MLPs)
    moe = any(isinstance(m, SwitchLinear) or re.search(r"\.experts\.\d+$", n)
              for n, m in modules)
    names = {n for n, _ in tree_flatten(model.parameters())}
    features = []
    try:
        caches = model.make_cache() if hasattr(model, "make_cache") else []
    except Exception:  # noqa: BLE001 (a model whose make_cache needs more than its config)
        caches = []
    kinds = {type(c).__name__ for c in _flat_caches(caches)}
    if kinds & {"ArraysCache", "MambaCache"}:
        features.append("recurrent")
    if kinds & {"RotatingKVCache", "LayerCache"}:  # LayerCache: DeepSeek-V4.1's window
        features.append("sliding window")
    if "ChunkedKVCache" in kinds:
        features.append("chunked attention")
    if isinstance(cache_mod, object) and any("kv_a_proj" in n or "kv_b_proj" in n
                                             for n in names):
        features.append("MLA")
    if any(n.endswith("sinks") for n in names):
        features.append("attention sinks")
    if any(re.search(r"(q|k)_(layer)?norm", n) for n in names):
        features.append("q/k norm")
    text = {**cfg, **(cfg.get("text_config") or {})}
    if any(text.get(k) for k in ("num_kv_shared_layers", "num_kv_reuse_layers")):
        features.append("shared KV")
    if any(isinstance(text.get(k), list) for k in ("num_kv_heads", "num_query_heads")):
        features.append("per-layer heads")
    if text.get("no_rope_layers"):
        features.append("no-RoPE layers")
    if "MLA" not in features and text.get("kv_lora_rank") and any(
            "kv_a" in n for n in names):
        features.append("MLA")
    flat = json.dumps(cfg)
    if "softcap" in flat or "soft_cap" in flat:
        features.append("soft-capping")
    if any(cfg.get(k) not in (None, 1, 1.0) for k in ("partial_rotary_factor", "rotary_pct")):
        features.append("partial rotary")
    if moe:
        features.append("MoE")
    return moe, features


def _flat_caches(caches: Iterable[Any]) -> Iterable[Any]:
    for c in caches:
        inner = getattr(c, "caches", None)
        if isinstance(inner, list | tuple):
            yield from _flat_caches(inner)
        else:
            yield c


def _seed(model_type: str) -> int:
    return zlib.crc32(model_type.encode())


def _drop_unapplied_window(cfg: dict[str, Any], features: list[str]) -> None:
    """Without sliding-window caches in mlx-lm's model, a top-level ``sliding_window`` (and no
    ``layer_types`` naming sliding layers) is one mlx-lm ignores while vLLM, and so our engine,
    applies it to every layer: drop it, so that mlx-lm stays a valid reference."""
    if "sliding window" in features:
        return
    for c in (cfg, cfg.get("text_config") or {}):
        if "sliding_attention" not in (c.get("layer_types") or ()):
            c.pop("sliding_window", None)


def build_checkpoint(model_type: str, root: Path) -> TypeResult:
    """Build, save and reload ``model_type``'s tiny checkpoint under ``root / model_type``.

    The folder holds config.json (with ``model_type`` and ``architectures``),
    model.safetensors (float32) and SmolLM2's tokenizer files. ``build_error`` says why a type
    could not be built (the exception, one line).
    """
    result = TypeResult(model_type)
    folder = Path(root) / model_type
    if model_type in TRANSFORMERS_BUILT:
        return _build_with_transformers(result, folder)
    try:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        cfg = tiny_config(model_type)
        cfg.setdefault("architectures", [architecture(model_type)])
        result.architecture = cfg["architectures"][0]
        model_class, args_class = model_classes(model_type)
        # mlx-lm's multimodal ModelArgs write their own values into the text_config they are
        # given (lfm2-vl: an untied LM head its lfm2 model never has): the checkpoint keeps
        # the config as written here
        model = model_class(args_class.from_dict(
            copy.deepcopy(cfg) if model_type in WRAPPED_TEXT else cfg))
        result.moe, result.features = classify(model, cfg)
        _drop_unapplied_window(cfg, result.features)
        randomize(model, _seed(model_type))
        randomize_packs(model, _seed(model_type))
        folder.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
        tok = _tokenizer_files(Path(root))
        cfg.update(bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"],
                   torch_dtype="float32")
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        for f in tok["files"]:
            shutil.copy(f, folder / f.name)
        reloaded = load_reference_model(folder)
        again = dict(tree_flatten(reloaded.parameters()))
        if model_type in SANITIZE_REWRITES:  # what mlx-lm's own sanitize makes of them
            weights = reloaded.sanitize(dict(weights))
        result.reload_identical = (again.keys() == weights.keys() and all(
            bool(mx.array_equal(again[k], weights[k])) for k in weights))
        result.built = True
    except BaseException as e:  # noqa: BLE001 (ImportError, SystemExit from mlx-lm's olmo)
        if isinstance(e, KeyboardInterrupt):
            raise
        result.build_error = _one_line(e)
        result.outcome = "not_built"
        result.moe = result.moe or _moe_by_fields(model_type)
    return result


def _build_with_transformers(result: TypeResult, folder: Path) -> TypeResult:
    """A :data:`TRANSFORMERS_BUILT` type's tiny checkpoint, written by transformers (random
    initialisation, seeded), with SmolLM2's tokenizer."""
    try:
        import torch
        import transformers

        config_name, model_name = TRANSFORMERS_BUILT[result.model_type]
        tok = _tokenizer_files(folder.parent)
        config = getattr(transformers, config_name)(
            hidden_size=_HIDDEN, intermediate_size=_FFN, num_hidden_layers=_LAYERS,
            num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS, vocab_size=VOCAB,
            max_position_embeddings=512, bos_token_id=tok["bos_token_id"],
            eos_token_id=tok["eos_token_id"], tie_word_embeddings=False,
            architectures=[model_name])
        torch.manual_seed(_seed(result.model_type))
        model = getattr(transformers, model_name)(config).float()
        model.save_pretrained(folder)
        for f in tok["files"]:
            shutil.copy(f, folder / f.name)
        result.architecture, result.built, result.reload_identical = model_name, True, True
    except Exception as e:  # noqa: BLE001 (recorded)
        result.build_error, result.outcome = _one_line(e), "not_built"
    return result


def _moe_by_fields(model_type: str) -> bool:
    """Whether ``model_type``'s ModelArgs (or its text config class) has expert fields."""
    try:
        _, args_class = model_classes(model_type)
        inner = _text_config_class(model_type)
    except BaseException:  # noqa: BLE001 (a module that cannot even be imported)
        return False
    names = set(_fields(args_class)) | (set(_fields(inner)) if inner is not None else set())
    return bool(names & _MOE_FIELDS)


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _tokenizer_files(root: Path) -> dict[str, Any]:
    """SmolLM2's tokenizer saved once under ``root / "tokenizer"``: its files and special ids."""
    folder = root / "tokenizer"
    meta = folder / "ids.json"
    if not meta.is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import smollm2_tokenizer

        tok = smollm2_tokenizer()
        tok.save_pretrained(folder)
        meta.write_text(json.dumps({"bos_token_id": tok.bos_token_id,
                                    "eos_token_id": tok.eos_token_id}))
    ids = json.loads(meta.read_text())
    return {**ids, "files": [f for f in folder.iterdir() if f.name != "ids.json"]}


def load_reference_model(folder: Path) -> Any:
    """The checkpoint's model as mlx-lm itself loads it (``mlx_lm.utils.load_model``: its
    config handling, ``sanitize``, strict weight names; ``mlx_lm.utils.load`` is this plus
    the tokenizer)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder), strict=True)
    return model


# ----------------------------------------------------------------------------- references


def prompts(model_type: str) -> list[list[int]]:
    """The matrix's prompts (token ids) for ``model_type``: :data:`PROMPT_LENGTHS` long."""
    s = _seed(model_type) % 997
    return [[(7 * i + 13 * j + s) % 40000 + 100 for j in range(n)]
            for i, n in enumerate(PROMPT_LENGTHS)]


#: types whose mlx-lm cache disagrees with its own model's mask: their reference is mlx-lm's
#: forward without a cache over the whole sequence at every step (the mask alone decides)
REFERENCE_WITHOUT_CACHE = {
    "plamo3": "mlx-lm's rotating cache keeps window_size keys where its mask (the "
              "checkpoints' convention) attends to window_size + 1",
}


def _bitlinear_without_metal(model: Any) -> None:
    """Where MLX has no Metal backend, compute ``model``'s mlx-lm ``BitLinear`` layers as their
    Metal kernel does (``out[:, r + j * out / 4] = sum_c x[:, c] * (code_j[r, c] - 1) * s``,
    code j in bits 2j..2j+1 of the packed byte), in plain MLX ops on the unpacked codes."""
    import mlx.core as mx
    from mlx_lm.models.bitlinear_layers import BitLinear

    if mx.metal.is_available():
        return

    def matmul(self: Any, x: Any, packed: Any) -> Any:
        codes = mx.concatenate([(packed >> (2 * j)) & 3 for j in range(4)], axis=0)
        scale = self.weight_scale[0]
        scale = 1 / scale if self.invert_weight_scales else scale
        return (x @ (codes.astype(x.dtype) - 1).T) * scale

    for _, m in model.named_modules():
        if isinstance(m, BitLinear):
            m.execute_matmul_kernel = matmul.__get__(m)


def mlx_lm_reference(folder: Path, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """mlx-lm's own greedy generation (``generate_step``, its own ``make_prompt_cache``), one
    prompt at a time, ``n`` new tokens each; for :data:`REFERENCE_WITHOUT_CACHE` types (the
    folder's name), mlx-lm's forward over the whole sequence at each step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model = load_reference_model(folder)
    _bitlinear_without_metal(model)
    out = []
    if Path(folder).name in REFERENCE_WITHOUT_CACHE:
        for prompt in prompt_ids:
            seq = list(prompt)
            for _ in range(n):
                seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1])))
            out.append(seq[len(prompt):])
        return out
    for prompt in prompt_ids:
        tokens = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                      sampler=lambda x: mx.argmax(x, axis=-1)):
            tokens.append(int(token))
        out.append(tokens)
    return out


# ----------------------------------------------------------------------------- serving


def engine_spec(folder: Path, prompt_ids: list[list[int]], n: int, recurrent: bool
                ) -> dict[str, Any]:
    """tests/llm_harness.py's spec: float32, 16-token prefill chunks, all prompts at once,
    prefix caching on (off for models with recurrent layers, as vLLM's 'align' mode is not
    implemented)."""
    return {
        "model": str(folder),
        "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
                   "kv_cache_memory_bytes": 64 * 2**20, "seed": 0,
                   "enable_prefix_caching": not recurrent},
        "requests": [{"prompt_token_ids": p,
                      "params": {"temperature": 0.0, "max_tokens": n, "ignore_eos": True}}
                     for p in prompt_ids],
    }


#: exception types a deliberate refusal raises (ours, vLLM's config checks); anything else at
#: start-up is a crash
_REFUSALS = ("ValueError", "NotImplementedError", "StartupRefused", "ValidationError",
             "UnsupportedModel")
#: vLLM's wrapper of an engine-core failure: the cause is logged above it
_GENERIC = ("Engine core initialization failed",)


def serve(folder: Path, prompt_ids: list[list[int]], n: int, recurrent: bool,
          work: Path, timeout: int = 600, native: bool = False,
          ) -> tuple[str, list[list[int]] | None, str | None]:
    """Serve ``folder`` through tests/llm_harness.py in a fresh process (``native``: vLLM's
    own CPU backend, the plugin excluded through ``VLLM_PLUGINS=none``).

    Returns:
        ``(state, tokens, message)``: state ``served`` with each prompt's token ids, or
        ``refused`` / ``crashed`` with the error's message (the last exception line and, for a
        crash, the traceback's tail).
    """
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / "spec.json", work / "out.json"
    spec_path.write_text(json.dumps(engine_spec(folder, prompt_ids, n, recurrent)))
    out_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if native:
        env["VLLM_PLUGINS"] = "none"
    try:
        proc = subprocess.run([sys.executable, str(HARNESS), str(spec_path), str(out_path)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "crashed", None, f"timed out after {timeout} s"
    log = proc.stdout + proc.stderr
    (work / "engine.log").write_text(log)
    if proc.returncode == 0 and out_path.exists():
        outs = json.loads(out_path.read_text())["outputs"]
        return "served", [o["completions"][0]["token_ids"] for o in outs], None
    return _failure(log)


def _failure(log: str) -> tuple[str, None, str]:
    """Classify a failed engine run from its log: ``refused`` when the root cause is a
    deliberate refusal (:data:`_REFUSALS`, before any request was processed), else
    ``crashed`` (the message carries the traceback's tail)."""
    lines = [re.sub(r"^\(\w+ pid=\d+\) ERROR \S+ \S+ \[[^]]+\] ", "", line)
             for line in log.splitlines()]
    errors = [i for i, line in enumerate(lines)
              if re.match(r"^\s*(\w+\.)*\w*(Error|Exception|Refused|UnsupportedModel)\b.*:",
                          line)
              and not any(g in line for g in _GENERIC)]
    if not errors:
        return "crashed", None, "\n".join(lines[-30:])
    i = errors[-1]
    message = lines[i].strip()
    if "validation error" in message and i + 1 < len(lines):  # pydantic: the cause follows
        message += " " + lines[i + 1].strip()
    kind = re.match(r"^\s*(?:\w+\.)*(\w+)", message).group(1)
    served_any = "Processed prompts" in log
    if kind in _REFUSALS and not served_any:
        return "refused", None, message
    return "crashed", None, message + "\n" + "\n".join(lines[max(0, i - 24):i])


# ----------------------------------------------------------------------------- the matrix


def prepare_type(model_type: str, work: Path) -> TypeResult:
    """Build ``model_type``'s checkpoint and mlx-lm's reference on it; never raises."""
    start = time.monotonic()
    result = build_checkpoint(model_type, work / "checkpoints")
    if result.built and model_type in TRANSFORMERS_BUILT:
        state, tokens, message = serve(work / "checkpoints" / model_type, prompts(model_type),
                                       NEW_TOKENS, False, work / "runs" / model_type / "vllm",
                                       native=True)
        result.reference = result.vllm_reference = tokens
        if state != "served":
            result.outcome = "reference_failed"
            result.message = f"vLLM's CPU backend failed on the checkpoint: {message}"
    elif result.built:
        folder = work / "checkpoints" / model_type
        try:
            result.reference = mlx_lm_reference(folder, prompts(model_type), NEW_TOKENS)
        except Exception as e:  # noqa: BLE001 (recorded: mlx-lm cannot generate with it)
            result.outcome, result.message = "reference_failed", _one_line(e)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def serve_type(result: TypeResult, work: Path) -> TypeResult:
    """Serve a prepared type through the engine and record the outcome (thread-safe: the
    engine runs in its own process). A type whose reference failed stays
    ``reference_failed`` if the engine serves it (nothing to compare with), and becomes
    ``refused`` or ``crashed`` as the engine's start-up goes."""
    start = time.monotonic()
    state, tokens, message = serve(work / "checkpoints" / result.model_type,
                                   prompts(result.model_type), NEW_TOKENS,
                                   "recurrent" in result.features,
                                   work / "runs" / result.model_type)
    if result.reference is None:  # mlx-lm cannot generate: did the engine refuse it too?
        result.served = tokens
        if state != "served":
            result.outcome, result.message = state, f"{message} (mlx-lm: {result.message})"
        result.seconds = round((result.seconds or 0) + time.monotonic() - start, 1)
        return result
    result.served, result.message = tokens, message
    if state == "served":
        result.outcome = "match" if tokens == result.reference else "mismatch"
        if result.outcome == "match" and result.model_type in TRANSFORMERS_BUILT:
            result.outcome = "match_vllm"  # its reference is vLLM's
        if result.outcome == "mismatch" and result.model_type in VLLM_OVER_MLX_LM:
            _compare_with_vllm(result, work)
    else:
        result.outcome = state
    result.seconds = round((result.seconds or 0) + time.monotonic() - start, 1)
    return result


def _compare_with_vllm(result: TypeResult, work: Path) -> None:
    """Serve ``result``'s checkpoint with vLLM's own CPU backend (fp32, the same engine
    settings): ``match_vllm`` where its tokens are the served ones, else ``mismatch`` (the
    message says why)."""
    state, tokens, message = serve(work / "checkpoints" / result.model_type,
                                   prompts(result.model_type), NEW_TOKENS,
                                   "recurrent" in result.features,
                                   work / "runs" / result.model_type / "vllm", native=True)
    result.vllm_reference = tokens
    if state != "served":
        result.message = f"vLLM's CPU backend failed on the checkpoint: {message}"
    elif tokens == result.served:
        result.outcome = "match_vllm"
    else:
        result.message = "differs from vLLM's CPU backend too"


def run_type(model_type: str, work: Path, serve_it: bool = True) -> TypeResult:
    """Build, reference and (``serve_it``) serve one type; never raises."""
    result = prepare_type(model_type, work)
    if serve_it and _servable(result):
        serve_type(result, work)
    return result


def _servable(result: TypeResult) -> bool:
    """Built, with a reference or one that mlx-lm itself failed to give."""
    return result.reference is not None or result.outcome == "reference_failed"


def run_matrix(types: Iterable[str], work: Path, out: Path, serve_it: bool = True,
               include_moe: bool = False, skip: Iterable[str] = (), jobs: int = 1,
               ) -> list[TypeResult]:
    """Run every type of ``types`` and write the results to ``out`` (JSON) as each finishes,
    so a long run can be read while it goes; types ``out`` already holds with an outcome in
    ``skip`` are left as they are. MoE types are built and classified but served only with
    ``include_moe``. Checkpoints and references are made here, one type at a time; up to
    ``jobs`` engines serve at once (each in its own process)."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    results: dict[str, TypeResult] = {}
    if out.exists():  # resume: keep what an earlier run recorded for other types
        for row in json.loads(out.read_text())["types"]:
            results[row["model_type"]] = TypeResult(**row)

    def record(result: TypeResult) -> None:
        results[result.model_type] = result
        state = result.outcome or ("built" if result.built else "?")
        print(f"{result.model_type:28s} {state:16s} {result.seconds or 0:6.1f}s "
              f"{(result.message or result.build_error or '')[:90]}", flush=True)
        _write(out, results)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        pending: set = set()
        for model_type in types:
            if model_type in results and results[model_type].outcome in skip:
                continue
            result = prepare_type(model_type, work)
            if serve_it and _servable(result) and (include_moe or not result.moe):
                while len(pending) >= max(1, jobs):
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        record(f.result())
                pending.add(pool.submit(serve_type, result, work))
            else:
                record(result)
        for f in wait(pending).done:
            record(f.result())
    return list(results.values())


def reclassify(out: Path, work: Path) -> None:
    """Recompute the outcome of every refused or crashed type in ``out`` from its engine log
    (``work/runs/<type>/engine.log``) with the current classifier."""
    data = json.loads(out.read_text())
    results = {row["model_type"]: TypeResult(**row) for row in data["types"]}
    for r in results.values():
        log = work / "runs" / r.model_type / "engine.log"
        if r.outcome in ("refused", "crashed") and log.is_file():
            r.outcome, _, r.message = _failure(log.read_text())
    _write(out, results)


def merge_results(out: Path, inputs: Iterable[Path]) -> None:
    """Write ``out`` from the rows of ``inputs`` (results files), a later file's row of a type
    replacing an earlier one's; mlx-lm's types in none of them are recorded ``not_run``."""
    results: dict[str, TypeResult] = {}
    for path in inputs:
        for row in json.loads(Path(path).read_text())["types"]:
            results[row["model_type"]] = TypeResult(**row)
    for model_type in model_types():
        if model_type not in results:
            result = TypeResult(model_type, architecture=architecture(model_type),
                                outcome="not_run")
            try:
                cfg = tiny_config(model_type)
                model_class, args_class = model_classes(model_type)
                result.moe, result.features = classify(model_class(args_class.from_dict(cfg)),
                                                       cfg)
            except BaseException:  # noqa: BLE001 (not buildable: judged by its fields)
                result.moe = _moe_by_fields(model_type)
            results[model_type] = result
    _write(out, results)


def _write(out: Path, results: dict[str, TypeResult]) -> None:
    import mlx_lm

    rows = [dataclasses.asdict(results[t]) for t in sorted(results)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"mlx_lm": mlx_lm.__version__, "types": rows}, indent=1))
    tmp.replace(out)


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The matrix's totals: types, non-MoE, built, and each outcome over non-MoE types; the
    same over MoE types as ``moe_<outcome>`` (``moe_built``...; ``moe_not_run``: MoE types
    without an outcome)."""
    dense = [r for r in rows if not r["moe"]]
    moe = [r for r in rows if r["moe"]]
    c = {"types": len(rows), "moe": len(moe), "non_moe": len(dense),
         "built": sum(r["built"] for r in dense), "moe_built": sum(r["built"] for r in moe)}
    for outcome in OUTCOMES:
        c[outcome] = sum(r["outcome"] == outcome for r in dense)
        c[f"moe_{outcome}"] = sum((r["outcome"] or "not_run") == outcome for r in moe)
    return c


# ----------------------------------------------------------------------------- docs


TABLE_START = "<!-- model-matrix:start (generated by tests/model_matrix.py --docs) -->"
TABLE_END = "<!-- model-matrix:end -->"
_RESULT_TEXT = {
    "match": "serves, equals mlx-lm",
    "match_vllm": "serves, equals vLLM's CPU backend (fp32), differs from mlx-lm",
    "mismatch": "serves, **differs** from mlx-lm",
    "refused": "refused at start-up",
    "crashed": "**crashes**",
    "not_built": "no test checkpoint",
    "reference_failed": "mlx-lm cannot generate",
    "not_run": "not run yet",
    None: "not run yet",
}


#: types served as vLLM serves them where vLLM and mlx-lm's module disagree: where their
#: tokens differ from mlx-lm's the matrix serves the checkpoint with vLLM's CPU backend too
#: (outcome ``match_vllm`` when the tokens are its)
VLLM_OVER_MLX_LM = {
    "cohere2": "sliding layers see window + 1 tokens, as vLLM serves Cohere 2",
}


def docs_table(data: dict[str, Any]) -> str:
    """docs/models.md's generated table (markdown, between the matrix markers)."""
    rows = data["types"]
    c = counts(rows)
    lines = [
        TABLE_START,
        f"mlx-lm {data.get('mlx_lm', '?')}: {c['types']} text model types, {c['moe']} with "
        f"routed experts (MoE); of the {c['non_moe']} others {c['match']} serve and equal "
        f"mlx-lm's own generation, {c['match_vllm']} serve as vLLM does (equal to vLLM's CPU "
        f"backend, not to mlx-lm), {c['refused']} are refused at start-up, {c['mismatch']} "
        f"differ, {c['crashed']} crash, {c['not_built']} have no test checkpoint, "
        f"{c['reference_failed']} cannot run in mlx-lm here, {c['not_run']} were not run. "
        f"Of the {c['moe']} MoE types {c['moe_match']} serve and equal mlx-lm's own "
        f"generation, {c['moe_refused']} are refused at start-up, {c['moe_mismatch']} differ, "
        f"{c['moe_crashed']} crash, {c['moe_not_built']} have no test checkpoint, "
        f"{c['moe_reference_failed']} cannot run in mlx-lm here, {c['moe_not_run']} were not "
        "run.",
        "",
        "| model type | architecture | features | test checkpoint | tested how | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        built_by = (f"transformers {TRANSFORMERS_BUILT[r['model_type']][1]}"
                    if r["model_type"] in TRANSFORMERS_BUILT else "mlx-lm ModelArgs")
        checkpoint = (f"tiny random ({built_by})" if r["built"]
                      else f"none: {_cell(r['build_error'])}")
        tested = ("greedy ids vs mlx-lm, 4 prompts (3-70 tokens), 16-token chunks"
                  if r["outcome"] in ("match", "mismatch") else "")
        if r["outcome"] == "match_vllm":
            tested = ("greedy ids vs vLLM's CPU backend (fp32) and mlx-lm, 4 prompts (3-70 "
                      "tokens), 16-token chunks")
        result = _RESULT_TEXT.get(r["outcome"], r["outcome"])
        if r["outcome"] in ("match_vllm", "mismatch") and r["model_type"] in VLLM_OVER_MLX_LM:
            result = (f"{result}: " + VLLM_OVER_MLX_LM[r["model_type"]])
        if r["outcome"] in ("refused", "crashed", "reference_failed") and r.get("message"):
            result += f": {_cell(r['message'].splitlines()[0])}"
        features = ", ".join(r["features"]) or "attention"
        lines.append(f"| `{r['model_type']}` | {r['architecture'] or ''} | {features} | "
                     f"{checkpoint} | {tested} | {result} |")
    lines.append(TABLE_END)
    return "\n".join(lines)


def _cell(text: str | None, limit: int = 160) -> str:
    text = (text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def write_docs_table(results: Path, docs: Path = DOCS) -> None:
    """Replace the generated table in ``docs`` (between :data:`TABLE_START` and
    :data:`TABLE_END`; appended as a section the first time), keeping the other text."""
    table = docs_table(json.loads(Path(results).read_text()))
    text = docs.read_text()
    if TABLE_START in text:
        head, rest = text.split(TABLE_START, 1)
        tail = rest.split(TABLE_END, 1)[1]
        text = head + table + tail
    else:
        text = text.rstrip("\n") + "\n\n## The model matrix\n\n" + table + "\n"
    docs.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: all)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/model-matrix"))
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default: WORK/results.json)")
    parser.add_argument("--build-only", action="store_true", help="no engine, no reference")
    parser.add_argument("--moe", action="store_true", help="serve MoE types too")
    parser.add_argument("--reclassify", action="store_true", help="recompute refused / "
                        "crashed outcomes of the results file from the engine logs and exit")
    parser.add_argument("--merge", type=Path, nargs="+", help="write --out from these "
                        "results files (later ones win per type) and exit")
    parser.add_argument("--jobs", type=int, default=1, help="engines serving at once")
    parser.add_argument("--skip", default="", help="comma-separated outcomes: types the "
                        "results file already holds with one of them are not run again")
    parser.add_argument("--docs", type=Path, help="write docs/models.md's table from this "
                        "results file and exit")
    args = parser.parse_args(argv)
    if args.docs:
        write_docs_table(args.docs)
        return 0
    types = args.types.split(",") if args.types else model_types()
    out = args.out or args.work / "results.json"
    if args.merge:
        merge_results(out, args.merge)
        return 0
    if args.reclassify:
        reclassify(out, args.work)
        return 0
    if args.build_only:
        for t in types:
            r = build_checkpoint(t, args.work / "checkpoints")
            print(f"{t:28s} {'built' if r.built else 'FAILED'} moe={r.moe} "
                  f"reload_identical={r.reload_identical} {r.features} {r.build_error or ''}",
                  flush=True)
        return 0
    rows = run_matrix(types, args.work, out, include_moe=args.moe,
                      skip=[o for o in args.skip.split(",") if o], jobs=args.jobs)
    print(json.dumps(counts([dataclasses.asdict(r) for r in rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
