"""The token-major forward of an mlx-lm model over the paged cache, which the model runner
and the draft model (:mod:`vllm_unified.worker.draft_model`) both run."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_unified.models.output_head import decoder, lm_head

__all__ = ["forward", "forward_hidden"]


def forward(
    model: nn.Module, layer_caches: list[Any], input_ids: mx.array, rows: np.ndarray,
    input_embeddings: mx.array | None = None,
) -> mx.array:
    """One token-major forward of an mlx-lm model over the paged cache (lazy). Call it inside
    :func:`~vllm_unified.kv.forward_context.set_step_context` with the step's context.

    Args:
        model: mlx-lm model with paged attention installed.
        layer_caches: one cache per layer (:mod:`vllm_unified.kv.layer_cache`).
        input_ids: ``[T]`` int32 token ids, one row per scheduled token.
        rows: ``[R]`` int32 rows whose logits are needed (numpy, or an MLX array): the rows
            that sample, plus prompt rows only for requests that asked for prompt logprobs.
        input_embeddings: ``[T, D]`` hidden states fed instead of the token embedding (a
            later pipeline stage: the previous stage's output), or None.

    Returns:
        ``[R, V]`` logits in the model dtype (the LM head runs on those rows only).
    """
    hidden = _inner_forward(model, layer_caches, input_ids, input_embeddings)  # [T, 1, D]
    if rows.size:
        hidden = hidden[rows if isinstance(rows, mx.array) else mx.array(rows), 0, :]
    else:
        hidden = hidden[:0, 0, :]
    return lm_head(model, hidden)


def forward_hidden(
    model: nn.Module, layer_caches: list[Any], input_ids: mx.array,
    input_embeddings: mx.array | None,
) -> mx.array:
    """:func:`forward` of a pipeline stage before the last (lazy): ``[T, D]`` hidden states
    after this stage's layers (its final norm is the identity: the residual stream)."""
    return _inner_forward(model, layer_caches, input_ids, input_embeddings)[:, 0, :]


def _inner_forward(model: nn.Module, layer_caches: list[Any], input_ids: mx.array,
                   input_embeddings: mx.array | None) -> mx.array:
    """The mlx-lm decoder stack over ``[T, 1]`` rows: ``[T, 1, D]``."""
    if input_embeddings is None:
        return decoder(model)(input_ids[:, None], cache=layer_caches)
    return decoder(model)(input_ids[:, None], cache=layer_caches,
                          input_embeddings=input_embeddings[:, None, :])
