"""Edge cases of the native CPU kernels (native/src/cpu_math.cpp, cpu_norm.cpp, cpu_quant.cpp,
cpu_amx.cpp) and their routing (models/cpu_kernels.py), found by an adversarial review:
overflowing SwiGLU gates and RMSNorm rows, RoPE offsets (negative, beyond int32, bool, one
offset for a batch), inverse frequencies of any head size, shapes changed under
mx.compile(shapeless=True), quantized mixture-of-experts layers, the kernels' environment
variables, the AMX kernels' buffer bounds. Each docstring says what the first version of the
kernels did wrong (or that a test is a guard).
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu as mlx_swiglu

from vllm_unified import bridge
from vllm_unified.models import cpu_kernels

native = bridge.native_kernels()
pytestmark = pytest.mark.skipif(
    native is None, reason=f"native extension unavailable: {bridge.native_error()}")


@pytest.mark.parametrize("n", [8, 16, 1536])
def test_silu_mul_of_a_very_negative_gate_is_zero_not_nan(n):
    """silu(g) for g below about -88.72 (where expf(-g) overflows fp32) is -0 in MLX / mlx-lm's
    swiglu, and cpu_math.cpp's header promises the same ("expf(-g) overflows to +inf and
    1 / (1 + inf) is 0, as in the reference"). On this AVX-512 machine that holds for arrays
    of 1 or 4 elements only (tests/test_cpu_kernels.py checks 4): from 8 elements on, every such
    gate gives NaN (seen for -88.8, -89, -90, -103, -200, -1e10; fast-math's reciprocal
    estimate + Newton step gives NaN for 1 / inf; positive gates show it too: silu(88) came
    out 87.99999). Elements in the loop's 8- and 16-wide vector blocks are NaN, only the
    scalar tail (the last n % 8) is right, so in a real [rows, 1536] tensor one large
    negative gate activation in a decode row turns the MLP output, then the whole hidden state,
    into NaN."""
    gate = mx.array(np.where(np.arange(n) % 3 == 0, -90.0, 1.5).astype(np.float32))
    up = mx.ones((n,), dtype=mx.float32)
    want = np.array(mlx_swiglu(gate, up))
    got = np.array(native.silu_mul(gate, up))
    assert not np.isnan(want).any()
    assert not np.isnan(got).any(), got
    assert np.allclose(got, want, rtol=2e-6, atol=0)


def test_installed_model_with_large_negative_gates_stays_finite(monkeypatch):
    """The same through a model: a tiny llama whose first MLP has large gate pre-activations
    (gate_proj weight x 100, so some gates fall below -89) gives finite logits with mlx-lm's
    swiglu and all-NaN logits (1500 of 1500 seen) once install_cpu_kernels routed swiglu to
    the native kernel."""
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=300, tie_word_embeddings=True)
    mx.random.seed(3)
    model = llama.Model(args)
    model.layers[0].mlp.gate_proj.weight = model.layers[0].mlp.gate_proj.weight * 100
    mx.eval(model.parameters())
    # the reference with mlx-lm's own swiglu, whatever an earlier install routed module-wide
    monkeypatch.setattr(llama, "swiglu", mlx_swiglu)
    tokens = mx.array([[1, 2, 3, 4, 5]])
    want = model(tokens)
    assert mx.isfinite(want).all().item()
    cpu_kernels.install_cpu_kernels(model)
    got = model(tokens)
    assert not mx.isnan(got).any().item(), int(mx.isnan(got).sum().item())
    assert float(mx.abs(got - want).max()) <= 1e-4 * float(mx.abs(want).max())


def _rope_pair(dims: int, base: float, **kwargs) -> tuple[nn.RoPE, nn.RoPE]:
    """An MLX ``nn.RoPE`` and the same layer as the installed ``NativeRoPE``."""
    ref = nn.RoPE(dims, base=base, **kwargs)
    nat = nn.RoPE(dims, base=base, **kwargs)
    nat.__class__ = cpu_kernels.NativeRoPE
    return ref, nat


def _x(shape: tuple[int, ...], seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("offset", [-5, "array"], ids=["int", "per_row"])
def test_native_rope_negative_offsets_match_mlx(offset):
    """mx.fast.rope takes negative offsets, and mlx-lm's own ``BatchKVCache`` passes them
    (``offset = -left_padding``). rope_f32 computes the position as ``int64_t(offsets[b]) + l``
    with ``l`` a size_t: the sum is unsigned, so every row whose position offset + l is
    negative is rotated by the angle of a position ~1.8e19 (rows with offset + l >= 0 wrap
    back to the right value). Max abs difference to MLX seen: 2.83 for unit-normal x; with
    offset -1 and L = 3 only row 0 differs (3.15)."""
    x = _x((2, 2, 3, 16))
    if offset == "array":
        offset = mx.array([-5, 7], dtype=mx.int32)
    ref, nat = _rope_pair(16, 10000.0)
    want = ref(x, offset)
    got = nat(x, offset)
    diff = float(mx.abs(got - want).max())
    assert diff < 2e-6


@pytest.mark.parametrize("offset", ["int64", "uint32", "python_int"])
def test_native_rope_offsets_outside_int32_match_mlx(offset):
    """Offsets MLX takes (int64 / uint32 arrays, Python ints) beyond int32 are cast to int32 by
    ``_rope_offsets`` (silently wrapped: differences to MLX of 3.7-4.7 seen), and a Python int
    >= 2**31 raises ``RuntimeError('std::bad_cast')`` where nn.RoPE works. Expected: MLX's
    result (e.g. by falling back to it) or a clear error naming the offset."""
    x = _x((2, 2, 3, 16))
    offset = {"int64": mx.array([2**31 + 5, 7], dtype=mx.int64),
              "uint32": mx.array([2**32 - 3, 7], dtype=mx.uint32),
              "python_int": 2**31 + 5}[offset]
    ref, nat = _rope_pair(16, 10000.0)
    want = ref(x, offset)
    got = nat(x, offset)
    diff = float(mx.abs(got - want).max())
    assert diff < 1e-5


@pytest.mark.parametrize("dims, base", [(80, 160000.0), (96, 50000.0), (80, 20000.0),
                                        (96, 10000000.0)])
def test_native_rope_inverse_frequencies_match_mlx(dims, base):
    """``_inv_freq`` claims to compute MLX's rope inverse frequencies bit for bit, but computes
    ``log(base) / half`` in double precision (Python) where MLX 0.32.4's fallback computes
    ``std::log(float base) / half`` in float: for these (dims, base) some frequencies differ in
    the last bit, and at position 4096 the outputs differ from nn.RoPE by 2e-4 .. 9e-4 (seen),
    growing with the position. With equal frequencies the difference is ~2e-7."""
    x = _x((1, 2, 3, dims))
    ref, nat = _rope_pair(dims, base)
    want = ref(x, 4096)
    got = nat(x, 4096)
    diff = float(mx.abs(got - want).max())
    assert diff < 2e-6


def test_native_rope_with_one_offset_in_a_shapeless_compile_follows_the_batch():
    """An int offset becomes offsets ``[1]``, which the ``rope`` builder broadcasts to the
    traced batch size (``mx::broadcast_to(offsets, {B})``). Under ``mx.compile(shapeless=True)``
    that broadcast keeps the first call's B, and ``Rope::eval_cpu`` never checks the offsets'
    size against x's batch: with a larger batch it reads ``offsets[b]`` past the end of the
    buffer (an out-of-bounds heap read) and rotates those rows by garbage positions. Seen: B = 1
    then B = 64 -> max abs difference to nn.RoPE 5.8 (the direct kernel call with offsets [1]:
    6.3 already at B = 8). Expected: the right rotation, or a clear error (MLX's own
    mx.fast.rope refuses shapeless compilation: "Slice cannot infer output shapes")."""
    ref, nat = _rope_pair(16, 10000.0)
    step = mx.compile(lambda a: nat(a, 5), shapeless=True)
    try:
        mx.eval(step(_x((1, 2, 3, 16))))
        # what lies past the buffer varies: several batch sizes (reads <= 1 KiB past it)
        diffs = {}
        for batch in (2, 8, 64, 256):
            x = _x((batch, 2, 3, 16), seed=batch)
            diffs[batch] = float(mx.abs(step(x) - ref(x, 5)).max())
    except ValueError:
        return  # refused: as MLX's own rope
    assert max(diffs.values()) < 2e-6, diffs


def test_native_rms_norm_in_a_shapeless_compile_checks_the_weight_size():
    """Under ``mx.compile(shapeless=True)`` a call with another last dimension than the traced
    one reaches ``RmsNorm::eval_cpu`` unchecked (the builder's check ran at trace time only;
    ``output_shapes`` does not re-check): x [2, 64] with a [16] weight reads 48 floats past
    the weight's buffer and returns a result. MLX's mx.fast.rms_norm raises "[rms_norm]
    (*weight) must have the same size as the last dimension of x"."""
    w = mx.ones((16,), dtype=mx.float32)
    step = mx.compile(lambda a: native.rms_norm(a, w, 1e-5), shapeless=True)
    mx.eval(step(_x((2, 16))))
    with pytest.raises(ValueError):
        mx.eval(step(_x((2, 64))))


_ROPE_SHAPELESS_SMALLER_D = """
import mlx.core as mx
from vllm_unified_native import rope
inv = mx.exp(mx.arange(0, -8, -1, dtype=mx.float32) * 0.5)
step = mx.compile(lambda a: rope(a, 16, False, inv, 1.0, mx.array([1], mx.int32)),
                  shapeless=True)
mx.eval(step(mx.ones((1, 1, 1, 16))))
try:
    for _ in range(50):
        mx.eval(step(mx.ones((1, 1, 1, 4))))
    print("returned")
except ValueError as e:
    print("raised", e)
"""


def test_native_rope_in_a_shapeless_compile_never_writes_past_its_output():
    """The same unchecked path with a head size below ``dims``: rope_f32 writes
    ``o[i + half]`` for i < dims / 2 into rows of D = 4 floats, past the output buffer (heap
    corruption: the process seen dying with "free(): invalid size"). Run in a subprocess.
    Expected: a clear error (as outside compile: "dims must be even and in (0, D]")."""
    out = subprocess.run([sys.executable, "-c", _ROPE_SHAPELESS_SMALLER_D],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("raised"), (
        out.returncode, out.stdout, out.stderr[-300:])


def test_native_rms_norm_row_whose_sum_of_squares_overflows_matches_mlx():
    """cpu_math.cpp is compiled with -ffast-math, so ``1.f / std::sqrt(ss / D + eps)`` becomes
    an rsqrt estimate + Newton step: for ss = inf it gives NaN (inf * 0), not IEEE's 0. MLX's
    mx.fast.rms_norm returns 0 for such a row (its rsqrt(inf) is 0); the native kernel returns
    NaN for every element of the row (the cpu_math.cpp header says nothing there depends on
    NaN/inf semantics beyond IEEE behaviour)."""
    x = mx.array([[1e20, 1e20, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]], dtype=mx.float32)
    w = mx.ones((4,), dtype=mx.float32)
    want = np.array(mx.fast.rms_norm(x, w, 1e-5))
    got = np.array(native.rms_norm(x, w, 1e-5))
    assert not np.isnan(want).any()
    assert np.array_equal(np.isnan(got), np.isnan(want)), got
    assert np.allclose(got, want, rtol=1e-6, atol=0)


def test_native_rope_refuses_a_bool_offset_like_mlx():
    """nn.RoPE / mx.fast.rope refuse ``offset=True`` ("[rope] offset must be an integer but got
    type bool"); NativeRoPE takes it as position 1 (``isinstance(True, int)``) and returns a
    result: a parameter MLX rejects is silently accepted."""
    x = _x((1, 2, 3, 16))
    ref, nat = _rope_pair(16, 10000.0)
    with pytest.raises(ValueError, match="integer"):
        ref(x, True)
    with pytest.raises(ValueError, match="integer"):
        nat(x, True)


def _tiny_quantized_qwen3_next() -> nn.Module:
    from tiny_models import tiny_quantized_mlx_model

    return tiny_quantized_mlx_model("qwen3_next")


def test_quantized_moe_experts_are_not_left_to_mlx_quantized_matmul():
    """Since 2319ff0 the loader keeps MLX-quantized checkpoints quantized on the CPU
    (``keep_quantized_on_cpu``); before, ``mlx_lm.utils.dequantize_model`` also turned mlx-lm's
    ``QuantizedSwitchLinear`` experts (qwen3_next, granitemoehybrid: supported model types)
    into dense ``SwitchLinear``. ``install_cpu_kernels`` only looks at exact
    ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``, so the experts now stay on MLX's
    quantized ``gather_qmm``, which the docs say is avoided ("Other quantized layers ... are
    dequantized to fp32 after loading ... MLX's one-core quantized matmul would be far
    slower"), and the start-up log does not name them. Measured here (OpenBLAS, 16 experts,
    512 -> 1024, top-2): 4 tokens 8.8 ms quantized vs 2.3 ms dense, 64 tokens 2.3 s vs 0.61 s.
    They now stay quantized on the native expert kernel (``NativeQuantizedSwitchLinear``,
    tests/test_expert_kernels.py), named in the log; none is left on MLX's own layer."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    model = _tiny_quantized_qwen3_next()
    routed = cpu_kernels.install_cpu_kernels(model)
    left = [name for name, m in model.named_modules() if type(m) is QuantizedSwitchLinear]
    assert not left, (left, routed)
    assert any("quantized expert layers" in line for line in routed), routed


def test_cpu_quantized_env_rejects_values_other_than_0_and_1(monkeypatch):
    """``VLLM_UNIFIED_CPU_QUANTIZED=false`` (or ``no``, ``off``) silently keeps checkpoints
    quantized: only the exact string ``0`` is read. The project's rule is a clear start-up error
    naming the flag (as ``VLLM_UNIFIED_COMPILE_DECODE`` does: any value but 0/1 is an error)."""
    monkeypatch.setenv("VLLM_UNIFIED_CPU_QUANTIZED", "false")
    with pytest.raises(ValueError, match="VLLM_UNIFIED_CPU_QUANTIZED"):
        cpu_kernels.keep_quantized_on_cpu(mx.float32)


_ISA_TYPO = """
import mlx.core as mx
from vllm_unified_native import dequantize
wq, s, b = mx.quantize(mx.ones((4, 64)), group_size=32, bits=4)
mx.eval(dequantize(wq, s, b, 32, 4))
print("ran")
"""


def test_cpu_isa_env_rejects_unknown_values():
    """``VLLM_UNIFIED_CPU_ISA`` takes ``avx2`` or ``portable`` (docs/configuration.md); any
    other value (a typo such as ``avx-2``) is silently treated as "the best the CPU has", so a
    test or comparison meant to run the AVX2 variant runs AVX-512 without a word. Expected: an
    error naming the variable."""
    env = {**os.environ, "VLLM_UNIFIED_CPU_ISA": "avx-2"}
    out = subprocess.run([sys.executable, "-c", _ISA_TYPO], env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "VLLM_UNIFIED_CPU_ISA" in out.stderr, out.stdout


_CONFIGURE_LATE = """
import mlx.core as mx
import pytest
from vllm_unified_native import configure, dequantize, linear
configure("avx2", 1)
configure("avx2", 1)
wq, s, b = mx.quantize(mx.ones((4, 64)), group_size=32, bits=4)
mx.eval(dequantize(wq, s, b, 32, 4), linear(mx.ones((2, 64)), mx.ones((4, 64))))
configure("avx2", 1)
with pytest.raises(RuntimeError, match="cpu_isa"):
    configure("portable", 1)
with pytest.raises(RuntimeError, match="cpu_threads"):
    configure("avx2", 2)
with pytest.raises(ValueError, match="cpu_isa"):
    configure("avx-2", 1)
print("ok")
"""


def test_native_configure_after_a_kernel_ran_keeps_the_decision():
    """Guard: the ISA and thread caps (vllm_unified_native sets them at import from
    ``vllm_unified.envs``) are decided once per process when a kernel first runs; configure
    with the same values is a no-op afterwards, other values are a RuntimeError, never a
    silent half-change."""
    out = subprocess.run([sys.executable, "-c", _CONFIGURE_LATE], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_native_rope_table_kept_between_calls_follows_every_input():
    """The kernel keeps the last call's cos/sin table for the next call at the same positions
    (every layer of a step rotates at the same positions). Calls that differ only in the
    offsets' values, the base, the scale, the length or the batch must each recompute it:
    each call of this sequence equals nn.RoPE's output."""
    rng = np.random.default_rng(4)
    x = _x((4, 3, 2, 64))
    calls = []
    for base, scale in [(10000.0, 1.0), (10000.0, 0.5), (500000.0, 1.0)]:
        ref, nat = _rope_pair(64, base, scale=scale)
        for offsets in ([0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 3]):
            calls.append((ref, nat, x, mx.array(offsets, mx.int32)))
        calls.append((ref, nat, x[:, :, :1], mx.array([0, 1, 2, 3], mx.int32)))
        calls.append((ref, nat, x[:3], mx.array([0, 1, 2], mx.int32)))
    calls.append((calls[0][0], calls[0][1], x, mx.array(rng.integers(0, 9000, 4), mx.int32)))
    for i, (ref, nat, xi, offsets) in enumerate(calls):
        want = ref(xi, offsets)
        got = nat(xi, offsets)
        mx.eval(got)  # one call at a time: the table of the previous call is the one kept
        assert float(mx.abs(got - want).max()) < 2e-6, i


_POOL_GENERATIONS = r"""
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#define private public  // the harness sets the job counter; the pool's code is unchanged
#include "thread_pool.h"
#undef private

int main() {
  vun::ThreadPool pool(2);
  pool.generation_ = 0xffffffffull - 1;  // jobs 2^32 - 1, 2^32, 2^32 + 1
  int idle = 0;
  for (int job = 0; job < 3; ++job) {
    const auto caller = std::this_thread::get_id();
    std::atomic<bool> caller_ran{false};
    pool.run(2, [&](size_t) {
      if (std::this_thread::get_id() == caller) {
        caller_ran = true;
        return;
      }
      // The worker's chunk waits for the caller to take the other one; bounded, so that a
      // caller that takes no chunk fails the check below instead of hanging the test.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!caller_ran && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    });
    if (!caller_ran) {
      std::printf("job %d: the caller took no chunk\n", job);
      ++idle;
    }
  }
  std::printf("%d idle\n", idle);
  return idle == 0 ? 0 : 1;
}
"""


def test_kernel_pool_caller_keeps_taking_chunks_after_2_to_the_32_jobs(tmp_path):
    """ThreadPool::run passes the full 64-bit job counter to the caller's take_chunks, but the
    state word keeps only its low 32 bits (``gen << 32``). From job 2^32 on (about a week of
    decode at ~200 kernel calls per step and ~30 steps/s) the caller's generation never
    matches the state's, so MLX's stream thread takes no chunk at all: it spins while the
    workers do everything (half the kernel throughput on 2 cores; a process without worker
    threads, e.g. forked after the pool started, would spin forever). Seen with this harness:
    'job 1: the caller took no chunk', 'job 2: ...' (generations 2^32 and 2^32 + 1; the worker
    then ran both chunks of each job)."""
    out = _run_pool_harness(tmp_path, _POOL_GENERATIONS)
    assert out.returncode == 0, out.stdout + out.stderr


def _run_pool_harness(tmp_path, source: str, *args: str,
                      link: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Compiles a C++ program against native/src/thread_pool.h (and the native/src files in
    ``link``) and runs it (a hang fails the test through the timeout instead of stalling the
    suite)."""
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "a C++ compiler (the native extension's build needs one)"
    src = tmp_path / "harness.cpp"
    src.write_text(source)
    native_src = os.path.join(os.path.dirname(__file__), "..", "native", "src")
    exe = tmp_path / "harness"
    subprocess.run([cxx, "-std=c++20", "-O2", "-ffp-contract=off", "-pthread", "-I", native_src,
                    str(src), *(os.path.join(native_src, f) for f in link), "-o", str(exe)],
                   check=True, capture_output=True, timeout=300)
    try:
        return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the pool harness hung: {e.stdout!r}") from None


_POOL_STRESS = r"""
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>
#include "thread_pool.h"

int main(int argc, char** argv) {
  const int jobs = std::atoi(argv[1]);
  vun::ThreadPool pool(3);  // more threads than this machine's cores: preempted mid-claim
  std::vector<std::atomic<int>> runs(64);
  const size_t sizes[] = {3, 16, 2, 64, 5, 33, 4};  // jobs with more chunks than the last
  for (int job = 0; job < jobs; ++job) {
    const size_t n = sizes[job % 7];
    for (size_t c = 0; c < n; ++c) runs[c].store(0);
    const bool fail = job % 101 == 0;  // a chunk that throws now and then
    try {
      pool.run(n, [&](size_t c) {
        runs[c].fetch_add(1);
        if (fail && c == n - 1) throw std::runtime_error("chunk failed");
      });
      if (fail) {
        std::printf("job %d: the chunk's exception was not rethrown\n", job);
        return 1;
      }
    } catch (const std::runtime_error&) {
      if (!fail) {
        std::printf("job %d: an exception no chunk threw\n", job);
        return 1;
      }
    }
    for (size_t c = 0; c < n; ++c) {
      if (runs[c].load() != 1) {
        std::printf("job %d: chunk %zu ran %d times\n", job, c, runs[c].load());
        return 1;
      }
    }
  }
  std::printf("ok\n");
  return 0;
}
"""


def test_kernel_pool_runs_every_chunk_once_over_many_short_jobs(tmp_path):
    """A guard for the livelock e65cd9a fixed (no test came with it): a worker of the previous
    job could claim a chunk of a new job with more chunks under the old generation, so a chunk
    ran twice and the caller's wait for ``done_ == chunks`` never ended. One million tiny jobs
    of alternating chunk counts (with a throwing chunk every 101st job) on 3 threads: the pool
    before e65cd9a failed this in 6 of 6 runs here (a chunk run twice by job 414, 470, 3445,
    or a hang), the pool now passes it. Each chunk runs exactly once and a chunk's exception
    comes out of run()."""
    out = _run_pool_harness(tmp_path, _POOL_STRESS, "1000000")
    assert out.returncode == 0, out.stdout + out.stderr


_AMX_BOUNDS = r"""
// cpu_amx.cpp's kernels, called the way native.cpp's amx_quantized_linear calls them, with
// every buffer ending (even cases) or starting (odd cases) at an inaccessible page and y
// pre-filled with a NaN sentinel: a read or write past any buffer faults, an output left
// unwritten or wrong is counted.
#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "cpu_math.h"

static const size_t kPage = 4096;

// `bytes` right before a PROT_NONE page (at_end, start aligned down to `align`) or right after.
static char* guarded(size_t bytes, bool at_end, size_t align) {
  const size_t body = (bytes + kPage - 1) / kPage * kPage + kPage;
  char* base = static_cast<char*>(mmap(nullptr, body + 2 * kPage, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  mprotect(base, kPage, PROT_NONE);
  mprotect(base + kPage + body, kPage, PROT_NONE);
  if (!at_end) return base + kPage;
  const uintptr_t p = reinterpret_cast<uintptr_t>(base + kPage + body - bytes);
  return reinterpret_cast<char*>(p / align * align);
}

int main(int argc, char** argv) {
  if (!vun::amx_usable()) return 2;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  const size_t Ms[] = {4, 15, 16, 17, 31, 32, 33, 47, 49, 64, 65, 129};
  const size_t Ns[] = {1, 15, 16, 17, 63, 65, 385};
  const size_t gss[] = {32, 64, 128};
  int failures = 0;
  for (int c = 0; c < std::atoi(argv[1]); ++c) {
    const size_t M = Ms[rng() % 12], N = Ns[rng() % 7], gs = gss[rng() % 3];
    const int bits = rng() % 2 ? 4 : 8;
    const size_t K = gs * (1 + rng() % 4), groups = K / gs;
    const bool at_end = c % 2 == 0;
    auto* x = reinterpret_cast<float*>(guarded(M * K * 4, at_end, 4));
    auto* w = reinterpret_cast<uint32_t*>(guarded(N * K * bits / 8, at_end, 4));
    // every third case keeps its scales and biases as float16 (2-byte elements)
    const bool half = c % 3 == 1;
    const auto st = half ? vun::ScaleType::kF16 : vun::ScaleType::kF32;
    const size_t elem = half ? 2 : 4;
    void* sh = guarded(N * groups * elem, at_end, 2);
    void* bh = guarded(N * groups * elem, at_end, 2);
    std::vector<float> s(N * groups), b(N * groups);
    auto* y = reinterpret_cast<float*>(guarded(M * N * 4, at_end, 4));
    std::vector<uint8_t> q(N * K);
    std::memset(w, 0, N * K * bits / 8);
    for (size_t i = 0; i < N * K; ++i) {
      q[i] = rng() % (1u << bits);
      w[i * bits / 32] |= uint32_t{q[i]} << (i * bits % 32);
    }
    for (size_t i = 0; i < N * groups; ++i) {
      s[i] = normal(rng) * 0.05f, b[i] = normal(rng) * 0.3f;
      if (half) {
        const _Float16 hs = static_cast<_Float16>(s[i]), hb = static_cast<_Float16>(b[i]);
        std::memcpy(static_cast<char*>(sh) + 2 * i, &hs, 2);
        std::memcpy(static_cast<char*>(bh) + 2 * i, &hb, 2);
        s[i] = static_cast<float>(hs), b[i] = static_cast<float>(hb);
      } else {
        std::memcpy(static_cast<char*>(sh) + 4 * i, &s[i], 4);
        std::memcpy(static_cast<char*>(bh) + 4 * i, &b[i], 4);
      }
    }
    for (size_t i = 0; i < M * K; ++i) x[i] = normal(rng);
    const uint32_t sentinel = 0x7fc0dead;
    for (size_t i = 0; i < M * N; ++i) std::memcpy(&y[i], &sentinel, 4);
    const size_t te = vun::amx_x_tile_elems(M, K), sf = vun::amx_x_sum_floats(M, K, gs);
    auto* tiles = reinterpret_cast<uint16_t*>(guarded(te * 2 + sf * 4, at_end, 64));
    auto* sums = reinterpret_cast<float*>(tiles + te);
    const size_t mblocks = (M + 15) / 16, nblocks = (N + 15) / 16;
    vun::amx_prepare_x(x, M, K, gs, tiles, sums, 0, mblocks);
    if (mblocks <= 2) {
      for (size_t nb = 0; nb < nblocks; nb += 4) {
        vun::amx_quantized_linear_blocks(tiles, sums, w, sh, bh, st, y, M, N, K, gs, bits, nb,
                                         std::min(nblocks, nb + 4));
      }
    } else {
      auto* panel = reinterpret_cast<uint16_t*>(
          guarded(vun::amx_weight_elems(N, K) * 2, at_end, 64));
      vun::amx_unpack_weight(w, N, K, bits, panel, 0, nblocks);
      for (size_t mb = 0; mb < mblocks; mb += 4) {
        for (size_t nb = 0; nb < nblocks; nb += 24) {
          vun::amx_quantized_linear_panel(tiles, sums, panel, sh, bh, st, y, M, N, K, gs, nb,
                                          std::min(nblocks, nb + 24), mb,
                                          std::min(mblocks, mb + 4));
        }
      }
    }
    double largest = 0, err = 0;
    size_t unwritten = 0;
    for (size_t m = 0; m < M; ++m) {
      for (size_t n = 0; n < N; ++n) {
        double want = 0;
        for (size_t k = 0; k < K; ++k) {
          const size_t g = n * groups + k / gs;
          want += double{x[m * K + k]} * (double{s[g]} * q[n * K + k] + double{b[g]});
        }
        uint32_t got;
        std::memcpy(&got, &y[m * N + n], 4);
        unwritten += got == sentinel;
        largest = std::max(largest, std::fabs(want));
        err = std::max(err, std::fabs(want - y[m * N + n]));
      }
    }
    if (unwritten || !(err <= 2e-6 * largest)) {
      ++failures;
      std::printf("M=%zu N=%zu K=%zu gs=%zu bits=%d: %zu outputs unwritten, error %g of %g\n",
                  M, N, K, gs, bits, unwritten, err, largest);
    }
  }
  std::printf("%d failed\n", failures);
  return failures ? 1 : 0;
}
"""


def test_amx_kernels_stay_inside_their_buffers(tmp_path):
    """A guard (the review of the AMX kernels found no such bug): row and column tails (M, N not
    multiples of 16), both the decode path (weight tiles unpacked where used) and the prefill
    panel, each buffer next to an inaccessible page on either side: the kernels read and write
    nothing outside x, w, scales, biases, their scratch and y [M, N], and write every output."""
    if not native.amx_usable():
        pytest.skip("CPU without AMX (or VLLM_UNIFIED_CPU_ISA below amx)")
    out = _run_pool_harness(tmp_path, _AMX_BOUNDS, "120",
                            link=("cpu_amx.cpp", "cpu_config.cpp", "cpu_quant.cpp"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_paged_attention_bad_block_in_a_pool_chunk_raises_and_leaves_the_pool_usable():
    """Checked in review, found right (kept as a guard): the block-range check now runs inside
    the (row, KV head) items on the kernel pool, so it throws on whichever thread runs the
    item. The error must still come out of mx.eval with its message, and the pool must take
    the next calls (no job left half-open, no chunk counted twice): the same good call before
    and after failing ones gives the same bits."""
    rng = np.random.default_rng(5)
    rows, heads, kv_heads, dim, block_size, num_blocks = 48, 4, 2, 64, 8, 64
    pool = mx.array(rng.standard_normal((num_blocks * block_size, kv_heads, 2 * dim))
                    .astype(np.float32))
    tables = rng.integers(0, num_blocks, (rows, 4)).astype(np.int32)
    seqs = mx.array(np.arange(rows, dtype=np.int32))
    lens = mx.array(rng.integers(1, 4 * block_size + 1, rows).astype(np.int32))
    q = mx.array(rng.standard_normal((rows, heads, dim)).astype(np.float32))
    want = np.array(native.paged_attention(q, pool, mx.array(tables), seqs, lens, 0.125,
                                           block_size))
    bad = tables.copy()
    bad[[17, 40]] = num_blocks + 3  # rows in different chunks
    for _ in range(3):
        with pytest.raises(RuntimeError, match="outside a pool of 512 slots"):
            mx.eval(native.paged_attention(q, pool, mx.array(bad), seqs, lens, 0.125,
                                           block_size))
        got = native.paged_attention(q, pool, mx.array(tables), seqs, lens, 0.125, block_size)
        assert np.array_equal(np.array(got), want)


_ATTENTION_NO_KV_HEADS = """
import mlx.core as mx
from vllm_unified_native import paged_attention
t = mx.array([[0]], mx.int32)
try:
    paged_attention(mx.zeros((1, 4, 8)), mx.zeros((8, 0, 16)), t, t[0], t[0] + 1, 1.0, 8)
    print("returned")
except ValueError as e:
    print("raised", e)
"""


def test_paged_attention_refuses_a_pool_without_kv_heads():
    """The builder checks ``H % Hkv`` before anything rules out Hkv = 0: a [slots, 0, 2D] pool
    (a malformed cache) makes it divide by zero and the process dies of SIGFPE instead of
    raising (seen: return code -8). Run in a subprocess. Expected: the ValueError naming the
    shapes that other bad shapes get."""
    out = subprocess.run([sys.executable, "-c", _ATTENTION_NO_KV_HEADS], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.startswith("raised"), (
        out.returncode, out.stdout, out.stderr[-300:])
    assert "H % Hkv" in out.stdout
