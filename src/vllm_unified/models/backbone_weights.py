"""Checkpoints of a decoder's backbone alone, as embedding models ship them (Qwen3-Embedding:
``embed_tokens.weight``, ``layers.N...``, ``norm.weight``, saved from transformers'
``Qwen3Model`` under a ``*ForCausalLM`` architecture), loaded into mlx-lm's whole model.

vLLM's pooling adapter accepts weights relative to the backbone and has no LM head; mlx-lm's
``Model`` wants ``model.``-prefixed names and, unless embeddings are tied, an ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

__all__ = ["backbone_relative", "with_backbone_weights"]

#: names that start a backbone's tensors (the decoder stack of mlx-lm's ``model``)
_BACKBONE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def backbone_relative(weights: dict[str, Any]) -> bool:
    """Whether ``weights`` are named relative to the backbone: no ``model.`` prefix and every
    name under the embedding, the layers or the final norm."""
    return bool(weights) and all(n.startswith(_BACKBONE_PREFIXES) for n in weights)


def with_backbone_weights(model_class: type, pooling: bool) -> type:
    """``model_class`` with a ``sanitize`` that first prefixes backbone-relative names with
    ``model.``; for a pooling model (``pooling``) without an LM head in its checkpoint, the
    head the architecture declares gets the token embedding: the pooling runner never runs
    the head, but mlx-lm's strict load and the load-time probe need one.

    A generation model keeps mlx-lm's strict check: a missing head stays an error.
    """
    sanitize_next: Callable[[Any, dict], dict] | None = getattr(model_class, "sanitize", None)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if backbone_relative(weights):
            weights = {f"model.{n}": w for n, w in weights.items()}
            if pooling and "lm_head" in self and "lm_head.weight" not in weights:
                weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return sanitize_next(self, weights) if sanitize_next is not None else weights

    return type(model_class.__name__, (model_class,), {
        "sanitize": sanitize, "__module__": model_class.__module__,
        "__doc__": f"{model_class.__doc__ or ''} (backbone-relative weights accepted)"})
