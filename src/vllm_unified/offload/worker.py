"""The worker side of vLLM's OffloadingConnector on the MLX KV pool.

vLLM's own ``CPUOffloadingWorker`` drives CUDA streams and ``swap_blocks`` kernels. On unified
memory the KV pool is host memory already (vLLM's torch views of the buffer MLX reads and
writes in place), so a transfer is a plain memory copy between those views and the host pool
carved out of vLLM's shared offload region. Copies run synchronously when vLLM submits them:
a load has landed before ``submit_load`` returns (vLLM schedules the request's next forward
only after the load is reported finished), and a store reads the KV bytes only after MLX's
pending writes to the pool have been evaluated (:meth:`MLXOffloadingWorker.bind_kv_barrier`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from vllm_unified import compat
from vllm_unified.compat import init_logger
from vllm_unified.offload.host_views import checked_numpy
from vllm_unified.offload.transfer import BlockTransfer, TensorRef

logger = init_logger(__name__)


class MLXOffloadingWorker(compat.OffloadingWorker):
    """Moves blocks between the KV pool and the host pool (``OffloadingWorker``).

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches`` of the KV pool (int8 ``[num_blocks, page]``
            tensors over the pool's torch memory, one per layer).
        blocks_per_chunk: KV blocks per host chunk.
        region: vLLM's ``SharedOffloadRegion`` (this worker's slot of every chunk row); this
            worker owns it from now on and releases it in :meth:`shutdown`.

    Raises:
        RuntimeError: a numpy view of the KV pool or of the host pool is not zero-copy.
        ValueError: tensors that do not fit together.
    """

    def __init__(self, kv_caches, blocks_per_chunk: int, region) -> None:
        self._region = region
        kv, host = [], []
        for t, tensor in enumerate(kv_caches.tensors):
            kv.append(checked_numpy(tensor.tensor, f"KV pool tensor {t}"))
            view = region.create_next_worker_view(tensor.page_size_bytes * blocks_per_chunk)
            host.append(checked_numpy(view, f"host pool view {t}"))
        refs = [[TensorRef(r.tensor_idx, r.page_size_bytes) for r in group]
                for group in kv_caches.group_data_refs]
        self._transfer = BlockTransfer(kv, host, refs, blocks_per_chunk)
        self._finished: list = []
        self._kv_barrier: Callable[[], None] | None = None
        logger.info(
            "vllm-unified: KV offload host pool: %d chunks x %d block(s), %d tensors, %.2f GiB "
            "(views of vLLM's shared offload region, zero-copy checked)",
            self._transfer.num_chunks, blocks_per_chunk, len(kv),
            region.total_size_bytes / 2**30,
        )

    def bind_kv_barrier(self, barrier: Callable[[], None]) -> None:
        """Set the call that evaluates MLX's pending writes to the KV pool; run before any
        copy touches the pool."""
        self._kv_barrier = barrier

    def _run(self, job_id: int, gpu_spec, cpu_spec, to_host: bool) -> bool:
        if self._kv_barrier is None:
            raise RuntimeError("KV offload worker used before it was bound to the KV pool")
        self._kv_barrier()
        start = time.perf_counter()
        nbytes = self._transfer.copy(
            gpu_spec.block_ids, list(gpu_spec.group_sizes), list(gpu_spec.block_indices),
            np.asarray(cpu_spec.block_ids), to_host=to_host,
        )
        self._finished.append(compat.TransferResult(
            job_id=job_id, success=True, transfer_size=nbytes,
            transfer_time=time.perf_counter() - start,
        ))
        return True

    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        """KV pool -> host pool, done when this returns."""
        return self._run(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec, dst_spec) -> bool:
        """Host pool -> KV pool, done when this returns."""
        return self._run(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every submitted copy has completed."""

    def shutdown(self) -> None:
        self._finished.clear()
        # Our numpy views keep the region's buffer exported; drop them before it is unmapped.
        self._transfer = None
        if self._region is not None:
            if not os.path.exists(self._region.mmap_path):
                self._region._creator = False  # the spec already removed the name
            self._region.cleanup()
            self._region = None
