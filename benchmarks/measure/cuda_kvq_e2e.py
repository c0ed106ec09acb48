"""Greedy output with a quantized KV cache on the GPU against the CPU backend, end to end.

The tiny fp32 Llama of ``benchmarks/cuda.py decode`` (``expected DIR`` writes it) served through
``LLM.generate`` with ``--kv-cache-dtype`` ``int8_per_token_head``, ``int4_per_token_head`` and
``fp8_per_token_head``; ``int8_skip0`` (int8 with ``--kv-cache-dtype-skip-layers 0``: pages of
two precisions in one pool); and ``turboquant_k8v4`` on a 6-layer variant of the same Llama
(``TQ_TINY_LAYERS``: vLLM keeps TurboQuant's first and last two layers in the model dtype, so
layers 2 and 3 hold TurboQuant cells; ``pack`` ships it as ``run/tiny6.tar.xz``)
(:data:`FORMATS`; ``KVQ_FORMATS``, comma-separated names, selects), prefix caching off and on,
on the 8 prompts of ``expected.json`` (32 greedy tokens each, 2 logprobs for the top-2 gap):

* ``cpu RUN_DIR`` (here, MLX's CPU backend: the native quantized KV kernels; the tiny
  checkpoint rebuilt by ``tests/tiny_models.py``, the same bytes for the same seed) writes
  ``RUN_DIR/kvq_cpu.json``;
* ``has-baseline RUN_DIR`` (``pack``) exits 1 unless ``kvq_cpu.json`` there has every
  format of :data:`FORMATS` (an older one is remade);
* ``tiny6 DIR`` (``pack``, here) writes the 6-layer tiny under DIR and prints its folder;
* ``gpu RUN_DIR TINY TINY6 OUT`` (on the GPU machine, through ``cuda_h200.sh kvq``: the GPU
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
#: layers of the tiny Llama the TurboQuant run serves
TQ_TINY_LAYERS = 6
#: run name -> (--kv-cache-dtype, extra engine arguments, served by the 6-layer tiny)
FORMATS: dict[str, tuple[str, dict, bool]] = {
    "int8_per_token_head": ("int8_per_token_head", {}, False),
    "int4_per_token_head": ("int4_per_token_head", {}, False),
    "fp8_per_token_head": ("fp8_per_token_head", {}, False),
    "int8_skip0": ("int8_per_token_head", {"kv_cache_dtype_skip_layers": ["0"]}, False),
    "turboquant_k8v4": ("turboquant_k8v4", {}, True),
}


def tiny6(where: str | Path) -> Path:
    """The 6-layer tiny fp32 Llama (seed 0) the TurboQuant run serves, written under
    ``where`` (tests/tiny_models.py: the same bytes wherever it is built)."""
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(where, "llama", "float32", 0, num_layers=TQ_TINY_LAYERS)


def _runs(mode: str, models: tuple[str, str], run_dir: Path) -> dict:
    sys.path.insert(0, str(run_dir))
    sys.path.insert(0, str(HERE))
    import cuda_decode as cd

    expected = json.loads((run_dir / "expected.json").read_text())
    work = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "kvq"
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for fmt in os.environ.get("KVQ_FORMATS", ",".join(FORMATS)).split(","):
        dtype, extra, six = FORMATS[fmt]
        for prefix in (False, True):
            engine = dict(cd._tiny_engine(), kv_cache_dtype=dtype, enable_prefix_caching=prefix,
                          **extra)
            spec = {"model": models[six], "engine": engine,
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
        sys.path.insert(0, str(HERE.parents[1] / "tests"))
        from tiny_models import make_tiny_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            tiny = make_tiny_checkpoint(tmp, "llama", "float32", 0)
            results = _runs("cpu", (str(tiny), str(tiny6(tmp))), run_dir)
        (run_dir / "kvq_cpu.json").write_text(json.dumps(results))
        return
    if mode == "has-baseline":  # pack: exit 1 unless RUN_DIR/kvq_cpu.json has every format
        path = Path(sys.argv[2]) / "kvq_cpu.json"
        have = json.loads(path.read_text()) if path.is_file() else {}
        sys.exit(0 if all(f"{n}/noprefix" in have for n in FORMATS) else 1)
    if mode == "tiny6":  # pack: the 6-layer tiny, as a folder to ship
        print(tiny6(sys.argv[2]))
        return
    run_dir, tiny, out = Path(sys.argv[2]), sys.argv[3], Path(sys.argv[5])
    out.mkdir(parents=True, exist_ok=True)
    results = _runs("gpu", (tiny, sys.argv[4]), run_dir)
    cpu = json.loads((run_dir / "kvq_cpu.json").read_text())
    summary = {}
    missing = {n.split("/")[0] for n in results} - {n.split("/")[0] for n in cpu}
    if missing:  # a stale CPU side: say so rather than fail after every GPU run
        print(f"no CPU baseline for {sorted(missing)} in kvq_cpu.json (rerun pack)", flush=True)
    for name, run in results.items():
        if name.split("/")[0] in missing:
            summary[name] = {"equal": None, "error": "no CPU baseline"}
            continue
        base = cpu[name.split("/")[0] + "/noprefix"]
        summary[name] = {"equal": run["ids"] == base["ids"],
                         "first_divergences": _first_divergences(run["ids"], base)}
    print("KVQ_E2E", json.dumps(summary), flush=True)
    (out / "kvq_gpu.json").write_text(json.dumps(results))
    (out / "kvq_summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
