"""mlx-lm attention layers whose pure-decode steps hand the raw projections to the GPU kernels.

Why: on a GPU backend a decode step of a small model is bound by the host encoding one MLX
primitive after another (docs/dev/benchmarks.md). Between its projections and its attention a
llama-style layer runs a query norm, a key norm (Qwen3) and two RoPE rotations: four kernel
launches per layer and step that the KV write and the paged attention kernel can do on the
heads they load anyway (:mod:`vllm_unified.kv.attention.qk_prologue`).

Which layers: the attention modules of :data:`FAMILIES` (mlx-lm's llama, qwen2, qwen3 and
qwen3_moe modules, whose ``__call__`` is the sequence reproduced below) whose norms and
rotation the kernels compute (:func:`~vllm_unified.kv.attention.qk_prologue.prologue_of`). Their
class is swapped for a subclass (:func:`install_fused_decode_attention`) whose ``__call__``
takes the fused path when the layer's cache says this step allows it
(:meth:`~vllm_unified.kv.layer_cache.PagedLayerCache.fuses_decode`: a pure-decode step, a
KV write kernel and the paged GPU attention kernel) and otherwise calls mlx-lm's own, so
prefill chunks, mixed steps, the CPU backend and plain mlx-lm use are unchanged.

The fused path is mlx-lm's ``Attention.__call__`` (``mlx_lm/models/qwen3.py``) with its
middle handed to the cache: the three projections as mlx-lm calls them (so fused projections
and the decode GEMM kernel still apply), then
:meth:`~vllm_unified.kv.layer_cache.PagedLayerCache.attend_raw` (the key prologue in the KV
write, the query prologue in the attention kernel), then ``o_proj`` over the heads laid side by
side, which for one query row per sequence is mlx-lm's ``transpose(0, 2, 1, 3).reshape``.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_unified.kv.attention.qk_prologue import QKPrologue, prologue_of
from vllm_unified.kv.layer_cache import PagedLayerCache, PagedMask

__all__ = ["FAMILIES", "FusedDecodeAttention", "install_fused_decode_attention"]


def _families() -> tuple[type, ...]:
    from mlx_lm.models import llama, qwen2, qwen3, qwen3_moe

    return llama.Attention, qwen2.Attention, qwen3.Attention, qwen3_moe.Attention


#: mlx-lm attention classes whose ``__call__`` is projections, optional per-head norms, RoPE at
#: ``cache.offset``, ``cache.update_and_fetch``, ``scaled_dot_product_attention`` with
#: ``self.scale`` and the mask, ``o_proj`` (read in mlx-lm 0.32.2's sources, the pinned
#: version that vllm_unified.versions checks at start-up)
FAMILIES: tuple[type, ...] = _families()


class FusedDecodeAttention:
    """Mixin of the swapped classes (``type(name, (FusedDecodeAttention, family), {})``).

    Attributes (set by :func:`install_fused_decode_attention`):
        qk_prologue: the layer's :class:`~vllm_unified.kv.attention.qk_prologue.QKPrologue`.
        head_dim: D.
    """

    qk_prologue: QKPrologue
    head_dim: int

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not (isinstance(cache, PagedLayerCache)
                and cache.fuses_decode(x.dtype, self.head_dim)):
            return super().__call__(x, mask=mask, cache=cache)  # type: ignore[misc]
        if mask is not None and not isinstance(mask, PagedMask):
            raise TypeError(f"unexpected attention mask {type(mask).__name__} with a paged "
                            "cache")
        tokens, length, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out = cache.attend_raw(queries, keys, values, self.qk_prologue, self.n_heads,
                               self.scale, mask.window if mask is not None else None)
        return self.o_proj(out.reshape(tokens, length, -1))


@functools.cache
def _fused_class(family: type) -> type:
    return type(f"FusedDecode{family.__name__}", (FusedDecodeAttention, family), {})


def install_fused_decode_attention(model: nn.Module, head_dim: int) -> int:
    """Swap the class of every attention module of :data:`FAMILIES` in ``model`` whose prologue
    the kernels compute; idempotent. Call after the weights are loaded (the norm weights are
    copied into each layer's prologue parameters).

    Args:
        head_dim: the model's head size (vLLM's ``get_head_size()``).

    Returns:
        The number of layers swapped (0 for other families).
    """
    swapped = 0
    for _, module in model.named_modules():
        family = type(module)
        if isinstance(module, FusedDecodeAttention) or family not in FAMILIES:
            continue
        prologue = prologue_of(module, head_dim)
        if prologue is None:
            continue
        module.qk_prologue = prologue
        module.head_dim = head_dim
        module.__class__ = _fused_class(family)
        swapped += 1
    return swapped
