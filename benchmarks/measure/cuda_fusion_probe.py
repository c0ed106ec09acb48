"""Does fusing a layer's projections pay on a host-bound GPU decode step? (plain mlx-lm).

On the lent H200 a decode step of a 0.6B model is bound by host work: MLX encodes and launches
every primitive of the step, so the step time follows the number of primitives more than the
arithmetic. This probe measures plain mlx-lm's Qwen3-0.6B-shaped bf16 model (random weights)
at batch 1, 16 and 64 with its projections as they are and fused:

* ``base``: mlx-lm's model as it is (q, k, v, gate and up: five matmuls per layer);
* ``gate_up``: gate and up projections as one matmul whose output halves feed SwiGLU;
* ``qkv_gate_up``: also q, k and v as one matmul, its output cut into three views.

Each variant's step is timed as mlx-lm runs it (eagerly, the host reading each step's tokens);
variants are interleaved round by round. The variants' logits are compared with ``base``
on the same input.

Usage (on the GPU machine, MLX's CUDA backend): ``python cuda_fusion_probe.py OUT_DIR``.
Prints a table and writes ``OUT_DIR/cuda_fusion_probe.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROUNDS = int(__import__("os").environ.get("PROBE_ROUNDS", "3"))
STEPS = 64
WARM = 8
BATCHES = (1, 16, 64)
CONTEXT = 512
QWEN3_06B = {
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
}


def attention_call(self, x, mask=None, cache=None):
    """mlx-lm's Qwen3 attention with q, k, v cut from one matmul (``self.qkv``)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    b, length, _ = x.shape
    nq, nk, _ = self.qkv_sizes
    y = self.qkv(x)
    queries, keys, values = y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:]
    queries = self.q_norm(queries.reshape(b, length, self.n_heads, -1)).transpose(0, 2, 1, 3)
    keys = self.k_norm(keys.reshape(b, length, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                       mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


def build(variant: str):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen3

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(QWEN3_06B))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    if variant == "base":
        return model
    for layer in model.model.layers:
        mlp = layer.mlp
        hidden = mlp.gate_proj.weight.shape[0]
        w = mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight], axis=0)
        mlp.gate_up = nn.Linear(w.shape[1], w.shape[0], bias=False)
        mlp.gate_up.weight = w
        mlp.hidden = hidden
        mlp.__class__ = FusedMLP
        if variant == "qkv_gate_up":
            at = layer.self_attn
            ws = [at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]
            at.qkv_sizes = [int(a.shape[0]) for a in ws]
            at.qkv = nn.Linear(ws[0].shape[1], sum(at.qkv_sizes), bias=False)
            at.qkv.weight = mx.concatenate(ws, axis=0)
            at.__class__ = FusedAttention
    mx.eval(model.parameters())
    return model


def _classes():
    from mlx_lm.models import qwen3
    from mlx_lm.models.activations import swiglu

    class _FusedMLP(qwen3.MLP):
        def __call__(self, x):
            y = self.gate_up(x)
            return self.down_proj(swiglu(y[..., :self.hidden], y[..., self.hidden:]))

    class _FusedAttention(qwen3.Attention):
        __call__ = attention_call

    return _FusedMLP, _FusedAttention


FusedMLP = FusedAttention = None


def decode(mx, model, batch: int) -> float:
    """ms per decode step at ``batch`` after a ``CONTEXT``-token prefill (mlx-lm's cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, QWEN3_06B["vocab_size"], (batch, CONTEXT))
    y = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)

    def step(tokens):
        return mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)

    start = 0.0
    for i in range(WARM + STEPS):
        if i == WARM:
            start = time.perf_counter()
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    y.tolist()
    return (time.perf_counter() - start) / STEPS * 1e3


def main(out_dir: str) -> None:
    global FusedMLP, FusedAttention
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    FusedMLP, FusedAttention = _classes()
    variants = ("base", "gate_up", "qkv_gate_up")
    models = {v: build(v) for v in variants}
    tokens = mx.random.randint(0, QWEN3_06B["vocab_size"], (4, 32))
    ref = models["base"](tokens, cache=make_prompt_cache(models["base"])).astype(mx.float32)
    diffs = {}
    for v in variants[1:]:
        got = models[v](tokens, cache=make_prompt_cache(models[v])).astype(mx.float32)
        diffs[v] = float(mx.abs(got - ref).max())
    print("max |logits - base| (bf16):", diffs, flush=True)
    times: dict = {v: {b: [] for b in BATCHES} for v in variants}
    for r in range(ROUNDS):
        for b in BATCHES:
            for v in variants:
                times[v][b].append(decode(mx, models[v], b))
                mx.clear_cache()
            print(f"round {r} batch {b}: " + ", ".join(
                f"{v} {times[v][b][-1]:.2f}" for v in variants) + " ms/step", flush=True)
    table = {}
    for b in BATCHES:
        base = np.array(times["base"][b])
        table[b] = {v: {"ms": float(np.median(times[v][b])),
                        "speedup_vs_base": float(np.median(base / np.array(times[v][b])))}
                    for v in variants}
        print(f"batch {b}: " + ", ".join(
            f"{v} {table[b][v]['ms']:.2f} ms ({table[b][v]['speedup_vs_base']:.2f}x)"
            for v in variants), flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "cuda_fusion_probe.json").write_text(json.dumps(
        {"diffs": diffs, "times_ms": times, "table": table}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
