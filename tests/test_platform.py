"""The plugin registers as vLLM's platform, reports unified memory, and rejects what it cannot
serve with errors that name the flag or field."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

PROBE = (
    "from vllm.platforms import current_platform as p; "
    "print(type(p).__module__ + '.' + type(p).__name__)"
)


def _platform_in_subprocess(**env: str) -> str:
    full_env = {**os.environ, **env}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full_env, capture_output=True, text=True, timeout=300,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_entry_point_resolves_to_our_platform():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "vllm_unified.platform.MLXPlatform"


def test_excluding_plugin_gives_native_cpu_backend():
    assert _platform_in_subprocess(VLLM_PLUGINS="none") == "vllm.platforms.cpu.CpuPlatform"


def test_unified_memory_facts():
    from vllm_unified.backend import detect_backend
    from vllm_unified.platform import MLXPlatform

    kind = "metal" if sys.platform == "darwin" else "cpu"  # mlx (mlx-metal) / mlx[cpu]
    info = detect_backend()
    assert info.kind == kind and info.unified
    assert MLXPlatform.get_device_total_memory() == psutil.virtual_memory().total
    assert MLXPlatform.is_pin_memory_available() is False
    assert MLXPlatform.get_device_name() == f"mlx-{kind}"


def test_device_override_rejects_unknown(monkeypatch):
    from vllm_unified import backend

    backend.detect_backend.cache_clear()
    monkeypatch.setenv(backend.DEVICE_ENV, "tpu")
    try:
        with pytest.raises(ValueError, match="VLLM_UNIFIED_DEVICE"):
            backend.detect_backend()
        # A forced backend whose MLX wheel is missing: mlx-metal on Linux, mlx-cuda on a Mac.
        missing, wheel = ("cuda", r"mlx\[cuda13\]") if sys.platform == "darwin" else (
            "metal", "mlx-metal")
        monkeypatch.setenv(backend.DEVICE_ENV, missing)
        with pytest.raises(ValueError, match=wheel):
            backend.detect_backend()
    finally:
        backend.detect_backend.cache_clear()


def _engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, max_model_len=256, **kwargs).create_engine_config()


def test_config_policy(default_model):
    cfg = _engine_config(default_model)
    assert cfg.parallel_config.worker_cls == "vllm_unified.worker.worker.MLXWorker"
    assert cfg.cache_config.block_size == 16
    assert cfg.model_config.enforce_eager
    assert str(cfg.model_config.dtype) == "torch.float32"  # auto -> fp32 on MLX's CPU backend
    # idempotent: vLLM calls the hook again in the engine core
    from vllm_unified.platform import MLXPlatform

    MLXPlatform.check_and_update_config(cfg)
    assert cfg.parallel_config.worker_cls == "vllm_unified.worker.worker.MLXWorker"


def test_async_scheduling_kept_only_with_the_uni_executor(default_model):
    """The runner's output futures are collected on the stepping thread: uni-process only."""
    assert _engine_config(default_model).scheduler_config.async_scheduling
    cfg = _engine_config(default_model, distributed_executor_backend="mp")
    assert not cfg.scheduler_config.async_scheduling
    cfg = _engine_config(default_model, async_scheduling=False)
    assert not cfg.scheduler_config.async_scheduling


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tensor_parallel_size": 3}, "--tensor-parallel-size"),
        ({"block_size": 24}, "--block-size"),
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype"),
    ],
)
def test_config_rejections_name_the_flag(default_model, kwargs, flag):
    with pytest.raises(Exception, match=flag):
        _engine_config(default_model, **kwargs)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"extra_args": {"my_processor": 1}}, "extra_args"),
        ({"thinking_token_budget": 16}, "thinking_token_budget"),
        ({"logprob_token_ids": [3, 4]}, "logprob_token_ids"),
    ],
)
def test_unsupported_sampling_rejected_with_field(params, field):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from vllm_unified.platform import MLXPlatform

    with pytest.raises(VLLMValidationError) as err:
        MLXPlatform.validate_request({"prompt_token_ids": [1, 2]}, SamplingParams(**params))
    assert err.value.parameter == field
    assert field in str(err.value)


def test_supported_sampling_accepted():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from vllm_unified.platform import MLXPlatform

    for params in (
        {"temperature": 0},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3, "n": 2,
         "stop": ["."], "stop_token_ids": [5], "ignore_eos": True, "max_tokens": 7},
        {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
        {"logprobs": 2, "prompt_logprobs": 1},
        {"logit_bias": {1: 2.0}, "allowed_token_ids": [1, 2, 3], "bad_words": ["no"],
         "min_tokens": 3},
        {"structured_outputs": StructuredOutputsParams(choice=["a", "b"])},
    ):
        MLXPlatform.validate_request({"prompt_token_ids": [1, 2]}, SamplingParams(**params))
