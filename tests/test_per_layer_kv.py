"""Per-layer KV shapes (Gemma 4: sliding layers of 2 x 32, full-attention layers of 2 x 64) and
KV shared across layers: the specs vLLM gets, the pool each layer gets, and greedy ids served by
our engine equal to mlx-lm's own generation on the same weights (chunked prefill, 4 concurrent
requests, a shared prefix for prefix caching)."""

from __future__ import annotations

import mlx.core as mx
import pytest
import torch
from tiny_models import make_tiny_checkpoint, mlx_lm_greedy

from vllm_unified.backend import profile
from vllm_unified.compat import FullAttentionSpec
from vllm_unified.kv.cache import AttentionShape, KVCache, layer_name
from vllm_unified.kv.hybrid import HybridLayers
from vllm_unified.kv.pool import KVPool
from vllm_unified.kv.quant import KVFormat

NEW_TOKENS = 12
#: two prompts share a 40-token prefix (prefix caching), the others are longer than the
#: sliding window (8) and span several 16-token chunks
_PREFIX = [(11 * j) % 40000 + 100 for j in range(40)]
PROMPTS = [_PREFIX + [501, 502, 503], [(7 * j) % 40000 + 100 for j in range(3)],
           [(13 * j) % 40000 + 300 for j in range(70)], _PREFIX + [601, 602]]

# ----------------------------------------------------------------------------- unit


def _cache(kv_shapes, cache_dtype="auto"):
    layers = HybridLayers("gemma4_text", 3, [])
    shape = AttentionShape(2, 32, torch.float32, cache_dtype)
    return KVCache(profile(), layers, shape, {0: 8, 1: None, 2: 8}, mx.float32,
                   kv_shapes=kv_shapes)


def test_spec_per_layer_shape():
    cache = _cache({1: (1, 64)})
    specs = cache.kv_cache_spec(16, None)
    got = {n: (s.num_kv_heads, s.head_size, s.sliding_window) for n, s in specs.items()}
    assert got == {layer_name(0): (2, 32, 8), layer_name(1): (1, 64, None),
                   layer_name(2): (2, 32, 8)}
    assert all(isinstance(s, FullAttentionSpec) for s in specs.values())
    # page bytes: 2 (K, V) x 16 tokens x heads x size x 4 bytes, each layer its own
    assert cache.bytes_per_block(16, None) == 2 * 16 * 4 * (2 * 32 + 64 + 2 * 32)
    assert cache.per_layer_shapes and "per-layer KV shapes" in cache.describe_format()
    assert cache.tokens_per_gib() == 2**30 / (2 * 4 * (2 * 32 + 64 + 2 * 32))


def test_uniform_shapes_unchanged():
    cache = _cache({0: (2, 32), 1: (2, 32)})
    assert not cache.per_layer_shapes
    assert {s.head_size for s in cache.kv_cache_spec(16, None).values()} == {32}


def test_vllm_groups_per_layer_shapes_as_one_group():
    """vLLM puts full-attention layers of different page sizes in one KV cache group (one
    block table), each layer viewed with its own spec."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    class _Sched:
        disable_hybrid_kv_cache_manager = False

    class _Cfg:
        scheduler_config = _Sched()

        class attention_config:  # noqa: N801 - vLLM's attribute name
            hisparse_config = None

    specs = _cache({1: (1, 64)}).kv_cache_spec(16, None)
    groups = get_kv_cache_groups(_Cfg(), specs)
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    assert sorted(groups[0].layer_names) == sorted(specs)


def test_quantized_per_layer_shapes_refused():
    with pytest.raises(ValueError, match="different KV heads or head sizes"):
        _cache({1: (1, 64)}, "int8_per_token_head")


def test_mlx_pool_per_layer_shapes():
    pool = KVPool.allocate_mlx(3, 4, 16, 2, 32, mx.float32, write="scatter",
                               layer_shapes=[(2, 32), (1, 64), (2, 32)])
    assert [tuple(a.shape) for a in pool.kv] == [(64, 2, 64), (64, 1, 128), (64, 2, 64)]
    k = mx.ones((3, 1, 64))
    pool.write(1, mx.array([0, 5, 17]), k, 2 * k)
    row = pool.kv[1][5, 0]
    assert float(row[:64].sum()) == 64 and float(row[64:].sum()) == 128
    with pytest.raises(ValueError, match="per-layer KV shapes"):
        KVPool.allocate_mlx(2, 4, 16, 2, 32, mx.float32, layer_shapes=[(2, 32)],
                            fmt=KVFormat())


def test_shared_layers_read_their_target_pages():
    layers = HybridLayers("gemma4_text", 3, [])
    cache = KVCache(profile(), layers, AttentionShape(2, 32, torch.float32),
                    {0: 8, 1: None, 2: 8}, mx.float32, kv_shapes={1: (1, 64)},
                    shared={3: 2, 4: 1})
    assert sorted(cache.kv_cache_spec(16, None)) == [layer_name(i) for i in range(3)]
    pool = KVPool.allocate_mlx(3, 4, 16, 2, 32, mx.float32, write="scatter",
                               layer_shapes=[(2, 32), (1, 64), (2, 32)])
    caches = cache._layer_caches(pool, None)
    assert [type(c).__name__ for c in caches] == ["PagedLayerCache"] * 3 + [
        "SharedLayerCache"] * 2
    assert [(c.layer, c.window) for c in caches[3:]] == [(2, 8), (1, None)]
    k = mx.ones((2, 1, 1, 64))
    assert caches[4].update_and_fetch(k, k)[0] is k
    assert float(mx.abs(pool.kv[1]).sum()) == 0  # nothing written by the reader
    with pytest.raises(ValueError, match="must follow"):
        KVCache(profile(), layers, AttentionShape(2, 32, torch.float32),
                {0: 8, 1: None, 2: 8}, mx.float32, shared={4: 1})


def test_gemma4_layout(tmp_path):
    """The load-time check records each slot's shape and which layers read which slot."""
    from vllm_unified.models.capability import route_model
    from vllm_unified.models.loader import load_model

    folder = make_tiny_checkpoint(tmp_path, "gemma4_shared")
    loaded = load_model(str(folder), hf_config=None, dtype=mx.float32, keep_quantized=False)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=(2, 32), config_window=None)
    assert layout.num_slots == 4 and layout.shared == {4: 3, 5: 2}
    assert {i: (s.window, s.num_kv_heads, s.head_dim) for i, s in layout.attention.items()} \
        == {0: (8, 2, 32), 1: (8, 2, 32), 2: (None, 2, 64), 3: (8, 2, 32)}
    assert any("per-layer KV shapes" in n for n in layout.notes)


def test_shared_kv_of_an_unknown_family_is_refused():
    from vllm_unified.models.capability import ModelLayout, UnsupportedModel, _shared_kv

    layout = ModelLayout("gemma3n_text", 2)
    with pytest.raises(UnsupportedModel, match="KV shared across layers"):
        _shared_kv(None, "gemma3n_text", {"num_kv_shared_layers": 2}, layout)
    assert _shared_kv(None, "llama", {}, layout) == {}


# ----------------------------------------------------------------------------- engine


def _spec(folder: str) -> dict:
    return {
        "model": folder,
        "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
                   "kv_cache_memory_bytes": 64 * 2**20, "seed": 0,
                   "enable_prefix_caching": True, "disable_log_stats": False},
        "requests": [{"prompt_token_ids": p,
                      "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS,
                                 "ignore_eos": True}} for p in PROMPTS],
        # the second round reads the prompts' full blocks from the prefix cache
        "rounds": 2, "metrics": True,
        "rpc": ["runner_stats"],
    }


# the shared-KV variant (per-layer shapes and shared pages) in CI; the plain one and the K=V
# one (full-attention layers of 1 KV head whose values are the keys) slow
@pytest.mark.engine
@pytest.mark.parametrize("family", [*(pytest.param(f, marks=pytest.mark.slow)
                                      for f in ("gemma4", "gemma4_kv")), "gemma4_shared"])
def test_gemma4_matches_mlx_lm(family, tmp_path):
    from conftest import run_llm

    folder = str(make_tiny_checkpoint(tmp_path / family, family))
    ours = run_llm(_spec(folder), tmp_path)
    for i, prompt in enumerate(PROMPTS * 2):
        got = ours["outputs"][i]["completions"][0]["token_ids"]
        assert got == mlx_lm_greedy(folder, prompt, NEW_TOKENS), f"request {i}"
    assert ours["metrics"]["vllm:prefix_cache_hits"] >= 16 * 4
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(PROMPTS)
    assert "per-layer KV shapes" in ours["log"]
    assert ("KV shared across layers" in ours["log"]) == (family == "gemma4_shared")


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4", "gemma4_shared", "gemma4_kv"])
def test_gemma4_vllm_native_fp32_matches_mlx_lm(family, tmp_path):
    """vLLM's own CPU backend in fp32 on the same weights gives mlx-lm's greedy ids (which
    :func:`test_gemma4_matches_mlx_lm` shows ours give): the checkpoint means the same model
    to both."""
    from conftest import run_llm

    folder = str(make_tiny_checkpoint(tmp_path / family, family))
    spec = _spec(folder)
    del spec["rpc"]  # our runner's statistics
    native = run_llm(spec, tmp_path, native=True)
    for i, prompt in enumerate(PROMPTS * 2):
        got = native["outputs"][i]["completions"][0]["token_ids"]
        assert got == mlx_lm_greedy(folder, prompt, NEW_TOKENS), f"prompt {i}"
