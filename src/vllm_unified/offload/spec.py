"""The offloading spec vLLM loads for our platform (``spec_name`` + ``spec_module_path``).

vLLM's ``TieringOffloadingSpec`` already does everything on the scheduler side: the host (CPU)
tier in vLLM's shared offload region, its eviction policy, and secondary tiers such as the
disk. Its worker side is CUDA/XPU only; this subclass swaps in
:class:`~vllm_unified.offload.worker.MLXOffloadingWorker` over the same shared region.
"""

from __future__ import annotations

from vllm_unified import compat
from vllm_unified.offload.worker import MLXOffloadingWorker


class MLXOffloadingSpec(compat.TieringOffloadingSpec):
    """vLLM's tiering spec with the MLX platform's worker.

    Raises (at construction, i.e. engine start-up):
        ValueError: ``cpu_bytes_to_use`` is too small to hold one chunk.
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        if self.num_chunks == 0 and config.worker_kv_bytes_per_block > 0:
            raise ValueError(
                f"--kv-offloading-size: {int(self.extra_config['cpu_bytes_to_use'])} bytes "
                f"hold no offload chunk of {self.kv_bytes_per_chunk} bytes "
                f"({self.blocks_per_chunk} KV block(s)); use a larger size"
            )

    def get_worker(self, kv_caches) -> MLXOffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches) -> MLXOffloadingWorker:
        region = compat.SharedOffloadRegion(
            engine_id=self.config.engine_id, num_chunks=self.num_chunks,
            rank=self.config.parallel.rank, kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return MLXOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except BaseException:
            region.cleanup()
            raise
