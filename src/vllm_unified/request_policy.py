"""Request limits that are policy, not vLLM semantics: each is a documented setting
(``VLLM_UNIFIED_*`` environment variable, see ``docs/configuration.md``) with a default.

vLLM's own front end validates ranges and types; these cover what it accepts although it can
hurt the server or silently lose what the client asked for.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_unified import compat, envs
from vllm_unified.envs import MAX_N_ENV, MAX_REQUEST_BYTES_ENV, UNKNOWN_FIELDS_ENV

DEFAULT_MAX_N: int = envs.SETTINGS[MAX_N_ENV].default
DEFAULT_MAX_REQUEST_BYTES: int = envs.SETTINGS[MAX_REQUEST_BYTES_ENV].default
DEFAULT_UNKNOWN_FIELDS: str = envs.SETTINGS[UNKNOWN_FIELDS_ENV].default
#: The signed 64-bit range: vLLM hands a request to its engine process as msgpack, which
#: carries no integer outside [-2**63, 2**64 - 1], and its samplers keep integers as int64.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class RequestLimits:
    """The request policy in force.

    Attributes:
        max_n: most completions (``n``) one request may ask for.
        max_request_bytes: largest HTTP request body, bytes; 0: no limit (vLLM's behaviour).
        unknown_fields: ``ignore`` (vLLM's behaviour: dropped, with a warning) or ``reject``
            (HTTP 400 naming them) for top-level fields the OpenAI endpoint does not know.
    """

    max_n: int = DEFAULT_MAX_N
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    unknown_fields: str = DEFAULT_UNKNOWN_FIELDS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RequestLimits:
        """Read the settings (from ``os.environ`` unless ``environ`` is given).

        Raises:
            ValueError: a setting that is not an integer in its range / not one of the choices,
                naming the variable and the value.
        """
        return cls(
            max_n=envs.read(MAX_N_ENV, environ),
            max_request_bytes=envs.read(MAX_REQUEST_BYTES_ENV, environ),
            unknown_fields=envs.read(UNKNOWN_FIELDS_ENV, environ),
        )


@functools.cache
def current_limits() -> RequestLimits:
    """The limits from this process's environment, read once (checked at start-up by
    :meth:`vllm_unified.platform.MLXPlatform.validate_environ`)."""
    return RequestLimits.from_env()


def sampling_problem(
    n: int, prompt_logprobs: bool, streamed: bool, limits: RequestLimits
) -> tuple[str, str] | None:
    """What vLLM would accept but this server refuses, as (message, field), else None.

    Args:
        n: completions asked for.
        prompt_logprobs: whether prompt logprobs are asked for (``prompt_logprobs``, or
            ``echo`` with ``logprobs`` on the completions endpoint).
        streamed: whether the outputs are streamed (vLLM's ``RequestOutputKind.DELTA``).
    """
    if n > limits.max_n:
        return (f"n={n} exceeds this server's limit of {limits.max_n} completions per "
                f"request (set {MAX_N_ENV} to change it)", "n")
    # vLLM's streaming completions code takes the prompt (token ids, logprobs) from the first
    # output of each request; with n > 1 later children arrive without it and the OpenAI
    # server fails with HTTP 500 (vLLM 0.32, its own CPU backend too).
    if n > 1 and prompt_logprobs and streamed:
        return ("streaming with n > 1 and prompt logprobs (echo with logprobs, or "
                "prompt_logprobs) is not supported by vLLM's streaming code; use "
                "stream=false, n=1, or no prompt logprobs", "n")
    return None


def _numbers(name: str, value: Any) -> Iterator[tuple[str, int | float]]:
    """The numbers of one field with their names: the value itself, or the items, keys and
    values of a list / tuple / dict value (one level; booleans are not numbers)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield name, value
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, int | float) and not isinstance(item, bool):
                yield f"{name}[{i}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, int | float) and not isinstance(key, bool):
                yield f"{name} key", key
            if isinstance(item, int | float) and not isinstance(item, bool):
                yield f"{name}[{key!r}]", item


def _short(number: int) -> str:
    text = str(number)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text.lstrip('-'))} digits)"


def number_problem(fields: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first number vLLM accepts but cannot serve, as (message, field), else None.

    - an integer outside the signed 64-bit range (:data:`INT64_MIN`, :data:`INT64_MAX`):
      vLLM checks the range of ``seed`` and ``priority`` only; a larger ``top_k`` or
      ``stream_interval`` fails when the request is handed to the engine, as HTTP 500 with
      an empty message (vLLM 0.32, its own CPU backend too);
    - a NaN or an infinity (JSON has neither; Python's parser reads ``NaN``, ``Infinity``
      and ``1e999``): vLLM refuses them for temperature, top_p and the penalties, but takes
      them as ``logit_bias`` values and adds them to the logits (a NaN logit; an infinite one
      that turns NaN under a structured-output mask).

    Args:
        fields: field name -> value (a request body's top-level fields, or a
            ``SamplingParams``' fields); lists and dicts are looked into one level deep.
    """
    for field, value in fields.items():
        for name, number in _numbers(field, value):
            if isinstance(number, int) and not INT64_MIN <= number <= INT64_MAX:
                return (f"{name} = {_short(number)} is outside the 64-bit integer range "
                        f"[-2**63, 2**63 - 1] this server accepts", field)
            if isinstance(number, float) and not math.isfinite(number):
                return f"{name} is {number}; numbers must be finite", field
    return None


#: Token restrictions that can leave no token a structured-output grammar allows.
TOKEN_RESTRICTIONS = ("allowed_token_ids", "bad_words")


def constraint_problem(fields: Mapping[str, Any]) -> tuple[str, str] | None:
    """Structured output together with a token restriction (:data:`TOKEN_RESTRICTIONS`), as
    (message, field), else None.

    When the grammar's tokens and the restriction have none in common (a regex of digits
    with ``allowed_token_ids`` of letters; ``choice: ["a"]`` with ``bad_words: ["a"]``),
    vLLM's sampler has no token left, samples a masked one, the grammar rejects it and the
    engine ends the request: HTTP 500 "Internal server error" (vLLM 0.32, its own backend
    too). That cannot be known before generating, so the combination is refused.

    Args:
        fields: a ``SamplingParams``' fields (``structured_outputs`` is set for
            ``structured_outputs``, ``response_format`` and a ``tool_choice`` that forces
            a tool alike).
    """
    if fields.get("structured_outputs") is None:
        return None
    for name in TOKEN_RESTRICTIONS:
        if fields.get(name):
            return (f"{name} cannot be combined with structured output (structured_outputs, "
                    "response_format, or a tool_choice that forces a tool): where they leave "
                    "no token allowed, the engine could only end the request with an error",
                    name)
    return None


def check_sampling(params: Any, limits: RequestLimits) -> None:
    """Refuse sampling requests vLLM accepts but that would hurt the server or fail late:
    :func:`sampling_problem`, :func:`number_problem` on every public field,
    :func:`constraint_problem`.

    Args:
        params: the request's ``SamplingParams`` (before vLLM fans ``n`` out).

    Raises:
        VLLMValidationError: naming the field and the limit (HTTP 400 in the server).
    """
    problem = sampling_problem(
        params.n, params.prompt_logprobs is not None,
        params.output_kind == compat.RequestOutputKind.DELTA, limits,
    )
    fields = compat.sampling_fields(params)
    problem = problem or number_problem(fields) or constraint_problem(fields)
    if problem is not None:
        message, field = problem
        raise compat.VLLMValidationError(message, parameter=field, value=getattr(params, field))


def check_room_for_output(prompt_len: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no room for one output token in the context window.

    Args:
        prompt_len: tokens of the prompt as the model sees it (after the chat template and
            any truncation).
        max_model_len: the engine's ``--max-model-len``.

    Raises:
        VLLMValidationError: ``prompt_len >= max_model_len``; the message names both numbers
            and ``--max-model-len``; parameter ``input_tokens`` (vLLM's name for the prompt's
            length in its own context-length error).
    """
    if prompt_len < max_model_len:
        return
    raise compat.VLLMValidationError(
        f"This model's maximum context length is {max_model_len} tokens (--max-model-len) "
        f"and your prompt contains {prompt_len} input tokens, which leaves no room for any "
        f"output token (at least 1 is needed). Please reduce the prompt to at most "
        f"{max_model_len - 1} tokens.",
        parameter="input_tokens", value=prompt_len)
