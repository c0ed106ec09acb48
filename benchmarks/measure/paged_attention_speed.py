"""Milliseconds of the native CPU paged attention (``paged_attention``) for one prompt's prefill
and for a decode step, summed over a model's layers, at a model's attention shapes.

prefill: one sequence of ``--tokens`` prompt tokens attended in chunks of ``--chunk`` rows
(causal, each chunk after the cached ones), every layer. decode: ``--seqs`` sequences of
``--context`` keys, one row each, every layer. One pool of random fp32 (or ``--dtype``) keys is
shared by the layers (the figure is per-layer time x layers). GMAC/s counts the products of
q.K and p.V of the visible keys only. Run with ``VLLM_UNIFIED_CPU_THREADS=1`` for one thread.

    .venv/bin/python benchmarks/kernels.py attention
    VLLM_UNIFIED_CPU_THREADS=1 .venv/bin/python benchmarks/kernels.py attention --models qwen
"""

from __future__ import annotations

import argparse
import time

# (name, query heads, KV heads, head size, layers)
MODELS = {
    "qwen": ("Qwen2.5-0.5B", 14, 2, 64, 24),
    "smol": ("SmolLM2-135M", 9, 3, 64, 30),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill rows per call")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    from vllm_unified import bridge

    native = bridge.native_kernels()
    if native is None:
        raise SystemExit(f"native extension unavailable: {bridge.native_error()}")
    print(f"native: {native.__file__}")
    dtype = getattr(mx, args.dtype)
    bs = args.block_size
    rng = np.random.default_rng(0)

    def pool_for(seqs: int, ctx: int, kv: int, d: int):
        per = -(-ctx // bs)
        tables = rng.permutation(seqs * per).reshape(seqs, per).astype(np.int32)
        pool = mx.array(rng.standard_normal((seqs * per * bs, kv, 2 * d)).astype(np.float32))
        return mx.array(tables), pool.astype(dtype)

    def best_ms(call: tuple, rounds: int) -> float:
        """Best ms of native.paged_attention(*call) over ``rounds`` runs."""
        mx.eval(native.paged_attention(*call))
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            mx.eval(native.paged_attention(*call))
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    print("| model | case | ms per layer | ms all layers | GMAC/s |")
    print("|---|---|---:|---:|---:|")
    for key in args.models:
        name, h, kv, d, layers = MODELS[key]
        tables, pool = pool_for(1, args.tokens, kv, d)
        mx.eval(pool)
        total, macs = 0.0, 0
        for c0 in range(0, args.tokens, args.chunk):
            rows = min(args.chunk, args.tokens - c0)
            q = mx.array(rng.standard_normal((rows, h, d)).astype(np.float32)).astype(dtype)
            seqs = mx.zeros((rows,), mx.int32)
            lens = mx.arange(c0 + 1, c0 + rows + 1, dtype=mx.int32)
            mx.eval(q, seqs, lens)
            total += best_ms((q, pool, tables, seqs, lens, d**-0.5, bs), args.rounds)
            macs += 2 * h * d * sum(range(c0 + 1, c0 + rows + 1))
        print(f"| {name} | prefill {args.tokens} (chunks of {args.chunk}) | {total:.1f} | "
              f"{total * layers:.0f} | {macs / total / 1e6:.1f} |")
        tables, pool = pool_for(args.seqs, args.context, kv, d)
        q = mx.array(rng.standard_normal((args.seqs, h, d)).astype(np.float32)).astype(dtype)
        seqs = mx.arange(args.seqs, dtype=mx.int32)
        lens = mx.full((args.seqs,), args.context, mx.int32)
        mx.eval(pool, q)
        ms = best_ms((q, pool, tables, seqs, lens, d**-0.5, bs), args.rounds * 3)
        macs = 2 * h * d * args.context * args.seqs
        print(f"| {name} | decode {args.seqs} x {args.context} | {ms:.2f} | "
              f"{ms * layers:.1f} | {macs / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
