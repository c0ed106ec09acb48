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

import sys
from collections.abc import Collection
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_unified import patches
from vllm_unified.kv.forward_context import get_step_context
from vllm_unified.kv.hybrid import HYBRID_FAMILIES, recurrent_layers
from vllm_unified.kv.layer_cache import PagedLayerCache, PagedMask, StateLayerCache


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
    :class:`PagedLayerCache`, mlx-lm's own function for any other cache. ``sinks``: ``[H]``
    attention sinks of any float dtype (gpt-oss), computed by every paged kernel.

    Raises:
        TypeError: a dense mask with a paged cache.
        ValueError: sinks that are not ``[H]`` for the queries' H heads.
    """
    if not isinstance(cache, PagedLayerCache):
        return patches.original_mlx_lm_sdpa()(queries, keys, values, cache, scale=scale,
                                              mask=mask, sinks=sinks)
    if mask is not None and not isinstance(mask, PagedMask):
        raise TypeError(f"unexpected attention mask {type(mask).__name__} with a paged cache")
    window = mask.window if isinstance(mask, PagedMask) else None
    # keys/values are this step's rows as the cache wrote them (update_and_fetch returns its
    # inputs): a prefill chunk with no earlier context attends to exactly these.
    return cache.attend(queries, scale, window, fresh=(keys, values), sinks=sinks)


def install_paged_attention(model: Any, recurrent: Collection[int] = ()) -> list[str]:
    """Route the attention of every module that defines a layer of ``model`` to
    :func:`paged_sdpa` (an architecture built from another's layers is covered too).

    ``recurrent``: indices of layers without attention here: state-space layers (hybrid
    models) and layers another pipeline stage holds.
    Idempotent. Returns the names of the modules patched, for the log.

    Raises:
        ValueError: an attention layer that does not compute attention through mlx-lm's
            ``scaled_dot_product_attention`` (it could not be routed).
    """
    names = sorted({type(m).__module__ for m in model.modules()})
    patched = patches.route_mlx_lm_attention(names, paged_sdpa)
    for i, layer in enumerate(model.layers):
        if i in recurrent:
            continue
        attn = getattr(layer, "self_attn", None)
        module = sys.modules.get(type(attn).__module__) if attn is not None else None
        if getattr(module, "scaled_dot_product_attention", None) is not paged_sdpa:
            raise ValueError(
                f"layer {i} ({type(layer).__name__}) does not compute attention through mlx-lm's "
                "scaled_dot_product_attention, so it cannot be routed to the paged KV cache"
            )
    return patched


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
        mixer = getattr(layer, family.mixer)
        if not isinstance(mixer, RecurrentMixer):
            setattr(layer, family.mixer, RecurrentMixer(mixer))
    return layers


class _SegmentCache:
    """mlx-lm's ``ArraysCache`` protocol for one segment (``cache[i]``, ``lengths``,
    ``advance``), holding the states the wrapped mixer reads and replaces."""

    def __init__(self, states: list[mx.array]) -> None:
        self.cache = list(states)
        self.lengths = None
        self.left_padding = None

    def __getitem__(self, i: int) -> mx.array:
        return self.cache[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.cache[i] = value

    def advance(self, n: int) -> None:
        """Positions are not tracked here (the attention metadata has them)."""


class RecurrentMixer(nn.Module):
    """Wraps an mlx-lm recurrent mixer (``mixer(x, mask, cache)`` over an ``ArraysCache``) so
    it runs on the token-major batch with states in vLLM's pages. Other caches pass through."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, StateLayerCache):
            return self.inner(x, mask, cache)
        if mask is not None:
            raise TypeError("a recurrent layer on vLLM's state pages takes no mask")
        pages = cache.pages
        ctx = get_step_context()
        meta, attn = ctx.state, ctx.attn
        if meta is None:
            raise RuntimeError("recurrent state used in a step without state metadata")
        outs, slots, new_states = [], [], []
        if attn.decode_rows is not None:
            idx = meta.decode_slots[cache.group]
            states = _initial(pages.read(idx), meta.decode_has_state)
            seg = _SegmentCache(states)
            outs.append(self.inner(x[attn.decode_rows], None, seg))  # [Bd, 1, D]
            slots.append(idx)
            new_states.append(seg.cache)
        for i, chunk in enumerate(attn.prefills):
            idx = mx.array([meta.prefill_slots[cache.group][i]], dtype=mx.int32)
            states = pages.read(idx)
            if not meta.prefill_has_state[i]:
                states = [mx.zeros_like(s) for s in states]
            seg = _SegmentCache(states)
            xs = x[chunk.start:chunk.start + chunk.length].transpose(1, 0, 2)  # [1, L, D]
            outs.append(self.inner(xs, None, seg).transpose(1, 0, 2))
            slots.append(idx)
            new_states.append(seg.cache)
        if not outs:
            return x
        pages.write(mx.concatenate(slots),
                    [mx.concatenate([s[f] for s in new_states]) for f in range(len(pages.fields))])
        out = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        return out if attn.output_order is None else out[attn.output_order]


def _initial(states: list[mx.array], has_state: mx.array | None) -> list[mx.array]:
    """Zero the states of sequences at position 0 (their slot may hold an old request's)."""
    if has_state is None:
        return states
    return [mx.where(has_state.reshape(-1, *([1] * (s.ndim - 1))), s, mx.zeros_like(s))
            for s in states]
