"""Speed and memory of a mixture-of-experts model of Qwen3-30B-A3B's shape (fewer layers), the
figures of the MoE issue's acceptance points 3 and 5, in one run on one CPU:

1. **checkpoints**: :mod:`moe_checkpoint` writes (once; kept between runs) a random-weight
   model of Qwen3-30B-A3B's shape with ``--layers`` layers as a ``qwen3moe`` GGUF (Q4_K) and
   an mlx-community 4-bit folder holding the same weights, under ``--work-dir``;
2. **gguf**: ``serve.py compare`` on the GGUF, ``llama-server`` (the baseline) then ours, one
   server up at a time, at ``--concurrency`` (1 and 16): output tok/s, mean TTFT, mean TPOT;
   ours' worker ``memory_report`` after start-up (weights held, RSS) and its start-up log
   lines naming parameters or weights;
3. **mlx**: ours serving the MLX folder at concurrency 1 (decode rate = 1000 / mean TPOT),
   then mlx-lm's own generation on the same folder, greedy, ``--mlx-lm-tokens`` new tokens, our
   platform's BLAS preloaded as for every mlx-lm contender: ``python -m mlx_lm generate`` as the
   folder is (bfloat16 scales and norms) and the same model cast to float32 first (MLX's CPU
   quantized matmul is several times slower in bfloat16); each run's printed ``Generation: ...
   tokens-per-sec`` and peak RSS; the faster run is the reference.

Our server runs with ``--dtype float32`` (``--ours-dtype``): vLLM's ``auto`` reads the folder's
``bfloat16``, which our CPU mixture-of-experts path refuses.

A contender that does not start (ours before the MoE families land) is recorded with its log's
tail and the run goes on. Printed at the end: each figure, its ratio and the acceptance target
(ours / llama-server >= 1.0 at C=1 and >= 2.0 at C=16, TTFT ratio at C=16 <= 1.0, ours /
mlx-lm >= 3.0 at batch 1, weights held / GGUF file <= 1.1). Written:
``<results-dir>/moe-bench-<ts>.json`` (the CPU named, every figure, the compare runs' paths).

    .venv/bin/python benchmarks/serve.py moe                      # everything, 8 layers
    .venv/bin/python benchmarks/serve.py moe --parts gguf         # only against llama-server
    .venv/bin/python benchmarks/serve.py moe --work-dir /tmp/moe --keep-checkpoints
    .venv/bin/python benchmarks/serve.py moe --ours ours:/path/to/src   # another checkout
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import harness  # noqa: E402
import moe_checkpoint  # noqa: E402

PARTS = ("gguf", "mlx")
#: start-up log lines kept in the result: parameter counts, weight bytes, the model load
LOG_GREP = (r"(?i)parameters|params|GGUF weights|weights held|Loaded |expert|file size|"
            r"model size|buffer size|refus|not supported")
GENERATION_RE = re.compile(r"Generation: (?P<tokens>\d+) tokens, (?P<tps>[\d.]+) tokens-per-sec")
PROMPT_RE = re.compile(r"Prompt: (?P<tokens>\d+) tokens, (?P<tps>[\d.]+) tokens-per-sec")
PROMPT_TEXT = ("Mixture-of-experts models route every token to a few of many feed-forward "
               "experts, so only a small share of the weights is read per token. ")
#: (figure, target, True when higher is better) of the acceptance points
TARGETS = {"ours/llama-server tok/s at C=1": (1.0, True),
           "ours/llama-server tok/s at C=16": (2.0, True),
           "ours/llama-server mean TTFT at C=16": (1.0, False),
           "ours/mlx-lm decode tok/s at batch 1": (3.0, True),
           "ours weights held / GGUF file": (1.1, False)}


def compare_args(args: argparse.Namespace, model: Path, tokenizer: Path, contenders: list[str],
                 baseline: str, concurrency: list[int]) -> argparse.Namespace:
    """The ``serve.py compare`` arguments of one part."""
    import serve

    ap = argparse.ArgumentParser()
    serve.add_compare_args(ap)
    argv = ["--model", str(model), "--tokenizer", str(tokenizer), "--baseline", baseline,
            "--concurrency", *map(str, concurrency), "--rounds", str(args.rounds),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--results-dir", str(args.results_dir), "--startup-timeout",
            str(args.startup_timeout), "--sequential", "--keep-going", "--memory-report",
            "--log-grep", LOG_GREP, "--max-rss-gib", str(args.max_rss_gib)]
    for c in contenders:
        argv += ["--contender", c]
    if args.num_prompts:
        argv += ["--num-prompts", str(args.num_prompts)]
    if args.llama_server:
        argv += ["--llama-server", str(args.llama_server)]
    ours_args = f"--dtype {args.ours_dtype} {args.ours_args}".strip()
    argv += ["--server-args", f"{ours_name(args)}={ours_args}"]
    return ap.parse_args(argv)


def ours_name(args: argparse.Namespace) -> str:
    return args.ours.partition(":")[0]


def level(result: dict, conc: int, name: str) -> dict | None:
    """The summary of contender ``name`` at concurrency ``conc`` (None when it did not run)."""
    entry = result.get("levels", {}).get(str(conc))
    return None if entry is None else entry["summary"].get(name)


#: mlx-lm's own generation with every floating weight (scales and biases included) cast to
#: float32 first: MLX's CPU quantized matmul is several times slower in bfloat16
FLOAT32_GENERATE = """
import sys
import mlx.core as mx
from mlx_lm import generate, load
model, tokenizer = load(sys.argv[1])
model.set_dtype(mx.float32)
generate(model, tokenizer, sys.argv[2], max_tokens=int(sys.argv[3]), verbose=True)
"""


def mlx_lm_generate(model: Path, prompt_tokens: int, max_tokens: int, log: Path,
                    dtype: str, max_rss: int | None = None, timeout_s: float = 1200.0) -> dict:
    """mlx-lm's own generation on ``model``: greedy, a prompt of about ``prompt_tokens``
    tokens, ``max_tokens`` new ones; ``dtype`` "folder" runs ``python -m mlx_lm generate``
    as it is (the folder's 16-bit dtype), "float32" casts the loaded model to float32 first.
    Returns its printed prompt / generation rates and token counts and its process's peak RSS
    (MiB); ``error`` instead when it failed (or was killed above ``max_rss`` bytes or after
    ``timeout_s`` seconds)."""
    words = PROMPT_TEXT.split()
    prompt = " ".join(words[i % len(words)] for i in range(int(prompt_tokens * 0.75)))
    if dtype == "folder":
        cmd = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt",
               prompt, "--max-tokens", str(max_tokens), "--temp", "0",
               "--ignore-chat-template"]
        shown = cmd[:7] + ["<prompt>"] + cmd[8:]
    else:
        cmd = [sys.executable, "-c", FLOAT32_GENERATE, str(model), prompt, str(max_tokens)]
        shown = [*cmd[:2], "<float32 generate>", str(model), "<prompt>", str(max_tokens)]
    env = dict(os.environ)
    blas = harness.platform_blas()
    if blas is not None:  # as for every mlx-lm contender: engine meets engine, not BLAS
        env["LD_PRELOAD"] = ":".join(x for x in (str(blas), env.get("LD_PRELOAD")) if x)
    print(f"== mlx-lm generate ({dtype}) on {model}, {max_tokens} tokens\n   log: {log}",
          flush=True)
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        rss = harness.RssSampler(proc.pid, max_rss)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            rss.stop()
            harness.kill_group(proc, grace_s=2)
    text = log.read_text(errors="replace")
    out: dict = {"dtype": dtype, "cmd": shown, "blas": str(blas) if blas else None,
                 "wall_s": time.perf_counter() - t0, "peak_rss_mib": rss.peak / 2**20,
                 "log": str(log)}
    gen, pro = GENERATION_RE.search(text), PROMPT_RE.search(text)
    if rss.exceeded is not None:
        out["error"] = f"killed: RSS {rss.exceeded / 2**30:.1f} GiB above the limit"
    elif rc is None:
        out["error"] = f"killed after {timeout_s:.0f} s"
    elif rc != 0 or gen is None:
        out["error"] = f"exit {rc}: {harness.log_tail(log, 15)}"
        return out
    out |= {"generation_tokens": int(gen["tokens"]), "generation_tps": float(gen["tps"])}
    if pro is not None:
        out |= {"prompt_tokens": int(pro["tokens"]), "prompt_tps": float(pro["tps"])}
    print(f"   {out['generation_tps']:.3f} tok/s ({out['generation_tokens']} tokens)",
          flush=True)
    return out


def figures(gguf_run: dict | None, mlx_run: dict | None, mlx_lm: list[dict] | None,
            ours: str, gguf_bytes: int) -> dict[str, float | None]:
    """The acceptance figures (ratios) from the parts that ran (None where one is missing);
    mlx-lm's reference is the faster of its runs (``mlx_lm``)."""
    def ratio(conc: int, key: str) -> float | None:
        entry = level(gguf_run, conc, ours) if gguf_run else None
        return None if entry is None else entry.get(f"{key}_ratio")

    out: dict[str, float | None] = {
        "ours/llama-server tok/s at C=1": ratio(1, "output_throughput"),
        "ours/llama-server tok/s at C=16": ratio(16, "output_throughput"),
        "ours/llama-server mean TTFT at C=16": ratio(16, "mean_ttft_ms")}
    entry = level(mlx_run, 1, ours) if mlx_run else None
    decode = 1000.0 / entry["mean_tpot_ms"] if entry and entry.get("mean_tpot_ms") else None
    rates = [r["generation_tps"] for r in (mlx_lm or []) if "generation_tps" in r]
    ref = max(rates) if rates else None  # the faster of mlx-lm's runs
    out["ours/mlx-lm decode tok/s at batch 1"] = decode / ref if decode and ref else None
    report = ((gguf_run or {}).get("contenders", {}).get(ours, {}).get("memory_report"))
    held = weights_held(report) if report else None
    out["ours weights held / GGUF file"] = held / gguf_bytes if held else None
    return out


def weights_held(report: dict) -> int:
    """Bytes of model weights a worker's ``memory_report`` says it holds (all parts)."""
    return sum(v for k, v in report.items() if k.startswith("weights_") and k.endswith("_bytes"))


def verdict(name: str, value: float | None) -> str:
    if value is None:
        return "not measured"
    target, higher = TARGETS[name]
    ok = value >= target if higher else value <= target
    return f"{'met' if ok else 'NOT met'} ({'>=' if higher else '<='} {target})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, model=False)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/moebench-ckpt"),
                    help="where the checkpoints are written (about 6.3 GB for 8 layers; "
                         "default /tmp/moebench-ckpt)")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep the checkpoints after the run (default: deleted at the end)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gguf-type", choices=moe_checkpoint.GGUF_TYPES, default="q4_k")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--ours", default="ours", metavar="NAME[:SRC]",
                    help="our contender as serve.py compare names it (e.g. ours:/path/to/src)")
    ap.add_argument("--ours-args", default="", metavar="ARGS",
                    help="extra arguments of our server, e.g. '--max-num-seqs 16'")
    ap.add_argument("--ours-dtype", default="float32",
                    help="our server's --dtype (default float32: vLLM's auto reads the "
                         "folder's bfloat16, which our CPU MoE path refuses)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mlx-lm-tokens", type=int, default=8,
                    help="tokens mlx-lm generates (default 8: its bfloat16 run is slow)")
    ap.add_argument("--mlx-lm-prompt", type=int, default=32,
                    help="prompt tokens of mlx-lm's runs, about (default 32: its prefill is slow "
                         "and the decode rate hardly depends on it)")
    ap.add_argument("--mlx-lm-timeout", type=float, default=1200.0,
                    help="seconds an mlx-lm run may take before it is killed")
    ap.add_argument("--mlx-lm-dtypes", nargs="+", choices=("folder", "float32"),
                    default=["folder", "float32"],
                    help="mlx-lm runs: the folder's dtype as it is, cast to float32")
    ap.add_argument("--max-rss-gib", type=float, default=8.0,
                    help="a server or mlx-lm run whose process tree's RSS exceeds this is "
                         "killed and recorded as failed (default 8 GiB: the model is ~3)")
    ap.add_argument("--llama-server", type=Path, default=None, metavar="PATH")
    args = ap.parse_args(argv)
    import serve

    ours = ours_name(args)
    shape = moe_checkpoint.MoeShape(layers=args.layers)
    total, active = shape.parameters()
    load_before = os.getloadavg()
    ts = harness.timestamp()
    gguf, mlx_dir = moe_checkpoint.write_checkpoints(args.work_dir, shape,
                                                     gguf_type=args.gguf_type)
    result: dict = {
        "shape": asdict(shape) | {"total_parameters": total, "active_parameters": active},
        "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "mlx_dir": str(mlx_dir),
        "mlx_bytes": moe_checkpoint.dir_bytes(mlx_dir), "gguf_type": args.gguf_type,
        "versions": harness.versions(), "parts": {}}
    gguf_run = mlx_run = mlx_lm = None
    try:
        if "gguf" in args.parts:
            gguf_run = serve.run_compare(compare_args(
                args, gguf, mlx_dir, ["llama-server", args.ours], "llama-server",
                args.concurrency))
            result["parts"]["gguf"] = gguf_run
        if "mlx" in args.parts:
            mlx_run = serve.run_compare(compare_args(args, mlx_dir, mlx_dir, [args.ours], ours,
                                                     [1]))
            result["parts"]["mlx"] = mlx_run
            mlx_lm = result["parts"]["mlx_lm_generate"] = []
            for dtype in args.mlx_lm_dtypes:
                log = args.results_dir / f"moe-bench-{ts}-mlx-lm-{dtype}.log"
                mlx_lm.append(mlx_lm_generate(mlx_dir, args.mlx_lm_prompt, args.mlx_lm_tokens,
                                              log, dtype, int(args.max_rss_gib * 2**30),
                                              args.mlx_lm_timeout))
    finally:
        result["figures"] = figures(gguf_run, mlx_run, mlx_lm, ours, result["gguf_bytes"])
        result["machine"] = harness.machine_info(load_before, os.getloadavg())
        path = harness.write_result("moe-bench", ts, result, args.results_dir)
        if not args.keep_checkpoints:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    print_report(result, ours)
    print(f"result: {path}")
    return 0


def print_report(result: dict, ours: str) -> None:
    """The run's figures as text: the CPU, each part's numbers, the ratios and targets."""
    m = result["machine"]
    print(f"\nMoE benchmark on {m.get('cpu_model')} ({m['cpus']} CPUs, load "
          f"{m['loadavg_before'][0]:.1f} -> {m['loadavg_after'][0]:.1f}); "
          f"{result['shape']['layers']} layers, {result['shape']['total_parameters'] / 1e9:.2f}B "
          f"parameters ({result['shape']['active_parameters'] / 1e9:.2f}B active); GGUF "
          f"{result['gguf_bytes'] / 2**30:.2f} GiB ({result['gguf_type']}), MLX folder "
          f"{result['mlx_bytes'] / 2**30:.2f} GiB")
    for part, run in result["parts"].items():
        if part == "mlx_lm_generate":
            for r in run:
                if "error" in r:
                    print(f"mlx-lm generate ({r['dtype']}) failed: {r['error']}")
                else:
                    print(f"mlx-lm generate ({r['dtype']}): {r['generation_tps']:.3f} tok/s "
                          f"decode ({r['generation_tokens']} tokens), prompt "
                          f"{r.get('prompt_tps', 0):.1f} tok/s, peak RSS "
                          f"{r['peak_rss_mib']:.0f} MiB")
            continue
        for name, c in run["contenders"].items():
            if "start_error" in c:
                cause = f"\n  cause: {c['start_cause']}" if c.get("start_cause") else ""
                print(f"[{part}] {name} did not start: {c['start_error']}{cause}")
                continue
            mem = ""
            if rep := c.get("memory_report"):
                held = weights_held(rep) / 2**30
                mem = (f", weights held {held:.2f} GiB, RSS after load "
                       f"{rep['rss_after_load'] / 2**30:.2f} GiB")
            print(f"[{part}] {name}: up in {c['startup_s']:.0f} s, RSS at start "
                  f"{c['startup_rss_mib'] / 1024:.2f} GiB{mem}")
            for line in c.get("log_lines", [])[:8]:
                print(f"    log: {line.strip()[:160]}")
        for conc, entry in run["levels"].items():
            print(f"[{part}] concurrency {conc}:\n{entry['table']}")
    print("\nacceptance figures:")
    for name, value in result["figures"].items():
        shown = "-" if value is None else f"{value:.3f}"
        print(f"  {name}: {shown}  {verdict(name, value)}")


if __name__ == "__main__":
    sys.exit(main())
