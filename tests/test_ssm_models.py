"""Attention-free state-space models (Mamba, Mamba2, Falcon-Mamba) served through vLLM on our
platform: every layer is recurrent, vLLM's KV cache config holds state groups only, and the
step's block table lists each request's state slot.

Per family (a tiny random-weight checkpoint): greedy generation with chunked prefill and four
requests batched equals mlx-lm's own generation on the same weights and vLLM's own CPU backend
in fp32. Unit tests cover the config checks, the mixers' call conventions and the platform's
policy without an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import run_llm
from tiny_models import SSM_FAMILIES, make_tiny_checkpoint, mlx_lm_generate_step_ids

from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.layer_cache import StateLayerCache
from vllm_unified.kv.state_pages import StatePages, StateStore, build_state_metadata, state_fields
from vllm_unified.models.loader import load_model
from vllm_unified.models.routing import RecurrentMixer

NEW_TOKENS = 24
PROMPT_LENGTHS = (3, 20, 45, 70)
PROMPTS = [[(11 * i + 17 * j) % 40000 + 100 for j in range(n)]
           for i, n in enumerate(PROMPT_LENGTHS)]
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
# fp32, 16-token steps (the longer prompts prefill in several chunks and the four requests
# share steps), no prefix caching (vLLM's 'align' state mode is refused at start-up)
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
          "seed": 0, "enable_prefix_caching": False, "kv_cache_memory_bytes": 16 * 2**20}
#: the family whose engine runs in CI; the others in the slow tier
CI_FAMILY = "mamba2"
HARNESS = Path(__file__).resolve().parent / "hybrid_harness.py"


@pytest.fixture(scope="module", params=[
    f if f == CI_FAMILY else pytest.param(f, marks=pytest.mark.slow) for f in SSM_FAMILIES])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp(family), family))


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    """mlx-lm's own greedy generation (``generate_step``), one prompt at a time."""
    return mlx_lm_generate_step_ids(checkpoint, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def ours(checkpoint, tmp_path_factory) -> dict:
    spec = {"model": checkpoint, "engine": ENGINE,
            "requests": [{"prompt_token_ids": p, "params": {**GREEDY, "logprobs": 3}}
                         for p in PROMPTS],
            "rpc": ["runner_stats", "state_slots"]}
    return run_llm(spec, tmp_path_factory.mktemp("ours"))


@pytest.mark.engine
def test_greedy_equals_mlx_lm(ours, reference):
    """Four prompts (3-70 tokens) in 16-token chunks, batched: mlx-lm's tokens; one state slot
    per request; the start-up log names the attention-free layout."""
    got = [o["completions"][0]["token_ids"] for o in ours["outputs"]]
    for i, (mine, ref) in enumerate(zip(got, reference, strict=True)):
        assert mine == ref, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens)"
    assert len({tuple(r) for r in reference}) == len(PROMPTS)  # the model is not degenerate
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(PROMPTS)  # batched
    assert len(set(map(tuple, ours["rpc_after"]["state_slots"].values()))) == len(PROMPTS)
    assert "attention-free model: 3 recurrent layers on state pages" in ours["log"]


#: families vLLM's CPU backend serves: its Mamba (v1) mixer, also Falcon-Mamba's, fails in the
#: profiling forward ("Expected a.stride(-1) == 1": out_proj on a transposed input, which the
#: CPU's oneDNN GEMM refuses), so Mamba and Falcon-Mamba are compared with mlx-lm only
VLLM_CPU_FAMILIES = ("mamba2",)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("family", VLLM_CPU_FAMILIES, indirect=True)
def test_greedy_and_logprobs_equal_vllm_cpu_fp32(ours, checkpoint, tmp_path):
    """The same requests through vLLM's own CPU backend in fp32: the same tokens, every
    step's top-3 logprobs within 1e-3."""
    spec = {"model": checkpoint, "engine": ENGINE,
            "requests": [{"prompt_token_ids": p, "params": {**GREEDY, "logprobs": 3}}
                         for p in PROMPTS]}
    native = run_llm(spec, tmp_path, native=True)
    assert native["platform"] != ours["platform"]
    for i, (o, r) in enumerate(zip(ours["outputs"], native["outputs"], strict=True)):
        got, want = o["completions"][0], r["completions"][0]
        assert got["token_ids"] == want["token_ids"], f"prompt {i}"
        for step, (a, b) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
            assert [t for t, _, _ in a] == [t for t, _, _ in b], f"prompt {i} step {step}"
            np.testing.assert_allclose([lp for _, lp, _ in a], [lp for _, lp, _ in b],
                                       atol=1e-3, err_msg=f"prompt {i} step {step}")


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("family", [CI_FAMILY], indirect=True)
def test_reused_state_slots_do_not_leak(family, checkpoint, ours, reference, tmp_path):
    """A request aborted mid-decode and one run to the end, then the four prompts in a pool
    of three blocks (vLLM's null block and two state slots: requests wait for a free slot):
    the tokens are a fresh server's, on slots phase 1 used."""
    long_prompt = [(11 * j) % 30000 + 500 for j in range(60)]
    # one block (all three layers' state pages) per running request, plus the null block
    page = 3 * (3 * (192 + 2 * 16) + 6 * 32 * 16) * 4
    engine = {**ENGINE, "kv_cache_memory_bytes": 3 * page}
    spec = {"model": checkpoint, "engine": engine, "phases": [
        {"abort": {"prompt_token_ids": long_prompt, "params": GREEDY, "steps": 8}},
        {"generate": [{"prompt_token_ids": long_prompt[:37], "params": GREEDY}]},
        {"rpc": "state_slots"},
        {"generate": [{"prompt_token_ids": p, "params": GREEDY} for p in PROMPTS]},
        {"rpc": "state_slots"},
    ]}
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    proc = subprocess.run([sys.executable, str(HARNESS), str(spec_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    aborted, _, first, later, after = json.loads(out_path.read_text())["phases"]
    assert 0 < len(aborted) < NEW_TOKENS  # really aborted mid-generation
    assert later == reference
    old = {s for slots in first.values() for s in slots}
    new = {s for k, slots in after.items() if k not in first for s in slots}
    assert old & new, f"no state slot reused ({old}, {new}): test is void"


# ------------------------------------------------------------------------------- unit tests


def test_layout_is_all_recurrent(tmp_path):
    """Every cache slot of an attention-free model is a recurrent slot on state pages."""
    from vllm_unified.models.capability import route_model

    for family in SSM_FAMILIES:
        folder = make_tiny_checkpoint(tmp_path, family)
        loaded = load_model(folder, hf_config=None, dtype=mx.float32, keep_quantized=False)
        layout, _ = route_model(loaded.model, loaded.config, kv_shape=None,
                                config_window=None)
        assert (layout.recurrent, layout.attention) == ([0, 1, 2], {}), family


@pytest.mark.parametrize("family", SSM_FAMILIES)
def test_mlx_lm_forward_equals_transformers(family, tmp_path):
    """mlx-lm's model from the laid-out config gives transformers' own logits on the same
    tiny checkpoint: the check of the config mapping where vLLM's CPU backend cannot serve
    the family (Mamba, Falcon-Mamba)."""
    import transformers
    from mlx_lm.models.cache import make_prompt_cache

    folder = make_tiny_checkpoint(tmp_path, family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[2]])).logits[0].numpy()
    model = load_model(str(folder), hf_config=None, dtype=mx.float32,
                       keep_quantized=False).model
    got = np.array(model(mx.array([PROMPTS[2]]), cache=make_prompt_cache(model))[0])
    np.testing.assert_allclose(got, want, atol=2e-5 * float(np.abs(want).max()))


def test_mamba_config_fixups():
    """Transformers' Mamba2 config gets mlx-lm's intermediate_size; what mlx-lm's modules
    would compute differently from vLLM is refused."""
    from vllm_unified.models.config import mlx_lm_config

    cfg = mlx_lm_config({"model_type": "mamba2", "hidden_size": 96, "expand": 2,
                         "n_groups": 1})
    assert cfg["intermediate_size"] == 192
    for model_type, bad, match in [
        ("mamba2", {"n_groups": 8}, "n_groups=8"),
        ("mamba2", {"norm_before_gate": True}, "norm_before_gate"),
        ("mamba", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("falcon_mamba", {"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ]:
        with pytest.raises(ValueError, match=f"{model_type}: {match}"):
            mlx_lm_config({"model_type": model_type, "hidden_size": 96, "n_groups": 1, **bad})


class _TwoArgMixer:
    """mlx-lm's Mamba call convention ``mixer(x, cache)``; stores states only into an
    ``ArraysCache`` (as mlx-lm's Mamba does): running sum and last input."""

    def __call__(self, x, cache):
        from mlx_lm.models.cache import ArraysCache

        b, s, d = x.shape
        state = cache[1] if cache[1] is not None else mx.zeros((b, d))
        outs = []
        for t in range(s):
            state = state + x[:, t]
            outs.append(state)
        if isinstance(cache, ArraysCache):
            cache[0] = x[:, -1:]
            cache[1] = state
        return mx.stack(outs, axis=1)


class _KeywordMixer(_TwoArgMixer):
    """PLaMo 2's convention: ``mixer(hidden_states=..., mask=..., cache=...)``."""

    def __call__(self, hidden_states, mask=None, cache=None):
        return super().__call__(hidden_states, cache)


class _NoCacheMixer:
    def __call__(self, x, mask):
        return x


@pytest.mark.parametrize("inner, call", [
    (_TwoArgMixer(), lambda m, x, c: m(x, c)),
    (_KeywordMixer(), lambda m, x, c: m(hidden_states=x, mask=None, cache=c)),
])
def test_recurrent_adapter_call_conventions(inner, call):
    """The adapter takes the layer's call as the mixer's own signature has it, and the
    mixer's new states reach the pages (the segment cache is an ``ArraysCache``)."""
    d = 4
    fields = state_fields([(1, d), (d,)], [torch.float32, torch.float32])
    pages = StatePages.allocate_mlx(4, 64, fields)
    store = StateStore({0: pages}, {0: 0})
    mixer = RecurrentMixer(inner)
    qlens, slens = np.array([1, 2]), np.array([1, 2])  # a decode at 0, a chunk at 0
    ctx = StepContext(
        attn=build_attention_metadata(qlens, slens, np.zeros((2, 1), np.int32), 256),
        state=build_state_metadata(qlens, slens, {0: np.array([1, 3])}))
    x = mx.arange(3 * d, dtype=mx.float32).reshape(3, 1, d)
    with set_step_context(ctx):
        out = call(mixer, x, StateLayerCache(store, 0))
    mx.eval(out, pages.pages)
    xs = np.array(x)[:, 0]
    np.testing.assert_array_equal(np.array(out)[:, 0], [xs[0], xs[1], xs[1] + xs[2]])
    conv, total = pages.read(mx.array([1, 3], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(total), [xs[0], xs[1] + xs[2]])
    np.testing.assert_array_equal(np.array(conv)[:, 0], [xs[0], xs[2]])
    with pytest.raises(TypeError, match="takes its input and .cache."):
        RecurrentMixer(_NoCacheMixer())


def test_attention_free_policy():
    """An attention-free model is a state-keeping one: vLLM's hybrid KV-cache manager stays
    vLLM's to decide, and prefix caching ('align' mode) is refused by name."""
    from vllm_unified.platform import _hybrid_policy, keeps_state

    config = SimpleNamespace(
        model_config=SimpleNamespace(is_hybrid=False, is_attention_free=True,
                                     architecture="MambaForCausalLM"),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=None),
        cache_config=SimpleNamespace(enable_prefix_caching=True, mamba_block_size=256))
    assert keeps_state(config.model_config)
    with pytest.raises(ValueError, match="--enable-prefix-caching: MambaForCausalLM is an "
                                         "attention-free state-space model"):
        _hybrid_policy(config)
    config.cache_config.enable_prefix_caching = False
    assert _hybrid_policy(config) is True
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is None


def test_split_groups_without_attention():
    from vllm_unified.worker.input_batch import split_groups

    assert split_groups(([5], [7]), None) == ([], {0: [5], 1: [7]})
    assert split_groups(([5], [7]), 1) == ([7], {0: [5]})


def test_plamo2_layers_route_to_pages(tmp_path):
    """PLaMo 2 (mlx-lm only: vLLM 0.32 dropped its class): Mamba layers on state pages at the
    even slots, attention at the odd ones, routed to the paged attention by its adapter
    (mlx-lm calls ``mx.fast.scaled_dot_product_attention`` itself; the probe refuses a slot
    that does not attend through the route, and checks the logits are mlx-lm's)."""
    from model_matrix import build_checkpoint

    from vllm_unified.models.capability import route_model
    from vllm_unified.models.registration import register_mlx_lm_types

    register_mlx_lm_types()  # transformers has no PLaMo 2 config: the plugin's stands in
    result = build_checkpoint("plamo2", tmp_path)
    assert result.built, result.build_error
    loaded = load_model(str(tmp_path / "plamo2"), hf_config=None, dtype=mx.float32,
                        keep_quantized=False)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)
    assert layout.recurrent == [0, 2]
    assert {i: (a.num_kv_heads, a.head_dim) for i, a in layout.attention.items()} == {
        1: (1, 32), 3: (1, 32)}


def test_plamo2_config_fixups():
    from vllm_unified.models.config import mlx_lm_config

    base = {"model_type": "plamo2", "max_position_embeddings": 2048}
    assert mlx_lm_config({**base, "attention_window_size": 2048})
    for bad, match in [({"attention_window_size": 512}, "attention_window_size=512"),
                       ({"rope_theta": 500000}, "rope_theta=500000")]:
        with pytest.raises(ValueError, match=f"plamo2: {match}"):
            mlx_lm_config({**base, **bad})
