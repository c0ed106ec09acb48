"""What the bounded prefix cache costs and saves: the soak's mixed traffic served twice in one
run, with the default bound (``VLLM_UNIFIED_PREFIX_CACHE_RETAIN`` unset: the floor is
``--max-model-len``, the cache follows the load's peak, blocks beyond it are given back) and with
vLLM's own order (``all``: every freed block kept, the lazy pool committed as fresh blocks are
written).

Each contender is one ``benchmarks/serve.py soak`` run (its own server, the README's command, the
same ``--seed`` and so the same requests) in the order bound, all, bound, all ... for ``--rounds``
rounds; every response is checked as the soak checks it. Printed per contender: load time and
requests/s, the KV pool's resident MiB at the drift start, at its maximum and at the end, and the
engine's RSS; the ratios (bound / all) are per round, from the two runs of that round. Run on a
quiet machine. Writes ``benchmarks/results/prefix_cache_bound-<ts>.json``.

    .venv/bin/python benchmarks/serve.py prefix-cache                 # 400 requests, 1 round
    .venv/bin/python benchmarks/serve.py prefix-cache --requests 1000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from harness import machine_info, versions, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
CONTENDERS = {"bound": None, "all": "all"}


def run_soak(retain: str | None, args: argparse.Namespace, out_dir: Path) -> dict:
    """One soak run; its result JSON (raises if the soak failed a check)."""
    env = dict(os.environ)
    env.pop("VLLM_UNIFIED_PREFIX_CACHE_RETAIN", None)
    if retain is not None:
        env["VLLM_UNIFIED_PREFIX_CACHE_RETAIN"] = retain
    before = set(out_dir.glob("soak-*.json"))
    proc = subprocess.run(
        [sys.executable, str(HERE / "soak.py"), "--requests", str(args.requests),
         "--concurrency", str(args.concurrency), "--seed", str(args.seed),
         "--results-dir", str(out_dir)],
        env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"soak ({retain or 'bound'}) failed:\n{proc.stdout[-4000:]}"
                         f"{proc.stderr[-2000:]}")
    (path,) = set(out_dir.glob("soak-*.json")) - before
    return json.loads(path.read_text())


def figures(result: dict) -> dict:
    s, d = result["summary"], result["drift"]
    pool = [x["kv_pool_rss"] for x in result["samples"] if x.get("kv_pool_rss") is not None]
    return {"load_s": s["load_s"], "req_per_s": s["requests"] / s["load_s"],
            "completion_tokens": s["completion_tokens"],
            "greedy_checked": s["greedy_checked"], "failed": s["failed"],
            "kv_pool_mib": {"drift_start": d["kv_pool_rss"]["start"] / 2**20,
                            "max": max(pool) / 2**20, "end": d["kv_pool_rss"]["end"] / 2**20},
            "engine_rss_mib": {"drift_start": d["engine_rss"]["start"] / 2**20,
                               "max": d["engine_rss"]["max"] / 2**20,
                               "end": d["engine_rss"]["end"] / 2**20}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    ts = datetime.now().strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            got = {name: figures(run_soak(retain, args, Path(tmp)))
                   for name, retain in CONTENDERS.items()}
            got["ratio_req_per_s"] = got["bound"]["req_per_s"] / got["all"]["req_per_s"]
            rounds.append(got)
            for name in CONTENDERS:
                f = got[name]
                print(f"round {r + 1} {name:>5}: load {f['load_s']:.0f} s "
                      f"({f['req_per_s']:.2f} req/s), KV pool resident MiB "
                      f"{f['kv_pool_mib']['drift_start']:.0f} at the drift start, "
                      f"max {f['kv_pool_mib']['max']:.0f}, end {f['kv_pool_mib']['end']:.0f}; "
                      f"engine RSS max {f['engine_rss_mib']['max']:.0f} MiB", flush=True)
            print(f"round {r + 1}: bound / all requests per second "
                  f"{got['ratio_req_per_s']:.2f}x", flush=True)
    out = {"machine": machine_info(load_before, os.getloadavg()), "versions": versions(),
           "args": vars(args), "rounds": rounds}
    write_result("prefix_cache_bound", ts, out)


if __name__ == "__main__":
    main()
