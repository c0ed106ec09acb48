"""Attention layers that keep a recurrent state of their own, on vLLM's state pages.

Baichuan-M1's attention convolves its keys and values over time (a kernel of two: each
token's key mixes in the previous token's raw key), and keeps the last raw key and value of a
sequence in an ``ArraysCache`` next to its KV cache (mlx-lm's ``CacheList(ArraysCache,
KVCache)``). In the token-major forward every token is its own batch row with one query
token, so the module's convolution reads "the previous token" from that state: here each row
gets the raw key and value of the row before it in its sequence, or, for a sequence's first
row in the step, its state page (zeros at position 0). After the layer the last raw key and
value of every sequence go back to its page. The module's own code computes everything else.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_unified.kv.forward_context import get_step_context
from vllm_unified.kv.layer_cache import LayerCacheList, StateLayerCache

__all__ = ["ConvStateAttention"]


class _ReusedProjection(nn.Module):
    """A projection that returns the output computed for the same input array once more
    (:meth:`ConvStateAttention.__call__` needs it before the module computes it)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._last: tuple[mx.array, mx.array] | None = None

    def remember(self, x: mx.array) -> mx.array:
        out = self.inner(x)
        self._last = (x, out)
        return out

    def __call__(self, x: mx.array) -> mx.array:
        last, self._last = self._last, None
        if last is not None and last[0] is x:
            return last[1]
        return self.inner(x)


class _PreviousRows:
    """The module's view of its ``ArraysCache`` in a paged step: ``[0]`` / ``[1]`` are each
    row's previous raw key / value ``[T, Hkv, 1, D]``; what the module stores back is ignored
    (the wrapper writes the pages)."""

    def __init__(self, previous: list[mx.array]) -> None:
        self.previous = previous

    def __getitem__(self, i: int) -> mx.array:
        return self.previous[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        pass


class ConvStateAttention(nn.Module):
    """Wraps an mlx-lm attention module that convolves keys and values over time with its own
    state (Baichuan-M1's ``Attention``: ``W_pack`` projections, ``num_kv_heads``,
    ``head_dim``; called as ``attn(x, mask, cache)`` with ``cache[0]`` its state and
    ``cache[1]`` its KV cache). Other caches pass through to the module."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        if not isinstance(inner.W_pack, _ReusedProjection):
            inner.W_pack = _ReusedProjection(inner.W_pack)
        self.inner = inner

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not (isinstance(cache, LayerCacheList) and isinstance(cache[0], StateLayerCache)):
            return self.inner(x, mask, cache)
        state, attention = cache[0], cache[1]
        ctx = get_step_context()
        meta, attn = ctx.state, ctx.attn
        if meta is None:
            raise RuntimeError("recurrent state used in a step without state metadata")
        t, d = x.shape[0], x.shape[-1]
        heads, dim = self.inner.num_kv_heads, self.inner.head_dim
        proj = self.inner.W_pack.remember(x)  # [T, 1, D + 2 * Hkv * dim]
        _, k, v = mx.split(proj, (d, d + heads * dim), axis=-1)
        raw = [a.reshape(t, 1, heads, dim).transpose(0, 2, 1, 3) for a in (k, v)]
        starts = attn.query_start_loc
        qlens = np.diff(starts)
        # state rows: the decode sequences, then the prefill chunks (the state metadata's
        # order), each sequence's slot
        seqs = np.concatenate([np.flatnonzero(qlens == 1), np.flatnonzero(qlens > 1)])
        group = state.group
        slots = [meta.decode_slots[group]] if attn.decode_rows is not None else []
        if meta.prefill_slots[group]:
            slots.append(mx.array(meta.prefill_slots[group], dtype=mx.int32))
        slots = mx.concatenate(slots) if len(slots) > 1 else slots[0]
        has = [meta.decode_has_state] if meta.decode_has_state is not None else []
        if meta.prefill_has_state:
            has.append(mx.array(meta.prefill_has_state))
        has = mx.concatenate(has) if len(has) > 1 else has[0]
        stored = [mx.where(has[:, None, None, None], s, mx.zeros_like(s))
                  for s in state.pages.read(slots)]
        # each row's previous raw row: the row before it, or its sequence's state row
        state_row = np.empty(len(qlens), dtype=np.int64)
        state_row[seqs] = np.arange(len(seqs))
        prev = np.arange(t) - 1
        prev[starts[:-1]] = t + state_row
        index = mx.array(prev.astype(np.int32))
        previous = [mx.concatenate([r, s.astype(r.dtype)])[index]
                    for r, s in zip(raw, stored, strict=True)]
        out = self.inner(x, mask, (_PreviousRows(previous), attention))
        last = mx.array((starts[1:] - 1)[seqs].astype(np.int32))
        state.pages.write(slots, [r[last] for r in raw])
        return out
