"""Quantized KV cache (``--kv-cache-dtype int8_per_token_head / int4_per_token_head``).

* The quantizing write produces vLLM's page bytes: vLLM's own Triton write kernels, run on the
  CPU by Triton's interpreter (tests/kv_quant_oracle.py), are the oracle, byte for byte.
* The page layout and size are vLLM's (``TritonAttentionBackend.customize_spec``).
* The native paged attention over quantized pages equals the pure-MLX reference over the
  dequantized pages within fp32 rounding (decode, prefill chunks, GQA, windows).
* Unsupported values of the flag are refused naming it and the supported values.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

TESTS = Path(__file__).resolve().parent
MODES = ["int8_per_token_head", "int4_per_token_head"]


def _pool(fmt, num_blocks: int, block_size: int, heads: int, dim: int):
    """Our KV pool over our allocation of vLLM's views for one layer in format ``fmt``."""
    from vllm_unified import compat
    from vllm_unified.kv.allocation import allocate_kv_cache
    from vllm_unified.kv.pool import KVPool
    from vllm_unified.kv.quant import attention_spec

    spec = attention_spec(fmt, block_size=block_size, num_kv_heads=heads, head_size=dim,
                          dtype=torch.float32)
    size = spec.page_size_bytes * num_blocks
    tensor = compat.KVCacheTensor(size=size, layers=["l0"], layer_stride=size,
                                  block_stride=spec.page_size_bytes)
    config = compat.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                                  kv_cache_groups=[compat.KVCacheGroupSpec(["l0"], spec)])
    buf, views = allocate_kv_cache(config)
    pool = KVPool.from_torch_views([views["l0"]], block_size, buf, fmt=fmt, head_size=dim)
    return pool, buf, spec


def _oracle(tmp_path: Path, cases: list[dict]) -> list:
    """vLLM's write kernels over each case (one subprocess for all)."""
    args = []
    for i, case in enumerate(cases):
        src, dst = tmp_path / f"case{i}-in.npz", tmp_path / f"case{i}-out.npz"
        np.savez(src, **case)
        args += [str(src), str(dst)]
    proc = subprocess.run([sys.executable, str(TESTS / "kv_quant_oracle.py"), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [np.load(args[2 * i + 1]) for i in range(len(cases))]


def test_quantizing_write_gives_vllms_page_bytes(tmp_path):
    """Every mode and head sizes 64 and 128: the cells our native write puts at each slot are
    the bytes vLLM's write kernel puts there (untouched cells differ only because vLLM's
    backend fills its scale views with 1.0)."""
    import mlx.core as mx

    from vllm_unified.kv.quant import kv_format

    num_blocks, block_size, heads, tokens = 6, 16, 2, 41
    cases, ours = [], []
    for dim in (64, 128):
        rng = np.random.default_rng(dim)
        # Gaussian rows with an outlier, an all-zero row (the 1e-6 scale floor) and one-sided
        # rows (the zero point at an end).
        keys = rng.standard_normal((tokens, heads, dim)).astype(np.float32) * 3
        values = rng.standard_normal((tokens, heads, dim)).astype(np.float32)
        keys[3, 0, 5] = 40.0
        values[7, 1, :] = 0.0
        keys[9] = np.abs(keys[9])
        slots = rng.permutation(num_blocks * block_size)[:tokens]
        for name in MODES:
            fmt = kv_format(name)
            pool, buf, spec = _pool(fmt, num_blocks, block_size, heads, dim)
            pool.write(0, mx.array(slots.astype(np.int32)), mx.array(keys), mx.array(values))
            mx.eval(pool.kv)
            cases.append(dict(keys=keys, values=values, slots=slots.astype(np.int64),
                              num_blocks=num_blocks, block_size=block_size, cache_dtype=name))
            ours.append((name, dim, fmt, spec, buf.numpy().view(np.uint8).copy(), slots))
    for (name, dim, fmt, spec, mine, slots), ref in zip(ours, _oracle(tmp_path, cases),
                                                        strict=True):
        assert int(ref["page_size"]) == spec.page_size_bytes, name
        assert int(ref["cell"]) == fmt.cell_bytes(dim), name
        cell = fmt.cell_bytes(dim)
        ours_cells = mine[:ref["buffer"].size].reshape(-1, heads, cell)[slots]
        ref_cells = ref["buffer"].reshape(-1, heads, cell)[slots]
        assert (ours_cells != 0).mean() > 0.5, (name, dim)  # the write did land
        mismatch = np.argwhere(ours_cells != ref_cells)
        assert mismatch.size == 0, (name, dim, mismatch[:10])
