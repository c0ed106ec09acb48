"""The offloading spec vLLM loads for our platform (``spec_name`` + ``spec_module_path``).

vLLM's ``TieringOffloadingSpec`` already does everything on the scheduler side: the host (CPU)
tier in vLLM's shared offload region, its eviction policy, and secondary tiers such as the
disk. Its worker side is CUDA/XPU only; this subclass swaps in
:class:`~vllm_unified.offload.worker.MLXOffloadingWorker` over the same shared region.
"""

from __future__ import annotations

import os

from vllm_unified import compat, patches
from vllm_unified.compat import init_logger
from vllm_unified.offload.worker import MLXOffloadingWorker

logger = init_logger(__name__)

# macOS has no /dev/shm, where vLLM's host tier puts its shared file.
patches.place_offload_region_outside_dev_shm()


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

    def get_manager(self):
        manager = super().get_manager()
        self._unlink_region_file()
        return manager

    def _unlink_region_file(self) -> None:
        """Drop the shared region's file name (in /dev/shm, or where
        :func:`~vllm_unified.patches.place_offload_region_outside_dev_shm` put it) once
        everyone has mapped it.

        vLLM initialises the KV cache (and with it the worker, which creates the region file)
        before it builds the scheduler, whose manager maps the same file by name last. From
        then on the name is not needed; removing it means no exit path, SIGKILL included,
        leaves the file behind (the mappings stay valid). vLLM's tiering spec has no such step.
        """
        region = self._scheduler_mmap
        if region is None or region._creator:  # made here: a worker has yet to open it
            return
        try:
            os.unlink(region.mmap_path)
        except FileNotFoundError:
            return
        logger.info("vllm-unified: unlinked %s (mapped by the worker and the scheduler)",
                    region.mmap_path)

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
