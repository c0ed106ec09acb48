"""Allocate the KV cache the way vLLM does, without paying for it up front.

vLLM's ``allocate_kv_cache`` (``vllm/v1/worker/utils.py``) backs every layer with one
``torch.zeros`` buffer and views it per layer with ``create_kv_cache_views``. On unified memory
the zero fill commits every page of a pool that mostly stays unused. Here the same buffer is
``torch.empty`` when vLLM does not need zeroed blocks (``KVCacheConfig.needs_kv_cache_zeroing``
is False: no Mamba layers, uniform KV precision): its pages are committed by the first write to a
block. vLLM's own ``create_kv_cache_views`` then makes the per-layer views, so sizes, strides,
offsets and dtypes are exactly vLLM's. Never-written memory cannot reach an output: attention
only reads positions below each sequence's length (and the MLX kernel keeps garbage in unread
slots out of the softmax; see ``attention/metadata.py``).
"""

from __future__ import annotations

import torch

from vllm_unified import compat

#: The layout the MLX attention reads: layer-compact, then block, token, head, channels. One
#: layer's region is then ``[num_blocks * block_size, num_kv_heads, head_size + head_size_v]``
#: slot-major, exactly what ``paged_attention_kv`` takes.
KV_LAYOUT = "LBNHC"


def allocate_kv_cache(
    kv_cache_config, layout_name: str = KV_LAYOUT, *, zero: bool | None = None,
    kernel_block_sizes: dict[int, int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The backing buffer and vLLM's per-layer views of it.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig``.
        layout_name: a ``KVCacheLayout`` name (vLLM's resolved layout).
        zero: force zeroing on or off (benchmarks compare both); default: vLLM's
            ``needs_kv_cache_zeroing``.
        kernel_block_sizes: KV-cache group id -> kernel block size ``k`` for attention
            groups whose pages the MLX attention reads as ``B/k`` kernel blocks (vLLM's
            ``create_kv_cache_views(kernel_block_size=k)``: a view of the same bytes).

    Returns:
        ``(buffer, views)``: the int8 buffer and ``{layer name: view}``, each attention view a
        ``[num_blocks * B/k, num_kv_heads, k, head_size + head_size_v]`` tensor in the spec's
        dtype with vLLM's strides (``k = B`` without a kernel block size); each state (Mamba)
        view vLLM's int8 ``[num_blocks, 1, 1, state_bytes]`` page view.

    Raises:
        ValueError: the config's tensors do not share one backing allocation, or a layer has no
            per-layer view.
    """
    layout = compat.KVCacheLayout[layout_name]
    tensors = kv_cache_config.kv_cache_tensors
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"KV cache tensors must share one backing allocation, got {sizes}")
    if zero is None:
        zero = kv_cache_config.needs_kv_cache_zeroing
    size = sizes.pop()
    buf = torch.zeros(size, dtype=torch.int8) if zero else torch.empty(size, dtype=torch.int8)
    views: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        gid = next(i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                   if tensor.layers[0] in g.layer_names)
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        if not getattr(spec, "has_layer_views", True):
            raise ValueError(f"layer {tensor.layers[0]} has no per-layer view")
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        kernel = (kernel_block_sizes or {}).get(gid)
        layer_views = compat.create_kv_cache_views(buf, spec, num_blocks, layout, tensor,
                                                   kernel_block_size=kernel)
        views.update(zip(tensor.layers, layer_views, strict=True))
    return buf, views


def slot_major(view: torch.Tensor) -> torch.Tensor:
    """One layer's ``[B, H, N, C]`` view (LBNHC strides) as ``[B * N, H, C]`` rows, no copy.

    Raises:
        ValueError: the view's memory is not block, token, head, channel ordered (another
            layout was resolved).
    """
    rows = view.permute(0, 2, 1, 3)
    if not rows.is_contiguous():
        raise ValueError(
            f"KV view with strides {tuple(view.stride())} is not in {KV_LAYOUT} order"
        )
    return rows.reshape(rows.shape[0] * rows.shape[1], rows.shape[2], rows.shape[3])
