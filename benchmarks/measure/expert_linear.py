"""Milliseconds per mixture-of-experts projection at decode sizes: the native
``gather_quantized_linear`` (the engine's route for mlx-lm's ``QuantizedSwitchLinear``) against
MLX's own ``mx.gather_qmm`` on the same packed experts and MLX's ``mx.gather_mm`` on the
experts dequantized to fp32 (the route before the native kernel: ``SwitchLinear``).

Shapes are Qwen3-30B-A3B's (hidden 2048, 128 experts, top-8, expert width 768): the gate/up
projection (2048 -> 768) and the down projection (768 -> 2048), called as mlx-lm's
``SwitchGLU`` calls them (indices sorted by expert from 64 pairs on). The native kernel runs
in exact fp32 arithmetic and with int16 activations (``VLLM_UNIFIED_CPU_ACTIVATIONS``'s
default). All variants run in one process on the same inputs, interleaved round-robin over
``--rounds`` rounds; the median round is reported with the ratios of the same run. Each result
is checked against ``gather_qmm`` (fp32 rounding, or the integer arithmetic's error).

    .venv/bin/python benchmarks/kernels.py experts
    .venv/bin/python benchmarks/kernels.py experts --tokens 1 16 64 --bits 4 8 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import harness

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
PROJECTIONS = {"gate/up": (WIDTH, HIDDEN), "down": (HIDDEN, WIDTH)}  # name: (N, K)
VARIANTS = ("native int16", "native fp32", "gather_qmm", "dequantized gather_mm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--bits", type=int, nargs="+", default=[4])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=200.0, help="per variant and round")
    args = ap.parse_args()

    from vllm_unified.blas import preload_blas

    preload_blas()
    import mlx.core as mx
    import numpy as np

    from vllm_unified import bridge

    native = bridge.native_kernels()
    if native is None:
        raise SystemExit(f"native extension unavailable: {bridge.native_error()}")
    load_before = os.getloadavg()
    cpu = harness.cpu_info().get("cpu_model", "unknown CPU")
    print(f"CPU: {cpu}, {os.cpu_count()} CPUs; load average {load_before[0]:.2f}")
    print("| projection | bits | tokens | " + " | ".join(f"{v} ms" for v in VARIANTS)
          + " | native int16 vs gather_qmm | vs dequantized | native fp32 vs dequantized |")
    print("|---|---:|---:|" + "---:|" * (len(VARIANTS) + 3))
    rng = np.random.default_rng(0)
    rows = []
    for bits in args.bits:
        for name, (n, k) in PROJECTIONS.items():
            w = mx.array(rng.standard_normal((EXPERTS, n, k)).astype(np.float32) * 0.02)
            wq, scales, biases = mx.quantize(w, group_size=args.group_size, bits=bits)
            scales, biases = scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)
            dense = mx.dequantize(wq, scales, biases, group_size=args.group_size, bits=bits)
            dense = dense.astype(mx.float32)
            del w
            mx.eval(wq, scales, biases, dense)
            for tokens in args.tokens:
                rows.append(_measure(args, native, name, bits, tokens, wq, scales, biases,
                                     dense, rng))
            del dense
            mx.clear_cache()
    native.quantized_gemv_mode(4)
    results = {"kind": "expert_linear", "cpu": cpu, "rows": rows, "args": vars(args),
               "machine": harness.machine_info(load_before, os.getloadavg()),
               "versions": harness.versions()}
    harness.write_result("expert_linear", harness.timestamp(), results)


def _measure(args, native, name, bits, tokens, wq, scales, biases, dense, rng) -> dict:
    import mlx.core as mx
    import numpy as np

    k = wq.shape[-1] * 32 // bits
    gs = args.group_size
    x = mx.array(rng.standard_normal((tokens, k)).astype(np.float32))
    idx = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).astype(np.uint32)
    sort = tokens * TOP_K >= 64  # mlx-lm's SwitchGLU sorts from 64 pairs on
    if sort:
        order = np.argsort(idx.reshape(-1), kind="stable")
        xs = x[mx.array(order // TOP_K)][:, None, :]
        ids = mx.array(idx.reshape(-1)[order])
    else:
        xs, ids = x[:, None, None, :], mx.array(idx)
    mx.eval(xs, ids)
    calls = {
        "native int16": (4, lambda: native.gather_quantized_linear(xs, wq, scales, biases, ids,
                                                                   gs, bits)),
        "native fp32": (1, lambda: native.gather_quantized_linear(xs, wq, scales, biases, ids,
                                                                  gs, bits)),
        "gather_qmm": (1, lambda: mx.gather_qmm(xs, wq, scales, biases, rhs_indices=ids,
                                                transpose=True, group_size=gs, bits=bits,
                                                sorted_indices=sort)),
        "dequantized gather_mm": (1, lambda: mx.gather_mm(xs, dense.swapaxes(-1, -2),
                                                          rhs_indices=ids, sorted_indices=sort)),
    }
    want = None
    for v, (mode, call) in calls.items():  # warm-up and check
        native.quantized_gemv_mode(mode)
        out = np.array(call())
        if v == "gather_qmm":
            want = out
    native.quantized_gemv_mode(1)
    for v in ("native fp32", "native int16"):
        native.quantized_gemv_mode(calls[v][0])
        got = np.array(calls[v][1]())
        err = float(np.abs(got - want).max() / np.abs(want).max())
        if err > (1e-5 if v == "native fp32" else 1e-2):
            raise SystemExit(f"{v} differs from gather_qmm: {name} {bits}-bit {tokens} tokens, "
                             f"relative error {err:.2e}")
    times: dict[str, list[float]] = {v: [] for v in calls}
    for _ in range(args.rounds):
        for v, (mode, call) in calls.items():
            native.quantized_gemv_mode(mode)
            iters, start = 0, time.perf_counter()
            while True:
                mx.eval(call())
                iters += 1
                el = time.perf_counter() - start
                if el * 1e3 > args.budget_ms and iters >= 3:
                    break
            times[v].append(el / iters * 1e3)
    med = {v: statistics.median(t) for v, t in times.items()}
    ratios = (med["gather_qmm"] / med["native int16"],
              med["dequantized gather_mm"] / med["native int16"],
              med["dequantized gather_mm"] / med["native fp32"])
    print(f"| {name} {k}->{wq.shape[1]} | {bits} | {tokens} | "
          + " | ".join(f"{med[v]:.3f}" for v in calls)
          + " | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |", flush=True)
    return {"projection": name, "bits": bits, "tokens": tokens, "sorted": sort,
            "median_ms": med, "rounds_ms": times}


if __name__ == "__main__":
    main()
