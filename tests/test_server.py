"""``vllm serve`` of the default model through our plugin, driven over HTTP like a user would.

One server for the module: the real ``vllm`` command of the environment, given the GGUF file
itself, with ``--max-num-batched-tokens 256`` so long prompts are chunked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from conftest import default_model_path

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PARIS = " Paris.\n\nThe answer is: 2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    vllm = Path(sys.executable).parent / "vllm"
    cmd = [str(vllm), "serve", default_model_path(), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL, "--max-model-len", "2048",
           "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes", str(512 * 2**20),
           "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {log_path.read_text()[-5000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise AssertionError(f"server not healthy: {log_path.read_text()[-5000:]}")
            time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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


def _stream_completion(base: str, prompt: str, **params) -> tuple[str, dict]:
    body = {"model": MODEL, "prompt": prompt, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **params}
    text, usage = [], None
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice.get("text") or "")
    return "".join(text), usage


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
