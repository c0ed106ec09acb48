"""Microseconds per ``quantized_linear`` call for decode-sized x: the scratch path (each 4 weight
rows dequantized into a per-thread buffer, then multiplied) vs the gemv kernels that dequantize in
registers (``native.quantized_gemv_mode``: 1 by table lookup, 2 without the table; both
bit-identical to the scratch path) and the integer ones (3: x in one int8 term, 4: two, the
engine's default; VNNI for 1-4 rows, AMX-INT8 tiles for 5-16; not exact, so not compared).
Rows of 4 or more take the AMX tiles in modes 0-2 on a CPU that has them.

All variants run in one process, interleaved round-robin over ``--rounds`` rounds on the same
inputs; the best round is reported with each variant's ratio to the scratch path. Each result is
checked against the scratch path (bit for bit). Run once with
``VLLM_UNIFIED_CPU_THREADS=1`` for one thread.

    .venv/bin/python benchmarks/kernels.py gemv
    VLLM_UNIFIED_CPU_THREADS=1 .venv/bin/python benchmarks/kernels.py gemv --rows 1
    .venv/bin/python benchmarks/kernels.py gemv --bits 4 8 --groups 32 --rounds 9
"""

from __future__ import annotations

import argparse
import time

# (name, N, K): SmolLM2-135M's and Qwen2.5-0.5B's decode layers, y[M, N] = x[M, K] @ w[N, K].T
SHAPES: list[tuple[str, int, int]] = [
    ("smol q/o", 576, 576), ("smol k/v", 192, 576), ("smol gate/up", 1536, 576),
    ("smol down", 576, 1536), ("qwen q/o", 896, 896), ("qwen k/v", 128, 896),
    ("qwen gate/up", 4864, 896), ("qwen down", 896, 4864),
]
HEAD = ("smol head", 49152, 576)  # 8-bit only (the Q8_0 output head)
MODES = {"scratch": 0, "table": 1, "exact": 2, "int8": 3, "int16": 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 5, 6, 8])
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=20.0, help="per variant and round")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()

    from vllm_unified.blas import preload_blas

    preload_blas()
    import mlx.core as mx
    import numpy as np

    from vllm_unified import bridge

    native = bridge.native_kernels()
    if native is None:
        raise SystemExit(f"native extension unavailable: {bridge.native_error()}")
    rng = np.random.default_rng(0)
    modes = [m for m in args.modes if m != "scratch"]
    print("| layer | bits | group | M | scratch us | " + " | ".join(
        f"{m} us | {m} x" for m in modes) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|---:|" * len(modes))
    cases = [(s, b, g) for s in SHAPES for b in args.bits for g in args.groups]
    if 8 in args.bits:
        cases += [(HEAD, 8, g) for g in args.groups]
    for (name, n, k), bits, gs in cases:
        wq, _, _ = mx.quantize(mx.zeros((n, k)), group_size=32, bits=bits)
        wq = mx.array(rng.integers(0, 2**32, wq.shape, dtype=np.uint32))
        scales = mx.array(rng.standard_normal((n, k // gs)).astype(np.float32) * 0.01)
        biases = mx.array(rng.standard_normal((n, k // gs)).astype(np.float32) * 0.01)
        mx.eval(wq, scales, biases)
        for m in args.rows:
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            mx.eval(x)
            outs, best = {}, {v: float("inf") for v in ["scratch", *modes]}
            for v in best:
                native.quantized_gemv_mode(MODES[v])
                outs[v] = np.array(native.quantized_linear(x, wq, scales, biases, gs, bits))
            for _ in range(args.rounds):
                for v in best:
                    native.quantized_gemv_mode(MODES[v])
                    iters, start = 0, time.perf_counter()
                    while True:
                        mx.eval(native.quantized_linear(x, wq, scales, biases, gs, bits))
                        iters += 1
                        el = time.perf_counter() - start
                        if el * 1e3 > args.budget_ms and iters >= 3:
                            break
                    best[v] = min(best[v], el / iters)
            native.quantized_gemv_mode(1)
            for v in ("exact", "table"):
                if v in outs and not np.array_equal(outs[v], outs["scratch"]):
                    raise SystemExit(f"{v} differs from the scratch path: {name} {bits} {gs} {m}")
            base = best["scratch"] * 1e6
            cells = " | ".join(f"{best[v] * 1e6:.1f} | {best['scratch'] / best[v]:.2f}"
                               for v in modes)
            print(f"| {name} {n}x{k} | {bits} | {gs} | {m} | {base:.1f} | {cells} |",
                  flush=True)


if __name__ == "__main__":
    main()
