"""mlx-lm cache lists made to agree with their own model's attention mask.

PLaMo 3's sliding layers attend to the current token and the ``window_size`` tokens before it
(``window_size + 1`` keys: the mask mlx-lm's module builds, as the checkpoints' own modeling
code does), while mlx-lm's ``make_cache`` gives them a rotating cache of ``window_size``
entries, so its decode steps see one key fewer than its prefill. The cache slot's size is the
window the paged cache serves the layer with (:mod:`vllm_unified.models.capability`), so the
model's ``make_cache`` is given the mask's window.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import mlx.nn as nn

__all__ = ["match_cache_windows"]


def match_cache_windows(model: nn.Module, config: Mapping[str, Any]) -> bool:
    """Make ``model.make_cache`` size sliding caches as its attention mask reads them; returns
    whether the model changed (only PLaMo 3 needs it)."""
    if config.get("model_type") != "plamo3" or not hasattr(model, "make_cache"):
        return False
    model.__class__ = _plamo3_class(type(model))
    return True


def _plamo3_make_cache(self: Any) -> list[Any]:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    window = int(self.config.window_size) + 1  # the mask's window_size argument
    return [KVCache() if layer.full_attn else RotatingKVCache(max_size=window)
            for layer in self.layers]


@functools.cache
def _plamo3_class(base: type) -> type:
    return type(f"WindowMatched{base.__name__}", (base,),
                {"make_cache": _plamo3_make_cache,
                 "__doc__": "PLaMo 3 with sliding caches of window_size + 1 entries."})
