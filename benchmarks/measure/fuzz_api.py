"""Fuzz the HTTP API of ``vllm serve`` through vllm-unified: thousands of generated requests
across every endpoint of vLLM's own ``/openapi.json``, with the property that no response is a
server error (HTTP >= 500, or a server-error event in a stream), no request hangs, and after
every batch the server is healthy and gives the same greedy text as before the first.

The requests come from ``tests/api_fuzz.py``: schemathesis' cases for every operation of the
schema (positive and negative), our Hypothesis strategies for the generation fields of
``/v1/completions`` and ``/v1/chat/completions`` (extreme numbers, huge arrays, odd Unicode,
conflicting options) and raw bodies (deep nesting, NaN tokens, huge integer literals, invalid
UTF-8). Half of all requests come from our strategies. The server serves a tiny random-weight
Llama (``tests/tiny_models.py``, cheap) or, with ``--model default``, SmolLM2-135M's GGUF.

Prints the counts by endpoint and status and every failed request; writes
``benchmarks/results/fuzz_api-<ts>.json``. Exit status 1 if any request failed or the server
went down.

    .venv/bin/python benchmarks/serve.py fuzz                     # 5,000 requests, seed 0
    .venv/bin/python benchmarks/serve.py fuzz --requests 20000 --seed 7 --model default
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from harness import machine_info, versions, write_result  # noqa: E402

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))

from api_fuzz import Fuzzer, ServerDown, rounds, server_args, sources_for  # noqa: E402
from conftest import default_model_path, vllm_server  # noqa: E402

SERVED = "fuzzed"


def print_counts(report: dict) -> None:
    statuses = sorted(report["by_status"], key=str)
    width = max(len(label) for label in report["by_endpoint"])
    print(f"{'endpoint':<{width}} " + " ".join(f"{s:>7}" for s in statuses))
    for label, counts in report["by_endpoint"].items():
        print(f"{label:<{width}} " + " ".join(f"{counts.get(s, 0):>7}" for s in statuses))
    print(f"{'all':<{width}} " + " ".join(f"{report['by_status'][s]:>7}" for s in statuses))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="requests to send")
    parser.add_argument("--seed", type=int, default=0, help="seed of every batch's draw")
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny",
                        help="tiny random-weight Llama, or SmolLM2-135M (the default model)")
    parser.add_argument("--workers", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds of silence after which a request counts as hung")
    parser.add_argument("--schema-batch", type=int, default=4,
                        help="requests per schema operation and mode in each round")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the server (its own process group) is always stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    ts = datetime.now().strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fuzz-api-") as tmp:
        if args.model == "tiny":
            from tiny_models import make_tiny_checkpoint

            model = str(make_tiny_checkpoint(tmp, "llama"))
        else:
            model = default_model_path()
        served_args = server_args(model, SERVED)
        down = None
        started = time.monotonic()
        with vllm_server(Path(tmp), served_args) as (base, proc):
            fuzzer = Fuzzer(base, SERVED, timeout_s=args.timeout, workers=args.workers,
                            alive=lambda: proc.poll() is None)
            sources = sources_for(base, SERVED)
            try:
                fuzzer.run(rounds(sources, args.seed, args.schema_batch), args.requests,
                           log=lambda line: print(line, flush=True))
            except ServerDown as e:
                down = str(e)
            elapsed = time.monotonic() - started
            log = (Path(tmp) / "server.log").read_text(errors="replace").splitlines()
            # the engine's and API server's error lines (their tracebacks), the last 400
            server_errors = [line for line in log if " ERROR " in line][-400:]
    report = fuzzer.report()
    print_counts(report)
    for failure in report["failed_requests"]:
        print("FAILED", failure)
    if down:
        print("SERVER DOWN:", down)
    for name, reason in report["unsupported_sources"].items():
        print(f"NOT FUZZED {name}: {reason}")
    results = {"kind": "fuzz_api", "timestamp": ts, "args": vars(args),
               "server_args": ["<model>", *served_args[1:]], "model": args.model,
               "sources": sorted(sources), "server_down": down, "elapsed_s": round(elapsed, 1),
               **report, "versions": versions(),
               "machine": machine_info(load_before, os.getloadavg())}
    if down or report["failed_requests"]:
        results["server_errors"] = server_errors
    write_result("fuzz_api", ts, results)
    ok = not report["failed_requests"] and down is None and report["requests"] >= args.requests
    print(f"{report['requests']} requests, {report['failures']} failures, "
          f"{report['liveness_checks']} liveness checks, server "
          f"{'DOWN' if down else 'healthy'} ({elapsed:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
