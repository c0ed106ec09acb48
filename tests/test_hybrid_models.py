"""Hybrid attention + state-space models served through vLLM on our platform.

Per family (a tiny random-weight checkpoint): greedy generation with chunked prefill and four
requests batched equals mlx-lm's own ``generate_step`` on the same weights; vLLM's attention block
size is larger than the MLX kernel block size (the translation runs) and is logged; a request
that finished or was aborted leaves nothing in the state slot the next request reuses. Unit
tests cover the state pages and the recurrent-layer adapter directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from conftest import run_llm
from tiny_models import HYBRID_FAMILIES, make_tiny_checkpoint, mlx_lm_generate_step_ids

from vllm_unified import bridge
from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.layer_cache import StateLayerCache
from vllm_unified.kv.state_pages import StatePages, StateStore, build_state_metadata, state_fields
from vllm_unified.models.loader import load_model
from vllm_unified.models.routing import RecurrentMixer

NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 20, 45, 70)
PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
           for i, n in enumerate(PROMPT_LENGTHS)]
GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
# fp32, a 16-token step budget (the longer prompts prefill in several chunks, and the four
# requests share steps), a pool of 32 blocks (so freed state slots are soon reused), no prefix
# caching (hybrid prefix caching is refused at start-up).
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
          "seed": 0, "enable_prefix_caching": False}
HARNESS = Path(__file__).resolve().parent / "hybrid_harness.py"


#: bytes of one page of each family's tiny model (one attention page of vLLM's aligned block
#: size over the attention layers = one padded state page)
PAGE_BYTES = {"qwen3_next": 24576, "granitemoehybrid": 24576, "lfm2": 8192, "qwen3_5": 32768,
              "nemotron_h": 12288, "falcon_h1": 24576}
#: pages that hold two of the leak test's requests but not four (vLLM then preempts): per
#: request one block per state group plus its attention blocks, and vLLM's null block
LEAK_TEST_PAGES = {"qwen3_next": 13, "granitemoehybrid": 13, "lfm2": 17, "qwen3_5": 10,
                   "nemotron_h": 13, "falcon_h1": 9}
#: families whose engine runs in CI (one engine each); the others, and every family's second
#: engine (the leak test) except qwen3_next's, run in the slow tier
CI_FAMILIES = ("qwen3_next", "qwen3_5", "falcon_h1")
#: families whose tiny model's attention block (vLLM's alignment to the state page) is larger
#: than the MLX kernel block: 48-token blocks read as 3 x 16 (LFM2's is 16 tokens, Qwen3.5's 64:
#: both one kernel block)
TRANSLATED = ("qwen3_next", "granitemoehybrid", "nemotron_h")
STUBS = Path(__file__).resolve().parent / "stubs"


def _engine(family: str) -> dict:
    return {**ENGINE, "kv_cache_memory_bytes": 32 * PAGE_BYTES[family]}


def _engine_env(family: str) -> dict[str, str]:
    """Variables a vLLM engine of ``family`` needs here: vLLM's Qwen3.5 module imports
    torchvision (tests/stubs/torchvision stands in where it is not installed)."""
    if family != "qwen3_5" or importlib.util.find_spec("torchvision") is not None:
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(STUBS),
                                                        os.environ.get("PYTHONPATH")]))}


def _params(ci: tuple[str, ...]) -> list:
    return [f if f in ci else pytest.param(f, marks=pytest.mark.slow) for f in HYBRID_FAMILIES]


@pytest.fixture(scope="module", params=_params(CI_FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp(family), family))


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    """mlx-lm's own greedy generation, one prompt at a time, with its own caches."""
    return mlx_lm_generate_step_ids(checkpoint, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def fresh(family, checkpoint, tmp_path_factory) -> dict:
    spec = {"model": checkpoint, "engine": _engine(family),
            "requests": [{"prompt_token_ids": p, "params": GREEDY} for p in PROMPTS],
            "rpc": ["runner_stats", "state_slots"]}
    return run_llm(spec, tmp_path_factory.mktemp("fresh"), env=_engine_env(family))


@pytest.mark.engine
def test_greedy_equals_mlx_lm(fresh, reference):
    got = [o["completions"][0]["token_ids"] for o in fresh["outputs"]]
    for i, (ours, ref) in enumerate(zip(got, reference, strict=True)):
        assert ours == ref, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens)"
    stats = fresh["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(PROMPTS)  # batched
    assert len(set(map(tuple, fresh["rpc_after"]["state_slots"].values()))) == len(PROMPTS)


@pytest.mark.engine
def test_attention_block_size_is_translated_and_logged(family, fresh):
    """Where vLLM inflates the attention block to fit the state page beyond a kernel block
    (:data:`TRANSLATED`), the kernel reads it as several kernel blocks; elsewhere as one."""
    pool = re.search(r"KV pool \d+ blocks x (\d+) tokens \(read as (\d+)-token kernel blocks\)",
                     fresh["log"])
    assert pool, "start-up log lacks the KV pool line"
    m = re.search(r"attention block size (\d+) tokens .*MLX kernel block size (\d+): each "
                  r"block is viewed as (\d+) kernel blocks", fresh["log"])
    assert m, "start-up log lacks the block-size translation line"
    block, kernel, ratio = map(int, m.groups())
    assert (int(pool[1]), int(pool[2])) == (block, kernel)
    if family in TRANSLATED:
        assert block > kernel and block == kernel * ratio
    else:
        assert block == kernel and ratio == 1


@pytest.mark.engine
@pytest.mark.parametrize("family", _params(("qwen3_next",)), indirect=True)
def test_finished_aborted_and_preempted_state_does_not_leak(family, checkpoint, fresh,
                                                             reference, tmp_path):
    """Phase 1: a request runs to the end, another is aborted mid-decode; phase 2: the four
    prompts, whose state slots include phase 1's, give a fresh server's tokens. The pool is
    too small for the four at once, so vLLM also preempts some (freeing their state blocks)
    and resumes them by recomputation."""
    long_prompt = [(11 * j) % 30000 + 500 for j in range(60)]
    # e.g. qwen3_next: a request needs one block per state group (3) plus up to 3 attention
    # blocks of 48 tokens: 13 blocks hold two requests, not four
    engine = {**ENGINE, "max_model_len": 128,
              "kv_cache_memory_bytes": LEAK_TEST_PAGES[family] * PAGE_BYTES[family]}
    spec = {"model": checkpoint, "engine": engine, "phases": [
        {"abort": {"prompt_token_ids": long_prompt, "params": GREEDY, "steps": 8}},
        {"generate": [{"prompt_token_ids": long_prompt[:37], "params": GREEDY}]},
        {"rpc": "state_slots"},
        {"generate": [{"prompt_token_ids": p, "params": GREEDY} for p in PROMPTS]},
        {"rpc": "state_slots"},
        {"rpc": "runner_stats"},
    ]}
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(_engine_env(family))
    proc = subprocess.run([sys.executable, str(HARNESS), str(spec_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    aborted, _, first, later, after, stats = json.loads(out_path.read_text())["phases"]
    assert stats["resumed"] > 0, "nothing was preempted"
    assert 0 < len(aborted) < NEW_TOKENS  # really aborted mid-generation
    assert later == [o["completions"][0]["token_ids"] for o in fresh["outputs"]] == reference
    old = {tuple(v) for v in first.values()}
    new = [tuple(v) for k, v in after.items() if k not in first]
    assert len(first) == 2 and len(new) == len(PROMPTS)
    reused = {s for slots in new for s in slots} & {s for slots in old for s in slots}
    assert reused, f"no state slot was reused (phase 1 {old}, phase 2 {new}): test is void"


#: families vLLM's CPU backend serves in fp32 (its gated delta-net, qwen3_next / qwen3_5,
#: requires bf16 there: "CPU GDN attention requires BF16.")
VLLM_CPU_FAMILIES = ("lfm2", "nemotron_h", "falcon_h1")


@pytest.mark.slow
@pytest.mark.parametrize("family", VLLM_CPU_FAMILIES, indirect=True)
def test_greedy_and_logprobs_equal_vllm_cpu_fp32(family, checkpoint, tmp_path):
    """The same requests (with top-3 logprobs) through vLLM's own CPU backend in fp32: the
    same tokens as ours, every step's top-3 logprobs within 1e-3."""
    params = {**GREEDY, "logprobs": 3}
    spec = {"model": checkpoint, "engine": _engine(family),
            "requests": [{"prompt_token_ids": p, "params": params} for p in PROMPTS]}
    ours = run_llm(spec, tmp_path, env=_engine_env(family))
    native = run_llm({**spec, "engine": {**ENGINE, "kv_cache_memory_bytes": 64 * 2**20}},
                     tmp_path, native=True, env=_engine_env(family))
    assert native["platform"] != ours["platform"]
    for i, (o, r) in enumerate(zip(ours["outputs"], native["outputs"], strict=True)):
        got, want = o["completions"][0], r["completions"][0]
        assert got["token_ids"] == want["token_ids"], f"prompt {i}"
        for step, (a, b) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
            assert [t for t, _, _ in a] == [t for t, _, _ in b], f"prompt {i} step {step}"
            np.testing.assert_allclose([lp for _, lp, _ in a], [lp for _, lp, _ in b],
                                       atol=1e-3, err_msg=f"prompt {i} step {step}")


# ------------------------------------------------------------------------------- unit tests


def _pages_from_torch(num_blocks: int, fields, page: int):
    buf = torch.zeros(num_blocks * page, dtype=torch.int8)
    view = buf.view(num_blocks, page)[:, None, None, : fields[-1].offset + fields[-1].nbytes]
    return buf, StatePages.from_torch(view, fields, buf)


def test_state_pages_share_torch_memory():
    fields = state_fields([(3, 8), (2, 4, 4)], [torch.float32, torch.float32])
    buf, pages = _pages_from_torch(5, fields, 256)
    assert bridge.data_ptr(pages.pages) == buf.data_ptr()
    conv = mx.arange(2 * 24, dtype=mx.float32).reshape(2, 3, 8)
    ssm = -mx.arange(2 * 32, dtype=mx.float32).reshape(2, 2, 4, 4)
    pages.write(mx.array([3, 1], dtype=mx.int32), [conv, ssm])
    mx.eval(pages.pages)
    assert bridge.data_ptr(pages.pages) == buf.data_ptr()  # written in place
    rows = buf.view(5, 256)
    got = rows[3, :96].view(torch.float32).reshape(3, 8)
    np.testing.assert_array_equal(got.numpy(), np.array(conv[0]))
    got = rows[1, 96:224].view(torch.float32).reshape(2, 4, 4)
    np.testing.assert_array_equal(got.numpy(), np.array(ssm[1]))
    back = pages.read(mx.array([1, 3], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(back[0]), np.array(conv[::-1]))
    pages.zero([3])
    mx.eval(pages.pages)
    assert not rows[3].any() and rows[1].any()


def test_state_page_padding_must_fit():
    fields = state_fields([(3, 8)], [torch.float32])
    with pytest.raises(ValueError, match="state pages"):
        StatePages(mx.zeros((4, 64), dtype=mx.int8), fields, shared=False)


class _ToyMixer:
    """An mlx-lm style recurrent mixer: running sum state, conv state = last 2 inputs."""

    def __call__(self, x, mask, cache):
        b, s, d = x.shape
        state = cache[1] if cache[1] is not None else mx.zeros((b, d))
        conv = cache[0] if cache[0] is not None else mx.zeros((b, 2, d))
        outs = []
        for t in range(s):
            state = state + x[:, t]
            outs.append(state)
        cache[0] = mx.concatenate([conv, x], axis=1)[:, -2:]
        cache[1] = state
        return mx.stack(outs, axis=1)


def test_recurrent_adapter_segments_and_fresh_state():
    """Decode rows batched, prefill chunks alone, each with its slot's state; a sequence at
    position 0 ignores whatever its slot holds (a previous request's state)."""
    d = 4
    fields = state_fields([(2, d), (d,)], [torch.float32, torch.float32])
    pages = StatePages.allocate_mlx(6, 64, fields)
    garbage = mx.full((6, d), 1000.0)
    pages.write(mx.arange(6, dtype=mx.int32), [mx.zeros((6, 2, d)), garbage])
    store = StateStore({0: pages}, {0: 1})
    mixer = RecurrentMixer(_ToyMixer())
    # seq 0: decode at pos 5 (slot 2, has state), seq 1: chunk of 3 at pos 0 (slot 4, fresh),
    # seq 2: decode at pos 0 (slot 5, fresh)
    qlens, slens = np.array([1, 3, 1]), np.array([6, 3, 1])
    ctx = StepContext(
        attn=build_attention_metadata(qlens, slens, np.zeros((3, 1), np.int32), 16),
        state=build_state_metadata(qlens, slens, {1: np.array([2, 4, 5])}))
    x = mx.arange(5 * d, dtype=mx.float32).reshape(5, 1, d)
    with set_step_context(ctx):
        out = mixer(x, None, StateLayerCache(store, 0))
    mx.eval(out, pages.pages)
    xs = np.array(x)[:, 0]
    want = np.stack([1000 + xs[0], xs[1], xs[1] + xs[2], xs[1] + xs[2] + xs[3], xs[4]])
    np.testing.assert_array_equal(np.array(out)[:, 0], want)
    states = pages.read(mx.array([2, 4, 5], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(states[1]), want[[0, 3, 4]])
    np.testing.assert_array_equal(np.array(states[0])[1], xs[2:4])  # conv: last two inputs


def test_prefix_caching_for_hybrids_is_refused():
    from vllm_unified.platform import _hybrid_policy

    config = SimpleNamespace(
        model_config=SimpleNamespace(is_hybrid=True, architecture="Qwen3NextForCausalLM"),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=None),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
    )
    with pytest.raises(ValueError, match="--enable-prefix-caching: Qwen3NextForCausalLM"):
        _hybrid_policy(config)
    config.cache_config.enable_prefix_caching = False
    assert _hybrid_policy(config) is True
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is None  # vLLM: HMA on
    config.model_config.is_hybrid = False
    assert _hybrid_policy(config) is False
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True


def test_moe_in_low_precision_on_cpu_is_refused(tmp_path):
    """MLX's CPU gather_mm (MoE experts) is float32-only: refuse bf16 up front, naming
    --dtype, instead of failing in the first forward."""
    from vllm_unified.models.loader import check_dtype_supported

    folder = make_tiny_checkpoint(tmp_path, "qwen3_next")
    model = load_model(folder, hf_config=None, dtype=mx.bfloat16, keep_quantized=False).model
    with pytest.raises(ValueError, match="--dtype bfloat16: .*use --dtype float32"):
        check_dtype_supported(model, mx.bfloat16, "cpu")
    check_dtype_supported(model, mx.bfloat16, "metal")
    check_dtype_supported(model, mx.float32, "cpu")


def test_lfm2_config_fixups():
    """mlx-lm's LFM2 reads block_dim / block_ff_dim and always ties its head: transformers'
    names are mapped, and what mlx-lm would compute differently is refused."""
    from vllm_unified.models.config import mlx_lm_config

    base = {"model_type": "lfm2", "hidden_size": 160, "intermediate_size": 192,
            "num_attention_heads": 5, "layer_types": ["conv", "full_attention"],
            "tie_word_embeddings": True, "conv_dim": 160}
    cfg = mlx_lm_config(base)
    assert (cfg["block_dim"], cfg["block_ff_dim"]) == (160, 192)
    for bad, match in [({"tie_word_embeddings": False}, "untied LM head"),
                       ({"conv_dim": 128}, "conv_dim 128 != hidden_size"),
                       ({"block_ff_dim": 100}, "block_ff_dim 100 != intermediate_size"),
                       ({"layer_types": None}, "neither layer_types nor full_attn_idxs")]:
        with pytest.raises(ValueError, match=match):
            mlx_lm_config({**base, **bad})


def test_qwen3_5_config_fixups():
    """transformers' text-only ``qwen3_5_text`` is built as mlx-lm's ``qwen3_5``, whose layer
    kinds are periodic (every p-th layer full attention); other layouts are refused."""
    from vllm_unified.models.config import mlx_lm_config, model_classes

    kinds = ["linear_attention", "full_attention"] * 2
    cfg = mlx_lm_config({"model_type": "qwen3_5_text", "layer_types": kinds})
    assert (cfg["model_type"], cfg["full_attention_interval"]) == ("qwen3_5", 2)
    assert model_classes(cfg)[0].__module__ == "mlx_lm.models.qwen3_5"
    nested = mlx_lm_config({"model_type": "qwen3_5", "text_config": {"layer_types": kinds}})
    assert nested["text_config"]["full_attention_interval"] == 2
    with pytest.raises(ValueError, match="not 'every p-th layer is full attention'"):
        mlx_lm_config({"model_type": "qwen3_5_text",
                       "layer_types": ["full_attention", "linear_attention"]})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        mlx_lm_config({"model_type": "qwen3_5_text", "num_experts": 4, "layer_types": kinds})


@pytest.mark.parametrize("model_type, match", [
])
def test_unsupported_recurrent_families_are_refused_at_load(model_type, match):
    from vllm_unified.models.config import mlx_lm_config

    with pytest.raises(ValueError, match=f"{model_type}: .*{match}"):
        mlx_lm_config({"model_type": model_type})


def test_nemotron_h_config_fixups():
    from vllm_unified.models.config import mlx_lm_config

    base = {"model_type": "nemotron_h", "layers_block_type": ["mamba", "attention", "mlp"]}
    assert mlx_lm_config(base)["layers_block_type"] == base["layers_block_type"]
    for bad, match in [({"layers_block_type": ["mamba", "moe"]}, "mixture-of-experts"),
                       ({"hybrid_override_pattern": "M*E"}, "mixture-of-experts"),
                       ({"sliding_window": 64}, "sliding_window=64"),
                       ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'")]:
        with pytest.raises(ValueError, match=match):
            mlx_lm_config({**base, **bad})


def test_falcon_h1_config_fixups():
    """Falcon-H1's Mamba2 width from mamba_expand where the config leaves it out (as
    transformers and vLLM do); a per-group gated norm, a dt clip or an activation mlx-lm's
    module does not compute are refused."""
    from vllm_unified.models.config import mlx_lm_config

    base = {"model_type": "falcon_h1", "hidden_size": 96, "mamba_d_ssm": None,
            "mamba_expand": 2}
    assert mlx_lm_config(base)["mamba_d_ssm"] == 192
    for bad, match in [({"mamba_rms_norm": True, "mamba_n_groups": 2}, "not per group"),
                       ({"time_step_limit": [0.0, 10.0]}, "time_step_limit"),
                       ({"hidden_act": "gelu"}, "hidden_act 'gelu'")]:
        with pytest.raises(ValueError, match=match):
            mlx_lm_config({**base, **bad})


def test_recurrent_gemma_config_fixups():
    """What mlx-lm's RecurrentGemma hard-codes differently from the config is refused."""
    from vllm_unified.models.config import mlx_lm_config

    base = {"model_type": "recurrent_gemma", "hidden_size": 96, "num_attention_heads": 3,
            "num_key_value_heads": 1, "lru_width": 96,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5}}
    assert mlx_lm_config(base)["lru_width"] == 96
    for bad, match in [({"num_key_value_heads": 3}, "num_key_value_heads 3"),
                       ({"lru_width": 128}, "lru_width 128"),
                       ({"attention_bias": True}, "attention_bias"),
                       ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
                       ({"rope_parameters": {"rope_theta": 5e5, "partial_rotary_factor": 0.5}},
                        "rope_theta other than 10000"),
                       ({"rope_parameters": {"partial_rotary_factor": 1.0}},
                        "partial_rotary_factor other than 0.5")]:
        with pytest.raises(ValueError, match=match):
            mlx_lm_config({**base, **bad})


def test_layers_with_state_and_attention(tmp_path):
    """Falcon-H1's layers each hold mlx-lm's CacheList(ArraysCache, KVCache): every slot is
    both a recurrent slot (state pages) and an attention slot (KV pages), in that order."""
    from vllm_unified.models.capability import route_model

    folder = make_tiny_checkpoint(tmp_path, "falcon_h1")
    loaded = load_model(folder, hf_config=None, dtype=mx.float32, keep_quantized=False)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)
    assert layout.num_slots == 3 and layout.recurrent == [0, 1, 2]
    assert list(layout.attention) == [0, 1, 2]
    assert {(a.num_kv_heads, a.head_dim) for a in layout.attention.values()} == {(1, 32)}
    assert layout.cache_lists == dict.fromkeys(range(3), ("state", "attention"))
    assert all(isinstance(layer.mamba, RecurrentMixer) for layer in loaded.model.layers)


def test_cache_slots_skip_stateless_layers(tmp_path):
    """Nemotron-H's MLP-only blocks hold no cache: mlx-lm's cache list (attention and Mamba
    blocks only) is the runner's slots, and the recurrent mixers sit at their slots."""
    from vllm_unified.models.capability import route_model

    folder = make_tiny_checkpoint(tmp_path, "nemotron_h")
    loaded = load_model(folder, hf_config=None, dtype=mx.float32, keep_quantized=False)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)
    # blocks: mamba, mlp, attention, mamba, mamba, mlp -> slots: M, *, M, M
    assert layout.num_slots == 4
    assert layout.recurrent == [0, 2, 3] and list(layout.attention) == [1]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_token_major_forward_equals_mlx_lm_call(family, tmp_path):
    """The runner's forward pieces (decoder stack under ``model`` / ``backbone`` /
    ``language_model``, then the head on chosen rows) give mlx-lm's own ``model(inputs)``
    logits: the head's wrapper, tied embedding and Granite's logits scaling included."""
    from vllm_unified.models.output_head import decoder, lm_head

    folder = make_tiny_checkpoint(tmp_path, family)
    model = load_model(folder, hf_config=None, dtype=mx.float32, keep_quantized=False).model
    ids = mx.array([PROMPTS[1]])
    want = model(ids)[0]
    got = lm_head(model, decoder(model)(ids)[0])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


#: hybrid model types only mlx-lm defines (vLLM has no class: the state pages are sized by
#: the shapes of mlx-lm's own caches after the load-time probe step)
MLX_LM_ONLY_HYBRIDS = ("recurrent_gemma", "baichuan_m1", "bailing_moe_linear", "bailing_hybrid")


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("model_type", MLX_LM_ONLY_HYBRIDS)
def test_mlx_lm_only_hybrid_serves_like_mlx_lm(model_type, tmp_path):
    """The model matrix's tiny checkpoint (built from mlx-lm's ModelArgs), served with
    16-token prefill chunks and 4 requests at once: greedy ids equal mlx-lm's own
    generation."""
    import model_matrix as mm

    result = mm.run_type(model_type, tmp_path)
    assert result.outcome == "match", (result.outcome, result.message, result.served,
                                       result.reference)


@pytest.mark.slow
@pytest.mark.engine
def test_ling_2_5_under_vllms_architecture_name_serves_like_mlx_lm(tmp_path):
    """Ling 2.5 checkpoints name vLLM's ``BailingMoeV2_5ForCausalLM`` (mlx-lm's
    ``bailing_hybrid``): vLLM's class then sizes the state pages (one ``[heads, head_dim,
    head_dim]`` state, float32 here as in mlx-lm's module), and the greedy ids of the model
    matrix's checkpoint still equal mlx-lm's."""
    import model_matrix as mm

    result = mm.prepare_type("bailing_hybrid", tmp_path)
    config = tmp_path / "checkpoints" / "bailing_hybrid" / "config.json"
    cfg = json.loads(config.read_text())
    assert cfg["architectures"] == ["BailingHybridForCausalLM"]
    config.write_text(json.dumps(cfg | {"architectures": ["BailingMoeV2_5ForCausalLM"]}))
    mm.serve_type(result, tmp_path)
    assert result.outcome == "match", (result.outcome, result.message, result.served,
                                       result.reference)


class _FreshMixer:
    """A mixer that, like RecurrentGemma's RG-LRU, treats unset states as a sequence start:
    its first output is 100 x its input there, and a running sum after."""

    def __call__(self, x, cache=None, mask=None):
        state = cache[0]
        outs = []
        for t in range(x.shape[1]):
            state = 100 * x[:, t] if state is None else state + x[:, t]
            outs.append(state)
        cache[0] = state
        return mx.stack(outs, axis=1)


def test_recurrent_adapter_gives_unset_states_at_a_sequence_start():
    """With ``fresh_is_none``, single-token rows at position 0 are called with unset states
    (apart from the rows that continue a sequence) and prefill chunks at position 0 too; the
    outputs come back in row order. The mixer's own argument order (``cache`` before
    ``mask``) is kept."""
    d = 2
    fields = state_fields([(d,)], [torch.float32])
    pages = StatePages.allocate_mlx(6, 64, fields)
    pages.write(mx.arange(6, dtype=mx.int32), [mx.full((6, d), 1000.0)])
    store = StateStore({0: pages}, {0: 1})
    mixer = RecurrentMixer(_FreshMixer(), fresh_is_none=True)
    # seq 0: decode at pos 0 (slot 1), seq 1: decode at pos 4 (slot 2), seq 2: chunk of 2 at
    # pos 0 (slot 3), seq 3: decode at pos 0 (slot 4)
    qlens, slens = np.array([1, 1, 2, 1]), np.array([1, 5, 2, 1])
    ctx = StepContext(
        attn=build_attention_metadata(qlens, slens, np.zeros((4, 1), np.int32), 16),
        state=build_state_metadata(qlens, slens, {1: np.array([1, 2, 3, 4])}))
    x = mx.arange(5 * d, dtype=mx.float32).reshape(5, 1, d)
    with set_step_context(ctx):
        out = mixer(x, cache=StateLayerCache(store, 0), mask=None)
    mx.eval(out, pages.pages)
    xs = np.array(x)[:, 0]
    want = np.stack([100 * xs[0], 1000 + xs[1], 100 * xs[2], 100 * xs[2] + xs[3], 100 * xs[4]])
    np.testing.assert_array_equal(np.array(out)[:, 0], want)
    (states,) = pages.read(mx.array([1, 2, 3, 4], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(states), want[[0, 1, 3, 4]])


class _OffsetMixer:
    """Bailing's linear-attention call shape ``(x, mask, cache, offset)``: adds its rows'
    rotary positions (``offset`` + index in the segment) to a running sum, so the output
    shows which start position each segment got."""

    def __call__(self, x, mask=None, cache=None, offset=0):
        state = cache[0] if cache[0] is not None else mx.zeros((x.shape[0], x.shape[2]))
        outs = []
        for t in range(x.shape[1]):
            state = state + x[:, t]
            outs.append(state + (mx.array(offset) + t).reshape(-1, 1))
        cache[0] = state
        return mx.stack(outs, axis=1)


def test_recurrent_adapter_gives_each_segment_its_start_position():
    """With ``start_position``, the decode rows get their own positions and each prefill chunk
    the position of its first token, whatever one value the model hands every row; a mixer
    without that argument is refused."""
    d = 2
    pages = StatePages.allocate_mlx(6, 64, state_fields([(d,)], [torch.float32]))
    store = StateStore({0: pages}, {0: 1})
    mixer = RecurrentMixer(_OffsetMixer(), start_position="offset")
    # seq 0: decode at pos 9 (slot 1), seq 1: chunk of 3 at pos 4 (slot 2), seq 2: decode at
    # pos 0 (slot 3)
    qlens, slens = np.array([1, 3, 1]), np.array([10, 7, 1])
    pages.write(mx.array([1, 2, 3], dtype=mx.int32), [mx.full((3, d), 100.0)])
    ctx = StepContext(
        attn=build_attention_metadata(qlens, slens, np.zeros((3, 1), np.int32), 16),
        state=build_state_metadata(qlens, slens, {1: np.array([1, 2, 3])}))
    x = mx.arange(5 * d, dtype=mx.float32).reshape(5, 1, d)
    with set_step_context(ctx):
        out = mixer(x, None, StateLayerCache(store, 0), offset=mx.full((5,), 77, mx.int32))
    mx.eval(out, pages.pages)
    xs = np.array(x)[:, 0]
    sums = np.stack([100 + xs[0], 100 + xs[1], 100 + xs[1] + xs[2],
                     100 + xs[1] + xs[2] + xs[3], xs[4]])
    positions = np.array([9, 4, 5, 6, 0], np.float32)[:, None]
    np.testing.assert_array_equal(np.array(out)[:, 0], sums + positions)
    with pytest.raises(TypeError, match="no 'offset' argument"):
        RecurrentMixer(_ToyMixer(), start_position="offset")


_LIGHTNING_STATE = ((3, 32, 32),)
_KDA_STATES = ((3, 96), (3, 96), (3, 96), (3, 32, 32))


@pytest.mark.parametrize("model_type, arch, latent, start, states", [
    ("bailing_moe_linear", "BailingMoeLinearForCausalLM", None, "offset", _LIGHTNING_STATE),
    ("bailing_hybrid", "BailingHybridForCausalLM", (32, 32), "offset", _LIGHTNING_STATE),
    # vLLM's own class (its fused convolution state split for the mixer: _split_kda_conv)
    ("bailing_moe_v3", None, (32, 32), None, _KDA_STATES),
])
def test_bailing_linear_layers_route_to_state_pages(model_type, arch, latent, start, states,
                                                    tmp_path):
    """Ling linear, Ling 2.5 and Bailing V3 (the model matrix's checkpoints: a linear layer,
    then a GQA or an MLA attention layer): the linear layer's mixer is wrapped (with the start
    position where it rotates), its probed states are mlx-lm's (one ``[heads, head_dim,
    head_dim]`` float32 array; Kimi delta attention's three convolution windows first), the
    MLA layer is on latent pages, and vLLM's registry holds ``arch`` (None: vLLM has the
    class) as a hybrid only mlx-lm defines."""
    import model_matrix as mm

    from vllm_unified import compat
    from vllm_unified.models import registration
    from vllm_unified.models.capability import probed_state_layout, route_model

    registration.register_mlx_lm_types()
    result = mm.build_checkpoint(model_type, tmp_path)
    assert result.built, result.build_error
    loaded = load_model(str(tmp_path / model_type), hf_config=None, dtype=mx.float32,
                        keep_quantized=False)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)
    assert layout.recurrent == [0] and list(layout.attention) == [1]
    assert layout.latent == latent
    mixer = loaded.model.layers[0].attention
    assert isinstance(mixer, RecurrentMixer) and mixer.start_position == start
    assert probed_state_layout(layout) == (states, (torch.float32,) * len(states))
    if arch is None:
        assert model_type not in registration.MLX_LM_HYBRID_ARCHITECTURES.values()
        return
    assert registration.MLX_LM_HYBRID_ARCHITECTURES[arch] == model_type
    assert compat.ModelRegistry._try_inspect_model_cls(arch).is_hybrid
    cls = compat.ModelRegistry.models[arch].load_model_cls()
    assert issubclass(cls, registration.MLXLMHybridModel)
    registration.register_mlx_lm_types()  # idempotent
    assert compat.ModelRegistry.models[arch].load_model_cls() is cls


class _ShiftProbe(nn.Module):
    """Baichuan-M1's attention call shape (``W_pack`` = q|k|v, one KV head of 2): returns the
    previous raw keys its state gives it and stores its raw keys and values back."""

    num_kv_heads, head_dim = 1, 2

    def __init__(self):
        super().__init__()
        self.W_pack = nn.Linear(2, 6, bias=False)
        self.W_pack.weight = mx.concatenate([mx.eye(2), mx.eye(2), 2 * mx.eye(2)])

    def __call__(self, x, mask=None, cache=None):
        t = x.shape[0]
        _, k, v = mx.split(self.W_pack(x), (2, 4), axis=-1)
        previous = cache[0][0]
        cache[0][0] = k.reshape(t, 1, 1, 2).transpose(0, 2, 1, 3)
        cache[0][1] = v.reshape(t, 1, 1, 2).transpose(0, 2, 1, 3)
        return previous.reshape(t, 1, 2)


def test_attention_state_reads_the_previous_row_or_the_page():
    """Each token row gets the raw key of the row before it in its sequence; a sequence's
    first row in the step its page's (zeros at position 0); the pages then hold each
    sequence's last raw key and value."""
    from vllm_unified.kv.layer_cache import LayerCacheList
    from vllm_unified.models.attention_state import ConvStateAttention

    fields = state_fields([(1, 1, 2), (1, 1, 2)], [torch.float32, torch.float32])
    pages = StatePages.allocate_mlx(6, 64, fields)
    pages.write(mx.arange(6, dtype=mx.int32), [mx.full((6, 1, 1, 2), 1000.0)] * 2)
    store = StateStore({0: pages}, {0: 1})
    attn = ConvStateAttention(_ShiftProbe())
    # seq 0: decode at pos 5 (slot 2), seq 1: chunk of 3 at pos 0 (slot 4), seq 2: decode at
    # pos 0 (slot 5)
    qlens, slens = np.array([1, 3, 1]), np.array([6, 3, 1])
    ctx = StepContext(
        attn=build_attention_metadata(qlens, slens, np.zeros((3, 1), np.int32), 16),
        state=build_state_metadata(qlens, slens, {1: np.array([2, 4, 5])}))
    x = mx.arange(10, dtype=mx.float32).reshape(5, 1, 2) + 1
    with set_step_context(ctx):
        out = attn(x, None, LayerCacheList(StateLayerCache(store, 0), None))
    mx.eval(out, pages.pages)
    xs = np.array(x)[:, 0]
    want = np.stack([[1000.0, 1000.0], [0.0, 0.0], xs[1], xs[2], [0.0, 0.0]])
    np.testing.assert_array_equal(np.array(out)[:, 0], want)
    keys, values = pages.read(mx.array([2, 4, 5], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(keys).reshape(3, 2), xs[[0, 3, 4]])
    np.testing.assert_array_equal(np.array(values).reshape(3, 2), 2 * xs[[0, 3, 4]])


class _FourStateMixer(nn.Module):
    """Keeps four states as Kimi Linear's KDA does (q, k, v convolutions, the recurrence):
    each conv state becomes its last input row times 1, 2, 3; the recurrence adds the input."""

    def __call__(self, x, mask=None, cache=None):
        q, k, v, s = (cache[i] for i in range(4))
        last = x[:, -1:, :]
        cache[0], cache[1], cache[2] = q * 0 + last, k * 0 + 2 * last, v * 0 + 3 * last
        cache[3] = s + x.sum(axis=1)
        return x


def test_kda_states_are_vllms_fused_convolution_state():
    """Kimi Linear's mixer sees vLLM's one convolution state [K-1, 3P] as its q, k and v
    states [K-1, P] each, and its writes land back in the fused state in that order."""
    from vllm_unified.kv.hybrid import HYBRID_FAMILIES
    from vllm_unified.models.routing import _StateLayout

    p = 4
    family = HYBRID_FAMILIES["kimi_linear"]
    fields = state_fields([(1, 3 * p), (p,)], [torch.float32, torch.float32])
    pages = StatePages.allocate_mlx(3, 64, fields)
    store = StateStore({0: pages}, {0: 1})
    mixer = RecurrentMixer(_FourStateMixer(), layout=_StateLayout(family.to_mixer,
                                                                  family.from_mixer))
    qlens, slens = np.array([2]), np.array([2])
    ctx = StepContext(
        attn=build_attention_metadata(qlens, slens, np.zeros((1, 1), np.int32), 16),
        state=build_state_metadata(qlens, slens, {1: np.array([1])}))
    x = mx.arange(2 * p, dtype=mx.float32).reshape(2, 1, p)
    with set_step_context(ctx):
        mx.eval(mixer(x, None, StateLayerCache(store, 0)))
    conv, recurrent = pages.read(mx.array([1], dtype=mx.int32))
    last = np.array(x)[1, 0]
    np.testing.assert_array_equal(np.array(conv)[0, 0], np.concatenate([last, 2 * last,
                                                                         3 * last]))
    np.testing.assert_array_equal(np.array(recurrent)[0], np.array(x)[:, 0].sum(axis=0))


@pytest.mark.parametrize("model_type", ["kimi_linear", "kimi_k3"])
def test_kimi_routes_kda_and_nope_latent_attention(model_type):
    """Kimi Linear's and Kimi K3's tiny models (matrix weights: O(1) activations): KDA layers
    on state pages, the NoPE MLA layer (K3's with its output gate) on latent pages; the
    load-time probe compares the absorbed attention with mlx-lm's module. Kimi Linear's MLA
    with RoPE is refused, which mlx-lm's module does not compute."""
    import model_matrix as mm

    from vllm_unified.models.capability import route_model
    from vllm_unified.models.config import mlx_lm_config

    config = mm.tiny_config(model_type)
    model_class, args_class = mm.model_classes(model_type)
    model = model_class(args_class.from_dict(config))
    mm.randomize(model, 1)
    layout, _ = route_model(model, config, kv_shape=None, config_window=None)
    assert layout.recurrent == [0, 1] and list(layout.attention) == [2]
    assert (layout.attention[2].latent_dim, layout.attention[2].rope_dim) == (32, 32)
    if model_type == "kimi_linear":
        with pytest.raises(ValueError, match="mla_use_nope False"):
            mlx_lm_config({**config, "mla_use_nope": False})
