"""The compiled pure-decode forward (worker/compiled_decode.py) gives the plain forward's logits.

The CUDA kernels it is built for (in-place KV write, the paged GPU attention) do not exist on
MLX's CPU backend, so here they are stood in for by pure-MLX functions with the same interface
and the same inputs (the attention's stand-in replaces the kernel launch of
kv/gpu/paged.py in its decode form and reads the pool only through the device-side
block tables and lengths, as the kernel does). The stand-ins are first checked against the
reference paged attention, then the compiled forward against the plain one over several decode
steps of changing positions, slots, lengths, batch sizes and token sources (tokens fed from
earlier steps on the device, as under async scheduling): a value captured as a constant while
tracing would make a later step differ.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3

from vllm_unified import bridge
from vllm_unified.kv import pool as kv_pool
from vllm_unified.kv.attention import dispatch as paged
from vllm_unified.kv.attention import qk_prologue
from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.gpu import paged as gpu_paged
from vllm_unified.kv.layer_cache import PagedLayerCache
from vllm_unified.kv.pool import KVPool
from vllm_unified.models.cpu_kernels import install_cpu_kernels
from vllm_unified.models.decode_attention import install_fused_decode_attention
from vllm_unified.models.fused_projections import fuse_projections
from vllm_unified.models.routing import install_paged_attention
from vllm_unified.worker.async_output import feed_pending
from vllm_unified.worker.compiled_decode import CompiledDecode, padded_tables
from vllm_unified.worker.forward import forward

BS, LAYERS, KV_HEADS, DIM, BLOCKS = 8, 3, 2, 32, 40


def _write_qk_stand_in(pool, slots, keys, values, positions, prologue, *, dialect,
                       tokens=None):
    """Functional stand-in of gpu_write.write_kv_qk_gpu: the reference prologue, then the
    write."""
    keys = qk_prologue.reference(keys.reshape(keys.shape[0], KV_HEADS, DIM), prologue, 1,
                                 positions).astype(pool.dtype)
    return _write_stand_in(pool, slots, keys, values, dialect=dialect)


def _write_stand_in(pool, slots, keys, values, *, dialect, tokens=None):
    """Functional stand-in of gpu_write.write_kv_gpu (a scatter of the K|V cells)."""
    assert dialect == "cuda"
    cells = mx.concatenate([keys.reshape(keys.shape[0], KV_HEADS, DIM),
                            values.reshape(values.shape[0], KV_HEADS, DIM)], axis=-1)
    out = mx.array(pool)
    out[slots] = cells
    return out


def _decode_stand_in(dialect, queries, kv_pool, tables, lens, scale, window, block_size, rows,
                     decode, prologue=None, after=None):
    """gpu_paged.launch's function in its decode form, from the device-side tables and
    lengths only (every key slot of the table, masked by length and window); with a
    prologue, the raw queries go through the reference prologue at position ``len - 1``."""
    assert decode and rows == 1, "a pure-decode step launches the decode form"
    if prologue is not None:
        queries = qk_prologue.reference(queries, prologue, 0, lens - 1).astype(queries.dtype)
    pos = mx.arange(tables.shape[1] * block_size)
    slots = tables[:, pos // block_size] * block_size + pos % block_size
    cells = kv_pool[slots].transpose(0, 2, 1, 3)  # [T, Hkv, S, 2D]
    mask = pos[None] < lens[:, None]
    if window is not None:
        mask = mask & (pos[None] >= lens[:, None] - window)
    return mx.fast.scaled_dot_product_attention(
        queries, cells[..., :DIM], cells[..., DIM:], scale=scale, mask=mask[:, None, None, :])


@pytest.fixture
def model():
    mx.random.seed(0)
    args = qwen3.ModelArgs.from_dict(dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=DIM, vocab_size=300,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True))
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    install_paged_attention(m)
    return m


def _filled_pool(seed: int, write: str | None = None) -> KVPool:
    pool = KVPool.allocate_mlx(LAYERS, BLOCKS, BS, KV_HEADS, DIM, mx.float32, write=write)
    rng = np.random.default_rng(seed)
    pool.kv = [mx.array(rng.standard_normal(a.shape).astype(np.float32)) for a in pool.kv]
    return pool


def _steps():
    """(seq_lens after the step, block tables) of consecutive decode steps: the batch grows,
    shrinks and comes back, contexts cross block boundaries."""
    tables = np.array([[1, 2, 3, 4, 0], [5, 6, 7, 0, 0], [8, 9, 10, 11, 12]], np.int32)
    lens = np.array([7, 15, 30])
    out = []
    for step in range(6):
        n = 2 if step in (2, 3) else 3
        # From step 3 on the runner's tables are a column wider (a longer context somewhere).
        wide = np.pad(tables, ((0, 0), (0, 1))) if step >= 3 else tables
        out.append((lens[:n] + step, wide[:n]))
    return out


def _run(model, pool, steps, compiled: CompiledDecode | None):
    """Decode steps fed as under async scheduling: after the first step (all tokens known on
    the host), most rows take an earlier step's sampled token from the device (from the
    previous step's; in step 4, from two different steps), one row a token known on the
    host."""
    caches = [PagedLayerCache(pool, i) for i in range(LAYERS)]
    logits = []
    rng = np.random.default_rng(7)
    history = [mx.array(rng.integers(0, 300, 3).astype(np.int32))]
    for k, (seq_lens, tables) in enumerate(steps):
        n = len(seq_lens)
        meta = build_attention_metadata([1] * n, seq_lens, tables, BS)
        assert meta.is_pure_decode
        host_ids = rng.integers(0, 300, n).astype(np.int32)
        pending = [(r, (history[-1], (r + k) % history[-1].size)) for r in range(n) if r != 1]
        if k == 0:
            pending = []  # every token known on the host
        if k == 4:
            pending[0] = (0, (history[-3], 1))
        host_ids[[r for r, _ in pending]] = 0  # placeholders, as InputBatch.layout leaves them
        rows = np.arange(n, dtype=np.int32)[::-1].copy()  # any row order
        if compiled is not None:
            out = compiled(meta, host_ids, pending, rows)
        else:
            with set_step_context(StepContext(attn=meta)):
                out = forward(model, caches, feed_pending(mx.array(host_ids), pending), rows)
        history.append(mx.argmax(out, axis=-1).astype(mx.int32))
        mx.eval(out, history[-1], pool.arrays())
        logits.append(np.array(out))
    return logits


def _plain_with_stand_ins(model, steps, monkeypatch):
    """The CUDA kernels replaced by their stand-ins; the plain forward's pool and logits."""
    monkeypatch.setattr(kv_pool, "write_kv_gpu", _write_stand_in)
    monkeypatch.setattr(kv_pool, "write_kv_qk_gpu", _write_qk_stand_in)
    monkeypatch.setattr(gpu_paged, "launch", _decode_stand_in)
    monkeypatch.setattr(paged, "_gpu_kernel",
                        lambda d, b: functools.partial(gpu_paged.paged_gpu_attention, "cuda"))
    pool = _filled_pool(1)
    pool.cuda_write = True
    return pool, _run(model, pool, steps, None)


def test_compiled_decode_matches_the_plain_forward(model, monkeypatch):
    steps = _steps()
    monkeypatch.setattr(paged, "_cpu_rows_kernel", lambda b: False)  # the CUDA route's shape
    want = _run(model, _filled_pool(1), steps, None)  # the reference route (gather + SDPA)

    plain_pool, plain = _plain_with_stand_ins(model, steps, monkeypatch)
    for a, b in zip(want, plain, strict=True):  # the stand-ins compute the reference's values
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)

    pool = _filled_pool(1)
    pool.cuda_write = True
    compiled = CompiledDecode(model, pool, [PagedLayerCache(pool, i) for i in range(LAYERS)],
                              forward)
    got = _run(model, pool, steps, compiled)
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    # One trace per batch size, replayed otherwise: the token source (host, an earlier step's
    # tokens of any count, ids assembled from two steps) and the tables' width (5 or 6
    # columns, both padded to 8) do not change the compiled graph's inputs.
    assert compiled.traces == [3, 2]
    for a, b in zip(plain_pool.kv, pool.kv, strict=True):  # the same K/V were written
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-5)


def test_compiled_decode_with_the_qk_prologue_matches_the_plain_forward(model, monkeypatch):
    """The attention classes swapped for the fused decode path (models/decode_attention.py):
    compiled, the q/k norms and RoPE go to the write and attention kernels (stand-ins that
    apply the reference prologue) and the steps give the plain forward's logits and K/V."""
    steps = _steps()
    monkeypatch.setattr(paged, "_cpu_rows_kernel", lambda b: False)
    plain_pool, plain = _plain_with_stand_ins(model, steps, monkeypatch)

    assert install_fused_decode_attention(model, DIM) == LAYERS
    calls = []
    monkeypatch.setattr(kv_pool, "write_kv_qk_gpu",
                        lambda *a, **k: calls.append(1) or _write_qk_stand_in(*a, **k))
    pool = _filled_pool(1)
    pool.cuda_write = True
    compiled = CompiledDecode(model, pool, [PagedLayerCache(pool, i) for i in range(LAYERS)],
                              forward)
    got = _run(model, pool, steps, compiled)
    assert len(calls) == LAYERS * len(compiled.traces)  # traced once per batch size
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    for a, b in zip(plain_pool.kv, pool.kv, strict=True):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-5)


def test_compiled_decode_refuses_the_host_table_route(model, monkeypatch):
    """Inside a trace the gather reference would capture this step's key rows as constants:
    it raises instead."""
    monkeypatch.setattr(paged, "_cpu_rows_kernel", lambda b: False)  # the gather, not a kernel
    pool = _filled_pool(2)
    compiled = CompiledDecode(model, pool, [PagedLayerCache(pool, i) for i in range(LAYERS)],
                              forward)
    seq_lens, tables = _steps()[0]
    meta = build_attention_metadata([1] * 3, seq_lens, tables, BS)
    with pytest.raises(ValueError, match="compiled step"):
        compiled(meta, np.array([1, 2, 3], np.int32), [], np.arange(3, dtype=np.int32))


def test_tables_padded_to_a_power_of_two_columns():
    tables = np.arange(1, 16, dtype=np.int32).reshape(3, 5)
    out = padded_tables(tables)
    assert out.shape == (3, 8) and out.dtype == np.int32
    assert np.array_equal(out[:, :5], tables) and not out[:, 5:].any()
    assert [padded_tables(np.ones((2, c), np.int32)).shape[1] for c in (1, 2, 3, 8, 9, 33)] == \
        [1, 2, 4, 8, 16, 64]


@pytest.mark.skipif(bridge.native_kernels() is None,
                    reason="the native CPU kernels are not built (bridge.native_error)")
@pytest.mark.parametrize("quantize", [False, True], ids=["fp32", "4bit"])
def test_compiled_decode_on_the_cpu_kernels_matches_the_plain_forward(model, quantize):
    """MLX's CPU backend: the native KV write and attention kernel take a compiled step's
    decode tables and lengths (traced inputs; decode row r is sequence r), the linears are
    the native kernels with q/k/v and gate/up fused for one-row inputs, as the runner sets a
    CPU model up. Compiled and plain steps give the same logits and K/V, bit for bit."""
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    assert install_cpu_kernels(model)
    assert fuse_projections(model, max_rows=1) == {"qkv_proj": LAYERS, "gate_up_proj": LAYERS}
    steps = _steps()
    plain_pool = _filled_pool(3, write="native_rows")
    plain = _run(model, plain_pool, steps, None)
    pool = _filled_pool(3, write="native_rows")
    compiled = CompiledDecode(model, pool, [PagedLayerCache(pool, i) for i in range(LAYERS)],
                              forward)
    got = _run(model, pool, steps, compiled)
    assert compiled.traces == [3, 2]
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_array_equal(b, a)
    for a, b in zip(plain_pool.kv, pool.kv, strict=True):
        np.testing.assert_array_equal(np.array(b), np.array(a))
