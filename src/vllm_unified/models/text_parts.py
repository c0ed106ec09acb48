"""The text part of an mlx-lm multimodal model, as the model the runner drives.

The runner calls a model's inner model (``model.model``) and then its output head
(:func:`vllm_unified.models.output_head.lm_head`). mlx-lm's Llama 4 (``mlx_lm.models.llama4``,
what ``model_type: llama4`` checkpoints load) nests both one level down, under
``language_model``, beside vision weights it drops. :class:`Llama4Text` is that
``LanguageModel`` itself, built from the same ``ModelArgs``, with the whole model's cache list,
weight sanitizing and layers: the same arithmetic, one level up. Kimi-VL and Kimi K2.5
(``kimi_vl``, ``kimi_k25``) nest a DeepSeek-V3 decoder the same way, in a ``LanguageModel``
without ``layers``: :class:`KimiVLText` and :class:`KimiK25Text` add them. The vision tower is
never built and its weights are dropped. :data:`TEXT_MODELS` lists such classes by model type
(used by :func:`vllm_unified.models.config.model_classes`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from mlx_lm.models import kimi_k25, kimi_vl, llama4

__all__ = ["TEXT_MODELS", "KimiK25Text", "KimiVLText", "Llama4Text"]

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


def _one_level_up(model: Any, weights: dict[str, mx.array], sanitize: Any
                  ) -> dict[str, mx.array]:
    """``sanitize`` (a wrapper's, reading names under ``language_model.``) applied to
    ``weights``, those of ``model``'s own children (``model.``, ``lm_head.``) named with or
    without that prefix; the result without it."""
    own = tuple(f"{name}." for name in model.children())
    weights = {(_PREFIX + k if k.startswith(own) else k): v for k, v in weights.items()}
    return {k.removeprefix(_PREFIX): v for k, v in sanitize(weights).items()}


class KimiVLText(kimi_vl.LanguageModel):
    """mlx-lm's Kimi-VL ``LanguageModel`` (a DeepSeek-V3 decoder and ``lm_head``) built from
    the multimodal ``kimi_vl.ModelArgs``, with its layers; weights named as the checkpoint's
    (``language_model.``) or without that prefix, sanitized as mlx-lm's ``Model`` does (vision
    weights dropped, experts stacked)."""

    def __init__(self, args: kimi_vl.ModelArgs) -> None:
        super().__init__(args.text_config)
        self.model_type = args.model_type
        self._wrapper_args = args

    @property
    def layers(self) -> list[Any]:
        return self.model.pipeline_layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        whole = SimpleNamespace(args=self._wrapper_args)
        return _one_level_up(self, weights, lambda w: kimi_vl.Model.sanitize(whole, w))

    cast_predicate = kimi_vl.Model.cast_predicate


class KimiK25Text(kimi_k25.LanguageModel):
    """mlx-lm's Kimi K2.5 ``LanguageModel`` (a DeepSeek-V3 decoder and ``lm_head``) built from
    the multimodal ``kimi_k25.ModelArgs``, with its layers; weights named as the checkpoint's
    (``language_model.``) or without that prefix, sanitized as mlx-lm's ``Model`` does (vision
    and projector weights dropped, then DeepSeek-V3's own sanitizing)."""

    def __init__(self, args: kimi_k25.ModelArgs) -> None:
        super().__init__(args.text_config)
        self.model_type = args.model_type

    @property
    def layers(self) -> list[Any]:
        return self.model.pipeline_layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        whole = SimpleNamespace(language_model=self)
        return _one_level_up(self, weights, lambda w: kimi_k25.Model.sanitize(whole, w))

    cast_predicate = kimi_k25.Model.cast_predicate


#: model type -> the class that loads its text part as the model (with mlx-lm's ``ModelArgs``)
TEXT_MODELS: dict[str, tuple[type, type]] = {
    "llama4": (Llama4Text, llama4.ModelArgs),
    "kimi_vl": (KimiVLText, kimi_vl.ModelArgs),
    "kimi_k25": (KimiK25Text, kimi_k25.ModelArgs),
}
