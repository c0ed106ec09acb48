"""``vllm bench serve`` (vLLM's own load client, :func:`vllm.benchmarks.serve.main`) with SSE
comment events dropped from streamed responses before its parser reads them.

Why: vLLM's request functions strip every chunk read from the socket before handing it to
their SSE parser, so an event that arrives alone loses its blank-line terminator. For ``data:``
events the parser recovers (it accepts a buffer that is complete JSON), but a comment event
(``: keepalive 3/4``, which mlx_lm.server sends while it processes a prompt) stays in the
buffer and every later event is glued to it: the request then yields its first token only at
the end (TTFT = latency, TPOT 0) or fails. Comments carry no data in SSE, so dropping them
changes nothing else; events are passed on as soon as their terminator arrives, as an SSE
reader dispatches them. Every contender's load goes through this same client.

    python benchmarks/measure/bench_client.py --backend openai --base-url URL ...  # its flags
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator


def _events_without_comments(iter_any):
    """Wrap ``aiohttp.StreamReader.iter_any``: yield whole SSE events (terminator included),
    comment events left out; a tail without terminator (a plain JSON body) comes last."""

    async def events(self) -> AsyncIterator[bytes]:
        pending = b""
        async for chunk in iter_any(self):
            pending += chunk
            *complete, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in complete:
                if event.strip() and not event.lstrip().startswith(b":"):
                    yield event + b"\n\n"
        if pending.strip():
            yield pending

    return events


def main(argv: list[str]) -> None:
    import aiohttp
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    aiohttp.StreamReader.iter_any = _events_without_comments(aiohttp.StreamReader.iter_any)
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
