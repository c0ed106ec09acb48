"""Request limits that are policy, not vLLM semantics: each is a documented setting
(``VLLM_UNIFIED_*`` environment variable, see ``docs/configuration.md``) with a default.

vLLM's own front end validates ranges and types; these cover what it accepts although it can
hurt the server or silently lose what the client asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_unified import compat, envs
from vllm_unified.envs import MAX_N_ENV, MAX_REQUEST_BYTES_ENV, UNKNOWN_FIELDS_ENV

DEFAULT_MAX_N: int = envs.SETTINGS[MAX_N_ENV].default
DEFAULT_MAX_REQUEST_BYTES: int = envs.SETTINGS[MAX_REQUEST_BYTES_ENV].default


@dataclass(frozen=True)
class RequestLimits:
    """The request policy in force.

    Attributes:
        max_n: most completions (``n``) one request may ask for.
        max_request_bytes: largest HTTP request body, bytes.
        unknown_fields: ``reject`` (HTTP 400 naming them) or ``ignore`` (vLLM's behaviour:
            logged and dropped) for top-level fields the OpenAI endpoint does not know.
    """

    max_n: int = DEFAULT_MAX_N
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    unknown_fields: str = "reject"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RequestLimits:
        """Read the settings (from ``os.environ`` unless ``environ`` is given).

        Raises:
            ValueError: a setting that is not a positive integer / not one of the choices,
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


def check_sampling(params: Any, limits: RequestLimits) -> None:
    """Refuse sampling requests vLLM accepts but that would hurt the server or fail late.

    Args:
        params: the request's ``SamplingParams`` (before vLLM fans ``n`` out).

    Raises:
        VLLMValidationError: naming the field and the limit (HTTP 400 in the server).
    """
    problem = sampling_problem(
        params.n, params.prompt_logprobs is not None,
        params.output_kind == compat.RequestOutputKind.DELTA, limits,
    )
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
