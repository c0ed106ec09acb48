"""Where a scheduler step's time goes, by phase, for decode-only and mixed steps.

Each step gets a :class:`StepTimer` (:meth:`StepProfile.start`) whose marks close its phases:

* ``prepare``: applying the ``SchedulerOutput`` to the request states, the token-major layout
  and the attention metadata (host-side numpy work);
* ``graph``: building the lazy MLX graph of the forward and of the MLX sampler (Python work
  per layer; nothing is computed yet);
* ``eval``: ``mx.eval`` of the step: the forward, the KV writes and the MLX sampling (with
  asynchronous scheduling only queueing it, ``mx.async_eval``: the wait is then in ``output``);
* ``output``: reading the sampled ids back, vLLM's sampler for the requests that need it,
  prompt logprobs and the ``ModelRunnerOutput`` (for a queued step: from the moment vLLM asks
  for its output).

Steps whose scheduled requests all have one query token are "decode" steps; the others
(with a prefill chunk) are "mixed". With ``VLLM_UNIFIED_STEP_PROFILE=N`` the runner logs the
mean per phase every N steps of each kind (``benchmarks/serve.py`` reads those lines);
the totals are always kept and returned by the ``runner_stats`` RPC.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_unified import envs
from vllm_unified.envs import STEP_PROFILE_ENV  # log the phase means every N steps (0: never)

PHASES = ("prepare", "graph", "eval", "output")

#: The log line's fixed start, which the benchmark searches for.
LOG_PREFIX = "vllm-unified: step profile"


def log_interval() -> int:
    """Steps between profile log lines, from ``VLLM_UNIFIED_STEP_PROFILE`` (0: never).

    Raises:
        ValueError: the variable is set but not a non-negative integer.
    """
    return envs.read(STEP_PROFILE_ENV)


@dataclass
class PhaseTotals:
    """Accumulated seconds per phase over ``steps`` steps that scheduled ``tokens`` tokens
    for ``requests`` request slots in all."""

    steps: int = 0
    tokens: int = 0
    requests: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def means_ms(self) -> dict[str, float]:
        """Mean milliseconds per step for each phase and ``total``."""
        n = max(self.steps, 1)
        means = {p: 1e3 * s / n for p, s in self.seconds.items()}
        means["total"] = sum(means.values())
        return means


class StepTimer:
    """The phase times of one step. With asynchronous scheduling a step's output is read back
    after the next step has started, so each step keeps its own timer."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or start, or :meth:`resume`) to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def resume(self) -> None:
        """Restart the clock without charging the time since the last mark (the wait between
        queueing a step and vLLM asking for its output belongs to the next step)."""
        self._last = time.perf_counter()


class StepProfile:
    """Phase totals of the runner's steps, and the periodic log line."""

    def __init__(self, interval: int | None = None) -> None:
        self.interval = log_interval() if interval is None else interval
        self.totals = {"decode": PhaseTotals(), "mixed": PhaseTotals()}
        self._window = {"decode": PhaseTotals(), "mixed": PhaseTotals()}

    def start(self) -> StepTimer:
        """Begin a step (the time before this call belongs to no phase)."""
        return StepTimer()

    def finish(self, timer: StepTimer, num_reqs: int, num_tokens: int, pure_decode: bool
               ) -> str | None:
        """End a step that scheduled ``num_tokens`` tokens for ``num_reqs`` requests;
        ``pure_decode``: the step's ``AttentionMetadata.is_pure_decode``.

        Returns:
            A log line when this kind of step reached the logging interval, else None.
        """
        kind = "decode" if pure_decode else "mixed"
        for acc in (self.totals[kind], self._window[kind]):
            acc.steps += 1
            acc.tokens += num_tokens
            acc.requests += num_reqs
            for phase, seconds in timer.seconds.items():
                acc.seconds[phase] += seconds
        window = self._window[kind]
        if not self.interval or window.steps < self.interval:
            return None
        self._window[kind] = PhaseTotals()
        return format_line(kind, window)

    def seconds(self) -> dict[str, float]:
        """Seconds per phase summed over all steps of both kinds."""
        return {p: sum(t.seconds[p] for t in self.totals.values()) for p in PHASES}

    def as_dict(self) -> dict[str, dict]:
        """Totals per kind: steps, tokens, requests and mean ms per phase."""
        return {
            kind: {"steps": t.steps, "tokens": t.tokens, "requests": t.requests,
                   "mean_ms": t.means_ms()}
            for kind, t in self.totals.items()
        }


def format_line(kind: str, window: PhaseTotals) -> str:
    """``vllm-unified: step profile decode: 50 steps, 16.0 req/step, mean ms prepare 1.20
    graph 9.80 eval 160.31 output 0.90 total 172.21``."""
    means = window.means_ms()
    phases = " ".join(f"{p} {means[p]:.2f}" for p in (*PHASES, "total"))
    return (f"{LOG_PREFIX} {kind}: {window.steps} steps, "
            f"{window.requests / max(window.steps, 1):.1f} req/step, "
            f"{window.tokens / max(window.steps, 1):.1f} tokens/step, mean ms {phases}")
