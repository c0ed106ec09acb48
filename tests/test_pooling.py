"""vLLM's pooling runner on MLX (issue 41, first slice): a decoder embedder (Qwen3-Embedding
style: last-token pooling, normalised, Matryoshka dimensions) through the paged forward, against
vLLM's own CPU backend in fp32 on the same weights; what is not served yet is refused at
start-up, naming the model type or the task."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_llm, vllm_server
from tiny_models import make_tiny_checkpoint

#: the engine's step budget: the long prompts are pooled only after several chunks
BUDGET = 64
MATRYOSHKA = [16, 32, 64]


def embedder_checkpoint(tmp_path: Path) -> Path:
    """A tiny random Qwen3 saved as Qwen3-Embedding ships: backbone weights only (no
    ``model.`` prefix, no LM head) under ``Qwen3ForCausalLM``, sentence-transformers' modules
    (last-token pooling, then Normalize) and Matryoshka dimensions in the config."""
    from safetensors.numpy import load_file, save_file

    source = make_tiny_checkpoint(tmp_path / "src", "qwen3")
    folder = tmp_path / "tiny-qwen3-embedding"
    folder.mkdir()
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    weights = load_file(source / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied: the backbone is the whole checkpoint
    save_file({name.removeprefix("model."): w for name, w in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config["hidden_size"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}))
    (folder / "2_Normalize").mkdir()
    return folder


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 104729 * i) % 40000 + 100 for i in range(n)]


LONG = _ids(1, 3 * BUDGET + 21)  # four chunks
TEXTS = ["The capital of France is Paris.", "A retrieval stack needs an embedder.",
         "Reranking orders passages by relevance to a query."]
BATCHES = [
    # several short prompts next to a chunked one; Matryoshka and unnormalised outputs
    [*({"prompt": t} for t in TEXTS),
     {"prompt_token_ids": LONG},
     {"prompt_token_ids": _ids(2, 40), "params": {"dimensions": 32}},
     {"prompt_token_ids": _ids(3, 25), "params": {"use_activation": False}},
     {"prompt_token_ids": _ids(4, BUDGET + 5), "params": {"dimensions": 16}}],
    # the long prompt's blocks come from the prefix cache; a longer prompt extends it
    [{"prompt_token_ids": LONG}, {"prompt_token_ids": LONG + _ids(5, 30)},
     {"prompt": TEXTS[0]}],
    # dimensions the model does not offer: refused by vLLM's validation (both backends)
    [{"prompt": TEXTS[1], "params": {"dimensions": 17}}],
]


def _spec(model: str, native: bool) -> dict:
    engine = {"dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": BUDGET,
              "enable_prefix_caching": True, "seed": 0, "disable_log_stats": False,
              "kv_cache_memory_bytes": (512 if native else 64) * 2**20}
    if native:
        engine["enforce_eager"] = True
    spec = {"model": model, "engine": engine, "embed_batches": BATCHES, "metrics": True}
    if not native:
        spec["rpc"] = ["runner_stats"]
    return spec


def _close(got: list[float], want: list[float]) -> tuple[float, float]:
    """(1 - cosine, largest difference relative to the largest reference element)."""
    dot = sum(a * b for a, b in zip(got, want, strict=True))
    cos = dot / (math.sqrt(sum(a * a for a in got)) * math.sqrt(sum(b * b for b in want)))
    rel = max(abs(a - b) for a, b in zip(got, want, strict=True)) / max(abs(b) for b in want)
    return 1 - cos, rel


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> tuple[str, dict]:
    """The embedder's folder and vLLM's CPU backend's results for :data:`BATCHES`."""
    tmp_path = tmp_path_factory.mktemp("embedder")
    model = str(embedder_checkpoint(tmp_path))
    return model, run_llm(_spec(model, native=True), tmp_path, native=True)


@pytest.mark.engine
def test_decoder_embedder_matches_vllm(embedder, tmp_path):
    """``LLM.embed`` on the Qwen3-Embedding-style checkpoint (vLLM resolves the pooling runner
    from its sentence-transformers files: LAST pooling, normalised) equals vLLM's CPU backend:
    short prompts, prompts longer than the step budget (chunked, pooled once), prefix-cached
    prompts, Matryoshka ``dimensions`` and ``use_activation=False``; refused dimensions are
    refused alike."""
    model, ref = embedder
    ours = run_llm(_spec(model, native=False), tmp_path)
    assert ours["platform"] == "vllm_unified.platform.MLXPlatform"
    for b, (got, want) in enumerate(zip(ours["embed_batches"], ref["embed_batches"],
                                        strict=True)):
        if b == 2:
            assert "error" in got and "error" in want
            assert "dimensions" in got["error"] and "17" in got["error"]
            continue
        assert got["num_tokens"] == want["num_tokens"]
        for i, (g, w) in enumerate(zip(got["embeddings"], want["embeddings"], strict=True)):
            params = BATCHES[b][i].get("params", {})
            assert len(g) == len(w) == params.get("dimensions", 64), (b, i)
            one_minus_cos, rel = _close(g, w)
            assert one_minus_cos <= 1e-5 and rel <= 1e-4, (b, i, one_minus_cos, rel)
            norm = math.sqrt(sum(a * a for a in g))
            if params.get("use_activation", True):
                assert abs(norm - 1) < 1e-5, (b, i, norm)
            else:
                assert abs(norm - 1) > 1e-2, (b, i, norm)  # really not normalised
    stats = ours["rpc_after"]["runner_stats"]
    assert stats["pooled"] == len(BATCHES[0]) + len(BATCHES[1])
    assert stats["sampled"] == 0
    # the long prompt took several steps, and the second batch read the prefix cache
    assert stats["forwards"] >= len(LONG) // BUDGET + 3
    assert ours["metrics"].get("vllm:prefix_cache_hits", 0) >= len(LONG) // 16 * 16
    # the long prompt chunked from scratch and read back from the prefix cache: one embedding
    _, rel = _close(ours["embed_batches"][1]["embeddings"][0],
                    ours["embed_batches"][0]["embeddings"][3])
    assert rel <= 1e-5


def _cosine(a: list[float], b: list[float]) -> float:
    return 1 - _close(a, b)[0]


@pytest.mark.engine
def test_embedding_server(embedder, tmp_path):
    """``vllm serve`` on the embedder: ``/v1/embeddings`` (texts, token ids, ``dimensions``),
    and the bi-encoder ``/score`` and ``/v1/rerank`` vLLM builds on the embed task, equal vLLM's
    CPU backend's embeddings and their cosines; bad requests get a 400 naming the problem and
    the server keeps serving."""
    import requests

    model, ref = embedder
    want = ref["embed_batches"][0]["embeddings"]
    args = [model, "--served-model-name", "emb", "--dtype", "float32", "--max-model-len", "512",
            "--max-num-batched-tokens", str(BUDGET), "--kv-cache-memory-bytes",
            str(64 * 2**20)]
    with vllm_server(tmp_path, args) as (base, _):
        def post(path: str, **body) -> requests.Response:
            return requests.post(f"{base}{path}", json={"model": "emb", **body}, timeout=120)

        got = []
        for inputs in (TEXTS, [LONG]):  # texts, then token ids (one kind per request)
            r = post("/v1/embeddings", input=inputs)
            assert r.status_code == 200, r.text
            got += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        for i, (g, w) in enumerate(zip(got, want[:4], strict=True)):
            one_minus_cos, rel = _close(g, w)
            assert one_minus_cos <= 1e-5 and rel <= 1e-4, (i, one_minus_cos, rel)
        r = post("/v1/embeddings", input=[_ids(2, 40)], dimensions=32)
        assert r.status_code == 200, r.text
        g = r.json()["data"][0]["embedding"]
        assert len(g) == 32 and _close(g, want[4])[1] <= 1e-4
        # bi-encoder scores: cosines of the embeddings
        cosines = [_cosine(want[0], want[j]) for j in (1, 2)]
        r = post("/score", text_1=TEXTS[0], text_2=TEXTS[1:3])
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        assert scores == pytest.approx(cosines, rel=1e-4, abs=1e-6)
        r = post("/v1/rerank", query=TEXTS[0], documents=TEXTS[1:3])
        assert r.status_code == 200, r.text
        ranked = {d["index"]: d["relevance_score"] for d in r.json()["results"]}
        assert [ranked[0], ranked[1]] == pytest.approx(cosines, rel=1e-4, abs=1e-6)
        # bad input: a 400 naming the problem each time
        for body, word in (({"input": [TEXTS[0]], "dimensions": 17}, "dimensions"),
                           ({"input": [_ids(6, 600)]}, "512"),
                           ({"input": []}, "at least one prompt")):
            r = post("/v1/embeddings", **body)
            assert r.status_code == 400 and word in r.text, (body, r.status_code, r.text)
        # a generation route on a pooling server: 400 naming the server (vLLM's is a 404)
        r = post("/v1/completions", prompt="Hello", max_tokens=4)
        assert r.status_code == 400 and "runs a pooling" in r.text, (r.status_code, r.text)
        r = post("/v1/embeddings", input=TEXTS[:1])
        assert r.status_code == 200 and _close(r.json()["data"][0]["embedding"],
                                               want[0])[1] <= 1e-4


def test_backbone_checkpoint_loads_for_pooling_only(tmp_path):
    """Backbone-only weights (Qwen3-Embedding's layout) load into mlx-lm's model with the same
    parameters as the full checkpoint; without tied embeddings only the pooling runner accepts
    the missing LM head (it never runs it), generation keeps mlx-lm's strict check."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from vllm_unified.models.loader import load_model

    full = load_model(make_tiny_checkpoint(tmp_path, "qwen3"), dtype=mx.float32,
                      keep_quantized=False)
    backbone = embedder_checkpoint(tmp_path)
    loaded = load_model(backbone, dtype=mx.float32, keep_quantized=False, pooling=True)
    want = dict(tree_flatten(full.model.parameters()))
    got = dict(tree_flatten(loaded.model.parameters()))
    assert got.keys() == want.keys()
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
    config = json.loads((backbone / "config.json").read_text())
    (backbone / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="lm_head"):
        load_model(backbone, dtype=mx.float32, keep_quantized=False)
    untied = load_model(backbone, dtype=mx.float32, keep_quantized=False, pooling=True)
    assert "lm_head" in untied.model


def classifier_checkpoint(tmp_path: Path, num_labels: int) -> Path:
    """A tiny random ``Qwen3ForSequenceClassification`` (transformers' class: backbone under
    ``model.``, a ``score`` layer of ``num_labels`` outputs, no LM head)."""
    import torch
    import transformers
    from tiny_models import _randomize, smollm2_tokenizer, tiny_config

    config = tiny_config("qwen3")
    config.num_labels = num_labels
    config.architectures = ["Qwen3ForSequenceClassification"]
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(config)
    _randomize(model, "qwen3", 0)
    folder = tmp_path / f"tiny-qwen3-cls{num_labels}"
    model.save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


#: a Qwen3-Reranker served as vLLM's docs say: the causal LM scored on its "no"/"yes" rows
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                      "classifier_from_token": ["no", "yes"],
                      "is_original_qwen3_reranker": True}


def _classify_spec(model: str, native: bool, batches: list, **engine) -> dict:
    spec = _spec(model, native)
    spec["engine"].update(engine)
    spec["embed_batches"] = batches
    return spec


def _assert_scores_match(got: list[float], want: list[float], what: object) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= 1e-4 * max(abs(w), 1e-3), (what, got, want)


@pytest.mark.engine
@pytest.mark.slow  # the ci tier classifies through vLLM's pooler in tests/test_encoders.py
def test_sequence_classifier_matches_vllm(tmp_path):
    """``LLM.classify`` on a 3-label ``Qwen3ForSequenceClassification`` (softmax
    probabilities; raw logits with ``use_activation=False``; a prompt longer than the step
    budget) equals vLLM's CPU backend."""
    model = str(classifier_checkpoint(tmp_path, 3))
    requests = [*({"prompt": t} for t in TEXTS), {"prompt_token_ids": LONG},
                {"prompt_token_ids": _ids(3, 25), "params": {"use_activation": False}}]
    batches = [{"method": "classify", "requests": requests}]
    ours = run_llm(_classify_spec(model, False, batches), tmp_path)
    ref = run_llm(_classify_spec(model, True, batches), tmp_path, native=True)
    got, want = ours["embed_batches"][0], ref["embed_batches"][0]
    assert "probs" in got, got
    for i, (g, w) in enumerate(zip(got["probs"], want["probs"], strict=True)):
        _assert_scores_match(g, w, i)
    assert all(abs(sum(p) - 1) < 1e-5 for p in got["probs"][:4])
    assert abs(sum(got["probs"][4]) - 1) > 1e-3  # logits, not probabilities
    assert max(max(p) for p in got["probs"][:4]) > 0.5  # the random head is not flat


def _encode_ours_and_vllm(model: str, task: str, requests: list[dict],
                          tmp_path: Path) -> tuple[dict, dict]:
    """``LLM.encode(pooling_task=task)`` of ``requests`` served with ``--pooler-config
    '{"task": task}'`` by ours and by vLLM's CPU backend: (ours, vLLM's) per-token outputs,
    checked to hold one output per prompt token."""
    batches = [{"method": "encode", "task": task, "requests": requests}]
    engine = {"pooler_config": {"task": task}}
    ours = run_llm(_classify_spec(model, False, batches, **engine), tmp_path)
    ref = run_llm(_classify_spec(model, True, batches, **engine), tmp_path, native=True)
    got, want = ours["embed_batches"][0], ref["embed_batches"][0]
    assert "data" in got, got
    assert [len(d) for d in got["data"]] == got["num_tokens"] == want["num_tokens"]
    return got, want


@pytest.mark.slow  # a model of its own per pooling type / task: ~40 s each
def test_token_classification_matches_vllm(tmp_path):
    """``LLM.encode(pooling_task="token_classify")`` on the 3-label classifier (one softmax
    per prompt token, ``--pooler-config '{"task": "token_classify"}'``) equals vLLM's CPU
    backend, a chunked prompt included."""
    model = str(classifier_checkpoint(tmp_path, 3))
    requests = [{"prompt": TEXTS[1]}, {"prompt_token_ids": LONG}]
    got, want = _encode_ours_and_vllm(model, "token_classify", requests, tmp_path)
    for i, (g, w) in enumerate(zip(got["data"], want["data"], strict=True)):
        for t, (gt, wt) in enumerate(zip(g, w, strict=True)):
            _assert_scores_match(gt, wt, (i, t))
            assert abs(sum(gt) - 1) < 1e-5


@pytest.mark.engine
def test_causal_lm_reranker_matches_vllm(tmp_path):
    """A Qwen3-Reranker-style scorer (the causal LM's "yes" row minus its "no" row, sigmoid):
    ``LLM.score`` of a query against documents, one of them longer than the step budget,
    equals vLLM's CPU backend."""
    model = str(make_tiny_checkpoint(tmp_path, "qwen3"))
    long_doc = " ".join(["Paris is the capital and largest city of France."] * 12)
    batches = [{"method": "score", "query": TEXTS[0],
                "documents": [TEXTS[1], TEXTS[2], long_doc]}]
    engine = {"hf_overrides": RERANKER_OVERRIDES}
    ours = run_llm(_classify_spec(model, False, batches, **engine), tmp_path)
    ref = run_llm(_classify_spec(model, True, batches, **engine), tmp_path, native=True)
    got, want = ours["embed_batches"][0], ref["embed_batches"][0]
    assert "scores" in got, got
    _assert_scores_match(got["scores"], want["scores"], "scores")
    assert len(set(round(x, 3) for x in got["scores"])) == 3  # scores that tell apart


@pytest.mark.slow  # a model of its own per pooling type / task: ~40 s each
@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_match_vllm(tmp_path, pooling_type):
    """MEAN and CLS pooling of a decoder (``--pooler-config``; vLLM turns chunked prefill and
    prefix caching off for them, so every prompt runs whole in one step) equal vLLM's CPU
    backend, several prompts sharing a step."""
    model = str(make_tiny_checkpoint(tmp_path, "qwen3"))
    requests = [*({"prompt": t} for t in TEXTS), {"prompt_token_ids": _ids(7, 200)},
                {"prompt_token_ids": _ids(3, 25), "params": {"use_activation": False}}]
    engine = {"runner": "pooling", "max_model_len": 256, "max_num_batched_tokens": 256,
              "pooler_config": {"seq_pooling_type": pooling_type}}
    batches = [requests]
    ours = run_llm(_classify_spec(model, False, batches, **engine), tmp_path)
    ref = run_llm(_classify_spec(model, True, batches, **engine), tmp_path, native=True)
    got, want = ours["embed_batches"][0], ref["embed_batches"][0]
    assert "embeddings" in got, got
    for i, (g, w) in enumerate(zip(got["embeddings"], want["embeddings"], strict=True)):
        one_minus_cos, rel = _close(g, w)
        assert one_minus_cos <= 1e-5 and rel <= 1e-4, (i, one_minus_cos, rel)
    stats = ours["rpc_after"]["runner_stats"]
    assert stats["pooled"] == len(requests)
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) > 1


@pytest.mark.slow  # a model of its own per pooling type / task: ~40 s each
def test_token_embeddings_match_vllm(embedder, tmp_path):
    """``LLM.encode(pooling_task="token_embed")`` (``--pooler-config '{"task":
    "token_embed"}'``: one normalised vector per prompt token) equals vLLM's CPU backend,
    the chunked prompt's rows gathered over its steps."""
    model, _ = embedder
    requests = [{"prompt": TEXTS[0]}, {"prompt_token_ids": LONG},
                {"prompt_token_ids": _ids(2, 40), "params": {"dimensions": 32}}]
    got, want = _encode_ours_and_vllm(model, "token_embed", requests, tmp_path)
    for i, (g, w) in enumerate(zip(got["data"], want["data"], strict=True)):
        for t, (gt, wt) in enumerate(zip(g, w, strict=True)):
            one_minus_cos, rel = _close(gt, wt)
            assert one_minus_cos <= 1e-5 and rel <= 1e-4, (i, t, one_minus_cos, rel)
    assert len(got["data"][2][0]) == 32


def _engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, max_model_len=256, **kwargs).create_engine_config()


def _tiny_bert(tmp_path: Path) -> Path:
    import transformers
    from tiny_models import smollm2_tokenizer

    config = transformers.BertConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=128)
    folder = tmp_path / "tiny-bert"
    transformers.BertModel(config).save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("case", "kwargs", "words"), [
    ("bert", {"hf_overrides": {"architectures": ["BertForTokenClassification"]}},
     ["'bert'", "encoder-only"]),
    ("qwen2", {"hf_overrides": {"architectures": ["Qwen2ForRewardModel"]}},
     ["'qwen2'", "own pooling head"]),
    ("qwen3", {"runner": "pooling", "pooler_config": {"tok_pooling_type": "STEP"}},
     ["'qwen3'", "pooling type STEP"]),
])
def test_unserved_pooling_refused_at_start(tmp_path, case, kwargs, words):
    """What the pooling runner does not serve yet stops the start-up, naming the model type
    and the task or pooling type, before any weight is loaded."""
    from vllm_unified.errors import StartupRefused

    model = (_tiny_bert(tmp_path) if case == "bert"
             else make_tiny_checkpoint(tmp_path, case))
    with pytest.raises(Exception) as err:
        _engine_config(str(model), dtype="float32", **kwargs)
    cause = err.value
    while cause is not None and not isinstance(cause, StartupRefused):
        cause = cause.__cause__ or cause.__context__
    message = str(cause if cause is not None else err.value)
    for word in words:
        assert word in message, message


def test_pooling_requests_only_on_a_pooling_server(monkeypatch):
    """An embedding request to a generating server and a generation request to a pooling
    server are refused with a 400 naming the task (``VLLMValidationError``)."""
    from types import SimpleNamespace

    from vllm import PoolingParams, SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_unified.platform import MLXPlatform

    inputs = {"prompt_token_ids": [1, 2]}
    monkeypatch.setattr(MLXPlatform, "serving_model_config",
                        SimpleNamespace(runner_type="generate"))
    with pytest.raises(VLLMValidationError, match="--runner pooling") as err:
        MLXPlatform.validate_request(inputs, PoolingParams(task="embed"))
    assert err.value.parameter == "task"
    monkeypatch.setattr(MLXPlatform, "serving_model_config",
                        SimpleNamespace(runner_type="pooling"))
    MLXPlatform.validate_request(inputs, PoolingParams(task="embed"))
    with pytest.raises(VLLMValidationError, match="generation is not served"):
        MLXPlatform.validate_request(inputs, SamplingParams(max_tokens=4))
