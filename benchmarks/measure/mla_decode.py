"""One decode step of a random MiniCPM3 (multi-head latent attention on vLLM's MLA pages)
against a llama of the same width, on our paged forward with the runner's CPU kernels.

MiniCPM3-4B's width (hidden 2560, 40 heads, q LoRA 768, latent 256, rope 32, nope 64, MLP 6400)
with ``--layers`` layers and a 32000-token vocabulary; the llama has 40 heads of 64 with 8 KV
heads and the same MLP. Each of ``--batch`` sequences has 192 tokens of context in MLX-owned
pools; the contenders alternate over ``--rounds`` rounds and the minimum step time is printed
(the least noisy estimate on a shared machine). No vLLM engine is involved.

    .venv/bin/python benchmarks/measure/mla_decode.py --batch 1 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np

CONTEXT = 192
BLOCK = 16
VOCAB = 32000


def models(layers: int, mx):  # noqa: ANN001, ANN201
    """``{name: model}``: random MiniCPM3 and llama, attention routed, CPU kernels in."""
    from mlx_lm.models import llama, minicpm3

    from vllm_unified.models.cpu_kernels import install_cpu_kernels
    from vllm_unified.models.latent_attention import install_latent_attention
    from vllm_unified.models.routing import install_paged_attention

    mla = minicpm3.Model(minicpm3.ModelArgs(
        model_type="minicpm3", hidden_size=2560, dim_model_base=256, num_hidden_layers=layers,
        intermediate_size=6400, num_attention_heads=40, rms_norm_eps=1e-5, vocab_size=VOCAB,
        num_key_value_heads=40, q_lora_rank=768, qk_nope_head_dim=64, qk_rope_head_dim=32,
        kv_lora_rank=256, scale_depth=1.4, scale_emb=12, max_position_embeddings=32768,
        rope_scaling={}))
    dense = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=2560, num_hidden_layers=layers, intermediate_size=6400,
        num_attention_heads=40, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=VOCAB, rope_theta=10000.0))
    for m in (mla, dense):
        mx.eval(m.parameters())
        install_paged_attention(m)
        install_cpu_kernels(m)
    install_latent_attention(mla)
    return {"minicpm3": mla, "llama": dense}


def caches(name: str, layers: int, batch: int, mx):  # noqa: ANN001, ANN201
    """``(pool, layer caches, block tables)`` for ``batch`` sequences of CONTEXT tokens."""
    from vllm_unified.kv.layer_cache import PagedLatentCache, PagedLayerCache
    from vllm_unified.kv.pool import KVPool

    per = -(-CONTEXT // BLOCK)
    blocks = batch * per + 2
    if name == "minicpm3":
        pool = KVPool.allocate_latent_mlx(layers, blocks, BLOCK, 256 + 32, mx.float32)
        layer_caches = [PagedLatentCache(pool, i, 256) for i in range(layers)]
    else:
        pool = KVPool.allocate_mlx(layers, blocks, BLOCK, 8, 64, mx.float32, write="scatter")
        layer_caches = [PagedLayerCache(pool, i) for i in range(layers)]
    tables = (np.arange(batch * per).reshape(batch, per) + 1).astype(np.int32)
    return pool, layer_caches, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()

    from vllm_unified.backend import import_mlx

    mx = import_mlx()  # interposes the BLAS first, as the worker does
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.worker.forward import forward

    rng = np.random.default_rng(0)
    built = models(args.layers, mx)
    print(f"{args.layers} layers, context {CONTEXT}, fp32; min of {args.rounds} rounds")
    print("| batch | minicpm3 ms | llama ms | minicpm3 / llama |\n|---:|---:|---:|---:|")
    for batch in args.batch:
        state = {n: caches(n, args.layers, batch, mx) for n in built}
        times: dict[str, list[float]] = {n: [] for n in built}
        meta = build_attention_metadata([1] * batch, [CONTEXT] * batch, state["llama"][2],
                                        BLOCK)
        rows = np.arange(batch, dtype=np.int32)
        for _ in range(args.rounds):
            for name, model in built.items():
                pool, layer_caches, _ = state[name]
                ids = mx.array(rng.integers(100, VOCAB - 1, (batch,)).astype(np.int32))
                start = time.perf_counter()
                with set_step_context(StepContext(attn=meta)):
                    logits = forward(model, layer_caches, ids, rows)
                mx.eval(mx.argmax(logits, -1), pool.arrays())
                times[name].append(time.perf_counter() - start)
        mla, dense = (1e3 * min(times[n]) for n in ("minicpm3", "llama"))
        print(f"| {batch} | {mla:.1f} | {dense:.1f} | {mla / dense:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
