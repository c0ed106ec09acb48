"""Pipeline parallelism (``--pipeline-parallel-size``) through vLLM's multiprocessing executor.

Unit parts: the stage split and pruning of an mlx-lm model, the tokens a stage before the last
learns from the scheduler, the start-up refusals. End to end: PP=2 (two worker processes on
this machine) gives the same greedy tokens as PP=1 for the default model and the tiny
checkpoints, batched, with chunked prefill and prefix caching; each stage holds only its
layers' weights; each stage logs its KV budget.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import run_llm
from mlx.utils import tree_flatten
from test_e2e_offline import _prompts

from vllm_unified.distributed.pipeline import PipelineStage
from vllm_unified.models.pipeline_layers import MissingLayer, prune_model
from vllm_unified.worker.input_batch import InputBatch, RequestState


def _tiny_mlx_llama(layers: int = 4, tied: bool = True):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=layers,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=100, num_key_value_heads=2, tie_word_embeddings=tied)
    return llama.Model(args)


@pytest.mark.parametrize("tied", [True, False])
def test_prune_keeps_only_the_stage_weights(tied):
    names = {k for k, _ in tree_flatten(_tiny_mlx_llama(tied=tied).parameters())}
    first, last = _tiny_mlx_llama(tied=tied), _tiny_mlx_llama(tied=tied)
    prune_model(first, PipelineStage(0, 2, 0, 2, 4), "llama")
    prune_model(last, PipelineStage(1, 2, 2, 4, 4), "llama")
    held_first = {k for k, _ in tree_flatten(first.parameters())}
    held_last = {k for k, _ in tree_flatten(last.parameters())}
    assert all(isinstance(first.model.layers[i], MissingLayer) for i in (2, 3))
    assert all(isinstance(last.model.layers[i], MissingLayer) for i in (0, 1))
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.", "model.norm.",
                                 "lm_head.")) for k in held_first)
    assert not any(k.startswith(("model.layers.0.", "model.layers.1.")) for k in held_last)
    assert "model.embed_tokens.weight" in held_first
    # the last stage keeps the embedding only when it is the (tied) LM head
    assert ("model.embed_tokens.weight" in held_last) == tied
    assert held_first | held_last == names


def test_stage_forwards_compose_to_the_whole_model():
    """Stage 1 then stage 2 (the residual stream handed over) equals the unsplit model."""
    mx.random.seed(3)
    whole = _tiny_mlx_llama()
    mx.eval(whole.parameters())
    weights = tree_flatten(whole.parameters())
    stages = []
    for stage in (PipelineStage(0, 2, 0, 2, 4), PipelineStage(1, 2, 2, 4, 4)):
        m = _tiny_mlx_llama()
        prune_model(m, stage, "llama")
        held = {k for k, _ in tree_flatten(m.parameters())}
        m.load_weights([(k, v) for k, v in weights if k in held], strict=True)
        stages.append(m)
    ids = mx.array([[1, 5, 7, 9, 11]])
    want = whole.model(ids)
    hidden = stages[0].model(ids)
    got = stages[1].model(ids, input_embeddings=hidden)
    assert mx.allclose(got, want, atol=1e-6).item()


def test_prune_refuses_other_architectures():
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 2: model type 'gemma3_text'"):
        prune_model(_tiny_mlx_llama(), PipelineStage(0, 2, 0, 2, 4), "gemma3_text")


def test_stage_learns_tokens_from_the_scheduler():
    """A stage before the last samples nothing: the tokens to feed come in
    ``scheduled_cached_reqs.new_token_ids`` (vLLM sends them when PP > 1)."""
    batch = InputBatch()
    batch.requests = {"a": RequestState(req_id="a", token_ids=[5, 6, 7], num_prompt_tokens=3,
                                        block_ids=[1], num_computed_tokens=3,
                                        sampling_params=None)}
    out = batch.requests["a"].output_token_ids
    cached = SimpleNamespace(req_ids=["a"], num_computed_tokens=[3], num_output_tokens=[1],
                             all_token_ids={}, new_block_ids=[None], resumed_req_ids=set(),
                             new_token_ids=[[42]])
    sched = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[],
                            scheduled_cached_reqs=cached)
    batch.update(sched, None)
    assert batch.requests["a"].token_ids == [5, 6, 7, 42]
    assert out == [42]  # the output list kept its identity (vLLM's penalties hold it)
    step = batch.layout(SimpleNamespace(num_scheduled_tokens={"a": 1}))
    assert step.input_ids.tolist() == [42]


def _policy_config(model_type="llama", pp=2, backend="mp", spec=None, kv=None, tp=1):
    parallel = SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                               distributed_executor_backend=backend)
    return SimpleNamespace(parallel_config=parallel, speculative_config=spec,
                           kv_transfer_config=kv,
                           model_config=SimpleNamespace(
                               hf_config=SimpleNamespace(model_type=model_type)))


@pytest.mark.parametrize(("kw", "message"), [
    ({"model_type": "gemma3_text"}, r"model type 'gemma3_text' is not supported with pipeline"),
    ({"backend": "uni"}, r"needs --distributed-executor-backend mp"),
    ({"spec": object()}, r"--speculative-config is not supported with pipeline"),
    ({"kv": object()}, r"KV offloading .* is not supported with pipeline"),
])
def test_pipeline_refusals_name_the_flag(kw, message):
    from vllm_unified.platform import _pipeline_policy

    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 2: " + message):
        _pipeline_policy(_policy_config(**kw), hybrid=False)
    _pipeline_policy(_policy_config(), hybrid=False)  # llama, mp: accepted


def test_tensor_parallelism_is_refused_with_the_reason():
    from vllm_unified.platform import _parallel_sizes_policy

    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2: .*one MLX device per "
                                         r"machine.*--pipeline-parallel-size"):
        _parallel_sizes_policy(SimpleNamespace(tensor_parallel_size=2))


# ----------------------------------------------------------------------------- end to end
def _pp_spec(model: str, requests: list, pp: int, **engine) -> dict:
    base = {"max_model_len": 1024, "kv_cache_memory_bytes": 128 * 2**20, "seed": 0,
            "max_num_batched_tokens": 128, "enable_prefix_caching": True}
    base.update(engine)
    if pp > 1:
        base.update(pipeline_parallel_size=pp, distributed_executor_backend="mp")
    return {"model": model, "engine": base, "requests": requests, "rounds": 2,
            "rpc_workers": ["memory_report", "runner_stats"]}


def _requests(vocab: int, n_tokens: int = 16) -> list[dict]:
    """Batched greedy requests: prompts longer than a 128-token step (chunked prefill) and
    prompts sharing a 200-token prefix (prefix-cache hits in the second round, and within a
    round once the first has been computed)."""
    lengths = [7, 33, 150, 260, 90, 400, 12, 64]
    prompts = _prompts(len(lengths), lengths, vocab=vocab, seed=5)
    shared = _prompts(1, [200], vocab=vocab, seed=6)[0]
    prompts += [shared + p[:20] for p in prompts[:4]]
    params = {"temperature": 0.0, "max_tokens": n_tokens, "ignore_eos": True}
    return [{"prompt_token_ids": p, "params": params} for p in prompts]


def _dir(tmp_path, name: str):
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    return path


def _tokens(result: dict) -> list[list[int]]:
    return [o["completions"][0]["token_ids"] for o in result["outputs"]]


@pytest.mark.engine
def test_pp2_equals_pp1_default_model(default_model, tmp_path):
    requests = _requests(49152)
    # PP=2 batches the requests differently from PP=1. Without AMX the quantized layers'
    # int16 arithmetic serves 1-4 rows only, so a near tie could flip with the batch size;
    # the exact fp32 arithmetic makes each row's result independent of its batch.
    exact = {"VLLM_UNIFIED_CPU_ACTIVATIONS": "fp32"}
    one = run_llm(_pp_spec(default_model, requests, 1), _dir(tmp_path, "pp1"), env=exact)
    two = run_llm(_pp_spec(default_model, requests, 2), _dir(tmp_path, "pp2"), env=exact)
    assert _tokens(two) == _tokens(one)
    n = len(requests)
    assert _tokens(two)[:n] == _tokens(two)[n:]  # the prefix-cached round gives the same

    whole = one["rpc_workers"]["memory_report"][0]
    stages = two["rpc_workers"]["memory_report"]
    assert len(stages) == 2
    # Each stage holds its 15 of the 30 (equal) layers; both hold the embedding (tied: the
    # last stage's LM head).
    for s in stages:
        assert s["weights_layers_bytes"] == whole["weights_layers_bytes"] // 2, s
        assert s["weights_other_bytes"] <= whole["weights_other_bytes"], s
        assert s["rss"] < whole["rss"], (s, whole)
    stats = two["rpc_workers"]["runner_stats"]
    assert stats[0]["sampled"] == 0 and stats[1]["sampled"] == 2 * n * 16
    # chunked prefill and prefix caching happened: fewer tokens computed than prompts fed
    fed = 2 * sum(len(r["prompt_token_ids"]) + 15 for r in requests)
    assert stats[0]["tokens"] == stats[1]["tokens"] < fed
    assert max(len(r["prompt_token_ids"]) for r in requests) > 128
    for rank, layers_desc in ((1, "layers 0-14 of 30"), (2, "layers 15-29 of 30")):
        assert re.search(rf"pipeline stage {rank} of 2: {layers_desc}[^\n]*KV budget = ",
                         two["log"]), f"stage {rank}'s KV budget not logged"


@pytest.mark.engine
@pytest.mark.slow  # the family grid of test_pp2_equals_pp1_default_model
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_pp2_equals_pp1_tiny(family, tmp_path):
    from tiny_models import make_tiny_checkpoint

    model = str(make_tiny_checkpoint(tmp_path / "ckpt", family))
    requests = _requests(1000, n_tokens=12)
    one = run_llm(_pp_spec(model, requests, 1, dtype="float32"), _dir(tmp_path, "pp1"))
    two = run_llm(_pp_spec(model, requests, 2, dtype="float32"), _dir(tmp_path, "pp2"))
    assert _tokens(two) == _tokens(one)


def test_worker_module_imports_no_mlx():
    """The worker module (and what it imports for pipeline stages) must not load MLX: the
    fast BLAS is interposed in ``init_device`` before MLX loads (a PP import that loaded MLX
    first made fp32 prefill ~40x slower)."""
    import subprocess
    import sys

    code = ("import sys, vllm_unified.worker.worker, vllm_unified.platform, "
            "vllm_unified.distributed.pipeline; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
