"""The soak benchmark's traffic: the request mix, the HTTP client (with client-side aborts) and
the check of every response. ``benchmarks/serve.py soak`` runs it against a server.

**The mix** (:func:`make_plan`, deterministic for a seed). Half of the requests are **greedy**
(temperature 0), each one of a pool of distinct request bodies (:func:`greedy_pool`) whose
text alone on the server is measured first; the other half are **sampled** (temperature 0.8,
top-p 0.95, a per-request seed, ``n`` of 1 to 3). Every body is a chat or a completions
request and may carry logprobs (top 2), stop strings, or structured output (a JSON schema, a
choice, a regex; never together with stop strings, which would cut the structure); its prompt is
**long** (one of three ~1,450-token documents plus a question: about 1,500 tokens, the documents
shared as prefixes) or **short** (a shared instruction plus a question). Each request is sent
streamed or not (half each). A fraction of the requests (default 10%) is **aborted by the
client**: a streamed one by closing the connection after 0 to 10 chunks or after a random delay
before its first chunk, a non-streamed one by closing it after a random delay (0.05 to 2 s)
before the response. A planned abort whose response arrives first is checked as a normal
request and counted as ``abort_missed``.

**The checks** (:func:`check`) of a request that was not aborted: HTTP 200, a well-formed body
or stream (``[DONE]``, no error event, usage present), ``n`` choices with indices 0..n-1, each
finished by ``stop`` or ``length``; prompt tokens in 1,300..1,700 for long prompts; logprobs:
one entry per generated token (their count sums to ``completion_tokens``), finite and <= 0,
and for greedy requests the chosen token's logprob is the largest of the top entries; stop
strings: none in the text, a ``stop_reason`` string is one of them; structured output, when
finished by ``stop``: JSON that matches the schema (exactly the keys ``name``: str and
``age``: int), one of the choices, a full match of the regex (finished by ``length``: counted
as truncated, not a failure); greedy requests: the text and finish reason equal their solo
run's, and logprobs within :data:`LOGPROB_TOL` of it. An aborted greedy stream's partial text
must be a prefix of its solo text.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import requests

from vllm_unified import envs

MODEL = "SmolLM2-135M-Instruct"

#: Largest difference allowed between a greedy request's logprobs and its solo run's: with
#: exact fp32 arithmetic 1e-3 (the agreement the project claims with vLLM's own backend,
#: README "Status"); with the CPU backend's default integer arithmetic of quantized layers
#: (``VLLM_UNIFIED_CPU_ACTIVATIONS`` int16 or int8) 5e-3: x is rounded per 32 elements, so a
#: last-bit difference that the step's composition makes upstream (the fp32 summation order of
#: another kernel path, or exact kernels where the CPU has no AMX-INT8) can move a rounding
#: step of x (measured: 2.5e-3 at most, docs/features/quantization.md). The server the soak starts
#: inherits this process's environment.
LOGPROB_TOL = 1e-3 if envs.CPU_ACTIVATIONS == "fp32" else 5e-3
#: Prompt tokens a "long" request must have.
LONG_RANGE = (1300, 1700)
#: Tokens of each long document (before the question).
DOC_TOKENS = 1450
#: Seconds a request that is not aborted may take (read timeout).
REQUEST_TIMEOUT_S = 600.0

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[A-Z]{2}-[0-9]{3}"
STOP_SETS = [["."], ["\n"], [".", "!"], ["\n\n", "?"]]

SHORT_PREFIX = ("You are a concise assistant. Answer the question below in one or two "
                "sentences, plainly and without lists.")
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "What do bees make?",
    "How many legs does a spider have?", "What is the boiling point of water?",
    "Name a planet in our solar system.", "What is photosynthesis?", "Who wrote Hamlet?",
    "What is the largest ocean?", "What does a thermometer measure?",
    "Why do leaves change color in autumn?", "What is a prime number?",
    "How does a bicycle stay upright?", "What is the speed of light?",
    "What language is spoken in Brazil?", "What causes rain?", "What is an atom?",
    "Why do cats purr?", "What is the tallest mountain?", "How do magnets work?",
    "What is the main ingredient of bread?", "What does DNA stand for?",
    "Why is exercise healthy?", "What is a volcano?", "How many days are in a leap year?",
    "What is gravity?", "What is the moon made of?", "Why do we sleep?",
    "What is the function of the heart?", "What is a rainbow?",
]
DOC_QUESTIONS = [
    "Who is mentioned first in the text?", "Summarize the text in one sentence.",
    "Which city appears most often?", "What year is mentioned last?",
    "What did the baker do?", "Name two people from the text.",
    "What is the text about?", "Which animal is mentioned?",
]
STRUCTURED_PROMPTS = {
    "json": "Invent a fictional person and describe them as a JSON object with a name and an age.",
    "choice": "Is this statement true: 'Water freezes at zero degrees Celsius'? "
              "Answer yes, no or maybe.",
    "regex": "Write a product code made of two capital letters, a dash and three digits.",
}

_NAMES = ["Maria", "Tom", "Aiko", "Lars", "Priya", "Omar", "Lena", "Jonas", "Sofia", "Ravi",
          "Clara", "Mateo", "Yuki", "Nadia", "Felix", "Ines"]
_CITIES = ["Lisbon", "Oslo", "Kyoto", "Cairo", "Lima", "Vienna", "Dakar", "Quebec", "Porto",
           "Hanoi", "Bergen", "Cusco"]
_ANIMALS = ["a grey heron", "an old dog", "a pair of foxes", "a stray cat", "a young horse",
            "a flock of geese"]
_TEMPLATES = [
    "In {year}, {name} moved to {city} and opened a small bakery near the harbour.",
    "Every morning {name} walked along the river in {city}, counting the boats.",
    "The archive of {city} kept letters that {name} had written in {year}.",
    "{name} once said that {city} was the only place where {animal} slept on the steps of "
    "the town hall.",
    "By {year} the bakery had become famous, and visitors from {city} asked {name} for the "
    "recipe.",
    "On rainy days {name} read old newspapers from {year} and watched {animal} in the yard.",
    "The market in {city} opened at six, and {name} was always the first to arrive.",
    "A teacher from {city} wrote a short book about {name} and the winter of {year}.",
]


def _sentence(rng: random.Random) -> str:
    return rng.choice(_TEMPLATES).format(
        year=rng.randint(1890, 2020), name=rng.choice(_NAMES), city=rng.choice(_CITIES),
        animal=rng.choice(_ANIMALS))


def make_documents(tokenizer: Any, seed: int, count: int = 3) -> list[str]:
    """``count`` synthetic stories of exactly :data:`DOC_TOKENS` tokens each (``tokenizer``
    counts them; a story is cut at a token boundary and kept only if it re-encodes to the same
    length)."""
    rng = random.Random(seed)
    docs: list[str] = []
    while len(docs) < count:
        text = " ".join(_sentence(rng) for _ in range(DOC_TOKENS // 10))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < DOC_TOKENS:
            continue
        cut = tokenizer.decode(ids[:DOC_TOKENS])
        if len(tokenizer.encode(cut, add_special_tokens=False)) == DOC_TOKENS:
            docs.append(cut)
    return docs


# --------------------------------------------------------------------------- plan


@dataclass
class Body:
    """One request body and what its response must satisfy.

    Attributes:
        endpoint: ``"completions"`` or ``"chat"``.
        payload: the JSON body without ``stream``/``stream_options``.
        n: completions asked for.
        greedy: temperature 0.
        long: the prompt is one of the long documents plus a question.
        logprobs: top-2 logprobs asked for.
        stop: the stop strings, if any.
        structured: ``"json"``, ``"choice"``, ``"regex"`` or None.
    """

    endpoint: str
    payload: dict[str, Any]
    n: int = 1
    greedy: bool = False
    long: bool = False
    logprobs: bool = False
    stop: list[str] | None = None
    structured: str | None = None

    def features(self) -> list[str]:
        """Labels for the summary: endpoint, greedy/sampled, long/short, n>1 and options."""
        out = [self.endpoint, "greedy" if self.greedy else "sampled",
               "long" if self.long else "short"]
        if self.n > 1:
            out.append("n>1")
        if self.logprobs:
            out.append("logprobs")
        if self.stop:
            out.append("stop")
        if self.structured:
            out.append(f"structured:{self.structured}")
        return out


def make_body(rng: random.Random, docs: list[str], greedy: bool) -> Body:
    """A random request body (see the module docstring for the distribution)."""
    endpoint = rng.choice(["completions", "chat"])
    long = rng.random() < 0.35
    logprobs = rng.random() < 0.3
    structured = rng.choice(["json", "choice", "regex"]) if rng.random() < 0.3 else None
    stop = rng.choice(STOP_SETS) if structured is None and rng.random() < 0.35 else None
    n = 1 if greedy or rng.random() < 0.6 else rng.choice([2, 3])
    if structured is not None:
        question = STRUCTURED_PROMPTS[structured]
    else:
        question = rng.choice(DOC_QUESTIONS if long else QUESTIONS)
    context = rng.choice(docs) if long else SHORT_PREFIX
    if structured == "json":
        max_tokens = 80
    else:
        max_tokens = rng.randint(12, 32) if long else rng.randint(16, 48)
    payload: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens}
    if endpoint == "chat":
        payload["messages"] = [{"role": "system", "content": context},
                               {"role": "user", "content": question}]
    else:
        payload["prompt"] = f"{context}\n\nQuestion: {question}\nAnswer:"
    if greedy:
        payload["temperature"] = 0.0
    else:
        payload.update(temperature=0.8, top_p=0.95, seed=rng.randint(0, 2**31 - 1), n=n)
    if logprobs:
        if endpoint == "chat":
            payload.update(logprobs=True, top_logprobs=2)
        else:
            payload["logprobs"] = 2
    if stop:
        payload["stop"] = stop
    if structured == "json":
        if endpoint == "chat":
            payload["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON_SCHEMA}}
        else:
            payload["structured_outputs"] = {"json": PERSON_SCHEMA}
    elif structured == "choice":
        payload["structured_outputs"] = {"choice": CHOICES}
    elif structured == "regex":
        payload["structured_outputs"] = {"regex": REGEX}
    return Body(endpoint, payload, n, greedy, long, logprobs, stop, structured)


def greedy_pool(size: int, docs: list[str], seed: int) -> list[Body]:
    """``size`` distinct greedy bodies (their solo texts are the reference)."""
    rng = random.Random(seed * 7919 + 1)
    pool: list[Body] = []
    seen: set[str] = set()
    while len(pool) < size:
        body = make_body(rng, docs, greedy=True)
        key = json.dumps(body.payload, sort_keys=True)
        if key not in seen:
            seen.add(key)
            pool.append(body)
    return pool


@dataclass
class Planned:
    """One request of the run: its body, how it is sent and whether the client aborts it.

    Attributes:
        idx: position in the plan.
        body: the request body.
        stream: sent with ``stream: true`` (and ``stream_options.include_usage``).
        greedy_ref: index into the greedy pool, or None for a sampled request.
        abort: None, ``("chunks", k)``: close after k streamed chunks, or ``("delay", s)``:
            close after s seconds if no response (non-streamed) or no chunk (streamed) came.
    """

    idx: int
    body: Body
    stream: bool
    greedy_ref: int | None
    abort: tuple[str, float] | None


def make_plan(requests_n: int, pool: list[Body], docs: list[str], seed: int,
              abort_fraction: float) -> list[Planned]:
    """The whole run's requests in sending order: half greedy (drawn from ``pool``), half
    sampled, ``round(abort_fraction * requests_n)`` of them aborted.

    Raises:
        ValueError: ``requests_n`` < 1, an empty pool, or ``abort_fraction`` outside [0, 1).
    """
    if requests_n < 1 or not pool:
        raise ValueError(f"--requests must be >= 1 and the greedy pool non-empty, got "
                         f"{requests_n} and {len(pool)}")
    if not 0 <= abort_fraction < 1:
        raise ValueError(f"--abort-fraction must be in [0, 1), got {abort_fraction}")
    rng = random.Random(seed)
    aborted = set(rng.sample(range(requests_n), round(abort_fraction * requests_n)))
    plan: list[Planned] = []
    for i in range(requests_n):
        greedy_ref = rng.randrange(len(pool)) if rng.random() < 0.5 else None
        body = pool[greedy_ref] if greedy_ref is not None else make_body(rng, docs, False)
        stream = rng.random() < 0.5
        abort: tuple[str, float] | None = None
        if i in aborted:
            if stream and rng.random() < 0.7:
                abort = ("chunks", float(rng.randint(0, 10)))
            else:
                abort = ("delay", rng.uniform(0.05, 2.0))
        plan.append(Planned(i, body, stream, greedy_ref, abort))
    return plan


# --------------------------------------------------------------------------- client


@dataclass
class Choice:
    """One choice of a response: its text, how it finished and its logprobs as
    ``(token, chosen logprob, {top token: logprob})`` per generated token (empty without
    logprobs)."""

    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: list[tuple[str, float, dict[str, float]]] = field(default_factory=list)


@dataclass
class Outcome:
    """What the client saw of one request.

    Attributes:
        status: ``"ok"`` (complete response), ``"aborted"`` (the client closed it) or
            ``"error"`` (HTTP error, broken stream, exception).
        error: what went wrong, for ``"error"``.
        choices: by choice index.
        usage: the response's ``usage``.
        latency_s: sending to the end (or the abort).
        ttft_s: sending to the first streamed chunk with choices (streams only).
        chunks: streamed chunks with choices received.
        done_at_s: when it ended, seconds since the load started.
    """

    status: str = "ok"
    error: str | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    chunks: int = 0
    done_at_s: float = 0.0


def _logprob_entries(endpoint: str, logprobs: dict | None) -> list[tuple[str, float, dict]]:
    if not logprobs:
        return []
    if endpoint == "chat":
        return [(e["token"], e["logprob"],
                 {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
                for e in logprobs.get("content") or []]
    return [(tok, lp, top or {}) for tok, lp, top in zip(
        logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [],
        logprobs.get("top_logprobs") or [], strict=True)]


def _absorb(endpoint: str, out: Outcome, choice: dict, streamed: bool) -> None:
    c = out.choices.setdefault(int(choice["index"]), Choice())
    if endpoint == "chat":
        part = (choice.get("delta") if streamed else choice.get("message")) or {}
        c.text += part.get("content") or ""
    else:
        c.text += choice.get("text") or ""
    c.finish_reason = choice.get("finish_reason") or c.finish_reason
    c.stop_reason = choice.get("stop_reason") if choice.get("stop_reason") is not None \
        else c.stop_reason
    c.logprobs.extend(_logprob_entries(endpoint, choice.get("logprobs")))


def send(base_url: str, p: Planned, t0: float) -> Outcome:
    """Send ``p`` (a fresh connection, so that closing it aborts only this request) and
    return what came back; never raises for a request-level problem."""
    payload = dict(p.body.payload)
    if p.stream:
        payload.update(stream=True, stream_options={"include_usage": True})
    path = "/v1/chat/completions" if p.body.endpoint == "chat" else "/v1/completions"
    delay = p.abort[1] if p.abort and p.abort[0] == "delay" else None
    max_chunks = int(p.abort[1]) if p.abort and p.abort[0] == "chunks" else None
    out = Outcome()
    start = time.perf_counter()
    try:
        with requests.post(base_url + path, json=payload, stream=p.stream,
                           timeout=(10, delay or REQUEST_TIMEOUT_S)) as r:
            if r.status_code != 200:
                out.status, out.error = "error", f"HTTP {r.status_code}: {r.text[:300]}"
            elif not p.stream:
                body = r.json()
                for choice in body.get("choices") or []:
                    _absorb(p.body.endpoint, out, choice, streamed=False)
                out.usage = body.get("usage")
            else:
                _read_stream(p, r, out, start, max_chunks)
    except (requests.ConnectionError, requests.Timeout) as e:
        # A read timeout is the planned abort (raised as ReadTimeout before the response, as
        # a ConnectionError wrapping urllib3's ReadTimeoutError inside a stream).
        if delay is not None and (isinstance(e, requests.ReadTimeout)
                                  or "Read timed out" in str(e)):
            out.status = "aborted"
        else:
            out.status, out.error = "error", f"{type(e).__name__}: {e}"
    except (requests.RequestException, ValueError, KeyError, TypeError) as e:
        out.status, out.error = "error", f"{type(e).__name__}: {e}"
    out.latency_s = time.perf_counter() - start
    out.done_at_s = time.perf_counter() - t0
    return out


def _read_stream(p: Planned, r: requests.Response, out: Outcome, start: float,
                 max_chunks: int | None) -> None:
    """Read an SSE stream into ``out``; closing early (``max_chunks``) marks it aborted."""
    if max_chunks == 0:
        out.status = "aborted"  # response headers seen, closed before any chunk
        return
    done = False
    for raw in r.iter_lines():
        if not raw or not raw.startswith(b"data: "):
            continue
        data = raw[6:]
        if data == b"[DONE]":
            done = True
            break
        msg = json.loads(data)
        if "error" in msg or msg.get("object") == "error":
            out.status, out.error = "error", f"error event: {data[:300]!r}"
            return
        if msg.get("usage"):
            out.usage = msg["usage"]
        if msg.get("choices"):
            out.chunks += 1
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
            for choice in msg["choices"]:
                _absorb(p.body.endpoint, out, choice, streamed=True)
            if max_chunks is not None and out.chunks >= max_chunks:
                out.status = "aborted"
                return
    if not done:
        out.status, out.error = "error", "stream ended without [DONE]"


# --------------------------------------------------------------------------- checks


def _check_structured(kind: str, text: str) -> str | None:
    if kind == "json":
        try:
            obj = json.loads(text)
        except ValueError as e:
            return f"not JSON ({e}): {text[:120]!r}"
        if not (isinstance(obj, dict) and set(obj) == {"name", "age"}
                and isinstance(obj["name"], str) and isinstance(obj["age"], int)
                and not isinstance(obj["age"], bool)):
            return f"JSON does not match the schema: {text[:120]!r}"
    elif kind == "choice":
        if text not in CHOICES:
            return f"not one of {CHOICES}: {text!r}"
    elif re.fullmatch(REGEX, text) is None:
        return f"does not match {REGEX}: {text!r}"
    return None


def check(p: Planned, out: Outcome, solo: Outcome | None) -> tuple[list[str], dict[str, Any]]:
    """Problems with a complete response ``out`` of ``p`` (empty: it passed), and notes
    (``truncated_structured``, ``logprob_max_diff``, ``greedy_mismatch``: bool).

    ``solo`` is the greedy body's solo outcome (None for sampled requests)."""
    b = p.body
    problems: list[str] = []
    notes: dict[str, Any] = {}
    if sorted(out.choices) != list(range(b.n)):
        problems.append(f"choices {sorted(out.choices)}, expected indices 0..{b.n - 1}")
    if not out.usage:
        return [*problems, "no usage in the response"], notes
    prompt_tokens = int(out.usage.get("prompt_tokens") or 0)
    completion_tokens = int(out.usage.get("completion_tokens") or 0)
    if b.long and not LONG_RANGE[0] <= prompt_tokens <= LONG_RANGE[1]:
        problems.append(f"long prompt has {prompt_tokens} tokens, expected {LONG_RANGE}")
    logprob_count = 0
    for i, c in sorted(out.choices.items()):
        if c.finish_reason not in ("stop", "length"):
            problems.append(f"choice {i} finish_reason {c.finish_reason!r}")
        if b.stop:
            hit = [s for s in b.stop if s in c.text]
            if hit:
                problems.append(f"choice {i} text contains stop string(s) {hit}: {c.text!r}")
            if isinstance(c.stop_reason, str) and c.stop_reason not in b.stop:
                problems.append(f"choice {i} stop_reason {c.stop_reason!r} not in {b.stop}")
        if b.structured:
            if c.finish_reason == "stop":
                bad = _check_structured(b.structured, c.text)
                if bad:
                    problems.append(f"choice {i} structured output {b.structured}: {bad}")
            else:
                notes["truncated_structured"] = True
        if b.logprobs:
            if not c.logprobs:
                problems.append(f"choice {i} has no logprobs")
            logprob_count += len(c.logprobs)
            for _, lp, top in c.logprobs:
                if not (math.isfinite(lp) and lp <= 1e-6):
                    problems.append(f"choice {i} logprob {lp}")
                    break
                if b.greedy and top and lp < max(top.values()) - 1e-5:
                    problems.append(f"choice {i}: greedy token logprob {lp} below the top "
                                    f"{max(top.values())}")
                    break
    if b.logprobs and logprob_count != completion_tokens:
        problems.append(f"{logprob_count} logprob entries for {completion_tokens} completion "
                        "tokens")
    if solo is not None:
        mine, ref = out.choices.get(0, Choice()), solo.choices.get(0, Choice())
        if (mine.text, mine.finish_reason) != (ref.text, ref.finish_reason):
            notes["greedy_mismatch"] = True
            diff = _first_difference(ref.text, mine.text)
            problems.append(f"greedy text differs from solo: {diff}")
        elif b.logprobs and len(mine.logprobs) == len(ref.logprobs):
            diff = max((abs(a[1] - r[1]) for a, r in zip(mine.logprobs, ref.logprobs,
                                                         strict=True)), default=0.0)
            notes["logprob_max_diff"] = diff
            if diff > LOGPROB_TOL:
                problems.append(f"greedy logprobs differ from solo by {diff:.2e} "
                                f"(> {LOGPROB_TOL})")
    return problems, notes


def check_aborted(p: Planned, out: Outcome, solo: Outcome | None) -> list[str]:
    """Problems with an aborted request: the text a greedy stream got before the client
    closed it must be a prefix of its solo text."""
    if solo is None or not out.choices:
        return []
    got, ref = out.choices.get(0, Choice()).text, solo.choices.get(0, Choice()).text
    if not ref.startswith(got):
        return [f"aborted greedy stream's partial text is not a prefix of its solo text: "
                f"{_first_difference(ref, got)}"]
    return []


def with_logprobs(body: Body) -> Body:
    """``body`` asking for the top-2 logprobs too (a greedy body's tokens stay the same)."""
    payload = dict(body.payload)
    if body.endpoint == "chat":
        payload.update(logprobs=True, top_logprobs=2)
    else:
        payload["logprobs"] = 2
    return Body(body.endpoint, payload, body.n, body.greedy, body.long, True, body.stop,
                body.structured)


def divergence(solo: Outcome, other: str) -> dict[str, Any]:
    """Where the text ``other`` leaves ``solo``'s text (``solo`` has logprobs): the character,
    the solo token there, the solo's two best candidates for it and their logprob gap (a tiny
    gap is a near-tie that last-bit differences can flip)."""
    c = solo.choices.get(0, Choice())
    char = _first_index(c.text, other)
    pos = 0
    for k, (tok, _, top) in enumerate(c.logprobs):
        if pos + len(tok) > char:
            ranked = sorted(top.items(), key=lambda kv: -kv[1])
            return {"char": char, "token_index": k, "solo_token": tok,
                    "solo_top": ranked[:2],
                    "gap": ranked[0][1] - ranked[1][1] if len(ranked) >= 2 else None,
                    "other_continues": other[pos:pos + 24]}
        pos += len(tok)
    return {"char": char, "token_index": None, "other_continues": other[pos:pos + 24]}


def _first_index(ref: str, got: str) -> int:
    common = min(len(ref), len(got))
    return next((k for k in range(common) if ref[k] != got[k]), common)


def _first_difference(ref: str, got: str) -> str:
    i = _first_index(ref, got)
    return (f"first difference at char {i}: solo {ref[max(0, i - 20):i + 40]!r} vs "
            f"{got[max(0, i - 20):i + 40]!r} (lengths {len(ref)} / {len(got)})")


def outcome_record(p: Planned, out: Outcome, problems: list[str], notes: dict[str, Any]
                   ) -> dict[str, Any]:
    """One request as the result JSON keeps it (texts cut to 300 characters, but for a greedy
    mismatch)."""
    return {
        "idx": p.idx, "features": p.body.features(), "stream": p.stream,
        "greedy_ref": p.greedy_ref, "abort": list(p.abort) if p.abort else None,
        "status": out.status, "error": out.error, "problems": problems, **notes,
        "latency_s": round(out.latency_s, 4), "ttft_s": out.ttft_s, "chunks": out.chunks,
        "done_at_s": round(out.done_at_s, 3), "usage": out.usage,
        "choices": {i: {"text": c.text if notes.get("greedy_mismatch") else c.text[:300],
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason} for i, c in sorted(out.choices.items())},
    }


def solo_record(i: int, body: Body, out: Outcome) -> dict[str, Any]:
    """One greedy pool entry and its solo result, for the result JSON."""
    c = out.choices.get(0, Choice())
    return {"ref": i, "features": body.features(), "payload": _short_payload(body.payload),
            "text": c.text, "finish_reason": c.finish_reason, "usage": out.usage,
            "latency_s": round(out.latency_s, 3),
            "logprobs": [lp for _, lp, _ in c.logprobs] or None}


def _short_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with long texts cut (the documents are regenerated from the seed)."""
    def cut(s: str) -> str:
        return s if len(s) <= 200 else f"{s[:80]}...[{len(s)} chars]...{s[-80:]}"
    out = dict(payload)
    if "prompt" in out:
        out["prompt"] = cut(out["prompt"])
    if "messages" in out:
        out["messages"] = [{**m, "content": cut(m["content"])} for m in out["messages"]]
    return out

