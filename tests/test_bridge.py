"""Zero-copy torch <-> MLX bridge: shared pointers, visibility both ways, in-place
row writes, lifetimes, and the cases that must raise instead of copying.

Needs the native extension (``native/``, built by scripts/setup.sh); its absence is a failure,
except on macOS, where setup.sh does not build it: there MLX's buffers are Metal buffers and
``to_mlx`` shares torch memory through ``mx.from_dlpack``, so the tests of the extension skip.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from vllm_unified import bridge
from vllm_unified.backend import import_mlx

mx = import_mlx()

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


NOT_ON_MACOS = ("macOS: native/ (the extension for MLX's CPU backend) is not built there; "
                "bridge.to_mlx shares through mx.from_dlpack on Metal")


@pytest.fixture(scope="module")
def native():
    if sys.platform == "darwin":
        pytest.skip(NOT_ON_MACOS)
    err = bridge.native_error()
    assert err is None, f"native extension unusable (run scripts/setup.sh): {err}"
    import vllm_unified_native

    return vllm_unified_native


def sample(dtype: torch.dtype, shape=(6, 5), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2 if dtype == torch.bool else 100, shape, generator=g)
    return x.to(dtype)


def mlx_equals(a, t: torch.Tensor) -> bool:
    """MLX evaluates ``a`` now and compares it with ``t`` (copied into MLX, independently)."""
    return bool(mx.array_equal(a, bridge.to_mlx(t.clone(), copy=True)).item())


# --- both directions share the bytes, for every dtype ----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_to_mlx_is_a_view(native, dtype):
    t = sample(dtype)
    a = bridge.to_mlx(t)
    assert a.dtype == bridge.mlx_dtype(dtype) and tuple(a.shape) == tuple(t.shape)
    assert bridge.data_ptr(a) == t.data_ptr()
    facts = native.info(a)
    assert not facts["owned"] and not facts["donatable"]
    assert mlx_equals(a, t)

    # torch writes -> MLX reads them (at evaluation)
    t[2] = sample(dtype, (5,), seed=1)
    assert mlx_equals(a, t)

    # MLX writes (the one in-place path) -> torch sees them, same buffer
    src = sample(dtype, (2, 5), seed=2)
    out = bridge.write_rows(a, mx.array([4, 0]), bridge.to_mlx(src, copy=True))
    mx.eval(out)
    assert bridge.data_ptr(out) == t.data_ptr()
    assert torch.equal(t[4], src[0]) and torch.equal(t[0], src[1])
    assert mlx_equals(a, t)  # the adopted array itself aliases the written bytes

    # and back to torch: still the same bytes
    back = bridge.to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlx_to_torch_is_a_view(native, dtype):
    a = bridge.to_mlx(sample(dtype, seed=3), copy=True)  # an MLX-owned buffer
    mx.eval(a)
    t = bridge.to_torch(a)
    assert t.dtype == dtype and tuple(t.shape) == tuple(a.shape)
    assert t.data_ptr() == bridge.data_ptr(a)
    assert native.info(a)["owned"]
    assert mlx_equals(a, t)

    # torch writes -> MLX sees them
    t[1] = sample(dtype, (5,), seed=4)
    assert mlx_equals(a, t)

    # MLX writes through write_rows -> torch sees them; the buffer is not forked
    src = sample(dtype, (1, 5), seed=5)
    out = bridge.write_rows(a, mx.array([3]), bridge.to_mlx(src, copy=True))
    mx.eval(out)
    assert bridge.data_ptr(out) == t.data_ptr()
    assert torch.equal(t[3], src[0])


def test_views_with_offsets_share(native):
    base = torch.arange(40, dtype=torch.int64)
    tail = base[8:].view(4, 8)  # contiguous, storage offset 8
    a = bridge.to_mlx(tail)
    assert bridge.data_ptr(a) == tail.data_ptr() == base.data_ptr() + 8 * 8
    assert mx.array_equal(a, mx.arange(8, 40).reshape(4, 8)).item()
    # an MLX slice of an adopted array stays a view; torch of it too
    row = a[2:3].squeeze(0)
    assert bridge.data_ptr(row) == tail[2].data_ptr()
    assert bridge.to_torch(row).data_ptr() == tail[2].data_ptr()
    assert bridge.data_ptr(a[:, 1]) == tail[:, 1].data_ptr()
    # ... but an integer index on axis 0 is a gather in MLX 0.32.4: a copy, whoever owns the
    # buffer. Take per-layer views with a slice, never a[i].
    assert bridge.data_ptr(a[2]) != tail[2].data_ptr()
    # 0-d and empty tensors
    s = torch.tensor(7, dtype=torch.int32)
    assert bridge.to_mlx(s).item() == 7 and bridge.data_ptr(bridge.to_mlx(s)) == s.data_ptr()
    assert tuple(bridge.to_mlx(torch.empty(0, 3)).shape) == (0, 3)


def test_round_trip_whatever_the_header_offset(native):
    """The adopted array reaches the data through an offset from a private header that may sit
    above or below the data (negative offset); both must export to torch correctly."""
    keep, signs = [], set()
    for i in range(300):
        t = torch.full((1000,), float(i))
        a = bridge.to_mlx(t)
        signs.add(native.info(a)["offset"] < 0)
        back = bridge.to_torch(a)
        assert back.data_ptr() == t.data_ptr() and back[999].item() == float(i)
        keep.append(a)
    if signs != {True, False}:
        pytest.skip(f"only offsets of one sign seen ({signs}); the allocator placed every header "
                    "on the same side")


# --- where sharing is impossible: raise, or copy when asked -----------------------------------


def test_non_contiguous_raises_unless_copy(native):
    t = sample(torch.float32, (4, 6))
    for bad in (t.t(), t[:, ::2]):
        with pytest.raises(RuntimeError, match="non-contiguous"):
            bridge.to_mlx(bad)
        c = bridge.to_mlx(bad, copy=True)
        assert mlx_equals(c, bad)
        assert native.info(c)["owned"]
    # an explicit copy shares nothing: later writes do not cross
    c = bridge.to_mlx(t, copy=True)
    assert bridge.data_ptr(c) != t.data_ptr()
    t.zero_()
    assert not mlx_equals(c, t)
    a = mx.ones((3, 3), dtype=mx.bfloat16)
    tc = bridge.to_torch(a, copy=True)
    assert tc.dtype == torch.bfloat16 and tc.data_ptr() != bridge.data_ptr(a)
    tc.zero_()
    assert mx.all(a == 1).item()


def test_unsupported_dtypes_raise():
    with pytest.raises(TypeError, match="not supported"):
        bridge.to_mlx(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="not supported"):
        bridge.to_torch(mx.zeros(3, dtype=mx.uint32))
    with pytest.raises(TypeError):
        bridge.to_mlx([1, 2, 3])  # type: ignore[arg-type]


def test_gpu_backend_raises_unless_copy(monkeypatch):
    """On MLX's CUDA backend neither direction can share: raise, never copy silently."""
    monkeypatch.setattr(bridge, "_backend", lambda: "cuda")
    t = sample(torch.float32)
    with pytest.raises(RuntimeError, match="copy=True"):
        bridge.to_mlx(t)
    with pytest.raises(RuntimeError, match="copy=True"):
        bridge.to_torch(mx.ones(3))
    assert mlx_equals(bridge.to_mlx(t, copy=True), t)
    assert torch.equal(bridge.to_torch(mx.ones(3), copy=True), torch.ones(3))


@pytest.mark.skipif(sys.platform == "darwin", reason=NOT_ON_MACOS)
def test_missing_native_raises_unless_copy(monkeypatch):
    monkeypatch.setattr(bridge, "_native", lambda: (None, "ImportError: simulated"))
    t = sample(torch.int32)
    with pytest.raises(RuntimeError, match="vllm-unified-native.*simulated"):
        bridge.to_mlx(t)
    with pytest.raises(RuntimeError, match="vllm-unified-native"):
        bridge.write_rows(mx.zeros((2, 2)), mx.array([0]), mx.ones((1, 2)))
    assert mlx_equals(bridge.to_mlx(t, copy=True), t)
    # MLX -> torch needs no native code
    a = mx.arange(4)
    assert bridge.to_torch(a).data_ptr() == bridge.data_ptr(a)


# --- write_rows: in place, lazy, ordered ------------------------------------------------------


def test_write_rows_into_torch_kv_pool(native):
    """The KV-cache pattern: torch owns the pool, MLX writes token rows at slot indices."""
    torch.manual_seed(0)
    blocks, block_size, heads, dim = 8, 4, 2, 3
    pool = torch.zeros(blocks, block_size, heads, dim, dtype=torch.bfloat16)
    cache = bridge.to_mlx(pool).reshape(blocks * block_size, heads, dim)  # a view, no copy
    assert bridge.data_ptr(cache) == pool.data_ptr()
    slots = mx.array([5, 17, 30], dtype=mx.int32)
    rows = torch.randn(3, heads, dim).to(torch.bfloat16)
    out = bridge.write_rows(cache, slots, bridge.to_mlx(rows, copy=True))
    assert torch.count_nonzero(pool.float()) == 0  # lazy: nothing written before evaluation
    reader = out[slots].astype(mx.float32).sum()  # built on the result: ordered after the write
    mx.eval(reader)
    flat = pool.view(blocks * block_size, heads, dim)
    for i, s in enumerate([5, 17, 30]):
        assert torch.equal(flat[s], rows[i])
    assert reader.item() == pytest.approx(rows.float().sum().item(), rel=1e-2)
    assert bridge.data_ptr(out) == pool.data_ptr()
    assert not native.info(out)["owned"]

    # chained writes in one graph: a reader of the last result sees all of them, in place
    ones = mx.ones((1, heads, dim), dtype=mx.bfloat16)
    c = cache
    for k in range(3):
        c = bridge.write_rows(c, mx.array([k]), ones * (k + 1))
    total = c[:3].astype(mx.float32).sum()
    mx.eval(total)
    assert total.item() == 36.0
    assert bridge.data_ptr(c) == pool.data_ptr()
    assert flat[:3].float().sum().item() == 36.0

    # step by step (write, read, evaluate), as the model runner does per forward
    for k in range(3):
        c = bridge.write_rows(c, mx.array([k]), ones * 0)
        step_sum = c[:3].astype(mx.float32).sum()
        mx.eval(step_sum)
        assert step_sum.item() == 36.0 - 6.0 * sum(range(1, k + 2))  # rows 0..k zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, four_d", [(1, True), (3, False), (700, True)])
def test_write_kv_equals_write_rows_of_the_concatenation(native, dtype, tokens, four_d):
    """``write_kv`` puts keys and values side by side in each (slot, head) cell of a torch-owned
    pool, in place, with the bytes ``write_rows`` of their concatenation gives ([T, Hkv, D]
    and the layer's [T, Hkv, 1, D]; 700 tokens split over the kernel pool)."""
    torch.manual_seed(tokens)
    slots, heads, dim = 1024, 3, 64
    pools = [torch.zeros(slots, heads, 2 * dim, dtype=dtype) for _ in range(2)]
    index = mx.array(torch.randperm(slots)[:tokens].numpy().astype("int32"))
    shape = (tokens, heads, 1, dim) if four_d else (tokens, heads, dim)
    keys, values = (bridge.to_mlx(torch.randn(shape).to(dtype), copy=True) for _ in range(2))
    got = bridge.write_kv(bridge.to_mlx(pools[0]), index, keys, values)
    flat = (keys.reshape(tokens, heads, dim), values.reshape(tokens, heads, dim))
    want = bridge.write_rows(bridge.to_mlx(pools[1]), index, mx.concatenate(flat, axis=-1))
    assert torch.count_nonzero(pools[0].float()) == 0  # lazy
    mx.eval(got, want)
    assert bridge.data_ptr(got) == pools[0].data_ptr()
    assert torch.equal(pools[0], pools[1]) and torch.count_nonzero(pools[0].float()) > 0


def test_write_kv_errors(native):
    pool = bridge.to_mlx(torch.zeros(8, 2, 8))
    k = mx.ones((2, 2, 4))
    with pytest.raises(IndexError, match="row index 8 is out of range"):
        bridge.write_kv(pool, mx.array([1, 8]), k, k)
    lazy = bridge.write_kv(pool, mx.array([1, 4]) * 2, k, k)  # 8: checked when it runs
    with pytest.raises(RuntimeError, match="row index 8 is out of range"):
        mx.eval(lazy)
    assert mx.sum(pool).item() == 0  # nothing written
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\] or \[T, Hkv, 1, D\]"):
        bridge.write_kv(pool, mx.array([0, 1]), mx.ones((2, 2, 3)), mx.ones((2, 2, 3)))
    with pytest.raises(TypeError, match="one dtype"):
        bridge.write_kv(pool, mx.array([0, 1]), k.astype(mx.float16), k.astype(mx.float16))
    with pytest.raises(TypeError, match="slot_mapping must be int32/int64"):
        bridge.write_kv(pool, mx.array([0.0, 1.0]), k, k)


def test_write_rows_into_layer_view(native):
    """One layer of a pool is an MLX view with an offset; writing it touches only that layer."""
    pool = torch.zeros(3, 10, 4)
    layer = bridge.to_mlx(pool)[1:2].squeeze(0)  # a slice: a[1] would be a copy (gather)
    out = bridge.write_rows(layer, mx.array([9, 0]), mx.full((2, 4), 2.0))
    mx.eval(out)
    assert bridge.data_ptr(out) == pool[1].data_ptr()
    assert pool[1, 9].tolist() == [2.0] * 4 and pool[1, 0].tolist() == [2.0] * 4
    assert pool.sum().item() == 16.0


def test_plain_mlx_update_forks_an_adopted_buffer(native):
    """The trap the primitive exists for: MLX's own update copies and torch never sees it."""
    pool = torch.zeros(16, 4)
    a = bridge.to_mlx(pool)
    a[3] = mx.ones(4)
    mx.eval(a)
    assert bridge.data_ptr(a) != pool.data_ptr()
    assert pool.sum().item() == 0.0


def test_write_rows_under_compile(native):
    pool = torch.zeros(8, 2)

    @mx.compile
    def step(c, idx, v):
        c2 = bridge.write_rows(c, idx, v)
        return c2, c2.sum()

    c, s = step(bridge.to_mlx(pool), mx.array([3, 5]), mx.full((2, 2), 2.0))
    mx.eval(c, s)
    assert s.item() == 8.0 and pool.sum().item() == 8.0
    c, s = step(c, mx.array([0]), mx.full((1, 2), 1.0))
    mx.eval(c, s)
    assert s.item() == 10.0 and pool.sum().item() == 10.0
    assert bridge.data_ptr(c) == pool.data_ptr()


def test_write_rows_errors(native):
    pool = torch.zeros(4, 3)
    a = bridge.to_mlx(pool)
    src = mx.ones((1, 3))
    with pytest.raises(IndexError, match="out of range"):
        bridge.write_rows(a, mx.array([4]), src)  # computed indices: checked at the call
    with pytest.raises(IndexError, match="out of range"):
        bridge.write_rows(a, mx.array([-1]), src)
    lazy = mx.array([1]) + 3  # lazy indices: checked when the write runs, before any row
    with pytest.raises(RuntimeError, match="out of range"):
        mx.eval(bridge.write_rows(a, mx.concatenate([mx.array([0]), lazy]), mx.ones((2, 3))))
    assert pool.sum().item() == 0.0  # nothing written, not even the valid row
    with pytest.raises(TypeError, match="dtype"):
        bridge.write_rows(a, mx.array([0]), mx.ones((1, 3), dtype=mx.float16))
    with pytest.raises(ValueError, match="shape"):
        bridge.write_rows(a, mx.array([0]), mx.ones((1, 4)))
    with pytest.raises(TypeError, match="1-D integer"):
        bridge.write_rows(a, mx.array([[0]]), src)
    with pytest.raises(TypeError, match="1-D integer"):
        bridge.write_rows(a, mx.array([0.0]), src)
    with pytest.raises(ValueError, match="row-contiguous"):
        mx.eval(bridge.write_rows(a.T, mx.array([0]), mx.ones((1, 4))))
    with pytest.raises(NotImplementedError, match="CPU"):
        bridge.write_rows(a, mx.array([0]), src, stream=mx.gpu)
    # other integer index dtypes and an empty write are fine
    mx.eval(bridge.write_rows(a, mx.array([2], dtype=mx.uint8), src))
    out = bridge.write_rows(a, mx.array([], dtype=mx.int32), mx.ones((0, 3)))
    mx.eval(out)
    assert bridge.data_ptr(out) == pool.data_ptr() and pool.sum().item() == 3.0


def test_adopt_argument_checks(native):
    t = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="nbytes"):
        native.adopt(t.data_ptr(), 63, [4, 4], mx.float32, t)
    with pytest.raises(ValueError, match="int32"):
        native.adopt(t.data_ptr(), 64, [2**31, 1], mx.uint8, t)
    with pytest.raises(ValueError, match="aligned"):
        native.adopt(t.data_ptr() + 2, 60, [15], mx.float32, t)


# --- lifetimes --------------------------------------------------------------------------------


def test_owner_released_exactly_once(native):
    owner = object()
    base = sys.getrefcount(owner)
    buf = torch.zeros(16)
    for _ in range(1000):
        a = native.adopt(buf.data_ptr(), 64, [4, 4], mx.float32, owner)
        assert sys.getrefcount(owner) == base + 1
        v = (a.T + 1).sum()  # a graph holding the adopted buffer
        mx.eval(v)
        del a, v
        assert sys.getrefcount(owner) == base  # released once: not leaked, not over-released


def test_tensors_freed_after_adopt_and_drop(native):
    freed = [0]

    def on_free():
        freed[0] += 1

    for i in range(1000):
        t = torch.full((8, 8), float(i))
        weakref.finalize(t, on_free)
        a = bridge.to_mlx(t)
        view = bridge.to_torch(a[1:, ::2])  # torch view of an MLX view of the tensor
        del t
        if i % 2:
            del a, view
        else:
            del view, a
    gc.collect()
    mx.synchronize()
    assert freed[0] == 1000


def test_release_on_mlx_worker_thread_subprocess():
    """Last reference dropped while the graph is queued: the deleter runs on MLX's worker thread
    and must take the GIL without deadlocking against a main thread waiting in MLX. Runs in a
    subprocess so that a deadlock fails the test instead of hanging the suite."""
    script = textwrap.dedent(
        """
        import threading, weakref
        import torch
        from vllm_unified import bridge
        from vllm_unified.backend import import_mlx
        mx = import_mlx()
        main = threading.get_ident()
        freed, off_main = [0], [0]
        def on_free():
            freed[0] += 1
            off_main[0] += threading.get_ident() != main
        big = mx.ones((128, 128))
        for i in range(300):
            t = torch.full((32, 32), float(i))
            weakref.finalize(t, on_free)
            a = bridge.to_mlx(t)
            del t
            b = (big @ big).sum() + a.sum()
            del a
            mode = i % 3
            if mode == 0:
                assert b.item() == 128.0 ** 3 + 1024 * i
            elif mode == 1:
                mx.eval(b)
            else:
                mx.async_eval(b); del b; mx.synchronize()
        mx.synchronize()
        print(freed[0], off_main[0])
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    freed, off_main = map(int, proc.stdout.split())
    assert freed == 300
    # Most releases happen on MLX's worker thread (the path that needs the GIL); not asserted
    # exactly because scheduling decides which thread drops the last reference.
    print(f"released on MLX's worker thread: {off_main}/300")
