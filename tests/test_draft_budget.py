"""The batch-aware draft budget (``vllm_unified.worker.draft_budget``) on synthetic step costs
and acceptance: the choice itself (cheap rows -> every draft, compute-bound rows -> none,
monotonic in cost, acceptance and batch size), the local cost fit, the acceptance estimate,
and the policy's cold start and probes. No model, no vLLM engine."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_unified.worker import draft_budget as db
from vllm_unified.worker.draft_budget import Acceptance, DraftBudget, LocalCost, best_depth

HIGH = [0.9, 0.8, 0.7, 0.6]
LOW = [0.3, 0.1, 0.05, 0.01]


# ------------------------------------------------------------------------------ the choice
def test_cheap_rows_hand_every_draft():
    # one stream bound by reading the weights: 20 ms a step, 0.1 ms a row
    assert best_depth([4], HIGH, fixed_s=0.020, per_row_s=0.0001) == 4
    assert best_depth([4], LOW, fixed_s=0.020, per_row_s=0.0001) == 4
    assert best_depth([4] * 16, HIGH, fixed_s=0.020, per_row_s=0.0001) == 4


def test_compute_bound_rows_hand_none():
    # 16 streams, a step's time all rows (15 ms each): no draft pays, however well accepted
    assert best_depth([4] * 16, LOW, fixed_s=0.0, per_row_s=0.015) == 0
    assert best_depth([4] * 16, [0.99] * 4, fixed_s=0.0, per_row_s=0.015) == 0
    # a fixed part that a few well-accepted drafts do pay for, with low acceptance none
    assert best_depth([4] * 16, LOW, fixed_s=0.05, per_row_s=0.015) == 0
    assert 0 < best_depth([4] * 16, HIGH, fixed_s=0.2, per_row_s=0.015) < 4


def _throughput(lengths, rates, fixed, per_row, d, exempt=None):
    """Expected tokens/s of cap d, written out longhand."""
    exempt = exempt or [False] * len(lengths)
    handed = [m if e else min(m, d) for m, e in zip(lengths, exempt, strict=True)]
    tokens = len(lengths) + sum(rates[:h].sum() for h in handed)
    return tokens / (fixed + per_row * (len(lengths) + sum(handed)))


def test_the_chosen_cap_is_the_best_one():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(0, 5, size=int(rng.integers(1, 20))).tolist()
        rates = np.minimum.accumulate(rng.uniform(0, 1, 4))
        fixed, per_row = rng.uniform(0, 0.1), rng.uniform(0, 0.02)
        best = best_depth(lengths, rates, fixed, per_row)
        throughput = [_throughput(lengths, rates, fixed, per_row, d)
                      for d in range(max(lengths) + 1)]
        assert throughput[best] >= max(throughput) * (1 - 1e-9)


def test_monotonic_in_row_cost_acceptance_batch_and_draft_cost():
    per_rows = np.linspace(0.0, 0.3, 61)
    caps = [best_depth([4] * 4, HIGH, 0.03, b) for b in per_rows]
    assert caps[0] == 4 and caps[-1] == 0
    assert all(a >= b for a, b in zip(caps, caps[1:], strict=False)), caps
    scales = np.linspace(0.0, 1.0, 21)
    caps = [best_depth([4] * 8, [s * r for r in HIGH], 0.05, 0.01) for s in scales]
    assert caps[0] == 0 and caps[-1] > 0
    assert all(a <= b for a, b in zip(caps, caps[1:], strict=False)), caps
    caps = [best_depth([4] * n, HIGH, 0.06, 0.004) for n in range(1, 257)]
    assert caps[0] == 4 and caps[-1] == 0
    assert all(a >= b for a, b in zip(caps, caps[1:], strict=False)), caps
    caps = [best_depth([4], HIGH, 0.02, 0.0001, c) for c in np.linspace(0, 0.05, 26)]
    assert caps[0] == 4 and caps[-1] == 0
    assert all(a >= b for a, b in zip(caps, caps[1:], strict=False)), caps


def test_ties_keep_fewer_drafts_and_no_proposals_hand_none():
    assert best_depth([4, 4], [0.0] * 4, 0.01, 0.0) == 0  # drafts that gain nothing
    assert best_depth([0, 0, 0], HIGH, 0.01, 0.0) == 0
    assert best_depth([], HIGH, 0.01, 0.0) == 0
    # only the request with drafts decides; the others still cost their row
    assert best_depth([0, 0, 3], HIGH, 0.02, 0.0001) == 3


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="outside 0..4"):
        best_depth([5], HIGH, 0.01, 0.001)
    with pytest.raises(ValueError, match="negative cost"):
        best_depth([2], HIGH, 0.01, -0.001)
    with pytest.raises(ValueError, match="x must be > 0"):
        LocalCost().observe(0, 0.1)
    with pytest.raises(ValueError, match="3 accepted of 2"):
        Acceptance(4).observe(2, 3)


# ------------------------------------------------------------------------------ the measurements
def test_local_cost_recovers_the_line_and_follows_the_roofline():
    rng = np.random.default_rng(1)
    cost = LocalCost()
    for _ in range(200):
        n = int(rng.integers(1, 6))
        cost.observe(n, 0.02 + 0.003 * n + rng.normal(0, 1e-4))
    fit = cost.fit(1, 5)
    assert fit.a == pytest.approx(0.02, abs=5e-4) and fit.b == pytest.approx(0.003, abs=2e-4)
    assert fit.slope_error < 1e-4
    # flat up to 64 rows, then 0.2 ms a row: the line near 1..5 rows is flat, near 128..512 steep
    roof = LocalCost()
    for n in [1, 2, 3, 4, 5] * 20 + [128, 256, 384, 512] * 20:
        roof.observe(n, 0.006 + 0.0002 * max(0, n - 64))
    assert roof.fit(1, 5).b == pytest.approx(0.0, abs=1e-6)
    assert roof.fit(128, 512).b == pytest.approx(0.0002, rel=0.05)


def test_local_cost_needs_weight_and_spread():
    cost = LocalCost()
    assert cost.fit(1, 5) is None and cost.level(1) is None
    for _ in range(10):
        cost.observe(16, 0.2)
    assert cost.fit(16, 80) is None  # every step had 16 rows: no slope
    assert cost.level(16) == pytest.approx(0.2)
    cost.observe(20, 0.26)  # one step with 4 more rows (a probe) gives the slope
    assert cost.fit(16, 80).b == pytest.approx(0.015)
    far = LocalCost()
    for n in [1, 5] * 20:
        far.observe(n, 0.01 * n)
    assert far.fit(1000, 2000) is None  # nothing measured near 1000 rows


def test_old_observations_fade():
    cost = LocalCost(halflife=8)
    for n in [1, 5] * 50:
        cost.observe(n, 0.01 + 0.01 * n)
    for n in [1, 5] * 50:
        cost.observe(n, 0.01 + 0.001 * n)
    assert cost.fit(1, 5).b == pytest.approx(0.001, rel=1e-2)


def test_acceptance_rates():
    acc = Acceptance(4)
    assert acc.rates().tolist() == [0.5] * 4  # the prior
    rng = np.random.default_rng(2)
    true = [0.8, 0.6, 0.5, 0.3]
    for _ in range(3000):
        n = int(rng.integers(1, 5))
        accepted = 0
        while accepted < n and rng.random() < true[accepted] / (true[accepted - 1]
                                                                  if accepted else 1):
            accepted += 1
        acc.observe(n, accepted)
    np.testing.assert_allclose(acc.rates(), true, atol=0.06)
    acc = Acceptance(3)
    for _ in range(50):
        acc.observe(1, 0)
        acc.observe(3, 3)  # position 2 and 3: always accepted when drafted
    r = acc.rates()
    assert r[0] == pytest.approx(0.5, abs=0.02) and r[1] == r[2] == r[0]  # non-increasing


# ------------------------------------------------------------------------------ the policy
def _feed(budget: DraftBudget, cost, lengths_of_steps, rng, rates):
    """Run the policy as the runner does: decide, 'run' the step, observe."""
    caps_seen = []
    for lengths in lengths_of_steps:
        caps = budget.caps(lengths)
        assert all(0 <= c <= m for c, m in zip(caps, lengths, strict=True))
        caps_seen.append(caps)
        budget.observe_step(len(lengths) + sum(caps), cost(len(lengths) + sum(caps)))
        for c in caps:
            if c:
                accepted = 0
                while accepted < c and rng.random() < rates[accepted]:
                    accepted += 1
                budget.observe_acceptance(c, accepted)
    return caps_seen


def test_cold_start_hands_everything_and_probes_with_none():
    budget = DraftBudget(4)
    caps = [budget.caps([4, 2]) for _ in range(6)]
    assert caps == [[4, 2], [0, 0]] * 3  # nothing measured: vLLM's behaviour, every other none
    assert budget.low_probes == 3 and budget.cold_decisions == 6
    assert budget.caps([0, 0]) == [0, 0] and budget.decisions == 6  # nothing to decide


def test_bandwidth_bound_steps_keep_every_draft():
    rng = np.random.default_rng(3)
    budget = DraftBudget(4)
    steps = [[int(rng.integers(0, 5))] for _ in range(200)] + [[4]]  # one stream, ngram-like
    caps = _feed(budget, lambda n: 0.02 + 0.0002 * n, steps, rng, [0.9] * 4)
    assert all(c == m for c, m in zip(caps[40:], steps[40:], strict=True))
    assert budget.last_cap == 4 and budget.cold_decisions < 40


def test_compute_bound_steps_hand_none_but_probe():
    rng = np.random.default_rng(4)
    budget = DraftBudget(4)
    steps = [[4] * 16] * 320
    caps = _feed(budget, lambda n: 0.015 * n, steps, rng, [0.5] * 4)
    late = caps[64:]
    handed = [sum(c) for c in late]
    # every 16th decision one request hands its 4 drafts (a high probe); the others none
    assert sorted(set(handed)) == [0, 4], handed
    assert sum(1 for h in handed if h) == len(late) // db.PROBE_EVERY
    assert budget.last_cap == 0 and budget.high_probes >= len(late) // db.PROBE_EVERY
    # the probes go round the requests
    probed = {c.index(4) for c in late if sum(c)}
    assert len(probed) == len(late) // db.PROBE_EVERY


def test_exempt_requests_hand_everything_and_count_in_the_cost():
    budget = DraftBudget(4)
    assert budget.caps([4, 3], exempt=[True, False]) == [4, 3]  # cold start: all
    assert budget.caps([4, 3], exempt=[True, False]) == [4, 0]  # cold low probe: not exempt
    assert budget.caps([4, 0], exempt=[True, False]) == [4, 0]  # nothing to decide
    assert budget.decisions == 2
    with pytest.raises(ValueError, match="1 exemptions for 2 requests"):
        budget.caps([1, 1], exempt=[True])
    # an exempt request's drafts are paid whatever the cap: the others' cap is still the best
    assert best_depth([4] * 8, HIGH, 0.0, 0.01, exempt=[True] + [False] * 7) == 0
    rng = np.random.default_rng(6)
    for _ in range(100):
        lengths = rng.integers(0, 5, size=6).tolist()
        exempt = (rng.random(6) < 0.3).tolist()
        fixed, per_row = rng.uniform(0, 0.1), rng.uniform(0, 0.02)
        best = best_depth(lengths, HIGH, fixed, per_row, exempt=exempt)
        throughput = [_throughput(lengths, np.array(HIGH), fixed, per_row, d, exempt)
                      for d in range(max(lengths) + 1)]
        assert throughput[best] >= max(throughput) * (1 - 1e-9)


def test_draft_forward_cost_counts_per_position():
    rng = np.random.default_rng(5)
    cheap, dear = DraftBudget(4, draft_forwards=True), DraftBudget(4, draft_forwards=True)
    for _ in range(20):
        cheap.observe_draft_forward(1, 0.0001)
        dear.observe_draft_forward(1, 0.5)
    steps = [[4]] * 80
    _feed(cheap, lambda n: 0.02 + 0.0005 * n + rng.normal(0, 1e-4), steps, rng, [0.9] * 4)
    _feed(dear, lambda n: 0.02 + 0.0005 * n + rng.normal(0, 1e-4), steps, rng, [0.9] * 4)
    assert cheap.last_cap == 4 and dear.last_cap == 0
