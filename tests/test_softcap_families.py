"""Gemma 2 (attention logit soft-capping computed by the module itself, adapted in
models/attention_adapters.py; final-logit soft-capping in its head; sliding windows from the
config) served through vLLM on our platform: greedy ids equal to mlx-lm's own generation on the
same weights, and to vLLM's own CPU backend in fp32.

mlx-lm's Gemma 2 applies no sliding window, so it is the reference only for a checkpoint whose
window is wider than every sequence (``gemma2_wide``); the windowed one (window 8) is compared
with vLLM's CPU backend, which applies it."""

from __future__ import annotations

import pytest
from conftest import run_llm
from tiny_models import make_tiny_checkpoint, mlx_lm_greedy

pytestmark = pytest.mark.engine

NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 20, 37, 50)


def _prompts() -> list[list[int]]:
    return [[(11 * i + 17 * j) % 40000 + 100 for j in range(n)]
            for i, n in enumerate(PROMPT_LENGTHS)]


def _spec(folder: str, prompts: list[list[int]]) -> dict:
    """Two rounds in one engine (the second hits the prefix cache), 16-token chunks, four
    requests sharing steps."""
    requests = [{"prompt_token_ids": p,
                 "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}}
                for p in prompts]
    return {"model": folder,
            "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
                       "kv_cache_memory_bytes": 64 * 2**20, "seed": 0,
                       "enable_prefix_caching": True},
            "batches": [requests, requests]}


def _ids(out: dict) -> list[list[int]]:
    return [o["completions"][0]["token_ids"] for o in out["outputs"]]


def test_gemma2_matches_mlx_lm(tmp_path):
    folder = str(make_tiny_checkpoint(tmp_path / "g2", "gemma2_wide"))
    prompts = _prompts()
    ours = _ids(run_llm(_spec(folder, prompts), tmp_path))
    expected = [mlx_lm_greedy(folder, p, NEW_TOKENS) for p in prompts]
    assert ours == expected + expected  # both rounds


@pytest.mark.slow
def test_gemma2_windows_match_vllm_cpu(tmp_path):
    folder = str(make_tiny_checkpoint(tmp_path / "g2w", "gemma2"))
    spec = _spec(folder, _prompts())
    assert _ids(run_llm(spec, tmp_path)) == _ids(run_llm(spec, tmp_path, native=True))
