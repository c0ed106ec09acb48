"""Pure-decode steps as one compiled MLX function (``mx.compile``), on the CUDA backend.

Why: on the H200 a decode step of a 28-layer model is bound by host work, not by the GPU:
Python building each layer's lazy graph (mlx-lm's model code, our cache protocol and attention
routing: 1.8-3.2 ms per step) and MLX encoding and launching its ~500 kernels. ``mx.compile``
traces the forward once per input shape and afterwards replays the recorded graph from C++,
so the Python per layer is gone and chains of elementwise ops are fused into single kernels.

What makes this safe:

* every per-step value is an input of the compiled function, never a constant captured while
  tracing: token ids, positions, slot mapping, the decode rows' block tables and context
  lengths (:attr:`AttentionMetadata.decode_tables` / ``decode_lens``), the rows whose logits
  are wanted, and the KV pool arrays; the attention path used inside reads only those (the
  CUDA decode kernel of :mod:`vllm_unified.attention.cuda_decode`; the gather reference, which
  needs host-side tables, raises inside a trace instead of baking them in);
* the pools go in as inputs and come back as outputs: each layer's write returns
  ``mx.depends(pool, token)`` (:mod:`vllm_unified.attention.gpu_write`), so the attention of
  that layer, and the next step's write, stay ordered after the write exactly as without
  compilation;
* only steps whose every request has one query token take this path, and only with the
  in-place CUDA write and the CUDA decode kernel; everything else runs the plain forward.

Shapes: one trace per number of decode rows ``T`` and block-table width (``shapeless=False``:
the kernels' launch grids depend on ``T``); the width is padded to a power of two
(:func:`padded_tables`), so a batch size sees a handful of widths over a server's life. MLX's
compile cache keeps every trace for the life of the process.

``VLLM_UNIFIED_COMPILE_DECODE=0`` turns it off (the plain forward for every step).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified.attention.metadata import AttentionMetadata
from vllm_unified.models.paged_cache import KVPool, PagedLayerCache
from vllm_unified.worker.async_output import feed_pending

#: Set to 0 to build every decode step's graph in Python (no ``mx.compile``).
COMPILE_DECODE_ENV = "VLLM_UNIFIED_COMPILE_DECODE"


def compile_decode_enabled() -> bool:
    """``VLLM_UNIFIED_COMPILE_DECODE`` is not ``0`` (the default is on).

    Raises:
        ValueError: the variable is set to something other than 0 or 1.
    """
    raw = os.environ.get(COMPILE_DECODE_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{COMPILE_DECODE_ENV}={raw!r}: expected 0 or 1")
    return raw == "1"


def is_pure_decode(meta: AttentionMetadata) -> bool:
    """Every row of the step is a decode row (one query token per request), in order."""
    return (meta.decode_rows is not None and not meta.prefills and meta.output_order is None
            and meta.num_tokens > 0)


def padded_tables(tables: np.ndarray) -> np.ndarray:
    """``[T, max_blocks]`` block tables widened with zeros to a power of two of columns.

    The runner's tables are as wide as the longest context needs, which grows by one column
    every ``block_size`` tokens; a compiled step is traced once per input shape, so padding
    keeps the number of traces per batch size logarithmic in the context length. Columns past
    a sequence's blocks are never read (the decode kernel stops at its length)."""
    rows, cols = tables.shape
    width = 1 << max(cols - 1, 0).bit_length()
    out = np.zeros((rows, width), np.int32)
    out[:, :cols] = tables
    return out


class CompiledDecode:
    """The forward of pure-decode steps, compiled.

    Args:
        model: the mlx-lm model, paged attention installed.
        pool: the KV pool the layer caches write to (its ``kv`` list is rebound to the
            compiled function's outputs after each call).
        layer_caches: one :class:`PagedLayerCache` per layer over ``pool``.
        forward: ``forward(model, layer_caches, input_ids, rows) -> logits``, the runner's
            plain forward (traced once per shape).
    """

    def __init__(self, model: Any, pool: KVPool, layer_caches: list[PagedLayerCache],
                 forward: Any) -> None:
        self._model = model
        self._pool = pool
        self._caches = layer_caches
        self._forward = forward
        self._fn = mx.compile(self._trace)
        #: the number of decode rows of each trace so far, in order (one per shape)
        self.traces: list[int] = []

    def _trace(self, fed: mx.array, host_ids: mx.array, from_src: mx.array,
               positions: mx.array, slots: mx.array, lens: mx.array, rows: mx.array,
               tables: mx.array, kv: list[mx.array]) -> tuple[mx.array, list[mx.array]]:
        """Runs once per shape, on MLX's tracer arrays: the token ids (row r takes ``fed[r]``,
        an earlier step's token, where ``from_src[r]``, else ``host_ids[r]``), then the plain
        forward over a metadata object and pool arrays made of the inputs only."""
        pool, num = self._pool, host_ids.shape[0]
        self.traces.append(num)
        input_ids = mx.where(from_src > 0, fed, host_ids)
        saved_kv, saved_meta = pool.kv, pool.meta
        pool.meta = AttentionMetadata(
            num_tokens=num, positions=positions, slot_mapping=slots,
            block_size=saved_meta.block_size,
            query_start_loc=np.arange(num + 1, dtype=np.int32), decode_rows=slice(0, num),
            decode_seq_lens=None, decode_block_tables=None, prefills=(), output_order=None,
            decode_tables=tables, decode_lens=lens,
        )
        pool.kv = list(kv)
        try:
            logits = self._forward(self._model, self._caches, input_ids, rows)
            return logits, list(pool.kv)
        finally:
            pool.kv, pool.meta = saved_kv, saved_meta

    def __call__(self, host_ids: np.ndarray, pending_rows: list, rows: np.ndarray
                 ) -> mx.array:
        """Logits ``[R, V]`` of ``rows`` for the pure-decode step whose metadata is
        ``pool.meta`` (lazy; the pool's arrays are rebound to the written ones).

        Args:
            host_ids: ``[T]`` int32 token ids known on the host (placeholders at pending rows).
            pending_rows: ``(row, (tokens, index))`` rows whose token is an earlier step's
                sampled (device) token (:func:`vllm_unified.worker.async_output.feed_pending`).
            rows: ``[R]`` rows whose logits are wanted.

        Every per-step integer input travels in ONE host-made array, cut into views: MLX's
        CUDA backend puts host-made arrays in managed memory, and each such array costs a
        page migration when the GPU first reads it.
        """
        pool = self._pool
        meta = pool.meta
        num = meta.num_tokens
        src, src_index, from_src = self._pending_source(host_ids, pending_rows, num)
        tables = padded_tables(meta.decode_block_tables)
        parts = [np.asarray(host_ids, np.int32), src_index, from_src, meta.host_positions,
                 meta.host_slot_mapping, meta.decode_seq_lens.astype(np.int32),
                 np.asarray(rows, np.int32), tables.reshape(-1)]
        packed = mx.array(np.concatenate(parts))
        views, start = [], 0
        for part in parts:
            views.append(packed[start:start + part.size])
            start += part.size
        views[-1] = views[-1].reshape(tables.shape)
        host, index = views[0], views[1]
        # The earlier step's tokens are gathered outside the compiled graph, so its shape
        # (that step's number of sampled rows) does not key the traces.
        fed = host if src is None else src[index].astype(mx.int32)
        logits, kv = self._fn(fed, host, *views[2:], pool.kv)
        pool.kv = list(kv)
        return logits

    @staticmethod
    def _pending_source(host_ids: np.ndarray, pending_rows: list, num: int
                        ) -> tuple[mx.array | None, np.ndarray, np.ndarray]:
        """``(src, src_index, from_src)`` for the token ids: the one earlier token array all
        pending rows read from (the usual case: the previous step's), or, when they read from
        several, the ids assembled by ``feed_pending`` as the source of every row; None when
        no row is pending."""
        src_index = np.zeros(num, np.int32)
        from_src = np.zeros(num, np.int32)
        if not pending_rows:
            return None, src_index, from_src
        sources = {id(tokens): tokens for _, (tokens, _) in pending_rows}
        if len(sources) > 1:
            ids = feed_pending(mx.array(host_ids), pending_rows)
            return ids, np.arange(num, dtype=np.int32), np.ones(num, np.int32)
        for row, (_, index) in pending_rows:
            src_index[row] = index
            from_src[row] = 1
        return next(iter(sources.values())), src_index, from_src
