"""Low-rank adapters (LoRA) on the linear layers of a loaded mlx-lm model, several adapters in
one forward (vLLM's ``--enable-lora``; the adapters themselves are loaded by
:mod:`vllm_unified.worker.lora`).

Each targeted linear keeps its class, parameters and module path; its ``__class__`` becomes a
subclass whose call adds the step's low-rank update to the base output. As vLLM's stacked LoRA
layers do, the adapters a step may use sit in ``max_loras`` slots of rank ``max_lora_rank``
(:class:`LoRASlots`): per linear, every slot's A stacked (``[S*R, in]``, transposed) and every
slot's B stacked (``[S*R, out]``), the adapter's scaling folded into B. On the native CPU
kernels one operation per linear adds each row's update under its own slot and rank, in the
base output's buffer (vLLM's punica shrink and expand). Elsewhere (GPU backends, other
dtypes) the pure-MLX form: ``y + ((x @ A.T) * mask) @ B``, the step's mask keeping for each row
the R columns of its adapter's slot (:class:`LoRAStep`), three MLX operations per linear
whatever the number of adapters in the step. The base layer (quantized or not) runs once
over all rows. Rows of requests without an adapter are not updated (native) or get exact
zeros (MLX): their outputs keep their bits. Without adapter rows in the step the layer is the
base layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_unified import bridge
from vllm_unified.kv.forward_context import current_step_context

__all__ = ["TARGETS", "AdapterWeights", "LoRASlots", "LoRAStep", "install_lora_layers",
           "lora_targets"]

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


class LoRASlots:
    """``num_slots`` adapter slots of rank ``max_rank`` on every target linear: per module path,
    ``a[path]`` ``[S*R, in]`` (each slot's A transposed: R rows of ``in``) and ``b[path]``
    ``[S*R, out]``.

    Args:
        targets: module path -> ``(in, out)`` (:func:`lora_targets`).
        num_slots: S, vLLM's ``max_loras``.
        max_rank: R, vLLM's ``max_lora_rank``; an adapter of rank r fills the first r columns
            of its slot's A and rows of its B, the rest stay zero.
        dtype: the compute dtype.
    """

    def __init__(self, targets: dict[str, tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: mx.Dtype) -> None:
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        width = num_slots * max_rank
        self.a = {p: mx.zeros((width, i), dtype) for p, (i, _) in targets.items()}
        self.b = {p: mx.zeros((width, o), dtype) for p, (_, o) in targets.items()}
        mx.eval(list(self.a.values()), list(self.b.values()))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.a.values()) + sum(b.nbytes for b in self.b.values())

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Put ``adapter`` in ``slot`` (zeros where it has no module or a lower rank).

        The stacks are replaced by new arrays, never updated in place: a step queued before
        (asynchronous scheduling) still holds the stacks it was built with, and an in-place
        update (``a[lo:hi] = ...`` rewrites the array every holder sees) would change its
        adapter under it.
        """
        lo, hi = slot * self.max_rank, (slot + 1) * self.max_rank
        for path in self.a:
            a, b = self.a[path], self.b[path]
            a_slot = mx.zeros((self.max_rank, a.shape[1]), self.dtype)
            b_slot = mx.zeros((self.max_rank, b.shape[1]), self.dtype)
            weights = adapter.modules.get(path)
            if weights is not None:
                r = weights[0].shape[1]
                a_slot = mx.concatenate([weights[0].T, a_slot[r:]])
                b_slot = mx.concatenate([weights[1], b_slot[r:]])
            self.a[path] = mx.concatenate([a[:lo], a_slot, a[hi:]])
            self.b[path] = mx.concatenate([b[:lo], b_slot, b[hi:]])
        mx.eval(list(self.a.values()), list(self.b.values()))


class LoRAStep:
    """The adapters of one step's rows.

    Args:
        slots: the slots the step's adapters are in.
        row_slots: ``[T]`` int, each token row's slot, -1 for rows without an adapter.
        targeted: the module paths some adapter of the step has weights for.
        ranks: slot -> the rank of the adapter in it, for the slots the step uses.
        native: take the native CPU kernel where it applies (False: the pure-MLX form).
    """

    def __init__(self, slots: LoRASlots, row_slots: np.ndarray, targeted: set[str],
                 ranks: dict[int, int], native: bool = True) -> None:
        self.slots = slots
        self.targeted = targeted
        self.row_slots = row_slots
        self.native = (bridge.native_kernels() if native and slots.dtype == mx.float32
                       else None)
        self.mask: mx.array | None = None
        if self.native is not None:
            self.slot_of_row = mx.array(row_slots.astype(np.int32))
            self.rank = mx.array([ranks.get(s, 0) for s in range(slots.num_slots)], mx.int32)
        else:
            mask = np.zeros((row_slots.size, slots.num_slots), np.float32)
            rows = np.flatnonzero(row_slots >= 0)
            mask[rows, row_slots[rows]] = 1.0
            self.mask = mx.array(np.repeat(mask, slots.max_rank, axis=1)).astype(slots.dtype)

    def apply(self, name: str, x: mx.array, y: mx.array) -> mx.array:
        """``y`` plus the update of module ``name`` for the step's rows (``y`` itself when no
        adapter of the step targets it).

        Args:
            x: ``[..., in]`` the layer's input, T rows (``x.size // in``).
            y: ``[..., out]`` the base layer's output, the same leading axes.
        """
        if name not in self.targeted:
            return y
        a, b = self.slots.a[name], self.slots.b[name]
        if self.native is not None and x.dtype == y.dtype == mx.float32:
            # each row's own slot and rank only (vLLM's punica shrink / expand), in place in y
            return self.native.lora_update(y, x, a, b, self.slot_of_row, self.rank)
        if self.mask is None:
            raise RuntimeError(f"LoRA step on the native kernels got {x.dtype} / {y.dtype} "
                               "rows (float32 only)")
        rows = x.size // x.shape[-1]
        x2 = x.reshape(rows, x.shape[-1])
        if x2.dtype != a.dtype:
            x2 = x2.astype(a.dtype)
        update_in = (x2 @ a.T) * self.mask
        out = mx.addmm(y.reshape(rows, y.shape[-1]), update_in,
                       b if b.dtype == y.dtype else b.astype(y.dtype))
        return out.reshape(y.shape)


def lora_targets(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The linear layers of ``model`` an adapter may target: module path -> ``(in, out)``
    features (quantized layers included; their packed weights give ``out``, ``in`` from the
    unpacked width)."""
    targets: dict[str, tuple[int, int]] = {}
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in TARGETS:
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
        return ctx.lora.apply(self.lora_path, x, y)

    return type(f"LoRA{cls.__name__}", (cls,), {"__call__": __call__})
