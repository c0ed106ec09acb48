"""The text part of an mlx-lm multimodal model, as the model the runner drives.

The runner calls a model's inner model (``model.model``) and then its output head
(:func:`vllm_unified.models.output_head.lm_head`). mlx-lm's Llama 4 (``mlx_lm.models.llama4``,
what ``model_type: llama4`` checkpoints load) nests both one level down, under
``language_model``, beside vision weights it drops. :class:`Llama4Text` is that
``LanguageModel`` itself, built from the same ``ModelArgs``, with the whole model's cache list,
weight sanitizing and layers: the same arithmetic, one level up. :data:`TEXT_MODELS` lists
such classes by model type (used by :func:`vllm_unified.models.config.model_classes`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import llama4

__all__ = ["TEXT_MODELS", "Llama4Text"]

_PREFIX = "language_model."


class Llama4Text(llama4.LanguageModel):
    """mlx-lm's Llama 4 ``LanguageModel`` (``model``: the decoder, ``lm_head``) built from the
    multimodal ``llama4.ModelArgs``; weights named as the checkpoint's (``language_model.``)
    or without that prefix; vision weights are dropped as mlx-lm drops them."""

    def __init__(self, args: llama4.ModelArgs) -> None:
        super().__init__(args.text_config)
        # mlx-lm's Model methods read the multimodal args (``args.text_config``)
        self.args = args
        self.model_type = args.model_type

    @property
    def layers(self) -> list[Any]:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        """mlx-lm's cache list: ``ChunkedKVCache`` for chunked layers, ``KVCache`` else."""
        return llama4.Model.make_cache(self)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """mlx-lm's sanitizing (vision weights dropped, experts stacked), then the names one
        level up (``language_model.`` removed)."""
        weights = {(k if k.startswith(_PREFIX) else _PREFIX + k): v for k, v in weights.items()}
        weights = llama4.Model.sanitize(self, weights)
        return {k.removeprefix(_PREFIX): v for k, v in weights.items()}


#: model type -> the class that loads its text part as the model (with mlx-lm's ``ModelArgs``)
TEXT_MODELS: dict[str, tuple[type, type]] = {"llama4": (Llama4Text, llama4.ModelArgs)}
