"""KV writes never copy the pool: pointers stay put across prefill and decode, and a decode
step's cost does not grow with the pool's size (MLX silently copies a whole array on a slice
write when anything else references its buffer; DESIGN.md "Writing the KV cache is the trap")."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from vllm_unified.attention.metadata import build_attention_metadata
from vllm_unified.models.paged_cache import KVPool, PagedLayerCache, install_paged_attention
from vllm_unified.worker.model_runner import forward

BLOCK = 16
ARGS = llama.ModelArgs(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
    head_dim=64, tie_word_embeddings=True,
)
# bytes per slot: K and V x 2 layers x 2 kv heads x 64 x 4 bytes
SLOT_BYTES = 2 * ARGS.num_hidden_layers * ARGS.num_key_value_heads * ARGS.head_dim * 4


def _model():
    mx.random.seed(0)
    model = llama.Model(ARGS)
    mx.eval(model.parameters())
    install_paged_attention(model)
    return model


def _step(model, pool, caches, query_lens, seq_lens, tables):
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK)
    pool.meta = meta
    ids = mx.array(np.arange(sum(query_lens), dtype=np.int32) % ARGS.vocab_size)
    last = (np.cumsum(query_lens) - 1).astype(np.int32)
    logits = forward(model, caches, ids, last)
    mx.eval(logits, pool.k, pool.v)
    pool.meta = None
    return logits


def _decode_times(model, pool_bytes: int, steps: int = 15) -> tuple[list[float], bool]:
    num_blocks = pool_bytes // (SLOT_BYTES * BLOCK)
    pool = KVPool(ARGS.num_hidden_layers, num_blocks, BLOCK, ARGS.num_key_value_heads,
                  ARGS.head_dim, mx.float32)
    caches = [PagedLayerCache(pool, i) for i in range(ARGS.num_hidden_layers)]
    # 4 sequences, 64-token prompts, blocks spread over the whole pool
    tables = np.stack([np.array([1 + i, num_blocks // 2 + i, num_blocks - 8 + i,
                                 num_blocks - 4 + i, 10 + i], dtype=np.int32) for i in range(4)])
    ptrs = pool.data_ptrs()
    _step(model, pool, caches, [64] * 4, [64] * 4, tables)
    times = []
    for t in range(steps):
        start = time.perf_counter()
        _step(model, pool, caches, [1] * 4, [65 + t] * 4, tables)
        times.append(time.perf_counter() - start)
    same = pool.data_ptrs() == ptrs
    del pool, caches
    return times, same


def test_pool_pointers_stable_and_decode_cost_independent_of_pool_size():
    model = _model()
    small, small_same = _decode_times(model, 256 * 2**20)
    large, large_same = _decode_times(model, 2 * 2**30)
    assert small_same and large_same, "a KV write moved the pool to a new buffer"
    ratio = statistics.median(large) / statistics.median(small)
    assert ratio <= 1.5, (
        f"decode step with a 2 GiB pool took {ratio:.2f}x the 256 MiB one "
        f"({statistics.median(large) * 1e3:.2f} ms vs {statistics.median(small) * 1e3:.2f} ms)"
    )


def test_outside_reference_forces_a_copy_the_guard_would_see():
    """Control: holding a second reference to the pool array defeats donation, so the pointer
    check above is able to fail."""
    model = _model()
    pool = KVPool(ARGS.num_hidden_layers, 64, BLOCK, ARGS.num_key_value_heads, ARGS.head_dim,
                  mx.float32)
    caches = [PagedLayerCache(pool, i) for i in range(ARGS.num_hidden_layers)]
    ptrs = pool.data_ptrs()
    held = [a.reshape(-1) for a in pool.k]  # views sharing the buffer, like a torch view
    mx.eval(held)
    _step(model, pool, caches, [8], [8], np.array([[3]], dtype=np.int32))
    assert pool.data_ptrs() != ptrs
    del held


def test_pool_pages_committed_only_when_written():
    """Start-up RSS does not grow with the pool: the zero fill's pages are handed back, and a
    written block commits only its own pages."""
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    pool = KVPool(ARGS.num_hidden_layers, (2 * 2**30) // (SLOT_BYTES * BLOCK), BLOCK,
                  ARGS.num_key_value_heads, ARGS.head_dim, mx.float32)
    grown = proc.memory_info().rss - before
    assert pool.nbytes >= 2 * 2**30 - 2**20
    assert pool.released_bytes >= pool.nbytes - 16 * 2**20
    assert grown < 128 * 2**20, f"a 2 GiB pool made RSS grow by {grown / 2**20:.0f} MiB"
    model = _model()
    caches = [PagedLayerCache(pool, i) for i in range(ARGS.num_hidden_layers)]
    ptrs = pool.data_ptrs()
    logits = _step(model, pool, caches, [32], [32], np.array([[5, 9000]], dtype=np.int32))
    assert pool.data_ptrs() == ptrs
    assert np.isfinite(np.array(logits)).all()
    # the written rows hold K/V, everything else still reads as zeros
    k0 = np.array(pool.k[0][5 * BLOCK:5 * BLOCK + 16])
    assert np.abs(k0).sum() > 0
    assert not np.array(pool.k[0][100 * BLOCK:101 * BLOCK]).any()
