"""YaRN RoPE as the config declares it where mlx-lm's ``YarnRoPE`` rounds it differently.

YaRN blends interpolated and extrapolated frequencies over a ramp between two correction
dimensions. transformers and vLLM round those dimensions outwards (floor / ceil) unless the
config's ``rope_scaling`` says ``truncate: false`` (gpt-oss's checkpoints do); mlx-lm's
``YarnRoPE`` always rounds. :func:`match_yarn_truncation` recomputes the frequencies of the
model's ``YarnRoPE`` modules built from the config's top-level RoPE without rounding, so the
model computes what its config describes (as vLLM serves it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["match_yarn_truncation", "yarn_frequencies"]


def yarn_frequencies(dims: int, base: float, scaling: Mapping[str, Any],
                     truncate: bool) -> mx.array:
    """The per-pair wavelengths (``freqs`` of ``mx.fast.rope``, ``dims // 2`` float32 values)
    of YaRN for a rotary width ``dims``: the extrapolated frequency ``base ** (-2i / dims)``
    below the ramp, the interpolated one (divided by ``factor``) above it, blended linearly
    between the correction dimensions of ``beta_fast`` and ``beta_slow``, rounded outwards
    when ``truncate``."""
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings", 4096))
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # a step, not a ramp
    pairs = mx.arange(dims // 2, dtype=mx.float32)
    extrapolated = mx.clip((pairs - low) / (high - low), 0, 1)  # share of the interpolated
    wavelength = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inverse = (1 - extrapolated) / wavelength + extrapolated / (factor * wavelength)
    return 1.0 / inverse


def match_yarn_truncation(model: nn.Module, config: Mapping[str, Any]) -> int:
    """Give every ``YarnRoPE`` of ``model`` built from the config's top-level RoPE
    (``rope_theta``, ``rope_scaling``) the unrounded ramp where ``rope_scaling`` has
    ``truncate: false``; returns how many modules changed (0 otherwise). A module is
    recognised by its frequencies equalling the rounded ones mlx-lm derives from the config;
    others (a second RoPE of another base) are left as they are."""
    from mlx_lm.models.rope_utils import YarnRoPE

    scaling = config.get("rope_scaling")
    if not isinstance(scaling, Mapping) or scaling.get("truncate", True):
        return 0
    if scaling.get("rope_type", scaling.get("type")) not in ("yarn", "deepseek_yarn"):
        return 0
    base = float(config["rope_theta"])
    changed = 0
    for _, module in model.named_modules():
        if not isinstance(module, YarnRoPE):
            continue
        rounded = yarn_frequencies(module.dims, base, scaling, truncate=True)
        if module._freqs.shape != rounded.shape or not mx.allclose(
                module._freqs, rounded, rtol=1e-5).item():
            continue
        module._freqs = yarn_frequencies(module.dims, base, scaling, truncate=False)
        changed += 1
    return changed
