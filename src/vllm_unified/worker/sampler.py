"""Token sampling in MLX with vLLM's semantics.

Implemented here: greedy (``temperature < 1e-5``), temperature, ``top_k``, ``top_p``, ``min_p`` and
per-request ``seed``. The order and the masking rules follow vLLM 0.32's V1 sampler
(``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``, the builtin ``MinPLogitsProcessor``):
temperature, then min-p, then top-k, then top-p, then a draw ``argmax(probs / q)`` with
``q ~ Exponential(1)`` (the Gumbel-max equivalent vLLM uses). A request that uses any other
sampling parameter is sampled by vLLM's own sampler instead (:mod:`.vllm_sampling`), and what
neither implements is rejected by ``MLXPlatform.validate_request`` with HTTP 400, so none is
silently ignored.

Random streams: a request with a ``seed`` owns an MLX PRNG key split once per sampled token, so
its tokens do not depend on which other requests share the batch. Unseeded requests draw from
MLX's global generator (seeded once per engine from vLLM's ``--seed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from vllm_unified.compat import SAMPLING_EPS


@dataclass
class SamplingRow:
    """Sampling settings of one logits row (one request at one step).

    Attributes:
        temperature: vLLM semantics; below 1e-5 means greedy.
        top_k: keep the k largest logits; 0 or -1 disables.
        top_p: keep the smallest set whose probability mass reaches p; 1.0 disables.
        min_p: drop tokens whose probability is below ``min_p * max_prob``; 0 disables.
        key: this step's PRNG key for a seeded request, else None (global generator).
    """

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    key: mx.array | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def sample(logits: mx.array, rows: list[SamplingRow]) -> mx.array:
    """Sample one token per row.

    Args:
        logits: ``[R, V]`` raw logits (any float dtype; computed in float32).
        rows: ``R`` settings, in row order.

    Returns:
        ``[R]`` int32 token ids (lazy MLX array).
    """
    if len(rows) != logits.shape[0]:
        raise ValueError(f"{len(rows)} sampling rows for {logits.shape[0]} logits rows")
    logits = logits.astype(mx.float32)
    greedy_ids = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all(r.greedy for r in rows):
        return greedy_ids

    temps = mx.array([r.temperature if not r.greedy else 1.0 for r in rows], dtype=mx.float32)
    scaled = logits / temps[:, None]
    if any(r.min_p > SAMPLING_EPS for r in rows):
        scaled = apply_min_p(scaled, mx.array([r.min_p for r in rows], dtype=mx.float32))
    if any(0 < r.top_k < logits.shape[-1] or r.top_p < 1.0 - SAMPLING_EPS for r in rows):
        scaled = apply_top_k_top_p(scaled, rows)
    probs = mx.softmax(scaled, axis=-1)
    random_ids = mx.argmax(probs / _exponential_noise(rows, logits.shape[-1]), axis=-1)
    is_greedy = mx.array([r.greedy for r in rows])
    return mx.where(is_greedy, greedy_ids, random_ids.astype(mx.int32))


def apply_min_p(logits: mx.array, min_p: mx.array) -> mx.array:
    probs = mx.softmax(logits, axis=-1)
    threshold = probs.max(axis=-1, keepdims=True) * min_p[:, None]
    return mx.where(probs < threshold, -mx.inf, logits)


def apply_top_k_top_p(logits: mx.array, rows: list[SamplingRow]) -> mx.array:
    """vLLM's ``apply_top_k_top_p``: sort ascending; top-k keeps values >= the k-th largest
    (ties kept); top-p drops the low tail whose cumulative mass is <= 1 - p, keeping at least
    the largest token. Masked entries become -inf."""
    vocab = logits.shape[-1]
    order = mx.argsort(logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)

    k = mx.array([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], dtype=mx.int32)
    kth = mx.take_along_axis(sorted_logits, (vocab - k)[:, None], axis=-1)
    sorted_logits = mx.where(sorted_logits < kth, -mx.inf, sorted_logits)

    p = mx.array([r.top_p for r in rows], dtype=mx.float32)
    cumulative = mx.cumsum(mx.softmax(sorted_logits, axis=-1), axis=-1)
    drop = cumulative <= (1.0 - p)[:, None]
    drop = mx.concatenate([drop[:, :-1], mx.zeros((len(rows), 1), dtype=mx.bool_)], axis=-1)
    sorted_logits = mx.where(drop, -mx.inf, sorted_logits)

    # Undo the sort: position order[i, j] receives sorted_logits[i, j].
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(sorted_logits, inverse, axis=-1)


def _exponential_noise(rows: list[SamplingRow], vocab: int) -> mx.array:
    """``[R, V]`` Exponential(1) draws: per-row keys for seeded rows, one global draw for the
    rest. Uniforms are kept away from 0 so ``-log(u)`` is finite and positive."""
    unseeded = mx.random.uniform(shape=(len(rows), vocab))
    per_row = [
        mx.random.uniform(shape=(vocab,), key=r.key) if r.key is not None else unseeded[i]
        for i, r in enumerate(rows)
    ]
    u = mx.stack(per_row) if any(r.key is not None for r in rows) else unseeded
    return -mx.log(mx.maximum(u, 1e-10))
