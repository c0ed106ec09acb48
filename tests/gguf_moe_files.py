"""Tiny random mixture-of-experts GGUF files, written the way llama.cpp's converter lays them
out (``qwen3moe`` and ``gpt-oss`` architectures: stacked expert tensors, router, gpt-oss's
biases and attention sinks, MXFP4 experts), for tests/test_gguf_moe.py.

Shapes are awkward on purpose: experts not a power of two, top-k > 1, a head size that is not
hidden / heads, an expert width that is not the hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


@dataclass
class WrittenTensor:
    """What the file holds for one tensor: its GGML type, logical shape and stored bytes
    (quantized blocks, or the float32 values)."""

    qtype: T
    shape: tuple[int, ...]
    data: np.ndarray

    def reference(self) -> np.ndarray:
        """The ``gguf`` package's reference dequantization, float32 of :attr:`shape`."""
        if self.qtype == T.F32:
            return self.data.astype(np.float32)
        return gguf.quants.dequantize(self.data, self.qtype).reshape(self.shape).astype(
            np.float32)


@dataclass
class MoeFile:
    """A written file and its tensors by GGUF name."""

    path: Path
    arch: str
    tensors: dict[str, WrittenTensor] = field(default_factory=dict)


#: qwen3moe: the expert projections' GGML types per layer (a Q4_K_M-like mix of repackable
#: types: 4-bit K-quants for gate/up, wider types for down)
QWEN3MOE_EXPERT_TYPES = (
    {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q5_K},
    {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_0, "ffn_down_exps": T.Q8_0},
)
QWEN3MOE = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 32, "experts": 6,
            "top_k": 2, "expert_ffn": 256, "layers": 2}
GPT_OSS = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 32, "experts": 5, "top_k": 2,
           "expert_ffn": 96, "layers": 2, "window": 8}


#: K-quant types -> byte offsets of their float16 super-block scale d and minimum scale dmin
_K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2)}


def _random_k_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random ``qtype`` super-blocks for a tensor of ``shape`` (bytes ``[..., row bytes]``):
    random codes and 6-bit sub-block scales / mins, with positive float16 ``d`` and ``dmin``
    sized so values stay within about +-0.2 and centre near zero."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-4, (n, 1))
    at_d, at_dmin = _K_SCALES[qtype]
    raw[:, at_d:at_d + 2] = d.astype(np.float16).view(np.uint8)
    mid = 7.5 if qtype == T.Q4_K else 15.5  # centre codes 0..15 / 0..31
    raw[:, at_dmin:at_dmin + 2] = (d * mid).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


class _Writer:
    def __init__(self, path: Path, arch: str, seed: int):
        self.file = MoeFile(path, arch)
        self.writer = gguf.GGUFWriter(str(path), arch)
        self.rng = np.random.default_rng(seed)

    def add(self, name: str, shape: tuple[int, ...], qtype: T = T.F32, *, scale: float = 0.08,
            offset: float = 0.0) -> None:
        if qtype in _K_SCALES:  # the gguf package has no K-quant quantizer: random blocks
            data = _random_k_blocks(qtype, shape, self.rng)
        else:
            w = (offset + scale * self.rng.standard_normal(shape)).astype(np.float32)
            data = w if qtype == T.F32 else gguf.quants.quantize(w, qtype)
        self.writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        self.file.tensors[name] = WrittenTensor(qtype, shape, data)

    def close(self) -> MoeFile:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()
        return self.file


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every ``tokenizer.*`` key of the GGUF ``source`` into ``writer``; returns the
    vocabulary size."""
    reader = gguf.GGUFReader(str(source))
    n_vocab = 0
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = fld.types[0]
        sub = fld.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = fld.contents()
        writer.add_key_value(key, value, vtype, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    return n_vocab


def _common_metadata(w: gguf.GGUFWriter, s: dict, vocab: int, ffn: int, context: int) -> None:
    w.add_context_length(context)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["top_k"])
    w.add_expert_feed_forward_length(s["expert_ffn"])
    w.add_vocab_size(vocab)


def write_qwen3moe(path: Path, *, seed: int = 0, tokenizer_from: Path | None = None,
                   vocab: int = 320) -> MoeFile:
    """A tiny ``qwen3moe`` GGUF: Q8_0 attention and token embedding, Q4_K output, F32 norms
    and router, experts of :data:`QWEN3MOE_EXPERT_TYPES`. With ``tokenizer_from`` (a GGUF) its
    tokenizer is copied and sets the vocabulary size."""
    s = QWEN3MOE
    out = _Writer(path, "qwen3moe", seed)
    if tokenizer_from is not None:
        vocab = copy_tokenizer(out.writer, tokenizer_from)
    # llama.cpp's dense feed_forward_length is no expert's width: a wrong value on purpose
    _common_metadata(out.writer, s, vocab, ffn=3 * s["expert_ffn"], context=4096)
    out.writer.add_rope_freq_base(1_000_000.0)
    h, d, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    out.add("token_embd.weight", (vocab, h), T.Q8_0, scale=0.1)
    out.add("output_norm.weight", (h,), offset=1.0, scale=0.1)
    out.add("output.weight", (vocab, h), T.Q4_K)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out.add(b + "attn_norm.weight", (h,), offset=1.0, scale=0.1)
        out.add(b + "attn_q.weight", (s["heads"] * d, h), T.Q8_0)
        out.add(b + "attn_k.weight", (s["kv_heads"] * d, h), T.Q8_0)
        out.add(b + "attn_v.weight", (s["kv_heads"] * d, h), T.Q8_0)
        out.add(b + "attn_output.weight", (h, s["heads"] * d), T.Q8_0)
        out.add(b + "attn_q_norm.weight", (d,), offset=1.0, scale=0.1)
        out.add(b + "attn_k_norm.weight", (d,), offset=1.0, scale=0.1)
        out.add(b + "ffn_norm.weight", (h,), offset=1.0, scale=0.1)
        out.add(b + "ffn_gate_inp.weight", (e, h), scale=0.3)
        types = QWEN3MOE_EXPERT_TYPES[i % len(QWEN3MOE_EXPERT_TYPES)]
        out.add(b + "ffn_gate_exps.weight", (e, f, h), types["ffn_gate_exps"])
        out.add(b + "ffn_up_exps.weight", (e, f, h), types["ffn_up_exps"])
        out.add(b + "ffn_down_exps.weight", (e, h, f), types["ffn_down_exps"])
    return out.close()


def write_gpt_oss(path: Path, *, seed: int = 0, tokenizer_from: Path | None = None,
                  vocab: int = 320, fused_gate_up: bool = False,
                  window: int = GPT_OSS["window"]) -> MoeFile:
    """A tiny ``gpt-oss`` GGUF as llama.cpp converts gpt-oss's MXFP4 checkpoints: MXFP4
    experts with F32 biases, Q8_0 attention with biases, attention sinks, F32 router with
    bias, untied Q8_0 output, alternating sliding (``window`` tokens) and full layers, YaRN
    RoPE metadata. ``fused_gate_up``: one ``ffn_gate_up_exps`` tensor per layer
    (gate rows first), as newer converters may write."""
    s = GPT_OSS
    out = _Writer(path, "gpt-oss", seed)
    if tokenizer_from is not None:
        vocab = copy_tokenizer(out.writer, tokenizer_from)
    _common_metadata(out.writer, s, vocab, ffn=s["expert_ffn"], context=32 * 4096)
    w = out.writer
    w.add_rope_freq_base(150_000.0)
    w.add_sliding_window(window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    h, d, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    out.add("token_embd.weight", (vocab, h), T.Q8_0, scale=0.5)
    out.add("output_norm.weight", (h,), offset=1.0, scale=0.1)
    out.add("output.weight", (vocab, h), T.Q8_0, scale=0.2)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out.add(b + "attn_norm.weight", (h,), offset=1.0, scale=0.1)
        out.add(b + "post_attention_norm.weight", (h,), offset=1.0, scale=0.1)
        for part, rows in (("q", s["heads"] * d), ("k", s["kv_heads"] * d),
                           ("v", s["kv_heads"] * d)):
            out.add(b + f"attn_{part}.weight", (rows, h), T.Q8_0, scale=0.15)
            out.add(b + f"attn_{part}.bias", (rows,), scale=0.05)
        out.add(b + "attn_output.weight", (h, s["heads"] * d), T.Q8_0)
        out.add(b + "attn_output.bias", (h,), scale=0.05)
        out.add(b + "attn_sinks.weight", (s["heads"],), scale=1.0)
        out.add(b + "ffn_gate_inp.weight", (e, h), scale=0.3)
        out.add(b + "ffn_gate_inp.bias", (e,), scale=0.1)
        if fused_gate_up:
            out.add(b + "ffn_gate_up_exps.weight", (e, 2 * f, h), T.MXFP4, scale=0.15)
            out.add(b + "ffn_gate_up_exps.bias", (e, 2 * f), scale=0.05)
        else:
            for part in ("gate", "up"):
                out.add(b + f"ffn_{part}_exps.weight", (e, f, h), T.MXFP4, scale=0.15)
                out.add(b + f"ffn_{part}_exps.bias", (e, f), scale=0.05)
        out.add(b + "ffn_down_exps.weight", (e, h, f), T.MXFP4, scale=0.15)
        out.add(b + "ffn_down_exps.bias", (e, h), scale=0.05)
    return out.close()
