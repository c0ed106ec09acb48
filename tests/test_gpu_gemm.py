"""The decode GEMM kernel of :mod:`vllm_unified.models.gpu_gemm`: its fragment algebra, its
routing into a model, and where it declines.

The kernel is CUDA only (PTX ``mma.sync``), so it cannot run here. What runs here:

* :func:`emulate` follows the kernel body step by step (the lanes' 16-byte loads, the two MMAs
  per 32 k with their register operands, the warps' partial sums in warp order, the store of
  each fragment element) and assembles each MMA's A, B and C/D matrices from the 32 lanes'
  registers by the PTX ISA's fragment layouts for ``mma.m16n8k16`` with 16-bit inputs. Equal
  to the fp32 product, it shows the body's k permutation and output mapping are consistent
  with those layouts; the CUDA instance itself is checked on the lent GPU
  (``benchmarks/cuda.py decode``, ``gemm_check``).
* the same emulation stands in for the kernel while a model runs (fused q/k/v and gate/up,
  o/down, the tied head), against the model without it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from vllm_unified.models import gpu_gemm
from vllm_unified.models.fused_projections import FusedPart, fuse_projections
from vllm_unified.models.gpu_gemm import GpuEmbedding, GpuLinear, gemm, install_gpu_gemm


def _mma(lanes_a: np.ndarray, lanes_b: np.ndarray, lanes_c: np.ndarray) -> np.ndarray:
    """One ``mma.m16n8k16`` (f32 accumulate) from 32 lanes' registers.

    ``lanes_a``: ``[32, 4, 2]`` (four .b32 registers of two 16-bit values, low half first),
    ``lanes_b``: ``[32, 2, 2]``, ``lanes_c``: ``[32, 4]``; returns the lanes' D ``[32, 4]``.
    PTX layouts (groupID g = lane >> 2, threadID_in_group t = lane % 4): A register i holds
    row ``g + 8 * (i % 2)``, columns ``2t + 8 * (i // 2) + {0, 1}``; B register i holds rows
    ``2t + 8 * i + {0, 1}``, column g; C/D element j is row ``g + 8 * (j // 2)``, column
    ``2t + j % 2``."""
    a = np.zeros((16, 16), np.float32)
    b = np.zeros((16, 8), np.float32)
    c = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            for h in range(2):
                a[g + 8 * (i % 2), 2 * t + 8 * (i // 2) + h] = lanes_a[lane, i, h]
        for i in range(2):
            for h in range(2):
                b[2 * t + 8 * i + h, g] = lanes_b[lane, i, h]
        for j in range(4):
            c[g + 8 * (j // 2), 2 * t + j % 2] = lanes_c[lane, j]
    d = c + a @ b
    out = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            out[lane, j] = d[g + 8 * (j // 2), 2 * t + j % 2]
    return out


def emulate(x: np.ndarray, w: np.ndarray, sizes: list[int], bias: np.ndarray | None,
            warps: int, tiles: int = gpu_gemm.TILES) -> list[np.ndarray]:
    """The kernel body on the host (fp32 values of the 16-bit inputs): see the module
    docstring. ``x`` ``[M, K]``, ``w`` ``[N, K]``, ``tiles`` the template's ``MT``; one
    ``[M, size]`` array per part."""
    m_rows, k = x.shape
    n = w.shape[0]
    mt_count = tiles
    outs = [np.full((m_rows, s), np.nan, np.float32) for s in sizes]
    bounds = np.cumsum([0, *sizes])

    def store(f0: int, mt: int, j: int, ln: int, v: float) -> None:
        feature = f0 + (ln >> 2) + (8 if j >= 2 else 0)
        row = mt * 8 + 2 * (ln & 3) + (j & 1)
        if row >= m_rows:
            return
        if bias is not None:
            v += bias[feature]
        part = int(np.searchsorted(bounds, feature, side="right") - 1)
        outs[part][row, feature - bounds[part]] = v

    for block in range(n // 16):
        f0 = block * 16
        partial = np.zeros((warps, mt_count, 32, 4), np.float32)
        for warp in range(warps):
            acc = np.zeros((mt_count, 32, 4), np.float32)
            for kc in range(warp, k // 32, warps):
                lanes = np.arange(32)
                g, t = lanes >> 2, lanes & 3
                cols = kc * 32 + 8 * t[:, None] + np.arange(8)  # the lane's 16-byte word
                a_lo, a_hi = w[f0 + g[:, None], cols], w[f0 + g[:, None] + 8, cols]
                for mt in range(mt_count):
                    rows = mt * 8 + g
                    bw = np.where((rows < m_rows)[:, None],
                                  x[np.minimum(rows, m_rows - 1)[:, None], cols], 0.0)
                    # registers .x .y .z .w are the word's element pairs 0-1, 2-3, 4-5, 6-7
                    for first in (0, 4):
                        regs_a = np.stack([a_lo[:, first:first + 2], a_hi[:, first:first + 2],
                                           a_lo[:, first + 2:first + 4],
                                           a_hi[:, first + 2:first + 4]], axis=1)
                        regs_b = np.stack([bw[:, first:first + 2], bw[:, first + 2:first + 4]],
                                          axis=1)
                        acc[mt] = _mma(regs_a, regs_b, acc[mt])
            partial[warp] = acc
        for mt in range(mt_count):
            for j in range(4):
                for ln in range(32):
                    store(f0, mt, j, ln, float(partial[:, mt, ln, j].sum(dtype=np.float32)))
    return outs


def _as_f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("warps", [1, 2, 4])
@pytest.mark.parametrize("rows", [2, 3, 8, 9, 33, 64])
@pytest.mark.parametrize("sizes,has_bias", [([32, 16, 16], False), ([32, 16, 16], True),
                                            ([48], False)])
def test_fragment_algebra_gives_the_product(warps, rows, sizes, has_bias):
    rng = np.random.default_rng(rows * 10 + warps)
    k = 128
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((sum(sizes), k)).astype(np.float32)
    bias = rng.standard_normal(sum(sizes)).astype(np.float32) if has_bias else None
    outs = emulate(x, w, sizes, bias, warps)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if bias is None else bias)
    got = np.concatenate(outs, axis=1)
    assert not np.isnan(got).any()  # every output element is stored exactly once
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


def test_a_wrong_k_permutation_is_caught():
    """The check above can fail: B operand registers swapped (k 8t+2.. paired with 8t..)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    cols = 8 * t[:, None] + np.arange(8)
    a_lo, a_hi, bw = w[g[:, None], cols], w[g[:, None] + 8, cols], x[g[:, None], cols]
    acc = np.zeros((32, 4), np.float32)
    for first in (0, 4):
        regs_a = np.stack([a_lo[:, first:first + 2], a_hi[:, first:first + 2],
                           a_lo[:, first + 2:first + 4], a_hi[:, first + 2:first + 4]], axis=1)
        regs_b = np.stack([bw[:, first + 2:first + 4], bw[:, first:first + 2]], axis=1)
        acc = _mma(regs_a, regs_b, acc)
    ref = w @ x.T  # [16 features, 8 tokens]
    got = np.array([[acc[(f % 8) * 4 + tok // 2, (tok % 2) + (2 if f >= 8 else 0)]
                     for tok in range(8)] for f in range(16)])
    assert np.abs(got - ref).max() > 1e-2


class _StandIn:
    """Stands in for the CUDA kernel object: the emulation, called as MLX calls a kernel."""

    def __init__(self, parts: int, has_bias: bool) -> None:
        self.parts, self.has_bias = parts, has_bias
        self.calls: list[dict] = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        spec = dict(template)
        warps = spec["WARPS"]
        assert threadgroup == (warps * 32, 1, 1)
        assert grid == (sum(s[1] for s in output_shapes) // 16 * warps * 32, 1, 1)
        assert spec["MT"] == 8 and output_shapes[0][0] <= 8 * spec["MT"]
        x, w = _as_f32(inputs[0]), _as_f32(inputs[1])
        bias = _as_f32(inputs[2]) if self.has_bias else None
        assert x.shape[1] == spec["K"] and len(output_shapes) == self.parts
        sizes = [spec[f"N{p}"] for p in range(self.parts)]
        self.calls.append({"rows": x.shape[0], "sizes": sizes})
        outs = emulate(x, w, sizes, bias, warps, spec["MT"])
        return [mx.array(o).astype(d) for o, d in zip(outs, output_dtypes, strict=True)]


@pytest.fixture
def stand_in(monkeypatch):
    made: dict = {}

    def kernel(parts: int, has_bias: bool):
        return made.setdefault((parts, has_bias), _StandIn(parts, has_bias))

    monkeypatch.setattr(gpu_gemm, "_kernel", kernel)
    return made


def _tiny_llama(tie: bool) -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=80, tie_word_embeddings=tie,
                           head_dim=16)
    mx.random.seed(3)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_model_with_the_kernel_matches_mlx(stand_in, tie, tokens):
    """2-64 rows go to the kernel (q/k/v and gate/up as one launch each, with separate
    row-contiguous parts); 1 and 70 rows stay on MLX's matmul."""
    plain = _tiny_llama(tie)
    routed = _tiny_llama(tie)
    fuse_projections(routed)
    assert install_gpu_gemm(routed) == 2 * 4 + (0 if tie else 1) + 1  # + the embedding
    ids = mx.array(np.arange(tokens, dtype=np.int32) % 80)[None]
    want = _as_f32(plain(ids))
    got = _as_f32(routed(ids))
    calls = [c for s in stand_in.values() for c in s.calls]
    if 2 <= tokens <= 64:
        # per layer: q/k/v (3 parts), o, gate/up (2 parts), down; then the head
        assert sorted(len(c["sizes"]) for c in calls) == sorted([3, 1, 2, 1] * 2 + [1])
        assert any(c["sizes"] == [64, 32, 32] for c in calls)
    else:
        assert calls == []
    np.testing.assert_allclose(got, want, rtol=0, atol=0.06)


def test_install_swaps_only_dense_16_bit_layers():
    model = _tiny_llama(tie=True)
    model.layers[0].mlp.down_proj.set_dtype(mx.float32)
    fuse_projections(model)
    install_gpu_gemm(model)
    assert type(model.layers[0].mlp.down_proj) is nn.Linear
    assert type(model.layers[1].mlp.down_proj) is GpuLinear
    assert type(model.model.embed_tokens) is GpuEmbedding
    parts = [m for m in model.modules() if isinstance(m, FusedPart)]
    assert parts and all(p.group.split is not None for p in parts)
    assert install_gpu_gemm(model) == 0  # idempotent
    assert type(model.layers[1].mlp.down_proj) is GpuLinear


@pytest.mark.parametrize("case", ["fp32", "one_row", "65_rows", "k_not_32", "part_not_16",
                                  "four_parts", "dtype_mismatch", "bias_dtype", "k_zero",
                                  "empty_part"])
def test_gemm_declines_what_it_does_not_take(case, stand_in):
    k, rows, sizes, dtype = 64, 4, [32], mx.bfloat16
    x_dtype, bias = dtype, None
    if case == "fp32":
        dtype = x_dtype = mx.float32
    elif case == "one_row":
        rows = 1
    elif case == "65_rows":
        rows = 65
    elif case == "k_not_32":
        k = 48
    elif case == "part_not_16":
        sizes = [24, 8]
    elif case == "four_parts":
        sizes = [16, 16, 16, 16]
    elif case == "dtype_mismatch":
        x_dtype = mx.float16
    elif case == "bias_dtype":
        bias = mx.zeros(32, mx.float32)
    elif case == "k_zero":
        k = 0
    elif case == "empty_part":
        sizes = [32, 0]
    x = mx.zeros((rows, k), x_dtype)
    w = mx.zeros((sum(sizes), k), dtype)
    assert gemm(x, w, sizes, bias) is None
    assert stand_in == {}


def test_warps_fill_the_gpu_within_k():
    assert gpu_gemm.warps_for(1024, 3072) == 8  # 64 blocks
    assert gpu_gemm.warps_for(151936, 1024) == 1  # 9,496 blocks
    assert gpu_gemm.warps_for(1024, 64) == 2  # only two 32-k chunks
    assert gpu_gemm.warps_for(4096, 1024) == 8


def test_the_body_is_what_the_emulation_follows():
    """The CUDA body's operand order and store formula, as :func:`emulate` takes them: a
    register swapped in an MMA call or a changed store (which the emulation, a copy, would
    not see) fails here."""
    body = " ".join(gpu_gemm._source(3, True).split())
    for line in ("const uint4 a_lo = w_lo[kc * 4 + t];", "const uint4 a_hi = w_hi[kc * 4 + t];",
                 "const uint4* w_hi = w_lo + 8 * K8;",
                 "b = xs[(int64_t)row * K8 + kc * 4 + t];", "const int row = mt * 8 + g;",
                 "UniMma<T>::run(acc[mt], a_lo.x, a_hi.x, a_lo.y, a_hi.y, b.x, b.y);",
                 "UniMma<T>::run(acc[mt], a_lo.z, a_hi.z, a_lo.w, a_hi.w, b.z, b.w);",
                 "const int n = f0 + (ln >> 2) + (j >= 2 ? 8 : 0);",
                 "const int m = mt * 8 + 2 * (ln & 3) + (j & 1);",
                 "v += partial[w][i / 32][i % 32];",
                 "uni_gemm_store(i / 128, (i / 32) % 4, i % 32, v);",
                 "v += static_cast<float>(bias[n]);",
                 "out1[(int64_t)m * N1 + (n - (0 + N0))] = static_cast<T>(v);"):
        assert line in body, line
    header = " ".join(gpu_gemm._HEADER.split())
    for ctype, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16")):
        assert f"struct UniMma<{ctype}>" in header
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in header
    assert '"{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};' in header
