"""The host out of memory for the KV pool at a long request, provoked for real (slow, Linux,
root): the engine core of a running ``vllm serve`` is moved into a memory cgroup of its own
whose limit leaves room for a short request but not for a long prompt's KV pages.

The KV pool is lazy (``kv/allocation.py``): its pages are committed as blocks are written, so
no allocation can fail at a request's start and the shortage comes as a page fault the kernel
cannot serve. Moving a process into a cgroup does not move the memory it already holds (cgroup
v1 with ``memory.move_charge_at_immigrate`` 0, cgroup v2 always), so the cgroup counts only what
the engine allocates afterwards, and the kernel's OOM killer picks the engine, the only process
in it. The rest of the machine is never short of memory: other processes are not at risk.

Documented outcome (docs/troubleshooting.md, "Failures"): the engine is SIGKILLed by the OOM killer;
the request in flight gets a clean error (an error event in its stream, or HTTP 500), and the
API server exits by itself (vLLM's engine-death watchdog); it never hangs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from conftest import default_model_path, engine_core_pid, require_root, vllm_server

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(sys.platform != "linux", reason="memory cgroups are Linux's")]

MODEL = "SmolLM2-135M-Instruct"
#: what the engine may allocate once in the cgroup: a short request fits (measured: a few MiB
#: on top of MLX's reused buffers), a 1,900-token prompt's KV pages alone do not (SmolLM2 in
#: fp32: 30 layers x 3 KV heads x 64 x 2 x 4 bytes = 45 KiB per token, 84 MiB in all)
LIMIT_BYTES = 48 * 2**20
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def _cgroup_root() -> tuple[Path, str]:
    """Where a memory cgroup can be made here, and its version ("v1" or "v2"); fails the test
    naming why where none can."""
    require_root("making a memory cgroup")
    if (V1 / "memory.limit_in_bytes").is_file():
        return V1, "v1"
    controllers = V2 / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split():
        return V2, "v2"
    pytest.fail("no writable memory cgroup (neither /sys/fs/cgroup/memory nor a cgroup v2 "
                "hierarchy with the memory controller) to provoke the fault", pytrace=False)


@contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[Path, str]]:
    """A fresh memory cgroup limited to ``limit`` bytes (no swap), removed afterwards."""
    root, version = _cgroup_root()
    group = root / f"vllm-unified-test-{os.getpid()}"
    group.mkdir()
    try:
        if version == "v1":
            (group / "memory.move_charge_at_immigrate").write_text("0")
            (group / "memory.limit_in_bytes").write_text(str(limit))
        else:
            (group / "memory.max").write_text(str(limit))
            if (group / "memory.swap.max").is_file():
                (group / "memory.swap.max").write_text("0")
        yield group, version
    finally:
        for _ in range(50):  # the killed engine leaves the group once it is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)


def _oom_kills(group: Path, version: str) -> int:
    """The cgroup's count of processes its OOM killer killed."""
    text = (group / ("memory.oom_control" if version == "v1" else "memory.events")).read_text()
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise AssertionError(f"no oom_kill counter in {group}: {text!r}")


def _complete(base: str, prompt: list[int] | str, max_tokens: int) -> requests.Response:
    return requests.post(f"{base}/v1/completions", timeout=300, stream=True, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True})


def _stream_events(r: requests.Response) -> list[str]:
    return [line[6:].decode() for line in r.iter_lines() if line.startswith(b"data: ")]


def test_long_request_past_the_memory_left_kills_the_engine_cleanly(tmp_path):
    args = [default_model_path(), "--served-model-name", MODEL, "--max-model-len", "2048",
            "--max-num-batched-tokens", "2048", "--kv-cache-memory-bytes", str(2**30),
            "--seed", "0"]
    with vllm_server(tmp_path, args) as (base, proc):
        with _complete(base, "The capital of France is", 8) as r:  # warm the engine up
            assert r.status_code == 200 and _stream_events(r)[-1] == "[DONE]"
        engine = engine_core_pid(proc.pid)
        with memory_cgroup(LIMIT_BYTES) as (group, version):
            (group / "cgroup.procs").write_text(str(engine))
            with _complete(base, "The capital of Italy is", 8) as r:  # still fits
                events = _stream_events(r)
            assert r.status_code == 200 and events[-1] == "[DONE]", events[-3:]
            assert "error" not in json.loads(events[-2])
            assert _oom_kills(group, version) == 0

            started = time.monotonic()
            long_prompt = [1000 + (i * 7919) % 40000 for i in range(1900)]
            with _complete(base, long_prompt, 16) as r:
                status, body = r.status_code, (_stream_events(r) if r.status_code == 200
                                               else r.text)
            answered = time.monotonic() - started
            kills = _oom_kills(group, version)
        proc.wait(timeout=60)  # the API server exits by itself
        exited = time.monotonic() - started
    assert kills == 1, f"the cgroup's OOM killer killed {kills} processes"
    with pytest.raises(OSError):
        os.kill(engine, 0)  # the engine is gone
    if status == 200:  # the stream had started: an error event, then [DONE]
        assert body[-1] == "[DONE]", body[-3:]
        error = json.loads(body[-2])["error"]
        assert error["code"] == 500 and "EngineCore" in error["message"], error
    else:
        assert status == 500, (status, body)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{base}/health", timeout=5)
    print(f"KV pool out of memory ({version} cgroup of {LIMIT_BYTES >> 20} MiB): engine OOM-"
          f"killed, request answered {status} after {answered:.1f} s, API server exited after "
          f"{exited:.1f} s (rc {proc.returncode})")
