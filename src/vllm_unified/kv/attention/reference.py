"""Pure-MLX reference paged attention (the oracle every faster kernel is tested against).

It imports no kernel: :mod:`vllm_unified.kv.attention.dispatch` picks the kernel that runs,
and the GPU kernels take the prefill chunks they leave to MLX's SDPA from here.

Layout (one layer):
    * ``k_pool``, ``v_pool``: ``[num_blocks * block_size, Hkv, D]``, "slot-major": slot
      ``block_id * block_size + offset`` holds one token's K (V) for all KV heads. vLLM's block ids
      index the pool directly.
    * queries: ``[T, H, 1, D]``, token-major (every scheduled token is its own batch row of
      length 1); new keys/values: ``[T, Hkv, 1, D]`` or ``[T, Hkv, D]``, already RoPE'd.

The work is grouped so the number of MLX ops per layer does not grow with the number of decode
requests: all single-token sequences form one batched attention call; each multi-token (prefill
chunk) sequence gets one call of its own. Keys and values are gathered through the block tables
row by row (pool row ``slot * Hkv + head``), which lands them directly in SDPA's layout.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from vllm_unified.kv.attention.metadata import AttentionMetadata, Chunk, Window
from vllm_unified.kv.quant import TQ_SHORT_CONTINUATION, KVFormat, dequantize_pool

#: Reads the keys and values at int32 pool rows ``[..., S]`` -> two ``[..., S, D]`` arrays.
Gather = Callable[[mx.array], tuple[mx.array, mx.array]]
#: ``(pool_rows [R, 2 * D], rows [..., S])`` -> ``(keys, values)`` ``[..., S, D]``, or None.
RowsGather = Callable[[mx.array, mx.array], "tuple[mx.array, mx.array] | None"]

# Gather indices are int32 rows of the pool viewed as [slots * Hkv, D].
_MAX_ROWS = 2**31


def write_kv(
    k_pool: mx.array,
    v_pool: mx.array,
    keys: mx.array,
    values: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array]:
    """Write each token's K/V into its slot and return the updated pools.

    Args:
        k_pool, v_pool: ``[num_slots, Hkv, D]`` pools of one layer.
        keys, values: ``[T, Hkv, D]`` or ``[T, Hkv, 1, D]``; cast to the pool dtype.
        slot_mapping: int32 ``[T]``, distinct slots in ``[0, num_slots)`` (not bounds-checked:
            MLX wraps negative indices, so vLLM's padding slot -1 must not reach here).

    Returns:
        ``(k_pool, v_pool)`` after the write, lazily (nothing is evaluated here).

    Buffer contract: the write is an in-place-able scatter (``pool[slots] = rows``). The Python
    objects passed in are updated in place (MLX ``__setitem__`` rebinds them to the scatter) and
    the same objects are returned. When evaluated, MLX reuses ("donates") the old pool buffer for
    the result instead of copying the whole pool, provided nothing else still refers to the old
    value: no other MLX array that is an earlier version of the pool, no numpy/torch view of it,
    no un-evaluated graph that reads it. The caller rebinds, ``k, v = write_kv(k, v, ...)``, and
    keeps no other reference. If something does keep one, the result is still correct but costs
    a full copy of the pool per write.

    Raises:
        ValueError: if shapes disagree.
    """
    keys = _token_rows(keys, k_pool, "keys")
    values = _token_rows(values, v_pool, "values")
    if slot_mapping.shape != (keys.shape[0],):
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != ({keys.shape[0]},)")
    k_pool[slot_mapping] = keys
    v_pool[slot_mapping] = values
    return k_pool, v_pool


def after_token(indices: mx.array, done: mx.array | None) -> mx.array:
    """``indices`` (integer) made by a kernel that reads ``done``, so an MLX op gathering
    with them runs after the write that returned ``done``
    (:func:`vllm_unified.kv.gpu.write.ordered_after`); the values are unchanged (``done`` is
    1, times 0)."""
    if done is None:
        return indices
    return indices + (done[0] * 0).astype(indices.dtype)


def _token_rows(rows: mx.array, pool: mx.array, name: str) -> mx.array:
    """Accept ``[T, Hkv, 1, D]`` (the layer's layout) or ``[T, Hkv, D]``; return the latter."""
    if rows.ndim == 4 and rows.shape[2] == 1:
        rows = rows.squeeze(2)
    if rows.ndim != 3 or rows.shape[1:] != pool.shape[1:]:
        raise ValueError(f"{name} shape {rows.shape} does not fit pool rows {pool.shape[1:]}")
    return rows


def paged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of every scheduled token over its own sequence's keys in the paged pool.

    Each query attends causally to its sequence's keys at positions <= its own (read through the
    block table); with ``window``, only to keys at positions > its position - window (the
    convention of ``mlx_lm.models.base.create_causal_mask``); with ``chunk`` (chunked local
    attention, vLLM's ``attention_chunk_size``), only to keys k with
    ``k // chunk == position // chunk``. GQA/MQA when H is a multiple of
    Hkv. The K/V of this step's tokens must already be in the pools (:func:`write_kv`).

    Args:
        queries: ``[T, H, 1, D]``, RoPE'd, in the pool's dtype (computation stays in it; softmax
            runs in fp32 inside MLX's SDPA).
        k_pool, v_pool: ``[num_blocks * block_size, Hkv, D]``.
        meta: the step's metadata (``meta.num_tokens == T``).
        scale: multiplier of the scores, usually ``D ** -0.5``.
        window: sliding-window size in tokens, or ``None`` for full attention.
        chunk: attention chunk size in tokens, or ``None``.
        softcap: attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``, vLLM's
            ``logits_soft_cap``): the scaled scores become ``softcap * tanh(scores /
            softcap)`` before the mask and the softmax; ``None``: none.
        sinks: attention sinks (gpt-oss), ``[H]`` of any float dtype: one logit per query
            head that joins the softmax's denominator and contributes no value, as
            ``mx.fast.scaled_dot_product_attention(..., sinks=)``; ``None``: none.

    Returns:
        ``[T, H, 1, D]`` in the queries' dtype, rows in token order.

    Raises:
        ValueError: on shape mismatches, a window or chunk < 1, a softcap <= 0, sinks that are
            not ``[H]``, or a pool of more than 2**31 rows (``slots * Hkv``; gather indices
            are int32).
    """
    _check_inputs(queries.shape, k_pool.shape, v_pool.shape, meta, window, chunk)
    check_logit_options(queries.shape[1], softcap, sinks)
    k_rows, v_rows = _rows_view(k_pool), _rows_view(v_pool)
    return _attend(queries, lambda rows: (k_rows[rows], v_rows[rows]), k_pool.shape[1], meta,
                   scale, window, chunk, softcap, sinks)


def paged_attention_kv(
    queries: mx.array,
    kv_pool: mx.array,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    fresh: tuple[mx.array, mx.array] | None = None,
    kv_format: KVFormat | None = None,
    after: mx.array | None = None,
    gather_rows: RowsGather | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """:func:`paged_attention` over one pool holding K and V side by side: MLX's gather + SDPA.

    ``kv_pool``: ``[num_blocks * block_size, Hkv, 2 * D]``, each (slot, head) cell holding the
    head's key followed by its value: vLLM's attention page ``[B, H, N, C]`` with
    ``C = head_size + head_size_v`` in the LBNHC layout, viewed slot-major. K and V are read as
    the column halves of the same ``[slots * Hkv, 2 * D]`` rows, so nothing is copied to split
    them (a reshape of a half would copy the pool). ``gather_rows(pool_rows, rows)``: a
    primitive that reads those rows in one pass (``(keys, values)``, or None where it does not
    apply; :func:`vllm_unified.bridge.gather_kv`), used in place of MLX's gather. ``chunk``:
    as :func:`paged_attention`.

    ``kv_format``: a quantized format (:mod:`vllm_unified.kv.quant`) makes ``kv_pool`` vLLM's
    page bytes ``[slots, Hkv, cell bytes]``, dequantized whole
    (:func:`vllm_unified.kv.quant.dequantize_pool`) and attended in fp32. For
    ``turboquant_k8v4`` with ``fresh`` (the step's ``[T, Hkv, 1, D]`` keys and values),
    prefill chunks read their own tokens' keys and values unquantized, as vLLM's TurboQuant
    backend attends them
    (:meth:`~vllm_unified.kv.attention.metadata.AttentionMetadata.fresh_key_rows`): those rows
    replace their cells in the dequantized pool.

    ``after``: the completion token of this evaluation's GPU kernel write into ``kv_pool``
    (:func:`vllm_unified.kv.gpu.write.ordered_after`), taken as an input by the gather, so the
    GPU runs the read after the write; None when nothing wrote it.

    ``softcap``, ``sinks``: as :func:`paged_attention`.

    Raises:
        ValueError: as :func:`paged_attention`, or a last axis that is not ``2 * D`` (the
            format's cell bytes).
    """
    if kv_format is not None and kv_format.quantized:
        return _quantized_attention(queries, kv_pool, meta, scale, window, kv_format, fresh,
                                    chunk, softcap, sinks)
    check_kv_pool(queries, kv_pool, meta, window, chunk=chunk)
    check_logit_options(queries.shape[1], softcap, sinks)
    head_dim = queries.shape[-1]
    pool_rows = kv_pool.reshape(-1, 2 * head_dim)

    def gather(rows: mx.array) -> tuple[mx.array, mx.array]:
        rows = after_token(rows, after)
        gathered = gather_rows(pool_rows, rows) if gather_rows is not None else None
        if gathered is not None:
            return gathered
        return pool_rows[:, :head_dim][rows], pool_rows[:, head_dim:][rows]

    return _attend(queries, gather, kv_pool.shape[1], meta, scale, window, chunk, softcap,
                   sinks)


def check_logit_options(heads: int, softcap: float | None, sinks: mx.array | None) -> None:
    """The checks of ``softcap`` and ``sinks`` (:func:`paged_attention`) for ``heads`` query
    heads.

    Raises:
        ValueError: a softcap that is not a finite number > 0, or sinks that are not a
            floating ``[heads]`` array.
    """
    if softcap is not None and not (0 < float(softcap) < float("inf")):
        raise ValueError(f"softcap must be a finite number > 0 (None: none), got {softcap}")
    if sinks is not None and (sinks.shape != (heads,)
                              or not mx.issubdtype(sinks.dtype, mx.floating)):
        raise ValueError(f"sinks must be a floating [{heads}] array (one logit per query "
                         f"head), got {sinks.dtype} {sinks.shape}")


def paged_attention_latent(
    queries: mx.array,
    latent_pool: mx.array,
    meta: AttentionMetadata,
    scale: float,
    latent_dim: int,
    window: int | None = None,
    after: mx.array | None = None,
) -> mx.array:
    """Multi-head latent attention (MLA) in its absorbed form over vLLM's MLA pages.

    ``latent_pool``: ``[num_blocks * block_size, 1, W]``, slot-major: each token's one row of
    ``W = kv_lora_rank + qk_rope_head_dim`` values, the normalised latent ``c_kv`` followed by
    the rotated shared key ``k_pe`` (vLLM's ``MLAAttentionSpec`` page, ``num_kv_heads=1``).
    ``queries``: ``[T, H, 1, W]``, each head's ``q_nope`` already multiplied into the latent
    space (first ``latent_dim`` values) followed by its rotated ``q_pe``. Every row is both key
    and value (MQA with one KV head of size W): the scores are ``q . row * scale`` and the
    output is the softmax-weighted sum of the rows' first ``latent_dim`` values. Causality,
    ``window`` and ``after`` as :func:`paged_attention_kv`.

    Returns:
        ``[T, H, 1, latent_dim]`` in the queries' dtype, rows in token order (the caller
        multiplies them by the value up-projection).

    Raises:
        ValueError: as :func:`paged_attention`, a pool that is not ``[slots, 1, W]``, or a
            ``latent_dim`` outside ``(0, W]``.
    """
    check_latent_pool(queries, latent_pool, meta, latent_dim, window)
    pool_rows = latent_pool.reshape(-1, latent_pool.shape[-1])

    def gather(rows: mx.array) -> tuple[mx.array, mx.array]:
        keys = pool_rows[after_token(rows, after)]
        return keys, keys

    out = _attend(queries, gather, 1, meta, scale, window)
    return out[..., :latent_dim]


def check_latent_pool(queries: mx.array, latent_pool: mx.array, meta: AttentionMetadata,
                      latent_dim: int, window: Window) -> None:
    """The shape checks of :func:`paged_attention_latent`.

    Raises:
        ValueError: as :func:`paged_attention_latent`.
    """
    width = queries.shape[-1]
    if latent_pool.ndim != 3 or latent_pool.shape[1:] != (1, width):
        raise ValueError(f"an MLA pool must be [slots, 1, {width}] (one latent row per "
                         f"token), got {latent_pool.shape}")
    if not 0 < latent_dim <= width:
        raise ValueError(f"latent_dim {latent_dim} outside (0, {width}]")
    _check_inputs(queries.shape, latent_pool.shape, latent_pool.shape, meta, window)


def check_kv_pool(queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata,
                  window: Window, fmt: KVFormat | None = None, chunk: Chunk = None) -> None:
    """The shape checks of :func:`paged_attention_kv` (``fmt``: a quantized pool's format).

    Raises:
        ValueError: as :func:`paged_attention_kv`.
    """
    head_dim = queries.shape[-1]
    cell = 2 * head_dim if fmt is None else fmt.cell_bytes(head_dim)
    if kv_pool.ndim != 3 or kv_pool.shape[-1] != cell:
        what = "kv_pool" if fmt is None else f"a {fmt.name} pool"
        raise ValueError(f"{what} must be [slots, Hkv, {cell if fmt else f'2*{head_dim}'}], "
                         f"got {kv_pool.shape}")
    half = (*kv_pool.shape[:2], head_dim)
    _check_inputs(queries.shape, half, half, meta, window, chunk)


def fresh_rows(queries: mx.array, meta: AttentionMetadata, fmt: KVFormat,
               fresh: tuple[mx.array, mx.array] | None
               ) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
    """turboquant_k8v4's rows that read the step's own keys and values unquantized:
    ``(keys, values, *meta.fresh_key_rows(...))`` with ``[T, Hkv, D]`` keys and values in the
    queries' dtype, or None (another format, no ``fresh``, no such row)."""
    if not (fmt.turboquant and fresh is not None and meta.num_tokens):
        return None
    rows = meta.fresh_key_rows(TQ_SHORT_CONTINUATION)
    if rows is None:
        return None
    head_dim = queries.shape[-1]
    fk, fv = (x.reshape(x.shape[0], x.shape[1], head_dim).astype(queries.dtype) for x in fresh)
    return (fk, fv, *rows)


def _quantized_attention(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: int | None, fmt: KVFormat, fresh: tuple[mx.array, mx.array] | None = None,
    chunk: Chunk = None,
    softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """:func:`paged_attention_kv` over a quantized pool (see there)."""
    check_kv_pool(queries, kv_pool, meta, window, fmt, chunk)
    head_dim = queries.shape[-1]
    raw = fresh_rows(queries, meta, fmt, fresh)
    dense = dequantize_pool(kv_pool, fmt, head_dim)
    if raw is not None:  # the rows that read their own step's K/V, in place of the cells
        fk, fv, raw_from, _ = raw
        own = np.flatnonzero(np.array(raw_from) <= meta.host_positions)
        if own.size:
            sel = mx.array(own.astype(np.int32))
            dense[meta.slot_mapping[sel]] = mx.concatenate(
                [fk[sel], fv[sel]], axis=-1).astype(mx.float32)
    return paged_attention_kv(queries.astype(mx.float32), dense, meta, scale, window,
                              chunk=chunk, softcap=softcap,
                              sinks=sinks).astype(queries.dtype)


def quantized_chunk_attention(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, index: int, scale: float,
    window: Window, fmt: KVFormat, fresh: tuple[mx.array, mx.array] | None = None,
    after: mx.array | None = None, softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Prefill chunk ``index`` of a step over a quantized pool by MLX's SDPA: its
    ``[L, H, 1, D]`` rows of ``queries`` over its own context's cells gathered from ``kv_pool``
    (``[slots, Hkv, cell bytes]``) and dequantized by pure MLX
    (:func:`vllm_unified.kv.quant.dequantize_pool`: that chunk's keys only, never the pool),
    in fp32 as the reference; ``[L, H, 1, D]`` in the queries' dtype out (for GPU kernels that
    leave long chunks to SDPA). ``fresh``: the step's unquantized keys and values
    (``[T, Hkv, 1, D]`` or ``[T, Hkv, D]``), read for the chunk's own ``L`` tokens in place of
    their cells (turboquant_k8v4's long continuation chunks, as vLLM's TurboQuant backend).
    ``after``, ``softcap``, ``sinks``: as :func:`paged_attention_kv`."""
    dim = queries.shape[-1]
    cell_rows = kv_pool.reshape(-1, kv_pool.shape[-1])
    chunk = meta.prefills[index]

    def own(x: mx.array) -> mx.array:
        # [L, Hkv, (1,) D] rows of the chunk -> [1, Hkv, L, D] fp32
        rows = x[chunk.start:chunk.start + chunk.length]
        return rows.reshape(chunk.length, -1, dim).transpose(1, 0, 2)[None].astype(mx.float32)

    def gather(rows: mx.array) -> tuple[mx.array, mx.array]:
        if fresh is not None:  # the view ends with the chunk's own L positions
            rows = rows[..., :rows.shape[-1] - chunk.length]
        dense = dequantize_pool(cell_rows[after_token(rows, after)], fmt, dim)
        keys, values = dense[..., :dim], dense[..., dim:]
        if fresh is not None:
            keys = mx.concatenate([keys, own(fresh[0])], axis=2)
            values = mx.concatenate([values, own(fresh[1])], axis=2)
        return keys, values

    return _prefill_attention(queries.astype(mx.float32), gather, meta, index, scale, window,
                              kv_pool.shape[1], softcap=softcap,
                              sinks=sinks).astype(queries.dtype)


def _attend(
    queries: mx.array,
    gather: Gather,
    kv_heads: int,
    meta: AttentionMetadata,
    scale: float,
    window: Window,
    chunk: Chunk = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention given ``gather``, which reads keys and values at pool rows (see _rows_view)."""
    if meta.num_tokens == 0:
        return queries
    outputs = []
    if meta.decode_rows is not None:
        outputs.append(_decode_attention(queries, gather, meta, scale, window, kv_heads,
                                         chunk, softcap, sinks))
    for index in range(len(meta.prefills)):
        outputs.append(_prefill_attention(queries, gather, meta, index, scale, window,
                                          kv_heads, chunk, softcap, sinks))
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
    return out if meta.output_order is None else out[meta.output_order]


def _check_inputs(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    meta: AttentionMetadata,
    window: Window,
    chunk: Chunk = None,
) -> None:
    """Shape checks only (no MLX op is created: graph building is per layer and step)."""
    if len(q_shape) != 4 or q_shape[0] != meta.num_tokens or q_shape[2] != 1:
        raise ValueError(f"queries must be [{meta.num_tokens}, H, 1, D], got {q_shape}")
    if tuple(k_shape) != tuple(v_shape) or len(k_shape) != 3:
        raise ValueError(f"pools must both be [slots, Hkv, D], got {k_shape}, {v_shape}")
    heads, kv_heads = q_shape[1], k_shape[1]
    if q_shape[3] != k_shape[2] or heads % kv_heads:
        raise ValueError(f"queries {q_shape} do not fit pool rows {k_shape[1:]}")
    if k_shape[0] % meta.block_size:
        raise ValueError(f"{k_shape[0]} slots is not a multiple of {meta.block_size}")
    if k_shape[0] * kv_heads > _MAX_ROWS:
        raise ValueError(f"{k_shape[0]} slots x {kv_heads} heads overflow int32 row indices")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"attention chunk must be >= 1, got {chunk}")


def _rows_view(pool: mx.array) -> mx.array:
    """``[slots, Hkv, D]`` -> ``[slots * Hkv, D]`` (a reshape, no copy): one row per slot and head.

    Gathering rows ``slot * Hkv + head`` puts keys straight into SDPA's ``[B, Hkv, S, D]`` layout
    in one pass; gathering whole blocks would leave ``[B, S, Hkv, D]`` and need a transposing
    copy (SDPA on a transposed view was several times slower on CPU).
    """
    return pool.reshape(-1, pool.shape[-1])


def _decode_attention(
    queries: mx.array,
    gather: Gather,
    meta: AttentionMetadata,
    scale: float,
    window: Window,
    kv_heads: int,
    chunk: Chunk = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """One SDPA over all single-token sequences: ``[Bd, H, 1, D]`` against ``[Bd, Hkv, S, D]``."""
    view = meta.decode_view(window, kv_heads, chunk)
    q = queries[meta.decode_rows]
    keys, values = gather(view.rows)
    return sdpa(q, keys, values, scale, view.mask, softcap, sinks)


def prefill_chunk_attention(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, index: int, scale: float,
    window: Window, after: mx.array | None = None, chunk: Chunk = None,
    softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """The reference's attention of prefill chunk ``index`` alone: its ``[L, H, 1, D]`` rows
    of ``queries`` (``[T, H, 1, D]``) over its keys gathered from ``kv_pool``
    (``[slots, Hkv, 2 * D]``) by MLX, then MLX's SDPA; ``[L, H, 1, D]`` out (for GPU kernels
    that leave long chunks to SDPA). ``after``, ``chunk``, ``softcap``, ``sinks``: as
    :func:`paged_attention_kv`."""
    dim = queries.shape[-1]
    pool_rows = kv_pool.reshape(-1, 2 * dim)

    def gather(rows: mx.array) -> tuple[mx.array, mx.array]:
        rows = after_token(rows, after)
        return pool_rows[:, :dim][rows], pool_rows[:, dim:][rows]

    return _prefill_attention(queries, gather, meta, index, scale, window, kv_pool.shape[1],
                              chunk, softcap, sinks)


def _prefill_attention(
    queries: mx.array,
    gather: Gather,
    meta: AttentionMetadata,
    index: int,
    scale: float,
    window: Window,
    kv_heads: int,
    attention_chunk: Chunk = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """One chunk: ``[1, H, L, D]`` queries against its context ``[1, Hkv, S, D]``, causal."""
    chunk = meta.prefills[index]
    view = meta.prefill_view(index, window, kv_heads, attention_chunk)
    # [L, H, 1, D] rows -> [1, H, L, D]: the chunk becomes one sequence of length L.
    q = queries[chunk.start : chunk.start + chunk.length].transpose(2, 1, 0, 3)
    keys, values = gather(view.rows)
    out = sdpa(q, keys, values, scale, view.mask, softcap, sinks)
    return out.transpose(2, 1, 0, 3)


def sdpa(q: mx.array, keys: mx.array, values: mx.array, scale: float,
         mask: mx.array | str | None, softcap: float | None = None,
         sinks: mx.array | None = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` with attention logit soft-capping.

    Args:
        q: ``[B, H, L, D]``; keys, values: ``[B, Hkv, S, D]`` with ``H % Hkv == 0``.
        scale: score multiplier.
        mask: None, ``"causal"`` (lower-right aligned: query i sees keys ``j <= i + S - L``)
            or a boolean array broadcasting to ``[B, H, L, S]`` (True: visible).
        softcap, sinks: as :func:`paged_attention`; ``sinks`` is cast to ``q``'s dtype, as
            MLX's SDPA requires.

    Returns:
        ``[B, H, L, D]`` in ``q``'s dtype. Without ``softcap``, MLX's SDPA itself (sinks
        included); with it the scores are computed explicitly in fp32 (MLX's SDPA has no
        soft-capping), capped, masked, and softmaxed with the sinks as an extra column.
    """
    if sinks is not None:
        sinks = sinks.astype(q.dtype)
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask,
                                                    sinks=sinks)
    b, heads, length, dim = q.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    # [B, Hkv, G, L, D] against [B, Hkv, 1, S, D]: GQA without repeating the keys
    qf = (q.astype(mx.float32) * scale).reshape(b, kv_heads, group, length, dim)
    kf = keys.astype(mx.float32)[:, :, None]
    scores = qf @ kf.swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        visible = mx.arange(num_keys)[None] <= mx.arange(length)[:, None] + (num_keys - length)
    else:
        visible = mask
    if visible is not None:
        visible = mx.broadcast_to(visible, (b, heads, length, num_keys)).reshape(
            b, kv_heads, group, length, num_keys)
        scores = mx.where(visible, scores, mx.array(-mx.inf, mx.float32))
    if sinks is not None:
        column = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, kv_heads, group, 1, 1),
                                 (b, kv_heads, group, length, 1))
        probs = mx.softmax(mx.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    else:
        probs = mx.softmax(scores, axis=-1)
    out = probs @ values.astype(mx.float32)[:, :, None]
    return out.reshape(b, heads, length, dim).astype(q.dtype)

