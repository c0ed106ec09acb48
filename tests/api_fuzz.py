"""Property-based fuzzing of the OpenAI server's HTTP API (vLLM's own ``/openapi.json``).

Sources of requests, each a Hypothesis strategy of :class:`FuzzRequest`:

- ``schema:<mode>:<METHOD path>``: schemathesis' cases for every operation of the running
  server's ``/openapi.json`` (vLLM's FastAPI schema), ``positive`` (fit the schema) and
  ``negative`` (break it: wrong types, missing fields, odd bytes and media types);
- ``generation:/v1/completions`` and ``generation:/v1/chat/completions``: our strategies for
  the generation fields (:func:`completion_body`, :func:`chat_body`): extreme numbers, huge
  arrays, odd Unicode, conflicting options, on top of a request that is valid otherwise;
- ``raw:<path>``: bodies no JSON encoder writes (:func:`raw_body`): deep nesting, NaN and
  Infinity tokens, integers of hundreds of digits, invalid UTF-8, duplicate keys.

The property (:class:`Fuzzer`): no response has an HTTP status >= 500, no streamed response
carries an error event of a server error, no request hangs (``timeout_s``), and after each
batch the server answers ``/health`` and a fixed greedy completion with the same text as
before the first batch. Failures are recorded, not raised, so one run reports them all.

Used by ``tests/test_fuzz_api.py`` (a few hundred requests) and ``benchmarks/serve.py fuzz``
(thousands, with a result file).
"""

from __future__ import annotations

import json
import re
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

#: The greedy request checked after every batch (tokens the tiny and default models both have).
REFERENCE_PROMPT = "The capital of France is"
REFERENCE_TOKENS = 8

#: Fields of a failure's request kept in the report, characters.
KEEP_CHARS = 1500


@dataclass
class FuzzRequest:
    """One HTTP request to send.

    Attributes:
        source: the strategy it came from (see the module docstring).
        method: HTTP method.
        path: URL path (with path parameters filled in).
        kwargs: for ``requests.Session.request`` besides method and URL (``json`` or
            ``data``, ``headers``, ``params``, ``cookies``).
        template: the operation's path in the schema (``/v1/responses/{response_id}``), if
            it has path parameters.
    """

    source: str
    method: str
    path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    template: str | None = None

    @property
    def label(self) -> str:
        """``METHOD /path`` of the operation (path parameters as in the schema)."""
        return f"{self.method} {self.template or self.path}"

    def to_loopback(self) -> FuzzRequest:
        """The same request with every ``scheme://host`` in its body and query pointing at a
        closed loopback port: a fuzzed URL (an image, a tool server) must never make the
        server reach another machine."""
        kwargs = dict(self.kwargs)
        if "json" in kwargs:
            kwargs["json"] = json.loads(_loopback(_dumps(kwargs["json"])))
        if isinstance(kwargs.get("data"), bytes):
            kwargs["data"] = _loopback(kwargs["data"].decode("latin-1")).encode("latin-1")
        if kwargs.get("params"):
            kwargs["params"] = {k: _loopback(str(v)) for k, v in kwargs["params"].items()}
        return FuzzRequest(self.source, self.method, self.path, kwargs, self.template)

    def describe(self) -> dict[str, Any]:
        """The request for a report: method, path, and the body or params, truncated."""
        out: dict[str, Any] = {"source": self.source, "method": self.method, "path": self.path}
        for key in ("params", "headers"):
            if self.kwargs.get(key):
                out[key] = {k: str(v)[:200] for k, v in self.kwargs[key].items()
                            if k.lower() not in ("user-agent", "accept", "accept-encoding",
                                                 "connection", "x-schemathesis-testcaseid")}
        if "json" in self.kwargs:
            out["body"] = _dumps(self.kwargs["json"])[:KEEP_CHARS]
        elif self.kwargs.get("data") is not None:
            data = self.kwargs["data"]
            out["body"] = (data.decode("utf-8", "backslashreplace") if isinstance(data, bytes)
                           else str(data))[:KEEP_CHARS]
        return out


_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,30})://[^/\"\\\s?#]{0,300}")


def _loopback(text: str) -> str:
    return _URL.sub(r"\1://127.0.0.1:9", text) if "://" in text else text


def _dumps(value: Any) -> str:
    """JSON as Python writes it: NaN/Infinity tokens allowed, lone surrogates escaped."""
    return json.dumps(value, allow_nan=True)


# ------------------------------------------------------------------------ our generation fields

#: Integers at the edges of every width a server might keep them in.
EDGE_INTS = (0, 1, -1, 2, 255, 256, 2**15, 2**16, 2**31 - 1, 2**31, -(2**31), 2**32,
             2**53, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64,
             10**20, -(10**20), 10**100)
EDGE_FLOATS = (0.0, -0.0, 1e-308, 5e-324, -5e-324, 1e-7, 0.5, 1.0, 1.0000001, 2.0, 2.0000001,
               100.0, 1e10, 1e308, -1e308, float("inf"), float("-inf"), float("nan"))

#: Text that is hard on tokenizers, detokenizers and JSON: NUL and control characters, bidi
#: overrides, a stack of combining marks, zero-width joiners, BOM, noncharacters, emoji,
#: lone surrogates (valid JSON escapes, not Unicode text).
ODD_TEXT = ("", "\x00", "a\x00b", "\x01\x02\x1f\x7f", "\u202eevil\u202c", "\u200f\u05e9\u05dc",
            "e" + "\u0301" * 500, "\u200d" * 100, "\ufeffBOM", "\uffff\ufffe", "\U0010ffff",
            "👩‍👩‍👧‍👦" * 20, "\ud800", "a\udfffb", "\ud83d", "</s><|im_end|><|endoftext|>",
            "{{ raise_exception('x') }}", "\\u0000", "%s%n%x", "\r\n" * 50)


def extreme_ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70),
                     st.integers(-5, 600))


def extreme_floats() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True,
                                                              allow_infinity=True))


def extreme_numbers() -> st.SearchStrategy[Any]:
    """Numbers and things that are almost numbers."""
    return st.one_of(extreme_ints(), extreme_floats(), st.sampled_from(
        ["1", "1e3", "", "NaN", True, False, None, [], {}, [1], {"value": 1}]))


def odd_text(max_size: int = 200) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=max_size),
                     st.text(st.characters(codec="utf-8"), max_size=max_size),
                     st.integers(1000, 200_000).map(lambda n: "x" * n),
                     st.integers(10, 3000).map(lambda n: "héllo wörld 你好 " * n))


def token_ids() -> st.SearchStrategy[int]:
    """Token ids: mostly in SmolLM2's vocabulary (49152), some outside or negative."""
    return st.one_of(st.integers(0, 49151), st.sampled_from([49152, 10**6, -1, 2**31, 2**63]))


def token_lists(max_size: int = 600) -> st.SearchStrategy[list[int]]:
    return st.one_of(st.lists(token_ids(), max_size=max_size),
                     st.integers(1, 4000).map(lambda n: [7] * n))


def huge_arrays(item: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Arrays from empty to tens of thousands of items."""
    return st.one_of(st.lists(item, max_size=50),
                     st.tuples(item, st.integers(1000, 40_000)).map(lambda t: [t[0]] * t[1]))


def logit_biases() -> st.SearchStrategy[Any]:
    keys = st.one_of(token_ids().map(str), st.sampled_from(["", "abc", "1.5", "-0", " 5"]))
    return st.one_of(
        st.dictionaries(keys, extreme_numbers(), max_size=30),
        st.integers(100, 49152).map(lambda n: {str(i): -100.0 for i in range(n)}),
        st.sampled_from([[], "x", 5, None]),
    )


def json_values(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    """Arbitrary JSON (with NaN and Infinity, which Python's parser accepts)."""
    leaves = st.one_of(st.none(), st.booleans(), extreme_numbers(), odd_text(40))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=max_leaves)


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                           "n": {"type": "integer"}}, "required": ["answer"]}


def structured_outputs() -> st.SearchStrategy[Any]:
    """Valid, conflicting (several constraints at once) and broken structured output."""
    one = st.one_of(
        st.builds(lambda c: {"choice": c}, st.lists(odd_text(20), max_size=5)),
        st.builds(lambda r: {"regex": r}, st.sampled_from(
            ["[a-z]+", "(a|b)*c", "(", "a{99999999}", "\\", ".*", "(a*)*b", "[^\\x00-\\x7f]+"])),
        st.builds(lambda s: {"json": s}, st.one_of(st.just(SCHEMA), json_values(8))),
        st.just({"json_object": True}),
        st.builds(lambda g: {"grammar": g}, st.sampled_from(
            ['root ::= "yes" | "no"', "root ::= root", "root ::=", "?", 'root ::= [a-z]{0,5}'])),
        st.just({"structural_tag": "{}"}),
        st.just({}),
    )
    return st.one_of(one, st.lists(one, min_size=2, max_size=3).map(
        lambda parts: {k: v for part in parts for k, v in part.items()}), json_values(6))


def response_formats() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                         {"type": "nope"}, {}, None, "json"]),
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                  st.one_of(st.just(SCHEMA), json_values(8))),
    )


Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False)


def common_fields() -> dict[str, Field]:
    """Generation fields both endpoints share: (a plausible value, a hostile value) each."""
    ids = _ints(0, 49151)
    words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1,
                    max_size=5)
    return {
        "max_tokens": (_ints(1, 16), extreme_numbers()),
        "temperature": (st.one_of(st.sampled_from([0.0, 0.7, 1.0, 2.0]), _floats(0, 2)),
                        extreme_numbers()),
        "top_p": (_floats(0.01, 1), extreme_numbers()),
        "top_k": (st.sampled_from([-1, 0, 1, 5, 40, 49152, 10**9]), extreme_numbers()),
        "min_p": (_floats(0, 1), extreme_numbers()),
        "n": (_ints(1, 4), st.one_of(st.sampled_from([0, -1, 128, 129, 10**6]),
                                     extreme_numbers())),
        "seed": (_ints(-(2**63), 2**63 - 1), extreme_numbers()),
        "presence_penalty": (_floats(-2, 2), extreme_numbers()),
        "frequency_penalty": (_floats(-2, 2), extreme_numbers()),
        "repetition_penalty": (_floats(0.01, 2), extreme_numbers()),
        "length_penalty": (_floats(-2, 2), extreme_numbers()),
        "min_tokens": (_ints(0, 8), extreme_numbers()),
        "stop": (st.one_of(words, st.lists(words, max_size=4)),
                 st.one_of(odd_text(20), huge_arrays(odd_text(10)), extreme_numbers())),
        "stop_token_ids": (st.lists(ids, max_size=5),
                           st.one_of(huge_arrays(token_ids()), extreme_numbers())),
        "logit_bias": (st.dictionaries(ids.map(str), _floats(-100, 100), max_size=10),
                       logit_biases()),
        "allowed_token_ids": (st.lists(ids, min_size=1, max_size=50),
                              st.one_of(huge_arrays(token_ids()), extreme_numbers())),
        "bad_words": (st.lists(words, max_size=3),
                      st.one_of(huge_arrays(odd_text(10)), extreme_numbers())),
        "logprob_token_ids": (st.lists(ids, max_size=5),
                              st.one_of(st.lists(token_ids(), max_size=30), extreme_numbers())),
        "prompt_logprobs": (_ints(0, 5), st.one_of(st.integers(-2, 25), extreme_numbers())),
        "ignore_eos": (st.booleans(), extreme_numbers()),
        "include_stop_str_in_output": (st.booleans(), extreme_numbers()),
        "skip_special_tokens": (st.booleans(), extreme_numbers()),
        "spaces_between_special_tokens": (st.booleans(), extreme_numbers()),
        "stream": (st.booleans(), extreme_numbers()),
        "stream_options": (st.fixed_dictionaries({}, optional={
            "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
            json_values(4)),
        "use_beam_search": (st.booleans(), extreme_numbers()),
        "truncate_prompt_tokens": (st.one_of(st.just(-1), _ints(1, 20)),
                                   st.one_of(st.integers(-2, 600), extreme_numbers())),
        "truncation_side": (st.sampled_from(["left", "right"]),
                            st.one_of(st.just("middle"), extreme_numbers())),
        "structured_outputs": (st.one_of(
            st.builds(lambda c: {"choice": c}, st.lists(words, min_size=1, max_size=4)),
            st.just({"regex": "[a-z]{1,5}"}), st.just({"json": SCHEMA}),
            st.just({"json_object": True})), structured_outputs()),
        "response_format": (st.sampled_from([
            {"type": "text"}, {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}]),
            response_formats()),
        "priority": (st.just(0), extreme_numbers()),
        "return_tokens_as_token_ids": (st.booleans(), extreme_numbers()),
        "return_token_ids": (st.booleans(), extreme_numbers()),
        "cache_salt": (words, odd_text(20)),
        "user": (words, odd_text(20)),
        "request_id": (words, odd_text(20)),
        "stream_interval": (_ints(1, 10), extreme_numbers()),
        "thinking_token_budget": (st.none(), extreme_numbers()),
        "repetition_detection": (st.none(), json_values(4)),
        "kv_transfer_params": (st.none(), json_values(4)),
        "vllm_xargs": (st.none(), json_values(4)),
        "best_of": (st.none(), st.integers(1, 4)),  # removed from vLLM: an unknown field now
        "guided_choice": (st.none(), st.lists(st.text(max_size=5), max_size=3)),  # removed
    }


@st.composite
def _with_optional(draw: Callable, required: dict[str, Field],
                   optional: dict[str, Field]) -> dict[str, Any]:
    """A body with the ``required`` fields and 0..6 of the ``optional`` ones; each field is
    hostile with probability 1/4, so that a good share of requests reach the engine with one
    or two odd values among plausible ones."""
    body = {}
    for name, (valid, hostile) in [*required.items(),
                                   *((n, optional[n]) for n in draw(st.lists(
                                       st.sampled_from(sorted(optional)), max_size=6,
                                       unique=True)))]:
        odd = draw(st.sampled_from([False, False, False, True]), label=f"{name} hostile")
        body[name] = draw(hostile if odd else valid, label=name)
    return body


def completion_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    """``/v1/completions`` bodies: a prompt (text, token ids, lists of either, odd text) and
    hostile generation fields."""
    prompt = (st.one_of(st.sampled_from(["Hello", "The capital of France is"]),
                        st.text(min_size=1, max_size=50).filter(str.strip),
                        st.lists(_ints(1, 49151), min_size=1, max_size=50),
                        st.lists(st.sampled_from(["a", "b c"]), min_size=1, max_size=3)),
              st.one_of(odd_text(), token_lists(), st.lists(odd_text(30), max_size=4),
                        st.lists(token_lists(40), max_size=4), extreme_numbers()))
    optional = {**common_fields(),
                "echo": (st.booleans(), extreme_numbers()),
                "logprobs": (_ints(0, 5), st.one_of(st.integers(0, 21), extreme_numbers())),
                "suffix": (st.none(), odd_text(20)),
                "add_special_tokens": (st.booleans(), extreme_numbers()),
                "return_token_offsets": (st.booleans(), extreme_numbers())}
    return _with_optional({"model": (st.just(model), odd_text(20)), "prompt": prompt}, optional)


def chat_messages() -> st.SearchStrategy[Any]:
    role = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function",
                            "nope", ""])
    content = st.one_of(
        odd_text(), st.none(),
        st.lists(st.one_of(st.builds(lambda t: {"type": "text", "text": t}, odd_text(50)),
                           st.just({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}),
                           st.just({"type": "input_audio", "input_audio": {"data": "AAAA",
                                                                           "format": "wav"}}),
                           st.just({"type": "nope"}), json_values(4)), max_size=4),
        extreme_numbers())
    message = st.builds(lambda r, c: {"role": r, "content": c}, role, content)
    tool_message = st.just({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]})
    return st.one_of(
        st.lists(st.one_of(message, tool_message), min_size=1, max_size=6),
        st.just([{"role": "user", "content": "hi"}]),
        st.integers(200, 5000).map(lambda n: [{"role": "user", "content": "hi"}] * n),
        json_values(6))


def chat_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    """``/v1/chat/completions`` bodies: odd messages, tools and hostile generation fields."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    optional = {**common_fields(),
                "logprobs": (st.booleans(), extreme_numbers()),
                "top_logprobs": (_ints(0, 5), st.one_of(st.integers(-1, 25), extreme_numbers())),
                "max_completion_tokens": (_ints(1, 8), extreme_numbers()),
                "echo": (st.booleans(), extreme_numbers()),
                "tools": (st.just([tool]), st.one_of(
                    st.lists(json_values(4), max_size=3),
                    st.integers(100, 3000).map(lambda n: [tool] * n))),
                "tool_choice": (st.sampled_from(["none", "auto"]), st.one_of(
                    st.sampled_from(["required", "x"]),
                    st.just({"type": "function", "function": {"name": "missing"}}),
                    json_values(3))),
                "parallel_tool_calls": (st.booleans(), extreme_numbers()),
                "add_generation_prompt": (st.booleans(), extreme_numbers()),
                "continue_final_message": (st.booleans(), extreme_numbers()),
                "add_special_tokens": (st.booleans(), extreme_numbers()),
                "documents": (st.lists(st.fixed_dictionaries(
                    {"title": st.text(max_size=5), "text": st.text(max_size=20)}), max_size=2),
                    st.one_of(st.lists(st.dictionaries(odd_text(5), odd_text(20), max_size=2),
                                       max_size=3), json_values(3))),
                "chat_template": (st.none(),
                                  st.sampled_from(["{{ messages }}", "{% for %}", ""])),
                "chat_template_kwargs": (st.just({"add_generation_prompt": True}), st.one_of(
                    st.dictionaries(st.sampled_from(["add_generation_prompt", "tools",
                                                     "messages", "enable_thinking", "x"]),
                                    json_values(3), max_size=3), json_values(3))),
                "reasoning_effort": (st.none(), st.sampled_from(["low", "high", "max", "x"])),
                "include_reasoning": (st.booleans(), extreme_numbers()),
                "return_prompt_text": (st.booleans(), extreme_numbers())}
    plain = st.lists(st.builds(lambda r, c: {"role": r, "content": c},
                               st.sampled_from(["user", "assistant", "system"]),
                               st.text(max_size=60)), min_size=1, max_size=4)
    return _with_optional({"model": (st.just(model), odd_text(20)),
                           "messages": (plain, chat_messages())}, optional)


def generation_requests(path: str, model: str) -> st.SearchStrategy[FuzzRequest]:
    body = completion_body(model) if path == "/v1/completions" else chat_body(model)
    return body.map(lambda b: FuzzRequest(f"generation:{path}", "POST", path,
                                          {"data": _dumps(b).encode(),
                                           "headers": {"Content-Type": "application/json"}}))


# --------------------------------------------------------------------------- raw JSON bodies

def _nested(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def raw_body(draw: Callable, model: str, path: str) -> bytes:
    """A body no JSON encoder writes, for ``path``: a plain valid request in which one field
    (or the whole body) is deep nesting, NaN/Infinity tokens, a huge integer literal, an
    invalid UTF-8 byte, a duplicate key, a BOM, trailing garbage..."""
    head = (b'{"model": "' + model.encode() + b'", "max_tokens": 4, '
            + (b'"prompt": "hi"' if path == "/v1/completions"
               else b'"messages": [{"role": "user", "content": "hi"}]'))
    field = draw(st.sampled_from(["prompt", "temperature", "top_k", "n", "logit_bias", "stop",
                                  "messages", "max_tokens", "seed", "structured_outputs",
                                  "response_format", "chat_template_kwargs", "tools"]))
    value = draw(st.one_of(
        st.builds(_nested, st.one_of(st.integers(1, 200), st.integers(900, 1100),
                                     st.sampled_from([5000, 100_000])),
                  st.sampled_from(["array", "object"])),
        st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1E-400",
                         b"-0", b"0.0e0", b"00", b"1.", b".5", b"+1", b"0x10", b"true",
                         b'{"5": NaN}', b'[NaN, Infinity]', b'"\\ud800"', b'"\\u0000"',
                         b'"\xff\xfe"', b'"\xc0\x80"', b'"\xed\xa0\x80"', b'"a\x01b"']),
        st.integers(19, 4400).map(lambda n: b"9" * n),
        st.integers(19, 400).map(lambda n: b"-" + b"9" * n),
    ))
    shape = draw(st.sampled_from(["field", "duplicate", "whole", "bom", "trailing"]))
    if shape == "field":
        return head + b', "' + field.encode() + b'": ' + value + b"}"
    if shape == "duplicate":  # the same key twice: the last one wins in Python's parser
        return head + b', "' + field.encode() + b'": 1, "' + field.encode() + b'": ' + value + b"}"
    if shape == "whole":
        return value
    if shape == "bom":
        return b"\xef\xbb\xbf" + head + b"}"
    return head + b"} " + value


def raw_requests(path: str, model: str) -> st.SearchStrategy[FuzzRequest]:
    content_types = st.sampled_from(["application/json", "application/json; charset=latin-1",
                                     "text/plain", "application/x-www-form-urlencoded"])
    return st.builds(lambda b, ct: FuzzRequest(f"raw:{path}", "POST", path,
                                               {"data": b, "headers": {"Content-Type": ct}}),
                     raw_body(model, path),
                     st.one_of(st.just("application/json"), content_types))


# ---------------------------------------------------------------------------- schema (OpenAPI)

def schema_sources(base: str) -> dict[str, st.SearchStrategy[FuzzRequest]]:
    """schemathesis' strategies for every operation of ``base``'s ``/openapi.json``, positive
    and negative, keyed ``schema:<mode>:<METHOD path>``."""
    import schemathesis
    from schemathesis import GenerationMode

    spec = requests.get(f"{base}/openapi.json", timeout=60).json()
    schema = schemathesis.openapi.from_dict(spec)
    sources: dict[str, st.SearchStrategy[FuzzRequest]] = {}
    for path, methods in schema.items():
        for method, operation in methods.items():
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                key = f"schema:{mode.value}:{method.upper()} {path}"
                sources[key] = operation.as_strategy(generation_mode=mode).map(
                    lambda case, key=key: _from_case(case, key, base))
    return sources


def _from_case(case: Any, source: str, base: str) -> FuzzRequest:
    kwargs = case.as_transport_kwargs(base_url=base)
    method, url = kwargs.pop("method"), kwargs.pop("url")
    return FuzzRequest(source, method, url.removeprefix(base), kwargs,
                       case.operation.path).to_loopback()


# ------------------------------------------------------------------------------------ running

@dataclass
class Outcome:
    """What one request got: ``status`` (an HTTP status, or ``timeout`` / ``connection``),
    the server-error event of a streamed body if any, and the start of the body."""

    status: int | str
    stream_error: str | None
    text: str

    @property
    def failed(self) -> bool:
        return not isinstance(self.status, int) or self.status >= 500 or bool(self.stream_error)


def stream_server_error(text: str) -> str | None:
    """The first error event of a server error in an SSE body, else None: an OpenAI-style
    ``{"error": {"code": >= 500}}`` chunk, or an Anthropic-style ``error`` event whose type
    names an internal or API error."""
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        error = event.get("error") if isinstance(event, dict) else None
        if not isinstance(error, dict):
            continue
        code, kind = error.get("code"), str(error.get("type", "")).lower()
        if (isinstance(code, int) and code >= 500) or any(
                word in kind for word in ("internal", "api_error", "server")):
            return line[:KEEP_CHARS]
    return None


def send(base: str, request: FuzzRequest, timeout_s: float) -> Outcome:
    """Send ``request`` on a connection of its own (``Connection: close``); read the whole
    body (streams too) within ``timeout_s`` between bytes.

    A connection per request: reusing idle keep-alive connections races with the server
    closing them (uvicorn after 5 s), and a request sent on a connection just closed fails
    with "connection reset" through no fault of the request.
    """
    headers = {**(request.kwargs.get("headers") or {}), "Connection": "close"}
    kwargs = {**request.kwargs, "headers": headers}
    try:
        with requests.Session() as session, session.request(
                request.method, base + request.path, timeout=(10, timeout_s), stream=True,
                allow_redirects=False, **kwargs) as r:
            body = r.content.decode("utf-8", "replace")
    except requests.Timeout:
        return Outcome("timeout", None, "")
    except requests.ConnectionError as e:
        return Outcome("connection", None, str(e)[:KEEP_CHARS])
    error = stream_server_error(body) if "text/event-stream" in r.headers.get(
        "content-type", "") else None
    return Outcome(r.status_code, error, body[:KEEP_CHARS])


def draw_examples(strategy: st.SearchStrategy[Any], count: int, seed: int) -> list[Any]:
    """Up to ``count`` examples of ``strategy`` from one seeded Hypothesis run (fewer when the
    strategy has fewer distinct values, none when it has none: schemathesis' negative mode
    for an operation without parameters or body).

    Raises:
        schemathesis.core.errors.UnsupportedSchema: schemathesis cannot generate cases for
            this part of the schema (e.g. negative cases of a ``not`` below the root);
            :meth:`Fuzzer.run` records it per source.
    """
    out: list[Any] = []

    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schemathesis' and Hypothesis' advice for test suites
        try:
            collect()
        except Unsatisfiable:
            return []
    return out[:count]


class ServerDown(AssertionError):
    """The server failed the liveness check (not healthy, or the greedy text changed)."""


@dataclass
class Fuzzer:
    """Sends batches of generated requests to ``base`` and checks the server after each.

    Attributes:
        base: the server's URL (``http://127.0.0.1:PORT``).
        model: the served model name.
        timeout_s: longest silence on a response before it counts as a hang.
        workers: requests in flight at once.
        alive: extra liveness check (e.g. the server process has not exited), or None.
    """

    base: str
    model: str
    timeout_s: float = 120.0
    workers: int = 4
    alive: Callable[[], bool] | None = None
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    sources: Counter = field(default_factory=Counter)
    stream_errors: Counter = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    unsupported: dict[str, str] = field(default_factory=dict)
    checks: int = 0
    reference: str | None = None

    def greedy_text(self) -> str:
        body = {"model": self.model, "prompt": REFERENCE_PROMPT, "temperature": 0.0,
                "max_tokens": REFERENCE_TOKENS, "ignore_eos": True}
        r = requests.post(f"{self.base}/v1/completions", json=body, timeout=self.timeout_s)
        if r.status_code != 200:
            raise ServerDown(f"the greedy reference request got HTTP {r.status_code}: "
                             f"{r.text[:500]}")
        return r.json()["choices"][0]["text"]

    def check(self) -> None:
        """The liveness property.

        Raises:
            ServerDown: the process is gone, ``/health`` is not 200, or the greedy text
                differs from the first one.
        """
        self.checks += 1
        if self.alive is not None and not self.alive():
            raise ServerDown("the server process exited")
        try:
            health = requests.get(f"{self.base}/health", timeout=self.timeout_s).status_code
            text = self.greedy_text()
        except requests.RequestException as e:
            raise ServerDown(f"the server did not answer: {e}") from e
        if health != 200:
            raise ServerDown(f"/health answered {health}")
        if self.reference is None:
            self.reference = text
        elif text != self.reference:
            raise ServerDown(f"greedy text changed: {text!r} != {self.reference!r}")

    def run_batch(self, requests_: list[FuzzRequest]) -> None:
        """Send ``requests_`` (``workers`` at a time) and record every outcome."""
        def one(request: FuzzRequest) -> tuple[FuzzRequest, Outcome]:
            request = request.to_loopback()
            return request, send(self.base, request, self.timeout_s)

        with ThreadPoolExecutor(self.workers) as pool:
            for request, outcome in pool.map(one, requests_):
                self.counts[request.label][str(outcome.status)] += 1
                self.sources[request.source] += 1
                if outcome.stream_error:
                    self.stream_errors[request.label] += 1
                if outcome.failed:
                    self.failures.append({**request.describe(), "status": outcome.status,
                                          "stream_error": outcome.stream_error,
                                          "response": outcome.text})

    def run(self, plan: Iterator[Batch], total: int,
            log: Callable[[str], None] | None = None) -> None:
        """Draw and send batches from ``plan`` ((name, strategy, count, seed) tuples) until
        ``total`` requests were sent, checking liveness before the first and after each batch.

        A source schemathesis cannot generate for is recorded in ``unsupported`` (name ->
        schemathesis' reason, in the report) and not drawn from again; the plan goes on.

        Raises:
            ServerDown: at the first failed liveness check (the counts so far are kept).
        """
        from schemathesis.core.errors import UnsupportedSchema

        self.check()
        started = time.monotonic()
        for name, strategy, count, seed in plan:
            sent = self.total()
            if sent >= total:
                break
            if name in self.unsupported:
                continue
            try:
                batch = draw_examples(strategy, min(count, total - sent), seed)
            except UnsupportedSchema as e:
                self.unsupported[name] = str(e)
                if log is not None:
                    log(f"{name}: schemathesis cannot generate it: {e}")
                continue
            self.run_batch(batch)
            self.check()
            if log is not None:
                log(f"{self.total()}/{total} requests, {len(self.failures)} failures, "
                    f"{time.monotonic() - started:.0f} s")

    def total(self) -> int:
        return sum(self.sources.values())

    def report(self) -> dict[str, Any]:
        """Counts by endpoint and status, by source, stream errors, failures, checks."""
        by_status: Counter = Counter()
        for statuses in self.counts.values():
            by_status.update(statuses)
        return {"requests": self.total(), "failures": len(self.failures),
                "liveness_checks": self.checks, "reference_text": self.reference,
                "by_status": dict(sorted(by_status.items())),
                "by_endpoint": {label: dict(sorted(c.items()))
                                for label, c in sorted(self.counts.items())},
                "by_source": dict(sorted(self.sources.items())),
                "stream_server_errors": dict(self.stream_errors),
                "unsupported_sources": dict(sorted(self.unsupported.items())),
                "failed_requests": self.failures}


#: One batch of :func:`rounds`' plan: the source's name, its strategy, the count, the seed.
Batch = tuple[str, st.SearchStrategy[FuzzRequest], int, int]


def sources_for(base: str, model: str) -> dict[str, st.SearchStrategy[FuzzRequest]]:
    """Every source: the schema's operations, our generation strategies, raw bodies."""
    sources = schema_sources(base)
    for path in ("/v1/completions", "/v1/chat/completions"):
        sources[f"generation:{path}"] = generation_requests(path, model)
        sources[f"raw:{path}"] = raw_requests(path, model)
    return sources


def rounds(sources: dict[str, st.SearchStrategy[FuzzRequest]], seed: int,
           schema_batch: int = 4, ours_batch: int | None = None) -> Iterator[Batch]:
    """An endless plan of rounds; each round draws one batch from every source:
    ``schema_batch`` requests per schema source (each operation, both modes), and
    ``ours_batch`` per ``generation:`` / ``raw:`` source (default: as many requests in all as
    the schema sources get, so half of all requests come from our own strategies). Our
    batches are spread between the schema ones; every batch has its own seed."""
    ours = [(n, s) for n, s in sorted(sources.items()) if not n.startswith("schema:")]
    schema = [(n, s) for n, s in sorted(sources.items()) if n.startswith("schema:")]
    if ours_batch is None:
        ours_batch = max(1, schema_batch * len(schema) // max(1, len(ours)))
    per_ours = max(1, len(schema) // max(1, len(ours)))
    n = 0
    while True:
        for i, (name, strategy) in enumerate(ours):
            yield name, strategy, ours_batch, seed * 1_000_003 + n
            n += 1
            for other, other_strategy in schema[i * per_ours:(i + 1) * per_ours
                                                if i < len(ours) - 1 else len(schema)]:
                yield other, other_strategy, schema_batch, seed * 1_000_003 + n
                n += 1


def server_args(model: str, served_name: str) -> list[str]:
    """``vllm serve`` arguments of the fuzzed server: ``model`` (a checkpoint folder or GGUF)
    as ``served_name``, a 512-token context (bounds every generation), 32 output tokens for
    requests that name no ``max_tokens`` (vLLM's default is the rest of the context), a fixed
    256 MiB KV budget, vLLM's tool calling (so ``tool_choice`` reaches its tool machinery)."""
    return [model, "--served-model-name", served_name, "--max-model-len", "512",
            "--override-generation-config", '{"max_new_tokens": 32}',
            "--kv-cache-memory-bytes", str(256 * 2**20), "--seed", "0",
            "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
