"""Adapters for mlx-lm attention modules that compute attention themselves instead of calling
``scaled_dot_product_attention`` (so :mod:`vllm_unified.models.routing` cannot reach them).

An adapter replaces the module class's ``__call__`` with one that computes the same
projections and rotation, then attends through :func:`softcapped_sdpa`: the paged attention
for a :class:`~vllm_unified.kv.layer_cache.PagedLayerCache`, mlx-lm's own arithmetic for any
other cache (plain mlx-lm use in the same process is unchanged). :data:`ADAPTERS` lists them
by module and class; :func:`install_attention_adapters` installs those a model uses.

Llama 4 computes its attention through ``scaled_dot_product_attention`` but builds its
temperature-tuning scales and its chunk mask from a scalar cache offset; with a paged cache
(one position per token row) its attention takes per-row positions and its decoder leaves
the masks to the paged attention (each layer's cache carries its attention chunk). Other
caches keep mlx-lm's own code.

GPT-BigCode's decoder adds learned position embeddings from a scalar cache offset; AFM's
decoder hands its KV-reuse layers the last cache's keys and values, which with paged caches
are that layer's pages (a ``SharedLayerCache`` per reuse layer after the model's caches).
Their adapters take each row's position from the step and pass the shared caches.
Phixtral's decoder takes the mask from its caller (mlx-lm's ``Model.__call__`` builds it); its
adapter builds it from the first cache where none is given, so the runner calls the decoder
with ``cache=`` only, as it calls every other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from vllm_unified import patches
from vllm_unified.kv.forward_context import get_step_context
from vllm_unified.kv.layer_cache import MissingLayerCache, PagedLayerCache
from vllm_unified.models import routing

__all__ = ["ADAPTERS", "install_attention_adapters", "softcapped_sdpa"]


def softcapped_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                    scale: float, mask: Any, softcap: float) -> mx.array:
    """Attention with logit soft-capping (``softcap * tanh(scores / softcap)`` on the scaled
    scores, before the mask), ``[B, H, L, D]`` in and out.

    Paged through ``cache.attend(..., softcap=)`` for a paged cache; otherwise computed as
    mlx-lm's Gemma 2 does (a probe cache of :mod:`vllm_unified.models.capability` records the
    call as routed)."""
    if isinstance(cache, PagedLayerCache):
        return cache.attend(queries, scale, cache.window, fresh=(keys, values), softcap=softcap)
    record = getattr(cache, "probe_record", None)
    if record is not None:
        record.attends += 1
    return _dense_softcapped(queries, keys, values, scale, mask, softcap)


def _dense_softcapped(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: Any, softcap: float) -> mx.array:
    b, h, n, d = queries.shape
    kv_heads = keys.shape[1]
    q = (queries * scale).reshape(b, kv_heads, h // kv_heads, n, d)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str) and mask == "causal":
        offset = keys.shape[2] - n
        rows = mx.arange(offset, offset + n)[:, None]
        mask = rows >= mx.arange(keys.shape[2])[None]
    if isinstance(mask, mx.array):
        scores = (mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
                  if mask.dtype == mx.bool_ else scores + mask)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ mx.expand_dims(values, 2)).reshape(b, h, n, -1)


def _gemma2_attention(self: nn.Module, x: mx.array, mask: Any = None,
                      cache: Any = None) -> mx.array:
    """mlx-lm's Gemma 2 ``Attention.__call__`` with its attention through
    :func:`softcapped_sdpa`."""
    b, n, _ = x.shape
    queries = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset if cache is not None else 0
    queries = self.rope(queries, offset=offset)
    keys = self.rope(keys, offset=offset)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    out = softcapped_sdpa(queries, keys, values, cache, self.scale, mask,
                          self.attn_logit_softcapping)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _gear_attention(self: nn.Module, x: mx.array, mask: Any = None,
                    cache: Any = None) -> mx.array:
    """mlx-lm's Gear ``Attention.__call__`` (q/k norms before RoPE) with its soft-capped
    attention through :func:`softcapped_sdpa`."""
    b, n, _ = x.shape
    queries = self.q_norm(self.q_proj(x).reshape(b, n, self.n_heads, self.head_dim))
    keys = self.k_norm(self.k_proj(x).reshape(b, n, self.n_kv_heads, self.head_dim))
    queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
    values = self.v_proj(x).reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
    offset = cache.offset if cache is not None else 0
    queries = self.rope(queries, offset=offset)
    keys = self.rope(keys, offset=offset)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    if self.attn_logit_softcapping:
        out = softcapped_sdpa(queries, keys, values, cache, self.scale, mask,
                              self.attn_logit_softcapping)
    else:
        out = routing.paged_sdpa(queries, keys, values, cache, self.scale, mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _phi3small_attention(self: nn.Module, x: mx.array, mask: Any = None,
                         cache: Any = None) -> mx.array:
    """mlx-lm's Phi-3-small ``Attention.__call__`` with every layer's attention through
    :func:`~vllm_unified.models.routing.paged_sdpa`: its block-sparse layers attend to every
    earlier token while the context fits in their local blocks, which the config fix-up
    makes a condition of loading (:mod:`vllm_unified.models.config`). Caches that are neither
    paged nor the load-time probe's keep mlx-lm's own code."""
    if not isinstance(cache, PagedLayerCache) and getattr(cache, "probe_record", None) is None:
        return _ORIGINAL[("mlx_lm.models.phi3small", "Attention")](self, x, mask, cache)
    b, n, _ = x.shape
    qkv = self.query_key_value(x).reshape(b, n, -1, self.n_q_per_kv + 2, self.head_dim)
    queries = qkv[..., :-2, :].flatten(-3, -2).transpose(0, 2, 1, 3)
    keys = qkv[..., -2, :].transpose(0, 2, 1, 3)
    values = qkv[..., -1, :].transpose(0, 2, 1, 3)
    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    out = routing.paged_sdpa(queries, keys, values, cache, self.scale, mask)
    return self.dense(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _plamo_attention(self: nn.Module, hidden_states: mx.array,
                     attention_mask: Any = None, cache: Any = None) -> mx.array:
    """mlx-lm's PLaMo ``Attention.__call__`` over a paged cache: query head ``h`` attends
    with KV head ``h % k_num_heads`` (mlx-lm tiles the keys), where the paged attention pairs
    consecutive query heads with one KV head; the query heads are permuted into that order
    and the output back. Other caches keep mlx-lm's own code."""
    if not isinstance(cache, PagedLayerCache):
        return _ORIGINAL[("mlx_lm.models.plamo", "Attention")](self, hidden_states,
                                                               attention_mask, cache)
    b, n, _ = hidden_states.shape
    kv, group = self.k_num_heads, self.q_num_heads // self.k_num_heads
    queries = self.q_proj(hidden_states).reshape(b, n, self.q_num_heads, self.qk_dim)
    keys = self.k_proj(hidden_states).reshape(b, n, kv, self.qk_dim).transpose(0, 2, 1, 3)
    values = self.v_proj(hidden_states).reshape(b, n, kv, self.v_dim).transpose(0, 2, 1, 3)
    # head h = g * kv + k (tiled) -> k * group + g (grouped)
    queries = queries.reshape(b, n, group, kv, self.qk_dim).swapaxes(2, 3)
    queries = queries.reshape(b, n, self.q_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
    queries = self.rotary_emb(queries, offset=cache.offset)
    keys = self.rotary_emb(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    out = routing.paged_sdpa(queries, keys, values, cache, self.scale, attention_mask)
    out = out.transpose(0, 2, 1, 3).reshape(b, n, kv, group, self.v_dim).swapaxes(2, 3)
    return self.o_proj(out.reshape(b, n, -1))


def _llama4_attention(self: nn.Module, x: mx.array, mask: Any = None,
                      cache: Any = None) -> mx.array:
    """mlx-lm's Llama 4 ``Attention.__call__`` with its temperature tuning (NoPE layers:
    queries scaled by ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1`` at position
    p) computed per row where the cache's offset is one position per row."""
    b, n, _ = x.shape
    queries = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset if cache is not None else 0
    if self.use_rope:
        queries = self.rope(queries, offset=offset)
        keys = self.rope(keys, offset=offset)
    if self.use_qk_norm:
        queries = mx.fast.rms_norm(queries, weight=None, eps=1e-6)
        keys = mx.fast.rms_norm(keys, weight=None, eps=1e-6)
    if self.attn_temperature_tuning and not self.use_rope:
        # [B or 1, 1, n, 1]: row r's token i sits at position offset[r] + i
        pos = mx.reshape(mx.array(offset), (-1, 1, 1, 1)) + mx.arange(1, n + 1)[:, None]
        scales = mx.log(mx.floor(pos / self.floor_scale) + 1.0) * self.attn_scale + 1.0
        queries = (queries * scales).astype(queries.dtype)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    out = routing.paged_sdpa(queries, keys, values, cache, self.scale, mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _llama4_decoder(self: nn.Module, inputs: mx.array, cache: Any = None) -> mx.array:
    """mlx-lm's Llama 4 ``LlamaModel.__call__``; with paged caches its layers attend without
    dense masks (the paged attention applies causality and each layer's chunk)."""
    if cache is None or not any(isinstance(c, PagedLayerCache | MissingLayerCache)
                                for c in cache):
        return _ORIGINAL[("mlx_lm.models.llama4", "LlamaModel")](self, inputs, cache)
    h = self.embed_tokens(inputs)
    for layer, c in zip(self.layers, cache, strict=False):
        h = layer(h, None, cache=c)
    return self.norm(h)


def _plamo2_attention(self: nn.Module, hidden_states: mx.array, mask: Any = None,
                      cache: Any = None) -> mx.array:
    """mlx-lm's PLaMo 2 ``Attention.__call__`` (fused QKV, per-head q/k RMS norms with
    learned scales, RoPE) with its attention through :func:`routing.paged_sdpa`: mlx-lm
    calls ``mx.fast.scaled_dot_product_attention`` itself."""
    b, n, _ = hidden_states.shape
    qkv = self.qkv_proj(hidden_states)
    q, k, v = mx.split(qkv, [self.q_proj_dim, self.q_proj_dim + self.k_proj_dim], axis=-1)
    q = q.reshape(b, n, self.q_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
    k = k.reshape(b, n, self.k_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
    v = v.reshape(b, n, self.v_num_heads, self.v_dim).transpose(0, 2, 1, 3)
    q = mx.fast.rms_norm(q, weight=None, eps=1e-6) * self.q_weight[:, None]
    k = mx.fast.rms_norm(k, weight=None, eps=1e-6) * self.k_weight[:, None]
    offset = cache.offset if cache is not None else 0
    q = self.rope(q, offset=offset)
    k = self.rope(k, offset=offset)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    out = routing.paged_sdpa(q, k, v, cache, self.scale, mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _afm7_decoder(self: nn.Module, inputs: mx.array, cache: Any = None) -> mx.array:
    """mlx-lm's AFM ``AFMModel.__call__``; with paged caches its KV-reuse layers (after the
    layers with caches) attend over the last cached layer's pages: the runner passes one
    :class:`~vllm_unified.kv.layer_cache.SharedLayerCache` per reuse layer after the
    layers' own caches (:mod:`vllm_unified.models.capability`'s KV sharing)."""
    if cache is None or not any(isinstance(c, PagedLayerCache | MissingLayerCache)
                                for c in cache):
        return _ORIGINAL[("mlx_lm.models.afm7", "AFMModel")](self, inputs, cache)
    h = self.embedding(inputs)
    for layer, c in zip(self.layers, cache, strict=False):
        h = layer(h, None, cache=c)
    shared = cache[len(self.layers):]
    if len(shared) != len(self.kv_reuse_layers):
        raise ValueError(f"afm7: {len(shared)} shared caches for "
                         f"{len(self.kv_reuse_layers)} KV-reuse layers")
    for layer, c in zip(self.kv_reuse_layers, shared, strict=True):
        h = layer(h, c, c, None)  # keys and values: the pages the shared cache reads
    return self.output_norm(h)


def _afm7_reuse_attention(self: nn.Module, x: mx.array, keys: Any, values: Any,
                          mask: Any = None) -> mx.array:
    """mlx-lm's AFM ``KVReuseAttention.__call__``; given a paged cache for ``keys`` (from
    :func:`_afm7_decoder`), its queries take their rows' positions and attend over the
    cache's pages."""
    if not isinstance(keys, PagedLayerCache):
        return _ORIGINAL[("mlx_lm.models.afm7", "KVReuseAttention")](self, x, keys, values,
                                                                     mask)
    b, n, _ = x.shape
    queries = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
    queries = self.q_norm(self.rope(queries, offset=keys.offset))
    out = keys.attend(queries, self.scale, keys.window)
    return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _gpt_bigcode_decoder(self: nn.Module, inputs: mx.array, cache: Any = None) -> mx.array:
    """mlx-lm's GPT-BigCode ``GPTBigCodeModel.__call__``; with paged caches its learned
    position embeddings take each row's own positions (the cache offset is one per row)."""
    if cache is None or not any(isinstance(c, PagedLayerCache | MissingLayerCache)
                                for c in cache):
        return _ORIGINAL[("mlx_lm.models.gpt_bigcode", "GPTBigCodeModel")](self, inputs, cache)
    _, n = inputs.shape
    positions = get_step_context().attn.positions[:, None] + mx.arange(n)  # [T, n]
    h = self.wte(inputs) + self.wpe(positions)
    for layer, c in zip(self.h, cache, strict=False):
        h = layer(h, None, cache=c)
    return self.ln_f(h)


def _phixtral_decoder(self: nn.Module, x: mx.array, mask: Any = None,
                      cache: Any = None) -> mx.array:
    """mlx-lm's Phixtral ``TransformerDecoder.__call__`` with ``mask`` optional: when not
    given, it is built from the first cache as mlx-lm's ``Model.__call__`` builds it."""
    if mask is None:
        mask = create_attention_mask(x, cache[0] if cache else None)
    return _ORIGINAL[("mlx_lm.models.phixtral", "TransformerDecoder")](self, x, mask, cache)


def _deepseek_v41_decoder(self: nn.Module, inputs: mx.array, cache: Any = None) -> mx.array:
    """mlx-lm's DeepSeek-V4.1 ``TextModel.__call__`` over attention caches other than its own
    ``LayerCache`` (window-only models, :mod:`vllm_unified.models.cache_fixes`): each layer's
    positions are its cache's offset, and the window mask (a paged marker, or mlx-lm's mask
    for a rotating cache) goes to the attention in ``window_idx``'s place; the
    hyper-connection streams as mlx-lm computes them. No pipeline stages."""
    from mlx_lm.models import deepseek_v41

    if cache is None or isinstance(cache[0], deepseek_v41.LayerCache):
        return _ORIGINAL[("mlx_lm.models.deepseek_v41", "TextModel")](self, inputs, cache)
    h = self.embed_tokens(inputs)
    batch, length, dim = h.shape
    mask = create_attention_mask(h, cache[0], window_size=int(self.args.sliding_window))
    mult = int(self.args.hc_mult)
    streams = mx.broadcast_to(h[:, :, None, :], (batch, length, mult, dim))
    pre_mix = mx.zeros((batch, length, mult), dtype=mx.float32)
    pre_mix[..., 0] = 1.0
    for layer, c in zip(self.pipeline_layers, cache, strict=True):
        streams, pre_mix = layer(streams, pre_mix, start_pos=c.offset, window_idx=mask,
                                 cache=c, shared={})
    return self.norm(deepseek_v41._collapse(streams, pre_mix))


def _deepseek_v41_attention(self: nn.Module, x: mx.array, *, start_pos: Any,
                            window_idx: Any, cache: Any, shared: dict[str, Any]) -> mx.array:
    """mlx-lm's DeepSeek-V4.1 ``Attention.__call__`` of a window-only layer over an attention
    cache (from :func:`_deepseek_v41_decoder`: ``window_idx`` is the mask): one key/value
    head (keys are values: the normalised, rotated, fp8-rounded ``kv_proj`` rows), attention
    with sinks within the window, the output's rotary part rotated back. ``LayerCache``: mlx-lm's
    own code.

    Raises:
        TypeError: a compressed layer (``compress_ratios``) over another cache.
    """
    from mlx_lm.models import deepseek_v41 as v41

    if isinstance(cache, v41.LayerCache):
        return _ORIGINAL[("mlx_lm.models.deepseek_v41", "Attention")](
            self, x, start_pos=start_pos, window_idx=window_idx, cache=cache, shared=shared)
    if self.ratio:
        raise TypeError("deepseek_v41: a compressed attention layer needs mlx-lm's LayerCache")
    b, n, _ = x.shape
    q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).reshape(b, n, self.num_heads, -1)
    q = v41._apply_rope(q, self.rope, rope_dim=self.rope_dim, offset=start_pos)
    kv = self.kv_norm(self.kv_proj(x))[:, :, None, :]  # [B, L, 1, D]
    kv = v41._apply_rope(kv, self.rope, rope_dim=self.rope_dim, offset=start_pos)
    kv = v41._fake_quant_fp8(kv, 32).transpose(0, 2, 1, 3)  # [B, 1, L, D]
    keys, values = cache.update_and_fetch(kv, kv)
    out = routing.paged_sdpa(q.transpose(0, 2, 1, 3), keys, values, cache,
                             self.head_dim ** -0.5, window_idx, sinks=self.sinks)
    out = v41._apply_rope(out.transpose(0, 2, 1, 3), self.rope, rope_dim=self.rope_dim,
                          offset=start_pos, inverse=True)
    out = self.o_a_proj(out.reshape(b * n, self.o_groups, 1, -1), self._group_ids)
    return self.o_b_proj(out.reshape(b, n, -1))


def _deepseek_v32_decoder(self: nn.Module, x: mx.array, cache: Any = None) -> mx.array:
    """mlx-lm's DeepSeek-V3.2 ``DeepseekV32Model.__call__`` over one cache per layer (the
    MLA slot; :mod:`vllm_unified.models.cache_fixes`): the mask comes from the first cache
    (mlx-lm reads it from the first ``CacheList``'s latent cache). No pipeline stages."""
    from mlx_lm.models.cache import CacheList

    if cache is None or isinstance(cache[0], CacheList):
        return _ORIGINAL[("mlx_lm.models.deepseek_v32", "DeepseekV32Model")](self, x, cache)
    h = self.embed_tokens(x)
    mask = create_attention_mask(h, cache[0], return_array=True)
    for layer, c in zip(self.pipeline_layers, cache, strict=True):
        h = layer(h, mask, c)
    return self.norm(h)


def _longcat_flash_decoder(self: nn.Module, x: mx.array, cache: Any = None) -> mx.array:
    """mlx-lm's LongCat-Flash ``LongcatFlashModel.__call__`` over one cache per attention
    sublayer (:mod:`vllm_unified.models.cache_fixes`): layer i's two sublayers get caches 2i
    and 2i + 1; the mask comes from the first."""
    from mlx_lm.models.cache import CacheList

    if cache is None or isinstance(cache[0], CacheList):
        return _ORIGINAL[("mlx_lm.models.longcat_flash", "LongcatFlashModel")](self, x, cache)
    if len(cache) != 2 * len(self.layers):
        raise ValueError(f"longcat_flash: {len(cache)} caches for {len(self.layers)} layers "
                         "of two attention sublayers")
    h = self.embed_tokens(x)
    mask = create_attention_mask(h, cache[0], return_array=True)
    for i, layer in enumerate(self.layers):
        h = layer(h, mask, cache=(cache[2 * i], cache[2 * i + 1]))
    return self.norm(h)


#: (module, class) of an mlx-lm attention -> its adapted ``__call__``
ADAPTERS: dict[tuple[str, str], Callable[..., mx.array]] = {
    ("mlx_lm.models.gemma2", "Attention"): _gemma2_attention,
    ("mlx_lm.models.gear", "Attention"): _gear_attention,
    ("mlx_lm.models.phi3small", "Attention"): _phi3small_attention,
    ("mlx_lm.models.plamo", "Attention"): _plamo_attention,
    ("mlx_lm.models.llama4", "Attention"): _llama4_attention,
    ("mlx_lm.models.llama4", "LlamaModel"): _llama4_decoder,
    ("mlx_lm.models.plamo2", "Attention"): _plamo2_attention,
    ("mlx_lm.models.afm7", "AFMModel"): _afm7_decoder,
    ("mlx_lm.models.afm7", "KVReuseAttention"): _afm7_reuse_attention,
    ("mlx_lm.models.gpt_bigcode", "GPTBigCodeModel"): _gpt_bigcode_decoder,
    ("mlx_lm.models.phixtral", "TransformerDecoder"): _phixtral_decoder,
    ("mlx_lm.models.deepseek_v41", "TextModel"): _deepseek_v41_decoder,
    ("mlx_lm.models.deepseek_v41", "Attention"): _deepseek_v41_attention,
    ("mlx_lm.models.deepseek_v32", "DeepseekV32Model"): _deepseek_v32_decoder,
    ("mlx_lm.models.longcat_flash", "LongcatFlashModel"): _longcat_flash_decoder,
}

#: (module, class) -> mlx-lm's own ``__call__``, kept when its adapter is installed
_ORIGINAL: dict[tuple[str, str], Callable[..., mx.array]] = {}


def install_attention_adapters(model: nn.Module) -> list[str]:
    """Give every attention class of ``model`` listed in :data:`ADAPTERS` its adapted
    ``__call__`` (:func:`vllm_unified.patches.adapt_mlx_lm_attention_class`). Returns the
    ``module.Class`` names changed now, for the log."""
    installed = []
    for cls in {type(m) for m in model.modules()}:
        key = (cls.__module__, cls.__name__)
        adapted = ADAPTERS.get(key)
        if adapted is not None and cls.__call__ is not adapted:
            _ORIGINAL.setdefault(key, cls.__call__)
        if adapted is not None and patches.adapt_mlx_lm_attention_class(cls, adapted):
            installed.append(f"{cls.__module__}.{cls.__name__}")
    return sorted(installed)
