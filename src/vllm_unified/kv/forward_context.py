"""The step context: what the layers of one forward need to know about this step.

In the spirit of vLLM's ``vllm/forward_context.py`` (``set_forward_context`` /
``get_forward_context``): the runner builds one :class:`StepContext` per forward and binds it
for the duration of the forward with :func:`set_step_context`; the layer caches mlx-lm calls
(:mod:`vllm_unified.kv.layer_cache`) and the recurrent mixers
(:mod:`vllm_unified.models.routing`) read it with :func:`get_step_context`. Nothing per step is
written onto long-lived objects. Graph building happens inside the ``with`` block; MLX
evaluates later from the arrays the graph captured, so leaving the block early is safe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

    from vllm_unified.kv.attention.metadata import AttentionMetadata
    from vllm_unified.kv.state_pages import StateMetadata


@dataclass
class StepContext:
    """One forward's step data.

    Attributes:
        attn: the attention metadata of the step (positions, slot mapping, block tables on
            kernel blocks).
        state: a hybrid model's state-slot metadata for the same sequences, else None.
        kv: the per-layer pool arrays this forward reads and writes (index = attention
            ordinal). None: the pool's own list (the layers write through it in place). A
            compiled trace passes its traced inputs here and returns the written list.
        written: layer -> the completion token of this forward's GPU kernel write into it,
            which the layer's attention takes as an input
            (:func:`vllm_unified.kv.gpu.write.ordered_after`).
        lora: the adapters of the step's rows (a :class:`vllm_unified.models.lora.LoRAStep`;
            typed loosely: the layers above the cache define it), None when
            no row has one.
    """

    attn: AttentionMetadata
    state: StateMetadata | None = None
    kv: list[mx.array] | None = None
    written: dict[int, mx.array] = field(default_factory=dict)
    lora: Any = None


_current: StepContext | None = None


@contextlib.contextmanager
def set_step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Bind ``ctx`` for the forward built inside the block; the previous binding, if any, is
    restored on exit (a compiled step's trace binds its own context while it runs)."""
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def current_step_context() -> StepContext | None:
    """The bound step context, or None outside a step (a layer probed at load time)."""
    return _current


def get_step_context() -> StepContext:
    """The bound step context.

    Raises:
        RuntimeError: called outside :func:`set_step_context` (a paged layer used outside a
            step).
    """
    if _current is None:
        raise RuntimeError("paged KV cache used outside a step (no step context bound)")
    return _current
