"""Route mlx-lm's layers to vLLM's paged KV cache and state pages; mlx-lm's files stay
untouched.

* Attention: every mlx-lm model module imports ``scaled_dot_product_attention`` from
  ``mlx_lm.models.base``; :func:`install_paged_attention` points that name at
  :func:`paged_sdpa` (the swap itself is :func:`vllm_unified.patches.route_mlx_lm_attention`).
  For a :class:`~vllm_unified.kv.layer_cache.PagedLayerCache` it runs the paged attention over
  the block tables; for any other cache it calls mlx-lm's original function, so plain mlx-lm
  use in the same process is unchanged.
* Recurrent layers of hybrid models: the mixer is wrapped in :class:`RecurrentMixer`, which
  runs once over all single-token (decode) sequences as a batch and once per multi-token
  (prefill chunk) sequence, each with its own state read from and written back to vLLM's
  state pages. A sequence whose chunk starts at position 0 starts from zero state whatever its
  slot holds (vLLM's ``has_initial_state``), so a slot reused after a finished, aborted or
  preempted request never leaks into the next one.

Both read the step's metadata from the bound step context
(:mod:`vllm_unified.kv.forward_context`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

from vllm_unified import patches
from vllm_unified.kv.forward_context import get_step_context
from vllm_unified.kv.hybrid import HYBRID_FAMILIES, recurrent_layers
from vllm_unified.kv.layer_cache import PagedLayerCache, PagedMask, StateLayerCache
from vllm_unified.models.attention_state import ConvStateAttention


def paged_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` signature, paged for a
    :class:`PagedLayerCache` (the layer's sliding window is the cache's), mlx-lm's own
    function for any other cache (a cache :func:`record_cache` marked records the call).
    ``sinks``: ``[H]`` attention sinks of any float dtype (gpt-oss), computed by every paged
    kernel.

    Raises:
        TypeError: a dense mask with a paged cache.
        ValueError: the mask's sliding window is not the layer's; sinks that are not ``[H]``
            for the queries' H heads.
    """
    if not isinstance(cache, PagedLayerCache):
        record = getattr(cache, "probe_record", None)
        if record is not None:
            record.attends += 1
            record.sinks = record.sinks or sinks is not None
        return patches.original_mlx_lm_sdpa()(queries, keys, values, cache, scale=scale,
                                              mask=mask, sinks=sinks)
    if mask is not None and not isinstance(mask, PagedMask):
        raise TypeError(f"unexpected attention mask {type(mask).__name__} with a paged cache")
    if isinstance(mask, PagedMask) and mask.window is not None and mask.window != cache.window:
        raise ValueError(f"the model asks for a sliding window of {mask.window} on a layer "
                         f"whose window is {cache.window}")
    # keys/values are this step's rows as the cache wrote them (update_and_fetch returns its
    # inputs): a prefill chunk with no earlier context attends to exactly these.
    return cache.attend(queries, scale, cache.window, fresh=(keys, values), sinks=sinks)


@dataclass
class CacheRecord:
    """What one mlx-lm cache saw in a probe forward: the ``(kv_heads, key_dim, value_dim)``
    of each ``update_and_fetch``, the number of :func:`paged_sdpa` calls, and whether any
    passed attention sinks."""

    writes: list[tuple[int, int, int]] = field(default_factory=list)
    attends: int = 0
    sinks: bool = False


def record_cache(cache: Any) -> CacheRecord:
    """Make the mlx-lm cache ``cache`` record its use into the returned :class:`CacheRecord`
    (its class becomes a recording subclass of its own; behaviour is unchanged)."""
    record = CacheRecord()
    cache.__class__ = _recording_class(type(cache))
    cache.probe_record = record
    return record


_RECORDING: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    if cls not in _RECORDING:
        def update_and_fetch(self: Any, keys: mx.array, values: mx.array) -> Any:
            self.probe_record.writes.append((keys.shape[1], keys.shape[-1], values.shape[-1]))
            return cls.update_and_fetch(self, keys, values)

        _RECORDING[cls] = type(f"Recording{cls.__name__}", (cls,),
                               {"update_and_fetch": update_and_fetch})
    return _RECORDING[cls]


def install_paged_attention(model: Any) -> list[str]:
    """Route the attention of every module that defines a layer of ``model`` to
    :func:`paged_sdpa` (an architecture built from another's layers is covered too); whether
    each attention layer really computes through it is checked by the load-time probe
    (:mod:`vllm_unified.models.capability`).

    Idempotent. Returns the names of the modules patched, for the log.
    """
    names = sorted({type(m).__module__ for m in model.modules()})
    return patches.route_mlx_lm_attention(names, paged_sdpa)


def install_recurrent_mixers(model_type: str, model: nn.Module) -> list[int]:
    """Wrap each recurrent layer's mixer in :class:`RecurrentMixer` (idempotent; this changes
    the model instance, not mlx-lm).

    Returns:
        The recurrent layer indices (empty for a model type that is not hybrid).
    """
    family = HYBRID_FAMILIES.get(model_type)
    layers = recurrent_layers(model_type, model)
    for i in layers:
        layer = model.layers[i]
        mixer = getattr(layer, family.mixer) if family.mixer else layer
        if isinstance(mixer, RecurrentMixer | ConvStateAttention):
            continue
        wrapped = (ConvStateAttention(mixer) if family.state_in_attention
                   else RecurrentMixer(mixer, family.fresh_is_none, family.start_position,
                                       _StateLayout(family.to_mixer, family.from_mixer)))
        if family.mixer:
            setattr(layer, family.mixer, wrapped)
        else:  # the decoder layer is the mixer (its own list entry is replaced)
            model.layers[i] = wrapped
    return layers


class _SegmentCache(ArraysCache):
    """mlx-lm's ``ArraysCache`` for one segment (``cache[i]``, ``lengths``, ``advance``),
    holding the states the wrapped mixer reads and replaces. An ``ArraysCache`` because some
    mixers (mlx-lm's Mamba) store their new states only into one."""

    def __init__(self, states: list[mx.array]) -> None:
        super().__init__(len(states))
        self.cache = list(states)

    def advance(self, n: int) -> None:
        """Positions are not tracked here (the attention metadata has them)."""


@dataclass(frozen=True)
class _StateLayout:
    """A family's translation between vLLM's state fields and its mixer's cache entries
    (:attr:`vllm_unified.kv.hybrid.HybridFamily.to_mixer`); None: the same arrays."""

    to_mixer: Any = None
    from_mixer: Any = None


class _MixerPages:
    """``pages`` (:class:`~vllm_unified.kv.state_pages.StatePages`) read and written as the
    mixer's cache entries (``layout``); ``entries``: how many the mixer keeps."""

    def __init__(self, pages: Any, layout: _StateLayout) -> None:
        self.pages, self.layout = pages, layout

    @functools.cached_property
    def entries(self) -> int:
        if self.layout.to_mixer is None:
            return len(self.pages.fields)
        # the count only: built lazily, never evaluated
        zeros = [mx.zeros((1, *f.shape), dtype=f.dtype) for f in self.pages.fields]
        return len(self.layout.to_mixer(zeros))

    def read(self, slots: mx.array) -> list[mx.array]:
        states = self.pages.read(slots)
        return self.layout.to_mixer(states) if self.layout.to_mixer else states

    def write(self, slots: mx.array, states: list[mx.array]) -> None:
        self.pages.write(slots, self.layout.from_mixer(states) if self.layout.from_mixer
                         else states)


class RecurrentMixer(nn.Module):
    """Wraps an mlx-lm recurrent mixer (called with its input, ``cache`` over an
    ``ArraysCache`` and, where it takes one, ``mask``, positionally or by name in the mixer's
    own order: ``mixer(x, mask, cache)``, Mamba's ``mixer(x, cache)``, Falcon-H1's
    ``mixer(input_states=, cache=, mask=)``) so it runs on the token-major batch with states
    in vLLM's pages. Other caches pass through. ``fresh_is_none``: a sequence's first tokens
    see unset (None) cache entries instead of zero states
    (:attr:`vllm_unified.kv.hybrid.HybridFamily.fresh_is_none`). ``start_position``: the
    mixer's argument that gets each segment's first position in its sequence (an int32 ``[B]``
    array: one per decode row, ``[1]`` for a prefill chunk) in place of the model's value
    (:attr:`vllm_unified.kv.hybrid.HybridFamily.start_position`).

    Any other argument is a per-token side input: an array of the input's ``[T, 1, ...]``
    rows is split over the segments like the input (RWKV-7's ``v_first``); None passes
    as is. A mixer returning a tuple (RWKV-7's ``(out, v_first)``) has each array of it
    gathered back into ``[T, 1, ...]`` rows like the output.

    Raises:
        TypeError: the mixer's ``__call__`` takes no ``cache`` (or no ``start_position``).
    """

    def __init__(self, inner: nn.Module, fresh_is_none: bool = False,
                 start_position: str | None = None,
                 layout: _StateLayout | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.fresh_is_none = fresh_is_none
        self.start_position = start_position
        #: vLLM's state fields <-> the mixer's cache entries
        self.layout = layout or _StateLayout()
        params = list(inspect.signature(type(inner).__call__).parameters)[1:]
        if "cache" not in params:
            raise TypeError(f"{type(inner).__name__}: a recurrent mixer takes its input and "
                            f"'cache' (its parameters: {params})")
        if start_position is not None and start_position not in params:
            raise TypeError(f"{type(inner).__name__}: no {start_position!r} argument for the "
                            f"sequences' start positions (its parameters: {params})")
        #: the mixer's parameter names: input, then the others in order
        self._params = params

    def _call(self, x: mx.array, mask: Any, cache: Any,
              extra: dict[str, Any] | None = None) -> Any:
        kwargs = {self._params[0]: x, "cache": cache, **(extra or {})}
        if "mask" in self._params:
            kwargs["mask"] = mask
        return self.inner(**kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(self._params, args, strict=False)) | kwargs
        x, mask, cache = bound[self._params[0]], bound.get("mask"), bound.get("cache")
        extra = {k: v for k, v in bound.items() if k not in (self._params[0], "mask", "cache")}
        if not isinstance(cache, StateLayerCache):
            return self._call(x, mask, cache, extra)
        if mask is not None and not isinstance(mask, PagedMask):
            # a model handing every layer the attention layers' mask passes the paged marker
            raise TypeError("a recurrent layer on vLLM's state pages takes no mask")
        pages = _MixerPages(cache.pages, self.layout)
        ctx = get_step_context()
        meta, attn = ctx.state, ctx.attn
        if meta is None:
            raise RuntimeError("recurrent state used in a step without state metadata")
        if self.start_position is not None:
            # mlx-lm's model hands every row one offset; each segment gets its own below
            extra.pop(self.start_position, None)
        outs, slots, new_states = [], [], []
        if attn.decode_rows is not None:
            idx = meta.decode_slots[cache.group]
            fresh = meta.decode_fresh if self.fresh_is_none else []
            rows = attn.decode_rows
            rows_extra = self._with_start(_map_rows(extra, lambda a: a[rows]),
                                          attn.positions[rows])
            if not fresh:
                states = _initial(pages.read(idx), meta.decode_has_state)
                seg = _SegmentCache(states)
                outs.append(self._call(x[rows], None, seg, rows_extra))  # [Bd, 1, D]
                slots.append(idx)
                new_states.append(seg.cache)
            else:
                outs.append(self._decode_with_fresh(x[rows], rows_extra, idx, fresh, pages,
                                                    slots, new_states))
        for i, chunk in enumerate(attn.prefills):
            idx = mx.array([meta.prefill_slots[cache.group][i]], dtype=mx.int32)
            states = pages.read(idx)
            if not meta.prefill_has_state[i]:
                states = ([None] * len(states) if self.fresh_is_none
                          else [mx.zeros_like(s) for s in states])
            seg = _SegmentCache(states)

            def segment(a: mx.array, chunk: Any = chunk) -> mx.array:  # [L, 1, ..] -> [1, L, ..]
                return a[chunk.start:chunk.start + chunk.length].swapaxes(0, 1)

            out = self._call(segment(x), None, seg, self._with_start(
                _map_rows(extra, segment), attn.positions[chunk.start:chunk.start + 1]))
            outs.append(_map_rows(out, lambda a: a.swapaxes(0, 1)))
            slots.append(idx)
            new_states.append(seg.cache)
        if not outs:
            # no rows: a mixer with side inputs hands them on after its output (RWKV-7)
            return (x, *extra.values()) if extra else x
        pages.write(mx.concatenate(slots),
                    [mx.concatenate([s[f] for s in new_states])
                     for f in range(len(new_states[0]))])
        order = attn.output_order
        return _gather_rows(outs, None if order is None else lambda a: a[order])

    def _with_start(self, extra: dict[str, Any], starts: mx.array) -> dict[str, Any]:
        """``extra`` plus the segment's start positions ``starts`` where the mixer takes
        them."""
        if self.start_position is None:
            return extra
        return {**extra, self.start_position: starts}

    def _decode_with_fresh(self, x: mx.array, extra: dict[str, Any], idx: mx.array,
                           fresh: list[int], pages: Any, slots: list[mx.array],
                           new_states: list[list[mx.array]]) -> Any:
        """The single-token rows ``x`` ``[Bd, 1, D]`` (side inputs ``extra`` alike) where rows
        ``fresh`` start their sequence: those in one call with unset states, the others in
        one with their slots' states. Appends both calls' slots and states; returns the
        outputs in row order."""
        fresh_set = set(fresh)
        rest = [r for r in range(x.shape[0]) if r not in fresh_set]
        order, outs = [], []
        for rows, from_pages in ((rest, True), (fresh, False)):
            if not rows:
                continue
            sel = mx.array(rows, dtype=mx.int32)
            states = pages.read(idx[sel]) if from_pages else [None] * pages.entries
            seg = _SegmentCache(states)
            outs.append(self._call(x[sel], None, seg,
                                   _map_rows(extra, lambda a, sel=sel: a[sel])))
            slots.append(idx[sel])
            new_states.append(seg.cache)
            order += rows
        back = mx.array(np.argsort(order), dtype=mx.int32)
        return _gather_rows(outs, lambda a: a[back])


def _map_rows(value: Any, fn: Any) -> Any:
    """``fn`` applied to each array of ``value`` (an array, or a dict or tuple of arrays and
    other values, which pass unchanged)."""
    if isinstance(value, mx.array):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_rows(v, fn) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_map_rows(v, fn) for v in value)
    return value


def _gather_rows(outs: list[Any], reorder: Any) -> Any:
    """The segments' outputs ``outs`` (arrays, or tuples of arrays and Nones) joined along the
    token axis, then ``reorder``-ed (None: kept in segment order)."""
    first = outs[0]
    if isinstance(first, tuple):
        return tuple(_gather_rows([o[j] for o in outs], reorder) if first[j] is not None
                     else None for j in range(len(first)))
    out = mx.concatenate(outs) if len(outs) > 1 else first
    return out if reorder is None else reorder(out)


def _initial(states: list[mx.array], has_state: mx.array | None) -> list[mx.array]:
    """Zero the states of sequences at position 0 (their slot may hold an old request's)."""
    if has_state is None:
        return states
    return [mx.where(has_state.reshape(-1, *([1] * (s.ndim - 1))), s, mx.zeros_like(s))
            for s in states]
