"""Fuzzing the HTTP API, and the regression tests of every server error the fuzzer found.

Unit tests (fast): each fix in :mod:`vllm_unified.request_guard`,
:mod:`vllm_unified.request_policy` and :func:`vllm_unified.patches.patch_anthropic_stream_errors`
on its own.

End to end (``slow``, one ``vllm serve`` of a tiny random-weight Llama through our plugin):
each request the fuzzer found answered with a 5xx before its fix, sent as a plain example with
its expected 4xx and message; then a short fuzz run (:mod:`api_fuzz`, a few hundred requests
over every operation of ``/openapi.json`` and our generation strategies): no response >= 500,
no server-error event in a stream, no hang, and the server healthy with the same greedy text
after every batch. ``benchmarks/serve.py fuzz`` runs the same with thousands of requests.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import requests
from api_fuzz import Fuzzer, rounds, server_args, sources_for, stream_server_error
from conftest import vllm_server

from vllm_unified.request_guard import (
    RequestGuard,
    RequestRejected,
    check_beam_search,
    check_model,
    check_text,
)
from vllm_unified.request_policy import (
    RequestLimits,
    check_sampling,
    constraint_problem,
    number_problem,
)

# ---------------------------------------------------------------------------------- unit tests


def _client(app_state: object | None = None):
    """A TestClient of the guard over a stand-in app that answers "ok" (with ``app_state`` as
    the ``state`` of the ``app`` in the ASGI scope, as Starlette sets it)."""
    from starlette.testclient import TestClient

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = RequestGuard(app, RequestLimits())

    async def with_app(scope, receive, send):
        if app_state is not None:
            scope["app"] = SimpleNamespace(state=app_state)
        await guard(scope, receive, send)

    return TestClient(with_app)


def test_guard_refuses_json_nested_too_deeply_to_parse():
    client = _client()
    for body in (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                 b'{"prompt": "x", "user": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"):
        r = client.post("/v1/completions", content=body)
        assert r.status_code == 400, r.text  # was 500 (RecursionError in the guard)
        assert "nests JSON arrays/objects too deeply" in r.json()["error"]["message"]
    shallow = b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}"
    assert client.post("/v1/completions", content=shallow).text == "ok"  # vLLM's to judge


def test_text_check_walks_deep_values_without_recursion():
    deep: object = "a\ud800"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(RequestRejected, match="U\\+D800 at character 1"):
        check_text({"prompt": deep})


def test_number_problem_names_integers_beyond_64_bits_and_non_finite_numbers():
    assert number_problem({"top_k": 2**63 - 1, "seed": -(2**63), "n": True,
                           "logit_bias": {"5": -100.0}, "stop_token_ids": [1, 2]}) is None
    cases = {
        "top_k": (10**20, "top_k = 100000000000000000000 is outside the 64-bit integer range"),
        "stream_interval": (2**64, "stream_interval = 18446744073709551616 is outside"),
        "stop_token_ids": ([1, -(2**63) - 1], "stop_token_ids[1] = -9223372036854775809"),
        "logit_bias": ({"5": float("nan")}, "logit_bias['5'] is nan; numbers must be finite"),
        "temperature": (float("inf"), "temperature is inf; numbers must be finite"),
        "prompt": (["x", 10**400], "(401 digits)"),
    }
    for name, (value, words) in cases.items():
        message, field = number_problem({"max_tokens": 4, name: value})
        assert field == name and words in message, (name, message)


def test_validate_request_refuses_what_the_engine_would_fail_on():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from vllm_unified.compat import VLLMValidationError
    from vllm_unified.platform import MLXPlatform

    regex = StructuredOutputsParams(regex="[0-9]+")
    for params, field in ((SamplingParams(top_k=10**20), "top_k"),
                          (SamplingParams(stream_interval=2**70), "stream_interval"),
                          (SamplingParams(logit_bias={5: float("nan")}), "logit_bias"),
                          (SamplingParams(structured_outputs=regex, allowed_token_ids=[5]),
                           "allowed_token_ids"),
                          (SamplingParams(structured_outputs=regex, bad_words=["1"]),
                           "bad_words")):
        with pytest.raises(VLLMValidationError) as e:
            MLXPlatform.validate_request({}, params)
        assert e.value.parameter == field
    # each alone is served
    for params in (SamplingParams(structured_outputs=regex), SamplingParams(bad_words=["1"]),
                   SamplingParams(allowed_token_ids=[5], top_k=2**63 - 1)):
        check_sampling(params, RequestLimits())
    assert constraint_problem({"structured_outputs": None, "bad_words": ["x"]}) is None


def test_check_model_names_the_field_vllms_validators_crash_on():
    for endpoint, body in (("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}],
                             "structured_outputs": [1]}),
                           ("/v1/completions", {"prompt": "hi", "structured_outputs": "x"})):
        with pytest.raises(RequestRejected, match="field 'structured_outputs' of") as e:
            check_model(body, endpoint)  # vLLM: AttributeError -> HTTP 500
        assert e.value.param == "structured_outputs"
    # what vLLM answers with a 4xx itself stays vLLM's: a TypeError (400), a ValidationError
    check_model({"messages": 5}, "/v1/chat/completions")
    check_model({"prompt": "hi", "max_tokens": "ten"}, "/v1/completions")
    check_model({"prompt": "hi", "structured_outputs": {"choice": ["a"]}}, "/v1/completions")


def test_beam_search_with_structured_output_is_refused():
    for body in ({"use_beam_search": True, "structured_outputs": {"choice": ["a"]}},
                 {"use_beam_search": True, "response_format": {"type": "json_object"}}):
        with pytest.raises(RequestRejected, match="vLLM's beam search does not apply"):
            check_beam_search(body)
    check_beam_search({"use_beam_search": True, "response_format": {"type": "text"}})
    check_beam_search({"use_beam_search": False, "structured_outputs": {"choice": ["a"]}})


def test_conditional_routes_answer_404_with_the_reason():
    config = SimpleNamespace(parallel_config=SimpleNamespace(enable_elastic_ep=False),
                             model_config=SimpleNamespace(architecture="LlamaForCausalLM",
                                                          logprobs_mode="raw_logits"))
    client = _client(SimpleNamespace(vllm_config=config, serving_structured_decisions=None))
    r = client.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
    assert r.status_code == 404  # vLLM: 500 "Scale failed"
    assert "--enable-elastic-ep" in r.json()["error"]["message"]
    r = client.post("/v1/systemone", json={"questions": {}})
    assert r.status_code == 404  # vLLM: 501
    assert "does not support LlamaForCausalLM" in r.json()["error"]["message"]
    served = _client(SimpleNamespace(vllm_config=config, serving_structured_decisions=object()))
    assert served.post("/v1/systemone", json={"questions": {}}).text == "ok"


def test_guard_applies_the_server_patches_when_built(monkeypatch):
    """vLLM builds the guard with its app: that is where the server-code patches are applied
    (a merge once left these calls unreachable, and the fixes silently off)."""
    from vllm_unified import patches

    called = []
    for name in ("patch_anthropic_stream_errors", "patch_responses_empty_output_message"):
        monkeypatch.setattr(patches, name, lambda name=name: called.append(name))
    RequestGuard(lambda scope, receive, send: None, RequestLimits())
    assert called == ["patch_anthropic_stream_errors", "patch_responses_empty_output_message"]


def test_anthropic_stream_passes_the_chat_streams_error_on():
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    from vllm_unified import patches

    patches.patch_anthropic_stream_errors()
    patches.patch_anthropic_stream_errors()  # idempotent
    error = {"message": "top_k = 1 is bad", "type": "BadRequestError", "param": "top_k",
             "code": 400}
    closed = []

    async def chat_stream():
        try:
            yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            closed.append(True)

    async def events() -> list[str]:
        converter = AnthropicServingMessages.message_stream_converter
        return [e async for e in converter(object.__new__(AnthropicServingMessages),
                                           chat_stream())]

    out = "".join(asyncio.run(events()))
    assert out.startswith("event: error\n"), out  # was internal_error with pydantic's text
    data = json.loads(out.split("data: ", 1)[1])
    assert data == {"type": "error", "error": {"type": "BadRequestError",
                                               "message": "top_k = 1 is bad"}}
    assert closed == [True]
    assert stream_server_error("data: " + json.dumps(data)) is None
    assert stream_server_error('data: {"error": {"code": 500, "message": ""}}') is not None


def test_responses_output_message_without_content_is_a_validation_error():
    from vllm.entrypoints.openai.responses import utils
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    from vllm_unified import patches
    from vllm_unified.compat import VLLMValidationError

    patches.patch_responses_empty_output_message()
    patches.patch_responses_empty_output_message()  # idempotent

    def items(content: list) -> list:
        return ResponsesRequest.model_validate({"model": "m", "input": [
            {"type": "message", "role": "assistant", "content": content,
             "status": "completed", "id": "m1"}]}).input

    with pytest.raises(VLLMValidationError, match="has no content"):  # was IndexError: 500
        utils.construct_chat_messages_with_tool_call(items([]))
    text = [{"type": "output_text", "text": "hi", "annotations": []}]
    assert utils.construct_chat_messages_with_tool_call(items(text)) == [
        {"role": "assistant", "content": "hi"}]


def test_a_source_schemathesis_cannot_generate_is_reported_and_the_run_goes_on(monkeypatch):
    """schemathesis raises UnsupportedSchema for some negative cases (a `not` below the root),
    at draw time and not for every seed (a CI run hit it): the source is named in the report
    with the reason, not drawn from again, and the other sources still fill the run."""
    from api_fuzz import FuzzRequest
    from hypothesis import strategies as st
    from schemathesis.core.errors import UnsupportedSchema

    def unsupported(_: object) -> FuzzRequest:
        raise UnsupportedSchema("a `not` whose complement is not spelled out")

    sent: list[str] = []
    fuzzer = Fuzzer("http://127.0.0.1:9", "m")
    monkeypatch.setattr(Fuzzer, "check", lambda self: None)
    monkeypatch.setattr(Fuzzer, "run_batch", lambda self, batch: (
        sent.extend(r.source for r in batch), self.sources.update(r.source for r in batch)))
    good = st.integers(0, 10**6).map(lambda i: FuzzRequest("schema:positive:GET /x", "GET",
                                                           f"/x?{i}"))
    sources = {"schema:negative:GET /x": st.just(0).map(unsupported),
               "schema:positive:GET /x": good, "raw:/x": good}
    fuzzer.run(rounds(sources, 1, schema_batch=2), 12)
    report = fuzzer.report()
    assert report["unsupported_sources"] == {
        "schema:negative:GET /x": "a `not` whose complement is not spelled out"}
    assert report["requests"] == 12 == len(sent)
    assert "schema:negative:GET /x" not in report["by_source"]


# ------------------------------------------------------------------------- end to end (server)

MODEL = "tiny"
C, CHAT, MSG = "/v1/completions", "/v1/chat/completions", "/v1/messages"
HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def _c(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 4, **kw}


def _nested(depth: int) -> bytes:
    return b'{"model": "tiny", "max_tokens": 4, "prompt": ' + b"[" * depth + b"]" * depth + b"}"


#: (what the fuzzer sent, endpoint, JSON body or raw bytes, status, error param or None, words
#: of the message). Every one was an HTTP 500/501 (or an internal-error stream) before its fix.
REGRESSIONS = [
    ("JSON nested 2000 deep", C, _nested(2000), 400, None, "nests JSON arrays/objects too"),
    ("top_k beyond 64 bits", C, _c(top_k=10**20, temperature=1.0), 400, "top_k",
     "top_k = 100000000000000000000 is outside the 64-bit integer range"),
    ("top_k beyond 64 bits, streamed", CHAT, _chat(top_k=10**20, stream=True), 400, "top_k",
     "outside the 64-bit integer range"),
    ("stream_interval beyond 64 bits", C, _c(stream=True, stream_interval=10**20), 400,
     "stream_interval", "stream_interval = 100000000000000000000 is outside"),
    ("top_k beyond 64 bits on /v1/messages", MSG, _chat(top_k=10**20), 400, None,
     "top_k = 100000000000000000000 is outside"),
    ("NaN logit bias", C, b'{"model": "tiny", "prompt": "hi", "logit_bias": {"5": NaN}}', 400,
     "logit_bias", "logit_bias['5'] is nan"),
    ("structured_outputs as a list", CHAT, _chat(structured_outputs=[1]), 400,
     "structured_outputs", "field 'structured_outputs' of /v1/chat/completions"),
    ("regex with allowed_token_ids", C, _c(structured_outputs={"regex": "[0-9]+"},
                                           allowed_token_ids=[4809, 184]), 400,
     "allowed_token_ids", "allowed_token_ids cannot be combined with structured output"),
    ("JSON schema with allowed_token_ids", C, _c(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        allowed_token_ids=[4809, 184, 20331], n=2, temperature=1.0), 400, "allowed_token_ids",
     "cannot be combined with structured output"),
    ("choice with bad_words", C, _c(structured_outputs={"choice": ["a"]}, bad_words=["a"]),
     400, "bad_words", "bad_words cannot be combined"),
    ("beam search with structured output", C, _c(
        use_beam_search=True, n=2, structured_outputs={"choice": ["a", "b"]}), 400,
     "use_beam_search", "does not apply the constraint"),
    ("output message without content", "/v1/responses", {
        "model": MODEL, "max_output_tokens": 4, "input": [
            {"type": "message", "role": "assistant", "content": [], "status": "completed",
             "id": "m1"}, {"role": "user", "content": "hi"}]}, 400, "input",
     "an output message item (type 'message', role 'assistant') has no content"),
    ("structured decisions API", "/v1/systemone", {"questions": {}, "state": None}, 404, None,
     "is not available on this server: The structured decisions API does not support"),
    ("elastic EP scaling", "/scale_elastic_ep", {"new_data_parallel_size": 2}, 404, None,
     "--enable-elastic-ep"),
]


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama, tmp_path_factory):
    with vllm_server(tmp_path_factory.mktemp("fuzz-server"), server_args(tiny_llama, MODEL)
                     ) as served:
        yield served


def _post(base: str, endpoint: str, body: dict | bytes) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(base + endpoint, data=data, timeout=300,
                         headers={"Content-Type": "application/json"})


def _error(r: requests.Response) -> dict:
    error = r.json().get("error") or {}
    return error


@pytest.mark.engine
def test_fuzzer_findings_get_their_4xx(fuzz_server):
    base, proc = fuzz_server
    wrong = []
    for what, endpoint, body, status, param, words in REGRESSIONS:
        r = _post(base, endpoint, body)
        error = _error(r) if r.headers.get("content-type", "").startswith("application/json") \
            else {"message": r.text}
        if (r.status_code != status or words not in str(error.get("message"))
                or (param and error.get("param") != param)):
            wrong.append(f"{what}: HTTP {r.status_code}, {r.text[:300]}")
    assert not wrong, "\n".join(wrong)
    # A one-token prompt with prompt_logprobs killed the engine (every later request: 500).
    for prompt in ([11], [11, 12]):
        r = _post(base, C, _c(prompt=prompt, prompt_logprobs=3, max_tokens=3))
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["prompt_logprobs"]
        assert len(logprobs) == len(prompt) and logprobs[0] is None
        assert all(len(entry) >= 3 for entry in logprobs[1:])
    # A negative seed (vLLM takes any int64) killed the engine: MLX keys are unsigned.
    texts = []
    for seed in (-189, -189, -(2**63)):
        r = _post(base, C, _c(prompt="The capital of France is", seed=seed, temperature=1.0,
                              max_tokens=8))
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    # /v1/messages streamed: the platform's 400 arrives as an Anthropic error event of its type
    r = _post(base, MSG, _chat(top_k=10**20, stream=True))
    assert r.status_code == 200
    assert r.text.startswith("event: error\n"), r.text[:500]
    event = json.loads(r.text.split("data: ", 1)[1])
    assert event["error"]["type"] == "BadRequestError", event
    assert "outside the 64-bit integer range" in event["error"]["message"]
    assert proc.poll() is None and requests.get(f"{base}/health", timeout=30).status_code == 200


#: One round of :func:`api_fuzz.rounds` with 3 requests per schema operation and mode: every
#: operation is reached, half of the requests come from our generation and raw strategies.
FUZZ_REQUESTS = 300
FUZZ_SEED = 20


@pytest.mark.engine
@pytest.mark.slow  # a fuzz run; test_fuzzer_findings_get_their_4xx stays in CI
def test_fuzzing_finds_no_server_error(fuzz_server):
    base, proc = fuzz_server
    fuzzer = Fuzzer(base, MODEL, timeout_s=120, workers=4, alive=lambda: proc.poll() is None)
    sources = sources_for(base, MODEL)
    fuzzer.run(rounds(sources, FUZZ_SEED, schema_batch=3), FUZZ_REQUESTS)
    report = fuzzer.report()
    assert report["requests"] == FUZZ_REQUESTS
    assert not report["failed_requests"], json.dumps(report["failed_requests"], indent=1)[:8000]
    spec = requests.get(f"{base}/openapi.json", timeout=60).json()
    operations = {f"{m.upper()} {p}" for p, methods in spec["paths"].items() for m in methods}
    assert operations <= set(report["by_endpoint"]), operations - set(report["by_endpoint"])
    assert report["by_status"].get("200", 0) >= 30  # a good share reached the engine
    # schemathesis cannot make negative cases of some schemas (a `not` below the root): such a
    # source is reported; every operation's positive cases must still be generated
    unsupported = report["unsupported_sources"]
    assert all(name.startswith("schema:negative:") for name in unsupported), unsupported
    assert len(unsupported) <= len(operations) // 4, unsupported
    assert fuzzer.checks >= 10
