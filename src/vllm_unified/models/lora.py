"""Low-rank adapters (LoRA) on the linear layers of a loaded mlx-lm model, several adapters in
one forward (vLLM's ``--enable-lora``; the adapters themselves are loaded by
:mod:`vllm_unified.worker.lora`).

Each targeted linear keeps its class, parameters and module path; its ``__class__`` becomes a
subclass whose call adds the step's low-rank update to the base output. The rows of a step are
grouped by adapter (:class:`LoRAStep`, bound in the step context); for each group the update
is ``(x[rows] @ A) @ B`` with A ``[in, r]`` and B ``[r, out]`` (the adapter's scaling folded
into B), in the compute dtype, and the base layer (quantized or not) runs once over all rows.
Rows of requests without an adapter get an update of exact zeros: their outputs keep their
bits. Without adapter rows in the step the layer is the base layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_unified.kv.forward_context import current_step_context

__all__ = ["TARGETS", "AdapterWeights", "LoRAStep", "install_lora_layers", "lora_targets"]

#: the linear layers adapters may target, by their last name (PEFT's ``target_modules``)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class AdapterWeights:
    """One loaded adapter.

    Attributes:
        lora_int_id: vLLM's adapter id (``LoRARequest.lora_int_id``, > 0).
        name: vLLM's adapter name.
        modules: module path -> ``(A [in, r], B [r, out])`` in the compute dtype, scaling in B.
        rank: the largest rank over its modules.
    """

    lora_int_id: int
    name: str
    modules: dict[str, tuple[mx.array, mx.array]]
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


class LoRAStep:
    """The adapters of one step's rows.

    Args:
        groups: ``(adapter, rows)`` per adapter present, rows as an ascending int array into
            the step's ``T`` token rows.
        num_rows: ``T``.
    """

    def __init__(self, groups: list[tuple[AdapterWeights, np.ndarray]], num_rows: int) -> None:
        self.groups = [(adapter, _row_selector(rows)) for adapter, rows in groups]
        self.sizes = [int(rows.size) for _, rows in groups]
        self.ids = [adapter.lora_int_id for adapter, _ in groups]
        # one group holding every row in order: its update is the whole update
        self.whole = len(groups) == 1 and groups[0][1].size == num_rows
        index = np.zeros(num_rows, np.int32)  # row -> its row in [zero row, group rows...]
        offset = 1
        for _, rows in groups:
            index[rows] = np.arange(offset, offset + rows.size, dtype=np.int32)
            offset += rows.size
        self.index = None if self.whole else mx.array(index)

    def delta(self, name: str, x: mx.array, out_dim: int) -> mx.array | None:
        """The update of module ``name`` for the step's rows: ``[T, out_dim]`` in x's dtype,
        or None when no adapter of the step targets it.

        Args:
            x: ``[T, in]`` the layer's input rows.
        """
        if not any(name in adapter.modules for adapter, _ in self.groups):
            return None
        parts = []
        for (adapter, rows), size in zip(self.groups, self.sizes, strict=True):
            weights = adapter.modules.get(name)
            if weights is None:
                parts.append(mx.zeros((size, out_dim), x.dtype))
                continue
            a, b = weights
            parts.append(((x if rows is None else x[rows]) @ a) @ b)
        if self.whole:
            return parts[0]
        return mx.concatenate([mx.zeros((1, out_dim), x.dtype), *parts])[self.index]


def _row_selector(rows: np.ndarray) -> slice | mx.array | None:
    """``rows`` as the cheapest index: a slice when contiguous (None: every row from 0)."""
    if rows.size and rows[-1] - rows[0] + 1 == rows.size:
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return mx.array(rows.astype(np.int32))


def lora_targets(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The linear layers of ``model`` an adapter may target: module path -> ``(in, out)``
    features (quantized layers included; their packed weights give ``out``, ``in`` from the
    unpacked width)."""
    targets: dict[str, tuple[int, int]] = {}
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in TARGETS and isinstance(module, nn.Module):
            dims = _features(module)
            if dims is not None:
                targets[path] = dims
    return targets


def _features(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear (dense or MLX-quantized), or None for another module."""
    weight = module.get("weight")
    if not isinstance(weight, mx.array) or weight.ndim != 2:
        return None
    bits = getattr(module, "bits", None) if "scales" in module else None
    width = weight.shape[1] * 32 // bits if bits else weight.shape[1]
    return width, weight.shape[0]


def install_lora_layers(model: nn.Module, targets: dict[str, tuple[int, int]]) -> None:
    """Give each module of ``targets`` (paths from :func:`lora_targets`) the adapter update.
    Idempotent."""
    modules = dict(model.named_modules())
    for path in targets:
        module = modules[path]
        if getattr(module, "lora_path", None) is None:
            module.lora_path = path
            module.__class__ = _with_lora(type(module))


@functools.cache
def _with_lora(cls: type) -> type:
    """``cls`` with the step's adapter update added to its output."""
    base_call: Callable[..., Any] = cls.__call__

    def __call__(self: Any, x: mx.array) -> mx.array:
        y = base_call(self, x)
        ctx = current_step_context()
        if ctx is None or ctx.lora is None:
            return y
        d = ctx.lora.delta(self.lora_path, x.reshape(-1, x.shape[-1]), y.shape[-1])
        return y if d is None else y + d.reshape(y.shape).astype(y.dtype)

    return type(f"LoRA{cls.__name__}", (cls,), {"__call__": __call__})
