"""The paged GPU attention (kv/gpu/paged.py): host-side tiles, routing, dispatch, and
the kernel body's Metal dialect through the CPU emulation, against the pure-MLX reference.

The kernel itself runs only on a GPU backend (its CUDA dialect is checked on the H200 by
``benchmarks/cuda.py decode`` on the same grid, :mod:`gpu_attention_grid`). Here:

* the tile builder against a plain loop (exact);
* the step plan (which rows the kernel takes, which chunks MLX's SDPA takes over their fresh
  keys, the output segments) and the whole Python path of :func:`paged_gpu_attention` with the
  launch replaced by a numpy model of the kernel's contract that reads only what the kernel
  reads (tables, tiles, the pool), on the grid;
* the launch parameters within the register and shared-memory budgets;
* the Metal dialect of the body, assembled as ``mx.fast.metal_kernel`` assembles it, compiled
  with clang against the Metal shim and run on the CPU emulation of its thread model, on the
  grid (max abs error 1e-5 fp32, 2e-2 bf16).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import metal_emulation as emu
import mlx.core as mx
import numpy as np
import pytest
from conftest import cover_each_value
from gpu_attention_grid import (
    BLOCK_SIZES,
    GROUPS,
    HEAD_SIZES,
    KINDS,
    ROUTES,
    TOLERANCE,
    WINDOWS,
    build,
    grid,
    max_error,
    option_grid,
)

from vllm_unified import gpu_dialect
from vllm_unified.kv.attention import dispatch as paged
from vllm_unified.kv.attention.metadata import build_attention_metadata, build_tiles
from vllm_unified.kv.gpu import paged as gpu_paged


def _tiles_by_loop(starts, seq_lens, include, rows):
    tiles = []
    for seq in range(len(seq_lens)):
        n = starts[seq + 1] - starts[seq]
        if not include[seq]:
            continue
        for k in range(0, n, rows):
            count = min(rows, n - k)
            tiles.append((starts[seq] + k, count, seq, seq_lens[seq] - n + k + count))
    tiles.sort(key=lambda t: -t[3])  # stable: ties keep row order
    return np.array(tiles, np.int32).reshape(-1, 4)


def test_build_tiles_matches_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        b = int(rng.integers(1, 9))
        qlens = rng.integers(0, 40, b)
        qlens[rng.random(b) < 0.4] = 1
        slens = qlens + rng.integers(0, 300, b)
        starts = np.concatenate([[0], np.cumsum(qlens)])
        include = rng.random(b) < 0.8
        rows = int(rng.integers(1, 17))
        got = build_tiles(starts, slens, include, rows)
        want = _tiles_by_loop(starts, slens, include, rows)
        assert got.dtype == np.int32 and got.shape == want.shape
        assert np.array_equal(got, want)
        # Every included row in exactly one tile.
        covered = np.zeros(starts[-1], int)
        for row0, n, _, _ in got:
            covered[row0:row0 + n] += 1
        rows_in = np.repeat(include, qlens)
        assert np.array_equal(covered, rows_in.astype(int))


def test_build_tiles_rejects_bad_input():
    with pytest.raises(ValueError, match="rows per tile"):
        build_tiles(np.array([0, 2]), np.array([2]), np.array([True]), 0)
    with pytest.raises(ValueError, match="same sequences"):
        build_tiles(np.array([0, 2]), np.array([2, 3]), np.array([True, True]), 4)
    assert build_tiles(np.array([0, 0]), np.array([5]), np.array([True]), 4).shape == (0, 4)


def test_gpu_plan_routes_chunks_and_keeps_token_order():
    # decode, chunk after context, decode, fresh chunk, fresh chunk, decode, long chunk after
    # context
    qlens, slens = [1, 6, 1, 9, 3, 1, 20], [30, 20, 5, 9, 3, 12, 60]
    tables = np.arange(7 * 8, dtype=np.int32).reshape(7, 8)
    meta = build_attention_metadata(qlens, slens, tables, 8)
    plan = meta.gpu_plan(4, True, 16)
    # prefills: 0 (6 of 20), 1 (9 of 9), 2 (3 of 3), 3 (20 of 60, longer than 16)
    assert plan.sdpa == (1, 2, 3)
    assert plan.segments == ((0, 8, None), (8, 17, 1), (17, 20, 2), (20, 21, None),
                             (21, 41, 3))
    tiles = np.array(plan.tiles)
    assert np.array_equal(np.array(plan.tables), tables)
    assert np.array_equal(tiles, build_tiles(meta.query_start_loc, slens,
                                             np.array([1, 1, 1, 0, 0, 1, 0], bool), 4))
    assert sorted(int(r) for t in tiles for r in range(t[0], t[0] + t[1])) == \
        [0, 1, 2, 3, 4, 5, 6, 7, 20]
    assert meta.gpu_plan(4, True, 16) is plan  # made once per step
    every = meta.gpu_plan(4, False, 1 << 30)
    assert every.sdpa == () and every.segments == ((0, 41, None),)
    assert int(np.array(every.tiles)[:, 1].sum()) == 41
    # Without fresh keys, only chunks longer than max_chunk leave the kernel (fresh or not).
    assert meta.gpu_plan(4, False, 8).sdpa == (1, 3)
    one = build_attention_metadata([5], [5], tables[:1], 8).gpu_plan(4, True, 16)
    assert one.tiles is None and one.tables is None and one.segments == ((0, 5, 0),)


def test_fresh_mask_follows_the_window_convention():
    meta = build_attention_metadata([6], [6], np.zeros((1, 1), np.int32), 8)
    assert meta.fresh_mask(0, None) == "causal" and meta.fresh_mask(0, 6) == "causal"
    mask = np.array(meta.fresh_mask(0, 2))
    i, j = np.indices((6, 6))
    assert np.array_equal(mask, (j <= i) & (j > i - 2))


def _launch_model(dialect, queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                  decode, prologue=None, after=None, softcap=None, sinks=None):
    """The kernel's contract in numpy, from what the kernel reads (tables, tiles, the pool):
    rows no tile covers come out NaN, so an assembly that used them would show. (The query
    prologue is tests/test_qk_prologue.py's.)"""
    assert dialect in ("cuda", "metal") and prologue is None
    q = np.array(queries.astype(mx.float32)).astype(np.float64)
    pool = np.array(kv_pool.astype(mx.float32)).astype(np.float64)
    tb, tl = np.array(tables), np.array(tiles)
    if decode:
        assert rows == 1 and tl.ndim == 1 and len(tl) == q.shape[0]
        n = len(tl)
        tl = np.stack([np.arange(n), np.ones(n, int), np.arange(n), tl], axis=1)
    tokens, heads, _, dim = q.shape
    kv_heads = pool.shape[1]
    kh = np.arange(heads) // (heads // kv_heads)
    out = np.full(q.shape, np.nan)
    covered = []
    for row0, count, seq, last in tl:
        assert count <= rows, f"tile of {count} rows over the limit {rows}"
        covered += range(row0, row0 + count)
        for r in range(count):
            length = last - count + 1 + r
            first = max(length - window, 0) if window else 0
            pos = np.arange(first, length)
            slots = tb[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
            k, v = pool[slots][:, kh, :dim], pool[slots][:, kh, dim:]  # [S, H, D]
            s = np.einsum("hd,shd->hs", q[row0 + r, :, 0], k) * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            m = s.max(-1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, np.array(sinks, np.float64)[:, None])
            p = np.exp(s - m)
            total = p.sum(-1, keepdims=True)
            if sinks is not None:
                total += np.exp(np.array(sinks, np.float64)[:, None] - m)
            out[row0 + r, :, 0] = np.einsum("hs,shd->hd", p / total, v)
    assert sorted(covered) == sorted(set(covered)), "a row in two tiles"
    return mx.array(out.astype(np.float32)).astype(queries.dtype)


@pytest.mark.parametrize("case", grid(("float32",)) + option_grid(("float32",)),
                         ids=lambda c: c.name)
def test_routing_and_assembly_match_the_reference(case, monkeypatch):
    """paged_gpu_attention's own work (tiles, plan, fresh chunks through MLX's SDPA, the
    output in token order) with the launch modelled: the reference's function."""
    monkeypatch.setattr(gpu_paged, "launch", _launch_model)
    for route in ROUTES:
        c = replace(case, route=route)
        assert max_error(c, _attend("metal")) <= 1e-5, c.name


def _attend(dialect):
    def attend(q, pool, meta, scale, window, fresh, max_chunk, **options):
        return gpu_paged.paged_gpu_attention(dialect, q, pool, meta, scale, window, fresh,
                                             max_chunk, **options)
    return attend


def test_dispatch_by_the_profile(monkeypatch):
    """paged_attention_kv hands every row to the GPU kernel of the profile's dialect where it
    takes the head size, and to the reference elsewhere."""
    calls = []

    def launch(*args):
        calls.append((args[0], args[9]))
        return _launch_model(*args)

    monkeypatch.setattr(gpu_paged, "launch", launch)
    case = grid(("float32",))[2]  # a mixed step on the split route
    b = build(case)
    profile = type("P", (), {"cpu_attention": False, "gpu_attention": "metal"})()
    got = paged.paged_attention_kv(b.queries, b.pool, b.meta, b.scale, case.window,
                                   backend=profile, fresh=b.fresh)
    assert calls == [("metal", False)]
    np.testing.assert_allclose(np.array(got), b.reference, atol=1e-5)
    assert paged.gpu_attention_routed(case.dim, profile)
    assert not paged.gpu_attention_routed(48, profile)  # not a multiple of 32
    assert not paged.gpu_attention_routed(96, profile)  # 3 channels a lane: no aligned vector
    profile.gpu_attention = None
    assert not paged.gpu_attention_routed(case.dim, profile)
    got = paged.paged_attention_kv(b.queries, b.pool, b.meta, b.scale, case.window,
                                   backend=profile, fresh=b.fresh)
    assert len(calls) == 1
    np.testing.assert_allclose(np.array(got), b.reference, atol=1e-5)


def test_unsupported_head_size_is_refused():
    meta = build_attention_metadata([1], [3], np.zeros((1, 1), np.int32), 4)
    with pytest.raises(ValueError, match="head sizes \\(32, 64, 128, 256\\), not 48"):
        gpu_paged.paged_gpu_attention("cuda", mx.zeros((1, 2, 1, 48)), mx.zeros((4, 1, 96)),
                                      meta, 1.0, None)


@pytest.mark.parametrize("group,dim", list(itertools.product(range(1, 9), HEAD_SIZES)))
def test_launch_parameters_stay_within_budgets(group, dim):
    rows = gpu_paged.q_tile(group, dim)
    vectors = 2 * group * dim // 32  # a lane's fp32 query + accumulator floats per row
    # the largest tile within 64 lane floats (one row when even one does not fit), capped
    assert rows == max(1, min(gpu_paged.MAX_Q_TILE, 64 // vectors)), (rows, vectors)
    for r in (1, rows):
        warps = gpu_paged.warps_per_group(group, dim, r)
        assert warps in (16, 8, 4, 2, 1)
        assert warps * 4 * (dim + 2 * r * group) <= gpu_paged.SHARED_BYTES
        # maximal: twice the warps would break the shared-memory or register budget
        qg, epl = r * group, dim // 32
        assert warps == gpu_paged.MAX_WARPS or (
            2 * warps * 4 * (dim + 2 * qg) > gpu_paged.SHARED_BYTES
            or 2 * warps * 32 * (2 * qg * epl + 4 * qg + 2 * epl + 40) > 65536), (r, warps)
    # The decode shape of the benchmarked model keeps the full group (16 warps, as before).
    assert gpu_paged.warps_per_group(2, 128, 1) == 16


def test_grid_covers_every_pair():
    cases = grid()
    for dtype in ("float32", "bfloat16"):
        sub = [c for c in cases if c.dtype == dtype]
        assert {(c.group, c.dim) for c in sub} == set(itertools.product(GROUPS, HEAD_SIZES))
        assert {(c.kind, c.window) for c in sub} == set(itertools.product(KINDS, WINDOWS))
        assert {(c.kind, c.block_size) for c in sub} == \
            set(itertools.product(KINDS, BLOCK_SIZES))
        assert {c.kv_heads for c in sub} == {1, 2}
        assert {(c.kind, c.route) for c in sub} == set(itertools.product(KINDS, ROUTES))
    assert TOLERANCE["float32"] == 1e-5 and TOLERANCE["bfloat16"] == 2e-2


def _emulated_launch(dialect, queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                     decode, prologue=None, after=None, softcap=None, sinks=None):
    """gpu_paged.launch with the Metal instance run by the CPU emulation: the same inputs,
    template, grid and threadgroup, the source assembled as mx.fast.metal_kernel assembles it
    (its output rows no tile covers start as NaN)."""
    assert dialect == "metal"
    assert prologue is None
    a = gpu_paged.launch_args(queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                              decode, softcap=softcap, sinks=sinks)
    _, source = gpu_dialect.assemble_metal(
        gpu_paged.KERNEL_NAME, gpu_paged.INPUT_NAMES, gpu_paged.OUTPUT_NAMES,
        gpu_paged.kernel_source(False), a.inputs, a.template, output_dtypes=a.output_dtypes,
        header=gpu_paged.HEADER)
    _, outputs = emu.run(source, a.inputs, a.output_shapes, a.output_dtypes, a.grid,
                         a.threadgroup)
    return mx.array(outputs[0]).astype(queries.dtype)


@pytest.mark.skipif(emu.clang() is None,
                    reason="clang++ is not installed (the Metal emulation compiles kernels "
                           "with it; scripts/setup.sh installs clang on Debian/Ubuntu)")
@pytest.mark.parametrize("case", cover_each_value(grid()))
def test_metal_dialect_matches_the_reference_on_the_grid(case, monkeypatch):
    """The Metal instance of the kernel body, emulated, through the whole
    paged_gpu_attention path: max abs error 1e-5 (fp32), 2e-2 (bf16) against the reference."""
    monkeypatch.setattr(gpu_paged, "launch", _emulated_launch)
    err = max_error(case, _attend("metal"))
    assert err <= TOLERANCE[case.dtype], f"{case.name}: max abs error {err}"


@pytest.mark.skipif(emu.clang() is None, reason="clang++ is not installed")
@pytest.mark.parametrize("case", cover_each_value(option_grid()))
def test_metal_dialect_with_softcap_and_sinks_matches_the_reference(case, monkeypatch):
    """The Metal instance with the SOFTCAP and SINKS options, emulated, through the whole
    paged_gpu_attention path (the chunks left to MLX's SDPA take the options too), on the
    option grid: decode, prefill and mixed steps, each options pair."""
    monkeypatch.setattr(gpu_paged, "launch", _emulated_launch)
    err = max_error(case, _attend("metal"))
    assert err <= TOLERANCE[case.dtype], f"{case.name}: max abs error {err}"


@pytest.mark.skipif(emu.clang() is None, reason="clang++ is not installed")
@pytest.mark.parametrize("change", [
    ("s[g] = cap * uni_tanh(s[g] / cap);", "s[g] = s[g];"),  # the cap ignored
    ("float ll = SINKS ? uni_exp(sink - mm) : 0.f;", "float ll = 0.f;"),  # the sink dropped
], ids=["softcap", "sinks"])
def test_a_kernel_without_the_options_fails_the_check(change, monkeypatch):
    """The option grid catches a kernel that ignores an option (the check can fail)."""
    case = next(c for c in option_grid(("float32",)) if c.kind == "decode"
                and (c.softcap is not None if change[0].startswith("s[g]") else c.sinks))
    assert change[0] in gpu_paged.SOURCE
    monkeypatch.setattr(gpu_paged, "SOURCE", gpu_paged.SOURCE.replace(*change))
    monkeypatch.setattr(gpu_paged, "launch", _emulated_launch)
    err = max_error(case, _attend("metal"))
    assert not err <= TOLERANCE[case.dtype], err
