"""One prefill step of the quantized model through the runner's forward, in each arithmetic of
the quantized layers (``VLLM_UNIFIED_CPU_ACTIVATIONS``: fp32 exact, int16 the default, int8), in
one process on the same weights.

``--batch`` sequences of ``--tokens`` prompt tokens each (random ids) form one prefill step of
``batch x tokens`` rows, as vLLM schedules concurrent requests' prompts (serve.py's
C=16 load: 16 x 128 = 2,048 rows), over the paged KV pool (:mod:`benchmarks.decode_forward`'s
set-up) with the runner's CPU kernels, the logits of each sequence's last token taken. On a CPU
with AMX the quantized layers run on bf16 tiles in fp32 mode (three bf16 parts per x value) and
on AMX-INT8 tiles in the integer modes (one or two int8 terms); without AMX-INT8, the integer
modes compute 5 rows and more exactly, as fp32. The modes run interleaved over ``--rounds``
rounds; min and median seconds per step and the ratio to fp32 (min over rounds) are printed.

    .venv/bin/python benchmarks/engine.py prefill                 # Qwen2.5-Coder, 16 x 128
    .venv/bin/python benchmarks/engine.py prefill --gguf PATH --batch 1 --tokens 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from decode_forward import BLOCK, paged_caches  # noqa: E402
from harness import versions, write_result  # noqa: E402

MODES = {"fp32": 1, "int16": 4, "int8": 3}  # native.quantized_gemv_mode
QWEN = Path.home() / ".cache/vllm-unified/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=QWEN)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="the arithmetics to run (the ratio column needs fp32)")
    args = ap.parse_args()
    if not args.gguf.exists():
        raise SystemExit(f"{args.gguf} not found (scripts/serve.sh --help says how to get it)")

    from vllm_unified.backend import import_mlx

    mx = import_mlx()  # BLAS interposed first, as the platform does
    import torch
    import vllm_unified_native as native

    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.models.cpu_kernels import install_cpu_kernels
    from vllm_unified.models.loader import _gguf_hf_config, load_model
    from vllm_unified.models.routing import install_paged_attention
    from vllm_unified.worker.forward import forward

    model = load_model(str(args.gguf), hf_config=_gguf_hf_config(args.gguf), dtype=mx.float32,
                       keep_quantized=True, native_kernels=True).model
    install_paged_attention(model)
    print("native CPU kernels:", ", ".join(install_cpu_kernels(model)))
    rng = np.random.default_rng(0)
    batch, tokens = args.batch, args.tokens
    pool, caches, tables, _ = paged_caches(model, batch, rng, torch.empty, context=tokens)
    last = mx.array((np.arange(batch, dtype=np.int32) + 1) * tokens - 1)

    def step(mode: int) -> float:
        previous = native.quantized_gemv_mode(mode)
        try:
            meta = build_attention_metadata([tokens] * batch, [tokens] * batch, tables, BLOCK)
            ids = mx.array(rng.integers(1000, 30000, (batch * tokens,)).astype(np.int32))
            t0 = time.perf_counter()
            with set_step_context(StepContext(attn=meta)):
                logits = forward(model, caches, ids, last)
            mx.eval(mx.argmax(logits, -1), pool.arrays())
            return time.perf_counter() - t0
        finally:
            native.quantized_gemv_mode(previous)

    modes = {label: MODES[label] for label in args.modes}
    for mode in modes.values():  # warm-up
        step(mode)
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(args.rounds):
        for label, mode in modes.items():
            times[label].append(step(mode))
    rows = []
    print(f"{args.gguf.name}: one prefill step of {batch} x {tokens} tokens, {args.rounds} rounds")
    print("| arithmetic | min s | median s | tokens/s (min) | fp32 / this (min) |")
    print("|---|---:|---:|---:|---:|")
    for label, ts in times.items():
        row = {"arithmetic": label, "min_s": min(ts), "median_s": statistics.median(ts),
               "speedup_vs_fp32": min(times["fp32"]) / min(ts) if "fp32" in times else None}
        rows.append(row)
        ratio = row["speedup_vs_fp32"]
        print(f"| {label} | {row['min_s']:.3f} | {row['median_s']:.3f} | "
              f"{batch * tokens / row['min_s']:.0f} | "
              f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    write_result("prefill_forward", datetime.now().strftime("%Y%m%d-%H%M%S"),
                 {"versions": versions(), "rows": rows, "times": times,
                  "args": vars(args) | {"gguf": str(args.gguf)}})


if __name__ == "__main__":
    main()
