"""The quantized KV cache on the GPU path: the quantizing write and the paged attention over
quantized pages (one source each, CUDA and Metal dialects), and the backend decision.

* The numpy reference of the write (``kv/quant.quantize_cells_reference``, the H200 check's
  expectation) equals the native write (``write_kv_quant``, itself equal to vLLM's kernels in
  tests/test_kv_quant.py) byte for byte; its fp8 encoding equals torch's ``float8_e4m3fn``.
* The Metal instance of the write (``kv/gpu/quant_write.py``), assembled as
  ``mx.fast.metal_kernel`` assembles it and run by the CPU emulation of Metal's thread model
  (tests/metal_emulation.py), writes the native write's bytes, byte for byte, on
  :func:`gpu_kv_quant_grid.write_cases`.
* The Metal instance of the attention (``kv/gpu/paged_quant.py``), emulated, through the
  whole ``paged_gpu_attention_quant`` path, against the pure-MLX reference over the pool
  dequantized by pure MLX: max abs error 1e-5 (fp32), 2e-2 (bf16) on
  :func:`gpu_kv_quant_grid.grid`.
* The backend decision with the profile mocked: Metal (torch-shared pool, Metal kernels) and
  CUDA (MLX-owned pool, CUDA kernel) serve the formats; a profile without the kernels, a head
  size they do not take and hybrids are refused at start-up, naming the flag; the pool routes
  its writes, zeroing and attention to the GPU kernels of its dialect.
* The CUDA instances' text (what NVRTC would compile) holds the CUDA prelude and none of
  Metal's names.
"""

from __future__ import annotations

import dataclasses

import metal_emulation as emu
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import cover_each_value, profile_for
from gpu_kv_quant_grid import (
    DTYPES,
    MODES,
    TOLERANCE,
    grid,
    max_error,
    option_grid,
    pool_bytes,
    write_cases,
    write_inputs,
)

from vllm_unified import bridge
from vllm_unified import gpu_dialect as gd
from vllm_unified.kv.attention import dispatch as paged
from vllm_unified.kv.attention import reference
from vllm_unified.kv.gpu import paged_quant as gpu_paged_quant
from vllm_unified.kv.gpu import quant_write as gpu_quant_write
from vllm_unified.kv.quant import f32_to_e4m3_reference, kv_format, rht_signs

needs_clang = emu.needs_clang


def _native():
    native = bridge.native_kernels()
    if native is None:
        pytest.skip(f"the native extension is not built: {bridge.native_error()}")
    return native


def _native_write(inp, mode: str) -> np.ndarray:
    """The native write_kv_quant's pool bytes for a write case (on a copy of its pool)."""
    native = _native()
    fmt = kv_format(mode)
    keys, values = inp.keys, inp.values
    if keys.ndim == 4:
        keys, values = keys.squeeze(2), values.squeeze(2)
    dst = mx.array(np.array(inp.pool))
    out = native.write_kv_quant(dst, inp.slots, keys, values, fmt.native_mode,
                                rht_signs(keys.shape[-1]) if fmt.rotated else None)
    mx.eval(out)
    return pool_bytes(out)


# --- the references -----------------------------------------------------------------------

@pytest.mark.parametrize("case", write_cases(), ids=lambda c: c.name)
def test_numpy_reference_write_is_the_native_write(case):
    inp = write_inputs(case)
    np.testing.assert_array_equal(_native_write(inp, case.mode), inp.expected)


def test_fp8_reference_encoding_is_torchs():
    """Every float32 of a dense sweep over [-448, 448] (all exponents, ties, subnormals,
    signed zeros) encodes to torch's float8_e4m3fn byte."""
    rng = np.random.default_rng(0)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = e4m3[np.isfinite(e4m3)]
    mids = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2  # every tie
    sweep = np.concatenate([
        finite, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
        rng.uniform(-448, 448, 20000), rng.uniform(-0.05, 0.05, 20000),
        np.ldexp(rng.uniform(1, 2, 2000), rng.integers(-30, -5, 2000)),
        [0.0, -0.0, 448.0, -448.0, 1e-30, -1e-45]]).astype(np.float32)
    sweep = np.clip(sweep, -448, 448)
    want = torch.from_numpy(sweep).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(f32_to_e4m3_reference(sweep), want)


# --- the write kernel's Metal instance ------------------------------------------------------

@pytest.fixture
def emulated_metal(monkeypatch):
    """mx.fast.metal_kernel replaced by MLX's assembly plus the emulator (as in
    test_metal_dialect.py): the call runs on the CPU, its inputs after the run are kept, and
    a byte or fp32 input the kernel wrote (through UNI_WRITABLE) gets the written bytes in its
    own MLX buffer, as on a GPU (so ``mx.depends(pool, token)`` reads them)."""
    runs = []

    def make(*, name, input_names, output_names, source, header="", **_):
        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            _, text = gd.mlx_metal_source(name, input_names, output_names, source, inputs,
                                          template, output_dtypes=output_dtypes, header=header)
            ins, outs = emu.run(text, inputs, output_shapes, output_dtypes, grid, threadgroup)
            for x, after in zip(inputs, ins, strict=True):
                if x.dtype in (mx.int8, mx.uint8, mx.float32):  # pools: cells, fp32 pages
                    mx.eval(x)
                    buf = np.asarray(memoryview(x))
                    if not np.array_equal(buf, after):
                        buf[...] = after
            runs.append((text, ins, outs))
            return [mx.array(o) for o in outs]
        return call

    gd._kernel.cache_clear()
    gpu_paged_quant._kernel.cache_clear()
    monkeypatch.setattr(mx.fast, "metal_kernel", make)
    yield runs
    gd._kernel.cache_clear()
    gpu_paged_quant._kernel.cache_clear()


@needs_clang
@pytest.mark.parametrize("case", cover_each_value(write_cases()))
def test_metal_write_is_the_native_write_byte_for_byte(emulated_metal, case):
    """Every cell at a slot the native write's bytes, every other byte untouched (the padding
    slot -1 skipped), the token written; the text is MLX's assembly of the instance."""
    inp = write_inputs(case)
    native = _native_write(inp, case.mode)
    fmt = kv_format(case.mode)
    signs = rht_signs(case.dim) if fmt.rotated else None
    out = gpu_quant_write.write_kv_quant_gpu(inp.pool, inp.slots, inp.keys, inp.values, fmt,
                                             signs, dialect="metal")
    text, ins, outs = emulated_metal[-1]
    launch = gpu_quant_write.launch_args(inp.pool, inp.slots, inp.keys, inp.values, fmt, signs)
    assert text == gd.assemble_metal(*gpu_quant_write.KERNEL, gpu_quant_write.SOURCE,
                                     launch["inputs"], launch["template"],
                                     output_dtypes=[mx.int32],
                                     header=gpu_quant_write.HEADER)[1]
    got = pool_bytes(ins[0])
    np.testing.assert_array_equal(got, native)
    np.testing.assert_array_equal(got, inp.expected)
    assert outs[0].tolist() == [1]
    assert out.shape == inp.pool.shape and out.dtype == inp.pool.dtype
    np.testing.assert_array_equal(pool_bytes(out), got)  # the result is the written buffer


@needs_clang
@pytest.mark.parametrize("mode,change", [
    ("int8_per_token_head", ("uni_add_rn(q, 0.5f)", "q")),  # truncation for rounding
    ("int4_per_token_head", ("| (uint32_t)zp;", ";")),  # the zero point dropped
    ("fp8_per_token_head", ("(q & 1u) != 0u", "false")),  # ties away instead of to even
    ("int4_per_token_head", ("x[i] + o", "o + x[i] + 0.0f * o")),  # same value: must pass
    ("turboquant_k8v4", ("(x[i] - lo) / scale, 0.5f", "(x[i] - lo) / scale, 0.0f")),  # floor
    ("turboquant_k8v4", ("float k = x[i] < -448.0f ? -448.0f : x[i];",
                         "float k = x[i];")),  # keys not saturated: 0x7f (NaN) beyond 448
    ("turboquant_k8v4", ("return sign | uni_kvq_steps(a, 126u);\n    }\n"
                         "    const unsigned int r = a + 0xfffu", "return sign;\n    }\n"
                         "    const unsigned int r = a + 0xfffu")),  # fp16 subnormals lost
], ids=["int8-rounding", "int4-zero-point", "fp8-ties", "int4-equivalent", "tq-value-floor",
        "tq-key-saturation", "tq-f16-subnormal"])
def test_a_wrong_write_kernel_fails_the_check(emulated_metal, monkeypatch, mode, change):
    """The byte comparison catches a kernel one rule off (and passes an equivalent one)."""
    case = next(c for c in write_cases() if c.mode == mode and c.tokens > 5)
    inp = write_inputs(case)
    fmt = kv_format(mode)
    assert change[0] in gpu_quant_write.SOURCE + gpu_quant_write.HEADER
    monkeypatch.setattr(gpu_quant_write, "SOURCE", gpu_quant_write.SOURCE.replace(*change))
    monkeypatch.setattr(gpu_quant_write, "HEADER", gpu_quant_write.HEADER.replace(*change))
    gpu_quant_write.write_kv_quant_gpu(inp.pool, inp.slots, inp.keys, inp.values, fmt,
                                       rht_signs(case.dim) if fmt.rotated else None,
                                       dialect="metal")
    same = np.array_equal(pool_bytes(emulated_metal[-1][1][0]), inp.expected)
    assert same == (change[1].startswith("o + x[i]"))


def test_write_rejects_bad_input():
    fmt = kv_format("int8_per_token_head")
    pool = mx.zeros((8, 2, fmt.cell_bytes(64)), mx.int8)
    keys = mx.zeros((2, 2, 64))
    slots = mx.array([0, 1], mx.int32)
    kw = dict(dialect="metal")
    with pytest.raises(ValueError, match="not a quantized"):
        gpu_quant_write.write_kv_quant_gpu(pool, slots, keys, keys, kv_format("auto"), None, **kw)
    with pytest.raises(ValueError, match="do not fit"):
        gpu_quant_write.write_kv_quant_gpu(pool, slots, mx.zeros((2, 2, 32)),
                                           mx.zeros((2, 2, 32)), fmt, None, **kw)
    with pytest.raises(ValueError, match="multiples of 32"):
        small = mx.zeros((8, 2, fmt.cell_bytes(48)), mx.int8)
        gpu_quant_write.write_kv_quant_gpu(small, slots, mx.zeros((2, 2, 48)),
                                           mx.zeros((2, 2, 48)), fmt, None, **kw)
    with pytest.raises(ValueError, match="RHT signs"):
        int4 = kv_format("int4_per_token_head")
        gpu_quant_write.write_kv_quant_gpu(mx.zeros((8, 2, int4.cell_bytes(64)), mx.uint8),
                                           slots, keys, keys, int4, None, **kw)
    with pytest.raises(ValueError, match="unknown GPU dialect"):
        gpu_quant_write.write_kv_quant_gpu(pool, slots, keys, keys, fmt, None, dialect="rocm")
    with pytest.raises(ValueError, match="one of float32"):
        gpu_quant_write.write_kv_quant_gpu(pool, slots, keys.astype(mx.int32),
                                           keys.astype(mx.int32), fmt, None, **kw)
    assert gpu_quant_write.write_kv_quant_gpu(pool, slots[:0], keys[:0], keys[:0], fmt, None,
                                              **kw) is pool


# --- the attention kernel's Metal instance --------------------------------------------------

def _emulated_launch(dialect, queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                     decode, fmt, signs, after=None, softcap=None, sinks=None):
    """gpu_paged_quant.launch with the Metal instance run by the CPU emulation (its output rows
    no tile covers start as NaN)."""
    assert dialect == "metal"
    a = gpu_paged_quant.launch_args(queries, kv_pool, tables, tiles, scale, window, block_size,
                                    rows, decode, fmt, signs, softcap=softcap, sinks=sinks)
    _, source = gd.assemble_metal(
        gpu_paged_quant.KERNEL_NAME, gpu_paged_quant.INPUT_NAMES, gpu_paged_quant.OUTPUT_NAMES,
        gpu_paged_quant.SOURCE, a.inputs, a.template, output_dtypes=a.output_dtypes,
        header=gpu_paged_quant.HEADER)
    _, outputs = emu.run(source, a.inputs, a.output_shapes, a.output_dtypes, a.grid,
                         a.threadgroup)
    return mx.array(outputs[0]).astype(queries.dtype)


def _attend(dialect):
    def attend(q, pool, meta, scale, window, fmt, signs, max_chunk, fresh, **options):
        return gpu_paged_quant.paged_gpu_attention_quant(dialect, q, pool, meta, scale, window,
                                                         fmt, signs, max_chunk, fresh,
                                                         **options)
    return attend


@needs_clang
@pytest.mark.parametrize("case", cover_each_value(grid()))
def test_metal_attention_matches_the_reference_on_the_grid(case, monkeypatch):
    """The Metal instance, emulated, through paged_gpu_attention_quant: max abs error 1e-5
    (fp32), 2e-2 (bf16) against the reference over the dequantized pool."""
    monkeypatch.setattr(gpu_paged_quant, "launch", _emulated_launch)
    err = max_error(case, _attend("metal"))
    assert err <= TOLERANCE[case.dtype], f"{case.name}: max abs error {err}"


@needs_clang
@pytest.mark.parametrize("case", cover_each_value(option_grid()))
def test_metal_attention_with_softcap_and_sinks_matches_the_reference(case, monkeypatch):
    """The quantized kernel's Metal instance with the SOFTCAP and SINKS options, emulated,
    through paged_gpu_attention_quant, against the reference over the dequantized pool."""
    monkeypatch.setattr(gpu_paged_quant, "launch", _emulated_launch)
    err = max_error(case, _attend("metal"))
    assert err <= TOLERANCE[case.dtype], f"{case.name}: max abs error {err}"


@needs_clang
@pytest.mark.parametrize("change", [
    ("s[g] = uni_simd_sum(t) * ks;", "s[g] = uni_simd_sum(t);"),  # the key scale dropped
    ("qi < nrows && j < lr &&", "qi < nrows && j <= lr &&"),  # a row sees the next key
    ("static_cast<T>((srot[c][d] * signs[d % BLK]) / (float)BLK)",
     "static_cast<T>(srot[c][d] / (float)BLK)"),  # int4: the output's signs forgotten
    ("& 15u) * vs + vz;", "& 15u) * vs;"),  # turboquant: the value minimum dropped
    ("q * s + min\n                kf[e] = uni_kvq_e4m3_value((uint32_t)kc[c]);",
     "q * s + min\n                kf[e] = uni_kvq_e4m3_value((uint32_t)kc[c] & 0x7fu);"),
], ids=["key-scale", "one-key-more", "int4-signs", "tq-value-min", "tq-key-sign"])
def test_a_wrong_attention_kernel_fails_the_check(monkeypatch, change):
    mode = "turboquant_k8v4" if "vs + vz" in change[0] or "0x7fu" in change[1] \
        else "int4_per_token_head"
    case = next(c for c in grid(("float32",)) if c.mode == mode and c.kind == "mixed")
    assert change[0] in gpu_paged_quant.SOURCE
    monkeypatch.setattr(gpu_paged_quant, "SOURCE", gpu_paged_quant.SOURCE.replace(*change))
    monkeypatch.setattr(gpu_paged_quant, "launch", _emulated_launch)
    err = max_error(dataclasses.replace(case, route="kernel"), _attend("metal"))
    assert not err <= TOLERANCE[case.dtype], err  # NaN fails too


@needs_clang
@pytest.mark.parametrize("kind", ["prefill", "long"])
def test_turboquant_chunks_that_vllm_attends_unquantized_fail_over_cells(monkeypatch, kind):
    """The grid's TurboQuant steps would fail if the chunks vLLM's TurboQuant backend attends
    over their own unquantized K/V read cells instead: ``prefill``'s chunks that start their
    sequence (to the kernel here), ``long``'s 150-token continuation (its own rows from the
    cells)."""
    from vllm_unified.kv.gpu import paged as gpu_paged

    case = next(c for c in grid(("float32",)) if c.mode == "turboquant_k8v4"
                and c.kind == kind)
    monkeypatch.setattr(gpu_paged_quant, "launch", _emulated_launch)
    assert max_error(case, _attend("metal")) <= TOLERANCE[case.dtype]
    if kind == "long":  # the long chunk's own rows from the cells
        chunk = reference.quantized_chunk_attention
        monkeypatch.setattr(reference, "quantized_chunk_attention",
                            lambda *a, **k: chunk(*a[:7]))
    else:  # fresh chunks to the kernel, over the cells
        monkeypatch.setattr(gpu_paged.AttentionMetadata, "gpu_plan",
                            lambda self, rows, fresh, limit: self._make_gpu_plan(
                                rows, False, 1 << 20))
    err = max_error(dataclasses.replace(case, route="kernel"), _attend("metal"))
    assert not err <= TOLERANCE[case.dtype], err


def test_grid_covers_formats_head_sizes_kinds_windows_and_routes():
    cases = grid()
    for dtype in ("float32", "bfloat16"):
        sub = [c for c in cases if c.dtype == dtype]
        assert {(c.mode, c.kind) for c in sub} == {(m, k) for m in MODES
                                                   for k in ("decode", "prefill", "mixed")} \
            | {("turboquant_k8v4", "long")}
    assert {(c.mode, c.dim) for c in cases} == {(m, d) for m in MODES
                                                for d in (64, 96, 128, 256)}
    assert {c.window for c in cases} == {None, 16, 61}
    assert {(c.kind, c.route) for c in cases} >= {("prefill", "kernel"), ("prefill", "split"),
                                                  ("mixed", "kernel"), ("mixed", "split")}
    assert {c.group for c in cases} == {1, 2, 4, 8} and {c.kv_heads for c in cases} == {1, 2}
    assert {(c.mode, c.dtype) for c in write_cases()} == {(m, d) for m in MODES
                                                          for d in DTYPES}


@pytest.mark.parametrize("group,dim", [(g, d) for g in (1, 2, 4, 7, 8) for d in (64, 96, 256)])
@pytest.mark.parametrize("rotated", [False, True])
def test_launch_shape_stays_within_shared_memory(group, dim, rotated):
    rows = gpu_paged_quant.q_tile(group, dim, rotated)
    for r in (1, rows):
        warps, cb = gpu_paged_quant.launch_shape(group, dim, r, rotated)
        qg = r * group
        used = 4 * (warps * (2 * qg + cb * dim) + (qg if rotated else 1) * dim)
        assert warps in (16, 8, 4, 2, 1) and 1 <= cb <= qg
        assert used <= gpu_paged_quant.gpu_paged.SHARED_BYTES, (r, warps, cb, used)


# --- the CUDA instances' text ---------------------------------------------------------------

@pytest.mark.parametrize("which", ["write", "attention"])
def test_cuda_instances_hold_the_cuda_prelude_only(which):
    """The CUDA instance (the text mx.fast.cuda_kernel gets) has the CUDA helpers the bodies
    use and none of Metal's names; the Metal instance none of CUDA's."""
    from test_metal_dialect import CUDA_NAMES, METAL_NAMES, _has

    source, header = ((gpu_quant_write.SOURCE, gpu_quant_write.HEADER) if which == "write"
                      else (gpu_paged_quant.SOURCE, gpu_paged_quant.HEADER))
    cuda_header, cuda_source = gd.instance_source(source, dialect="cuda", header=header)
    metal_header, metal_source = gd.instance_source(source, dialect="metal", header=header)
    cuda, metal = cuda_header + cuda_source, metal_header + metal_source
    for helper in ("__fmul_rn", "__fadd_rn", "__float_as_uint", "__uint_as_float",
                   "#define UNI_FUNC __device__ __forceinline__"):
        assert helper in cuda, helper
    assert "metal::fma(a, b, 0.0f)" in metal and "as_type<uint32_t>" in metal
    for name in METAL_NAMES:
        assert not _has(cuda, name), name
    for name in CUDA_NAMES:
        assert not _has(metal, name), name


# --- the backend decision and the routing ---------------------------------------------------

def test_profiles_name_their_quantized_kv_kernels():
    metal, cuda = profile_for("metal", "metal"), profile_for("cuda", "cuda")
    assert metal.quantized_kv == "metal" and cuda.quantized_kv == "cuda"
    assert dataclasses.replace(metal, gpu_attention=None).quantized_kv is None
    assert dataclasses.replace(cuda, kv_write="scatter").quantized_kv is None
    cpu = profile_for("cpu", "cpu")
    assert cpu.quantized_kv == ("native" if cpu.cpu_attention else None)
    assert dataclasses.replace(cpu, cpu_attention=False).quantized_kv is None
    # a GPU build of MLX forced onto the CPU: MLX-owned pool, no kernels
    assert profile_for("cpu", "cuda").quantized_kv is None


def _cache(profile, dim=64, recurrent=(), name="int8_per_token_head", skip=()):
    from vllm_unified.kv.cache import AttentionShape, KVCache
    from vllm_unified.kv.hybrid import HybridLayers

    layers = HybridLayers("qwen3_next" if recurrent else "llama", 4, list(recurrent))
    return KVCache(profile, layers, AttentionShape(2, dim, torch.bfloat16, name, tuple(skip)),
                   {i: None for i in layers.attention}, mx.bfloat16)


@pytest.mark.parametrize("kind", ["metal", "cuda"])
def test_gpu_profiles_serve_the_formats_and_refuse_the_rest(kind):
    profile = profile_for(kind, kind)
    for name in MODES:
        assert _cache(profile, name=name).fmt.name == name
        assert f"by the {kind} kernel" in _cache(profile, name=name).describe_format()
    with pytest.raises(ValueError, match="int4_per_token_head: the .* multiples of 32 up to 256"):
        _cache(profile, dim=80, name="int4_per_token_head")
    with pytest.raises(ValueError, match="hybrid"):
        _cache(profile, recurrent=[1, 3])
    with pytest.raises(ValueError, match="--kv-cache-dtype int8_per_token_head: quantized"):
        _cache(dataclasses.replace(profile, gpu_attention=None))
    # layers kept in the model dtype next to quantized ones, each on its format's kernels
    for name in MODES:
        cache = _cache(profile, name=name, skip=["0", "1"])
        assert cache.skipped_layers() == [0, 1]
        assert [f.name for f in cache._pool_formats()] == ["auto", "auto", name, name]
        assert "layers 0, 1 in bfloat16" in cache.describe_format()
    assert _cache(profile, name="auto", skip=["0"]).skipped_layers() == []


def test_mlx_owned_quantized_pool_is_written_by_the_cuda_kernel(monkeypatch):
    """allocate_mlx with a quantized format on the CUDA write path: uint8 cells, writes and
    zeroing through the GPU kernels of the CUDA dialect (stood in by the native write, same
    contract), attention through the quantized GPU kernel."""
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.gpu import write as gpu_write
    from vllm_unified.kv.pool import KVPool

    native = _native()
    fmt = kv_format("int4_per_token_head")
    calls = []

    def write(pool, slots, keys, values, fmt_, signs, *, dialect, tokens=None):
        calls.append(("write", dialect))
        keys, values = keys.squeeze(2), values.squeeze(2)
        return native.write_kv_quant(pool, slots, keys, values, fmt_.native_mode, signs)

    def rows(dst, idx, src, *, dialect):
        calls.append(("rows", dialect))
        return bridge.write_rows(dst, idx, src)

    monkeypatch.setattr(gpu_quant_write, "write_kv_quant_gpu", write)
    monkeypatch.setattr(gpu_write, "write_rows_gpu", rows)
    pool = KVPool.allocate_mlx(1, 4, 16, 2, 64, mx.float32, write="cuda_kernel", fmt=fmt)
    assert pool.kv[0].dtype == mx.uint8 and pool.kv[0].shape == (64, 2, fmt.cell_bytes(64))
    assert pool.write_path == "cuda_kernel" and pool.signs is not None
    assert KVPool.allocate_mlx(1, 4, 16, 2, 64, mx.float32, cuda_write=True,
                               fmt=fmt).write_path == "cuda_kernel"
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((20, 2, 1, 64)).astype(np.float32))
    slots = mx.arange(40, 60, dtype=mx.int32)  # blocks 2 and 3
    pool.write(0, slots, k, k * 0.5)
    pool.zero_blocks([3])
    mx.eval(pool.kv)
    assert calls == [("write", "cuda"), ("rows", "cuda")]
    cells = np.array(pool.kv[0])
    assert cells[40:48].any(axis=(1, 2)).all() and not cells[48:].any()

    launches = []

    def launch(dialect, queries, *args):
        launches.append(dialect)
        return mx.zeros(queries.shape, queries.dtype)

    monkeypatch.setattr(gpu_paged_quant, "launch", launch)
    profile = profile_for("cuda", "cuda")
    meta = build_attention_metadata([1], [20], np.array([[0, 1]], np.int32), 16)
    out = paged.paged_attention_kv(mx.zeros((1, 4, 1, 64)), pool.kv[0], meta, 0.125, None,
                                   backend=profile, kv_format=fmt, rht_signs=pool.signs)
    mx.eval(out)
    assert launches == ["cuda"] and out.shape == (1, 4, 1, 64)
    with pytest.raises(RuntimeError, match="neither of which"):
        paged.paged_attention_kv(mx.zeros((1, 4, 1, 64)), pool.kv[0], meta, 0.125, None,
                                 backend=dataclasses.replace(profile, gpu_attention=None),
                                 kv_format=fmt, rht_signs=pool.signs)


def _adopt_as_metal_would(monkeypatch, native) -> None:
    """MLX's import of the shared pool and its memory calls stood in on the CPU, as
    test_metal_memory does: ``from_dlpack`` adopts the torch bytes without a copy."""
    monkeypatch.setattr(mx, "from_dlpack", lambda t, copy=None: native.adopt(
        t.data_ptr(), t.numel() * t.element_size(), list(t.shape), bridge.mlx_dtype(t.dtype), t))
    monkeypatch.setattr(mx, "device_info", lambda: {"max_buffer_length": 1 << 40})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: 8 * 2**30)
    monkeypatch.setattr(mx, "get_memory_limit", lambda: 12 * 2**30)
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: 12 * 2**30)


@pytest.mark.parametrize("name", MODES)
def test_metal_quantized_cache_writes_vllms_views_in_place(name, monkeypatch, default_model):
    """The Metal profile's KV cache for a quantized format: vLLM's layout in the torch buffer
    shared with MLX (the import stood in as test_metal_memory does), written by the Metal
    quantizing kernel (stood in by the native write, same contract): the bytes land in vLLM's
    own views, the pool's pointers unchanged."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    from vllm_unified.kv.allocation import KV_LAYOUT, slot_major
    from vllm_unified.kv.cache import layer_name
    from vllm_unified.kv.gpu import quant_write as gqw
    from vllm_unified.kv.quant import attention_spec

    native = _native()
    monkeypatch.setattr(bridge, "_backend", lambda: "metal")
    _adopt_as_metal_would(monkeypatch, native)
    seen = []

    def write(pool, slots, keys, values, fmt, signs, *, dialect, tokens=None):
        seen.append(dialect)
        if keys.ndim == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        return native.write_kv_quant(pool, slots, keys, values, fmt.native_mode, signs)

    monkeypatch.setattr(gqw, "write_kv_quant_gpu", write)
    cfg = EngineArgs(model=default_model, max_model_len=256,
                     enable_prefix_caching=False).create_engine_config()
    cfg.cache_config.kv_cache_layout = KV_LAYOUT
    fmt = kv_format(name)
    spec = attention_spec(fmt, block_size=16, num_kv_heads=2, head_size=64,
                          dtype=torch.bfloat16)
    kv_config = get_kv_cache_configs(cfg, [{layer_name(i): spec for i in range(4)}],
                                     [64 * spec.page_size_bytes * 4])[0]
    cache = _cache(profile_for("metal", "metal"), name=name)
    cache.initialize(kv_config, KV_LAYOUT)
    pool = cache.pool
    assert pool.shared and pool.write_path == "metal_kernel" and pool.fmt == fmt
    before = pool.data_ptrs()
    rng = np.random.default_rng(2)
    k = mx.array(rng.standard_normal((5, 2, 1, 64)).astype(np.float32)).astype(mx.bfloat16)
    slots = mx.array([17, 3, 40, 41, 0], mx.int32)
    pool.write(1, slots, k, k)
    mx.eval(pool.kv)
    assert seen == ["metal"] and pool.data_ptrs() == before
    raw = slot_major(cache.connector_views()[layer_name(1)]).view(torch.uint8)
    got = pool_bytes(pool.kv[1])
    np.testing.assert_array_equal(raw.numpy(), got)
    assert got[17].any() and not got[16].any()


# --- the H200 check, run here with the Metal instances emulated ----------------------------

@pytest.mark.slow  # the whole format grid again; the grid's fast cases cover each kernel
@needs_clang
def test_h200_check_reports_worst_figures_per_format(emulated_metal, monkeypatch):
    """benchmarks/cuda.py decode's quantized-KV check (what the H200 runs in check-only mode)
    end to end, with the CUDA launches replaced by the Metal instances of the same bodies
    under the emulation: every write exact, every attention case within tolerance, worst
    figures per format."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "measure" / "cuda_decode.py"
    spec = importlib.util.spec_from_file_location("cuda_decode_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    real_write = gpu_quant_write.write_kv_quant_gpu
    real_attention = gpu_paged_quant.paged_gpu_attention_quant

    def write(*args, dialect, tokens=None):
        assert dialect == "cuda"
        return real_write(*args, dialect="metal", tokens=tokens)

    def attention(dialect, *args):
        assert dialect == "cuda"
        return real_attention("metal", *args)

    monkeypatch.setattr(gpu_quant_write, "write_kv_quant_gpu", write)
    monkeypatch.setattr(gpu_paged_quant, "paged_gpu_attention_quant", attention)
    monkeypatch.setattr(gpu_paged_quant, "launch", _emulated_launch)
    report = bench.kvquant_check(mx)
    print({k: v for k, v in report.items()
           if k not in ("write_bytes_differing", "attention_max_abs_error")})
    assert report["all_exact_and_within_tolerance"], report["failed"]
    assert report["write_cases"] == len(write_cases())
    assert report["attention_cases"] == len(grid())
    assert report["worst_write_bytes_differing"] == {m: 0 for m in MODES}
    worst = report["worst_attention_max_abs_error"]
    assert set(worst) == {f"{m}/{d}" for m in MODES for d in ("float32", "bfloat16")}
    assert all(worst[f"{m}/float32"] <= 1e-5 and worst[f"{m}/bfloat16"] <= 2e-2 for m in MODES)


@needs_clang
@pytest.mark.parametrize("kind", ["metal", "cuda"])
@pytest.mark.parametrize("name, flag", [("turboquant_k8v4", None),
                                        ("int8_per_token_head", ["0", "1"])],
                         ids=["turboquant", "int8-skip-0-1"])
def test_mixed_precision_pool_on_the_emulated_gpu_kernels(emulated_metal, monkeypatch,
                                                          default_model, name, flag, kind):
    """A quantized cache with layers kept in the model dtype on a GPU profile
    (turboquant_k8v4's boundary layers; int8_per_token_head with
    ``--kv-cache-dtype-skip-layers 0 1``), vLLM's one group of UniformTypeKVCacheSpecs. Metal:
    the torch buffer shared with MLX (the import stood in as test_metal_memory does), the bytes
    landing in vLLM's own views; CUDA: MLX-owned arrays, each layer in its own format. Each
    layer is written by its format's GPU kernel and attended by its format's paged GPU kernel,
    the Metal instances emulated (CUDA's calls run the same bodies' Metal instances), and every
    checked layer (skipped and quantized) equals the reference over its own pages."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core import kv_cache_utils

    from vllm_unified.kv.allocation import KV_LAYOUT, slot_major
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.cache import AttentionShape, KVCache, layer_name
    from vllm_unified.kv.gpu import paged as gpu_paged
    from vllm_unified.kv.hybrid import HybridLayers

    native = _native()
    gpu_paged._kernel.cache_clear()
    if kind == "cuda":  # the same bodies' Metal instances, under the emulation
        kernel = gd.kernel
        monkeypatch.setattr(gd, "kernel", lambda *a, dialect, **k: kernel(*a, dialect="metal",
                                                                          **k))
    monkeypatch.setattr(bridge, "_backend", lambda: kind)
    _adopt_as_metal_would(monkeypatch, native)
    cfg = EngineArgs(model=default_model, max_model_len=256, enable_prefix_caching=False,
                     kv_cache_dtype=name,
                     **({"kv_cache_dtype_skip_layers": flag} if flag else {})
                     ).create_engine_config()
    cfg.cache_config.kv_cache_layout = KV_LAYOUT
    block = cfg.cache_config.block_size
    skip = cfg.cache_config.kv_cache_dtype_skip_layers
    profile = profile_for(kind, kind)
    cache = KVCache(profile, HybridLayers("llama", 30, []),
                    AttentionShape(3, 64, torch.float32, name, tuple(skip)),
                    dict.fromkeys(range(30)), mx.float32)
    groups = kv_cache_utils.get_kv_cache_groups(cfg, cache.kv_cache_spec(block, cfg))
    cache.initialize(kv_cache_utils.get_kv_cache_config_from_groups(cfg, groups, 8 << 20),
                     KV_LAYOUT)
    pool = cache.pool
    assert pool.shared == (kind == "metal") and pool.write_path == f"{kind}_kernel"
    assert cache.skipped_layers() == [int(i) for i in skip]
    before = pool.data_ptrs()
    rng = np.random.default_rng(3)
    lens, query_lens = [70, 30], [1, 30]  # a decode row; a chunk that starts its sequence
    tables = np.array([[1, 2], [3, 0]], np.int32)
    slots = np.concatenate([tables[b, np.arange(n) // block] * block + np.arange(n) % block
                            for b, n in enumerate(lens)]).astype(np.int32)
    own = np.array([69, *range(70, 100)])
    q = mx.array(rng.standard_normal((31, 9, 1, 64)).astype(np.float32))
    checked = [0, 2, 29]
    for j in checked:  # skipped, quantized, skipped (TurboQuant) / quantized (int8)
        k = rng.standard_normal((len(slots), 3, 1, 64)).astype(np.float32)
        v = rng.standard_normal((len(slots), 3, 1, 64)).astype(np.float32)
        pool.write(j, mx.array(slots), mx.array(k), mx.array(v))
        mx.eval(pool.kv)
        fmt = pool.layer_format(j)
        assert fmt.quantized == (str(j) not in skip), j
        assert pool.kv[j].shape[-1] == (fmt.cell_bytes(64) if fmt.quantized else 128), j
        if kind == "metal":
            view = slot_major(cache.connector_views()[layer_name(j)]).view(torch.uint8)
            np.testing.assert_array_equal(view.numpy().reshape(len(view), -1),
                                          pool_bytes(pool.kv[j]).reshape(len(view), -1))
        meta = build_attention_metadata(query_lens, lens, tables, block)
        fresh = (mx.array(k[own]), mx.array(v[own]))
        kw = dict(kv_format=fmt, rht_signs=pool.signs, fresh=fresh)
        want = np.array(paged.paged_attention_kv(q, pool.kv[j], meta, 0.125, None,
                                                 accelerate=False, **kw))
        runs = len(emulated_metal)
        got = np.array(paged.paged_attention_kv(q, pool.kv[j], meta, 0.125, None,
                                                backend=profile, **kw))
        assert len(emulated_metal) > runs, "no Metal kernel ran"
        assert np.abs(want).max() > 0.1, j  # the pages hold this step's rows
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), j
    assert pool.data_ptrs() == before
    gpu_paged._kernel.cache_clear()


def test_turboquant_without_the_steps_own_kv_is_refused():
    """turboquant_k8v4 prefill chunks that vLLM attends over their own unquantized K/V need
    them (``fresh``): without, a clear error before any launch."""
    from vllm_unified.kv.attention.metadata import build_attention_metadata

    fmt = kv_format("turboquant_k8v4")
    pool = mx.zeros((64, 2, fmt.cell_bytes(64)), mx.uint8)
    tables = np.array([[0, 1], [2, 3]], np.int32)
    prefill = build_attention_metadata([20, 1], [20, 30], tables, 16)
    with pytest.raises(ValueError, match="turboquant_k8v4: prefill chunks that start their "
                                         "sequence .* 128 tokens .* not given"):
        gpu_paged_quant.paged_gpu_attention_quant("metal", mx.zeros((21, 4, 1, 64)), pool,
                                                  prefill, 0.125, None, fmt, None)
