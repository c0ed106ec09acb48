"""The model matrix (tests/model_matrix.py): every mlx-lm text model type as a tiny random
checkpoint, served by our engine and compared with mlx-lm's own greedy generation.

Fast tier: the checkpoint builder (every type builds from its ModelArgs or has a recorded
reason; checkpoints reload in mlx-lm; weights give O(1) logits), the outcome classifier and
the docs table. CI tier: a few types with different attention features through the engine.
Slow tier: every other type through the engine (MoE types included).
"""

from __future__ import annotations

import json

import model_matrix as mm
import pytest

TYPES = mm.model_types()

#: served in the CI tier (one engine each; the families' own tests cover phi3, cohere2, gemma
#: and the hybrids): a type neither transformers nor vLLM defines, accepted through the
#: plugin's registration (internlm2); sliding-window layers with q/k norms and a RoPE-less
#: global layer (exaone4); a multimodal checkpoint (Gemma3ForConditionalGeneration) whose
#: language model is served text-only, with no torchvision installed (gemma3)
CI_TYPES = ("internlm2", "exaone4", "gemma3")

#: built and reloaded in the fast tier (the rest in the slow tier): one per kind of layer
#: stack the builder must get right
RELOAD_FAST = ("llama", "gemma3_text", "phi3", "minicpm3", "lfm2", "nemotron_h", "gemma4_text",
               "openelm", "qwen3_5")


def test_type_list_is_mlx_lms():
    from vllm_unified.models.registration import mlx_lm_model_types

    assert TYPES == mlx_lm_model_types()
    assert len(TYPES) > 100 and "llama" in TYPES and "base" not in TYPES


@pytest.mark.parametrize("model_type", TYPES)
def test_type_builds_or_has_a_reason(model_type, tmp_path):
    """mlx-lm's Model instantiates from the tiny config, or the type is listed with the reason
    it cannot be (a listed type that builds is a stale entry); a type transformers builds
    instead (:data:`model_matrix.TRANSFORMERS_BUILT`) gets its checkpoint."""
    if model_type in mm.TRANSFORMERS_BUILT:
        result = mm.build_checkpoint(model_type, tmp_path)
        assert result.built, result.build_error
        return
    try:
        cfg = mm.tiny_config(model_type)
        model_class, args_class = mm.model_classes(model_type)
        model = model_class(args_class.from_dict(cfg))
    except BaseException as e:  # noqa: BLE001 (SystemExit from mlx-lm's olmo)
        if isinstance(e, KeyboardInterrupt):
            raise
        assert model_type in mm.KNOWN_UNBUILT, f"{model_type}: {mm._one_line(e)}"
        return
    assert model_type not in mm.KNOWN_UNBUILT, f"{model_type} builds: drop its reason"
    moe, features = mm.classify(model, cfg)
    assert moe == ("MoE" in features)


def _check_checkpoint(model_type, tmp_path):
    result = mm.build_checkpoint(model_type, tmp_path)
    assert result.built, result.build_error
    assert result.reload_identical, "mlx-lm's reload (sanitize) changed the weights"
    folder = tmp_path / model_type
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["architectures"] == [result.architecture]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name


@pytest.mark.parametrize("model_type", RELOAD_FAST)
def test_checkpoint_reloads_in_mlx_lm(model_type, tmp_path):
    _check_checkpoint(model_type, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in RELOAD_FAST
                                        and t not in mm.KNOWN_UNBUILT])
def test_every_checkpoint_reloads_in_mlx_lm(model_type, tmp_path):
    _check_checkpoint(model_type, tmp_path)


def test_random_weights_give_decisive_logits(tmp_path):
    """Greedy comparisons need logits far from flat: with mlx-lm's default init the top two
    logits of a tiny model are often within float noise."""
    import mlx.core as mx

    mm.build_checkpoint("llama", tmp_path)
    model = mm.load_reference_model(tmp_path / "llama")
    logits = model(mx.array([mm.prompts("llama")[1]]))[0].astype(mx.float32)
    assert float(mx.std(logits, axis=-1).min()) > 0.5
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    assert float(mx.median(top2[:, 1] - top2[:, 0])) > 1e-3


REFUSAL_LOG = """\
(EngineCore pid=7) ERROR 12-06 18:00:00 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=7) ERROR 12-06 18:00:00 [core.py:1510]   File "loader.py", line 1, in load
(EngineCore pid=7) ERROR 12-06 18:00:00 [core.py:1510] ValueError: model type 'x': layer 0 \
needs attention sinks
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_failure_is_a_refusal_or_a_crash():
    state, tokens, message = mm._failure(REFUSAL_LOG)
    assert (state, tokens) == ("refused", None)
    assert message == "ValueError: model type 'x': layer 0 needs attention sinks"
    crash = REFUSAL_LOG.replace("ValueError: model type 'x': layer 0 needs attention sinks",
                                "AttributeError: 'PagedLayerCache' object has no attribute 'y'")
    state, _, message = mm._failure(crash)
    assert state == "crashed" and message.startswith("AttributeError: 'PagedLayerCache'")
    pydantic = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                "ModelConfig\n  Value error, Model architectures ['X'] are not supported\n")
    state, _, message = mm._failure(pydantic)
    assert state == "refused" and message.endswith("Model architectures ['X'] are not supported")
    capability = REFUSAL_LOG.replace(
        "ValueError: model type 'x': layer 0 needs attention sinks",
        "vllm_unified.models.capability.UnsupportedModel: model type 'x' (cache slot 0): "
        "attention sinks is not supported by vllm-unified yet")
    state, _, message = mm._failure(capability)
    assert state == "refused" and message.endswith("is not supported by vllm-unified yet")
    state, _, _ = mm._failure(REFUSAL_LOG + "Processed prompts: 100%\n")
    assert state == "crashed"  # an error after requests were served is never a refusal


def test_a_type_mlx_lm_cannot_run_is_still_served(tmp_path, monkeypatch):
    """Without a reference the engine still starts: a refusal is the outcome (both causes
    named), a crash too; a served type stays reference_failed with its tokens."""
    def failed():
        return mm.TypeResult("x", built=True, outcome="reference_failed",
                             message="RuntimeError: no Metal")

    for state, tokens, message, outcome in (
            ("refused", None, "UnsupportedModel: model type 'x': kernels", "refused"),
            ("crashed", None, "AttributeError: y", "crashed"),
            ("served", [[1, 2]], None, "reference_failed")):
        monkeypatch.setattr(mm, "serve", lambda *a, _r=(state, tokens, message), **k: _r)
        result = mm.serve_type(failed(), tmp_path)
        assert result.outcome == outcome and result.served == tokens
        if message:
            assert message in result.message and "no Metal" in result.message
    assert mm._servable(failed()) and not mm._servable(mm.TypeResult("x", built=True))


def test_docs_table_replaces_only_its_section(tmp_path):
    rows = [{**json.loads(json.dumps(mm.dataclasses.asdict(mm.TypeResult(t)))),
             "built": True, "architecture": f"{t.title()}ForCausalLM", "features": f,
             "outcome": o, "message": m, "moe": moe}
            for t, f, o, m, moe in [
                ("aaa", [], "match", None, False),
                ("bbb", ["sliding window"], "refused", "ValueError: no | sinks", False),
                ("cohere2", ["sliding window"], "match_vllm", None, False),
                ("ccc", ["MoE"], None, None, True)]]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"mlx_lm": "0.0", "types": rows}))
    docs = tmp_path / "models.md"
    docs.write_text("# Models\n\nintro\n")
    mm.write_docs_table(results, docs)
    first = docs.read_text()
    assert first.startswith("# Models\n\nintro\n") and mm.TABLE_START in first
    assert "of the 3 others 1 serve and equal" in first and "1 serve as vLLM does" in first
    assert "Of the 1 MoE types 0 serve and equal" in first and "1 were not run." in first
    assert ("| `cohere2` | Cohere2ForCausalLM | sliding window | tiny random (mlx-lm ModelArgs) "
            "| greedy ids vs vLLM's CPU backend (fp32) and mlx-lm") in first
    assert "equals vLLM's CPU backend (fp32), differs from mlx-lm: sliding layers" in first
    assert "| `bbb` | BbbForCausalLM | sliding window |" in first
    assert "ValueError: no \\| sinks" in first
    docs.write_text(first + "\n## After\n\ntail\n")
    mm.write_docs_table(results, docs)
    second = docs.read_text()
    assert second.count(mm.TABLE_START) == 1 and second.endswith("## After\n\ntail\n")


@pytest.mark.engine
@pytest.mark.parametrize("model_type", CI_TYPES)
def test_type_serves_like_mlx_lm(model_type, tmp_path):
    """Greedy ids equal mlx-lm's own generation with 16-token prefill chunks, 4 requests at
    once and prefix caching (tests/model_matrix.py's engine settings)."""
    from conftest import require_engine_mark

    require_engine_mark("a vLLM engine (model_matrix.serve)")
    result = mm.run_type(model_type, tmp_path)
    assert result.outcome == "match", (result.outcome, result.message, result.served,
                                       result.reference)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in CI_TYPES])
def test_type_serves_or_is_refused(model_type, tmp_path):
    """Every other type: equal to mlx-lm (a type served as vLLM serves it: equal to vLLM's
    CPU backend in fp32), or refused at start-up by the capability check
    (models/capability.py), whose message names the model type and the missing feature;
    never a crash or different tokens (MoE types included)."""
    result = mm.prepare_type(model_type, tmp_path)
    if not result.built:
        assert model_type in mm.KNOWN_UNBUILT, result.build_error
        return
    mm.serve_type(result, tmp_path)
    if result.outcome == "reference_failed":  # served, but mlx-lm gives nothing to compare
        pytest.skip(f"{model_type}: {result.message}")
    allowed = ("match", "refused") + (
        ("match_vllm",) if model_type in mm.VLLM_OVER_MLX_LM or model_type in mm.TRANSFORMERS_BUILT
        else ())
    assert result.outcome in allowed, (result.outcome, result.message)
    if result.outcome == "refused":  # the capability check's message names the feature
        assert f"model type {model_type!r}" in result.message, result.message
        assert "is not supported by vllm-unified" in result.message, result.message


#: types whose tiny checkpoint vLLM 0.32 serves too (its own class or its Transformers
#: backend): compared once with vLLM's CPU backend in fp32 (cohere2 is, in every matrix run)
VLLM_CHECKED = ("gpt_bigcode",)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("model_type", VLLM_CHECKED)
def test_type_serves_like_vllm_cpu(model_type, tmp_path):
    """Greedy ids equal mlx-lm's and those of vLLM's own CPU backend (fp32, the matrix's
    engine settings) on the same checkpoint."""
    from conftest import require_engine_mark

    require_engine_mark("a vLLM engine (model_matrix.serve)")
    result = mm.run_type(model_type, tmp_path)
    assert result.outcome == "match", (result.outcome, result.message)
    state, tokens, message = mm.serve(tmp_path / "checkpoints" / model_type,
                                      mm.prompts(model_type), mm.NEW_TOKENS,
                                      "recurrent" in result.features, tmp_path / "vllm",
                                      native=True)
    assert state == "served", message
    assert tokens == result.served


@pytest.mark.slow
@pytest.mark.engine
def test_decilm_without_linear_stand_ins_serves(tmp_path, monkeypatch):
    """nemotron-nas whose blocks are GQA attention, no attention, and full MHA without an MLP
    (the matrix's blocks less the refused linear stand-in) equals mlx-lm."""
    from conftest import require_engine_mark

    require_engine_mark("a vLLM engine (model_matrix.serve)")
    blocks = mm.OVERRIDES["nemotron-nas"]["block_configs"]
    assert blocks[-1]["attention"] == {"replace_with_linear": True}
    monkeypatch.setitem(mm.OVERRIDES, "nemotron-nas",
                        {"num_hidden_layers": 3, "block_configs": blocks[:3]})
    result = mm.run_type("nemotron-nas", tmp_path)
    assert result.outcome == "match", (result.outcome, result.message)
