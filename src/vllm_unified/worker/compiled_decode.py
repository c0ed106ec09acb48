"""Pure-decode steps as one compiled MLX function (``mx.compile``), on the CUDA and CPU backends.

Why: a decode step of a small model is bound by host work, not by the device: Python building
each layer's lazy graph (mlx-lm's model code, our cache protocol and attention routing) and MLX
encoding its hundreds of primitives (on CUDA, launching as many kernels; on the CPU, handing
each to the stream's thread). ``mx.compile`` traces the forward once per input shape and
afterwards replays the recorded graph from C++, so the Python per layer is gone and chains of
elementwise ops are fused into single kernels.

What makes this safe:

* every per-step value is an input of the compiled function, never a constant captured while
  tracing: token ids, positions, slot mapping, the decode rows' block tables and context
  lengths (:attr:`AttentionMetadata.decode_tables` / ``decode_lens``), the rows whose logits
  are wanted, and the KV pool arrays; the attention path used inside reads only those (the
  paged GPU kernel of :mod:`vllm_unified.kv.gpu.paged` in its decode form, which reads
  the decode tables and lengths only; the gather reference, which
  needs host-side tables, raises inside a trace instead of baking them in);
* the pools go in as inputs and come back as outputs: each layer's write returns
  ``mx.depends(pool, token)`` (:mod:`vllm_unified.kv.gpu.write`), so the attention of
  that layer, and the next step's write, stay ordered after the write exactly as without
  compilation;
* on the CPU the native KV write and paged attention kernel take the same traced inputs:
  the attention's block tables and lengths are the decode tables and lengths, each decode row
  its own sequence (:meth:`AttentionMetadata.row_tables_seqs_lens`);
* only steps whose every request has one query token take this path, and only with the
  in-place CUDA write and the paged GPU attention kernel, or the native CPU write and
  attention (not TurboQuant pools, whose fresh rows are laid out on the host); everything else
  runs the plain forward.

Shapes: one trace per number of decode rows ``T`` and block-table width (``shapeless=False``:
the kernels' launch grids depend on ``T``); the width is padded to a power of two
(:func:`padded_tables`), so a batch size sees a handful of widths over a server's life. MLX's
compile cache keeps every trace for the life of the process.

The step's metadata comes in as an argument and the traced forward runs under a step context
of its own, built from the traced inputs (:mod:`vllm_unified.kv.forward_context`); the pool's
arrays are replaced by the written ones the compiled function returns.

``VLLM_UNIFIED_COMPILE_DECODE=0`` turns it off (the plain forward for every step).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified.envs import COMPILE_DECODE_ENV
from vllm_unified.kv.attention.metadata import AttentionMetadata
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.layer_cache import PagedLayerCache
from vllm_unified.kv.pool import KVPool
from vllm_unified.worker.async_output import feed_pending

__all__ = ["COMPILE_DECODE_ENV", "CompiledDecode", "padded_tables"]


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
        pool: the KV pool the layer caches write to (its ``kv`` entries are replaced by the
            compiled function's outputs after each call).
        layer_caches: one :class:`PagedLayerCache` per layer over ``pool``.
        forward: ``forward(model, layer_caches, input_ids, rows) -> logits``, the runner's
            plain forward (traced once per shape).
        block_size: tokens per block of the step metadata (the kernel block size); default
            the pool's.
    """

    def __init__(self, model: Any, pool: KVPool, layer_caches: list[PagedLayerCache],
                 forward: Any, block_size: int | None = None) -> None:
        self._model = model
        self._pool = pool
        self._block_size = pool.block_size if block_size is None else block_size
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
        forward under a step context made of the inputs only."""
        num = host_ids.shape[0]
        self.traces.append(num)
        input_ids = mx.where(from_src > 0, fed, host_ids)
        meta = AttentionMetadata(
            num_tokens=num, positions=positions, slot_mapping=slots,
            block_size=self._block_size,
            query_start_loc=np.arange(num + 1, dtype=np.int32), decode_rows=slice(0, num),
            decode_seq_lens=None, decode_block_tables=None, prefills=(), output_order=None,
            decode_tables=tables, decode_lens=lens,
        )
        with set_step_context(StepContext(attn=meta, kv=list(kv))) as ctx:
            logits = self._forward(self._model, self._caches, input_ids, rows)
        return logits, ctx.kv

    def __call__(self, meta: AttentionMetadata, host_ids: np.ndarray, pending_rows: list,
                 rows: np.ndarray) -> mx.array:
        """Logits ``[R, V]`` of ``rows`` for the pure-decode step of ``meta`` (lazy; the
        pool's arrays are replaced by the written ones).

        Args:
            meta: the step's attention metadata (host-side fields set; on kernel blocks, whose
                size must be the pool's block size).
            host_ids: ``[T]`` int32 token ids known on the host (placeholders at pending rows).
            pending_rows: ``(row, (tokens, index))`` rows whose token is an earlier step's
                sampled (device) token (:func:`vllm_unified.worker.async_output.feed_pending`).
            rows: ``[R]`` rows whose logits are wanted.

        Every per-step integer input travels in ONE host-made array, cut into views: MLX's
        CUDA backend puts host-made arrays in managed memory, and each such array costs a
        page migration when the GPU first reads it.
        """
        pool = self._pool
        if meta.block_size != self._block_size:
            raise ValueError(f"metadata on {meta.block_size}-token blocks; this compiled "
                             f"decode was built for {self._block_size}-token blocks")
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
        pool.kv[:] = kv  # the cache's contents are the written arrays from now on
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
