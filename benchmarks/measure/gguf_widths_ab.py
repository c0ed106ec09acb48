"""One decode forward of a GGUF model held at its own widths vs the same values widened to 8 bits.

Loads the file as the engine holds it on the CPU backend (``keep_quantized=True,
native_kernels=True``: Q5_* as 5-bit, Q6_K / Q3_K / Q2_K as 6 / 3 / 2-bit groups of 16, ...)
twice, and re-encodes every layer of the second copy that is not 4 or 8 bits as 8-bit codes
with the same scales and biases (the layout before issue 17's kernels for those widths: same
values, more bytes). Then times one decode step of the runner's paged forward
(``worker.forward.forward`` with the native kernels) for each, in interleaved rounds so
that machine noise hits both alike, at each ``--batch`` size, and checks that both give the same
logits bit for bit. Prints min and median ms per step.

    .venv/bin/python benchmarks/engine.py gguf-widths \
        --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from decode_forward import BLOCK, CONTEXT, paged_caches


def widen_to_8_bits(model, mx, nn) -> int:  # noqa: ANN001 (modules imported late)
    """Re-encode every quantized layer of another width as 8-bit codes; returns how many."""
    from vllm_unified.models import gguf as G

    count = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.bits not in (4, 8):
            cols = m.weight.shape[1] * 32 // m.bits
            m.weight = mx.array(G._pack_bits(G._unpack_bits(np.array(m.weight), m.bits, cols),
                                              8))
            m.bits = 8
            count += 1
    mx.eval(model.parameters())
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()

    from vllm_unified.backend import import_mlx

    mx = import_mlx()  # interposes the BLAS first, as the worker does
    import mlx.nn as nn

    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.models.cpu_kernels import install_cpu_kernels
    from vllm_unified.models.loader import _gguf_hf_config, load_model
    from vllm_unified.models.routing import install_paged_attention
    from vllm_unified.worker.forward import forward

    path = Path(args.model)

    def load():  # noqa: ANN202
        model = load_model(str(path), hf_config=_gguf_hf_config(path), dtype=mx.float32,
                           keep_quantized=True, native_kernels=True).model
        install_paged_attention(model)
        install_cpu_kernels(model)
        return model

    own, wide = load(), load()
    print(f"{path.name}: {widen_to_8_bits(wide, mx, nn)} layers re-encoded as 8 bits; "
          f"context {CONTEXT} tokens, {args.rounds} interleaved rounds")
    print("| batch | own widths ms (min / median) | widened to 8 bits ms | logits equal |")
    print("|---:|---:|---:|---|")
    rng = np.random.default_rng(0)
    for batch in args.batch:
        _, caches, tables, rows = paged_caches(own, batch, rng, torch.zeros)
        ids = mx.array(rng.integers(1000, 30000, (batch,)).astype(np.int32))

        def step(model, batch=batch, tables=tables, caches=caches, ids=ids,  # noqa: ANN001, ANN202
                 rows=rows):
            meta = build_attention_metadata([1] * batch, [CONTEXT] * batch, tables, BLOCK)
            with set_step_context(StepContext(attn=meta)):
                logits = forward(model, caches, ids, rows)
            mx.eval(logits)
            return logits

        equal = bool(mx.array_equal(step(own), step(wide)).item())
        times: dict[str, list[float]] = {"own": [], "wide": []}
        for _ in range(args.rounds):
            for name, model in (("own", own), ("wide", wide)):
                start = time.perf_counter()
                step(model)
                times[name].append(time.perf_counter() - start)
        cells = " | ".join(f"{1e3 * min(v):.1f} / {1e3 * statistics.median(v):.1f}"
                           for v in times.values())
        print(f"| {batch} | {cells} | {equal} |", flush=True)


if __name__ == "__main__":
    main()
