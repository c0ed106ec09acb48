"""HTTP-level request checks for vLLM's OpenAI server: an ASGI middleware, installed through
vLLM's own ``--middleware`` option (the platform adds it to that option's default, see
:meth:`vllm_unified.platform.MLXPlatform.pre_register_and_update`).

It sees the raw body, which vLLM's per-request platform hook (``validate_request``) does not,
and answers with vLLM's error format (``{"error": {"message", "type", "param", "code"}}``).

By default it refuses only what vLLM itself fails on, or what no ordinary client sends, so that
a client served by vLLM on CUDA is served here too. Two settings make it stricter (opt-in):

- ``VLLM_UNIFIED_UNKNOWN_FIELDS=reject``: top-level fields ``/v1/completions`` or
  ``/v1/chat/completions`` do not know -> 400 naming them. By default (``ignore``) they reach
  vLLM, which drops them as it does everywhere; the guard logs a warning naming them, once per
  set of names (vLLM 0.32 logs them at debug level only); vLLM's removed ``guided_*`` fields
  (served with the constraint NOT applied) get a warning, or under ``reject`` a 400, naming
  their ``structured_outputs`` replacement;
- ``VLLM_UNIFIED_MAX_REQUEST_BYTES`` above 0: a larger body -> 413 (the excess is read and
  dropped, never kept), whether its length is declared or it comes in chunks. Default 0: no
  limit, as in vLLM and uvicorn (base64 images make bodies of many MiB).

Always (the body checks on those two endpoints only; ``VLLM_UNIFIED_MAX_N``, default 128, is
the OpenAI API's own maximum of ``n``):

- a body that is not UTF-8 -> 400 naming the offending byte (vLLM answers "There was an error
  parsing the body"), and one that is UTF-8 only by accident -> 400 naming its encoding: vLLM
  parses the body with ``json.loads(bytes)``, which also reads UTF-8 with a byte order mark and
  UTF-16/32, so such a body would say to vLLM what the guard never checked;
- a ``Content-Encoding`` other than ``identity`` -> 415 (nothing on the way decompresses it);
- a key twice in one JSON object -> 400 naming it (parsers disagree on which copy counts; vLLM's
  takes the last, so one value would be silently dropped);
- text holding a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but not Unicode text)
  -> 400 naming the field, instead of a tokenizer encoding error;
- a body nested too deeply for Python's JSON parser (about 1,000 levels of arrays/objects)
  -> 400 saying so (the parser's ``RecursionError`` was an HTTP 500);
- the sampling limits of :mod:`vllm_unified.request_policy` (``n``; streaming ``n`` > 1 with
  prompt logprobs; integers outside 64 bits, NaNs and infinities in top-level fields), which
  ``validate_request`` also applies, so streamed requests get a real 400 instead of an error
  event inside a 200 stream;
- beam search with structured output, whose constraint vLLM's beam search drops -> 400;
- a body on which vLLM's request model fails internally (a field of the wrong type that a
  validator reads before pydantic checks it, e.g. ``structured_outputs`` as a list) -> 400
  naming the field, where vLLM answers 500 (:func:`check_model`);
- ``POST /v1/systemone`` (vLLM's structured decisions API) while vLLM has not enabled it for
  the served model, ``POST /scale_elastic_ep`` without elastic EP -> 404 with the reason,
  instead of vLLM's 501 / 500 (:data:`CONDITIONAL_ROUTES`).
- ``POST`` to a route vLLM registers for tasks this server does not run (a generation route
  such as ``/v1/completions`` on a pooling server, a pooling route such as ``/v1/embeddings``
  on a generating one, ``/classify`` on an embedder) -> 400 naming the server's runner and
  tasks, where vLLM answers 404 (no route registered); unknown paths stay 404
  (:func:`check_task_route`).

Everything else, including malformed JSON and wrong types, is left to vLLM's own validation.

With ``--api-key`` the guard stands aside for requests vLLM's ``AuthenticationMiddleware`` will
refuse: vLLM installs user middleware outside its own, so without this the guard would read,
parse and answer unauthenticated requests (e.g. a 400 naming a field) before vLLM's 401. They
get vLLM's 401 and nothing else, whatever their body.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from http import HTTPStatus
from typing import Any

from starlette.datastructures import Headers

from vllm_unified import compat, patches
from vllm_unified.request_policy import (
    MAX_REQUEST_BYTES_ENV,
    UNKNOWN_FIELDS_ENV,
    RequestLimits,
    current_limits,
    number_problem,
    sampling_problem,
)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

logger = compat.init_logger(__name__)

#: The endpoints whose top-level fields are checked, and vLLM's request model for each.
CHECKED_ENDPOINTS: dict[str, str] = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
}

#: Guided-decoding fields vLLM removed (0.32 ignores them); ``structured_outputs`` replaces them.
REMOVED_GUIDED_FIELDS: dict[str, str] = {
    "guided_json": '"structured_outputs": {"json": <schema>}',
    "guided_regex": '"structured_outputs": {"regex": <pattern>}',
    "guided_choice": '"structured_outputs": {"choice": [...]}',
    "guided_grammar": '"structured_outputs": {"grammar": <grammar>}',
    "guided_decoding_backend": "--structured-outputs-config",
    "guided_whitespace_pattern": '"structured_outputs": {"whitespace_pattern": ...}',
}


#: Routes vLLM registers on every server although they work only on some: path -> (what
#: the route is, the compat function giving why it cannot work on a server app, or None).
#: vLLM answers them 501 (structured decisions off for the model) or 500 "Scale failed"
#: (no elastic EP); the guard answers 404 with the reason.
CONDITIONAL_ROUTES: dict[str, tuple[str, str]] = {
    "/v1/systemone": ("vLLM's structured decisions API", "structured_decisions_unavailable"),
    "/scale_elastic_ep": ("elastic EP scaling", "elastic_ep_unavailable"),
}

#: What each kind of server (vLLM's runner type) serves, for the refusal of the other's routes.
KIND_NAMES: dict[str, str] = {
    "generate": "text generation",
    "pooling": "pooling (embeddings, scores, classification)",
}


def _matches(routes: Any, path: str) -> bool:
    return any(getattr(route, "path_regex", None) is not None
               and route.path_regex.match(path) is not None for route in routes)


def check_task_route(app: Any, path: str) -> None:
    """A route vLLM registers only for tasks the server ``app`` does not run
    (:func:`vllm_unified.compat.kind_routes`), requested on it.

    Raises:
        RequestRejected: 400 naming the server's runner and tasks and what the route needs.
    """
    served = compat.served_tasks(app)
    if served is None or _matches(app.routes, path):
        return  # not vLLM's server, or a route it serves (vLLM answers)
    runner, tasks = served
    kind = next((k for k, routes in compat.kind_routes().items() if _matches(routes, path)),
                None)
    if kind is None:
        return  # unknown path: vLLM's 404
    listed = ", ".join(tasks)
    if kind == runner:  # e.g. /classify on an embedder
        raise RequestRejected(
            f"this server's {KIND_NAMES[runner]} model serves the tasks {listed}; "
            f"POST {path} needs another task and is not served", None, HTTPStatus.BAD_REQUEST)
    raise RequestRejected(
        f"this server runs a {KIND_NAMES[runner]} model (--runner {runner}, tasks: {listed}); "
        f"POST {path} is a {KIND_NAMES[kind]} route and is not served: start a server with "
        f"--runner {kind} and a model for it", None, HTTPStatus.BAD_REQUEST)


#: Import path given to vLLM's ``--middleware``.
GUARD_PATH = "vllm_unified.request_guard.RequestGuard"
#: The stalled-client timeout (:mod:`vllm_unified.stalled_clients`), installed with the guard.
STALL_PATH = "vllm_unified.stalled_clients.StalledClientTimeout"
#: Our middleware, in the order given to ``--middleware`` (vLLM adds each around the previous
#: ones, so the last is outermost).
MIDDLEWARE = (STALL_PATH, GUARD_PATH)


def add_to_middleware_default(parser: Any) -> None:
    """Make :data:`MIDDLEWARE` part of the default of vLLM's ``--middleware`` option, so
    ``vllm serve`` installs it; a user's own ``--middleware`` values are appended to it."""
    if parser is None or not any(a.dest == "middleware" for a in parser._actions):
        return
    current = list(parser.get_default("middleware") or [])
    ours = [m for m in MIDDLEWARE if m not in current]
    if ours:
        parser.set_defaults(middleware=[*ours, *current])


class RequestRejected(Exception):
    """A request refused before it reaches vLLM."""

    def __init__(self, message: str, param: str | None, status: HTTPStatus) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def known_fields(model_name: str) -> frozenset[str]:
    """Field names and aliases of vLLM's request model ``model_name`` (what vLLM accepts)."""
    model = getattr(compat, model_name)
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        if field.alias:
            names.add(field.alias)
    return frozenset(names)


def check_fields(body: dict[str, Any], known: frozenset[str], endpoint: str,
                 limits: RequestLimits) -> None:
    """Reject unknown fields (removed guided-decoding ones with their replacement named) with
    ``unknown_fields="reject"``; else log them (:func:`warn_unknown_fields`) and let vLLM drop
    them, as vLLM on CUDA does.

    Raises:
        RequestRejected: 400 naming the field(s).
    """
    unknown = sorted(set(body) - known)
    if not unknown:
        return
    reject = limits.unknown_fields == "reject"
    for name in unknown:
        if name in REMOVED_GUIDED_FIELDS:
            message = (f"'{name}' was removed from vLLM and is ignored (output NOT "
                       f"constrained); use {REMOVED_GUIDED_FIELDS[name]} or response_format")
            if reject:
                raise RequestRejected(message, name, HTTPStatus.BAD_REQUEST)
            warn_unknown_fields(endpoint, message)
    listed = ", ".join(f"'{n}'" for n in unknown)
    if reject:
        raise RequestRejected(
            f"unknown field(s) {listed} for {endpoint}: vLLM would ignore them "
            f"(this server sets {UNKNOWN_FIELDS_ENV}=reject; ignore accepts and ignores them)",
            unknown[0], HTTPStatus.BAD_REQUEST,
        )
    warn_unknown_fields(endpoint, listed)


#: Sets of unknown field names already warned about; emptied when it holds
#: :data:`MAX_WARNED` sets, so that clients inventing names cannot grow it without end.
_warned: set[tuple[str, str]] = set()
MAX_WARNED = 1024


def warn_unknown_fields(endpoint: str, listed: str) -> None:
    """Log a warning that ``listed`` fields of ``endpoint`` are ignored, once per set of names
    (clients that send extra fields send them on every request)."""
    key = (endpoint, listed)
    if key in _warned:
        return
    if len(_warned) >= MAX_WARNED:
        _warned.clear()
    _warned.add(key)
    logger.warning(
        "vllm-unified: the following fields were present in the request but ignored (%s): "
        "%s (set %s=reject to refuse requests with unknown fields)",
        endpoint, listed, UNKNOWN_FIELDS_ENV)


def check_sampling_fields(body: dict[str, Any], endpoint: str, limits: RequestLimits) -> None:
    """The request policy's sampling limits (:func:`~vllm_unified.request_policy.
    sampling_problem`) on the raw fields, so that a streamed request gets a real HTTP 400
    rather than an error event in a 200 stream (where ``validate_request`` errors land).

    Raises:
        RequestRejected: 400 naming the field.
    """
    n = body.get("n")
    if not isinstance(n, int) or isinstance(n, bool):
        return  # absent or a wrong type: vLLM's own validation answers
    prompt_logprobs = body.get("prompt_logprobs") is not None or (
        endpoint == "/v1/completions" and bool(body.get("echo"))
        and body.get("logprobs") is not None
    )
    problem = sampling_problem(n, prompt_logprobs, body.get("stream") is True, limits)
    if problem is not None:
        raise RequestRejected(problem[0], problem[1], HTTPStatus.BAD_REQUEST)


#: ``response_format`` types that constrain the output.
CONSTRAINING_FORMATS = ("json_object", "json_schema", "structural_tag")


def check_beam_search(body: dict[str, Any]) -> None:
    """Beam search with structured output: vLLM's beam search builds its own per-step
    sampling parameters without the constraint, so the output is silently unconstrained.

    Raises:
        RequestRejected: 400 naming ``use_beam_search``.
    """
    if body.get("use_beam_search") is not True:
        return
    response_format = body.get("response_format")
    constrained = bool(body.get("structured_outputs")) or (
        isinstance(response_format, dict)
        and response_format.get("type") in CONSTRAINING_FORMATS)
    if constrained:
        raise RequestRejected(
            "use_beam_search cannot be combined with structured output (structured_outputs, "
            "response_format): vLLM's beam search does not apply the constraint",
            "use_beam_search", HTTPStatus.BAD_REQUEST)


def check_numbers(body: dict[str, Any]) -> None:
    """:func:`~vllm_unified.request_policy.number_problem` on the body's top-level fields
    (an integer outside 64 bits, a NaN or an infinity).

    Raises:
        RequestRejected: 400 naming the field.
    """
    problem = number_problem(body)
    if problem is not None:
        raise RequestRejected(problem[0], problem[1], HTTPStatus.BAD_REQUEST)


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string in a parsed JSON value (keys too), with its JSON path, in document order.

    Iterative: a value nested as deeply as the JSON parser allows must not exhaust the
    interpreter's recursion limit here.
    """
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            yield path, value
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                children += [(child, key), (child, item)]
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend(reversed([(f"{path}[{i}]", item) for i, item in enumerate(value)]))


def check_text(body: Any) -> None:
    """Reject strings that are not valid Unicode text (a lone UTF-16 surrogate).

    Raises:
        RequestRejected: 400 naming the field, the code point and its position.
    """
    for path, text in _strings(body, ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestRejected(
                f"field '{path}' contains a lone UTF-16 surrogate "
                f"(U+{ord(text[e.start]):04X} at character {e.start}); text must be valid "
                "Unicode (surrogates only come in escaped pairs)",
                path, HTTPStatus.BAD_REQUEST,
            ) from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of :func:`parse_body`."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body exactly as vLLM will read it, or None where vLLM's own
    parser (``json.loads`` of the bytes, via Starlette's ``Request.json``) will refuse it.

    Raises:
        RequestRejected: 400 for a body that is not UTF-8, that ``json.loads`` would decode
            as another encoding (a UTF-8 byte order mark, UTF-16/32), with a key twice in
            one object, or nested too deeply for the JSON parser.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestRejected(
            f"request body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset "
            f"{e.start}); JSON must be UTF-8 encoded",
            None, HTTPStatus.BAD_REQUEST,
        ) from None
    encoding = json.detect_encoding(raw)
    if encoding != "utf-8":
        what = "has a UTF-8 byte order mark" if encoding == "utf-8-sig" else (
            f"reads as {encoding.upper()}")
        raise RequestRejected(
            f"request body {what}; JSON must be UTF-8 without a byte order mark",
            None, HTTPStatus.BAD_REQUEST,
        )
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise RequestRejected(
            f"key '{e.key}' appears more than once in one JSON object of the request body; "
            "send each key once", e.key, HTTPStatus.BAD_REQUEST,
        ) from None
    except ValueError:
        return None  # vLLM answers malformed JSON itself, naming the position
    except RecursionError:
        raise RequestRejected(
            "request body nests JSON arrays/objects too deeply to parse (the JSON parser "
            "stops at about 1,000 levels)",
            None, HTTPStatus.BAD_REQUEST,
        ) from None


def _find_authentication(app: Any) -> Any:
    """vLLM's ``AuthenticationMiddleware`` among the ASGI apps inside ``app`` (each
    middleware holds the next as ``.app``), or None (no ``--api-key``)."""
    for _ in range(64):
        if app is None:
            return None
        if isinstance(app, compat.AuthenticationMiddleware):
            return app
        app = getattr(app, "app", None)
    return None


def _field_adapter(model_name: str, name: str) -> Any:
    """A pydantic ``TypeAdapter`` for one field of vLLM's request model (by name or alias),
    or None if the model has no such field."""
    fields = getattr(compat, model_name).model_fields
    info = fields.get(name) or next((f for f in fields.values() if f.alias == name), None)
    if info is None:
        return None  # not cached: the names come from clients
    key = (model_name, name)
    if key not in _ADAPTERS:
        from typing import Annotated

        from pydantic import TypeAdapter

        _ADAPTERS[key] = TypeAdapter(
            Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation)
    return _ADAPTERS[key]


_ADAPTERS: dict[tuple[str, str], Any] = {}


def _wrong_field(body: dict[str, Any], model_name: str) -> tuple[str, str] | None:
    """The first top-level field whose value is not of its declared type, with pydantic's
    message, else None."""
    from pydantic import ValidationError

    for name, value in body.items():
        adapter = _field_adapter(model_name, name)
        if adapter is None:
            continue
        try:
            adapter.validate_python(value)
        except ValidationError as e:
            return name, e.errors()[0]["msg"]
    return None


def check_model(body: dict[str, Any], endpoint: str) -> None:
    """vLLM's own request model on the body, for what its validators fail on internally.

    vLLM's ``mode="before"`` model validators read fields before pydantic has checked their
    types (``structured_outputs`` as a list: ``AttributeError``), and the server answers
    HTTP 500. When validating raises an error that vLLM's error mapping
    (``create_error_response``) would answer with a 5xx, the request is refused here instead,
    naming the field of the wrong type; everything else is left to vLLM (the same validation
    runs again there and gives vLLM's own answer).

    Raises:
        RequestRejected: 400 naming the field, or the validator's error when no single field
            is of the wrong type.
    """
    model_name = CHECKED_ENDPOINTS[endpoint]
    try:
        getattr(compat, model_name).model_validate(body)
    except Exception as e:  # any error: vLLM's own mapping decides what it would answer
        if compat.create_error_response(e).error.code < 500:
            return
        wrong = _wrong_field(body, model_name)
        if wrong is not None:
            raise RequestRejected(f"field '{wrong[0]}' of {endpoint}: {wrong[1]}",
                                  wrong[0], HTTPStatus.BAD_REQUEST) from None
        raise RequestRejected(f"{endpoint} request is malformed: vLLM's validation failed with "
                              f"{type(e).__name__}: {e}", None, HTTPStatus.BAD_REQUEST) from None


class RequestGuard:
    """ASGI middleware applying the checks above to POST requests.

    Args:
        app: the next ASGI application (vLLM's middleware stack, then its router).
        limits: the policy; read from the environment (:class:`RequestLimits`) if omitted.
    """

    def __init__(self, app: Callable, limits: RequestLimits | None = None) -> None:
        self.app = app
        self.limits = limits or current_limits()
        self._known: dict[str, frozenset[str]] = {}
        self._auth = _find_authentication(app)
        # vLLM builds its app, and this middleware with it, once in the API-server process:
        # the patches of vLLM's server code go in here.
        patches.patch_anthropic_stream_errors()
        patches.patch_responses_empty_output_message()

    def _refused_by_auth(self, scope: Scope) -> bool:
        """Whether vLLM's ``--api-key`` check, further in, will answer 401 (its own rule)."""
        if self._auth is None:
            return False
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        return (path.startswith(compat.GUARDED_PREFIX)
                and not self._auth.verify_token(Headers(scope=scope)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or self._refused_by_auth(scope)):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
            if body is None:  # client went away
                return
            self._check_route(scope)
            self._check(scope, body)
        except RequestRejected as e:
            await _send_error(send, e)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None if the client disconnected.

        Raises:
            RequestRejected: 413 once the body (declared or received) passes the limit, if
                there is one (``max_request_bytes`` > 0); the rest is read and dropped first,
                so the client gets the answer rather than a reset connection while it is
                still sending.
        """
        limit = self.limits.max_request_bytes
        declared = _header(scope, b"content-length")
        too_large = (limit > 0 and declared is not None and declared.isdigit()
                     and int(declared) > limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            too_large = too_large or 0 < limit < size
            if not too_large:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if too_large:
            raise _too_large(max(size, int(declared or 0)), limit)
        return b"".join(chunks)

    def _check_route(self, scope: Scope) -> None:
        """A :data:`CONDITIONAL_ROUTES` route that cannot work on this server, or a route of
        tasks it does not run (:func:`check_task_route`).

        Raises:
            RequestRejected: 404 with the reason; 400 for the other tasks' routes.
        """
        path = _path(scope)
        if "app" not in scope:
            return  # no app in the scope: not vLLM's FastAPI server
        if path not in CONDITIONAL_ROUTES:
            check_task_route(scope["app"], path)
            return
        what, why = CONDITIONAL_ROUTES[path]
        reason = getattr(compat, why)(scope["app"])
        if reason is not None:
            raise RequestRejected(f"POST {path} ({what}) is not available on this server: "
                                  f"{reason}", None, HTTPStatus.NOT_FOUND)

    def _check(self, scope: Scope, raw: bytes) -> None:
        path = _path(scope)
        if path not in CHECKED_ENDPOINTS:
            return
        coding = (_header(scope, b"content-encoding") or "identity").strip().lower()
        if coding != "identity":
            raise RequestRejected(
                f"Content-Encoding '{coding}' is not supported: send the JSON body "
                "uncompressed", None, HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            )
        body = parse_body(raw)
        if body is None:
            return
        check_text(body)
        if isinstance(body, dict):
            if path not in self._known:
                self._known[path] = known_fields(CHECKED_ENDPOINTS[path])
            check_fields(body, self._known[path], path, self.limits)
            check_sampling_fields(body, path, self.limits)
            check_numbers(body)
            check_beam_search(body)
            check_model(body, path)


def _path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "") or "")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _too_large(size: int, limit: int) -> RequestRejected:
    return RequestRejected(
        f"request body of {size} bytes exceeds this server's limit of {limit} bytes "
        f"(set {MAX_REQUEST_BYTES_ENV} to change it)",
        None, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then defers to the client's
    (the app listens there for ``http.disconnect`` while it streams)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, error: RequestRejected) -> None:
    err_type = "BadRequestError" if error.status == HTTPStatus.BAD_REQUEST else error.status.phrase
    payload = compat.create_error_response(str(error), err_type, error.status, error.param)
    data = payload.model_dump_json().encode()
    await send({
        "type": "http.response.start",
        "status": int(error.status),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": data})
