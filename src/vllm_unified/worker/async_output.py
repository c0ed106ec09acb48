"""Asynchronous scheduling (vLLM's ``--async-scheduling``): read a step's tokens back while
the next step already runs.

With it, vLLM's engine schedules step N+1 before it has step N's sampled tokens, and collects
step N's output (``AsyncModelRunnerOutput.get_output``) only after step N+1 was submitted. The
runner therefore queues each step's MLX graph with ``mx.async_eval`` and returns at once; the
next step feeds each decode request's last sampled token straight from the previous step's MLX
token array (:func:`feed_pending`), so the GPU never waits for the host in between, and the
host builds the next graph while the GPU computes the current one, like mlx-lm's own decode loop.
Only the uni-process executor is used this way: it calls ``get_output`` on the thread that runs
the steps (vLLM's multiprocess executor would call it from another thread).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from vllm_unified.compat import AsyncModelRunnerOutput, ModelRunnerOutput


class MLXAsyncOutput(AsyncModelRunnerOutput):
    """A step's output, produced on first demand (``finish`` reads the tokens back and
    updates the request states) and kept: the runner may resolve it before vLLM asks."""

    def __init__(self, finish: Callable[[], ModelRunnerOutput]) -> None:
        self._finish = finish
        self._output: ModelRunnerOutput | None = None

    @property
    def resolved(self) -> bool:
        return self._output is not None

    def resolve(self) -> ModelRunnerOutput:
        """Block until the step's tokens are computed; build (once) its output."""
        if self._output is None:
            self._output = self._finish()
        return self._output

    def get_output(self) -> ModelRunnerOutput:
        return self.resolve()


def feed_pending(input_ids: mx.array, pending_rows: list[tuple[int, tuple[mx.array, int]]]
                 ) -> mx.array:
    """Put each pending token into its row of ``input_ids``, on the device (lazily).

    Args:
        input_ids: ``[T]`` int32 token ids with a placeholder at each pending row.
        pending_rows: ``(row, (tokens, index))``: row ``row`` takes ``tokens[index]``, where
            ``tokens`` is an earlier step's (possibly unevaluated) ``[R]`` token array.

    Returns:
        ``input_ids`` with the pending tokens in place (a lazy scatter; no host sync).
    """
    if not pending_rows:
        return input_ids
    groups: dict[int, tuple[mx.array, list[int], list[int]]] = {}
    for row, (tokens, index) in pending_rows:
        group = groups.setdefault(id(tokens), (tokens, [], []))
        group[1].append(row)
        group[2].append(index)
    for tokens, rows, indices in groups.values():
        src = tokens[mx.array(np.asarray(indices, dtype=np.int32))].astype(mx.int32)
        input_ids[mx.array(np.asarray(rows, dtype=np.int32))] = src
    return input_ids
