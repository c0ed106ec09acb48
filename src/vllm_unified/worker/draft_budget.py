"""Batch-aware draft budget (speculative decoding): after vLLM's proposer has drafted, how many
of its draft tokens each request hands to vLLM's scheduler.

Why: a verification step of ``B`` requests with ``d`` drafts each runs ``B (d + 1)`` rows.
Where decode is bound by reading the weights (one or a few streams, a GPU) rows are nearly
free and every accepted draft is a token gained; where a step is compute-bound (many streams
on a few CPU cores) its time grows with its rows, and drafts cost about what they save, or
more. Handing fewer drafts is always safe: vLLM's rejection sampler only ever sees fewer, so
outputs and the sampled distribution are unchanged.

The model, measured by the runner as it serves (:class:`DraftBudget`):

* **step cost** ``T(n) = a + b n`` seconds for a step of ``n`` scheduled tokens: a weighted
  least-squares line through the recent decode/verification steps (every request one token
  plus its drafts), each step's time being its whole period, from its ``execute_model`` to
  the next one's (the engine's scheduler and output handling, the proposer, the forward, the
  rejection sampler), less the draft model's forwards. The fit is local (:class:`LocalCost`):
  an observation's weight halves every :data:`STEP_HALFLIFE` steps and falls off with its
  distance, on a log scale, from the rows the decision is about, so the line is the tangent of
  the real cost curve (flat while the weights' bandwidth bounds a step, then rising) where it
  is used, not a chord through batch sizes long gone.
* **draft cost** (method ``draft_model``): each draft position is one draft forward over the
  requests, ``c(B)`` seconds, fitted the same way on the draft's forwards.
* **acceptance** ``r_j``: the probability that draft ``j`` is accepted given that the proposer
  made at least ``j`` drafts, ``j = 1..k``, from the verified requests (weights halving every
  :data:`ACCEPT_HALFLIFE` verifications of that position, a prior of one draft accepted with
  probability :data:`PRIOR_RATE`), made non-increasing in ``j``.

The choice (:func:`best_depth`): with ``m_i`` drafts proposed for request ``i`` and a cap
``D`` (0 to the proposal's longest), request ``i`` hands ``min(m_i, D)``; expected tokens
``sum_i (1 + r_1 + ... + r_min(m_i, D))`` over the step's time
``a + b (B + sum_i min(m_i, D)) + D c(B)``; the ``D`` with the most tokens per second wins
(ties: the smaller). A per-position cap is the optimum for rates shared by all requests (the
best set of equally costly rows is the one with the highest rates).

Exploration, so the measurements never go stale or one-sided:

* **cold start** (fewer than :data:`MIN_WEIGHT` weighted steps near the decision's rows, or no
  spread in their rows): every draft is handed (vLLM's own behaviour), and every
  :data:`COLD_PROBE_EVERY`-th decision (every :data:`PROBE_EVERY`-th once
  :data:`COLD_STEPS` steps were measured) hands none, which gives the line its other end;
* **high probe**: every :data:`PROBE_EVERY`-th decision with a cap below the longest proposal,
  the request with the longest proposal (in turn among equals) hands all of its drafts, which
  keeps every position's acceptance and the cost of extra rows measured;
* **low probe**: every :data:`PROBE_EVERY`-th decision that hands everything while the slope is
  uncertain (its standard error times the drafted rows above :data:`CONFIDENCE` of a step
  without drafts) hands none.

A probe costs at most one step in :data:`PROBE_EVERY` (a low probe) or one request's drafts
in such a step (a high probe).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: steps after which a step-cost observation's weight is halved
STEP_HALFLIFE = 64.0
#: verifications of a position after which its acceptance observation's weight is halved
ACCEPT_HALFLIFE = 256.0
#: acceptance prior: one pseudo-draft per position accepted with this probability
PRIOR_RATE = 0.5
#: weighted steps a fit needs near the decision's rows
MIN_WEIGHT = 3.0
#: rows of standard deviation the fit's observations need (else its slope is unknown)
MIN_SPREAD = 0.5
#: width (natural log of rows) of the fall-off of an observation's weight outside the
#: decision's rows: a factor of e ** 0.5 (1.65x) away weighs exp(-1/2)
LOG_WIDTH = 0.5
#: observations kept for the fits
HISTORY = 256
#: decisions between probes; in the cold start, and how many measured steps it lasts
PROBE_EVERY = 16
COLD_PROBE_EVERY = 2
COLD_STEPS = 16
#: a slope is certain enough when its standard error times the drafted rows is at most this
#: share of the time of a step without drafts
CONFIDENCE = 0.25


@dataclass(frozen=True)
class Fit:
    """A local line ``seconds = a + b * x``.

    Attributes:
        a: seconds at ``x = 0``.
        b: seconds per unit of ``x`` (>= 0: a negative fitted slope is taken as flat).
        slope_error: standard error of ``b`` (seconds per unit; ``inf`` with one
            observation's worth of weight or residual-free data of no spread).
        weight: the fit's total weight (weighted observations).
    """

    a: float
    b: float
    slope_error: float
    weight: float

    def __call__(self, x: float) -> float:
        """Predicted seconds at ``x`` (never below 1 ns)."""
        return max(self.a + self.b * x, 1e-9)


class LocalCost:
    """Recent ``(x, seconds)`` observations and weighted least-squares lines through them.

    Args:
        halflife: observations after which an observation's weight is halved (> 0).
        history: observations kept (the oldest are dropped).

    Raises:
        ValueError: ``halflife`` is not positive.
    """

    def __init__(self, halflife: float = STEP_HALFLIFE, history: int = HISTORY) -> None:
        if not halflife > 0:
            raise ValueError(f"halflife {halflife}: must be > 0")
        self.decay = 0.5 ** (1.0 / halflife)
        self._obs: deque[tuple[float, float]] = deque(maxlen=history)
        #: observations so far (also those dropped from the history)
        self.count = 0

    def observe(self, x: float, seconds: float) -> None:
        """Add one observation: ``seconds`` spent at ``x`` (rows; both finite, x > 0)."""
        if not (x > 0 and math.isfinite(seconds)):
            raise ValueError(f"cost observation x={x}, seconds={seconds}: x must be > 0 "
                             "and seconds finite")
        self._obs.append((float(x), float(seconds)))
        self.count += 1

    def _weights(self, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        obs = np.asarray(self._obs, dtype=np.float64).reshape(-1, 2)
        x, t = obs[:, 0], obs[:, 1]
        age = np.arange(len(x) - 1, -1, -1, dtype=np.float64)
        logx = np.log(x)
        dist = np.maximum(np.log(lo) - logx, 0.0) + np.maximum(logx - np.log(hi), 0.0)
        w = self.decay ** age * np.exp(-0.5 * (dist / LOG_WIDTH) ** 2)
        return x, t, w

    def fit(self, lo: float, hi: float) -> Fit | None:
        """The line through the observations weighted for rows ``lo..hi`` (``0 < lo <= hi``),
        or None when they weigh less than :data:`MIN_WEIGHT` or their rows spread less than
        :data:`MIN_SPREAD`."""
        if not self._obs:
            return None
        x, t, w = self._weights(lo, hi)
        total = float(w.sum())
        if total < MIN_WEIGHT:
            return None
        mx, mt = float((w * x).sum()) / total, float((w * t).sum()) / total
        sxx = float((w * (x - mx) ** 2).sum())
        if sxx / total < MIN_SPREAD ** 2:
            return None
        sxt = float((w * (x - mx) * (t - mt)).sum())
        stt = float((w * (t - mt) ** 2).sum())
        b = sxt / sxx
        resid = max(stt - b * sxt, 0.0) / max(total - 2.0, 1.0)
        error = math.sqrt(resid / sxx) if total > 2.0 else math.inf
        if b < 0:
            return Fit(a=mt, b=0.0, slope_error=error, weight=total)
        return Fit(a=mt - b * mx, b=b, slope_error=error, weight=total)

    def level(self, x: float) -> float | None:
        """Seconds at ``x``: the local line's value there, else the weighted mean of the
        observations near ``x`` (a slope is not needed for one point), None without any."""
        fit = self.fit(x, x)
        if fit is not None:
            return fit(x)
        if not self._obs:
            return None
        _, t, w = self._weights(x, x)
        total = float(w.sum())
        return float((w * t).sum()) / total if total > 1e-6 else None


class Acceptance:
    """Per-position acceptance rates of verified drafts.

    Args:
        k: positions (``num_speculative_tokens``).
        halflife: verifications of a position after which an observation's weight halves.
    """

    def __init__(self, k: int, halflife: float = ACCEPT_HALFLIFE) -> None:
        self.decay = 0.5 ** (1.0 / halflife)
        self.drafted = np.zeros(k, dtype=np.float64)
        self.accepted = np.zeros(k, dtype=np.float64)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: ``num_drafts`` drafts, the first ``num_accepted``
        accepted (``0 <= num_accepted <= num_drafts``; positions past ``k`` are ignored).

        Raises:
            ValueError: ``num_accepted`` outside ``0..num_drafts``.
        """
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"{num_accepted} accepted of {num_drafts} drafts")
        d = min(num_drafts, len(self.drafted))
        self.drafted[:d] = self.drafted[:d] * self.decay + 1.0
        self.accepted[:d] *= self.decay
        self.accepted[:min(num_accepted, d)] += 1.0

    def rates(self) -> np.ndarray:
        """``[k]`` float64 ``r_j``, non-increasing in ``j``, each in ``[0, 1]``."""
        r = (self.accepted + PRIOR_RATE) / (self.drafted + 1.0)
        return np.minimum.accumulate(r)


def best_depth(lengths: Sequence[int], rates: Sequence[float], fixed_s: float, per_row_s: float,
               per_position_s: float = 0.0, exempt: Sequence[bool] | None = None) -> int:
    """The draft cap ``D`` that maximizes expected tokens per second of the next step.

    Args:
        lengths: ``[B]`` drafts proposed per sampling request (0 allowed), each at most
            ``len(rates)``.
        rates: ``[k]`` acceptance probability of draft ``j`` given ``j`` drafts (non-increasing).
        fixed_s: the step's seconds at 0 rows (``a``).
        per_row_s: seconds per scheduled row (``b`` >= 0).
        per_position_s: seconds per draft position reached by any request (a draft model's
            forward over the requests; 0 for proposers whose cost does not depend on ``D``).
        exempt: ``[B]`` requests that hand all their drafts whatever ``D`` (None: none).

    Returns:
        ``D`` in ``0..max(lengths)``; request ``i`` hands ``min(lengths[i], D)`` drafts (all of
        them if exempt). Ties go to the smaller ``D``.

    Raises:
        ValueError: a length above ``len(rates)``, or negative costs.
    """
    m = np.asarray(lengths, dtype=np.int64)
    if not len(m) or m.max() == 0:
        return 0
    if m.max() > len(rates) or m.min() < 0:
        raise ValueError(f"draft lengths {list(lengths)} outside 0..{len(rates)}")
    if per_row_s < 0 or per_position_s < 0:
        raise ValueError(f"negative cost: per row {per_row_s}, per position {per_position_s}")
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(rates, dtype=np.float64))])
    depths = np.arange(int(m.max()) + 1)
    handed = np.minimum(m[None, :], depths[:, None])  # [D + 1, B]
    if exempt is not None:
        handed = np.where(np.asarray(exempt, dtype=bool)[None, :], m[None, :], handed)
    tokens = len(m) + cum[handed].sum(axis=1)
    seconds = np.maximum(fixed_s + per_row_s * (len(m) + handed.sum(axis=1))
                         + per_position_s * handed.max(axis=1), 1e-9)
    throughput = tokens / seconds
    best = 0
    for d in depths[1:]:  # strictly better only: ties keep the smaller cap
        if throughput[d] > throughput[best] * (1 + 1e-9):
            best = int(d)
    return best


class DraftBudget:
    """The policy and its measurements, for one runner.

    Args:
        k: ``num_speculative_tokens`` (the most drafts a request ever hands).
        draft_forwards: the proposer runs a forward per draft position (``draft_model``), so
            each position also costs :meth:`observe_draft_forward`'s measured time.
    """

    def __init__(self, k: int, draft_forwards: bool = False) -> None:
        self.k = k
        self.draft_forwards = draft_forwards
        self.step_cost = LocalCost()
        self.draft_cost = LocalCost()
        self.acceptance = Acceptance(k)
        self.decisions = 0
        self.low_probes = 0
        self.high_probes = 0
        self.cold_decisions = 0
        self._probe_turn = 0
        #: the last decision's cap and modelled tokens/s (for stats and logs)
        self.last_cap: int | None = None

    # ------------------------------------------------------------------ measurements
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode/verification step of ``num_tokens`` scheduled tokens took ``seconds``
        (its period, draft forwards excluded)."""
        self.step_cost.observe(num_tokens, seconds)

    def observe_draft_forward(self, rows: int, seconds: float) -> None:
        """A draft-model forward over ``rows`` token rows took ``seconds``."""
        self.draft_cost.observe(rows, seconds)

    def observe_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification (see :meth:`Acceptance.observe`)."""
        self.acceptance.observe(num_drafts, num_accepted)

    # ------------------------------------------------------------------ decision
    def caps(self, lengths: Sequence[int], exempt: Sequence[bool] | None = None) -> list[int]:
        """Drafts to hand per request for the next step.

        Args:
            lengths: ``[B]`` drafts proposed (or, for a draft model, that could be proposed)
                for each request that sampled this step, each in ``0..k``.
            exempt: ``[B]`` requests that always hand all their drafts (seeded ones: how many
                drafts they verify decides which random numbers they draw, so a budget that
                depends on timing would make their outputs irreproducible); they count in the
                step's cost like the others. None: none.

        Returns:
            ``[B]`` counts, ``0 <= caps[i] <= lengths[i]``, ``caps[i] == lengths[i]`` where
            exempt.
        """
        lengths = [int(m) for m in lengths]
        keep = [False] * len(lengths) if exempt is None else [bool(e) for e in exempt]
        if len(keep) != len(lengths):
            raise ValueError(f"{len(keep)} exemptions for {len(lengths)} requests")
        longest = max((m for m, e in zip(lengths, keep, strict=True) if not e), default=0)
        if longest == 0:
            return lengths
        self.decisions += 1
        base = len(lengths)
        drafted = sum(lengths)
        fit = self.step_cost.fit(base, base + drafted)
        if fit is None:  # cold start: hand everything, now and then nothing
            self.cold_decisions += 1
            every = (COLD_PROBE_EVERY if self.step_cost.count < COLD_STEPS else PROBE_EVERY)
            if self.cold_decisions % every == 0:
                self.low_probes += 1
                return self._done(self._none(lengths, keep), 0)
            return self._done(lengths, longest)
        per_position = 0.0
        if self.draft_forwards:
            per_position = self.draft_cost.level(base) or 0.0
        cap = best_depth(lengths, self.acceptance.rates(), fit.a, fit.b, per_position, keep)
        caps = [m if e else min(m, cap) for m, e in zip(lengths, keep, strict=True)]
        if self.decisions % PROBE_EVERY == 0:
            if cap < longest:  # high probe: one request hands all it has
                candidates = [i for i, (m, e) in enumerate(zip(lengths, keep, strict=True))
                              if m == longest and not e]
                i = candidates[self._probe_turn % len(candidates)]
                self._probe_turn += 1
                caps[i] = lengths[i]
                self.high_probes += 1
            elif fit.slope_error * drafted > CONFIDENCE * fit(base):
                self.low_probes += 1
                return self._done(self._none(lengths, keep), 0)
        return self._done(caps, cap)

    @staticmethod
    def _none(lengths: list[int], keep: list[bool]) -> list[int]:
        """No drafts, but for the exempt requests."""
        return [m if e else 0 for m, e in zip(lengths, keep, strict=True)]

    def _done(self, caps: list[int], cap: int) -> list[int]:
        self.last_cap = cap
        return caps

    def stats(self) -> dict[str, object]:
        """JSON-able counters: decisions (cold-start ones among them), low and high probes,
        the last decision's cap, the acceptance rates per position, steps measured."""
        return {"budget_decisions": self.decisions, "budget_cold_decisions": self.cold_decisions,
                "budget_low_probes": self.low_probes, "budget_high_probes": self.high_probes,
                "budget_last_cap": self.last_cap,
                "budget_acceptance_rates": [round(float(r), 4)
                                            for r in self.acceptance.rates()],
                "budget_steps_measured": self.step_cost.count}
