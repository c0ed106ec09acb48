"""Write KV rows into an MLX-owned pool in place on the CUDA backend.

MLX's scatter (``pool[slots] = rows``) donates its input buffer on the CPU backend, but on MLX
0.32.4's CUDA backend it copies the whole pool first: on the H200, writing 64 rows into a
32 GiB pool took 17.5 ms, the time of one full copy (17.7 ms). Per layer and step that would
be a copy of the layer's whole pool. Instead, a small ``mx.fast.cuda_kernel`` writes the rows
straight into the buffer of its ``pool`` input and returns a one-element token; the pool array
handed on is ``mx.depends(pool, token)``, which shares the pool's buffer, so every reader of
the cache (the attention of this step, the write of the next) takes the token as an input and
MLX orders it after the write (DESIGN.md, "Writing the KV cache is the trap"). MLX's value
semantics are bypassed on purpose, exactly as the CPU backend's native ``write_rows`` does.
"""

from __future__ import annotations

import functools

import mlx.core as mx

_SOURCE = """
    const long long i = (long long)cg::this_grid().thread_rank();
    const long long total = (long long)rows_shape[0] * ROW;
    if (i < total) {
        const long long t = i / ROW;
        const long long c = i - t * ROW;
        const long long slot = (long long)slots[t];
        const_cast<T*>(pool)[slot * ROW + c] = rows[i];
    }
    if (i == 0) {
        done[0] = 1;
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="vllm_unified_write_kv_rows",
        input_names=["pool", "slots", "rows"],
        output_names=["done"],
        source=_SOURCE,
    )


def _threads_per_block(row: int) -> int:
    """The largest power of two <= 256 dividing ``row`` (the grid then has no idle tail)."""
    tpb = 256
    while row % tpb:
        tpb //= 2
    return tpb


def write_rows_cuda(pool: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """Write ``rows`` at ``slots`` into ``pool``'s own buffer (lazy, in place).

    Args:
        pool: ``[num_slots, Hkv, C]`` row-contiguous MLX-owned pool (one layer).
        slots: ``[T]`` int32 distinct slots in ``[0, num_slots)`` (not bounds-checked).
        rows: ``[T, Hkv, C]`` in the pool's dtype.

    Returns:
        The pool to use from now on: the same buffer, ordered after the write.

    Raises:
        ValueError: shapes or dtypes disagree.
    """
    if rows.shape[1:] != pool.shape[1:] or rows.dtype != pool.dtype:
        raise ValueError(f"rows {rows.shape} {rows.dtype} do not fit pool rows "
                         f"{pool.shape[1:]} {pool.dtype}")
    if slots.shape != (rows.shape[0],):
        raise ValueError(f"slots shape {slots.shape} != ({rows.shape[0]},)")
    if rows.shape[0] == 0:
        return pool
    row = pool.shape[1] * pool.shape[2]
    done = _kernel()(
        inputs=[pool, slots if slots.dtype == mx.int32 else slots.astype(mx.int32), rows],
        template=[("T", pool.dtype), ("ROW", row)],
        grid=(rows.shape[0] * row, 1, 1),
        threadgroup=(_threads_per_block(row), 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )[0]
    return mx.depends([pool], [done])[0]
