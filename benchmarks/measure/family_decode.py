"""One decode step of each model family at a real model's width, against a llama of the same
width, served through vLLM on our platform (so every family takes the path it is served by:
its attention features, its KV pages, its head).

Each family gets a random-weight fp32 checkpoint built with transformers' own config class
(hidden 1024, 16 query heads of 64, 4 KV heads, MLP 4096, 24 layers: about 0.4B parameters;
each family's own features at their real settings: Gemma 2's soft-capping and windows, Gemma
4's wider full-attention heads and per-layer inputs, Phi-3's fused projections, MiniCPM3's
latent attention), then one engine per family in its own process generates greedily: one
request, then 16 at once, each with a 64-token prompt. The runner's step profile gives the
mean decode step (prepare + graph + eval + output) at each batch size; the ratio is the
family's step over llama's, measured in the same run.

    .venv/bin/python benchmarks/engine.py family-decode
    .venv/bin/python benchmarks/engine.py family-decode --families llama gemma2 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[2] / "tests")]
from harness import machine_info, timestamp, versions, write_result  # noqa: E402

FAMILIES = ("llama", "gemma2", "gemma4", "phi3", "minicpm3")
PROMPT = 64
NEW_TOKENS = 48
BATCHES = (1, 16)


def config(family: str, layers: int):  # noqa: ANN201 - a transformers config
    """The family's transformers config at the benchmark's width."""
    import transformers
    from tiny_models import smollm2_tokenizer

    tok = smollm2_tokenizer()
    common = dict(vocab_size=49152, hidden_size=1024, intermediate_size=4096,
                  num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=layers,
                  max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "llama":
        return transformers.LlamaConfig(**common, head_dim=64, rope_parameters=rope)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=64, query_pre_attn_scalar=64,
                                         sliding_window=4096, rope_parameters=rope)
    if family == "gemma4":
        pattern = ["sliding_attention"] * 5 + ["full_attention"]
        return transformers.Gemma4TextConfig(
            **common, head_dim=64, global_head_dim=128, sliding_window=512,
            layer_types=(pattern * layers)[:layers], hidden_size_per_layer_input=64,
            vocab_size_per_layer_input=49152, final_logit_softcapping=30.0,
            tie_word_embeddings=True)
    if family == "phi3":
        return transformers.Phi3Config(**common, rope_parameters=rope)
    if family == "minicpm3":
        # MiniCPM3-4B's latent attention (latent 256, rope 32, nope 64, query LoRA 768,
        # LongRoPE) at the benchmark's width: 16 heads, values of hidden / heads = 64. Every
        # width goes to the constructor (its derived sizes, v_head_dim among them, follow).
        return transformers.MiniCPM3Config(
            **{**common, "num_key_value_heads": 16}, kv_lora_rank=256, q_lora_rank=768,
            qk_nope_head_dim=64, qk_rope_head_dim=32, scale_emb=12, scale_depth=1.4,
            dim_model_base=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0] * 16, "long_factor": [1.0] * 16,
                             "original_max_position_embeddings": 4096, "factor": 1.0})
    raise ValueError(f"unknown family {family!r} (have: {', '.join(FAMILIES)})")


def build(family: str, layers: int, where: Path) -> Path:
    """A random-weight fp32 checkpoint of ``family`` with SmolLM2's tokenizer."""
    import torch
    import transformers
    from tiny_models import smollm2_tokenizer

    folder = where / family
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(family, layers),
                                                          dtype=torch.float32)
    model.save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def child(folder: str, out: str) -> None:
    """One engine: decode step times per batch size, from the runner's step profile."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype="float32", max_model_len=512, max_num_seqs=16,
              enable_prefix_caching=False, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def prompts(n: int, salt: int) -> list[dict]:
        return [{"prompt_token_ids": [(97 * i + 31 * j + salt) % 40000 + 100
                                      for j in range(PROMPT)]} for i in range(n)]

    def decode_totals() -> tuple[int, float]:
        prof = llm.collective_rpc("runner_stats")[0]["step_profile"].get("decode")
        if not prof:
            return 0, 0.0
        return prof["steps"], prof["steps"] * prof["mean_ms"]["total"]

    llm.generate(prompts(2, 7), params, use_tqdm=False)  # warm-up: kernels compiled
    result = {}
    for batch in BATCHES:
        steps0, ms0 = decode_totals()
        llm.generate(prompts(batch, batch), params, use_tqdm=False)
        steps1, ms1 = decode_totals()
        result[batch] = {"steps": steps1 - steps0, "ms_per_step": (ms1 - ms0) / (steps1 - steps0)}
    Path(out).write_text(json.dumps(result))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    if "llama" not in args.families:
        args.families.insert(0, "llama")
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="family-decode-") as tmp:
        for family in args.families:
            start = time.perf_counter()
            folder = build(family, args.layers, Path(tmp))
            out = Path(tmp) / f"{family}.json"
            proc = subprocess.run([sys.executable, __file__, "--child", str(folder), str(out)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                results[family] = {"error": (proc.stdout + proc.stderr)[-2000:]}
                print(f"{family}: failed\n{results[family]['error']}", flush=True)
                continue
            results[family] = json.loads(out.read_text())
            print(f"{family}: {results[family]} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            for f in folder.glob("*.safetensors"):
                f.unlink()
    base = results.get("llama", {})
    print(f"\n{args.layers} layers, hidden 1024, fp32, {PROMPT}-token prompts, "
          f"{NEW_TOKENS} new tokens")
    print("| family | " + " | ".join(f"B={b} ms/step | vs llama" for b in BATCHES) + " |")
    print("|---|" + "---:|---:|" * len(BATCHES))
    for family, res in results.items():
        if "error" in res:
            print(f"| {family} | failed |")
            continue
        cells = []
        for b in BATCHES:
            ms = res[str(b)]["ms_per_step"] if str(b) in res else res[b]["ms_per_step"]
            ref = base.get(str(b), base.get(b, {})).get("ms_per_step")
            cells.append(f"{ms:.1f} | {ms / ref:.2f}x" if ref else f"{ms:.1f} | -")
        print(f"| {family} | " + " | ".join(cells) + " |")
    print("(vs llama: the family's decode step over llama's; 1.30x is the budget)")
    write_result("family_decode", timestamp(), {
        "machine": machine_info(load_before, os.getloadavg()), "versions": versions(),
        "layers": args.layers, "results": results})


if __name__ == "__main__":
    main()
