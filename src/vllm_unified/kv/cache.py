"""The KV cache end to end, behind one object: :class:`KVCache` (the runner holds one).

It answers vLLM's questions (:meth:`KVCache.kv_cache_spec`, :meth:`KVCache.bytes_per_block`),
allocates the pool when vLLM has sized it (:meth:`KVCache.initialize`: vLLM's layout, lazy or
zeroed, per the backend profile; state pages of hybrid models; the kernel block size the
attention reads vLLM's pages as), builds each step's :class:`~vllm_unified.kv.forward_context.
StepContext` (:meth:`KVCache.step_context`), zeroes the blocks vLLM asks for, and hands the
offloading connector vLLM's per-layer views.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified import compat
from vllm_unified.backend import BackendProfile
from vllm_unified.compat import FullAttentionSpec, KVCacheConfig, KVCacheSpec, init_logger
from vllm_unified.envs import KV_EAGER_ZERO_ENV, read
from vllm_unified.kv.allocation import (
    KV_LAYOUT,
    allocate_kv_cache,
    commit_shortfall,
    import_views,
    kv_cache_views,
    slot_major,
)
from vllm_unified.kv.attention.dispatch import LATENT_ROUTE_REASON
from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.block_translation import (
    KERNEL_BLOCK_SIZES,
    expand_block_table,
    select_kernel_block_size,
)
from vllm_unified.kv.forward_context import StepContext
from vllm_unified.kv.gpu import quant_write as gpu_quant_write
from vllm_unified.kv.hybrid import HybridLayers
from vllm_unified.kv.layer_cache import (
    LayerCacheList,
    MissingLayerCache,
    PagedLatentCache,
    PagedLayerCache,
    SharedLayerCache,
    StateLayerCache,
)
from vllm_unified.kv.pool import KVPool
from vllm_unified.kv.quant import KVFormat, attention_spec, kv_format, tokens_per_gib
from vllm_unified.kv.state_pages import StatePages, StateStore, build_state_metadata, page_rows
from vllm_unified.memory.wired import prepare_kv_adoption

logger = init_logger(__name__)


def layer_name(i: int) -> str:
    """KV-cache layer name we report to vLLM for decoder layer ``i``."""
    return f"model.layers.{i}.self_attn.attn"


@dataclass(frozen=True)
class AttentionShape:
    """What every attention layer's pages hold: KV heads, head size, the model's torch dtype
    and ``--kv-cache-dtype`` (``auto``: the model dtype; else a quantized format of
    :mod:`vllm_unified.kv.quant`); ``skip_layers``: vLLM's
    ``cache_config.kv_cache_dtype_skip_layers`` (layer indices, or ``sliding_window``), whose
    layers keep the model dtype (vLLM adds TurboQuant's boundary layers to it);
    ``latent_dim``: set for multi-head latent attention (MLA) models, whose pages hold one row
    per token of ``head_size = latent_dim + rope dim`` values (vLLM's ``MLAAttentionSpec``,
    ``num_kv_heads`` 1)."""

    num_kv_heads: int
    head_size: int
    dtype: Any
    cache_dtype: str = "auto"
    skip_layers: tuple[str, ...] = ()
    latent_dim: int | None = None

    @classmethod
    def latent(cls, latent_dim: int, rope_dim: int, dtype: Any, cache_dtype: str = "auto"
               ) -> AttentionShape:
        """An MLA model's pages: one ``latent_dim + rope_dim`` row per token.

        Raises:
            ValueError: a quantized ``cache_dtype`` (MLA pages keep the model dtype here).
        """
        if (cache_dtype or "auto") != "auto":
            raise ValueError(f"--kv-cache-dtype {cache_dtype}: multi-head latent attention "
                             "pages keep the model dtype in vllm-unified; use auto")
        return cls(1, latent_dim + rope_dim, dtype, latent_dim=latent_dim)

    @property
    def fmt(self) -> KVFormat:
        """The pages' format (ValueError naming the flag for one not served)."""
        return kv_format(self.cache_dtype, self.head_size)

    def layer_format(self, index: int, window: int | None) -> KVFormat:
        """The format of model layer ``index``'s pages: the model dtype where vLLM's attention
        layer skips the quantization (its index in ``skip_layers``, matched through vLLM's
        ``extract_layer_index`` on the layer's name, or a sliding-window layer with
        ``sliding_window`` listed), else :attr:`fmt`."""
        fmt = self.fmt
        if not fmt.quantized or not self.skip_layers:
            return fmt
        skip = (window is not None and "sliding_window" in self.skip_layers) or \
            str(compat.extract_layer_index(layer_name(index))) in self.skip_layers
        return KVFormat() if skip else fmt


class KVCache:
    """The paged KV pool, a hybrid model's state pages, and the layer caches over them.

    Args:
        profile: the backend profile (memory model and write path).
        layers: the model's layer kinds (attention / recurrent).
        shape: the attention pages' shape.
        windows: sliding window (tokens) per attention layer index, None for full attention.
        dtype: the model's MLX compute dtype (an MLX-owned pool's dtype).
        kv_shapes: ``(num_kv_heads, head_size)`` per attention layer index where layers differ
            (Gemma 4's full-attention layers); a layer not listed has ``shape``'s. vLLM then
            gets one spec per layer with its own page size and groups them as one KV cache
            group of full-attention layers (its ``UniformTypeKVCacheSpecs``).
        shared: model layer index -> the attention layer whose pages it reads (KV shared
            across layers); those layers follow the ``layers.num_layers`` cache slots, in
            order, and have no pages or spec of their own (as vLLM's
            ``kv_sharing_target_layer_name``).
        chunks: attention chunk (tokens) per attention layer index with chunked local
            attention (Llama 4); a layer not listed has none.
        cache_lists: model layer index -> the kinds (``"state"``, ``"attention"``) of its
            caches, in mlx-lm's ``CacheList`` order, for layers that hold several (Falcon-H1:
            the layer is in ``layers.recurrent`` and ``layers.attention``).

    Raises:
        ValueError: a quantized ``--kv-cache-dtype`` on a backend profile no quantized kernels
            serve (:attr:`BackendProfile.quantized_kv`: the native CPU kernels, or the Metal /
            CUDA kernels where the profile writes and attends with them), with a head size
            the GPU kernels do not take, or for a hybrid model; a quantized format with
            per-layer KV shapes.
    """

    def __init__(self, profile: BackendProfile, layers: HybridLayers, shape: AttentionShape,
                 windows: dict[int, int | None], dtype: mx.Dtype,
                 kv_shapes: dict[int, tuple[int, int]] | None = None,
                 shared: dict[int, int] | None = None,
                 chunks: dict[int, int | None] | None = None,
                 cache_lists: dict[int, tuple[str, ...]] | None = None) -> None:
        self.profile = profile
        #: layer -> the kinds of its caches in mlx-lm's CacheList order (layers with several)
        self.cache_lists = dict(cache_lists or {})
        #: attention chunk (chunked local attention) per attention layer index, None: none
        self.chunks = {i: (chunks or {}).get(i) for i in layers.attention}
        self.layers = layers
        self.shape = shape
        self.windows = windows
        self.dtype = dtype
        default = (shape.num_kv_heads, shape.head_size)
        #: ``(num_kv_heads, head_size)`` of each attention layer (model layer index)
        self.kv_shapes = {i: tuple((kv_shapes or {}).get(i, default)) for i in layers.attention}
        #: the attention layers do not all have ``shape``'s heads and head size
        self.per_layer_shapes = any(s != default for s in self.kv_shapes.values())
        #: layer reading another layer's pages -> that layer (model layer indices)
        self.shared = dict(shared or {})
        if self.shared and (sorted(self.shared) != list(range(
                layers.num_layers, layers.num_layers + len(self.shared)))
                or not set(self.shared.values()) <= set(layers.attention)):
            raise ValueError(f"layers sharing KV {self.shared} must follow the "
                             f"{layers.num_layers} cache slots and read attention layers")
        #: the pages' format (vLLM's --kv-cache-dtype)
        self.fmt = shape.fmt
        #: each attention layer's format (model layer index -> format; skip layers: auto)
        self.layer_formats = {i: shape.layer_format(i, windows[i]) for i in layers.attention}
        if self.fmt.quantized and self.per_layer_shapes:
            raise ValueError(f"--kv-cache-dtype {self.fmt.name}: a model whose attention "
                             "layers have different KV heads or head sizes keeps the model "
                             "dtype; use auto")
        if self.fmt.quantized:
            check_quantized_kv(profile, self.fmt, shape.head_size)
        if self.fmt.quantized and layers.is_hybrid:
            raise ValueError(f"--kv-cache-dtype {self.fmt.name}: hybrid models keep the model "
                             "dtype; use auto")
        self.pool: KVPool | None = None
        self.store: StateStore | None = None
        #: one cache per model layer (attention or state pages), what mlx-lm's forward takes
        self.layer_caches: list[Any] = []
        #: vLLM's attention block size (tokens per page) once allocated
        self.block_size: int | None = None
        #: tokens per block the MLX attention reads (``block_size`` divided)
        self.kernel_block_size: int | None = None
        #: the KV cache group of the attention layers (None: an attention-free model)
        self.attn_group = 0
        #: the pool was zero-filled at start-up (VLLM_UNIFIED_KV_EAGER_ZERO, benchmarks)
        self.zeroed = False
        #: vLLM needs zeroed blocks; the fresh mapping provides them without a fill
        self.reads_zero = False
        self._views: dict[str, Any] | None = None

    # ------------------------------------------------------------------ vLLM's questions
    def kv_cache_spec(self, block_size: int, vllm_config: Any) -> dict[str, KVCacheSpec]:
        """One ``FullAttentionSpec`` per attention layer, of the layer's own KV heads and head
        size (sliding-window layers record their window: vLLM keeps blocks for all tokens,
        the attention applies the window; all attention layers are then one KV cache group,
        one block table; chunked local attention layers likewise record their chunk, as vLLM
        promotes its ``ChunkedLocalAttentionSpec`` next to full attention), an
        ``MLAAttentionSpec`` per layer of an MLA model, and one ``MambaSpec`` per recurrent
        layer of a hybrid model."""
        if self.shape.latent_dim is not None:
            specs: dict[str, KVCacheSpec] = {
                layer_name(i): compat.MLAAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=self.shape.head_size,
                    dtype=self.shape.dtype, cache_dtype_str="auto")
                for i in self.layers.attention
            }
            specs.update(self.layers.state_specs(vllm_config))
            return specs
        specs = {
            layer_name(i): attention_spec(
                self.layer_formats[i], block_size=block_size,
                num_kv_heads=self.kv_shapes[i][0], head_size=self.kv_shapes[i][1],
                dtype=self.shape.dtype, sliding_window=self.windows[i],
                attention_chunk_size=self.chunks[i],
            )
            for i in self.layers.attention
        }
        specs.update(self.layers.state_specs(vllm_config))
        return specs

    def bytes_per_block(self, block_size: int, vllm_config: Any) -> int:
        """Bytes one KV block takes over all attention layers (each layer's vLLM page: 2 x
        block_size x kv_heads x head_size x dtype size, or its quantized format's). A hybrid
        model's state pages share vLLM's block pool with them (a request holds one per state
        group), so they are not added."""
        return sum(spec.page_size_bytes
                   for spec in self.kv_cache_spec(block_size, vllm_config).values()
                   if isinstance(spec, FullAttentionSpec))

    # ------------------------------------------------------------------ allocation
    def initialize(self, kv_cache_config: KVCacheConfig, layout: str | None) -> None:
        """Allocate the pool for ``kv_cache_config.num_blocks`` blocks.

        The attention reads each ``B``-token block as ``B/k`` kernel blocks of ``k`` tokens
        (vLLM's ``kernel_block_size`` views; no bytes move); a hybrid model's recurrent layers
        get their state pages.

        Args:
            kv_cache_config: vLLM's sized config.
            layout: vLLM's resolved ``kv_cache_layout`` (None: ours, LBNHC).

        Raises:
            ValueError: KV-cache groups that do not match the model's layers (several groups
                for a model that is not hybrid), or a block size no kernel block divides.
            NotImplementedError: a hybrid model where the pool cannot be shared with torch
                (CUDA: MLX-owned pool).
        """
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 and not self.layers.is_hybrid:
            raise ValueError(f"{len(groups)} KV cache groups: only one is supported (layers of "
                             "two page sizes share one group: vLLM's UniformTypeKVCacheSpecs)")
        names = [layer_name(i) for i in self.layers.attention]
        if self.layers.attention_free:
            spec = self._state_only_spec(kv_cache_config)
            self.attn_group = None
            self.block_size = self.kernel_block_size = spec.block_size
        else:
            self.attn_group = self.layers.attention_group(kv_cache_config, names)
            if sorted(groups[self.attn_group].layer_names) != sorted(names):
                raise ValueError("KV cache group layers do not match the model's layers")
            spec = groups[self.attn_group].kv_cache_spec
            self.block_size = spec.block_size
            self.kernel_block_size = select_kernel_block_size(spec.block_size,
                                                              KERNEL_BLOCK_SIZES)
        self._allocate(kv_cache_config, spec, names, layout or KV_LAYOUT)
        self.layer_caches = self._layer_caches(self.pool, self.store)
        if self.layers.attention_free:
            logger.info(
                "vllm-unified: attention-free model: %d recurrent layers on state pages in %d "
                "state groups, %d blocks (one per running request and group) of %d tokens, "
                "%.2f GiB (%s)", len(self.layers.recurrent), len(groups),
                kv_cache_config.num_blocks, spec.block_size,
                sum(p.pages.nbytes for p in self.store.pages.values()) / 2**30,
                self._describe_pool())
            return
        logger.info(
            "vllm-unified: KV pool %d blocks x %d tokens (read as %d-token kernel blocks)%s, "
            "%.2f GiB (%s)",
            kv_cache_config.num_blocks, spec.block_size, self.kernel_block_size,
            f", {len(self.layers.recurrent)} recurrent layers on state pages in "
            f"{len(groups) - 1} state groups" if self.layers.is_hybrid else "",
            self.pool.nbytes / 2**30, self._describe_pool(),
        )
        logger.info("vllm-unified: KV format %s, %s tokens per GiB of KV (%s)",
                    self.describe_format(), f"{self.tokens_per_gib():,.0f}",
                    f"{kv_cache_config.num_blocks * spec.block_size:,} tokens in the pool")
        if self.latent_layers():
            logger.info("vllm-unified: %s", LATENT_ROUTE_REASON)

    def _state_only_spec(self, kv_cache_config: KVCacheConfig) -> Any:
        """The state spec of an attention-free model's KV cache config, whose block size (the
        tokens one state block stands for) the step's block table is read with.

        Raises:
            ValueError: a group that is not a state (Mamba) group, or state groups of
                different block sizes.
        """
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        if not specs or not all(isinstance(s, compat.MambaSpec) for s in specs):
            raise ValueError(f"{self.layers.model_type}: an attention-free model needs state "
                             f"groups only, got {[type(s).__name__ for s in specs]}")
        if len({s.block_size for s in specs}) != 1:
            raise ValueError(f"state groups of block sizes {[s.block_size for s in specs]}")
        return specs[0]

    def _allocate(self, kv_cache_config: KVCacheConfig, spec: Any, names: list[str],
                  layout: str) -> None:
        """A torch buffer in vLLM's layout shared with MLX where the profile says so (the CPU
        and Metal backends: attention pages and a hybrid model's state pages, imported
        together), else MLX-owned arrays (logged).

        Raises:
            NotImplementedError: a hybrid model where the pool cannot be shared with torch.
        """
        if self.profile.kv_pool == "torch_shared":
            # The fresh mapping reads as zeros, which is all needs_kv_cache_zeroing asks for;
            # the eager fill (committing every page, as vLLM does) is for benchmarks only.
            self.zeroed = read(KV_EAGER_ZERO_ENV)
            self.reads_zero = kv_cache_config.needs_kv_cache_zeroing
            buf, views = allocate_kv_cache(
                kv_cache_config, layout, zero=self.zeroed,
                kernel_block_sizes=({} if self.attn_group is None
                                    else {self.attn_group: self.kernel_block_size}))
            warn_if_pool_can_outgrow_memory(buf.numel(), self.zeroed)
            state = self.layers.state_layout(kv_cache_config) if self.layers.is_hybrid else {}
            rows = [slot_major(views[n]) for n in names]
            rows += [page_rows(views[name], buf) for name, _, _ in state.values()]
            arrays = self._import(rows)
            write = self.profile.kv_write
            # KV connectors get vLLM's manager-block views (as vLLM's own runner hands them),
            # the same bytes the kernel-block views cover
            manager = views if self.kernel_block_size == spec.block_size else \
                kv_cache_views(buf, kv_cache_config, layout)
            self._views = {n: manager[n] for n in names}
            self.pool = KVPool(arrays[:len(names)], spec.block_size, shared=True,
                               torch_views=[views[n] for n in names], buffer=buf, write=write,
                               fmt=self.fmt, head_size=self.shape.head_size,
                               layer_formats=self._pool_formats(),
                               latent_layers=self.latent_layers())
            if state:
                pages = {i: StatePages(arr, fields, shared=True, write=write)
                         for (i, (_, _, fields)), arr in zip(state.items(), arrays[len(names):],
                                                             strict=True)}
                self.store = StateStore(pages, {i: gid for i, (_, gid, _) in state.items()})
            return
        if self.layers.is_hybrid:
            raise NotImplementedError("hybrid models need the KV cache shared with torch "
                                      f"({self.profile.kv_pool_reason})")
        logger.warning("vllm-unified: KV pool owned by MLX (torch cannot share it: %s)",
                       self.profile.kv_pool_reason)
        if self.latent_layers():
            self.pool = self._latent_mlx_pool(kv_cache_config.num_blocks, spec.block_size,
                                              self.profile.kv_write)
            return
        self.pool = KVPool.allocate_mlx(
            num_layers=len(names), num_blocks=kv_cache_config.num_blocks,
            block_size=spec.block_size, num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_size, dtype=self.dtype,
            cuda_write=self.profile.kv_write == "cuda_kernel", fmt=self.fmt,
            layer_formats=self._pool_formats(), layer_shapes=self._pool_shapes(),
        )

    def latent_layers(self) -> frozenset[int]:
        """The pool layers that hold MLA pages (every attention layer of an MLA model)."""
        if self.shape.latent_dim is None:
            return frozenset()
        return frozenset(range(len(self.layers.attention)))

    def _latent_mlx_pool(self, num_blocks: int, block_size: int, write: str) -> KVPool:
        """An MLX-owned MLA pool, written by the in-place GPU kernel where ``write`` names
        one, else MLX's donated scatter."""
        path = write if write in ("cuda_kernel", "metal_kernel") else "scatter"
        return KVPool.allocate_latent_mlx(len(self.layers.attention), num_blocks, block_size,
                                          self.shape.head_size, self.dtype, write=path)

    def skipped_layers(self) -> list[int]:
        """The attention layers kept in the model dtype by ``--kv-cache-dtype-skip-layers``
        under a quantized format (model layer indices, ascending)."""
        if not self.fmt.quantized:
            return []
        return [i for i in self.layers.attention if not self.layer_formats[i].quantized]

    def _pool_formats(self) -> list[KVFormat]:
        """Each pool layer's format (pool layer = attention ordinal)."""
        return [self.layer_formats[i] for i in self.layers.attention]

    def _pool_shapes(self) -> list[tuple[int, int]] | None:
        """Each pool layer's ``(num_kv_heads, head_size)``, None where all are ``shape``'s."""
        if not self.per_layer_shapes:
            return None
        return [self.kv_shapes[i] for i in self.layers.attention]

    def _import(self, rows: list[Any]) -> list[mx.array]:
        """MLX arrays over ``rows`` (contiguous views of the KV buffer), one import of the
        buffer (:func:`~vllm_unified.kv.allocation.import_views`). On Metal, Metal's largest
        buffer bounds each imported chunk, and MLX's wired and memory limits are prepared for
        the adopted bytes first (:func:`~vllm_unified.memory.wired.prepare_kv_adoption`)."""
        if self.profile.allocator != "metal":
            return import_views(rows)
        max_chunk = int(mx.device_info()["max_buffer_length"])
        storage = rows[0].untyped_storage().nbytes()
        prepare_kv_adoption(mx, storage, logger)
        return import_views(rows, max_chunk=max_chunk)

    def tokens_per_gib(self) -> float:
        """KV tokens one GiB of pool holds over all attention layers, each in its format
        (the layers of --kv-cache-dtype-skip-layers in the model dtype)."""
        if self.shape.latent_dim is not None:  # one row per token, no K|V halves
            return 2**30 / (len(self.layers.attention) * self.shape.head_size
                            * self.shape.dtype.itemsize)
        if self.per_layer_shapes:  # unquantized (refused otherwise): 2 x heads x size each
            return 2**30 / sum(2 * h * d * self.shape.dtype.itemsize
                               for h, d in self.kv_shapes.values())
        return tokens_per_gib(self._pool_formats(), self.shape.num_kv_heads,
                              self.shape.head_size, self.shape.dtype.itemsize)

    def describe_format(self) -> str:
        """The KV format for the start-up log (with the layers kept in the model dtype)."""
        d = self.shape.head_size
        dtype = str(self.shape.dtype).removeprefix("torch.")
        if self.shape.latent_dim is not None:
            return (f"{dtype} MLA pages (vLLM's MLAAttentionSpec: one row per token of the "
                    f"{self.shape.latent_dim}-value latent and the {d - self.shape.latent_dim}"
                    f"-value rope key, {d * self.shape.dtype.itemsize} bytes per token and "
                    "layer)")
        dense = f"{2 * d * self.shape.dtype.itemsize} bytes per token and KV head"
        if self.per_layer_shapes:
            shapes = ", ".join(f"{n} layers of {h} KV heads x {s}" for (h, s), n in
                               sorted(Counter(self.kv_shapes.values()).items()))
            return f"{dtype} (the model dtype; per-layer KV shapes: {shapes})"
        if not self.fmt.quantized:
            return f"{dtype} (the model dtype, {dense})"
        kernels = self.profile.quantized_kv
        by = ("the native write, read by the native paged attention" if kernels == "native"
              else f"the {kernels} kernel, read by the paged GPU kernel ({kernels})")
        text = (f"{self.fmt.name} (vLLM's page layout, {self.fmt.cell_bytes(d)} bytes per "
                f"token and KV head, quantized in place by {by})")
        skipped = self.skipped_layers()
        if skipped:
            why = (", where vLLM puts TurboQuant's first and last two layers"
                   if self.fmt.turboquant else "")
            text += (f" on {len(self.layers.attention) - len(skipped)} of "
                     f"{len(self.layers.attention)} attention layers; layers "
                     f"{', '.join(map(str, skipped))} in {dtype} ({dense}; "
                     f"--kv-cache-dtype-skip-layers{why})")
        return text

    def _describe_pool(self) -> str:
        if not self.pool.shared:
            return "MLX-owned"
        if self.zeroed:
            return "vLLM layout in torch memory, shared with MLX; zero-filled (eager)"
        contents = ("reads as zeros (vLLM needs zeroed blocks)" if self.reads_zero
                    else "uninitialised")
        return (f"vLLM layout in torch memory, shared with MLX; {contents}, committed as "
                "blocks are written")

    def _layer_caches(self, pool: KVPool, store: StateStore | None) -> list[Any]:
        """One cache per model layer: paged attention (pool layer = attention ordinal), state
        pages, or :class:`~vllm_unified.kv.layer_cache.MissingLayerCache` for a layer of
        another pipeline stage."""
        # a layer another pipeline stage holds only answers mask construction
        caches: list[Any] = [MissingLayerCache() for _ in range(self.layers.num_layers)]
        for j, i in enumerate(self.layers.attention):
            if j in pool.latent_layers:
                caches[i] = PagedLatentCache(pool, j, self.shape.latent_dim, self.profile)
                continue
            caches[i] = PagedLayerCache(pool, j, self.profile, self.windows[i], self.chunks[i])
        for i in self.layers.recurrent:
            state = StateLayerCache(store, i)
            kinds = self.cache_lists.get(i)
            if kinds is None:
                caches[i] = state
                continue
            # a layer with state and attention: mlx-lm's CacheList of both, in its order
            by_kind = {"state": state, "attention": caches[i]}
            caches[i] = LayerCacheList(*(by_kind[k] for k in kinds))
        ordinal = {i: j for j, i in enumerate(self.layers.attention)}
        for i in sorted(self.shared):
            target = self.shared[i]
            caches.append(SharedLayerCache(pool, ordinal[target], self.profile,
                                           self.windows[target], self.chunks[target]))
        return caches

    # ------------------------------------------------------------------ per step
    def step_context(self, query_lens: Any, seq_lens: Any, block_table: np.ndarray,
                     states: list[Any] | None) -> StepContext:
        """The step's context: attention metadata on kernel blocks (the block table expanded
        by ``block_size / kernel_block_size``) and a hybrid model's state slots (slot 0, vLLM's
        null block, for dummy sequences when ``states`` is None).

        Raises:
            ValueError: as :func:`~vllm_unified.kv.attention.metadata.build_attention_metadata`.
        """
        return self._context(query_lens, seq_lens, block_table, states, self.block_size,
                             self.kernel_block_size, self.store)

    def _context(self, query_lens: Any, seq_lens: Any, block_table: np.ndarray,
                 states: list[Any] | None, block_size: int, kernel_block_size: int | None,
                 store: StateStore | None) -> StepContext:
        table, size = block_table, block_size
        if kernel_block_size is not None and kernel_block_size != size:
            table = expand_block_table(table, size // kernel_block_size)
            size = kernel_block_size
        attn = build_attention_metadata(list(query_lens), list(seq_lens), table, size)
        state = None
        if store is not None:
            slots = self.layers.step_slots(store, states, len(query_lens))
            state = build_state_metadata(np.asarray(query_lens), np.asarray(seq_lens), slots)
        return StepContext(attn=attn, state=state)

    def arrays(self) -> list[mx.array]:
        """Pool and state arrays, evaluated with the step (their writes happen then)."""
        return self.pool.arrays() + (self.store.arrays() if self.store is not None else [])

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero these blocks in the pool and, for a hybrid model, in every state layer (block
        ids are shared by all KV cache groups): vLLM's ``new_block_ids_to_zero``."""
        self.pool.zero_blocks(block_ids)
        if self.store is not None:
            self.store.zero_block_ids(block_ids)

    # ------------------------------------------------------------------ connector, probes
    def connector_views(self) -> dict[str, Any] | None:
        """vLLM's per-layer torch views of the attention pages (for the offloading
        connector; the same bytes MLX reads and writes on the CPU and Metal backends), None
        when the pool is MLX-owned (CUDA, or the CPU without the native bridge).

        Where the attention reads vLLM's blocks as smaller kernel blocks, these are still
        vLLM's manager-block views ``[num_blocks, H, B, C]`` (block ids the scheduler's), as
        vLLM's own runner hands connectors.
        """
        return self._views

    def temporary(self, num_tokens: int, block_size: int, vllm_config: Any
                  ) -> tuple[list[Any], StepContext, Callable[[], list[mx.array]]]:
        """MLX-owned caches just big enough for one ``num_tokens``-token prefill of a single
        sequence (the activation-profiling forward): ``(layer_caches, step context, a function
        giving the arrays to evaluate after the forward is built)``."""
        blocks = -(-num_tokens // block_size) + 1
        # The backend's kernel where it writes in place (it does into any MLX buffer), so
        # the profiled forward is the served one; else MLX's donated scatter.
        write = self.profile.kv_write if self.profile.kv_write in ("cuda_kernel",
                                                                   "metal_kernel") else "scatter"
        if self.latent_layers():
            pool = self._latent_mlx_pool(blocks, block_size, write)
        else:
            pool = KVPool.allocate_mlx(len(self.layers.attention), blocks, block_size,
                                       self.shape.num_kv_heads, self.shape.head_size, self.dtype,
                                       write=write, fmt=self.fmt,
                                       layer_formats=self._pool_formats(),
                                       layer_shapes=self._pool_shapes())
        store = self.layers.temp_store(vllm_config, 2)
        table = np.arange(1, blocks, dtype=np.int32)[None]
        ctx = self._context([num_tokens], [num_tokens], table, None, block_size, None, store)

        def arrays() -> list[mx.array]:
            return pool.arrays() + (store.arrays() if store is not None else [])

        return self._layer_caches(pool, store), ctx, arrays


def check_quantized_kv(profile: BackendProfile, fmt: KVFormat, head_size: int) -> None:
    """Refuse, at start-up, a quantized KV cache that no kernels of this profile serve.

    Raises:
        ValueError: naming the flag: the profile has no quantized KV kernels
            (:attr:`BackendProfile.quantized_kv`), or the GPU kernels do not take the head
            size (a multiple of 32 up to 256).
    """
    kernels = profile.quantized_kv
    if kernels is None:
        raise ValueError(
            f"--kv-cache-dtype {fmt.name}: quantized KV pages are written and read by the "
            "native CPU kernels (MLX's CPU backend with the native extension and CPU "
            "attention) or the Metal / CUDA kernels (the paged GPU attention with the pool "
            f"written by the GPU kernels); this {profile.kind} backend profile has neither "
            f"(CPU attention {'on' if profile.cpu_attention else 'off'}, GPU attention "
            f"{profile.gpu_attention or 'off'}, KV write {profile.kv_write}); use auto")
    if kernels != "native" and not gpu_quant_write.supported(head_size):
        raise ValueError(
            f"--kv-cache-dtype {fmt.name}: the {kernels} quantized KV kernels take head sizes "
            f"that are multiples of 32 up to 256, not {head_size}; use auto")


def warn_if_pool_can_outgrow_memory(pool_bytes: int, committed: bool,
                                    available: int | None = None) -> int:
    """Warn once at start-up when the lazy pool, once full, would need more memory than the
    host has available now (:func:`~vllm_unified.kv.allocation.commit_shortfall`).

    Args:
        pool_bytes: the pool's size.
        committed: the pool was committed at start (``VLLM_UNIFIED_KV_EAGER_ZERO=1``).
        available: bytes available (default: ``psutil.virtual_memory().available``).

    Returns:
        The shortfall in bytes (0: none, nothing logged).
    """
    import psutil

    if available is None:
        available = psutil.virtual_memory().available
    short = commit_shortfall(pool_bytes, pool_bytes if committed else 0, available)
    if short:
        logger.warning(
            "vllm-unified: the KV pool (%.2f GiB) is committed as blocks are written and can "
            "outgrow the %.2f GiB of memory available now by %.2f GiB: a host that runs out "
            "kills the engine (every request in flight fails, the server exits). Lower "
            "--gpu-memory-utilization or --kv-cache-memory-bytes, or set %s=1 to commit the "
            "pool at start-up", pool_bytes / 2**30, available / 2**30, short / 2**30,
            KV_EAGER_ZERO_ENV)
    return short
