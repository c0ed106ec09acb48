"""End to end through vLLM's offline ``LLM``: known output, differential tests against vLLM's
native CPU backend (fp32), one forward per step, chunked prefill, in-place KV writes.

Each engine runs in its own process (``tests/llm_harness.py``); the native backend is the same
environment with our plugin excluded (``VLLM_PLUGINS=none``). The default model's greedy and
seeded cases share one engine (one ``generate`` call each).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import run_llm

pytestmark = pytest.mark.engine

PARIS = " Paris.\n\nThe answer is: 2"
PARIS_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34]


def _engine(**kw):
    base = {"max_model_len": 1024, "kv_cache_memory_bytes": 256 * 2**20, "seed": 0}
    base.update(kw)
    return base


def _native_engine(**kw):
    # vLLM's CPU backend in fp32 (its bf16 is not a reliable reference), eager to skip a long
    # torch.compile.
    base = {"max_model_len": 1024, "dtype": "float32", "enforce_eager": True,
            "kv_cache_memory_bytes": 512 * 2**20, "seed": 0}
    base.update(kw)
    return base


def _greedy(n: int, logprobs: int | None = None) -> dict:
    p = {"temperature": 0.0, "max_tokens": n, "ignore_eos": True}
    if logprobs is not None:
        p["logprobs"] = logprobs
    return p


PARIS_REQUEST = {"prompt": "The capital of France is",
                 "params": {"temperature": 0.0, "max_tokens": 10}}
POEM = "Write a short poem about the sea."
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "max_tokens": 12, "seed": 1234}


@pytest.fixture(scope="module")
def default_model_batches(default_model, tmp_path_factory) -> list[list[dict]]:
    """One engine of the default model (``max_model_len`` 512) generating, one call after
    another: the Paris prompt greedy; the seeded poem alone; the seeded poem among 7 unseeded
    requests, then again with another seed. Each call's outputs, in order."""
    others = [{"prompt": f"Tell me about topic number {i}.",
               "params": {"temperature": 1.0, "max_tokens": 12}} for i in range(7)]
    batched = [*others[:3], {"prompt": POEM, "params": SEEDED}, *others[3:],
               {"prompt": POEM, "params": {**SEEDED, "seed": 99}}]
    out = run_llm({"model": default_model, "engine": _engine(max_model_len=512),
                   "batches": [[PARIS_REQUEST], [{"prompt": POEM, "params": SEEDED}], batched],
                   "rpc": ["runner_stats"]}, tmp_path_factory.mktemp("default-model"))
    assert out["platform"] == "vllm_unified.platform.MLXPlatform"
    return out["batches"]


def test_default_model_known_output(default_model_batches):
    completion = default_model_batches[0][0]["completions"][0]
    assert completion["text"] == PARIS
    assert completion["token_ids"] == PARIS_IDS


# slow: the ci tier compares the default model with vLLM's CPU backend in
# tests/test_lora.py::test_adapter_over_quantized_default_model (its base request, one engine
# for both)
@pytest.mark.slow
def test_default_model_matches_native_backend(default_model_batches, default_model_reference,
                                              tmp_path):
    """Same weights (the GGUF dequantized by transformers into fp32 safetensors for the native
    backend, dequantized by MLX for ours), same prompt, identical greedy token ids."""
    request = {"prompt": "The capital of France is", "params": _greedy(10)}
    ref = run_llm({"model": default_model_reference, "engine": _native_engine(max_model_len=512),
                   "requests": [request]}, tmp_path, native=True)
    assert ref["platform"] == "vllm.platforms.cpu.CpuPlatform"
    assert default_model_batches[0][0]["completions"][0]["token_ids"] == PARIS_IDS
    assert ref["outputs"][0]["completions"][0]["token_ids"] == PARIS_IDS


def _prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths[:n]]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.mark.slow  # the CI tier compares with vLLM's CPU backend on the default model and phi3
def test_differential_tiny_llama(tiny_llama, tmp_path):
    """16 prompts of 8..700 tokens, 32 greedy tokens each: identical token ids to vLLM's native
    CPU backend, except where the reference's top-2 logit gap at the diverging step is < 1e-4."""
    lengths = [8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 700, 16, 17, 31, 64, 500]
    prompts = _prompts(16, lengths, vocab=49152, seed=1)
    requests = [{"prompt_token_ids": p, "params": _greedy(32)} for p in prompts]
    ref_requests = [{"prompt_token_ids": p, "params": _greedy(32, logprobs=2)} for p in prompts]
    ours = run_llm({"model": tiny_llama, "engine": _engine(dtype="float32"),
                    "requests": requests, "rpc": ["runner_stats"]}, tmp_path)
    ref = run_llm({"model": tiny_llama, "engine": _native_engine(), "requests": ref_requests},
                  tmp_path, native=True)
    exact = 0
    for i, (o, r) in enumerate(zip(ours["outputs"], ref["outputs"], strict=True)):
        got, want = o["completions"][0]["token_ids"], r["completions"][0]["token_ids"]
        step = _first_divergence(got, want)
        if step is None:
            exact += 1
            continue
        top2 = r["completions"][0]["logprobs"][step]
        gap = top2[0][1] - top2[1][1]
        assert gap < 1e-4, (
            f"prompt {i} (len {lengths[i]}) diverges at step {step}: ours {got[step]}, "
            f"reference {want[step]} with top-2 gap {gap:.3g}"
        )
    assert exact >= 14, f"only {exact}/16 prompts identical"
    stats = ours["rpc_after"]["runner_stats"]
    # Continuous batching: all 16 decode together, one forward per non-empty step.
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == 16
    assert stats["forwards"] == stats["steps"] - stats["empty_steps"]


# slow: chunked prefill equals one step in test_e2e_families.py (16-token chunks against
# mlx-lm) and test_server.py; in-place KV writes in test_kv_in_place.py
@pytest.mark.slow
def test_chunked_prefill_and_in_place_kv_writes(default_model, tmp_path):
    """A ~1,500-token prompt chunked at 256 tokens gives the same greedy output as one 2,048-token
    step; the KV pool's buffers never move (writes are in place)."""
    words = ("The quick brown fox jumps over the lazy dog while the curious cat watches "
             "from the warm windowsill and counts the passing clouds. ")
    prompt = words * 60
    request = {"prompt": prompt, "params": {"temperature": 0.0, "max_tokens": 16}}
    outs = {}
    for budget in (256, 2048):
        spec = {"model": default_model,
                "engine": _engine(max_model_len=2048, max_num_batched_tokens=budget,
                                  enable_prefix_caching=False),
                "requests": [request], "rpc": ["kv_pool_data_ptrs", "runner_stats"]}
        outs[budget] = run_llm(spec, tmp_path)
        before, after = (outs[budget]["rpc_before"]["kv_pool_data_ptrs"],
                         outs[budget]["rpc_after"]["kv_pool_data_ptrs"])
        assert before == after, "a KV write reallocated the pool"
    n_prompt = len(outs[256]["outputs"][0]["prompt_token_ids"])
    assert 1300 <= n_prompt <= 1700
    chunked = outs[256]["rpc_after"]["runner_stats"]
    assert chunked["forwards"] >= 16 + n_prompt // 256  # really chunked
    assert (outs[256]["outputs"][0]["completions"][0]["token_ids"]
            == outs[2048]["outputs"][0]["completions"][0]["token_ids"])


def test_seeded_sampling_is_reproducible_and_batch_invariant(default_model_batches):
    _, alone, batched = default_model_batches
    a = alone[0]["completions"][0]["token_ids"]
    b = batched[3]["completions"][0]["token_ids"]
    c = batched[-1]["completions"][0]["token_ids"]
    assert a == b
    assert a != c
    assert len(np.unique([str(o["completions"][0]["token_ids"]) for o in batched])) > 1


def test_preemption_and_resume_do_not_change_outputs(tiny_llama, tmp_path):
    """With too few KV blocks for all requests, vLLM preempts and later resumes some; the
    runner must pick them up from the scheduler's token list and produce the same tokens."""
    prompts = _prompts(8, [60] * 8, vocab=49152, seed=5)
    requests = [{"prompt_token_ids": p, "params": _greedy(48)} for p in prompts]
    ample = run_llm({"model": tiny_llama, "engine": _engine(dtype="float32", max_model_len=128),
                     "requests": requests}, tmp_path)
    tight = run_llm({"model": tiny_llama,
                     "engine": {**_engine(dtype="float32", max_model_len=128),
                                "num_gpu_blocks_override": 16},
                     "requests": requests, "rpc": ["runner_stats"]}, tmp_path)
    stats = tight["rpc_after"]["runner_stats"]
    assert stats["resumed"] > 0, "no request was preempted: the test did not exercise resume"
    assert stats["live_requests"] == 0, "finished requests left state behind"
    for a, b in zip(ample["outputs"], tight["outputs"], strict=True):
        assert a["completions"][0]["token_ids"] == b["completions"][0]["token_ids"]
