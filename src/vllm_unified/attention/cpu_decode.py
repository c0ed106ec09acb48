"""Decode attention straight from the paged pool on MLX's CPU backend (an optional accelerator).

The pure-MLX reference (:mod:`vllm_unified.attention.paged`) gathers every decode sequence's
keys and values into ``[Bd, Hkv, S, D]`` arrays per layer and step and runs MLX's SDPA over
them; on the CPU backend that SDPA is unfused (a batched matmul per head, a softmax whose
``exp`` MLX 0.32.4 evaluates one element at a time, a second matmul), and at 16 sequences of
192 tokens it took ~1.2 ms per layer. The native ``paged_decode`` primitive
(``native/src/native.cpp``, loops in ``native/src/cpu_math.cpp``) reads each key and value row
once where it lies in the pool, through the block table, computes all query heads of a KV head
together and takes ``exp`` through glibc's vector math library: ~0.3 ms for the same layer.
It computes the reference's function (keys ``first ... seq_len - 1``, ``first`` from the sliding
window; fp32 softmax with the maximum subtracted), which ``tests/test_cpu_kernels.py`` checks
against the reference for fp32, fp16 and bf16 pools, with and without a window.
"""

from __future__ import annotations

import mlx.core as mx

from vllm_unified import bridge
from vllm_unified.attention.metadata import AttentionMetadata, Window


def available() -> bool:
    """The kernel applies: the native extension is importable and the default device is the
    CPU (the primitive has no GPU implementation)."""
    return bridge.native_kernels() is not None


def paged_decode_attention(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: Window,
) -> mx.array:
    """Decode rows' attention over ``kv_pool`` (``[slots, Hkv, 2 * D]``, K then V per cell).

    Args:
        queries: ``[Bd, H, 1, D]`` decode queries (RoPE'd), in the pool's dtype (fp32, fp16 or
            bf16).
        kv_pool: one layer's pool, row-contiguous (read in place, never copied).
        meta: the step's metadata (its decode rows' block tables and lengths).
        scale: score multiplier.
        window: sliding window in tokens or None.

    Returns:
        ``[Bd, H, 1, D]`` in the queries' dtype, lazily.

    Raises:
        RuntimeError: the native extension is unavailable (check :func:`available` first).
        ValueError / TypeError: shapes or dtypes the primitive does not take; an out-of-range
            block id raises from the ``mx.eval`` that runs it.
    """
    native = bridge.native_kernels()
    if native is None:
        raise RuntimeError("the native CPU decode kernel is unavailable (see bridge.native_error)")
    bd, heads, _, dim = queries.shape
    tables, lens = meta.decode_tables_lens()
    out = native.paged_decode(queries.reshape(bd, heads, dim), kv_pool, tables, lens, scale,
                              meta.block_size, window or 0)
    return out.reshape(bd, heads, 1, dim)
