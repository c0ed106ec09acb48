"""A time limit on clients that stop reading: an ASGI middleware for vLLM's OpenAI server,
installed with the request guard through vLLM's ``--middleware`` option
(:func:`vllm_unified.request_guard.add_to_middleware_default`).

vLLM's engine does not slow down for a slow reader: it keeps generating, and the server's
``send`` of the next chunk waits until the client's TCP window opens (uvicorn's flow control,
after about 3 MB sit in the socket buffers on Linux). A client that stops reading without
closing its connection would hold its request's KV blocks until ``max_tokens`` and then its
HTTP handler, connection and buffers for as long as the TCP connection lives (indefinitely,
when the peer keeps acknowledging with a zero window).

:class:`StalledClientTimeout` bounds that: when one ``send`` of a response body has waited
``VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S`` seconds (default 60; 0 turns the limit off), the
request is treated as disconnected: a warning names it, the response is abandoned, the
connection is closed, and vLLM aborts the request as it does when a client goes away (its
output generator is closed), which frees its KV blocks. Other requests are never affected: each
``send`` waits on its own connection only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_unified import envs
from vllm_unified.compat import init_logger

logger = init_logger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientStalled(Exception):
    """Raised from ``send`` when the client accepted nothing within the timeout."""


class StalledClientTimeout:
    """ASGI middleware: abandon a response whose client accepts nothing for ``timeout_s``.

    Args:
        app: the next ASGI application.
        timeout_s: seconds one ``send`` may wait; default
            ``VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S``; 0 disables the limit.
    """

    def __init__(self, app: Callable, timeout_s: float | None = None) -> None:
        self.app = app
        self.timeout_s = (envs.read(envs.STALLED_CLIENT_TIMEOUT_ENV) if timeout_s is None
                          else timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.timeout_s:
            await self.app(scope, receive, send)
            return
        timeout = self.timeout_s

        async def timed_send(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await self.app(scope, receive, timed_send)
        except ClientStalled:
            client = scope.get("client") or ("?", "?")
            logger.warning(
                "vllm-unified: the client %s:%s of %s %s accepted no data for %g s "
                "(%s); its request is aborted and the connection closed",
                client[0], client[1], scope.get("method"), scope.get("path"), timeout,
                envs.STALLED_CLIENT_TIMEOUT_ENV)
            # Returning without completing the response makes the server close the
            # connection; the abandoned response's generator is closed, aborting the request.
