"""Paged attention reference vs. a naive dense attention, per sequence, in float64 numpy."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from vllm_unified import bridge
from vllm_unified.kv.attention import dispatch as paged
from vllm_unified.kv.attention.dispatch import paged_attention_kv
from vllm_unified.kv.attention.metadata import AttentionMetadata, build_attention_metadata
from vllm_unified.kv.attention.reference import paged_attention, write_kv

D = 16
TOL = 1e-5


@dataclass
class Pool:
    """A layer's KV pool plus random, shuffled block assignments for a batch of sequences."""

    k: mx.array
    v: mx.array
    block_size: int
    tables: np.ndarray  # [B, max_blocks], padded with block 0 (never assigned, like vLLM's)


def make_pool(
    rng: np.random.Generator, seq_lens: list[int], kv_heads: int, block_size: int
) -> Pool:
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 5  # spare blocks stay unwritten
    # Block 0 is reserved padding; the rest are handed out in random order.
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seq_lens), max(needed) + 2), dtype=np.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = ids[used : used + n]
        used += n
    # NaN stands in for never-initialised memory (lazy allocation): it must not reach an output.
    shape = (num_blocks * block_size, kv_heads, D)
    k = mx.full(shape, float("nan"))
    v = mx.full(shape, float("nan"))
    return Pool(k, v, block_size, tables)


def naive_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    scale: float,
    window: int | None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """q [L, H, D] at positions q_pos; k, v [S, Hkv, D] = the sequence's keys 0..S-1;
    ``softcap``: scores -> softcap * tanh(scores / softcap) before the mask; ``sinks`` [H]:
    an extra logit per head in the softmax that weights no value."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kh = np.arange(heads) // (heads // kv_heads)
    scores = np.einsum("lhd,shd->hls", q, k[:, kh]) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    k_pos = np.arange(k.shape[0])
    visible = k_pos[None] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None] > q_pos[:, None] - window
    scores = np.where(visible[None], scores, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(sinks.astype(np.float64)[:, None, None], (*scores.shape[:2], 1))
        scores = np.concatenate([scores, column], axis=-1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if sinks is not None:
        probs = probs[..., :-1]
    return np.einsum("hls,shd->lhd", probs, v[:, kh])


def run_step(
    pool: Pool,
    query_lens: list[int],
    seq_lens: list[int],
    full_k: list[np.ndarray],
    full_v: list[np.ndarray],
    heads: int,
    rng: np.random.Generator,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
    """Write this step's K/V, attend, and return (meta, output, naive reference) as [T, H, D]."""
    meta = build_attention_metadata(query_lens, seq_lens, pool.tables, pool.block_size)
    q_pos = np.array(meta.positions)
    seq_of_row = np.repeat(np.arange(len(query_lens)), query_lens)
    new_k = np.stack([full_k[s][p] for s, p in zip(seq_of_row, q_pos, strict=True)])
    new_v = np.stack([full_v[s][p] for s, p in zip(seq_of_row, q_pos, strict=True)])
    queries = rng.standard_normal((meta.num_tokens, heads, 1, D)).astype(np.float32)

    pool.k, pool.v = write_kv(
        pool.k,
        pool.v,
        mx.array(new_k)[:, :, None],
        mx.array(new_v)[:, :, None],
        meta.slot_mapping,
    )
    scale = D**-0.5
    out = paged_attention(mx.array(queries), pool.k, pool.v, meta, scale, window,
                          softcap=softcap, sinks=None if sinks is None else mx.array(sinks))
    assert out.shape == (meta.num_tokens, heads, 1, D) and out.dtype == mx.float32

    expected = np.zeros((meta.num_tokens, heads, D))
    start = 0
    for s, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        rows = slice(start, start + ql)
        start += ql
        if ql == 0:
            continue
        expected[rows] = naive_attention(
            queries[rows, :, 0].astype(np.float64),
            full_k[s][:sl],
            full_v[s][:sl],
            q_pos[rows],
            scale,
            window,
            softcap,
            sinks,
        )
    return meta, np.array(out)[:, :, 0], expected


def random_kv(rng, seq_lens, kv_heads) -> tuple[list[np.ndarray], list[np.ndarray]]:
    ks = [rng.standard_normal((s, kv_heads, D)).astype(np.float32) for s in seq_lens]
    vs = [rng.standard_normal((s, kv_heads, D)).astype(np.float32) for s in seq_lens]
    return ks, vs


def two_step(
    rng: np.random.Generator,
    prefix_lens: list[int],
    query_lens: list[int],
    heads: int,
    kv_heads: int,
    block_size: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> None:
    """Step 1 writes (and attends over) each prefix; step 2 runs the queries after it."""
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens, strict=True)]
    pool = make_pool(rng, seq_lens, kv_heads, block_size)
    ks, vs = random_kv(rng, seq_lens, kv_heads)
    if sum(prefix_lens):
        _, out, ref = run_step(pool, prefix_lens, prefix_lens, ks, vs, heads, rng, window,
                               softcap, sinks)
        np.testing.assert_allclose(out, ref, atol=TOL, rtol=TOL)
    _, out, ref = run_step(pool, query_lens, seq_lens, ks, vs, heads, rng, window, softcap,
                           sinks)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_decode_and_prefill_chunks(heads: int, kv_heads: int, block_size: int) -> None:
    rng = np.random.default_rng(block_size * 100 + heads)
    # Decodes with ragged contexts, a fresh prompt, chunks over prefixes (block-aligned or not),
    # a length-1 prompt, and an idle sequence, interleaved so rows need reordering.
    prefix_lens = [37, 0, 5, 64, 1, 20, 90, 0, 12]
    query_lens = [1, 23, 1, 17, 1, 0, 1, 1, 40]
    two_step(rng, prefix_lens, query_lens, heads, kv_heads, block_size)


@pytest.mark.parametrize("window", [1, 4, 16, 33, 1000])
@pytest.mark.parametrize("block_size", [8, 16])
def test_sliding_window(window: int, block_size: int) -> None:
    rng = np.random.default_rng(window + block_size)
    prefix_lens = [70, 3, 0, 41, 16, 100]
    query_lens = [1, 1, 29, 12, 1, 20]
    two_step(rng, prefix_lens, query_lens, 8, 2, block_size, window)


@pytest.mark.parametrize("softcap,with_sinks,window", [
    (2.0, False, None), (None, True, None), (1.5, True, 7), (30.0, True, None)])
def test_softcap_and_sinks(softcap, with_sinks, window) -> None:
    """Soft-capping and sinks over decode rows and prefill chunks (fresh and after context),
    GQA with an odd group, with and without a window, against the dense attention. Scores
    are scaled up so that a cap of 1.5-2 changes them; sinks are around the scores' size,
    so they take a real share of the softmax."""
    rng = np.random.default_rng(11 + int(with_sinks))
    heads = 9
    sinks = (2 * rng.standard_normal(heads)).astype(np.float32) if with_sinks else None
    prefix_lens = [37, 0, 5, 64, 20, 0]
    query_lens = [1, 23, 1, 17, 9, 1]
    two_step(rng, prefix_lens, query_lens, heads, 3, 8, window, softcap, sinks)


def test_sinks_and_softcap_change_the_result() -> None:
    """The options are not ignored: each changes every row's output (every row sees two
    keys or more: one key's weight is 1 whatever its capped score)."""
    rng = np.random.default_rng(12)
    tables = np.array([[3, 1], [2, 0]], dtype=np.int32)
    meta = build_attention_metadata([1, 5], [7, 8], tables, 4)
    k = mx.array(3 * rng.standard_normal((16, 2, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((16, 2, D)).astype(np.float32))
    q = mx.array(rng.standard_normal((6, 4, 1, D)).astype(np.float32))
    plain = np.array(paged_attention(q, k, v, meta, 1.0))
    for kw in ({"softcap": 1.0}, {"sinks": mx.full((4,), 10.0)}):
        other = np.array(paged_attention(q, k, v, meta, 1.0, **kw))
        assert (np.abs(other - plain).max(axis=(1, 2, 3)) > 1e-3).all(), kw


def test_sinks_match_mlx_lm_sdpa() -> None:
    """Attention sinks mean what mlx-lm's ``scaled_dot_product_attention(..., sinks=)``
    (gpt-oss) computes: a prompt attended over the paged pool against mlx-lm's own function
    over the same dense keys, causal, GQA, sinks in bf16 (gpt-oss keeps them in the model's
    dtype) as well as fp32."""
    from mlx_lm.models.base import scaled_dot_product_attention

    rng = np.random.default_rng(13)
    heads, kv_heads, length, block = 6, 2, 19, 8
    k = rng.standard_normal((length, kv_heads, D)).astype(np.float32)
    v = rng.standard_normal((length, kv_heads, D)).astype(np.float32)
    q = rng.standard_normal((length, heads, D)).astype(np.float32)
    tables = np.array([[4, 0, 2, 1]], dtype=np.int32)
    meta = build_attention_metadata([length], [length], tables, block)
    pool = mx.zeros((5 * block, kv_heads, 2 * D))
    pool[meta.slot_mapping] = mx.array(np.concatenate([k, v], axis=-1))
    dense = [mx.array(x.transpose(1, 0, 2))[None] for x in (q, k, v)]  # [1, H, L, D]
    for sinks in (mx.array(rng.standard_normal(heads).astype(np.float32)),
                  mx.array(rng.standard_normal(heads).astype(np.float32)).astype(mx.bfloat16)):
        want = scaled_dot_product_attention(*dense, None, scale=D**-0.5, mask="causal",
                                            sinks=sinks.astype(mx.float32))
        got = paged_attention_kv(mx.array(q)[:, :, None], pool, meta, D**-0.5,
                                 accelerate=False, sinks=sinks)
        np.testing.assert_allclose(np.array(got)[:, :, 0],
                                   np.array(want)[0].transpose(1, 0, 2), atol=1e-6)


def test_softcap_matches_gemma2_attention() -> None:
    """Soft-capping means what mlx-lm's gemma2 attention computes (scaled scores, tanh cap,
    then the mask and softmax): reference.sdpa against those steps written out in MLX."""
    from vllm_unified.kv.attention.reference import sdpa

    rng = np.random.default_rng(14)
    q = mx.array(rng.standard_normal((1, 4, 7, D)).astype(np.float32))
    k = mx.array(3 * rng.standard_normal((1, 2, 10, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 10, D)).astype(np.float32))
    scale, cap = D**-0.5, 2.5
    scores = (q * scale).reshape(1, 2, 2, 7, D) @ k[:, :, None].swapaxes(-1, -2)
    scores = mx.tanh(scores / cap) * cap
    mask = mx.arange(10)[None] <= mx.arange(7)[:, None] + 3
    scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
    want = (mx.softmax(scores, axis=-1, precise=True) @ v[:, :, None]).reshape(1, 4, 7, D)
    got = sdpa(q, k, v, scale, "causal", cap)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)


def test_bad_softcap_and_sinks_are_refused() -> None:
    meta = build_attention_metadata([1], [3], np.array([[1]], dtype=np.int32), 4)
    pool = mx.zeros((8, 2, 2 * D))
    q = mx.zeros((1, 4, 1, D))
    for kw, what in (({"softcap": 0.0}, "softcap"), ({"softcap": -1.0}, "softcap"),
                     ({"softcap": float("inf")}, "softcap"),
                     ({"sinks": mx.zeros((3,))}, "sinks"),
                     ({"sinks": mx.zeros((4,), mx.int32)}, "sinks")):
        for accelerate in (False, True):
            with pytest.raises(ValueError, match=what):
                paged_attention_kv(q, pool, meta, 0.25, accelerate=accelerate, **kw)


def test_decode_only_batch_keeps_token_order() -> None:
    rng = np.random.default_rng(1)
    prefix_lens = [int(n) for n in rng.integers(1, 80, size=13)]
    two_step(rng, prefix_lens, [1] * 13, 9, 3, 16)


def test_prefill_only_from_empty_pool() -> None:
    rng = np.random.default_rng(2)
    two_step(rng, [0, 0, 0], [31, 2, 48], 8, 2, 16)


def test_chunked_prefill_over_three_steps() -> None:
    """A prompt arrives in chunks (one ending mid-block), then decodes; each step is checked."""
    rng = np.random.default_rng(3)
    block_size, heads, kv_heads = 16, 8, 2
    chunks = [21, 19, 30, 1, 1]
    total = sum(chunks)
    pool = make_pool(rng, [total], kv_heads, block_size)
    ks, vs = random_kv(rng, [total], kv_heads)
    done = 0
    for chunk in chunks:
        done += chunk
        _, out, ref = run_step(pool, [chunk], [done], ks, vs, heads, rng)
        np.testing.assert_allclose(out, ref, atol=TOL, rtol=TOL)


def test_write_kv_places_rows_at_slots() -> None:
    rng = np.random.default_rng(4)
    k_pool = mx.zeros((64, 2, D))
    v_pool = mx.zeros((64, 2, D))
    slots = np.array([63, 0, 17, 5, 40], dtype=np.int32)
    keys = rng.standard_normal((5, 2, D)).astype(np.float32)
    values = rng.standard_normal((5, 2, 1, D)).astype(np.float32)  # layer layout [T, Hkv, 1, D]
    k_pool, v_pool = write_kv(k_pool, v_pool, mx.array(keys), mx.array(values), mx.array(slots))
    k_np, v_np = np.array(k_pool), np.array(v_pool)
    np.testing.assert_array_equal(k_np[slots], keys)
    np.testing.assert_array_equal(v_np[slots], values[:, :, 0])
    untouched = np.setdiff1d(np.arange(64), slots)
    assert not k_np[untouched].any() and not v_np[untouched].any()


def test_write_kv_rejects_bad_shapes() -> None:
    pool = mx.zeros((16, 2, D))
    with pytest.raises(ValueError):
        write_kv(pool, pool, mx.zeros((3, 4, D)), mx.zeros((3, 4, D)), mx.arange(3))
    with pytest.raises(ValueError):
        write_kv(pool, pool, mx.zeros((3, 2, D)), mx.zeros((3, 2, D)), mx.arange(4))


def _address(a: mx.array) -> int:
    view = np.array(a, copy=False)
    address = view.ctypes.data
    del view  # a live numpy view would itself pin the old buffer and block donation
    return address


def test_write_kv_donates_the_pool_buffer() -> None:
    k_pool = mx.zeros((4096, 2, D))
    v_pool = mx.zeros((4096, 2, D))
    mx.eval(k_pool, v_pool)
    before = _address(k_pool), _address(v_pool)
    for step in range(3):
        slots = mx.array([step, 100 + step, 4095], dtype=mx.int32)
        rows = mx.ones((3, 2, 1, D)) * (step + 1)
        k_pool, v_pool = write_kv(k_pool, v_pool, rows, rows, slots)
        mx.eval(k_pool, v_pool)
        assert (_address(k_pool), _address(v_pool)) == before
    assert float(k_pool[4095, 0, 0]) == 3.0


def test_metadata_positions_and_slots() -> None:
    block_size = 4
    tables = np.array([[7, 2, 0], [5, 9, 3]], dtype=np.int32)
    meta = build_attention_metadata([1, 3], [6, 9], tables, block_size)
    assert meta.num_tokens == 4
    assert meta.positions.dtype == mx.int32 and meta.slot_mapping.dtype == mx.int32
    assert np.array(meta.positions).tolist() == [5, 6, 7, 8]
    # seq 0, pos 5 -> block 2 offset 1; seq 1, pos 6, 7 -> block 9; pos 8 -> block 3.
    assert np.array(meta.slot_mapping).tolist() == [9, 38, 39, 12]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert meta.decode_rows == slice(0, 1) and meta.output_order is None
    assert [(p.start, p.length, p.seq_len) for p in meta.prefills] == [(1, 3, 9)]
    assert meta.decode_view(None, 2) is meta.decode_view(None, 2)


def test_metadata_rejects_inconsistent_inputs() -> None:
    tables = np.zeros((2, 2), dtype=np.int32)
    with pytest.raises(ValueError):
        build_attention_metadata([1], [3, 4], tables, 4)  # length mismatch
    with pytest.raises(ValueError):
        build_attention_metadata([5, 1], [3, 4], tables, 4)  # query longer than context
    with pytest.raises(ValueError):
        build_attention_metadata([1, 1], [3, 9], tables, 4)  # 9 tokens need 3 blocks
    with pytest.raises(ValueError):
        build_attention_metadata([1, 1], [3, 4], tables, 0)


def test_paged_attention_rejects_bad_window_and_shapes() -> None:
    meta = build_attention_metadata([1], [3], np.array([[1]], dtype=np.int32), 4)
    pool = mx.zeros((8, 2, D))
    with pytest.raises(ValueError):
        paged_attention(mx.zeros((1, 8, 1, D)), pool, pool, meta, 0.25, window=0)
    with pytest.raises(ValueError):
        paged_attention(mx.zeros((1, 7, 1, D)), pool, pool, meta, 0.25)  # 7 % 2 != 0
    with pytest.raises(ValueError):
        paged_attention(mx.zeros((2, 8, 1, D)), pool, pool, meta, 0.25)  # T mismatch


def test_bfloat16_stays_bfloat16() -> None:
    rng = np.random.default_rng(5)
    tables = np.array([[3, 1], [2, 0]], dtype=np.int32)
    meta = build_attention_metadata([1, 5], [7, 5], tables, 4)
    k = mx.array(rng.standard_normal((16, 2, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((16, 2, D)).astype(np.float32))
    q = mx.array(rng.standard_normal((6, 8, 1, D)).astype(np.float32))
    ref = paged_attention(q, k, v, meta, D**-0.5)
    out = paged_attention(
        q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16), meta, D**-0.5
    )
    assert out.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), atol=5e-2)


def test_window_reads_only_reachable_blocks() -> None:
    block_size = 8
    tables = np.arange(1, 1 + 2 * 20, dtype=np.int32).reshape(2, 20)
    meta = build_attention_metadata([1, 10], [150, 100], tables, block_size)
    # Decode at position 149 with window 10 reads keys 140..149 only, for each of 2 KV heads.
    view = meta.decode_view(10, 2)
    assert view.rows.shape == (1, 2, 10) and view.mask is None
    pos = np.arange(140, 150)
    slots = tables[0, pos // block_size] * block_size + pos % block_size
    assert np.array(view.rows[0]).tolist() == [(slots * 2).tolist(), (slots * 2 + 1).tolist()]
    assert meta.decode_view(None, 2).rows.shape == (1, 2, 150)
    # Chunk at positions 90..99 with window 10 sees keys from 81 on.
    chunk = meta.prefill_view(0, 10, 2)
    assert chunk.first_key == 81 and chunk.rows.shape == (1, 2, 19)
    assert meta.prefill_view(0, None, 2).mask == "causal"


@pytest.mark.parametrize("window", [None, 5])
def test_kv_pool_layout_matches_split_pools(window, monkeypatch) -> None:
    """K|V side by side in one pool (vLLM's LBNHC page, viewed slot-major) gives the same output
    as separate K and V pools."""
    rng = np.random.default_rng(3)
    slots, kv_heads, heads, dim, block = 64 * 16, 2, 6, 32, 16
    k = rng.normal(size=(slots, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(slots, kv_heads, dim)).astype(np.float32)
    tables = np.array([[3, 7, 9, 0], [12, 1, 0, 0], [40, 41, 42, 43]], dtype=np.int32)
    meta = build_attention_metadata([1, 9, 1], [20, 25, 60], tables, block)
    q = mx.array(rng.normal(size=(11, heads, 1, dim)).astype(np.float32))
    split = paged_attention(q, mx.array(k), mx.array(v), meta, dim**-0.5, window)
    pool = mx.array(np.concatenate([k, v], axis=-1))
    joint = paged_attention_kv(q, pool, meta, dim**-0.5, window)
    np.testing.assert_allclose(np.array(joint), np.array(split), rtol=1e-6, atol=1e-6)
    # The CPU attention kernel (the default on the CPU backend) sums in its own order: equal
    # within fp32 rounding. Without it, the native gather and MLX's gather (the reference)
    # read the same rows: bit-identical outputs.
    reference = paged_attention_kv(q, pool, meta, dim**-0.5, window, accelerate=False)
    if sys.platform != "darwin":  # macOS builds no native extension: MLX's gathers below
        assert bridge.native_error() is None
    np.testing.assert_allclose(np.array(joint), np.array(reference), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(paged, "_cpu_rows_kernel", lambda b: False)
    gathered = paged_attention_kv(q, pool, meta, dim**-0.5, window)
    np.testing.assert_array_equal(np.array(gathered), np.array(reference))


NATIVE_NOT_ON_MACOS = "macOS: the native CPU gather (native/) is not built there"


@pytest.mark.skipif(sys.platform == "darwin", reason=NATIVE_NOT_ON_MACOS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_native_gather_kv_equals_mlx_gather(dtype: mx.Dtype) -> None:
    """``bridge.gather_kv`` returns exactly the two halves of the selected rows, contiguous."""
    rng = np.random.default_rng(5)
    pool = mx.array(rng.normal(size=(300, 2 * 24)).astype(np.float32)).astype(dtype)
    rows = mx.array(rng.integers(0, 300, size=(4, 3, 17)).astype(np.int32))
    keys, values = bridge.gather_kv(pool, rows)
    assert keys.shape == values.shape == (4, 3, 17, 24) and keys.dtype == dtype
    assert mx.array_equal(keys, pool[:, :24][rows]).item()
    assert mx.array_equal(values, pool[:, 24:][rows]).item()
    # Lazy inputs (the pool as the output of a write) are ordered before the gather.
    written = bridge.write_rows(pool, mx.array([7], dtype=mx.int32), mx.ones((1, 48), dtype))
    keys, _ = bridge.gather_kv(written, mx.array([[7]], dtype=mx.int32))
    assert mx.array_equal(keys, mx.ones((1, 1, 24), dtype)).item()


@pytest.mark.skipif(sys.platform == "darwin", reason=NATIVE_NOT_ON_MACOS)
def test_native_gather_kv_rejects_out_of_range_rows() -> None:
    pool = mx.zeros((10, 8))
    with pytest.raises(IndexError, match="out of range"):
        bridge.gather_kv(pool, mx.array([3, 10], dtype=mx.int32))
    lazy = mx.array([3], dtype=mx.int32) + 20  # not computed yet: checked when it runs
    with pytest.raises(RuntimeError, match="out of range"):
        mx.eval(bridge.gather_kv(pool, lazy))


@pytest.mark.parametrize("accelerate", [True, False], ids=["kernel", "reference"])
def test_gpt_oss_attention_sinks_through_the_paged_cache(accelerate, monkeypatch) -> None:
    """mlx-lm's gpt-oss attention layer (learned sinks, GQA) routed to the paged cache
    (routing.paged_sdpa -> PagedLayerCache.attend -> dispatch: the native CPU kernel, or the
    reference) gives mlx-lm's own outputs with its KVCache: a prompt, then two decode steps."""
    from mlx_lm.models import gpt_oss
    from mlx_lm.models.cache import KVCache

    from vllm_unified.kv.forward_context import StepContext, set_step_context
    from vllm_unified.kv.layer_cache import PagedLayerCache, PagedMask
    from vllm_unified.kv.pool import KVPool
    from vllm_unified.models.routing import paged_sdpa

    if not accelerate:
        original = paged.paged_attention_kv
        monkeypatch.setattr(paged, "paged_attention_kv",
                            lambda *a, **k: original(*a, **{**k, "accelerate": False}))
    mx.random.seed(7)
    args = gpt_oss.ModelArgs(hidden_size=40, head_dim=16, num_attention_heads=6,
                             num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)
    attn = gpt_oss.AttentionBlock(args)
    attn.sinks = mx.random.normal((6,)) * 2
    monkeypatch.setattr(gpt_oss, "scaled_dot_product_attention", paged_sdpa)
    xs = mx.random.normal((1, 14, 40))
    cache = KVCache()
    want = [attn(xs[:, :12], mask="causal", cache=cache)]
    want += [attn(xs[:, t:t + 1], mask=None, cache=cache) for t in (12, 13)]

    block = 4
    pool = KVPool([mx.zeros((6 * block, 2, 32))], block, shared=False)
    layer = PagedLayerCache(pool, 0)
    tables = np.array([[5, 2, 0, 3]], dtype=np.int32)
    for (start, stop), expect in zip(((0, 12), (12, 13), (13, 14)), want, strict=True):
        meta = build_attention_metadata([stop - start], [stop], tables, block)
        with set_step_context(StepContext(attn=meta)):
            got = attn(xs[0, start:stop][:, None], mask=PagedMask(None), cache=layer)
        mx.eval(got, pool.kv)
        np.testing.assert_allclose(np.array(got)[:, 0], np.array(expect)[0], atol=2e-5)
