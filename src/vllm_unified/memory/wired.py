"""Wired weights: keep MLX's buffers resident on Metal.

On Apple Silicon the OS may page out GPU memory under pressure, which stalls inference. MLX can
wire its buffers up to a limit; the device's recommended working set
(``max_recommended_working_set_size`` from ``mx.device_info()``) is the safe ceiling. It must be
set before the weights load so they are wired as they are allocated. The limit covers every
buffer MLX knows, including torch memory it adopts (the KV pool on Metal): before the pool is
adopted the limit is capped at what MLX holds (:func:`prepare_kv_adoption`), so the pool stays
pageable. Wiring does not exist on MLX's CPU and CUDA backends.
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


#: Bytes of MLX's own small-buffer heap (``MetalAllocator::heap_size_``, MLX 0.32.4's
#: ``mlx/backend/metal/allocator.h``): in the residency sets as one allocation, while
#: ``mx.get_active_memory()`` counts only the buffers carved from it.
_METAL_HEAP_BYTES = 1 << 20
#: Slack above MLX's active memory when the wired limit is capped: a buffer's allocated size
#: may exceed the length MLX counts (page rounding of small buffers), and a cap below what is
#: wired makes MLX unwire arbitrary allocations (weights among them) to get under it. A pool
#: chunk smaller than this could still be wired; every real pool is far larger.
_WIRED_SLACK_BYTES = 64 << 20


def prepare_kv_adoption(mx: ModuleType, nbytes: int, logger: logging.Logger) -> None:
    """On Metal, just before MLX adopts ``nbytes`` of the torch KV buffer
    (:func:`vllm_unified.kv.allocation.import_views`): keep the pool out of the wired set and
    count it once against MLX's memory limit.

    What MLX 0.32.4 does with an adopted buffer (``mlx/backend/metal/allocator.cpp``
    ``MetalAllocator::make_buffer``): it wraps the pointer with ``newBuffer(ptr, ...)``, adds
    the buffer to ``active_memory_`` (so ``mx.get_active_memory()`` counts the whole pool, a
    virtual size, not what is resident) and inserts it into the residency sets
    (``mlx/backend/metal/resident.cpp`` ``ResidencySets::insert``). ``insert`` puts an
    allocation into a set only while the wired bytes plus its size stay within the wired
    limit (``set_wired_limit`` -> ``ResidencySets::resize``), and every set holds a standing
    ``requestResidency()`` (``add_set_locked``): a pool that fits would be asked to be made
    resident as a whole, i.e. every page committed and kept, written or not, against the lazy
    pool and the design (weights wired, KV pageable). (What the driver does for a no-copy
    buffer is Apple's; that residency covers all of an allocation is Metal's documented
    contract, and measuring it needs a Mac.) ``resize`` re-adds tracked allocations that fit
    whenever the limit grows, so the cap below is kept for the life of the process.

    Steps: empty MLX's buffer cache (cached buffers stay in the residency sets until released),
    cap the wired limit at what MLX holds now (``mx.get_active_memory()`` plus its heap and a
    small slack, never above the limit already set), so the weights stay wired and the pool
    does not fit; then raise MLX's memory limit (``set_memory_limit``) by ``nbytes``: the KV
    budget already accounts for the pool, and MLX's limit, which makes every evaluation wait
    while active memory is above it (``mlx/transforms.cpp``), is for MLX's own buffers. MLX's
    cache-trimming threshold (``gc_limit_``, 0.95 x the recommended working set) cannot be
    raised: with a pool that large, MLX releases cached buffers on a cache miss.

    Args:
        mx: the ``mlx.core`` module (Metal backend).
        nbytes: bytes MLX is about to wrap (the chunks of the KV buffer).
        logger: where the one line about it goes.
    """
    mx.clear_cache()
    cap = int(mx.get_active_memory()) + _METAL_HEAP_BYTES + _WIRED_SLACK_BYTES
    previous = int(mx.set_wired_limit(cap))
    if previous < cap:  # never raise it (0: wiring was never asked for)
        mx.set_wired_limit(previous)
        cap = previous
    limit = int(mx.get_memory_limit()) + int(nbytes)
    mx.set_memory_limit(limit)
    logger.info(
        "vllm-unified: KV pool of %.2f GiB adopted by MLX on Metal: wired limit capped at "
        "%.2f GiB (what MLX holds now, so the pool stays out of the wired set and pageable), "
        "MLX memory limit raised to %.2f GiB (the pool counts once, in the KV budget)",
        nbytes / 2**30, cap / 2**30, limit / 2**30)
