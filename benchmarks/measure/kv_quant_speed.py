"""Serving speed with a quantized KV cache: 16 concurrent requests of 1,500-token prompts,
output tokens per second with ``--kv-cache-dtype int8_per_token_head`` (and int4) against the
unquantized cache (the model dtype). Target (issue 18): int8 >= 0.9x the unquantized cache.

Each format is its own engine process (vLLM's offline ``LLM``, default model SmolLM2, fp32,
prefix caching off so every round prefills): a warm-up round, then ``--rounds`` timed rounds
of ``--requests`` prompts of ``--prompt-tokens`` random token ids (seeded, the same in every
process) generating ``--max-tokens`` tokens each (``ignore_eos``). Output tok/s = generated
tokens / wall time of ``LLM.generate`` (prefill included, as a client sees it); the decode
rate alone subtracts a ``max_tokens=1`` round of the same prompts. Run it on a quiet machine
(2 cores shared make the figures meaningless). Writes
``benchmarks/results/kv_quant_speed-<ts>.json``.

    .venv/bin/python benchmarks/kernels.py kv-quant-speed
    .venv/bin/python benchmarks/kernels.py kv-quant-speed --formats auto int8_per_token_head \
        --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from harness import machine_info, run_child, versions, write_result  # noqa: E402
from real_models import models  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TARGET = {"int8_per_token_head": 0.9}


def child(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    spec = json.loads(Path(spec_path).read_text())
    n, length = spec["requests"], spec["prompt_tokens"]
    llm = LLM(model=str(prepare_gguf_dir(Path(spec["gguf"]))), dtype="float32",
              kv_cache_dtype=spec["format"], max_model_len=length + spec["max_tokens"] + 64,
              max_num_seqs=n, enable_prefix_caching=False, seed=0,
              kv_cache_memory_bytes=spec["kv_bytes"])
    rng = random.Random(1234)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]}
               for _ in range(n)]
    full = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, full, use_tqdm=False)  # warm-up
    walls, prefills, tokens = [], [], 0
    for _ in range(spec["rounds"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, first, use_tqdm=False)
        prefills.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, full, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    wall, prefill = statistics.median(walls), statistics.median(prefills)
    Path(out_path).write_text(json.dumps({
        "walls_s": walls, "prefill_walls_s": prefills, "generated_tokens": tokens,
        "output_tok_s": tokens / wall,
        "decode_tok_s": (tokens - n) / max(wall - prefill, 1e-9)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+",
                    default=["auto", "int8_per_token_head", "int4_per_token_head",
                             "fp8_per_token_head"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-bytes", type=int, default=2 << 30, help="KV pool bytes")
    ap.add_argument("--qwen-gguf", help="run Qwen2.5-Coder-0.5B-Instruct instead of SmolLM2")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    found = models(args.qwen_gguf)
    name = "Qwen2.5-Coder-0.5B-Instruct" if args.qwen_gguf else "SmolLM2-135M-Instruct"
    ts = datetime.now().strftime("%Y%m%d-%H%M%S")
    env = dict(os.environ, PYTHONHASHSEED="0")
    load_before = os.getloadavg()
    rows = {}
    for fmt in args.formats:
        rows[fmt] = run_child(__file__, f"kv_quant_speed-{ts}-{fmt}", {
            "gguf": str(found[name]), "format": fmt, "requests": args.requests,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "kv_bytes": args.kv_bytes}, env, 3600, "KV format")
    base = rows.get("auto")
    print(f"{name}: {args.requests} x {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} tokens each")
    ok = True
    for fmt, row in rows.items():
        ratio = row["output_tok_s"] / base["output_tok_s"] if base else float("nan")
        row["ratio"] = ratio
        target = TARGET.get(fmt)
        ok &= target is None or base is None or ratio >= target
        print(f"  {fmt:22s} output {row['output_tok_s']:8.1f} tok/s ({ratio:.2f}x"
              f"{'' if target is None else f', target >= {target}x'}), decode "
              f"{row['decode_tok_s']:8.1f} tok/s")
    results = {"versions": versions(), "machine": machine_info(load_before, os.getloadavg()),
               "model": name, "args": vars(args), "formats": rows}
    write_result("kv_quant_speed", ts, results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
