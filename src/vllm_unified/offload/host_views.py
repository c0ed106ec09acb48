"""Zero-copy numpy views of torch memory, checked.

The offload worker copies KV bytes with numpy between vLLM's per-layer KV views and the host
pool (views carved out of vLLM's shared offload region), and the disk tier reads and writes the
host pool through a memoryview. A numpy array that silently copied its torch source would
make a store land in a private copy that the disk tier never sees (and a load never reach the
KV pool), so every view is checked by address once, when it is made.
"""

from __future__ import annotations

import numpy as np
import torch


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor.numpy()``; a module-level seam so tests can force a copying conversion."""
    return tensor.numpy()


def checked_numpy(tensor: torch.Tensor, what: str) -> np.ndarray:
    """A numpy array sharing ``tensor``'s bytes (same address, shape and byte strides).

    Args:
        tensor: a CPU tensor (any shape and strides).
        what: names the memory in the error message (e.g. "host pool view 3").

    Raises:
        RuntimeError: the conversion did not produce a view of the same bytes.
    """
    arr = _to_numpy(tensor)
    expected = tuple(s * tensor.element_size() for s in tensor.stride())
    if (arr.ctypes.data != tensor.data_ptr() or arr.strides != expected
            or arr.shape != tuple(tensor.shape)):
        raise RuntimeError(
            f"{what}: numpy view is not zero-copy (numpy address {arr.ctypes.data:#x}, "
            f"strides {arr.strides}; torch data_ptr {tensor.data_ptr():#x}, strides {expected}); "
            "a copy would hide KV stores and loads from the other side"
        )
    return arr


def check_buffer_address(view: memoryview, address: int, what: str) -> None:
    """Check that ``view`` starts at ``address``.

    Raises:
        RuntimeError: it does not (the memoryview is over a copy, not the shared bytes).
    """
    actual = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data
    if actual != address:
        raise RuntimeError(
            f"{what}: memoryview at {actual:#x} is not the shared region at {address:#x}"
        )
