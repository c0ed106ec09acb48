"""Milliseconds per ``quantized_linear`` call in each arithmetic and instruction set the
CPU offers, against dequantize + BLAS.

The instruction-set cap (``VLLM_UNIFIED_CPU_ISA``) and the arithmetic
(``VLLM_UNIFIED_CPU_ACTIVATIONS``) are read once per process, so each variant runs in a fresh
subprocess, round-robin over ``--rounds`` rounds; the best round is reported (contention only
makes a call slower) with each variant's speed-up over dequantize + BLAS measured in the same
run. ``--shapes smol`` (the default) are SmolLM2-135M's layers (hidden 576, MLP 1,536, the 8-bit
49,152-row output head), ``--shapes qwen`` Qwen2.5-0.5B's (hidden 896, MLP 4,864), at decode
batch sizes and one prefill chunk. Each variant's result is also checked against the float64
product (relative to its largest value).

    .venv/bin/python benchmarks/kernels.py linear
    .venv/bin/python benchmarks/kernels.py linear --rows 1 4 16 --rounds 5 --shapes qwen
    .venv/bin/python benchmarks/kernels.py linear --bits 2 3 4 5 6 8   # every layer per width

Variants (:data:`VARIANTS`): ``exact`` (fp32, the CPU's best path: AMX bf16 tiles where present),
``int16`` (the engine's default: AMX-INT8 tiles where present, else the VNNI gemv and GEMM),
``int8`` (one int8 term), ``int16-avx512``, ``int16-avxvnni`` and ``int16-avx2`` (the ISA
capped: AMX off; AVX-512 off too; AVX-VNNI off too), and ``blas`` (``native.dequantize`` then
MLX's matmul through the interposed BLAS: the exact prefill path without AMX).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (name, N, K, bits): y[M, N] = x[M, K] @ dequantize(w[N, K]).T, group size 32.
SHAPES: dict[str, list[tuple[str, int, int, int]]] = {
    "smol": [("q/o 576x576", 576, 576, 4), ("gate/up 1536x576", 1536, 576, 4),
             ("down 576x1536", 576, 1536, 4), ("head 49152x576 8-bit", 49152, 576, 8)],
    "qwen": [("q/o 896x896", 896, 896, 4), ("gate/up 4864x896", 4864, 896, 4),
             ("down 896x4864", 896, 4864, 4), ("head 151936x896 8-bit", 151936, 896, 8)],
}
# variant -> the settings its subprocess runs with
VARIANTS: dict[str, dict[str, str]] = {
    "exact": {"VLLM_UNIFIED_CPU_ACTIVATIONS": "fp32"},
    "int16": {"VLLM_UNIFIED_CPU_ACTIVATIONS": "int16"},
    "int8": {"VLLM_UNIFIED_CPU_ACTIVATIONS": "int8"},
    "int16-avx512": {"VLLM_UNIFIED_CPU_ACTIVATIONS": "int16", "VLLM_UNIFIED_CPU_ISA": "avx512"},
    "int16-avxvnni": {"VLLM_UNIFIED_CPU_ACTIVATIONS": "int16",
                      "VLLM_UNIFIED_CPU_ISA": "avxvnni"},
    "int16-avx2": {"VLLM_UNIFIED_CPU_ACTIVATIONS": "int16", "VLLM_UNIFIED_CPU_ISA": "avx2"},
    "blas": {"VLLM_UNIFIED_CPU_ACTIVATIONS": "fp32"},
}


def _call(native, variant: str, x, params: tuple):  # noqa: ANN001 (modules imported late)
    """One lazy call of ``variant`` on ``x``: ``params`` = (w, scales, biases, group, bits)."""
    if variant == "blas":
        return x @ native.dequantize(*params).T
    return native.quantized_linear(x, *params)


def layers(shapes: str, widths: list[int] | None) -> list[tuple[str, int, int, int]]:
    """:data:`SHAPES` ``[shapes]``, or each of them at every width of ``widths`` (name +
    ``N-bit``)."""
    if not widths:
        return SHAPES[shapes]
    return [(f"{name.removesuffix(' 8-bit')} {b}-bit", n, k, b)
            for name, n, k, _ in SHAPES[shapes] for b in widths]


def child(variant: str, rows: list[int], budget_s: float, shapes: str,
          widths: list[int] | None) -> None:
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
    for name, n, k, bits in layers(shapes, widths):
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


def run_variant(variant: str, rows: list[int], budget_s: float, shapes: str,
                widths: list[int] | None) -> dict:
    env = {**os.environ, **VARIANTS[variant]}
    cmd = [sys.executable, __file__, "--child", variant, "--budget", str(budget_s),
           "--shapes", shapes, "--rows", *map(str, rows)]
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
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smol")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--bits", type=int, nargs="+", choices=(2, 3, 4, 5, 6, 8),
                        help="run every layer at each of these widths (default: 4-bit layers, "
                             "8-bit head)")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.budget, args.shapes, args.bits)
        return
    variants = list(dict.fromkeys([*args.variants, "blas"]))
    best: dict[str, dict[str, float]] = {v: {} for v in variants}
    errors: dict[str, float] = dict.fromkeys(variants, 0.0)
    amx = False
    for _ in range(args.rounds):
        for variant in variants:
            res = run_variant(variant, args.rows, args.budget, args.shapes, args.bits)
            amx = amx or res["amx_usable"]
            for key, ms in res["ms"].items():
                best[variant][key] = min(ms, best[variant].get(key, float("inf")))
            errors[variant] = max(errors[variant], *res["err"].values())
    print(f"quantized_linear on {cpu_name()}, ms per call (best of {args.rounds} rounds; "
          f"x: speed-up over dequantize + BLAS); AMX tiles "
          f"{'available' if amx else 'NOT available'}")
    shown = [v for v in variants if v != "blas"]
    print("| layer | rows | blas | " + " | ".join(f"{v} | x" for v in shown) + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(shown))
    for key in best["blas"]:
        name, m = key.split("|")
        b = best["blas"][key]
        cells = " | ".join(f"{best[v][key]:.3f} | {b / best[v][key]:.2f}" for v in shown)
        print(f"| {name} | {m} | {b:.3f} | {cells} |")
    print("max error vs float64 (relative to the largest output): "
          + ", ".join(f"{v} {e:.1e}" for v, e in errors.items()))


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.machine()


if __name__ == "__main__":
    main()
