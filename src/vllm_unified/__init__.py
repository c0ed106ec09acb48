"""vllm-unified: a vLLM platform plugin that runs vLLM's engine on MLX.

vLLM finds this package through the ``vllm.platform_plugins`` entry point and calls
:func:`register` in every process (API server, engine core, workers). Nothing here may import
MLX: MLX is not fork-safe, and vLLM may fork the engine core after loading plugins
(see ``docs/internals.md``).
"""

from __future__ import annotations

import importlib.util
import os

__version__ = "0.1.0"

#: Setting this to 1 disables the plugin in a process (vLLM then falls back to its own platform).
DISABLE_ENV = "VLLM_UNIFIED_DISABLE"


def register() -> str | None:
    """Entry point for ``vllm.platform_plugins``.

    Returns:
        The qualified name of our Platform class, or ``None`` when the plugin is disabled via
        ``VLLM_UNIFIED_DISABLE=1`` or MLX / mlx-lm are not installed (vLLM then keeps looking).
    """
    if os.environ.get(DISABLE_ENV, "0") == "1":
        return None
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        return None
    # Pin the scheduler's message format we implement: with Triton importable vLLM 0.32 would
    # otherwise switch to the "model runner V2" format.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    return "vllm_unified.platform.MLXPlatform"
