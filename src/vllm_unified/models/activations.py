"""MLP activations as the checkpoint's config names them, where mlx-lm's module hard-codes
one: StarCoder2's and GPT-BigCode's MLPs compute exact GELU, while their checkpoints (and vLLM,
and transformers) use the tanh approximation by default (StarCoder2's ``hidden_act``,
GPT-BigCode's ``activation_function``: ``gelu_pytorch_tanh``)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

import mlx.nn as nn

__all__ = ["match_config_activations"]

_EXACT_GELU = ("gelu",)
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")

#: model type -> (the config key naming the activation, its default in transformers)
_FAMILIES = {
    "starcoder2": ("hidden_act", "gelu_pytorch_tanh"),
    "gpt_bigcode": ("activation_function", "gelu_pytorch_tanh"),
}


def match_config_activations(model: nn.Module, config: Mapping[str, Any]) -> int:
    """Make ``model``'s MLPs compute the config's activation; returns how many changed.

    Raises:
        ValueError: an activation the family's mlx-lm module cannot be given.
    """
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        return 0
    key, default = _FAMILIES[model_type]
    act = config.get(key) or default
    if act in _EXACT_GELU:
        return 0
    if act not in _TANH_GELU:
        raise ValueError(f"{model_type}: {key} {act!r} is not supported (known: "
                         f"{', '.join(_EXACT_GELU + _TANH_GELU)})")
    mlp = importlib.import_module(f"mlx_lm.models.{model_type}").MLP
    changed = 0
    for _, module in model.named_modules():
        if type(module) is mlp:
            module.__class__ = _tanh_gelu_class(mlp)
            changed += 1
    return changed


def _tanh_gelu_call(self: Any, x: Any) -> Any:
    return self.c_proj(nn.gelu_approx(self.c_fc(x)))


@functools.cache
def _tanh_gelu_class(mlp: type) -> type:
    return type("TanhGeluMLP", (mlp,), {"__call__": _tanh_gelu_call,
                                         "__doc__": f"{mlp.__module__}'s MLP with tanh GELU."})
