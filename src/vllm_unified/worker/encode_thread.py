"""A queued step's MLX evaluation on a thread of its own, while vLLM's engine runs its Python.

Why: on a GPU backend a decode step of a small model is bound by host work, and most of it is
MLX encoding the step (``mx.async_eval``: every primitive's launch, several milliseconds on
CUDA; docs/benchmarking.md). With asynchronous scheduling vLLM's engine, in the same thread,
then processes the previous step's output and schedules the next step: Python that does not
touch MLX. ``mx.async_eval`` releases the GIL, so running it on a second thread lets the two
overlap instead of adding up. The same job then reads the step's MLX-sampled tokens back to
the host, so ``get_output`` of the step (vLLM asks for it while the next step is encoding)
needs no MLX call.

MLX streams made by ``mx.new_stream`` (every thread's default ones) can only be evaluated on
the thread that made them, so the worker makes its thread's default streams with
``mx.new_thread_unsafe_stream`` first (:func:`share_default_streams`, before any array
exists), which any thread may evaluate, one at a time. The contract that makes it safe: while
a job runs, no other thread calls MLX. Every runner and worker entry point that touches MLX calls
:meth:`EncodeThread.wait` first; only the Python between them (vLLM's scheduler, output
processing, the runner's own bookkeeping of an asynchronous step) runs alongside a job.

Used only with asynchronous scheduling, for steps whose outputs stay in MLX (their logits
do not go to torch), and where the backend profile says so (``encode_thread``: CUDA by
default; ``VLLM_UNIFIED_ENCODE_THREAD``).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import mlx.core as mx

__all__ = ["SWITCH_INTERVAL_S", "EncodeThread", "share_default_streams"]

#: the interpreter's thread switch interval while an encode thread exists, seconds: a thread
#: waiting for the GIL gets it only when the holder blocks or after this interval (Python's
#: default, 5 ms, is longer than a whole decode step: the job would not start until the engine's
#: thread waits for it, and nothing would overlap)
SWITCH_INTERVAL_S = 1e-4


def share_default_streams() -> None:
    """Make this thread's default CPU (and GPU, where there is one) stream a stream that any
    thread may evaluate (``mx.new_thread_unsafe_stream``). Call before creating any array
    that an :class:`EncodeThread` job will evaluate."""
    mx.set_default_stream(mx.new_thread_unsafe_stream(mx.cpu))
    if mx.is_available(mx.gpu):
        mx.set_default_stream(mx.new_thread_unsafe_stream(mx.gpu))


class EncodeThread:
    """One background thread that evaluates queued steps, one at a time.

    Attributes:
        encode_s: seconds the thread spent in jobs (encoding plus the token read-back).
        wait_s: seconds callers spent blocked in :meth:`wait` for a job to finish.
    """

    def __init__(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-unified-encode")
        self._job: Future | None = None
        self.encode_s = 0.0
        self.wait_s = 0.0

    def submit(self, arrays: list[Any], tokens: mx.array | None) -> Future:
        """Queue ``mx.async_eval(*arrays)`` then ``tokens.tolist()``; returns the job, whose
        result is the tokens as a list (None without ``tokens``). Waits for the previous job
        first (one at a time, in step order)."""
        self.wait()

        def job() -> list[int] | None:
            start = time.perf_counter()
            try:
                mx.async_eval(*arrays)
                return tokens.tolist() if tokens is not None else None
            finally:
                self.encode_s += time.perf_counter() - start

        self._job = self._pool.submit(job)
        return self._job

    def wait(self) -> None:
        """Block until the running job (if any) is done; re-raise its exception (the step's
        failure surfaces at the next entry point, as an ``mx.eval`` error would)."""
        job, self._job = self._job, None
        if job is None:
            return
        start = time.perf_counter()
        try:
            job.result()
        finally:
            self.wait_s += time.perf_counter() - start

    def shutdown(self) -> None:
        """Finish the running job and stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            sys.setswitchinterval(self._switch_interval)
