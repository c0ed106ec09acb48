"""The per-head q/k norms and RoPE folded into the GPU kernels of pure-decode steps.

* :func:`qk_prologue.prologue_of` reads mlx-lm's modules (which it takes, which it declines),
  and the pure-MLX oracle :func:`qk_prologue.reference` equals mlx-lm's own ``q_norm`` /
  ``k_norm`` and RoPE modules;
* the Metal instances of the prologue KV write and of the attention kernel's query prologue,
  assembled as ``mx.fast.metal_kernel`` assembles them and run by the CPU emulation of Metal's
  thread model (``tests/metal_emulation.py``), against the oracle (the CUDA instances are
  checked on the same cases on the GPU by ``benchmarks/cuda.py decode``);
* the swapped attention classes (models/decode_attention.py): a pure-decode step through the
  emulated kernels gives the logits and the KV pool of the unfused path, other steps and other
  caches take mlx-lm's own ``__call__``.
"""

from __future__ import annotations

from dataclasses import replace

import metal_emulation as emu
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import cover_each_value
from gpu_attention_grid import (
    TOLERANCE,
    build,
    make_prologue,
    prologue_grid,
    prologue_max_error,
    write_cases,
    write_error,
)
from mlx_lm.models import llama, qwen2, qwen3, qwen3_moe
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE

from vllm_unified import gpu_dialect
from vllm_unified.backend import profile
from vllm_unified.kv.attention import qk_prologue
from vllm_unified.kv.attention.metadata import build_attention_metadata
from vllm_unified.kv.attention.qk_prologue import QKPrologue, prologue_of, reference
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.gpu import paged as gpu_paged
from vllm_unified.kv.gpu import write as gpu_write
from vllm_unified.kv.layer_cache import PagedLayerCache
from vllm_unified.kv.pool import KVPool
from vllm_unified.kv.quant import kv_format
from vllm_unified.models.decode_attention import (
    FusedDecodeAttention,
    install_fused_decode_attention,
)
from vllm_unified.models.routing import install_paged_attention
from vllm_unified.worker.forward import forward

needs_clang = emu.needs_clang


# --- reading mlx-lm's modules --------------------------------------------------------------

def _qwen3_attention(head_dim=64, **extra) -> qwen3.Attention:
    args = qwen3.ModelArgs.from_dict(dict(
        model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=100,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=50000.0,
        tie_word_embeddings=True, **extra))
    mx.random.seed(1)
    attn = qwen3.Attention(args)
    attn.q_norm.weight = 1 + 0.3 * mx.random.normal((head_dim,))
    attn.k_norm.weight = 1 + 0.3 * mx.random.normal((head_dim,))
    return attn


def _llama_attention(**extra) -> llama.Attention:
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=1,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=100, head_dim=32, **extra)
    return llama.Attention(args)


def test_prologue_of_reads_norms_and_rotation():
    attn = _qwen3_attention()
    p = prologue_of(attn, 64)
    assert p is not None and p.norm and p.rope == 1 and p.head_dim == 64
    params = np.array(p.params)
    assert params.shape == (2 + 32 + 128,) and params[0] == np.float32(1e-5) and params[1] == 1
    np.testing.assert_array_equal(params[34:98], np.array(attn.q_norm.weight))
    np.testing.assert_array_equal(params[98:], np.array(attn.k_norm.weight))
    # mx.fast.rope's inverse frequencies: 2^(-(i / (D/2)) log2(base))
    np.testing.assert_allclose(params[2:34], 50000.0 ** (-np.arange(32) / 32), rtol=1e-6)

    trad = prologue_of(_llama_attention(rope_traditional=True), 32)
    assert trad is not None and not trad.norm and trad.rope == 2
    scaled = _llama_attention(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "original_max_position_embeddings": 64})
    assert type(scaled.rope) is Llama3RoPE
    p3 = prologue_of(scaled, 32)
    np.testing.assert_allclose(np.array(p3.params)[2:18],
                               1 / np.array(scaled.rope._freqs), rtol=1e-6)


@pytest.mark.parametrize("case", ["partial_rotary", "yarn", "one_norm", "other_eps",
                                  "head_48", "head_96", "layer_norm"])
def test_prologue_of_declines_what_the_kernels_do_not_compute(case):
    attn = _qwen3_attention()
    head_dim = 64
    if case == "partial_rotary":
        attn.rope = nn.RoPE(32, base=10000.0)
    elif case == "yarn":
        attn.rope = YarnRoPE(64, base=10000.0)
    elif case == "one_norm":
        del attn.k_norm
    elif case == "other_eps":
        attn.k_norm = nn.RMSNorm(64, eps=1e-3)
    elif case in ("head_48", "head_96"):
        head_dim = int(case[-2:])
    else:
        attn.q_norm = nn.LayerNorm(64)
    assert prologue_of(attn, head_dim) is None


@pytest.mark.parametrize("family", ["qwen3", "llama_traditional", "llama3_scaled"])
def test_reference_equals_mlx_lm_modules(family):
    """The oracle (plain MLX ops in the kernels' order) against mlx-lm's own modules
    (``mx.fast.rms_norm``, ``mx.fast.rope`` with one offset per row), fp32."""
    if family == "qwen3":
        attn, dim, heads = _qwen3_attention(), 64, 4
    elif family == "llama_traditional":
        attn, dim, heads = _llama_attention(rope_traditional=True), 32, 4
    else:
        attn, dim, heads = _llama_attention(rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}), 32, 4
    p = prologue_of(attn, dim)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((7, heads, 1, dim)).astype(np.float32))
    positions = mx.array([0, 1, 5, 17, 64, 130, 255], dtype=mx.int32)
    for which, norm in ((0, getattr(attn, "q_norm", None)), (1, getattr(attn, "k_norm", None))):
        want = norm(x) if norm is not None else x
        want = attn.rope(want, offset=positions)
        got = reference(x, p, which, positions)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)


def test_build_checks_its_arguments():
    with pytest.raises(ValueError, match="head size 48"):
        QKPrologue.build(48, None)
    with pytest.raises(ValueError, match="inv_freq"):
        QKPrologue.build(64, np.ones(16, np.float32))
    p = QKPrologue.build(64, None)
    assert p.template() == [("NORM", 0), ("ROPE", 0)]


# --- the Metal instances, emulated ----------------------------------------------------------

def _emulate(name, input_names, output_names, source, a, header=""):
    _, text = gpu_dialect.assemble_metal(name, input_names, output_names, source, a["inputs"],
                                         a["template"], output_dtypes=a["output_dtypes"],
                                         header=header)
    return emu.run(text, a["inputs"], a["output_shapes"], a["output_dtypes"], a["grid"],
                   a["threadgroup"])


def _emulated_write(pool, slots, keys, values, positions, prologue):
    a = gpu_write.write_kv_qk_launch(pool, slots, keys, values, positions, prologue)
    ins, outs = _emulate(*gpu_write.WRITE_KV_QK_KERNEL, gpu_write.WRITE_KV_QK_SOURCE, a)
    assert outs[0].tolist() == [1]
    return mx.array(ins[0])


@needs_clang
@pytest.mark.parametrize("case", write_cases(), ids=lambda c: c.name)
def test_metal_prologue_write_matches_the_reference(case):
    worst, others_kept = write_error(case, _emulated_write)
    assert worst <= 1, f"{case.name}: worst error {worst} tolerances"
    assert others_kept


@needs_clang
def test_a_wrong_prologue_fails_the_write_check(monkeypatch):
    """A rotation by the wrong partner lane, or no norm, is caught."""
    case = next(c for c in write_cases() if c.rope == 1 and c.norm and c.dtype == "float32")
    body = gpu_write.WRITE_KV_QK_SOURCE
    for wrong in (body.replace("uni_shfl_xor(kx[e], 16)", "uni_shfl_xor(kx[e], 8)"),
                  body.replace("if (NORM) {", "if (false) {")):
        assert wrong != body
        monkeypatch.setattr(gpu_write, "WRITE_KV_QK_SOURCE", wrong)
        assert write_error(case, _emulated_write)[0] > 1


def _emulated_launch(dialect, queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                     decode, prologue=None, after=None, softcap=None, sinks=None):
    """gpu_paged.launch with the Metal instance run by the CPU emulation."""
    assert dialect == "metal"
    a = gpu_paged.launch_args(queries, kv_pool, tables, tiles, scale, window, block_size, rows,
                              decode, prologue, softcap=softcap, sinks=sinks)
    name, inputs, outputs = gpu_paged.kernel_spec(prologue is not None)
    _, (out,) = _emulate(name, inputs, outputs, gpu_paged.kernel_source(prologue is not None),
                         a.__dict__, header=gpu_paged.HEADER)
    return mx.array(out).astype(queries.dtype)


@needs_clang
@pytest.mark.parametrize("case,rope,norm", cover_each_value(
    prologue_grid(), name=lambda c: "-".join(getattr(x, "name", str(x)) for x in c)))
def test_metal_query_prologue_matches_the_reference(case, rope, norm, monkeypatch):
    """Decode steps of every head size and GQA group, block sizes and windows of the grid,
    each with a prologue: max abs error 1e-5 fp32, 2e-2 bf16."""
    monkeypatch.setattr(gpu_paged, "launch", _emulated_launch)

    def attend(q, pool, meta, scale, window, prologue):
        return gpu_paged.paged_gpu_attention("metal", q, pool, meta, scale, window,
                                             prologue=prologue)

    err = prologue_max_error(case, rope, norm, attend)
    assert err <= TOLERANCE[case.dtype], f"{case.name}: max abs error {err}"


@needs_clang
def test_metal_query_prologue_with_softcap_and_sinks(monkeypatch):
    """The fused decode path's kernel (query prologue) takes the attention options too: one
    decode step with soft-capping and sinks against the reference over the reference
    prologue's queries."""
    from vllm_unified.kv.attention.reference import paged_attention_kv

    monkeypatch.setattr(gpu_paged, "launch", _emulated_launch)
    case = next(c for c in prologue_grid(("float32",)) if c[0].group == 4)[0]
    b = build(case)
    prologue = make_prologue(case.dim, 1, True, case.seed)
    heads = case.group * case.kv_heads
    options = {"softcap": 0.8,
               "sinks": mx.array(np.linspace(-1.0, 2.0, heads).astype(np.float32))}
    positions = mx.array(b.meta.host_positions.astype(np.int32))
    with mx.stream(mx.cpu):
        q = reference(b.queries, prologue, 0, positions)
        want = np.array(paged_attention_kv(q, b.pool, b.meta, b.scale, case.window, **options))
    got = np.array(gpu_paged.paged_gpu_attention("metal", b.queries, b.pool, b.meta, b.scale,
                                                 case.window, prologue=prologue, **options))
    assert np.abs(got - want).max() <= TOLERANCE["float32"]
    plain = np.array(gpu_paged.paged_gpu_attention("metal", b.queries, b.pool, b.meta, b.scale,
                                                   case.window, prologue=prologue))
    assert np.abs(plain - want).max() > 1e-3


def test_the_query_prologue_is_for_decode_steps_only():
    meta = build_attention_metadata([3, 1], [3, 9], np.array([[0], [1]], np.int32), 16)
    with pytest.raises(ValueError, match="pure-decode"):
        gpu_paged.paged_gpu_attention("metal", mx.zeros((4, 2, 1, 64)), mx.zeros((32, 1, 128)),
                                      meta, 0.1, None, prologue=QKPrologue.build(64, None))


def test_prologue_write_rejects_bad_input():
    pool = mx.zeros((64, 2, 128))
    p = QKPrologue.build(64, None)
    slots, keys = mx.array([1, 2], mx.int32), mx.zeros((2, 1, 128))
    with pytest.raises(ValueError, match="keys"):
        gpu_write.write_kv_qk_gpu(pool, slots, mx.zeros((2, 1, 64)), keys, slots, p,
                                  dialect="metal")
    with pytest.raises(ValueError, match="positions"):
        gpu_write.write_kv_qk_gpu(pool, slots, keys, keys, slots[:1], p, dialect="metal")
    with pytest.raises(ValueError, match="prologue of head size 64, pool of 32"):
        gpu_write.write_kv_qk_gpu(mx.zeros((64, 4, 64)), slots, keys, keys, slots,
                                  QKPrologue.build(64, None), dialect="metal")


# --- the swapped attention classes --------------------------------------------------------

LAYERS, KV_HEADS, DIM, BS, BLOCKS = 2, 2, 64, 16, 12


def _model(family: str) -> nn.Module:
    common = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=KV_HEADS, vocab_size=120,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)
    mx.random.seed(4)
    if family == "qwen3":
        model = qwen3.Model(qwen3.ModelArgs.from_dict(dict(
            model_type="qwen3", head_dim=DIM, max_position_embeddings=512, rope_theta=1e4,
            **common)))
        for layer in model.layers:  # norms that are not all ones
            layer.self_attn.q_norm.weight = 1 + 0.3 * mx.random.normal((DIM,))
            layer.self_attn.k_norm.weight = 1 + 0.3 * mx.random.normal((DIM,))
    elif family == "qwen3_moe":
        model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(dict(
            model_type="qwen3_moe", head_dim=DIM, max_position_embeddings=512,
            rope_theta=1e4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[], moe_intermediate_size=64, norm_topk_prob=True, **common)))
        for layer in model.layers:
            layer.self_attn.q_norm.weight = 1 + 0.3 * mx.random.normal((DIM,))
            layer.self_attn.k_norm.weight = 1 + 0.3 * mx.random.normal((DIM,))
    elif family == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs.from_dict(dict(model_type="qwen2", **common)))
    else:
        model = llama.Model(llama.ModelArgs(model_type="llama", head_dim=DIM,
                                            rope_traditional=True, **common))
    mx.eval(model.parameters())
    install_paged_attention(model)
    return model


def _pool() -> KVPool:
    pool = KVPool.allocate_mlx(LAYERS, BLOCKS, BS, KV_HEADS, DIM, mx.float32)
    rng = np.random.default_rng(3)
    pool.kv = [mx.array(rng.standard_normal(a.shape).astype(np.float32)) for a in pool.kv]
    pool.write_path = "metal_kernel"
    return pool


def _emulated_kernels(monkeypatch, afters: list | None = None) -> list[str]:
    """Every GPU kernel runs its Metal instance on the emulation; returns the names called
    (and appends to ``afters`` the ``after`` input of each attention call). A write kernel's
    destination after the run (the emulation writes into a copy of it) is what
    ``ordered_after`` hands on, so readers and the test see the rows it wrote."""
    called: list[str] = []
    written: dict[int, mx.array] = {}
    ordered_after = gpu_write.ordered_after

    def after_write(dst, done, tokens):
        ordered_after(dst, done, tokens)
        return written.pop(id(done))

    def make(*, name, input_names, output_names, source, header="", **_):
        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            called.append(name)
            if afters is not None and "after" in input_names:
                afters.append(np.array(inputs[input_names.index("after")]).tolist())
            _, text = gpu_dialect.mlx_metal_source(name, input_names, output_names, source,
                                                   inputs, template,
                                                   output_dtypes=output_dtypes, header=header)
            ins, outs = emu.run(text, inputs, output_shapes, output_dtypes, grid, threadgroup)
            result = [mx.array(o) for o in outs]
            if name.startswith("vllm_unified_write"):
                written[id(result[0])] = mx.array(ins[0]).astype(inputs[0].dtype)
            return result
        return call

    gpu_dialect._kernel.cache_clear()
    gpu_paged._kernel.cache_clear()  # it keeps the kernel objects too
    monkeypatch.setattr(mx.fast, "metal_kernel", make)
    monkeypatch.setattr(gpu_write, "ordered_after", after_write)
    return called


@pytest.fixture(autouse=True)
def _fresh_kernel_objects():
    yield
    gpu_dialect._kernel.cache_clear()
    gpu_paged._kernel.cache_clear()


def _step(model, pool, qlens, slens, tables, ids):
    """One step's logits and the pool after it; the layers' caches on the Metal profile."""
    backend = replace(profile(), gpu_attention="metal", cpu_attention=False)
    caches = [PagedLayerCache(pool, i, backend) for i in range(LAYERS)]
    meta = build_attention_metadata(qlens, slens, tables, BS)
    rows = np.cumsum(qlens).astype(np.int32) - 1
    with set_step_context(StepContext(attn=meta)):
        out = forward(model, caches, mx.array(ids), rows)
    mx.eval(out, pool.kv)
    return np.array(out), [np.array(a) for a in pool.kv]


@needs_clang
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2", "llama"])
def test_fused_decode_step_matches_mlx_lm_path(family, monkeypatch):
    """A pure-decode step of three sequences through the swapped classes (the prologue write
    and attention kernels) gives the logits and the pool of mlx-lm's own attention code over
    the plain kernels; a mixed step takes mlx-lm's code in both."""
    _check_fused_step(family, monkeypatch)


@needs_clang
def test_a_wrong_key_prologue_fails_the_step_check(monkeypatch):
    """The step check sees the keys the write kernel stores: without the key norm in the
    write kernel (the query prologue intact) the pools and logits differ."""
    body = gpu_write.WRITE_KV_QK_SOURCE
    monkeypatch.setattr(gpu_write, "WRITE_KV_QK_SOURCE", body.replace("if (NORM) {",
                                                                      "if (false) {"))
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        _check_fused_step("qwen3", monkeypatch)


def _check_fused_step(family, monkeypatch):
    afters: list = []
    called = _emulated_kernels(monkeypatch, afters)
    tables = np.array([[3, 5, 0], [7, 1, 8], [2, 0, 0]], np.int32)
    decode = ([1, 1, 1], [20, 40, 9], [11, 57, 3])
    mixed = ([1, 5], [21, 14], [9, 30, 31, 32, 33, 34])

    plain = _model(family)
    want = [_step(plain, pool := _pool(), *decode[:2], tables, decode[2]),
            _step(plain, pool, mixed[0], mixed[1], tables[:2], mixed[2])]
    assert set(called) == {"vllm_unified_write_kv", "vllm_unified_paged_attention"}
    # every attention launch takes its layer's write token as an input (the kernel wrote 1;
    # the stand-in for "nothing written" is 0): the GPU orders it after the write
    assert afters and all(a == [1] for a in afters)
    afters.clear()

    fused = _model(family)
    assert install_fused_decode_attention(fused, DIM) == LAYERS
    assert install_fused_decode_attention(fused, DIM) == 0  # idempotent
    called.clear()
    pool = _pool()
    before = [np.array(a) for a in pool.kv]
    got = _step(fused, pool, *decode[:2], tables, decode[2])
    assert called == ["vllm_unified_write_kv_qk", "vllm_unified_paged_attention_qk"] * LAYERS
    slots = tables[np.arange(3), (np.array(decode[1]) - 1) // BS] * BS + (
        np.array(decode[1]) - 1) % BS
    for a, b in zip(got[1], before, strict=True):  # the step's cells were written, no other
        assert not np.array_equal(a[slots], b[slots])
        assert np.array_equal(np.delete(a, slots, axis=0), np.delete(b, slots, axis=0))
    assert afters == [[1]] * LAYERS
    called.clear()
    got_mixed = _step(fused, pool, mixed[0], mixed[1], tables[:2], mixed[2])
    assert "vllm_unified_write_kv_qk" not in called
    for (wl, wp), (gl, gp) in zip(want, [got, got_mixed], strict=True):
        np.testing.assert_allclose(gl, wl, rtol=1e-4, atol=1e-4)
        for a, b in zip(gp, wp, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_swapped_class_outside_paged_caches_is_mlx_lm():
    """With mlx-lm's own cache (or none) the swapped module is mlx-lm's module; families
    outside the list and layers whose prologue the kernels do not compute stay as they are."""
    model = _model("qwen3")
    x = mx.random.normal((1, 5, 256))
    want = model.layers[0].self_attn(x)
    install_fused_decode_attention(model, DIM)
    attn = model.layers[0].self_attn
    assert isinstance(attn, FusedDecodeAttention) and isinstance(attn, qwen3.Attention)
    np.testing.assert_array_equal(np.array(attn(x)), np.array(want))

    other = _model("llama")
    other.layers[1].self_attn.rope = YarnRoPE(DIM)
    assert install_fused_decode_attention(other, DIM) == 1
    assert not isinstance(other.layers[1].self_attn, FusedDecodeAttention)


def test_fused_path_declined_by_the_cache(monkeypatch):
    """The cache declines raw projections where a kernel would not take them: a step that
    is not pure decode, a pool not written by a GPU kernel, a quantized layer, a dtype other
    than the pool's, a head size the kernels do not take, a profile without the paged GPU
    attention."""
    pool = _pool()
    metal = replace(profile(), gpu_attention="metal", cpu_attention=False)
    cache = PagedLayerCache(pool, 0, metal)
    decode = build_attention_metadata([1], [5], np.array([[1]], np.int32), BS)
    mixed = build_attention_metadata([2], [5], np.array([[1]], np.int32), BS)
    with set_step_context(StepContext(attn=decode)):
        assert cache.fuses_decode(mx.float32, DIM)
        assert not cache.fuses_decode(mx.bfloat16, DIM)
        assert not cache.fuses_decode(mx.float32, 48)
        assert not PagedLayerCache(pool, 0, replace(metal, gpu_attention=None)).fuses_decode(
            mx.float32, DIM)
        pool.write_path = "scatter"
        assert not cache.fuses_decode(mx.float32, DIM)
        with pytest.raises(ValueError, match="key prologue"):
            pool.write(0, decode.slot_mapping, mx.zeros((1, 1, 128)), mx.zeros((1, 1, 128)),
                       prologue=QKPrologue.build(DIM, None), positions=decode.positions)
    pool.write_path = "metal_kernel"
    with set_step_context(StepContext(attn=mixed)):
        assert not cache.fuses_decode(mx.float32, DIM)
    quantized = KVPool.allocate_mlx(1, BLOCKS, BS, KV_HEADS, DIM, mx.float32,
                                    write="metal_kernel", fmt=kv_format("int8_per_token_head"))
    with set_step_context(StepContext(attn=decode)):
        assert not PagedLayerCache(quantized, 0, metal).fuses_decode(mx.float32, DIM)
    assert qk_prologue.SNIPPET.count("uni_simd_sum") == 1
