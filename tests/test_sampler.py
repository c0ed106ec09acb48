"""The MLX sampler follows vLLM's semantics: its masks equal vLLM's own torch implementations
(``apply_top_k_top_p_pytorch``, the builtin min-p processor) and draws stay inside them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from vllm_unified.worker.sampler import SamplingRow, apply_min_p, apply_top_k_top_p, sample

V = 512


def _logits(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, V)).astype(np.float32) * 3
    x[:, :8] = x[:, :1]  # ties at the top-k boundary must be kept, as vLLM keeps them
    return x


def _vllm_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # vllm/v1/sample/logits_processor/builtin.py: MinPLogitsProcessor.apply
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, -float("inf"))


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_mask_equals_vllm(seed):
    logits = _logits(6, seed)
    ks = [1, 5, 50, V, 0, 3]
    ps = [1.0, 0.9, 0.5, 0.3, 0.95, 0.01]
    rows = [SamplingRow(temperature=1.0, top_k=k, top_p=p) for k, p in zip(ks, ps, strict=True)]
    ours = np.array(apply_top_k_top_p(mx.array(logits), rows))
    k = torch.tensor([k if 0 < k < V else V for k in ks])
    ref = apply_top_k_top_p_pytorch(torch.tensor(logits), k, torch.tensor(ps)).numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))


def test_min_p_mask_equals_vllm():
    logits = _logits(4, 7)
    min_p = np.array([0.0, 0.05, 0.3, 0.9], dtype=np.float32)
    ours = np.array(apply_min_p(mx.array(logits), mx.array(min_p)))
    ref = _vllm_min_p(torch.tensor(logits), torch.tensor(min_p)).numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))


def test_draws_stay_in_allowed_set_and_greedy_is_argmax():
    logits = _logits(4, 3)
    rows = [SamplingRow(temperature=0.0), SamplingRow(temperature=0.8, top_k=5),
            SamplingRow(temperature=1.3, top_p=0.6), SamplingRow(temperature=1.0, min_p=0.2)]
    allowed_k = set(np.argsort(-logits[1])[:8])  # 5 plus the tied ones
    probs2 = torch.softmax(torch.tensor(logits[2] / 1.3), -1).numpy()
    order = np.argsort(-probs2)
    allowed_p = set(order[: int(np.searchsorted(np.cumsum(probs2[order]), 0.6)) + 1])
    p3 = torch.softmax(torch.tensor(logits[3]), -1).numpy()
    allowed_min_p = set(np.nonzero(p3 >= 0.2 * p3.max())[0])
    for _ in range(50):
        got = np.array(sample(mx.array(logits), rows)).tolist()
        assert got[0] == int(np.argmax(logits[0]))
        assert got[1] in allowed_k
        assert got[2] in allowed_p
        assert got[3] in allowed_min_p


def test_seeded_rows_reproducible_and_independent_of_batch():
    logits = _logits(3, 11)
    key = mx.random.key(42)
    alone = sample(mx.array(logits[1:2]), [SamplingRow(temperature=1.0, key=key)])
    batched = sample(mx.array(logits), [SamplingRow(temperature=1.0),
                                        SamplingRow(temperature=1.0, key=key),
                                        SamplingRow(temperature=0.5)])
    assert int(alone[0]) == int(batched[1])
    other = [int(sample(mx.array(logits[1:2]),
                        [SamplingRow(temperature=1.0, key=mx.random.key(s))])[0])
             for s in range(20)]
    assert len(set(other)) > 1


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="sampling rows"):
        sample(mx.zeros((2, V)), [SamplingRow(temperature=0.0)])
