"""The paged attention kernels' CUDA instance against the pure-MLX reference, on the lent GPU.

Runs there (no registry): the MLX CUDA wheels and Python dependencies that
``benchmarks/cuda_h200.sh pack DEST`` builds, stashed in /tmp/cuda_kern by three device calls
(carry DEST/part1, DEST/part2, then DEST/part3 and a folder with this file, cuda_decode.py,
tests/gpu_attention_grid.py, tests/gpu_kv_quant_grid.py and ``site/vllm_unified``)::

    python3 cuda_kernel_checks.py      # writes $OUT/kern_fp32.json, $OUT/kern_tf32default.json

Two child processes: ``fp32`` (MLX_ENABLE_TF32=0, MLX's fp32 matmul and SDPA in full fp32)
runs the dense grid with the option cases (soft-capping, sinks), the quantized-KV grid and the
attention-chunk cases; ``tf32default`` (MLX's CUDA default, TF32) runs the fp32 cases whose
prefill chunks go to MLX's SDPA (the "split" route). Both measure MLX's own fp32 SDPA and
matmul against float64."""

import io
import json
import lzma
import os
import pathlib
import subprocess
import sys
import tarfile
import time

HERE = pathlib.Path(__file__).resolve().parent
STASH, SITE = pathlib.Path("/tmp/cuda_kern"), pathlib.Path("/tmp/site_kern")
OUT = pathlib.Path(os.environ.get("OUT", "/tmp"))
SUMMARY_SKIP = ("max_abs_error", "attention_max_abs_error", "write_bytes_differing")


def precision(mx, np) -> dict:
    """MLX's fp32 causal SDPA and matmul on the default device against float64 numpy."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 40, 64)).astype(np.float32) for _ in range(3))
    out = mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v),
                                               scale=0.125, mask="causal")
    s = (q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)) * 0.125
    s = np.where(np.tril(np.ones((40, 40), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    mm = mx.array(q[0, 0]) @ mx.array(k[0, 0]).T
    mref = q[0, 0].astype(np.float64) @ k[0, 0].astype(np.float64).T
    return {"sdpa_fp32_vs_f64": float(np.abs(np.array(out) - ref).max()),
            "matmul_fp32_vs_f64": float(np.abs(np.array(mm) - mref).max())}


def split_fp32(grid) -> dict:
    """The fp32 cases of the grid on the production ("split") route."""
    from vllm_unified.kv.gpu.paged import paged_gpu_attention

    def attend(q, pool, meta, scale, window, fresh, max_chunk, **options):
        return paged_gpu_attention("cuda", q, pool, meta, scale, window, fresh, max_chunk,
                                   **options)

    cases = [c for c in grid.grid(("float32",)) if c.route == "split"]
    errs = {c.name: float(grid.max_error(c, attend)) for c in cases}
    bad = [k for k, v in errs.items() if not v <= grid.TOLERANCE["float32"]]
    return {"cases": len(cases), "failed": len(bad), "worst": max(errs.values())}


def child(mode: str) -> None:
    sys.path[:0] = [str(HERE), str(HERE / "site"), str(SITE)]
    import cuda_decode
    import mlx.core as mx
    import numpy as np

    res = {"mode": mode, "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32"),
           "device": str(mx.default_device()), "precision": precision(mx, np)}
    print(mode, "precision", res["precision"], flush=True)
    if mode == "fp32":
        for name, fn in (("dense", cuda_decode.kernel_grid_check),
                         ("quant", cuda_decode.kvquant_check),
                         ("chunk", cuda_decode.chunk_check)):
            res[name] = fn(mx)
            print(mode, name, json.dumps({k: v for k, v in res[name].items()
                                          if k not in SUMMARY_SKIP}), flush=True)
    else:
        res["split_fp32"] = split_fp32(cuda_decode._grid_module())
        print(mode, "split fp32", res["split_fp32"], flush=True)
    (OUT / f"kern_{mode}.json").write_text(json.dumps(res, indent=1))


def unpack() -> None:
    """The MLX CUDA wheels and Python dependencies, from the stash into SITE (once)."""
    if (SITE / "mlx").exists():
        return
    SITE.mkdir(parents=True, exist_ok=True)
    joined = (STASH / "mlx.part1").read_bytes() + (STASH / "mlx.part2").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(joined))) as t:
        t.extractall(SITE, filter="fully_trusted")
    with tarfile.open(STASH / "py.tar.xz", "r:xz") as t:
        t.extractall(SITE, filter="fully_trusted")


def main() -> None:
    t0 = time.time()
    unpack()
    print("unpacked", round(time.time() - t0, 1), flush=True)
    env = dict(os.environ)
    env.pop("MLX_ENABLE_TF32", None)
    subprocess.run([sys.executable, __file__, "child", "tf32default"], env=env, check=False)
    env["MLX_ENABLE_TF32"] = "0"
    subprocess.run([sys.executable, __file__, "child", "fp32"], env=env, check=False)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        child(sys.argv[2])
    else:
        main()
