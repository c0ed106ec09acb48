"""The KV-cache budget: how many bytes vLLM may turn into KV blocks.

vLLM does no memory profiling for an out-of-tree worker; the number the worker returns from
``determine_available_memory`` is all the scheduler knows, so it is computed here, explained in
the start-up log, and checked against the smallest useful pool (one ``max_model_len`` sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


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
    """

    total: int
    utilization: float
    in_use: int
    activations: int
    bytes_per_block: int
    min_bytes: int
    budget: int
    explicit: bool = False

    def describe(self) -> str:
        """One line: the formula with the numbers, for the start-up log and errors."""
        if self.explicit:
            return f"KV budget = --kv-cache-memory-bytes = {self.budget / GIB:.2f} GiB"
        return (
            f"KV budget = {self.utilization:.2f} x {self.total / GIB:.2f} GiB total - "
            f"{self.in_use / GIB:.2f} GiB in use (weights, runtime) - "
            f"{self.activations / GIB:.2f} GiB activations = {self.budget / GIB:.2f} GiB "
            f"({self.budget // max(self.bytes_per_block, 1)} blocks of "
            f"{self.bytes_per_block / 2**20:.2f} MiB)"
        )


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
) -> KVBudget:
    """``utilization x total - in_use - activations``, or ``kv_cache_memory_bytes`` if given.

    Raises:
        ValueError: the budget cannot hold one ``max_model_len`` sequence (plus vLLM's null
            block); the message names ``--gpu-memory-utilization`` and ``--max-model-len`` (or
            ``--kv-cache-memory-bytes``) and shows the arithmetic.
    """
    # ceil(max_model_len / block_size) blocks for the sequence, + 1 for vLLM's null block.
    min_blocks = -(-max_model_len // block_size) + 1
    min_bytes = min_blocks * bytes_per_block
    if kv_cache_memory_bytes is not None:
        budget = KVBudget(total, utilization, in_use, activations, bytes_per_block, min_bytes,
                          int(kv_cache_memory_bytes), explicit=True)
        if budget.budget < min_bytes:
            raise ValueError(
                f"--kv-cache-memory-bytes {kv_cache_memory_bytes}: one sequence of "
                f"--max-model-len {max_model_len} needs {min_blocks} blocks x "
                f"{bytes_per_block} bytes = {min_bytes} bytes; raise it or lower --max-model-len"
            )
        return budget
    value = int(utilization * total) - in_use - activations
    budget = KVBudget(total, utilization, in_use, activations, bytes_per_block, min_bytes, value)
    if value < min_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {budget.describe()}, but one sequence of "
            f"--max-model-len {max_model_len} needs {min_blocks} blocks x "
            f"{bytes_per_block / 2**20:.2f} MiB = {min_bytes / GIB:.3f} GiB. Raise "
            f"--gpu-memory-utilization or lower --max-model-len / --max-num-batched-tokens."
        )
    return budget
