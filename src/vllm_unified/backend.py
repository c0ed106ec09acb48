"""Which MLX backend this process runs on, and the memory facts that follow from it.

Two halves, on purpose:

* :func:`detect_backend` answers from installed distributions and the OS alone. vLLM calls the
  platform in its API-server process *before* it forks the engine core, and MLX is not fork-safe
  (a forked child hangs in its first ``mx.eval``), so nothing here imports ``mlx``.
* :func:`import_mlx` is for the engine-core/worker process: it interposes a fast BLAS first
  (see :mod:`vllm_unified.blas`), imports ``mlx.core`` and selects the device.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import psutil

from vllm_unified import envs

#: Environment variable forcing the backend: ``metal``, ``cuda`` or ``cpu``.
from vllm_unified.envs import DEVICE_ENV

BackendKind = Literal["metal", "cuda", "cpu"]


@dataclass(frozen=True)
class BackendInfo:
    """Facts about the MLX backend, known without importing MLX.

    Attributes:
        kind: ``"metal"`` (Apple GPU), ``"cuda"`` (NVIDIA GPU) or ``"cpu"``.
        device_name: human-readable device name for logs and ``get_device_name``.
        total_memory: bytes the device can address. Unified backends (Metal, CPU) report the
            machine's RAM (``psutil.virtual_memory().total``); CUDA reports the card's memory.
        unified: whether device memory is the host's RAM (then pinned memory is meaningless).
        reason: how the kind was chosen (override, installed wheel, fallback), for the log.
    """

    kind: BackendKind
    device_name: str
    total_memory: int
    unified: bool
    reason: str


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _cuda_total_memory() -> int | None:
    """Memory of GPU 0 in bytes from ``nvidia-smi``; None when it cannot be asked."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return int(out.strip().splitlines()[0]) * 1024 * 1024  # MiB -> bytes
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


@functools.cache
def detect_backend() -> BackendInfo:
    """Choose the MLX backend: Metal GPU, else CUDA GPU, else CPU.

    ``VLLM_UNIFIED_DEVICE`` overrides the choice.

    Raises:
        ValueError: ``VLLM_UNIFIED_DEVICE`` holds something other than metal/cuda/cpu, or names
            a backend whose MLX wheel is not installed.
    """
    ram = psutil.virtual_memory().total
    has_metal = sys.platform == "darwin" and _installed("mlx-metal")
    has_cuda = _installed("mlx-cuda-13") or _installed("mlx-cuda-12")
    forced = envs.read(DEVICE_ENV) or ""  # ValueError naming it unless metal, cuda or cpu
    if forced == "metal" and not has_metal:
        raise ValueError(f"{DEVICE_ENV}=metal but MLX's Metal backend (mlx-metal) is not installed")
    if forced == "cuda" and not has_cuda:
        raise ValueError(f"{DEVICE_ENV}=cuda but MLX's CUDA backend (mlx[cuda13]) is not installed")

    kind: BackendKind
    if forced:
        kind, reason = forced, f"{DEVICE_ENV}={forced}"  # type: ignore[assignment]
    elif has_metal:
        kind, reason = "metal", "mlx-metal installed on macOS"
    elif has_cuda:
        kind, reason = "cuda", "mlx-cuda installed"
    else:
        kind, reason = "cpu", "no MLX GPU backend installed"

    if kind == "metal":
        return BackendInfo("metal", f"Apple GPU ({platform.machine()})", ram, True, reason)
    if kind == "cuda":
        total = _cuda_total_memory()
        if total is None:  # Exact figure comes from mx.device_info() in the worker.
            total = ram
        return BackendInfo("cuda", "NVIDIA GPU", total, False, reason)
    return BackendInfo("cpu", _cpu_name(), ram, True, reason)


@functools.cache
def import_mlx() -> ModuleType:
    """Import ``mlx.core`` for compute in this process and select the backend's device.

    Call this (never ``import mlx.core`` directly) in the worker before anything touches MLX:
    on the CPU backend it first interposes a fast BLAS, which only works before MLX is loaded.

    Returns:
        The ``mlx.core`` module.
    """
    info = detect_backend()
    if info.kind == "cpu":
        from vllm_unified.blas import preload_blas

        preload_blas()
    import mlx.core as mx

    mx.set_default_device(mx.gpu if info.kind in ("metal", "cuda") else mx.cpu)
    return mx
