"""Multi-head latent attention (MLA) of mlx-lm's models on vLLM's MLA pages.

mlx-lm's MLA modules (:data:`FAMILIES`) up-project the compressed latent into per-head keys
and values and cache those (or, for DeepSeek-V3, the latent and the rope key as two arrays).
vLLM's MLA page holds, per token, one row: the normalised latent ``c_kv`` (``kv_lora_rank``
values) followed by the rotated shared key ``k_pe`` (``qk_rope_head_dim``). The attention
runs in the absorbed form: each head's ``q_nope`` is multiplied by its key up-projection
``W_UK`` into latent space, the scores are ``(q_latent . c_kv + q_pe . k_pe) * scale``, the
softmax-weighted latent is multiplied by the value up-projection ``W_UV`` - the expanded
attention's result, reassociated.

:func:`install_latent_attention` wraps each such module in :class:`LatentAttention`, which
takes this path for a :class:`~vllm_unified.kv.layer_cache.PagedLatentCache` (and for the
load-time probe's :class:`LatentProbeCache`) and calls mlx-lm's own module for any other
cache. The probe (:mod:`vllm_unified.models.capability`) compares the two paths' logits.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache

from vllm_unified.kv.layer_cache import PagedLatentCache, PagedMask

__all__ = ["FAMILIES", "GATED_OUTPUT", "INDEXED", "QUERY_SCALED", "IndexedLatentAttention",
           "LatentAttention", "LatentProbeCache", "ScaledLatentAttention",
           "install_latent_attention", "latent_layers", "num_latent_slots"]


def _families() -> tuple[type, ...]:
    from mlx_lm.models import (
        bailing_hybrid,
        bailing_moe_v3,
        deepseek_v2,
        deepseek_v3,
        deepseek_v32,
        glm4_moe_lite,
        kimi_k3,
        kimi_linear,
        longcat_flash,
        minicpm3,
        mistral4,
        youtu_llm,
    )

    return (minicpm3.Attention, youtu_llm.YoutuLLMAttention, deepseek_v2.DeepseekV2Attention,
            deepseek_v3.DeepseekV3Attention, glm4_moe_lite.Glm4MoeLiteAttention,
            bailing_hybrid.MultiLatentAttention, bailing_moe_v3.BailingMLA,
            mistral4.Mistral4Attention, deepseek_v32.DeepseekV32Attention,
            longcat_flash.LongcatFlashMLA, kimi_linear.KimiMLAAttention,
            kimi_k3.KimiK3MLAAttention)


def _gated_families() -> tuple[type, ...]:
    from mlx_lm.models import bailing_moe_v3

    return (bailing_moe_v3.BailingMLA,)


def _query_scaled() -> tuple[type, ...]:
    from mlx_lm.models import mistral4

    return (mistral4.Mistral4Attention,)


def _indexed() -> tuple[type, ...]:
    from mlx_lm.models import deepseek_v32

    return (deepseek_v32.DeepseekV32Attention,)


#: mlx-lm MLA attention classes whose ``__call__`` is: queries from ``q_proj`` or
#: ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` split into nope and rope parts; the latent
#: and rope key from ``kv_a_proj_with_mqa``, the latent normalised by ``kv_a_layernorm``;
#: ``rope(x, cache.offset)`` on both rope parts (Kimi Linear's module has no ``rope``: its
#: "rope" parts stay unrotated, NoPE); keys and values up-projected by ``kv_b_proj``
#: (or ``embed_q`` / ``unembed_out``); attention at ``scale`` (``softmax_scale``); where
#: ``use_gate`` (Kimi K3) the output times ``sigmoid(g_proj(x))``; ``o_proj``
#: (Bailing's: ``dense``); LongCat-Flash's heads as ``num_attention_heads`` and its
#: ``mla_scale_q_lora`` / ``mla_scale_kv_lora`` on the queries and the normalised latent
#: (read in mlx-lm 0.32.2's sources, the pinned version)
FAMILIES: tuple[type, ...] = _families()
#: those of :data:`FAMILIES` that scale each head's output by ``sigmoid(g_proj(x))`` (in
#: float32) before the output projection (Bailing V3)
GATED_OUTPUT: tuple[type, ...] = _gated_families()

#: the classes of :data:`FAMILIES` called as ``(x, attn_scale, mask, cache)``: both query parts
#: are multiplied by ``attn_scale`` (Llama 4's position-dependent scale, one value per row
#: or per position, computed by the model) after RoPE (Mistral 4)
QUERY_SCALED: tuple[type, ...] = _query_scaled()

#: the classes of :data:`FAMILIES` with DeepSeek sparse attention: mlx-lm's module takes a
#: ``CacheList`` of its latent cache and its indexer's key cache, and attends densely while a
#: sequence holds at most ``index_topk`` keys, the only contexts served
#: (:data:`vllm_unified.models.config.SPARSE_ATTENTION_INDEXED`); the absorbed path skips the
#: indexer
INDEXED: tuple[type, ...] = _indexed()


class LatentProbeCache(KVCache):
    """A dense, unpaged cache of MLA rows for one sequence (batch rows ``B``), for the
    load-time probe: mlx-lm's ``KVCache`` offset and masks, :class:`LatentAttention`'s
    protocol. ``writes``: the row width of each write; ``attends``: calls of
    :meth:`attend_latent`."""

    def __init__(self, latent_dim: int) -> None:
        super().__init__()
        self.latent_dim = latent_dim
        self.rows: mx.array | None = None
        self.writes: list[int] = []
        self.attends = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        raise TypeError("an MLA layer's probe cache holds latent rows only")

    def make_mask(self, N: int, return_array: bool = False,  # noqa: N803 - mlx-lm's names
                  window_size: int | None = None) -> Any:
        """mlx-lm's causal marker (``"causal"``, None for one row) even where a dense mask is
        asked for, as :class:`~vllm_unified.kv.layer_cache.PagedLatentCache` answers; a
        window as a :class:`~vllm_unified.kv.layer_cache.PagedMask` (refused by the
        adapter)."""
        if window_size is not None:
            return PagedMask(window_size)
        return "causal" if N > 1 else None

    def write_latent(self, rows: mx.array) -> None:
        """Append ``rows`` ``[B, L, W]``."""
        self.rows = rows if self.rows is None else mx.concatenate([self.rows, rows], axis=1)
        self.offset += rows.shape[1]
        self.writes.append(rows.shape[-1])

    def attend_latent(self, queries: mx.array, scale: float) -> mx.array:
        """Causal absorbed attention of ``queries`` ``[B, H, L, W]`` (the last ``L`` positions)
        over every row: ``[B, H, L, latent_dim]``."""
        self.attends += 1
        keys = self.rows[:, None]
        mask = "causal" if queries.shape[2] > 1 else None
        out = mx.fast.scaled_dot_product_attention(queries, keys, keys, scale=scale, mask=mask)
        return out[..., :self.latent_dim]


class LatentAttention(nn.Module):
    """Wraps an mlx-lm MLA attention module of :data:`FAMILIES` (``inner``): absorbed
    attention over latent rows for a latent cache, mlx-lm's own module otherwise."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def latent_dim(self) -> int:
        """``kv_lora_rank``: the latent's width."""
        return int(self.inner.kv_lora_rank)

    @property
    def rope_dim(self) -> int:
        """``qk_rope_head_dim``: the shared rope key's width."""
        return int(self.inner.qk_rope_head_dim)

    @property
    def num_heads(self) -> int:
        """The query heads (``num_heads``, LongCat-Flash's ``num_attention_heads``)."""
        inner = self.inner
        return int(inner.num_heads if hasattr(inner, "num_heads") else inner.num_attention_heads)

    @property
    def scale(self) -> float:
        """The softmax scale mlx-lm's module applies."""
        inner = self.inner
        return float(inner.scale if hasattr(inner, "scale") else inner.softmax_scale)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, (PagedLatentCache, LatentProbeCache)):
            return self.inner(x, mask, cache)
        return self._latent_forward(x, mask, cache)

    def _latent_forward(self, x: mx.array, mask: Any, cache: Any,
                        query_scale: mx.array | None = None) -> mx.array:
        """The absorbed path over ``cache``'s latent rows; ``query_scale`` multiplies both
        query parts after RoPE (broadcast against ``[B, H, L, 1]``)."""
        if not _plain_causal(mask):
            raise TypeError(f"an MLA layer takes a plain causal mask, got {mask!r}")
        inner = self.inner
        B, L, _ = x.shape  # noqa: N806 - mlx-lm's names
        heads, nope = self.num_heads, int(inner.qk_nope_head_dim)
        q = inner.q_proj(x) if getattr(inner, "q_lora_rank", None) is None else \
            inner.q_b_proj(inner.q_a_layernorm(inner.q_a_proj(x)))
        q = q.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
        q_lora_scale, kv_lora_scale = _lora_scales(inner)
        if q_lora_scale is not None:
            q = q * q_lora_scale
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        latent, k_pe = mx.split(inner.kv_a_proj_with_mqa(x), [self.latent_dim], axis=-1)
        latent = inner.kv_a_layernorm(latent)
        if kv_lora_scale is not None:
            latent = latent * kv_lora_scale
        k_pe = k_pe.reshape(B, L, 1, self.rope_dim).transpose(0, 2, 1, 3)
        if hasattr(inner, "rope"):
            q_pe = inner.rope(q_pe, cache.offset)
            k_pe = inner.rope(k_pe, cache.offset)
        if query_scale is not None:
            q_nope, q_pe = q_nope * query_scale, q_pe * query_scale
        cache.write_latent(mx.concatenate([latent, k_pe.transpose(0, 2, 1, 3)
                                           .reshape(B, L, self.rope_dim)], axis=-1))
        w_uk, w_uv = self._up_projections(x.dtype)
        q_latent = _per_head(q_nope, w_uk)  # [B, H, L, r]
        queries = mx.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)
        out = _per_head(cache.attend_latent(queries, self.scale), w_uv)  # [B, H, L, v]
        out = out.transpose(0, 2, 1, 3)  # [B, L, H, v]
        if isinstance(inner, GATED_OUTPUT):
            gate = mx.sigmoid(inner.g_proj(x).astype(mx.float32)).astype(out.dtype)
            out = out * gate[..., None]
        out = out.reshape(B, L, -1)
        if getattr(inner, "use_gate", False):
            out = out * mx.sigmoid(inner.g_proj(x))
        out_proj = inner.o_proj if "o_proj" in inner else inner.dense
        return out_proj(out)

    def _up_projections(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """``(W_UK [H, nope, r], W_UV^T [H, r, v])`` in ``dtype``, from ``kv_b_proj`` or
        ``embed_q`` / ``unembed_out``, computed once.

        Each is the module applied to the identity (its rows are the basis vectors), so it
        is exactly the weight the module multiplies by, however it stores it (dense,
        quantized in any format, swapped for a native kernel); kept dense beside the module.

        Raises:
            TypeError: an up-projection with a bias (not a linear map of the latent).
        """
        cached = getattr(self, "_absorbed", None)
        if cached is not None and cached[0].dtype == dtype:
            return cached
        inner, r = self.inner, self.latent_dim
        if "kv_b_proj" in inner:
            _no_bias(inner.kv_b_proj)
            heads, nope = self.num_heads, int(inner.qk_nope_head_dim)
            w = inner.kv_b_proj(mx.eye(r, dtype=dtype)).T.reshape(heads, -1, r)
            w_uk, w_uv = w[:, :nope], w[:, nope:].swapaxes(1, 2)
        else:
            _no_bias(inner.embed_q)
            _no_bias(inner.unembed_out)
            w_uk = inner.embed_q(mx.eye(int(inner.qk_nope_head_dim), dtype=dtype))
            w_uv = inner.unembed_out(mx.eye(r, dtype=dtype))
        cached = (mx.contiguous(w_uk.astype(dtype)), mx.contiguous(w_uv.astype(dtype)))
        mx.eval(cached)
        object.__setattr__(self, "_absorbed", cached)  # not a parameter of the model
        return cached


class ScaledLatentAttention(LatentAttention):
    """:class:`LatentAttention` for the modules of :data:`QUERY_SCALED`, whose callers pass
    the query scale before the mask."""

    def __call__(self, x: mx.array, attn_scale: mx.array, mask: Any = None,
                 cache: Any = None) -> mx.array:
        if not isinstance(cache, (PagedLatentCache, LatentProbeCache)):
            return self.inner(x, attn_scale, mask, cache)
        return self._latent_forward(x, mask, cache, query_scale=attn_scale)


class IndexedLatentAttention(LatentAttention):
    """:class:`LatentAttention` for the modules of :data:`INDEXED`. A plain ``KVCache`` (the
    load-time probe's, one per layer) is handed to mlx-lm's module as the ``CacheList`` it
    reads, with an indexer key cache kept on it."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(cache, (PagedLatentCache, LatentProbeCache)):
            return self._latent_forward(x, mask, cache)
        if isinstance(cache, KVCache):
            if getattr(cache, "indexer_cache", None) is None:
                cache.indexer_cache = KVCache()
            cache = CacheList(cache, cache.indexer_cache)
        return self.inner(x, mask, cache)


def _lora_scales(inner: nn.Module) -> tuple[float | None, float | None]:
    """LongCat-Flash's ``mla_scale_q_lora`` (on the queries) and ``mla_scale_kv_lora`` (on
    the normalised latent), None where the module has none."""
    return (getattr(inner, "mla_scale_q_lora", None), getattr(inner, "mla_scale_kv_lora", None))


def _plain_causal(mask: Any) -> bool:
    """The masks mlx-lm builds for causal attention without a window over these caches."""
    if isinstance(mask, PagedMask):
        return mask.window is None
    return mask is None or (isinstance(mask, str) and mask == "causal")


def _per_head(x: mx.array, w: mx.array) -> mx.array:
    """``x`` ``[B, H, L, a]`` times each head's ``w`` ``[H, a, b]``: ``[B, H, L, b]``, as one
    batched matmul per head over all ``B * L`` rows."""
    B, H, L, a = x.shape  # noqa: N806
    y = x.transpose(1, 0, 2, 3).reshape(H, B * L, a) @ w
    return y.reshape(H, B, L, -1).transpose(1, 0, 2, 3)


def _no_bias(module: nn.Module) -> None:
    if "bias" in module:  # a quantized layer's "biases" are its quantization offsets
        raise TypeError(f"an MLA up-projection with a bias ({type(module).__name__})")


def install_latent_attention(model: nn.Module) -> dict[int, LatentAttention]:
    """Wrap every MLA attention module of :data:`FAMILIES` that is a direct child of one of
    ``model.layers``, or an entry of a list that is (LongCat-Flash's two attention sublayers),
    in :class:`LatentAttention` (idempotent; changes this model instance).

    Returns:
        :func:`latent_layers` after the install.
    """
    for layer in getattr(model, "layers", None) or []:
        for name, child in layer.children().items():
            if isinstance(child, list):
                entries = layer[name]  # the layer's own list (children() builds a new one)
                for j, entry in enumerate(entries):
                    entries[j] = _wrapped(entry)
            else:
                layer[name] = _wrapped(child)
    return latent_layers(model)


def _wrapped(module: Any) -> Any:
    """``module`` in its :class:`LatentAttention` wrapper if it is an unwrapped MLA module."""
    if not isinstance(module, FAMILIES) or isinstance(module, LatentAttention):
        return module
    wrapper = ScaledLatentAttention if isinstance(module, QUERY_SCALED) else \
        IndexedLatentAttention if isinstance(module, INDEXED) else LatentAttention
    return wrapper(module)


def latent_layers(model: nn.Module) -> dict[int, LatentAttention]:
    """Cache slot -> its :class:`LatentAttention`, for the slots that have one. A decoder
    layer takes one slot, or one per entry of its list of MLA modules, in order (slots are the
    layer indices where no layer has such a list)."""
    return _latent_slots(model)[0]


def num_latent_slots(model: nn.Module) -> int:
    """The cache slots :func:`latent_layers` numbers: one per decoder layer, one per MLA
    module of a layer with a list of them."""
    return _latent_slots(model)[1]


def _latent_slots(model: nn.Module) -> tuple[dict[int, LatentAttention], int]:
    found, slot = {}, 0
    for layer in getattr(model, "layers", None) or []:
        listed = [entry for child in layer.children().values() if isinstance(child, list)
                  for entry in child if isinstance(entry, LatentAttention)]
        if listed:
            for entry in listed:
                found[slot] = entry
                slot += 1
            continue
        for child in layer.children().values():
            if isinstance(child, LatentAttention):
                found[slot] = child
        slot += 1
    return found, slot
