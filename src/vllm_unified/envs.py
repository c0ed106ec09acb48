"""Every ``VLLM_UNIFIED_*`` environment variable: its name, type, default and meaning.

This is the only module that reads them (the native extension gets its two settings from here
too, through ``vllm_unified_native``'s import). Each value is parsed on every read, so a test's
``monkeypatch.setenv`` is seen; modules that must decide once per process (the backend profile)
read once and keep the result. A value that does not parse is a ``ValueError`` naming the
variable and the value, never a silent default. Booleans take exactly ``0`` or ``1``.

Importing this module imports nothing heavy (no MLX, torch or vLLM): vLLM's API-server process
loads the plugin before it forks the engine, and MLX is not fork-safe.

Read a setting as an attribute (``envs.COMPILE_DECODE``), or with :func:`read` for another
mapping than ``os.environ``. docs/configuration.md has the same table for users;
:func:`describe` prints it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "VLLM_UNIFIED_"


@dataclass(frozen=True)
class Setting:
    """One variable.

    Attributes:
        name: the full variable name.
        default: the value when the variable is unset or empty (already parsed).
        parse: turns the raw string into the value; raises ValueError with a short reason.
        doc: one line for users.
    """

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str


def _bool(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return raw == "1"


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value
    return parse


def _count(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw) if raw.isdigit() else minimum - 1  # digits only: no sign, no "_"
        if value < minimum:
            raise ValueError("must be a positive integer" if minimum == 1
                             else f"expected an integer >= {minimum}")
        return value
    return parse


def _tokens_or_all(raw: str) -> int | str:
    if raw.lower() == "all":
        return "all"
    if not raw.isdigit():
        raise ValueError("expected a number of tokens (>= 0) or all")
    return int(raw)


def _text(raw: str) -> str:
    return raw


_SETTINGS = (
    Setting("VLLM_UNIFIED_DISABLE", False, _bool,
            "1: the plugin does not register (vLLM picks another platform)"),
    Setting("VLLM_UNIFIED_DEVICE", None, _choice("metal", "cuda", "cpu"),
            "force the MLX backend (metal, cuda, cpu); default: Metal, else CUDA, else CPU"),
    Setting("VLLM_UNIFIED_MAX_N", 128, _count(1),
            "most completions (n) one request may ask for (more: HTTP 400). Default 128, the "
            "OpenAI API's own maximum, so no client written for that API sends more; vLLM has "
            "no limit, and each completion is a request of its own in the engine"),
    Setting("VLLM_UNIFIED_MAX_REQUEST_BYTES", 0, _count(0),
            "largest HTTP request body in bytes (larger: HTTP 413). Default 0, no limit, as in "
            "vLLM and uvicorn: base64 images, audio and video make bodies of any size. Set one "
            "(e.g. 67108864) where clients are not trusted"),
    Setting("VLLM_UNIFIED_UNKNOWN_FIELDS", "ignore", _choice("ignore", "reject"),
            "top-level fields /v1/completions and /v1/chat/completions do not know. Default "
            "ignore, vLLM's behaviour: served, the fields dropped, a warning logged once per "
            "set of names (clients such as LangChain and LiteLLM send extra fields); reject: "
            "HTTP 400 naming them, so that a misspelt parameter is not silently dropped"),
    Setting("VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S", 60, _count(0),
            "seconds a response may wait for a client that reads nothing before the request "
            "is aborted and the connection closed (0: no limit). Default 60: vLLM has no limit "
            "and keeps the request's KV blocks for a client that never reads; only a send that "
            "waits the whole time ends a response, so a slow reader is not cut off"),
    Setting("VLLM_UNIFIED_BLAS", None, _text,
            "CPU backend: path of the BLAS library to interpose, or none for MLX's bundled one"),
    Setting("VLLM_UNIFIED_CACHE", None, _text,
            "folder for prepared GGUF folders and test models (default ~/.cache/vllm-unified)"),
    Setting("VLLM_UNIFIED_CPU_QUANTIZED", True, _bool,
            "CPU backend: 0 dequantizes quantized checkpoints to fp32 at load"),
    Setting("VLLM_UNIFIED_CPU_ATTENTION", True, _bool,
            "CPU backend: 0 attends through the pure-MLX reference instead of the native kernel"),
    Setting("VLLM_UNIFIED_CPU_ISA", None,
            _choice("amx", "avx512", "avxvnni", "avx2", "portable"),
            "CPU backend: the highest instruction set the native kernels may use (avxvnni: "
            "AVX2 with AVX-VNNI's dot products where the CPU has them; avx2 without)"),
    Setting("VLLM_UNIFIED_CPU_THREADS", None, _count(1),
            "CPU backend: most threads the native kernels use (default: the CPUs allowed)"),
    Setting("VLLM_UNIFIED_CPU_ACTIVATIONS", "int16", _choice("int16", "int8", "fp32"),
            "CPU backend: the arithmetic of quantized layers at every size, prefill included "
            "(AVX-512 VNNI: a gemv for 1-5 rows, from 6 a GEMM, or AMX-INT8 tiles from 5; AVX2: "
            "a gemv for 1-4 rows, from 5 a GEMM): the weight codes times x quantized per 32 "
            "elements, by integer dot products: int16 (x to ~16 bits in two terms), int8 (one "
            "term, llama.cpp's: faster, less exact); fp32 dequantizes exactly "
            "(docs/features/quantization.md)"),
    Setting("VLLM_UNIFIED_GPU_ATTENTION", True, _bool,
            "GPU backends (CUDA, Metal): 0 attends through the reference instead of the paged "
            "kernel"),
    Setting("VLLM_UNIFIED_FUSE_PROJECTIONS", True, _bool,
            "0 keeps q/k/v and gate/up as separate matmuls (GPU backends at every size, "
            "the native CPU kernels for one-row inputs)"),
    Setting("VLLM_UNIFIED_GPU_GEMM", True, _bool,
            "CUDA backend: 0 leaves matmuls of 2 to 64 rows (decode) to MLX's cuBLASLt path "
            "instead of the small tensor-core kernel"),
    Setting("VLLM_UNIFIED_FUSED_QK", True, _bool,
            "GPU backends: 0 keeps the per-head q/k norms and RoPE of decode steps as MLX "
            "kernels of their own instead of inside the KV write and attention kernels"),
    Setting("VLLM_UNIFIED_ENCODE_THREAD", None, _bool,
            "async scheduling: 1/0 evaluates queued steps on a thread of their own or not "
            "(default: on CUDA only)"),
    Setting("VLLM_UNIFIED_BUILD_ALONGSIDE", True, _bool,
            "with the encode thread: 0 waits for the queued step before building the next "
            "pure-decode step (no overlap of building and encoding)"),
    Setting("VLLM_UNIFIED_COMPILE_DECODE", True, _bool,
            "CUDA and CPU backends: 0 builds every decode step's graph in Python "
            "(no mx.compile)"),
    Setting("VLLM_UNIFIED_KV_EAGER_ZERO", False, _bool,
            "1 zero-fills the KV pool at start as vLLM does (benchmarks compare start-up memory)"),
    Setting("VLLM_UNIFIED_PREFIX_CACHE_RETAIN", None, _tokens_or_all,
            "fewest tokens of freed KV blocks the prefix cache keeps (it keeps as many blocks "
            "as the load has held at once if that is more); blocks beyond are evicted and "
            "their pool pages given back. all: vLLM's order (the cache may fill the pool). "
            "Default: --max-model-len on Metal and CPU, all on CUDA"),
    Setting("VLLM_UNIFIED_STEP_PROFILE", 0, _count(0),
            "log the step-phase profile every N steps (0: never)"),
    Setting("VLLM_UNIFIED_MEMORY_LOG", 0, _count(0),
            "log MLX's active, cache and peak memory every N steps (0: never)"),
    Setting("VLLM_UNIFIED_LOCAL_ENGINES", 1, _count(1),
            "set by the server for its engine processes: data-parallel engines on this "
            "machine (--data-parallel-size-local), whose KV budgets share its RAM"),
    Setting("VLLM_UNIFIED_SPEC_BUDGET", True, _bool,
            "speculative decoding: 0 hands vLLM every draft token (no adaptive draft budget "
            "from measured step cost and acceptance)"),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _SETTINGS}

#: Names of variables vLLM itself sets for our platform (``device_control_env_var``), which
#: are not settings of ours.
VISIBLE_DEVICES_ENV = "VLLM_UNIFIED_VISIBLE_DEVICES"

DISABLE_ENV = "VLLM_UNIFIED_DISABLE"
DEVICE_ENV = "VLLM_UNIFIED_DEVICE"
MAX_N_ENV = "VLLM_UNIFIED_MAX_N"
MAX_REQUEST_BYTES_ENV = "VLLM_UNIFIED_MAX_REQUEST_BYTES"
UNKNOWN_FIELDS_ENV = "VLLM_UNIFIED_UNKNOWN_FIELDS"
STALLED_CLIENT_TIMEOUT_ENV = "VLLM_UNIFIED_STALLED_CLIENT_TIMEOUT_S"
BLAS_ENV = "VLLM_UNIFIED_BLAS"
CACHE_ENV = "VLLM_UNIFIED_CACHE"
CPU_QUANTIZED_ENV = "VLLM_UNIFIED_CPU_QUANTIZED"
CPU_ATTENTION_ENV = "VLLM_UNIFIED_CPU_ATTENTION"
CPU_ISA_ENV = "VLLM_UNIFIED_CPU_ISA"
CPU_THREADS_ENV = "VLLM_UNIFIED_CPU_THREADS"
CPU_ACTIVATIONS_ENV = "VLLM_UNIFIED_CPU_ACTIVATIONS"
GPU_ATTENTION_ENV = "VLLM_UNIFIED_GPU_ATTENTION"
COMPILE_DECODE_ENV = "VLLM_UNIFIED_COMPILE_DECODE"
FUSE_PROJECTIONS_ENV = "VLLM_UNIFIED_FUSE_PROJECTIONS"
ENCODE_THREAD_ENV = "VLLM_UNIFIED_ENCODE_THREAD"
GPU_GEMM_ENV = "VLLM_UNIFIED_GPU_GEMM"
FUSED_QK_ENV = "VLLM_UNIFIED_FUSED_QK"
BUILD_ALONGSIDE_ENV = "VLLM_UNIFIED_BUILD_ALONGSIDE"
KV_EAGER_ZERO_ENV = "VLLM_UNIFIED_KV_EAGER_ZERO"
STEP_PROFILE_ENV = "VLLM_UNIFIED_STEP_PROFILE"
PREFIX_CACHE_RETAIN_ENV = "VLLM_UNIFIED_PREFIX_CACHE_RETAIN"
MEMORY_LOG_ENV = "VLLM_UNIFIED_MEMORY_LOG"
SPEC_BUDGET_ENV = "VLLM_UNIFIED_SPEC_BUDGET"
LOCAL_ENGINES_ENV = "VLLM_UNIFIED_LOCAL_ENGINES"


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of setting ``name`` in ``environ`` (default: ``os.environ``).

    Raises:
        KeyError: ``name`` is not one of :data:`SETTINGS`.
        ValueError: the value does not parse; the message is ``NAME='value': reason``.
    """
    setting = SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return setting.default
    try:
        return setting.parse(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def validate(environ: Mapping[str, str] | None = None) -> list[str]:
    """Parse every setting (start-up check); return the ``VLLM_UNIFIED_*`` names that are set
    but are not settings (likely typos, for a warning).

    Raises:
        ValueError: the first setting whose value does not parse.
    """
    env = os.environ if environ is None else environ
    for name in SETTINGS:
        read(name, env)
    return sorted(n for n in env if n.startswith(PREFIX) and n not in SETTINGS
                  and n != VISIBLE_DEVICES_ENV)


def describe() -> str:
    """The settings as a Markdown table (name, default, meaning)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in _SETTINGS:
        default = "unset" if s.default is None else (
            str(int(s.default)) if isinstance(s.default, bool) else str(s.default))
        rows.append(f"| `{s.name}` | {default} | {s.doc} |")
    return "\n".join(rows)


def __getattr__(attr: str) -> Any:
    """``envs.COMPILE_DECODE`` -> the parsed ``VLLM_UNIFIED_COMPILE_DECODE``."""
    name = PREFIX + attr
    if name in SETTINGS:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *(n.removeprefix(PREFIX) for n in SETTINGS)])
