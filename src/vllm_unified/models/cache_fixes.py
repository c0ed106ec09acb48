"""mlx-lm cache lists made to agree with their own model's attention mask.

PLaMo 3's sliding layers attend to the current token and the ``window_size`` tokens before it
(``window_size + 1`` keys: the mask mlx-lm's module builds, as the checkpoints' own modeling
code does), while mlx-lm's ``make_cache`` gives them a rotating cache of ``window_size``
entries, so its decode steps see one key fewer than its prefill. The cache slot's size is the
window the paged cache serves the layer with (:mod:`vllm_unified.models.capability`), so the
model's ``make_cache`` is given the mask's window.

DeepSeek-V4.1's ``make_cache`` gives every layer one ``LayerCache`` (its sliding window, plus
the compressed KV groups and index keys of its compressed layers). A model without compressed
layers (``compress_ratios`` all 0) attends over its window only: its caches become rotating
caches of ``sliding_window`` entries, which the paged cache serves as sliding-window layers
(the attention and decoder adapters of :mod:`vllm_unified.models.attention_adapters` compute
on them); with compressed layers the ``LayerCache`` stays and the model is refused.

DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: ``models/config.py``'s
``SPARSE_ATTENTION_INDEXED``) caches the MLA latent and its indexer's keys as a ``CacheList``
per layer; served where the context never exceeds ``index_topk`` (the indexer then selects
every key), each layer gets one cache, its MLA slot (the latent adapter,
:mod:`vllm_unified.models.latent_attention`, keeps an indexer cache beside it for mlx-lm's
own code).

LongCat-Flash caches its two MLA sublayers per decoder layer as a ``CacheList`` of two
caches; each sublayer gets its own cache slot (layer i: slots 2i and 2i + 1), which the
decoder's adapter pairs again.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import mlx.nn as nn

from vllm_unified.models.config import SPARSE_ATTENTION_INDEXED

__all__ = ["match_cache_windows"]


def match_cache_windows(model: nn.Module, config: Mapping[str, Any]) -> bool:
    """Make ``model.make_cache`` size sliding caches as its attention mask reads them (PLaMo
    3), give window-only DeepSeek-V4.1 rotating caches, DeepSeek sparse attention one MLA
    cache per layer and LongCat-Flash one per attention sublayer; returns whether the model
    changed."""
    if not hasattr(model, "make_cache"):
        return False
    model_type = config.get("model_type")
    if model_type == "plamo3":
        fix = _plamo3_make_cache
    elif model_type == "longcat_flash":
        fix = _sublayer_make_cache
    elif model_type in SPARSE_ATTENTION_INDEXED:
        fix = _latent_only_make_cache
    elif model_type == "deepseek_v41" and not any(model.args.compress_ratios):
        fix = _window_only_make_cache
    else:
        return False
    model.__class__ = _with_make_cache(type(model), fix)
    return True


def _plamo3_make_cache(self: Any) -> list[Any]:
    """PLaMo 3: sliding caches of window_size + 1 entries."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    window = int(self.config.window_size) + 1  # the mask's window_size argument
    return [KVCache() if layer.full_attn else RotatingKVCache(max_size=window)
            for layer in self.layers]


def _window_only_make_cache(self: Any) -> list[Any]:
    """DeepSeek-V4.1 without compressed layers: one rotating cache of sliding_window entries
    per layer."""
    from mlx_lm.models.cache import RotatingKVCache

    return [RotatingKVCache(max_size=int(self.args.sliding_window)) for _ in self.layers]


def _latent_only_make_cache(self: Any) -> list[Any]:
    """DeepSeek sparse attention within index_topk: one MLA cache per layer (the indexer's
    keys are not paged)."""
    from mlx_lm.models.cache import KVCache

    return [KVCache() for _ in self.layers]


def _sublayer_make_cache(self: Any) -> list[Any]:
    """LongCat-Flash: one cache per attention sublayer."""
    from mlx_lm.models.cache import KVCache

    return [KVCache() for layer in self.layers for _ in layer.self_attn]


@functools.cache
def _with_make_cache(base: type, make_cache: Any) -> type:
    """``base`` (an mlx-lm ``Model``) whose ``make_cache`` is ``make_cache`` (its docstring says
    which caches), one class per pair."""
    return type(f"CacheFixed{base.__name__}", (base,),
                {"make_cache": make_cache, "__doc__": make_cache.__doc__})
