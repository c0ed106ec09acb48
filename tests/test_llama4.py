"""Llama 4 text (dense layers): chunked local attention, layers without RoPE, attention
temperature tuning and QK norm, served by our engine on a tiny random checkpoint.

The same random weights are written twice: as mlx-lm and multimodal Llama 4 checkpoints
have them (``model_type: llama4``, ``text_config``, weights under ``language_model.``), which
mlx-lm's ``llama4`` module and our engine load; and as transformers' ``Llama4ForCausalLM``
(``model_type: llama4_text``), which vLLM's CPU backend serves (mlx-lm would load that type with
its ``llama4_text`` module, which applies no attention chunk).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import _randomize, greedy_ids, smollm2_tokenizer

#: attention chunk of the tiny model (tokens): every prompt but one spans several chunks
CHUNK = 8
#: the chunk of the checkpoint vLLM's CPU backend serves (it takes chunks that are multiples of
#: its 128-token blocks), and prompts spanning two such chunks
NATIVE_CHUNK = 128
NEW_TOKENS = 12


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(m * i + 3) % 49000 + 10 for i in range(n)]
            for m, n in zip((7, 11, 13, 17), lengths, strict=True)]


PROMPTS = _prompts((37, 21, 9, 30))
NATIVE_PROMPTS = _prompts((200, 140, 9, 131))


def _text_config(chunk: int, tuning: bool, moe: bool = False) -> dict:
    """5 layers: 0, 1, 2, 4 chunked with RoPE and QK norm, 3 global without RoPE (temperature
    tuning from position 3 on: floor_scale 4); 6 query heads on 2 KV heads; no MoE layer
    (interleave_moe_layer_step beyond the layer count), or with ``moe`` layers 1 and 3 MoE
    (5 routed experts, top-1, and the shared expert) as Llama 4 Maverick alternates them;
    llama3 RoPE scaling as Llama 4's."""
    tok = smollm2_tokenizer()
    experts = ({"interleave_moe_layer_step": 2, "num_local_experts": 5} if moe
               else {"interleave_moe_layer_step": 6, "num_local_experts": 2})
    return dict(
        model_type="llama4_text", vocab_size=49152, hidden_size=96, intermediate_size=64,
        intermediate_size_mlp=128, num_hidden_layers=5, num_attention_heads=6,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        attention_chunk_size=chunk, use_qk_norm=True, attention_bias=False,
        **experts, num_experts_per_tok=1,
        no_rope_layers=[1, 1, 1, 0, 1], attn_temperature_tuning=tuning, floor_scale=4,
        attn_scale=0.5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )


def make_llama4_checkpoints(root: str | Path, chunk: int = CHUNK, tuning: bool = True,
                            moe: bool = False) -> tuple[Path, Path]:
    """Write (once) the tiny model with attention chunk ``chunk``, temperature tuning on or
    off and (``moe``) MoE layers as ``(llama4 folder, llama4_text folder)``."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    root = Path(root)
    multi, text = root / "tiny-llama4", root / "tiny-llama4-text"
    if (multi / "model.safetensors").is_file() and (text / "model.safetensors").is_file():
        return multi, text
    cfg = _text_config(chunk, tuning, moe)
    config = transformers.Llama4TextConfig(**{k: v for k, v in cfg.items()
                                              if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).to(torch.float32)
    assert any("experts" in n for n, _ in model.named_parameters()) == moe
    _randomize(model, "llama4", 0)
    model.config.dtype = torch.float32
    model.save_pretrained(text)
    smollm2_tokenizer().save_pretrained(text)

    multi.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(text / "model.safetensors"))
    save_file({f"language_model.{k}": v.contiguous() for k, v in weights.items()},
              str(multi / "model.safetensors"), metadata={"format": "pt"})
    (multi / "config.json").write_text(json.dumps({
        "model_type": "llama4", "architectures": ["Llama4ForCausalLM"],
        "text_config": cfg, "vision_config": {"model_type": "llama4_vision_model"},
        "dtype": "float32", "tie_word_embeddings": False,
    }))
    smollm2_tokenizer().save_pretrained(multi)
    return multi, text


def _mlx_lm_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own model and cache (no vllm-unified code) on ``folder``."""
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return greedy_ids(model, prompt, n)


def _spec(folder: Path, prompts: list[list[int]]) -> dict:
    return {
        "model": str(folder),
        "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
                   "kv_cache_memory_bytes": 64 * 2**20, "seed": 0,
                   "enable_prefix_caching": True, "disable_log_stats": False},
        "requests": [{"prompt_token_ids": p,
                      "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS,
                                 "ignore_eos": True}} for p in prompts],
        # the second round reads the prompts' full blocks from the prefix cache
        "rounds": 2, "metrics": True,
        "rpc": ["runner_stats"],
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    return make_llama4_checkpoints(tmp_path_factory.mktemp("llama4"))


def test_mlx_lm_llama4_is_transformers_llama4(checkpoints):
    """The two folders are one model: mlx-lm's llama4 on the first gives transformers'
    ``Llama4ForCausalLM`` logits on the second (prompt over several attention chunks)."""
    import torch
    import transformers
    from mlx_lm.utils import load_model

    multi, text = checkpoints
    model, _ = load_model(multi)
    ours = np.array(model(mx.array([PROMPTS[0]]))[0])
    hf = transformers.Llama4ForCausalLM.from_pretrained(str(text), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * np.abs(theirs).max())


@pytest.mark.engine
def test_llama4_matches_mlx_lm(checkpoints, tmp_path):
    """Chunked prefill (16 tokens a step), 4 concurrent requests over prompts of 1-5 attention
    chunks, then again from the prefix cache: mlx-lm's greedy ids."""
    from conftest import run_llm

    multi, _ = checkpoints
    ours = run_llm(_spec(multi, PROMPTS), tmp_path)
    for i, prompt in enumerate(PROMPTS * 2):
        got = ours["outputs"][i]["completions"][0]["token_ids"]
        assert got == _mlx_lm_greedy(multi, prompt, NEW_TOKENS), f"request {i}"
    assert ours["metrics"]["vllm:prefix_cache_hits"] >= 16 * 4
    stats = ours["rpc_after"]["runner_stats"]
    assert max(int(k) for k in stats["forwards_by_num_reqs"]) == len(PROMPTS)
    assert "chunked local attention (attention_chunk_size) runs on the" in ours["log"]


def _transformers_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' ``Llama4ForCausalLM`` (the model's reference code), a full forward per
    token in fp32."""
    import torch
    import transformers

    model = transformers.Llama4ForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.engine
@pytest.mark.slow
def test_llama4_two_chunks_match_transformers_and_mlx_lm(tmp_path):
    """Chunk 128 (vLLM's CPU block multiple), prompts reaching into the second chunk: our
    engine's greedy ids equal transformers' and mlx-lm's."""
    from conftest import run_llm

    multi, text = make_llama4_checkpoints(tmp_path / "ckpt", NATIVE_CHUNK)
    ours = run_llm(_spec(multi, NATIVE_PROMPTS), tmp_path)
    for i, prompt in enumerate(NATIVE_PROMPTS * 2):
        got = ours["outputs"][i]["completions"][0]["token_ids"]
        assert got == _mlx_lm_greedy(multi, prompt, NEW_TOKENS), f"prompt {i}"
        if i < len(NATIVE_PROMPTS):
            assert got == _transformers_greedy(text, prompt, NEW_TOKENS), f"prompt {i}"


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_llama4_vllm_native_fp32_matches_ours_and_mlx_lm(moe, tmp_path):
    """vLLM's own CPU backend in fp32 on the same weights (its ``Llama4ForCausalLM``), chunk
    128 (a multiple of its blocks), prompts reaching into the second chunk: its greedy ids
    equal ours and mlx-lm's. Temperature tuning is off in this checkpoint: vLLM 0.32 applies
    it only for a ``max_model_len`` beyond 32K (it ignores the config's flag), mlx-lm and
    transformers whenever the config sets it
    (:func:`test_llama4_two_chunks_match_transformers_and_mlx_lm` checks it on). ``moe``:
    layers 1 and 3 are MoE (5 routed experts, top-1, a shared expert)."""
    from conftest import run_llm

    multi, text = make_llama4_checkpoints(tmp_path / "ckpt", NATIVE_CHUNK, tuning=False,
                                          moe=moe)
    spec = _spec(text, NATIVE_PROMPTS)
    del spec["rpc"]  # our runner's statistics
    native = run_llm(spec, tmp_path, native=True)
    ours = run_llm(_spec(multi, NATIVE_PROMPTS), tmp_path)
    for i, prompt in enumerate(NATIVE_PROMPTS * 2):
        got = native["outputs"][i]["completions"][0]["token_ids"]
        assert got == ours["outputs"][i]["completions"][0]["token_ids"], f"prompt {i}"
        assert got == _mlx_lm_greedy(multi, prompt, NEW_TOKENS), f"prompt {i}"


# ----------------------------------------------------------------------------- load time


def test_layout_carries_each_layers_chunk(checkpoints):
    """Layers 0-2 and 4 are chunked (chunk 8), layer 3 global; vLLM's spec records the chunk
    (its own promotion of chunked layers next to full attention)."""
    from vllm_unified.kv.quant import attention_spec, kv_format
    from vllm_unified.models.capability import route_model
    from vllm_unified.models.loader import load_model

    multi, _ = checkpoints
    loaded = load_model(str(multi), hf_config=None, dtype=mx.float32, keep_quantized=False)
    layout, _ = route_model(loaded.model, loaded.config, kv_shape=(2, 32), config_window=None)
    assert {i: (s.chunk, s.window, s.num_kv_heads, s.head_dim)
            for i, s in layout.attention.items()} == {
        0: (CHUNK, None, 2, 32), 1: (CHUNK, None, 2, 32), 2: (CHUNK, None, 2, 32),
        3: (None, None, 2, 32), 4: (CHUNK, None, 2, 32)}
    spec = attention_spec(kv_format("auto"), block_size=16, num_kv_heads=2, head_size=32,
                          dtype=None, attention_chunk_size=CHUNK)
    assert spec.attention_chunk_size == CHUNK and spec.sliding_window is None


def test_llama4_configs_mlx_lm_cannot_compute_are_refused():
    from vllm_unified.models.config import mlx_lm_config

    text = _text_config(CHUNK, True)
    with pytest.raises(ValueError, match="no_rope_layers"):
        mlx_lm_config({"model_type": "llama4",
                       "text_config": {**text, "no_rope_layers": [1, 0, 1, 1, 1]}})
    with pytest.raises(ValueError, match="attention_chunk_size is not set"):
        mlx_lm_config({"model_type": "llama4",
                       "text_config": {**text, "attention_chunk_size": None}})
    # llama4_text (mlx-lm's module without chunks or temperature tuning)
    with pytest.raises(ValueError, match="chunked local attention"):
        mlx_lm_config(text)
    dense = {**text, "attention_chunk_size": 4096, "no_rope_layers": [1] * 5,
             "max_position_embeddings": 4096}
    assert mlx_lm_config(dense)["no_rope_layers"] == [1] * 5
    with pytest.raises(ValueError, match="QK norm"):
        mlx_lm_config({**dense, "no_rope_layers": [1, 1, 1, 0, 1], "floor_scale": 8192})
