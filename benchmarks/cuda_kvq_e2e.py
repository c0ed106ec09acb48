"""Greedy output with a quantized KV cache on the GPU against the CPU backend, end to end.

The tiny fp32 Llama of ``benchmarks/cuda_decode.py`` (``expected DIR`` writes it) served through
``LLM.generate`` with ``--kv-cache-dtype`` ``int8_per_token_head``, ``int4_per_token_head`` and
``fp8_per_token_head`` (``KVQ_FORMATS``, comma-separated, overrides), prefix caching off and on,
on the 8 prompts of ``expected.json`` (32 greedy tokens each, 2 logprobs for the top-2 gap):

* ``cpu RUN_DIR`` (here, MLX's CPU backend: the native quantized KV kernels; the tiny
  checkpoint rebuilt by ``tests/tiny_models.py``, the same bytes for the same seed) writes
  ``RUN_DIR/kvq_cpu.json``;
* ``gpu RUN_DIR TINY OUT`` (on the GPU machine, through ``cuda_h200.sh kvq``: the GPU
  quantizing write and paged attention of the profile's dialect) compares each run's token ids
  with the CPU backend's run of the same format without prefix caching, prints
  ``KVQ_E2E {...}`` (equal, and the first divergence per prompt with the CPU's top-2 logprob
  gap there) and writes ``OUT/kvq_gpu.json`` and ``OUT/kvq_summary.json``.

Each engine is its own process (``cuda_decode.run_engine``), its log under ``$TMPDIR/kvq``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_FORMATS = "int8_per_token_head,int4_per_token_head,fp8_per_token_head"


def _runs(mode: str, model: str, run_dir: Path) -> dict:
    sys.path.insert(0, str(run_dir))
    sys.path.insert(0, str(HERE))
    import cuda_decode as cd

    expected = json.loads((run_dir / "expected.json").read_text())
    work = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "kvq"
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for fmt in os.environ.get("KVQ_FORMATS", DEFAULT_FORMATS).split(","):
        for prefix in (False, True):
            engine = dict(cd._tiny_engine(), kv_cache_dtype=fmt, enable_prefix_caching=prefix)
            spec = {"model": model, "engine": engine,
                    "greedy": {"prompts": expected["prompts"],
                               "max_tokens": cd.GREEDY_TOKENS, "logprobs": 2}}
            name = f"{fmt}/{'prefix' if prefix else 'noprefix'}"
            out = cd.run_engine(spec, work, f"{mode}_{fmt}_{prefix}", os.environ.copy())
            results[name] = {"ids": out["greedy"], "top2_gap": out.get("top2_gap")}
            print(mode, name, "done", flush=True)
    return results


def _first_divergences(got: list[list[int]], cpu: dict) -> list[dict]:
    found = []
    for i, (g, c) in enumerate(zip(got, cpu["ids"], strict=True)):
        step = next((s for s, (a, b) in enumerate(zip(g, c, strict=True)) if a != b), None)
        if step is not None:
            found.append({"prompt": i, "step": step, "cpu_top2_gap": cpu["top2_gap"][i][step]})
    return found


def main() -> None:
    mode = sys.argv[1]
    if mode == "cpu":
        run_dir = Path(sys.argv[2])
        sys.path.insert(0, str(HERE.parent / "tests"))
        from tiny_models import make_tiny_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            tiny = make_tiny_checkpoint(tmp, "llama", "float32", 0)
            results = _runs("cpu", str(tiny), run_dir)
        (run_dir / "kvq_cpu.json").write_text(json.dumps(results))
        return
    run_dir, tiny, out = Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    results = _runs("gpu", tiny, run_dir)
    cpu = json.loads((run_dir / "kvq_cpu.json").read_text())
    summary = {}
    for name, run in results.items():
        base = cpu[name.split("/")[0] + "/noprefix"]
        summary[name] = {"equal": run["ids"] == base["ids"],
                         "first_divergences": _first_divergences(run["ids"], base)}
    print("KVQ_E2E", json.dumps(summary), flush=True)
    (out / "kvq_gpu.json").write_text(json.dumps(results))
    (out / "kvq_summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
