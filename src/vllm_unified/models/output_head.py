"""Where an mlx-lm model's decoder stack is, and its output head on selected hidden states:
exactly what mlx-lm's ``Model.__call__`` does after the decoder stack (LM head or tied
embedding, then the family's own final step: logit soft-capping, logit scaling, ...), without
running it over every token."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["decoder", "decoder_path", "lm_head"]


def decoder_path(model: nn.Module) -> tuple[str, ...]:
    """Attribute path from ``model`` to its decoder stack (embedding, layers, final norm):
    ``("model",)`` for most architectures, ``("backbone",)`` (Nemotron-H, Mamba),
    ``("transformer",)`` (EXAONE 3, GPT-BigCode, nanochat), ``("language_model", "model")``
    (a text model inside a multimodal wrapper, Qwen3.5).

    Raises:
        ValueError: none of these.
    """
    if "language_model" in model:
        return ("language_model", *decoder_path(model.language_model))
    for name in ("model", "backbone", "transformer"):
        if name in model:
            return (name,)
    raise ValueError(f"{type(model).__module__}.{type(model).__name__}: no decoder stack "
                     "(model, backbone, transformer or language_model.model)")


def decoder(model: nn.Module) -> nn.Module:
    """The module at :func:`decoder_path`."""
    for name in decoder_path(model):
        model = getattr(model, name)
    return model


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """``[R, V]`` logits of ``hidden`` ``[R, D]`` (the decoder stack's output rows), lazily.

    Runs the architecture's own ``Model.__call__`` on a stand-in for ``model`` whose decoder
    stack returns ``hidden``; whether that equals mlx-lm's forward is checked once at load
    (:mod:`vllm_unified.models.capability`).
    """
    stand_in = _StandIn(model, decoder_path(model), hidden[:, None, :])
    out = type(model).__call__(stand_in, mx.zeros((hidden.shape[0], 1), dtype=mx.int32))
    return out[:, 0, :]


class _Decoder:
    """The decoder stack as ``Model.__call__`` sees it: calling it gives the given hidden
    states; every attribute is the real stack's."""

    def __init__(self, inner: nn.Module, hidden: mx.array) -> None:
        self._inner = inner
        self._hidden = hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _StandIn:
    """``obj`` whose attribute ``path[0]`` leads on to the :class:`_Decoder` (attributes,
    calls and ``in`` checks otherwise answer as ``obj`` does)."""

    def __init__(self, obj: nn.Module, path: tuple[str, ...], hidden: mx.array) -> None:
        self._obj = obj
        self._path = path
        self._hidden = hidden

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._obj, name)
        if name != self._path[0]:
            return value
        if len(self._path) == 1:
            return _Decoder(value, self._hidden)
        return _StandIn(value, self._path[1:], self._hidden)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self._obj).__call__(self, *args, **kwargs)

    def __contains__(self, key: str) -> bool:
        return key in self._obj
