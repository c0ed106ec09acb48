"""The one place that imports vLLM internals (vLLM 0.32.x, model runner V1 message format).

Everything else in the package imports vLLM names from here, so a vLLM bump is checked and
mended in one file. Public, stable vLLM API (``vllm.LLM``, ``SamplingParams``) may be imported
directly by tests and benchmarks.
"""

from __future__ import annotations

import importlib
from typing import Any

# Safe while vLLM is still resolving ``current_platform`` (the platform module needs them).
from vllm.logger import init_logger as _vllm_init_logger
from vllm.platforms.interface import Platform, PlatformEnum

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
    "CachedRequestData": "vllm.v1.core.sched.output",
    "NewRequestData": "vllm.v1.core.sched.output",
    "SchedulerOutput": "vllm.v1.core.sched.output",
    "FullAttentionSpec": "vllm.v1.kv_cache_interface",
    "KVCacheConfig": "vllm.v1.kv_cache_interface",
    "create_kv_cache_views": "vllm.v1.kv_cache_interface",
    "KVCacheLayout": "vllm.v1.kv_cache_layout",
    "KVCacheSpec": "vllm.v1.kv_cache_interface",
    "SlidingWindowSpec": "vllm.v1.kv_cache_interface",
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
    "SamplerOutput": "vllm.v1.outputs",
    "Sampler": "vllm.v1.sample.sampler",
    "SamplingMetadata": "vllm.v1.sample.metadata",
    "BUILTIN_LOGITS_PROCESSORS": "vllm.v1.sample.logits_processor",
    "BatchUpdate": "vllm.v1.sample.logits_processor",
    "LogitsProcessors": "vllm.v1.sample.logits_processor",
    "build_logitsprocs": "vllm.v1.sample.logits_processor",
    "apply_grammar_bitmask": "vllm.v1.structured_output.utils",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


#: vLLM version this compatibility layer was written and tested against.
VLLM_SERIES = "0.32"

#: Below this temperature vLLM samples greedily (``vllm/sampling_params.py: _SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


def vllm_environment_variables() -> set[str]:
    """Names of the environment variables vLLM knows (``vllm.envs``)."""
    from vllm import envs

    return set(envs.environment_variables)


def init_logger(name: str):
    """A logger under vLLM's ``vllm.`` hierarchy: vLLM only attaches handlers there, so a
    plugin logger named ``vllm_unified.*`` would be silent (spike pitfall P3)."""
    return _vllm_init_logger(f"vllm.{name}" if not name.startswith("vllm.") else name)


__all__ = [  # noqa: F822 (lazy names resolve through __getattr__)
    "create_kv_cache_views",
    "KVCacheLayout",
    "AttentionBackendEnum",
    "BUILTIN_LOGITS_PROCESSORS",
    "BatchUpdate",
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "GrammarOutput",
    "LogitsProcessors",
    "LogprobsLists",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_grammar_bitmask",
    "build_logitsprocs",
    "SAMPLING_EPS",
    "VLLM_SERIES",
    "CachedRequestData",
    "CompilationMode",
    "CompilationTimes",
    "CUDAGraphMode",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheSpec",
    "ModelRunnerOutput",
    "NewRequestData",
    "Platform",
    "PlatformEnum",
    "SamplingParams",
    "SamplingType",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "VLLMValidationError",
    "VllmConfig",
    "WorkerBase",
    "init_logger",
]
