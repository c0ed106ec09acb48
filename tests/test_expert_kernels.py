"""The native mixture-of-experts kernel for quantized experts (``gather_quantized_linear``,
native/src/native.cpp) against MLX's ``gather_qmm``, MLX's ``gather_mm`` on the dequantized
experts and the dense kernels run per expert, and its routing into mlx-lm's
``QuantizedSwitchLinear`` (models/cpu_kernels.py). No engine.

What "equal" means here: per expert, the kernel runs the dense quantized kernels on that
expert's rows, so it equals ``linear(rows, dequantize(w[e]))`` (exact fp32 arithmetic) or
``quantized_linear(rows, w[e], ...)`` (integer activations) bit for bit. MLX's ``gather_qmm``
and ``gather_mm`` sum in another order: equal within fp32 rounding (relative error below
:data:`FP32_TOL` of the output's largest magnitude).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from vllm_unified import bridge
from vllm_unified.models import cpu_kernels

native = bridge.native_kernels()
pytestmark = pytest.mark.skipif(
    native is None, reason=f"native extension unavailable: {bridge.native_error()}")

#: Relative error allowed against MLX's own ops (another summation order, fp32).
FP32_TOL = 2e-6
EXPERTS, OUT, IN, TOP_K = 7, 37, 256, 3  # 7 experts, 37 outputs: a last block of 1 row


@pytest.fixture(autouse=True)
def exact_arithmetic():
    """Exact fp32 arithmetic (quantized_gemv_mode 1) unless a test sets another mode."""
    previous = native.quantized_gemv_mode(1)
    yield
    native.quantized_gemv_mode(previous)


def _rel_err(got: mx.array, want: mx.array) -> float:
    g, w = np.array(got), np.array(want.astype(mx.float32))
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


def _experts(rng, bits: int, group_size: int, mode: str = "affine",
             scale_dtype: mx.Dtype = mx.float32) -> tuple[mx.array, ...]:
    """``(w, scales, biases or None, dense)``: EXPERTS random experts [OUT, IN] quantized by
    ``mx.quantize``, and their fp32 dequantization by ``mx.dequantize``."""
    w = mx.array(rng.standard_normal((EXPERTS, OUT, IN)).astype(np.float32) * 0.05)
    if mode == "mxfp4":
        wq, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
        dense = mx.dequantize(wq, scales, None, group_size=32, bits=4, mode="mxfp4",
                              dtype=mx.float32)
        return wq, scales, None, dense
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    dense = mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32),
                          group_size=group_size, bits=bits)
    return wq, scales, biases, dense


def _routing(rng, tokens: int) -> mx.array:
    """uint32 [tokens, TOP_K]: distinct experts per token, as a router's top-k gives them."""
    return mx.array(np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)])
                    .astype(np.uint32))


def _call_shapes(rng, tokens: int) -> dict[str, tuple[mx.array, mx.array]]:
    """mlx-lm's call shapes of a switch layer for ``tokens`` tokens: ``up`` (SwitchGLU's
    gate/up projections: x [T, 1, 1, K] for indices [T, k]), ``down`` (x [T, k, 1, K], one
    entry per pair), ``sorted`` (``_gather_sort``'s: pairs sorted by expert, x [T * k, 1, K]
    and indices [T * k])."""
    x = mx.array(rng.standard_normal((tokens, IN)).astype(np.float32))
    idx = _routing(rng, tokens)
    down = mx.array(rng.standard_normal((tokens, TOP_K, 1, IN)).astype(np.float32))
    flat = np.array(idx).reshape(-1)
    order = np.argsort(flat, kind="stable")
    xs = mx.array(np.array(x)[order // TOP_K][:, None, :])
    return {"up": (x[:, None, None, :], idx), "down": (down, idx),
            "sorted": (xs, mx.array(flat[order]))}


def _per_expert(x: mx.array, idx: mx.array, kernel) -> np.ndarray:
    """The dense route per expert: x's rows of each expert's pairs (in call order) through
    ``kernel(rows, e)``, put back in place: ``[*idx.shape, M, N]``."""
    ids = np.array(idx).reshape(-1)
    xb = np.array(x).reshape(-1, *x.shape[-2:])
    repeat = ids.size // xb.shape[0]
    out = np.zeros((ids.size, x.shape[-2], OUT), np.float32)
    for e in np.unique(ids):
        pairs = np.nonzero(ids == e)[0]
        rows = mx.array(xb[pairs // repeat].reshape(-1, x.shape[-1]))
        out[pairs] = np.array(kernel(rows, int(e))).reshape(len(pairs), x.shape[-2], OUT)
    return out.reshape(*idx.shape, x.shape[-2], OUT)


def _assert_bits_equal(got: mx.array, want: np.ndarray) -> None:
    got = np.array(got)
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.abs(got - want).max()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_affine_experts_equal_the_dense_route_and_mlx(bits, group_size):
    """Every width and group size, 1, 5 and 33 tokens (33 * 3 pairs: experts of up to ~20
    rows), each call shape: bit-identical to linear on each expert's dequantized weight
    (exact fp32 arithmetic), within fp32 rounding of mx.gather_qmm and of mx.gather_mm on the
    dequantized experts (the route before this kernel)."""
    rng = np.random.default_rng(100 * bits + group_size)
    wq, scales, biases, dense = _experts(rng, bits, group_size)
    for tokens in (1, 5, 33):
        for shape, (x, idx) in _call_shapes(rng, tokens).items():
            got = native.gather_quantized_linear(x, wq, scales, biases, idx, group_size, bits)
            assert got.shape == (*idx.shape, 1, OUT) and got.dtype == mx.float32
            _assert_bits_equal(got, _per_expert(x, idx, lambda r, e: native.linear(r, dense[e])))
            mlx_q = mx.gather_qmm(x, wq, scales, biases, rhs_indices=idx, transpose=True,
                                  group_size=group_size, bits=bits)
            mlx_d = mx.gather_mm(x, dense.swapaxes(-1, -2), rhs_indices=idx)
            assert _rel_err(got, mlx_q) < FP32_TOL, (tokens, shape)
            assert _rel_err(got, mlx_d) < FP32_TOL, (tokens, shape)


@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16])
def test_16bit_scales_equal_their_fp32_widening(scale_dtype):
    """mlx-community checkpoints store scales and biases in 16 bits: the kernel widens them
    exactly, so the result is that of the same experts with fp32 scales, bit for bit."""
    rng = np.random.default_rng(7)
    wq, scales, biases, dense = _experts(rng, 4, 64, scale_dtype=scale_dtype)
    for x, idx in _call_shapes(rng, 5).values():
        got = native.gather_quantized_linear(x, wq, scales, biases, idx, 64, 4)
        wide = native.gather_quantized_linear(x, wq, scales.astype(mx.float32),
                                              biases.astype(mx.float32), idx, 64, 4)
        _assert_bits_equal(got, np.array(wide))
        _assert_bits_equal(got, _per_expert(x, idx, lambda r, e: native.linear(r, dense[e])))


@pytest.mark.parametrize("mode", [3, 4])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (8, 64), (3, 128), (6, 32)])
def test_integer_activations_equal_quantized_linear_per_expert(mode, bits, group_size):
    """VLLM_UNIFIED_CPU_ACTIVATIONS int8 (3) / int16 (4): an expert with 1-4 rows multiplies
    its codes by x quantized per 32 elements, as quantized_linear does for that many rows, and
    more rows take the VNNI GEMM where it runs (no AMX; on AVX2 the AVX2 gemv and GEMM), else
    compute exactly: bit-identical to
    quantized_linear on each expert's weight and rows (to linear on the dequantized weight where
    quantized_linear would take AMX tiles, which the expert kernel does not)."""
    native.quantized_gemv_mode(mode)
    if not (native.int8_runs(1, IN, group_size, bits)
            or native.q8_avx2_gemv_runs(1, IN, group_size, bits)):
        pytest.skip("no integer kernel for this layout on this CPU (int8_runs, q8_avx2_gemv_runs)")
    rng = np.random.default_rng(mode * 10 + bits)
    wq, scales, biases, dense = _experts(rng, bits, group_size, scale_dtype=mx.bfloat16)

    def dense_route(rows: mx.array, e: int) -> mx.array:
        if rows.shape[0] > 4 and native.amx_usable():
            return native.linear(rows, dense[e])
        return native.quantized_linear(rows, wq[e], scales[e], biases[e], group_size, bits)

    for tokens in (1, 5, 33):
        for x, idx in _call_shapes(rng, tokens).values():
            got = native.gather_quantized_linear(x, wq, scales, biases, idx, group_size, bits)
            _assert_bits_equal(got, _per_expert(x, idx, dense_route))
            mlx_q = mx.gather_qmm(x, wq, scales, biases, rhs_indices=idx, transpose=True,
                                  group_size=group_size, bits=bits)
            assert _rel_err(got, mlx_q) < (2e-2 if mode == 3 else 1e-4)


def test_mxfp4_experts_equal_the_dense_route_and_mlx():
    """gpt-oss's format (e2m1 codes, e8m0 scales per 32, no biases): its dequantization is
    exact in fp32, so the kernel is bit-identical to linear on mx.dequantize's experts and
    within fp32 rounding of mx.gather_qmm in mode mxfp4: experts of 1-3 rows by the table gemv
    (modes 1-4), the others and mode 0 by the scratch rows."""
    rng = np.random.default_rng(4)
    wq, scales, _, dense = _experts(rng, 4, 32, mode="mxfp4")
    for mode in (0, 1, 4):  # integer activations are for affine experts only: mxfp4 stays exact
        native.quantized_gemv_mode(mode)
        for tokens in (1, 5, 33):
            for x, idx in _call_shapes(rng, tokens).values():
                got = native.gather_quantized_linear(x, wq, scales, None, idx, 32, 4, "mxfp4")
                _assert_bits_equal(
                    got, _per_expert(x, idx, lambda r, e: native.linear(r, dense[e])))
                mlx_q = mx.gather_qmm(x, wq, scales, None, rhs_indices=idx, transpose=True,
                                      group_size=32, bits=4, mode="mxfp4")
                assert _rel_err(got, mlx_q) < FP32_TOL


@pytest.mark.parametrize("bits", [2, 3, 6])
@pytest.mark.parametrize("mode", [1, 4])
def test_groups_of_16_as_gguf_k_quants_give_them(bits, mode):
    """Groups of 16 with fp32 scales (how the GGUF reader keeps Q2_K, Q3_K and Q6_K experts;
    MLX's own quantize does not make them): bit-identical per expert to quantized_linear on
    that expert (exact or int16 activations), and in exact arithmetic to linear on the native
    dequantization."""
    native.quantized_gemv_mode(mode)
    rng = np.random.default_rng(bits)
    wq = mx.array(rng.integers(0, 2**32, (EXPERTS, OUT, IN * bits // 32), dtype=np.uint32))
    scales = mx.array(rng.standard_normal((EXPERTS, OUT, IN // 16)).astype(np.float32) * 0.01)
    biases = mx.array(rng.standard_normal((EXPERTS, OUT, IN // 16)).astype(np.float32) * 0.01)
    for tokens in (1, 5, 33):
        for x, idx in _call_shapes(rng, tokens).values():
            got = native.gather_quantized_linear(x, wq, scales, biases, idx, 16, bits)
            _assert_bits_equal(got, _per_expert(x, idx, lambda r, e: native.quantized_linear(
                r, wq[e], scales[e], biases[e], 16, bits) if r.shape[0] <= 4
                or not native.amx_usable() else native.linear(
                    r, native.dequantize(wq[e], scales[e], biases[e], 16, bits))))
            if mode == 1:
                _assert_bits_equal(got, _per_expert(x, idx, lambda r, e: native.linear(
                    r, native.dequantize(wq[e], scales[e], biases[e], 16, bits))))


def test_several_rows_per_entry_and_int32_indices():
    """x entries of M > 1 rows ([T, 1, M, K]: every row through each of the entry's experts)
    and int32 indices compute what gather_qmm does."""
    rng = np.random.default_rng(11)
    wq, scales, biases, dense = _experts(rng, 4, 64)
    x = mx.array(rng.standard_normal((4, 1, 3, IN)).astype(np.float32))
    idx = _routing(rng, 4).astype(mx.int32)
    got = native.gather_quantized_linear(x, wq, scales, biases, idx, 64, 4)
    assert got.shape == (4, TOP_K, 3, OUT)
    _assert_bits_equal(got, _per_expert(x, idx, lambda r, e: native.linear(r, dense[e])))
    want = mx.gather_qmm(x, wq, scales, biases, rhs_indices=idx, transpose=True, group_size=64,
                         bits=4)
    assert _rel_err(got, want) < FP32_TOL


def test_an_index_outside_the_experts_gives_nan_rows():
    """An index that names no expert is not read through: its rows are NaN (never another
    expert's output), the other pairs' rows are computed as always."""
    rng = np.random.default_rng(12)
    wq, scales, biases, dense = _experts(rng, 4, 64)
    x = mx.array(rng.standard_normal((3, 1, 1, IN)).astype(np.float32))
    idx = mx.array([[0, EXPERTS], [2, 1], [-1, 3]], dtype=mx.int32)
    got = np.array(native.gather_quantized_linear(x, wq, scales, biases, idx, 64, 4))
    assert np.isnan(got[0, 1]).all() and np.isnan(got[2, 0]).all()
    assert np.isfinite(got[0, 0]).all() and np.isfinite(got[1]).all() and np.isfinite(got[2, 1])\
        .all()
    want = np.array(native.linear(x[1].reshape(1, IN), dense[2]))
    assert np.array_equal(got[1, 0], want)


def test_bad_input_is_refused():
    rng = np.random.default_rng(13)
    wq, scales, biases, _ = _experts(rng, 4, 64)
    x = mx.zeros((2, 1, 1, IN))
    idx = _routing(rng, 2)
    with pytest.raises(TypeError, match="float32"):
        native.gather_quantized_linear(x.astype(mx.bfloat16), wq, scales, biases, idx, 64, 4)
    with pytest.raises(TypeError, match="uint32 or int32"):
        native.gather_quantized_linear(x, wq, scales, biases, idx.astype(mx.int64), 64, 4)
    with pytest.raises(ValueError, match="bits must be"):
        native.gather_quantized_linear(x, wq, scales, biases, idx, 64, 7)
    with pytest.raises(ValueError, match="mode must be"):
        native.gather_quantized_linear(x, wq, scales, biases, idx, 64, 4, "nvfp4")
    with pytest.raises(ValueError, match="affine mode needs biases"):
        native.gather_quantized_linear(x, wq, scales, None, idx, 64, 4)
    with pytest.raises(ValueError, match="mxfp4 takes"):
        native.gather_quantized_linear(x, wq, scales, biases, idx, 32, 4, "mxfp4")
    with pytest.raises(ValueError, match=r"\[E, N, \.\.\.\]"):
        native.gather_quantized_linear(x, wq[0], scales[0], biases[0], idx, 64, 4)
    with pytest.raises(ValueError, match="x must be"):
        native.gather_quantized_linear(mx.zeros((2, 1, 1, IN + 64)), wq, scales, biases, idx,
                                       64, 4)
    with pytest.raises(ValueError, match="must divide"):
        native.gather_quantized_linear(mx.zeros((4, 1, 1, IN)), wq, scales, biases,
                                       mx.zeros((3,), mx.uint32), 64, 4)


def _switch_glu(bits: int, group_size: int, mode: str = "affine") -> SwitchGLU:
    mx.random.seed(bits + group_size)
    glu = SwitchGLU(IN, 128, EXPERTS)
    nn.quantize(glu, group_size=group_size, bits=bits, mode=mode)
    mx.eval(glu.parameters())
    return glu


def _dequantized(glu: SwitchGLU) -> SwitchGLU:
    """The same SwitchGLU with its experts dequantized to fp32 SwitchLinear layers."""
    dense = SwitchGLU(IN, 128, EXPERTS)
    for name in ("gate_proj", "up_proj", "down_proj"):
        q = getattr(glu, name)
        w = mx.dequantize(q.weight, q.scales, q.get("biases"), group_size=q.group_size,
                          bits=q.bits, mode=q.mode).astype(mx.float32)
        getattr(dense, name).weight = w
    return dense


@pytest.mark.parametrize("bits, group_size, mode", [(4, 64, "affine"), (8, 32, "affine"),
                                                    (4, 32, "mxfp4")])
def test_switch_glu_runs_the_kernel_in_both_call_shapes(bits, group_size, mode, monkeypatch):
    """install_cpu_kernels makes mlx-lm's quantized SwitchGLU experts
    NativeQuantizedSwitchLinear (named in the log), kept quantized; 1 and 5 tokens (unsorted
    call) and 33 tokens (99 pairs >= 64: mlx-lm sorts them by expert first) all go through the
    kernel and equal the experts dequantized to fp32 (MLX's gather_mm) within fp32 rounding."""
    glu = _switch_glu(bits, group_size, mode)
    dense = _dequantized(glu)
    routed = cpu_kernels.install_cpu_kernels(glu)
    assert f"3 {mode} {bits}-bit quantized expert layers (native gather_quantized_linear)" \
        in routed, routed
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(glu, name)
        assert type(layer) is cpu_kernels.NativeQuantizedSwitchLinear
        assert layer["weight"].dtype == mx.uint32  # still packed
    calls = []
    kernel = native.gather_quantized_linear
    monkeypatch.setattr(native, "gather_quantized_linear",
                        lambda *a, **k: calls.append(a[4].shape) or kernel(*a, **k))
    rng = np.random.default_rng(bits)
    for tokens in (1, 5, 33):
        x = mx.array(rng.standard_normal((1, tokens, IN)).astype(np.float32))
        idx = _routing(rng, tokens).reshape(1, tokens, TOP_K)
        calls.clear()
        got = glu(x, idx)
        assert got.shape == (1, tokens, TOP_K, IN)
        assert len(calls) == 3
        assert calls[0] == ((tokens * TOP_K,) if tokens * TOP_K >= 64 else (1, tokens, TOP_K))
        assert _rel_err(got, dense(x, idx)) < 1e-5


def test_formats_the_kernel_does_not_take_are_dequantized_and_named():
    """nvfp4 experts (a global scale per expert possible, 16-element groups) are not the
    kernel's: dequantized to fp32 SwitchLinear layers at install, as before, and named."""
    glu = _switch_glu(4, 16, "nvfp4")
    routed = cpu_kernels.install_cpu_kernels(glu)
    assert any("nvfp4 4-bit expert layers dequantized to float32" in line for line in routed)
    assert all(type(getattr(glu, n)) is SwitchLinear for n in ("gate_proj", "up_proj",
                                                               "down_proj"))


def test_other_call_shapes_fall_back_to_gather_qmm():
    """A broadcast the kernel does not take (x's batch axes not indices' with trailing 1s)
    runs MLX's gather_qmm: same result as the unrouted layer."""
    layer = QuantizedSwitchLinear(IN, OUT, EXPERTS, bias=True, group_size=64, bits=4)
    layer.bias = mx.arange(EXPERTS * OUT, dtype=mx.float32).reshape(EXPERTS, OUT) / 100
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((2, 1, 1, IN)).astype(np.float32))
    idx = mx.array([0, 4, 6], dtype=mx.uint32)  # [3] against x's batch [2, 1]: [2, 3]
    want = layer(x, idx)
    ok_x, ok_idx = x, _routing(rng, 2)
    want_ok = layer(ok_x, ok_idx)
    cpu_kernels.install_cpu_kernels(layer)
    assert type(layer) is cpu_kernels.NativeQuantizedSwitchLinear
    assert mx.array_equal(layer(x, idx), want).item()
    assert _rel_err(layer(ok_x, ok_idx), want_ok) < FP32_TOL  # with the experts' bias


def _tiny_qwen3_next(quantized_experts: bool) -> nn.Module:
    """The tiny qwen3_next (gated delta-net hybrid, sparse MoE block with a shared expert),
    4-bit; without ``quantized_experts`` its quantized weights dequantized to fp32."""
    from tiny_models import tiny_quantized_mlx_model

    return tiny_quantized_mlx_model("qwen3_next", dequantize=not quantized_experts)


@pytest.mark.parametrize("mode", [1, 4])
def test_quantized_moe_model_greedy_equals_its_dequantized_experts(mode):
    """A whole model: the tiny qwen3_next with quantized experts on the native kernel gives the
    greedy ids of the same weights dequantized to fp32 (MLX's gather_mm for the experts, the
    native linear for the rest), over a 40-token prompt (80 pairs: mlx-lm's sorted call) and
    12 decode steps (unsorted); logits within fp32 rounding in exact arithmetic (mode 1), and
    with int16 activations (mode 4, the default) in the kept model's quantized layers."""
    from tiny_models import greedy_ids

    native.quantized_gemv_mode(mode)
    kept, dense = _tiny_qwen3_next(True), _tiny_qwen3_next(False)
    routed = cpu_kernels.install_cpu_kernels(kept)
    assert any("quantized expert layers" in line for line in routed), routed
    cpu_kernels.install_cpu_kernels(dense)
    assert not any(type(m) is QuantizedSwitchLinear for m in kept.modules())
    assert any(type(m) is cpu_kernels.NativeQuantizedSwitchLinear for m in kept.modules())
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 1000, 40)]
    if mode == 1:
        from mlx_lm.models.cache import make_prompt_cache

        logits = [m(mx.array([prompt]), cache=make_prompt_cache(m)) for m in (kept, dense)]
        assert _rel_err(*logits) < 1e-5
    assert greedy_ids(kept, prompt, 12) == greedy_ids(dense, prompt, 12)


@pytest.mark.engine
@pytest.mark.slow  # two engines; the model-level test above checks the same without them
def test_served_quantized_moe_equals_its_dequantized_load(tmp_path):
    """The tiny qwen3_next checkpoint quantized to 4 bits by mlx-lm (``quantize_model``,
    groups of 32: experts, shared expert and linears) served kept quantized (experts on the
    native kernel, named in the start-up log) gives the greedy ids of the same checkpoint
    dequantized to fp32 at load (``VLLM_UNIFIED_CPU_QUANTIZED=0``), four requests batched with
    chunked prefill; exact fp32 arithmetic (``VLLM_UNIFIED_CPU_ACTIVATIONS=fp32``), so the two
    differ only in the experts' summation order."""
    from conftest import run_llm
    from mlx_lm.utils import quantize_model, save_config, save_model
    from tiny_models import make_tiny_checkpoint

    from vllm_unified.models.loader import load_model

    src = make_tiny_checkpoint(tmp_path, "qwen3_next")
    dense = load_model(src, hf_config=None, dtype=mx.float32, keep_quantized=False)
    model, config = quantize_model(dense.model, dict(dense.config), group_size=32, bits=4)
    assert any(isinstance(m, QuantizedSwitchLinear) for m in model.modules())
    out = tmp_path / "tiny-qwen3_next-4bit"
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
               for i, n in enumerate((3, 20, 45, 70))]
    spec = {"model": str(out),
            "engine": {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 16,
                       "seed": 0, "enable_prefix_caching": False,
                       "kv_cache_memory_bytes": 32 * 24576},
            "requests": [{"prompt_token_ids": p,
                          "params": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}}
                         for p in prompts]}
    runs = {}
    for kept in ("1", "0"):
        (tmp_path / kept).mkdir()
        runs[kept] = run_llm(spec, tmp_path / kept, env={"VLLM_UNIFIED_CPU_QUANTIZED": kept,
                                                        "VLLM_UNIFIED_CPU_ACTIVATIONS": "fp32"})
    assert "quantized expert layers (native gather_quantized_linear)" in runs["1"]["log"]
    assert "quantized expert layers" not in runs["0"]["log"]
    ids = {k: [o["completions"][0]["token_ids"] for o in r["outputs"]] for k, r in runs.items()}
    assert all(len(i) == 24 for i in ids["1"])
    assert ids["1"] == ids["0"]


def test_integer_experts_on_avx2():
    """The integer experts' test again with ``VLLM_UNIFIED_CPU_ISA=avx2``: each expert's rows
    by the AVX2 gemv (1-4 rows) or GEMM (5 and more), bit-identical to quantized_linear on that
    expert."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_UNIFIED_CPU_ISA": "avx2"}
    probe = "import vllm_unified_native as n; print(n.q8_avx2_gemm_runs(16, 128, 32, 4))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True)
    if out.stdout.strip() != "True":
        pytest.skip("no AVX2 and FMA on this CPU")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "integer_activations_equal_quantized_linear_per_expert", __file__],
        env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
