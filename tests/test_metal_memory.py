"""The Metal memory path, run on the CPU with MLX's Metal import mocked at the one call that
differs.

On Metal the KV pool is the CPU backend's: vLLM's layout in one uninitialised torch buffer
(attention pages and a hybrid model's state pages), imported into MLX without a copy and
written in place by kernels. What differs is the import (``mx.from_dlpack(t, copy=False)``
wrapping the pointer as a Metal buffer, which MLX refuses for a pointer that is not page-aligned)
and the writes (the Metal dialect of ``kv/gpu/write.py``'s kernels, whose logic
``tests/test_metal_dialect.py`` checks in a CPU emulation). Here the import is a stand-in that
enforces Metal's alignment and adopts through the native extension (the CPU backend's zero-copy
import), and the write kernels are stand-ins with the same contract (the native ``write_rows``).
The backend profile is the real ``backend.profile()`` decision with the device facts mocked.
CUDA keeps its MLX-owned pool and refusals.
"""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx
import numpy as np
import psutil
import pytest
import torch
from conftest import assert_views_like_vllms, profile_for
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache as vllm_allocate_kv_cache

from vllm_unified import bridge
from vllm_unified.kv import pool as kv_pool
from vllm_unified.kv import state_pages
from vllm_unified.kv.allocation import KV_LAYOUT, PAGE_ALIGN, allocate_kv_cache, import_views
from vllm_unified.kv.cache import AttentionShape, KVCache, layer_name
from vllm_unified.kv.hybrid import HybridLayers, recurrent_layer_name
from vllm_unified.memory import wired
from vllm_unified.offload.runner import KVConnectorHooks

APPLE_PAGE = 16384
HEADS, HEAD = 2, 64
ATTN_PAGE = FullAttentionSpec(block_size=48, num_kv_heads=HEADS, head_size=HEAD,
                              dtype=torch.float32).page_size_bytes  # 49152 bytes


# ----------------------------------------------------------------------------- configs
@pytest.fixture(scope="module")
def vllm_config(default_model):
    cfg = EngineArgs(model=default_model, max_model_len=256,
                     enable_prefix_caching=False).create_engine_config()
    cfg.cache_config.kv_cache_layout = KV_LAYOUT
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # state groups for hybrids
    return cfg


def _attention_config(vllm_config, layers: int, memory: int, block: int = 16):
    specs = {layer_name(i): FullAttentionSpec(block_size=block, num_kv_heads=3, head_size=HEAD,
                                              dtype=torch.float32) for i in range(layers)}
    return get_kv_cache_configs(vllm_config, [specs], [memory])[0]


def _hybrid_config(vllm_config, memory: int):
    """Layers 0, 2 attention (48-token pages), 1, 3 recurrent (state pages padded to them)."""
    mamba = MambaSpec(shapes=((3, 64), (2, 16, 16)), dtypes=(torch.float32, torch.float32),
                      block_size=256, page_size_padded=ATTN_PAGE,
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="none")
    specs = {}
    for i in range(4):
        if i % 2:
            specs[recurrent_layer_name(i)] = mamba
        else:
            specs[layer_name(i)] = FullAttentionSpec(block_size=48, num_kv_heads=HEADS,
                                                     head_size=HEAD, dtype=torch.float32)
    return get_kv_cache_configs(vllm_config, [specs], [memory])[0]


# ----------------------------------------------------------------------------- Metal stand-ins
@dataclasses.dataclass
class MetalStandIns:
    """What the mocked Metal calls saw, in order."""

    events: list = dataclasses.field(default_factory=list)
    max_buffer_length: int = 1 << 40


@pytest.fixture
def metal(monkeypatch) -> MetalStandIns:
    """MLX's Metal calls replaced by CPU stand-ins with Metal's contracts."""
    err = bridge.native_error()
    assert err is None, f"native extension unusable (run scripts/setup.sh): {err}"
    import vllm_unified_native as native

    seen = MetalStandIns()

    def from_dlpack(t, copy=None):
        # MLX 0.32.4 on Metal: copy=False wraps the pointer (make_buffer) or raises, never
        # copies; Metal refuses a pointer that is not page-aligned.
        assert copy is False, "the bridge must ask for no copy"
        if t.data_ptr() % APPLE_PAGE:
            raise ValueError("[convert] Cannot import a CPU array without a copy.")
        nbytes = t.numel() * t.element_size()
        if nbytes > seen.max_buffer_length:
            raise ValueError("[convert] Cannot import a CPU array without a copy.")
        seen.events.append(("import", t.data_ptr(), nbytes))
        return native.adopt(t.data_ptr(), nbytes, list(t.shape), bridge.mlx_dtype(t.dtype), t)

    def write_kv(pool, slots, keys, values, *, dialect, tokens=None):
        assert dialect == "metal"
        seen.events.append(("write_kv", int(slots.shape[0])))
        if keys.ndim == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        return bridge.write_rows(pool, slots, mx.concatenate([keys, values], axis=-1))

    def write_rows(dst, row_idx, src, *, dialect):
        assert dialect == "metal"
        seen.events.append(("write_rows", int(row_idx.shape[0])))
        return bridge.write_rows(dst, row_idx, src)

    def set_wired_limit(n):
        seen.events.append(("wired_limit", n))
        return 8 * 2**30  # the limit the worker set before the weights loaded

    monkeypatch.setattr(bridge, "_backend", lambda: "metal")
    monkeypatch.setattr(mx, "from_dlpack", from_dlpack)
    monkeypatch.setattr(kv_pool, "write_kv_gpu", write_kv)
    monkeypatch.setattr(state_pages, "write_rows_gpu", write_rows)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_buffer_length": seen.max_buffer_length})
    monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
    monkeypatch.setattr(mx, "get_memory_limit", lambda: 12 * 2**30)
    monkeypatch.setattr(mx, "set_memory_limit",
                        lambda n: seen.events.append(("memory_limit", n)) or 12 * 2**30)
    return seen


def _cache(profile, layers: int, recurrent: list[int], block_dtype=torch.float32,
           heads: int = HEADS) -> KVCache:
    hybrid = HybridLayers("qwen3_next" if recurrent else "llama", layers, recurrent)
    return KVCache(profile, hybrid, AttentionShape(heads, HEAD, block_dtype),
                   {i: None for i in hybrid.attention}, mx.float32)


# ----------------------------------------------------------------------------- the decision
def test_profile_on_metal_takes_the_shared_path_and_cuda_keeps_mlx_owned():
    metal = profile_for("metal", "metal")
    assert (metal.kv_pool, metal.kv_pool_reason, metal.kv_write) == (
        "torch_shared", None, "metal_kernel")
    cuda = profile_for("cuda", "cuda")
    assert (cuda.kv_pool, cuda.kv_write) == ("mlx_owned", "cuda_kernel")
    assert "cannot be shared" in cuda.kv_pool_reason


# ----------------------------------------------------------------------------- allocation
@pytest.mark.parametrize("kind", ["attention", "attention-kernel-blocks", "hybrid"])
def test_buffer_is_page_aligned_and_views_are_vllms(vllm_config, kind):
    if kind == "hybrid":
        cfg, kernel = _hybrid_config(vllm_config, 64 * ATTN_PAGE), {0: 16}
    elif kind == "attention":
        cfg, kernel = _attention_config(vllm_config, 5, 3 * 2**20 + 12345), None
    else:
        cfg, kernel = _attention_config(vllm_config, 3, 4 * 2**20, block=48), {0: 16}
    buf, ours = allocate_kv_cache(cfg, KV_LAYOUT, kernel_block_sizes=kernel)
    assert buf.data_ptr() % APPLE_PAGE == 0 and buf.storage_offset() == 0
    assert buf.untyped_storage().nbytes() % APPLE_PAGE == 0
    assert buf.numel() == cfg.kv_cache_tensors[0].size
    sizes = None if kernel is None else [kernel.get(g) for g in range(len(cfg.kv_cache_groups))]
    theirs = vllm_allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[KV_LAYOUT], sizes)
    assert_views_like_vllms(ours, theirs, buf)


def test_zeroing_kept_for_a_hybrid_and_skipped_otherwise(vllm_config, metal):
    """Through the Metal path: a hybrid config (Mamba state: vLLM needs zeroed blocks) gets a
    pool that reads as zeros without a fill (a fresh mapping: no page committed, unlike vLLM's
    ``torch.zeros``); a plain attention config gets an uninitialised one that commits nothing;
    the benchmarks' eager fill commits every page."""
    proc = psutil.Process()
    size = 128 * 2**20
    hybrid_cfg = _hybrid_config(vllm_config, size)
    assert hybrid_cfg.needs_kv_cache_zeroing
    hybrid = _cache(profile_for("metal", "metal"), 4, [1, 3])
    before = proc.memory_info().rss
    hybrid.initialize(hybrid_cfg, KV_LAYOUT)
    grown = proc.memory_info().rss - before
    buf = hybrid.pool._buffer
    assert hybrid.reads_zero and not hybrid.zeroed
    assert grown < 16 * 2**20, f"a 128 MiB hybrid pool committed {grown / 2**20:.0f} MiB"
    assert int(torch.count_nonzero(buf)) == 0  # reading it commits nothing new either

    buf, _ = allocate_kv_cache(hybrid_cfg, KV_LAYOUT, zero=True)
    committed = proc.memory_info().rss - before
    assert committed > 0.9 * buf.numel(), f"eager fill of {buf.numel()} bytes: {committed}"
    del buf

    plain_cfg = _attention_config(vllm_config, 4, size)
    assert not plain_cfg.needs_kv_cache_zeroing
    plain = _cache(profile_for("metal", "metal"), 4, [], heads=3)
    before = proc.memory_info().rss
    plain.initialize(plain_cfg, KV_LAYOUT)
    grown = proc.memory_info().rss - before
    assert not plain.zeroed and plain.pool.nbytes >= size - 2**20
    assert grown < 16 * 2**20, f"an uninitialised 128 MiB pool committed {grown / 2**20:.0f} MiB"


# ----------------------------------------------------------------------------- import, writes
def test_hybrid_on_metal_is_served_from_vllms_pages(vllm_config, metal):
    """KVCache.initialize with a hybrid config: no refusal; attention and state pages are
    MLX arrays over vLLM's views (one aligned import of the whole buffer, after the wired and
    memory limits were prepared), written in place by the Metal kernels."""
    cfg = _hybrid_config(vllm_config, 32 * ATTN_PAGE)
    cache = _cache(profile_for("metal", "metal"), 4, [1, 3])
    cache.initialize(cfg, KV_LAYOUT)
    pool, store = cache.pool, cache.store
    assert pool.shared and pool.write_path == "metal_kernel" and store is not None
    buf = pool._buffer
    imports = [e for e in metal.events if e[0] == "import"]
    assert len(imports) == 1 and imports[0][1] == buf.data_ptr()
    assert imports[0][2] == buf.untyped_storage().nbytes()
    kinds = [e[0] for e in metal.events]
    assert kinds.index("wired_limit") < kinds.index("import")
    assert kinds.index("memory_limit") < kinds.index("import")
    assert ("memory_limit", 12 * 2**30 + buf.untyped_storage().nbytes()) in metal.events

    _, views = allocate_kv_cache(cfg, KV_LAYOUT, kernel_block_sizes={0: 16})  # the geometry
    assert pool.data_ptrs() == [v.data_ptr() for v in pool.torch_views]
    for i, pages in store.pages.items():
        view = views[recurrent_layer_name(i)]
        assert bridge.data_ptr(pages.pages) == buf.data_ptr() + (
            view.data_ptr() - views[recurrent_layer_name(i)].untyped_storage().data_ptr())
        assert pages.write_path == "metal_kernel"

    # A K/V write lands in vLLM's torch view of the layer, in place (slots of 16-token kernel
    # blocks; vLLM's block 1 of 48 tokens is kernel blocks 3..5, slots 48..95).
    keys = 1 + mx.arange(3 * HEADS * HEAD, dtype=mx.float32).reshape(3, HEADS, 1, HEAD)
    ptrs = pool.data_ptrs()
    pool.write(1, mx.array([5, 17, 50], dtype=mx.int32), keys, -keys)
    mx.eval(pool.arrays())
    assert pool.data_ptrs() == ptrs and ("write_kv", 3) in metal.events
    view = pool.torch_views[1]  # [kernel blocks, H, 16, 2D]
    for i, slot in enumerate((5, 17, 50)):
        np.testing.assert_array_equal(view[slot // 16, :, slot % 16, :HEAD].numpy(),
                                      np.array(keys[i, :, 0]))
        np.testing.assert_array_equal(view[slot // 16, :, slot % 16, HEAD:].numpy(),
                                      -np.array(keys[i, :, 0]))
    cache.zero_blocks([1])
    assert not view[3:6].any() and view[0:2].any()

    # A state write lands in the layer's pages of the torch buffer, in place.
    pages = store.pages[1]
    conv = mx.full((1, 3, 64), 2.5, dtype=mx.float32)
    ssm = mx.full((1, 2, 16, 16), -1.0, dtype=mx.float32)
    ptr = bridge.data_ptr(pages.pages)
    pages.write(mx.array([7], dtype=mx.int32), [conv, ssm])
    mx.eval(pages.pages)
    assert bridge.data_ptr(pages.pages) == ptr and ("write_rows", 1) in metal.events
    row = bridge.to_torch(pages.pages)[7]
    assert torch.all(row[:768].view(torch.float32) == 2.5)
    assert torch.all(row[768:768 + 2048].view(torch.float32) == -1.0)
    store.zero_block_ids([7])
    assert not bridge.to_torch(pages.pages)[7].any()


def test_offloading_connector_gets_vllms_views_on_metal(vllm_config, metal):
    cfg = _attention_config(vllm_config, 4, 4 * 2**20)
    cache = _cache(profile_for("metal", "metal"), 4, [], heads=3)
    cache.initialize(cfg, KV_LAYOUT)
    views = cache.connector_views()
    assert views is not None and list(views) == [layer_name(i) for i in range(4)]
    theirs = vllm_allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[KV_LAYOUT])
    for name, view in views.items():
        ref = theirs[name]
        assert (view.shape, view.stride(), view.storage_offset(), view.dtype) == (
            ref.shape, ref.stride(), ref.storage_offset(), ref.dtype)
    assert [v.data_ptr() for v in views.values()] == cache.pool.data_ptrs()


def test_pool_beyond_metals_largest_buffer_is_imported_in_aligned_chunks(vllm_config, metal):
    cfg = _attention_config(vllm_config, 6, 3 * 2**20)
    layer = cfg.kv_cache_tensors[0].layer_stride
    metal.max_buffer_length = 2 * layer + 2 * PAGE_ALIGN  # two layers (and a page) per buffer
    cache = _cache(profile_for("metal", "metal"), 6, [], heads=3)
    cache.initialize(cfg, KV_LAYOUT)
    imports = [e for e in metal.events if e[0] == "import"]
    assert len(imports) == 3
    assert all(n <= metal.max_buffer_length and ptr % APPLE_PAGE == 0 for _, ptr, n in imports)
    assert cache.pool.data_ptrs() == [v.data_ptr() for v in cache.pool.torch_views]
    metal.max_buffer_length = layer // 2  # one layer's view cannot be cut
    with pytest.raises(ValueError, match="max_buffer_length"):
        _cache(profile_for("metal", "metal"), 6, [], heads=3).initialize(cfg, KV_LAYOUT)


def test_unaligned_memory_is_refused_not_copied(metal):
    """The stand-in refuses what Metal refuses: an import from an unaligned storage raises
    (so the alignment checks above can fail)."""
    import mmap

    mapping = mmap.mmap(-1, 4 * APPLE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mapping, dtype=torch.float32, count=APPLE_PAGE // 4, offset=64)
    with pytest.raises(RuntimeError, match="refused"):
        import_views([t.view(16, -1)])


def test_adoption_caps_the_wired_limit_and_raises_the_memory_limit():
    calls = []

    class FakeMetal:
        def clear_cache(self):
            calls.append("clear")

        def get_active_memory(self):
            return 5 * 2**30

        def set_wired_limit(self, n):
            calls.append(("wired", n))
            return 8 * 2**30

        def get_memory_limit(self):
            return 12 * 2**30

        def set_memory_limit(self, n):
            calls.append(("memory", n))
            return 12 * 2**30

    wired.prepare_kv_adoption(FakeMetal(), 3 * 2**30, logging.getLogger("test"))
    cap = 5 * 2**30 + wired._METAL_HEAP_BYTES + wired._WIRED_SLACK_BYTES
    assert calls == ["clear", ("wired", cap), ("memory", 15 * 2**30)]

    calls.clear()  # never raise a lower limit (wiring never set: 0)
    FakeMetal.set_wired_limit = lambda self, n: calls.append(("wired", n)) or 0
    wired.prepare_kv_adoption(FakeMetal(), 2**30, logging.getLogger("test"))
    assert calls == ["clear", ("wired", cap), ("wired", 0), ("memory", 13 * 2**30)]


# --------------------------------------------------------------- CUDA keeps its refusals
def test_cuda_keeps_the_mlx_owned_pool_and_its_refusals(vllm_config):
    cuda = profile_for("cuda", "cuda")
    with pytest.raises(NotImplementedError, match="cannot be shared"):
        _cache(cuda, 4, [1, 3]).initialize(_hybrid_config(vllm_config, 32 * ATTN_PAGE),
                                           KV_LAYOUT)
    cache = _cache(cuda, 4, [], heads=3)
    cache.initialize(_attention_config(vllm_config, 4, 4 * 2**20), KV_LAYOUT)
    assert not cache.pool.shared and cache.pool.cuda_write and cache.connector_views() is None
    hooks = KVConnectorHooks(vllm_config)
    hooks.enabled = True
    with pytest.raises(RuntimeError, match="MLX-owned"):
        hooks.register(None, cache.connector_views(), lambda: None)
