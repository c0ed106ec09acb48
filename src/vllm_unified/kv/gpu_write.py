"""Write KV rows into an MLX-owned pool in place on the CUDA backend.

MLX's scatter (``pool[slots] = rows``) donates its input buffer on the CPU backend, but on MLX
0.32.4's CUDA backend it copies the whole pool first (a write of a few rows costs the time of one
full copy; docs/benchmarking.md): per layer and step, a copy of the layer's whole pool. Instead, a
small ``mx.fast.cuda_kernel`` writes the rows straight into the buffer of its ``pool`` input and
returns a one-element token; the pool array handed on is ``mx.depends(pool, token)``, which shares
the pool's buffer, so every reader of the cache (the attention of this step, the write of the next)
takes the token as an input and MLX orders it after the write (docs/internals.md, "KV writes stay in
place"). MLX's value semantics are bypassed on purpose, exactly as the CPU backend's native
``write_rows`` does.

The kernel takes the keys and the values as they come out of the layer and puts each head's
key and value side by side in its (slot, head) cell itself, so no ``[T, Hkv, 2 * D]``
concatenation is built per layer and step (two copy kernels fewer per layer on CUDA).
"""

from __future__ import annotations

import functools

import mlx.core as mx

_SOURCE = """
    const long long i = (long long)cg::this_grid().thread_rank();
    const long long total = (long long)keys_shape[0] * HKV * 2 * D;
    if (i < total) {
        const long long cell = i / (2 * D);  // t * HKV + h
        const long long c = i - cell * (2 * D);
        const long long t = cell / HKV;
        const long long h = cell - t * HKV;
        const long long slot = (long long)slots[t];
        const T x = c < D ? keys[cell * D + c] : values[cell * D + c - D];
        const_cast<T*>(pool)[(slot * HKV + h) * (2 * D) + c] = x;
    }
    if (i == 0) {
        done[0] = 1;
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="vllm_unified_write_kv",
        input_names=["pool", "slots", "keys", "values"],
        output_names=["done"],
        source=_SOURCE,
    )


def _threads_per_block(row: int) -> int:
    """The largest power of two <= 256 dividing ``row`` (the grid then has no idle tail)."""
    tpb = 256
    while row % tpb:
        tpb //= 2
    return tpb


def _cell(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """``(Hkv, D)`` of ``[T, Hkv, D]`` or ``[T, Hkv, 1, D]`` rows (the same bytes: the kernel
    reads either as it is, with no reshape op in the graph); None for any other shape."""
    if len(shape) == 3:
        return shape[1:]
    if len(shape) == 4 and shape[2] == 1:
        return shape[1], shape[3]
    return None


def write_kv_cuda(pool: mx.array, slots: mx.array, keys: mx.array, values: mx.array
                  ) -> mx.array:
    """Write ``keys``/``values`` at ``slots`` into ``pool``'s own buffer (lazy, in place).

    Args:
        pool: ``[num_slots, Hkv, 2 * D]`` row-contiguous MLX-owned pool (one layer), each
            (slot, head) cell holding the key then the value.
        slots: ``[T]`` int32 distinct slots in ``[0, num_slots)`` (not bounds-checked).
        keys, values: ``[T, Hkv, D]`` or ``[T, Hkv, 1, D]`` in the pool's dtype (the kernel
            reads them row-contiguous; MLX copies a strided input first).

    Returns:
        The pool to use from now on: the same buffer, ordered after the write.

    Raises:
        ValueError: shapes or dtypes disagree.
    """
    num_slots, kv_heads, width = pool.shape
    for name, rows in (("keys", keys), ("values", values)):
        if _cell(tuple(rows.shape)) != (kv_heads, width // 2) or rows.dtype != pool.dtype:
            raise ValueError(f"{name} {rows.shape} {rows.dtype} do not fit pool rows "
                             f"{pool.shape[1:]} {pool.dtype}")
    if values.shape != keys.shape:
        raise ValueError(f"values {values.shape} != keys {keys.shape}")
    if slots.shape != (keys.shape[0],):
        raise ValueError(f"slots shape {slots.shape} != ({keys.shape[0]},)")
    if keys.shape[0] == 0:
        return pool
    row = kv_heads * width
    done = _kernel()(
        inputs=[pool, slots if slots.dtype == mx.int32 else slots.astype(mx.int32), keys,
                values],
        template=[("T", pool.dtype), ("HKV", kv_heads), ("D", width // 2)],
        grid=(keys.shape[0] * row, 1, 1),
        threadgroup=(_threads_per_block(row), 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )[0]
    return mx.depends([pool], [done])[0]
