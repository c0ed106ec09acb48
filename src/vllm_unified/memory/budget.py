"""The KV-cache budget: how many bytes vLLM may turn into KV blocks.

vLLM does no memory profiling for an out-of-tree worker; the number the worker returns from
``determine_available_memory`` is all the scheduler knows, so it is computed here, explained in
the start-up log, and checked against the smallest useful pool (one ``max_model_len`` sequence).

Where the memory facts come from depends on the backend (:func:`read_device_memory`): on the
unified-memory backends (Metal, CPU) the device is the machine's RAM and what this process holds
is its RSS; on CUDA the card's own memory as MLX reports it (``mx.device_info()``), what MLX holds
on it (``mx.get_active_memory()``), and a cap at what the card has free, so the budget never asks
MLX for more than exists (another process may hold part of the card).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

from vllm_unified.errors import StartupRefused

GIB = 2**30

#: vLLM's CPU-backend KV cache size variable: whole GiB (``vllm/platforms/cpu.py``).
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


@dataclass(frozen=True)
class DeviceMemory:
    """The device-memory facts the KV budget is computed from (bytes).

    Attributes:
        total: the device's memory: system RAM on unified backends, the card's on CUDA.
        in_use: what this process holds now (RSS on unified backends; MLX's active device
            memory on CUDA: weights, runtime buffers).
        free: what the device has free now (CUDA), the ceiling of any allocation; None on
            unified backends, where pages are committed lazily and RAM is shared.
        source: where the numbers were read, for the start-up log.
    """

    total: int
    in_use: int
    free: int | None
    source: str


def read_device_memory(mx: ModuleType, kind: str, *, rss: int, ram: int) -> DeviceMemory:
    """Read the memory facts of MLX's device ``kind`` (``"metal"``, ``"cuda"`` or ``"cpu"``).

    Args:
        mx: the ``mlx.core`` module (its device must be selected already).
        kind: the backend kind (:func:`vllm_unified.backend.detect_backend`).
        rss: this process's resident memory in bytes (in use on unified backends).
        ram: system RAM in bytes (total on unified backends).

    Returns:
        On CUDA, ``total``/``free`` from ``mx.device_info()`` (``total_memory``,
        ``free_memory``; free is read after MLX's buffer cache is emptied, so cached buffers
        count as free) and ``in_use`` = ``mx.get_active_memory()``. Elsewhere RAM and RSS.

    Raises:
        RuntimeError: on CUDA, ``mx.device_info()`` lacks ``total_memory`` or ``free_memory``.
    """
    if kind != "cuda":
        return DeviceMemory(total=ram, in_use=rss, free=None, source="system RAM, process RSS")
    mx.clear_cache()
    info = mx.device_info()
    missing = [k for k in ("total_memory", "free_memory") if k not in info]
    if missing:
        raise RuntimeError(f"MLX CUDA device_info() lacks {missing}: {dict(info)}")
    return DeviceMemory(
        total=int(info["total_memory"]), in_use=int(mx.get_active_memory()),
        free=int(info["free_memory"]), source="mx.device_info(), mx.get_active_memory()",
    )


@dataclass(frozen=True)
class KVBudget:
    """The arithmetic behind the KV budget (all sizes in bytes).

    Attributes:
        total: device memory (system RAM on unified backends).
        utilization: ``--gpu-memory-utilization``.
        in_use: memory the engine process already holds (weights, runtime).
        activations: peak activation memory of a ``max_num_batched_tokens`` forward.
        bytes_per_block: one KV block over all layers.
        min_bytes: bytes of the blocks one ``max_model_len`` sequence needs.
        budget: bytes handed to vLLM.
        explicit: True when ``--kv-cache-memory-bytes`` set the budget directly.
        free: device memory free now (CUDA), None on unified backends.
        capped: True when ``free - activations`` was below the utilization formula and set
            the budget.
    """

    total: int
    utilization: float
    in_use: int
    activations: int
    bytes_per_block: int
    min_bytes: int
    budget: int
    explicit: bool = False
    free: int | None = None
    capped: bool = False

    def describe(self) -> str:
        """One line: the formula with the numbers, for the start-up log and errors."""
        if self.explicit:
            return f"KV budget = --kv-cache-memory-bytes = {self.budget / GIB:.2f} GiB"
        if self.capped:
            return (
                f"KV budget = {self.free / GIB:.2f} GiB free on the device - "
                f"{self.activations / GIB:.2f} GiB activations = {self.budget / GIB:.2f} GiB "
                f"(below {self.utilization:.2f} x {self.total / GIB:.2f} GiB total - "
                f"{self.in_use / GIB:.2f} GiB in use - activations; "
                f"{self.budget // max(self.bytes_per_block, 1)} blocks of "
                f"{self.bytes_per_block / 2**20:.2f} MiB)"
            )
        return (
            f"KV budget = {self.utilization:.2f} x {self.total / GIB:.2f} GiB total - "
            f"{self.in_use / GIB:.2f} GiB in use (weights, runtime) - "
            f"{self.activations / GIB:.2f} GiB activations = {self.budget / GIB:.2f} GiB "
            f"({self.budget // max(self.bytes_per_block, 1)} blocks of "
            f"{self.bytes_per_block / 2**20:.2f} MiB)"
        )


def min_kv_blocks(bytes_per_block: int, block_size: int, max_model_len: int) -> tuple[int, int]:
    """The smallest useful KV pool, as vLLM's own check asks for (``check_enough_kv_cache_
    memory``: one ``max_model_len`` request of full-attention pages, plus the null block its
    block pool holds back): ``ceil(max_model_len / block_size) + 1`` blocks.

    Returns:
        (blocks, bytes).
    """
    blocks = -(-max_model_len // block_size) + 1
    return blocks, blocks * bytes_per_block


def compute_kv_budget(
    *,
    total: int,
    utilization: float,
    in_use: int,
    activations: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    kv_cache_memory_bytes: int | None = None,
    free: int | None = None,
) -> KVBudget:
    """``utilization x total - in_use - activations``, or ``kv_cache_memory_bytes`` if given.

    With ``free`` (a discrete device: CUDA) the budget is at most ``free - activations``: the
    pool is allocated after the step's activations are accounted for, and never from memory
    the card does not have.

    Raises:
        ValueError: the budget cannot hold one ``max_model_len`` sequence (plus vLLM's null
            block), or ``kv_cache_memory_bytes`` exceeds ``free``; the message names
            ``--gpu-memory-utilization`` and ``--max-model-len`` (or
            ``--kv-cache-memory-bytes``) and shows the arithmetic.
    """
    min_blocks, min_bytes = min_kv_blocks(bytes_per_block, block_size, max_model_len)
    if kv_cache_memory_bytes is not None:
        budget = KVBudget(total, utilization, in_use, activations, bytes_per_block, min_bytes,
                          int(kv_cache_memory_bytes), explicit=True, free=free)
        if free is not None and budget.budget > free:
            raise ValueError(
                f"--kv-cache-memory-bytes {kv_cache_memory_bytes}: the device has only {free} "
                f"bytes ({free / GIB:.2f} GiB) free; lower it"
            )
        if budget.budget < min_bytes:
            raise ValueError(
                f"--kv-cache-memory-bytes {kv_cache_memory_bytes}: one sequence of "
                f"--max-model-len {max_model_len} needs {min_blocks} blocks x "
                f"{bytes_per_block} bytes = {min_bytes} bytes; raise it or lower --max-model-len"
            )
        return budget
    value = int(utilization * total) - in_use - activations
    capped = free is not None and free - activations < value
    if capped:
        value = free - activations
    budget = KVBudget(total, utilization, in_use, activations, bytes_per_block, min_bytes, value,
                      free=free, capped=capped)
    if value < min_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {budget.describe()}, but one sequence of "
            f"--max-model-len {max_model_len} needs {min_blocks} blocks x "
            f"{bytes_per_block / 2**20:.2f} MiB = {min_bytes / GIB:.3f} GiB. Raise "
            f"--gpu-memory-utilization or lower --max-model-len / --max-num-batched-tokens."
        )
    return budget


def kv_space_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``VLLM_CPU_KVCACHE_SPACE`` as vLLM's CPU backend reads it: a whole number of GiB that
    becomes ``--kv-cache-memory-bytes`` (``N x 2^30``); unset or empty: None.

    Raises:
        StartupRefused: a value that is not a positive whole number (vLLM's CPU backend fails
            on a fraction with a traceback and on 0 later, with "No available memory for the
            cache blocks"), naming the variable, the value and ``--kv-cache-memory-bytes``.
    """
    raw = (os.environ if environ is None else environ).get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) == 0:
        raise StartupRefused(
            f"{CPU_KVCACHE_SPACE_ENV}={raw!r}: the KV cache size in whole GiB (vLLM's CPU-backend "
            f"variable, read as --kv-cache-memory-bytes N x 2^30) must be a positive integer; "
            f"unset it to size the KV cache from --gpu-memory-utilization, or give "
            f"--kv-cache-memory-bytes in bytes")
    return int(raw) * GIB


def check_kv_budget_before_load(
    *,
    total: int,
    utilization: float,
    weights: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    kv_cache_memory_bytes: int | None,
) -> None:
    """Refuse, before any weight loads, a KV budget that :func:`compute_kv_budget` would
    refuse after loading.

    With ``kv_cache_memory_bytes`` the check is the same one (the budget is that number).
    Otherwise only a bound is known before loading: the budget will be at most
    ``utilization x total - weights`` (the process then holds at least the weights; runtime
    and activations come on top), so that must hold one ``max_model_len`` sequence.

    Args:
        total: device memory, bytes (system RAM on unified backends).
        utilization: ``--gpu-memory-utilization``.
        weights: a lower bound of the memory the loaded weights take (0: not known).
        bytes_per_block: one KV block over the attention layers known now.

    Raises:
        StartupRefused: one line naming the flag and the numbers.
    """
    min_blocks, min_bytes = min_kv_blocks(bytes_per_block, block_size, max_model_len)
    need = (f"one sequence of --max-model-len {max_model_len} needs {min_blocks} blocks x "
            f"{bytes_per_block} bytes = {min_bytes} bytes ({min_bytes / GIB:.3f} GiB)")
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes < min_bytes:
            raise StartupRefused(
                f"--kv-cache-memory-bytes {kv_cache_memory_bytes}: {need}; raise it or lower "
                f"--max-model-len")
        return
    ceiling = int(utilization * total) - weights
    if ceiling < min_bytes:
        raise StartupRefused(
            f"--gpu-memory-utilization {utilization}: {utilization} x {total / GIB:.2f} GiB "
            f"total - {weights / GIB:.3f} GiB of weights (checkpoint files) leaves at most "
            f"{max(ceiling, 0) / GIB:.3f} GiB for the KV cache, but {need}; raise "
            f"--gpu-memory-utilization (or give --kv-cache-memory-bytes) or lower "
            f"--max-model-len")
