"""Paged attention over quantized KV pages on MLX's GPU backends: one source, CUDA and Metal.

The quantized counterpart of :mod:`vllm_unified.kv.gpu.paged`, with its work split,
tiles, masks and combine (one thread group per (tile, KV head); the warps split the keys, each
lane ``D / 32`` contiguous channels; an fp32 online softmax per (row, query head); the warps'
results combined in shared memory ``CB`` pairs per pass). The pool holds vLLM's cells
(:mod:`vllm_unified.kv.quant`, ``[slots, Hkv, cell bytes]``): each key and value is read
where it lies, through the block table, and dequantized in registers (never a dense copy of
the context), as the native CPU kernel does (native/src/cpu_kvquant.cpp):

* int8 / fp8: a lane's bytes widened (fp8 e4m3fn decoded from its bits), score
  ``(q . k_q) * s_k`` with the softmax scale folded into ``q``, values weighted by
  ``p * s_v``;
* int4: nibbles less the zero point, ``(q . (k_q - zp_k)) * s_k``, values
  ``p * s_v * (v_q - zp_v)``; as vLLM's ``unified_attention_int4`` and the CPU kernel do, the
  queries are rotated by ``single_rht`` (in shared memory, butterfly stage by stage between
  barriers) and rounded to the queries' dtype, the softmax scale is divided by the rotation
  block ``b``, and each output row is rounded to the dtype, rotated back (butterfly, signs)
  and divided by ``b`` before it is stored.

* turboquant_k8v4: keys the fp8 bytes decoded (no scale), values ``q * s + min`` with the
  cell's fp16 scale and minimum, weighted by ``p``.

Routing (:func:`paged_gpu_attention_quant`): every decode row and every prefill chunk of at
most :data:`gpu_paged.MAX_KERNEL_CHUNK` rows goes to the kernel; for the per-token-head formats
fresh chunks too (the pool's quantized keys are what vLLM's Triton backend attends over, not the
layer's unquantized ones); a longer chunk goes to MLX's SDPA over its own context gathered from
the pool and dequantized (:func:`vllm_unified.kv.attention.reference.quantized_chunk_attention`), as
the dense path gathers long chunks. turboquant_k8v4 follows vLLM's TurboQuant backend: a chunk
that starts its sequence goes to MLX's SDPA over the step's own unquantized keys and values,
one longer than :data:`~vllm_unified.kv.quant.TQ_SHORT_CONTINUATION` tokens over its context's
cells followed by its own unquantized rows; shorter ones and decode rows read every key from
the cells.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from vllm_unified import gpu_dialect
from vllm_unified.kv.attention import reference
from vllm_unified.kv.attention.metadata import AttentionMetadata, Window
from vllm_unified.kv.gpu import paged as gpu_paged
from vllm_unified.kv.gpu import quant_write
from vllm_unified.kv.gpu.paged import LaunchArgs
from vllm_unified.kv.gpu.quant_write import HEADER as QUANT_HEADER
from vllm_unified.kv.quant import TQ_SHORT_CONTINUATION, KVFormat, rotation_block

KERNEL_NAME = "vllm_unified_paged_attention_quant"
#: ``after``: as :data:`gpu_paged.INPUT_NAMES`'s (the write's completion token, not read)
#: ``scale``, ``sinks``: as :data:`gpu_paged.INPUT_NAMES`'s
INPUT_NAMES = ["q", "kv", "tables", "tiles", "scale", "sinks", "signs", "after"]
OUTPUT_NAMES = ["out"]

#: the kernel's helpers: the dense kernel's vector type, vLLM's float8 e4m3fn decoding and the
#: fp32 scale word of a cell side (read byte by byte: any alignment)
HEADER = gpu_paged.HEADER + QUANT_HEADER + gpu_dialect.kernel_file(__package__,
                                                                 "paged_quant.h")

#: The kernel body. Template arguments: T (queries' dtype), P (pool dtype, int8/uint8), MODE
#: (1 int8, 2 int4, 3 fp8, 4 turboquant_k8v4), BLK (int4's rotation block, else 1), RQ (rows
#: of the rotation buffer: QT * G for int4, else 1), and those of :data:`gpu_paged.SOURCE`
#: (D, H, HKV, BS, WARPS, WINDOW, CHUNK (0: quantized pools with an attention chunk take the
#: reference), QT, CB, DECODE, SOFTCAP, SINKS). ``scale`` is the softmax scale (int4:
#: divided by BLK) and the soft-cap.
SOURCE = gpu_paged.attention_body("paged_quant.inc")


def supported(head_dim: int) -> bool:
    """Head sizes the kernel takes: a multiple of 32 up to 256 (as the quantizing write,
    :func:`vllm_unified.kv.gpu.quant_write.supported`; no vector loads of D / 32 elements,
    so unlike the dense kernel 96, 160, 192 and 224 are taken too)."""
    return quant_write.supported(head_dim)


@functools.cache
def launch_shape(group: int, head_dim: int, rows: int, rotated: bool) -> tuple[int, int]:
    """``(WARPS, CB)`` for ``rows`` query rows x ``group`` heads of ``head_dim``: the dense
    kernel's warps (:func:`gpu_paged.warps_per_group`), halved while the shared memory
    (``WARPS x (2 QG + CB x D) x 4`` bytes with ``CB = 1``, plus the rotation buffer
    ``RQ x D x 4``, ``RQ = QG`` for int4, else 1) exceeds :data:`gpu_paged.SHARED_BYTES`; CB as
    many pairs as the rest holds, at least 1, at most ``QG``."""
    qg = rows * group
    floats = gpu_paged.SHARED_BYTES // 4 - rotation_rows(group, rows, rotated) * head_dim
    warps = gpu_paged.warps_per_group(group, head_dim, rows)
    while warps > 1 and warps * (2 * qg + head_dim) > floats:
        warps //= 2
    return warps, max(1, min(qg, (floats // warps - 2 * qg) // head_dim))


@functools.cache
def q_tile(group: int, head_dim: int, rotated: bool) -> int:
    """Query rows per prefill tile: the dense kernel's (:func:`gpu_paged.q_tile`), fewer
    while one warp's shared memory does not fit beside the int4 rotation buffer."""
    rows = gpu_paged.q_tile(group, head_dim)
    while rows > 1 and launch_shape(group, head_dim, rows, rotated)[0] * \
            (2 * rows * group + head_dim) > gpu_paged.SHARED_BYTES // 4 - \
            rotation_rows(group, rows, rotated) * head_dim:
        rows -= 1
    return rows


def rotation_rows(group: int, rows: int, rotated: bool) -> int:
    """RQ, the rows of the kernel's rotation buffer: every (row, head) pair of a tile for int4
    (its queries, then the output rows of a combine pass), else 1 (unused)."""
    return rows * group if rotated else 1


@functools.cache
def _kernel(dialect: str):
    return gpu_dialect.kernel(KERNEL_NAME, INPUT_NAMES, OUTPUT_NAMES, SOURCE, dialect=dialect,
                              header=HEADER)


_UNUSED: list[mx.array] = []


def _no_signs() -> mx.array:
    if not _UNUSED:
        _UNUSED.append(mx.array([1.0], dtype=mx.float32))
    return _UNUSED[0]


def launch_args(
    queries: mx.array, kv_pool: mx.array, tables: mx.array, tiles: mx.array, scale: float,
    window: Window, block_size: int, rows: int, decode: bool, fmt: KVFormat,
    signs: mx.array | None, after: mx.array | None = None, softcap: float | None = None,
    sinks: mx.array | None = None,
) -> LaunchArgs:
    """The kernel call over ``tiles`` (see :func:`launch`)."""
    tokens, heads, _, dim = queries.shape
    kv_heads = kv_pool.shape[1]
    group = heads // kv_heads
    warps, cb = launch_shape(group, dim, rows, fmt.rotated)
    block = rotation_block(dim) if fmt.rotated else 1
    return LaunchArgs(
        inputs=[queries, kv_pool, tables, tiles, gpu_paged.scale_input(scale / block, softcap),
                gpu_paged.sinks_input(sinks), signs if fmt.rotated else _no_signs(),
                gpu_paged.no_write() if after is None else after],
        template=[("T", queries.dtype), ("P", kv_pool.dtype), ("MODE", fmt.native_mode),
                  ("BLK", block), ("RQ", rotation_rows(group, rows, fmt.rotated)), ("D", dim),
                  ("H", heads), ("HKV", kv_heads), ("BS", block_size), ("WARPS", warps),
                  ("WINDOW", 0 if window is None else int(window)),
                  ("CHUNK", 0), ("QT", rows),
                  ("CB", cb), ("DECODE", int(decode)),
                  *gpu_paged.option_template(softcap, sinks)],
        grid=(tiles.shape[0] * kv_heads * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(tokens, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )


def launch(
    dialect: str, queries: mx.array, kv_pool: mx.array, tables: mx.array, tiles: mx.array,
    scale: float, window: Window, block_size: int, rows: int, decode: bool, fmt: KVFormat,
    signs: mx.array | None, after: mx.array | None = None, softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """One launch over ``tiles`` (as :func:`gpu_paged.launch`, over a quantized pool
    ``[slots, Hkv, cell bytes]`` of format ``fmt``; ``signs``: int4's RHT signs; ``after``:
    the write's completion token; ``softcap``, ``sinks``: as :func:`gpu_paged.launch`);
    returns ``[T, H, 1, D]`` where only the rows the tiles cover are written."""
    a = launch_args(queries, kv_pool, tables, tiles, scale, window, block_size, rows, decode,
                    fmt, signs, after, softcap, sinks)
    return _kernel(dialect)(inputs=a.inputs, template=a.template, grid=a.grid,
                            threadgroup=a.threadgroup, output_shapes=a.output_shapes,
                            output_dtypes=a.output_dtypes)[0]


def paged_gpu_attention_quant(
    dialect: str, queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: Window, fmt: KVFormat, signs: mx.array | None, max_chunk: int | None = None,
    fresh: tuple[mx.array, mx.array] | None = None, after: mx.array | None = None,
    softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """Every row's attention over a quantized pool (``[slots, Hkv, fmt.cell_bytes(D)]``).

    Args:
        dialect: ``"cuda"`` or ``"metal"`` (the backend profile's ``gpu_attention``).
        queries: ``[T, H, 1, D]`` (RoPE'd), token-major, float32/float16/bfloat16.
        kv_pool: one layer's quantized pool, this step's keys and values already written.
        meta: the step's metadata (as :func:`gpu_paged.paged_gpu_attention`).
        scale, window: score multiplier, sliding window or None.
        fmt: the pool's quantized format; ``signs``: int4's RHT signs (fp32 ``[b]``).
        max_chunk: prefill chunks longer than this go to MLX's SDPA over their context
            gathered and dequantized; default :data:`gpu_paged.MAX_KERNEL_CHUNK`
            (``turboquant_k8v4``: at most :data:`~vllm_unified.kv.quant.TQ_SHORT_CONTINUATION`).
        fresh: ``turboquant_k8v4``: this step's keys and values of the layer (``[T, Hkv, 1,
            D]`` or ``[T, Hkv, D]``, unquantized), which prefill chunks read for their own
            tokens as vLLM's TurboQuant backend does: a chunk that starts its sequence goes to
            MLX's SDPA over them alone, one longer than ``TQ_SHORT_CONTINUATION`` over its
            context's cells followed by them. Ignored by the other formats (vLLM attends
            every key from their cells).
        after: the completion token of this evaluation's write into ``kv_pool``
            (:func:`vllm_unified.kv.gpu.write.ordered_after`), taken by every read of it here.
        softcap, sinks: as :func:`gpu_paged.paged_gpu_attention` (the kernel and the chunks
            left to MLX's SDPA both apply them).

    Returns:
        ``[T, H, 1, D]`` in the queries' dtype and token order, lazily.

    Raises:
        ValueError: a head size the kernel does not take, int4 without signs, a step with
            prefill chunks whose metadata lacks the host-side fields, or ``turboquant_k8v4``
            without ``fresh`` where a chunk reads its own keys unquantized.
    """
    dim = queries.shape[-1]
    if not supported(dim):
        raise ValueError(f"the paged GPU kernel takes head sizes that are multiples of 32 up "
                         f"to 256, not {dim}")
    if fmt.rotated and signs is None:
        raise ValueError(f"{fmt.name}: the attention needs vLLM's RHT signs")
    reference.check_logit_options(queries.shape[1], softcap, sinks)
    if meta.is_pure_decode:
        tables, lens = meta.decode_tables_lens()
        return launch(dialect, queries, kv_pool, tables, lens, scale, window, meta.block_size,
                      1, True, fmt, signs, after, **gpu_paged.options(softcap, sinks))
    limit = gpu_paged.MAX_KERNEL_CHUNK if max_chunk is None else max_chunk
    if fmt.turboquant:  # chunks that read their own K/V unquantized never reach the kernel
        if fresh is None and meta.fresh_key_rows(TQ_SHORT_CONTINUATION) is not None:
            raise ValueError(f"{fmt.name}: prefill chunks that start their sequence or are "
                             f"longer than {TQ_SHORT_CONTINUATION} tokens attend the step's "
                             "unquantized keys and values (fresh), which were not given")
        limit = min(limit, TQ_SHORT_CONTINUATION)
    rows = q_tile(queries.shape[1] // kv_pool.shape[1], dim, fmt.rotated)
    plan = meta.gpu_plan(rows, fmt.turboquant, limit)
    out = None
    if plan.tiles is not None:
        out = launch(dialect, queries, kv_pool, plan.tables, plan.tiles, scale, window,
                     meta.block_size, rows, False, fmt, signs, after,
                     **gpu_paged.options(softcap, sinks))
    if not plan.sdpa:
        return out
    pieces = []
    for start, stop, chunk in plan.segments:
        if chunk is None:
            pieces.append(out[start:stop])
        elif fmt.turboquant and meta.prefills[chunk].seq_len == stop - start:
            pieces.append(gpu_paged.fresh_chunk(queries[start:stop], fresh, start, stop,
                                                queries.dtype, meta.fresh_mask(chunk, window),
                                                scale, softcap, sinks))
        else:
            own = fmt.turboquant and stop - start > TQ_SHORT_CONTINUATION
            pieces.append(reference.quantized_chunk_attention(
                queries, kv_pool, meta, chunk, scale, window, fmt, fresh if own else None,
                after, softcap, sinks))
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
