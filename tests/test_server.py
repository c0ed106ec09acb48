"""``vllm serve`` of the default model through our plugin, driven over HTTP like a user would.

One server for the module: the real ``vllm`` command of the environment, given the GGUF file
itself, with ``--max-num-batched-tokens 256`` so long prompts are chunked, and vLLM's tool
calling (``--enable-auto-tool-choice --tool-call-parser pythonic``).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import default_server_args, image_chat_body, stream_completion, vllm_server

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
PARIS = " Paris.\n\nThe answer is: 2"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The module's server with the default settings: its base URL and its log file."""
    # vLLM needs a tool parser for any tool_choice; pythonic needs no special tokens
    # (SmolLM2's chat template has no tool markup).
    args = [*default_server_args(MODEL), "--enable-auto-tool-choice",
            "--tool-call-parser", "pythonic"]
    log_dir = tmp_path_factory.mktemp("server")
    with vllm_server(log_dir, args) as (base, _):
        yield base, log_dir / "server.log"


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _complete(base: str, prompt: str, **params) -> dict:
    body = {"model": MODEL, "prompt": prompt, "temperature": 0.0, **params}
    r = requests.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(base: str, content: str, **params) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0.0, **params}
    r = requests.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _stream_chat(base: str, content: str, max_tokens: int) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0.0, "max_tokens": max_tokens, "stream": True}
    text = []
    with requests.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            text.append(delta.get("content") or "")
    return "".join(text)


def _metrics(base: str) -> dict[str, float]:
    """Sum of each vLLM metric's samples (over label sets) from /metrics."""
    out: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_completion_known_output(server):
    out = _complete(server, "The capital of France is", max_tokens=10)
    assert out["choices"][0]["text"] == PARIS
    assert out["usage"]["completion_tokens"] == 10


def test_chat_uses_gguf_template(server):
    answer = _chat(server, "What is the capital of France?", max_tokens=30)
    assert "Paris" in answer


def test_concurrent_streams_equal_alone(server):
    questions = [f"Name one fact about the number {i}." for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda q: _stream_chat(server, q, 24), questions))
    alone = [_stream_chat(server, q, 24) for q in questions]
    assert all(together)
    assert together == alone


def test_long_prompt_chunked_and_prefix_cached(server):
    words = ("The quick brown fox jumps over the lazy dog while the curious cat watches "
             "from the warm windowsill and counts the passing clouds. ")
    prompt = words * 60 + "\nSummarize the story in one sentence:"
    before = _metrics(server)
    first = _complete(server, prompt, max_tokens=16)
    second = _complete(server, prompt, max_tokens=16)
    after = _metrics(server)
    assert 1300 <= first["usage"]["prompt_tokens"] <= 1700
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
    assert hits >= 1024  # the second request reused the first one's full blocks


def test_abort_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 400,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    with requests.post(f"{server}/v1/completions", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break  # client disconnects mid-stream
    with ThreadPoolExecutor(5) as pool:
        outs = list(pool.map(lambda i: _complete(server, f"Question {i}: 2+2=", max_tokens=8),
                             range(10)))
    assert all(o["choices"][0]["finish_reason"] in ("length", "stop") for o in outs)
    deadline = time.time() + 60
    while True:
        m = _metrics(server)
        if m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:kv_cache_usage_perc") == 0:
            break
        assert time.time() < deadline, f"blocks not released: {m}"
        time.sleep(1)


def test_bad_request_gets_400_naming_field(server):
    # vllm_xargs become SamplingParams.extra_args, which vllm-unified refuses
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "vllm_xargs": {"x": 1}}
    r = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert "extra_args" in r.text
    still = _complete(server, "The capital of France is", max_tokens=10)
    assert still["choices"][0]["text"] == PARIS


def test_unknown_fields_are_ignored_with_a_warning(served):
    """vLLM's API contract by default: unknown top-level fields (as LangChain or LiteLLM send)
    are dropped and the request served as without them; the server log names them."""
    base, log = served
    out = _complete(base, "The capital of France is", max_tokens=10, tempreature=0.0)
    assert out["choices"][0]["text"] == PARIS
    assert _chat(base, "Hi", max_tokens=3, client_meta={"trace": 1}) == _chat(
        base, "Hi", max_tokens=3)
    text = log.read_text()
    for endpoint, field in (("/v1/completions", "tempreature"),
                            ("/v1/chat/completions", "client_meta")):
        assert re.search(rf"present in the request but ignored \({endpoint}\): '{field}'",
                         text), f"no warning for {field}"


def test_three_image_chat_is_not_refused_by_the_guard(server):
    """Three 1024x1024 noise PNGs as data URLs (~12 MiB): no 413, no answer of the guard.
    The served model is text-only, so vLLM itself may refuse the images; then it says so."""
    r = requests.post(f"{server}/v1/chat/completions", json=image_chat_body(MODEL), timeout=300)
    assert r.status_code != 413, r.text[:500]
    assert "exceeds this server's limit" not in r.text, r.text[:500]
    if r.status_code != 200:
        assert r.status_code < 500, r.text[:500]
    assert _complete(server, "The capital of France is", max_tokens=10)["choices"][0][
        "text"] == PARIS


def _stream_completion(base: str, prompt: str, **params) -> tuple[str, dict]:
    body = {"model": MODEL, "prompt": prompt, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **params}
    text, _, usage = stream_completion(base, body)
    return text, usage


def test_streaming_and_non_streaming_agree(server):
    """Same text and usage for 5 requests, streamed (with include_usage) or not."""
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
               "The three primary colors are", "Water boils at"]
    for prompt in prompts:
        whole = _complete(server, prompt, max_tokens=20)
        text, usage = _stream_completion(server, prompt, max_tokens=20)
        assert text == whole["choices"][0]["text"], prompt
        assert usage is not None, "include_usage sent no usage chunk"
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert usage[key] == whole["usage"][key], (prompt, key)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                       "properties": {"zone": {"type": "string"}}}}}


def _valid_weather_args(arguments: str) -> bool:
    args = json.loads(arguments)
    return (set(args) == {"city", "unit"} and isinstance(args["city"], str)
            and args["unit"] in ("celsius", "fahrenheit"))


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_calling(server, tool_choice):
    """A named tool_choice (and "required") goes through vLLM's tool machinery: the output is
    constrained to the tool's parameter schema by structured output on our logits, and the
    server returns it as a parsed tool_calls entry."""
    body = {"model": MODEL, "temperature": 0.0, "max_tokens": 80, "tools": [TIME, WEATHER],
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tool_choice": tool_choice}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    calls = message["tool_calls"]
    assert len(calls) >= 1, message
    if tool_choice != "required":
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
    for call in calls:
        assert call["type"] == "function" and call["id"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        assert name in ("get_weather", "get_time"), call
        if name == "get_weather":
            assert _valid_weather_args(arguments), arguments
        else:
            assert isinstance(json.loads(arguments)["zone"], str), arguments
