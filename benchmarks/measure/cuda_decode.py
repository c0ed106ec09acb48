"""Decode throughput and time to first token on an NVIDIA GPU through MLX's CUDA backend: our
plugin vs plain mlx-lm, and the paged GPU attention kernel's CUDA dialect vs the reference.

Run through ``benchmarks/cuda_h200.sh`` (it packs what must travel and runs ``device`` on the
lent H200). Subcommands:

* ``expected DIR`` (here, MLX's CPU backend): writes the tiny fp32 test checkpoint
  (``tests/tiny_models.py``, llama family, seed 0) to ``DIR/tiny`` and the greedy token ids our
  plugin produces for it through ``LLM.generate`` to ``DIR/expected.json``.
* ``expected-moe DIR`` (here): tiny fp32 mixture-of-experts checkpoints (``qwen3_moe``,
  ``mixtral``: :func:`tiny_moe_config`) in ``DIR/tiny_moe/`` and our plugin's greedy ids for
  them in ``DIR/expected_moe.json``; the device's greedy check serves them too.
* ``device DIR OUT`` (on the GPU machine, ``DIR`` holding what ``expected`` wrote):

  1. device facts: ``mx.default_device()``, ``mx.device_info()``, copy bandwidth (an
     elementwise pass over 2 GiB of bf16, bytes read + written), and whether the KV write
     (``KVPool.write`` on an MLX-owned pool: a scatter whose input buffer is donated) updates
     in place: its time on a 4 GiB pool against one full copy of that pool;
  2. greedy check: the tiny checkpoint through our plugin on the GPU, token ids compared with
     the CPU backend's (``expected.json``); the engine runs with ``--gpu-memory-utilization``
     so the CUDA memory budget is exercised (its log line is printed);
  3. a random-weight Qwen3-0.6B-shaped bf16 checkpoint built on the device (596M parameters,
     28 layers, hidden 1024, 16 heads / 8 KV heads of 128, vocab 151936, tied embeddings);
     or, with ``CUDA_BENCH_MODEL``, a Qwen3-30B-A3B-shaped mixture-of-experts one
     (:func:`build_qwen3_moe`, bf16 or mlx-lm's 4-bit);
  4. the paged GPU attention kernel's CUDA dialect (``kv/gpu/paged.py``, through
     ``paged_gpu_attention``: decode rows, prefill tiles, fresh chunks routed to MLX's SDPA)
     against the pure-MLX reference on the grid of ``tests/gpu_attention_grid.py`` (the one the
     Metal dialect is emulated on; every unowned slot NaN): max abs error per case, fp32 and
     bf16 on the whole grid, fp16 on its mixed steps; the quantized-KV kernels'
     CUDA dialect (``kv/gpu/quant_write.py``: bytes against the numpy reference of vLLM's
     write, ``kv/gpu/paged_quant.py``: max abs error against the reference over the
     dequantized pool; ``tests/gpu_kv_quant_grid.py``), worst per format in the JSON's
     ``kvquant_grid``; then attention alone, one 28-layer step:
     decode at 650-token contexts and a 512-token chunk after 1,536 cached tokens, our kernel
     over a paged pool against MLX's SDPA over contiguous keys;
  5. per engine mode (``CUDA_BENCH_MODES``, default ``compiled,eager``: pure-decode steps
     through ``mx.compile`` or built in Python every step, ``VLLM_UNIFIED_COMPILE_DECODE``;
     ``unfused``: compiled with ``VLLM_UNIFIED_FUSE_PROJECTIONS=0``; ``nothread``: compiled
     with ``VLLM_UNIFIED_ENCODE_THREAD=0``),
     one ``LLM`` with async scheduling on the same checkpoint, and ``CUDA_BENCH_ROUNDS``
     (default 3) interleaved rounds. In each round, for B = 1, 16, 64: first plain mlx-lm in
     a fresh Python process of its own while the engine waits (B prompts of 512 random
     tokens prefilled into mlx-lm's KV cache, then the decode loop of ``mlx_lm.generate``'s
     ``generate_step``: the next step queued with ``mx.async_eval`` before the previous
     token is read back, ms/step over 128 steps after 8 warm-up steps), then ours through
     ``LLM.generate`` (B prompts of 512 random tokens, greedy, ``ignore_eos``: decode
     ms/step = (t(144) - t(16)) / 128 from two runs whose prefill cancels; the engine's own
     decode step period and its breakdown from ``runner_stats``); the first round starts
     with a warm-up run per B. Each round's ratio is ours tok/s / mlx-lm tok/s measured back
     to back, so machine-to-machine noise (large between fresh machines) cancels in it.
     Each round ends with time to first token of one 2,048-token prompt (random ids,
     prefix caching off): plain mlx-lm (in the same fresh process as its decode: one warm-up,
     then ``TTFT_REPS`` prompts through ``mlx_lm.generate.generate_step`` until the first
     token is on the host) and ours (``LLM.generate`` with ``max_tokens=1``, ``TTFT_REPS``
     prompts after a warm-up); the round's TTFT ratio is mlx-lm's median / ours (>= 1: ours no
     slower). Before the engines, plain mlx-lm runs once with no engine alive, as a control for
     the idle engine's presence;
  6. a table per mode and batch: medians over the rounds of both contenders' ms/step and of
     the ratio (with its range), the step breakdown, and the weight-read roofline (bf16
     weight bytes / measured copy bandwidth).

  Writes ``OUT/cuda_decode.json`` with every figure. ``CUDA_BENCH_CHECK_ONLY=1`` stops after
  steps 1, 2 and 4 (no checkpoint, no engines); ``CUDA_BENCH_SKIP_CHECKS=1`` skips step 2 and
  the grid (for a second call after a check-only one), ``CUDA_BENCH_SKIP_CHECKS=dense_grid``
  the dense kernel's grid only (the quantized-KV kernels' check runs),
  ``CUDA_BENCH_SKIP_CHECKS=grid`` the grid
  only (the kernel unchanged since a run that checked it), ``prologue`` the q/k prologue
  kernels' check (``prologue_check``: the query prologue of the attention kernel on the
  grid's decode steps and the prologue KV write, against the pure-MLX oracle; it runs right
  after the GEMM check, also with ``1``).
* ``engine SPEC OUT`` (internal): one ``LLM`` in its own process (each engine gets a fresh
  process so the GPU memory of one is free for the next).
* ``mlx_lm CKPT OUT B...`` (internal): plain mlx-lm's decode loop for each batch size B, in a
  process of its own, figures to ``OUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
COMPILE_ENV = "VLLM_UNIFIED_COMPILE_DECODE"  # envs.COMPILE_DECODE_ENV, set for children
FUSE_ENV = "VLLM_UNIFIED_FUSE_PROJECTIONS"  # envs.FUSE_PROJECTIONS_ENV
THREAD_ENV = "VLLM_UNIFIED_ENCODE_THREAD"  # envs.ENCODE_THREAD_ENV
#: engines to run, comma-separated: "compiled" (the default forward), "eager" (no mx.compile),
#: "unfused" (compiled, q/k/v and gate/up as separate matmuls) and/or "nothread" (compiled,
#: queued steps evaluated on the engine's thread); a mode may end in "@VAR=VALUE" terms (e.g.
#: "compiled@MLX_MAX_OPS_PER_BUFFER=1000") that set environment variables for our engine only
MODES_ENV = "CUDA_BENCH_MODES"
#: set in an engine's environment: the "@VAR" names of its mode, removed for plain mlx-lm
ENGINE_ONLY_ENV = "CUDA_BENCH_ENGINE_ONLY"
#: this process's environment before the engine starts in it: plain mlx-lm runs with it
BASE_ENV = dict(os.environ)
#: 1: stop after the device facts, the greedy check and the kernel grid (no engines)
CHECK_ONLY_ENV = "CUDA_BENCH_CHECK_ONLY"
#: 1: skip the greedy check and the kernel grid (a CHECK_ONLY run on this machine did them)
SKIP_CHECKS_ENV = "CUDA_BENCH_SKIP_CHECKS"


def _skipped() -> set[str]:
    """What ``CUDA_BENCH_SKIP_CHECKS`` skips, comma-separated: ``1`` (the greedy checks and
    both grids), ``dense_greedy`` (the tiny dense model's greedy check; the MoE ones run),
    ``grid`` (both grids), ``dense_grid``, ``gemm`` (the decode GEMM check),
    ``prologue`` (the q/k prologue kernels' check), ``attention`` (attention alone)."""
    return set(filter(None, os.environ.get(SKIP_CHECKS_ENV, "").split(",")))
#: interleaved rounds of (mlx-lm, ours) per batch size in each engine
ROUNDS = int(os.environ.get("CUDA_BENCH_ROUNDS", "3"))
PROMPT_LEN = 512
#: the time-to-first-token prompt, and prompts timed per contender and round
TTFT_LEN = 2048
TTFT_REPS = 3
#: chunk lengths of the attention timing (a chunk whose context ends at 2,048 tokens)
CHUNK_ROWS = (4, 8, 16, 32, 64, 512)
BATCHES = tuple(int(b) for b in os.environ.get("CUDA_BENCH_BATCHES", "1,16,64").split(","))
#: the benchmarked checkpoint, built on the device: "qwen3" (Qwen3-0.6B-shaped, bf16),
#: "qwen3_moe" (Qwen3-30B-A3B-shaped with MOE_LAYERS layers, bf16) or "qwen3_moe_4bit" (the
#: same weights quantized by mlx-lm: affine 4-bit, groups of 64, routers at 8 bits)
MODEL_ENV = "CUDA_BENCH_MODEL"
MODELS = ("qwen3", "qwen3_moe", "qwen3_moe_4bit")
#: 1: the MoE checkpoint at a few-MB shape (2 layers, 8 experts, top-2, hidden 256), in the
#: engine dtype CUDA_BENCH_DTYPE: for checking this script on MLX's CPU backend
MOE_SMALL_ENV = "CUDA_BENCH_MOE_SMALL"
#: 0: skip the control runs of plain mlx-lm with no engine alive (before and after the engines)
CONTROL_ENV = "CUDA_BENCH_CONTROL"
#: the engines' and the checkpoint's dtype (float32 for MoE on MLX's CPU backend)
DTYPE = os.environ.get("CUDA_BENCH_DTYPE", "bfloat16")
MLX_LM_STEPS = 128
SHORT, LONG = 16, 144
GREEDY_TOKENS = 32
GREEDY_LENGTHS = (6, 7, 13, 33, 60, 100, 200, 250)

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "use_sliding_window": False,
}

#: Qwen3-30B-A3B's shape with 8 of its 48 layers (5.6B parameters, 0.9B active per token)
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 8,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "use_sliding_window": False, "sliding_window": None,
}
QWEN3_MOE_SMALL = {**QWEN3_MOE, "hidden_size": 256, "intermediate_size": 512,
                   "moe_intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
                   "num_experts_per_tok": 2}
#: tiny fp32 mixture-of-experts checkpoints of the greedy check (``expected-moe``): odd expert
#: counts, top-2, untied heads, a 4,096-token vocabulary (SmolLM2's tokenizer, prompts below it)
#: so they travel in a few MB; qwen3_moe with a dense first layer
TINY_MOE_VOCAB = 4096


# --------------------------------------------------------------------------- engine process

def engine_main(spec_path: str, out_path: str) -> None:
    """Run one ``LLM`` as ``spec`` says: ``greedy`` prompts and/or ``bench`` batch sizes."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], **spec["engine"])
    result: dict = {}
    if "greedy" in spec:
        g = spec["greedy"]
        params = SamplingParams(temperature=0.0, max_tokens=g["max_tokens"], ignore_eos=True,
                                logprobs=g.get("logprobs"))
        outs = llm.generate([{"prompt_token_ids": p} for p in g["prompts"]], params,
                            use_tqdm=False)
        result["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
        if g.get("logprobs"):  # top-2 gap per step: how close a divergence was to a tie
            result["top2_gap"] = [
                [_top2_gap(step) for step in o.outputs[0].logprobs] for o in outs]
    if "bench" in spec:
        result["rounds"], result["ttft_rounds"] = _interleaved(llm, SamplingParams,
                                                               spec["bench"])
    result["stats"] = llm.collective_rpc("runner_stats")[0]
    Path(out_path).write_text(json.dumps(result))


def _top2_gap(step: dict) -> float:
    lps = sorted((lp.logprob for lp in step.values()), reverse=True)
    return float(lps[0] - lps[1]) if len(lps) > 1 else float("inf")


def _interleaved(llm, sampling_params, cfg: dict) -> tuple[list[list[dict]], list[dict]]:
    """``cfg["rounds"]`` rounds; in each, plain mlx-lm for every batch size and its time to
    first token in a fresh Python process of its own (while this engine waits, idle), then our
    engine for every batch size and its time to first token: both contenders see the same
    machine state, round after round. Returns the decode rounds and the TTFT rounds."""
    rounds, ttft = [], []
    for r in range(cfg["rounds"]):
        plain = run_mlx_lm(Path(cfg["checkpoint"]), cfg["batches"], cfg["ttft_len"])
        row = []
        for b, p in zip(cfg["batches"], plain["decode"], strict=True):
            ours = _bench_batch(llm, sampling_params, b, cfg, warm=r == 0)
            row.append({"batch": b, "mlx_lm": p, "ours": ours,
                        "ratio": ours["decode_tok_s"] / p["tok_s"]})
            print(f"round {r} batch {b}: mlx-lm {p['ms_per_step']:.2f} ms/step, ours "
                  f"{ours['decode_ms_per_step']:.2f} ms/step, ratio {row[-1]['ratio']:.2f}",
                  flush=True)
        rounds.append(row)
        ours_ttft = _bench_ttft(llm, sampling_params, cfg, warm=r == 0)
        cell = {"mlx_lm": plain["ttft"], "ours": ours_ttft,
                "ratio": plain["ttft"]["ttft_s"] / ours_ttft["ttft_s"]}
        ttft.append(cell)
        print(f"round {r} TTFT ({cfg['ttft_len']} tokens): mlx-lm "
              f"{plain['ttft']['ttft_s'] * 1e3:.1f} ms, ours {ours_ttft['ttft_s'] * 1e3:.1f} ms, "
              f"mlx-lm / ours {cell['ratio']:.2f}", flush=True)
    return rounds, ttft


def run_mlx_lm(checkpoint: Path, batches: list[int], ttft_len: int = 0) -> dict:
    """Plain mlx-lm in a fresh process (``mlx_lm`` subcommand): ``{"decode": [per batch
    size], "ttft": time to first token of a ``ttft_len``-token prompt, or None when 0}``."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"mlx_lm_{os.getpid()}.json"
    env = {k: v for k, v in BASE_ENV.items()
           if k not in BASE_ENV.get(ENGINE_ONLY_ENV, "").split(",")}
    subprocess.run([sys.executable, __file__, "mlx_lm", str(checkpoint), str(out),
                    str(ttft_len), *map(str, batches)], check=True, env=env)
    return json.loads(out.read_text())


def mlx_lm_main(checkpoint: str, out: str, ttft_len: int, batches: list[int]) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(checkpoint))
    result: dict = {"ttft": mlx_lm_ttft(mx, model, ttft_len) if ttft_len else None}
    mx.clear_cache()
    result["decode"] = []
    for b in batches:
        result["decode"].append(mlx_lm_decode(mx, model, b))
        mx.clear_cache()  # its KV cache is gone with the call: free its buffers
    Path(out).write_text(json.dumps(result))


def mlx_lm_ttft(mx, model, length: int) -> dict:
    """Plain mlx-lm's time to first token: ``generate_step`` (mlx-lm's own prefill: the prompt
    but its last token, then the last token) until the first token is on the host; one
    warm-up, then the median of TTFT_REPS prompts of random ids."""
    from mlx_lm.generate import generate_step

    rng = np.random.default_rng(7)

    def once() -> float:
        prompt = mx.array(rng.integers(1000, 40000, length).astype(np.int32))
        mx.eval(prompt)
        start = time.perf_counter()
        token, _ = next(generate_step(prompt, model, max_tokens=1))  # yields token.item()
        assert isinstance(token, int)
        return time.perf_counter() - start

    once()
    times = [once() for _ in range(TTFT_REPS)]
    return {"prompt_len": length, "ttft_s": float(np.median(times)), "times_s": times}


def _bench_ttft(llm, sampling_params, cfg: dict, warm: bool) -> dict:
    """Our time to first token: ``LLM.generate`` of one ``ttft_len``-token prompt with
    ``max_tokens=1`` (prefix caching is off, ids random), median of TTFT_REPS; warm-up runs
    first in the first round (kernels for the prefill shapes)."""
    rng = np.random.default_rng(11)
    params = sampling_params(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def once() -> float:
        prompt = [{"prompt_token_ids": rng.integers(1000, 40000, cfg["ttft_len"]).tolist()}]
        start = time.perf_counter()
        outs = llm.generate(prompt, params, use_tqdm=False)
        wall = time.perf_counter() - start
        assert len(outs[0].outputs[0].token_ids) == 1
        return wall

    if warm:
        once()
        once()
    times = [once() for _ in range(TTFT_REPS)]
    return {"prompt_len": cfg["ttft_len"], "ttft_s": float(np.median(times)), "times_s": times}


def _bench_batch(llm, sampling_params, batch: int, cfg: dict, warm: bool) -> dict:
    rng = np.random.default_rng(batch)

    def run(max_tokens: int) -> tuple[float, dict]:
        prompts = [{"prompt_token_ids": rng.integers(1000, 40000, cfg["prompt_len"]).tolist()}
                   for _ in range(batch)]
        params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                 detokenize=False)
        before = llm.collective_rpc("runner_stats")[0]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.collective_rpc("runner_stats")[0]
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        delta = {k: after[k] - before[k] for k in after
                 if isinstance(after[k], (int, float)) and k in before}
        return wall, delta

    if warm:
        run(cfg["long"])  # warm-up: kernels (and compiled graphs) for these shapes
    short_wall, short = run(cfg["short"])
    long_wall, long = run(cfg["long"])
    steps = cfg["long"] - cfg["short"]
    per_step = {k: (long[k] - short[k]) / steps * 1e3
                for k in ("prepare_s", "build_s", "eval_s", "finish_s",
                          "encode_thread_s", "encode_wait_s", "read_back_s")}
    period_ms = long["decode_period_s"] / max(long["decode_steps"], 1) * 1e3
    return {
        "batch": batch, "short_wall_s": short_wall, "long_wall_s": long_wall,
        "decode_ms_per_step": (long_wall - short_wall) / steps * 1e3,
        "decode_tok_s": batch * steps / (long_wall - short_wall),
        "engine_period_ms": period_ms, "breakdown_ms": per_step,
        "forwards_long": long["forwards"],
    }


def run_engine(spec: dict, work: Path, name: str, env: dict) -> dict:
    spec_path, out_path = work / f"{name}_spec.json", work / f"{name}_out.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, __file__, "engine", str(spec_path),
                               str(out_path)], stdout=f, stderr=subprocess.STDOUT, env=env)
    lines = log.read_text().splitlines()
    for line in lines:
        if ("vllm-unified" in line and ("budget" in line or "backend" in line
                                        or "KV pool" in line or "worker on" in line
                                        or "compiled" in line or "fused" in line)
                ) or line.startswith("round "):
            print(f"  [{name}] {line.strip()[-260:]}")
    if proc.returncode != 0:
        print("\n".join(lines[-60:]))
        raise SystemExit(f"engine run {name} failed ({proc.returncode}); log {log}")
    return json.loads(out_path.read_text())


# --------------------------------------------------------------------------- expected (CPU)

def expected_main(out_dir: str) -> None:
    """Tiny fp32 checkpoint and our plugin's greedy ids on MLX's CPU backend."""
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from tiny_models import make_tiny_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folder = make_tiny_checkpoint(out, "llama", "float32", 0)
    tiny = out / "tiny"
    if tiny.exists():
        import shutil

        shutil.rmtree(tiny)
    folder.rename(tiny)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 49152, n).tolist() for n in GREEDY_LENGTHS]
    spec = {"model": str(tiny), "engine": _tiny_engine(),
            "greedy": {"prompts": prompts, "max_tokens": GREEDY_TOKENS, "logprobs": 2}}
    res = run_engine(spec, out, "tiny_cpu", os.environ.copy())
    (out / "expected.json").write_text(json.dumps({
        "prompts": prompts, "token_ids": res["greedy"], "top2_gap": res["top2_gap"]}))
    print("expected greedy ids (MLX CPU backend):", res["greedy"])


def tiny_moe_config(family: str):  # noqa: ANN201 (a transformers config)
    """The transformers config of a tiny mixture-of-experts checkpoint: ``qwen3_moe`` (6
    experts of width 48, top-2, renormalised, dense first layer, q/k norms) or ``mixtral`` (5
    experts of width 48, top-2); 2 layers, 4 query / 2 KV heads of 32."""
    import transformers

    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from tiny_models import smollm2_tokenizer

    tok = smollm2_tokenizer()
    common = dict(vocab_size=TINY_MOE_VOCAB, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, num_hidden_layers=2, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, hidden_size=64, head_dim=32, intermediate_size=96,
            moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    if family == "mixtral":  # mlx-lm's mixtral takes head_dim = hidden / heads
        return transformers.MixtralConfig(
            **common, hidden_size=128, intermediate_size=48, num_local_experts=5,
            num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 10000.0})
    raise ValueError(f"no tiny mixture-of-experts config for {family!r}")


TINY_MOE_FAMILIES = ("qwen3_moe", "mixtral")


def build_tiny_moe(folder: Path, family: str, seed: int = 0) -> Path:
    """Write the tiny fp32 checkpoint of ``family`` (:func:`tiny_moe_config`, weights as the
    tests' ``_randomize`` makes them) and SmolLM2's tokenizer into ``folder``."""
    import torch
    import transformers

    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from tiny_models import _randomize, smollm2_tokenizer

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family),
                                                         dtype=torch.float32)
    _randomize(model, family, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def expected_moe_main(out_dir: str) -> None:
    """The tiny mixture-of-experts checkpoints (``OUT/tiny_moe/<family>``) and our plugin's
    greedy ids for them on MLX's CPU backend (``OUT/expected_moe.json``: per family the
    folder relative to ``OUT``, prompts, ids and each step's top-2 logprob gap)."""
    out = Path(out_dir)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, TINY_MOE_VOCAB, n).tolist() for n in GREEDY_LENGTHS]
    families = {}
    for family in TINY_MOE_FAMILIES:
        folder = build_tiny_moe(out / "tiny_moe" / family, family)
        spec = {"model": str(folder), "engine": _tiny_engine(),
                "greedy": {"prompts": prompts, "max_tokens": GREEDY_TOKENS, "logprobs": 2}}
        res = run_engine(spec, out, f"tiny_moe_{family}_cpu", os.environ.copy())
        families[family] = {"folder": f"tiny_moe/{family}", "prompts": prompts,
                            "token_ids": res["greedy"], "top2_gap": res["top2_gap"]}
        print(f"expected greedy ids of tiny {family} (MLX CPU backend):", res["greedy"])
    (out / "expected_moe.json").write_text(json.dumps({"families": families}))


def _tiny_engine() -> dict:
    # async scheduling: on CUDA the encode thread evaluates queued steps and pure-decode
    # steps are built while it encodes the previous one (the default engine's path)
    return {"dtype": "float32", "max_model_len": 256, "seed": 0, "max_num_seqs": 4,
            "gpu_memory_utilization": 0.3, "enable_prefix_caching": False,
            "async_scheduling": True}


# --------------------------------------------------------------------------- device

def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def device_facts(mx) -> dict:
    x = mx.random.normal((2**30,)).astype(mx.bfloat16)  # 2 GiB
    mx.eval(x)

    def copy():
        mx.eval(x * 2)

    copy()
    t = _median_time(copy, 10)
    bandwidth = 2 * x.nbytes / t
    # KV write: 64 rows into a 4 GiB MLX-owned pool through the runner's own write path (the
    # in-place CUDA kernel), against MLX's plain scatter (which copies the pool on CUDA).
    from vllm_unified.kv.pool import KVPool

    pool = KVPool.allocate_mlx(num_layers=1, num_blocks=65536, block_size=16,
                               num_kv_heads=8, head_dim=128, dtype=mx.bfloat16)
    slots = mx.array(np.random.default_rng(0).choice(pool.kv[0].shape[0], 64, replace=False)
                     .astype(np.int32))
    rows = mx.random.normal((64, 8, 1, 128)).astype(mx.bfloat16)
    mx.eval(slots, rows)

    def write():
        pool.write(0, slots, rows, rows)
        mx.eval(pool.arrays())

    write()
    t_write = _median_time(write, 20)
    got = np.array(pool.kv[0][slots].astype(mx.float32))
    want = np.array(rows.squeeze(2).astype(mx.float32))
    ok = bool(np.array_equal(got[..., :128], want) and np.array_equal(got[..., 128:], want))
    # Every other slot still zero: the pool's total equals the rows' total.
    total = float(mx.sum(mx.abs(pool.kv[0].astype(mx.float32))).item())
    ok = ok and abs(total - 2 * float(np.abs(want).sum())) < 1e-3 * total
    plain = pool.kv[0]

    def scatter():
        plain[slots] = mx.concatenate([rows.squeeze(2), rows.squeeze(2)], axis=-1)
        mx.eval(plain)

    scatter()
    t_scatter = _median_time(scatter, 5)
    t_copy = _median_time(lambda: mx.eval(pool.kv[0] + 0), 5)
    info = {k: (v if isinstance(v, (int, float, str)) else str(v))
            for k, v in mx.device_info().items()}
    return {"device": str(mx.default_device()), "device_info": info,
            "copy_bandwidth_GBps": bandwidth / 1e9, "kv_pool_GiB": pool.nbytes / 2**30,
            "kv_write_64_rows_ms": t_write * 1e3, "mlx_scatter_64_rows_ms": t_scatter * 1e3,
            "kv_pool_full_copy_ms": t_copy * 1e3, "kv_write_in_place": t_write < 0.1 * t_copy,
            "kv_write_rows_correct": ok, "cuda_write_kernel": pool.cuda_write}


def _divergences(got: list[list[int]], expected: dict) -> list[dict]:
    """First differing step per prompt, with the CPU run's top-2 logprob gap there."""
    out = []
    for i, (g, c) in enumerate(zip(got, expected["token_ids"], strict=False)):
        step = next((k for k, (a, b) in enumerate(zip(g, c, strict=True)) if a != b), None)
        if step is not None:
            out.append({"prompt": i, "step": step, "gpu": g[step], "cpu": c[step],
                        "cpu_top2_gap": expected["top2_gap"][i][step]})
    return out


def _grid_module():
    """tests/gpu_attention_grid.py: next to this file on the GPU machine (``pack`` copies it),
    in ``tests/`` of a checkout."""
    for folder in (HERE, HERE.parents[1] / "tests"):
        if (folder / "gpu_attention_grid.py").exists():
            sys.path.insert(0, str(folder))
            break
    import gpu_attention_grid

    return gpu_attention_grid


def kernel_grid_check(mx) -> dict:
    """The paged GPU kernel's CUDA dialect against the pure-MLX reference on the grid of
    tests/gpu_attention_grid.py (fp32 and bf16 whole, fp16 on the mixed steps, and the option
    grid: soft-capping and sinks): max abs error per case, the worst per dtype, and whether
    every case is within its tolerance."""
    from vllm_unified.kv.gpu.paged import paged_gpu_attention

    grid = _grid_module()
    cases = grid.grid(("float32", "bfloat16")) + [
        c for c in grid.grid(("float16",)) if c.kind == "mixed"] + grid.option_grid()

    def attend(q, pool, meta, scale, window, fresh, max_chunk, **options):
        return paged_gpu_attention("cuda", q, pool, meta, scale, window, fresh, max_chunk,
                                   **options)

    start = time.perf_counter()
    errors, failed = {}, []
    for case in cases:
        try:
            err = grid.max_error(case, attend)
        except Exception as exc:  # reported per case; the others still run
            errors[case.name] = repr(exc)
            failed.append(case.name)
            continue
        errors[case.name] = err
        if not err <= grid.TOLERANCE[case.dtype]:  # NaN fails too
            failed.append(case.name)
    worst = {}
    for dtype in sorted({c.dtype for c in cases}):
        errs = [errors[c.name] for c in cases if c.dtype == dtype]
        finite = all(isinstance(e, float) and np.isfinite(e) for e in errs)
        worst[dtype] = max(errs) if finite else float("nan")
    return {"cases": len(cases), "elapsed_s": time.perf_counter() - start,
            "worst_max_abs_error": worst, "failed": failed,
            "all_within_tolerance": not failed, "tolerance": grid.TOLERANCE,
            "max_abs_error": errors}


def chunk_check(mx) -> dict:
    """The paged GPU kernel's CUDA dialect with an attention chunk (chunked local attention)
    against the pure-MLX reference, on the cases tests/test_chunked_attention.py runs the Metal
    instance on (step kinds x chunk 16 / 5 x window none / 16 x kernel / split route, fp32)."""
    from vllm_unified.kv.attention.reference import paged_attention_kv
    from vllm_unified.kv.gpu.paged import paged_gpu_attention

    grid = _grid_module()
    start = time.perf_counter()
    errors, failed = {}, []
    for kind in ("mixed", "decode", "prefill"):
        for chunk in (16, 5):
            for window in (None, 16):
                for route in ("kernel", "split"):
                    name = f"{kind}-c{chunk}-w{window}-{route}"
                    b = grid.build(grid.Case(kind=kind, dim=64, group=3, kv_heads=2,
                                             block_size=16, window=window, dtype="float32",
                                             route=route, seed=chunk))
                    with mx.stream(mx.cpu):
                        want = np.array(paged_attention_kv(b.queries, b.pool, b.meta, b.scale,
                                                           window, chunk=chunk))
                    got = np.array(paged_gpu_attention(
                        "cuda", b.queries, b.pool, b.meta, b.scale, window, b.fresh,
                        grid.EVERY_ROW if route == "kernel" else None, chunk=chunk))
                    err = float(np.abs(got - want).max())
                    errors[name] = err
                    if not err <= grid.TOLERANCE["float32"]:  # NaN fails too
                        failed.append(name)
    return {"cases": len(errors), "elapsed_s": time.perf_counter() - start,
            "worst_max_abs_error": max(errors.values()), "failed": failed,
            "all_within_tolerance": not failed, "tolerance": grid.TOLERANCE["float32"],
            "max_abs_error": errors}


def prologue_check(mx) -> dict:
    """The q/k prologue's CUDA instances (kv/attention/qk_prologue.py) against the pure-MLX
    oracle, on the cases the CPU tests run the Metal instances on
    (``tests/gpu_attention_grid.py``): the attention kernel's query prologue on the grid's
    decode steps (max abs error per case, within the grid's tolerance) and the prologue KV
    write (worst error in units of ``WRITE_TOLERANCE``, <= 1 passes; cells outside the
    written rows unchanged)."""
    from vllm_unified.kv.gpu.paged import paged_gpu_attention
    from vllm_unified.kv.gpu.write import write_kv_qk_gpu

    grid = _grid_module()
    start = time.perf_counter()
    attention, writes, failed = {}, {}, []

    def attend(q, pool, meta, scale, window, prologue):
        return paged_gpu_attention("cuda", q, pool, meta, scale, window, prologue=prologue)

    def write(pool, slots, keys, values, positions, prologue):
        return write_kv_qk_gpu(pool, slots, keys, values, positions, prologue, dialect="cuda")

    for case, rope, norm in grid.prologue_grid():
        name = f"{case.name}-rope{rope}-norm{int(norm)}"
        try:
            err = grid.prologue_max_error(case, rope, norm, attend)
        except Exception as exc:  # reported per case; the others still run
            attention[name], err = repr(exc), float("nan")
        else:
            attention[name] = err
        if not err <= grid.TOLERANCE[case.dtype]:
            failed.append(name)
    for case in grid.write_cases():
        try:
            worst, kept = grid.write_error(case, write)
        except Exception as exc:
            writes[case.name], worst, kept = repr(exc), float("nan"), False
        else:
            writes[case.name] = {"worst_in_tolerances": worst, "others_unchanged": kept}
        if not (worst <= 1 and kept):
            failed.append(case.name)
    finite = [e for e in attention.values() if isinstance(e, float)]
    return {"attention_cases": len(attention), "write_cases": len(writes),
            "elapsed_s": time.perf_counter() - start,
            "worst_attention_error": max(finite) if finite else None,
            "worst_write_in_tolerances": max(
                (w["worst_in_tolerances"] for w in writes.values() if isinstance(w, dict)),
                default=None),
            "failed": failed, "all_within_tolerance": not failed,
            "attention_max_abs_error": attention, "writes": writes}


#: the decode GEMM kernel's cases: (K, part widths, bias), Qwen3-0.6B's linears (q/k/v with
#: a bias as Qwen2's), and the tied output head
GEMM_SHAPES = ((1024, (2048, 1024, 1024), False), (1024, (2048, 1024, 1024), True),
               (2048, (1024,), False), (1024, (3072, 3072), False), (3072, (1024,), False),
               (1024, (151936,), False))
GEMM_ROWS = (2, 3, 7, 8, 9, 16, 31, 33, 64)


def _bound_ratio(mx, got, ref, scale, mantissa: int, k: int) -> float:
    """Largest ``|got - ref|`` over its a-priori bound, elementwise: one rounding to the
    output dtype (``2^-mantissa * |ref|``) plus twice fp32's summation error of any order
    (``k * 2^-24 * sum_k |x_k w_k|``, Higham, "Accuracy and Stability of Numerical
    Algorithms", 3.1). At most 1 for a correct product in any summation order; a wrong
    element or a mismatched k gives errors of the order of ``scale`` itself."""
    bound = 2.0 ** -mantissa * mx.abs(ref) + 2 * k * 2.0 ** -24 * scale
    return float(mx.max(mx.abs(got - ref) / bound).item())


def gemm_check(mx) -> dict:
    """The decode GEMM kernel (:mod:`vllm_unified.models.gpu_gemm`) against the fp32 product
    as a ratio to the error bound of :func:`_bound_ratio` (pass: at most 1), with MLX's own
    matmul in the same units; then the host cost of a 28-layer chain of Qwen3-0.6B's
    matmuls, ours against MLX's."""
    from vllm_unified.models.gpu_gemm import gemm

    rng = np.random.default_rng(0)
    cases, failed = {}, []
    for dtype, mantissa in ((mx.bfloat16, 7), (mx.float16, 10)):
        for k, sizes, has_bias in GEMM_SHAPES:
            n = sum(sizes)
            w = mx.array(rng.standard_normal((n, k), np.float32) / np.sqrt(k)).astype(dtype)
            b = mx.array(rng.standard_normal(n, np.float32)).astype(dtype) if has_bias else None
            for rows in GEMM_ROWS:
                x = mx.array(rng.standard_normal((rows, k), np.float32)).astype(dtype)
                ref = x.astype(mx.float32) @ w.astype(mx.float32).T
                scale = mx.abs(x.astype(mx.float32)) @ mx.abs(w.astype(mx.float32)).T
                mine = (x @ w.T) if b is None else mx.addmm(b, x, w.T)
                if b is not None:
                    ref = ref + b.astype(mx.float32)
                name = f"{dtype}-K{k}-{'+'.join(map(str, sizes))}{'-bias' if has_bias else ''}" \
                       f"-M{rows}"
                try:
                    outs = gemm(x, w, sizes, b)
                    got = mx.concatenate([o.astype(mx.float32) for o in outs], axis=-1)
                    err = _bound_ratio(mx, got, ref, scale, mantissa, k)
                except Exception as exc:  # reported per case; the others still run
                    cases[name] = repr(exc)
                    failed.append(name)
                    continue
                cases[name] = {"ours": err,
                               "mlx": _bound_ratio(mx, mine.astype(mx.float32), ref, scale,
                                                   mantissa, k)}
                if not err <= 1.0:
                    failed.append(name)
    worst = max((c["ours"] for c in cases.values() if isinstance(c, dict)), default=None)
    worst_mlx = max((c["mlx"] for c in cases.values() if isinstance(c, dict)), default=None)
    return {"cases": len(cases), "failed": failed, "worst_bound_ratio": worst,
            "worst_mlx_bound_ratio": worst_mlx, "per_case": cases, "chain": _gemm_chain(mx)}


def _gemm_chain(mx) -> list[dict]:
    """Host time to build and to encode (``mx.async_eval``) one step's chain of Qwen3-0.6B's
    matmuls (28 x q/k/v, o, gate/up, down, then the head), and the step's wall time, ms:
    through the kernel and through MLX's matmul, B = 1 (MLX only: its gemv), 16, 64."""
    from vllm_unified.models.gpu_gemm import gemm

    rng = np.random.default_rng(1)

    def weight(n, k):
        return mx.array(rng.standard_normal((n, k), np.float32) / np.sqrt(k)).astype(
            mx.bfloat16)

    layers = [(weight(4096, 1024), weight(1024, 2048), weight(6144, 1024), weight(1024, 3072))
              for _ in range(28)]
    head = weight(151936, 1024)
    mx.eval(layers, head)

    def mlx_parts(x, w, sizes):
        y = x @ w.T
        bounds = np.cumsum((0, *sizes))
        return [y[:, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def step(x, parts):
        h = x
        for qkv, o, gu, d in layers:
            q, _, _ = parts(h, qkv, (2048, 1024, 1024))
            h = h + parts(q, o, (1024,))[0]
            g, u = parts(h, gu, (3072, 3072))
            h = h + parts(g * u, d, (1024,))[0]
        return parts(h, head, (151936,))[0]

    out = []
    for rows in (1, 16, 64):
        x = mx.array(rng.standard_normal((rows, 1024), np.float32)).astype(mx.bfloat16)
        for name, parts in (("mlx", mlx_parts), ("ours", lambda a, w, s: gemm(a, w, s))):
            if name == "ours" and rows == 1:
                continue
            build = encode = wall = 0.0
            reps = 20
            for i in range(reps + 3):
                t0 = time.perf_counter()
                y = step(x, parts)
                t1 = time.perf_counter()
                mx.async_eval(y)
                t2 = time.perf_counter()
                mx.eval(y)
                t3 = time.perf_counter()
                if i >= 3:
                    build, encode, wall = build + t1 - t0, encode + t2 - t1, wall + t3 - t0
            out.append({"rows": rows, "path": name, "build_ms": build / reps * 1e3,
                        "encode_ms": encode / reps * 1e3, "wall_ms": wall / reps * 1e3})
            print("gemm chain:", out[-1], flush=True)
    return out


def _quant_grid_module():
    """tests/gpu_kv_quant_grid.py, found as :func:`_grid_module` finds its sibling."""
    _grid_module()
    import gpu_kv_quant_grid

    return gpu_kv_quant_grid


def kvquant_check(mx) -> dict:
    """The quantized-KV GPU kernels' CUDA dialect: the quantizing write
    (``kv/gpu/quant_write.py``) against the numpy reference bytes
    (``kv/quant.quantize_cells_reference``, equal to the native write and vLLM's kernels in the
    CPU tests) on ``gpu_kv_quant_grid.write_cases()`` (bytes that differ per case, 0 expected),
    and the paged attention over quantized pages (``kv/gpu/paged_quant.py``, through
    ``paged_gpu_attention_quant``) against the pure-MLX reference over the dequantized pool on
    ``gpu_kv_quant_grid.grid()`` and ``option_grid()`` (soft-capping, sinks) (fp32 and bf16;
    max abs error per case). Worst figures per format (and per dtype for the attention)."""
    from vllm_unified.kv.gpu.paged_quant import paged_gpu_attention_quant
    from vllm_unified.kv.gpu.quant_write import write_kv_quant_gpu
    from vllm_unified.kv.quant import kv_format

    q = _quant_grid_module()
    start = time.perf_counter()
    write: dict = {}
    failed = []
    for case in q.write_cases():
        try:
            inp = q.write_inputs(case)
            fmt = kv_format(case.mode)
            out = write_kv_quant_gpu(inp.pool, inp.slots, inp.keys, inp.values, fmt,
                                     q.signs_for(case.mode, case.dim), dialect="cuda")
            mx.eval(out)
            bad = int((q.pool_bytes(out) != inp.expected).sum())
        except Exception as exc:  # reported per case; the others still run
            write[case.name] = repr(exc)
            failed.append(case.name)
            continue
        write[case.name] = bad
        if bad:
            failed.append(case.name)

    def attend(qs, pool, meta, scale, window, fmt, signs, max_chunk, fresh, **options):
        return paged_gpu_attention_quant("cuda", qs, pool, meta, scale, window, fmt, signs,
                                         max_chunk, fresh, **options)

    attention: dict = {}
    cases = q.grid(("float32", "bfloat16")) + q.option_grid()
    for case in cases:
        try:
            err = q.max_error(case, attend)
        except Exception as exc:
            attention[case.name] = repr(exc)
            failed.append(case.name)
            continue
        attention[case.name] = err
        if not err <= q.TOLERANCE[case.dtype]:  # NaN fails too
            failed.append(case.name)
    worst_write = {}
    for mode in q.MODES:
        got = [write[c.name] for c in q.write_cases() if c.mode == mode]
        worst_write[mode] = max(got) if all(isinstance(b, int) for b in got) else "error"
    worst_attention: dict = {}
    for mode in q.MODES:
        for dtype in ("float32", "bfloat16"):
            errs = [attention[c.name] for c in cases if c.mode == mode and c.dtype == dtype]
            finite = all(isinstance(e, float) and np.isfinite(e) for e in errs)
            worst_attention[f"{mode}/{dtype}"] = max(errs) if finite else float("nan")
    return {"write_cases": len(write), "attention_cases": len(cases),
            "elapsed_s": time.perf_counter() - start,
            "worst_write_bytes_differing": worst_write,
            "worst_attention_max_abs_error": worst_attention, "failed": failed,
            "all_exact_and_within_tolerance": not failed, "tolerance": q.TOLERANCE,
            "write_bytes_differing": write, "attention_max_abs_error": attention}


def attention_timing(mx) -> dict:
    """Attention alone, one Qwen3-0.6B-shaped step (28 layers, 16 query / 8 KV heads of 128,
    bf16), ms per step (28 calls, evaluated together), median of 20: decode at 650-token
    contexts for each batch size, against MLX's SDPA over contiguous keys and values (what
    mlx-lm runs); one chunk of L rows whose context ends at 2,048 tokens, for L in
    CHUNK_ROWS: the kernel (every row), the reference's route (keys gathered from the pool,
    MLX's SDPA) and MLX's SDPA over contiguous keys (the data behind
    ``gpu_paged.MAX_KERNEL_CHUNK``)."""
    out = {"decode": [], "chunk": []}
    for b in BATCHES:
        out["decode"].append(_attention_case(mx, b))
        mx.clear_cache()
    for rows in CHUNK_ROWS:
        out["chunk"].append(_chunk_case(mx, rows, 2048))
        mx.clear_cache()
    return out


def _paged_setup(mx, qlens: list[int], slens: list[int], rng) -> tuple:
    from vllm_unified.kv.attention.metadata import build_attention_metadata

    bs, kv_heads, dim = 16, 8, 128
    per_seq = [-(-s // bs) for s in slens]
    num_blocks = sum(per_seq) + 1
    ids = rng.permutation(num_blocks - 1) + 1
    tables = np.zeros((len(slens), max(per_seq)), np.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = ids[used:used + n]
        used += n
    meta = build_attention_metadata(qlens, slens, tables, bs)
    pool = mx.random.normal((num_blocks * bs, kv_heads, 2 * dim)).astype(mx.bfloat16)
    return meta, pool


def _attention_case(mx, b: int) -> dict:
    from vllm_unified.kv.gpu.paged import paged_gpu_attention

    heads, kv_heads, dim, ctx, layers = 16, 8, 128, 650, 28
    meta, pool = _paged_setup(mx, [1] * b, [ctx] * b, np.random.default_rng(b))
    q = mx.random.normal((b, heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((b, kv_heads, ctx, dim)).astype(mx.bfloat16)
    v = mx.random.normal((b, kv_heads, ctx, dim)).astype(mx.bfloat16)
    mx.eval(pool, q, k, v, *meta.decode_tables_lens())

    def ours():
        mx.eval([paged_gpu_attention("cuda", q, pool, meta, dim ** -0.5, None)
                 for _ in range(layers)])

    def sdpa():
        mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5)
                 for _ in range(layers)])

    ours()
    sdpa()
    return {"batch": b, "ours_kernel_ms": _median_time(ours, 20) * 1e3,
            "mlx_sdpa_ms": _median_time(sdpa, 20) * 1e3}


def _chunk_case(mx, length: int, context: int) -> dict:
    from vllm_unified.kv.attention.reference import prefill_chunk_attention
    from vllm_unified.kv.gpu.paged import paged_gpu_attention, q_tile

    heads, kv_heads, dim, layers = 16, 8, 128, 28
    meta, pool = _paged_setup(mx, [length], [context], np.random.default_rng(5))
    q = mx.random.normal((length, heads, 1, dim)).astype(mx.bfloat16)
    qd = q.transpose(2, 1, 0, 3)  # [1, H, L, D], as mlx-lm's layout
    k = mx.random.normal((1, kv_heads, context, dim)).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, context, dim)).astype(mx.bfloat16)
    plan = meta.gpu_plan(q_tile(heads // kv_heads, dim), False, 1 << 30)
    mx.eval(pool, q, qd, k, v, plan.tables, plan.tiles)

    def ours():
        mx.eval([paged_gpu_attention("cuda", q, pool, meta, dim ** -0.5, None, None, 1 << 30)
                 for _ in range(layers)])

    def gathered():
        mx.eval([prefill_chunk_attention(q, pool, meta, 0, dim ** -0.5, None)
                 for _ in range(layers)])

    def sdpa():
        mx.eval([mx.fast.scaled_dot_product_attention(qd, k, v, scale=dim ** -0.5,
                                                      mask="causal") for _ in range(layers)])

    ours()
    gathered()
    sdpa()
    return {"rows": length, "context": context, "ours_kernel_ms": _median_time(ours, 20) * 1e3,
            "gather_sdpa_ms": _median_time(gathered, 20) * 1e3,
            "mlx_sdpa_ms": _median_time(sdpa, 20) * 1e3}


def build_qwen3(mx, folder: Path, tokenizer_from: Path) -> int:
    """Random-weight Qwen3-0.6B-shaped bf16 checkpoint; returns its weight bytes."""
    import shutil

    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    args = qwen3.ModelArgs.from_dict(QWEN3_06B)
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(QWEN3_06B))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return sum(v.nbytes for v in weights.values())


def build_qwen3_moe(mx, work: Path, tokenizer_from: Path,
                    bits: int | None) -> tuple[Path, int, int]:
    """Random-weight Qwen3-30B-A3B-shaped checkpoint (:data:`QWEN3_MOE`, or
    :data:`QWEN3_MOE_SMALL` when ``CUDA_BENCH_MOE_SMALL=1``) in ``DTYPE`` under ``work``: every
    matrix normal with std 0.02 (so activations stay finite and the router's scores spread
    tokens over the experts), norms one. ``bits=4``: the same weights through mlx-lm's
    ``quantize_model`` (affine, groups of 64; its ``qwen3_moe`` predicate keeps each router at
    8 bits). Returns (folder, weight bytes, bytes read per token: the expert stacks at top-k /
    experts). A folder from an earlier call with the same settings is kept."""
    import shutil

    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import quantize_model, save_model

    small = os.environ.get(MOE_SMALL_ENV) == "1"
    config = dict(QWEN3_MOE_SMALL if small else QWEN3_MOE, torch_dtype=DTYPE)
    tag = f"{'small' if small else str(config['num_hidden_layers']) + 'l'}-{DTYPE}"
    folder = work / (f"qwen3moe-random-{tag}" + ("-4bit" if bits else ""))
    dtype = getattr(mx, DTYPE)
    args = qwen3_moe.ModelArgs.from_dict(config)
    model = qwen3_moe.Model(args)  # lazy: its own initial weights are never computed
    mx.random.seed(0)

    def init(path: str, p: mx.array) -> mx.array:
        if p.ndim == 1:
            return mx.ones(p.shape, dtype=dtype)
        return (mx.random.normal(p.shape) * 0.02).astype(dtype)

    model.update(tree_map_with_path(init, model.parameters()))
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)  # one tensor at a time: no float32 copy of the whole model
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
        config["quantization_config"] = config["quantization"]
    weights = dict(tree_flatten(model.parameters()))
    total = sum(v.nbytes for v in weights.values())
    experts = sum(v.nbytes for k, v in weights.items() if ".switch_mlp." in k)
    active = total - experts + experts * args.num_experts_per_tok // args.num_experts
    if not (folder / "config.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        save_model(folder, model, donate_model=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, folder / name)
        (folder / "config.json").write_text(json.dumps(config))  # last: the folder is whole
    del model, weights
    return folder, total, active


def mlx_lm_decode(mx, model, batch: int) -> dict:
    """Plain mlx-lm: prefill ``batch`` prompts into its KV cache, then time the decode loop."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(1000, 40000, (batch, PROMPT_LEN))
    logits = model(prompt, cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)

    def step(tokens):
        out = model(tokens[:, None], cache=cache)
        return mx.argmax(out[:, -1, :], axis=-1)

    warm = 8
    start = 0.0
    for i in range(warm + MLX_LM_STEPS):
        if i == warm:
            start = time.perf_counter()
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()  # the host reads each token, as a server must
        y = nxt
    y.tolist()
    ms = (time.perf_counter() - start) / MLX_LM_STEPS * 1e3
    return {"batch": batch, "ms_per_step": ms, "tok_s": batch / ms * 1e3}


def device_main(carry: str, out_dir: str) -> None:
    # This process (the kernel grid's fp32 cases: fresh chunks go to MLX's SDPA) computes
    # fp32 matmuls in full fp32, not MLX's CUDA default TF32; the engines keep the default.
    tf32 = os.environ.get("MLX_ENABLE_TF32")
    os.environ["MLX_ENABLE_TF32"] = "0"
    import mlx.core as mx

    carry_dir, out = Path(carry), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "cuda_decode"
    work.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    if tf32 is None:
        del env["MLX_ENABLE_TF32"]
    else:
        env["MLX_ENABLE_TF32"] = tf32
    report: dict = {}

    facts = device_facts(mx)
    mx.clear_cache()  # this process's cached buffers would be missing for the engines
    report["facts"] = facts
    print("device:", json.dumps(facts, indent=1), flush=True)
    try:
        report["gemm"] = ({"skipped": f"{SKIP_CHECKS_ENV}=gemm"} if "gemm" in _skipped()
                          else gemm_check(mx))
    except Exception as err:  # reported; the engines below still run
        report["gemm"] = {"error": repr(err)}
    mx.clear_cache()
    print("decode GEMM kernel vs the fp32 product:", json.dumps(
        {k: v for k, v in report["gemm"].items() if k not in ("per_case", "chain")}),
        flush=True)

    try:
        report["qk_prologue"] = ({"skipped": f"{SKIP_CHECKS_ENV}=prologue"}
                                 if "prologue" in _skipped() else prologue_check(mx))
    except Exception as err:  # reported; the engines below still run
        report["qk_prologue"] = {"error": repr(err)}
    mx.clear_cache()
    print("q/k prologue kernels (CUDA dialect) vs the pure-MLX oracle:", json.dumps(
        {k: v for k, v in report["qk_prologue"].items()
         if k not in ("attention_max_abs_error", "writes")}), flush=True)

    if "1" in _skipped():
        _benchmark(mx, report, carry_dir, out, work, env)
        return
    report["greedy"] = ({"skipped": f"{SKIP_CHECKS_ENV}=dense_greedy"}
                        if "dense_greedy" in _skipped()
                        else greedy_dense_check(carry_dir, work, env))
    report["greedy_moe"] = greedy_moe_check(carry_dir, work, env)

    try:
        skip = _skipped() & {"grid", "dense_grid"}
        check = ({"skipped": f"{SKIP_CHECKS_ENV}={','.join(sorted(skip))}"}
                 if skip else kernel_grid_check(mx))
    except Exception as err:  # reported, and the engines below still run
        check = {"error": repr(err)}
    report["kernel_grid"] = check
    print("paged GPU kernel (CUDA dialect) vs pure-MLX reference on the grid:",
          json.dumps({k: v for k, v in check.items() if k != "max_abs_error"}), flush=True)
    try:
        quant = ({"skipped": f"{SKIP_CHECKS_ENV}=grid"}
                 if "grid" in _skipped() else kvquant_check(mx))
    except Exception as err:  # reported, and the engines below still run
        quant = {"error": repr(err)}
    report["kvquant_grid"] = quant
    try:
        chunked = ({"skipped": f"{SKIP_CHECKS_ENV}=grid"}
                   if "grid" in _skipped() else chunk_check(mx))
    except Exception as err:  # reported, and the engines below still run
        chunked = {"error": repr(err)}
    report["chunk_grid"] = chunked
    print("paged GPU kernel (CUDA dialect) with an attention chunk vs the reference:",
          json.dumps({k: v for k, v in chunked.items() if k != "max_abs_error"}), flush=True)
    print("quantized KV kernels (CUDA dialect): write vs numpy bytes, attention vs reference:",
          json.dumps({k: v for k, v in quant.items()
                      if k not in ("write_bytes_differing", "attention_max_abs_error")}),
          flush=True)
    (out / "cuda_decode.json").write_text(json.dumps(report, indent=1))
    mx.clear_cache()
    if os.environ.get(CHECK_ONLY_ENV) == "1":
        _attention_timing(mx, report)
        (out / "cuda_decode.json").write_text(json.dumps(report, indent=1))
        print_checks(report)
        return
    _benchmark(mx, report, carry_dir, out, work, env)


def greedy_dense_check(carry_dir: Path, work: Path, env: dict) -> dict:
    """The tiny fp32 checkpoint (``carry_dir/tiny``) through our plugin on the GPU: token
    ids against the CPU backend's (``expected.json``), with the divergences."""
    expected = json.loads((carry_dir / "expected.json").read_text())
    tiny = {"model": str(carry_dir / "tiny"), "engine": _tiny_engine(),
            "greedy": {"prompts": expected["prompts"], "max_tokens": GREEDY_TOKENS}}
    try:
        tiny_run = run_engine(tiny, work, "tiny_gpu", env)
        got, stats = tiny_run["greedy"], tiny_run["stats"]
    except SystemExit as err:  # reported; the benchmark still runs
        print(f"greedy tiny fp32 run failed: {err}", flush=True)
        got, stats = [], {}
    same = got == expected["token_ids"]
    result = {"gpu": got, "cpu": expected["token_ids"], "equal": same,
              "divergences": _divergences(got, expected),
              "built_alongside": stats.get("built_alongside"),
              "decode_steps": stats.get("decode_steps")}
    print(f"greedy tiny fp32, {len(got)} prompts x {GREEDY_TOKENS} tokens: GPU ids "
          f"{'==' if same else '!='} CPU ids; steps built alongside a queued one: "
          f"{stats.get('built_alongside')}", flush=True)
    for d in result["divergences"]:
        print("  divergence:", d)
    return result


def greedy_moe_check(carry_dir: Path, work: Path, env: dict) -> dict:
    """Each tiny mixture-of-experts checkpoint of ``expected_moe.json`` (unpacked next to it
    from ``tiny_moe.tar.xz``) through our plugin on the GPU: token ids against the CPU
    backend's, per family; a family that differs runs again with ``MLX_ENABLE_TF32=0``
    (``full_fp32``). ``{}`` when the carry holds none."""
    import tarfile

    path = carry_dir / "expected_moe.json"
    if not path.is_file():
        print(f"greedy tiny MoE check skipped: no {path}", flush=True)
        return {}
    if (carry_dir / "tiny_moe.tar.xz").is_file():
        with tarfile.open(carry_dir / "tiny_moe.tar.xz", "r:xz") as t:
            t.extractall(work, filter="fully_trusted")
    out = {}
    for family, exp in json.loads(path.read_text())["families"].items():
        folder = work / exp["folder"]
        spec = {"model": str(folder), "engine": _tiny_engine(),
                "greedy": {"prompts": exp["prompts"], "max_tokens": GREEDY_TOKENS}}
        try:
            got = run_engine(spec, work, f"tiny_moe_{family}_gpu", env)["greedy"]
        except SystemExit as err:  # reported; the other families still run
            print(f"greedy tiny {family} run failed: {err}", flush=True)
            out[family] = {"error": str(err)}
            continue
        same = got == exp["token_ids"]
        out[family] = {"gpu": got, "cpu": exp["token_ids"], "equal": same,
                       "divergences": _divergences(got, exp)}
        print(f"greedy tiny {family} fp32, {len(got)} prompts x {GREEDY_TOKENS} tokens: GPU "
              f"ids {'==' if same else '!='} CPU ids", flush=True)
        for d in out[family]["divergences"]:
            print("  divergence:", d)
        if not same and env.get("MLX_ENABLE_TF32") != "0":
            # MLX's CUDA backend computes fp32 matmuls in TF32 by default: the same run in
            # full fp32 tells rounding from a wrong result
            try:
                full = run_engine(spec, work, f"tiny_moe_{family}_gpu_fp32",
                                  {**env, "MLX_ENABLE_TF32": "0"})["greedy"]
            except SystemExit as err:
                out[family]["full_fp32"] = {"error": str(err)}
                continue
            out[family]["full_fp32"] = {"gpu": full, "equal": full == exp["token_ids"],
                                        "divergences": _divergences(full, exp)}
            print(f"  with MLX_ENABLE_TF32=0: GPU ids "
                  f"{'==' if full == exp['token_ids'] else '!='} CPU ids", flush=True)
    return out


def _attention_timing(mx, report: dict) -> None:
    if "attention" in _skipped():
        report["attention_timing"] = {"skipped": f"{SKIP_CHECKS_ENV}=attention"}
        return
    try:
        report["attention_timing"] = attention_timing(mx)
    except Exception as err:  # reported; the engines below still run
        report["attention_timing"] = {"error": repr(err)}
    print("attention alone, one 28-layer step:", json.dumps(report["attention_timing"]),
          flush=True)
    mx.clear_cache()


def _benchmark(mx, report: dict, carry_dir: Path, out: Path, work: Path, env: dict) -> None:
    """Steps 3 to 6 for each checkpoint of ``CUDA_BENCH_MODEL`` (comma-separated): one model
    writes ``OUT/cuda_decode.json``, several ``OUT/cuda_decode-<model>.json`` each (the checks'
    figures in every one)."""
    names = os.environ.get(MODEL_ENV, "qwen3").split(",")
    for name in names:
        if name not in MODELS:
            raise SystemExit(f"{MODEL_ENV}={name!r}: one of {', '.join(MODELS)}")
    for name in names:
        dest = out / ("cuda_decode.json" if len(names) == 1 else f"cuda_decode-{name}.json")
        _benchmark_model(mx, dict(report), carry_dir, dest, work, env, name)
        mx.clear_cache()


def _tokenizer_folder(carry_dir: Path, work: Path) -> Path:
    """A folder holding SmolLM2's tokenizer for a benchmark checkpoint: the tiny dense
    checkpoint when the carry has it, else the tiny qwen3_moe one (from ``tiny_moe.tar.xz``,
    unpacked into ``work`` if the greedy check has not done so)."""
    import tarfile

    if (carry_dir / "tiny").is_dir():
        return carry_dir / "tiny"
    folder = work / "tiny_moe" / "qwen3_moe"
    if not (folder / "tokenizer.json").is_file():
        with tarfile.open(carry_dir / "tiny_moe.tar.xz", "r:xz") as t:
            t.extractall(work, filter="fully_trusted")
    return folder


def _benchmark_model(mx, report: dict, carry_dir: Path, dest: Path, work: Path, env: dict,
                     name: str) -> None:
    """The checkpoint ``name`` (built on the device), attention alone, the engines' rounds;
    figures to ``dest``."""
    facts = report["facts"]
    if name == "qwen3":
        ckpt = work / "qwen3-0.6b-random-bf16"
        weight_bytes = active_bytes = build_qwen3(mx, ckpt, carry_dir / "tiny")
    else:
        ckpt, weight_bytes, active_bytes = build_qwen3_moe(
            mx, work, _tokenizer_folder(carry_dir, work),
            bits=4 if name.endswith("4bit") else None)
    mx.clear_cache()
    # a decode step at batch 1 reads the weights a token uses (its top-k experts)
    roofline_ms = active_bytes / (facts["copy_bandwidth_GBps"] * 1e9) * 1e3
    report["model"], report["checkpoint"] = name, str(ckpt)
    report["weight_bytes"], report["active_weight_bytes"] = weight_bytes, active_bytes
    report["roofline_ms"] = roofline_ms
    print(f"checkpoint {ckpt}: {weight_bytes / 1e9:.3f} GB of weights, "
          f"{active_bytes / 1e9:.3f} GB read per token; weight-read roofline at batch 1 "
          f"{roofline_ms:.3f} ms/step", flush=True)

    _attention_timing(mx, report)
    # Control: plain mlx-lm with no engine process alive (the rounds below run it while an
    # idle engine holds its own CUDA context and memory), before and after the engines.
    control = os.environ.get(CONTROL_ENV, "1") == "1"
    if control:
        report["mlx_lm_alone"] = run_mlx_lm(ckpt, list(BATCHES))
        print("plain mlx-lm, no engine alive:", report["mlx_lm_alone"], flush=True)

    engine = {"dtype": DTYPE, "max_model_len": 4096, "seed": 0,
              "max_num_seqs": max(BATCHES), "max_num_batched_tokens": 8192,
              "kv_cache_memory_bytes": 16 * 2**30, "enable_prefix_caching": False,
              "async_scheduling": True}
    bench = {"batches": list(BATCHES), "prompt_len": PROMPT_LEN, "short": SHORT, "long": LONG,
             "rounds": ROUNDS, "checkpoint": str(ckpt), "ttft_len": TTFT_LEN}
    # Each engine: decode attention by the CUDA kernel, KV written in place; pure-decode steps
    # compiled (the default) or built in Python every step. mlx-lm is measured inside each
    # engine's process, interleaved with it.
    for mode in os.environ.get(MODES_ENV, "compiled,eager").split(","):
        spec = {"model": str(ckpt), "engine": engine, "bench": bench}
        base, *terms = mode.split("@")
        extra = dict(term.split("=", 1) for term in terms)
        try:
            ours = run_engine(spec, work, f"{name}_gpu_{mode}",
                              {**env, COMPILE_ENV: "0" if base == "eager" else "1",
                               FUSE_ENV: "0" if base == "unfused" else "1",
                               THREAD_ENV: "0" if base == "nothread" else "1",
                               **extra, ENGINE_ONLY_ENV: ",".join(extra)})
        except SystemExit as err:
            print(f"ours ({mode}) failed: {err}", flush=True)
            continue
        report[f"rounds_{mode}"] = ours["rounds"]
        report[f"ttft_rounds_{mode}"] = ours["ttft_rounds"]
        report[f"ttft_summary_{mode}"] = summarize_ttft(ours["ttft_rounds"])
        report[f"stats_{mode}"] = ours["stats"]
        report[f"summary_{mode}"] = summarize(ours["rounds"])
        dest.write_text(json.dumps(report, indent=1))
    if control:
        report["mlx_lm_alone_after"] = run_mlx_lm(ckpt, list(BATCHES))
    dest.write_text(json.dumps(report, indent=1))
    print_table(report)


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Per batch size: medians over the rounds of each contender's ms/step, of the ratio
    (ours tok/s / mlx-lm tok/s, each round's pair measured back to back) and of ours' step
    breakdown; the ratio's range."""
    out = []
    for k, first in enumerate(rounds[0]):
        cells = [r[k] for r in rounds]
        ratios = [c["ratio"] for c in cells]
        plain_ms = float(np.median([c["mlx_lm"]["ms_per_step"] for c in cells]))
        ours_ms = float(np.median([c["ours"]["decode_ms_per_step"] for c in cells]))
        out.append({
            "batch": first["batch"], "rounds": len(cells),
            "mlx_lm_ms": plain_ms, "mlx_lm_tok_s": first["batch"] / plain_ms * 1e3,
            "ours_ms": ours_ms, "ours_tok_s": first["batch"] / ours_ms * 1e3,
            "engine_period_ms": float(np.median([c["ours"]["engine_period_ms"]
                                                 for c in cells])),
            "ratio_median": float(np.median(ratios)), "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "breakdown_ms": {p: float(np.median([c["ours"]["breakdown_ms"][p] for c in cells]))
                             for p in first["ours"]["breakdown_ms"]},
        })
    return out


def summarize_ttft(rounds: list[dict]) -> dict:
    """Medians over the rounds of each contender's TTFT and of the per-round ratio (mlx-lm /
    ours: >= 1 means ours is no slower), with the ratio's range."""
    ratios = [r["ratio"] for r in rounds]
    return {"rounds": len(rounds), "prompt_len": rounds[0]["ours"]["prompt_len"],
            "mlx_lm_ms": float(np.median([r["mlx_lm"]["ttft_s"] for r in rounds])) * 1e3,
            "ours_ms": float(np.median([r["ours"]["ttft_s"] for r in rounds])) * 1e3,
            "ratio_median": float(np.median(ratios)), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


def print_checks(report: dict) -> None:
    if "greedy" not in report:
        print(f"greedy check and kernel grid skipped ({SKIP_CHECKS_ENV}=1)")
        return
    quant = report.get("kvquant_grid", {})
    print(f"quantized KV kernels: write bytes differing (worst per format) "
          f"{quant.get('worst_write_bytes_differing')}, attention worst max abs error "
          f"{quant.get('worst_attention_max_abs_error')}, failed "
          f"{quant.get('failed', quant.get('error', quant.get('skipped')))}")
    grid = report.get("kernel_grid", {})
    print(f"greedy tiny fp32 GPU == CPU: "
          f"{report['greedy'].get('equal', report['greedy'].get('skipped'))}")
    for family, res in report.get("greedy_moe", {}).items():
        print(f"greedy tiny {family} fp32 GPU == CPU: {res.get('equal', res.get('error'))}")
    print(f"paged GPU kernel grid: {grid.get('cases')} cases, worst max abs error "
          f"{grid.get('worst_max_abs_error')}, failed {grid.get('failed', grid.get('error'))}")


def print_table(report: dict) -> None:
    print(f"\nweight-read roofline: {report['roofline_ms']:.3f} ms/step "
          f"({report['weight_bytes'] / 1e9:.2f} GB at "
          f"{report['facts']['copy_bandwidth_GBps']:.0f} GB/s)")
    print(f"{'batch':>5} {'ours mode':>9} {'rounds':>6} | {'mlx-lm ms/step':>14} {'tok/s':>7} | "
          f"{'ours ms/step':>12} {'tok/s':>7} {'engine ms':>9} | {'ratio med':>9} "
          f"{'(min-max)':>11} | breakdown ms/step (prepare/build/eval/finish; encode thread "
          f"busy/waited for/read-back)")
    for mode in [k.removeprefix("summary_") for k in report if k.startswith("summary_")]:
        for row in report[f"summary_{mode}"]:
            b = row["breakdown_ms"]
            print(f"{row['batch']:>5} {mode:>9} {row['rounds']:>6} | {row['mlx_lm_ms']:>14.2f} "
                  f"{row['mlx_lm_tok_s']:>7.0f} | {row['ours_ms']:>12.2f} "
                  f"{row['ours_tok_s']:>7.0f} {row['engine_period_ms']:>9.2f} | "
                  f"{row['ratio_median']:>9.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | "
                  f"{b['prepare_s']:.2f}/{b['build_s']:.2f}/{b['eval_s']:.2f}/{b['finish_s']:.2f}"
                  f"; {b.get('encode_thread_s', 0):.2f}/{b.get('encode_wait_s', 0):.2f}"
                  f"/{b.get('read_back_s', 0):.2f}")
    for mode in [k.removeprefix("ttft_summary_") for k in report
                 if k.startswith("ttft_summary_")]:
        t = report[f"ttft_summary_{mode}"]
        print(f"TTFT {t['prompt_len']} tokens ({mode}, {t['rounds']} rounds): mlx-lm "
              f"{t['mlx_lm_ms']:.1f} ms, ours {t['ours_ms']:.1f} ms, mlx-lm / ours "
              f"{t['ratio_median']:.2f} ({t['ratio_min']:.2f}-{t['ratio_max']:.2f})")
    for key, when in (("mlx_lm_alone", "before"), ("mlx_lm_alone_after", "after")):
        if report.get(key):
            print(f"plain mlx-lm with no engine alive ({when} the engines), ms/step: "
                  + ", ".join(f"B={p['batch']}: {p['ms_per_step']:.2f}"
                              for p in report[key]["decode"]))
    print_checks(report)


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "engine":
        engine_main(sys.argv[2], sys.argv[3])
    elif cmd == "mlx_lm":
        mlx_lm_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(b) for b in sys.argv[5:]])
    elif cmd == "expected":
        expected_main(sys.argv[2])
    elif cmd == "expected-moe":
        expected_moe_main(sys.argv[2])
    elif cmd == "device":
        device_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
