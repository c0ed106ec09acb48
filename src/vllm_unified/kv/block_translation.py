"""Zero-copy block-size translation.

For hybrid attention + state-space models vLLM inflates the attention block size ``B`` (e.g.
144 or 544 tokens) so that an attention page and a state page have the same size. The MLX
attention runs on a small *kernel* block size ``k`` that divides ``B``: a cache
``[num_blocks, B, ...]`` is the same memory as ``[num_blocks * B/k, k, ...]`` (a view, no bytes
move), and vLLM's block id ``b`` becomes the kernel block ids ``b*B/k ... b*B/k + B/k - 1``.

This module holds no MLX or vLLM imports, so the platform can use it while vLLM resolves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Block sizes (tokens per KV page) the MLX attention implementation is built and tested for.
#: vLLM's ``--block-size`` must be a multiple of one of them (larger pages are read as several
#: kernel blocks).
KERNEL_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64)


def select_kernel_block_size(block_size: int, kernel_block_sizes: Sequence[int]) -> int:
    """The largest supported kernel block size that divides ``block_size``.

    Args:
        block_size: vLLM's attention block size ``B`` (tokens per page).
        kernel_block_sizes: the block sizes the attention implementation supports.

    Returns:
        ``k`` with ``B % k == 0`` (``B`` itself when it is supported).

    Raises:
        ValueError: no supported size divides ``B``; the message names ``--block-size``.
    """
    fitting = [k for k in kernel_block_sizes if k > 0 and block_size % k == 0]
    if block_size <= 0 or not fitting:
        raise ValueError(
            f"--block-size {block_size}: no MLX kernel block size "
            f"{sorted(kernel_block_sizes)} divides it; use a multiple of one of them"
        )
    return max(fitting)


def kernel_block_view(cache: Any, block_size: int, kernel_block_size: int) -> Any:
    """View ``cache`` ``[num_blocks, B, *rest]`` as ``[num_blocks * B/k, k, *rest]``.

    Works on torch tensors (``Tensor.view``: never copies, raises if it would have to) and on
    row-contiguous MLX arrays (``reshape`` of a contiguous array shares its buffer).

    Raises:
        ValueError: ``k`` does not divide ``B``, or axis 1 of ``cache`` is not ``B``.
    """
    if kernel_block_size <= 0 or block_size % kernel_block_size:
        raise ValueError(f"kernel block size {kernel_block_size} does not divide {block_size}")
    if cache.ndim < 2 or cache.shape[1] != block_size:
        raise ValueError(f"cache must be [num_blocks, {block_size}, ...], got {cache.shape}")
    shape = (cache.shape[0] * (block_size // kernel_block_size), kernel_block_size,
             *cache.shape[2:])
    if hasattr(cache, "view") and hasattr(cache, "data_ptr"):  # torch: a view or an error
        return cache.view(shape)
    return cache.reshape(shape)


def expand_block_table(
    block_table: np.ndarray,
    ratio: int,
    num_blocks: Sequence[int] | np.ndarray | None = None,
    pad: int = 0,
) -> np.ndarray:
    """Map a block table in vLLM's blocks to one in kernel blocks.

    Args:
        block_table: int ``[R, W]``; row i lists request i's block ids.
        ratio: ``B / k``, kernel blocks per vLLM block.
        num_blocks: per row, how many leading entries are real blocks (``len <= R``); the rest
            of a row, and rows past ``len(num_blocks)``, are padding. None: every entry is real.
        pad: value written for padding entries.

    Returns:
        int32 ``[R, W * ratio]``: entry ``(i, c * ratio + j)`` is ``block_table[i, c] * ratio
        + j`` for real entries, ``pad`` elsewhere.

    Raises:
        ValueError: ``ratio < 1``, a table that is not 2-D, or a row count past its width.
    """
    table = np.asarray(block_table)
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    if table.ndim != 2:
        raise ValueError(f"block_table must be [rows, width], got shape {table.shape}")
    out = (table.astype(np.int64)[:, :, None] * ratio + np.arange(ratio)).reshape(
        table.shape[0], -1
    )
    if num_blocks is not None:
        counts = np.asarray(num_blocks, dtype=np.int64).reshape(-1)
        if len(counts) > table.shape[0] or (counts > table.shape[1]).any() or (counts < 0).any():
            raise ValueError(f"num_blocks {counts.tolist()} do not fit a table {table.shape}")
        full = np.zeros(table.shape[0], dtype=np.int64)
        full[: len(counts)] = counts
        real = np.arange(out.shape[1])[None, :] < (full * ratio)[:, None]
        out = np.where(real, out, pad)
    return out.astype(np.int32)
