"""A queued step's MLX evaluation on a thread of its own, while vLLM's engine runs its Python.

Why: on a GPU backend a decode step of a small model is bound by host work, and most of it is
MLX encoding the step (``mx.async_eval``: every primitive's launch, several milliseconds on
CUDA; docs/dev/benchmarks.md). With asynchronous scheduling vLLM's engine, in the same thread,
then processes the previous step's output and schedules the next step: Python that does not
touch MLX. ``mx.async_eval`` releases the GIL, so running it on a second thread lets the two
overlap instead of adding up.

A job only encodes: it returns once the step is launched, so the engine's thread can build the
next step's graph while the device still computes this one. The step's MLX-sampled tokens are
read back by the engine's thread when vLLM asks for the step's output (:meth:`EncodeThread.
read_back`), usually while the next step's job is encoding. That read-back is the one MLX call
allowed alongside a job, and only under two conditions that make it touch nothing the job
touches: the array's own job has finished (so the array is already scheduled and reading it
only waits for its event: MLX's ``eval`` of scheduled arrays, ``mlx/transforms.cpp``), and the
array is a copy that no later step's graph contains (the next step feeds the original token
array, whose graph node a later job's evaluation detaches).

Building alongside a job: the next step's graph may be built on the engine's thread while a
job encodes, for steps whose building makes arrays and calls the compiled graph only, no
evaluation and no assignment into an existing array (compiled pure-decode steps;
:meth:`vllm_unified.worker.model_runner.MLXModelRunner._builds_alongside_queued_step` says
which). That graph takes the job's outputs (the written
KV pool, the sampled tokens) as inputs. MLX 0.32.4's graph construction and compiled-graph
replay read only an input's shape, dtype and tracer flag (``ArrayDesc::init`` in
``mlx/array.cpp``; ``compile_replace`` and the compile cache's ``find`` in
``mlx/compile.cpp``), and copy its handle (an atomic reference count); the job's evaluation
writes the data, status, flags and strides of the arrays it evaluates and detaches their
inputs and primitive (``eval_impl`` in ``mlx/transforms.cpp``): disjoint fields. MLX's
allocator, which both threads call, locks. The job's own array list is flattened when it is
queued, so the engine's thread may rebind the pool's list right after.

MLX streams made by ``mx.new_stream`` (every thread's default ones) can only be evaluated on
the thread that made them, so the worker makes its thread's default streams with
``mx.new_thread_unsafe_stream`` first (:func:`share_default_streams`, before any array
exists), which any thread may evaluate, one at a time. The contract that makes it safe: while
a job runs, no other thread evaluates anything (except the read-back above) or calls MLX
outside graph building. Every runner and worker entry
point that touches MLX calls :meth:`EncodeThread.wait` first; only the Python between them
(vLLM's scheduler, output processing, the runner's own bookkeeping of an asynchronous step)
runs alongside a job.

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
    """One background thread that encodes queued steps, one at a time.

    Attributes:
        encode_s: seconds the thread spent in jobs (``mx.async_eval``: encoding and launching).
        wait_s: seconds callers spent blocked in :meth:`wait` for a job to finish.
        read_back_s: seconds callers spent in :meth:`read_back` (waiting for the device).
    """

    def __init__(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-unified-encode")
        self._job: Future | None = None
        self.encode_s = 0.0
        self.wait_s = 0.0
        self.read_back_s = 0.0

    def submit(self, arrays: list[Any]) -> Future:
        """Queue ``mx.async_eval(*arrays)``; returns the job (its result is None). Waits for the
        previous job first (one at a time, in step order). ``arrays`` may hold lists (one
        level), copied here: the caller may change them once this returns."""
        self.wait()
        arrays = [a for x in arrays for a in (x if isinstance(x, (list, tuple)) else (x,))]

        def job() -> None:
            start = time.perf_counter()
            try:
                mx.async_eval(*arrays)
            finally:
                self.encode_s += time.perf_counter() - start

        self._job = self._pool.submit(job)
        return self._job

    @property
    def busy(self) -> bool:
        """A queued job is still running."""
        return self._job is not None and not self._job.done()

    def read_back(self, job: Future, tokens: mx.array) -> list[int]:
        """``tokens.tolist()`` once ``job`` (the job that evaluates ``tokens``) has finished;
        other jobs may be running meanwhile.

        Args:
            job: the :meth:`submit` future whose arrays include ``tokens``.
            tokens: ``[R]`` integer array that no later job's graph contains (a copy made for
                the read-back; see the module docstring).

        Raises:
            Exception: the job's own failure (an ``mx.async_eval`` error), re-raised.
        """
        start = time.perf_counter()
        try:
            job.result()
            return tokens.tolist()
        finally:
            self.read_back_s += time.perf_counter() - start

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
