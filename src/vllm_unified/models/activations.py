"""MLP activations as the checkpoint's config names them, where mlx-lm's module hard-codes
one: StarCoder2's MLP computes exact GELU, while its checkpoints (and vLLM, and transformers)
use the tanh approximation (``hidden_act = "gelu_pytorch_tanh"``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import mlx.nn as nn

__all__ = ["match_config_activations"]

_EXACT_GELU = ("gelu",)
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")


def match_config_activations(model: nn.Module, config: Mapping[str, Any]) -> int:
    """Make ``model``'s MLPs compute the config's ``hidden_act``; returns how many changed.

    Raises:
        ValueError: an activation the family's mlx-lm module cannot be given.
    """
    if config.get("model_type") != "starcoder2":
        return 0
    act = config.get("hidden_act", "gelu_pytorch_tanh")
    if act in _EXACT_GELU:
        return 0
    if act not in _TANH_GELU:
        raise ValueError(f"starcoder2: hidden_act {act!r} is not supported (known: "
                         f"{', '.join(_EXACT_GELU + _TANH_GELU)})")
    from mlx_lm.models.starcoder2 import MLP

    changed = 0
    for layer in model.model.layers:
        if type(layer.mlp) is MLP:
            layer.mlp.__class__ = _tanh_gelu_class()
            changed += 1
    return changed


def _tanh_gelu_call(self: Any, x: Any) -> Any:
    return self.c_proj(nn.gelu_approx(self.c_fc(x)))


@functools.cache
def _tanh_gelu_class() -> type:
    from mlx_lm.models.starcoder2 import MLP

    return type("TanhGeluMLP", (MLP,), {"__call__": _tanh_gelu_call,
                                         "__doc__": "StarCoder2's MLP with tanh GELU."})
