"""Unified memory end to end: the KV arrays attention uses are vLLM's torch views (no hidden
copy), the pool costs resident memory only as blocks are written, and an impossible budget
fails at start-up naming the flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import default_model_path, run_llm

pytestmark = pytest.mark.engine

GIB = 2**30


def test_attention_arrays_are_vllms_torch_views(tiny_llama, tmp_path):
    spec = {
        "model": tiny_llama,
        "engine": {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20},
        "requests": [{"prompt_token_ids": list(range(100, 180)),
                      "params": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}}],
        "rpc": ["kv_pool_data_ptrs", "kv_torch_view_ptrs"],
    }
    out = run_llm(spec, tmp_path)
    before, after = out["rpc_before"], out["rpc_after"]
    assert before["kv_torch_view_ptrs"], "the pool is not backed by vLLM's torch views"
    assert before["kv_pool_data_ptrs"] == before["kv_torch_view_ptrs"]
    assert after["kv_pool_data_ptrs"] == after["kv_torch_view_ptrs"] == before["kv_torch_view_ptrs"]
    assert len(out["outputs"][0]["completions"][0]["token_ids"]) == 12


def test_pool_is_paid_as_blocks_are_written(default_model, tmp_path):
    """A pool of >= 4 GiB adds < 5% of its size at start-up; a ~1,000-token request then adds
    roughly the bytes of the blocks it wrote (within 2x)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 100
    spec = {
        "model": default_model,
        "engine": {"max_model_len": 2048, "gpu_memory_utilization": 0.3, "seed": 0},
        "requests": [{"prompt": prompt, "params": {"temperature": 0.0, "max_tokens": 8}}],
        "rpc": ["memory_report"],
    }
    out = run_llm(spec, tmp_path)
    start, end = out["rpc_before"]["memory_report"], out["rpc_after"]["memory_report"]
    pool = start["kv_pool_bytes"]
    assert pool >= 4 * GIB
    startup = start["rss_after_kv_init"] - start["rss_after_load"]
    assert startup < 0.05 * pool, f"start-up committed {startup / 2**20:.0f} MiB of the pool"
    tokens = len(out["outputs"][0]["prompt_token_ids"]) + 8
    assert 900 <= tokens <= 1200
    blocks = -(-tokens // 16)
    written = blocks * 737_280  # SmolLM2 fp32: 2 x 16 x 3 x 64 x 4 bytes x 30 layers per block
    grown = end["rss"] - start["rss"]
    assert written / 2 <= grown <= 2 * written, (
        f"RSS grew {grown / 2**20:.1f} MiB for {blocks} blocks ({written / 2**20:.1f} MiB)"
    )


BLOCK_BYTES = 737_280  # SmolLM2 fp32 KV block: 2 x 16 x 3 x 64 x 4 bytes x 30 layers


# vLLM's order ("all", and the token cross-check of the two runs) in the slow tier
@pytest.mark.parametrize("retain", ["default", pytest.param("all", marks=pytest.mark.slow)])
def test_the_pool_commits_what_the_load_needs_not_what_the_prefix_cache_saw(
        default_model, tmp_path, monkeypatch, retain):
    """16 distinct ~300-token prompts, one at a time: with the default bound (max_model_len =
    512 tokens = 32 blocks) the blocks beyond it are evicted and their pages given back, so
    after the last request the pool holds the bound's 32 blocks (and the null block); vLLM's
    order (``all``) writes fresh blocks for every prompt and keeps them. The tokens are the
    same either way (checked against the other run's, kept in a file)."""
    if retain == "all":
        monkeypatch.setenv("VLLM_UNIFIED_PREFIX_CACHE_RETAIN", "all")
    else:
        monkeypatch.delenv("VLLM_UNIFIED_PREFIX_CACHE_RETAIN", raising=False)
    words = "river stone lamp orchard winter copper violin harbor meadow lantern".split()
    prompts = [" ".join(words[(i + j * 7) % 10] + str(i * 31 + j) for j in range(100))
               for i in range(16)]
    spec = {
        "model": default_model,
        "engine": {"max_model_len": 512, "max_num_seqs": 1, "seed": 0,
                   "kv_cache_memory_bytes": 1 * GIB},
        "requests": [{"prompt": p, "params": {"temperature": 0.0, "max_tokens": 4}}
                     for p in prompts],
        "rpc": ["memory_report"],
    }
    out = run_llm(spec, tmp_path)
    report = out["rpc_after"]["memory_report"]
    resident = report["kv_pool_resident_bytes"]
    blocks = [-(-(len(o["prompt_token_ids"]) + 4) // 16) for o in out["outputs"]]
    request_blocks = max(blocks)
    assert 15 <= request_blocks <= 32
    tokens = [o["completions"][0]["token_ids"] for o in out["outputs"]]
    reference = tmp_path.parent / "pool-commit-reference.json"
    if retain == "default":
        assert "prefix cache keeps at least 32 freed blocks (512 tokens" in out["log"]
        assert "the pages of blocks beyond it are given back to the OS" in out["log"]
        assert resident <= (32 + 2) * BLOCK_BYTES, (
            f"{resident / BLOCK_BYTES:.1f} blocks resident after the load")
    else:
        assert "prefix cache keeps every freed block" in out["log"]
        assert resident >= 0.95 * sum(blocks) * BLOCK_BYTES
    if reference.exists():
        assert json.loads(reference.read_text()) == tokens
    else:
        reference.write_text(json.dumps(tokens))


def test_impossible_budget_fails_at_start_naming_the_flags(tmp_path):
    vllm = Path(sys.executable).parent / "vllm"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    proc = subprocess.run(
        [str(vllm), "serve", default_model_path(), "--port", "8799", "--host", "127.0.0.1",
         "--gpu-memory-utilization", "0.01", "--max-model-len", "2048"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "--gpu-memory-utilization 0.01" in output and "--max-model-len 2048" in output
    assert "GiB in use (weights, runtime)" in output  # the arithmetic is shown
