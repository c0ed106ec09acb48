"""Sibling projections as one matmul on GPU backends: q/k/v and gate/up (vLLM's
``QKVParallelLinear`` and ``MergedColumnParallelLinear``, done on a loaded mlx-lm model).

Why: on a GPU a decode step of a small model is bound by host work per primitive (MLX
encodes and launches every primitive of the step; docs/dev/benchmarks.md, GPU decode), so
three matmuls over the same input cost about three times one matmul of their summed width.

How, without rewriting mlx-lm's model code: its layers call ``q_proj(x)``, ``k_proj(x)`` and
``v_proj(x)`` (``gate_proj(x)``, ``up_proj(x)``) on the same input array. The siblings'
weights are concatenated along the output axis into one linear, registered once on the parent
module (``qkv_proj`` / ``gate_up_proj``, so the model's parameters count it once); each former
projection becomes a :class:`FusedPart` that returns its columns of the group's output. The
first part called with an input computes the whole matmul; a sibling called with the same
array object takes its columns of that result (a slice, no copy). A part called with another
input, or a second time with the same one, computes the whole matmul again: always correct,
fused only in the usual call order.

q, k and v are fused only for inputs of one token row (a decode step of one sequence; the
token-major forward has one row per scheduled token): with more rows each part's columns are
a strided view, which MLX's RMSNorm and our row-contiguous KV write copy first (three copies
for the two matmuls saved). From two rows on, each part runs its own matmul on its rows of
the fused weight, a view of it (no second copy of the weights). gate/up columns go to
elementwise SwiGLU, which reads strided views as they are: always fused. Where a kernel can
write each part as an array of its own (``FusedGroup.split``: the CUDA decode GEMM kernel of
:mod:`vllm_unified.models.gpu_gemm`), q/k/v are fused at every row count it takes.

Only exact ``nn.Linear`` siblings (one dtype, biases on all or none) and exact
``nn.QuantizedLinear`` siblings (one ``bits`` / ``group_size`` / ``mode``; MLX groups along the
input axis, so their rows concatenate like dense rows) are fused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["GROUPS", "FusedGroup", "FusedPart", "fuse_projections"]

#: sibling projections fused, the parent attribute their fused linear gets, and the most
#: input rows for which the fused matmul runs (None: any)
GROUPS: tuple[tuple[tuple[str, ...], str, int | None], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj", 1),
    (("gate_proj", "up_proj"), "gate_up_proj", None),
)


#: the arrays of nn.Linear / nn.QuantizedLinear, each with output rows on axis 0
ARRAYS = ("weight", "scales", "biases", "bias")


class FusedGroup:
    """The shared state of one fused group: its linear and the latest input's output.

    Not an ``nn.Module`` (so the parts' parameter trees stay empty); holds the last output only
    until every part has taken its columns, so no activation outlives its layer's use.

    Args:
        linear: the fused linear (its output axis is the parts' outputs, in order).
        sizes: each part's output width.
        max_rows: the most input rows (``x.size // x.shape[-1]``) the fused matmul runs for;
            above it each part runs alone on its rows of the fused weight. None: no limit.
    """

    def __init__(self, linear: nn.Module, sizes: list[int], max_rows: int | None) -> None:
        self.linear = linear
        self.bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        self.max_rows = max_rows
        #: each part as a linear of its own over row views of the fused arrays (evaluated
        #: once here: MLX slices share their source's buffer)
        self.alone = [_rows(linear, a, b) for a, b in self.bounds] if max_rows else []
        #: ``split(x) -> [part outputs] | None``: a kernel that writes each part's columns as
        #: an array of its own (:func:`vllm_unified.models.gpu_gemm.install_gpu_gemm`), tried
        #: first at any row count; None where it does not apply
        self.split: Callable[[mx.array], list[mx.array] | None] | None = None
        self._x: mx.array | None = None
        self._y: mx.array | list[mx.array] | None = None
        self._taken: set[int] = set()

    def columns(self, x: mx.array, index: int) -> mx.array:
        """Part ``index``'s output for input ``x`` (``[..., in]`` -> ``[..., size_index]``)."""
        if self._x is not x or index in self._taken:
            self._x, self._y, self._taken = x, self._outputs(x), set()
        y = self._y
        self._taken.add(index)
        if len(self._taken) == len(self.bounds):
            self._x = self._y = None
        if isinstance(y, list):
            return y[index]
        if y is None:
            return self.alone[index](x)
        start, stop = self.bounds[index]
        return y[..., start:stop]

    def _outputs(self, x: mx.array) -> mx.array | list[mx.array] | None:
        """Every part's output (a list, from ``split``), the fused matmul's output, or None
        where each part runs alone (more rows than ``max_rows``)."""
        if self.split is not None and (parts := self.split(x)) is not None:
            return parts
        if self.max_rows is not None and x.size > self.max_rows * x.shape[-1]:
            return None
        return self.linear(x)


class FusedPart(nn.Module):
    """What a fused projection becomes: ``part(x)`` is the former linear's ``x @ W.T (+ b)``,
    computed as columns of the group's one matmul."""

    def __init__(self, group: FusedGroup, index: int) -> None:
        super().__init__()
        self._group = (group,)  # a tuple: MLX would register a Module or dict as a child
        self._index = index

    @property
    def group(self) -> FusedGroup:
        return self._group[0]

    def __call__(self, x: mx.array) -> mx.array:
        return self._group[0].columns(x, self._index)


def _fusable(parts: list[Any]) -> bool:
    """Siblings of one class (MLX's linears or their native-kernel subclasses), one weight
    dtype or one quantization (bits, group size, mode, scale dtype, biases), one input width,
    biases on all or none."""
    first = parts[0]
    kind = type(first)
    if not all(type(p) is kind for p in parts):
        return False
    if issubclass(kind, nn.QuantizedLinear):
        key = _quantization(first)
        same = all(_quantization(p) == key for p in parts)
    elif issubclass(kind, nn.Linear):
        same = all(p.weight.dtype == first.weight.dtype for p in parts)
    else:
        return False
    return (same and len({p.weight.shape[1] for p in parts}) == 1
            and len({"bias" in p for p in parts}) == 1)


def _quantization(linear: nn.QuantizedLinear) -> tuple:
    return (linear.bits, linear.group_size, getattr(linear, "mode", "affine"),
            linear.scales.dtype, "biases" in linear)


def _like(linear: nn.Module) -> nn.Module:
    """An empty module of ``linear``'s class with its settings (bits, group_size, mode) and
    none of its arrays."""
    module = type(linear).__new__(type(linear))
    nn.Module.__init__(module)
    module.__dict__.update({k: v for k, v in vars(linear).items() if k != "_no_grad"})
    module.__dict__["_no_grad"] = set(vars(linear).get("_no_grad", ()))
    return module


def _concatenated(parts: list[Any]) -> nn.Module:
    """One linear of the same class whose output rows are the parts' rows, in order."""
    first = parts[0]
    fused = _like(first)
    for key in ARRAYS:
        if key in first:
            fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    return fused


def _rows(linear: nn.Module, start: int, stop: int) -> nn.Module:
    """A linear of ``linear``'s class over output rows ``[start, stop)`` of its arrays."""
    part = _like(linear)
    for key in ARRAYS:
        if key in linear:
            part[key] = linear[key][start:stop]
    mx.eval(part.parameters())
    return part


def _groups(model: nn.Module) -> Iterator[tuple[nn.Module, tuple[str, ...], str, int | None]]:
    for _, module in model.named_modules():
        for names, fused_name, max_rows in GROUPS:
            if all(name in module for name in names) and fused_name not in module:
                yield module, names, fused_name, max_rows


def fuse_projections(model: nn.Module, max_rows: int | None = None) -> dict[str, int]:
    """Fuse every q/k/v and gate/up sibling set of ``model`` that :func:`_fusable` accepts.

    ``max_rows``: the most input rows any group's fused matmul runs for (each group's own
    limit of :data:`GROUPS` if lower); None keeps the groups' own limits.

    The siblings' arrays are freed as each group is fused (one group's weights exist twice at
    a time). Idempotent: fused groups are skipped.

    Returns:
        How many groups of each fused name were fused (``{"qkv_proj": 28, ...}``), for the log.
    """
    counts: dict[str, int] = {}
    for module, names, fused_name, group_rows in list(_groups(model)):
        parts = [module[name] for name in names]
        if not _fusable(parts):
            continue
        fused = _concatenated(parts)
        mx.eval(fused.parameters())
        limit = min((r for r in (group_rows, max_rows) if r is not None), default=None)
        group = FusedGroup(fused, [int(p.weight.shape[0]) for p in parts], limit)
        module[fused_name] = fused
        for index, name in enumerate(names):
            module[name] = FusedPart(group, index)
        counts[fused_name] = counts.get(fused_name, 0) + 1
    return counts
