"""Which of a loaded mlx-lm model's layers the paged cache can drive, decided at load.

mlx-lm describes a model's per-layer state by the cache list its ``make_cache`` returns (one
entry per *cache slot*: usually one per decoder layer, fewer where some layers keep nothing).
Each slot is classified by its cache type:

* ``KVCache`` -> paged attention over the whole context;
* ``RotatingKVCache(max_size=W, keep=0)`` -> paged attention with a sliding window of W;
* ``ChunkedKVCache(chunk_size=C)`` -> paged attention within attention chunks of C tokens
  (chunked local attention, Llama 4);
* ``ArraysCache`` / ``MambaCache`` -> a recurrent layer on vLLM's state pages (its family must
  be known to :mod:`vllm_unified.kv.hybrid`);
* ``CacheList(ArraysCache, KVCache or RotatingKVCache)`` (either order) -> a layer that runs a
  recurrent mixer and attention side by side (Falcon-H1): on state pages and on KV pages;
* anything else -> refused, naming the feature.

A ``KVCache`` slot whose layer's attention is multi-head latent attention (wrapped by
:mod:`vllm_unified.models.latent_attention`) is an MLA slot: vLLM's MLA pages, one latent row
per token.

A probe forward then runs the model as mlx-lm would (a short prefill and one decode step) with
recording caches, and checks what the types cannot show: that each attention slot computes
its attention through mlx-lm's ``scaled_dot_product_attention`` (which
:mod:`vllm_unified.models.routing` sends to the paged kernels), the key/value shapes every slot
writes, and that the runner's forward (inner model, then the model's own output head) gives
mlx-lm's logits; for MLA slots, that the absorbed attention over latent rows gives mlx-lm's
logits (a second forward with :class:`~vllm_unified.models.latent_attention.LatentProbeCache`
on those slots). A model loads when every slot is drivable; otherwise
:class:`UnsupportedModel` names the model type, the slot and the missing feature.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_unified.bridge import torch_dtype
from vllm_unified.kv.hybrid import HYBRID_FAMILIES, stateless_layers
from vllm_unified.models import latent_attention, routing
from vllm_unified.models.attention_adapters import install_attention_adapters
from vllm_unified.models.output_head import decoder, lm_head

__all__ = ["AttentionSlot", "ModelLayout", "UnsupportedModel", "check_model",
           "probed_state_layout", "route_model"]

#: probe tokens (prefill, then one decode step): ids valid in any vocabulary
_PROBE_PROMPT = (1, 2, 3, 4, 5)
#: largest |difference| between mlx-lm's logits and the runner's, relative to their largest
#: magnitude, per compute dtype (a missing soft-cap or logit scale differs by far more)
_LOGITS_RTOL = {mx.float32: 1e-4}
_LOGITS_RTOL_16BIT = 1e-2


class UnsupportedModel(ValueError):
    """A model whose layers the paged cache cannot drive; the message names the model type,
    the slot (decoder layer) and the missing feature."""

    def __init__(self, model_type: str, feature: str, slot: int | None = None) -> None:
        where = f" (cache slot {slot})" if slot is not None else ""
        super().__init__(f"model type {model_type!r}{where}: {feature} is not supported by "
                         "vllm-unified yet")
        self.model_type = model_type
        self.feature = feature
        self.slot = slot


@dataclass(frozen=True)
class AttentionSlot:
    """One paged-attention cache slot: sliding window (tokens, None for full attention), the
    key/value shape the layer writes (``num_kv_heads`` x ``head_dim``, or None where the probe
    did not run: a pipeline stage) and the attention chunk (tokens, None: none). An MLA slot
    has ``latent_dim`` (``kv_lora_rank``) and ``rope_dim``; its rows are
    ``1 x (latent_dim + rope_dim)``."""

    window: int | None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    chunk: int | None = None
    latent_dim: int | None = None
    rope_dim: int | None = None


@dataclass
class ModelLayout:
    """A model's cache slots as the runner drives them.

    Attributes:
        model_type: the config's model type.
        num_slots: entries of mlx-lm's cache list (what the inner model takes as ``cache``).
        attention: slot index -> :class:`AttentionSlot`.
        recurrent: slot indices of recurrent layers (vLLM's state pages).
        shared: layer index -> the attention slot whose keys and values it reads (KV shared
            across layers: layers after the last slot that mlx-lm gives no cache of their own).
        cache_lists: slot index -> the kinds (``"state"``, ``"attention"``) of its caches in
            mlx-lm's ``CacheList`` order, for slots that are both recurrent and attention.
        states: per recurrent slot, the ``(shape, dtype)`` of each state mlx-lm's own cache
            held after the probe step, per sequence (empty where the probe did not run).
        notes: how each decision was taken, for the start-up log.
    """

    model_type: str
    num_slots: int
    attention: dict[int, AttentionSlot] = field(default_factory=dict)
    recurrent: list[int] = field(default_factory=list)
    shared: dict[int, int] = field(default_factory=dict)
    cache_lists: dict[int, tuple[str, ...]] = field(default_factory=dict)
    states: dict[int, tuple[tuple[tuple[int, ...], mx.Dtype], ...]] = field(
        default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def windows(self) -> dict[int, int | None]:
        """Sliding window per attention slot."""
        return {i: s.window for i, s in self.attention.items()}

    @property
    def latent(self) -> tuple[int, int] | None:
        """``(latent_dim, rope_dim)`` of an MLA model (every attention slot is MLA, one
        shape), else None."""
        shapes = {(s.latent_dim, s.rope_dim) for s in self.attention.values()}
        if len(shapes) != 1 or None in next(iter(shapes)):
            return None
        return next(iter(shapes))


def check_model(
    model: nn.Module, config: Mapping[str, Any], *, recurrent_families: Collection[str],
    kv_shape: tuple[int, int] | None, config_window: int | None, probe: bool = True,
) -> ModelLayout:
    """Classify ``model``'s cache slots; raise :class:`UnsupportedModel` for any the paged
    cache cannot drive.

    Args:
        model: the loaded mlx-lm model, attention already routed
            (:func:`vllm_unified.models.routing.install_paged_attention`).
        config: the mlx-lm config it was built from.
        recurrent_families: model types whose recurrent mixers run on state pages.
        kv_shape: ``(num_kv_heads, head_size)`` of vLLM's model config, or None. Slots whose
            probe shape differs (per-layer KV heads or head sizes) are accepted with their own
            shape (the runner sizes each layer's pages by it) and noted.
        config_window: vLLM's sliding window for the model (``ModelConfig.get_sliding_window``)
            where the config declares one for every layer, else None.
        probe: run the probe forward (off for a pipeline stage, whose model is partial).

    Raises:
        UnsupportedModel: naming the slot and the feature.
    """
    from mlx_lm.models.cache import make_prompt_cache

    model_type = str(config["model_type"])
    caches = make_prompt_cache(model)
    if model_type in _STATES_BEFORE_LAYERS:
        raise UnsupportedModel(model_type, _STATES_BEFORE_LAYERS[model_type], 0)
    layout = ModelLayout(model_type, len(caches))
    declared = _declared_windows(config, len(caches), config_window,
                                 [_cache_window(_attention_cache(c)) for c in caches])
    latent = latent_attention.latent_layers(model)
    for i, cache in enumerate(caches):
        named = _layer_feature(model, len(caches), i)
        try:
            kind = _slot_kind(model_type, i, cache)
        except UnsupportedModel as e:
            if named is None:
                raise
            raise UnsupportedModel(model_type, f"{named} ({e.feature})", i) from None
        if kind in ("recurrent", "list") and model_type not in recurrent_families:
            raise UnsupportedModel(model_type, f"{named + ': ' if named else ''}a recurrent "
                                   "(state-space) layer of this family "
                                   f"({_describe_cache(cache)})", i)
        if kind == "recurrent":
            layout.recurrent.append(i)
            continue
        if kind == "list":
            layout.recurrent.append(i)
            layout.cache_lists[i] = _list_kinds(cache)
            cache = _attention_cache(cache)
        window = _window(model_type, i, cache, declared)
        if i in latent:
            if window is not None or _cache_chunk(cache) is not None:
                raise UnsupportedModel(model_type, "multi-head latent attention with a "
                                       "sliding window or an attention chunk", i)
            layer = latent[i]
            layout.attention[i] = AttentionSlot(None, latent_dim=layer.latent_dim,
                                                rope_dim=layer.rope_dim)
            continue
        layout.attention[i] = AttentionSlot(window, chunk=_cache_chunk(cache))
    # after the slots' own refusals (a recurrent slot among MLA layers names that)
    _check_latent_slots(model, model_type, len(caches))
    if latent and layout.latent is None:
        raise UnsupportedModel(model_type, "multi-head latent attention next to other "
                               "attention layers (one MLA page shape for every layer)")
    if declared is not None and any(
        w != _cache_window(_attention_cache(caches[i])) for i, w in declared.items()
        if i in layout.attention
    ):
        layout.notes.append("sliding windows from the config (vLLM's), which mlx-lm's "
                            "model does not apply itself")
    _check_config_features(model_type, config, latent=bool(latent))
    layout.shared = _shared_kv(model, model_type, config, layout)
    if layout.shared:
        layout.notes.append("KV shared across layers (layer -> the layer whose pages it "
                            f"reads: {layout.shared})")
    if probe:
        _probe(model, model_type, layout, kv_shape)
    return layout


def route_model(
    model: nn.Module, config: Mapping[str, Any], *, kv_shape: tuple[int, int] | None,
    config_window: int | None, probe: bool = True,
) -> tuple[ModelLayout, list[str]]:
    """Wrap the recurrent mixers, route the attention to the paged cache (adapting the
    modules that compute it themselves: :mod:`vllm_unified.models.attention_adapters`), and
    check every cache slot (:func:`check_model`).

    Returns:
        The layout and the names of the mlx-lm modules whose attention was routed.

    Raises:
        UnsupportedModel: as :func:`check_model`; also where the hybrid family's recurrent
            layers are not mlx-lm's recurrent cache slots.
    """
    model_type = str(config["model_type"])
    mixers = routing.install_recurrent_mixers(model_type, model)
    patched = routing.install_paged_attention(model) + install_attention_adapters(model)
    latent_attention.install_latent_attention(model)
    layout = check_model(model, config, recurrent_families=HYBRID_FAMILIES, kv_shape=kv_shape,
                         config_window=config_window, probe=probe)
    # mlx-lm's cache list skips a family's stateless (MLP-only) layers: slot = layer index
    # among the others
    stateless = set(stateless_layers(model_type, model))
    slot_of = {layer: slot for slot, layer in enumerate(
        i for i in range(len(model.layers)) if i not in stateless)}
    if [slot_of.get(i) for i in mixers] != layout.recurrent:
        raise UnsupportedModel(model_type, f"recurrent layers {mixers} at other cache slots "
                               f"({layout.recurrent})")
    return layout, patched


def probed_state_layout(layout: ModelLayout) -> tuple[tuple[tuple[int, ...], ...],
                                                      tuple[Any, ...]] | None:
    """The per-sequence state shapes and torch dtypes every recurrent slot's mlx-lm cache held
    after the probe step (what vLLM sizes the state pages of an architecture only mlx-lm
    defines by), or None without recurrent slots or a probe.

    Raises:
        UnsupportedModel: recurrent layers whose states differ (one state spec for all).
    """
    kinds = set(layout.states.values())
    if not kinds:
        return None
    if len(kinds) != 1:
        raise UnsupportedModel(layout.model_type, "recurrent layers whose states differ in "
                               "shape or dtype (one state page layout for all)")
    (states,) = kinds
    return (tuple(shape for shape, _ in states),
            tuple(torch_dtype(dtype) for _, dtype in states))


# ----------------------------------------------------------------------------- slots


def _slot_kind(model_type: str, i: int, cache: Any) -> str:
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        KVCache,
        RotatingKVCache,
    )

    if type(cache) in (KVCache, RotatingKVCache, ChunkedKVCache):
        return "attention"
    if isinstance(cache, ArraysCache):
        return "recurrent"
    if isinstance(cache, CacheList):
        kinds = sorted("state" if isinstance(c, ArraysCache) else
                       "attention" if type(c) in (KVCache, RotatingKVCache) else
                       type(c).__name__ for c in cache.caches)
        if kinds == ["attention", "state"]:
            return "list"
        raise UnsupportedModel(model_type, "a layer with several caches (mlx-lm CacheList of "
                               f"{_describe_cache(cache)}: only one recurrent state next to "
                               "one attention cache is served)", i)
    feature = _CACHE_FEATURES.get(type(cache).__name__,
                                  f"mlx-lm's {type(cache).__name__} cache")
    raise UnsupportedModel(model_type, feature, i)


#: model types whose mlx-lm cache list starts with a state that belongs to no decoder layer
#: (the paged cache keeps states per layer), and what it holds
_STATES_BEFORE_LAYERS = {
    "longcat_flash_ngram": "n-gram embeddings over each sequence's previous tokens (mlx-lm "
                           "keeps the last token ids in an ArraysCache ahead of the layers' "
                           "caches; its layers then hold two MLA caches each)",
}

#: mlx-lm cache types and the attention feature they stand for
_CACHE_FEATURES = {
    "QuantizedKVCache": "mlx-lm's quantized KV cache",
    # DeepSeek-V4.1 (window-only models get rotating caches: models/cache_fixes.py)
    "LayerCache": "compressed sparse attention (mlx-lm's LayerCache: compressed KV groups an "
                  "indexer picks per query, next to the sliding window; models whose "
                  "compress_ratios are all 0 are served)",
}

#: (mlx-lm module, class) of a decoder layer's mixer -> the feature it computes, named when
#: its cache slot is refused
LAYER_FEATURES: dict[tuple[str, str], str] = {
    ("minimax_m3_vl", "Attention"): "MiniMax-M3's attention, whose cache is a per-layer "
                                    "CacheList (its block-sparse layers' key-block indexer "
                                    "keeps its keys in a second cache)",
}


def _layer_feature(model: nn.Module, num_slots: int, i: int) -> str | None:
    """The :data:`LAYER_FEATURES` entry of a mixer of decoder layer ``i`` (cache slot ``i``:
    only where every layer has a slot), else None."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != num_slots:
        return None
    for child in layers[i].children().values():
        kind = type(child)
        feature = LAYER_FEATURES.get((kind.__module__.rsplit(".", 1)[-1], kind.__name__))
        if feature is not None:
            return feature
    return None


def _describe_cache(cache: Any) -> str:
    """``ArraysCache``, or ``CacheList(ArraysCache, KVCache)`` for a list."""
    inner = getattr(cache, "caches", None)
    if inner is None:
        return type(cache).__name__
    return f"CacheList({', '.join(type(c).__name__ for c in inner)})"


def _list_kinds(cache: Any) -> tuple[str, ...]:
    """The kinds of a served ``CacheList``'s caches, in its order (``"state"``,
    ``"attention"``)."""
    from mlx_lm.models.cache import ArraysCache

    return tuple("state" if isinstance(c, ArraysCache) else "attention" for c in cache.caches)


def _attention_cache(cache: Any) -> Any:
    """The attention cache of a slot: the slot's cache, or a ``CacheList``'s attention one."""
    from mlx_lm.models.cache import CacheList

    if not isinstance(cache, CacheList):
        return cache
    return cache.caches[_list_kinds(cache).index("attention")]


def _cache_window(cache: Any) -> int | None:
    from mlx_lm.models.cache import RotatingKVCache

    return int(cache.max_size) if isinstance(cache, RotatingKVCache) else None


def _cache_chunk(cache: Any) -> int | None:
    from mlx_lm.models.cache import ChunkedKVCache

    return int(cache.chunk_size) if isinstance(cache, ChunkedKVCache) else None


def _window(model_type: str, i: int, cache: Any,
            declared: dict[int, int | None] | None) -> int | None:
    """The slot's window: the config's where it declares windows (vLLM applies those), else
    mlx-lm's rotating cache size."""
    from mlx_lm.models.cache import RotatingKVCache

    if isinstance(cache, RotatingKVCache) and cache.keep:
        raise UnsupportedModel(model_type, f"a rotating cache keeping {cache.keep} tokens "
                               "(attention-sink tokens)", i)
    mine = _cache_window(cache)
    if declared is None:
        return mine
    theirs = declared.get(i)
    if mine is not None and theirs != mine:
        raise UnsupportedModel(model_type, f"a sliding window of {mine} tokens in mlx-lm's "
                               f"model where the config says {theirs}", i)
    return theirs


def _declared_windows(config: Mapping[str, Any], num_slots: int,
                      config_window: int | None, cache_windows: list[int | None]
                      ) -> dict[int, int | None] | None:
    """Per slot, the window the HF config declares (``layer_types`` with
    ``sliding_attention`` entries, or one window for all layers), or None if it declares
    none. Layer types index slots only where there is one slot per layer. A config window
    without layer types where mlx-lm's caches (``cache_windows``) window some layers with it
    and not others: the config lists its windowed layers under a key of its own
    (Baichuan-M1's ``sliding_window_layers``), so the caches carry the windows."""
    layer_types = config.get("layer_types")
    window = config.get("sliding_window")
    if layer_types and "sliding_attention" in layer_types and window:
        if len(layer_types) != num_slots:
            return None  # slots are not layers: mlx-lm's caches carry the windows
        return {i: int(window) if t == "sliding_attention" else None
                for i, t in enumerate(layer_types)}
    windowed = {w for w in cache_windows if w is not None}
    if (config_window and not layer_types and windowed == {int(config_window)}
            and None in cache_windows):
        return None
    if config_window and not layer_types:
        return dict.fromkeys(range(num_slots), int(config_window))
    return None


def _gemma4_shared(model: nn.Module, num_slots: int) -> dict[int, int]:
    # mlx-lm's Gemma 4 hands layer j the keys/values layer previous_kvs[j] computed
    previous = list(model.model.previous_kvs)
    return {j: int(previous[j]) for j in range(num_slots, len(previous))}


def _afm7_shared(model: nn.Module, num_slots: int) -> dict[int, int]:
    # mlx-lm's AFM hands every KV-reuse layer (after the cached layers) the last cache's KV
    return {num_slots + k: num_slots - 1 for k in range(len(model.model.kv_reuse_layers))}


#: model type -> its KV sharing (layer -> the slot it reads), read from mlx-lm's model
_KV_SHARING = {"gemma4_text": _gemma4_shared, "afm7": _afm7_shared}


def _shared_kv(model: nn.Module, model_type: str, config: Mapping[str, Any],
               layout: ModelLayout) -> dict[int, int]:
    """Layers without a cache slot that read another slot's keys and values.

    Raises:
        UnsupportedModel: a config declaring shared KV for a family whose sharing is not
            known, or a layer reading a slot that is not attention.
    """
    sharing = _KV_SHARING.get(model_type)
    if sharing is None:
        for key in ("num_kv_shared_layers", "num_kv_reuse_layers"):
            if config.get(key):
                raise UnsupportedModel(model_type, f"KV shared across layers ({key}) in this "
                                       "family")
        return {}
    shared = sharing(model, layout.num_slots)
    for j, target in shared.items():
        if target not in layout.attention:
            raise UnsupportedModel(model_type, f"layer {j} reading the keys and values of "
                                   f"slot {target}, which is not an attention slot")
    return shared


def _check_latent_slots(model: nn.Module, model_type: str, num_slots: int) -> None:
    """MLA adapters number the cache slots one per decoder layer, or one per MLA sublayer
    (:func:`~vllm_unified.models.latent_attention.latent_layers`).

    Raises:
        UnsupportedModel: MLA layers where the model's cache slots are not those.
    """
    if (latent_attention.latent_layers(model)
            and num_slots != latent_attention.num_latent_slots(model)):
        raise UnsupportedModel(model_type, "multi-head latent attention in a model whose "
                               "cache slots are not its layers")


#: mlx-lm modules whose layers attend over keys another cache slot holds, passing their own
#: slot's cache (the paged attention would read the wrong pages; the probe cannot see it)
_CROSS_SLOT_ATTENTION = {
    "iquestloopcoder": "attention over another cache slot's keys (its second loop attends to "
                       "the first loop's KV)",
}


def _check_config_features(model_type: str, config: Mapping[str, Any], *,
                           latent: bool = False) -> None:
    """Config features no mlx-lm module computes and the paged path cannot add (``latent``:
    the model's MLA layers are adapted, :mod:`vllm_unified.models.latent_attention`)."""
    if config.get("use_bidirectional_attention") or config.get("is_causal") is False:
        raise UnsupportedModel(model_type, "bidirectional (non-causal) attention")
    if model_type in _CROSS_SLOT_ATTENTION:
        raise UnsupportedModel(model_type, _CROSS_SLOT_ATTENTION[model_type])
    if config.get("kv_lora_rank") and not latent:
        # mlx-lm caches the up-projected keys and values; vLLM pages hold the latent
        raise UnsupportedModel(model_type, "multi-head latent attention (MLA: vLLM's latent "
                               "page layout) in an mlx-lm module the latent adapter does not "
                               "know")


# ----------------------------------------------------------------------------- probe


def _probe(model: nn.Module, model_type: str, layout: ModelLayout,
           kv_shape: tuple[int, int] | None) -> None:
    """Run mlx-lm's forward on the probe prompt with recording caches; check each attention
    slot routes through the paged SDPA with the pages' shape, and the runner's head."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([list(_PROBE_PROMPT)])
    caches = make_prompt_cache(model)
    records = [routing.record_cache(_attention_cache(c)) for c in caches]
    try:
        logits = model(prompt, cache=caches)
        logits = mx.concatenate([logits, model(mx.array([[6]]), cache=caches)], axis=1)
        mx.eval(logits)
    except Exception as e:  # noqa: BLE001 - re-raised with the model named
        if "No Metal back-end" in str(e):
            raise UnsupportedModel(model_type, "Metal-only kernels of mlx-lm's module "
                                   "(mx.fast.metal_kernel) on a backend without Metal "
                                   f"({mx.default_device()})") from e
        raise UnsupportedModel(model_type, f"mlx-lm's forward with a KV cache ({e!r})") from e
    for i, slot in list(layout.attention.items()):
        if slot.latent_dim is None:
            layout.attention[i] = _attention_slot(model_type, i, slot, records[i])
    for i in layout.recurrent:
        layout.states[i] = _probed_states(model_type, i, caches[i])
    shapes = {(s.num_kv_heads, s.head_dim) for s in layout.attention.values()
              if s.latent_dim is None}
    if kv_shape is not None and shapes - {tuple(kv_shape)}:
        layout.notes.append("per-layer KV shapes (heads x head size: "
                            f"{', '.join(f'{h} x {d}' for h, d in sorted(shapes))}; vLLM's "
                            f"config says {kv_shape[0]} x {kv_shape[1]})")
    if layout.latent is not None:
        _probe_latent(model, model_type, layout, prompt, logits, kv_shape)
    _check_head(model, model_type, prompt, logits)


def _probe_latent(model: nn.Module, model_type: str, layout: ModelLayout, prompt: mx.array,
                  expected: mx.array, kv_shape: tuple[int, int] | None) -> None:
    """The probe forward again with :class:`~vllm_unified.models.latent_attention.
    LatentProbeCache` on the MLA slots: each must write one latent row per token and attend
    in absorbed form, and the logits must be mlx-lm's (``expected``)."""
    from mlx_lm.models.cache import make_prompt_cache

    latent_dim, rope_dim = layout.latent
    caches = make_prompt_cache(model)
    for i in layout.attention:
        caches[i] = latent_attention.LatentProbeCache(latent_dim)
    try:
        got = model(prompt, cache=caches)
        got = mx.concatenate([got, model(mx.array([[6]]), cache=caches)], axis=1)
        mx.eval(got)
    except Exception as e:  # noqa: BLE001 - re-raised with the model named
        raise UnsupportedModel(model_type, f"multi-head latent attention in absorbed form "
                               f"({e!r})") from e
    for i in layout.attention:
        if caches[i].writes != [latent_dim + rope_dim] * 2 or caches[i].attends != 2:
            raise UnsupportedModel(model_type, "an MLA layer that does not attend its own "
                                   "latent rows once per step", i)
        layout.attention[i] = AttentionSlot(None, 1, latent_dim + rope_dim,
                                            latent_dim=latent_dim, rope_dim=rope_dim)
    _check_logits(model_type, got, expected, "multi-head latent attention in absorbed form "
                  "(vLLM's MLA pages) whose logits are not mlx-lm's")
    if kv_shape is not None and tuple(kv_shape) != (1, latent_dim + rope_dim):
        layout.notes.append(f"MLA pages of {latent_dim} latent + {rope_dim} rope values per "
                            f"token, where vLLM's own model of this type caches "
                            f"{kv_shape[0]} KV heads of {kv_shape[1]}")


def _check_logits(model_type: str, got: mx.array, expected: mx.array, feature: str) -> None:
    """Raise :class:`UnsupportedModel` (``feature``, with the difference) where ``got`` is not
    ``expected`` within the dtype's tolerance (:data:`_LOGITS_RTOL`)."""
    expected = expected.astype(mx.float32)
    scale = float(mx.max(mx.abs(expected))) or 1.0
    err = float(mx.max(mx.abs(got.astype(mx.float32) - expected)))
    rtol = _LOGITS_RTOL.get(got.dtype, _LOGITS_RTOL_16BIT)
    if got.shape != expected.shape or err > rtol * scale:
        raise UnsupportedModel(model_type, f"{feature} (differ by {err:.3g})")


def _probed_states(model_type: str, i: int, cache: Any
                   ) -> tuple[tuple[tuple[int, ...], mx.Dtype], ...]:
    """``(shape, dtype)`` per state of a recurrent slot's mlx-lm cache after the probe step,
    without the batch axis.

    Raises:
        UnsupportedModel: a state the mixer left unset.
    """
    from mlx_lm.models.cache import CacheList

    if isinstance(cache, CacheList):
        cache = cache.caches[_list_kinds(cache).index("state")]
    states = list(cache.cache)
    if any(a is None for a in states):
        raise UnsupportedModel(model_type, "a recurrent layer that leaves some of its cache "
                               "entries unset", i)
    return tuple((tuple(a.shape[1:]), a.dtype) for a in states)


def _attention_slot(model_type: str, i: int, slot: AttentionSlot,
                    record: routing.CacheRecord) -> AttentionSlot:
    if not record.writes and record.attends == 0:
        raise UnsupportedModel(model_type, "a KV cache slot whose layer neither writes nor "
                               "attends (a stand-in for attention, e.g. DeciLM's "
                               "replace_with_linear block)", i)
    if not record.writes:
        raise UnsupportedModel(model_type, "an attention layer that writes no keys of its own "
                               "(KV shared across layers)", i)
    if record.attends == 0:
        raise UnsupportedModel(model_type, "attention computed outside mlx-lm's "
                               "scaled_dot_product_attention (e.g. logit soft-capping or a "
                               "custom kernel)", i)
    shapes = set(record.writes)
    if len(shapes) != 1:
        raise UnsupportedModel(model_type, f"key/value shapes that change between steps "
                               f"({sorted(shapes)})", i)
    (kv_heads, k_dim, v_dim), = shapes
    if k_dim != v_dim:
        raise UnsupportedModel(model_type, f"a value head size ({v_dim}) other than the key "
                               f"head size ({k_dim})", i)
    return AttentionSlot(slot.window, kv_heads, k_dim, slot.chunk)


def _check_head(model: nn.Module, model_type: str, prompt: mx.array, expected: mx.array
                ) -> None:
    """The runner computes logits as the inner model then :func:`lm_head`: that must be
    mlx-lm's ``Model.__call__`` (a model that changes the inputs or embeddings before its
    inner model would be computed wrongly)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    try:
        hidden = decoder(model)(prompt, cache=caches)
        got = lm_head(model, hidden[0])[None]
        got = mx.concatenate([got, lm_head(model, decoder(model)(mx.array([[6]]),
                                                              cache=caches)[0])[None]], axis=1)
        mx.eval(got)
    except Exception as e:  # noqa: BLE001 - re-raised with the model named
        raise UnsupportedModel(model_type, f"a model whose inner model cannot be called alone "
                               f"({e!r})") from e
    _check_logits(model_type, got, expected, "a model whose logits are not its inner model "
                  "followed by its output head")
