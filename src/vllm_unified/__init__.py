"""vllm-unified: a vLLM platform plugin that runs vLLM's engine on MLX.

vLLM finds this package through the ``vllm.platform_plugins`` entry point and calls
:func:`register` in every process (API server, engine core, workers). Nothing here may import
MLX: MLX is not fork-safe, and vLLM may fork the engine core after loading plugins
(see ``docs/dev/architecture.md``).
"""

from __future__ import annotations

import importlib.util
import os

from vllm_unified import envs, patches
from vllm_unified.backend import set_mlx_env_defaults

#: Setting this to 1 disables the plugin in a process (vLLM then falls back to its own platform).
from vllm_unified.envs import DISABLE_ENV

__version__ = "0.1.0"


def _active() -> bool:
    try:
        disabled = envs.read(DISABLE_ENV)
    except ValueError:
        # vLLM swallows a plugin's exception (a debug log) and picks another platform: stay
        # registered instead, so that validate_environ names the bad value at start-up.
        disabled = False
    if disabled:
        return False
    return importlib.util.find_spec("mlx") is not None and \
        importlib.util.find_spec("mlx_lm") is not None


def register() -> str | None:
    """Entry point for ``vllm.platform_plugins``.

    Returns:
        The qualified name of our Platform class, or ``None`` when the plugin is disabled via
        ``VLLM_UNIFIED_DISABLE=1`` or MLX / mlx-lm are not installed (vLLM then keeps looking).
    """
    if not _active():
        return None
    # Pin the scheduler's message format we implement: with Triton importable vLLM 0.32 would
    # otherwise switch to the "model runner V2" format.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # MLX reads its graph limits once, at its first stream: set ours before any process of
    # this server imports MLX (engine processes inherit them).
    try:
        set_mlx_env_defaults()
    except ValueError:
        # A bad VLLM_UNIFIED_DEVICE: vLLM would swallow the error here (a debug log) and pick
        # another platform; the platform raises it at start-up instead, naming the value.
        pass
    return "vllm_unified.platform.MLXPlatform"


def register_general() -> None:
    """Entry point for ``vllm.general_plugins``, which vLLM loads in every process, the engine
    core included, before it builds its scheduler: the scheduler-side patches
    (:func:`vllm_unified.patches.bound_prefix_cache_residency`,
    :func:`vllm_unified.patches.load_structured_output_tokenizer_lazily`) where our platform
    is active, a stand-in for torchvision where it is not installed
    (:func:`vllm_unified.patches.stand_in_for_missing_torchvision`: vLLM's multimodal model
    modules import it), a text-only reading of a multimodal checkpoint without its processor
    files (:func:`vllm_unified.patches.serve_text_only_without_processor_files`), and the
    mlx-lm model types transformers and vLLM do not know or read
    otherwise (:func:`vllm_unified.models.registration.register_mlx_lm_types`,
    :func:`~vllm_unified.models.registration.as_image_text_config`). Imports vLLM's scheduler
    modules, never MLX."""
    if not _active():
        return
    import logging

    # A ``vllm.`` name so that vLLM's logging configuration shows our records.
    patches.bound_prefix_cache_residency(logging.getLogger("vllm.vllm_unified.scheduler"))
    patches.load_structured_output_tokenizer_lazily()
    # before vLLM inspects a multimodal architecture: its module imports torchvision
    patches.stand_in_for_missing_torchvision()
    # before vLLM builds a ModelConfig: a multimodal checkpoint without its processor files
    patches.serve_text_only_without_processor_files(logging.getLogger("vllm.vllm_unified"))
    # lazy: imports transformers and vLLM's model registry, which only a vLLM process needs
    from vllm_unified.models.registration import as_image_text_config, register_mlx_lm_types

    register_mlx_lm_types()
    patches.convert_model_configs(as_image_text_config)
