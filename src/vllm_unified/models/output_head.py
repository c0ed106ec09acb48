"""A model's output head on selected hidden states: exactly what mlx-lm's ``Model.__call__``
does after its inner model (LM head or tied embedding, then the family's own final step:
logit soft-capping, logit scaling, ...), without running it over every token."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["lm_head"]


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """``[R, V]`` logits of ``hidden`` ``[R, D]`` (the inner model's output rows), lazily.

    Runs the architecture's own ``Model.__call__`` on a stand-in for ``model`` whose inner
    model returns ``hidden``; whether that equals mlx-lm's forward is checked once at load
    (:mod:`vllm_unified.models.capability`).
    """
    out = type(model).__call__(_HeadOnly(model, hidden[:, None, :]),
                               mx.zeros((hidden.shape[0], 1), dtype=mx.int32))
    return out[:, 0, :]


class _Inner:
    """The inner model as ``Model.__call__`` sees it: calling it gives the given hidden
    states; every attribute is the real inner model's."""

    def __init__(self, inner: nn.Module, hidden: mx.array) -> None:
        self._inner = inner
        self._hidden = hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _HeadOnly:
    """``model`` with its inner model replaced by :class:`_Inner` (attributes and ``in``
    checks answer as ``model`` does)."""

    def __init__(self, model: nn.Module, hidden: mx.array) -> None:
        self._model = model
        self.model = _Inner(model.model, hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __contains__(self, key: str) -> bool:
        return key in self._model
