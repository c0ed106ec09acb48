"""Security of what the plugin adds to vLLM's HTTP server, in process (no engine):

* the request guard and vLLM's own body parser (``json.loads`` of the bytes, through
  Starlette's ``Request.json``) agree on what every body says: a body vLLM would decode
  differently from UTF-8 (byte order mark, UTF-16/32), a key given twice, a compressed body,
  a chunked body are each refused or checked, never passed unchecked;
* vLLM's ``--api-key`` protects what we add: on an app assembled by vLLM's own
  ``init_entrypoints_middleware`` with our middleware, an unauthenticated request gets vLLM's
  401, whatever its body, and never an answer of the guard;
* a client that stops reading has its response abandoned after the stalled-client timeout,
  and the response's generator (vLLM's request) is closed.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from vllm_unified.request_guard import MIDDLEWARE, RequestGuard, parse_body
from vllm_unified.request_policy import RequestLimits
from vllm_unified.stalled_clients import StalledClientTimeout

C = "/v1/completions"
GOOD = {"model": "m", "prompt": "hi", "max_tokens": 3}


def _guard_client(**limits):
    seen = []

    async def app(scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        seen.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return TestClient(RequestGuard(app, RequestLimits(**limits))), seen


def _unknown_field_body() -> dict:
    return {**GOOD, "tempreature": 0.0}


@pytest.mark.parametrize("encode,words", [
    (lambda s: b"\xef\xbb\xbf" + s.encode(), "UTF-8 byte order mark"),
    (lambda s: s.encode("utf-16-le"), "reads as UTF-16-LE"),
    (lambda s: s.encode("utf-16-be"), "reads as UTF-16-BE"),
    (lambda s: s.encode("utf-32-le"), "reads as UTF-32-LE"),
], ids=["utf8-bom", "utf16le", "utf16be", "utf32le"])
def test_body_vllm_would_decode_otherwise_is_refused(encode, words):
    """vLLM's parser reads these bodies (``json.loads`` detects the encoding), so a guard that
    only parsed UTF-8 text would pass them on unchecked: an unknown field, a removed
    ``guided_*`` field or ``n`` above the limit would reach vLLM."""
    client, seen = _guard_client()
    for body in (_unknown_field_body(), {**GOOD, "guided_choice": ["a"]}, {**GOOD, "n": 10**5}):
        raw = encode(json.dumps(body))
        assert json.loads(raw) == body  # what vLLM would read
        r = client.post(C, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
    assert seen == []


@pytest.mark.parametrize("raw,key", [
    (b'{"model": "m", "prompt": "hi", "n": 1, "n": 100000}', "n"),
    (b'{"model": "m", "prompt": "hi", "n": 100000, "n": 1}', "n"),
    (b'{"model": "m", "prompt": "a", "prompt": "b\\ud800"}', "prompt"),
    (b'{"model": "m", "prompt": "hi", "response_format": {"type": "json_object", '
     b'"type": "text"}}', "type"),
])
def test_duplicate_keys_are_refused(raw, key):
    client, seen = _guard_client()
    r = client.post(C, content=raw)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == key and f"key '{key}' appears more than once" in error["message"]
    assert seen == []


def test_guard_parses_what_vllm_parses():
    """For bodies the guard passes, its parse is vLLM's."""
    bodies = [json.dumps(GOOD).encode(), b'{"model": "m", "prompt": [1, 2, 3]}',
              b'{"model": "m", "prompt": "caf\\u00e9 \\ud83d\\ude00", "max_tokens": 1e2}',
              b'  {"model": "m", "prompt": "x", "temperature": 1E400}  ']
    for raw in bodies:
        assert parse_body(raw) == json.loads(raw)
    assert parse_body(b'{"model": ') is None  # malformed: vLLM answers it, naming the position


def test_compressed_body_is_refused():
    client, seen = _guard_client()
    raw = gzip.compress(json.dumps(_unknown_field_body()).encode())
    r = client.post(C, content=raw, headers={"content-encoding": "gzip"})
    assert r.status_code == 415
    assert "Content-Encoding 'gzip' is not supported" in r.json()["error"]["message"]
    r = client.post(C, content=json.dumps(GOOD).encode(),
                    headers={"content-encoding": "identity"})
    assert r.status_code == 200
    assert len(seen) == 1


def test_chunked_body_is_checked_and_limited():
    client, seen = _guard_client(max_request_bytes=1000, unknown_fields="reject")

    def chunks(data: bytes, size: int = 7):
        for i in range(0, len(data), size):
            yield data[i:i + size]

    raw = json.dumps(_unknown_field_body()).encode()
    r = client.post(C, content=chunks(raw))  # no Content-Length: chunked transfer
    assert r.status_code == 400 and "tempreature" in r.json()["error"]["message"]
    r = client.post(C, content=chunks(json.dumps({**GOOD, "prompt": "x" * 2000}).encode()))
    assert r.status_code == 413
    r = client.post(C, content=chunks(json.dumps(GOOD).encode()))
    assert r.status_code == 200
    assert seen == [json.dumps(GOOD).encode()]


# ----------------------------------------------------------------------------- --api-key
def test_plugin_registers_no_route():
    """What the plugin adds to vLLM's server is middleware only: no route of its own that
    vLLM's --api-key prefixes might not cover."""
    src = Path(__file__).resolve().parents[1] / "src" / "vllm_unified"
    route = re.compile(r"APIRouter|add_api_route|add_route|include_router|Mount\(|"
                       r"\.(get|post|put|patch|delete|api_route|route|websocket)\(\s*[\"']/")
    found = [f"{p.relative_to(src)}:{n}" for p in src.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if route.search(line)]
    assert found == []


def _vllm_app(api_key: str | None):
    """A FastAPI app with vLLM's own middleware set-up (``init_entrypoints_middleware``) for
    ``vllm serve`` arguments parsed by vLLM's parser with the platform's defaults, and a
    stand-in completions route."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["m"] + (["--api-key", api_key] if api_key else [])
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    assert args.middleware[:len(MIDDLEWARE)] == list(MIDDLEWARE)
    app = FastAPI()
    reached = []

    @app.post(C)
    async def completions(request: Request):
        reached.append(await request.json())
        return {"ok": True}

    init_entrypoints_middleware(args, app, ("generate",))
    return TestClient(app), reached


@pytest.fixture
def reject_unknown_fields(monkeypatch):
    """The operator's opt-in ``VLLM_UNIFIED_UNKNOWN_FIELDS=reject`` for guards vLLM builds
    (they read the environment once per process: :func:`current_limits`)."""
    from vllm_unified.request_policy import current_limits

    monkeypatch.setenv("VLLM_UNIFIED_UNKNOWN_FIELDS", "reject")
    current_limits.cache_clear()
    yield
    current_limits.cache_clear()


@pytest.mark.usefixtures("reject_unknown_fields")
def test_unauthenticated_requests_get_vllms_401_whatever_the_body():
    client, reached = _vllm_app("secret")
    bodies = [json.dumps(GOOD).encode(), json.dumps(_unknown_field_body()).encode(),
              json.dumps({**GOOD, "guided_json": {}}).encode(), b'{"prompt": "a\xff"}',
              b'{"n": 1, "n": 2}', b"x" * (5 * 2**20)]
    for raw in bodies:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "secret"}):
            r = client.post(C, content=raw, headers={"content-type": "application/json",
                                                     **headers})
            assert r.status_code == 401, (raw[:40], headers, r.text[:200])
            assert r.json() == {"error": "Unauthorized"}
    assert reached == []
    ok = {"authorization": "Bearer secret", "content-type": "application/json"}
    r = client.post(C, content=json.dumps(_unknown_field_body()).encode(), headers=ok)
    assert r.status_code == 400 and "tempreature" in r.text  # the guard, once authenticated
    r = client.post(C, content=json.dumps(GOOD).encode(), headers=ok)
    assert r.status_code == 200 and reached == [GOOD]


@pytest.mark.usefixtures("reject_unknown_fields")
def test_guard_still_checks_without_api_key():
    client, reached = _vllm_app(None)
    r = client.post(C, content=json.dumps(_unknown_field_body()).encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "tempreature" in r.text
    assert reached == []


# ----------------------------------------------------------------------------- stalled clients
def test_stalled_client_is_cut_off_and_the_generator_closed():
    """A streaming response whose ``send`` never completes (the client reads nothing) is
    abandoned after the timeout and its generator closed (vLLM aborts the request there);
    a client that reads is unaffected."""
    from starlette.responses import StreamingResponse

    events = []

    async def tokens():
        try:
            for i in range(10**6):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)
        finally:
            events.append("closed")

    async def app(scope, receive, send):
        await StreamingResponse(tokens(), media_type="text/event-stream")(scope, receive, send)

    async def run(blocked_after: int) -> float:
        sent = []
        never = asyncio.Event()

        async def send(message):
            sent.append(message)
            if len(sent) > blocked_after:
                await never.wait()  # the socket buffer is full and stays full

        async def receive():
            await never.wait()  # no disconnect either: the client is alive, not reading
            return {"type": "http.disconnect"}

        start = time.perf_counter()
        scope = {"type": "http", "method": "POST", "path": C, "client": ("1.2.3.4", 5),
                 "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(StalledClientTimeout(app, timeout_s=0.5)(scope, receive, send),
                               timeout=30)
        return time.perf_counter() - start

    elapsed = asyncio.run(run(blocked_after=3))
    assert 0.5 <= elapsed < 10
    assert events == ["closed"]


def test_stalled_client_timeout_setting(monkeypatch):
    async def app(scope, receive, send):
        return None

    monkeypatch.setenv("VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S", "7")
    assert StalledClientTimeout(app).timeout_s == 7
    monkeypatch.setenv("VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S", "0")
    assert StalledClientTimeout(app).timeout_s == 0  # off
    monkeypatch.setenv("VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S='-1'"):
        StalledClientTimeout(app)
