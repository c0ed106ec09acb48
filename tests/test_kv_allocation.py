"""Our KV allocation is vLLM's, byte for byte, except that the buffer is not zero-filled when
vLLM does not need zeroing: same per-layer views (shape, stride, storage offset, dtype), and the
MLX arrays attention uses are those views' bytes."""

from __future__ import annotations

import psutil
import pytest
import torch
from conftest import assert_views_like_vllms
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache as vllm_allocate_kv_cache

from vllm_unified import bridge
from vllm_unified.kv.allocation import KV_LAYOUT, allocate_kv_cache
from vllm_unified.kv.pool import KVPool


@pytest.fixture(scope="module")
def vllm_config(default_model):
    cfg = EngineArgs(model=default_model, max_model_len=256).create_engine_config()
    cfg.cache_config.kv_cache_layout = KV_LAYOUT
    return cfg


def _config(vllm_config, layers: int, kv_heads: int, head_size: int, dtype, memory: int):
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=16, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)
        for i in range(layers)}
    return get_kv_cache_configs(vllm_config, [specs], [memory])[0]


MODELS = {
    # name: (layers, kv heads, head size, dtype) -- MHA-like, GQA (SmolLM2), bf16 GQA
    "full-attention": (4, 8, 64, torch.float32),
    "gqa": (30, 3, 64, torch.float32),
    "gqa-bf16": (6, 2, 128, torch.bfloat16),
}


@pytest.mark.parametrize("name", MODELS)
def test_views_equal_vllm_allocate_kv_cache(vllm_config, name):
    cfg = _config(vllm_config, *MODELS[name], memory=64 * 2**20)
    ours_buf, ours = allocate_kv_cache(cfg, KV_LAYOUT)
    theirs = vllm_allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[KV_LAYOUT])
    assert_views_like_vllms(ours, theirs, ours_buf)


def test_zeroing_kept_when_vllm_needs_it(vllm_config, monkeypatch):
    cfg = _config(vllm_config, *MODELS["gqa"], memory=64 * 2**20)
    monkeypatch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda self: True))
    assert cfg.needs_kv_cache_zeroing
    buf, _ = allocate_kv_cache(cfg, KV_LAYOUT)
    assert int(torch.count_nonzero(buf)) == 0


def test_uninitialised_buffer_commits_no_pages(vllm_config):
    cfg = _config(vllm_config, *MODELS["gqa"], memory=4 * 2**30)
    assert not cfg.needs_kv_cache_zeroing
    proc = psutil.Process()
    before = proc.memory_info().rss
    buf, views = allocate_kv_cache(cfg, KV_LAYOUT)
    grown = proc.memory_info().rss - before
    assert buf.numel() >= 4 * 2**30 - 2**26
    assert grown < 64 * 2**20, f"allocating a 4 GiB pool committed {grown / 2**20:.0f} MiB"


def test_mlx_arrays_are_the_views_bytes(vllm_config):
    cfg = _config(vllm_config, *MODELS["gqa"], memory=64 * 2**20)
    buf, views = allocate_kv_cache(cfg, KV_LAYOUT)
    names = list(views)
    pool = KVPool.from_torch_views([views[n] for n in names], 16, buf)
    for arr, view in zip(pool.kv, pool.torch_views, strict=True):
        assert bridge.data_ptr(arr) == view.data_ptr()
        assert arr.shape == (view.shape[0] * view.shape[2], view.shape[1], view.shape[3])
    views[names[0]][2, 1, 3, :] = 7.0  # block 2, head 1, token 3: slot 35
    assert float(pool.kv[0][2 * 16 + 3, 1, 0]) == 7.0


def test_other_layouts_are_refused(vllm_config):
    cfg = _config(vllm_config, *MODELS["gqa"], memory=64 * 2**20)
    _, views = allocate_kv_cache(cfg, "LBHNC")
    with pytest.raises(ValueError, match="LBNHC"):
        KVPool.from_torch_views(list(views.values()), 16)


def test_lazy_pool_that_can_outgrow_memory_is_reported(monkeypatch):
    """A lazy pool larger than the memory available at start-up is named in a warning with
    the way out; committed (eager) or fitting pools are not."""
    from vllm_unified.kv import cache

    said = []
    monkeypatch.setattr(cache.logger, "warning", lambda msg, *args: said.append(msg % args))
    gib = 2**30
    assert cache.warn_if_pool_can_outgrow_memory(8 * gib, False, available=6 * gib) == 2 * gib
    assert len(said) == 1
    assert "KV pool (8.00 GiB)" in said[0] and "outgrow the 6.00 GiB" in said[0]
    assert "VLLM_UNIFIED_KV_EAGER_ZERO=1" in said[0]
    assert cache.warn_if_pool_can_outgrow_memory(8 * gib, True, available=6 * gib) == 0
    assert cache.warn_if_pool_can_outgrow_memory(4 * gib, False, available=6 * gib) == 0
    assert len(said) == 1
