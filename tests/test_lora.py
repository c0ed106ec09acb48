"""LoRA adapters (``--enable-lora``): the per-step update against references (numpy, mlx-lm's
own LoRA layer), both adapter formats, vLLM's errors; end to end against vLLM's CPU backend
with ``--enable-lora`` (fp32, the same files), a quantized base, and the server's runtime
load / unload and per-adapter prefix caching.

vLLM's CPU backend (``vllm/lora/ops/torch_ops/lora_ops.py``) indexes its adapter slots with
each row's slot, and a row without an adapter has slot -1: torch reads that as the *last*
slot, so base-model rows in a batch that fills every slot get that slot's adapter (vLLM's GPU
kernels skip them). The reference runs with one slot more than it has adapters, so the last
slot holds zeros and its base rows are the base model's, as on CUDA.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import default_model_path, run_llm, stream_completion, vllm_server
from tiny_models import (
    make_mlx_lm_adapter,
    make_peft_adapter,
    make_tiny_checkpoint,
    peft_to_mlx_lm,
)

from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.models.lora import (
    AdapterWeights,
    LoRASlots,
    LoRAStep,
    install_lora_layers,
    lora_targets,
)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
#: (name, rank, alpha, targets, rsLoRA): ranks 8, 16, 64, different target sets, one rsLoRA
ADAPTERS = (("a8", 8, 16, ("q_proj", "v_proj"), False),
            ("a16", 16, 16, ATTENTION + MLP, True),
            ("a64", 64, 32, ("o_proj",) + MLP, False))


# ------------------------------------------------------------------------------- layers
def _step(pairs: list[tuple[mx.array, mx.array]], row_slots: list[int], dims: tuple[int, int],
          max_rank: int = 8, native: bool = True) -> StepContext:
    """A step context whose slot s holds ``pairs[s]`` on the module path "" (``dims``)."""
    slots = LoRASlots({"": dims}, len(pairs), max_rank, mx.float32)
    for s, pair in enumerate(pairs):
        slots.write(s, AdapterWeights(s + 1, f"a{s}", {"": pair}, pair[0].shape[1]))
    ranks = {s: pair[0].shape[1] for s, pair in enumerate(pairs)}
    step = LoRAStep(slots, np.array(row_slots), {""}, ranks, native=native)
    assert (step.native is not None) == native  # the path under test is the one taken
    return StepContext(attn=None, lora=step)


@pytest.mark.parametrize("native", [True, False], ids=["native", "mlx"])
@pytest.mark.parametrize("num_rows", [9, 150])
def test_step_update_matches_numpy_and_leaves_base_rows_bit_identical(num_rows, native):
    """Two adapters of ranks 4 and 8 in slots of rank 8 on interleaved rows, base rows between
    them, on the native CPU kernel and the pure-MLX form (input width 24: a vector tail; output
    40: a scalar column tail): each row's output is the base output plus its own adapter's
    ``x A B``; base rows keep their bits."""
    rng = np.random.default_rng(0)
    linear = nn.Linear(24, 40)
    x = mx.array(rng.standard_normal((num_rows, 1, 24), dtype=np.float32))
    base = np.array(linear(x))
    install_lora_layers(linear, {"": (24, 40)})
    pairs = [tuple(mx.array(rng.standard_normal(s, dtype=np.float32)) for s in ((24, r), (r, 40)))
             for r in (4, 8)]
    row_slots = ([0, 0, -1, 1, -1, 0, -1, 1, 1] * num_rows)[:num_rows]
    with set_step_context(_step(pairs, row_slots, (24, 40), native=native)):
        got = np.array(linear(x))
    want = base.copy()
    xs = np.array(x)[:, 0]
    for t, slot in enumerate(row_slots):
        if slot >= 0:
            want[t, 0] += xs[t] @ np.array(pairs[slot][0]) @ np.array(pairs[slot][1])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    base_rows = [t for t, slot in enumerate(row_slots) if slot < 0]
    assert got[base_rows].tobytes() == base[base_rows].tobytes()
    # no step: the base layer
    assert np.array(linear(x)).tobytes() == base.tobytes()


@pytest.mark.parametrize("native", [True, False], ids=["native", "mlx"])
def test_update_on_a_quantized_layer_matches_mlx_lm_lora_layer(native):
    """A quantized base (4-bit, group 32) with one adapter on every row: the same output as
    mlx-lm's own ``LoRALinear`` over the same layer and weights."""
    from mlx_lm.tuner.lora import LoRALinear

    rng = np.random.default_rng(1)
    dense = nn.Linear(64, 48, bias=False)
    quantized = nn.QuantizedLinear.from_linear(dense, group_size=32, bits=4)
    reference = LoRALinear.from_base(quantized, r=8, scale=2.5)
    reference.lora_b = mx.array(rng.standard_normal((8, 48), dtype=np.float32))
    x = mx.array(rng.standard_normal((5, 1, 64), dtype=np.float32))
    want = np.array(reference(x))
    install_lora_layers(quantized, {"": (64, 48)})
    pair = (reference.lora_a, reference.lora_b * 2.5)
    with set_step_context(_step([pair], [0] * 5, (64, 48), max_rank=16, native=native)):
        got = np.array(quantized(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert lora_targets(nn.Sequential(quantized)) == {}  # not named like a projection


# ------------------------------------------------------------------------------ adapters
@pytest.fixture(scope="module")
def tiny_llama_lora(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A tiny Llama and the three adapters of :data:`ADAPTERS` for it: (base, name -> path)."""
    root = tmp_path_factory.mktemp("lora-llama")
    base = make_tiny_checkpoint(root, "llama")
    return str(base), {name: str(make_peft_adapter(root / name, base, rank=r, alpha=alpha,
                                                   targets=targets, seed=r, rslora=rs))
                       for name, r, alpha, targets, rs in ADAPTERS}


def _adapters(base: str, max_rank: int = 64, capacity: int = 2):
    from mlx_lm.utils import load_model
    from vllm.config.lora import LoRAConfig

    from vllm_unified.worker.lora import LoRAAdapters

    model, _ = load_model(Path(base))
    config = LoRAConfig(max_lora_rank=max_rank, max_loras=capacity)
    return model, LoRAAdapters(config, lora_targets(model), mx.float32, 128)


def _request(name: str, lora_id: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, path)


def test_peft_and_mlx_lm_formats_load_to_the_same_update(tiny_llama_lora, tmp_path):
    """PEFT's scaling (``alpha / r``; rsLoRA ``alpha / sqrt(r)``) folded into B: the a8
    adapter read as PEFT and converted to mlx-lm's format gives the same arrays; rsLoRA's B is
    ``alpha / sqrt(r)`` times the stored one."""
    base, paths = tiny_llama_lora
    _, adapters = _adapters(base)
    assert adapters.add(_request("a8", 1, paths["a8"])) is True
    assert adapters.add(_request("a8", 1, paths["a8"])) is False  # held: not read again
    converted = str(peft_to_mlx_lm(paths["a8"], tmp_path / "mlx", num_layers=2))
    adapters.add(_request("a8-mlx", 2, converted))
    peft, mlx_lm = adapters._held[1].modules, adapters._held[2].modules
    assert sorted(peft) == sorted(mlx_lm) and len(peft) == 4
    for name in peft:
        for p, q in zip(peft[name], mlx_lm[name], strict=True):
            np.testing.assert_allclose(np.array(p), np.array(q), rtol=1e-6)
    # load_inplace: the same id read again (here from the mlx-lm copy of a8)
    assert adapters.add(_request("a8-mlx", 2, paths["a8"]), reload=True) is True
    assert sorted(adapters._held[2].modules) == sorted(peft)
    adapters.add(_request("a16", 3, paths["a16"]))  # rsLoRA; evicts a8 (two held)
    assert adapters.ids() == {2, 3}
    from safetensors.numpy import load_file
    stored = load_file(str(Path(paths["a16"]) / "adapter_model.safetensors"))
    b = stored["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].T
    got = np.array(adapters._held[3].modules["model.layers.0.mlp.down_proj"][1])
    np.testing.assert_allclose(got, b * 16 / np.sqrt(16), rtol=1e-6)


def test_adapter_errors_name_the_problem(tiny_llama_lora, tmp_path):
    """vLLM's errors: a missing adapter is ``LoRAAdapterNotFoundError`` (the server's 404); a
    rank above ``--max-lora-rank``, a target the model lacks and a wrong shape raise ValueError
    naming it; pinning an adapter that is not held raises."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    base, paths = tiny_llama_lora
    _, adapters = _adapters(base, max_rank=16)
    with pytest.raises(LoRAAdapterNotFoundError, match="nowhere"):
        adapters.add(_request("nowhere", 1, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="LoRA rank 64 is greater than max_lora_rank 16"):
        adapters.add(_request("a64", 2, paths["a64"]))
    head = make_peft_adapter(tmp_path / "head", base, rank=4, alpha=8, targets=("q_proj",),
                             seed=1)
    _edit(head, lambda k, v: v, lambda k: k.replace("self_attn.q_proj", "self_attn.qkv_mixer"))
    with pytest.raises(ValueError, match="qkv_mixer"):
        adapters.add(_request("head", 3, str(head)))
    wrong = make_peft_adapter(tmp_path / "wrong", base, rank=4, alpha=8, targets=("q_proj",),
                              seed=1)
    _edit(wrong, lambda k, v: v[:-1] if "layers.1" in k and "lora_B" in k else v)
    with pytest.raises(ValueError, match=r"layers.1.self_attn.q_proj has A \(64, 4\) and B "
                                         r"\(4, 127\) .* the layer is 64 -> 128"):
        adapters.add(_request("wrong", 4, str(wrong)))
    with pytest.raises(ValueError, match="LoRA 9 is not registered"):
        adapters.pin(9)
    assert adapters.ids() == set()


def _edit(adapter: Path, change, rename=lambda k: k) -> None:
    """Rewrite a PEFT adapter's tensors: ``change(key, array)``, keys through ``rename``."""
    from safetensors.numpy import load_file, save_file

    file = str(adapter / "adapter_model.safetensors")
    save_file({rename(k): np.ascontiguousarray(change(k, v))
               for k, v in load_file(file).items()}, file)


def test_step_puts_adapters_in_slots_and_reloads_evicted_ones(tiny_llama_lora):
    """Requests in step order with their query lengths: each row gets its adapter's slot (-1
    without one); a new adapter takes a free slot, then the least recently used slot of an
    adapter the step does not use; an adapter evicted from the held set is read again from its
    path when a scheduled request names it; a removed one leaves its slot."""
    from types import SimpleNamespace

    base, paths = tiny_llama_lora
    _, adapters = _adapters(base, capacity=2)
    a8, a16, a64 = (_request(n, i + 1, paths[n]) for i, n in enumerate(("a8", "a16", "a64")))
    reqs = [SimpleNamespace(lora_request=r) for r in (a8, None, a16, a8)]
    step = adapters.step(reqs, np.array([2, 3, 1, 4]))
    assert step.row_slots.tolist() == [0, 0, -1, -1, -1, 1, 0, 0, 0, 0]
    assert step.targeted == set(adapters._held[1].modules) | set(adapters._held[2].modules)
    assert np.array(step.rank).tolist() == [8, 16]
    assert adapters.step(reqs[1:2], np.array([5])) is None
    step = adapters.step([SimpleNamespace(lora_request=a64), reqs[2]], np.array([1, 1]))
    assert step.row_slots.tolist() == [0, 1]  # a8's slot (least recent) went to a64
    assert adapters.ids() == {2, 3}  # capacity 2: a8 was evicted when a64 came
    # a8 read again, into the slot used least recently (a tie: the first)
    assert adapters.step(reqs[:1], np.array([3])).row_slots.tolist() == [0] * 3
    assert adapters.ids() == {2, 1} and adapters._slot_owner == [1, 2]
    assert adapters.remove(1) and adapters._slot_owner == [None, 2]
    with pytest.raises(RuntimeError, match="3 LoRA adapters in one step, 2 slots"):
        adapters.step([SimpleNamespace(lora_request=r) for r in (a8, a16, a64)],
                      np.array([1, 1, 1]))


# ---------------------------------------------------------------------------- end to end
def _engine(native: bool, **kw) -> dict:
    # the reference: one slot more than it has adapters (module docstring)
    base = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 2**20, "seed": 0,
            "dtype": "float32", "enable_lora": True, "max_loras": 4 if native else 3,
            "max_lora_rank": 64}
    if native:
        base["enforce_eager"] = True
    base.update(kw)
    return base


def _mixed_requests(paths: dict[str, str], vocab: int, max_tokens: int = 16) -> list[dict]:
    """3 prompts of 5-90 tokens, each under the base model and the three adapters, interleaved
    (12 requests, one batch)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 37, 90)]
    loras = [None, *[[name, i + 1, paths[name]] for i, (name, *_rest) in enumerate(ADAPTERS)]]
    return [{"prompt_token_ids": p, "lora": lora,
             "params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}}
            for p in prompts for lora in loras]


@pytest.mark.engine
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_adapters_match_native_backend_and_mlx_lm(family, tmp_path):
    """12 concurrent requests mixing the base model and three PEFT adapters (ranks 8/16/64,
    one rsLoRA): greedy token ids identical to vLLM's CPU backend with ``--enable-lora`` in
    fp32; every adapter changes some output (really applied); all in one batch. Then (llama)
    the same engine serves two adapters written by mlx-lm's own LoRA layers (last layer,
    different projections) and the base model: the greedy ids of mlx-lm's generation with
    each ``adapter_path``; five adapters over three slots, so slots are rewritten."""
    base = make_tiny_checkpoint(tmp_path, family)
    if family == "llama":
        base = _with_legacy_rope_keys(base, tmp_path / "llama")
    paths = {name: str(make_peft_adapter(tmp_path / name, base, rank=r, alpha=alpha,
                                         targets=targets, seed=r, rslora=rs, std=0.15))
             for name, r, alpha, targets, rs in ADAPTERS}
    requests = _mixed_requests(paths, 49152)
    mlx_requests, mlx_reference = _mlx_lm_adapter_cases(base, tmp_path) if family == "llama" \
        else ([], [])
    ours = run_llm({"model": str(base), "engine": _engine(False),
                    "batches": [requests] + ([mlx_requests] if mlx_requests else []),
                    "rpc": ["runner_stats"]}, tmp_path)
    ref = run_llm({"model": str(base), "engine": _engine(True), "requests": requests},
                  tmp_path, native=True)
    got = [o["completions"][0]["token_ids"] for o in ours["batches"][0]]
    want = [o["completions"][0]["token_ids"] for o in ref["outputs"]]
    assert got == want
    for a in range(1, 4):  # request 4p + a is prompt p under adapter a, 4p under the base
        assert any(got[4 * p + a] != got[4 * p] for p in range(3)), ADAPTERS[a - 1][0]
    assert "LoRA adapters on" in ours["log"]
    assert max(int(k) for k in ours["rpc_after"]["runner_stats"]["forwards_by_num_reqs"]) == 12
    if mlx_requests:
        assert [o["completions"][0]["token_ids"] for o in ours["batches"][1]] == mlx_reference


def _mlx_lm_adapter_cases(base: Path, tmp_path: Path) -> tuple[list[dict], list[list[int]]]:
    """Requests under two mlx-lm adapters (ids 4 and 5) and the base model, interleaved, and
    mlx-lm's own greedy generation for each (``adapter_path``)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    keys = {"qvd": ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"),
            "oug": ("self_attn.o_proj", "mlp.up_proj", "mlp.gate_proj")}
    paths = {name: str(make_mlx_lm_adapter(tmp_path / name, base, rank=8, scale=4.0,
                                           num_layers=1, keys=k, seed=i + 5))
             for i, (name, k) in enumerate(keys.items())}
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (6, 40)]
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    order = [(0, "qvd"), (0, None), (1, "oug"), (1, "qvd"), (0, "oug"), (1, None)]
    requests = [{"prompt_token_ids": prompts[p], "params": greedy,
                 "lora": [name, 4 + list(keys).index(name), paths[name]] if name else None}
                for p, name in order]
    want = {}
    for name in (*keys, None):
        model, _ = load(str(base), adapter_path=paths.get(name))
        want[name] = [[int(t) for (t, _), _ in zip(generate_step(mx.array(p), model,
                                                                  max_tokens=12), range(12),
                                                    strict=False)] for p in prompts]
    assert all(want[name] != want[None] for name in keys)  # each adapter changes the output
    return requests, [want[name][p] for p, name in order]


def _with_legacy_rope_keys(folder: Path, out: Path) -> Path:
    """A copy of a tiny checkpoint whose config also has the pre-transformers-5 ``rope_theta``
    and ``rope_scaling`` keys: mlx-lm's llama reads only those (it would run the default RoPE
    instead of the checkpoint's llama3 one); our loader and vLLM read either."""
    import shutil

    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["rope_scaling"] = dict(config["rope_parameters"])
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.engine
def test_adapter_over_quantized_default_model(default_model, default_model_reference, tmp_path):
    """SmolLM2 kept quantized (Q4_1, native kernels) with a random rank-16 adapter, and a
    base-model request beside it: the greedy ids of the same requests over the dequantized fp32
    base on vLLM's CPU backend (divergence allowed only at a reference top-2 gap below 0.01,
    as int16 activations may swap a near tie); the base request gives the default model's
    known Paris answer on both (the ci tier's comparison of the default model with vLLM's
    backend); the adapted text differs from the base model's."""
    from test_e2e_offline import PARIS_IDS

    adapter = make_peft_adapter(tmp_path / "smol", default_model_reference, rank=16, alpha=32,
                                targets=ATTENTION + MLP, seed=3, std=0.06)
    lora = ["smol", 1, str(adapter)]
    prompts = ["The capital of France is", "Write a haiku about autumn leaves."]
    greedy = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    requests = [*({"prompt": p, "lora": lora, "params": greedy} for p in prompts),
                {"prompt": prompts[0], "params": greedy}]
    # the reference has a second, empty slot for its base row (module docstring)
    engine = {"max_model_len": 512, "seed": 0, "enable_lora": True, "max_lora_rank": 16,
              "max_loras": 2, "kv_cache_memory_bytes": 256 * 2**20}
    ours = run_llm({"model": default_model, "engine": engine, "requests": requests}, tmp_path)
    ref = run_llm({"model": default_model_reference,
                   "engine": {**engine, "dtype": "float32", "enforce_eager": True},
                   "requests": [{**r, "params": {**greedy, "logprobs": 2}} for r in requests]},
                  tmp_path, native=True)
    assert "quantized=True" in ours["log"]
    for o, r in zip(ours["outputs"], ref["outputs"], strict=True):
        got, want = o["completions"][0]["token_ids"], r["completions"][0]["token_ids"]
        step = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), None)
        if step is not None:
            top2 = r["completions"][0]["logprobs"][step]
            assert top2[0][1] - top2[1][1] < 0.01, (step, got, want)
    adapted, plain = ours["outputs"][0], ours["outputs"][2]
    assert plain["completions"][0]["token_ids"][:10] == PARIS_IDS
    assert ref["outputs"][2]["completions"][0]["token_ids"][:10] == PARIS_IDS
    assert adapted["completions"][0]["text"] != plain["completions"][0]["text"]


def _metric(base: str, name: str) -> float:
    import requests

    text = requests.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.mark.engine
def test_server_loads_and_unloads_adapters_while_requests_run(default_model_reference,
                                                             tmp_path):
    """``vllm serve --enable-lora --lora-modules`` with runtime updating: adapters in
    ``/v1/models``; an adapter loaded at run time serves; one unloaded while its request runs
    lets that request finish and answers the next one 404 naming it; others keep serving; a
    prompt cached under one adapter is no prefix-cache hit under another, and is one under the
    same adapter; a missing adapter path is vLLM's 404."""
    import requests

    paths = {name: make_peft_adapter(tmp_path / name, default_model_reference, rank=8, alpha=16,
                                     targets=ATTENTION + MLP, seed=seed, std=0.06)
             for name, seed in (("first", 1), ("second", 2))}
    args = [default_model_path(), "--served-model-name", "smol", "--max-model-len", "1024",
            "--kv-cache-memory-bytes", str(256 * 2**20), "--seed", "0", "--enable-lora",
            "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules",
            f"first={paths['first']}"]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with vllm_server(tmp_path, args, env) as (base, _):
        models = {m["id"] for m in requests.get(f"{base}/v1/models", timeout=10).json()["data"]}
        assert models == {"smol", "first"}
        r = requests.post(f"{base}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "second", "lora_path": str(paths["second"])})
        assert r.status_code == 200, r.text
        r = requests.post(f"{base}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "ghost", "lora_path": str(tmp_path / "ghost")})
        assert r.status_code == 404 and "ghost" in r.text, r.text

        prompt = "A long shared system prompt about the sea and ships. " * 6
        greedy = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        texts, hits = {}, []
        for name in ("first", "second", "second"):
            before = _metric(base, "vllm:prefix_cache_hits_total")
            texts.setdefault(name, []).append(stream_completion(
                base, {**greedy, "model": name, "stream": True})[0])
            hits.append(_metric(base, "vllm:prefix_cache_hits_total") - before)
        assert hits[1] == 0 and hits[2] > 0, hits  # never across adapters; within one, yes
        assert texts["second"][0] == texts["second"][1] != texts["first"][0]

        started, results = threading.Event(), {}

        def long_request() -> None:
            results["first"] = stream_completion(base, {
                "model": "first", "prompt": "Tell me a story.", "max_tokens": 200,
                "min_tokens": 200, "stream": True}, started)

        runner = threading.Thread(target=long_request)
        runner.start()
        assert started.wait(120)
        r = requests.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "first"},
                          timeout=60)
        assert r.status_code == 200, r.text
        r = requests.post(f"{base}/v1/completions", timeout=60,
                          json={"model": "first", "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 404 and "first" in r.text, r.text
        assert stream_completion(base, {**greedy, "model": "second", "stream": True})[0] == \
            texts["second"][0]
        runner.join(300)
        assert results["first"][1] == "length" and results["first"][0]
