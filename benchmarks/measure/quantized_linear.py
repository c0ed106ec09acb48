"""Milliseconds per ``quantized_linear`` call: AMX tiles vs the AVX-512 kernel vs dequantize + BLAS.

The instruction-set level is chosen once per process (``VLLM_UNIFIED_CPU_ISA``), so each variant
runs in a fresh subprocess, round-robin over ``--rounds`` rounds; the best round is reported
(contention only makes a call slower) with the ratio of each variant to the AVX-512 kernel
measured in the same run. Shapes are SmolLM2-135M's layers (hidden 576, MLP 1,536, the 8-bit
49,152-row output head) at decode batch sizes and one prefill chunk. Each variant's result is
also checked against the float64 product (relative to its largest value).

    .venv/bin/python benchmarks/kernels.py linear
    .venv/bin/python benchmarks/kernels.py linear --rows 1 4 16 --rounds 5
    .venv/bin/python benchmarks/kernels.py linear --bits 2 3 4 5 6 8   # every layer per width

Variants: ``amx`` (the default dispatch: AMX tiles from 4 rows where the CPU has them),
``avx512`` (``VLLM_UNIFIED_CPU_ISA=avx512``: the AVX-512 kernel at every size) and ``blas``
(``native.dequantize`` then MLX's matmul through the interposed BLAS: the non-AMX prefill path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (name, N, K, bits): y[M, N] = x[M, K] @ dequantize(w[N, K]).T, group size 32.
LAYERS: list[tuple[str, int, int, int]] = [
    ("q/o 576x576", 576, 576, 4),
    ("gate/up 1536x576", 1536, 576, 4),
    ("down 576x1536", 576, 1536, 4),
    ("head 49152x576 8-bit", 49152, 576, 8),
]
VARIANTS = ("amx", "avx512", "blas")


def _call(native, variant: str, x, params: tuple):  # noqa: ANN001 (modules imported late)
    """One lazy call of ``variant`` on ``x``: ``params`` = (w, scales, biases, group, bits)."""
    if variant == "blas":
        return x @ native.dequantize(*params).T
    return native.quantized_linear(x, *params)


def layers(widths: list[int] | None) -> list[tuple[str, int, int, int]]:
    """:data:`LAYERS`, or each of them at every width of ``widths`` (name + ``N-bit``)."""
    if not widths:
        return LAYERS
    return [(f"{name.removesuffix(' 8-bit')} {b}-bit", n, k, b)
            for name, n, k, _ in LAYERS for b in widths]


def child(variant: str, rows: list[int], budget_s: float, widths: list[int] | None) -> None:
    """Time every (layer, rows) pair in this process; print one JSON line."""
    from vllm_unified.blas import preload_blas

    preload_blas()
    import mlx.core as mx
    import numpy as np

    from vllm_unified import bridge

    native = bridge.native_kernels()
    if native is None:
        raise SystemExit(f"native extension unavailable: {bridge.native_error()}")
    rng = np.random.default_rng(0)
    out: dict[str, dict] = {"amx_usable": native.amx_usable(), "ms": {}, "err": {}}
    for name, n, k, bits in layers(widths):
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        wq, scales, biases = mx.quantize(w, group_size=32, bits=bits)
        dense64 = np.array(mx.dequantize(wq, scales, biases, 32, bits)).astype(np.float64)
        mx.eval(wq, scales, biases)
        del w
        params = (wq, scales, biases, 32, bits)
        for m in rows:
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            got = np.array(_call(native, variant, x, params))
            ref = np.array(x).astype(np.float64) @ dense64.T
            out["err"][f"{name}|{m}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
            iters, start = 0, time.perf_counter()
            while True:
                mx.eval(_call(native, variant, x, params))
                iters += 1
                elapsed = time.perf_counter() - start
                if (elapsed >= budget_s and iters >= 3) or elapsed >= 10 * budget_s:
                    break
            out["ms"][f"{name}|{m}"] = elapsed / iters * 1e3
    print(json.dumps(out))


def run_variant(variant: str, rows: list[int], budget_s: float,
                widths: list[int] | None) -> dict:
    env = dict(os.environ)
    if variant == "avx512":
        env["VLLM_UNIFIED_CPU_ISA"] = "avx512"
    cmd = [sys.executable, __file__, "--child", variant, "--budget", str(budget_s),
           "--rows", *map(str, rows)]
    if widths:
        cmd += ["--bits", *map(str, widths)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--bits", type=int, nargs="+", choices=(2, 3, 4, 5, 6, 8),
                        help="run every layer at each of these widths (default: 4-bit layers, "
                             "8-bit head)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.budget, args.bits)
        return
    best: dict[str, dict[str, float]] = {v: {} for v in VARIANTS}
    errors: dict[str, float] = dict.fromkeys(VARIANTS, 0.0)
    amx = False
    for _ in range(args.rounds):
        for variant in VARIANTS:
            res = run_variant(variant, args.rows, args.budget, args.bits)
            amx = amx or (variant == "amx" and res["amx_usable"])
            for key, ms in res["ms"].items():
                best[variant][key] = min(ms, best[variant].get(key, float("inf")))
            errors[variant] = max(errors[variant], *res["err"].values())
    print(f"quantized_linear, ms per call (best of {args.rounds} rounds); AMX tiles "
          f"{'available' if amx else 'NOT available: amx = the default dispatch without them'}")
    print("| layer | rows | amx | avx512 | dequantize + BLAS | avx512 / amx |")
    print("|---|---:|---:|---:|---:|---:|")
    for key in best["avx512"]:
        name, m = key.split("|")
        a, v, b = best["amx"][key], best["avx512"][key], best["blas"][key]
        print(f"| {name} | {m} | {a:.3f} | {v:.3f} | {b:.3f} | {v / a:.2f}x |")
    print("max error vs float64 (relative to the largest output): "
          + ", ".join(f"{v} {e:.1e}" for v, e in errors.items()))


if __name__ == "__main__":
    main()
