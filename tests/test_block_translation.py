"""Block-size translation: a cache of vLLM's big attention blocks is viewed as small
kernel blocks without moving bytes, and block tables expand to match."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_unified import bridge
from vllm_unified.kv.attention.dispatch import paged_attention_kv
from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.block_translation import (
    expand_block_table,
    kernel_block_view,
    select_kernel_block_size,
)

CASES = [(b, k) for b in (16, 64, 144, 544) for k in (16, 32) if b % k == 0]


def test_cases_cover_the_hybrid_block_sizes():
    assert CASES == [(16, 16), (64, 16), (64, 32), (144, 16), (544, 16), (544, 32)]


@pytest.mark.parametrize(("block_size", "k"), CASES)
def test_torch_view_shares_memory(block_size, k):
    cache = torch.randn(5, block_size, 2, 8)
    view = kernel_block_view(cache, block_size, k)
    assert view.shape == (5 * block_size // k, k, 2, 8)
    assert view.data_ptr() == cache.data_ptr()
    view[3, 1] = 7.0  # a write through the view is a write to the cache
    r = block_size // k
    assert torch.equal(cache[3 // r, (3 % r) * k + 1], torch.full((2, 8), 7.0))
    assert torch.equal(view.reshape(cache.shape), cache)


@pytest.mark.parametrize(("block_size", "k"), CASES)
def test_mlx_view_shares_memory(block_size, k):
    t = torch.randn(4, block_size, 2, 8)
    cache = bridge.to_mlx(t)  # adopted torch memory, as the KV pool is
    view = kernel_block_view(cache, block_size, k)
    assert view.shape == (4 * block_size // k, k, 2, 8)
    assert bridge.data_ptr(view) == bridge.data_ptr(cache) == t.data_ptr()
    np.testing.assert_array_equal(np.array(view).reshape(t.shape), t.numpy())


@pytest.mark.parametrize(("block_size", "k"), CASES)
def test_expand_block_table_with_padded_rows(block_size, k):
    r = block_size // k
    table = np.array([[3, 1, 4], [5, 9, 0], [0, 0, 0]], dtype=np.int32)  # row 2: spare row
    out = expand_block_table(table, r, num_blocks=[3, 2], pad=-1)
    assert out.shape == (3, 3 * r) and out.dtype == np.int32
    for i, n in enumerate([3, 2, 0]):
        for c in range(3):
            for j in range(r):
                want = table[i, c] * r + j if c < n else -1
                assert out[i, c * r + j] == want
    # Without counts every entry is real (vLLM's own convention: padding 0 -> kernel blocks
    # of the null block 0 .. r-1, never read past a sequence's length).
    np.testing.assert_array_equal(
        expand_block_table(table, r), (table[:, :, None] * r + np.arange(r)).reshape(3, -1)
    )


@pytest.mark.parametrize(("block_size", "k"), CASES)
def test_slots_are_unchanged_by_translation(block_size, k):
    """Every token's slot (block * size + offset) is the same in both block sizes, so the
    expanded table addresses exactly the bytes vLLM's table does."""
    r = block_size // k
    table = np.array([[7, 2, 5]])
    pos = np.arange(3 * block_size)
    big = table[0, pos // block_size] * block_size + pos % block_size
    small_table = expand_block_table(table, r)
    small = small_table[0, pos // k] * k + pos % k
    np.testing.assert_array_equal(big, small)


@pytest.mark.parametrize(("block_size", "k"), [(144, 16), (544, 32)])
def test_attention_through_translation_equals_big_blocks(block_size, k):
    """Paged attention over the kernel-block view with the expanded table gives the same
    output as over vLLM's blocks directly (prefill chunk + decode rows)."""
    rng = np.random.default_rng(0)
    num_blocks, heads, kv_heads, d = 4, 4, 2, 16
    pool = mx.array(rng.standard_normal((num_blocks * block_size, kv_heads, 2 * d)),
                    dtype=mx.float32)
    table = np.array([[2, 1, 0], [3, 0, 0]], dtype=np.int32)
    qlens, slens = [5, 1], [block_size + 7, 40]
    q = mx.array(rng.standard_normal((sum(qlens), heads, 1, d)), dtype=mx.float32)
    ref = paged_attention_kv(q, pool, build_attention_metadata(qlens, slens, table, block_size),
                             d**-0.5)
    small = kernel_block_view(pool.reshape(num_blocks, block_size, kv_heads, 2 * d),
                              block_size, k).reshape(-1, kv_heads, 2 * d)
    meta = build_attention_metadata(
        qlens, slens, expand_block_table(table, block_size // k, num_blocks=[2, 1]), k
    )
    out = paged_attention_kv(q, small, meta, d**-0.5)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-6, atol=1e-6)


def test_vllm_kernel_block_views_are_ours():
    """vLLM's own create_kv_cache_views(kernel_block_size=k) is the same memory as the view
    of its manager-block view (what the runner allocates through)."""
    from vllm_unified import compat
    from vllm_unified.kv.allocation import KV_LAYOUT, slot_major

    block_size, k, num_blocks = 144, 16, 3
    spec = compat.FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                                    dtype=torch.float32)
    page = spec.page_size_bytes
    tensor = compat.KVCacheTensor(size=page * num_blocks, layers=["l0"],
                                  layer_stride=page * num_blocks, block_stride=page)
    buf = torch.empty(tensor.size, dtype=torch.int8)
    layout = compat.KVCacheLayout[KV_LAYOUT]
    big = compat.create_kv_cache_views(buf, spec, num_blocks, layout, tensor)[0]
    small = compat.create_kv_cache_views(buf, spec, num_blocks, layout, tensor,
                                         kernel_block_size=k)[0]
    assert small.shape == (num_blocks * block_size // k, 2, k, 16)
    assert small.data_ptr() == big.data_ptr() == buf.data_ptr()
    assert slot_major(small).data_ptr() == slot_major(big).data_ptr()
    big.copy_(torch.randn(big.shape))
    assert torch.equal(slot_major(small), slot_major(big))


@pytest.mark.parametrize("bad", [8, 24, 100])
def test_block_size_no_kernel_divides_is_rejected(bad):
    with pytest.raises(ValueError, match=rf"--block-size {bad}:"):
        select_kernel_block_size(bad, (16, 32, 64))


def test_kernel_block_choice():
    assert select_kernel_block_size(16, (16, 32, 64)) == 16
    assert select_kernel_block_size(144, (16, 32, 64)) == 16
    assert select_kernel_block_size(544, (16, 32, 64)) == 32
    assert select_kernel_block_size(1024, (16, 32, 64)) == 64
