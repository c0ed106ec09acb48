"""Attention straight from the paged pool on MLX's CPU backend (an optional accelerator).

The pure-MLX reference (:mod:`vllm_unified.kv.attention.reference`) gathers each group's keys and
values out of the pool (the decode batch into ``[Bd, Hkv, S, D]``, each prefill chunk into
``[1, Hkv, S, D]``) per layer and step and runs MLX's SDPA over them. On the CPU backend that
SDPA is unfused (a matmul per head, a softmax whose ``exp`` MLX 0.32.4 evaluates one element at
a time, a second matmul), and the gathers copy every sequence's context per layer and step.

The native ``paged_attention`` primitive (``native/src/native.cpp``, loops in
``native/src/cpu_math.cpp`` and ``native/src/cpu_attn_tile.cpp``) takes every token row of the
step at once: row r of sequence ``seqs[r]`` attends to keys ``first ... lens[r] - 1``
(``lens[r]`` = its position + 1, so prefill chunks are causal; ``first`` from the sliding window
and the attention chunk), read where they lie in the pool through the block table, all query
heads of a KV head together. Decode rows and prefill chunks need no separate groups,
concatenation or reordering. Two kernels share the rows:

- the rows of prefill chunks (2+ consecutive rows of one sequence) on dense pools with head
  sizes 64, 128 and 256, on AVX-512 or AVX2 (within ``VLLM_UNIFIED_CPU_ISA``): a blocked
  (flash-attention style) kernel, tiles of up to 16 rows x the KV head's query heads against
  key blocks of 32 positions, both products register-blocked GEMMs, an online softmax;
- every other row (decode rows, quantized and latent pools, other head sizes, CPUs without
  AVX2): the row kernel, one row's query heads over its keys, ``exp`` vectorized.

Items ((tile or row) x KV head) are split over the kernel threads (``VLLM_UNIFIED_CPU_THREADS``).
Batch invariance: a row's arithmetic depends on its own query and keys alone, so its output has
the same bits whatever else the step holds, however a prompt is cut into chunks of 2+ rows and
however the items fall on threads. A chunk's row and a decode row (or a chunk of one row) of the
same query take different kernels and may differ in the last bits. Speed: docs/dev/benchmarks.md.
Both compute the reference's function, which ``tests/test_cpu_kernels.py`` checks against the
reference for fp32, fp16 and bf16 pools, mixed steps, long chunks, with and without a window, an
attention chunk, soft-capping and sinks.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from vllm_unified import bridge
from vllm_unified.compat import init_logger
from vllm_unified.kv.attention.metadata import AttentionMetadata, Chunk, Window

logger = init_logger(__name__)


def paged_attention_rows(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: Window, kv_mode: int = 0, rht_signs: mx.array | None = None,
    fresh: tuple[mx.array, mx.array, mx.array, mx.array] | None = None,
    chunk: Chunk = None,
    softcap: float | None = None, sinks: mx.array | None = None, latent: bool = False,
) -> mx.array:
    """Every token row's attention over ``kv_pool`` (``[slots, Hkv, 2 * D]``, K then V; with
    ``latent``, an MLA pool ``[slots, 1, D]`` whose rows are keys and values at once).

    Args:
        queries: ``[T, H, 1, D]`` (RoPE'd), token-major as the runner lays a step out, in the
            pool's dtype (fp32, fp16 or bf16).
        kv_pool: one layer's pool, row-contiguous (read in place, never copied), with this
            step's keys and values already written.
        meta: the step's metadata (block tables, each row's sequence and position).
        scale: score multiplier.
        window: sliding window in tokens or None.
        chunk: attention chunk in tokens (chunked local attention) or None.
        kv_mode: a quantized pool's format (:class:`vllm_unified.kv.quant.KVFormat`
            ``native_mode``; 0: the pool holds the model dtype); the pool is then vLLM's page
            bytes ``[slots, Hkv, cell bytes]`` and every cell is dequantized in registers.
        rht_signs: vLLM's RHT signs (``int4_per_token_head``).
        fresh: ``turboquant_k8v4`` only: ``(keys, values, raw_from, raw_row0)``, this step's
            K/V (``[T, Hkv, D]`` in the queries' dtype) and per row (int32 ``[T]``) the first
            position read from them and the fresh row of that position
            (:meth:`~vllm_unified.kv.attention.metadata.AttentionMetadata.fresh_key_rows`).
        softcap: attention logit soft-capping (``softcap * tanh(s / softcap)`` of the scaled
            scores) or None.
        sinks: ``[H]`` sink logits of any float dtype (read as fp32) or None.

    Returns:
        ``[T, H, 1, D]`` in the queries' dtype and token order, lazily.

    Raises:
        RuntimeError: the native extension is unavailable (the backend profile's
            ``cpu_attention`` says when the kernel applies).
        ValueError / TypeError: shapes or dtypes the primitive does not take; an out-of-range
            block id raises from the ``mx.eval`` that runs it.
    """
    native = bridge.native_kernels()
    if native is None:
        raise RuntimeError("the native CPU attention kernel is unavailable "
                           "(see bridge.native_error)")
    _log_kernels()
    tokens, heads, _, dim = queries.shape
    tables, seqs, lens = meta.row_tables_seqs_lens()
    extra = {}
    if fresh is not None:
        extra = dict(zip(("fresh_k", "fresh_v", "raw_from", "raw_row0"), fresh, strict=True))
    if softcap is not None:
        extra["softcap"] = float(softcap)
    if sinks is not None:
        extra["sinks"] = sinks
    if latent:
        extra["latent"] = True
    out = native.paged_attention(queries.reshape(tokens, heads, dim), kv_pool, tables, seqs,
                                 lens, scale, meta.block_size, window or 0, kv_mode=kv_mode,
                                 rht_signs=rht_signs, chunk=chunk or 0, **extra)
    return out.reshape(tokens, heads, 1, dim)


@functools.cache
def _log_kernels() -> None:
    """Names, once per process, which kernel takes which rows (and the blocked one's ISA)."""
    import vllm_unified_native  # the extension itself: bridge.native_kernels() said it loads

    isa = getattr(vllm_unified_native, "attention_tile_isa", lambda: "")()
    if isa:
        logger.info("CPU paged attention: rows of prefill chunks by the blocked kernel (%s; "
                    "head sizes 64, 128, 256, dense pools), decode rows by the row kernel",
                    "AVX-512" if isa == "avx512" else "AVX2")
    else:
        logger.info("CPU paged attention: every row by the row kernel (no AVX2 or AVX-512, or "
                    "VLLM_UNIFIED_CPU_ISA=portable, or an extension built before the blocked "
                    "kernel)")


def takes(softcap: float | None, sinks: mx.array | None) -> bool:
    """Whether the native kernel computes these options: always without them; with them,
    only an extension built from sources that have them (an older build would refuse the
    arguments)."""
    return (softcap is None and sinks is None) or _has_logit_options()


@functools.cache
def takes_latent() -> bool:
    """Whether the native kernel has the latent (MLA) mode (an extension built before it had
    it is passed over for the reference, logged once)."""
    native = bridge.native_kernels()
    ok = native is not None and "latent" in (native.paged_attention.__doc__ or "")
    if native is not None and not ok:
        logger.warning("the native CPU attention kernel was built without the latent (MLA) "
                       "mode: MLA layers are attended by the pure-MLX reference (rebuild the "
                       "extension with scripts/setup.sh)")
    return ok


@functools.cache
def _has_logit_options() -> bool:
    native = bridge.native_kernels()
    ok = native is not None and "sinks" in (native.paged_attention.__doc__ or "")
    if not ok:
        logger.warning("the native CPU attention kernel was built without soft-capping and "
                       "sinks: layers that use them are attended by the pure-MLX reference "
                       "(rebuild the extension with scripts/setup.sh)")
    return ok
