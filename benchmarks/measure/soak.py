"""Soak: thousands of mixed requests against the default model served as the README serves it;
every response checked, memory and file descriptors sampled over time.

    .venv/bin/python benchmarks/serve.py soak                                  # full: 2,000 at 16
    .venv/bin/python benchmarks/serve.py soak --requests 150 --concurrency 8   # short (the test's)

**The server** is ``vllm serve <SmolLM2 GGUF> --host 127.0.0.1 --port PORT
--gpu-memory-utilization 0.5 --served-model-name SmolLM2-135M-Instruct --max-model-len 2048``:
exactly the command ``scripts/serve.sh`` runs (its defaults, another port; tests/test_soak.py
checks that the two agree), with ``VLLM_UNIFIED_MEMORY_LOG`` set so that the engine logs MLX's
memory counters (:mod:`vllm_unified.memory.mlx_log`); ``--server-args`` adds arguments.
scripts/serve.sh itself is not run because it first runs scripts/setup.sh for the checkout it
lives in, which would re-install a virtual environment shared with another checkout.

**The run.** (1) The server starts; (2) **solo**: every distinct greedy body of the mix
(:func:`soak_traffic.greedy_pool`, ``--greedy-pool``) is sent alone, one after the other, not
streamed, and its response is the reference (``--solo fresh`` measures them on a server of
their own, stopped before the load server starts: no state shared with the load); (3) **load**:
``--requests`` requests (:func:`soak_traffic.make_plan`: chat and completions, streamed or not,
greedy and sampled, n up to 3, logprobs, structured output, stop strings, long and short
prompts with shared prefixes, ``--abort-fraction`` aborted by the client) at ``--concurrency``
in flight, every response checked (:func:`soak_traffic.check`); (4) **settle**: ``/metrics``
polled until ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` are 0 (60 s at most); (5) one more greedy request, whose text must
still equal its solo text; (6) the server is stopped (SIGTERM to its process group, SIGKILL
after 30 s).

**Sampled every ``--sample-interval`` s** from the start of the load: resident memory and open
file descriptors (``/proc/PID/fd``) of the API server (the ``vllm`` process) and of its
``VLLM::EngineCore`` child, the resident part of the engine's KV pool (the anonymous mapping of
the pool's size in ``/proc/PID/smaps``; its pages are committed as blocks are first written and
stay, so the engine's RSS grows with the pool until every block has been used once), and the
three ``/metrics`` gauges; and every ``VLLM_UNIFIED_MEMORY_LOG`` steps the engine's line with
MLX's active, cache and peak memory.

**Drift** is measured from the first sample after request ``--drift-from`` (default 200, at most
a quarter of the run) completed to a sample taken after the settle: engine RSS, engine RSS less
its KV-pool pages, API-server RSS, both processes' fds, MLX active and cache memory. The issue's
acceptance (engine RSS growth < 2%, fds flat: no more at the end than at the drift start) is
printed as a verdict; it does not decide the exit code.

**Exit code**: 0 when every correctness check passed (no failed request among those not
aborted, every greedy text equal to its solo text, the settle reached, the last request right),
1 otherwise. Writes ``<results-dir>/soak-<timestamp>.json`` (every request, the solo texts, the
samples, the summary) and the server logs next to it (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import requests

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import soak_traffic as traffic  # noqa: E402
from harness import (  # noqa: E402
    free_port,
    kill_group,
    log_tail,
    machine_info,
    versions,
    wait_healthy,
    write_result,
)
from real_models import smollm2_gguf  # noqa: E402

from vllm_unified.envs import MEMORY_LOG_ENV  # noqa: E402
from vllm_unified.memory.mlx_log import parse_line  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

#: What scripts/serve.sh adds to ``vllm serve <gguf>`` for the default model, in its order
#: (its --port 8000 replaced by ours).
SERVE_DEFAULTS = ["--host", "127.0.0.1", "--gpu-memory-utilization", "0.5",
                  "--served-model-name", traffic.MODEL, "--max-model-len", "2048"]
METRIC_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc")
_METRIC_RE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$")
_POOL_RE = re.compile(r"vllm-unified: KV pool \d+ blocks .*?, ([\d.]+) GiB")
SETTLE_TIMEOUT_S = 60.0


def server_command(gguf: Path, port: int, extra: list[str]) -> list[str]:
    """``vllm serve`` as scripts/serve.sh runs it for the default model, on ``port``."""
    host, rest = SERVE_DEFAULTS[:2], SERVE_DEFAULTS[2:]
    return [str(VENV_BIN / "vllm"), "serve", str(gguf), *host, "--port", str(port), *rest,
            *extra]


# --------------------------------------------------------------------------- server


@dataclass
class Server:
    """A running server: its URL, process, log and, once found, its engine process."""

    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    startup_s: float = 0.0
    engine: psutil.Process | None = None
    kv_pool_bytes: int | None = None


@contextmanager
def serve(gguf: Path, log_path: Path, extra: list[str], memory_log_steps: int,
          startup_timeout: float):
    """Start the server, wait for ``/health``, find its EngineCore child; stop it afterwards.

    Raises:
        RuntimeError: it exited or was not healthy in time (with the log's tail).
    """
    port = free_port()
    cmd = server_command(gguf, port, extra)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env[MEMORY_LOG_ENV] = str(memory_log_steps)
    print(f"server: {shlex.join(cmd)}\n  log: {log_path}", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        try:
            server.startup_s = wait_healthy(proc, server.base_url, startup_timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{log_tail(log_path)}") from e
        server.engine = _engine_child(proc.pid)
        m = _POOL_RE.search(log_path.read_text(errors="replace"))
        server.kv_pool_bytes = int(float(m.group(1)) * 2**30) if m else None
        print(f"  healthy after {server.startup_s:.0f} s; API server pid {proc.pid}, engine "
              f"pid {server.engine.pid}", flush=True)
        yield server
    finally:
        kill_group(proc)


def _engine_child(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise RuntimeError(f"no EngineCore process under the API server {pid}")



def metrics(base_url: str) -> dict[str, float]:
    """The :data:`METRIC_NAMES` gauges from ``/metrics`` (summed over label sets)."""
    out: dict[str, float] = {}
    for line in requests.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        m = _METRIC_RE.match(line)
        if m and m.group(1) in METRIC_NAMES:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


# --------------------------------------------------------------------------- sampling


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mapping_rss(pid: int, size: int | None) -> int | None:
    """Resident bytes of the anonymous mapping of ``size`` bytes (within 1%) in ``pid``'s
    ``/proc/PID/smaps``: the KV pool (:func:`vllm_unified.kv.allocation.aligned_empty`)."""
    if size is None:
        return None
    best: int | None = None
    in_pool = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)  # a mapping's header: range perms offset dev inode [path]
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                anonymous = len(head) == 5 or not head[5].strip()
                in_pool = anonymous and abs((hi - lo) - size) <= size // 100
            elif in_pool and line.startswith("Rss:"):
                best = int(line.split()[1]) * 1024
                in_pool = False
    return best


@dataclass
class Sampler:
    """Samples the two processes, the metrics and the engine's MLX memory lines every
    ``interval`` seconds on a thread of its own."""

    server: Server
    interval: float
    progress: dict[str, int]
    t0: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    mlx: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _log_offset: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._log_offset = self.server.log_path.stat().st_size  # lines from now on

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> dict[str, Any] | None:
        """Take one sample now (also called after the settle); None if it failed (recorded
        in ``errors``)."""
        api, engine = self.server.proc.pid, self.server.engine
        try:
            s = {"t": round(time.perf_counter() - self.t0, 2), "done": self.progress["done"],
                 "api_rss": psutil.Process(api).memory_info().rss, "api_fds": fd_count(api),
                 "engine_rss": engine.memory_info().rss, "engine_fds": fd_count(engine.pid),
                 "kv_pool_rss": mapping_rss(engine.pid, self.server.kv_pool_bytes),
                 **metrics(self.server.base_url)}
        except (psutil.Error, OSError, requests.RequestException) as e:
            self.errors.append(f"t={time.perf_counter() - self.t0:.1f}: {type(e).__name__}: {e}")
            return None
        self.samples.append(s)
        self._read_log(s)
        return s

    def _read_log(self, s: dict[str, Any]) -> None:
        with open(self.server.log_path, "rb") as f:
            f.seek(self._log_offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only
        self._log_offset += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            m = parse_line(line)
            if m is not None:
                self.mlx.append({"t": s["t"], "done": s["done"], "steps": m.steps,
                                 "active_mib": m.active_mib, "cache_mib": m.cache_mib,
                                 "peak_mib": m.peak_mib})


# --------------------------------------------------------------------------- phases


def run_solo(base_url: str, pool: list[traffic.Body]) -> list[traffic.Outcome]:
    """Each pool body alone, in order, not streamed.

    Raises:
        RuntimeError: a solo request failed (there is no reference without it).
    """
    t0 = time.perf_counter()
    outs = []
    for i, body in enumerate(pool):
        p = traffic.Planned(-1, body, False, i, None)
        out = traffic.send(base_url, p, t0)
        problems, _ = traffic.check(p, out, None) if out.status == "ok" else ([out.error], {})
        if problems:
            raise RuntimeError(f"solo request {i} ({body.features()}) failed: {problems}")
        outs.append(out)
    return outs


def run_load(base_url: str, plan: list[traffic.Planned], solo: list[traffic.Outcome],
             concurrency: int, progress: dict[str, int], t0: float,
             ) -> list[dict[str, Any]]:
    """Send ``plan`` with ``concurrency`` in flight; one record per request, in plan order."""
    records: list[dict[str, Any] | None] = [None] * len(plan)
    lock = threading.Lock()

    def one(p: traffic.Planned) -> None:
        out = traffic.send(base_url, p, t0)
        ref = solo[p.greedy_ref] if p.greedy_ref is not None else None
        notes: dict[str, Any] = {}
        if out.status == "ok":
            problems, notes = traffic.check(p, out, ref)
            if p.abort is not None:
                notes["abort_missed"] = True
        elif out.status == "aborted":
            problems = traffic.check_aborted(p, out, ref)
        else:
            problems = [out.error or "error"]
        records[p.idx] = traffic.outcome_record(p, out, problems, notes)
        with lock:
            progress["done"] += 1
            if problems:
                progress["failed"] += 1
                print(f"  request {p.idx} {p.body.features()} stream={p.stream}: "
                      f"{problems[0][:300]}", flush=True)
            if progress["done"] % 100 == 0:
                print(f"  {progress['done']}/{len(plan)} done, {progress['failed']} with "
                      f"problems, {time.perf_counter() - t0:.0f} s", flush=True)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, plan))
    return [r for r in records if r is not None]


def diagnose_mismatches(base_url: str, pool: list[traffic.Body], solo: list[traffic.Outcome],
                        records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each greedy body whose load text differed from its solo text: the body sent alone
    again with top-2 logprobs, and where each differing text left it
    (:func:`soak_traffic.divergence`)."""
    out = []
    for ref in sorted({r["greedy_ref"] for r in records if r.get("greedy_mismatch")}):
        p = traffic.Planned(-1, traffic.with_logprobs(pool[ref]), False, ref, None)
        again = traffic.send(base_url, p, time.perf_counter())
        entry: dict[str, Any] = {"ref": ref, "features": pool[ref].features(),
                                 "rerun_status": again.status, "rerun_error": again.error}
        if again.status == "ok":
            solo_text = solo[ref].choices[0].text
            entry["rerun_equals_solo"] = again.choices[0].text == solo_text
            entry["solo_vs_rerun"] = (None if entry["rerun_equals_solo"] else
                                      traffic.divergence(again, solo_text))
            entry["mismatches"] = [
                {"idx": r["idx"], "stream": r["stream"],
                 **traffic.divergence(again, r["choices"].get(0, {}).get("text", ""))}
                for r in records if r["greedy_ref"] == ref and r.get("greedy_mismatch")]
        out.append(entry)
    return out


def settle(base_url: str) -> tuple[bool, float, dict[str, float]]:
    """Poll ``/metrics`` until nothing runs or waits and KV usage is 0; (reached, seconds,
    the last gauges)."""
    t0 = time.perf_counter()
    while True:
        m = metrics(base_url)
        if all(m.get(k) == 0 for k in METRIC_NAMES):
            return True, time.perf_counter() - t0, m
        if time.perf_counter() - t0 > SETTLE_TIMEOUT_S:
            return False, time.perf_counter() - t0, m
        time.sleep(1)


# --------------------------------------------------------------------------- report


def _growth(base: float | None, end: float | None) -> float | None:
    if base is None or end is None or base == 0:
        return None
    return 100.0 * (end - base) / base


def drift(samples: list[dict[str, Any]], mlx: list[dict[str, Any]], drift_from: int,
          end: dict[str, Any]) -> dict[str, Any]:
    """Each sampled quantity at the first sample with ``done >= drift_from``, at ``end``, its
    maximum in between and the growth in percent."""
    after = [s for s in samples if s["done"] >= drift_from]
    if not after:
        return {"error": f"no sample after request {drift_from}"}
    base = after[0]
    out: dict[str, Any] = {"from_request": drift_from, "from_t": base["t"], "to_t": end["t"]}
    for key in ("engine_rss", "api_rss", "kv_pool_rss", "engine_fds", "api_fds"):
        values = [s[key] for s in after if s.get(key) is not None]
        out[key] = {"start": base.get(key), "end": end.get(key),
                    "max": max(values) if values else None,
                    "growth_pct": _growth(base.get(key), end.get(key))}
    if base.get("kv_pool_rss") is not None and end.get("kv_pool_rss") is not None:
        b, e = (base["engine_rss"] - base["kv_pool_rss"], end["engine_rss"] - end["kv_pool_rss"])
        out["engine_rss_less_kv_pool"] = {"start": b, "end": e, "growth_pct": _growth(b, e)}
    mlx_after = [m for m in mlx if m["done"] >= drift_from]
    if mlx_after:
        for key in ("active_mib", "cache_mib", "peak_mib"):
            out[f"mlx_{key}"] = {"start": mlx_after[0][key], "end": mlx_after[-1][key],
                                 "max": max(m[key] for m in mlx_after),
                                 "growth_pct": _growth(mlx_after[0][key], mlx_after[-1][key])}
    rss_growth = out["engine_rss"]["growth_pct"]
    less_pool = out.get("engine_rss_less_kv_pool", {}).get("growth_pct")
    out["verdict"] = {
        "engine_rss_growth_below_2pct": rss_growth is not None and rss_growth < 2.0,
        "engine_rss_less_kv_pool_growth_below_2pct": less_pool is not None and less_pool < 2.0,
        "fds_flat": all(out[k]["end"] is not None and out[k]["start"] is not None
                        and out[k]["end"] <= out[k]["start"] for k in ("engine_fds", "api_fds")),
    }
    return out


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f} MiB"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2f}%"


def print_summary(r: dict[str, Any]) -> None:
    s, d = r["summary"], r["drift"]
    print(f"\nSoak {r['timestamp']}: {s['requests']} requests at concurrency {s['concurrency']}, "
          f"{s['greedy_pool']} distinct greedy bodies; load {s['load_s']:.0f} s "
          f"({s['requests'] / s['load_s']:.2f} req/s, {s['completion_tokens']} completion tokens), "
          f"solo {s['solo_s']:.0f} s, server start {s['startup_s']:.0f} s")
    print(f"  load average before {r['machine']['loadavg_before'][0]:.1f}, after "
          f"{r['machine']['loadavg_after'][0]:.1f} (other work on the machine skews timings)")
    print(f"  completed {s['ok']}, aborted by the client {s['aborted']} (planned "
          f"{s['abort_planned']}, {s['abort_missed']} finished first), failed {s['failed']}")
    print(f"  greedy checked {s['greedy_checked']}, mismatches {s['greedy_mismatches']}; "
          f"greedy logprob max diff vs solo {s['greedy_logprob_max_diff']}; structured outputs "
          f"cut by max_tokens {s['truncated_structured']}")
    print(f"  features: {json.dumps(s['features'])}")
    for d in r["greedy_mismatch_diagnosis"]:
        print(f"  greedy body {d['ref']} {d['features']} mismatched; alone again with logprobs: "
              f"{d.get('rerun_status')}, equals solo: {d.get('rerun_equals_solo')}")
        for m in d.get("mismatches", []):
            print(f"    request {m['idx']}: leaves at char {m['char']}, solo token "
                  f"{m.get('solo_token')!r}, solo top-2 {m.get('solo_top')}, gap {m.get('gap')}, "
                  f"load text continues {m['other_continues']!r}")
    print(f"  settle: {r['settle']}; final greedy request equals solo: {r['final_check']['ok']}")
    if "error" in d:
        print(f"  drift: {d['error']}")
    else:
        print(f"  drift from request {d['from_request']} (t={d['from_t']:.0f} s) to the end "
              f"(t={d['to_t']:.0f} s):")
        for key in ("engine_rss", "api_rss", "kv_pool_rss"):
            v = d[key]
            print(f"    {key:<24} {_mib(v['start'])} -> {_mib(v['end'])} (max {_mib(v['max'])}) "
                  f"{_pct(v['growth_pct'])}")
        if "engine_rss_less_kv_pool" in d:
            v = d["engine_rss_less_kv_pool"]
            print(f"    {'engine_rss_less_kv_pool':<24} {_mib(v['start'])} -> {_mib(v['end'])} "
                  f"{_pct(v['growth_pct'])}")
        for key in ("engine_fds", "api_fds"):
            v = d[key]
            print(f"    {key:<24} {v['start']} -> {v['end']} (max {v['max']})")
        for key in ("mlx_active_mib", "mlx_cache_mib", "mlx_peak_mib"):
            if key in d:
                v = d[key]
                print(f"    {key:<24} {v['start']:.1f} -> {v['end']:.1f} MiB (max {v['max']:.1f})")
        verdict = d["verdict"]
        def yes(key: str) -> str:
            return "yes" if verdict[key] else "NO"

        print(f"    acceptance: engine RSS growth < 2%: {yes('engine_rss_growth_below_2pct')} "
              f"(less its KV-pool pages: {yes('engine_rss_less_kv_pool_growth_below_2pct')}); "
              f"fds flat: {yes('fds_flat')}")
    print(f"  checks: {json.dumps(r['checks'])}")
    print("PASSED" if all(r["checks"].values()) else "FAILED")


def summarize(plan: list[traffic.Planned], records: list[dict[str, Any]]) -> dict[str, Any]:
    features: dict[str, int] = {}
    for p in plan:
        for f in p.body.features() + (["stream"] if p.stream else []):
            features[f] = features.get(f, 0) + 1
    greedy = [r for r in records if r["greedy_ref"] is not None and r["status"] == "ok"]
    diffs = [r["logprob_max_diff"] for r in records if "logprob_max_diff" in r]
    return {
        "ok": sum(r["status"] == "ok" for r in records),
        "aborted": sum(r["status"] == "aborted" for r in records),
        "failed": sum(bool(r["problems"]) for r in records),
        "errors": sum(r["status"] == "error" for r in records),
        "abort_planned": sum(p.abort is not None for p in plan),
        "abort_missed": sum(bool(r.get("abort_missed")) for r in records),
        "greedy_checked": len(greedy),
        "greedy_mismatches": sum(bool(r.get("greedy_mismatch")) for r in records),
        "greedy_logprob_max_diff": max(diffs) if diffs else None,
        "truncated_structured": sum(bool(r.get("truncated_structured")) for r in records),
        "completion_tokens": sum(int((r["usage"] or {}).get("completion_tokens") or 0)
                                 for r in records if r["status"] == "ok"),
        "features": dict(sorted(features.items())),
    }


# --------------------------------------------------------------------------- main


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests of the load")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--abort-fraction", type=float, default=0.1,
                    help="share of the requests the client aborts")
    ap.add_argument("--greedy-pool", type=int, default=None,
                    help="distinct greedy bodies, each measured alone first (default: "
                         "requests / 16, between 8 and 64)")
    ap.add_argument("--solo", choices=["same", "fresh"], default="same",
                    help="measure the solo texts on the load's server before the load, or on "
                         "a fresh server of their own")
    ap.add_argument("--seed", type=int, default=0, help="seed of the documents and the mix")
    ap.add_argument("--sample-interval", type=float, default=2.0, help="seconds")
    ap.add_argument("--memory-log-steps", type=int, default=20,
                    help=f"{MEMORY_LOG_ENV} of the server: steps between MLX memory lines")
    ap.add_argument("--drift-from", type=int, default=200,
                    help="drift is measured from this request (at most a quarter of the run)")
    ap.add_argument("--server-args", type=shlex.split, default=[],
                    help='extra `vllm serve` arguments, one string: --server-args="--seed 1"')
    ap.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    if args.concurrency < 1:
        ap.error(f"--concurrency must be at least 1, got {args.concurrency}")
    if not 0 <= args.abort_fraction < 1:
        ap.error(f"--abort-fraction must be in [0, 1), got {args.abort_fraction}")
    if args.greedy_pool is not None and args.greedy_pool < 1:
        ap.error(f"--greedy-pool must be at least 1, got {args.greedy_pool}")
    if args.sample_interval <= 0:
        ap.error(f"--sample-interval must be positive, got {args.sample_interval}")
    if args.memory_log_steps < 1:
        ap.error(f"--memory-log-steps must be at least 1, got {args.memory_log_steps}")
    if args.drift_from < 0:
        ap.error(f"--drift-from must be >= 0, got {args.drift_from}")


def main(argv: list[str] | None = None) -> int:
    ap = make_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    pool_size = args.greedy_pool or min(64, max(8, args.requests // 16))
    drift_from = min(args.drift_from, args.requests // 4)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf()

    from transformers import AutoTokenizer

    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_gguf_dir(gguf)))
    docs = traffic.make_documents(tokenizer, args.seed)
    pool = traffic.greedy_pool(pool_size, docs, args.seed)
    plan = traffic.make_plan(args.requests, pool, docs, args.seed, args.abort_fraction)

    def _on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_sigterm)
    load_before = os.getloadavg()
    log = args.results_dir / f"soak-{stamp}.log"
    solo_info: dict[str, Any] = {"mode": args.solo}
    solo: list[traffic.Outcome] = []
    if args.solo == "fresh":
        solo_log = args.results_dir / f"soak-{stamp}-solo.log"
        with serve(gguf, solo_log, args.server_args, args.memory_log_steps,
                   args.startup_timeout) as s:
            t = time.perf_counter()
            solo = run_solo(s.base_url, pool)
            solo_info.update(seconds=time.perf_counter() - t, log=str(solo_log))
    with serve(gguf, log, args.server_args, args.memory_log_steps, args.startup_timeout) as srv:
        if args.solo == "same":
            t = time.perf_counter()
            solo = run_solo(srv.base_url, pool)
            solo_info["seconds"] = time.perf_counter() - t
        print(f"solo: {len(pool)} greedy bodies in {solo_info['seconds']:.0f} s", flush=True)
        progress = {"done": 0, "failed": 0}
        t0 = time.perf_counter()
        sampler = Sampler(srv, args.sample_interval, progress, t0)
        idle_before = sampler.sample()
        sampler.start()
        print(f"load: {len(plan)} requests at concurrency {args.concurrency}", flush=True)
        try:
            records = run_load(srv.base_url, plan, solo, args.concurrency, progress, t0)
        finally:
            sampler.stop()
        load_s = time.perf_counter() - t0
        reached, settle_s, gauges = settle(srv.base_url)
        final = pool[0]
        p = traffic.Planned(-1, final, False, 0, None)
        out = traffic.send(srv.base_url, p, t0)
        problems = traffic.check(p, out, solo[0])[0] if out.status == "ok" else [out.error]
        end = sampler.sample()
        engine_alive = srv.engine.is_running()
        diagnosis = diagnose_mismatches(srv.base_url, pool, solo, records)
    load_after = os.getloadavg()

    summary = {"requests": len(plan), "concurrency": args.concurrency, "greedy_pool": len(pool),
               "load_s": load_s, "solo_s": solo_info["seconds"], "startup_s": srv.startup_s,
               **summarize(plan, records)}
    result: dict[str, Any] = {
        "timestamp": stamp, "machine": machine_info(load_before, load_after),
        "versions": versions(), "model": str(gguf),
        "server": {"cmd": server_command(gguf, 0, args.server_args), "log": str(log),
                   "kv_pool_bytes": srv.kv_pool_bytes, "engine_pid": srv.engine.pid,
                   "api_pid": srv.proc.pid},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "solo": {**solo_info, "bodies": [traffic.solo_record(i, b, o)
                                         for i, (b, o) in enumerate(zip(pool, solo,
                                                                        strict=True))]},
        "summary": summary,
        "settle": {"reached": reached, "seconds": round(settle_s, 1), "gauges": gauges},
        "final_check": {"ok": not problems, "problems": problems},
        "greedy_mismatch_diagnosis": diagnosis,
        "idle_before_load": idle_before, "end": end,
        "drift": drift(sampler.samples, sampler.mlx, drift_from, end) if end else
        {"error": "no final sample"},
        "samples": sampler.samples, "mlx_memory": sampler.mlx, "sample_errors": sampler.errors,
        "requests": records,
    }
    result["checks"] = {
        "no_failed_requests": summary["failed"] == 0,
        "greedy_equals_solo": summary["greedy_mismatches"] == 0,
        "idle_at_end": reached,
        "final_request_correct": not problems,
        "engine_alive": engine_alive,
        "all_requests_recorded": len(records) == len(plan),
    }
    write_result("soak", stamp, result, args.results_dir)
    print_summary(result)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e or 'Ctrl-C'}); the server was stopped", file=sys.stderr)
        sys.exit(130)
