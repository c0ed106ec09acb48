"""GGUF mixture-of-experts files (llama.cpp's ``qwen3moe`` and ``gpt-oss``): the stacked expert
tensors are re-laid expert by expert into MLX's layouts (affine triples; MXFP4 as MLX's
``mxfp4``) and dequantize to exactly the ``gguf`` package's reference; the model loads with
``QuantizedSwitchLinear`` experts and generates the same greedy tokens as the same file's
dequantized load; the config comes from the GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import run_llm
from gguf_moe_files import GPT_OSS, QWEN3MOE, MoeFile, write_gpt_oss, write_qwen3moe
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from vllm_unified.models import gguf as G
from vllm_unified.models.gguf_dir import gguf_hf_config
from vllm_unified.models.loader import load_model

T = gguf.GGMLQuantizationType
WRITERS = {"qwen3moe": write_qwen3moe, "gpt-oss": write_gpt_oss}
#: mlx-lm's module path of a block's experts
EXPERTS_AT = {"qwen3moe": "mlp.switch_mlp", "gpt-oss": "mlp.experts"}
PROMPT = [3, 17, 92, 5, 250, 41, 8, 77, 130, 2, 199, 64]  # longer than gpt-oss's window (8)


@pytest.fixture(scope="module", params=list(WRITERS))
def moe_file(request, tmp_path_factory) -> MoeFile:
    arch = request.param
    return WRITERS[arch](tmp_path_factory.mktemp("moe-gguf") / f"tiny-{arch}.gguf")


def _expert_names(f: MoeFile) -> list[str]:
    return [n for n, t in f.tensors.items() if n.endswith("_exps.weight")]


def test_every_expert_tensor_dequantizes_to_the_reference(moe_file):
    """Every stacked expert tensor comes back as a 3-D QuantizedTensor (MXFP4 as MLX mxfp4
    with its e8m0 bytes as scales, the affine types as 4/5/8-bit triples) and MLX's own
    ``mx.dequantize`` of it equals the gguf package's reference bit for bit; so do the other
    quantized tensors of the file."""
    index = G.read_gguf_index(moe_file.path)
    read = G.read_gguf_tensors(moe_file.path, index, quantized=True)
    names = _expert_names(moe_file)
    assert len(names) == 3 * 2
    for name, written in moe_file.tensors.items():
        t = read[name]
        if written.qtype == T.F32:
            assert isinstance(t, mx.array)
            np.testing.assert_array_equal(np.array(t), written.reference())
            continue
        assert isinstance(t, G.QuantizedTensor), name
        assert t.shape == written.shape and t.source_type == written.qtype.name
        if t.mode == "affine":  # as the loader holds them at float32 (held_scales)
            t = t.map_rows(lambda a: a if a.dtype == mx.uint32 else a.astype(mx.float32))
        dense = mx.dequantize(t.weight, t.scales, t.biases, t.group_size, t.bits, mode=t.mode,
                              dtype=mx.float32)
        np.testing.assert_array_equal(np.array(dense), written.reference(), err_msg=name)
        if written.qtype == T.MXFP4:
            assert (t.mode, t.bits, t.group_size, t.biases) == ("mxfp4", 4, 32, None)
            assert t.scales.dtype == mx.uint8
        else:
            assert t.mode == "affine"
    if moe_file.arch == "gpt-oss":
        assert {moe_file.tensors[n].qtype for n in names} == {T.MXFP4}


#: byte offsets of each type's float16 block scales (the rest of a block is random bytes)
_F16_AT = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
           T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


@pytest.mark.parametrize("qtype", list(_F16_AT) + [T.MXFP4])
def test_every_expert_type_is_relaid_per_expert(qtype):
    """A stack of 3 experts of random blocks of every type kept for experts: a 3-D triple
    (MXFP4: mxfp4) whose expert ``e`` is exactly the 2-D re-lay of expert ``e`` alone, and
    whose dequantization is the gguf reference bit for bit."""
    e, rows, cols = 3, 5, 512
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 254, (e * rows, cols // block, size), dtype=np.uint8)
    for at in _F16_AT.get(qtype, ()):
        raw[..., at:at + 2] = rng.uniform(-0.05, 0.05, raw.shape[:-1] + (1,)).astype(
            np.float16).view(np.uint8)
    info = G.GGUFTensorInfo("blk.1.ffn_down_exps.weight", int(qtype), (e, rows, cols), 0,
                            raw.size)
    qt = G._repack_experts(raw.reshape(-1), info)
    assert qt.shape == (e, rows, cols) and qt.weight.ndim == 3
    assert qt.mode == ("mxfp4" if qtype == T.MXFP4 else "affine")
    per_expert = raw.reshape(e, -1)
    for i in range(e):
        one = G.GGUFTensorInfo("x", int(qtype), (rows, cols), 0, per_expert[i].size)
        alone = (G._repack_mxfp4 if qtype == T.MXFP4 else G._repack)(per_expert[i], one)
        for part in ("weight", "scales", "biases"):
            a, b = getattr(qt, part), getattr(alone, part)
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(np.array(a[i]), np.array(b))
    ref = gguf.quants.dequantize(raw.reshape(e * rows, -1), qtype).reshape(e, rows, cols)
    np.testing.assert_array_equal(np.array(qt.dequantize(mx.float32)), ref)


def test_mxfp4_repack_covers_every_code_and_scale():
    """Random MXFP4 blocks with every e8m0 scale byte 0..254 (subnormal results included) and
    every 4-bit code: MLX's mxfp4 dequantization equals ggml's reference exactly, the codes
    are re-laid, not re-quantized (MLX's own quantize of the values gives the same bytes),
    and a scale byte of 255 (MLX: infinity) is refused by name."""
    rng = np.random.default_rng(39)
    rows, cols = 255, 64
    raw = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(rows, dtype=np.uint8)[:, None]  # scale byte = row number
    info = G.GGUFTensorInfo("blk.0.ffn_up_exps.weight", int(T.MXFP4), (rows, cols), 0,
                            raw.size)
    qt = G._repack_mxfp4(raw.reshape(-1), info)
    with np.errstate(over="ignore"):  # scale byte 254 times 6: infinity in both
        ref = gguf.quants.dequantize(raw.reshape(rows, -1), T.MXFP4)
    np.testing.assert_array_equal(np.array(qt.dequantize(mx.float32)), ref)
    # MLX quantizes values that are already on the grid back to the same codes and scales
    normal = slice(8, 200)  # away from the subnormal and overflow ends of the e8m0 range
    wq, scales = mx.quantize(mx.array(ref[normal]), group_size=32, bits=4, mode="mxfp4")
    codes = np.array(wq).view(np.uint8) & 0x77  # -0 and +0 both decode to 0: compare
    np.testing.assert_array_equal(codes, np.array(qt.weight[normal]).view(np.uint8) & 0x77)
    np.testing.assert_array_equal(np.array(scales), raw[normal, :, 0])
    bad = raw.copy()
    bad[3, 1, 0] = 255
    with pytest.raises(ValueError, match="blk.0.ffn_up_exps.weight.*255"):
        G._repack_mxfp4(bad.reshape(-1), info)


def test_group16_expert_stacks_stay_dense_and_say_why(tmp_path):
    """Q6_K expert stacks (16-value sub-blocks: MLX's gather_qmm takes groups of 32 and up)
    are dequantized exactly even where the native kernels keep Q6_K matrices quantized, and
    the start-up lines say why."""
    e, rows, cols = 3, 4, 256
    raw = np.random.default_rng(6).integers(0, 256, (e * rows, cols // 256, 210), np.uint8)
    raw[..., 208:210] = np.full((e * rows, 1, 1), 1e-3, np.float16).view(np.uint8)
    path = tmp_path / "q6k.bin"
    path.write_bytes(raw.tobytes())
    info = G.GGUFTensorInfo("blk.0.ffn_down_exps.weight", int(T.Q6_K), (e, rows, cols), 0,
                            raw.size)
    index = G.GGUFIndex({}, {info.name: info})
    t = G.read_gguf_tensors(path, index, quantized=True, group16=True)[info.name]
    assert isinstance(t, mx.array) and t.shape == (e, rows, cols)
    ref = gguf.quants.dequantize(raw.reshape(e * rows, -1), T.Q6_K).reshape(e, rows, cols)
    np.testing.assert_array_equal(np.array(t), ref)
    (line,) = G.describe_weights(index, {info.name: t})
    assert "dequantized" in line and "stacked experts run through MLX's gather_qmm" in line


def _switch_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, SwitchLinear | QuantizedSwitchLinear)}


@pytest.fixture(scope="module")
def loaded(moe_file):
    """The file loaded kept quantized and dequantized (float32), as (kept, dense)."""
    kept = load_model(moe_file.path, dtype=mx.float32, keep_quantized=True)
    dense = load_model(moe_file.path, dtype=mx.float32, keep_quantized=False)
    return kept, dense


def test_loaded_model_holds_the_experts_quantized(moe_file, loaded):
    """Kept quantized, every expert projection of the mlx-lm model is a QuantizedSwitchLinear
    holding the file's codes (mxfp4 for gpt-oss's MXFP4, affine at the type's width for the
    qwen3moe mix) before any kernel route is installed; dequantized, a SwitchLinear holding
    the reference values. gpt-oss's expert biases, router bias and sinks are loaded too."""
    kept, dense = loaded
    assert kept.quantized and not dense.quantized
    layers = QWEN3MOE["layers"] if moe_file.arch == "qwen3moe" else GPT_OSS["layers"]
    q_switch, d_switch = _switch_layers(kept.model), _switch_layers(dense.model)
    assert len(q_switch) == len(d_switch) == 3 * layers
    bits = {T.Q4_K: 4, T.Q4_0: 4, T.Q5_K: 5, T.Q8_0: 8, T.MXFP4: 4}
    for i in range(layers):
        for proj in ("gate", "up", "down"):
            written = moe_file.tensors[f"blk.{i}.ffn_{proj}_exps.weight"]
            at = f"model.layers.{i}.{EXPERTS_AT[moe_file.arch]}.{proj}_proj"
            q, d = q_switch[at], d_switch[at]
            assert type(q) is QuantizedSwitchLinear and type(d) is SwitchLinear
            assert q.mode == ("mxfp4" if written.qtype == T.MXFP4 else "affine")
            assert q.bits == bits[written.qtype] and q.weight.dtype == mx.uint32
            np.testing.assert_array_equal(
                np.array(mx.dequantize(q.weight, q.scales, q.get("biases"), q.group_size,
                                       q.bits, mode=q.mode, dtype=mx.float32)),
                written.reference())
            np.testing.assert_array_equal(np.array(d.weight), written.reference())
            if moe_file.arch == "gpt-oss":
                bias = moe_file.tensors[f"blk.{i}.ffn_{proj}_exps.bias"].reference()
                np.testing.assert_array_equal(np.array(q.bias), bias)
        if moe_file.arch == "gpt-oss":
            block = kept.model.model.layers[i]
            np.testing.assert_array_equal(
                np.array(block.self_attn.sinks),
                moe_file.tensors[f"blk.{i}.attn_sinks.weight"].reference())
            np.testing.assert_array_equal(
                np.array(block.mlp.router.bias),
                moe_file.tensors[f"blk.{i}.ffn_gate_inp.bias"].reference())


def test_describe_weights_names_the_expert_stacks(moe_file):
    index = G.read_gguf_index(moe_file.path)
    lines = G.describe_weights(index, G.read_gguf_tensors(moe_file.path, index,
                                                          quantized=True))
    experts = [line for line in lines if "stacked experts" in line]
    n = sum(int(line.split(": ")[1].split(" ")[0]) for line in experts)
    assert n == len(_expert_names(moe_file))
    if moe_file.arch == "gpt-oss":
        assert experts == [next(line for line in lines if line.startswith("MXFP4: 6 tensors, "
                                                                          "kept as MXFP4"))]


def _greedy(model: nn.Module, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy decode with mlx-lm's own caches (gpt-oss: a rotating cache on sliding layers):
    the argmax at every prompt position then the ``n`` generated tokens, and all their
    logits ``[len(ids) + n - 1, vocab]``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = [np.array(model(mx.array([ids]), cache=cache)[0])]
    out = [int(i) for i in logits[0].argmax(-1)]
    for _ in range(n - 1):
        logits.append(np.array(model(mx.array([[out[-1]]]), cache=cache)[0]))
        out.append(int(logits[-1][-1].argmax()))
    return out, np.concatenate(logits)


def test_kept_quantized_generates_what_the_dequantized_load_does(moe_file, loaded):
    """mlx-lm's forward on the kept-quantized load (gather_qmm over the experts' codes) gives
    the same argmax at every prompt position and the same 16 greedy tokens as the same file's
    dequantized load, logits within fp32 rounding; the ids vary (the test can tell models
    apart)."""
    kept, dense = loaded
    q_ids, q_logits = _greedy(kept.model, PROMPT, 16)
    d_ids, d_logits = _greedy(dense.model, PROMPT, 16)
    assert q_ids == d_ids
    assert len(set(d_ids)) > 5
    np.testing.assert_allclose(q_logits, d_logits, atol=2e-4, rtol=0)


def _transformers_reference(f: MoeFile):
    """transformers' fp32 model of ``f``: its own GGUF loader (names, dequantization) for
    qwen3moe; for gpt-oss, whose llama.cpp expert tensors and sinks transformers 5.19's GGUF
    loader does not read, those placed by hand in its layout (``gate_up_proj`` ``[E, hidden,
    2 ffn]`` with gate and up interleaved by column). YaRN as the config has it
    (``truncate: false``), which the loader applies to mlx-lm's rounded YaRN
    (``rope_fixes.match_yarn_truncation``)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = gguf_hf_config(f.path)
    if f.arch == "gpt-oss":
        cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(str(f.path.parent), gguf_file=f.path.name,
                                                 config=cfg, dtype=torch.float32)
    if f.arch == "gpt-oss":
        def ref(name: str) -> torch.Tensor:
            return torch.from_numpy(f.tensors[name].reference())

        state = {}
        for i in range(cfg.num_hidden_layers):
            b, p = f"blk.{i}.", f"model.layers.{i}."
            gate = ref(b + "ffn_gate_exps.weight").transpose(1, 2)
            up = ref(b + "ffn_up_exps.weight").transpose(1, 2)
            state[p + "mlp.experts.gate_up_proj"] = torch.stack([gate, up], -1).flatten(-2)
            state[p + "mlp.experts.gate_up_proj_bias"] = torch.stack(
                [ref(b + "ffn_gate_exps.bias"), ref(b + "ffn_up_exps.bias")], -1).flatten(-2)
            state[p + "mlp.experts.down_proj"] = ref(b + "ffn_down_exps.weight").transpose(1, 2)
            state[p + "mlp.experts.down_proj_bias"] = ref(b + "ffn_down_exps.bias")
            state[p + "self_attn.sinks"] = ref(b + "attn_sinks.weight")
        assert not model.load_state_dict(state, strict=False).unexpected_keys
    return model


def test_dequantized_load_equals_transformers(moe_file, loaded):
    """The file's tensor names and layouts mean what llama.cpp means: the dequantized load's
    logits over the prompt (longer than gpt-oss's 8-token window) equal transformers'
    implementation of the same weights within fp32 rounding."""
    import torch

    model = _transformers_reference(moe_file)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    ours = np.array(loaded[1].model(mx.array([PROMPT]))[0])
    np.testing.assert_allclose(ours, ref, atol=5e-5, rtol=0)


def test_fused_gate_up_experts_are_split(tmp_path):
    """A gpt-oss file with llama.cpp's fused ``ffn_gate_up_exps`` (gate rows first) loads its
    first half as the gate projection and its second as the up projection, still MXFP4."""
    f = write_gpt_oss(tmp_path / "fused.gguf", fused_gate_up=True)
    model = load_model(f.path, dtype=mx.float32, keep_quantized=True).model
    ffn = GPT_OSS["expert_ffn"]
    for i in range(GPT_OSS["layers"]):
        w = f.tensors[f"blk.{i}.ffn_gate_up_exps.weight"].reference()
        b = f.tensors[f"blk.{i}.ffn_gate_up_exps.bias"].reference()
        experts = model.model.layers[i].mlp.experts
        for proj, half in ((experts.gate_proj, slice(0, ffn)), (experts.up_proj,
                                                                slice(ffn, 2 * ffn))):
            assert type(proj) is QuantizedSwitchLinear and proj.mode == "mxfp4"
            dense = mx.dequantize(proj.weight, proj.scales, None, 32, 4, mode="mxfp4",
                                  dtype=mx.float32)
            np.testing.assert_array_equal(np.array(dense), w[:, half])
            np.testing.assert_array_equal(np.array(proj.bias), b[:, half])


def test_split_fused_experts_refuses_odd_rows():
    with pytest.raises(ValueError, match="do not split"):
        G.split_fused_experts("blk.0.ffn_gate_up_exps.bias", mx.zeros((2, 5)))
    t = mx.zeros((3,))
    assert G.split_fused_experts("blk.0.ffn_up_exps.bias", t) == [("blk.0.ffn_up_exps.bias", t)]


def test_config_comes_from_the_gguf_metadata(moe_file):
    """The HF config fields vLLM and mlx-lm read, from llama.cpp's metadata keys: the
    experts' width (not the dense feed_forward_length), their count and top-k; gpt-oss's
    window, head size, YaRN and untied head; qwen3moe's renormalised top-k."""
    cfg = gguf_hf_config(moe_file.path)
    if moe_file.arch == "qwen3moe":
        s = QWEN3MOE
        assert type(cfg).__name__ == "Qwen3MoeConfig"
        assert cfg.architectures == ["Qwen3MoeForCausalLM"]
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (s["experts"], s["top_k"])
        assert cfg.moe_intermediate_size == s["expert_ffn"] and cfg.head_dim == s["head_dim"]
        assert cfg.norm_topk_prob and not cfg.tie_word_embeddings
    else:
        s = GPT_OSS
        assert type(cfg).__name__ == "GptOssConfig"
        assert cfg.architectures == ["GptOssForCausalLM"]
        assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (s["experts"], s["top_k"])
        assert cfg.intermediate_size == s["expert_ffn"] and cfg.head_dim == s["head_dim"]
        assert cfg.sliding_window == s["window"] and not cfg.tie_word_embeddings
        assert cfg.layer_types == ["sliding_attention", "full_attention"]
        rope = cfg.rope_parameters
        assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"],
                rope["rope_theta"]) == ("yarn", 32.0, 4096, 150000.0)
    assert cfg.hidden_size == s["hidden"] and cfg.num_hidden_layers == s["layers"]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (s["heads"], s["kv_heads"])


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> dict[str, MoeFile]:
    """Both files with a real tokenizer (SmolLM2's, copied into them), by architecture."""
    from tiny_models import smollm2_gguf_path

    folder = tmp_path_factory.mktemp("moe-gguf-tokenized")
    return {arch: writer(folder / f"{arch}.gguf", tokenizer_from=smollm2_gguf_path())
            for arch, writer in WRITERS.items()}


@pytest.mark.slow  # ~40 s: SmolLM2's vocabulary read and converted twice
def test_prepared_folder_serves_the_config_and_tokenizer(tokenized, tmp_path):
    """prepare_gguf_dir on MoE files with a real tokenizer: config.json carries the expert
    fields, and the tokenizer round-trips text."""
    import json

    from transformers import AutoTokenizer

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    for arch, f in tokenized.items():
        folder = prepare_gguf_dir(f.path, tmp_path / f"{arch}-dir")
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["vocab_size"] == 49152
        if arch == "qwen3moe":
            assert cfg["moe_intermediate_size"] == QWEN3MOE["expert_ffn"]
        else:
            assert cfg["intermediate_size"] == GPT_OSS["expert_ffn"]
            assert cfg["sliding_window"] == GPT_OSS["window"]
        tok = AutoTokenizer.from_pretrained(str(folder))
        text = "The capital of France is"
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.slow  # ~40 s: two tokenizers converted, two fp32 folders written
def test_export_dequantized_holds_every_weight_of_the_file(tokenized, tmp_path):
    """export_dequantized (the fp32 HF folder for vLLM's own CPU backend) holds the file's
    weights, gpt-oss's experts and sinks included (transformers' GGUF loader skips them):
    transformers on the folder gives the dequantized load's logits (gpt-oss's YaRN rounded
    as mlx-lm rounds it, as in test_dequantized_load_equals_transformers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_unified.models.gguf_dir import export_dequantized

    for arch, f in tokenized.items():
        folder = export_dequantized(f.path, tmp_path / arch)
        cfg = AutoConfig.from_pretrained(folder)
        if arch == "gpt-oss":
            cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.float32)
        with torch.no_grad():
            ref = model(torch.tensor([PROMPT])).logits[0].numpy()
        dense = load_model(f.path, dtype=mx.float32, keep_quantized=False).model
        np.testing.assert_allclose(np.array(dense(mx.array([PROMPT]))[0]), ref, atol=5e-5,
                                   rtol=0)


# ---------------------------------------------------------------- served through vLLM

ENGINE_PROMPTS = [[(7 * i + 13 * j) % 300 + 3 for j in range(n)]
                  for i, n in enumerate((5, 12, 19))]
NEW_TOKENS = 8


def _served_folder(f: MoeFile, folder: Path) -> Path:
    """What prepare_gguf_dir makes for ``f``, less the tokenizer (the tiny files have none:
    the engine runs with ``skip_tokenizer_init``): config.json and the link to the file."""
    from vllm_unified.models.gguf_dir import GGUF_LINK

    folder.mkdir()
    gguf_hf_config(f.path).save_pretrained(folder)
    (folder / GGUF_LINK).symlink_to(f.path)
    return folder


def _engine_spec(folder: Path) -> dict:
    requests = [{"prompt_token_ids": p,
                 "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}}
                for p in ENGINE_PROMPTS]
    return {
        "model": str(folder),
        "engine": {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 16,
                   "kv_cache_memory_bytes": 32 * 2**20, "seed": 0, "skip_tokenizer_init": True,
                   "enable_prefix_caching": True},
        # the second batch reads the first one's full prompt blocks from the prefix cache
        "batches": [requests, requests],
    }


def _ids(result: dict) -> list[list[int]]:
    return [o["completions"][0]["token_ids"] for o in result["outputs"]]


@pytest.mark.engine
# qwen3moe's experts are served in the CI tier by tests/test_moe_families.py's qwen3_moe case
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "qwen3moe"
                                  else a for a in WRITERS])
def test_served_kept_quantized_equals_the_dequantized_load(arch, tmp_path):
    """The GGUF served by vLLM through the plugin (3 concurrent requests in 16-token chunks,
    then again from the prefix cache), its experts read kept quantized, gives the greedy ids
    of mlx-lm's own generation on the same file's dequantized load. (gpt-oss with a window
    longer than the requests: how windows are served is the model-families tests' part.)"""
    writer = write_gpt_oss if arch == "gpt-oss" else write_qwen3moe
    kwargs = {"window": 64} if arch == "gpt-oss" else {}
    f = writer(tmp_path / f"{arch}.gguf", **kwargs)
    result = run_llm(_engine_spec(_served_folder(f, tmp_path / "folder")), tmp_path)
    dense = load_model(f.path, dtype=mx.float32, keep_quantized=False).model
    want = [_greedy(dense, p, NEW_TOKENS)[0][len(p) - 1:] for p in ENGINE_PROMPTS]
    assert _ids(result) == want + want
    weights = [line for line in result["log"].splitlines() if "GGUF weights" in line]
    experts = [line for line in weights if "stacked experts" in line]
    assert experts and all(" kept as " in line for line in experts)
    if arch == "gpt-oss":
        assert any("MXFP4: 6 tensors, kept as MXFP4" in line for line in experts)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("arch", list(WRITERS))
def test_served_kept_quantized_equals_served_dequantized(arch, tmp_path):
    """Engine against engine on the same file: kept quantized (the default) and dequantized
    at load (``VLLM_UNIFIED_CPU_QUANTIZED=0``) give the same greedy ids, gpt-oss with its
    8-token window on the sliding layers."""
    f = WRITERS[arch](tmp_path / f"{arch}.gguf")
    spec = _engine_spec(_served_folder(f, tmp_path / "folder"))
    kept = run_llm(spec, tmp_path)
    (tmp_path / "dense").mkdir()
    dense = run_llm(spec, tmp_path / "dense", env={"VLLM_UNIFIED_CPU_QUANTIZED": "0"})
    assert _ids(kept) == _ids(dense)
    assert "dequantized to float32 (quantized layers off)" in dense["log"]
