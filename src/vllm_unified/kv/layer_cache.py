"""The per-layer caches mlx-lm's model code sees in the token-major forward.

Each step the runner lays out every scheduled token as its own batch row (``inputs`` of shape
``[T, 1]``) and hands the model one cache per layer. Through mlx-lm's cache protocol a
:class:`PagedLayerCache` gives:

* ``cache.offset`` -> a ``[T]`` array of token positions, so RoPE rotates each row by its own
  position (``mx.fast.rope`` accepts one offset per batch row);
* ``cache.update_and_fetch(k, v)`` -> writes the new K/V rows into the pool by slot mapping;
* ``cache.make_mask(...)`` -> a :class:`PagedMask` marker carrying the sliding window, if any;
* ``cache.attend(...)`` -> the paged attention over the pool (called by the attention router,
  :mod:`vllm_unified.models.routing`).

A recurrent layer of a hybrid model gets a :class:`StateLayerCache` instead, and a layer with
both (mlx-lm's ``CacheList``, Falcon-H1) a :class:`LayerCacheList` of the two. They read the
step's metadata from the bound step context (:mod:`vllm_unified.kv.forward_context`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from vllm_unified.backend import BackendProfile
from vllm_unified.kv.attention import dispatch
from vllm_unified.kv.attention.qk_prologue import QKPrologue
from vllm_unified.kv.forward_context import get_step_context
from vllm_unified.kv.gpu import paged as gpu_paged
from vllm_unified.kv.pool import KVPool
from vllm_unified.kv.state_pages import StatePages, StateStore


@dataclass(frozen=True)
class PagedMask:
    """Stands in for mlx-lm's mask: the paged kernel builds masks from the metadata itself.

    Attributes:
        window: sliding-window size in tokens, or None for full causal attention.
    """

    window: int | None = None


class _PagedMaskSource:
    """mlx-lm builds masks through a layer's cache: paged layers answer with a marker."""

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None  # noqa: N803
    ) -> PagedMask:
        # return_array: the model computes attention itself (Gemma 2); only an adapter that
        # attends through the paged cache gets past the load-time probe, and it ignores the
        # mask, so no dense mask is ever built
        return PagedMask(window_size)


class PagedLayerCache(_PagedMaskSource):
    """mlx-lm cache protocol for one attention layer, backed by :class:`KVPool` layer
    ``layer`` (its attention ordinal, not the model layer index of a hybrid model);
    ``backend``: the profile whose attention kernels run (default: the process's);
    ``window``: the layer's sliding window in tokens (None: full attention); ``chunk``: its
    attention chunk in tokens (chunked local attention, None: none)."""

    def __init__(self, pool: KVPool, layer: int, backend: BackendProfile | None = None,
                 window: int | None = None, chunk: int | None = None) -> None:
        self.pool = pool
        self.layer = layer
        self.backend = backend
        self.window = window
        self.chunk = chunk

    def _arrays(self) -> list[mx.array]:
        """The pool arrays of the bound step (a compiled trace's inputs, or the pool's)."""
        kv = get_step_context().kv
        return self.pool.kv if kv is None else kv

    @property
    def offset(self) -> mx.array:
        """``[T]`` int32 positions: mlx-lm passes this to RoPE as per-row offsets."""
        return get_step_context().attn.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``keys``/``values`` (``[T, Hkv, 1, D]``, post-RoPE) at the step's slot mapping.

        Returns the inputs unchanged; attention reads the context from the pool.
        """
        ctx = get_step_context()
        token = self.pool.write(self.layer, ctx.attn.slot_mapping, keys, values, ctx.kv)
        if token is not None:
            ctx.written[self.layer] = token
        return keys, values

    def attend(self, queries: mx.array, scale: float, window: int | None,
               fresh: tuple[mx.array, mx.array] | None = None,
               softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
        """Paged attention of ``queries`` ``[T, H, 1, D]`` over this layer's pool (after this
        step's write), within the layer's attention chunk if it has one; ``fresh``: the keys
        and values this step wrote (``update_and_fetch``'s result), which a GPU kernel may
        attend directly for chunks with no earlier context; ``softcap``: attention logit
        soft-capping; ``sinks``: ``[H]`` sink logits (any float dtype).
        See :func:`vllm_unified.kv.attention.dispatch.paged_attention_kv`."""
        ctx = get_step_context()
        return dispatch.paged_attention_kv(queries, self._arrays()[self.layer], ctx.attn,
                                           scale, window, backend=self.backend, fresh=fresh,
                                           kv_format=self.pool.layer_format(self.layer),
                                           rht_signs=self.pool.signs,
                                           after=ctx.written.get(self.layer), chunk=self.chunk,
                                           softcap=softcap, sinks=sinks)

    def fuses_decode(self, dtype: mx.Dtype, head_dim: int) -> bool:
        """Whether this step's attention of ``head_dim`` heads in ``dtype`` may take raw
        projections (:meth:`attend_raw`): a pure-decode step, the layer's pages unquantized in
        ``dtype`` and written by a GPU kernel, no attention chunk, and the paged GPU attention
        kernel attending (:mod:`vllm_unified.models.decode_attention`)."""
        meta = get_step_context().attn
        return (meta.num_tokens > 0 and meta.is_pure_decode and self.chunk is None
                and self.pool.write_path in ("cuda_kernel", "metal_kernel")
                and not self.pool.layer_format(self.layer).quantized
                and self._arrays()[self.layer].dtype == dtype
                and dispatch.fused_decode_kernel(head_dim, self.backend) is not None)

    def attend_raw(self, queries: mx.array, keys: mx.array, values: mx.array,
                   prologue: QKPrologue, heads: int, scale: float,
                   window: int | None, softcap: float | None = None,
                   sinks: mx.array | None = None) -> mx.array:
        """Write and attend one pure-decode step from raw projections: the keys normalised and
        rotated by the write kernel, the queries by the attention kernel
        (:mod:`vllm_unified.kv.attention.qk_prologue`). Only where :meth:`fuses_decode` holds.

        Args:
            queries: ``[T, 1, heads * D]``, the query projection.
            keys, values: ``[T, 1, Hkv * D]``, the key and value projections.
            prologue: the layer's norms and rotation.
            heads: query heads.
            scale, window, softcap, sinks: as :meth:`attend`.

        Returns:
            ``[T, heads, 1, D]`` in the queries' dtype, lazily (projections of another dtype
            than the pages are cast to it first, as :meth:`KVPool.write` casts).
        """
        ctx = get_step_context()
        meta = ctx.attn
        dtype = self._arrays()[self.layer].dtype
        out_dtype = queries.dtype
        queries, keys, values = (x if x.dtype == dtype else x.astype(dtype)
                                 for x in (queries, keys, values))
        token = self.pool.write(self.layer, meta.slot_mapping, keys, values, ctx.kv,
                                prologue=prologue, positions=meta.positions)
        dim = prologue.head_dim
        attend = dispatch.fused_decode_kernel(dim, self.backend)
        out = attend(queries.reshape(queries.shape[0], heads, 1, dim),
                     self._arrays()[self.layer], meta, scale, window, prologue=prologue,
                     after=token, **gpu_paged.options(softcap, sinks))
        return out if out.dtype == out_dtype else out.astype(out_dtype)

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> Any:
        raise NotImplementedError("the paged cache state lives in the KV pool")


class SharedLayerCache(PagedLayerCache):
    """The cache of an attention layer that reads another layer's pages (KV shared across
    layers, Gemma 4's ``num_kv_shared_layers``): ``layer`` is the pool layer it reads, whose
    own layer wrote this step's keys and values; :meth:`update_and_fetch` writes nothing."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The keys/values (the owning layer's, already in the pool), unchanged."""
        return keys, values


class PagedLatentCache(PagedLayerCache):
    """mlx-lm cache protocol for one multi-head latent attention (MLA) layer over vLLM's MLA
    pages (:class:`KVPool` layer ``layer`` in its ``latent_layers``: one row of
    ``latent_dim + rope_dim`` values per token). The layer's adapter
    (:mod:`vllm_unified.models.latent_attention`) writes the rows (:meth:`write_latent`) and
    attends in absorbed form (:meth:`attend_latent`); mlx-lm's expanded
    ``update_and_fetch`` is refused."""

    def __init__(self, pool: KVPool, layer: int, latent_dim: int,
                 backend: BackendProfile | None = None) -> None:
        super().__init__(pool, layer, backend)
        self.latent_dim = latent_dim

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        raise TypeError("an MLA layer's cache holds the latent rows: its attention must go "
                        "through the latent adapter (models/latent_attention.py)")

    def write_latent(self, rows: mx.array) -> None:
        """Write the step's rows ``[T, 1, W]`` (normalised latent, then rotated shared key) at
        the step's slot mapping."""
        ctx = get_step_context()
        token = self.pool.write_latent(self.layer, ctx.attn.slot_mapping, rows, ctx.kv)
        if token is not None:
            ctx.written[self.layer] = token

    def attend_latent(self, queries: mx.array, scale: float) -> mx.array:
        """Absorbed attention of ``queries`` ``[T, H, 1, W]`` over this layer's rows (after
        this step's write): ``[T, H, 1, latent_dim]``
        (:func:`vllm_unified.kv.attention.dispatch.paged_attention_latent`)."""
        ctx = get_step_context()
        return dispatch.paged_attention_latent(queries, self._arrays()[self.layer], ctx.attn,
                                               scale, self.latent_dim,
                                               after=ctx.written.get(self.layer),
                                               backend=self.backend)

    def fuses_decode(self, dtype: mx.Dtype, head_dim: int) -> bool:
        return False


class MissingLayerCache(_PagedMaskSource):
    """The cache of a layer another pipeline stage holds: it only answers mlx-lm's mask
    construction (a model may build its masks from any layer's cache)."""


class StateLayerCache:
    """What a recurrent layer gets as its "cache" in the token-major forward: its state pages
    and its KV-cache group."""

    def __init__(self, store: StateStore, layer: int) -> None:
        self.store = store
        self.layer = layer

    @property
    def pages(self) -> StatePages:
        return self.store.pages[self.layer]

    @property
    def group(self) -> int:
        return self.store.groups[self.layer]


class LayerCacheList:
    """mlx-lm's ``CacheList`` protocol for a layer that holds several caches (Falcon-H1: its
    Mamba2 mixer's state pages and its attention's paged cache): ``cache[i]`` is the i-th,
    in the order of mlx-lm's own ``CacheList`` for that layer."""

    def __init__(self, *caches: Any) -> None:
        self.caches = tuple(caches)

    def __getitem__(self, i: int) -> Any:
        return self.caches[i]

    def __len__(self) -> int:
        return len(self.caches)
