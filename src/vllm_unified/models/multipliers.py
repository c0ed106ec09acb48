"""Scale factors a checkpoint's config declares that mlx-lm's module does not apply.

Falcon-H1 (muP): transformers and vLLM scale the keys by ``key_multiplier`` and the attention's
input by ``attention_in_multiplier``. mlx-lm folds the multipliers into the weights when it
converts a transformers checkpoint (its ``sanitize``), but multiplies only ``q_proj`` and
``k_proj`` by ``attention_in_multiplier`` and never applies ``key_multiplier``. The missing
factors are applied here, to the outputs of ``k_proj`` and ``v_proj`` (dense or quantized),
so the model computes what its config describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["ScaledProjection", "apply_config_multipliers"]


class ScaledProjection(nn.Module):
    """``inner(x) * scale``: a projection whose output the config scales."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner = inner
        self.scale = float(scale)

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x) * self.scale


def apply_config_multipliers(model: nn.Module, config: Mapping[str, Any]) -> int:
    """Apply what mlx-lm's module leaves out of the config's multipliers (Falcon-H1's keys and
    values); returns how many projections were scaled (0 for other model types or factors
    of 1)."""
    if config.get("model_type") != "falcon_h1":
        return 0
    attn_in = float(config.get("attention_in_multiplier", 1.0))
    factors = {"k_proj": float(config.get("key_multiplier", 1.0)), "v_proj": attn_in}
    scaled = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        for name, factor in factors.items():
            proj = getattr(attn, name)
            if factor != 1.0 and not isinstance(proj, ScaledProjection):
                setattr(attn, name, ScaledProjection(proj, factor))
                scaled += 1
    return scaled
