"""Bad and hostile input: a clear HTTP 4xx naming the problem, and the server keeps serving.

Unit tests (fast): the request policy settings, the HTTP request guard
(:mod:`vllm_unified.request_guard`) on a stand-in ASGI app, and that the platform installs
the guard through vLLM's own ``--middleware`` option when vLLM builds its ``serve`` parser.

End to end (``slow``, one ``vllm serve`` of the default model through our plugin): every bad
input of the list below is answered with its 4xx and a message naming the problem, while
streaming requests run back to back and each completes normally (all tokens, finish_reason,
the same text as the request alone); afterwards the process is up and ``/health`` is 200.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import default_server_args, stream_completion, vllm_server

from vllm_unified.request_guard import (
    GUARD_PATH,
    MIDDLEWARE,
    RequestGuard,
    RequestRejected,
    check_fields,
    check_text,
    known_fields,
)
from vllm_unified.request_policy import RequestLimits, check_sampling

# ---------------------------------------------------------------------------------- unit tests


def test_limits_from_env_defaults_and_errors():
    limits = RequestLimits.from_env({})
    # vLLM's contract by default: no body limit, unknown fields ignored; OpenAI's maximum n.
    assert (limits.max_n, limits.max_request_bytes, limits.unknown_fields) == (
        128, 0, "ignore")
    custom = RequestLimits.from_env({"VLLM_UNIFIED_MAX_N": "4",
                                     "VLLM_UNIFIED_MAX_REQUEST_BYTES": "1000",
                                     "VLLM_UNIFIED_UNKNOWN_FIELDS": "reject"})
    assert (custom.max_n, custom.max_request_bytes, custom.unknown_fields) == (4, 1000, "reject")
    for name, bad in (("VLLM_UNIFIED_MAX_N", "0"), ("VLLM_UNIFIED_MAX_REQUEST_BYTES", "1MB"),
                      ("VLLM_UNIFIED_UNKNOWN_FIELDS", "warn")):
        with pytest.raises(ValueError, match=f"{name}='{bad}'"):
            RequestLimits.from_env({name: bad})


def test_platform_validate_environ_checks_settings(monkeypatch):
    from vllm_unified.platform import MLXPlatform

    monkeypatch.setenv("VLLM_UNIFIED_MAX_N", "-3")
    with pytest.raises(ValueError, match="VLLM_UNIFIED_MAX_N='-3'"):
        MLXPlatform.validate_environ(hard_fail=False)


def test_check_sampling_limits():
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from vllm_unified.compat import VLLMValidationError

    limits = RequestLimits(max_n=8)
    check_sampling(SamplingParams(n=8, temperature=1.0), limits)
    with pytest.raises(VLLMValidationError, match="n=9 exceeds .* limit of 8 .*VLLM_UNIFIED_MAX_N"):
        check_sampling(SamplingParams(n=9, temperature=1.0), limits)
    streamed = dict(n=2, temperature=1.0, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
    with pytest.raises(VLLMValidationError, match="streaming with n > 1 and prompt logprobs"):
        check_sampling(SamplingParams(**streamed), limits)
    # each alone is served
    check_sampling(SamplingParams(**{**streamed, "n": 1}), limits)
    check_sampling(SamplingParams(**{**streamed, "output_kind": RequestOutputKind.FINAL_ONLY}),
                   limits)


def test_platform_validate_request_applies_limits():
    """The same limits reach offline ``LLM`` use through vLLM's per-request platform hook."""
    from vllm.sampling_params import SamplingParams

    from vllm_unified.compat import VLLMValidationError
    from vllm_unified.platform import MLXPlatform

    MLXPlatform.validate_request({}, SamplingParams(n=128, temperature=1.0))
    with pytest.raises(VLLMValidationError, match="n=129 exceeds") as e:
        MLXPlatform.validate_request({}, SamplingParams(n=129, temperature=1.0))
    assert e.value.parameter == "n"


def test_prompt_filling_the_context_is_refused_naming_length_and_limit(monkeypatch):
    """A prompt of exactly ``--max-model-len`` tokens: vLLM's OpenAI server lowers
    ``max_tokens`` to ``max_model_len - prompt_len`` (``get_max_tokens``, which asks the
    platform for its own cap) and then rejects its own 0 as "max_tokens must be at least 1,
    got 0". The platform's cap refuses the prompt instead, naming its length and the limit;
    one token shorter is served."""
    import types

    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    from vllm_unified.compat import VLLMValidationError
    from vllm_unified.platform import MLXPlatform

    monkeypatch.setattr(MLXPlatform, "serving_model_config",
                        types.SimpleNamespace(max_model_len=256), raising=False)
    assert get_max_tokens(256, 50, 255, {}) == 1
    assert get_max_tokens(256, None, 200, {}) == 56
    for max_tokens in (50, None):
        with pytest.raises(VLLMValidationError,
                           match="maximum context length is 256 tokens.*contains 256 input "
                                 "tokens.*at most 255 tokens") as e:
            get_max_tokens(256, max_tokens, 256, {})
        assert e.value.parameter == "input_tokens"


def test_check_fields(caplog):
    known = known_fields("CompletionRequest")
    assert {"prompt", "max_tokens", "structured_outputs", "vllm_xargs"} <= known
    reject, ignore = RequestLimits(unknown_fields="reject"), RequestLimits()
    check_fields({"prompt": "x", "structured_outputs": {"choice": ["a"]}}, known, "/c", reject)
    with pytest.raises(RequestRejected, match="unknown field.*'foo'.*VLLM_UNIFIED_UNKNOWN_FIELDS"):
        check_fields({"prompt": "x", "foo": 1}, known, "/c", reject)
    check_fields({"prompt": "x", "foo": 1}, known, "/c", ignore)
    # a removed guided field loses its constraint: refused under reject, named in a warning
    # (with its replacement) by default, as vLLM serves it
    with pytest.raises(RequestRejected, match="'guided_choice' was removed") as e:
        check_fields({"prompt": "x", "guided_choice": ["a"]}, known, "/c", reject)
    assert e.value.param == "guided_choice"
    assert "structured_outputs" in str(e.value)
    with caplog.at_level(logging.WARNING):
        check_fields({"prompt": "x", "guided_regex": "a+"}, known, "/c", ignore)
    assert "'guided_regex' was removed" in caplog.text and "structured_outputs" in caplog.text


def test_check_text_names_lone_surrogate():
    check_text({"prompt": "a\U0001F600b", "x": [{"y": "\x00\x01"}]})
    with pytest.raises(RequestRejected, match=r"'messages\[0\].content'.*U\+D800 at character 2"):
        check_text({"messages": [{"content": "ab\ud800"}]})


def _guard_client(**limits):
    from starlette.testclient import TestClient

    seen = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return TestClient(RequestGuard(app, RequestLimits(**limits))), seen


def test_guard_passes_body_through_and_rejects():
    client, seen = _guard_client(max_request_bytes=1000, unknown_fields="reject")
    good = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}).encode()
    assert client.post("/v1/completions", content=good).text == "ok"
    assert seen == [good]  # the app gets the very bytes the client sent
    junk = b"{not json"  # left to vLLM, which names the position
    assert client.post("/v1/completions", content=junk).text == "ok"
    assert client.post("/other", content=b'{"foo": 1}').text == "ok"  # only known endpoints

    r = client.post("/v1/completions", content=b"x" * 1001)
    assert r.status_code == 413
    error = r.json()["error"]
    assert "1001 bytes" in error["message"] and "limit of 1000" in error["message"]
    assert "VLLM_UNIFIED_MAX_REQUEST_BYTES" in error["message"]

    cases = {
        b'{"messages": "a\xff"}': (None, "not valid UTF-8 (byte 0xff at offset 15)"),
        b'{"messages": "a\\udc00"}': ("messages", "lone UTF-16 surrogate (U+DC00"),
        b'{"messages": [], "tempreature": 1}': ("tempreature", "unknown field(s) 'tempreature'"),
    }
    for body, (param, words) in cases.items():
        r = client.post("/v1/chat/completions", content=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param
        assert words in r.json()["error"]["message"]
    assert len(seen) == 3


def test_unknown_fields_are_served_with_a_warning_by_default(monkeypatch):
    """vLLM's contract: a request with unknown top-level fields reaches vLLM unchanged (which
    drops them); the guard logs a warning naming them, once per set of names."""
    from vllm_unified import request_guard

    warnings = []
    monkeypatch.setattr(request_guard.logger, "warning",
                        lambda msg, *args: warnings.append(msg % args))
    monkeypatch.setattr(request_guard, "_warned", set())
    client, seen = _guard_client()
    body = json.dumps({"messages": [], "tempreature": 1, "user_id": "x"}).encode()
    for _ in range(2):
        r = client.post("/v1/chat/completions", content=body)
        assert r.status_code == 200 and r.text == "ok"
    assert seen == [body, body]
    assert len(warnings) == 1
    assert "'tempreature', 'user_id'" in warnings[0] and "/v1/chat/completions" in warnings[0]
    assert "VLLM_UNIFIED_UNKNOWN_FIELDS=reject" in warnings[0]


def test_three_image_chat_passes_the_guard_by_default():
    """Three 1024x1024 PNGs of noise as data URLs (a body of about 12 MiB) reach vLLM as sent:
    by default the guard has no body limit, as vLLM and uvicorn have none."""
    from conftest import image_chat_body

    client, seen = _guard_client()
    body = json.dumps(image_chat_body("m")).encode()
    assert len(body) > 12 * 10**6
    r = client.post("/v1/chat/completions", content=body)
    assert r.status_code == 200 and r.text == "ok"
    assert seen == [body]


def test_platform_installs_guard_in_vllm_serve_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert type(current_platform).__name__ == "MLXPlatform"
    parser = make_arg_parser(FlexibleArgumentParser())
    ours = list(MIDDLEWARE)
    assert GUARD_PATH in ours
    assert parser.parse_args(["m"]).middleware == ours
    assert parser.parse_args(["m", "--middleware", "a.B"]).middleware == [*ours, "a.B"]
    assert parser.parse_args(["m"]).middleware == ours  # the default is not mutated


# ------------------------------------------------------------------------- end to end (server)

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
C, CHAT = "/v1/completions", "/v1/chat/completions"
STREAM_PROMPT = "Count from one to twenty:"
STREAM_TOKENS = 16
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _c(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def _chat(messages, **kw) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **kw}


def _served_app(runner: str, tasks: tuple[str, ...], paths: list[str]):
    """A TestClient of a FastAPI app set up as vLLM's server app is for the guard: ``paths``
    registered, ``state.vllm_config`` with ``runner``, a pooling server's tasks on its
    ``/pooling`` handler, the guard installed as user middleware."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from starlette.testclient import TestClient

    app = FastAPI()
    for path in paths:
        app.add_api_route(path, lambda: {"ok": True}, methods=["POST"])
    app.state.vllm_config = SimpleNamespace(model_config=SimpleNamespace(runner_type=runner))
    if runner == "pooling":
        app.state.serving_pooling = SimpleNamespace(supported_tasks=tasks)
    app.add_middleware(RequestGuard, limits=RequestLimits())
    return TestClient(app)


def test_other_tasks_routes_are_400_naming_the_server():
    """vLLM registers no route for tasks the server does not run (its answer is 404): the
    guard answers the other kind's routes (from vLLM's own routers) with 400 naming the
    server's runner and tasks; served routes and unknown paths are left to vLLM."""
    pooling = _served_app("pooling", ("embed", "token_embed"), ["/v1/embeddings", "/pooling"])
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                 "/v1/responses/resp-1/cancel", "/v1/messages", "/inference/v1/generate"):
        r = pooling.post(path, json={"model": "m", "prompt": "hi"})
        assert r.status_code == 400, (path, r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        for words in ("pooling (embeddings, scores, classification) model",
                      "tasks: embed, token_embed", f"POST {path} is a text generation route"):
            assert words in error["message"], (path, error)
    r = pooling.post("/classify", json={"input": ["a"]})  # a pooling route of another task
    assert r.status_code == 400 and "serves the tasks embed, token_embed" in r.text, r.text
    assert pooling.post("/v1/embeddings", json={"input": ["a"]}).json() == {"ok": True}
    assert pooling.post("/no/such/route", json={}).status_code == 404

    generate = _served_app("generate", (), ["/v1/completions"])
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/score",
                 "/v1/score", "/classify", "/pooling"):
        r = generate.post(path, json={"model": "m", "input": ["a"]})
        assert r.status_code == 400, (path, r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert ("text generation model (--runner generate, tasks: generate)" in message
                and f"POST {path} is a pooling" in message and "--runner pooling" in message)
    good = {"model": "m", "prompt": "hi", "max_tokens": 3}
    assert generate.post("/v1/completions", json=good).json() == {"ok": True}
    assert generate.post("/no/such/route", json={}).status_code == 404


def _raw(prompt_json: bytes) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4, "prompt": ' + prompt_json + b"}"


#: (what, endpoint, JSON body or raw bytes, HTTP status, error param or None, words of the
#: message). vLLM's own front end answers most; ``request_guard``/``request_policy`` the rest.
#: The server runs with the guard's opt-in limits (:data:`OPT_IN`): unknown fields refused,
#: a 4 MiB body limit.
BAD_INPUTS = [
    ("empty prompt", C, _c(prompt=""), 400, "prompt", "must be provided and non-empty"),
    ("empty chat", CHAT, _chat([]), 400, None, "empty conversation"),
    ("prompt longer than max_model_len", C, _c(prompt="hello " * (MAX_MODEL_LEN + 10)), 400,
     "input_tokens", f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("prompt of exactly max_model_len tokens", C, _c(prompt=[1] * MAX_MODEL_LEN, max_tokens=5),
     400, "input_tokens", f"maximum context length is {MAX_MODEL_LEN} tokens (--max-model-len) "
     f"and your prompt contains {MAX_MODEL_LEN} input tokens"),
    ("max_tokens 0", C, _c(max_tokens=0), 400, "max_tokens", "max_tokens must be at least 1"),
    ("max_tokens negative", C, _c(max_tokens=-1), 400, "max_tokens", "at least 1, got -1"),
    ("max_tokens huge", C, _c(max_tokens=10**9), 400, "max_tokens",
     f"cannot be greater than max_model_len={MAX_MODEL_LEN}"),
    ("temperature negative", C, _c(temperature=-0.5), 400, "temperature",
     "temperature must be non-negative"),
    ("top_p 0", C, _c(top_p=0), 400, "top_p", "top_p must be in (0, 1], got 0.0"),
    ("top_p above 1", C, _c(top_p=1.5), 400, "top_p", "top_p must be in (0, 1], got 1.5"),
    ("logprobs above 20", C, _c(logprobs=1000), 400, "logprobs", "greater than max allowed: 20"),
    ("unknown field", C, _c(tempreature=0.0), 400, "tempreature",
     "unknown field(s) 'tempreature'"),
    ("unknown chat field", CHAT, _chat([{"role": "user", "content": "hi"}], foo=1), 400, "foo",
     "unknown field(s) 'foo' for /v1/chat/completions"),
    ("removed guided_choice", C, _c(guided_choice=["yes", "no"]), 400, "guided_choice",
     '"structured_outputs": {"choice"'),
    ("removed guided_json", CHAT, _chat([{"role": "user", "content": "hi"}], guided_json={}),
     400, "guided_json", "'guided_json' was removed"),
    ("wrong type max_tokens", C, _c(max_tokens="ten"), 400, "body.max_tokens",
     "valid integer"),
    ("wrong type temperature", C, _c(temperature="hot"), 400, "body.temperature",
     "valid number"),
    ("wrong type messages", CHAT, _chat("hi"), 400, "body.messages", "valid list"),
    ("malformed JSON", C, b'{"model": "x", "prompt": ', 400, None, "JSON decode error"),
    ("invalid UTF-8", C, _raw(b'"caf\xc3\xa9 \xff\xfe"'), 400, None,
     "not valid UTF-8 (byte 0xff"),
    ("raw control character", C, _raw(b'"a\x01b"'), 400, None, "Invalid control character"),
    ("lone surrogate", C, _raw(b'"a\\ud800b"'), 400, "prompt",
     "lone UTF-16 surrogate (U+D800 at character 1)"),
    ("lone surrogate in chat", CHAT, _chat([{"role": "user", "content": "x\udfff"}]), 400,
     "messages[0].content", "lone UTF-16 surrogate (U+DFFF"),
    ("token id outside the vocabulary", C, _c(prompt=[1, 2, 10**6]), 400, None,
     "Token id 1000000 is out of vocabulary"),
    ("negative token id", C, _c(prompt=[1, -5]), 400, "body.prompt.1",
     "greater than or equal to 0"),
    ("n 0", C, _c(n=0), 400, None, "n must be at least 1"),
    ("n 10000", C, _c(n=10000, temperature=1.0), 400, "n",
     "n=10000 exceeds this server's limit of 128"),
    ("n 10000 streamed", C, _c(n=10000, temperature=1.0, stream=True), 400, "n",
     "n=10000 exceeds"),
    ("5 MB body", C, _c(junk="x" * 5_000_000), 413, None,
     "exceeds this server's limit of 4194304 bytes"),
    ("malformed JSON schema", C, _c(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": "not-an-object"}}}), 400, None,
     "Grammar error: properties must be an object"),
    ("unknown JSON schema type", CHAT, _chat([{"role": "user", "content": "hi"}],
     response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "no-such-type"}}}), 400, None,
     "Grammar error: Invalid type: no-such-type"),
    ("embeddings on a generating server", "/v1/embeddings", {"model": MODEL, "input": ["hi"]},
     400, None, "POST /v1/embeddings is a pooling (embeddings, scores, classification) route"),
    ("streaming n > 1 with echo and logprobs", C,
     _c(n=2, echo=True, logprobs=1, stream=True, temperature=1.0), 400, "n",
     "streaming with n > 1 and prompt logprobs"),
]


#: The guard's stricter settings (off by default: vLLM's contract), as an operator sets them.
OPT_IN = {"VLLM_UNIFIED_UNKNOWN_FIELDS": "reject", "VLLM_UNIFIED_MAX_REQUEST_BYTES": str(4 * 2**20)}


@pytest.fixture(scope="module")
def bad_input_server(tmp_path_factory):
    args = [*default_server_args(MODEL), "--max-model-len", str(MAX_MODEL_LEN)]
    with vllm_server(tmp_path_factory.mktemp("bad-input-server"), args, OPT_IN) as served:
        yield served


def _post(base: str, endpoint: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(base + endpoint, data=data, timeout=300,
                      headers={"Content-Type": "application/json"})
    try:
        return r.status_code, r.json().get("error") or {}
    except ValueError:
        return r.status_code, {"message": r.text}


def _stream(base: str, started: threading.Event) -> tuple[str, str | None, dict | None]:
    """One streamed greedy completion: (text, finish_reason, usage)."""
    body = {"model": MODEL, "prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    return stream_completion(base, body, started)


@pytest.mark.engine
def test_bad_inputs_answered_while_streams_complete(bad_input_server):
    base, proc = bad_input_server
    alone = requests.post(f"{base}{C}", timeout=300, json={
        "model": MODEL, "prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS,
        "temperature": 0.0, "ignore_eos": True}).json()["choices"][0]["text"]

    started, done = threading.Event(), threading.Event()

    def streams_until_done() -> list[tuple[str, str | None, dict | None]]:
        outs = [_stream(base, started)]  # back to back, so one is always running
        while not done.is_set():
            outs.append(_stream(base, started))
        return outs

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(streams_until_done)
        assert started.wait(300), "the streaming request produced nothing"
        answers = [_post(base, endpoint, body) for _, endpoint, body, *_ in BAD_INPUTS]
        done.set()
        outs = streaming.result(timeout=600)

    wrong = []
    for (what, _, _, status, param, words), (code, error) in zip(BAD_INPUTS, answers,
                                                                  strict=True):
        message = str(error.get("message", ""))
        if code != status or words not in message or (param and error.get("param") != param):
            wrong.append(f"{what}: HTTP {code}, {error}")
    assert not wrong, "\n".join(wrong)

    for text, finish, usage in outs:
        assert finish == "length"
        assert usage is not None and usage["completion_tokens"] == STREAM_TOKENS
        assert text == alone
    assert proc.poll() is None, "the server process died"
    assert requests.get(f"{base}/health", timeout=30).status_code == 200


@pytest.mark.engine
def test_chat_filling_the_context_names_length_and_limit(bad_input_server):
    """The same on the chat endpoint: a conversation whose templated prompt is
    exactly ``--max-model-len`` tokens gets a 400 naming both numbers (it used to be "max_tokens
    must be at least 1, got 0", whatever max_tokens the client sent); one token less is
    served."""
    base, _ = bad_input_server

    def templated(words: int) -> tuple[list[dict], int]:
        messages = [{"role": "user", "content": "hello " * words}]
        r = requests.post(f"{base}/tokenize", json={"model": MODEL, "messages": messages},
                          timeout=60)
        assert r.status_code == 200, r.text
        return messages, r.json()["count"]

    words = MAX_MODEL_LEN // 2
    for _ in range(4):  # "hello " is one token each here; converge in case it is not
        messages, count = templated(words)
        if count == MAX_MODEL_LEN:
            break
        words += MAX_MODEL_LEN - count
    assert count == MAX_MODEL_LEN
    for limit in ({"max_tokens": 5}, {"max_completion_tokens": 5}, {}):
        status, error = _post(base, CHAT, {"model": MODEL, "messages": messages, **limit})
        assert status == 400, error
        assert error["param"] == "input_tokens", error
        assert (f"maximum context length is {MAX_MODEL_LEN} tokens (--max-model-len) and your "
                f"prompt contains {MAX_MODEL_LEN} input tokens") in error["message"], error
    messages, count = templated(words - 1)
    assert count == MAX_MODEL_LEN - 1
    r = requests.post(f"{base}{CHAT}", json={"model": MODEL, "messages": messages,
                                            "max_tokens": 5, "temperature": 0.0}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.engine
def test_served_with_vllm_semantics(bad_input_server):
    """What vLLM itself accepts stays accepted: an output budget past max_model_len is
    lowered to what fits (finish_reason tells), top_k=-1 means "no top-k", escaped control
    characters and surrogate pairs are text."""
    base, _ = bad_input_server
    long_prompt = "hello " * (MAX_MODEL_LEN - 10)
    r = requests.post(f"{base}{C}", json=_c(prompt=long_prompt, max_tokens=100), timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == MAX_MODEL_LEN
    for body in (_c(top_k=-1, temperature=1.0), _raw(b'"tab\\u0009 nul\\u0000 \\ud83d\\ude00"')):
        status, error = _post(base, C, body)
        assert status == 200, error
