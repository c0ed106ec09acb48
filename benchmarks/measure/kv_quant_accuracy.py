"""Accuracy of the quantized KV formats: perplexity on real English text and greedy outputs,
each ``--kv-cache-dtype`` against the unquantized cache (the model dtype, fp32 here).

* **Text**: the topics of Python's own documentation that ship with every CPython
  (the stdlib package ``pydoc_data``, ``pydoc_data.topics.topics``, the values in key order,
  joined by blank lines), tokenized by the model's tokenizer; the first
  ``--windows x --window`` tokens (default 20 x 1,024 = 20,480) cut into windows, each scored
  as its own prompt with vLLM's ``prompt_logprobs=0`` (the logprob of every prompt token but
  the first). Perplexity = exp(mean negative logprob) over all scored tokens. Every prompt
  token attends over the quantized pages (the paged attention reads the pool for prefill rows
  too), so the figure carries the cache's error; except ``turboquant_k8v4``, which attends a
  prefill chunk that starts its sequence or is longer than 128 tokens over its own
  unquantized K/V, as vLLM's TurboQuant backend does: its figure carries the cache's error
  only where windows are split into short chunks; ``--max-num-batched-tokens 128`` makes every
  chunk after a window's first 128 tokens read the quantized pages.
* **Greedy**: the 8 prompts of :data:`PROMPTS`, 32 tokens each, temperature 0.

``--skip-layers 0,1`` keeps those layers in the model dtype (vLLM's
``--kv-cache-dtype-skip-layers``) in every quantized run; several sets run each format once per
set (``none``: no skip layers), e.g. ``--skip-layers none 0,1 0,1,22,23``. Rows are keyed
``FORMAT`` or ``FORMAT-skip0.1``.

Targets (issue 18): perplexity rises by at most 1% with ``int8_per_token_head`` and 5% with
``int4_per_token_head`` and ``turboquant_k8v4``; int8's greedy tokens equal the unquantized
cache's for all 32 tokens of every prompt. Each (model, format) is its own engine process.
Prints a table, exits 1 when a target is missed, writes
``benchmarks/results/kv_quant_accuracy-<ts>.json``.

    .venv/bin/python benchmarks/kernels.py kv-quant-accuracy           # SmolLM2 (~2 min, 2 cores)
    .venv/bin/python benchmarks/kernels.py kv-quant-accuracy --qwen-gguf PATH  # and Qwen
    .venv/bin/python benchmarks/kernels.py kv-quant-accuracy --formats auto turboquant_k8v4
    .venv/bin/python benchmarks/kernels.py kv-quant-accuracy --qwen-gguf PATH --models qwen \
        --formats int8_per_token_head int4_per_token_head --skip-layers 0,1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from harness import run_child, versions, write_result  # noqa: E402
from real_models import models  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FORMATS = ("auto", "int8_per_token_head", "int4_per_token_head", "fp8_per_token_head",
           "turboquant_k8v4")
PPL_TARGETS = {"int8_per_token_head": 0.01, "int4_per_token_head": 0.05,
               "turboquant_k8v4": 0.05}
GREEDY_EXACT = ("int8_per_token_head",)
GREEDY_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "The largest planet is",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "Translate to French: The weather is nice today.",
]


def english_text() -> str:
    """Python's documentation topics (stdlib ``pydoc_data.topics``), key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def child(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    spec = json.loads(Path(spec_path).read_text())
    window, windows = spec["window"], spec["windows"]
    extra = {}
    if spec.get("max_num_batched_tokens"):
        extra["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("skip_layers"):
        extra["kv_cache_dtype_skip_layers"] = spec["skip_layers"]
    llm = LLM(model=str(prepare_gguf_dir(Path(spec["gguf"]))), dtype="float32",
              kv_cache_dtype=spec["format"], max_model_len=max(2048, window + 64),
              kv_cache_memory_bytes=1 << 30, seed=0, **extra)
    ids = llm.get_tokenizer().encode(english_text(), add_special_tokens=False)
    if len(ids) < window * windows:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {window * windows}")
    prompts = [{"prompt_token_ids": ids[i * window:(i + 1) * window]} for i in range(windows)]
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                  temperature=0), use_tqdm=False)
    nll, n = 0.0, 0
    for res, prompt in zip(scored, prompts, strict=True):
        for tok, step in zip(prompt["prompt_token_ids"][1:], res.prompt_logprobs[1:],
                             strict=True):
            nll -= step[tok].logprob
            n += 1
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS,
                                                  ignore_eos=True), use_tqdm=False)
    Path(out_path).write_text(json.dumps({
        "scored_tokens": n, "nll": nll, "ppl": math.exp(nll / n),
        "greedy": [list(r.outputs[0].token_ids) for r in greedy],
        "greedy_text": [r.outputs[0].text for r in greedy]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qwen-gguf", help="also Qwen2.5-Coder-0.5B-Instruct q4_k_m (GGUF path)")
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS),
                    help="formats to run (auto, the baseline, is always run)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM's step budget (default: vLLM's); 128 makes turboquant_k8v4's "
                         "prefill chunks after the first read the quantized pages")
    ap.add_argument("--skip-layers", nargs="+", default=["none"], metavar="LAYERS",
                    help="layer indices kept in the model dtype, comma-separated "
                         "(--kv-cache-dtype-skip-layers), one set per run of each quantized "
                         "format; 'none' for none (default)")
    ap.add_argument("--models", nargs="+", choices=("smollm2", "qwen"),
                    default=["smollm2", "qwen"],
                    help="which of the available models to run (qwen needs its GGUF)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    ts = datetime.now().strftime("%Y%m%d-%H%M%S")
    env = dict(os.environ, PYTHONHASHSEED="0")
    skip_sets = [[] if s == "none" else s.split(",") for s in args.skip_layers]
    results: dict = {"versions": versions(), "text": "pydoc_data.topics (CPython stdlib)",
                     "window": args.window, "windows": args.windows,
                     "max_num_batched_tokens": args.max_num_batched_tokens,
                     "skip_layers": skip_sets, "models": {}}
    ok = True
    found = {n: g for n, g in models(args.qwen_gguf).items()
             if n.lower().startswith(tuple(args.models))}
    for name, gguf in found.items():
        rows, formats = {}, {}
        for fmt in dict.fromkeys(["auto", *args.formats]):
            for skip in ([[]] if fmt == "auto" else skip_sets):
                formats[fmt + (f"-skip{'.'.join(skip)}" if skip else "")] = (fmt, skip)
        for label, (fmt, skip) in formats.items():
            rows[label] = run_child(__file__, f"kv_quant_accuracy-{ts}-{name}-{label}",
                                    {"gguf": str(gguf), "format": fmt, "window": args.window,
                                     "windows": args.windows, "skip_layers": skip,
                                     "max_num_batched_tokens": args.max_num_batched_tokens},
                                    env, 1800, "KV format")
            print(f"  ({name} {label}: ppl {rows[label]['ppl']:.4f})", flush=True)
        base = rows["auto"]
        print(f"{name}: {base['scored_tokens']:,} tokens scored")
        for label, row in rows.items():
            fmt = formats[label][0]
            rise = row["ppl"] / base["ppl"] - 1
            same = [a == b for a, b in zip(row["greedy"], base["greedy"], strict=True)]
            first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y),
                               None) for a, b in zip(row["greedy"], base["greedy"], strict=True)]
            row.update(ppl_rise=rise, greedy_identical=sum(same), first_divergence=first_diff)
            target = PPL_TARGETS.get(fmt)
            ppl_ok = target is None or rise <= target
            greedy_ok = fmt not in GREEDY_EXACT or all(same)
            ok &= ppl_ok and greedy_ok
            print(f"  {label:30s} ppl {row['ppl']:8.4f} ({rise:+.2%}"
                  f"{'' if target is None else f', target <= +{target:.0%}'}"
                  f"{'' if ppl_ok else ' MISSED'}); greedy identical {sum(same)}/8 x "
                  f"{GREEDY_TOKENS} tokens{'' if greedy_ok else ' MISSED'}; first divergence "
                  f"{first_diff}")
        results["models"][name] = rows
    write_result("kv_quant_accuracy", ts, results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
