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

Shapes: one trace per number of decode rows ``T`` (``shapeless=False``: the kernels' launch
grids depend on ``T``), kept by MLX's compile cache for the life of the process.

``VLLM_UNIFIED_COMPILE_DECODE=0`` turns it off (the plain forward for every step).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified.attention.metadata import AttentionMetadata
from vllm_unified.models.paged_cache import KVPool, PagedLayerCache

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

    def _trace(self, input_ids: mx.array, positions: mx.array, slots: mx.array,
               tables: mx.array, lens: mx.array, rows: mx.array, kv: list[mx.array]
               ) -> tuple[mx.array, list[mx.array]]:
        """Runs once per shape, on MLX's tracer arrays: the plain forward over a metadata
        object and pool arrays made of the inputs only."""
        pool, num = self._pool, input_ids.shape[0]
        self.traces.append(num)
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

    def __call__(self, input_ids: mx.array, rows: np.ndarray) -> mx.array:
        """Logits ``[R, V]`` of ``rows`` for the pure-decode step whose metadata is
        ``pool.meta`` (lazy; the pool's arrays are rebound to the written ones)."""
        pool = self._pool
        meta = pool.meta
        tables, lens = meta.decode_tables_lens()
        logits, kv = self._fn(input_ids, meta.positions, meta.slot_mapping, tables, lens,
                              mx.array(np.asarray(rows, dtype=np.int32)), pool.kv)
        pool.kv = list(kv)
        return logits
