"""KV capacity per quantized format as vLLM's scheduler sees it: ``num_gpu_blocks x block
size`` for a KV pool of exactly 1 GiB (``--kv-cache-memory-bytes 1073741824``), i.e. tokens per
GiB of KV, for each ``--kv-cache-dtype`` against the model dtype (fp32 on the CPU backend).

Targets (issue 18): >= 3.5x with ``int8_per_token_head``, >= 6x with ``int4_per_token_head``.
Each (model, format) is its own engine process (vLLM's offline ``LLM``); nothing is generated.
Prints a table and writes ``benchmarks/results/kv_quant_capacity-<ts>.json``.

    .venv/bin/python benchmarks/memory.py kv-capacity
    .venv/bin/python benchmarks/memory.py kv-capacity --qwen-gguf qwen2.5-coder-0.5b-q4_k_m.gguf
    .venv/bin/python benchmarks/memory.py kv-capacity --formats auto turboquant_k8v4

``turboquant_k8v4`` has no target: vLLM keeps its first and last two layers in the model dtype,
so its ratio depends on the model's depth (3.3x for SmolLM2's 30 layers against fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from harness import run_child, versions, write_result  # noqa: E402
from real_models import models  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FORMATS = ("auto", "int8_per_token_head", "int4_per_token_head", "fp8_per_token_head",
           "turboquant_k8v4")
TARGETS = {"int8_per_token_head": 3.5, "int4_per_token_head": 6.0, "fp8_per_token_head": 3.5}
KV_BYTES = 1 << 30


def child(spec_path: str, out_path: str) -> None:
    from vllm import LLM

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=str(prepare_gguf_dir(Path(spec["gguf"]))), dtype="float32",
              kv_cache_dtype=spec["format"], kv_cache_memory_bytes=KV_BYTES,
              max_model_len=2048, enable_prefix_caching=True)
    cache = llm.llm_engine.vllm_config.cache_config
    Path(out_path).write_text(json.dumps({"num_gpu_blocks": cache.num_gpu_blocks,
                                          "block_size": cache.block_size}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qwen-gguf", help="Qwen2.5-Coder-0.5B-Instruct q4_k_m GGUF")
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS),
                    help="formats to run (auto, the baseline, is always run)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    ts = datetime.now().strftime("%Y%m%d-%H%M%S")
    results: dict = {"versions": versions(), "kv_cache_memory_bytes": KV_BYTES, "models": {}}
    env = dict(os.environ, PYTHONHASHSEED="0")
    ok = True
    for name, gguf in models(args.qwen_gguf).items():
        rows = {}
        for fmt in dict.fromkeys(["auto", *args.formats]):
            out = run_child(__file__, f"kv_quant_capacity-{ts}-{name}-{fmt}",
                            {"gguf": str(gguf), "format": fmt}, env, 900, "KV format")
            tokens = out["num_gpu_blocks"] * out["block_size"]
            rows[fmt] = {**out, "tokens_per_gib": tokens, "log_lines": out.get("log_lines")}
        base = rows["auto"]["tokens_per_gib"]
        print(f"{name}:")
        for fmt, row in rows.items():
            ratio = row["tokens_per_gib"] / base
            row["ratio"] = ratio
            target = TARGETS.get(fmt)
            verdict = "" if target is None else (" ok" if ratio >= target else " BELOW TARGET")
            ok &= target is None or ratio >= target
            print(f"  {fmt:22s} {row['num_gpu_blocks']:7d} blocks x {row['block_size']} = "
                  f"{row['tokens_per_gib']:9,d} tokens/GiB  {ratio:5.2f}x"
                  f"{'' if target is None else f' (target >= {target}x)'}{verdict}")
        results["models"][name] = rows
    write_result("kv_quant_capacity", ts, results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
