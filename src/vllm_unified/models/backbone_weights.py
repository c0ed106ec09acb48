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

__all__ = ["STAND_IN_HEAD", "backbone_relative", "with_backbone_weights"]

#: the key in ``head`` that says the LM head is the embedding standing in for a missing one
STAND_IN_HEAD = "lm_head.stand_in"
#: names that start a backbone's tensors (the decoder stack of mlx-lm's ``model``)
_BACKBONE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def backbone_relative(weights: dict[str, Any]) -> bool:
    """Whether ``weights`` are named relative to the backbone: no ``model.`` prefix and every
    name under the embedding, the layers or the final norm."""
    return bool(weights) and all(n.startswith(_BACKBONE_PREFIXES) for n in weights)


def with_backbone_weights(model_class: type, pooling: bool,
                          head: dict[str, Any] | None = None) -> type:
    """``model_class`` with a ``sanitize`` that first prefixes backbone-relative names with
    ``model.``. For a pooling model (``pooling``): a sequence classifier's ``score.*``
    tensors go to ``head`` (mlx-lm's model has no such layer; vLLM's pooler runs it), and
    where the checkpoint has no LM head the head the architecture declares gets the token
    embedding: the pooling runner never runs it, but mlx-lm's strict load and the load-time
    probe need one. A head read from the LM head's rows (Qwen3-Reranker) is read from a
    checkpoint that has one, or ties it.

    A generation model keeps mlx-lm's strict check: a missing head stays an error.
    """
    sanitize_next: Callable[[Any, dict], dict] | None = getattr(model_class, "sanitize", None)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if backbone_relative(weights):
            weights = {f"model.{n}": w for n, w in weights.items()}
        if pooling:
            for name in [n for n in weights if n.startswith("score.")]:
                if head is not None:
                    head[name] = weights[name]
                del weights[name]
            if ("lm_head" in self and "lm_head.weight" not in weights
                    and "model.embed_tokens.weight" in weights):
                weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
                if head is not None:  # no LM head to read classifier rows from
                    head[STAND_IN_HEAD] = weights["lm_head.weight"]
        return sanitize_next(self, weights) if sanitize_next is not None else weights

    return type(model_class.__name__, (model_class,), {
        "sanitize": sanitize, "__module__": model_class.__module__,
        "__doc__": f"{model_class.__doc__ or ''} (backbone-relative weights accepted)"})
