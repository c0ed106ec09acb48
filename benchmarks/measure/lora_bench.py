"""LoRA serving speed, the figures of the LoRA issue's acceptance point 4, in one run on one
CPU:

1. **adapters**: ``--adapters`` random rank-``--rank`` PEFT adapters on every attention and
   MLP projection of the model (shapes from its fp32 export), and the first one in mlx-lm's
   format (``tests/tiny_models.py``), under ``--work-dir``;
2. **multi**: ours, ``vllm serve GGUF --enable-lora --max-loras N --lora-modules ...`` (the
   GGUF kept quantized), one server; ``vllm bench serve`` at ``--concurrency`` (16) with the
   requests naming the adapters in turn (``--lora-assignment round-robin``), and the same load
   on the base model, alternating order over ``--rounds``: output tok/s, mean TTFT and TPOT,
   and adapters / base;
3. **mlx-lm**: at concurrency 1, ours under the first adapter against ``mlx_lm.server
   --adapter-path`` (the fp32 export and the same adapter in mlx-lm's format, our platform's
   BLAS preloaded as for every mlx-lm contender), one server up at a time.

Printed: each figure, its ratio and the target (adapters / base >= 0.7 at C=16, ours / mlx-lm
>= 1.5 at C=1). Written: ``<results-dir>/lora-bench-<ts>.json``.

    .venv/bin/python benchmarks/serve.py lora
    .venv/bin/python benchmarks/serve.py lora --parts multi --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "tests")]
import harness  # noqa: E402
import serve  # noqa: E402
from tiny_models import make_peft_adapter, peft_to_mlx_lm  # noqa: E402

PARTS = ("multi", "mlx-lm")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEYS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "completed", "failed")


def write_adapters(fp32: Path, work: Path, count: int, rank: int) -> list[Path]:
    """``count`` random PEFT adapters for the checkpoint at ``fp32`` (written once, kept)."""
    return [make_peft_adapter(work / f"lora{i}", fp32, rank=rank, alpha=2 * rank,
                              targets=PROJECTIONS, seed=i, std=0.02)
            if not (work / f"lora{i}" / "adapter_config.json").is_file() else work / f"lora{i}"
            for i in range(count)]


def measure(server: harness.Running, tokenizer: Path, args, out: Path, tag: str, conc: int,
            seed: int, lora: list[str] | None) -> dict:
    r = serve.run_once(server, tokenizer, args, conc, args.num_prompts if conc > 1 else 8,
                       out, tag, seed, lora_modules=lora)
    print(f"   {tag}: {r['output_throughput']:.1f} tok/s, TTFT {r['mean_ttft_ms']:.0f} ms, "
          f"TPOT {r['mean_tpot_ms']:.1f} ms ({r['completed']} done, {r['failed']} failed)",
          flush=True)
    return {k: r.get(k) for k in KEYS}


def multi(args, opts: harness.ServerOptions, adapters: list[Path], tokenizer: Path,
          out: Path) -> dict:
    names = [f"lora{i}" for i in range(len(adapters))]
    extra = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank",
             str(args.rank), "--lora-modules", *[f"{n}={p}" for n, p in zip(names, adapters,
                                                                             strict=True)]]
    spec = harness.server_spec("ours", "ours", opts, extra)
    runs: dict[str, list[dict]] = {"adapters": [], "base": []}
    with harness.running(spec, out / "ours-multi.log", args.startup_timeout) as server:
        for rnd in range(args.rounds):
            order = ("adapters", "base") if rnd % 2 == 0 else ("base", "adapters")
            for which in order:
                runs[which].append(measure(server, tokenizer, args, out, f"{which}-r{rnd}",
                                           args.concurrency, args.seed + rnd,
                                           names if which == "adapters" else None))
    ratios = [a["output_throughput"] / b["output_throughput"]
              for a, b in zip(runs["adapters"], runs["base"], strict=True)]
    return {"runs": runs, "adapters_over_base": sorted(ratios)[len(ratios) // 2]}


def versus_mlx_lm(args, opts: harness.ServerOptions, adapter: Path, mlx_adapter: Path,
                  tokenizer: Path, out: Path) -> dict:
    extra = ["--enable-lora", "--max-lora-rank", str(args.rank), "--lora-modules",
             f"lora0={adapter}"]
    result = {}
    with harness.running(harness.server_spec("ours", "ours", opts, extra),
                         out / "ours-c1.log", args.startup_timeout) as server:
        result["ours"] = measure(server, tokenizer, args, out, "ours-c1", 1, args.seed, ["lora0"])
    spec = harness.server_spec("mlx-lm", "mlx-lm", opts, ["--adapter-path", str(mlx_adapter)])
    with harness.running(spec, out / "mlx-lm-c1.log", args.startup_timeout) as server:
        result["mlx-lm"] = measure(server, tokenizer, args, out, "mlx-lm-c1", 1, args.seed,
                                   None)
    result["ours_over_mlx_lm"] = (result["ours"]["output_throughput"]
                                  / result["mlx-lm"]["output_throughput"])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64, help="per run at --concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", type=Path,
                    default=Path.home() / ".cache" / "vllm-unified" / "lora-bench")
    args = ap.parse_args(argv)
    gguf = args.model or harness.default_gguf()
    fp32, tokenizer = harness.fp32_dir(gguf), harness.served_dir(gguf)
    adapters = write_adapters(fp32, args.work_dir, args.adapters, args.rank)
    layers = int(json.loads((fp32 / "config.json").read_text())["num_hidden_layers"])
    mlx_adapter = peft_to_mlx_lm(adapters[0], args.work_dir / "lora0-mlx-lm", layers)
    opts = harness.ServerOptions(gguf=gguf, max_model_len=args.input_len + args.output_len + 64)
    ts = harness.timestamp()
    out = args.results_dir / f"lora-bench-{ts}"
    out.mkdir(parents=True, exist_ok=True)
    cpu = harness.cpu_info()
    flags = ", ".join(cpu.get("cpu_flags", []))
    print(f"CPU: {cpu.get('cpu_model')} ({flags}); model {gguf.name}; {args.adapters} "
          f"adapters of rank {args.rank}", flush=True)
    result: dict = {"cpu": cpu, "model": str(gguf), "args": {k: str(v) for k, v in
                                                             vars(args).items()}}
    if "multi" in args.parts:
        result["multi"] = multi(args, opts, adapters, tokenizer, out)
    if "mlx-lm" in args.parts:
        result["mlx_lm"] = versus_mlx_lm(args, opts, adapters[0], mlx_adapter, tokenizer, out)
    path = harness.write_result("lora-bench", ts, result, args.results_dir)
    print(f"\nCPU: {cpu.get('cpu_model')}")
    if "multi" in result:
        print(f"C={args.concurrency}, {args.adapters} adapters / base model, output tok/s: "
              f"{result['multi']['adapters_over_base']:.2f}x (target >= 0.7)")
    if "mlx_lm" in result:
        print(f"C=1, ours / mlx_lm.server --adapter-path, output tok/s: "
              f"{result['mlx_lm']['ours_over_mlx_lm']:.2f}x (target >= 1.5)")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
