"""KV writes never copy the pool: pointers stay put across prefill and decode, and a decode
step allocates no pool-sized buffer, however large the pool (MLX silently copies a whole array
on a slice write when anything else references its buffer; docs/dev/architecture.md, "KV writes stay
in place"). Measured by MLX's allocator (peak memory), not by time.

Both pool kinds are covered: the torch buffer in vLLM's layout adopted by MLX (what the CPU
backend uses, written through the native ``write_rows``), and the MLX-owned pool (GPU
backends, written by a donating scatter)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import psutil
import pytest
import torch
from mlx_lm.models import llama

from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.layer_cache import PagedLayerCache
from vllm_unified.kv.pool import KVPool
from vllm_unified.models.routing import install_paged_attention
from vllm_unified.worker.forward import forward

BLOCK = 16
ARGS = llama.ModelArgs(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
    head_dim=64, tie_word_embeddings=True,
)
KV_HEADS, DIM, LAYERS = ARGS.num_key_value_heads, ARGS.head_dim, ARGS.num_hidden_layers
# bytes per slot: K and V x layers x kv heads x head dim x 4 bytes
SLOT_BYTES = 2 * LAYERS * KV_HEADS * DIM * 4


def _torch_pool(num_blocks: int) -> KVPool:
    """Uninitialised torch buffer with one [B, H, N, 2D] LBNHC view per layer, as
    ``kv.allocation.allocate_kv_cache`` makes them."""
    layer_elems = num_blocks * BLOCK * KV_HEADS * 2 * DIM
    buf = torch.empty(LAYERS * layer_elems, dtype=torch.float32)
    views = [buf[i * layer_elems:(i + 1) * layer_elems]
             .view(num_blocks, BLOCK, KV_HEADS, 2 * DIM).permute(0, 2, 1, 3)
             for i in range(LAYERS)]
    return KVPool.from_torch_views(views, BLOCK, buf)


def _mlx_pool(num_blocks: int) -> KVPool:
    return KVPool.allocate_mlx(LAYERS, num_blocks, BLOCK, KV_HEADS, DIM, mx.float32)


POOLS = {"torch-shared": _torch_pool, "mlx-owned": _mlx_pool}


def _model():
    mx.random.seed(0)
    model = llama.Model(ARGS)
    mx.eval(model.parameters())
    install_paged_attention(model)
    return model


def _step(model, pool, caches, query_lens, seq_lens, tables):
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK)
    ids = mx.array(np.arange(sum(query_lens), dtype=np.int32) % ARGS.vocab_size)
    last = (np.cumsum(query_lens) - 1).astype(np.int32)
    with set_step_context(StepContext(attn=meta)):
        logits = forward(model, caches, ids, last)
    mx.eval(logits, pool.arrays())
    return logits


def _decode_peaks(model, make_pool, pool_bytes: int, steps: int = 4):
    """Prefill 4 sequences whose blocks are spread over the pool, then decode ``steps`` steps.

    Returns (largest MLX peak-memory rise of a decode step in bytes, pointers unchanged, last
    logits)."""
    num_blocks = pool_bytes // (SLOT_BYTES * BLOCK)
    pool = make_pool(num_blocks)
    caches = [PagedLayerCache(pool, i) for i in range(LAYERS)]
    tables = np.stack([np.array([1 + i, num_blocks // 2 + i, num_blocks - 8 + i,
                                 num_blocks - 4 + i, 10 + i], dtype=np.int32) for i in range(4)])
    ptrs = pool.data_ptrs()
    torch_ptrs = [v.data_ptr() for v in pool.torch_views or []]
    logits = _step(model, pool, caches, [64] * 4, [64] * 4, tables)
    rise = 0
    for t in range(steps):
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        logits = _step(model, pool, caches, [1] * 4, [65 + t] * 4, tables)
        rise = max(rise, mx.get_peak_memory() - base)
    same = pool.data_ptrs() == ptrs and (not torch_ptrs or torch_ptrs == ptrs)
    out = np.array(logits)
    del pool, caches
    return rise, same, out


@pytest.mark.parametrize("kind", POOLS)
def test_pool_pointers_stable_and_decode_allocates_no_pool_copy(kind):
    """A decode step's MLX allocations stay far below one layer of the pool (a copying write
    would allocate a whole layer, 1 GiB here) and do not grow with the pool's size."""
    model = _model()
    small, small_same, small_out = _decode_peaks(model, POOLS[kind], 256 * 2**20)
    large, large_same, large_out = _decode_peaks(model, POOLS[kind], 2 * 2**30)
    assert small_same and large_same, "a KV write moved the pool to a new buffer"
    np.testing.assert_allclose(small_out, large_out, rtol=1e-5, atol=1e-5)
    layer_bytes = 2 * 2**30 // LAYERS
    assert large < layer_bytes // 64, (
        f"a decode step over a 2 GiB pool allocated {large / 2**20:.1f} MiB at its peak")
    assert large <= small + 2**20, (
        f"decode step peak grew with the pool: {small / 2**20:.2f} MiB (256 MiB pool) vs "
        f"{large / 2**20:.2f} MiB (2 GiB pool)")


def test_shared_and_mlx_owned_pools_agree():
    model = _model()
    tables = np.array([[3, 5], [7, 2]], dtype=np.int32)
    outs = []
    for make in POOLS.values():
        pool = make(16)
        caches = [PagedLayerCache(pool, i) for i in range(LAYERS)]
        _step(model, pool, caches, [20, 9], [20, 9], tables)
        outs.append(np.array(_step(model, pool, caches, [1, 1], [21, 10], tables)))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_torch_views_see_mlx_writes():
    """The rows attention wrote are in vLLM's torch view of the cache, K then V per head."""
    model = _model()
    pool = _torch_pool(16)
    caches = [PagedLayerCache(pool, i) for i in range(LAYERS)]
    _step(model, pool, caches, [5], [5], np.array([[4]], dtype=np.int32))
    view = pool.torch_views[0]  # [B, H, N, 2D]
    written = view[4, :, :5, :]
    assert torch.count_nonzero(written) > 0
    np.testing.assert_array_equal(np.array(pool.kv[0][4 * BLOCK:4 * BLOCK + 5]),
                                  written.permute(1, 0, 2).numpy())


def test_outside_reference_forces_a_copy_the_guard_would_see():
    """Control: a second view holding the MLX-owned pool's buffer defeats donation, so the
    pointer checks above are able to fail."""
    model = _model()
    pool = _mlx_pool(64)
    caches = [PagedLayerCache(pool, i) for i in range(LAYERS)]
    ptrs = pool.data_ptrs()
    held = [a.reshape(-1) for a in pool.kv]  # views sharing the buffer, like a torch view
    mx.eval(held)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    _step(model, pool, caches, [8], [8], np.array([[3]], dtype=np.int32))
    assert pool.data_ptrs() != ptrs
    # ... and the copy shows in MLX's peak memory, which the test above bounds.
    assert mx.get_peak_memory() - base >= pool.kv[0].nbytes
    del held


@pytest.mark.parametrize("kind", POOLS)
def test_pool_pages_committed_only_when_written(kind):
    """Start-up RSS does not grow with the pool, and a written block commits only its pages."""
    proc = psutil.Process()
    before = proc.memory_info().rss
    pool = POOLS[kind]((2 * 2**30) // (SLOT_BYTES * BLOCK))
    grown = proc.memory_info().rss - before
    assert pool.nbytes >= 2 * 2**30 - 2**20
    assert grown < 128 * 2**20, f"a 2 GiB pool made RSS grow by {grown / 2**20:.0f} MiB"
    model = _model()
    caches = [PagedLayerCache(pool, i) for i in range(LAYERS)]
    ptrs = pool.data_ptrs()
    logits = _step(model, pool, caches, [32], [32], np.array([[5, 9000]], dtype=np.int32))
    assert pool.data_ptrs() == ptrs
    assert np.isfinite(np.array(logits)).all()
    assert np.abs(np.array(pool.kv[0][5 * BLOCK:5 * BLOCK + 16])).sum() > 0
