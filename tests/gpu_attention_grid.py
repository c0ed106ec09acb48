"""The shape grid every dialect of the paged GPU attention kernel is checked on.

Used by ``tests/test_gpu_attention.py`` (the Metal dialect through the CPU emulation) and by
``benchmarks/cuda.py decode`` (the CUDA dialect on the H200; ``benchmarks/cuda_h200.sh pack``
copies this file next to it), so both check the same cases against the same oracle: the
pure-MLX reference ``reference.paged_attention_kv`` evaluated in fp32 over the
same (dtype-rounded) queries and pool.

A case is one step: decode rows only, prefill chunks only (one with no context before it, one
after cached context, one of a length no tile size divides) or a mix with the decode rows not
first; ragged lengths from 1 up, crossing block boundaries; GQA groups of 1, 2, 4 and 8
query heads over 1 or 2 KV heads; head sizes 64, 128, 256; blocks of 16, 32, 64 tokens,
handed out from a pool twice the size needed in random order (block tables with holes,
non-consecutive, out of order; padding columns point at unowned blocks); no window, a window
cutting into tiles, a window longer than some contexts. Every slot no sequence owns is NaN,
so a read outside a row's keys shows in the output. The grid is a covering design, not the
full product (each kernel instance costs a compile on the GPU and an emulation on the CPU):
:func:`grid` covers every pair of (step kind, window), (step kind, block size), (group, head
size) and every single factor in both dtypes (``test_grid_covers_every_pair`` checks it).
:func:`option_grid` adds the attention options (logit soft-capping, sinks) on each step kind.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

HEAD_SIZES = (64, 128, 256)
GROUPS = (1, 2, 4, 8)
BLOCK_SIZES = (16, 32, 64)
WINDOWS = (None, 16, 61)
KINDS = ("decode", "prefill", "mixed")

#: (query lengths, context lengths after the step) of each step kind. Prefill: chunks with no
#: context before them (37 of 37, 70 of 70), after cached context (20 of 90, and 9 of 50:
#: short enough for the kernel on the split route). Mixed: decode rows around chunks (23 of 70
#: and 12 of 80 after context, 40 of 40 and 5 of 5 fresh), a decode row at position 0.
STEPS = {
    "decode": ([1, 1, 1, 1, 1], [1, 17, 65, 100, 150]),
    "prefill": ([37, 20, 70, 9], [37, 90, 70, 50]),
    "mixed": ([1, 23, 1, 40, 1, 5, 12], [60, 70, 1, 40, 129, 5, 80]),
}
ROUTES = ("kernel", "split")
#: ``max_chunk`` of the kernel route: every row to the kernel
EVERY_ROW = 1 << 30

#: Largest absolute error allowed against the reference, per dtype.
TOLERANCE = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Case:
    """One step of the grid.

    Attributes:
        kind: ``"decode"``, ``"prefill"`` or ``"mixed"`` (:data:`STEPS`).
        dim: head size.
        group: query heads per KV head.
        kv_heads: KV heads.
        block_size: tokens per block.
        window: sliding window or None.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        route: ``"kernel"``: every row to the kernel (no fresh keys, no chunk length limit);
            ``"split"``: the production routing (fresh keys given: chunks with no context
            before them to MLX's SDPA over them, chunks after context longer than
            ``gpu_paged.MAX_KERNEL_CHUNK`` to SDPA over gathered keys, the rest to the kernel).
        seed: random data seed.
        softcap: attention logit soft-capping, or None.
        sinks: with attention sinks (random ``[H]`` logits of twice the scores' spread).
    """

    kind: str
    dim: int
    group: int
    kv_heads: int
    block_size: int
    window: int | None
    dtype: str
    route: str
    seed: int
    softcap: float | None = None
    sinks: bool = False

    @property
    def name(self) -> str:
        return (f"{self.kind}-D{self.dim}-G{self.group}x{self.kv_heads}-bs{self.block_size}-"
                f"w{self.window or 0}-{self.dtype}-{self.route}{option_name(self)}")


def option_name(case) -> str:
    """The name suffix of a case's attention options ("" without them)."""
    return ((f"-cap{case.softcap:g}" if case.softcap is not None else "")
            + ("-sinks" if case.sinks else ""))


#: (softcap, sinks) of :func:`option_grid`'s cases, rotating
OPTIONS = ((1.0, False), (None, True), (0.7, True))


def option_grid(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[Case]:
    """Steps with attention options: every (step kind, options) pair of :data:`OPTIONS`
    once per dtype, head size, group, window, block size and route rotating."""
    cases = []
    i = 0
    for dtype in dtypes:
        for k, kind in enumerate(KINDS):
            for o, (softcap, sinks) in enumerate(OPTIONS):
                cases.append(Case(
                    kind=kind, dim=HEAD_SIZES[(i + k) % 3], group=GROUPS[(i + o) % 4],
                    kv_heads=1 + i % 2, block_size=BLOCK_SIZES[(i // 2) % 3],
                    window=WINDOWS[(i + o) % 3], dtype=dtype, route=ROUTES[(i + k) % 2],
                    seed=500 + i, softcap=softcap, sinks=sinks))
                i += 1
    return cases


def options_of(case, heads: int, rng: np.random.Generator) -> dict:
    """The ``softcap`` / ``sinks`` keyword arguments of a case (none without options); the
    sinks drawn from ``rng`` after the case's other data."""
    out: dict = {}
    if case.softcap is not None:
        out["softcap"] = case.softcap
    if case.sinks:
        out["sinks"] = mx.array((2 * rng.standard_normal(heads)).astype(np.float32))
    return out


def grid(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[Case]:
    """The covering grid, per dtype: every (group, head size, step kind) triple once, with
    block size, window, KV heads and route rotating so that every (kind, window), (kind,
    block size) and (kind, route) pair appears (decode steps take the kernel either way)."""
    cases = []
    i = 0
    for dtype in dtypes:
        for dim in HEAD_SIZES:
            for group in GROUPS:
                for k, kind in enumerate(KINDS):
                    cases.append(Case(
                        kind=kind, dim=dim, group=group, kv_heads=1 + (i // 3) % 2,
                        block_size=BLOCK_SIZES[(i // 3 + k) % 3],
                        window=WINDOWS[(i // 9 + k) % 3], dtype=dtype,
                        route=ROUTES[(i // 3) % 2], seed=i))
                    i += 1
    return cases


@dataclass
class Built:
    """A case's inputs (in its dtype) and the reference output (fp32 numpy)."""

    queries: mx.array
    pool: mx.array
    meta: object
    scale: float
    fresh: tuple[mx.array, mx.array] | None
    max_chunk: int | None
    reference: np.ndarray
    options: dict = field(default_factory=dict)


def build(case: Case) -> Built:
    """The case's queries ``[T, H, 1, D]``, pool ``[slots, Hkv, 2D]`` (unowned slots NaN), step
    metadata, fresh keys/values (the rows' own cells of the pool) and the reference output."""
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.attention.reference import paged_attention_kv

    rng = np.random.default_rng(case.seed)
    qlens, slens = STEPS[case.kind]
    bs = case.block_size
    need = [-(-s // bs) for s in slens]
    num_blocks = 2 * sum(need) + 3
    ids = rng.permutation(num_blocks)
    owned_ids = ids[: sum(need)]
    spare = ids[sum(need):]  # never owned: NaN blocks
    tables = np.empty((len(slens), max(need) + 2), np.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = owned_ids[used:used + n]
        tables[i, n:] = spare[i % len(spare)]
        used += n
    heads, dim = case.group * case.kv_heads, case.dim
    pool = rng.standard_normal((num_blocks * bs, case.kv_heads, 2 * dim)).astype(np.float32)
    owned = np.zeros(num_blocks * bs, bool)
    for i, s in enumerate(slens):
        pos = np.arange(s)
        owned[tables[i, pos // bs].astype(np.int64) * bs + pos % bs] = True
    pool[~owned] = np.nan
    tokens = sum(qlens)
    queries = rng.standard_normal((tokens, heads, 1, dim)).astype(np.float32)
    dtype = getattr(mx, case.dtype)
    q = mx.array(queries).astype(dtype)
    kv = mx.array(pool).astype(dtype)
    meta = build_attention_metadata(qlens, slens, tables, bs)
    scale = dim ** -0.5
    fresh = None
    if case.route == "split":
        cells = kv[mx.array(meta.host_slot_mapping)][:, :, None]  # [T, Hkv, 1, 2D]
        fresh = (cells[..., :dim], cells[..., dim:])
    ref_meta = build_attention_metadata(qlens, slens, tables, bs)
    options = options_of(case, heads, rng)
    # On MLX's CPU device on every machine: exact fp32 (MLX's CUDA backend computes fp32
    # matmuls in TF32 by default).
    with mx.stream(mx.cpu):
        reference = np.array(paged_attention_kv(
            q.astype(mx.float32), kv.astype(mx.float32), ref_meta, scale, case.window,
            **options))
    max_chunk = EVERY_ROW if case.route == "kernel" else None
    return Built(q, kv, meta, scale, fresh, max_chunk, reference, options)


Attend = Callable[[mx.array, mx.array, object, float, object, object, object], mx.array]


def max_error(case: Case, attend: Attend) -> float:
    """Largest absolute difference between ``attend(queries, pool, meta, scale, window,
    fresh, max_chunk, **options)`` (the arguments of ``gpu_paged.paged_gpu_attention`` after
    the dialect; ``options``: ``softcap`` / ``sinks`` for a case that has them) and the
    reference on ``case`` (NaN when the output is not finite)."""
    b = build(case)
    got = np.array(attend(b.queries, b.pool, b.meta, b.scale, case.window, b.fresh,
                          b.max_chunk, **b.options).astype(mx.float32))
    if got.shape != b.reference.shape:
        raise AssertionError(f"{case.name}: output {got.shape} != {b.reference.shape}")
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.abs(got - b.reference).max())


# --- the q/k prologue (kv/attention/qk_prologue.py) --------------------------------------------

#: (rope, norm) of the prologue cases, rotating: pairs (i, i + D/2) or (2i, 2i + 1), with and
#: without the per-head norm
PROLOGUES = ((1, True), (2, False), (2, True), (1, False))
#: Largest error of a prologue write against the reference, per dtype: ``(rtol, atol)`` (the
#: stored key is rounded once; kernel and reference may round one ulp apart)
WRITE_TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (2**-10, 1e-3),
                   "bfloat16": (2**-7, 1e-2)}


def make_prologue(dim: int, rope: int, norm: bool, seed: int):
    """A prologue with random norm weights (around 1), RoPE base 10,000 and position scale
    1 or 0.5."""
    from vllm_unified.kv.attention.qk_prologue import QKPrologue

    rng = np.random.default_rng(seed)
    inv = (10000.0 ** (-np.arange(dim // 2) / (dim // 2))).astype(np.float32)
    weights = None
    if norm:
        weights = (1 + 0.2 * rng.standard_normal(dim), 1 + 0.2 * rng.standard_normal(dim), 1e-6)
    return QKPrologue.build(dim, inv, 0.5 if seed % 2 else 1.0, rope == 2, weights)


def prologue_grid(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[tuple[Case, int,
                                                                                  bool]]:
    """The grid's decode steps (every head size and group), each with a prologue
    ``(case, rope, norm)`` from :data:`PROLOGUES` in turn."""
    cases = [c for c in grid(dtypes) if c.kind == "decode"]
    return [(c, *PROLOGUES[i % len(PROLOGUES)]) for i, c in enumerate(cases)]


def prologue_max_error(case: Case, rope: int, norm: bool, attend: Callable) -> float:
    """Largest absolute difference between ``attend(raw queries, pool, meta, scale, window,
    prologue)`` and the reference attention over the reference prologue's queries (fp32,
    positions ``len - 1``) on a decode ``case``; NaN when the output is not finite."""
    from vllm_unified.kv.attention.qk_prologue import reference
    from vllm_unified.kv.attention.reference import paged_attention_kv

    b = build(case)
    prologue = make_prologue(case.dim, rope, norm, case.seed)
    positions = mx.array(b.meta.host_positions.astype(np.int32))
    with mx.stream(mx.cpu):
        q = reference(b.queries, prologue, 0, positions)
        want = np.array(paged_attention_kv(q, b.pool.astype(mx.float32), b.meta, b.scale,
                                           case.window))
    got = np.array(attend(b.queries, b.pool, b.meta, b.scale, case.window, prologue
                          ).astype(mx.float32))
    if got.shape != want.shape:
        raise AssertionError(f"{case.name}: output {got.shape} != {want.shape}")
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.abs(got - want).max())


@dataclass(frozen=True)
class WriteCase:
    """One prologue KV write: ``tokens`` rows of ``kv_heads`` heads of ``dim`` into a pool
    of 4 x 16 slots (random distinct slots, positions up to 999)."""

    dtype: str
    dim: int
    kv_heads: int
    tokens: int
    rope: int
    norm: bool
    seed: int

    @property
    def name(self) -> str:
        return (f"D{self.dim}-Hkv{self.kv_heads}-T{self.tokens}-rope{self.rope}-"
                f"norm{int(self.norm)}-{self.dtype}")


def write_cases() -> list[WriteCase]:
    """Every head size the kernels take (32: one channel per lane, the traditional pairs
    across lanes) and prologue, in each dtype; few tokens (Metal's constant address space)
    and more."""
    cases = []
    for i, (dtype, dim) in enumerate(itertools.product(("float32", "float16", "bfloat16"),
                                                       (32, 64, 128, 256))):
        rope, norm = PROLOGUES[i % len(PROLOGUES)]
        cases.append(WriteCase(dtype, dim, 1 + i % 3, 3 if i % 2 else 13, rope, norm, i))
    return cases


def write_error(case: WriteCase, write: Callable) -> tuple[float, bool]:
    """``(worst error / tolerance, cells outside the written rows unchanged)`` of
    ``write(pool, slots, keys, values, positions, prologue) -> pool after the write`` against
    the reference (the reference prologue's keys, rounded to the dtype, and the values in the
    rows' cells) in :data:`WRITE_TOLERANCE` units (<= 1 passes)."""
    from vllm_unified.kv.attention.qk_prologue import reference

    rng = np.random.default_rng(case.seed)
    dtype = getattr(mx, case.dtype)
    slots_n = 64
    pool = mx.array(rng.standard_normal((slots_n, case.kv_heads, 2 * case.dim)
                                        ).astype(np.float32)).astype(dtype)
    slots = rng.permutation(slots_n)[:case.tokens].astype(np.int32)
    positions = rng.integers(0, 1000, case.tokens).astype(np.int32)
    shape = (case.tokens, 1, case.kv_heads * case.dim)  # the projections' layout
    keys = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    prologue = make_prologue(case.dim, case.rope, case.norm, case.seed)
    with mx.stream(mx.cpu):
        k = reference(keys.reshape(case.tokens, case.kv_heads, case.dim), prologue, 1,
                      mx.array(positions)).astype(dtype).astype(mx.float32)
        want = np.array(pool.astype(mx.float32))
    cells = np.concatenate([np.array(k), np.array(values.astype(mx.float32)).reshape(
        case.tokens, case.kv_heads, case.dim)], axis=-1)
    before = want.copy()
    want[slots] = cells
    out = write(pool, mx.array(slots), keys, values, mx.array(positions), prologue)
    # evaluated before it is read: within one evaluation MLX's GPU encoders order readers
    # after the write only through its token (kv/gpu/write.py, ordered_after)
    mx.eval(out)
    got = np.array(out.astype(mx.float32))
    rtol, atol = WRITE_TOLERANCE[case.dtype]
    worst = float((np.abs(got - want) / (atol + rtol * np.abs(want))).max())
    others = np.setdiff1d(np.arange(slots_n), slots)
    return worst, bool(np.array_equal(got[others], before[others]))
