"""The worker: owns the MLX device in the engine-core process and answers vLLM's calls.

vLLM's executor drives it in this order: ``init_device`` -> ``load_model`` ->
``get_kv_cache_spec`` -> ``determine_available_memory`` -> ``initialize_from_config`` ->
``compile_or_warm_up_model`` -> ``execute_model`` once per step -> ``shutdown``.
"""

from __future__ import annotations

import psutil
import torch

from vllm_unified.backend import detect_backend, import_mlx
from vllm_unified.compat import (
    CompilationTimes,
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    VllmConfig,
    WorkerBase,
    init_logger,
)

logger = init_logger(__name__)

#: Bytes per scheduled token reserved for activations when sizing the KV pool, per unit of
#: hidden size: residual stream, attention projections and the MLP intermediate (about
#: 4 x hidden + 3 x intermediate floats), rounded up. An estimate until the profiling forward of
#: the memory issue lands; see docs/configuration.md.
_ACTIVATION_FLOATS_PER_HIDDEN = 16


class MLXWorker(WorkerBase):
    """vLLM worker running the model in MLX on a single device."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.model_runner = None

    # ------------------------------------------------------------------ device and model
    def init_device(self) -> None:
        mx = import_mlx()
        info = detect_backend()
        self.device = torch.device("cpu")  # vLLM's bookkeeping tensors live on the host
        mx.random.seed(self.model_config.seed if self.model_config.seed is not None else 0)
        from vllm_unified.worker.model_runner import MLXModelRunner

        # Quantized GGUF matmuls are fast on GPU backends; MLX's CPU quantized matmul is
        # single-threaded, so the CPU backend dequantizes once at load.
        self.model_runner = MLXModelRunner(self.vllm_config, keep_quantized=info.kind != "cpu")
        logger.info("vllm-unified: worker on MLX %s (%s)", info.kind, mx.default_device())

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("--load-format dummy is not supported by vllm-unified")
        self.model_runner.load_model()

    def get_model(self):
        return self.model_runner.model

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # ------------------------------------------------------------------ KV cache
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """Bytes vLLM may turn into KV blocks.

        ``--kv-cache-memory-bytes`` when given; else ``--gpu-memory-utilization`` x the device's
        memory (system RAM on unified backends) minus what this process already holds (weights,
        runtime) minus an activation reserve for ``max_num_batched_tokens``. vLLM does no
        profiling for an out-of-tree worker, so this number is all the scheduler knows.

        Raises:
            ValueError: nothing is left for the KV cache, with the arithmetic.
        """
        cache = self.cache_config
        if cache.kv_cache_memory_bytes is not None:
            return int(cache.kv_cache_memory_bytes)
        total = detect_backend().total_memory
        used = psutil.Process().memory_info().rss
        hidden = self.model_config.get_hidden_size()
        tokens = self.scheduler_config.max_num_batched_tokens
        activations = tokens * hidden * _ACTIVATION_FLOATS_PER_HIDDEN * 4
        budget = int(cache.gpu_memory_utilization * total) - used - activations
        logger.info(
            "vllm-unified: KV budget = %.2f x %.2f GiB - %.2f GiB in use (weights, runtime) - "
            "%.2f GiB activations (%d tokens) = %.2f GiB",
            cache.gpu_memory_utilization, total / 2**30, used / 2**30, activations / 2**30,
            tokens, budget / 2**30,
        )
        if budget <= 0:
            raise ValueError(
                f"--gpu-memory-utilization {cache.gpu_memory_utilization}: "
                f"{cache.gpu_memory_utilization} x {total / 2**30:.2f} GiB leaves nothing for "
                f"the KV cache after {used / 2**30:.2f} GiB in use and "
                f"{activations / 2**30:.2f} GiB activations; raise it or lower "
                "--max-num-batched-tokens"
            )
        return budget

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """The MLX attention reads LBNHC pages (one layer's region is then slot-major)."""
        from vllm_unified.memory.kv_allocation import KV_LAYOUT

        return [KV_LAYOUT]

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        seconds = self.model_runner.warm_up()
        logger.info("vllm-unified: warm-up forward took %.2f s", seconds)
        return CompilationTimes(language_model=seconds, encoder=0.0)

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's forward and, unless it has structured-output requests (then None:
        vLLM calls :meth:`sample_tokens` with the grammar bitmask), its sampling."""
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return None

    def synchronize_device(self) -> None:
        import_mlx().synchronize()

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        if self.model_runner is not None:
            logger.info("vllm-unified: runner stats %s", self.model_runner.stats)

    # ------------------------------------------------------------------ introspection
    def runner_stats(self) -> dict:
        """Step/forward counters (``LLM.collective_rpc("runner_stats")``)."""
        return self.model_runner.stats_dict()

    def kv_pool_data_ptrs(self) -> list[int]:
        """Addresses of the KV pool buffers (``LLM.collective_rpc("kv_pool_data_ptrs")``)."""
        return self.model_runner.pool.data_ptrs()

    def kv_torch_view_ptrs(self) -> list[int]:
        """``data_ptr()`` of vLLM's per-layer torch KV views, in model layer order (empty when
        the pool is MLX-owned)."""
        views = self.model_runner.pool.torch_views or []
        return [v.data_ptr() for v in views]

    # ------------------------------------------------------------------ unsupported
    def add_lora(self, lora_request) -> bool:
        raise ValueError("LoRA adapters are not supported by vllm-unified")

    def remove_lora(self, lora_id: int) -> bool:
        raise ValueError("LoRA adapters are not supported by vllm-unified")

    def pin_lora(self, lora_id: int) -> bool:
        raise ValueError("LoRA adapters are not supported by vllm-unified")

    def list_loras(self) -> set[int]:
        return set()
