"""The vLLM platform: what the device is, and the config policy for serving on MLX.

vLLM resolves ``current_platform`` to :class:`MLXPlatform` in every process (API server,
engine core). This module never imports MLX (vLLM may fork after importing it); the worker
(:mod:`vllm_unified.worker.worker`) owns the device.

Subclasses vLLM's base ``Platform`` as an out-of-tree platform, not ``CpuPlatform``: the CPU
platform's config policy (``is_cpu()``) changes vLLM's behaviour in many places (batch
defaults, OpenMP binding, torch.compile) that do not apply to MLX.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from vllm_unified import (
    compat,
    envs,
    patches,
    request_guard,
    request_policy,
    torchvision_stand_in,
    versions,
)
from vllm_unified.backend import detect_backend
from vllm_unified.compat import Platform, PlatformEnum, init_logger
from vllm_unified.distributed.pipeline import PP_MODEL_TYPES
from vllm_unified.errors import StartupRefused
from vllm_unified.kv.block_translation import KERNEL_BLOCK_SIZES, select_kernel_block_size
from vllm_unified.kv.quant import KVFormat, attention_spec, kv_format
from vllm_unified.memory.budget import (
    CPU_KVCACHE_SPACE_ENV,
    GIB,
    check_kv_budget_before_load,
    kv_space_from_env,
)
from vllm_unified.models.gguf_dir import weights_file_bytes
from vllm_unified.offload.config import configure_kv_offloading
from vllm_unified.worker.pooling_policy import pooling_policy

if TYPE_CHECKING:
    from vllm_unified.compat import VllmConfig

logger = init_logger(__name__)

DEFAULT_BLOCK_SIZE = 16
#: Seconds the engine core may take to tear down after SIGTERM under vLLM's default
#: ``--shutdown-timeout 0`` before it is killed (:func:`vllm_unified.patches.
#: stop_engine_core_gracefully`); above the disk tier's drain (offload/disk.py). An engine core
#: that exits sooner is not waited for (2-4 s on an idle machine); under a full CI load on two
#: cores its teardown and interpreter exit once took longer than 10 s and it was killed.
ENGINE_EXIT_GRACE_S = 30.0
WORKER_CLS = "vllm_unified.worker.worker.MLXWorker"

patches.patch_torch_accelerator_teardown()


class MLXPlatform(Platform):
    """vLLM platform backed by MLX (Metal, CUDA or CPU backend).

    torch-facing facts stay "cpu": vLLM builds ``torch.device(device_type)`` and CPU tensors for
    its own bookkeeping; all model compute happens in MLX inside our worker.
    """

    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    device_control_env_var: str = envs.VISIBLE_DEVICES_ENV
    simple_compile_backend: str = "eager"
    #: vLLM's model config this process was last configured with (:meth:`check_and_update_
    #: config`), None before; :meth:`get_max_output_tokens` reads its ``max_model_len`` when
    #: called (vLLM may lower it once the engine has sized the KV cache).
    serving_model_config: Any = None

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # First entry is what vLLM's dtype="auto" picks for fp32/GGUF checkpoints. On MLX's CPU
        # backend only fp32 matmul uses BLAS (bf16/fp16 run ~40x slower), so auto means fp32.
        if detect_backend().kind == "cpu":
            return [torch.float32, torch.bfloat16, torch.float16]
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"mlx-{detect_backend().kind}"

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return f"mlx-{detect_backend().kind}-0"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """Bytes of device memory: system RAM on unified-memory backends, card memory on CUDA."""
        return detect_backend().total_memory

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Pinning is a discrete-GPU idea; on unified memory every page is already device memory.
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """One MLX device per process; the worker selects it in MLX."""

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        """MLX's seed is set by the worker (``mx.random.seed``)."""

    @classmethod
    def import_kernels(cls) -> None:
        """No vLLM C++/CUDA kernels are needed: compute runs in MLX."""

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """torch.distributed over gloo for every group (pipeline stages on one machine or
        several: plain TCP). vLLM's CpuCommunicator would need its CPU worker's shared-memory
        set-up (``VLLM_DIST_IDENT``) and only works within one machine."""
        return ("vllm.distributed.device_communicators.base_device_communicator."
                "DeviceCommunicatorBase")

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # vLLM asks for this when it negotiates KV layouts; the MLX worker never instantiates
        # a torch attention backend, so name vLLM's CPU one as a layout-compatible placeholder.
        return compat.AttentionBackendEnum.CPU_ATTN.get_path()

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        import psutil

        return float(psutil.Process().memory_info().rss)

    @classmethod
    def get_max_output_tokens(cls, prompt_len: int) -> int:
        """vLLM's per-prompt cap on output tokens (``get_max_tokens`` of the OpenAI server,
        which takes the least of it, ``max_model_len - prompt_len`` and the request's
        ``max_tokens``): no cap of its own, but a prompt that fills the context window is
        refused here, naming its length and the limit
        (:func:`vllm_unified.request_policy.check_room_for_output`). Without this, vLLM lowers
        ``max_tokens`` to 0 and then rejects its own value ("max_tokens must be at least 1,
        got 0") whatever the client sent.

        Raises:
            VLLMValidationError: ``prompt_len >= --max-model-len`` (HTTP 400, parameter
                ``input_tokens``).
        """
        if cls.serving_model_config is not None:
            request_policy.check_room_for_output(prompt_len,
                                                 cls.serving_model_config.max_model_len)
        return sys.maxsize

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # Hybrid attention + state-space models need vLLM's hybrid KV-cache manager; other
        # models keep it off (check_and_update_config), as before.
        return True

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        """vLLM's own page alignment of hybrid models, driven with the MLX attention's kernel
        block sizes (vLLM's version finds no torch attention layer to ask), then the check
        that a kernel block size divides the result (:mod:`vllm_unified.kv.
        block_translation`). Runs in the worker's process after the model is loaded.

        Raises:
            ValueError: no kernel block size divides the block size (names ``--block-size``).
        """
        model_config, cache = vllm_config.model_config, vllm_config.cache_config
        if model_config is None:
            return
        if keeps_state(model_config) and not model_config.is_hybrid:
            # attention-free: no attention pages; each state block stands for
            # mamba_block_size tokens (vLLM's MambaModelConfig: max_model_len)
            logger.info("vllm-unified: attention-free model: state pages only, no attention "
                        "block size")
            return
        if model_config.is_hybrid:
            cls._align_hybrid_block_size(vllm_config, MLXAttentionKernel)
        mixed = _align_mixed_precision_block_size(cls, vllm_config)
        kernel = select_kernel_block_size(cache.block_size, KERNEL_BLOCK_SIZES)
        logger.info(
            "vllm-unified: attention block size %d tokens (vLLM's pages%s), MLX kernel block "
            "size %d: each block is viewed as %d kernel blocks, no copy",
            cache.block_size,
            f", aligned to {cache.mamba_page_size_padded}-byte state pages"
            if model_config.is_hybrid else
            f", aligned by vLLM so a {cache.cache_dtype} page covers a model-dtype page of "
            "the layers in --kv-cache-dtype-skip-layers" if mixed else "",
            kernel, cache.block_size // kernel,
        )

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """vLLM's rejection sampler (speculative decoding) on CPU tensors: its Triton kernels
        routed to CPU implementations (:func:`vllm_unified.patches.
        route_rejection_sampler_kernels`). vLLM calls this in the worker's process before the
        worker exists, i.e. before MLX is imported."""
        patches.route_rejection_sampler_kernels()

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"--dtype {dtype}: MLX serves float32, bfloat16 or float16")

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        """Install the HTTP request guard (:mod:`vllm_unified.request_guard`) as a default of
        vLLM's ``--middleware`` option when vLLM builds the ``serve`` parser."""
        request_guard.add_to_middleware_default(parser)

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM's check for unknown ``VLLM_*`` variables, knowing ours, and the check of ours
        (:func:`vllm_unified.envs.validate`): a ``VLLM_UNIFIED_*`` name that is not a setting is
        a warning (an error with ``hard_fail``, as vLLM treats its own).

        Raises:
            ValueError: a ``VLLM_UNIFIED_*`` setting with a bad value, naming it and the value.
        """
        for env in envs.validate():
            if hard_fail:
                raise ValueError(f"Unknown vllm-unified environment variable detected: {env}")
            logger.warning("Unknown vllm-unified environment variable detected: %s "
                           "(the settings are listed in docs/configuration.md)", env)
        known = compat.vllm_environment_variables()
        for env in os.environ:
            if env.startswith("VLLM_") and not env.startswith(envs.PREFIX) and env not in known:
                if hard_fail:
                    raise ValueError(f"Unknown vLLM environment variable detected: {env}")
                logger.warning("Unknown vLLM environment variable detected: %s", env)

    @classmethod
    def log_warnings(cls) -> None:
        info = detect_backend()
        logger.info(
            "vllm-unified: MLX %s backend (%s; %s), %.1f GiB %s memory",
            info.kind, info.device_name, info.reason, info.total_memory / 2**30,
            "unified" if info.unified else "device",
        )

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Apply the MLX serving policy. vLLM calls this twice (front end, then the engine core
        after KV-cache sizing), so it must be idempotent and keep values vLLM computed.

        Raises:
            ValueError: a setting this platform cannot serve, naming the flag.
            RuntimeError: the installed vLLM is not of the series this plugin is written for
                (:func:`vllm_unified.versions.check`; MLX or mlx-lm releases other than the
                pins are warnings).
        """
        versions.check_once()
        parallel = vllm_config.parallel_config
        _parallel_sizes_policy(parallel)
        if parallel.data_parallel_size_local > 1:
            # vLLM gives each engine of a dense model a config of DP size 1: tell the engine
            # processes (they inherit the environment) how many of them share this machine.
            os.environ[envs.LOCAL_ENGINES_ENV] = str(parallel.data_parallel_size_local)
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        if parallel.distributed_executor_backend not in (None, "uni", "mp"):
            raise ValueError(
                f"--distributed-executor-backend {parallel.distributed_executor_backend}: "
                "vllm-unified supports 'uni' or 'mp' (vLLM 0.32's Ray executor places workers "
                "on a platform's Ray device resource, which neither its CPU platform nor this "
                "one has; across machines use 'mp' with --nnodes / --node-rank / --headless)"
            )
        parallel.distributed_executor_backend = parallel.distributed_executor_backend or (
            "mp" if parallel.world_size > 1 else "uni")
        parallel.disable_custom_all_reduce = True

        # MLX runs the model: no torch.compile, no CUDA graphs.
        compilation = vllm_config.compilation_config
        compilation.mode = compat.CompilationMode.NONE
        compilation.cudagraph_mode = compat.CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        compilation.max_cudagraph_capture_size = 0
        if vllm_config.model_config is not None:
            vllm_config.model_config.enforce_eager = True

        if vllm_config.use_v2_model_runner:
            raise ValueError(
                "VLLM_USE_V2_MODEL_RUNNER=1: vllm-unified implements the V1 model-runner "
                "message format; unset it"
            )
        # Async scheduling (vLLM's default where the executor allows it): the runner queues
        # each step and hands vLLM an output future (worker/async_output.py). Only with the
        # uni-process executor, which collects outputs on the thread that runs the steps.
        if parallel.distributed_executor_backend != "uni":
            vllm_config.scheduler_config.async_scheduling = False

        _lora_policy(vllm_config)
        _multimodal_policy(vllm_config)
        pooling_policy(vllm_config)
        _pooling_dtype_policy(vllm_config)

        cache = vllm_config.cache_config
        hybrid = _hybrid_policy(vllm_config)
        _speculative_policy(vllm_config, hybrid)
        _pipeline_policy(vllm_config, hybrid)
        # Async scheduling is tested with plain decoder models; hybrid models (state pages) and
        # KV offloading (the connector reads the pool each step) run steps synchronously.
        sched = vllm_config.scheduler_config
        if sched.async_scheduling and (hybrid or vllm_config.kv_transfer_config is not None):
            sched.async_scheduling = False
            logger.info("vllm-unified: async scheduling off (%s)",
                        "hybrid model" if hybrid else "KV connector")
        # A hybrid model's block size is vLLM's alignment (update_block_size_for_backend);
        # this hook runs again after it and must keep it.
        if not cache.user_specified_block_size and not hybrid:
            cache.block_size = DEFAULT_BLOCK_SIZE
        elif not any(cache.block_size % k == 0 for k in KERNEL_BLOCK_SIZES):
            raise ValueError(
                f"--block-size {cache.block_size}: must be a multiple of one of the MLX "
                f"kernel block sizes {list(KERNEL_BLOCK_SIZES)}"
            )
        # vLLM's quantized KV formats served here (kv/quant.py); the rest refused by name.
        fmt = kv_format(cache.cache_dtype)
        if fmt.quantized:
            if hybrid:
                raise ValueError(
                    f"--kv-cache-dtype {cache.cache_dtype}: hybrid (attention + state-space) "
                    "models keep the model dtype here; use auto")
            skip = cache.kv_cache_dtype_skip_layers
            if parallel.pipeline_parallel_size > 1 and (fmt.turboquant or skip):
                # a stage's pages would need vLLM's skip-layer matching on global indices
                raise ValueError(
                    f"--kv-cache-dtype {cache.cache_dtype} with --pipeline-parallel-size "
                    f"{parallel.pipeline_parallel_size}"
                    f"{' and --kv-cache-dtype-skip-layers' if skip else ''}: not supported "
                    "by vllm-unified yet")
            # vLLM's block size for pages of two precisions in one block pool (the layers in
            # --kv-cache-dtype-skip-layers, TurboQuant's boundary layers among them): the block
            # size just reset above is aligned again, every call.
            _align_mixed_precision_block_size(cls, vllm_config)

        # VLLM_CPU_KVCACHE_SPACE as on vLLM's CPU backend; a KV budget that cannot hold one
        # sequence refused now, not after the weights have loaded.
        _kv_budget_policy(vllm_config, hybrid)

        # vLLM's OffloadingConnector with our spec and disk tier; other connectors refused.
        configure_kv_offloading(vllm_config)
        # Before vLLM builds its renderer: chat without a template names --chat-template.
        patches.name_chat_template_flag(logger)
        # SIGTERM: the engine core tears down (KV offload writes) before it is killed.
        patches.stop_engine_core_gracefully(ENGINE_EXIT_GRACE_S, logger)
        patches.harden_engine_core_signals()

        # MLX is not fork-safe: a forked engine core hangs if the parent touched MLX.
        if "mlx.core" in sys.modules:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        model_config = vllm_config.model_config
        if model_config is not None:
            cls.serving_model_config = model_config
            logger.info(
                "vllm-unified: worker=%s dtype=%s block_size=%d max_model_len=%d "
                "max_num_batched_tokens=%d prefix_caching=%s chunked_prefill=%s",
                parallel.worker_cls, model_config.dtype, cache.block_size,
                model_config.max_model_len,
                vllm_config.scheduler_config.max_num_batched_tokens,
                cache.enable_prefix_caching,
                vllm_config.scheduler_config.enable_chunked_prefill,
            )

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Reject (HTTP 400, naming the field) what the MLX runner cannot honour yet, so no
        parameter is silently ignored.

        Raises:
            VLLMValidationError: for an unsupported parameter or input kind.
        """
        if isinstance(processed_inputs, dict) and processed_inputs.get("prompt_embeds") is not None:
            raise compat.VLLMValidationError(
                "prompt embeddings are not supported by vllm-unified", parameter="prompt_embeds"
            )
        pooling = (cls.serving_model_config is not None
                   and cls.serving_model_config.runner_type == "pooling")
        if isinstance(params, compat.PoolingParams) and pooling:
            return  # the task is checked by vLLM against the worker's supported tasks
        if not isinstance(params, compat.SamplingParams) or pooling:
            raise compat.VLLMValidationError(
                "this server runs the model for "
                + ("pooling (--runner pooling): text generation is not served"
                   if pooling else "text generation: pooling (embeddings, scores) is not "
                   "served; start it with --runner pooling"),
                parameter="task",
            )
        request_policy.check_sampling(params, request_policy.current_limits())
        for field, unsupported in _unsupported_sampling(params).items():
            if unsupported:
                raise compat.VLLMValidationError(
                    f"sampling parameter '{field}' is not supported by vllm-unified yet",
                    parameter=field,
                    value=getattr(params, field, None),
                )


def _pooling_dtype_policy(vllm_config: VllmConfig) -> None:
    """A float32 checkpoint served by the pooling runner on MLX's CPU backend runs in float32.

    vLLM's ``--dtype auto`` gives pooling models float16 (``_resolve_auto_dtype`` in
    vllm/config/model.py); MLX's CPU backend multiplies float16 matrices without BLAS, ~20x
    slower than float32 (``supported_dtypes`` says the same for generation). vLLM's resolved
    config does not tell ``auto`` from an explicit ``--dtype float16``: both are raised, with
    a warning naming the flag.
    """
    model_config = vllm_config.model_config
    if (model_config is None or model_config.runner_type != "pooling"
            or model_config.dtype != torch.float16 or detect_backend().kind != "cpu"):
        return
    hf = model_config.hf_config
    stored = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if stored not in (None, torch.float32, "float32"):
        return  # a float16 checkpoint, or the user's --dtype over a float16 one
    model_config.dtype = torch.float32
    logger.warning("vllm-unified: --dtype float16 (vLLM's auto choice for pooling models) "
                   "raised to float32, the checkpoint's dtype: MLX's CPU backend runs "
                   "float16 matmuls without BLAS, ~20x slower")


def _multimodal_policy(vllm_config: VllmConfig) -> None:
    """A multimodal architecture (Gemma 3, Qwen3-VL, Mistral 3, ...) is served text-only: its
    language model runs (mlx-lm's model for the type), vLLM's ``language_model_only`` gives
    every modality a limit of 0, so vLLM builds no multimodal processor and refuses a request
    carrying an image, video or audio (HTTP 400) instead of dropping it.

    Raises:
        ValueError: ``--limit-mm-per-prompt`` asks for a modality, or ``--enable-mm-embeds``.
    """
    model_config = vllm_config.model_config
    mm_config = model_config.multimodal_config if model_config is not None else None
    if mm_config is None or mm_config.language_model_only:
        return
    asked = {m: o.count for m, o in mm_config.limit_per_prompt.items()
             if getattr(o, "count", 0)}
    if asked or mm_config.enable_mm_embeds:
        flag = (f"--limit-mm-per-prompt {asked}" if asked else "--enable-mm-embeds")
        raise ValueError(
            f"{flag}: vllm-unified serves the language model of {model_config.architecture} "
            "only (image, video and audio inputs are not supported yet); leave the flag out "
            "(or use --language-model-only)")
    mm_config.language_model_only = True
    logger.info("vllm-unified: %s served text-only (its language model; requests with "
                "image, video or audio inputs are refused)%s", model_config.architecture,
                "; torchvision is not installed, vLLM imports a stand-in"
                if torchvision_stand_in.installed() else "")


class MLXAttentionKernel:
    """The MLX paged attention described the way vLLM's block-size arithmetic asks an attention
    backend (``Platform._align_hybrid_block_size``); never instantiated."""

    @staticmethod
    def get_name() -> str:
        return "MLX_PAGED_ATTN"

    @staticmethod
    def get_supported_kernel_block_sizes(spec: Any = None) -> list[int]:
        return list(KERNEL_BLOCK_SIZES)

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        return any(block_size % k == 0 for k in KERNEL_BLOCK_SIZES)

    @staticmethod
    def customize_spec(spec: Any) -> Any:
        """vLLM's FullAttentionSpec pages, unchanged, except the packed cells of the quantized
        formats served here, which vLLM's block-size alignment asks for: ``state_content_bytes``
        as ``TritonAttentionBackend.customize_spec`` sets it for the per-token-head formats
        (data and an fp32 scale per side) and ``TurboQuantAttentionBackend.customize_spec`` for
        TurboQuant (``TurboQuantConfig.slot_size_aligned``)."""
        from dataclasses import replace

        mode = getattr(spec, "kv_quant_mode", None)
        if spec.state_content_bytes is not None or mode is None or \
                not (mode.is_turboquant or mode.is_per_token_head):
            return spec
        fmt = kv_format(mode.name.lower(), spec.head_size)
        return replace(spec, state_content_bytes=fmt.cell_bytes(spec.head_size))


def _align_mixed_precision_block_size(platform: type[MLXPlatform], vllm_config: Any) -> bool:
    """vLLM's block size for a quantized cache with layers kept in the model dtype
    (``--kv-cache-dtype-skip-layers``, with any served format; vLLM adds TurboQuant's boundary
    layers to it):
    ``Platform._align_heterogeneous_kv_block_size`` with the MLX attention's kernel block sizes
    and page packing, as vLLM's ``update_block_size_for_backend`` does with a CUDA backend
    (the block grows until a quantized page covers a model-dtype page of the smallest kernel
    block). Idempotent. Returns whether it applied.

    Raises:
        ValueError: the --kv-cache-dtype is not served (naming the flag).
    """
    cache = vllm_config.cache_config
    if vllm_config.model_config is None or not cache.kv_cache_dtype_skip_layers or \
            not kv_format(cache.cache_dtype).quantized:
        return False
    platform._align_heterogeneous_kv_block_size(vllm_config, MLXAttentionKernel)
    return True


def _parallel_sizes_policy(parallel: Any) -> None:
    """Tensor parallelism refused (one MLX device per unified-memory machine: a layer split
    over machines would cross the network twice per layer; pipeline stages cross it once per
    stage). Pipeline and data parallelism go through vLLM's own executors and engines.

    Raises:
        ValueError: ``--tensor-parallel-size`` other than 1, naming the alternative.
    """
    if parallel.tensor_parallel_size != 1:
        raise ValueError(
            f"--tensor-parallel-size {parallel.tensor_parallel_size}: vllm-unified runs one "
            "MLX device per machine, and tensor parallelism across machines would exchange "
            "activations twice per layer; use --pipeline-parallel-size N to spread the layers "
            "over N machines (or processes), or --data-parallel-size N for more engines")


def _lora_policy(vllm_config: VllmConfig) -> None:
    """``--enable-lora`` (worker/lora.py) runs on one pipeline stage.

    Raises:
        ValueError: with ``--pipeline-parallel-size`` above 1.
    """
    if vllm_config.lora_config is None:
        return
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("--enable-lora with --pipeline-parallel-size > 1 is not supported by "
                         "vllm-unified")


def _pipeline_policy(vllm_config: VllmConfig, hybrid: bool) -> None:
    """What ``--pipeline-parallel-size`` > 1 runs with here, refused at start-up by flag.

    Raises:
        ValueError: an executor other than ``mp``, a model type outside
            :data:`~vllm_unified.distributed.pipeline.PP_MODEL_TYPES` (or hybrid),
            speculative decoding, or a KV connector (``--kv-offloading-size``).
    """
    parallel = vllm_config.parallel_config
    size = parallel.pipeline_parallel_size
    if size == 1:
        return
    flag = f"--pipeline-parallel-size {size}"
    if parallel.distributed_executor_backend != "mp":
        raise ValueError(f"{flag}: needs --distributed-executor-backend mp (one worker process "
                         f"per stage), not {parallel.distributed_executor_backend}")
    model = vllm_config.model_config
    model_type = getattr(model.hf_config, "model_type", None) if model is not None else None
    if hybrid or model_type not in PP_MODEL_TYPES:
        raise ValueError(f"{flag}: model type {model_type!r} is not supported with pipeline "
                         f"parallelism by vllm-unified (supported: {', '.join(PP_MODEL_TYPES)})")
    if vllm_config.speculative_config is not None:
        raise ValueError(f"{flag}: --speculative-config is not supported with pipeline "
                         "parallelism by vllm-unified yet")
    if vllm_config.kv_transfer_config is not None:
        raise ValueError(f"{flag}: KV offloading (--kv-offloading-size / --kv-transfer-config) "
                         "is not supported with pipeline parallelism by vllm-unified yet")


def _hybrid_policy(vllm_config: VllmConfig) -> bool:
    """Hybrid models use vLLM's hybrid KV-cache manager (state groups next to attention), as
    do attention-free state-space models (state groups only); other models keep it off unless
    asked for, as on vLLM's CPU platform. Returns whether the model keeps state
    (:func:`keeps_state`): the hybrid rules apply to it.

    Raises:
        ValueError: prefix caching for a hybrid model (vLLM's 'align' state mode, which
            copies states between blocks, is not implemented).
    """
    model_config, sched = vllm_config.model_config, vllm_config.scheduler_config
    if model_config is None:
        return False
    if not keeps_state(model_config):
        if sched.disable_hybrid_kv_cache_manager is None:
            sched.disable_hybrid_kv_cache_manager = True
        return False
    if vllm_config.cache_config.enable_prefix_caching:
        kind = ("a hybrid attention + state-space" if model_config.is_hybrid
                else "an attention-free state-space")
        raise ValueError(
            f"--enable-prefix-caching: {model_config.architecture} is {kind} model, whose "
            "prefix caching (vLLM's mamba_cache_mode 'align') vllm-unified does not "
            "implement yet; pass --no-enable-prefix-caching"
        )
    cache = vllm_config.cache_config
    if not model_config.is_hybrid and cache.mamba_block_size is None:
        # vLLM's MambaModelConfig does this for the attention-free classes it knows; an
        # mlx-lm-only one (RWKV-7) has no entry there: one state block per request
        cache.mamba_block_size = model_config.max_model_len
    return True


def keeps_state(model_config: Any) -> bool:
    """The model keeps per-request recurrent state in vLLM's state (Mamba) pages: a hybrid
    (attention + state-space) or an attention-free state-space model (Mamba, Mamba2)."""
    return bool(model_config.is_hybrid or getattr(model_config, "is_attention_free", False))


def _kv_budget_policy(vllm_config: VllmConfig, hybrid: bool) -> None:
    """``VLLM_CPU_KVCACHE_SPACE`` (vLLM's CPU-backend KV size, whole GiB) becomes
    ``--kv-cache-memory-bytes`` as on vLLM's CPU backend (on every MLX backend); then the KV
    budget is checked against one ``--max-model-len`` sequence where that is possible before
    loading (:func:`~vllm_unified.memory.budget.check_kv_budget_before_load`): models that are
    not hybrid (a hybrid model's block size and state pages are known after loading), with
    the target model's attention pages (a draft model's are added after loading). The weights
    count on the CPU backend only, where the process's RSS (the budget's "in use") holds at
    least the checkpoint's bytes once they are loaded.

    Raises:
        StartupRefused: ``VLLM_CPU_KVCACHE_SPACE`` not a positive whole number, or disagreeing
            with ``--kv-cache-memory-bytes``; a budget that cannot fit (one line, naming the
            flag and the numbers).
    """
    cache = vllm_config.cache_config
    space = kv_space_from_env()
    if space is not None:
        if cache.kv_cache_memory_bytes not in (None, space):
            raise StartupRefused(
                f"{CPU_KVCACHE_SPACE_ENV}={space // GIB} ({space} bytes) and "
                f"--kv-cache-memory-bytes {cache.kv_cache_memory_bytes} disagree; give one")
        if cache.kv_cache_memory_bytes is None:
            cache.kv_cache_memory_bytes = space
            logger.info("vllm-unified: %s=%d (vLLM's CPU-backend variable): KV cache of %d "
                        "GiB, as --kv-cache-memory-bytes %d", CPU_KVCACHE_SPACE_ENV,
                        space // GIB, space // GIB, space)
    model = vllm_config.model_config
    if model is None or hybrid:
        return
    parallel = vllm_config.parallel_config
    head_size = model.get_head_size()
    fmt = kv_format(cache.cache_dtype or "auto", head_size)
    # layers in --kv-cache-dtype-skip-layers keep the model dtype's pages
    skip = set(cache.kv_cache_dtype_skip_layers or ()) if fmt.quantized else set()

    latent = _mla_row_width(model)

    def page(i: int) -> int:
        if latent is not None:  # vLLM's MLA page (models/latent_attention.py serves it)
            return compat.MLAAttentionSpec(block_size=cache.block_size, num_kv_heads=1,
                                           head_size=latent, dtype=model.dtype).page_size_bytes
        return attention_spec(KVFormat() if str(i) in skip else fmt,
                              block_size=cache.block_size,
                              num_kv_heads=model.get_num_kv_heads(parallel),
                              head_size=head_size, dtype=model.dtype).page_size_bytes

    info = detect_backend()
    check_kv_budget_before_load(
        total=info.total_memory, utilization=cache.gpu_memory_utilization,
        weights=weights_file_bytes(model.model) if info.kind == "cpu" else 0,
        bytes_per_block=sum(page(i) for i in range(model.get_num_layers(parallel))),
        block_size=cache.block_size,
        max_model_len=model.max_model_len, kv_cache_memory_bytes=cache.kv_cache_memory_bytes)


def _mla_row_width(model: Any) -> int | None:
    """``kv_lora_rank + qk_rope_head_dim``: the width of a multi-head latent attention
    model's page row, for configs that declare a latent (None otherwise)."""
    text = model.hf_text_config
    rank = getattr(text, "kv_lora_rank", None)
    rope = getattr(text, "qk_rope_head_dim", None)
    return int(rank) + int(rope) if rank and rope else None


def _speculative_policy(vllm_config: VllmConfig, hybrid: bool) -> None:
    """``--speculative-config``: the methods the MLX runner implements, with synchronous
    scheduling (as vLLM 0.32 itself runs ``ngram`` and ``suffix``); the start-up log states
    method and k.

    Raises:
        ValueError: a method other than ``ngram`` / ``suffix``, a hybrid model (its recurrent
            state cannot be rolled back over rejected drafts yet), or a KV connector, each
            naming ``--speculative-config``.
    """
    spec = vllm_config.speculative_config
    if spec is None:
        return
    # lazy: spec_decode imports vllm.config, circular while vLLM imports this platform module
    from vllm_unified.worker.spec_decode import SUPPORTED_METHODS

    if spec.method not in SUPPORTED_METHODS:
        raise ValueError(
            f"--speculative-config method {spec.method!r}: vllm-unified implements "
            f"{', '.join(repr(m) for m in SUPPORTED_METHODS)} (EAGLE, MTP and the other "
            "hidden-state proposers are not implemented yet)"
        )
    if spec.method == "draft_model":
        cache = vllm_config.cache_config
        _draft_model_policy(spec, cache.cache_dtype, cache.kv_cache_dtype_skip_layers)
    if hybrid:
        raise ValueError(
            "--speculative-config: speculative decoding with a hybrid attention + "
            "state-space model is not supported by vllm-unified (recurrent states are not "
            "rolled back over rejected drafts)"
        )
    if vllm_config.kv_transfer_config is not None:
        raise ValueError(
            "--speculative-config together with a KV connector (--kv-offloading-size / "
            "--kv-transfer-config) is not supported by vllm-unified yet"
        )
    sched = vllm_config.scheduler_config
    if sched.async_scheduling:
        sched.async_scheduling = False
        logger.info("vllm-unified: async scheduling off (speculative decoding runs its steps "
                    "synchronously)")
    logger.info(
        "vllm-unified: speculative decoding, method %s, k = %d draft tokens per step%s; "
        "verified in the same MLX forward as the batch, accepted by vLLM's rejection sampler",
        spec.method, spec.num_speculative_tokens,
        f" (n-gram {spec.prompt_lookup_min}..{spec.prompt_lookup_max})"
        if spec.method == "ngram" else "",
    )


def _draft_model_policy(spec: Any, cache_dtype: str | None,
                        skip_layers: list[str] | None = None) -> None:
    """``draft_model``: the MLX runner drafts greedily (vLLM's default ``draft_sample_method``)
    one token per draft forward, with a draft of the target's vocabulary whose KV pages have
    the target's format (``cache_dtype``, its ``--kv-cache-dtype``: one KV cache group);
    ``skip_layers``: the target's ``--kv-cache-dtype-skip-layers``.

    Raises:
        ValueError: naming the ``--speculative-config`` field vllm-unified does not implement,
            or vLLM's own message for a vocabulary size mismatch.
    """
    unsupported = {
        "draft_sample_method": spec.draft_sample_method != "greedy",
        "use_heterogeneous_vocab": bool(spec.use_heterogeneous_vocab),
        "parallel_drafting": bool(spec.parallel_drafting),
        "kv_cache_dtype": spec.kv_cache_dtype not in (None, cache_dtype or "auto"),
        # a target with skip layers (TurboQuant's boundary layers, or the flag's) keeps them in
        # the model dtype; its draft pages would need vLLM's skip-layer matching on the
        # draft's layer names, not implemented
        "--kv-cache-dtype turboquant": kv_format(cache_dtype).turboquant,
        "--kv-cache-dtype-skip-layers": bool(skip_layers) and kv_format(cache_dtype).quantized,
    }
    bad = [name for name, set_ in unsupported.items() if set_]
    if bad:
        raise ValueError(
            f"--speculative-config method 'draft_model' with {', '.join(bad)}: not supported "
            "by vllm-unified (greedy drafts of a draft model with the target's vocabulary, "
            "one token per draft forward, KV pages in the target's --kv-cache-dtype)"
        )
    spec.verify_equal_vocab_size_if_draft_model()


def _unsupported_sampling(p: Any) -> dict[str, bool]:
    """Which set sampling fields the runner does not implement (field -> is it set).

    Everything else of ``SamplingParams`` is honoured: greedy/temperature/top-k/top-p/min-p/seed
    in MLX; penalties, ``logit_bias``, ``bad_words``, ``allowed_token_ids``, ``min_tokens``,
    ``logprobs``, ``prompt_logprobs`` and structured output through vLLM's own sampler
    (:mod:`vllm_unified.worker.vllm_sampling`); ``n``, stop strings/ids, ``ignore_eos``,
    ``max_tokens`` in vLLM's front end and scheduler.
    """
    return {
        # Per-request arguments for custom logits processors; none are wired to requests.
        "extra_args": bool(p.extra_args),
        "logits_processors": bool(getattr(p, "logits_processors", None)),
        "thinking_token_budget": p.thinking_token_budget is not None,
        # The sample-side half would work through vLLM's sampler, but not its prompt-side
        # counterpart (prompt_token_id_logprobs_dict): reject the pair until both are done.
        "logprob_token_ids": bool(p.logprob_token_ids),
    }
