"""Chunked local attention (Llama 4's ``attention_chunk_size``, vLLM's chunked local attention):
the paged reference against a naive dense attention in float64, the key views it reads, and the
production dispatch: the native CPU kernel on MLX's CPU backend (the reference where GPU kernels
would run)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from conftest import cover_each_value
from test_paged_attention import D, make_pool, random_kv

from vllm_unified import bridge
from vllm_unified.kv.attention import cpu as cpu_attention
from vllm_unified.kv.attention.dispatch import paged_attention_kv
from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.attention.reference import paged_attention, write_kv
from vllm_unified.kv.quant import dequantize_pool, kv_format, quantize_cells_reference

TOL = 1e-5


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                    scale: float, window: int | None, chunk: int | None) -> np.ndarray:
    """q [L, H, D] at positions q_pos; k, v [S, Hkv, D] = the sequence's keys 0..S-1; a query
    at p sees keys k <= p, k > p - window, k // chunk == p // chunk."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kh = np.arange(heads) // (heads // kv_heads)
    scores = np.einsum("lhd,shd->hls", q, k[:, kh]) * scale
    k_pos = np.arange(k.shape[0])[None]
    visible = k_pos <= q_pos[:, None]
    if window is not None:
        visible &= k_pos > q_pos[:, None] - window
    if chunk is not None:
        visible &= k_pos // chunk == q_pos[:, None] // chunk
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hls,shd->lhd", probs, v[:, kh])


@dataclass(frozen=True)
class Case:
    chunk: int
    block_size: int
    heads: tuple[int, int]
    window: int | None = None

    @property
    def name(self) -> str:
        return (f"c{self.chunk}-b{self.block_size}-h{self.heads[0]}x{self.heads[1]}"
                f"-w{self.window}")


CASES = [Case(c, b, h, w) for c in (1, 5, 8, 16, 1000) for b in (8, 16)
         for h in ((8, 2), (9, 3)) for w in (None, 6)]


def _step(pool, query_lens, seq_lens, ks, vs, heads, rng, case: Case):
    """Write the step's keys, attend by the reference and the dispatch; ``(reference,
    dispatch, naive)`` as ``[T, H, D]``."""
    meta = build_attention_metadata(query_lens, seq_lens, pool.tables, pool.block_size)
    q_pos = np.array(meta.positions)
    seq_of_row = np.repeat(np.arange(len(query_lens)), query_lens)
    new_k = np.stack([ks[s][p] for s, p in zip(seq_of_row, q_pos, strict=True)])
    new_v = np.stack([vs[s][p] for s, p in zip(seq_of_row, q_pos, strict=True)])
    pool.k, pool.v = write_kv(pool.k, pool.v, mx.array(new_k)[:, :, None],
                              mx.array(new_v)[:, :, None], meta.slot_mapping)
    queries = rng.standard_normal((meta.num_tokens, heads, 1, D)).astype(np.float32)
    scale = D**-0.5
    ref = paged_attention(mx.array(queries), pool.k, pool.v, meta, scale, case.window,
                          chunk=case.chunk)
    kv_pool = mx.concatenate([pool.k, pool.v], axis=-1)
    prod = paged_attention_kv(mx.array(queries), kv_pool, meta, scale, case.window,
                              chunk=case.chunk)
    expected = np.zeros((meta.num_tokens, heads, D))
    start = 0
    for s, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        rows = slice(start, start + ql)
        start += ql
        if ql:
            expected[rows] = naive_attention(queries[rows, :, 0].astype(np.float64),
                                             ks[s][:sl], vs[s][:sl], q_pos[rows], scale,
                                             case.window, case.chunk)
    return np.array(ref)[:, :, 0], np.array(prod)[:, :, 0], expected


@pytest.mark.parametrize("case", cover_each_value(CASES))
def test_chunked_attention_matches_naive(case: Case, monkeypatch) -> None:
    """Mixed steps (decodes at and across chunk boundaries, prefill chunks inside one attention
    chunk and spanning several, fresh prompts): reference and dispatch (the native CPU kernel
    where it is built) equal the naive attention; never-written (NaN) memory never reaches an
    output."""
    calls = []
    kernel = cpu_attention.paged_attention_rows
    monkeypatch.setattr(cpu_attention, "paged_attention_rows",
                        lambda *a, **k: calls.append(k.get("chunk")) or kernel(*a, **k))
    rng = np.random.default_rng(case.chunk * 7 + case.block_size + case.heads[0])
    heads, kv_heads = case.heads
    prefix_lens = [37, 0, 5, 64, 1, 16, 90, 0, 7]
    query_lens = [1, 23, 1, 17, 1, 1, 1, 3, 40]
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens, strict=True)]
    pool = make_pool(rng, seq_lens, kv_heads, case.block_size)
    ks, vs = random_kv(rng, seq_lens, kv_heads)
    for q_lens, s_lens in ((prefix_lens, prefix_lens), (query_lens, seq_lens)):
        ref, prod, expected = _step(pool, q_lens, s_lens, ks, vs, heads, rng, case)
        assert np.isfinite(ref).all() and np.isfinite(prod).all()
        np.testing.assert_allclose(ref, expected, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(prod, expected, atol=TOL, rtol=TOL)
    if sys.platform != "darwin":  # macOS builds no native extension
        assert bridge.native_error() is None and calls == [case.chunk] * 2


def test_chunk_views_read_only_the_query_chunk() -> None:
    """Decode at position 149 with chunk 16 reads keys 144..149 only; a prefill chunk at
    90..99 reads from 80 (the first query's chunk) with a mask that cuts at 96; a prefill
    inside one attention chunk stays causal."""
    block_size = 8
    tables = np.arange(1, 1 + 3 * 20, dtype=np.int32).reshape(3, 20)
    meta = build_attention_metadata([1, 10, 4], [150, 100, 36], tables, block_size)
    view = meta.decode_view(None, 2, chunk=16)
    assert view.rows.shape == (1, 2, 6) and view.mask is None
    pos = np.arange(144, 150)
    slots = tables[0, pos // block_size] * block_size + pos % block_size
    assert np.array(view.rows[0, 0]).tolist() == (slots * 2).tolist()
    prefill = meta.prefill_view(0, None, 2, chunk=16)
    assert prefill.first_key == 80 and prefill.rows.shape == (1, 2, 20)
    mask = np.array(prefill.mask)
    assert mask[5].tolist() == [True] * 16 + [False] * 4  # position 95 sees 80..95
    assert mask[6].tolist() == [False] * 16 + [True] + [False] * 3  # 96 sees 96
    inside = meta.prefill_view(1, None, 2, chunk=16)
    assert inside.first_key == 32 and inside.mask == "causal"
    # the chunk is part of the view's identity: full attention is not served from the cache
    assert meta.decode_view(None, 2).rows.shape == (1, 2, 150)
    fresh = np.array(meta.fresh_mask(0, None, chunk=4))
    assert fresh[5].tolist() == [False] * 4 + [True, True] + [False] * 4


def test_chunk_must_be_positive() -> None:
    pool = mx.zeros((16, 1, D))
    meta = build_attention_metadata([1], [1], np.array([[0]], dtype=np.int32), 16)
    with pytest.raises(ValueError, match="attention chunk must be >= 1"):
        paged_attention(mx.zeros((1, 2, 1, D)), pool, pool, meta, 0.25, chunk=0)


def test_quantized_pool_with_chunk_is_the_reference() -> None:
    """An int8 pool with a chunk (the native CPU kernel dequantizing cells as it reads them)
    equals the reference's attention over the dequantized pool."""
    fmt = kv_format("int8_per_token_head")
    rng = np.random.default_rng(0)
    block, kv_heads, heads, dim = 16, 2, 4, 32
    tables = np.array([[1, 2, 3, 0], [4, 5, 0, 0]], dtype=np.int32)
    meta = build_attention_metadata([1, 9], [40, 25], tables, block)
    kv = rng.normal(size=(6 * block, kv_heads, 2 * dim)).astype(np.float32)
    cells = mx.array(quantize_cells_reference(kv[..., :dim], kv[..., dim:], fmt, "float32"))
    q = mx.array(rng.normal(size=(10, heads, 1, dim)).astype(np.float32))
    got = paged_attention_kv(q, cells, meta, dim**-0.5, None, kv_format=fmt, chunk=8)
    dense = dequantize_pool(cells, fmt, dim)
    want = paged_attention_kv(q, dense, meta, dim**-0.5, None, accelerate=False, chunk=8)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- GPU kernels


@dataclass(frozen=True)
class GpuCase:
    kind: str
    chunk: int
    window: int | None
    route: str

    @property
    def name(self) -> str:
        return f"{self.kind}-c{self.chunk}-w{self.window}-{self.route}"


GPU_CASES = [GpuCase(k, c, w, r) for k in ("mixed", "decode", "prefill") for c in (16, 5)
             for w in (None, 16) for r in ("kernel", "split")]


def _emulated_launch(dialect, queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                     decode, prologue=None, after=None, chunk=None):
    """gpu_paged.launch with the Metal instance run by the CPU emulation (as
    tests/test_gpu_attention.py, with the chunk)."""
    import metal_emulation as emu

    from vllm_unified import gpu_dialect
    from vllm_unified.kv.gpu import paged as gpu_paged

    assert dialect == "metal" and prologue is None
    a = gpu_paged.launch_args(queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                              decode, chunk=chunk)
    assert ("CHUNK", chunk or 0) in a.template
    _, source = gpu_dialect.assemble_metal(
        gpu_paged.KERNEL_NAME, gpu_paged.INPUT_NAMES, gpu_paged.OUTPUT_NAMES,
        gpu_paged.kernel_source(False), a.inputs, a.template, output_dtypes=a.output_dtypes,
        header=gpu_paged.HEADER)
    _, outputs = emu.run(source, a.inputs, a.output_shapes, a.output_dtypes, a.grid,
                         a.threadgroup)
    return mx.array(outputs[0]).astype(queries.dtype)


def _clang_missing() -> bool:
    import metal_emulation as emu

    return emu.clang() is None


@pytest.mark.skipif(_clang_missing(), reason="clang++ is not installed (Metal emulation)")
@pytest.mark.parametrize("case", cover_each_value(GPU_CASES))
def test_metal_kernel_with_chunk_matches_the_reference(case: GpuCase, monkeypatch) -> None:
    """The paged GPU kernel's Metal instance, emulated, through paged_gpu_attention with an
    attention chunk (tiles spanning chunk boundaries; fresh chunks to SDPA on the split route)
    equals the reference; unowned (NaN) slots never reach an output."""
    from gpu_attention_grid import EVERY_ROW, Case, build

    from vllm_unified.kv.attention.reference import paged_attention_kv as reference_kv
    from vllm_unified.kv.gpu import paged as gpu_paged

    monkeypatch.setattr(gpu_paged, "launch", _emulated_launch)
    b = build(Case(kind=case.kind, dim=64, group=3, kv_heads=2, block_size=16,
                   window=case.window, dtype="float32", route=case.route, seed=case.chunk))
    with mx.stream(mx.cpu):
        want = np.array(reference_kv(b.queries, b.pool, b.meta, b.scale, case.window,
                                     chunk=case.chunk))
    got = np.array(gpu_paged.paged_gpu_attention(
        "metal", b.queries, b.pool, b.meta, b.scale, case.window, b.fresh,
        EVERY_ROW if case.route == "kernel" else None, chunk=case.chunk))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
