"""The worker: owns the MLX device in the engine-core process and answers vLLM's calls.

vLLM's executor drives it in this order: ``init_device`` -> ``load_model`` ->
``get_kv_cache_spec`` -> ``determine_available_memory`` -> ``initialize_from_config`` ->
``compile_or_warm_up_model`` -> ``execute_model`` once per step -> ``shutdown``.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import resource
import sys
import time
from dataclasses import replace

import psutil
import torch

from vllm_unified import envs
from vllm_unified.backend import detect_backend, import_mlx
from vllm_unified.backend import profile as resolve_profile
from vllm_unified.compat import (
    CompilationTimes,
    IntermediateTensors,
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    VllmConfig,
    WorkerBase,
    init_logger,
)
from vllm_unified.distributed.liveness import PeerWatch, abandon_pipeline
from vllm_unified.distributed.pipeline import init_stage_groups, recv_hidden, send_intermediate
from vllm_unified.envs import LOCAL_ENGINES_ENV
from vllm_unified.memory.budget import compute_kv_budget, read_device_memory
from vllm_unified.memory.resident import malloc_trim, release_free_memory, smaps_breakdown
from vllm_unified.memory.wired import configure_wired_limit
from vllm_unified.offload.runner import init_single_rank_groups
from vllm_unified.worker.pooling_policy import is_encoder_model

logger = init_logger(__name__)



#: Tokens of the profiling forward that measures activation memory (see _activation_peak).
_PROFILE_TOKENS = 256


def _skip_final_gc_scan() -> None:
    """At exit of an engine process (not the user's own: it has a parent process), freeze
    the heap so the interpreter's finalization does not run a full cyclic-GC scan of vLLM's,
    torch's and MLX's object graph: measured (py-spy) at 5-7 s in ``gc_collect_main`` after the
    engine core's teardown on a loaded 2-core machine, more than vLLM's process manager waits
    before it kills the engine. vLLM does the same on ROCm (``run_engine_core``: "Freeze the
    surviving graph to skip another slow cyclic-GC scan during finalization"). The process is
    exiting: the OS reclaims its memory; vLLM's and our teardown (KV offload tiers included)
    has already run."""
    if multiprocessing.parent_process() is not None:
        atexit.register(gc.freeze)


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
        #: RSS when vLLM made this worker (in a forked engine core: what it inherited)
        self.rss_at_start = psutil.Process().memory_info().rss
        self.rss_before_load = 0
        self.rss_after_load = 0
        self.rss_after_kv_init = 0
        self.rss_after_warm_up = 0
        #: liveness of the other nodes' workers (multi-node engines), else None
        self.peer_watch: PeerWatch | None = None

    # ------------------------------------------------------------------ device and model
    def init_device(self) -> None:
        """Import MLX, resolve the backend profile (the one backend decision of this
        process, passed down to the runner and the KV cache), wire the weights' memory."""
        mx = import_mlx()
        _skip_final_gc_scan()
        info = detect_backend()
        backend = resolve_profile()
        if backend.encode_thread and self.vllm_config.scheduler_config.async_scheduling:
            # lazy: encode_thread imports MLX, loaded only after the BLAS interposition
            from vllm_unified.worker.encode_thread import share_default_streams

            share_default_streams()  # before any array: queued steps evaluate off-thread
        self.device = torch.device("cpu")  # vLLM's bookkeeping tensors live on the host
        seed = self.model_config.seed if self.model_config.seed is not None else 0
        mx.random.seed(seed % 2**64)  # MLX takes an unsigned 64-bit seed, vLLM a signed one
        if self.parallel_config.world_size > 1:
            init_stage_groups(self.vllm_config, self.rank, self.local_rank,
                              self.distributed_init_method)
            if self.parallel_config.nnodes > 1:  # vLLM watches only this node's workers
                pc = self.parallel_config
                self.peer_watch = PeerWatch(pc.master_addr, pc.master_port, self.rank,
                                            pc.world_size)
                self.peer_watch.start()
        else:
            init_single_rank_groups(self.vllm_config, self.distributed_init_method)
        # Before any weight is allocated, so the weights are wired as they load (Metal only).
        configure_wired_limit(mx, info.kind, logger)
        if is_encoder_model(self.model_config):
            # lazy: the runner imports MLX, loaded only after the BLAS interposition
            from vllm_unified.worker.encoder_runner import EncoderModelRunner

            self.model_runner = EncoderModelRunner(self.vllm_config, backend)
        else:
            # lazy: the runner imports MLX, loaded only after the BLAS interposition
            from vllm_unified.worker.model_runner import MLXModelRunner

            self.model_runner = MLXModelRunner(self.vllm_config, backend)
        logger.info("vllm-unified: worker on %s (%s)", backend.describe(), mx.default_device())

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("--load-format dummy is not supported by vllm-unified")
        self.rss_before_load = psutil.Process().memory_info().rss
        self.model_runner.load_model()
        # the loader's temporaries (numpy copies of the GGUF's blocks, MLX arrays replaced by
        # casts) sit in MLX's cache and glibc's free lists: give them back before the KV
        # budget reads this process's RSS
        release_free_memory(import_mlx())
        self.rss_after_load = psutil.Process().memory_info().rss

    def get_model(self):
        return self.model_runner.model

    def get_supported_tasks(self) -> tuple[str, ...]:
        """``("generate",)``, or a pooling model's served tasks (``--runner pooling``)."""
        pooling = self.model_runner.pooling
        return pooling.tasks if pooling is not None else ("generate",)

    # ------------------------------------------------------------------ KV cache
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """Bytes vLLM may turn into KV blocks (:mod:`vllm_unified.memory.budget`).

        ``--gpu-memory-utilization`` x the device's memory (system RAM on unified backends)
        minus what this process holds now (weights, runtime; its RSS, or MLX's active device
        memory on CUDA, where the result is also capped at the card's free memory) minus the
        activation peak
        of a profiling forward at ``min(max_num_batched_tokens, max_model_len)`` tokens plus the
        logits of ``max_num_seqs`` sampled rows; or ``--kv-cache-memory-bytes``. MLX's buffer
        cache is capped at that activation peak so it cannot eat the budget. vLLM does no
        profiling for an out-of-tree worker: this number is all the scheduler knows.

        Raises:
            ValueError: the budget cannot hold one ``--max-model-len`` sequence (the message
                names the flags and shows the arithmetic).
        """
        mx = import_mlx()
        cache, sched = self.cache_config, self.scheduler_config
        tokens = min(sched.max_num_batched_tokens, self.model_config.max_model_len)
        start = time.perf_counter()
        activations = logits = 0
        info = detect_backend()
        # Explicit bytes: the user sized the pool, so no profile on the CPU backend (slow
        # there). On GPU backends the profile still caps MLX's buffer cache: step shapes change
        # every step (the context grows), and an uncapped cache of unreusable buffers can fill
        # the card (out of memory at batch 64 on an H200).
        if cache.kv_cache_memory_bytes is None or info.kind != "cpu":
            activations = self._activation_peak(tokens)
            if self.model_runner.stage.is_last:  # only the last pipeline stage has logits
                logits = sched.max_num_seqs * self.model_config.get_vocab_size() * 4 * 2
            mx.set_cache_limit(activations)
        mem = read_device_memory(mx, info.kind, rss=psutil.Process().memory_info().rss,
                                 ram=info.total_memory)
        sharing = self._engine_processes_on_this_machine()
        if info.unified and sharing > 1:
            # Pipeline stages and data-parallel engines on one machine share its RAM: each
            # takes its share of --gpu-memory-utilization x RAM.
            mem = replace(mem, total=mem.total // sharing)
        lora = self.model_runner.lora
        adapters = lora.held_bytes_limit() if lora is not None else 0
        budget = compute_kv_budget(
            total=mem.total,
            utilization=cache.gpu_memory_utilization,
            in_use=mem.in_use,
            free=mem.free,
            activations=activations + logits + adapters,
            bytes_per_block=self.model_runner.kv_bytes_per_block(),
            block_size=cache.block_size,
            max_model_len=self.model_config.max_model_len,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
        )
        where = self.model_runner.stage.describe() + ": " if self.model_runner.stage.size > 1 \
            else ""
        if info.unified and sharing > 1:
            where += (f"RAM shared by {sharing} worker processes on this machine (total below is "
                      "this worker's share); ")
        if budget.explicit:
            logger.info("vllm-unified: %s%s%s", where, budget.describe(),
                        f"; MLX buffer cache capped at {activations / 2**30:.2f} GiB (profiled)"
                        if activations else "")
        else:
            logger.info(
                "vllm-unified: %s%s; activations: %.2f GiB for a %d-token chunk (profiling "
                "forward of %d tokens in %.2f s, scaled, plus its attention scores), plus logits "
                "of %d sampled rows; MLX buffer cache capped at %.2f GiB",
                where, budget.describe(), activations / 2**30, tokens, min(tokens, _PROFILE_TOKENS),
                time.perf_counter() - start, sched.max_num_seqs, activations / 2**30,
            )
        if adapters:
            logger.info("vllm-unified: %.1f MiB of the budget set aside for the LoRA adapters "
                        "held (--max-cpu-loras %d at --max-lora-rank %d)", adapters / 2**20,
                        lora.capacity, lora.slots.max_rank)
        return budget.budget

    def _engine_processes_on_this_machine(self) -> int:
        """Worker processes of this model on this machine: this engine's local pipeline
        stages times the data-parallel engines on this machine (vLLM's ``local_world_size``;
        ``data_parallel_size_local``, which vLLM resets to 1 in the engines of a dense model,
        so the server passes it in ``VLLM_UNIFIED_LOCAL_ENGINES``)."""
        pc = self.parallel_config
        engines = max(pc.data_parallel_size_local, envs.read(LOCAL_ENGINES_ENV), 1)
        return max(pc.local_world_size, 1) * engines

    def _activation_peak(self, tokens: int) -> int:
        """Activation bytes of the largest step: one sequence's chunk of ``tokens`` tokens.

        Measured by a profiling forward of ``min(tokens, 256)`` tokens (a full-size forward
        takes tens of seconds on MLX's CPU backend), scaled linearly to ``tokens``, plus the
        part that grows quadratically: the fp32 attention scores and probabilities of one
        layer, ``2 x heads x tokens^2 x 4`` bytes (MLX's CPU attention materialises them).
        """
        probe = min(tokens, _PROFILE_TOKENS)
        measured = self.model_runner.profile_activations(probe)
        heads = self.model_config.get_num_attention_heads(self.parallel_config)
        return int(measured * tokens / probe) + 2 * heads * tokens * tokens * 4

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """The MLX attention reads LBNHC pages (one layer's region is then slot-major)."""
        # lazy: kv.allocation imports MLX, loaded only after the BLAS interposition (init_device)
        from vllm_unified.kv.allocation import KV_LAYOUT

        return [KV_LAYOUT]

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)
        self.rss_after_kv_init = psutil.Process().memory_info().rss

    def compile_or_warm_up_model(self) -> CompilationTimes:
        seconds = self.model_runner.warm_up()
        # the profiling and warm-up forwards' scratch: steps allocate what they need again
        release_free_memory(import_mlx())
        self.rss_after_warm_up = psutil.Process().memory_info().rss
        logger.info("vllm-unified: warm-up forward took %.2f s", seconds)
        return CompilationTimes(language_model=seconds, encoder=0.0)

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's forward and, unless it has structured-output requests (then None:
        vLLM calls :meth:`sample_tokens` with the grammar bitmask), its sampling.

        With pipeline parallelism (as vLLM's GPU worker) a stage after the first receives the
        step's hidden states from the previous one, and a stage before the last sends its
        own to the next and returns None (the last stage's output is the step's). A stage
        before the last that fails (its peer lost: gloo's "Connection reset by peer") ends its
        process and its engine (:func:`~vllm_unified.distributed.liveness.abandon_pipeline`):
        requests get an error instead of waiting forever."""
        stage = self.model_runner.stage
        if stage.size == 1:
            return self.model_runner.execute_model(scheduler_output)
        try:
            hidden_in = None
            if not stage.is_first and scheduler_output.total_num_scheduled_tokens > 0:
                hidden_in = recv_hidden(self.model_runner.backend.logits_zero_copy)
            output = self.model_runner.execute_model(scheduler_output, hidden_in)
            if isinstance(output, IntermediateTensors):
                send_intermediate(output)
                return None
            return output
        except Exception:
            if stage.is_last:
                raise  # the last stage's errors reach the engine (its reply is the step's)
            # vLLM's worker process only logs an error of a stage whose reply nobody reads,
            # and the engine would wait for the last stage forever (a lost node, a failed
            # step): end this process so the executor's monitor fails the engine.
            logger.exception("vllm-unified: %s failed", stage.describe())
            abandon_pipeline(f"{stage.describe()} failed; the pipeline cannot go on without it")

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        """The drafts proposed after the last step (speculative decoding), or None."""
        return self.model_runner.take_draft_token_ids()

    def synchronize_device(self) -> None:
        self.model_runner.quiesce()
        import_mlx().synchronize()

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        if self.peer_watch is not None:
            self.peer_watch.stop()
        if self.model_runner is not None:
            self.model_runner.shutdown()

    def get_kv_connector_handshake_metadata(self) -> None:
        """vLLM's engine asks every worker when a KV connector is configured."""
        return self.model_runner.kv_connector.handshake_metadata()

    # ------------------------------------------------------------------ introspection
    def runner_stats(self) -> dict:
        """Step/forward counters (``LLM.collective_rpc("runner_stats")``)."""
        return self.model_runner.stats_dict()

    def kv_pool_data_ptrs(self) -> list[int]:
        """Addresses of the KV pool buffers (``LLM.collective_rpc("kv_pool_data_ptrs")``)."""
        self.model_runner.quiesce()
        return self.model_runner.pool.data_ptrs()

    def memory_report(self) -> dict[str, int]:
        """Resident memory (bytes) of this process now, after weight load and after the KV
        cache was allocated, the KV pool's size and its committed pages (None for an
        MLX-owned pool), and the bytes of the model weights this process holds
        (``LLM.collective_rpc("memory_report")``).

        MLX's buffer cache and malloc's free lists are emptied first, so "now" counts live
        memory (weights, KV pages written, runtime), not recyclable scratch.
        """
        self.model_runner.quiesce()
        import_mlx().clear_cache()
        malloc_trim()
        return {"rss": psutil.Process().memory_info().rss,
                "rss_after_load": self.rss_after_load,
                "rss_after_kv_init": self.rss_after_kv_init,
                "kv_pool_bytes": self.model_runner.pool.nbytes,
                "kv_pool_resident_bytes": self.model_runner.pool.resident_bytes(),
                **{f"weights_{k}_bytes": v
                   for k, v in self.model_runner.weights_nbytes().items()},
                # ru_maxrss is in KiB on Linux (bytes on macOS)
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                * (1 if sys.platform == "darwin" else 1024)}

    def memory_breakdown(self) -> dict:
        """Where this process's resident memory is, as it stands (nothing emptied first), then
        after MLX's buffer cache is emptied, then after ``malloc_trim(0)``
        (``LLM.collective_rpc("memory_breakdown")``, as ``benchmarks/memory.py models`` reads
        it). Each stage: RSS, MLX's active/cache/peak bytes and the smaps split
        (:func:`vllm_unified.memory.resident.smaps_breakdown`: anonymous vs file-backed)."""
        mx = import_mlx()
        self.model_runner.quiesce()

        def reading() -> dict:
            return {"rss": psutil.Process().memory_info().rss,
                    "mlx_active": mx.get_active_memory(), "mlx_cache": mx.get_cache_memory(),
                    "mlx_peak": mx.get_peak_memory(), "smaps": smaps_breakdown()}

        as_is = reading()
        mx.clear_cache()
        cleared = reading()
        malloc_trim()
        trimmed = reading()
        return {"as_is": as_is, "mlx_cache_cleared": cleared, "malloc_trimmed": trimmed,
                "kv_pool_bytes": self.model_runner.pool.nbytes,
                "kv_pool_resident_bytes": self.model_runner.pool.resident_bytes(),
                **{f"weights_{k}_bytes": v
                   for k, v in self.model_runner.weights_nbytes().items()},
                "rss_at_start": self.rss_at_start,
                "rss_before_load": self.rss_before_load,
                "rss_after_load": self.rss_after_load,
                "rss_after_kv_init": self.rss_after_kv_init,
                "rss_after_warm_up": self.rss_after_warm_up,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                * (1 if sys.platform == "darwin" else 1024)}

    def state_slots(self) -> dict[str, list[int]]:
        """A hybrid model's state slot per state group of every request seen, in the order
        they were first scheduled (``LLM.collective_rpc("state_slots")``)."""
        return dict(self.model_runner.layers.slot_owners)

    def kv_torch_view_ptrs(self) -> list[int]:
        """``data_ptr()`` of vLLM's per-layer torch KV views, in model layer order (empty when
        the pool is MLX-owned)."""
        views = self.model_runner.pool.torch_views or []
        return [v.data_ptr() for v in views]

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request) -> bool:
        """Load an adapter (``--lora-modules``, ``/v1/load_lora_adapter``); see
        :class:`vllm_unified.worker.lora.LoRAAdapters`."""
        return self._lora().add(lora_request,
                                reload=bool(getattr(lora_request, "load_inplace", False)))

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin(lora_id)

    def list_loras(self) -> set[int]:
        lora = self.model_runner.lora
        return lora.ids() if lora is not None else set()

    def _lora(self):
        """Raises RuntimeError, vLLM's message, when the engine runs without --enable-lora."""
        if self.model_runner.lora is None:
            raise RuntimeError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        return self.model_runner.lora
