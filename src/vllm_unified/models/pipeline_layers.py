"""A pipeline stage's part of an mlx-lm model: the modules another stage holds are replaced
before any weight is read (:func:`prune_model`; the stage split is
:class:`vllm_unified.distributed.pipeline.PipelineStage`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_unified.distributed.pipeline import PP_MODEL_TYPES, PipelineStage

__all__ = ["MissingLayer", "prune_model"]


class MissingLayer(nn.Module):
    """Stands in for a decoder layer another stage holds: no parameters, passes the hidden
    states through. Per-layer flags the model's loop reads (``use_sliding``, ``is_sliding``,
    ``is_linear``) are kept from the layer it replaces."""

    def __init__(self, layer: nn.Module | None = None) -> None:
        super().__init__()
        for flag in ("use_sliding", "is_sliding", "is_linear"):
            if layer is not None and hasattr(layer, flag):
                setattr(self, flag, getattr(layer, flag))

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return x


class _Unheld(nn.Module):
    """A module this stage does not hold (embedding, norm or LM head of another stage)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._what = name

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        raise RuntimeError(f"{self._what} is held by another pipeline stage")


def prune_model(model: nn.Module, stage: PipelineStage, model_type: str) -> None:
    """Drop from ``model`` (an mlx-lm ``Model``, weights not yet evaluated) what ``stage``
    does not hold, so those weights are never read or kept.

    Raises:
        ValueError: the architecture is not in :data:`PP_MODEL_TYPES`, or the model's layer
            count is not the stage's.
    """
    if stage.size == 1:
        return
    if model_type not in PP_MODEL_TYPES:
        raise ValueError(f"--pipeline-parallel-size {stage.size}: model type {model_type!r} is "
                         f"not supported with pipeline parallelism by vllm-unified (supported: "
                         f"{', '.join(PP_MODEL_TYPES)})")
    inner = model.model
    if len(inner.layers) != stage.num_layers:
        raise ValueError(f"mlx-lm built {len(inner.layers)} layers, the pipeline split has "
                         f"{stage.num_layers}")
    for i, layer in enumerate(inner.layers):
        if i not in stage.layers:
            inner.layers[i] = MissingLayer(layer)
    tied = "lm_head" not in model
    if not stage.is_first and not (stage.is_last and tied):
        inner.embed_tokens = _Unheld("the token embedding")
    if not stage.is_last:
        inner.norm = nn.Identity()  # the next stage receives the residual stream
        if not tied:
            model.lm_head = _Unheld("the LM head")
