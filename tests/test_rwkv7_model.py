"""RWKV-7 (mlx-lm's ``rwkv7``; vLLM 0.32 has no class for it) served attention-free on vLLM's
state pages: each decoder layer is the recurrent mixer (its one cache holds the time mixing's
token shift and wkv state and the channel mixing's token shift), and layer 0's values
(``v_first``) reach the later layers per token within the step.

The slow engine test compares greedy generation (chunked prefill, four requests batched) with
mlx-lm's own on the same weights; the unit tests cover the side-input call convention, the
layout, the attention-free registration and the state block size without an engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import run_llm

from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.layer_cache import StateLayerCache
from vllm_unified.kv.state_pages import StatePages, StateStore, build_state_metadata, state_fields
from vllm_unified.models.loader import load_model
from vllm_unified.models.routing import RecurrentMixer

ARCH = "RWKV7ForCausalLM"
NUM_LAYERS = 3  # v_first crosses two layers
NEW_TOKENS = 16
PROMPT_LENGTHS = (3, 20, 45, 70)
PROMPTS = [[(13 * i + 29 * j) % 40000 + 100 for j in range(n)]
           for i, n in enumerate(PROMPT_LENGTHS)]
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
          "seed": 0, "enable_prefix_caching": False, "kv_cache_memory_bytes": 16 * 2**20}


def make_checkpoint(root: Path) -> Path:
    """A tiny random RWKV-7 checkpoint of :data:`NUM_LAYERS` layers: the model matrix's config
    (hidden 96, 3 heads of 32, untied head), its weights and SmolLM2's tokenizer."""
    from mlx.utils import tree_flatten
    from model_matrix import _tokenizer_files, model_classes, randomize, tiny_config

    cfg = tiny_config("rwkv7") | {"num_hidden_layers": NUM_LAYERS, "architectures": [ARCH]}
    model_class, args_class = model_classes("rwkv7")
    model = model_class(args_class.from_dict(cfg))
    randomize(model, 7)
    folder = root / "rwkv7"
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tok = _tokenizer_files(root)
    cfg.update(bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"],
               torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in tok["files"]:
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from vllm_unified.models.registration import register_mlx_lm_types

    register_mlx_lm_types()  # transformers has no RWKV-7 config: the plugin's stands in
    return make_checkpoint(tmp_path_factory.mktemp("rwkv7"))


@pytest.mark.slow
@pytest.mark.engine
def test_greedy_equals_mlx_lm(checkpoint, tmp_path):
    """Four prompts (3-70 tokens) in 16-token chunks, batched: mlx-lm's own greedy tokens;
    one state slot per request; the start-up log names the attention-free layout."""
    from model_matrix import mlx_lm_reference

    reference = mlx_lm_reference(checkpoint, PROMPTS, NEW_TOKENS)
    assert len({tuple(r) for r in reference}) == len(PROMPTS)  # the model is not degenerate
    spec = {"model": str(checkpoint), "engine": ENGINE,
            "requests": [{"prompt_token_ids": p,
                          "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS,
                                     "ignore_eos": True}} for p in PROMPTS],
            "rpc": ["runner_stats", "state_slots"]}
    ours = run_llm(spec, tmp_path)
    got = [o["completions"][0]["token_ids"] for o in ours["outputs"]]
    for i, (mine, ref) in enumerate(zip(got, reference, strict=True)):
        assert mine == ref, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens)"
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(PROMPTS)  # batched
    assert len(set(map(tuple, ours["rpc_after"]["state_slots"].values()))) == len(PROMPTS)
    assert f"attention-free model: {NUM_LAYERS} recurrent layers on state pages" in ours["log"]


# ------------------------------------------------------------------------------- unit tests


class _SideInputMixer:
    """RWKV-7's convention ``layer(x, v_first, cache) -> (out, v_first)``: a running sum in
    ``cache[0]``; ``v_first`` None is replaced by the input, else added to the output."""

    def __call__(self, x, v_first, cache):
        b, s, d = x.shape
        state = cache[0] if cache[0] is not None else mx.zeros((b, d))
        outs = []
        for t in range(s):
            state = state + x[:, t]
            outs.append(state)
        cache[0] = state
        out = mx.stack(outs, axis=1)
        if v_first is None:
            return out, 10 * x
        return out + v_first, v_first


def test_side_inputs_follow_the_rows():
    """A per-token side input is split over the segments like the input and a returned tuple
    is gathered back in token order (a chunk scheduled before a decode row)."""
    d = 2
    pages = StatePages.allocate_mlx(4, 64, state_fields([(d,)], [torch.float32]))
    store = StateStore({0: pages}, {0: 0})
    mixer = RecurrentMixer(_SideInputMixer())
    # a 2-token chunk continuing slot 1's sequence, then a decode row of slot 3's
    qlens, slens = np.array([2, 1]), np.array([5, 4])
    pages.write(mx.array([1, 3], dtype=mx.int32), [mx.array([[100.0, 100.0], [7.0, 7.0]])])
    ctx = StepContext(
        attn=build_attention_metadata(qlens, slens, np.zeros((2, 1), np.int32), 256),
        state=build_state_metadata(qlens, slens, {0: np.array([1, 3])}))
    x = mx.arange(3 * d, dtype=mx.float32).reshape(3, 1, d)
    with set_step_context(ctx):
        out, v_first = mixer(x, None, StateLayerCache(store, 0))
        out2, v_again = mixer(x, v_first, StateLayerCache(store, 0))
    xs = np.array(x)[:, 0]
    want = np.stack([100 + xs[0], 100 + xs[0] + xs[1], 7 + xs[2]])
    np.testing.assert_array_equal(np.array(out)[:, 0], want)
    np.testing.assert_array_equal(np.array(v_first)[:, 0], 10 * xs)
    np.testing.assert_array_equal(np.array(v_again), np.array(v_first))
    np.testing.assert_array_equal(np.array(out2)[:, 0], np.stack(
        [want[1] + xs[0], want[1] + xs[0] + xs[1], want[2] + xs[2]]) + 10 * xs)
    (total,) = pages.read(mx.array([1, 3], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(total), [want[1] + xs[0] + xs[1], want[2] + xs[2]])


def test_layers_route_to_state_pages(checkpoint):
    """Every layer is wrapped whole and is a recurrent slot; mlx-lm's probed caches give the
    per-sequence states vLLM sizes the pages by: token shift, wkv state, token shift."""
    from vllm_unified.models.capability import probed_state_layout, route_model

    loaded = load_model(str(checkpoint), hf_config=None, dtype=mx.float32,
                        keep_quantized=False)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=None, config_window=None)
    assert all(isinstance(layer, RecurrentMixer) for layer in loaded.model.layers)
    assert (layout.recurrent, layout.attention) == (list(range(NUM_LAYERS)), {})
    shapes, dtypes = probed_state_layout(layout)
    assert shapes == ((1, 96), (3, 32, 32), (1, 96))
    assert dtypes == (torch.float32,) * 3


def test_registered_attention_free():
    """vLLM sees RWKV-7 as attention-free (state groups only, no attention pages), with the
    state shapes the worker records."""
    from vllm_unified import compat
    from vllm_unified.models import registration

    registration.register_mlx_lm_types()
    info = compat.ModelRegistry._try_inspect_model_cls(ARCH)
    assert info.is_attention_free and info.has_inner_state and not info.is_hybrid
    cls = compat.ModelRegistry.models[ARCH].load_model_cls()
    registration.record_state_layout(ARCH, [(1, 96), (3, 32, 32), (1, 96)],
                                     [torch.float32] * 3)
    assert cls.get_mamba_state_shape_from_config(None) == ((1, 96), (3, 32, 32), (1, 96))


def test_attention_free_state_block_size():
    """An attention-free model vLLM has no config hook for gets one state block per request
    (``mamba_block_size`` = max_model_len, as vLLM's Mamba); a value set is kept, and
    hybrids are left to vLLM's alignment."""
    from vllm_unified.platform import _hybrid_policy

    def config(is_hybrid: bool, block: int | None) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(is_hybrid=is_hybrid, is_attention_free=not is_hybrid,
                                         architecture=ARCH, max_model_len=256),
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=None),
            cache_config=SimpleNamespace(enable_prefix_caching=False, mamba_block_size=block))

    for is_hybrid, block, want in [(False, None, 256), (False, 64, 64), (True, None, None)]:
        c = config(is_hybrid, block)
        assert _hybrid_policy(c) is True
        assert c.cache_config.mamba_block_size == want
