"""Wired weights: keep MLX's buffers resident on Metal.

On Apple Silicon the OS may page out GPU memory under pressure, which stalls inference. MLX can
wire its buffers up to a limit; the device's recommended working set
(``max_recommended_working_set_size`` from ``mx.device_info()``) is the safe ceiling. It must be
set before the weights load so they are wired as they are allocated. The limit covers MLX
buffers only: a KV pool allocated outside MLX stays pageable. Wiring does not exist on MLX's CPU
and CUDA backends.
"""

from __future__ import annotations

import logging
from types import ModuleType

_RECOMMENDED = "max_recommended_working_set_size"


def configure_wired_limit(mx: ModuleType, backend_kind: str, logger: logging.Logger) -> int | None:
    """Set MLX's wired limit on Metal; on other backends log once that it does not apply.

    Args:
        mx: the ``mlx.core`` module.
        backend_kind: ``"metal"``, ``"cuda"`` or ``"cpu"``.

    Returns:
        The limit set in bytes, or None when wiring does not apply.

    Raises:
        RuntimeError: on Metal, the device does not report its recommended working set.
    """
    if backend_kind != "metal":
        logger.info(
            "vllm-unified: wired memory does not apply on MLX's %s backend; weights are not wired",
            backend_kind,
        )
        return None
    info = mx.device_info()
    limit = info.get(_RECOMMENDED)
    if not limit:
        raise RuntimeError(f"Metal device reports no {_RECOMMENDED}: {info}")
    mx.set_wired_limit(int(limit))
    logger.info("vllm-unified: MLX wired limit set to %.2f GiB (%s)", int(limit) / 2**30,
                _RECOMMENDED)
    return int(limit)
