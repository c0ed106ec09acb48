"""The native CPU kernels (native/src/cpu_math.cpp) against MLX's own ops and the pure-MLX
paged attention reference, and their routing into mlx-lm models (models/cpu_kernels.py)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu as mlx_swiglu

from vllm_unified import bridge
from vllm_unified.kv.attention import dispatch as paged
from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.models import cpu_kernels

native = bridge.native_kernels()
pytestmark = pytest.mark.skipif(
    native is None, reason=f"native extension unavailable: {bridge.native_error()}")


def _rel_err(got: mx.array, want: mx.array) -> float:
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


@pytest.mark.parametrize("shape", [(1, 1536), (16, 1536), (3, 7, 37), (256, 1536)])
def test_silu_mul_equals_mlx_lm_swiglu(shape):
    rng = np.random.default_rng(0)
    gate = mx.array((rng.standard_normal(shape) * 8).astype(np.float32))  # exp over/underflows
    up = mx.array(rng.standard_normal(shape).astype(np.float32))
    got = native.silu_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == mx.float32
    assert _rel_err(got, mlx_swiglu(gate, up)) < 2e-6
    extreme = mx.array([-200.0, -90.0, 0.0, 90.0], dtype=mx.float32)
    ones = mx.ones_like(extreme)
    assert np.array_equal(np.array(native.silu_mul(extreme, ones)), np.array([0, 0, 0, 90]))


def test_silu_mul_rejects_bad_input():
    with pytest.raises(TypeError, match="float32"):
        native.silu_mul(mx.zeros((2, 3), mx.float16), mx.zeros((2, 3), mx.float16))
    with pytest.raises(ValueError, match="differ in shape"):
        native.silu_mul(mx.zeros((2, 3)), mx.zeros((3, 2)))


@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 17, 33])
@pytest.mark.parametrize("k, n", [(576, 1536), (37, 5), (64, 1), (1536, 579)])
def test_linear_equals_matmul(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    got = native.linear(x, w)
    assert got.shape == (m, n)
    assert _rel_err(got, x @ w.T) < 1e-5
    # A transposed (non-contiguous) input is made contiguous first, not misread.
    xt = mx.array(rng.standard_normal((k, m)).astype(np.float32)).T
    assert _rel_err(native.linear(xt, w), xt @ w.T) < 1e-5


def test_linear_rejects_bad_input():
    with pytest.raises(TypeError, match="float32"):
        native.linear(mx.zeros((2, 4), mx.bfloat16), mx.zeros((3, 4), mx.bfloat16))
    with pytest.raises(ValueError, match=r"\[\.\.\., K\] and w \[N, K\]"):
        native.linear(mx.zeros((2, 4)), mx.zeros((3, 5)))
    wt = mx.zeros((4, 3)).T  # a transposed view: never copied per call, refused
    mx.eval(wt)
    with pytest.raises(ValueError, match="row-contiguous"):
        native.linear(mx.zeros((2, 4)), wt)
    with pytest.raises(ValueError, match="row-contiguous"):  # still lazy: refused at eval
        mx.eval(native.linear(mx.zeros((2, 4)), mx.zeros((4, 3)).T))


def _step_case(rng, query_lens, heads, kv_heads, dim, block_size, dtype, max_len=150):
    """A step of sequences with ``query_lens`` new tokens each (1: decode, more: a prefill
    chunk with a prefix) over a NaN-filled pool where only the sequences' slots are written:
    a read outside a row's visible keys would put NaN into the output."""
    batch = len(query_lens)
    lens = np.array([rng.integers(q, max_len) for q in query_lens], np.int32)
    per_seq = -(-max_len // block_size)
    num_blocks = batch * per_seq + 3
    tables = rng.permutation(np.arange(1, num_blocks))[: batch * per_seq]
    tables = tables.reshape(batch, per_seq).astype(np.int32)
    pool = np.full((num_blocks * block_size, kv_heads, 2 * dim), np.nan, np.float32)
    for b in range(batch):
        pos = np.arange(lens[b])
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        pool[slots] = rng.standard_normal((lens[b], kv_heads, 2 * dim))
    meta = build_attention_metadata(query_lens, lens.tolist(), tables, block_size)
    q = mx.array(rng.standard_normal((sum(query_lens), heads, 1, dim)).astype(np.float32))
    return q.astype(dtype), mx.array(pool).astype(dtype), meta


@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.float16, 4e-3),
                                        (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim, block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 80, 32), (4, 2, 128, 16),
                          (6, 2, 256, 16)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("query_lens", [[1] * 6, [1, 9, 1, 1, 30], [17, 1]],
                         ids=["decode", "mixed", "prefill-first"])
def test_paged_attention_rows_equal_reference(dtype, tol, heads, kv_heads, dim, block_size,
                                              window, query_lens):
    from vllm_unified.kv.attention.cpu import paged_attention_rows

    rng = np.random.default_rng(heads + dim + len(query_lens))
    q, pool, meta = _step_case(rng, query_lens, heads, kv_heads, dim, block_size, dtype)
    want = paged.paged_attention_kv(q, pool, meta, 0.125, window, accelerate=False)
    got = paged_attention_rows(q, pool, meta, 0.125, window)
    assert got.shape == want.shape and got.dtype == dtype
    assert not np.isnan(np.array(got.astype(mx.float32))).any()
    assert _rel_err(got, want) < tol


_LATENT_BUILD = pytest.mark.skipif(
    native is None or "latent" not in (native.paged_attention.__doc__ or ""),
    reason="native extension built before the latent mode (rebuild: scripts/setup.sh)")


@_LATENT_BUILD
@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.float16, 4e-3),
                                        (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, latent_dim, rope_dim, block_size",
                         [(16, 256, 32, 16), (3, 40, 24, 8), (5, 48, 16, 16)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("query_lens", [[1] * 6, [1, 9, 1, 1, 30], [17, 1]],
                         ids=["decode", "mixed", "prefill-first"])
def test_latent_attention_rows_equal_reference(dtype, tol, heads, latent_dim, rope_dim,
                                               block_size, window, query_lens):
    """The native kernel's latent (MLA) mode against the reference's absorbed attention: one
    latent row per token as key and value, of the latent plus the rope key."""
    from vllm_unified.backend import profile

    rng = np.random.default_rng(heads + latent_dim + len(query_lens))
    width = latent_dim + rope_dim
    q, kv, meta = _step_case(rng, query_lens, heads, 1, width, block_size, dtype)
    latent_pool = kv[..., :width]  # the K halves: [slots, 1, W], NaN outside the sequences
    latent_pool = mx.contiguous(latent_pool)
    want = paged.reference.paged_attention_latent(q, latent_pool, meta, 0.1, latent_dim,
                                                  window)
    from vllm_unified.kv.attention import cpu as cpu_attention

    backend = profile()
    assert backend.cpu_attention and cpu_attention.takes_latent()  # decided before the spy
    spy = _Spy(native)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bridge, "native_kernels", lambda: spy)
        got = paged.paged_attention_latent(q, latent_pool, meta, 0.1, latent_dim, window,
                                           backend=backend)
    assert spy.calls == {"paged_attention": 1}
    assert got.shape == want.shape == (q.shape[0], heads, 1, latent_dim)
    assert got.dtype == dtype
    assert not np.isnan(np.array(got.astype(mx.float32))).any()
    assert _rel_err(got, want) < tol


@_LATENT_BUILD
def test_latent_mode_rejects_other_pools():
    q = mx.zeros((2, 4, 24))
    tables, seqs, lens = mx.zeros((1, 2), mx.int32), mx.zeros((2,), mx.int32), \
        mx.ones((2,), mx.int32)
    with pytest.raises(ValueError, match="latent pool"):
        native.paged_attention(q, mx.zeros((16, 2, 24)), tables, seqs, lens, 1.0, 16,
                               latent=True)
    with pytest.raises(ValueError, match="latent pool"):
        native.paged_attention(q, mx.zeros((16, 1, 24), mx.uint8), tables, seqs, lens, 1.0,
                               16, kv_mode=1, latent=True)
    with pytest.raises(ValueError, match="kv_pool"):
        native.paged_attention(q, mx.zeros((16, 1, 48)), tables, seqs, lens, 1.0, 16,
                               latent=True)


@pytest.mark.parametrize("dtype, tol, dim, window, softcap, with_sinks", [
    (mx.float32, 1e-5, 64, None, 1.0, True),  # the register path
    (mx.float32, 1e-5, 80, 7, 0.7, True),  # the generic loops
    (mx.bfloat16, 2e-2, 128, 7, None, True),
    (mx.float32, 1e-5, 256, None, 2.0, False),
])
def test_paged_attention_rows_softcap_and_sinks_equal_reference(dtype, tol, dim, window,
                                                                 softcap, with_sinks):
    """Soft-capping and sinks in the native kernel == the reference's, on a mixed step with an
    odd GQA group; the options change the output (they are not ignored)."""
    from vllm_unified.kv.attention.cpu import paged_attention_rows

    rng = np.random.default_rng(dim + 1)
    heads = 9
    q, pool, meta = _step_case(rng, [1, 9, 1, 1, 30], heads, 3, dim, 16, dtype)
    sinks = mx.array(rng.standard_normal(heads).astype(np.float32)) if with_sinks else None
    want = paged.paged_attention_kv(q, pool, meta, 0.125, window, accelerate=False,
                                    softcap=softcap, sinks=sinks)
    got = paged_attention_rows(q, pool, meta, 0.125, window, softcap=softcap, sinks=sinks)
    assert got.dtype == dtype and _rel_err(got, want) < tol
    plain = paged_attention_rows(q, pool, meta, 0.125, window)
    assert _rel_err(plain, want) > 10 * tol
    # through the dispatch too (the native kernel is the CPU backend's default)
    assert _rel_err(paged.paged_attention_kv(q, pool, meta, 0.125, window, softcap=softcap,
                                             sinks=sinks), want) < tol


@pytest.mark.parametrize("dim", [64, 80])  # the blocked and row kernels, and the generic one
def test_paged_attention_row_is_batch_invariant(dim):
    """A row's output does not depend on the other rows of the step nor on how the rows are
    split over the kernel's threads: the same bits alone (a decode row) or in its chunk alone
    (a chunk's row) as inside a mixed step."""
    rng = np.random.default_rng(dim)
    q, pool, meta = _step_case(rng, [1, 9, 1, 1, 30, 1, 1], 6, 2, dim, 16, mx.float32)
    tables, seqs, lens = meta.row_tables_seqs_lens()
    rows = q.reshape(q.shape[0], 6, dim)
    whole = native.paged_attention(rows, pool, tables, seqs, lens, 0.125, 16)
    for r, (lo, hi) in {0: (0, 1), 5: (1, 10), 11: (11, 12), 12: (12, 42), 41: (12, 42),
                        42: (42, 43)}.items():
        alone = native.paged_attention(rows[lo:hi], pool, tables, seqs[lo:hi], lens[lo:hi],
                                       0.125, 16)
        assert np.array_equal(np.array(alone[r - lo]), np.array(whole[r])), r


def _chunk_case(rng, chunks, heads, kv_heads, dim, block_size, dtype):
    """A step of one chunk of ``rows`` new tokens after ``prefix`` cached ones per sequence
    (``chunks``: [(prefix, rows)]; rows 1: a decode row) over a NaN-filled pool where only the
    sequences' keys are written: a read of a key outside a row's range would put NaN into the
    output."""
    lens = [p + r for p, r in chunks]
    per_seq = -(-max(lens) // block_size)
    num_blocks = len(chunks) * per_seq + 3
    tables = rng.permutation(np.arange(1, num_blocks))[: len(chunks) * per_seq]
    tables = tables.reshape(len(chunks), per_seq).astype(np.int32)
    pool = np.full((num_blocks * block_size, kv_heads, 2 * dim), np.nan, np.float32)
    for b, n in enumerate(lens):
        pos = np.arange(n)
        pool[tables[b, pos // block_size] * block_size + pos % block_size] = \
            rng.standard_normal((n, kv_heads, 2 * dim))
    meta = build_attention_metadata([r for _, r in chunks], lens, tables, block_size)
    q = rng.standard_normal((sum(r for _, r in chunks), heads, 1, dim)).astype(np.float32)
    return mx.array(q).astype(dtype), mx.array(pool).astype(dtype), meta


# Long prefill chunks (the blocked kernel's tiles of 16 rows and key blocks of 32 positions):
# (heads, kv_heads, dim, dtype, tol, window, chunk, softcap, sinks)
_TILE_CASES = [
    (14, 2, 64, mx.float32, 1e-5, None, None, None, False),  # Qwen2.5-0.5B's shape
    (9, 3, 64, mx.float32, 1e-5, 100, None, None, False),  # SmolLM2's, a sliding window
    (4, 2, 128, mx.float32, 1e-5, None, 128, None, False),  # an attention chunk
    (6, 2, 256, mx.float32, 1e-5, 77, None, 1.5, True),  # soft-capping and sinks
    (8, 1, 64, mx.float32, 1e-5, None, 96, 0.8, True),
    (14, 2, 64, mx.float16, 4e-3, 100, None, None, True),
    (4, 4, 128, mx.bfloat16, 2e-2, None, None, 2.0, False),
]


@pytest.mark.parametrize("heads, kv_heads, dim, dtype, tol, window, chunk, softcap, sinks",
                         _TILE_CASES)
def test_paged_attention_long_chunks_equal_reference(heads, kv_heads, dim, dtype, tol, window,
                                                     chunk, softcap, sinks):
    """Chunks spanning many tiles and key blocks (300 rows after 400 cached keys, one from
    position 0, one of 2 rows) next to decode rows == the pure-MLX reference."""
    from vllm_unified.kv.attention.cpu import paged_attention_rows

    rng = np.random.default_rng(heads * dim + (window or 0))
    q, pool, meta = _chunk_case(rng, [(400, 300), (699, 1), (0, 37), (50, 2), (20, 1)],
                                heads, kv_heads, dim, 16, dtype)
    sink = mx.array(rng.standard_normal(heads).astype(np.float32)) if sinks else None
    want = paged.paged_attention_kv(q, pool, meta, dim**-0.5, window, accelerate=False,
                                    chunk=chunk, softcap=softcap, sinks=sink)
    got = paged_attention_rows(q, pool, meta, dim**-0.5, window, chunk=chunk, softcap=softcap,
                               sinks=sink)
    assert got.shape == want.shape and got.dtype == dtype
    assert not np.isnan(np.array(got.astype(mx.float32))).any()
    assert _rel_err(got, want) < tol


@pytest.mark.parametrize("heads, kv_heads, dim, dtype, window, chunk, softcap, sinks", [
    (14, 2, 64, mx.float32, None, None, None, False),
    (9, 3, 64, mx.float16, 100, None, 1.5, True),
    (6, 2, 256, mx.bfloat16, None, 64, None, True),
    (4, 2, 128, mx.float32, 45, None, None, False),
])
def test_paged_attention_chunk_rows_are_batch_and_chunking_invariant(
        heads, kv_heads, dim, dtype, window, chunk, softcap, sinks):
    """A chunk row's bits do not depend on the rows that share its step or its tile nor on how
    its prompt is cut into chunks: a 300-row chunk after 400 cached keys attended whole, cut
    into chunks at other boundaries (tiles starting at other rows) and inside a mixed step."""
    rng = np.random.default_rng(dim + heads)
    q, pool, meta = _chunk_case(rng, [(400, 300)], heads, kv_heads, dim, 16, dtype)
    tables, seqs, lens = meta.row_tables_seqs_lens()
    rows = q.reshape(300, heads, dim)
    extra = {"chunk": chunk or 0, "softcap": softcap or 0.0}
    if sinks:
        extra["sinks"] = mx.array(rng.standard_normal(heads).astype(np.float32))

    def attend(lo, hi):
        return np.array(native.paged_attention(rows[lo:hi], pool, tables, seqs[lo:hi],
                                               lens[lo:hi], dim**-0.5, 16, window or 0,
                                               **extra).astype(mx.float32))

    whole = attend(0, 300)
    # (a chunk of one row is a decode row: the row kernel's, which may differ in the last bits)
    for cuts in ([0, 2, 37, 39, 200, 300], [0, 7, 23, 26, 298, 300], [0, 150, 300]):
        parts = np.concatenate([attend(a, b) for a, b in itertools.pairwise(cuts)])
        assert np.array_equal(parts, whole), cuts
    # inside a mixed step: the chunk's rows 5 .. 259 between a 3-row and a 2-row chunk of two
    # other sequences (table rows 1 and 2, the same blocks)
    mixed_rows = mx.concatenate([rows[:3], rows[5:260], rows[:2]])
    mixed_seqs = mx.array([1] * 3 + [0] * 255 + [2] * 2, mx.int32)
    mixed_lens = mx.concatenate([mx.array([3, 1, 2], mx.int32), lens[5:260],
                                 mx.array([700, 650], mx.int32)])
    mixed = np.array(native.paged_attention(mixed_rows, pool, mx.concatenate([tables] * 3),
                                            mixed_seqs, mixed_lens, dim**-0.5, 16, window or 0,
                                            **extra).astype(mx.float32))
    assert np.array_equal(mixed[3:258], whole[5:260])


_ROW_KERNEL_PROBE = """
import numpy as np, mlx.core as mx, sys
sys.path.insert(0, {tests!r})
from test_cpu_kernels import _chunk_case
from vllm_unified_native import attention_tile_isa, attention_tile_runs, paged_attention
rng = np.random.default_rng(4)
q, pool, meta = _chunk_case(rng, [(100, 40)], 14, 2, 64, 16, mx.float32)
tables, seqs, lens = meta.row_tables_seqs_lens()
rows = q.reshape(40, 14, 64)
chunk = np.array(paged_attention(rows, pool, tables, seqs, lens, 0.125, 16))
lone = np.stack([np.array(paged_attention(rows[r:r + 1], pool, tables, seqs[r:r + 1],
                                          lens[r:r + 1], 0.125, 16))[0] for r in range(40)])
print(attention_tile_isa() or "none", attention_tile_runs(64), np.array_equal(chunk, lone))
"""


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_prefill_rows_at_a_lower_isa(isa):
    """``VLLM_UNIFIED_CPU_ISA=avx2`` runs the blocked kernel's AVX2 version (where the CPU has
    AVX2), ``portable`` gives the rows of prefill chunks to the row kernel: long chunks equal
    the reference and chunk rows stay batch- and chunking-invariant either way; on the row
    kernel a chunk's rows have the bits of lone (decode) rows, on the blocked kernel some
    differ in the last bits (the two kernels order their sums otherwise)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "VLLM_UNIFIED_CPU_ISA": isa}
    probe = _ROW_KERNEL_PROBE.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    tile_isa, tiled, same_bits = out.stdout.split()[-3:]
    assert tiled == str(isa == "avx2" and native.attention_tile_runs(64))
    assert tile_isa == ("avx2" if tiled == "True" else "none")
    assert same_bits == str(tiled == "False")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "long_chunks or chunking_invariant", __file__], env=env, capture_output=True,
        text=True)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:]


def test_paged_attention_rejects_bad_input():
    q = mx.zeros((2, 4, 8))
    pool = mx.zeros((32, 2, 16))
    tables = mx.array([[0, 1], [2, 3]], dtype=mx.int32)
    seqs = mx.array([0, 1], dtype=mx.int32)
    lens = mx.array([3, 4], dtype=mx.int32)
    with pytest.raises(ValueError, match="H % Hkv"):
        native.paged_attention(mx.zeros((2, 3, 8)), pool, tables, seqs, lens, 1.0, 8)
    with pytest.raises(TypeError, match="int32"):
        native.paged_attention(q, pool, tables.astype(mx.int64), seqs, lens, 1.0, 8)
    with pytest.raises(ValueError, match="seqs, lens"):
        native.paged_attention(q, pool, tables, seqs[:1], lens, 1.0, 8)
    with pytest.raises(ValueError, match="whole blocks"):
        native.paged_attention(q, pool, tables, seqs, lens, 1.0, 5)
    with pytest.raises(ValueError, match="window"):
        native.paged_attention(q, pool, tables, seqs, lens, 1.0, 8, -1)
    with pytest.raises(ValueError, match="softcap"):
        native.paged_attention(q, pool, tables, seqs, lens, 1.0, 8, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        native.paged_attention(q, pool, tables, seqs, lens, 1.0, 8, sinks=mx.zeros((3,)))
    with pytest.raises(ValueError, match="sinks"):
        native.paged_attention(q, pool, tables, seqs, lens, 1.0, 8,
                               sinks=mx.zeros((4,), mx.int32))
    outside = mx.array([[0, 1], [2, 9]], dtype=mx.int32)  # block 9 of a 4-block pool
    with pytest.raises(RuntimeError, match="outside a pool"):
        mx.eval(native.paged_attention(q, pool, outside, seqs, mx.array([3, 12], mx.int32),
                                       1.0, 8))
    with pytest.raises(RuntimeError, match="do not fit a block table"):
        mx.eval(native.paged_attention(q, pool, tables, seqs, mx.array([3, 17], mx.int32),
                                       1.0, 8))
    with pytest.raises(RuntimeError, match="outside a table"):
        mx.eval(native.paged_attention(q, pool, tables, mx.array([0, 2], mx.int32), lens,
                                       1.0, 8))


class _Spy:
    """Counts calls to the native module's kernels, forwarding them."""

    def __init__(self, mod):
        self.mod, self.calls = mod, {}

    def __getattr__(self, name):
        fn = getattr(self.mod, name)

        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 12, 1]])
def test_steps_take_the_cpu_kernel(monkeypatch, query_lens):
    rng = np.random.default_rng(5)
    q, pool, meta = _step_case(rng, query_lens, 4, 2, 32, 16, mx.float32)
    spy = _Spy(native)
    monkeypatch.setattr(bridge, "native_kernels", lambda: spy)
    got = paged.paged_attention_kv(q, pool, meta, 0.3, None)
    assert spy.calls == {"paged_attention": 1}  # one call for decode rows and chunks alike
    spy.calls.clear()
    want = paged.paged_attention_kv(q, pool, meta, 0.3, None, accelerate=False)
    assert "paged_attention" not in spy.calls  # the reference takes no kernel
    assert _rel_err(got, want) < 1e-5


def _tiny_llama(tied: bool) -> llama.Model:
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=300, tie_word_embeddings=tied)
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_installed_kernels_keep_the_model_function(monkeypatch, tied):
    model = _tiny_llama(tied)
    tokens = mx.array(np.random.default_rng(0).integers(0, 300, (2, 40)))
    want_prefill = model(tokens)  # 80 rows: above MAX_NATIVE_ROWS
    want_decode = model(tokens[:, :1])
    routed = cpu_kernels.install_cpu_kernels(model)
    n_linear = 2 * 7 + (0 if tied else 1)
    assert f"{n_linear} linear layers" in routed
    assert "1 embedding layers" in routed  # its as_linear is the head only when tied
    assert "5 RMSNorm layers" in routed and "2 RoPE layers" in routed
    assert llama.swiglu is cpu_kernels.swiglu  # module-wide: routed by the first install
    assert cpu_kernels.install_cpu_kernels(model) == []  # idempotent
    spy = _Spy(native)
    monkeypatch.setattr(bridge, "native_kernels", lambda: spy)
    got_decode = model(tokens[:, :1])
    norms_and_rope = {"rms_norm": 5, "rope": 2 * 2}  # 2 norms per layer + final; q and k
    assert spy.calls == {"linear": n_linear + (1 if tied else 0), "silu_mul": 2,
                         **norms_and_rope}
    assert _rel_err(got_decode, want_decode) < 1e-5
    spy.calls.clear()
    got_prefill = model(tokens)
    assert spy.calls == {"silu_mul": 2, **norms_and_rope}  # 80 rows: MLX's matmul
    assert _rel_err(got_prefill, want_prefill) < 1e-5
    assert type(model.layers[0].mlp.gate_proj) is cpu_kernels.NativeLinear
    assert isinstance(model.layers[0].mlp.gate_proj, nn.Linear)


def test_half_layers_are_left_alone_and_unsupported_quantized_ones_dequantized():
    model = _tiny_llama(False)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: p.endswith("q_proj"))
    nn.quantize(model, group_size=32, bits=3, class_predicate=lambda p, m: p.endswith("k_proj"))
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: p.endswith("v_proj"))
    model.layers[1].mlp.down_proj.weight = model.layers[1].mlp.down_proj.weight.astype(
        mx.bfloat16)
    v_proj = model.layers[0].self_attn.v_proj
    dense_v = mx.dequantize(v_proj.weight, v_proj.scales, None, 32, 4, mode="mxfp4")
    x = mx.array(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
    want_v = v_proj(x)
    routed = cpu_kernels.install_cpu_kernels(model)
    assert f"{2 * 7 + 1 - 3 * 2 - 1 + 2} linear layers" in routed  # 2 of them were mxfp4
    assert "4 quantized linear layers" in routed  # 4-bit q_proj and 3-bit k_proj
    assert "2 mxfp4 4-bit layers dequantized to float32 (no native kernel for them)" in routed
    assert type(model.layers[0].self_attn.q_proj) is cpu_kernels.NativeQuantizedLinear
    assert type(model.layers[0].self_attn.k_proj) is cpu_kernels.NativeQuantizedLinear
    assert type(v_proj) is cpu_kernels.NativeLinear and "scales" not in v_proj
    assert mx.array_equal(v_proj.weight, dense_v).item()
    assert _rel_err(v_proj(x), want_v) < 1e-5
    assert type(model.layers[1].mlp.down_proj) is nn.Linear


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_quantized_embedding_lookup_equals_the_reference_rows(bits, group_size):
    """The lookup gathers the rows of weight, scales and biases and dequantizes them natively:
    the reference rows bit for bit, groups of 16 included (MLX's own lookup refuses them);
    the tied head (as_linear) equals linear on the dense table."""
    rng = np.random.default_rng(bits * group_size)
    vocab, dims = 50, 128
    emb = nn.QuantizedEmbedding(vocab, dims, group_size=max(group_size, 32), bits=bits)
    if group_size == 16:
        emb.weight, emb.scales, emb.biases, dense = _groups_of_16(rng, vocab, dims, bits)
        emb.group_size = 16
    else:
        emb.weight, emb.scales, emb.biases = _quantized(rng, vocab, dims, group_size, bits)
        dense = mx.dequantize(emb.weight, emb.scales, emb.biases, group_size, bits)
    holder = nn.Module()
    holder.embed = emb
    assert "1 quantized embedding layers" in cpu_kernels.install_cpu_kernels(holder)
    assert type(emb) is cpu_kernels.NativeQuantizedEmbedding
    ids = mx.array([[3, 0, 49], [7, 7, 12]])
    got = emb(ids)
    assert got.shape == (2, 3, dims) and got.dtype == mx.float32
    assert mx.array_equal(got, dense[ids]).item()
    x = mx.array(rng.standard_normal((2, dims)).astype(np.float32))
    assert mx.array_equal(emb.as_linear(x), native.linear(x, dense)).item()


def _quantized(rng, n: int, k: int, group_size: int, bits: int):
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    mx.eval(wq, scales, biases)
    return wq, scales, biases


QUANTIZED_SHAPES = [(1536, 576, 32, 4), (579, 64, 32, 8), (5, 256, 64, 4), (7, 128, 128, 8),
                    (1, 32, 32, 4),
                    # every other width MLX's affine mode makes, at each group size it takes
                    (300, 96, 32, 3), (45, 256, 64, 3), (9, 128, 128, 3),
                    (77, 160, 32, 5), (33, 128, 64, 5), (5, 384, 128, 5),
                    (130, 96, 32, 6), (17, 192, 64, 6), (3, 256, 128, 6),
                    (64, 128, 32, 2), (21, 64, 64, 2), (6, 256, 128, 2)]


def _codes(wq: mx.array, n: int, k: int, bits: int) -> np.ndarray:
    """The integer codes of an MLX-packed weight, as MLX reads them (mx.dequantize with unit
    scales and zero biases)."""
    ones = mx.ones((n, k // 32), dtype=mx.float32)
    return np.array(mx.dequantize(wq, ones, mx.zeros_like(ones), 32, bits)).astype(np.int64)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_mlx_packs_every_width_as_a_little_endian_bit_stream(bits):
    """The layout the kernels (cpu_math.h) and the GGUF reader (gguf._pack_bits) assume, checked
    on MLX itself: element k of a row in bits [bits k, bits (k + 1)) of the row's bytes."""
    from vllm_unified.models import gguf as G

    rng = np.random.default_rng(bits)
    wq, _, _ = _quantized(rng, 6, 256, 32, bits)
    codes = _codes(wq, 6, 256, bits)
    stream = np.unpackbits(np.array(wq).view(np.uint8), axis=1, bitorder="little")
    assert np.array_equal((stream.reshape(6, 256, bits) << np.arange(bits)).sum(-1), codes)
    assert np.array_equal(G._pack_bits(codes.astype(np.uint8), bits), np.array(wq))
    assert np.array_equal(G._unpack_bits(np.array(wq), bits, 256), codes)


def _groups_of_16(rng, n: int, k: int, bits: int):
    """A random triple with groups of 16 (MLX's ops refuse them) and its dense fp32 reference,
    rounded as MLX's dequantize rounds (scale * code, then + bias)."""
    wq, _, _ = _quantized(rng, n, k, 32, bits)
    scales = mx.array(rng.standard_normal((n, k // 16)).astype(np.float32))
    biases = mx.array(rng.standard_normal((n, k // 16)).astype(np.float32))
    codes = mx.array(_codes(wq, n, k, bits).astype(np.float32)).reshape(n, k // 16, 16)
    dense = (codes * scales[..., None] + biases[..., None]).reshape(n, k)
    mx.eval(dense)
    return wq, scales, biases, dense


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_groups_of_16_are_bit_identical_to_their_reference(m, bits):
    """Groups of 16 (GGUF's Q6_K / Q3_K / Q2_K sub-blocks): dequantize equals the reference
    bit for bit and quantized_linear equals linear on it (the AMX path needs groups of 32, so
    every call here takes the AVX / portable path)."""
    rng = np.random.default_rng(16 * m + bits)
    n, k = 37, 192
    wq, scales, biases, dense = _groups_of_16(rng, n, k, bits)
    assert mx.array_equal(native.dequantize(wq, scales, biases, 16, bits), dense).item()
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    assert not _amx_runs(m, k, 16)
    got = native.quantized_linear(x, wq, scales, biases, 16, bits)
    assert mx.array_equal(got, native.linear(x, dense)).item()


@pytest.mark.parametrize("n, k, group_size, bits", QUANTIZED_SHAPES)
def test_dequantize_is_bit_identical_to_mlx(n, k, group_size, bits):
    rng = np.random.default_rng(n + k + bits)
    wq, scales, biases = _quantized(rng, n, k, group_size, bits)
    got = native.dequantize(wq, scales, biases, group_size, bits)
    assert got.shape == (n, k) and got.dtype == mx.float32
    assert mx.array_equal(got, mx.dequantize(wq, scales, biases, group_size, bits)).item()


def _amx_runs(m: int, k: int, group_size: int) -> bool:
    """Whether quantized_linear takes the AMX path for this call (native.cpp's use_amx)."""
    return native.amx_runs(m, k, group_size)


def _reference(x: mx.array, dense: mx.array) -> np.ndarray:
    return np.array(x).astype(np.float64) @ np.array(dense).astype(np.float64).T


@pytest.mark.parametrize("m", [1, 4, 5, 16, 33])
@pytest.mark.parametrize("n, k, group_size, bits", QUANTIZED_SHAPES)
def test_quantized_linear_is_bit_identical_to_linear_on_dequantized(m, n, k, group_size, bits):
    """The AVX-512 / AVX2 / portable path: bit-identical to ``linear`` on the dequantized weight.
    Calls the AMX path takes (from 4 rows on a CPU with AMX) are fp32-accurate instead (more in
    the AMX tests below), and this test runs again without AMX in a subprocess there
    (test_avx_path_on_an_amx_machine)."""
    rng = np.random.default_rng(m * 7 + n + k + bits)
    wq, scales, biases = _quantized(rng, n, k, group_size, bits)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    got = native.quantized_linear(x, wq, scales, biases, group_size, bits)
    dense = mx.dequantize(wq, scales, biases, group_size, bits)
    assert got.shape == (m, n)
    if _amx_runs(m, k, group_size):
        want = _reference(x, dense)
        assert np.abs(np.array(got) - want).max() / np.abs(want).max() < 2e-6
        for r in {0, m // 2, m - 1}:  # the same bits among AMX calls (>= AMX_MIN_ROWS rows)
            alone = native.quantized_linear(mx.concatenate([x[r:r + 1], x[:3]]), wq, scales,
                                            biases, group_size, bits)
            assert mx.array_equal(alone[0], got[r]).item()
        return
    assert mx.array_equal(got, native.linear(x, dense)).item()
    assert _rel_err(got, x @ dense.T) < 1e-5
    assert _rel_err(got, mx.quantized_matmul(x, wq, scales, biases, transpose=True,
                                             group_size=group_size, bits=bits)) < 1e-5
    # Batch invariance: each row's outputs are the same bits whatever rows share the call.
    for r in {0, m // 2, m - 1}:
        alone = native.quantized_linear(x[r:r + 1], wq, scales, biases, group_size, bits)
        assert mx.array_equal(alone[0], got[r]).item()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", [1, 3, 4, 40])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (5, 32), (8, 32), (6, 16), (3, 64),
                                              (2, 128)])
def test_16bit_scales_give_the_bits_of_their_float32_values(m, bits, group_size, dtype):
    """float16 / bfloat16 scales and biases (GGUF's exact float16 d and minimum; MLX-format
    checkpoints' stored ones) are widened exactly as they are read: ``quantized_linear`` (the
    AVX path, and the AMX one from 4 rows) and ``dequantize`` give the bits of the same call
    with the values cast to float32, on an odd number of rows."""
    rng = np.random.default_rng(m + bits + group_size)
    n, k = 45, 256
    half = getattr(mx, dtype)
    wq = mx.array(rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32))
    scales = mx.array(rng.standard_normal((n, k // group_size)) * 0.05).astype(half)
    biases = mx.array(rng.standard_normal((n, k // group_size)) * 0.5).astype(half)
    wide = scales.astype(mx.float32), biases.astype(mx.float32)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    assert mx.array_equal(native.quantized_linear(x, wq, scales, biases, group_size, bits),
                          native.quantized_linear(x, wq, *wide, group_size, bits)).item()
    assert mx.array_equal(native.dequantize(wq, scales, biases, group_size, bits),
                          native.dequantize(wq, *wide, group_size, bits)).item()


@pytest.mark.parametrize("shape", [(5, 96), (3, 1, 96), (2, 2, 1, 96), (96,)])
def test_linears_take_leading_axes_as_rows(shape):
    """``linear`` and ``quantized_linear`` take x [..., K] and return [..., N] with the bits of
    the same rows as one [M, K] matrix (mlx-lm calls them on [T, 1, D]: no reshape nodes)."""
    rng = np.random.default_rng(len(shape))
    x = mx.array(rng.standard_normal(shape).astype(np.float32))
    flat = x.reshape(-1, shape[-1])
    w = mx.array(rng.standard_normal((40, 96)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
    for got, want in ((native.linear(x, w), native.linear(flat, w)),
                      (native.quantized_linear(x, wq, scales, biases, 32, 4),
                       native.quantized_linear(flat, wq, scales, biases, 32, 4))):
        assert got.shape == (*shape[:-1], 40)
        assert mx.array_equal(got.reshape(-1, 40), want).item()
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., K\] with K = w.shape"):
        native.quantized_linear(mx.zeros((2, 1, 64)), wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., K\] and w \[N, K\]"):
        native.linear(mx.zeros((2, 1, 64)), w)


def test_every_float16_value_is_widened_exactly():
    """All 65,536 float16 bit patterns as the scales of 8-bit codes 1 and as biases (-0.0
    scales): each dequantized value has the bits of the same call with float32 scales and
    biases (subnormals, signed zeros, infinities and NaNs included), and the values are the
    float16's own (scale * 1 + -0.0 and -0.0 * 1 + bias are exact)."""
    bits16 = np.arange(2**16, dtype=np.uint16).reshape(-1, 2)  # [32768, 2]: 2 groups of 16
    values = mx.array(bits16.view(np.float16))
    minus_zero = mx.full(values.shape, -0.0, dtype=mx.float16)
    wq = mx.array(np.full((bits16.shape[0], 8), 0x01010101, dtype=np.uint32))  # 32 codes 1
    want = np.repeat(bits16.view(np.float16).astype(np.float32), 16, axis=1)
    for scales, biases in ((values, minus_zero), (minus_zero, values)):
        got = np.array(native.dequantize(wq, scales, biases, 16, 8))
        wide = np.array(native.dequantize(wq, scales.astype(mx.float32),
                                          biases.astype(mx.float32), 16, 8))
        assert np.array_equal(got.view(np.uint32), wide.view(np.uint32))
        np.testing.assert_array_equal(got, want)  # equal NaN positions, other values exact

@pytest.fixture(autouse=True)
def exact_arithmetic():
    """This file's tests check the exact kernels bit for bit: quantized layers in fp32
    arithmetic (mode 1, VLLM_UNIFIED_CPU_ACTIVATIONS=fp32) unless a test sets another mode; the
    integer modes have tests of their own below."""
    previous = native.quantized_gemv_mode(1)
    yield
    native.quantized_gemv_mode(previous)


@pytest.fixture
def gemv_mode():
    """Sets native.quantized_gemv_mode for one test and restores the default after it."""
    previous = []
    yield lambda mode: previous.append(native.quantized_gemv_mode(mode))
    if previous:
        native.quantized_gemv_mode(previous[0])


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
def test_gemv_is_bit_identical_to_linear_on_dequantized(bits, group_size, gemv_mode):
    """The kernel for 1-3 rows of x (weights dequantized in registers, by table lookup or
    arithmetic: modes 1 and 2) equals linear on the dequantized weight bit for bit, with row
    counts that leave 1-3 rows of a last 4-row block to the scratch path (mode 0), and equals
    the rows' own bits in a call of 4 or more rows (batch invariance)."""
    rng = np.random.default_rng(bits * 1000 + group_size)
    k = 384
    for n in (1, 6, 37, 131):
        if group_size == 16:
            wq, scales, biases, dense = _groups_of_16(rng, n, k, bits)
        else:
            wq, scales, biases = _quantized(rng, n, k, group_size, bits)
            dense = mx.dequantize(wq, scales, biases, group_size, bits)
        x = mx.array(rng.standard_normal((5, k)).astype(np.float32))
        gemv_mode(0)
        if not native.amx_runs(5, k, group_size):
            five = native.quantized_linear(x, wq, scales, biases, group_size, bits)
        for mode in (0, 1, 2):
            gemv_mode(mode)
            for m in (1, 2, 3):
                got = native.quantized_linear(x[:m], wq, scales, biases, group_size, bits)
                assert got.shape == (m, n)
                assert mx.array_equal(got, native.linear(x[:m], dense)).item(), (mode, n, m)
                if not native.amx_runs(5, k, group_size):
                    assert mx.array_equal(got, five[:m]).item(), (mode, n, m)


def test_start_up_log_names_the_integer_arithmetic(gemv_mode):
    """install_cpu_kernels' account of the quantized layers' arithmetic follows the kernels'
    mode: int16 (VLLM_UNIFIED_CPU_ACTIVATIONS's default) in every layer they take, with the row
    ranges; exact fp32 in mode 1."""
    def quantized() -> llama.Model:
        model = _tiny_llama(False)
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear))
        return model

    gemv_mode(4)
    if not native.int8_runs(1, 64, 32, 4) and not native.q8_avx2_gemm_runs(16, 64, 32, 4):
        pytest.skip("no AVX-512 VNNI and VBMI, nor AVX2, on this CPU")
    routed = cpu_kernels.install_cpu_kernels(quantized())
    where = ("at every size (1-4 rows, from 5 on AMX-INT8 tiles)" if native.amx_usable()
             else "at every size (1-5 rows, from 6 by the AVX-512 VNNI GEMM)"
             if native.int8_runs(1, 64, 32, 4)
             else "at every size on AVX2 (1-4 rows, from 5 by the AVX2 GEMM; no AVX-512 VNNI)")
    assert f"int16 activations in all 15 quantized layers {where}" in routed
    gemv_mode(1)
    assert any(line.startswith("exact fp32 arithmetic in the quantized layers")
               for line in cpu_kernels.install_cpu_kernels(quantized()))


def test_gemv_mode_is_checked(gemv_mode):
    gemv_mode(3)
    with pytest.raises(ValueError, match="mode must be"):
        native.quantized_gemv_mode(5)
    assert native.quantized_gemv_mode(3) == 3  # unchanged by the refusal


def _int8_reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                    group_size: int, two_terms: bool) -> np.ndarray:
    """cpu_q8.cpp's arithmetic in float64 from its own int8 terms of x: per block of 32 elements
    of each row, amax = max|x| (fp32), v = x * (127 / amax) (fp32), hi = rint(v) (ties to
    even); one term: x~ = hi * amax / 127; two: lo = rint((v - hi) * 256) clipped to +-127,
    x~ = (256 hi + lo) * amax / 127 / 256. y = sum_k s q x~ + sum_g b_g * sum(x over g)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    v = blocks * inv
    hi = np.clip(np.rint(v), -127, 127)
    if two_terms:
        lo = np.clip(np.rint((v - hi) * np.float32(256)), -127, 127)
        xq, dx = 256.0 * hi + lo, amax.astype(np.float64) / 127 / 256
    else:
        xq, dx = hi, amax.astype(np.float64) / 127
    xt = (xq * dx).reshape(m, k)
    s = np.repeat(scales.astype(np.float64), group_size, axis=1)
    sums = x.astype(np.float64).reshape(m, k // group_size, group_size).sum(-1)
    return xt @ (codes * s).T + sums @ biases.astype(np.float64).T


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
@pytest.mark.parametrize("mode", [3, 4])
def test_int8_gemv_computes_its_reference(bits, group_size, mode, gemv_mode):
    """Modes 3 and 4 (x in one or two int8 terms; VNNI gemv for 1-4 rows, AMX-INT8 tiles from 5
    where the CPU has them, the codes unpacked once per call beyond 16; without AMX the VNNI
    GEMM from 6 rows): for 1-8, 16, 17, 40, 64 and 2,048 rows of x (several 16-row blocks, the
    last partial), fp32, float16 and bfloat16 scales,
    K a multiple of 64 and not (the last 64-element span half full), an all-zero block of x and
    weight row counts that leave a last block to the exact path: the result equals the float64
    value of the same arithmetic within fp32 summation's error bound, and stays within the bound
    the quantization of x allows around the exact result."""
    gemv_mode(mode)
    if not _int8_gemv_runs(1, 128, group_size, bits):
        pytest.skip("no integer gemv on this CPU (int8_runs, q8_avx2_gemv_runs)")
    rng = np.random.default_rng(bits * 100 + group_size)
    dtypes = (mx.float32, mx.float16, mx.bfloat16)
    for i, (n, k) in enumerate(((37, 384), (8, 128 if group_size > 32 else 96), (131, 640))):
        if k % group_size:
            continue
        if group_size == 16:
            wq, scales, biases, _ = _groups_of_16(rng, n, k, bits)
        else:
            wq, scales, biases = _quantized(rng, n, k, group_size, bits)
        scales, biases = scales.astype(dtypes[i]), biases.astype(dtypes[i])
        s64 = np.array(scales.astype(mx.float32)).astype(np.float64)
        b64 = np.array(biases.astype(mx.float32)).astype(np.float64)
        codes = _codes(wq, n, k, bits)
        scaled = np.abs(codes * np.repeat(s64, group_size, 1))
        dense = codes * np.repeat(s64, group_size, 1) + np.repeat(b64, group_size, 1)
        for m in (1, 2, 3, 4, 5, 8, 16, 17, 40, 64, 2048):
            x = rng.standard_normal((m, k)).astype(np.float32)
            x[0, 32:64] = 0.0
            gemv_mode(mode)
            tiles = (native.amx_int8_runs(m, k, group_size, bits)
                     or native.q8_gemm_runs(m, k, group_size, bits)
                     or native.q8_avx2_gemm_runs(m, k, group_size, bits))
            avx2_gemv = native.q8_avx2_gemv_runs(m, k, group_size, bits)
            int8 = native.int8_runs(m, k, group_size, bits) or tiles or avx2_gemv
            got = np.array(native.quantized_linear(mx.array(x), wq, scales, biases, group_size,
                                                   bits)).astype(np.float64)
            magnitude = np.abs(x).astype(np.float64) @ np.abs(dense).T
            if int8:
                want = _int8_reference(x, codes, s64, b64, group_size, mode == 4)
                # the AVX-512 gemv leaves the rows of a last block of < 4 to the exact path
                done = n if tiles or avx2_gemv else n // 4 * 4
                # recursive summation's bound (n u): the segments' fmas, the group's sum of x
                fp32 = 2.0 ** -24 * (k // 32 + group_size + 4) * magnitude
                assert np.all(np.abs(got - want)[:, :done] <= fp32[:, :done]), (n, k, m)
            exact = x.astype(np.float64) @ dense.T
            amax = np.abs(x.reshape(m, k // 32, 32)).max(-1).astype(np.float64)
            # per element, half a step of hi (one term) or one step of lo (two: its clip)
            step = np.repeat(amax / 127 / (256 if mode == 4 else 2), 32, axis=1)
            assert np.all(np.abs(got - exact) <= step @ scaled.T + 1e-6 * magnitude), (
                n, k, m, int8)


@pytest.mark.parametrize("mode", [3, 4])
def test_int8_gemv_takes_decode_sizes_only(mode, gemv_mode):
    """Where modes 3 and 4 apply: the gemv for 1-4 rows of x where AMX-INT8 tiles take 5 and
    more, else for 1-5 rows and the VNNI GEMM from 6, on any layer the kernels take; never in
    modes 0-2 or for layouts they do not take (K % 32, group 48, 7 bits)."""
    gemv_mode(mode)
    if not native.int8_runs(1, 128, 32, 4):
        pytest.skip("no AVX-512 VNNI and VBMI on this CPU (int8_runs)")
    amx = native.amx_usable()
    assert all(native.int8_runs(m, 128, 16, 6) for m in (1, 2, 3, 4))
    assert native.int8_runs(5, 128, 16, 6) != amx  # else the tiles'
    assert not native.int8_runs(0, 128, 32, 4)
    assert not native.int8_runs(6, 128, 16, 6)
    assert not native.int8_runs(1, 144, 48, 4)
    assert not native.int8_runs(1, 128, 32, 7)
    batch = (6, 16, 17, 2048)
    assert all(native.amx_int8_runs(m, 128, 16, 6) == amx for m in (5, *batch))
    assert all(native.q8_gemm_runs(m, 128, 16, 6) != amx for m in batch)
    assert not native.amx_int8_runs(4, 128, 16, 6)
    assert not native.q8_gemm_runs(5, 128, 16, 6)
    for layout in ((64, 144, 48, 4), (64, 128, 32, 7), (64, 80, 16, 4)):
        assert not native.amx_int8_runs(*layout) and not native.q8_gemm_runs(*layout)
    for mode in (0, 1, 2):
        gemv_mode(mode)
        assert not native.int8_runs(1, 128, 32, 4)
        assert not native.amx_int8_runs(64, 128, 32, 4)
        assert not native.q8_gemm_runs(64, 128, 32, 4)


@pytest.mark.parametrize("mode", [3, 4])
def test_int8_gemm_rows_do_not_depend_on_their_batch(mode, gemv_mode):
    """The VNNI GEMM (6 rows and more, no AMX) computes each row of x on its own: a row's bits
    are the same in a call of 6, 7, 9, 64 or 300 rows (row tails of the 4-row micro-kernel, x's
    rows split over the pool's items), for widths with and without VBMI's multishift unpack,
    groups of 16 and 64, and a weight whose last 16-row panel is partial."""
    gemv_mode(mode)
    if not native.q8_gemm_runs(6, 192, 16, 4):
        pytest.skip("the VNNI GEMM does not run here (AMX-INT8, or no AVX-512 VNNI and VBMI)")
    rng = np.random.default_rng(mode)
    x = mx.array(rng.standard_normal((300, 192)).astype(np.float32))
    for bits, group_size in ((4, 64), (3, 16), (8, 64)):
        if group_size == 16:
            wq, scales, biases, _ = _groups_of_16(rng, 83, 192, bits)
        else:
            wq, scales, biases = _quantized(rng, 83, 192, group_size, bits)
        full = native.quantized_linear(x, wq, scales, biases, group_size, bits)
        for m in (6, 7, 9, 64):
            part = native.quantized_linear(x[-m:], wq, scales, biases, group_size, bits)
            assert mx.array_equal(part, full[-m:]).item(), (bits, group_size, m)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_int8_kernels_take_groups_of_any_multiple_of_64(bits, gemv_mode):
    """Groups of 192 (a multiple of 64 that is no power of two: the kernels count blocks per
    group rather than assume a shift) on the integer gemv and GEMM that run here, 1-5, 8 and
    17 rows, two terms: within fp32 summation's bound of the float64 value of the arithmetic."""
    gemv_mode(4)
    if not (_int8_gemv_runs(1, 384, 192, bits) or _int8_gemm_runs(16, 384, 192, bits)):
        pytest.skip("no integer kernel here")
    rng = np.random.default_rng(bits)
    n, k, group_size = 21, 576, 192
    wq, _, _ = _quantized(rng, n, k, 32, bits)
    scales = mx.array(rng.standard_normal((n, k // group_size)).astype(np.float32))
    biases = mx.array(rng.standard_normal((n, k // group_size)).astype(np.float32))
    codes = _codes(wq, n, k, bits)
    s64, b64 = np.array(scales).astype(np.float64), np.array(biases).astype(np.float64)
    dense = codes * np.repeat(s64, group_size, 1) + np.repeat(b64, group_size, 1)
    for m in (1, 2, 3, 4, 5, 8, 17):
        assert _int8_gemv_runs(m, k, group_size, bits) or _int8_gemm_runs(m, k, group_size,
                                                                           bits), m
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = np.array(native.quantized_linear(mx.array(x), wq, scales, biases, group_size,
                                               bits)).astype(np.float64)
        want = _int8_reference(x, codes, s64, b64, group_size, True)
        magnitude = np.abs(x).astype(np.float64) @ np.abs(dense).T
        done = n if not native.int8_runs(m, k, group_size, bits) else n // 4 * 4
        bound = 2.0 ** -24 * (k // 32 + group_size + 4) * magnitude
        assert np.all(np.abs(got - want)[:, :done] <= bound[:, :done]), m


def _int8_gemv_runs(m: int, k: int, group_size: int, bits: int) -> bool:
    """Whether an integer gemv (AVX-512 VNNI, or AVX2 without it) takes x [m, k] here."""
    return (native.int8_runs(m, k, group_size, bits)
            or native.q8_avx2_gemv_runs(m, k, group_size, bits))


def _int8_gemm_runs(m: int, k: int, group_size: int, bits: int) -> bool:
    """Whether one of the integer GEMMs (AMX-INT8 from 5 rows, AVX-512 VNNI from 6, AVX2 from 5)
    takes x [m, k] here."""
    return (native.amx_int8_runs(m, k, group_size, bits)
            or native.q8_gemm_runs(m, k, group_size, bits)
            or native.q8_avx2_gemm_runs(m, k, group_size, bits))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
@pytest.mark.parametrize("mode", [3, 4])
def test_int8_gemm_computes_its_reference(bits, group_size, mode, gemv_mode):
    """Modes 3 and 4 on the integer GEMMs: the AMX-INT8 tiles from 5 rows, the AVX-512 VNNI GEMM
    from 6 or the AVX2 GEMM at every size, whichever this process runs (test_int8_gemm_on_avx2
    runs it again on AVX2): for 1-6, 16, 17, 64 and 2,048 rows of x (those a GEMM takes here;
    the gemv's are test_int8_gemv_computes_its_reference's), fp32, float16 and bfloat16
    scales, weight row counts that leave a last partial block of 8 and of 16 rows, an all-zero
    block of x: the result equals the float64 value of the same arithmetic to fp32 summation
    error."""
    gemv_mode(mode)
    if not _int8_gemm_runs(16, 128, group_size, bits):
        pytest.skip("no integer GEMM here")
    rng = np.random.default_rng(bits * 100 + group_size + mode)
    dtypes = (mx.float32, mx.float16, mx.bfloat16)
    for i, (n, k) in enumerate(((37, 384), (8, 128 if group_size > 32 else 96), (131, 640))):
        if k % group_size:
            continue
        if group_size == 16:
            wq, scales, biases, _ = _groups_of_16(rng, n, k, bits)
        else:
            wq, scales, biases = _quantized(rng, n, k, group_size, bits)
        scales, biases = scales.astype(dtypes[i]), biases.astype(dtypes[i])
        s64 = np.array(scales.astype(mx.float32)).astype(np.float64)
        b64 = np.array(biases.astype(mx.float32)).astype(np.float64)
        codes = _codes(wq, n, k, bits)
        dense = np.abs(codes * np.repeat(s64, group_size, 1) + np.repeat(b64, group_size, 1))
        for m in (1, 2, 3, 4, 5, 6, 16, 17, 64, 2048) if i == 0 else (1, 3, 6, 17, 64):
            if m < 6 and not _int8_gemm_runs(m, k, group_size, bits):
                continue  # the gemv's rows (test_int8_gemv_computes_its_reference)
            assert _int8_gemm_runs(m, k, group_size, bits)
            x = rng.standard_normal((m, k)).astype(np.float32)
            x[0, 32:64] = 0.0
            got = np.array(native.quantized_linear(mx.array(x), wq, scales, biases, group_size,
                                                   bits)).astype(np.float64)
            want = _int8_reference(x, codes, s64, b64, group_size, mode == 4)
            magnitude = np.abs(x).astype(np.float64) @ dense.T
            # fp32 summation of k products: the standard bound k * 2^-24 * sum |x| |w|
            assert np.all(np.abs(got - want) <= k * 2.0**-24 * magnitude), (n, k, m)


def test_int8_gemm_kernels_take_their_sizes_only(gemv_mode):
    """Exactly one integer kernel per size where any runs: the AVX-512 gemv (1-4 rows with the
    AMX-INT8 tiles from 5, else 1-5 with the AVX-512 VNNI GEMM from 6), or where none of those
    run the AVX2 gemv for 1-4 rows and the AVX2 GEMM from 5; none for 0 rows, in modes 0-2 or
    for layouts they do not take (K % 32, group 48, 7 bits)."""
    gemv_mode(4)
    if not _int8_gemm_runs(16, 128, 32, 4):
        pytest.skip("no integer GEMM here")
    for m in (1, 2, 3, 4, 5, 6, 16, 17, 2048):
        assert sum((native.int8_runs(m, 128, 16, 6), native.amx_int8_runs(m, 128, 16, 6),
                    native.q8_gemm_runs(m, 128, 16, 6), native.q8_avx2_gemv_runs(m, 128, 16, 6),
                    native.q8_avx2_gemm_runs(m, 128, 16, 6))) == 1, m
    if native.q8_avx2_gemm_runs(16, 128, 32, 4):
        assert all(native.q8_avx2_gemv_runs(m, 128, 32, 4) == (m <= 4) for m in (1, 4, 5, 16))
    assert not _int8_gemm_runs(0, 128, 16, 6)
    assert not _int8_gemv_runs(0, 128, 16, 6)
    assert not _int8_gemm_runs(64, 144, 48, 4)
    assert not _int8_gemm_runs(64, 128, 32, 7)
    assert not _int8_gemm_runs(64, 80, 16, 4)
    if native.int8_runs(1, 128, 32, 4):  # AVX-512 VNNI and VBMI here: never the AVX2 GEMM
        assert not native.q8_avx2_gemm_runs(64, 128, 32, 4)
    for mode in (0, 1, 2):
        gemv_mode(mode)
        assert not _int8_gemm_runs(64, 128, 32, 4)


def test_int8_gemm_on_avx2():
    """The tests of the integer GEMMs, again with ``VLLM_UNIFIED_CPU_ISA=avx2``: the AVX2 gemv
    and GEMM against their reference at every width, group size and row count, their
    predicates, the start-up log's account of them."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_UNIFIED_CPU_ISA": "avx2", "VLLM_UNIFIED_CPU_ACTIVATIONS": "int16"}
    probe = "import vllm_unified_native as n; print(n.q8_avx2_gemm_runs(16, 128, 32, 4))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True)
    if out.stdout.strip() != "True":
        pytest.skip("no AVX2 and FMA on this CPU")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "int8_gemm_computes_its_reference or int8_gemm_kernels_take_their_sizes_only "
         "or int8_gemv_computes_its_reference or start_up_log_names_the_integer_arithmetic "
         "or groups_of_any_multiple_of_64",
         __file__],
        env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


_Q8_GEMM_PROBE = """
import hashlib, sys, numpy as np, mlx.core as mx
import vllm_unified_native as native
rng = np.random.default_rng(4)
h = hashlib.sha1()
for mode in (3, 4):
    native.quantized_gemv_mode(mode)
    for bits, gs, n, k, m, dt in [
            (4, 32, 77, 576, 10, mx.float32), (8, 64, 45, 256, 17, mx.float16),
            (3, 16, 40, 192, 64, mx.bfloat16), (5, 128, 33, 384, 6, mx.float32),
            (6, 32, 20, 384, 300, mx.float16), (2, 16, 50, 128, 8, mx.float32),
            (4, 64, 24, 1536, 2048, mx.bfloat16), (8, 16, 9, 64, 16, mx.float16),
            (2, 128, 31, 256, 40, mx.bfloat16), (5, 32, 100, 96, 33, mx.float16),
            (3, 64, 7, 320, 9, mx.float32), (6, 16, 64, 160, 7, mx.bfloat16)]:
        wq, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)),
                               group_size=max(gs, 32), bits=bits)
        if gs == 16:  # MLX makes no groups of 16: any scales and biases make a valid triple
            s = mx.array(rng.standard_normal((n, k // 16)).astype(np.float32))
            b = mx.array(rng.standard_normal((n, k // 16)).astype(np.float32))
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :32] = 0.0
        runs = native.q8_avx2_gemm_runs if sys.argv[1] == "avx2" else native.q8_gemm_runs
        assert runs(m, k, gs, bits), (sys.argv[1], bits, gs, m)
        y = native.quantized_linear(mx.array(x), wq, s.astype(dt), b.astype(dt), gs, bits)
        h.update(np.array(y).tobytes())
print(h.hexdigest())
"""


def test_avx2_int8_gemm_is_bit_identical_to_the_avx512_one():
    """The AVX2 GEMM (``VLLM_UNIFIED_CPU_ISA=avx2``), its AVX-VNNI form (``avxvnni``, where the
    CPU has AVX-VNNI) and the AVX-512 VNNI GEMM (``avx512``) give the same bits at every width,
    group size, scale type and both modes: the same integer sums and the same fp32 operations
    in the same order per output."""
    import os
    import subprocess
    import sys

    digests = {}
    for isa in ("avx512", "avx2", "avxvnni"):
        env = {**os.environ, "VLLM_UNIFIED_CPU_ISA": isa}
        runs = "n.q8_gemm_runs(16, 128, 32, 4)" if isa == "avx512" else (
            "n.q8_avx2_gemm_runs(16, 128, 32, 4)" + (
                " and n.q8_avx2_vnni_runs()" if isa == "avxvnni" else
                " and not n.q8_avx2_vnni_runs()"))
        probe = f"import vllm_unified_native as n; n.quantized_gemv_mode(4); print({runs})"
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, check=True)
        if out.stdout.strip() != "True":
            if isa == "avxvnni":  # a CPU without AVX-VNNI: the other two still compared
                continue
            pytest.skip(f"this CPU cannot run the {isa} GEMM")
        arg = "avx2" if isa == "avxvnni" else isa  # the probe's name for the AVX2 predicate
        out = subprocess.run([sys.executable, "-c", _Q8_GEMM_PROBE, arg], env=env, check=True,
                             capture_output=True, text=True)
        digests[isa] = out.stdout.strip()
    assert len(digests) >= 2
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("setting, mode", [(None, 4), ("int16", 4), ("int8", 3), ("fp32", 1)])
def test_cpu_activations_setting_sets_the_kernel_mode(setting, mode):
    """VLLM_UNIFIED_CPU_ACTIVATIONS decides the quantized layers' arithmetic at import (a fresh
    process: the extension reads it once); a bad value names the variable."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_UNIFIED_CPU_ACTIVATIONS"}
    if setting is not None:
        env["VLLM_UNIFIED_CPU_ACTIVATIONS"] = setting
    code = "import vllm_unified_native as n; print(n.quantized_gemv_mode(1))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == str(mode)
    env["VLLM_UNIFIED_CPU_ACTIVATIONS"] = "int4"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "VLLM_UNIFIED_CPU_ACTIVATIONS" in bad.stderr


def test_avx_path_on_an_amx_machine():
    """On a CPU with AMX the in-process tests above skip the calls AMX takes: run them again
    with ``VLLM_UNIFIED_CPU_ISA=avx512`` (AMX off), so the AVX-512 kernel is still proven."""
    import os
    import subprocess
    import sys

    if not native.amx_usable():
        pytest.skip("no AMX here: the in-process run already took the AVX path for every call")
    env = {**os.environ, "VLLM_UNIFIED_CPU_ISA": "avx512"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "bit_identical_to_linear_on_dequantized or bit_identical_to_its_dequantized_copy",
         __file__], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


AMX_SHAPES = [  # (m, n, k, group_size, bits): row and column tails, group sizes, widths
    (4, 1536, 576, 32, 4), (16, 49, 576, 32, 8), (17, 200, 128, 64, 4), (33, 16, 1536, 32, 4),
    (100, 577, 64, 32, 8), (35, 24, 256, 128, 4), (300, 130, 96, 32, 4),
    (5, 70, 96, 32, 3), (40, 33, 256, 64, 3), (6, 100, 160, 32, 5), (70, 50, 384, 128, 5),
    (17, 45, 192, 64, 6), (100, 20, 96, 32, 6), (4, 64, 128, 32, 2), (50, 30, 256, 128, 2)]


def _needs_amx():
    if not native.amx_usable():
        pytest.skip("CPU without AMX (or VLLM_UNIFIED_CPU_ISA below amx)")


@pytest.mark.parametrize("m, n, k, group_size, bits", AMX_SHAPES)
def test_amx_quantized_linear_is_fp32_accurate(m, n, k, group_size, bits):
    """The AMX path splits x into three bf16 parts and keeps the integer q exact, so only fp32
    accumulation rounds: within 2e-6 of the float64 product (relative to its largest value), as
    close as MLX's own fp32 matmul on the dequantized weight (x3)."""
    _needs_amx()
    rng = np.random.default_rng(m + n + k + bits)
    wq, scales, biases = _quantized(rng, n, k, group_size, bits)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    dense = mx.dequantize(wq, scales, biases, group_size, bits)
    want = _reference(x, dense)
    got = np.array(native.quantized_linear(x, wq, scales, biases, group_size, bits))
    blas = np.array(x @ dense.T)
    scale = np.abs(want).max()
    err, blas_err = np.abs(got - want).max() / scale, np.abs(blas - want).max() / scale
    assert err < 2e-6 and err <= 3 * blas_err + 1e-7, (err, blas_err)


def test_amx_quantized_linear_keeps_small_and_large_values_of_a_row():
    """A row mixing magnitudes 1e-20 .. 1e20: each part of the split is a bf16 rounding of what
    is left, so small entries are not lost next to large ones (bf16 alone would drop them)."""
    _needs_amx()
    rng = np.random.default_rng(3)
    wq, scales, biases = _quantized(rng, 64, 256, 32, 4)
    x_np = rng.standard_normal((8, 256)).astype(np.float32)
    x_np *= np.float32(10.0) ** rng.integers(-20, 21, size=(8, 256)).astype(np.float32)
    x_np[1] = rng.standard_normal(256).astype(np.float32) * 1e-20  # a row of tiny values only
    x_np[2] = 1.0 + rng.standard_normal(256).astype(np.float32) * 1e-6  # bf16 would round these
    x = mx.array(x_np)
    dense = mx.dequantize(wq, scales, biases, 32, 4)
    want = _reference(x, dense)
    got = np.array(native.quantized_linear(x, wq, scales, biases, 32, 4))
    for r in range(8):
        tol = 1e-6 * np.abs(np.array(x[r])).astype(np.float64) @ np.abs(np.array(dense)).T
        assert np.all(np.abs(got[r] - want[r]) <= tol + 1e-35), r


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [6, 40], ids=["decode_tiles", "prefill_panel"])
def test_amx_quantized_linear_is_fp32_accurate_at_any_finite_magnitude(m, bits):
    """Rows whose values are all huge (1e36: x * q summed over a group overflowed fp32 before
    the scales applied, NaN where dequantize-then-multiply is finite), one value near FLT_MAX
    (its bf16 rounding was inf), or all tiny (1e-36, subnormal 1e-40: the bf16 instructions
    flush subnormal parts, so most of each value was lost): each row is accurate to fp32
    relative to its own outputs, like the AVX path (FLT_TRUE_MIN added: subnormal results)."""
    _needs_amx()
    rng = np.random.default_rng(8)
    k, n, gs = 128, 40, 32
    wq, scales, biases = mx.quantize(
        mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.02), group_size=gs,
        bits=bits)
    x_np = rng.standard_normal((m, k)).astype(np.float32)
    x_np[0] *= np.float32(1e36)
    x_np[1, 5] = np.float32(3.0e38)
    x_np[2] *= np.float32(1e-36)
    x_np[3] *= np.float32(1e-40)
    x = mx.array(x_np)
    dense = mx.dequantize(wq, scales, biases, gs, bits)
    want = _reference(x, dense)
    got = np.array(native.quantized_linear(x, wq, scales, biases, gs, bits))
    assert np.isfinite(want).all()
    for r in range(m):
        tol = 2e-6 * np.abs(want[r]).max() + np.finfo(np.float32).smallest_subnormal
        assert np.abs(got[r] - want[r]).max() <= tol, (r, np.abs(got[r] - want[r]).max(), tol)


def test_amx_quantized_linear_rows_do_not_depend_on_their_batch():
    """Each row's outputs are the same bits whether it is computed with 3 other rows (the
    decode tiles) or 299 (the prefill panel), at any position."""
    _needs_amx()
    rng = np.random.default_rng(5)
    wq, scales, biases = _quantized(rng, 300, 576, 32, 4)
    x = mx.array(rng.standard_normal((300, 576)).astype(np.float32))
    full = native.quantized_linear(x, wq, scales, biases, 32, 4)
    for r in (0, 17, 299):
        four = mx.concatenate([mx.zeros((2, 576)), x[r:r + 1], mx.ones((1, 576))])
        got = native.quantized_linear(four, wq, scales, biases, 32, 4)
        assert mx.array_equal(got[2], full[r]).item(), r


def test_amx_quantized_linear_propagates_nan_to_its_row_only():
    _needs_amx()
    rng = np.random.default_rng(6)
    wq, scales, biases = _quantized(rng, 40, 128, 32, 4)
    x_np = rng.standard_normal((5, 128)).astype(np.float32)
    x_np[3, 7] = np.nan
    got = np.array(native.quantized_linear(mx.array(x_np), wq, scales, biases, 32, 4))
    assert np.isnan(got[3]).all() and np.isfinite(np.delete(got, 3, axis=0)).all()


_ISA_PROBE = """
import hashlib, numpy as np, mlx.core as mx
from vllm_unified_native import dequantize, quantized_linear
rng = np.random.default_rng(1)
h = hashlib.sha1()
for bits, gs, n, k in [(4, 32, 77, 576), (8, 64, 45, 256), (4, 128, 33, 384), (3, 32, 40, 192),
                       (5, 64, 30, 256), (6, 128, 20, 384), (2, 32, 50, 128), (6, 16, 9, 96),
                       (3, 16, 11, 64), (5, 16, 7, 64), (2, 16, 5, 64)]:
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=max(gs, 32), bits=bits)
    if gs == 16:  # MLX makes no groups of 16: any scales and biases make a valid triple
        s = mx.array(rng.standard_normal((n, k // 16)).astype(np.float32))
        b = mx.array(rng.standard_normal((n, k // 16)).astype(np.float32))
    for m in (1, 3, 5, 16):
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
        h.update(np.array(quantized_linear(x, wq, s, b, gs, bits)).tobytes())
    h.update(np.array(dequantize(wq, s, b, gs, bits)).tobytes())
print(h.hexdigest())
"""


def test_quantized_kernels_give_the_same_bits_at_every_isa_level():
    """The AVX-512, AVX2 and portable dequantization (chosen once per process;
    VLLM_UNIFIED_CPU_ISA lowers the choice) give identical results."""
    import os
    import subprocess
    import sys

    digests = {}
    for isa in ("avx512", "avx2", "portable"):
        env = {**os.environ, "VLLM_UNIFIED_CPU_ISA": isa,
               "VLLM_UNIFIED_CPU_ACTIVATIONS": "fp32"}
        out = subprocess.run([sys.executable, "-c", _ISA_PROBE], env=env, check=True,
                             capture_output=True, text=True)
        digests[isa] = out.stdout.strip()
    assert len(set(digests.values())) == 1, digests


_AMX_PROBE = """
import hashlib, numpy as np, mlx.core as mx
from vllm_unified_native import amx_usable, quantized_linear
assert amx_usable()
rng = np.random.default_rng(2)
h = hashlib.sha1()
for bits, gs, n, k, m in [(4, 32, 1536, 576, 16), (8, 64, 300, 256, 5), (4, 32, 700, 1536, 200),
                          (5, 32, 700, 1536, 200), (3, 64, 300, 256, 5), (6, 32, 130, 384, 60)]:
    wq, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)),
                           group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    h.update(np.array(quantized_linear(x, wq, s, b, gs, bits)).tobytes())
print(h.hexdigest())
"""


def test_amx_bits_do_not_depend_on_the_thread_count():
    """Work is split over 16-row weight blocks (and 64-row x blocks): one thread or all give
    the same bits."""
    import os
    import subprocess
    import sys

    _needs_amx()
    digests = set()
    for threads in ("1", "2", ""):
        env = {**os.environ, "VLLM_UNIFIED_CPU_THREADS": threads,
               "VLLM_UNIFIED_CPU_ACTIVATIONS": "fp32"}
        out = subprocess.run([sys.executable, "-c", _AMX_PROBE], env=env, check=True,
                             capture_output=True, text=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


def test_quantized_kernels_reject_bad_input():
    rng = np.random.default_rng(0)
    wq, scales, biases = _quantized(rng, 8, 64, 32, 4)
    x = mx.zeros((2, 64))
    with pytest.raises(ValueError, match="bits must be 2, 3, 4, 5, 6 or 8, got 7"):
        native.quantized_linear(x, wq, scales, biases, 32, 7)
    with pytest.raises(ValueError, match="words do not hold whole 3-bit elements"):
        native.dequantize(wq[:, :7], scales, biases, 32, 3)
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        native.dequantize(wq, scales, biases, 24, 4)
    with pytest.raises(TypeError, match="scales, biases both float32, float16 or bfloat16"):
        native.quantized_linear(x, wq, scales.astype(mx.float16), biases, 32, 4)
    with pytest.raises(TypeError, match="scales, biases both float32, float16 or bfloat16"):
        native.dequantize(wq, scales.astype(mx.int32), biases.astype(mx.int32), 32, 4)
    with pytest.raises(TypeError, match="x must be float32"):
        native.quantized_linear(x.astype(mx.bfloat16), wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match=r"scales and biases must be \[N, K / group_size\]"):
        native.dequantize(wq, scales, biases, 64, 4)
    with pytest.raises(ValueError, match="K = w.shape\\[1\\] \\* 32 / bits = 64"):
        native.quantized_linear(mx.zeros((2, 32)), wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="row-contiguous"):
        sliced = wq[:, ::2]
        mx.eval(sliced)
        native.dequantize(sliced, scales[:, ::2], biases[:, ::2], 32, 4)


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_model_runs_bit_identical_to_its_dequantized_copy(monkeypatch, tied):
    """A model kept quantized (4-bit layers, 8-bit embedding) and run by the native kernels
    computes exactly what the same model dequantized at load computes: decode-sized inputs in
    the quantized kernel, larger ones dequantized natively for MLX's matmul. On a CPU with AMX
    the larger ones run on AMX tiles instead: fp32-accurate, not the same bits (the AVX path is
    checked there by test_avx_path_on_an_amx_machine)."""
    model = _tiny_llama(tied)
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda p, m: isinstance(m, nn.Linear))
    nn.quantize(model, group_size=64, bits=8,
                class_predicate=lambda p, m: isinstance(m, nn.Embedding))
    dense = _tiny_llama(tied)
    dense.update(dequantized_params(model))
    cpu_kernels.install_cpu_kernels(dense)
    routed = cpu_kernels.install_cpu_kernels(model)
    assert f"{2 * 7 + (0 if tied else 1)} quantized linear layers" in routed
    assert "1 quantized embedding layers" in routed
    amx_line = f"quantized linears on AMX tiles from {native.AMX_MIN_ROWS} rows"
    assert (amx_line in routed) == native.amx_usable()
    assert any(line.startswith("exact fp32 arithmetic in the quantized layers")
               for line in routed)  # this file's fixture: mode 1
    tokens = mx.array(np.random.default_rng(0).integers(0, 300, (2, 40)))
    spy = _Spy(native)
    monkeypatch.setattr(bridge, "native_kernels", lambda: spy)
    amx = native.amx_usable()
    for inputs, kernel in ((tokens[:, :1], "quantized_linear"),
                           (tokens, "quantized_linear" if amx else "dequantize")):
        got = model(inputs)
        lookup = 1 if kernel == "dequantize" else 0  # the embedding's rows: native dequantize
        assert spy.calls[kernel] == 2 * 7 + 1 + lookup
        assert spy.calls["dequantize"] >= 1
        spy.calls.clear()
        if amx and inputs.size >= native.AMX_MIN_ROWS:
            assert _rel_err(got, dense(inputs)) < 1e-5
        else:
            assert mx.array_equal(got, dense(inputs)).item()


def dequantized_params(model: nn.Module) -> dict:
    """The dense parameters a quantized ``model`` stands for (``mx.dequantize`` of each layer),
    in the parameter tree of the unquantized model."""
    from mlx.utils import tree_unflatten

    flat = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            flat.append((f"{name}.weight", mx.dequantize(m.weight, m.scales, m.biases,
                                                         m.group_size, m.bits)))
            if "bias" in m:
                flat.append((f"{name}.bias", m.bias))
    return tree_unflatten(flat)


def test_quantized_weights_stay_quantized_only_where_the_kernels_run(monkeypatch):
    assert cpu_kernels.keep_quantized_on_cpu(mx.float32)
    assert not cpu_kernels.keep_quantized_on_cpu(mx.bfloat16)
    monkeypatch.setenv("VLLM_UNIFIED_CPU_QUANTIZED", "0")
    assert not cpu_kernels.keep_quantized_on_cpu(mx.float32)
    monkeypatch.delenv("VLLM_UNIFIED_CPU_QUANTIZED")
    monkeypatch.setattr(bridge, "native_kernels", lambda: None)
    assert not cpu_kernels.keep_quantized_on_cpu(mx.float32)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims, head_dim", [(64, 64), (32, 64), (16, 20)])
@pytest.mark.parametrize("offset_kind", ["per_row", "int", "one"])
def test_rope_equals_mx_fast_rope(traditional, dims, head_dim, offset_kind):
    rng = np.random.default_rng(dims + head_dim)
    x = mx.array(rng.standard_normal((6, 3, 2, head_dim)).astype(np.float32))
    offset = {"per_row": mx.array(rng.integers(0, 4000, (6,)).astype(np.int32)),
              "int": 37, "one": mx.array([1234])}[offset_kind]
    rope = nn.RoPE(dims, traditional=traditional, base=100000.0, scale=0.5)
    want = rope(x, offset=offset)
    rope.__class__ = cpu_kernels.NativeRoPE
    spy = _Spy(native)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bridge, "native_kernels", lambda: spy)
        got = rope(x, offset=offset)
    assert spy.calls == {"rope": 1}
    assert got.shape == x.shape
    # angles up to 2,000 rad: fp32 rounding of theta dominates (MLX's own CPU path shares it)
    assert float(mx.abs(got - want).max()) < 2e-6
    # a transposed view (mlx-lm's [B, L, H, D] -> [B, H, L, D]) is read as it is
    xt = x.transpose(0, 2, 1, 3)
    assert float(mx.abs(rope(xt, offset=offset) - nn.RoPE.__call__(rope, xt, offset)).max()) < 2e-6


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (3, 5, 64), (7,)])
def test_rms_norm_equals_mx_fast_rms_norm(shape):
    rng = np.random.default_rng(len(shape))
    x = mx.array((rng.standard_normal(shape) * 3).astype(np.float32))
    norm = nn.RMSNorm(shape[-1], eps=1e-5)
    norm.weight = mx.array(rng.standard_normal(shape[-1]).astype(np.float32))
    want = norm(x)
    norm.__class__ = cpu_kernels.NativeRMSNorm
    got = norm(x)
    assert got.shape == x.shape
    assert _rel_err(got, want) < 2e-6


def _freqs_ropes():
    from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE

    return {
        "llama3": Llama3RoPE(64, max_position_embeddings=8192, base=500000.0, scaling_config={
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024}),
        "longrope_scaled": SuScaledRoPE(64, max_position_embeddings=8192,
                                        original_max_position_embeddings=1024,
                                        short_factor=1.0,
                                        long_factor=[1.0 + 0.1 * i for i in range(32)]),
        "longrope_partial": SuScaledRoPE(32, short_factor=1.0,
                                         long_factor=[1.0 + 0.3 * i for i in range(16)]),
        "proportional": ProportionalRoPE(64, rotated_dims=16, base=1000000.0),
    }


@pytest.mark.parametrize("variant", ["llama3", "longrope_scaled", "longrope_partial",
                                     "proportional"])
@pytest.mark.parametrize("offset_kind", ["per_row", "int"])
def test_freqs_ropes_equal_their_mlx_lm_modules(variant, offset_kind):
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((6, 3, 2, 64)).astype(np.float32))
    offset = {"per_row": mx.array(rng.integers(0, 4000, (6,)).astype(np.int32)),
              "int": 37}[offset_kind]
    holder = nn.Module()
    holder.rope = _freqs_ropes()[variant]
    want = holder.rope(x, offset)
    assert cpu_kernels.install_cpu_kernels(holder) == ["1 RoPE layers"]
    assert isinstance(holder.rope, cpu_kernels.NativeFreqsRoPE)
    spy = _Spy(native)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bridge, "native_kernels", lambda: spy)
        got = holder.rope(x, offset)
    assert spy.calls == {"rope": 1}
    assert float(mx.abs(got - want).max()) < 4e-6
    assert float(mx.abs(holder.rope(x.astype(mx.float16), offset).astype(mx.float32)
                        - want).max()) < 1e-2  # not fp32: the module's own call


def test_gemma_norms_equal_their_mlx_lm_modules():
    from mlx_lm.models import gemma2, gemma4_text

    rng = np.random.default_rng(3)
    x = mx.array((rng.standard_normal((5, 2, 96)) * 3).astype(np.float32))
    holder = nn.Module()
    holder.offset = gemma2.RMSNorm(96, eps=1e-6)
    holder.offset.weight = mx.array(rng.standard_normal(96).astype(np.float32))
    holder.no_scale = gemma4_text.RMSNormNoScale(96, eps=1e-6)
    want = (holder.offset(x), holder.no_scale(x))
    assert cpu_kernels.install_cpu_kernels(holder) == ["2 RMSNorm layers"]
    spy = _Spy(native)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bridge, "native_kernels", lambda: spy)
        got = (holder.offset(x), holder.no_scale(x))
    assert spy.calls == {"rms_norm": 2}
    for g, w in zip(got, want, strict=True):
        assert _rel_err(g, w) < 2e-6


def test_norm_and_rope_kernels_reject_bad_input():
    with pytest.raises(TypeError, match="float32"):
        native.rms_norm(mx.zeros((2, 4), mx.float16), mx.ones((4,), mx.float16), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[D\]"):
        native.rms_norm(mx.zeros((2, 4)), mx.ones((5,)), 1e-5)
    inv = mx.ones((8,))
    offsets = mx.zeros((2,), mx.int32)
    with pytest.raises(ValueError, match=r"\[B, H, L, D\]"):
        native.rope(mx.zeros((2, 3, 16)), 16, False, inv, 1.0, offsets)
    with pytest.raises(ValueError, match="dims must be even"):
        native.rope(mx.zeros((2, 3, 1, 16)), 15, False, inv, 1.0, offsets)
    with pytest.raises(ValueError, match=r"inv_freq must be \[dims / 2\]"):
        native.rope(mx.zeros((2, 3, 1, 16)), 8, False, inv, 1.0, offsets)
    with pytest.raises(ValueError, match=r"offsets must be \[B\] or \[1\]"):
        native.rope(mx.zeros((2, 3, 1, 16)), 16, False, inv, 1.0, mx.zeros((3,), mx.int32))
    with pytest.raises(TypeError, match="int32"):
        native.rope(mx.zeros((2, 3, 1, 16)), 16, False, inv, 1.0, mx.zeros((2,)))


def test_rope_calls_outside_the_kernel_fall_back():
    rope = nn.RoPE(16, base=10000.0)
    rope.__class__ = cpu_kernels.NativeRoPE
    x = mx.array(np.random.default_rng(0).standard_normal((2, 4, 16)).astype(np.float32))
    assert mx.array_equal(rope(x, offset=3), nn.RoPE.__call__(rope, x, 3)).item()  # 3-D input
    x16 = x.reshape(1, 2, 4, 16).astype(mx.float16)
    assert mx.array_equal(rope(x16), nn.RoPE.__call__(rope, x16)).item()  # not fp32


def test_threaded_elementwise_kernels_equal_their_single_thread_pieces():
    """SwiGLU, RMSNorm and RoPE split inputs of 65536 elements or more over the kernel threads;
    the pieces' bounds keep every element's arithmetic, so a large call has the bits of the
    same rows computed in calls too small to be split."""
    rng = np.random.default_rng(11)
    gate, up = (mx.array(rng.standard_normal((96, 1536)).astype(np.float32)) for _ in range(2))
    x = mx.array(rng.standard_normal((300, 576)).astype(np.float32))
    w = mx.array(rng.standard_normal(576).astype(np.float32))
    q = mx.array(rng.standard_normal((300, 9, 1, 64)).astype(np.float32))
    inv = mx.array(1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64), mx.float32)
    offsets = mx.array(rng.integers(0, 4000, 300), mx.int32)
    whole = [native.silu_mul(gate, up), native.rms_norm(x, w, 1e-5),
             native.rope(q, 64, False, inv, 1.0, offsets)]
    pieces = [mx.concatenate([native.silu_mul(gate[i:i + 8], up[i:i + 8])
                              for i in range(0, 96, 8)]),
              mx.concatenate([native.rms_norm(x[i:i + 50], w, 1e-5) for i in range(0, 300, 50)]),
              mx.concatenate([native.rope(q[i:i + 50], 64, False, inv, 1.0, offsets[i:i + 50])
                              for i in range(0, 300, 50)])]
    for name, a, b in zip(("silu_mul", "rms_norm", "rope"), whole, pieces, strict=True):
        assert np.array_equal(np.array(a), np.array(b)), name
