"""The Metal dialect of the one-source GPU kernels, checked without a Mac.

* :func:`gpu_dialect.mlx_metal_source` against the text MLX 0.32.4 itself generates (its
  ``metal_kernel`` prints the source with ``verbose=True``, and runs that far without a Metal
  device while a function is being exported).
* Each dialect's instance holds its own prelude and none of the other's names.
* The kernels' Metal instances, run by the CPU emulation of Metal's thread model
  (``tests/metal_emulation.py``), against MLX/numpy references; and the emulation itself
  (conversions, barriers, SIMD functions, divergence) against known answers, so a wrong shim
  or a wrong kernel fails.
"""

from __future__ import annotations

import os
import re
import tempfile

import metal_emulation as emu
import mlx.core as mx
import numpy as np
import pytest

from vllm_unified import gpu_dialect as gd
from vllm_unified.kv.gpu import write as gpu_write

needs_clang = emu.needs_clang

METAL_NAMES = ("thread_position_in_grid", "threadgroup", "simd_sum", "simd_max",
               "simd_shuffle_xor", "metal::", "mem_flags", "thread_index_in_simdgroup",
               "device", "threadgroup_barrier")
CUDA_NAMES = ("__syncthreads", "blockIdx", "threadIdx", "blockDim", "__shfl_xor_sync",
              "__shared__", "__device__", "__expf", "__int_as_float", "fmaxf", "cg::")

REDUCE = """
    UNI_SHARED float part[32];
    const float v = static_cast<float>(x[uni_global]);
    const float s = uni_simd_sum(v);
    if (uni_lane == 0) part[uni_simd] = s;
    UNI_BARRIER();
    if (uni_simd == 0) {
        const uint nsimd = (uni_threads + 31) / 32;
        float t = uni_lane < nsimd ? part[uni_lane] : 0.0f;
        t = uni_simd_sum(t);
        if (uni_lane == 0) out[uni_group] = t;
    }
"""


#: every name of the convention in one kernel: per group of 128, the sum and max of x, the sum
#: of exp(x - max), and x replaced by exp(x - max) in place
ALL_NAMES = """
    UNI_SHARED float sums[32];
    UNI_SHARED float maxs[32];
    UNI_SHARED float exps[32];
    const UNI_DEVICE T* xs = x;
    const float v = static_cast<float>(xs[uni_global]);
    const float m = uni_simd_max(v);
    float s = v;
    for (int k = 16; k > 0; k >>= 1) s += uni_shfl_xor(s, k);
    if (uni_lane == 0) { sums[uni_simd] = s; maxs[uni_simd] = m; }
    UNI_BARRIER();
    if (uni_thread == 0) {
        float total = 0.0f, best = uni_neg_inf();
        for (unsigned int g = 0; g < (uni_threads + 31) / 32; ++g) {
            total += sums[g];
            best = uni_fmax(best, maxs[g]);
        }
        sums[0] = total;
        maxs[0] = best;
    }
    UNI_BARRIER();
    const float e = uni_exp(v - maxs[0]);
    const float d = uni_simd_sum(e);
    if (uni_lane == 0) exps[uni_simd] = d;
    UNI_BARRIER();
    UNI_WRITABLE(T, x)[uni_global] = static_cast<T>(e);
    if (uni_thread == 0) {
        float denom = 0.0f;
        for (unsigned int g = 0; g < (uni_threads + 31) / 32; ++g) denom += exps[g];
        out[uni_group * 3 + 0] = sums[0];
        out[uni_group * 3 + 1] = maxs[0];
        out[uni_group * 3 + 2] = denom;
    }
"""

def _has(text: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text) is not None \
        if name[-1].isalnum() or name[-1] == "_" else name in text


def mlx_generated(name, input_names, output_names, source, header, inputs, template,
                  output_dtypes) -> str:
    """The Metal source MLX 0.32.4 builds for this call, as its ``verbose`` prints it."""
    kern = mx.fast.metal_kernel(name=name, input_names=input_names, output_names=output_names,
                                source=source, header=header)

    def call(*xs):
        return kern(inputs=list(xs), template=template, grid=(1, 1, 1), threadgroup=(1, 1, 1),
                    output_shapes=[(1,)] * len(output_dtypes), output_dtypes=output_dtypes,
                    verbose=True)

    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryFile() as out:
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            mx.export_function(os.path.join(d, "k.mlxfn"), call, *inputs)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()
    start = text.index(f"Generated source code for `{name}`:\n```\n")
    text = text[start:].split("\n", 2)[2]
    return text[:text.index("\n```\n")]


def _kv_case(dtype, kv_heads, head_size, block_size, tokens, seed, four_d=False):
    rng = np.random.default_rng(seed)
    num_slots = 4 * block_size
    pool = mx.array(rng.standard_normal((num_slots, kv_heads, 2 * head_size)).astype(np.float32)
                    ).astype(dtype)
    slots = mx.array(rng.permutation(num_slots)[:tokens].astype(np.int32))
    shape = (tokens, kv_heads, 1, head_size) if four_d else (tokens, kv_heads, head_size)
    keys = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return pool, slots, keys, values


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


# --- assembly -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["kv", "kv_few_slots", "rows", "reduce", "raw"])
def test_assemble_metal_is_mlx_text(case):
    """assemble_metal / mlx_metal_source reproduce MLX 0.32.4's own Metal text byte for byte."""
    if case.startswith("kv"):
        pool, slots, keys, values = _kv_case(mx.float16, 2, 64, 16, 3 if "few" in case else 9, 0)
        launch = gpu_write.write_kv_launch(pool, slots, keys, values)
        name, ins, outs = gpu_write.WRITE_KV_KERNEL
        body = gpu_write.WRITE_KV_SOURCE
    elif case == "rows":
        dst, idx = mx.zeros((10, 3, 5), mx.bfloat16), mx.array([4, 1], mx.int32)
        launch = gpu_write.write_rows_launch(dst, idx, mx.ones((2, 3, 5), mx.bfloat16))
        name, ins, outs = gpu_write.WRITE_ROWS_KERNEL
        body = gpu_write.WRITE_ROWS_SOURCE
    elif case == "reduce":
        launch = dict(inputs=[mx.zeros((512,))], template=[("T", mx.float32)],
                      output_dtypes=[mx.float32])
        name, ins, outs, body = "reduce", ("x",), ("out",), REDUCE
    if case != "raw":
        header, source = gd.instance_source(body, dialect="metal")
        want = mlx_generated(name, list(ins), list(outs), source, header, launch["inputs"],
                             launch["template"], launch["output_dtypes"])
        func, got = gd.assemble_metal(name, ins, outs, body, launch["inputs"],
                                      launch["template"], output_dtypes=launch["output_dtypes"])
    else:  # no dialect: scalar and small inputs, every shape buffer, int/bool template args
        ins, outs = ["a", "s", "b"], ["o1", "o2"]
        body = ("o1[0] = a[thread_index_in_simdgroup] + s + b_shape[0] + a_strides[0] + a_ndim;"
                " o2[0] = threads_per_threadgroup.x;")
        inputs = [mx.zeros((4, 3)), mx.array(2.0), mx.zeros((5,), mx.int32)]
        template = [("T", mx.bfloat16), ("N", 7), ("F", True), ("G", False)]
        want = mlx_generated("raw", ins, outs, body, "// mine\n", inputs, template,
                             [mx.float16, mx.uint32])
        func, got = gd.mlx_metal_source("raw", ins, outs, body, inputs, template,
                                        output_dtypes=[mx.float16, mx.uint32],
                                        header="// mine\n")
    assert got == want
    assert f"[[kernel]] void {func}(" in got


def test_metal_source_errors():
    with pytest.raises(ValueError, match="at least one output"):
        gd.mlx_metal_source("k", ["a"], [], "", [mx.zeros(9)], output_dtypes=[])
    with pytest.raises(ValueError, match="`inputs` to have size 1"):
        gd.mlx_metal_source("k", ["a"], ["o"], "", [], output_dtypes=[mx.float32])
    with pytest.raises(ValueError, match="Unsupported compilation type"):
        gd.mlx_metal_source("k", ["a"], ["o"], "", [mx.zeros(9)], output_dtypes=[_Unsupported()])
    with pytest.raises(ValueError, match="unknown GPU dialect"):
        gd.instance_source("", dialect="rocm")
    with pytest.raises(ValueError, match="unknown GPU dialect"):
        gd.kernel("k", ["a"], ["o"], "", dialect="hip")


class _Unsupported:
    """A dtype MLX's Metal assembly has no type string for."""

    def __repr__(self) -> str:
        return "unsupported"


# --- the dialects' instances ---------------------------------------------------------------

@pytest.fixture
def recorded(monkeypatch):
    """mx.fast.cuda_kernel / metal_kernel replaced by recorders; gpu_dialect's kernel cache
    emptied before and after (so no recorder stays cached)."""
    calls = []

    def fake(kind):
        def make(**kw):
            def call(**args):
                calls.append((kind, kw, args))
                return [mx.array([1], mx.int32)]
            return call
        return make

    gd._kernel.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake("cuda"))
    monkeypatch.setattr(mx.fast, "metal_kernel", fake("metal"))
    yield calls
    gd._kernel.cache_clear()


@pytest.mark.parametrize("which", ["kv", "rows"])
def test_each_dialect_has_its_prelude_and_none_of_the_other(recorded, which):
    pool, slots, keys, values = _kv_case(mx.float16, 2, 8, 16, 5, 1)
    for dialect in gd.DIALECTS:
        if which == "kv":
            out = gpu_write.write_kv_gpu(pool, slots, keys, values, dialect=dialect)
        else:
            out = gpu_write.write_rows_gpu(pool, slots, mx.zeros((5, 2, 16), mx.float16),
                                           dialect=dialect)
        assert out.shape == pool.shape and out.dtype == pool.dtype
    (k1, cuda, cuda_call), (k2, metal, metal_call) = recorded
    assert (k1, k2) == ("cuda", "metal")
    cuda_text, metal_text = cuda["header"] + cuda["source"], metal["header"] + metal["source"]
    assert "__device__ __forceinline__ float uni_simd_sum" in cuda["header"]
    assert "#define UNI_WRITABLE(T, p) const_cast<T*>(p)" in cuda["header"]
    assert "uni_global = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;" \
        in cuda["source"]
    assert "#define UNI_WRITABLE(T, p) const_cast<device T*>(p)" in metal["header"]
    assert "uni_global = thread_position_in_grid.x;" in metal["source"]
    for name in METAL_NAMES:
        assert not _has(cuda_text, name), name
    for name in CUDA_NAMES:
        assert not _has(metal_text, name), name
    # the same body, launch and names in both; the CUDA write kernel keeps its name
    for field in ("name", "input_names", "output_names"):
        assert cuda[field] == metal[field]
    assert cuda["source"].endswith(gpu_write.WRITE_KV_SOURCE if which == "kv"
                                   else gpu_write.WRITE_ROWS_SOURCE)
    assert cuda_call.keys() == metal_call.keys()
    for key in ("template", "grid", "threadgroup", "output_shapes", "output_dtypes"):
        assert cuda_call[key] == metal_call[key]
    if which == "kv":
        assert cuda["name"] == "vllm_unified_write_kv"
        assert cuda_call["template"] == [("T", mx.float16), ("HKV", 2), ("D", 8)]
        assert cuda_call["grid"] == (5 * 2 * 16, 1, 1) and cuda_call["threadgroup"] == (32, 1, 1)


def test_body_prefix_declares_only_what_the_body_uses():
    assert gd.body_prefix("metal", "x = uni_lane;") == \
        "    const uint uni_lane = thread_index_in_simdgroup;\n"
    assert gd.body_prefix("cuda", "y = uni_threads + uni_group;").count("\n") == 2
    assert gd.body_prefix("metal", "uni_lanes = 1;") == ""


def test_write_kernels_reject_bad_input():
    dst = mx.zeros((6, 4), mx.float32)
    idx = mx.array([0, 2], mx.int32)
    with pytest.raises(TypeError, match="dtype"):
        gpu_write.write_rows_gpu(dst, idx, mx.zeros((2, 4), mx.float16), dialect="cuda")
    with pytest.raises(TypeError, match="1-D integer"):
        gpu_write.write_rows_gpu(dst, idx.astype(mx.float32), mx.zeros((2, 4)), dialect="cuda")
    with pytest.raises(TypeError, match="1-D integer"):
        gpu_write.write_rows_gpu(dst, idx[None], mx.zeros((2, 4)), dialect="cuda")
    with pytest.raises(ValueError, match="do not fit rows"):
        gpu_write.write_rows_gpu(dst, idx, mx.zeros((2, 5)), dialect="cuda")
    with pytest.raises(ValueError, match="do not fit rows"):
        gpu_write.write_rows_gpu(dst, idx, mx.zeros((3, 4)), dialect="cuda")
    with pytest.raises(ValueError, match="unknown GPU dialect"):
        gpu_write.write_rows_gpu(dst, idx, mx.zeros((2, 4)), dialect="opencl")
    with pytest.raises(ValueError, match="constant address space"):
        gpu_write.write_rows_gpu(mx.zeros((7, 1)), idx, mx.zeros((2, 1)), dialect="metal")
    with pytest.raises(ValueError, match="constant address space"):
        gpu_write.write_kv_gpu(mx.zeros((1, 1, 6)), idx[:1], mx.zeros((1, 1, 3)),
                               mx.zeros((1, 1, 3)), dialect="metal")
    assert gpu_write.write_rows_gpu(dst, idx[:0], mx.zeros((0, 4)), dialect="metal") is dst


# --- the emulation itself ------------------------------------------------------------------

def _run_body(body, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(),
              name="probe"):
    mx_inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
    _, text = gd.assemble_metal(name, [f"x{i}" if i else "x" for i in range(len(inputs))],
                                [f"out{i}" if i else "out" for i in range(len(output_shapes))],
                                body, mx_inputs, list(template), output_dtypes=output_dtypes)
    return emu.run(text, inputs, output_shapes, output_dtypes, grid, threadgroup)


@needs_clang
@pytest.mark.parametrize("n", [1024, 1000, 300])
def test_emulated_reduction_uses_barrier_and_simd_sum(n):
    """Per-group sums through simd_sum, shared memory and a barrier; the last group of a grid
    that is not a multiple of 256 is smaller on Metal (threads_per_threadgroup)."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    groups = -(-n // 256)
    _, (out,) = _run_body(REDUCE, [x], [(groups,)], [mx.float32], (n, 1, 1), (256, 1, 1))
    want = np.array([x[g * 256:(g + 1) * 256].sum() for g in range(groups)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@needs_clang
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_emulated_kernel_with_every_convention_name(dtype):
    """Sum (xor butterfly), max, exp-sum per group and an in-place write, all names used."""
    x32 = np.random.default_rng(4).standard_normal(512).astype(np.float32)
    x = mx.array(x32).astype(dtype)
    xf = _f32(x).reshape(4, 128)
    (after,), (out,) = _run_body(ALL_NAMES, [x], [(12,)], [mx.float32], (512, 1, 1),
                                 (128, 1, 1), template=[("T", dtype)])
    out = out.reshape(4, 3)
    np.testing.assert_allclose(out[:, 0], xf.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out[:, 1], xf.max(1))
    e = np.exp(xf - xf.max(1, keepdims=True))
    np.testing.assert_allclose(out[:, 2], e.sum(1), rtol=1e-5)
    want = _f32(mx.array(e.reshape(-1)).astype(dtype))
    np.testing.assert_allclose(after.astype(np.float32), want, rtol=1e-6, atol=0)


@needs_clang
def test_emulation_exposes_a_missing_barrier():
    """The same reduction without its barrier reads partial sums before they are written."""
    x = np.random.default_rng(7).standard_normal(1024).astype(np.float32) + 1.0
    _, (out,) = _run_body(REDUCE.replace("UNI_BARRIER();", ""), [x], [(4,)], [mx.float32],
                          (1024, 1, 1), (256, 1, 1))
    want = x.reshape(4, 256).sum(1)
    assert not np.allclose(out, want, rtol=1e-3)


@needs_clang
def test_emulated_simd_functions():
    """Butterfly through uni_shfl_xor equals uni_simd_sum; uni_simd_max; every lane gets it."""
    body = """
        const float v = static_cast<float>(x[uni_global]);
        float b = v;
        for (int m = 16; m > 0; m >>= 1) b += uni_shfl_xor(b, m);
        out[uni_global] = b;
        out1[uni_global] = uni_simd_sum(v);
        out2[uni_global] = uni_simd_max(v);
        out3[uni_global] = uni_shfl_xor(v, 5);
    """
    x = np.random.default_rng(3).standard_normal(128).astype(np.float32)
    _, (bfly, ssum, smax, shfl) = _run_body(body, [x], [(128,)] * 4, [mx.float32] * 4,
                                            (128, 1, 1), (64, 1, 1))
    lanes = x.reshape(4, 32)
    np.testing.assert_allclose(bfly, np.repeat(lanes.sum(1), 32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ssum, np.repeat(lanes.sum(1), 32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(smax, np.repeat(lanes.max(1), 32))
    np.testing.assert_array_equal(shfl, lanes[:, np.arange(32) ^ 5].reshape(-1))


@needs_clang
def test_emulated_thread_attributes():
    """Positions, sizes and SIMD indices on a 3-D grid with partial groups, as Metal's
    dispatchThreads with MLX's threadgroup min(threadgroup, grid)."""
    body = """
        const uint t = thread_position_in_grid.x + 10 * (thread_position_in_grid.y
                       + 6 * thread_position_in_grid.z);
        out[t * 4 + 0] = threadgroup_position_in_grid.x + 100 * threadgroup_position_in_grid.y
                         + 10000 * threadgroup_position_in_grid.z;
        out[t * 4 + 1] = thread_index_in_threadgroup;
        out[t * 4 + 2] = threads_per_threadgroup.x * threads_per_threadgroup.y
                         * threads_per_threadgroup.z;
        out[t * 4 + 3] = thread_index_in_simdgroup + 100 * simdgroup_index_in_threadgroup;
    """
    grid, tg = (10, 6, 2), (4, 4, 8)  # z group clipped to 2 by MLX; x and y groups partial
    _, (out,) = emu.run(gd.mlx_metal_source("attrs", ["x"], ["out"], body, [mx.zeros(9)],
                                            output_dtypes=[mx.uint32])[1],
                        [np.zeros(9, np.float32)], [(10 * 6 * 2 * 4,)], [mx.uint32], grid, tg)
    out = out.reshape(2, 6, 10, 4)
    for z in range(2):
        for y in range(6):
            for x in range(10):
                size = (min(4, 10 - x // 4 * 4), min(4, 6 - y // 4 * 4), 2)
                index = x % 4 + size[0] * (y % 4 + size[1] * z)
                assert tuple(out[z, y, x]) == (x // 4 + 100 * (y // 4), index,
                                               size[0] * size[1] * size[2],
                                               index % 32 + 100 * (index // 32))


@needs_clang
def test_emulation_rejects_divergent_simd_and_barrier():
    x = np.zeros(64, np.float32)
    simd = "float v = 1.0f; if (uni_lane < 16) v = uni_simd_sum(v); out[uni_global] = v;"
    with pytest.raises(emu.EmulationError, match="divergent SIMD-group function"):
        _run_body(simd, [x], [(64,)], [mx.float32], (64, 1, 1), (64, 1, 1))
    barrier = "if (uni_thread < 40) { UNI_BARRIER(); } out[uni_global] = 1.0f;"
    with pytest.raises(emu.EmulationError, match="threadgroup_barrier reached by 40 of 64"):
        _run_body(barrier, [x], [(64,)], [mx.float32], (64, 1, 1), (64, 1, 1))
    shfl = "out[uni_global] = uni_shfl_xor(1.0f, 8);"  # lane 0 reads lane 8 of a 4-lane group
    with pytest.raises(emu.EmulationError, match="reads lane 8 of a SIMD group of 4"):
        _run_body(shfl, [x[:4]], [(4,)], [mx.float32], (4, 1, 1), (4, 1, 1))
    with pytest.raises(emu.EmulationError, match="clang\\+\\+ failed"):
        _run_body("out[0] = undeclared_name;", [x], [(1,)], [mx.float32], (1, 1, 1), (1, 1, 1))


@needs_clang
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_emulated_16_bit_floats_round_to_nearest_even(dtype):
    """float -> half / bfloat16 -> float in the shim, bit for bit as numpy (binary16) and MLX
    (bfloat16) convert: ties, subnormals, overflow, infinities and NaN included."""
    rng = np.random.default_rng(11)
    halves = np.arange(0x7c00, dtype=np.uint16).view(np.float16).astype(np.float64)
    bits = np.concatenate([
        rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x33000000, 0x33800000, 0x1000, dtype=np.uint32),  # half's subnormal range
        (np.arange(2**16, dtype=np.uint32) << 16) | 0x8000,  # bfloat16 ties
        # half ties (exact in float32): midpoints of neighbouring finite halves, both signs
        ((halves[1:] + halves[:-1]) / 2).astype(np.float32).view(np.uint32),
        ((halves[1:] + halves[:-1]) / -2).astype(np.float32).view(np.uint32),
        np.array([0, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0x477fefff, 0x477ff000,
                  0x7f7fffff, 0x33000000, 0x33000001, 0x387fe000, 0x387ff000], np.uint32)])
    x = bits.view(np.float32)
    body = """
        const T h = static_cast<T>(x[uni_global]);
        out[uni_global] = static_cast<float>(h);
        out1[uni_global] = static_cast<float>(-h * T(2));
    """
    _, (back, neg2) = _run_body(body, [x], [x.shape] * 2, [mx.float32] * 2, (x.size, 1, 1),
                                (256, 1, 1), template=[("T", dtype)])
    if dtype == mx.float16:
        with np.errstate(over="ignore"):
            want = x.astype(np.float16).astype(np.float32)
    else:
        want = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(back), nan)
    np.testing.assert_array_equal(back[~nan].view(np.uint32), want[~nan].view(np.uint32))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(neg2[~nan], -2 * want[~nan] if dtype == mx.bfloat16
                                      else (-2 * want[~nan]).astype(np.float16).astype(np.float32))


# --- the write kernels' Metal instances ----------------------------------------------------

@pytest.fixture
def emulated_metal(monkeypatch):
    """mx.fast.metal_kernel replaced by MLX's assembly (mlx_metal_source) plus the emulator:
    the kernel call runs on the CPU and its arrays (inputs after the run, outputs) are kept."""
    runs = []

    def make(*, name, input_names, output_names, source, header="", **_):
        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            _, text = gd.mlx_metal_source(name, input_names, output_names, source, inputs,
                                          template, output_dtypes=output_dtypes, header=header)
            ins, outs = emu.run(text, inputs, output_shapes, output_dtypes, grid, threadgroup)
            runs.append((text, ins, outs))
            return [mx.array(o) for o in outs]
        return call

    gd._kernel.cache_clear()
    monkeypatch.setattr(mx.fast, "metal_kernel", make)
    yield runs
    gd._kernel.cache_clear()


def _kv_reference(pool, slots, keys, values):
    ref = mx.array(pool)
    cells = mx.concatenate([keys.reshape(keys.shape[0], pool.shape[1], -1),
                            values.reshape(values.shape[0], pool.shape[1], -1)], axis=-1)
    ref[slots] = cells
    return _f32(ref)


@needs_clang
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("head_size,kv_heads", [(64, 8), (128, 2), (256, 1)])
def test_write_kv_metal_instance(emulated_metal, dtype, head_size, kv_heads):
    """GQA-shaped pools (few KV heads), block sizes 16/32/64, slots in random order, 3-D and
    4-D rows, few tokens (slots in Metal's constant address space) and more."""
    for i, (block_size, tokens, four_d) in enumerate([(16, 3, False), (32, 13, True),
                                                      (64, 20, False)]):
        pool, slots, keys, values = _kv_case(dtype, kv_heads, head_size, block_size, tokens,
                                             seed=i + head_size, four_d=four_d)
        want = _kv_reference(pool, slots, keys, values)
        out = gpu_write.write_kv_gpu(pool, slots, keys, values, dialect="metal")
        text, ins, outs = emulated_metal[-1]
        assert text == gd.assemble_metal(*gpu_write.WRITE_KV_KERNEL, gpu_write.WRITE_KV_SOURCE,
                                         [pool, slots, keys, values],
                                         [("T", dtype), ("HKV", kv_heads), ("D", head_size)],
                                         output_dtypes=[mx.int32])[1]
        assert ("const constant int32_t* slots" in text) == (tokens < 8)
        np.testing.assert_array_equal(ins[0].astype(np.float32), want)
        assert outs[0].tolist() == [1]
        assert out.shape == pool.shape and out.dtype == pool.dtype
    assert len(emulated_metal) == 3


@needs_clang
def test_a_wrong_write_kernel_fails_the_check(emulated_metal, monkeypatch):
    """The checks catch a kernel that writes the wrong values, and one that reads one
    element past the end of its input (the read faults on the guard page)."""
    pool, slots, keys, values = _kv_case(mx.float16, 2, 64, 16, 9, seed=5)
    body = gpu_write.WRITE_KV_SOURCE
    monkeypatch.setattr(gpu_write, "WRITE_KV_SOURCE",
                        body.replace("c < D ? keys[", "c < D ? values["))
    gpu_write.write_kv_gpu(pool, slots, keys, values, dialect="metal")
    got = emulated_metal[-1][1][0].astype(np.float32)
    assert not np.array_equal(got, _kv_reference(pool, slots, keys, values))
    monkeypatch.setattr(gpu_write, "WRITE_KV_SOURCE", body.replace("c < D ?", "c <= D ?"))
    with pytest.raises(emu.EmulationError, match="crashed \\(SIGSEGV\\)"):
        gpu_write.write_kv_gpu(pool, slots, keys, values, dialect="metal")


@needs_clang
def test_emulation_reports_a_kernel_that_does_not_finish():
    spin = "const volatile UNI_DEVICE float* v = x; while (v[0] == 0.0f) {}"
    with pytest.raises(emu.EmulationError, match="did not finish within 2"):
        emu.run(gd.assemble_metal("spin", ["x"], ["out"], spin, [mx.zeros(9)],
                                  output_dtypes=[mx.float32])[1],
                [np.zeros(9, np.float32)], [(1,)], [mx.float32], (1, 1, 1), (1, 1, 1),
                timeout=2)


@needs_clang
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_write_rows_metal_instance(emulated_metal, dtype):
    """Rows of several widths (one with a ragged last threadgroup), indices in random order
    with out-of-range ones skipped, and zeroing whole blocks of a KV pool."""
    rng = np.random.default_rng(2)
    for row, n, bad in [((3, 5), 6, [-1, 10]), ((2, 64), 9, []), ((4, 33, 7), 3, [99])]:
        dst = mx.array(rng.standard_normal((10, *row)).astype(np.float32)).astype(dtype)
        idx = np.concatenate([rng.permutation(10)[:n], bad]).astype(np.int32)
        src = mx.array(rng.standard_normal((idx.size, *row)).astype(np.float32)).astype(dtype)
        gpu_write.write_rows_gpu(dst, mx.array(idx), src, dialect="metal")
        want = _f32(dst).copy()
        ok = (idx >= 0) & (idx < 10)
        want[idx[ok]] = _f32(src)[ok]
        np.testing.assert_array_equal(emulated_metal[-1][1][0].astype(np.float32), want)
    # block zeroing: blocks 1 and 3 of a [4 blocks * 16, 2 heads, 2 * 64] pool
    pool = mx.array(rng.standard_normal((64, 2, 128)).astype(np.float32)).astype(dtype)
    slots = (np.array([3, 1])[:, None] * 16 + np.arange(16)).reshape(-1).astype(np.int64)
    gpu_write.write_rows_gpu(pool, mx.array(slots), mx.zeros((32, 2, 128), dtype),
                             dialect="metal")
    want = _f32(pool).copy()
    want[slots] = 0
    np.testing.assert_array_equal(emulated_metal[-1][1][0].astype(np.float32), want)
