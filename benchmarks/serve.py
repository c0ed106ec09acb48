"""Serving benchmarks through the OpenAI API of a running server.

Subcommands:

* ``compare`` (the default): throughput and latency of contenders on the same model and
  machine, the load driven by vLLM's own client, ``vllm bench serve``;
* ``prefill``: prompt tokens per second of the same contenders, one long prompt at a time
  (compare's machinery, see below);
* ``soak``: mixed traffic with response checks and memory / fd drift (``measure/soak.py``);
* ``prefix-cache``: the soak served with the bounded prefix cache and with vLLM's order
  (``measure/prefix_cache_bound.py``);
* ``fuzz``: thousands of generated requests against every endpoint (``measure/fuzz_api.py``);
* ``moe``: a Qwen3-30B-A3B-shaped mixture-of-experts model (random weights, fewer layers) as a
  GGUF against ``llama-server`` and as an mlx-community folder against mlx-lm's own
  generation, with our weights' memory (``measure/moe_bench.py``);
* ``lora``: LoRA serving, requests spread over several adapters against the base model on the
  same server, and one adapter against ``mlx_lm.server --adapter-path`` (``measure/lora_bench.py``).

``compare``: each ``--contender NAME[:SRC]`` is a server whose kind is the longest of
:data:`harness.SERVER_KINDS` that NAME equals or starts with followed by ``-`` (``ours``,
``ours-new``, ``vllm-cpu``, ``mlx-lm``, ``llama-server``); ``SRC`` (ours only) is a ``src/``
folder put first on the server's ``PYTHONPATH``, so that two checkouts of this project meet in
one run (the Python package only: the venv, vLLM and the native extension
``vllm_unified_native`` are the installed ones for every contender). All servers are started
first (one at a time) and stay up; then for each concurrency level and each of ``--rounds``
rounds every contender gets the same load in turn, the order reversed every other round and
level, so that the machine's drift hits them alike (idle servers wait on their sockets
meanwhile). The load per run is ``vllm bench serve --dataset-name random`` (``--input-len``
random tokens, ``--output-len`` output tokens with EOS ignored, temperature 0, ``--num-prompts``
at most C in flight, the same prompts for every contender of a round, new ones each round and
level, so that no run reads prompts a server's prefix cache kept), preceded by C
warm-up requests. ``--sequential`` starts one server at a time instead (each runs every level
and stops: for a model too large to hold twice), ``--keep-going`` records a server that does
not start and goes on, ``--memory-report`` reads our worker's memory report after start-up.
Printed per level: output tok/s, mean TTFT, mean TPOT and peak RSS of the server's process
tree, each with its ratio to ``--baseline`` (the median over rounds of the per-round ratio).
Written: ``<results-dir>/serve-compare-<ts>.json``, a log per server and ``vllm bench serve``'s
own result file per run under ``<results-dir>/serve-compare-<ts>/``.

``--isa {native,avx512,avx2}`` holds ours and llama-server to one instruction set, so that one
machine measures the paths of CPUs that lack some of its sets: ours gets
``VLLM_UNIFIED_CPU_ISA`` (under avx2 also ``OPENBLAS_CORETYPE=Haswell``,
``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2``: no AVX-512 anywhere in the
server; ``native`` clears them all), llama-server the binary that
``scripts/build_llama_server.sh --isa ISA`` built. The output opens (and ends) with the CPU
model, the ISA and each server's settings or build flags; the result JSON holds them
(``cpu_model``, ``isa``, ``header``, ``contenders.<name>.isa``). ``--max-model-len`` (default
2048) is ours' limit and each llama-server slot's context.

    .venv/bin/python benchmarks/serve.py                     # ours, vllm-cpu, mlx-lm; C = 1 4 16
    .venv/bin/python benchmarks/serve.py --contender ours --contender llama-server
    .venv/bin/python benchmarks/serve.py --contender ours:/path/to/old/src \
        --contender ours-new --concurrency 16 --num-prompts 128 --rounds 5  # before vs after
    .venv/bin/python benchmarks/serve.py --contender ours --contender ours-pp2 \
        --server-args "ours-pp2=--pipeline-parallel-size 2"              # a pipeline stage
    .venv/bin/python benchmarks/serve.py --contender ours --contender llama-server --isa avx2
    .venv/bin/python benchmarks/serve.py prefill --contender ours --contender llama-server

Why each contender speaks to ``vllm bench serve`` as it does:

* every contender is given ``--tokenizer`` = the folder vLLM serves for the GGUF
  (:func:`harness.served_dir`): ``vllm bench serve`` cannot read a tokenizer from a GGUF, and
  one tokenizer makes the prompts and the token counts the same for all;
* ``mlx-lm`` has no ``ignore_eos``: it gets ``logit_bias`` -1e9 on the EOS ids through
  ``--extra-body``, and ``logprobs: false`` (the client sends ``null``, which mlx_lm.server
  refuses), and names the model ``default_model`` (mlx_lm.server loads any other name as a
  new model); it reads no GGUF, so it serves the fp32 export, as vLLM's CPU backend does;
* ``llama-server`` serves ``/v1/completions`` in the OpenAI format; where its stream carries no
  ``usage``, ``vllm bench serve`` counts the streamed text's tokens with the tokenizer;
* ``vllm bench serve`` runs as ``measure/bench_client.py`` (vLLM's own ``main``), which drops
  SSE comment events before vLLM's parser reads the stream: mlx_lm.server sends
  ``: keepalive`` comments while it processes a prompt, and vLLM's parser, which strips each
  socket read before parsing, glues every later event to such a comment (first token only at
  the end, or a failed request). All contenders go through the same client.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "measure")]

import harness  # noqa: E402

#: Our runner logs its step profile every this many steps of a kind.
PROFILE_EVERY = 10
PROFILE_RE = re.compile(
    r"step profile decode: (?P<steps>\d+) steps, (?P<reqs>[\d.]+) req/step, [\d.]+ tokens/step, "
    r"mean ms prepare (?P<prepare>[\d.]+) graph (?P<graph>[\d.]+) eval (?P<eval>[\d.]+) "
    r"output (?P<output>[\d.]+) total (?P<total>[\d.]+)"
)
DEFAULT_CONTENDERS = ("ours", "vllm-cpu", "mlx-lm")
SERVED_NAME = "model"
METRICS = (("output_throughput", "tok/s"), ("mean_ttft_ms", "TTFT ms"),
           ("mean_tpot_ms", "TPOT ms"), ("peak_rss_mib", "RSS MiB"))
PREFILL_METRICS = (("prompt_throughput", "prompt tok/s"), ("mean_ttft_ms", "TTFT ms"),
                   ("peak_rss_mib", "RSS MiB"))
#: Tokens of max-model-len above prompt + output in ``prefill``: room for a prompt that the
#: load client's re-tokenization makes a little longer.
PREFILL_MARGIN = 64


@dataclass(frozen=True)
class Level:
    """One load of a comparison: ``num_prompts`` prompts of ``input_len`` tokens, at most
    ``conc`` in flight; ``key`` names it in the result's ``levels``."""

    key: str
    conc: int
    input_len: int
    num_prompts: int
    title: str


def parse_contender(text: str) -> tuple[str, str, Path | None]:
    """``NAME[:SRC]`` -> (name, server kind, resolved SRC or None). SystemExit when NAME names
    no kind or SRC holds no ``vllm_unified`` package."""
    name, _, src = text.partition(":")
    kinds = [k for k in harness.SERVER_KINDS if name == k or name.startswith(k + "-")]
    if not kinds:
        raise SystemExit(f"--contender {text}: the name must be one of "
                         f"{harness.SERVER_KINDS} or start with one of them and '-'")
    path = Path(src).expanduser().resolve() if src else None
    if path is not None and not (path / "vllm_unified" / "__init__.py").is_file():
        raise SystemExit(f"--contender {text}: {path} holds no vllm_unified package "
                         "(give the checkout's src/ folder)")
    return name, max(kinds, key=len), path


def bench_command(base_url: str, tokenizer: Path, spec: harness.ServerSpec, args, conc: int,
                  num_prompts: int, out_dir: Path, filename: str,
                  seed: int | None = None, input_len: int | None = None,
                  cold: bool = False, lora_modules: list[str] | None = None) -> list[str]:
    """``vllm bench serve`` for one run of ``num_prompts`` at concurrency ``conc``, through
    ``measure/bench_client.py`` (vLLM's client with SSE comments dropped, see there); ``seed``
    picks the prompts (default ``args.seed``), ``input_len`` their tokens (default
    ``args.input_len``). ``cold``: without the client's ready check and warm-up requests,
    which send the first prompt ahead of the run, so that a prefix cache (ours, llama-server's
    slots) would answer the first measured request from its cache. ``lora_modules``: the
    requests name these adapters instead of the model, in turn."""
    cmd = [sys.executable, str(harness.MEASURE / "bench_client.py"), "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", spec.served_name,
           "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(args.input_len if input_len is None else input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(conc), "--num-warmups", str(0 if cold else conc),
           "--temperature", "0", "--seed", str(args.seed if seed is None else seed),
           "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir",
           str(out_dir), "--result-filename", filename]
    if cold:
        cmd += ["--ready-check-timeout-sec", "0"]
    if lora_modules:
        cmd += ["--lora-modules", *lora_modules, "--lora-assignment", "round-robin"]
    if spec.ignore_eos:
        cmd.append("--ignore-eos")
    if spec.request_fields:
        cmd += ["--extra-body", json.dumps(spec.request_fields)]
    return cmd


def decode_profile(log_text: str) -> dict[str, float] | None:
    """Mean decode-step phases (ms) over all profile lines in ``log_text``, weighted by steps."""
    lines = [m.groupdict() for m in PROFILE_RE.finditer(log_text)]
    steps = sum(int(m["steps"]) for m in lines)
    if not steps:
        return None
    keys = ("reqs", "prepare", "graph", "eval", "output", "total")
    return {k: sum(float(m[k]) * int(m["steps"]) for m in lines) / steps for k in keys} | {
        "steps": float(steps)}


def prompt_throughput(raw: dict) -> float | None:
    """Mean over the completed requests of ``vllm bench serve``'s detailed result ``raw`` of
    prompt tokens / TTFT (tokens per second; None when none completed)."""
    rates = [n / t for n, t, err in zip(raw.get("input_lens", []), raw.get("ttfts", []),
                                        raw.get("errors", []), strict=False)
             if not err and t and t > 0]
    return sum(rates) / len(rates) if rates else None


def run_once(server: harness.Running, tokenizer: Path, args, conc: int, num_prompts: int,
             out_dir: Path, tag: str, seed: int, input_len: int | None = None,
             cold: bool = False, lora_modules: list[str] | None = None) -> dict:
    """One ``vllm bench serve`` run against ``server`` (:func:`bench_command`): its result
    JSON's summary fields, ``prompt_throughput`` (:func:`prompt_throughput`), the server's peak
    RSS during the run and (ours) the decode-step profile from its log."""
    filename = f"{tag}.json"
    cmd = bench_command(server.base_url, tokenizer, server.spec, args, conc, num_prompts,
                        out_dir, filename, seed, input_len, cold, lora_modules)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    seen = len(server.log_path.read_text(errors="replace"))
    server.rss.take_peak()
    log = out_dir / f"{tag}.log"
    with open(log, "wb") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=out_dir)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed for {tag} (exit {done.returncode}):\n"
                           f"{shlex.join(cmd)}\n{harness.log_tail(log)}")
    raw = json.loads((out_dir / filename).read_text())
    keep = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
            "mean_e2el_ms", "p99_e2el_ms")
    result = {k: raw.get(k) for k in keep}
    result["prompt_throughput"] = prompt_throughput(raw)
    result["peak_rss_mib"] = server.rss.take_peak() / 2**20
    if server.spec.kind == "ours":
        result["decode_step_ms"] = decode_profile(
            server.log_path.read_text(errors="replace")[seen:])
    return result


def level_table(runs: dict[str, list[dict]], baseline: str,
                metrics: tuple[tuple[str, str], ...] = METRICS) -> tuple[str, dict]:
    """The table of one level and its summary (:func:`harness.median_ratios`)."""
    summary = harness.median_ratios(runs, baseline, [key for key, _ in metrics])
    return harness.ratio_table(summary, baseline, metrics), summary


def compare(args: argparse.Namespace, prefill: bool = False) -> int:
    """Run the comparison (:func:`run_compare`), print each failure; 1 if any request or
    server failed."""
    result = run_compare(args, prefill)
    for failure in result["failures"]:
        print(f"FAILED {failure}")
    return 1 if result["failures"] else 0


def compare_levels(args: argparse.Namespace) -> list[Level]:
    """``compare``'s loads: one per ``--concurrency``, ``--input-len`` tokens each."""
    return [Level(str(conc), conc, args.input_len, n, f"concurrency {conc}, {n} prompts x "
                  f"{args.rounds} round(s), {args.input_len} in / {args.output_len} out tokens")
            for conc in args.concurrency for n in [args.num_prompts or max(4 * conc, 8)]]


def prefill_levels(args: argparse.Namespace) -> list[Level]:
    """``prefill``'s loads: one per ``--prompt-lens``, one request at a time."""
    return [Level(str(length), 1, length, args.num_prompts, f"prompt {length} tokens, "
                  f"{args.num_prompts} prompts x {args.rounds} round(s), concurrency 1, "
                  f"{args.output_len} out token(s)") for length in args.prompt_lens]


def isa_header(specs: list[harness.ServerSpec], isa: str | None) -> list[str]:
    """The lines that open a comparison's output: the CPU model, the forced ISA and what holds
    each server to it (ours: its ISA variables; llama-server: binary and build flags)."""
    cpu = harness.cpu_info()
    flags = " ".join(cpu.get("cpu_flags", []))
    lines = [f"CPU: {cpu.get('cpu_model') or 'unknown'} (flags {flags})",
             f"ISA: {isa or 'not forced (native, as the environment says)'}"]
    for spec in specs:
        if spec.kind == "ours":
            held = {k: v for k, v in spec.isa.items() if k != "isa" and v is not None}
            lines.append(f"  {spec.name}: " + (" ".join(f"{k}={v}" for k, v in held.items())
                                               or "no ISA setting (every path the CPU has)"))
        elif spec.kind == "llama-server":
            flags = spec.isa.get("build_flags") or "not recorded (no build-flags.txt)"
            lines.append(f"  {spec.name}: {spec.isa['binary']}, built with: "
                         + " / ".join(flags.splitlines()))
        else:
            lines.append(f"  {spec.name}: not held to an ISA")
    return lines


def run_compare(args: argparse.Namespace, prefill: bool = False) -> dict:
    """The comparison ``args`` describe (:func:`add_compare_args`, or with ``prefill``
    :func:`add_prefill_args`: one load per prompt length, each measured without warm-up
    requests on its prompts after one discarded run); returns the result written to
    ``<results-dir>/serve-compare-<ts>.json`` (``serve-prefill-<ts>.json``; its path under
    ``result_path``)."""
    kind = "serve-prefill" if prefill else "serve-compare"
    metrics = PREFILL_METRICS if prefill else METRICS
    contenders = [parse_contender(c) for c in (args.contender or DEFAULT_CONTENDERS)]
    names = [n for n, _, _ in contenders]
    if len(set(names)) != len(names):
        raise SystemExit(f"--contender: names must differ, got {names}")
    baseline = args.baseline or names[0]
    if baseline not in names:
        raise SystemExit(f"--baseline {baseline} is not among the contenders {names}")
    extra = dict(parse_server_args(s) for s in args.server_args)
    if unknown := set(extra) - set(names):
        raise SystemExit(f"--server-args for unknown contenders {sorted(unknown)}")
    if args.isa is not None:
        harness.require_isa(args.isa)
    levels = prefill_levels(args) if prefill else compare_levels(args)
    max_model_len = args.max_model_len
    if prefill:
        needed = max(level.input_len for level in levels) + args.output_len + PREFILL_MARGIN
        max_model_len = max(max_model_len or 0, needed)
    model = (args.model or harness.default_gguf()).resolve()
    opts = harness.ServerOptions(model, SERVED_NAME, max_model_len=max_model_len or 2048,
                                 slots=max(level.conc for level in levels),
                                 llama_server=args.llama_server, step_profile=PROFILE_EVERY,
                                 dev_mode=args.memory_report, isa=args.isa)
    specs = [harness.server_spec(n, k, opts, extra.get(n, []), src) for n, k, src in contenders]
    for spec in specs:
        if spec.src is not None:
            found = harness.check_source(spec.src, spec.env)
            print(f"{spec.name}: vllm_unified from {found}")
    header = isa_header(specs, args.isa)
    print("\n".join(header), flush=True)
    tokenizer = args.tokenizer.resolve() if args.tokenizer else harness.served_dir(model)
    ts = harness.timestamp()
    out_dir = args.results_dir / f"{kind}-{ts}"
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    result: dict = {"model": str(model), "baseline": baseline, "output_len": args.output_len,
                    "rounds": args.rounds, "seed": args.seed, "tokenizer": str(tokenizer),
                    "sequential": args.sequential, "max_model_len": opts.max_model_len,
                    "isa": args.isa, "cpu_model": harness.cpu_info().get("cpu_model"),
                    "header": header, "versions": harness.versions(), "contenders": {},
                    "levels": {}, "failures": []}
    if prefill:
        result["prompt_lens"] = args.prompt_lens
    else:
        result["input_len"] = args.input_len
    runs: dict[str, dict[str, list[dict]]] = {level.key: {} for level in levels}

    def write() -> None:
        for level in levels:
            done = {name: runs[level.key][name] for name in names
                    if runs[level.key].get(name)}  # rows in --contender order
            if baseline in done:
                table, summary = level_table(done, baseline, metrics)
                result["levels"][level.key] = {
                    "concurrency": level.conc, "input_len": level.input_len,
                    "num_prompts": level.num_prompts, "summary": summary, "runs": done,
                    "table": table}
        result["machine"] = harness.machine_info(load_before, os.getloadavg())
        result["result_path"] = str(harness.write_result(kind, ts, result, args.results_dir))

    def one_run(server: harness.Running, index: int, level: Level, rnd: int) -> None:
        # fresh prompts each round and level (a server's prefix cache keeps the last ones),
        # the same for every contender of the round
        seed = args.seed + 1000 * index + rnd
        tag = f"{'p' if prefill else 'c'}{level.key}-r{rnd}-{server.spec.name}"
        if prefill and rnd == 0:  # first-use costs of this length out of the figure
            run_once(server, tokenizer, args, 1, 1, out_dir, f"warmup-{tag}",
                     args.seed + 10**6 + index, level.input_len)
        t0 = time.perf_counter()
        r = run_once(server, tokenizer, args, level.conc, level.num_prompts, out_dir, tag, seed,
                     level.input_len, cold=prefill)
        runs[level.key].setdefault(server.spec.name, []).append(r)
        n = level.num_prompts
        if r["failed"] or r["completed"] != n:
            result["failures"].append(
                f"{tag}: {r['completed']} of {n} requests completed (errors in "
                f"{out_dir / (tag + '.json')}, server log {server.log_path})")
            print(f"   FAILED {result['failures'][-1]}", flush=True)
        what = (f"{r['prompt_throughput'] or 0:.1f} prompt tok/s" if prefill else
                f"{r['output_throughput']:.1f} tok/s")
        tpot = "" if prefill else f", TPOT {r['mean_tpot_ms']:.1f} ms"
        print(f"   {'L' if prefill else 'C'}={level.key} round {rnd} {server.spec.name}: "
              f"{what}, TTFT {r['mean_ttft_ms']:.0f} ms{tpot} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)

    def start(stack: ExitStack, spec: harness.ServerSpec) -> harness.Running | None:
        entry = result["contenders"][spec.name] = {
            "kind": spec.kind, "description": spec.description, "cmd": spec.cmd,
            "src": str(spec.src) if spec.src else None, "isa": spec.isa,
            "git": harness.git_revision(spec.src) if spec.src else harness.git_revision()}
        log = out_dir / f"{spec.name}.log"
        try:
            server = stack.enter_context(harness.running(
                spec, log, args.startup_timeout,
                max_rss=int(args.max_rss_gib * 2**30) if args.max_rss_gib else None))
        except RuntimeError as e:
            if not args.keep_going:
                raise
            entry["start_error"] = str(e)
            entry["start_cause"] = harness.first_error(log)
            entry["log_tail"] = harness.log_tail(log)
            result["failures"].append(f"{spec.name} did not start: {e}; "
                                      f"{entry['start_cause']} (log {log})")
            print(f"   {spec.name} left out: it did not start", flush=True)
            return None
        entry |= harness.startup_facts(server, args.log_grep or harness.ISA_LOG_GREP,
                                       args.memory_report)
        return server

    harness.stop_on_sigterm()
    if args.sequential:  # one server up at a time: each runs every level, then stops
        for spec in specs:
            with ExitStack() as stack:
                if (server := start(stack, spec)) is not None:
                    for index, level in enumerate(levels):
                        for rnd in range(args.rounds):
                            one_run(server, index, level, rnd)
            write()
    else:  # all up at once, each round alternating the order
        with ExitStack() as stack:
            servers = [s for s in (start(stack, spec) for spec in specs) if s is not None]
            for index, level in enumerate(levels):
                for rnd in range(args.rounds):
                    for server in (servers if (index + rnd) % 2 == 0 else servers[::-1]):
                        one_run(server, index, level, rnd)
                write()  # per level
    print("\n" + "\n".join(header), flush=True)
    for level in levels:
        if (entry := result["levels"].get(level.key)) is not None:
            print(f"\n{level.title}\n{entry['table']}\n", flush=True)
    return result


def parse_server_args(text: str) -> tuple[str, list[str]]:
    """``NAME=ARGS`` -> (name, ARGS split as a shell would)."""
    name, sep, rest = text.partition("=")
    if not sep:
        raise SystemExit(f"--server-args {text!r}: expected NAME=ARGS")
    return name, shlex.split(rest)


def add_server_args(ap: argparse.ArgumentParser) -> None:
    """The arguments ``compare`` and ``prefill`` share: the contenders, their servers and the
    run's bookkeeping."""
    harness.add_common_args(ap)
    ap.add_argument("--contender", action="append", metavar="NAME[:SRC]",
                    help="a server to compare (repeat; default: "
                         f"{' '.join(DEFAULT_CONTENDERS)}); e.g. ours:/path/to/old/src")
    ap.add_argument("--baseline", default=None,
                    help="the contender the ratios are against (default: the first)")
    ap.add_argument("--server-args", action="append", default=[], metavar="NAME=ARGS",
                    help='extra server arguments, e.g. "ours=--pipeline-parallel-size 2"')
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per contender and level, alternating the order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isa", choices=harness.ISAS, default=None,
                    help="hold ours and llama-server to one instruction set: ours with "
                         "VLLM_UNIFIED_CPU_ISA (avx2: OpenBLAS, torch and oneDNN too), "
                         "llama-server built by scripts/build_llama_server.sh --isa ISA; native "
                         "clears those settings (default: ours as the environment says, "
                         "llama-server's native build)")
    ap.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                    help="the llama-server binary (default: where "
                         "scripts/build_llama_server.sh [--isa ISA] puts it)")
    ap.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                    help="the tokenizer folder of the load client (default: the folder vLLM "
                         "serves for the GGUF)")
    ap.add_argument("--sequential", action="store_true",
                    help="one server up at a time (each runs every level, then stops): for "
                         "models too large to hold twice; no alternating order")
    ap.add_argument("--keep-going", action="store_true",
                    help="a contender that does not start is recorded (its log's tail) and "
                         "left out instead of ending the run (no ratios without the baseline)")
    ap.add_argument("--memory-report", action="store_true",
                    help="ours runs with VLLM_SERVER_DEV_MODE=1 and its worker's "
                         "memory_report (weights held, RSS) is read after start-up")
    ap.add_argument("--max-rss-gib", type=float, default=None, metavar="GIB",
                    help="kill a server whose process tree's RSS exceeds GIB (a start-up "
                         "failure; with --keep-going the run goes on)")
    ap.add_argument("--log-grep", default=None, metavar="REGEX",
                    help="keep the start-up log lines matching REGEX in the result (default: "
                         "those naming instruction sets)")


def add_compare_args(ap: argparse.ArgumentParser) -> None:
    add_server_args(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="ours' --max-model-len, and each llama-server slot's context")


def add_prefill_args(ap: argparse.ArgumentParser) -> None:
    add_server_args(ap)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048],
                    help="prompt tokens of each load")
    ap.add_argument("--num-prompts", type=int, default=3, help="requests per run")
    ap.add_argument("--output-len", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="ours' --max-model-len and llama-server's context (default and "
                         f"least: the longest prompt + output + {PREFILL_MARGIN})")


PREFILL_DOC = """Prompt tokens per second, ours against the other contenders: for each
--prompt-lens length (default 512 and 2048) --num-prompts random prompts (default 3), one at a
time, one output token; per request prompt tokens / TTFT, the mean over requests, and its ratio
to the baseline. All servers are up at once (as compare, whose options it shares); per length
each server first answers one discarded prompt (first-use costs), then the measured prompts
without the load client's warm-up requests (they would put the first prompt in a prefix cache).
max-model-len follows the longest prompt. Written: <results-dir>/serve-prefill-<ts>.json."""


#: Subcommands run as their ``benchmarks/measure/`` module (:func:`harness.dispatch`).
DELEGATED = {
    "soak": ("soak", "mixed traffic with response checks, memory and fd drift"),
    "prefix-cache": ("prefix_cache_bound", "the soak, bounded prefix cache vs vLLM's order"),
    "fuzz": ("fuzz_api", "generated requests against every endpoint; no 5xx, no hang"),
    "moe": ("moe_bench", "Qwen3-30B-A3B-shaped MoE vs llama-server and mlx-lm, and memory"),
    "lora": ("lora_bench", "LoRA adapters: 16 requests over 4 adapters vs the base; vs mlx-lm"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return harness.dispatch(__doc__, DELEGATED, argv)
    prefill = bool(argv) and argv[0] == "prefill"
    if argv and argv[0] in ("compare", "prefill"):
        argv = argv[1:]
    ap = argparse.ArgumentParser(
        prog="serve.py prefill" if prefill else None,
        description=(PREFILL_DOC if prefill else __doc__.split("\n\n")[0]),
        epilog="other subcommands: " + ", ".join(["compare", "prefill", *DELEGATED])
        + " (each takes --help)")
    (add_prefill_args if prefill else add_compare_args)(ap)
    args = ap.parse_args(argv)
    if prefill:
        args.concurrency = [1]
        if min(args.prompt_lens) < 1 or args.num_prompts < 1 or args.output_len < 1:
            ap.error("--prompt-lens, --num-prompts and --output-len must be at least 1")
    if args.rounds < 1 or min(args.concurrency) < 1:
        ap.error("--rounds and --concurrency must be at least 1")
    if not prefill and args.max_model_len < args.input_len + args.output_len:
        ap.error("--max-model-len must hold --input-len + --output-len tokens")
    return compare(args, prefill)


if __name__ == "__main__":
    sys.exit(main())
