"""fp32 matmul GFLOP/s in MLX's CPU backend, with and without an optimized BLAS preloaded.

Each configuration runs in a fresh subprocess (interposition only works before ``mlx.core`` is
imported). The baseline is MLX's bundled reference BLAS (``VLLM_UNIFIED_BLAS=none``), measured
in the same run; ratios are against it.

    .venv/bin/python benchmarks/kernels.py blas                 # baseline vs. default preload
    .venv/bin/python benchmarks/kernels.py blas --threads 1 2   # also vary BLAS thread count
    .venv/bin/python benchmarks/kernels.py blas --lib /path/libmkl_rt.so.2 --lib other.so

On a busy machine use ``--repeat 3``: configurations are run round-robin and the best of the
rounds is reported (contention only ever makes a run slower).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (name, M, K, N): C[M, N] = A[M, K] @ B[K, N]. SmolLM2-135M: hidden 576, MLP 1536.
SHAPES: list[tuple[str, int, int, int]] = [
    ("square 1024", 1024, 1024, 1024),
    ("decode 16x576@576x1536", 16, 576, 1536),
    ("decode 1x576@576x1536", 1, 576, 1536),
    ("prefill 256x576@576x1536", 256, 576, 1536),
]
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def child(budget_s: float) -> None:
    """Measure in this process (called in a fresh subprocess) and print one JSON line."""
    from vllm_unified.blas import preload_blas

    info = preload_blas()
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    results: dict[str, float] = {}
    max_err = 0.0
    for name, m, k, n in SHAPES:
        rng = np.random.default_rng(0)
        a_np = rng.standard_normal((m, k), dtype=np.float32)
        b_np = rng.standard_normal((k, n), dtype=np.float32)
        a, b = mx.array(a_np), mx.array(b_np)
        c = a @ b
        mx.eval(c)  # warm-up, and a correctness check against numpy
        ref = a_np.astype(np.float64) @ b_np.astype(np.float64)
        max_err = max(max_err, float(np.max(np.abs(np.array(c) - ref)) / np.max(np.abs(ref))))
        iters, start = 0, time.perf_counter()
        while True:
            mx.eval(a @ b)
            iters += 1
            elapsed = time.perf_counter() - start
            if (elapsed >= budget_s and iters >= 3) or elapsed >= 10 * budget_s:
                break
        results[name] = 2.0 * m * k * n * iters / elapsed / 1e9
    print(json.dumps({"blas": info.name, "path": info.path, "gflops": results, "err": max_err}))


def run_config(env_updates: dict[str, str | None], budget_s: float) -> dict:
    env = dict(os.environ)
    for key, value in env_updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    cmd = [sys.executable, __file__, "--child", "--budget", str(budget_s)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", action="append", default=[], help="extra BLAS library to try")
    parser.add_argument(
        "--threads", type=int, nargs="*", default=[], help="BLAS thread counts (0: unset)"
    )
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per shape")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the best is reported")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.budget)
        return

    from vllm_unified import envs

    configs: list[tuple[str, dict[str, str | None]]] = [("none", {envs.BLAS_ENV: "none"})]
    libs: list[str | None] = [envs.BLAS, *args.lib]
    for lib in libs:
        if lib is not None and lib.lower() == "none":
            continue
        label = "default" if lib is None else "/".join(lib.split("/")[-2:])[-22:]
        base: dict[str, str | None] = {"VLLM_UNIFIED_BLAS": lib}
        if not args.threads:
            configs.append((label, base))
        for t in args.threads:  # 0: leave the variables unset (the library's default)
            threads = dict.fromkeys(THREAD_VARS, str(t) if t else None)
            configs.append((f"{label} t={t or 'auto'}", {**base, **threads}))

    rows: list[tuple[str, dict]] = []
    for round_ in range(args.repeat):
        for i, (label, env) in enumerate(configs):
            r = run_config(env, args.budget)
            if round_ == 0:
                rows.append((label, r))
                continue
            best = rows[i][1]
            for shape, g in r["gflops"].items():
                best["gflops"][shape] = max(best["gflops"][shape], g)
            best["err"] = max(best["err"], r["err"])
    base_g = rows[0][1]["gflops"]
    width = max(len(s[0]) for s in SHAPES)
    best = f", best of {args.repeat} rounds" if args.repeat > 1 else ""
    print(f"cores: {os.cpu_count()}   fp32 GFLOP/s{best} (x = ratio to MLX's bundled BLAS)")
    header = f"{'config':<22} {'library':<10}" + "".join(f" {s[0]:>{width + 9}}" for s in SHAPES)
    print(header)
    for label, r in rows:
        cells = "".join(
            f" {r['gflops'][s[0]]:>{width}.1f} ({r['gflops'][s[0]] / base_g[s[0]]:>4.0f}x)"
            for s in SHAPES
        )
        print(f"{label:<22} {r['blas']:<10}{cells}")
    worst = max(r["err"] for _, r in rows)
    print(f"max relative error vs numpy float64: {worst:.1e}")


if __name__ == "__main__":
    main()
