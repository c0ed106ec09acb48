"""Write rows into MLX arrays in place on MLX's GPU backends (CUDA and Metal).

MLX's scatter (``pool[slots] = rows``) donates its input buffer on the CPU backend, but on MLX
0.32.4's CUDA backend it copies the whole pool first (a write of a few rows costs the time of one
full copy; benchmarks/results/HISTORY.md): per layer and step, a copy of the layer's whole pool.
Instead, a small GPU kernel writes the rows straight into the buffer of its destination input and
returns a one-element token; the array handed on is ``mx.depends(dst, token)``, which shares the
destination's buffer and orders MLX's evaluation after the write. Inside one evaluation the GPU does
not see that order (it orders kernels by the buffers they output, and the write outputs only its
token), so a kernel that reads the written buffer in the same evaluation takes the token itself as
an input (:func:`ordered_after`; the paged attention kernels' ``after``); later evaluations run
after it on CUDA's one stream (docs/dev/architecture.md, "KV writes stay in place").
MLX's value semantics are bypassed on purpose, exactly as the CPU backend's native
``write_rows`` does.

Each kernel is one body for both dialects (:mod:`vllm_unified.gpu_dialect`): ``dialect="cuda"``
instantiates ``mx.fast.cuda_kernel``, ``dialect="metal"`` ``mx.fast.metal_kernel``.

* :func:`write_kv_gpu`: the KV pool write. It takes the keys and the values as they come out of
  the layer and puts each head's key and value side by side in its (slot, head) cell itself, so
  no ``[T, Hkv, 2 * D]`` concatenation is built per layer and step.
* :func:`write_kv_qk_gpu`: the same write of raw key projections, each key head normalised and
  rotated by the kernel first (:mod:`vllm_unified.kv.attention.qk_prologue`).
* :func:`write_rows_gpu`: rows of any width into ``[R, *row]`` (state pages of hybrid models,
  block zeroing).

A destination must be an MLX array whose buffer is row-contiguous (MLX copies a strided kernel
input first, and the write would land in that copy): a pool allocated by MLX (CUDA), or on Metal
a layer view of the torch KV buffer MLX adopted (:func:`vllm_unified.kv.allocation.import_views`:
a Metal buffer over the torch memory, so the write lands in vLLM's views). On Metal it
must also hold at least 8 elements: MLX passes smaller inputs in the ``constant`` address
space, which cannot be written.
"""

from __future__ import annotations

import math

import mlx.core as mx

from vllm_unified import gpu_dialect
from vllm_unified.gpu_dialect import Dialect
from vllm_unified.kv.attention.qk_prologue import QKPrologue, prologue_code

#: one-source body of the KV write: thread i writes element c of cell (t, h) of the pool
WRITE_KV_SOURCE = gpu_dialect.kernel_file(__package__, "write_kv.inc")

#: one-source body of the row write: thread i writes element e of source row r; rows whose
#: index is outside [0, R) are skipped
WRITE_ROWS_SOURCE = gpu_dialect.kernel_file(__package__, "write_rows.inc")

#: one-source body of the KV write with the key prologue: SIMD group c handles cell c (token
#: t, KV head h), lane l channels l * EPL ... of the head; the key is normalised and rotated
#: at ``positions[t]`` (:mod:`vllm_unified.kv.attention.qk_prologue`) and stored next to the
#: value. Keys and values are read as ``[T, HKV * D]`` rows (any shape with those bytes).
WRITE_KV_QK_SOURCE = gpu_dialect.render(gpu_dialect.kernel_file(__package__, "write_kv_qk.inc"),
                                        PROLOGUE=prologue_code("kx", 1, "positions[t]"))

#: kernel name, input names, output names
WRITE_KV_KERNEL = ("vllm_unified_write_kv", ("pool", "slots", "keys", "values"), ("done",))
WRITE_KV_QK_KERNEL = ("vllm_unified_write_kv_qk",
                      ("pool", "slots", "keys", "values", "positions", "qkp"), ("done",))
WRITE_ROWS_KERNEL = ("vllm_unified_write_rows", ("dst", "row_idx", "src"), ("done",))

_MAX_GRID = 2**31 - 1  # MLX takes the grid as C ints
_ROWS_GROUP = 256


def _kernel(spec: tuple[str, tuple[str, ...], tuple[str, ...]], source: str, dialect: Dialect):
    return gpu_dialect.kernel(*spec, source, dialect=dialect)


def ordered_after(dst: mx.array, done: mx.array, tokens: list[mx.array] | None) -> mx.array:
    """``dst`` as readers must take it after a kernel wrote into its buffer and returned
    ``done``: ``mx.depends(dst, done)``, and ``done`` appended to ``tokens`` (when given).

    Why both: ``mx.depends`` orders MLX's evaluation, but inside one command buffer MLX's GPU
    encoders order kernels by buffers, an edge from the kernel that last *output* a buffer to
    each kernel that reads it (CUDA: the graph edges of ``CommandEncoder::
    insert_graph_dependencies``; Metal: the barriers of its concurrent encoder); ``Depends``
    launches nothing and the write kernel only *reads* ``dst`` as far as MLX knows. A GPU
    kernel that reads the written buffer in the same evaluation must take ``done`` as an
    input of its own (the paged attention kernels' ``after``); an MLX op must read something
    computed from ``done`` (:func:`vllm_unified.kv.attention.reference.after_token`)."""
    if tokens is not None:
        tokens.append(done)
    return mx.depends([dst], [done])[0]


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


def _check_destination(dst: mx.array, dialect: Dialect, grid: int) -> None:
    if dialect not in gpu_dialect.DIALECTS:
        raise ValueError(f"unknown GPU dialect {dialect!r} (expected one of "
                         f"{gpu_dialect.DIALECTS})")
    if dialect == "metal" and dst.size < 8:
        raise ValueError(f"destination of {dst.size} elements: Metal passes inputs under 8 "
                         "elements in the constant address space, which cannot be written")
    if grid > _MAX_GRID:
        raise ValueError(f"write of {grid} elements exceeds one kernel's grid ({_MAX_GRID})")


def _int32(x: mx.array) -> mx.array:
    """``x`` as int32 (the kernels' index type), cast only when it is another type."""
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def write_kv_launch(pool: mx.array, slots: mx.array, keys: mx.array, values: mx.array
                    ) -> dict:
    """The keyword arguments of the KV write kernel's call for these arrays (shared by
    :func:`write_kv_gpu` and the Metal emulation tests): ``inputs``, ``template``, ``grid``,
    ``threadgroup``, ``output_shapes``, ``output_dtypes``. No checks."""
    kv_heads, width = pool.shape[1], pool.shape[2]
    row = kv_heads * width
    return dict(
        inputs=[pool, _int32(slots), keys, values],
        template=[("T", pool.dtype), ("HKV", kv_heads), ("D", width // 2)],
        grid=(keys.shape[0] * row, 1, 1),
        threadgroup=(_threads_per_block(row), 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )


def write_kv_gpu(pool: mx.array, slots: mx.array, keys: mx.array, values: mx.array, *,
                 dialect: Dialect, tokens: list[mx.array] | None = None) -> mx.array:
    """Write ``keys``/``values`` at ``slots`` into ``pool``'s own buffer (lazy, in place).

    Args:
        pool: ``[num_slots, Hkv, 2 * D]`` row-contiguous pool (one layer; MLX-owned, or
            adopted torch memory on Metal), each (slot, head) cell holding the key then the
            value.
        slots: ``[T]`` integer distinct slots in ``[0, num_slots)`` (not bounds-checked; cast
            to int32 when another integer type).
        keys, values: ``[T, Hkv, D]`` or ``[T, Hkv, 1, D]`` in the pool's dtype (the kernel
            reads them row-contiguous; MLX copies a strided input first).
        dialect: ``"cuda"`` or ``"metal"``, the backend the kernel runs on.
        tokens: receives the write's completion token (:func:`ordered_after`: what a kernel
            reading the pool in the same evaluation takes as an input).

    Returns:
        The pool to use from now on: the same buffer, ordered after the write.

    Raises:
        ValueError: shapes or dtypes disagree, unknown dialect, a Metal pool under 8
            elements, or more than 2**31 - 1 elements to write.
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
    _check_destination(pool, dialect, keys.shape[0] * kv_heads * width)
    if keys.shape[0] == 0:
        return pool
    done = _kernel(WRITE_KV_KERNEL, WRITE_KV_SOURCE, dialect)(
        **write_kv_launch(pool, slots, keys, values))[0]
    return ordered_after(pool, done, tokens)


#: threads per group of the prologue write (8 cells)
_QK_GROUP = 256


def write_kv_qk_launch(pool: mx.array, slots: mx.array, keys: mx.array, values: mx.array,
                       positions: mx.array, prologue: QKPrologue) -> dict:
    """The keyword arguments of the prologue KV write's call (shared by
    :func:`write_kv_qk_gpu` and the Metal emulation tests). No checks."""
    kv_heads, width = pool.shape[1], pool.shape[2]
    threads = keys.shape[0] * kv_heads * 32
    return dict(
        inputs=[pool, _int32(slots), keys, values, _int32(positions), prologue.params],
        template=[("T", pool.dtype), ("HKV", kv_heads), ("D", width // 2),
                  *prologue.template()],
        grid=(threads, 1, 1),
        threadgroup=(min(_QK_GROUP, threads), 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )


def write_kv_qk_gpu(pool: mx.array, slots: mx.array, keys: mx.array, values: mx.array,
                    positions: mx.array, prologue: QKPrologue, *, dialect: Dialect,
                    tokens: list[mx.array] | None = None) -> mx.array:
    """:func:`write_kv_gpu` of raw key projections: each key head is normalised and rotated
    at its token's position first (``prologue``; :mod:`vllm_unified.kv.attention.qk_prologue`),
    values are stored as they are.

    Args:
        pool: as :func:`write_kv_gpu`.
        slots, positions: ``[T]`` integer slots (distinct) and token positions.
        keys, values: any shape of ``T * Hkv * D`` elements, row-major ``[T, Hkv, D]`` (the
            projections' ``[T, 1, Hkv * D]``), in the pool's dtype.
        prologue: the layer's, with ``head_dim == D``.
        dialect: ``"cuda"`` or ``"metal"``.
        tokens: as :func:`write_kv_gpu`.

    Returns:
        The pool ordered after the write, as :func:`write_kv_gpu`.

    Raises:
        ValueError: shapes or dtypes disagree, a prologue of another head size, unknown
            dialect, a Metal pool under 8 elements, or more than 2**31 - 1 threads.
    """
    num_slots, kv_heads, width = pool.shape
    count = slots.shape[0] if slots.ndim == 1 else -1
    cells = count * kv_heads * (width // 2)
    for name, rows in (("keys", keys), ("values", values)):
        if rows.size != cells or rows.shape[0] != count or rows.dtype != pool.dtype:
            raise ValueError(f"{name} {rows.shape} {rows.dtype} are not [{count}, "
                             f"{kv_heads} x {width // 2}] rows of pool {pool.shape} "
                             f"{pool.dtype}")
    if positions.shape != slots.shape:
        raise ValueError(f"positions {positions.shape} != slots {slots.shape}")
    if prologue.head_dim != width // 2:
        raise ValueError(f"prologue of head size {prologue.head_dim}, pool of {width // 2}")
    _check_destination(pool, dialect, count * kv_heads * 32)
    if count == 0:
        return pool
    done = _kernel(WRITE_KV_QK_KERNEL, WRITE_KV_QK_SOURCE, dialect)(
        **write_kv_qk_launch(pool, slots, keys, values, positions, prologue))[0]
    return ordered_after(pool, done, tokens)


def write_rows_launch(dst: mx.array, row_idx: mx.array, src: mx.array) -> dict:
    """The keyword arguments of the row write kernel's call for these arrays (shared by
    :func:`write_rows_gpu` and the Metal emulation tests). No checks."""
    width = math.prod(dst.shape[1:])
    total = src.shape[0] * width
    return dict(
        inputs=[dst, _int32(row_idx), src],
        template=[("T", dst.dtype), ("W", width)],
        grid=(total, 1, 1),
        threadgroup=(min(_ROWS_GROUP, total), 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )


def write_rows_gpu(dst: mx.array, row_idx: mx.array, src: mx.array, *, dialect: Dialect,
                   tokens: list[mx.array] | None = None) -> mx.array:
    """Write ``src[i]`` into row ``row_idx[i]`` of ``dst``'s buffer, in place; lazily.

    The GPU counterpart of :func:`vllm_unified.bridge.write_rows`, with the same contract
    except where a GPU kernel cannot check at the call:

    * ``dst`` ``[R, *row]`` (row-contiguous; MLX-owned, or adopted torch memory on Metal; on
      Metal at least 8 elements), ``src`` ``[N, *row]`` of the same dtype and any layout,
      ``row_idx`` a 1-D integer array of ``N`` indices (any layout; cast to int32 when another
      integer type).
    * The result has ``dst``'s shape and dtype and shares its buffer: once evaluated the rows
      are in that buffer. MLX evaluates anything computed from the result after the write, but
      a GPU kernel reading the buffer in the same evaluation must also take the write's token
      (``tokens``; :func:`ordered_after`), and a reader built on the old ``dst`` is not
      ordered at all.
    * Indices outside ``[0, R)`` are skipped by the kernel (nothing is written for them, no
      error is raised). Duplicate indices: which source row lands is unspecified (the CPU
      primitive's "last one wins" is not guaranteed); pass distinct indices.

    Args:
        dialect: ``"cuda"`` or ``"metal"``, the backend the kernel runs on.
        tokens: receives the write's completion token (:func:`ordered_after`).

    Returns:
        ``dst`` ordered after the write (``mx.depends(dst, token)``); ``dst`` itself when
        ``N == 0``.

    Raises:
        TypeError: dtype mismatch, or ``row_idx`` not 1-D integer.
        ValueError: shape mismatch, ``dst`` with no row axis, unknown dialect, a Metal ``dst``
            under 8 elements, or more than 2**31 - 1 elements to write.
    """
    if src.dtype != dst.dtype:
        raise TypeError(f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    if row_idx.ndim != 1 or not mx.issubdtype(row_idx.dtype, mx.integer):
        raise TypeError(f"row_idx must be a 1-D integer array, got {row_idx.shape} "
                        f"{row_idx.dtype}")
    if dst.ndim < 1 or src.shape[1:] != dst.shape[1:] or src.shape[0] != row_idx.shape[0]:
        raise ValueError(f"src {src.shape} and row_idx {row_idx.shape} do not fit rows of "
                         f"dst {dst.shape}")
    _check_destination(dst, dialect, src.size)
    if src.shape[0] == 0 or src.size == 0:
        return dst
    done = _kernel(WRITE_ROWS_KERNEL, WRITE_ROWS_SOURCE, dialect)(
        **write_rows_launch(dst, row_idx, src))[0]
    return ordered_after(dst, done, tokens)
