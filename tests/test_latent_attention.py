"""Multi-head latent attention (MLA) on vLLM's MLA pages: the reference's absorbed attention
against the expanded (up-projected) attention it reassociates, the pool's latent rows, the
adapter of mlx-lm's MLA modules and the capability check, and a tiny random MiniCPM3 served by
our engine, compared with mlx-lm's own generation and with vLLM's CPU backend in fp32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import run_llm
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import make_tiny_checkpoint

from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.attention.reference import paged_attention_latent
from vllm_unified.kv.pool import KVPool
from vllm_unified.models.capability import UnsupportedModel, route_model
from vllm_unified.models.config import mlx_lm_config
from vllm_unified.models.loader import load_model

BLOCK = 4
HEADS, NOPE, ROPE, LATENT, VDIM = 3, 24, 8, 20, 12


def _expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, positions):
    """One sequence's attention as mlx-lm computes it: per-head keys [W_UK c ; k_pe] and
    values W_UV c, queries [q_nope ; q_pe] at ``positions`` (causal). Shapes: q_* [L, H, d],
    c [S, r], k_pe [S, rope], w_uk [H, nope, r], w_uv [H, v, r] -> [L, H, v]."""
    k_nope = mx.einsum("hnr,sr->hsn", w_uk, c)
    keys = mx.concatenate([k_nope, mx.broadcast_to(k_pe[None], (HEADS, *k_pe.shape))], -1)
    values = mx.einsum("hvr,sr->hsv", w_uv, c)
    q = mx.concatenate([q_nope, q_pe], -1).transpose(1, 0, 2)  # [H, L, d]
    scores = (q @ keys.transpose(0, 2, 1)) * scale
    mask = mx.arange(c.shape[0])[None] <= mx.array(positions)[:, None]
    scores = mx.where(mask[None], scores, -mx.inf)
    return (mx.softmax(scores, axis=-1) @ values).transpose(1, 0, 2)


def test_reference_latent_attention_is_the_expanded_attention():
    """Decode rows and prefill chunks (after cached context and from position 0) over latent
    rows scattered through a paged pool equal mlx-lm's expanded attention."""
    rng = np.random.default_rng(0)
    query_lens, seq_lens = [1, 5, 1, 7], [9, 12, 3, 7]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    ids = rng.permutation(sum(blocks) + 2)[:sum(blocks)] + 1  # scattered, never block 0
    table = np.zeros((len(seq_lens), max(blocks)), np.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = ids[start:start + n]
        start += n
    num_slots = (ids.max() + 1) * BLOCK
    w_uk = mx.array(rng.standard_normal((HEADS, NOPE, LATENT)), mx.float32) / 4
    w_uv = mx.array(rng.standard_normal((HEADS, VDIM, LATENT)), mx.float32) / 4
    scale = (NOPE + ROPE) ** -0.5
    pool = mx.array(rng.standard_normal((num_slots, 1, LATENT + ROPE)), mx.float32)  # garbage
    queries, expected, slots_all, rows_all = [], [], [], []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        c = mx.array(rng.standard_normal((s_len, LATENT)), mx.float32)
        k_pe = mx.array(rng.standard_normal((s_len, ROPE)), mx.float32)
        pos = np.arange(s_len)
        slots = table[i, pos // BLOCK] * BLOCK + pos % BLOCK
        slots_all.append(slots)
        rows_all.append(mx.concatenate([c, k_pe], -1))
        q_nope = mx.array(rng.standard_normal((q_len, HEADS, NOPE)), mx.float32)
        q_pe = mx.array(rng.standard_normal((q_len, HEADS, ROPE)), mx.float32)
        positions = list(range(s_len - q_len, s_len))
        expected.append(_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, positions))
        q_latent = mx.einsum("lhn,hnr->lhr", q_nope, w_uk)
        queries.append(mx.concatenate([q_latent, q_pe], -1))
    pool[mx.array(np.concatenate(slots_all))] = mx.concatenate(rows_all)[:, None]
    meta = build_attention_metadata(query_lens, seq_lens, table, BLOCK)
    q = mx.concatenate(queries)[:, :, None]  # [T, H, 1, W]
    out = paged_attention_latent(q, pool, meta, scale, LATENT)
    assert out.shape == (sum(query_lens), HEADS, 1, LATENT)
    got = mx.einsum("thr,hvr->thv", out[:, :, 0], w_uv)
    np.testing.assert_allclose(np.array(got), np.array(mx.concatenate(expected)),
                               rtol=1e-4, atol=1e-5)


def test_reference_latent_attention_refuses_a_kv_pool():
    meta = build_attention_metadata([1], [1], np.ones((1, 1), np.int32), BLOCK)
    with pytest.raises(ValueError, match=r"MLA pool must be \[slots, 1, 28\]"):
        paged_attention_latent(mx.zeros((1, 2, 1, 28)), mx.zeros((8, 2, 56)), meta, 1.0, 20)


def test_pool_writes_latent_rows_in_place():
    """The MLX-owned pool's scatter and the zeroing of blocks on MLA layers: one row per
    token, no K|V halves."""
    pool = KVPool.allocate_latent_mlx(2, 3, BLOCK, LATENT + ROPE, mx.float32)
    rows = mx.arange(2 * (LATENT + ROPE), dtype=mx.float32).reshape(2, 1, -1)
    pool.write_latent(1, mx.array([5, 9], mx.int32), rows)
    mx.eval(pool.kv)
    assert pool.kv[1].shape == (3 * BLOCK, 1, LATENT + ROPE)
    assert mx.array_equal(pool.kv[1][mx.array([5, 9])], rows)
    assert float(mx.abs(pool.kv[0]).max()) == 0.0
    pool.zero_blocks([1])  # slots 4..7
    assert float(mx.abs(pool.kv[1][5]).max()) == 0.0 and mx.array_equal(pool.kv[1][9], rows[1])
    with pytest.raises(ValueError, match="do not fit"):
        pool.write_latent(0, mx.array([0], mx.int32), mx.zeros((1, 1, 7)))


def _module_outputs(module, steps, latent_dim):
    """``module``'s output for each input of ``steps`` (``[1, L, D]``: a prompt, then decode
    steps) with mlx-lm's KVCache, and the adapter's with a LatentProbeCache."""
    from mlx_lm.models.cache import KVCache

    from vllm_unified.models.latent_attention import LatentAttention, LatentProbeCache

    theirs_cache, ours_cache = KVCache(), LatentProbeCache(latent_dim)
    adapter = LatentAttention(module)
    theirs, ours = [], []
    for x in steps:  # the masks as the models build them (V3: dense)
        dense = {"return_array": True, "window_size": None}
        theirs.append(module(x, theirs_cache.make_mask(x.shape[1], **dense), theirs_cache))
        ours.append(adapter(x, ours_cache.make_mask(x.shape[1], **dense), ours_cache))
    return mx.concatenate(theirs, axis=1), mx.concatenate(ours, axis=1)


@pytest.mark.parametrize("version", ["v2-quantized", "v3"])
def test_adapter_serves_deepseek_attention(version):
    """The adapter's absorbed path equals mlx-lm's DeepSeek modules (the MoE families reuse
    it): V2 up-projects through a quantized ``kv_b_proj`` (dequantized by the adapter) with
    YaRN's scale; V3 carries the up-projections as ``embed_q`` / ``unembed_out``."""
    from mlx_lm.models import deepseek_v2, deepseek_v3

    mx.random.seed(1)
    common = dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=3,
                  kv_lora_rank=64, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24,
                  v_head_dim=20, max_position_embeddings=4096)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    if version == "v3":
        module = deepseek_v3.DeepseekV3Attention(deepseek_v3.ModelArgs(**common,
                                                                        rope_scaling=yarn))
    else:
        module = deepseek_v2.DeepseekV2Attention(deepseek_v2.ModelArgs(**common,
                                                                        rope_scaling=yarn))
        import mlx.nn as nn

        nn.quantize(module, group_size=32, bits=8,
                    class_predicate=lambda path, m: path.endswith("kv_b_proj"))
        assert "scales" in module.kv_b_proj
    steps = [mx.random.normal((1, 6, 96)), mx.random.normal((1, 1, 96)),
             mx.random.normal((1, 1, 96))]
    theirs, ours = _module_outputs(module, steps, 64)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("family", ["bailing_hybrid", "bailing_moe_v3"])
def test_adapter_serves_bailing_attention(family):
    """The MLA modules of Ling 2.5 (mlx-lm's bailing_hybrid) and Bailing V3: ``embed_q`` /
    ``unembed_out`` up-projections, interleaved RoPE, an output projection named ``dense``;
    V3 gates each head's output by ``sigmoid(g_proj(x))``."""
    from mlx_lm.models import bailing_hybrid, bailing_moe_v3

    mx.random.seed(2)
    if family == "bailing_moe_v3":
        args = bailing_moe_v3.ModelArgs(
            hidden_size=96, num_attention_heads=3, kv_lora_rank=64, q_lora_rank=48,
            qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, rope_theta=10000.0,
            max_position_embeddings=4096)
        module = bailing_moe_v3.BailingMLA(args)
        assert "g_proj" in module
        theirs, ours = _module_outputs(module, [mx.random.normal((1, 6, 96)),
                                                mx.random.normal((1, 1, 96))], 64)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=2e-4, atol=2e-5)
        return
    args = bailing_hybrid.ModelArgs(
        model_type="bailing_hybrid", hidden_size=96, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, layer_group_size=2,
        group_norm_size=1, vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, routed_scaling_factor=1.0, head_dim=32,
        kv_lora_rank=64, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24,
        v_head_dim=20)
    module = bailing_hybrid.MultiLatentAttention(args)
    steps = [mx.random.normal((1, 6, 96)), mx.random.normal((1, 1, 96)),
             mx.random.normal((1, 1, 96))]
    theirs, ours = _module_outputs(module, steps, 64)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=2e-4, atol=2e-5)


def test_minicpm3_config_takes_the_short_rope_factors():
    """mlx-lm rotates with long_factor everywhere; transformers and vLLM with short_factor up
    to original_max_position_embeddings."""
    hf = {"model_type": "minicpm3", "max_position_embeddings": 4096,
          "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 1.0,
                              "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
                              "original_max_position_embeddings": 4096}}
    assert mlx_lm_config(hf)["rope_scaling"]["long_factor"] == [1.0, 2.0]
    hf["max_position_embeddings"] = 8192
    with pytest.raises(ValueError, match="short to long factors"):
        mlx_lm_config(hf)
    plain = mlx_lm_config({"model_type": "minicpm3", "rope_theta": 1e4,
                           "max_position_embeddings": 64})
    assert plain["rope_scaling"] == {}


def _checkpoint(tmp_path, family: str = "minicpm3"):
    folder = make_tiny_checkpoint(tmp_path / family, family)
    return folder, load_model(folder, hf_config=None, dtype=mx.float32, keep_quantized=False)


def test_youtu_loads_as_mla_and_mlx_lm_matches_transformers(tmp_path):
    """transformers' ``youtu`` checkpoint runs as mlx-lm's youtu_llm (no query LoRA,
    interleaved RoPE): its MLA slots load, and mlx-lm's logits are transformers' (vLLM has
    no Youtu model of its own to compare with)."""
    import torch
    import transformers

    folder, loaded = _checkpoint(tmp_path, "youtu")
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)
    assert layout.latent == (56, 16) and loaded.config["model_type"] == "youtu_llm"
    prompt = [[5, 17, 300, 4000, 12, 9, 77]]
    ours = loaded.model(mx.array(prompt))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor(prompt)).logits.numpy()
    # transformers zeroes the padding token's embedding row when it loads (tied head)
    keep = np.arange(theirs.shape[-1]) != hf.config.pad_token_id
    np.testing.assert_allclose(np.array(ours)[..., keep], theirs[..., keep], rtol=1e-4,
                               atol=1e-4)


def test_minicpm3_loads_as_mla_and_a_wrong_adapter_is_refused(tmp_path, monkeypatch):
    """Every slot becomes an MLA slot (1 x (40 + 24) rows); vLLM's own MiniCPM3 caches 3
    expanded heads, which the layout notes. An absorbed path that differs from mlx-lm's
    module (here: a wrong softmax scale) is refused at load by the probe."""
    from vllm_unified.models import latent_attention

    _, loaded = _checkpoint(tmp_path)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=(3, 32), config_window=None)
    assert layout.latent == (40, 24)
    assert {(s.num_kv_heads, s.head_dim) for s in layout.attention.values()} == {(1, 64)}
    assert any("MLA pages of 40 latent + 24 rope" in n for n in layout.notes)
    monkeypatch.setattr(latent_attention.LatentAttention, "scale", property(lambda s: 0.5))
    with pytest.raises(UnsupportedModel, match="absorbed form .* not mlx-lm's"):
        route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)


def test_kv_bytes_per_token_of_mla_pages():
    """vLLM's MLAAttentionSpec page against mlx-lm's expanded cache (keys of nope + rope and
    values of v per head), per token and layer in fp32, for the tiny MiniCPM3 and
    MiniCPM3-4B's shape (40 heads, latent 256, rope 32, nope 64, values 64)."""
    from vllm_unified import compat

    def ratio(heads, latent, rope, nope, v):
        spec = compat.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=latent + rope,
                                       dtype=__import__("torch").float32)
        ours = spec.page_size_bytes // 16
        theirs = heads * (nope + rope + v) * 4
        return ours, theirs

    assert ratio(3, 40, 24, 40, 32) == (256, 1152)
    assert ratio(40, 256, 32, 64, 64) == (1152, 25600)


def test_kv_cache_hands_vllm_mla_specs_and_its_own_views(default_model):
    """An MLA model's KVCache: one MLAAttentionSpec per layer, vLLM's own allocation's views
    of the shared pool, rows written by the layer caches read back through torch, and a
    quantized KV format refused by name."""
    import torch
    from conftest import assert_views_like_vllms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.worker.utils import allocate_kv_cache as vllm_allocate_kv_cache

    from vllm_unified import compat
    from vllm_unified.backend import profile
    from vllm_unified.kv.cache import AttentionShape, KVCache, layer_name
    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.kv.hybrid import HybridLayers

    cfg = EngineArgs(model=default_model, max_model_len=256).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBNHC"
    block = cfg.cache_config.block_size
    shape = AttentionShape.latent(LATENT, ROPE, torch.float32)
    cache = KVCache(profile(), HybridLayers("minicpm3", 3, []), shape,
                    dict.fromkeys(range(3)), mx.float32)
    specs = cache.kv_cache_spec(block, cfg)
    assert all(isinstance(s, compat.MLAAttentionSpec) and s.num_kv_heads == 1
               and s.head_size == LATENT + ROPE for s in specs.values())
    assert cache.bytes_per_block(block, cfg) == 3 * block * (LATENT + ROPE) * 4
    groups = kv_cache_utils.get_kv_cache_groups(cfg, specs)
    config = kv_cache_utils.get_kv_cache_config_from_groups(cfg, groups, 4 << 20)
    cache.initialize(config, None)
    theirs = vllm_allocate_kv_cache(config, torch.device("cpu"), compat.KVCacheLayout.LBNHC)
    assert_views_like_vllms(cache.connector_views(), theirs, cache.pool.backing_buffer)
    assert cache.tokens_per_gib() == 2**30 / (3 * (LATENT + ROPE) * 4)
    assert "MLA pages" in cache.describe_format()
    meta = build_attention_metadata([2], [2], np.array([[1]], np.int32), block)
    rows = mx.arange(2 * (LATENT + ROPE), dtype=mx.float32).reshape(2, 1, -1)
    with set_step_context(StepContext(attn=meta)):
        cache.layer_caches[2].write_latent(rows)
        out = cache.layer_caches[2].attend_latent(mx.ones((2, HEADS, 1, LATENT + ROPE)), 0.1)
        mx.eval(out, cache.arrays())
    view = cache.connector_views()[layer_name(2)]  # [blocks, 1, block, W]
    assert torch.equal(view[1, 0, :2], torch.from_numpy(np.array(rows[:, 0])))
    assert out.shape == (2, HEADS, 1, LATENT)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8_per_token_head: multi-head"):
        AttentionShape.latent(LATENT, ROPE, torch.float32, "int8_per_token_head")


def test_kv_budget_before_load_counts_mla_pages(tmp_path):
    """The platform's start-up budget check sizes an MLA model's pages as served (one
    latent + rope row per token), not vLLM's expanded view of MiniCPM3 (3 heads of 32, K and
    V, 3x more): one 256-token sequence (17 blocks of 16) x 3 layers x 64 x 4 bytes fits."""
    from vllm.engine.arg_utils import EngineArgs

    folder = make_tiny_checkpoint(tmp_path / "minicpm3", "minicpm3")
    mla = 17 * 16 * 3 * (40 + 24) * 4
    cfg = EngineArgs(model=str(folder), max_model_len=256, dtype="float32",
                     kv_cache_memory_bytes=mla).create_engine_config()
    assert cfg.cache_config.kv_cache_memory_bytes == mla
    with pytest.raises(Exception, match="--kv-cache-memory-bytes .* 12288 bytes"):
        EngineArgs(model=str(folder), max_model_len=256, dtype="float32",
                   kv_cache_memory_bytes=mla - 1).create_engine_config()


# ----------------------------------------------------------------------------- engine

NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 21, 40, 70)


def _prompts(shift: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * j + shift) % 40000 + 100 for j in range(n)]
            for i, n in enumerate(PROMPT_LENGTHS)]


def _mlx_lm_greedy(loaded, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own cache and forward (its expanded K/V), one sequence at a time."""
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = loaded.model(mx.array([[out[-1]]]), cache=cache)
    return out


def _spec(folder, batches) -> dict:
    # 32-token budget: the longer prompts are prefilled in chunks, four requests share steps;
    # the second batch repeats the first's prompts with new tails (prefix cache hits)
    return {
        "model": str(folder),
        "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 32,
                   "kv_cache_memory_bytes": 32 * 2**20, "seed": 0,
                   "enable_prefix_caching": True, "disable_log_stats": False},
        "batches": [[{"prompt_token_ids": p,
                      "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS,
                                 "ignore_eos": True}} for p in batch] for batch in batches],
        "metrics": True,
        "rpc": ["runner_stats"],
    }


def _batches() -> list[list[list[int]]]:
    first = _prompts()
    return [first, [p + [(5 * j + 11) % 40000 + 100 for j in range(9)] for p in first]]


@pytest.mark.engine
@pytest.mark.parametrize("family", ["minicpm3", pytest.param("youtu", marks=pytest.mark.slow)])
def test_mla_family_served_on_mla_pages_matches_mlx_lm(family, tmp_path):
    """Our engine on vLLM's MLA pages (chunked prefill, 4 concurrent requests, prefix
    caching) gives mlx-lm's own greedy ids on the same weights."""
    folder, loaded = _checkpoint(tmp_path, family)
    batches = _batches()
    ours = run_llm(_spec(folder, batches), tmp_path)
    prompts = [p for batch in batches for p in batch]
    for i, prompt in enumerate(prompts):
        got = ours["outputs"][i]["completions"][0]["token_ids"]
        assert got == _mlx_lm_greedy(loaded, prompt, NEW_TOKENS), f"prompt {i} ({len(prompt)})"
    assert ours["metrics"].get("vllm:prefix_cache_hits", 0) > 0
    assert len({t for o in ours["outputs"] for t in o["completions"][0]["token_ids"]}) > 8
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == 4
    assert "MLA pages" in ours["log"] and "MLAAttentionSpec" in ours["log"]


@pytest.mark.engine
@pytest.mark.slow
def test_minicpm3_matches_vllm_cpu_backend(tmp_path):
    """vLLM's own CPU backend in fp32 (its MiniCPM3 attends expanded K/V) gives the same
    greedy ids as our engine on MLA pages."""
    folder, _ = _checkpoint(tmp_path)
    spec = _spec(folder, _batches())
    ours = run_llm(spec, tmp_path)
    theirs = run_llm({**spec, "rpc": []}, tmp_path, native=True)  # no runner_stats there
    assert "MLXPlatform" not in theirs["platform"]
    for i, (a, b) in enumerate(zip(ours["outputs"], theirs["outputs"], strict=True)):
        assert a["completions"][0]["token_ids"] == b["completions"][0]["token_ids"], i


def test_adapter_serves_mistral4_with_its_query_scale():
    """Mistral 4 (mlx-lm's layers call attention as ``(x, attn_scale, mask, cache)``): the
    installed adapter's absorbed path, Llama 4's position-dependent query scale included
    (a small ``original_max_position_embeddings``, so the scale changes within the prompt and
    again at decode), gives the model's logits with mlx-lm's own caches."""
    from mlx_lm.models import mistral4

    from vllm_unified.models.latent_attention import (
        LatentProbeCache,
        ScaledLatentAttention,
        install_latent_attention,
    )

    mx.random.seed(2)
    args = mistral4.ModelArgs(
        model_type="mistral4", vocab_size=64, hidden_size=96, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=1.5, kv_lora_rank=64, q_lora_rank=48, norm_topk_prob=True,
        max_position_embeddings=256, rms_norm_eps=1e-6, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, qk_rope_head_dim=16, qk_nope_head_dim=24,
        v_head_dim=20, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "llama_4_scaling_beta": 0.5,
                                        "original_max_position_embeddings": 2})
    model = mistral4.Model(args)
    steps = [mx.array([[5, 9, 11, 2, 40, 7]]), mx.array([[3]]), mx.array([[60]])]
    theirs_caches = make_prompt_cache(model)
    theirs = [model(x, cache=theirs_caches) for x in steps]
    assert set(install_latent_attention(model)) == {0, 1}
    assert all(isinstance(layer.self_attn, ScaledLatentAttention) for layer in model.layers)
    ours_caches = [LatentProbeCache(64) for _ in model.layers]
    ours = [model(x, cache=ours_caches) for x in steps]
    assert all(c.writes == [64 + 16] * 3 and c.attends == 3 for c in ours_caches)
    np.testing.assert_allclose(np.array(mx.concatenate(ours, axis=1)),
                               np.array(mx.concatenate(theirs, axis=1)), rtol=2e-4, atol=2e-4)
    # the scale matters: mlx-lm's model without it gives other logits
    for layer in model.layers:
        layer.self_attn = layer.self_attn.inner
    args.rope_parameters["llama_4_scaling_beta"] = 0.0
    caches = make_prompt_cache(model)
    unscaled = mx.concatenate([model(x, cache=caches) for x in steps], axis=1)
    assert not np.allclose(np.array(unscaled), np.array(mx.concatenate(theirs, axis=1)),
                           rtol=2e-4, atol=2e-4)


def test_mistral4_config_gets_the_neutral_query_scale():
    """mlx-lm's Mistral 4 reads Llama 4's query scale from ``rope_parameters`` unconditionally:
    a config without it gets beta 0 (no scale), one without a RoPE base is refused."""
    cfg = mlx_lm_config({"model_type": "mistral4", "max_position_embeddings": 4096,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert cfg["rope_parameters"]["llama_4_scaling_beta"] == 0.0
    assert cfg["rope_parameters"]["original_max_position_embeddings"] == 4096
    with pytest.raises(ValueError, match="mistral4: rope_parameters without rope_theta"):
        mlx_lm_config({"model_type": "mistral4", "rope_parameters": {"rope_type": "default"}})
