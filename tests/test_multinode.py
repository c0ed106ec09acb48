"""Serving across "nodes" and engines on this machine, through vLLM's own launchers.

* Two nodes on loopback: ``vllm serve --pipeline-parallel-size 2 --nnodes 2 --node-rank 0``
  (API server, stage 1) and ``--node-rank 1 --headless`` (stage 2), rendezvous at
  ``--master-addr 127.0.0.1``; greedy outputs equal the one-process engine's, and killing the
  second node mid-stream fails the request with an error and takes the server down (or
  unhealthy) within 30 s.
* ``--data-parallel-size 2``: two engines behind one API server serve 32 concurrent requests
  with the same outputs as one engine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from conftest import _free_port, default_model_path, run_llm, vllm_server

_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "The quick brown fox " * 60,  # ~300 tokens: chunked by --max-num-batched-tokens 128
    "Once upon a time, in a small village,",
]


def _common_args() -> list[str]:
    return [default_model_path(), "--max-model-len", "1024", "--max-num-batched-tokens", "128",
            "--kv-cache-memory-bytes", str(128 * 2**20), "--seed", "0"]


def _complete(base: str, prompt: str, max_tokens: int = 24) -> str:
    r = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": default_model_path(), "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _concurrent(base: str, prompts: list[str], max_tokens: int = 24) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(base, p, max_tokens), prompts))


def _reference(model: str, prompts: list[str], tmp_path: Path, max_tokens: int = 24,
               env: dict[str, str] | None = None) -> list[str]:
    """The same greedy requests through one engine in one process (vLLM's offline LLM on the
    folder ``vllm serve`` prepares from the GGUF)."""
    spec = {"model": model,
            "engine": {"max_model_len": 1024, "max_num_batched_tokens": 128,
                       "kv_cache_memory_bytes": 128 * 2**20, "seed": 0},
            "requests": [{"prompt": p, "params": {"temperature": 0.0, "max_tokens": max_tokens,
                                                  "ignore_eos": True}} for p in prompts]}
    return [o["completions"][0]["text"] for o in run_llm(spec, tmp_path, env=env)["outputs"]]


@contextlib.contextmanager
def _headless_node(log_dir: Path, args: list[str]):
    """``vllm serve ARGS --headless`` in its own session; killed afterwards."""
    vllm = Path(sys.executable).parent / "vllm"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    with open(log_dir / "node1.log", "w") as log:
        proc = subprocess.Popen([str(vllm), "serve", *args, "--headless"], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.engine
@pytest.mark.slow  # CI: pp2 == pp1 (test_pipeline_parallel.py), the peer-loss tests below
def test_two_nodes_on_loopback_then_the_second_is_lost(default_model, tmp_path):
    reference = _reference(default_model, _PROMPTS, tmp_path)
    port = _free_port()
    nodes = [*_common_args(), "--pipeline-parallel-size", "2", "--nnodes", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(port)]
    with _headless_node(tmp_path, [*nodes, "--node-rank", "1"]) as node1, \
            vllm_server(tmp_path, [*nodes, "--node-rank", "0"]) as (base, server):
        assert _concurrent(base, _PROMPTS) == reference
        log = (tmp_path / "server.log").read_text()
        assert "pipeline stage 1 of 2: layers 0-14 of 30" in log
        assert "pipeline stage 2 of 2: layers 15-29 of 30" in (tmp_path / "node1.log").read_text()

        # A long stream; the second node is killed (SIGKILL, its whole session) mid-stream.
        events: list[bytes] = []
        streaming = threading.Event()
        ended: list[float] = []

        def stream() -> None:
            try:
                with requests.post(f"{base}/v1/completions", stream=True, timeout=120, json={
                        "model": default_model_path(), "prompt": "Tell me a long story.",
                        "max_tokens": 900, "temperature": 0.0, "ignore_eos": True,
                        "stream": True}) as r:
                    for line in r.iter_lines():
                        if line:
                            events.append(line)
                            streaming.set()
            except requests.RequestException as e:  # the server went away: also an end
                events.append(f"connection: {e}".encode())
            ended.append(time.monotonic())

        client = threading.Thread(target=stream)
        client.start()
        assert streaming.wait(60), "the stream did not start"
        killed = time.monotonic()
        os.killpg(node1.pid, signal.SIGKILL)
        client.join(timeout=60)
        assert not client.is_alive(), "the stream hangs after the second node was lost"
        assert ended[0] - killed < 30, f"the stream ended {ended[0] - killed:.1f} s after"
        assert any(b'"error"' in e or e.startswith(b"connection: ") for e in events), events[-3:]
        assert not any(b'"finish_reason":"length"' in e for e in events), "stream completed"
        # the server exits (or at least stops reporting healthy) within 30 s of the loss
        while time.monotonic() - killed < 30 and server.poll() is None:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{base}/health", timeout=2).status_code != 200:
                    break
            time.sleep(0.5)
        healthy = False
        if server.poll() is None:
            with contextlib.suppress(requests.RequestException):
                healthy = requests.get(f"{base}/health", timeout=2).status_code == 200
        assert not healthy, "the server still reports healthy 30 s after losing a node"


@pytest.mark.engine
def test_data_parallel_two_engines_serve_32_concurrent(default_model, tmp_path):
    prompts = [f"{p} (variant {i})" for i in range(6) for p in _PROMPTS][:32]
    prompts += [f"Count from {i} to {i + 5}:" for i in range(32 - len(prompts))]
    # Each engine batches half the requests. Without AMX the quantized layers' int16
    # arithmetic serves 1-4 rows only, so a near tie could flip with the batch size; the exact
    # fp32 arithmetic makes each row's result independent of its batch.
    exact = {"VLLM_UNIFIED_CPU_ACTIVATIONS": "fp32"}
    reference = _reference(default_model, prompts, tmp_path, max_tokens=16, env=exact)
    with vllm_server(tmp_path, [*_common_args(), "--data-parallel-size", "2"],
                     env=exact) as (base, _):
        got = _concurrent(base, prompts, max_tokens=16)
        log = (tmp_path / "server.log").read_text()
    assert got == reference
    # two engines ran, each with its share of the machine's RAM for its KV budget
    assert log.count("vllm-unified: RAM shared by 2 worker processes on this machine") == 2, \
        "each engine should log its share"


def test_peer_watch_ends_the_worker_when_a_peer_stops_beating(tmp_path):
    """Rank 0 watches rank 1 through a rendezvous store; rank 1 never beats: within
    LOST_AFTER_S (+ one heartbeat) rank 0's watch declares it lost (both shortened here: the
    watch reads them at run time)."""
    heartbeat_s, lost_after_s = 0.5, 3.0
    port = _free_port()
    code = f"""
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from vllm_unified.distributed import liveness
store = TCPStore("127.0.0.1", {port}, is_master=True, wait_for_workers=False,
                 timeout=timedelta(seconds=30))
def lost(why):
    print("LOST:", why, flush=True)
    import os; os._exit(3)
liveness.abandon_pipeline = lost
liveness.HEARTBEAT_S, liveness.LOST_AFTER_S = {heartbeat_s}, {lost_after_s}
liveness.PeerWatch("127.0.0.1", {port}, 0, 2).start()
time.sleep(60)
"""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90)
    took = time.monotonic() - start
    assert done.returncode == 3, done.stdout + done.stderr
    assert "LOST: pipeline peer lost: worker rank 1 sent no heartbeat" in done.stdout
    assert lost_after_s <= took < lost_after_s + 3 * heartbeat_s + 10, took


def test_abandon_pipeline_stops_an_engine_blocked_past_sigterm():
    """The launcher (an engine core whose thread is blocked; here one that ignores SIGTERM)
    is killed after the grace period, and the worker exits 1."""
    launcher = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *a: None)  # like vLLM's handler: only flags it
child = subprocess.Popen([sys.executable, "-c",
    "from vllm_unified.distributed.liveness import abandon_pipeline; abandon_pipeline('test')"])
time.sleep(60)
"""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    assert time.monotonic() - start < 30
    assert "test; ending this worker process and stopping its engine" in proc.stderr
