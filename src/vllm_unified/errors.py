"""Exceptions of the plugin that callers tell apart from others."""

from __future__ import annotations


class StartupRefused(ValueError):
    """A configuration refused at start-up, before anything is loaded.

    The message is one line naming the flag or variable and the numbers; the ``vllm``
    command (:func:`vllm_unified.cli.main`) prints it alone instead of vLLM's traceback
    (raised inside vLLM's config validation, it reaches the command wrapped in pydantic's
    ``ValidationError``). Elsewhere (``LLM(...)``) it is an ordinary ``ValueError``.
    """
