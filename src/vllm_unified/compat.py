"""The one place that imports vLLM internals for use (vLLM 0.32.x, model runner V1 message
format); :mod:`vllm_unified.patches` imports the vLLM modules it patches.

Everything else in the package imports vLLM names from here, so a vLLM bump is checked and
mended in one file (``scripts/check_imports.py`` fails on any other ``import vllm``). Public,
stable vLLM API (``vllm.LLM``, ``SamplingParams``) may be imported directly by tests and
benchmarks.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

# Safe while vLLM is still resolving ``current_platform`` (the platform module needs them).
from vllm.logger import init_logger as _vllm_init_logger
from vllm.platforms.interface import Platform, PlatformEnum

#: vLLM version this compatibility layer was written and tested against (checked at start-up).
from vllm_unified.versions import VLLM_SERIES  # noqa: F401 (re-exported)

# Everything else is imported on first use (PEP 562): ``vllm.config`` imports
# ``vllm.platforms.current_platform``, so importing it while the platform class loads would be
# circular.
_LAZY: dict[str, str] = {
    "CompilationMode": "vllm.config",
    "CUDAGraphMode": "vllm.config",
    "VllmConfig": "vllm.config",
    "VLLMValidationError": "vllm.exceptions",
    "SamplingParams": "vllm.sampling_params",
    "SamplingType": "vllm.sampling_params",
    "RequestOutputKind": "vllm.sampling_params",
    # The OpenAI server's request models and error format (request_guard).
    "ChatCompletionRequest": "vllm.entrypoints.openai.chat_completion.protocol",
    "CompletionRequest": "vllm.entrypoints.openai.completion.protocol",
    "create_error_response": "vllm.entrypoints.serve.exception_handling.error_response",
    # vLLM's --api-key check (request_guard defers to it: unauthenticated requests get its 401)
    "AuthenticationMiddleware": "vllm.entrypoints.serve.middleware.authenticate",
    "GUARDED_PREFIX": "vllm.entrypoints.serve.middleware.authenticate",
    "NewRequestData": "vllm.v1.core.sched.output",
    # The scheduler's free-block queue (kv/block_reuse.py subclasses it).
    "FreeKVCacheBlockQueue": "vllm.v1.core.kv_cache_utils",
    "KVCacheBlock": "vllm.v1.core.kv_cache_utils",
    "SchedulerOutput": "vllm.v1.core.sched.output",
    "FullAttentionSpec": "vllm.v1.kv_cache_interface",
    "KVCacheConfig": "vllm.v1.kv_cache_interface",
    "KVCacheGroupSpec": "vllm.v1.kv_cache_interface",
    "KVCacheTensor": "vllm.v1.kv_cache_interface",
    "MambaSpec": "vllm.v1.kv_cache_interface",
    "MLAAttentionSpec": "vllm.v1.kv_cache_interface",
    "ModelRegistry": "vllm.model_executor.models",
    "MambaAttentionBackendEnum": "vllm.v1.attention.backends.registry",
    "is_conv_state_dim_first": "vllm.model_executor.layers.mamba.mamba_utils",
    "create_kv_cache_views": "vllm.v1.kv_cache_interface",
    "KVCacheLayout": "vllm.v1.kv_cache_layout",
    "KVCacheSpec": "vllm.v1.kv_cache_interface",
    "EMPTY_MODEL_RUNNER_OUTPUT": "vllm.v1.outputs",
    "ModelRunnerOutput": "vllm.v1.outputs",
    "AsyncModelRunnerOutput": "vllm.v1.outputs",
    "CompilationTimes": "vllm.v1.worker.worker_base",
    "WorkerBase": "vllm.v1.worker.worker_base",
    "AttentionBackendEnum": "vllm.v1.attention.backends.registry",
    # Sampling through vLLM's own sampler, logits processors and structured-output bitmask.
    "GrammarOutput": "vllm.v1.core.sched.output",
    "LogprobsLists": "vllm.v1.outputs",
    "LogprobsTensors": "vllm.v1.outputs",
    "Sampler": "vllm.v1.sample.sampler",
    "SamplingMetadata": "vllm.v1.sample.metadata",
    "BUILTIN_LOGITS_PROCESSORS": "vllm.v1.sample.logits_processor",
    "BatchUpdate": "vllm.v1.sample.logits_processor",
    "build_logitsprocs": "vllm.v1.sample.logits_processor",
    "apply_grammar_bitmask": "vllm.v1.structured_output.utils",
    # Speculative decoding: vLLM's proposers, rejection sampler and draft hand-over.
    "DraftTokenIds": "vllm.v1.outputs",
    "RejectionSampler": "vllm.v1.sample.rejection_sampler",
    "SpecDecodeMetadata": "vllm.v1.spec_decode.metadata",
    "NgramProposer": "vllm.v1.spec_decode.ngram_proposer",
    "SuffixDecodingProposer": "vllm.v1.spec_decode.suffix_decoding",
    "SpeculativeConfig": "vllm.config",
    # KV offloading (vllm_unified.offload): vLLM's OffloadingConnector, tiering spec, fs tier.
    "KVTransferConfig": "vllm.config",
    "OffloadingWorker": "vllm.v1.kv_offload.base",
    "TransferResult": "vllm.v1.kv_offload.base",
    "GPULoadStoreSpec": "vllm.v1.kv_offload.base",
    "CanonicalKVCaches": "vllm.v1.kv_offload.base",
    "CanonicalKVCacheTensor": "vllm.v1.kv_offload.base",
    "CanonicalKVCacheRef": "vllm.v1.kv_offload.base",
    "CPULoadStoreSpec": "vllm.v1.kv_offload.cpu.common",
    "OffloadingCounterMetadata": "vllm.v1.kv_offload.base",
    "SharedOffloadRegion": "vllm.v1.kv_offload.cpu.shared_offload_region",
    "TieringOffloadingSpec": "vllm.v1.kv_offload.tiering.spec",
    "FileSystemTierManager": "vllm.v1.kv_offload.tiering.fs.manager",
    "DualQueueThreadPool": "vllm.v1.kv_offload.tiering.fs.thread_pool",
    "FileMapper": "vllm.v1.kv_offload.file_mapper",
    "OffloadingConnectorStats":
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
    "set_forward_context": "vllm.forward_context",
    "KVConnectorModelRunnerMixin": "vllm.v1.worker.kv_connector_model_runner_mixin",
    "ensure_kv_transfer_initialized": "vllm.distributed.kv_transfer",
    "ensure_kv_transfer_shutdown": "vllm.distributed.kv_transfer",
    "get_kv_transfer_group": "vllm.distributed.kv_transfer",
    "init_distributed_environment": "vllm.distributed",
    "ensure_model_parallel_initialized": "vllm.distributed",
    # Pipeline parallelism (vllm_unified.distributed): vLLM's stage split and PP group.
    "get_pp_group": "vllm.distributed",
    "get_pp_indices": "vllm.distributed.utils",
    "IntermediateTensors": "vllm.sequence",
    # Quantized KV cache formats (kv/quant.py): vLLM's names, dtypes and RHT signs.
    "KVQuantMode": "vllm.v1.kv_cache_interface",
    "get_kv_quant_mode": "vllm.v1.kv_cache_interface",
    "STR_DTYPE_TO_TORCH_DTYPE": "vllm.utils.torch_utils",
    "largest_power_of_2_divisor": "vllm.utils.math_utils",
    # TurboQuant (kv/quant.py): presets, packed slot size, boundary skip layers; the layer
    # index vLLM's attention layer matches against --kv-cache-dtype-skip-layers.
    "TurboQuantConfig": "vllm.model_executor.layers.quantization.turboquant.config",
    "extract_layer_index": "vllm.model_executor.models.utils",
    "UniformTypeKVCacheSpecs": "vllm.v1.kv_cache_interface",
    # Pooling models (worker/pooling.py): vLLM's poolers run on torch views of our hidden
    # states, built under the engine's config as vLLM's model classes build them.
    "DispatchPooler": "vllm.model_executor.layers.pooler",
    "PoolingMetadata": "vllm.v1.pool.metadata",
    "PoolingStates": "vllm.v1.pool.metadata",
    "PoolingParams": "vllm.pooling_params",
    "set_current_vllm_config": "vllm.config",
    "get_tokenizer": "vllm.tokenizers",
    # Encoder models' pooling heads (worker/pooling.py), vLLM's own modules loaded with the
    # checkpoint's head tensors.
    "BertPooler": "vllm.model_executor.models.bert",
    "RobertaClassificationHead": "vllm.model_executor.models.roberta",
    "ModernBertPooler": "vllm.model_executor.models.modernbert",
    # LoRA adapters (worker/lora.py): vLLM's PEFT config rules and checkpoint reader, and the
    # error its OpenAI server turns into a 404.
    "PEFTHelper": "vllm.lora.peft_helper",
    "LoRAModel": "vllm.lora.lora_model",
    "get_adapter_absolute_path": "vllm.lora.utils",
    "LoRAAdapterNotFoundError": "vllm.exceptions",
}


def get_rht_signs(d: int, round_idx: int, device: str) -> Any:
    """vLLM's deterministic +-1 RHT sign vector of length ``d`` for its int4 KV format
    (``vllm.v1.attention.ops.int4_per_token_head._get_rht_signs``; private in vLLM 0.32)."""
    from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs

    return _get_rht_signs(d, round_idx, device)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


#: Below this temperature vLLM samples greedily (``vllm/sampling_params.py: _SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


def vllm_cli_main() -> int | None:
    """Run vLLM's own command line (``vllm.entrypoints.cli.main.main``) on ``sys.argv``."""
    from vllm.entrypoints.cli.main import main

    return main()


def has_vllm_config_class(model_type: str) -> bool:
    """Whether vLLM has its own config class for ``model_type``
    (``vllm.transformers_utils.config._CONFIG_REGISTRY``)."""
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    return model_type in _CONFIG_REGISTRY


def vllm_environment_variables() -> set[str]:
    """Names of the environment variables vLLM knows (``vllm.envs``)."""
    from vllm import envs

    return set(envs.environment_variables)


def sampling_fields(params: Any) -> dict[str, Any]:
    """A ``SamplingParams``' public fields and their values (a msgspec struct in vLLM 0.32:
    ``__struct_fields__``, private ones starting with ``_``)."""
    return {name: getattr(params, name) for name in params.__struct_fields__
            if not name.startswith("_")}


def structured_decisions_unavailable(app: Any) -> str | None:
    """Why vLLM's structured decisions API (``POST /v1/systemone``) is off on the OpenAI
    server ``app`` (a FastAPI app, after start-up), or None when it is on.

    vLLM registers the route for every model and answers 501 when no handler was made; the
    reason is the one vLLM logs at debug level, recomputed for the tasks this platform
    serves (``generate``).
    """
    from vllm.entrypoints.generate.structured_decisions import strategies

    if getattr(app.state, "serving_structured_decisions", None) is not None:
        return None
    try:
        strategies.select_read_strategy(app.state.vllm_config.model_config, ("generate",))
    except ValueError as e:
        return str(e)
    return "vLLM did not enable it at start-up"


def elastic_ep_unavailable(app: Any) -> str | None:
    """Why ``POST /scale_elastic_ep`` cannot work on the OpenAI server ``app``, or None.

    vLLM registers the route on every generating server; without elastic EP its engine
    client raises ``NotImplementedError``, which the route answers as HTTP 500 "Scale failed".
    """
    if app.state.vllm_config.parallel_config.enable_elastic_ep:
        return None
    return "the server was not started with --enable-elastic-ep"


@functools.cache
def kind_routes() -> dict[str, tuple[Any, ...]]:
    """vLLM's HTTP routes of each kind of server: ``"generate"`` (the routes vLLM registers
    when the engine supports the ``generate`` task: completions, chat, responses, Anthropic
    messages, generative scoring, elastic EP, token-in/token-out) and ``"pooling"`` (those of
    the pooling tasks: ``/pooling``, ``/classify``, embeddings, score and rerank), as Starlette
    routes (``path_regex`` matches a request path).

    Built once, from vLLM's own routers (``vllm/entrypoints/launchers/api_server/routers.py``
    registers them by task) on a scratch app, so they follow vLLM's registration.
    """
    from fastapi import FastAPI
    from vllm.entrypoints.generate.api_router import register_generate_api_routers
    from vllm.entrypoints.pooling.classify.api_router import router as classify
    from vllm.entrypoints.pooling.embed.api_router import router as embed
    from vllm.entrypoints.pooling.pooling.api_router import router as pooling
    from vllm.entrypoints.pooling.scoring.api_router import router as scoring
    from vllm.entrypoints.scale_out.token_in_token_out.api_router import router as tokens
    from vllm.entrypoints.serve.elastic_ep.api_router import router as elastic_ep

    generate = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # never served
    register_generate_api_routers(generate)
    return {"generate": (*generate.routes, *elastic_ep.routes, *tokens.routes),
            "pooling": tuple(r for router in (pooling, classify, embed, scoring)
                             for r in router.routes)}


def served_tasks(app: Any) -> tuple[str, tuple[str, ...]] | None:
    """The runner type (``"generate"`` / ``"pooling"``) and the supported tasks of vLLM's
    OpenAI server ``app`` (a FastAPI app, after start-up), or None for another app.

    The tasks of a pooling server are those vLLM gave its ``/pooling`` handler; a generating
    server on this platform serves ``generate`` only.
    """
    config = getattr(app.state, "vllm_config", None)
    if config is None:
        return None
    runner = config.model_config.runner_type
    handler = getattr(app.state, "serving_pooling", None)
    tasks = tuple(getattr(handler, "supported_tasks", None) or (runner,))
    return runner, tasks


def init_logger(name: str):
    """A logger under vLLM's ``vllm.`` hierarchy: vLLM only attaches handlers there, so a
    plugin logger named ``vllm_unified.*`` would print nothing."""
    return _vllm_init_logger(f"vllm.{name}" if not name.startswith("vllm.") else name)


__all__ = [  # the lazy names resolve through __getattr__
    "Platform",
    "PlatformEnum",
    "SAMPLING_EPS",
    "elastic_ep_unavailable",
    "has_vllm_config_class",
    "init_logger",
    "kind_routes",
    "sampling_fields",
    "served_tasks",
    "structured_decisions_unavailable",
    "vllm_cli_main",
    "vllm_environment_variables",
    *_LAZY,
]
