// vllm-unified-native: zero-copy helpers between torch and MLX's CPU backend.
//
// Built against the exact MLX the venv runs (headers and libmlx.so from the installed wheel) with
// nanobind 3.1.0 in MLX's nanobind domain, so `mx.array`, `mx.Dtype`, `mx.Stream` and
// `mx.Device` arguments and results are the very types mlx.core binds.
//
//   adopt(ptr, nbytes, shape, dtype, owner) -> mx.array
//       An MLX array aliasing foreign memory ("sidecar" mode). MLX's allocator does not own the
//       bytes: MLX never frees, recycles or counts them; when the last MLX reference goes, a
//       deleter releases `owner` (under the GIL, or leaks it if the interpreter is finalising).
//   write_rows(dst, row_idx, src, *, stream=None) -> mx.array
//       A lazy primitive writing src's rows into dst's buffer *in place*; its output shares that
//       buffer, so every alias (torch views included) sees the write and readers of the output
//       are ordered after it.
//   write_kv(dst, slot_mapping, keys, values, *, stream=None) -> mx.array
//       write_rows of keys and values side by side into a dense K|V pool, without building
//       their concatenation.
//   gather_kv(pool, rows, *, stream=None) -> (keys, values)
//       A lazy gather of rows of a [rows, 2 * D] K|V pool into two row-contiguous arrays (the
//       paged attention's key/value read; MLX's generic gather is several times slower here).
//   silu_mul(gate, up, *, stream=None) -> mx.array
//       fp32 silu(gate) * up, vectorized (MLX 0.32.4's CPU sigmoid is scalar).
//   gelu_tanh_mul(gate, up, *, stream=None) -> mx.array
//   softcap(x, cap, *, stream=None) -> mx.array
//       fp32 gelu_approx(gate) * up and cap * tanh(x / cap), vectorized (MLX's CPU tanh is
//       scalar).
//   gelu(x, *, approximate=False, stream=None) -> mx.array
//       fp32 GELU, exact (erf) or tanh-approximated, vectorized (MLX's CPU erf is scalar).
//   softmax(x, *, stream=None) -> mx.array
//       fp32 softmax over the last axis, vectorized (MLX's CPU exp is scalar).
//   paged_attention(q, kv_pool, tables, seqs, lens, scale, block_size, window=0, *, ...,
//                   chunk=0, softcap=0, sinks=None, stream=None)
//       Attention per query row read from the paged pool through block tables (no gather):
//       decode rows and prefill chunks (causal) alike; the rows of prefill chunks by a blocked
//       kernel (cpu_attn_tile.cpp) where it applies.
//   linear(x, w, *, stream=None) -> mx.array
//       fp32 x @ w.T reading each weight row once, threaded (decode-sized batches).
//   quantized_linear(x, w, scales, biases, group_size, bits, *, stream=None) -> mx.array
//       fp32 x @ dequantize(w).T for MLX affine-quantized w (2-6/8 bits), weights dequantized
//       4 rows at a time into a scratch buffer: bit-identical to linear on mx.dequantize(w).
//       scales and biases: float32, or float16 / bfloat16 (widened exactly as they are read).
//   dequantize(w, scales, biases, group_size, bits, *, stream=None) -> mx.array
//       mx.dequantize to fp32, vectorized and threaded (MLX's CPU one is scalar, one thread).
//   gather_quantized_linear(x, w, scales, biases, indices, group_size, bits, mode="affine", *,
//                           stream=None) -> mx.array
//       mx.gather_qmm(x, w, ..., rhs_indices=indices, transpose=True) for mixture-of-experts
//       layers (MLX affine experts of quantized_linear's widths, or mxfp4): pairs grouped by
//       expert, each active expert's weight read once per call for all of its rows, threaded.
//   rms_norm(x, weight, eps, *, stream=None) -> mx.array
//   rope(x, dims, traditional, inv_freq, scale, offsets, *, stream=None) -> mx.array
//       fp32 RMSNorm / rotary embedding as one primitive each (MLX's CPU backend evaluates
//       mx.fast.rms_norm / mx.fast.rope as graphs of ~10 / ~30 primitives).
//   to_torch(a) -> torch.Tensor
//       A torch view of an array's bytes with an exact data pointer (MLX's own DLPack export
//       breaks torch for adopted arrays whose offset is negative).
//   info(a) -> dict
//       Pointers and ownership facts of an (evaluated) array, for tests and assertions.
//
// Only the CPU allocator's buffer layout is supported for adopt (a size_t header in front of the
// data: Buffer::ptr() is the header, Buffer::raw_ptr() == ptr + 8), and only CPU streams for
// write_rows; GPU builds and streams raise: on GPU backends the in-place MLX kernels of
// src/vllm_unified/kv/gpu/write.py (write_kv_gpu, write_rows_gpu) write the pool instead.

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/gpu/device_info.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "mlx/utils.h"

#include "cpu_attn_tile.h"
#include "cpu_kvquant.h"
#include "cpu_lora.h"
#include "cpu_math.h"
#include "thread_pool.h"

#if defined(__linux__)
#include <sched.h>
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// The kernels' thread pool (defined with the linear kernels below).
vun::ThreadPool& kernel_pool();

// Runs fn(begin, end) over [0, n) in pieces whose bounds are multiples of `align`, on the kernel
// pool when the work (n * cost elements) is large enough to pay for waking it, else inline;
// several pieces per thread, so a thread the OS holds back costs at most one piece.
// Aligned bounds keep a vectorized loop's body / scalar-tail split where one call puts it.
template <typename Fn>
void split_work(size_t n, size_t cost, size_t align, const Fn& fn) {
  constexpr size_t kMinParallel = 65536;  // elements: below this waking the pool costs more
  auto& pool = kernel_pool();
  const size_t units = (n + align - 1) / align;
  const size_t chunks = n * cost < kMinParallel ? 1 : std::min(units, 8 * pool.size());
  if (chunks <= 1) {
    fn(size_t{0}, n);
    return;
  }
  pool.run(chunks, [&](size_t c) {
    fn(std::min(n, units * c / chunks * align), std::min(n, units * (c + 1) / chunks * align));
  });
}

[[noreturn]] void raise_py(PyObject* type, const std::string& msg) {
  PyErr_SetString(type, msg.c_str());
  throw nb::python_error();
}

std::string shape_str(const mx::Shape& shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    os << (i ? ", " : "") << shape[i];
  }
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// Row-contiguous inputs without graph nodes

// `a` itself when it is row-contiguous (the usual case: activations straight out of another
// kernel), else a temporary filled by a strided copy dispatched on `enc` before the caller's
// kernel (same stream: runs first). Called from eval_cpu, where an input's layout is known but
// its data may not be computed yet. A builder-side mx::contiguous would add a graph node to
// every call, ~750 per decode step of a 30-layer model, nearly all of them no-ops.
mx::array row_contiguous(const mx::array& a, mx::cpu::CommandEncoder& enc) {
  if (a.flags().row_contiguous) {
    return a;
  }
  mx::array out(a.shape(), a.dtype(), nullptr, {});
  out.set_data(mx::allocator::malloc(out.nbytes()));
  enc.add_temporary(out);
  enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([src = a.data<char>(), dst = out.data<char>(), shape = a.shape(),
                strides = a.strides(), item = a.itemsize(), n = a.size()]() {
    const int nd = static_cast<int>(shape.size());
    // Runs along the last axis when it is dense, single elements otherwise.
    const bool dense_last = nd > 0 && strides[nd - 1] == 1;
    const size_t run = dense_last ? static_cast<size_t>(shape[nd - 1]) : 1;
    const int outer = dense_last ? nd - 1 : nd;
    std::vector<int64_t> idx(static_cast<size_t>(std::max(outer, 0)), 0);
    for (size_t i = 0; i < n; i += run) {
      int64_t off = 0;
      for (int d = 0; d < outer; ++d) {
        off += idx[d] * strides[d];
      }
      std::memcpy(dst + i * item, src + off * static_cast<int64_t>(item), run * item);
      for (int d = outer - 1; d >= 0; --d) {
        if (++idx[d] < shape[d]) {
          break;
        }
        idx[d] = 0;
      }
    }
  });
  return out;
}

// For builders: `a` when it is already computed and row-contiguous (weights, host-made index
// arrays), else mx::contiguous(a).
mx::array contiguous_input(const mx::array& a, const mx::Stream& s) {
  if (a.is_available() && a.flags().row_contiguous) {
    return a;
  }
  return mx::contiguous(a, false, s);
}

// ---------------------------------------------------------------------------------------------
// Kernels of MLX's CPU backend only

// A primitive with a CPU implementation only: on a GPU stream it raises "[what] CPU only".
class CpuOnlyPrimitive : public mx::Primitive {
 public:
  CpuOnlyPrimitive(mx::Stream s, const char* what) : mx::Primitive(s), what_(what) {}

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("[") + what_ + "] CPU only");
  }

 private:
  const char* what_;  // a string literal: the Python-facing function's name
};

// ... whose one output has its first input's shape (elementwise and per-row kernels).
class SameShapePrimitive : public CpuOnlyPrimitive {
 public:
  using CpuOnlyPrimitive::CpuOnlyPrimitive;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// ---------------------------------------------------------------------------------------------
// adopt

// Whether the running MLX allocator keeps the buffer size in a size_t header at Buffer::ptr()
// and the data right after it, which is what the sidecar header imitates. True for the CPU
// ("common") allocator of mlx[cpu]; false for the Metal and CUDA allocators, whose Buffer wraps
// a device object. Probed once with a real allocation instead of trusted from the build flavour.
bool cpu_allocator_layout() {
  static const bool ok = [] {
    if (mx::gpu::is_available()) {
      return false;
    }
    auto data = mx::allocator::malloc(24);
    auto buf = data.buffer();
    const auto* hdr = static_cast<const size_t*>(buf.ptr());
    return hdr != nullptr && mx::allocator::allocator().size(buf) == hdr[0] && hdr[0] >= 24 &&
        buf.raw_ptr() == static_cast<void*>(static_cast<char*>(buf.ptr()) + sizeof(size_t));
  }();
  return ok;
}

mx::array adopt(
    uintptr_t ptr,
    size_t nbytes,
    const std::vector<int64_t>& shape,
    mx::Dtype dtype,
    nb::object owner) {
  if (!cpu_allocator_layout()) {
    raise_py(
        PyExc_RuntimeError,
        "adopt: this MLX build does not use the CPU allocator (a GPU backend is active); "
        "foreign memory can only be adopted on MLX's CPU backend");
  }
  mx::Shape mshape;
  size_t numel = 1;
  for (auto d : shape) {
    if (d < 0 || d > INT32_MAX) {
      raise_py(
          PyExc_ValueError,
          "adopt: every dimension must be in [0, 2**31 - 1] (MLX dims are int32), got " +
              std::to_string(d));
    }
    mshape.push_back(static_cast<int32_t>(d));
    if (d != 0 && numel > SIZE_MAX / static_cast<size_t>(d)) {
      raise_py(PyExc_ValueError, "adopt: shape too large");
    }
    numel *= static_cast<size_t>(d);
  }
  const size_t itemsize = dtype.size();
  if (numel > SIZE_MAX / itemsize || numel * itemsize > nbytes) {
    raise_py(
        PyExc_ValueError,
        "adopt: shape " + shape_str(mshape) + " needs more bytes than nbytes=" +
            std::to_string(nbytes));
  }
  if (numel > 0 && ptr == 0) {
    raise_py(PyExc_ValueError, "adopt: null pointer for a non-empty array");
  }
  if (ptr % itemsize != 0) {
    raise_py(
        PyExc_ValueError,
        "adopt: pointer " + std::to_string(ptr) + " is not aligned to the item size " +
            std::to_string(itemsize));
  }

  // The sidecar header: {nbytes, 0}. Buffer{hdr} makes raw_ptr() == hdr + 1, and the data is
  // reached through the array's offset (which may be negative: the header is wherever malloc
  // put it).
  auto* hdr = static_cast<size_t*>(std::malloc(2 * sizeof(size_t)));
  if (hdr == nullptr) {
    throw std::bad_alloc();
  }
  hdr[0] = nbytes;
  hdr[1] = 0;
  PyObject* o = owner.release().ptr();  // the deleter's strong reference
  mx::allocator::Data data(mx::allocator::Buffer{hdr}, [o](mx::allocator::Buffer buf) {
    // May run on MLX's CPU worker thread, without the GIL. cleanup_guard takes it, or is false
    // when the interpreter is finalising (then the owner is deliberately leaked).
    if (nb::detail::cleanup_guard guard{}) {
      Py_DECREF(o);
    }
    std::free(buf.ptr());
  });

  mx::Strides strides(mshape.size(), 1);
  for (int i = static_cast<int>(mshape.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * mshape[i + 1];
  }
  const auto offset = static_cast<int64_t>(ptr) -
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(hdr + 1));
  mx::array out(mshape, dtype, nullptr, {});
  mx::array::Flags flags;
  flags.contiguous = true;
  flags.row_contiguous = true;
  // Same rule as MLX's own: column-contiguous too when at most one dim is larger than 1.
  size_t big = 0;
  for (auto d : mshape) {
    big += d > 1;
  }
  flags.col_contiguous = numel <= 1 || big <= 1;
  out.set_data(std::move(data), numel, std::move(strides), flags, offset);
  out.set_status(mx::array::Status::available);
  return out;
}

// ---------------------------------------------------------------------------------------------
// write_rows

std::string out_of_range_msg(int64_t bad, int64_t nrows) {
  return "[write_rows] row index " + std::to_string(bad) + " is out of range for a destination of " +
      std::to_string(nrows) + " rows (valid: 0 <= index < rows); nothing was written";
}

template <typename I>
std::optional<int64_t> first_bad(const I* idx, size_t n, int64_t nrows) {
  for (size_t i = 0; i < n; ++i) {
    const auto v = static_cast<int64_t>(idx[i]);
    if (v < 0 || v >= nrows) {
      return v;
    }
  }
  return std::nullopt;
}

std::optional<int64_t> first_bad(const mx::array& idx, int64_t nrows) {
  if (idx.dtype() == mx::int32) {
    return first_bad(idx.data<int32_t>(), idx.size(), nrows);
  }
  return first_bad(idx.data<int64_t>(), idx.size(), nrows);
}

template <typename I>
void copy_rows(char* dst, const I* idx, size_t n, const char* src, size_t row_bytes) {
  for (size_t i = 0; i < n; ++i) {
    std::memmove(dst + static_cast<size_t>(idx[i]) * row_bytes, src + i * row_bytes, row_bytes);
  }
}

class WriteRows : public mx::Primitive {
 public:
  explicit WriteRows(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& dst = inputs[0];
    auto& out = outputs[0];
    if (!dst.flags().row_contiguous) {
      throw std::invalid_argument(
          "[write_rows] the destination is not row-contiguous (a transposed or strided view); "
          "only row-contiguous destinations can be written in place");
    }
    // The output *is* the destination's buffer: same Data, strides, offset and flags.
    out.copy_shared_buffer(dst);

    const size_t n = inputs[1].size();
    if (n == 0) {
      return;
    }
    const int64_t nrows = dst.shape(0);
    const size_t row_bytes = nrows > 0 ? dst.nbytes() / static_cast<size_t>(nrows) : 0;
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array idx = row_contiguous(inputs[1], enc);
    const mx::array src = row_contiguous(inputs[2], enc);
    enc.set_input_array(dst);
    enc.set_input_array(idx);
    enc.set_input_array(src);
    enc.set_output_array(out);
    char* dptr = out.data<char>();
    const char* sptr = src.data<char>();
    const bool i32 = idx.dtype() == mx::int32;
    const void* iptr = i32 ? static_cast<const void*>(idx.data<int32_t>())
                           : static_cast<const void*>(idx.data<int64_t>());
    // Runs on the stream's worker thread once the inputs are computed. All indices are checked
    // before any row is written, so a bad index leaves the destination untouched; the exception
    // is stored by MLX's scheduler and rethrown by the eval/wait that needs this output.
    enc.dispatch([dptr, sptr, iptr, i32, n, nrows, row_bytes]() {
      std::optional<int64_t> bad = i32
          ? first_bad(static_cast<const int32_t*>(iptr), n, nrows)
          : first_bad(static_cast<const int64_t*>(iptr), n, nrows);
      if (bad) {
        throw std::out_of_range(out_of_range_msg(*bad, nrows));
      }
      if (i32) {
        copy_rows(dptr, static_cast<const int32_t*>(iptr), n, sptr, row_bytes);
      } else {
        copy_rows(dptr, static_cast<const int64_t*>(iptr), n, sptr, row_bytes);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(
        "[write_rows] CPU streams only (on GPU backends vllm_unified.kv.gpu.write writes "
        "rows in place); use a CPU stream");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override {
    return "WriteRows";
  }
  // is_equivalent stays false: two writes must never be merged by mx.compile's simplification.
};

// The Hadamard signs an int4 pool needs (vLLM's rotation block): fp32 [block], block a power
// of two dividing the head size; [1.0] (unused) for the other modes. `op` names the caller.
mx::array kv_rht_signs(const char* op, int kv_mode, const std::optional<mx::array>& rht_signs,
                       int head_size) {
  if (kv_mode != vun::kKVInt4) {
    return mx::array({1.0f});
  }
  if (!rht_signs || rht_signs->dtype() != mx::float32 || rht_signs->ndim() != 1 ||
      rht_signs->shape(0) < 2 || head_size % rht_signs->shape(0) != 0 ||
      (rht_signs->shape(0) & (rht_signs->shape(0) - 1)) != 0) {
    raise_py(PyExc_ValueError,
             std::string(op) + ": int4 needs rht_signs, fp32 [block] with block a power of two "
             "dividing the head size");
  }
  return *rht_signs;
}

[[noreturn]] void raise_gpu_not_implemented(const char* what) {
  raise_py(
      PyExc_NotImplementedError,
      std::string(what) +
          ": only CPU streams are implemented (on GPU backends vllm_unified.kv.gpu.write "
          "writes rows in place); got a GPU stream or device");
}

mx::Stream cpu_stream_for(mx::Device d, const char* what) {
  if (d.type != mx::Device::cpu) {
    raise_gpu_not_implemented(what);
  }
  return mx::default_stream(d);
}

// None -> the default device's default stream; mx.Stream; mx.Device; mx.cpu / mx.gpu. `what`
// (the calling function's name) heads the errors.
mx::Stream resolve_stream(nb::handle stream, const char* what) {
  if (stream.is_none()) {
    return cpu_stream_for(mx::default_device(), what);
  }
  mx::Stream* sp = nullptr;
  if (nb::try_cast<mx::Stream*>(stream, sp) && sp != nullptr) {
    if (sp->device.type != mx::Device::cpu) {
      raise_gpu_not_implemented(what);
    }
    return *sp;
  }
  mx::Device* dp = nullptr;
  if (nb::try_cast<mx::Device*>(stream, dp) && dp != nullptr) {
    return cpu_stream_for(*dp, what);
  }
  mx::Device::DeviceType t;
  if (nb::try_cast<mx::Device::DeviceType>(stream, t)) {
    return cpu_stream_for(mx::Device(t), what);
  }
  raise_py(
      PyExc_TypeError,
      std::string(what) + ": stream must be None, an mx.Stream, an mx.Device or mx.cpu/mx.gpu");
}

mx::array write_rows(
    const mx::array& dst,
    const mx::array& row_idx,
    const mx::array& src,
    nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "write_rows");
  if (dst.ndim() < 1) {
    raise_py(PyExc_ValueError, "write_rows: dst must have at least one dimension (rows)");
  }
  if (src.dtype() != dst.dtype()) {
    raise_py(PyExc_TypeError, "write_rows: src and dst must have the same dtype");
  }
  if (row_idx.ndim() != 1 || !mx::issubdtype(row_idx.dtype(), mx::integer)) {
    raise_py(PyExc_TypeError, "write_rows: row_idx must be a 1-D integer array");
  }
  mx::Shape want = dst.shape();
  want[0] = row_idx.shape(0);
  if (src.shape() != want) {
    raise_py(
        PyExc_ValueError,
        "write_rows: src has shape " + shape_str(src.shape()) + ", expected " + shape_str(want) +
            " (len(row_idx) rows of dst's row shape)");
  }
  if (dst.status() != mx::array::Status::unscheduled && !dst.flags().row_contiguous) {
    raise_py(
        PyExc_ValueError,
        "write_rows: dst is not row-contiguous (a transposed or strided view); "
        "only row-contiguous destinations can be written in place");
  }
  const int64_t nrows = dst.shape(0);
  mx::array idx = row_idx;
  if (idx.dtype() != mx::int32 && idx.dtype() != mx::int64) {
    idx = mx::astype(idx, mx::int64, s);
  } else if (idx.is_available() && idx.flags().row_contiguous && idx.size() > 0) {
    // Indices already computed (e.g. built from a list): check them now, where the error is
    // raised at the call. Lazy indices are checked when the write runs.
    if (auto bad = first_bad(idx, nrows)) {
      raise_py(PyExc_IndexError, out_of_range_msg(*bad, nrows));
    }
  }
  return mx::array(dst.shape(), dst.dtype(), std::make_shared<WriteRows>(s), {dst, idx, src});
}

// ---------------------------------------------------------------------------------------------
// write_kv

// keys[t] and values[t] written side by side into slot slot_mapping[t] of a dense K|V pool
// [slots, Hkv, 2 * D] (cell (slot, h) = [K | V], vLLM's attention page viewed slot-major), in
// place: write_rows of their concatenation along the last axis without building it (the
// squeezes and the concatenation were three graph nodes and a copy per layer and step).
class WriteKV : public SameShapePrimitive {
 public:
  explicit WriteKV(mx::Stream s) : SameShapePrimitive(s, "write_kv") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& dst = inputs[0];
    auto& out = outputs[0];
    if (!dst.flags().row_contiguous) {
      throw std::invalid_argument("[write_kv] the pool is not row-contiguous");
    }
    out.copy_shared_buffer(dst);  // the output *is* the pool's buffer
    const size_t n = inputs[1].size();
    if (n == 0) {
      return;
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array idx = row_contiguous(inputs[1], enc);
    const mx::array k = row_contiguous(inputs[2], enc);
    const mx::array v = row_contiguous(inputs[3], enc);
    enc.set_input_array(dst);
    enc.set_input_array(idx);
    enc.set_input_array(k);
    enc.set_input_array(v);
    enc.set_output_array(out);
    const int64_t nrows = dst.shape(0);
    const auto heads = static_cast<size_t>(dst.shape(1));
    const size_t half = static_cast<size_t>(dst.shape(2)) / 2 * dst.itemsize();  // bytes of K
    const bool i32 = idx.dtype() == mx::int32;
    const void* iptr = i32 ? static_cast<const void*>(idx.data<int32_t>())
                           : static_cast<const void*>(idx.data<int64_t>());
    // Every index is checked before any row is written (a bad one leaves the pool untouched;
    // MLX rethrows from the eval that needs the output).
    enc.dispatch([dptr = out.data<char>(), kp = k.data<char>(), vp = v.data<char>(), iptr, i32,
                  n, nrows, heads, half]() {
      const std::optional<int64_t> bad = i32
          ? first_bad(static_cast<const int32_t*>(iptr), n, nrows)
          : first_bad(static_cast<const int64_t*>(iptr), n, nrows);
      if (bad) {
        throw std::out_of_range(out_of_range_msg(*bad, nrows));
      }
      split_work(n * heads, 2 * half / 4, 1, [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) {
          const size_t t = i / heads;
          const auto slot = static_cast<size_t>(
              i32 ? static_cast<const int32_t*>(iptr)[t] : static_cast<const int64_t*>(iptr)[t]);
          char* cell = dptr + (slot * heads + i % heads) * 2 * half;
          std::memcpy(cell, kp + i * half, half);
          std::memcpy(cell + half, vp + i * half, half);
        }
      });
    });
  }

  const char* name() const override {
    return "WriteKV";
  }
  // is_equivalent stays false: two writes must never be merged by mx.compile's simplification.
};

mx::array write_kv(const mx::array& dst, const mx::array& slot_mapping, const mx::array& keys,
                   const mx::array& values, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "write_kv");
  const bool four = keys.ndim() == 4 && keys.shape(2) == 1;
  if ((keys.ndim() != 3 && !four) || values.shape() != keys.shape() || dst.ndim() != 3 ||
      dst.shape(1) != keys.shape(1) || dst.shape(2) != 2 * keys.shape(-1)) {
    raise_py(PyExc_ValueError,
             "write_kv: keys and values must be [T, Hkv, D] or [T, Hkv, 1, D] and dst "
             "[slots, Hkv, 2 * D], got " + shape_str(keys.shape()) + ", " +
                 shape_str(values.shape()) + " and " + shape_str(dst.shape()));
  }
  if (keys.dtype() != dst.dtype() || values.dtype() != dst.dtype()) {
    raise_py(PyExc_TypeError, "write_kv: keys, values and dst must have one dtype");
  }
  if (slot_mapping.ndim() != 1 || slot_mapping.shape(0) != keys.shape(0) ||
      (slot_mapping.dtype() != mx::int32 && slot_mapping.dtype() != mx::int64)) {
    raise_py(PyExc_TypeError, "write_kv: slot_mapping must be int32/int64 [T]");
  }
  if (dst.status() != mx::array::Status::unscheduled && !dst.flags().row_contiguous) {
    raise_py(PyExc_ValueError, "write_kv: dst is not row-contiguous");
  }
  if (slot_mapping.is_available() && slot_mapping.flags().row_contiguous &&
      slot_mapping.size() > 0) {
    if (auto bad = first_bad(slot_mapping, dst.shape(0))) {  // checked now where it can be
      raise_py(PyExc_IndexError, out_of_range_msg(*bad, dst.shape(0)));
    }
  }
  return mx::array(dst.shape(), dst.dtype(), std::make_shared<WriteKV>(s),
                   {dst, slot_mapping, keys, values});
}

// ---------------------------------------------------------------------------------------------
// gather_kv

// Copies row r = rows[i] of a [nrows, 2 * D] K|V pool: its first D elements to keys[i], the
// last D to values[i]. One pass over the selected rows, two memcpy per row.
class GatherKV : public mx::Primitive {
 public:
  explicit GatherKV(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& pool = inputs[0];
    const auto& rows = inputs[1];
    auto& keys = outputs[0];
    auto& values = outputs[1];
    if (!pool.flags().row_contiguous || !rows.flags().row_contiguous) {
      throw std::invalid_argument("[gather_kv] pool and rows must be row-contiguous");
    }
    keys.set_data(mx::allocator::malloc(keys.nbytes()));
    values.set_data(mx::allocator::malloc(values.nbytes()));
    const size_t n = rows.size();
    if (n == 0) {
      return;
    }
    const int64_t nrows = pool.shape(0);
    const size_t row_bytes = pool.nbytes() / static_cast<size_t>(nrows);
    const size_t half = row_bytes / 2;
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(pool);
    enc.set_input_array(rows);
    enc.set_output_array(keys);
    enc.set_output_array(values);
    const char* src = pool.data<char>();
    const int32_t* idx = rows.data<int32_t>();
    char* kp = keys.data<char>();
    char* vp = values.data<char>();
    // Indices are checked before anything is read: an out-of-range row is an error (stored by
    // MLX's scheduler and rethrown by the eval that needs the outputs), never a wild read.
    enc.dispatch([src, idx, kp, vp, n, nrows, half]() {
      if (auto bad = first_bad(idx, n, nrows)) {
        throw std::out_of_range(
            "[gather_kv] row " + std::to_string(*bad) + " is out of range for a pool of " +
            std::to_string(nrows) + " rows");
      }
      for (size_t i = 0; i < n; ++i) {
        const char* row = src + static_cast<size_t>(idx[i]) * 2 * half;
        std::memcpy(kp + i * half, row, half);
        std::memcpy(vp + i * half, row + half, half);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[gather_kv] CPU only; use the pure-MLX gather on GPU streams");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[1].shape();
    shape.push_back(inputs[0].shape(1) / 2);
    return {shape, shape};
  }

  const char* name() const override {
    return "GatherKV";
  }
};

// keys, values = gather_kv(pool, rows): pool [nrows, 2 * D] (K then V per row), rows int32 of
// any shape S -> two row-contiguous arrays of shape S + [D].
std::vector<mx::array> gather_kv(const mx::array& pool, const mx::array& rows, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "gather_kv");
  if (pool.ndim() != 2 || pool.shape(1) % 2 != 0) {
    raise_py(
        PyExc_ValueError,
        "gather_kv: pool must be [rows, 2 * D] (keys then values), got " +
            shape_str(pool.shape()));
  }
  if (rows.dtype() != mx::int32) {
    raise_py(PyExc_TypeError, "gather_kv: rows must be int32");
  }
  if (rows.is_available() && rows.flags().row_contiguous && rows.size() > 0) {
    if (auto bad = first_bad(rows.data<int32_t>(), rows.size(), pool.shape(0))) {
      raise_py(
          PyExc_IndexError,
          "gather_kv: row " + std::to_string(*bad) + " is out of range for a pool of " +
              std::to_string(pool.shape(0)) + " rows");
    }
  }
  mx::Shape shape = rows.shape();
  shape.push_back(pool.shape(1) / 2);
  return mx::array::make_arrays(
      {shape, shape}, {pool.dtype(), pool.dtype()}, std::make_shared<GatherKV>(s),
      {mx::contiguous(pool, false, s), mx::contiguous(rows, false, s)});
}

// ---------------------------------------------------------------------------------------------
// silu_mul, gelu_tanh_mul, softcap

// The row kernel of a gated activation: out[i] = act(gate[i]) * up[i] over n fp32 values.
using GatedKernel = void (*)(const float*, const float*, float*, size_t);

// out = act(gate) * up for fp32 arrays of one shape; act is the kernel's (the vectorized loops
// are in cpu_math.cpp): silu for "silu_mul", tanh-approximated GELU for "gelu_tanh_mul".
class GatedActivation : public SameShapePrimitive {
 public:
  GatedActivation(mx::Stream s, const char* op, const char* name, GatedKernel kernel)
      : SameShapePrimitive(s, op), op_(op), name_(name), kernel_(kernel) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    if (inputs[0].shape() != inputs[1].shape()) {  // re-checked: shapeless compilation
      throw std::invalid_argument(std::string("[") + op_ + "] gate and up differ in shape");
    }
    const mx::array gate = row_contiguous(inputs[0], enc);
    const mx::array up = row_contiguous(inputs[1], enc);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    enc.set_input_array(gate);
    enc.set_input_array(up);
    enc.set_output_array(out);
    enc.dispatch([g = gate.data<float>(), u = up.data<float>(), o = out.data<float>(),
                  n = out.size(), kernel = kernel_]() {
      split_work(n, 1, 64, [&](size_t b, size_t e) { kernel(g + b, u + b, o + b, e - b); });
    });
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return kernel_ == static_cast<const GatedActivation&>(other).kernel_;
  }

  const char* name() const override {
    return name_;
  }

 private:
  const char* op_;
  const char* name_;
  GatedKernel kernel_;
};

mx::array gated_activation(const mx::array& gate, const mx::array& up, nb::handle stream,
                           const char* op, const char* name, GatedKernel kernel) {
  const mx::Stream s = resolve_stream(stream, op);
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, std::string(op) + ": gate and up must be float32");
  }
  if (gate.shape() != up.shape()) {
    raise_py(
        PyExc_ValueError,
        std::string(op) + ": gate " + shape_str(gate.shape()) + " and up " +
            shape_str(up.shape()) + " differ in shape");
  }
  return mx::array(gate.shape(), mx::float32,
                   std::make_shared<GatedActivation>(s, op, name, kernel), {gate, up});
}

mx::array silu_mul(const mx::array& gate, const mx::array& up, nb::handle stream) {
  return gated_activation(gate, up, stream, "silu_mul", "SiluMul", &vun::silu_mul_f32);
}

mx::array gelu_tanh_mul(const mx::array& gate, const mx::array& up, nb::handle stream) {
  return gated_activation(gate, up, stream, "gelu_tanh_mul", "GeluTanhMul",
                          &vun::gelu_tanh_mul_f32);
}

// The row-contiguous input of a one-input, one-output CPU primitive, with its output
// allocated; both registered with the command encoder.
mx::array one_in_one_out(const mx::array& in, mx::array& out, mx::cpu::CommandEncoder& enc) {
  mx::array x = row_contiguous(in, enc);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  enc.set_input_array(x);
  enc.set_output_array(out);
  return x;
}

// The kernel of an elementwise map: out[i] = f(x[i]; param) over n fp32 values.
using UnaryKernel = void (*)(const float*, float*, size_t, float);

void softcap_kernel(const float* x, float* out, size_t n, float cap) {
  vun::softcap_f32(x, cap, out, n);
}

void gelu_kernel(const float* x, float* out, size_t n, float tanh) {
  vun::gelu_f32(x, out, n, tanh != 0.f);
}

// out = f(x; param) for an fp32 array: cap * tanh(x / cap) ("softcap"), GELU ("gelu", param 1
// for the tanh approximation).
class Unary : public SameShapePrimitive {
 public:
  Unary(mx::Stream s, const char* op, const char* name, UnaryKernel kernel, float param)
      : SameShapePrimitive(s, op), name_(name), kernel_(kernel), param_(param) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array x = one_in_one_out(inputs[0], out, enc);
    enc.dispatch([xp = x.data<float>(), o = out.data<float>(), n = out.size(), k = kernel_,
                  p = param_]() {
      split_work(n, 1, 64, [&](size_t b, size_t e) { k(xp + b, o + b, e - b, p); });
    });
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Unary&>(other);
    return kernel_ == o.kernel_ && param_ == o.param_;
  }

  const char* name() const override {
    return name_;
  }

 private:
  const char* name_;
  UnaryKernel kernel_;
  float param_;
};

mx::array gelu(const mx::array& x, bool approximate, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "gelu");
  if (x.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, "gelu: x must be float32");
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Unary>(s, "gelu", approximate ? "GeluTanh" : "Gelu",
                                           &gelu_kernel, approximate ? 1.f : 0.f),
                   {x});
}

// out = softmax over the last axis of an fp32 array.
class Softmax : public SameShapePrimitive {
 public:
  explicit Softmax(mx::Stream s) : SameShapePrimitive(s, "softmax") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array x = one_in_one_out(inputs[0], out, enc);
    const size_t n = x.ndim() == 0 ? 1 : static_cast<size_t>(x.shape().back());
    enc.dispatch([xp = x.data<float>(), o = out.data<float>(), rows = out.size() / n, n]() {
      split_work(rows, n, 1, [&](size_t b, size_t e) {
        vun::softmax_rows_f32(xp + b * n, o + b * n, e - b, n);
      });
    });
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }

  const char* name() const override {
    return "Softmax";
  }
};

mx::array softmax(const mx::array& x, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "softmax");
  if (x.dtype() != mx::float32 || x.ndim() == 0 || x.shape().back() == 0) {
    raise_py(PyExc_TypeError, "softmax: x must be float32 with a non-empty last axis");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(s), {x});
}

mx::array softcap(const mx::array& x, float cap, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "softcap");
  if (x.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, "softcap: x must be float32");
  }
  if (!(cap > 0.f) || !std::isfinite(cap)) {
    raise_py(PyExc_ValueError, "softcap: cap must be a finite number > 0, got " +
                                   std::to_string(cap));
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Unary>(s, "softcap", "Softcap", &softcap_kernel, cap), {x});
}

// ---------------------------------------------------------------------------------------------
// rms_norm, rope: MLX 0.32.4's CPU backend runs mx.fast.rms_norm and mx.fast.rope as their
// fallback graphs (~10 and ~30 primitives per call); these are one primitive each.

class RmsNorm : public SameShapePrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : SameShapePrimitive(s, "rms_norm"), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    // Shapes are re-checked here: under mx.compile(shapeless=True) the builder's checks ran
    // for the traced shapes only.
    if (inputs[1].size() != static_cast<size_t>(inputs[0].shape(-1))) {
      throw std::invalid_argument("[rms_norm] weight must be [D] for x [..., D]");
    }
    const mx::array x = row_contiguous(inputs[0], enc);
    const mx::array w = row_contiguous(inputs[1], enc);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    enc.set_input_array(x);
    enc.set_input_array(w);
    enc.set_output_array(out);
    const size_t D = static_cast<size_t>(x.shape(-1));
    enc.dispatch([xp = x.data<float>(), wp = w.data<float>(), op = out.data<float>(),
                  rows = D ? x.size() / D : 0, D, eps = eps_]() {
      split_work(rows, D, 1, [&](size_t b, size_t e) {
        vun::rms_norm_f32(xp + b * D, wp, op + b * D, e - b, D, eps);
      });
    });
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

  const char* name() const override {
    return "RmsNorm";
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "rms_norm");
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, "rms_norm: x and weight must be float32");
  }
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
    raise_py(PyExc_ValueError,
             "rms_norm: weight must be [D] for x [..., D], got " + shape_str(w.shape()) +
                 " and " + shape_str(x.shape()));
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps),
                   {x, contiguous_input(w, s)});
}

// The cos/sin table of a RoPE call (vun::rope_table_f32), kept for the next call with the same
// positions and frequencies: every layer of a step rotates queries and keys at the same
// positions, so a step computes its table once instead of twice per layer (scalar std::cos and
// std::sin, as MLX's fallback; the 60 RoPE calls of a 16 x 128-token prefill of SmolLM2-135M
// took 96 ms recomputing it, 46 ms with it kept). Per thread: a stream's kernels run on one
// thread.
const float* rope_table(const int32_t* offsets, size_t num_offsets, size_t B, size_t L,
                        size_t half, const float* inv_freq, float scale) {
  struct Cached {
    std::vector<int32_t> offsets;
    std::vector<float> inv_freq, table;
    size_t B = 0, L = 0;
    float scale = 0.f;
    bool valid = false;
  };
  thread_local Cached c;
  const bool same = c.valid && c.B == B && c.L == L && c.scale == scale &&
                    c.offsets.size() == num_offsets && c.inv_freq.size() == half &&
                    std::equal(offsets, offsets + num_offsets, c.offsets.begin()) &&
                    std::memcmp(inv_freq, c.inv_freq.data(), half * sizeof(float)) == 0;
  if (!same) {
    c.valid = false;
    c.offsets.assign(offsets, offsets + num_offsets);
    c.inv_freq.assign(inv_freq, inv_freq + half);
    c.B = B;
    c.L = L;
    c.scale = scale;
    c.table.resize(B * L * 2 * half);
    vun::rope_table_f32(offsets, num_offsets, B, L, half, inv_freq, scale, c.table.data());
    c.valid = true;
  }
  return c.table.data();
}

class Rope : public SameShapePrimitive {
 public:
  Rope(mx::Stream s, int dims, bool traditional, float scale)
      : SameShapePrimitive(s, "rope"), dims_(dims), traditional_(traditional), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    const auto& x_in = inputs[0];
    if (x_in.ndim() != 4 || dims_ > x_in.shape(3) ||
        inputs[2].size() != static_cast<size_t>(dims_ / 2) ||
        (inputs[1].size() != 1 && inputs[1].size() != static_cast<size_t>(x_in.shape(0)))) {
      // Re-checked here: under mx.compile(shapeless=True) the builder saw the traced shapes.
      throw std::invalid_argument(
          "[rope] x must be [B, H, L, D] with D >= dims, offsets [B] or [1], inv_freq "
          "[dims / 2]");
    }
    const mx::array x = row_contiguous(x_in, enc);
    const mx::array offsets = row_contiguous(inputs[1], enc);
    const mx::array inv_freq = row_contiguous(inputs[2], enc);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    enc.set_input_array(x);
    enc.set_input_array(offsets);
    enc.set_input_array(inv_freq);
    enc.set_output_array(out);
    enc.dispatch([xp = x.data<float>(), op = out.data<float>(),
                  offs = offsets.data<int32_t>(), num_offsets = offsets.size(),
                  freqs = inv_freq.data<float>(),
                  B = static_cast<size_t>(x.shape(0)), H = static_cast<size_t>(x.shape(1)),
                  L = static_cast<size_t>(x.shape(2)), D = static_cast<size_t>(x.shape(3)),
                  dims = static_cast<size_t>(dims_), trad = traditional_, scale = scale_]() {
      const float* table = rope_table(offs, num_offsets, B, L, dims / 2, freqs, scale);
      // Rows of D elements; threads only where the work outweighs waking them.
      split_work(B * H * L, D, 1, [&](size_t b, size_t e) {
        vun::rope_apply_f32(xp, op, table, H, L, D, dims, trad, b, e);
      });
    });
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

  const char* name() const override {
    return "Rope";
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

mx::array rope(const mx::array& x, int dims, bool traditional, const mx::array& inv_freq,
               float scale, const mx::array& offsets, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "rope");
  if (x.dtype() != mx::float32 || inv_freq.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, "rope: x and inv_freq must be float32");
  }
  if (offsets.dtype() != mx::int32) {
    raise_py(PyExc_TypeError, "rope: offsets must be int32");
  }
  if (x.ndim() != 4) {
    raise_py(PyExc_ValueError, "rope: x must be [B, H, L, D], got " + shape_str(x.shape()));
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(3)) {
    raise_py(PyExc_ValueError,
             "rope: dims must be even and in (0, D = " + std::to_string(x.shape(3)) + "], got " +
                 std::to_string(dims));
  }
  if (inv_freq.ndim() != 1 || inv_freq.shape(0) != dims / 2) {
    raise_py(PyExc_ValueError,
             "rope: inv_freq must be [dims / 2] = [" + std::to_string(dims / 2) + "], got " +
                 shape_str(inv_freq.shape()));
  }
  if (offsets.ndim() != 1 || (offsets.shape(0) != x.shape(0) && offsets.shape(0) != 1)) {
    raise_py(PyExc_ValueError,
             "rope: offsets must be [B] or [1] for x " + shape_str(x.shape()) + ", got " +
                 shape_str(offsets.shape()));
  }
  // One offset stays one (the kernel applies it to every row): a broadcast to B made here
  // would keep the traced B under mx.compile(shapeless=True).
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(s, dims, traditional, scale),
                   {x, contiguous_input(offsets, s), contiguous_input(inv_freq, s)});
}

// ---------------------------------------------------------------------------------------------
// paged_attention

// Attention read straight from the paged K|V pool, one query token per row: for row r of
// sequence b = seqs[r] and query head h, out[r, h] = softmax(scale * q[r, h] . K_j) . V_j over
// the keys j in [first, lens[r]) (lens[r] = the row's position + 1: causal), first =
// max(lens[r] - window, 0) with a sliding window (0: none), raised to the start of the row's
// attention chunk ((lens[r] - 1) / chunk * chunk; chunked local attention, 0: none), key j at slot tables[b, j / block_size] * block_size + j % block_size, KV head h / (H / Hkv). The
// scores of one (sequence, KV head) are computed for all the head's queries at once, so each
// key and value row is read once; softmax in fp32 with the maximum subtracted (the reference's
// function: kv/attention/reference.py gathers the same rows and runs MLX's SDPA).
template <typename T>
struct PagedAttentionArgs {
  const T* q;        // [B, H, D]
  const T* kv;       // [slots, Hkv, 2 * D]
  const int32_t* tables;  // [S, max_blocks]
  const int32_t* seqs;    // [N]: each row's sequence (table row)
  const int32_t* lens;    // [N]: keys visible to each row
  T* out;            // [N, H, D]
  int64_t batch, heads, kv_heads, dim, max_blocks, block_size, slots, num_seqs;
  int64_t window;  // keys visible to the query, 0: all
  float scale;
  int64_t chunk = 0;  // attention chunk (chunked local attention), 0: none
  // Quantized pools (vun::KVMode != kKVDense): kv is unused and kvq holds [slots, Hkv, cell]
  // bytes; int4 rotates the queries (rht signs, `block` of them) and un-rotates the output.
  int mode = vun::kKVDense;
  const uint8_t* kvq = nullptr;
  const float* signs = nullptr;
  int64_t block = 0;
  // turboquant_k8v4: row r reads keys j >= raw_from[r] unquantized from this step's fresh K/V
  // ([fresh_rows, Hkv, D] each), key j at fresh row raw_row0[r] + j - raw_from[r] (vLLM's
  // TurboQuant prefill); fk == nullptr: every key from the cells.
  const T* fk = nullptr;
  const T* fv = nullptr;
  const int32_t* raw_from = nullptr;
  const int32_t* raw_row0 = nullptr;
  int64_t fresh_rows = 0;
  // Attention logit soft-capping (> 0) and per query head sink logits ([H] fp32 or nullptr):
  // vun::ScoreOpts.
  float softcap = 0.f;
  const float* sinks = nullptr;
  // Latent (MLA) pool: kv is [slots, 1, D], each row both key and value (vLLM's MLA page:
  // the latent then the rope key; the caller keeps the output's latent part).
  bool latent = false;
};

// The first key a row of `len` visible positions reads: its sliding window's, raised to the
// start of its attention chunk.
template <typename T>
int64_t first_visible_key(const PagedAttentionArgs<T>& a, int64_t len) {
  const int64_t first = a.window > 0 ? std::max<int64_t>(len - a.window, 0) : 0;
  return a.chunk > 0 ? std::max<int64_t>(first, (len - 1) / a.chunk * a.chunk) : first;
}

// The ScoreOpts of the query heads of KV head g (R of them).
template <typename T>
vun::ScoreOpts score_opts(const PagedAttentionArgs<T>& a, int64_t g, int64_t R) {
  return vun::ScoreOpts{a.softcap, a.sinks != nullptr ? a.sinks + g * R : nullptr};
}

// One (row, KV head) item: the R query heads of KV head g of row b over the row's keys.
// Scratch is per thread (items of one call run on several threads at once).
template <typename T>
void paged_attention_item(const PagedAttentionArgs<T>& a, int64_t b, int64_t g) {
  const int64_t D = a.dim;
  const int64_t R = a.heads / a.kv_heads;  // query heads per KV head
  constexpr bool is_f32 = std::is_same_v<T, float>;
  thread_local std::vector<float> qf, of, scores, rows;
  thread_local std::vector<const float*> keys, values;
  const int64_t len = a.lens[b];
  const int64_t first = first_visible_key(a, len);
  const int64_t n = len - first;
  qf.resize(R * D);
  of.resize(R * D);
  scores.resize(R * n);
  keys.resize(n);
  values.resize(n);
  const int64_t cell_size = a.latent ? D : 2 * D;  // K then V, or one latent row
  if constexpr (!is_f32) {
    rows.resize(n * cell_size);
  }
  const int32_t* table = a.tables + a.seqs[b] * a.max_blocks;
  // Block by block (no division per key): keys [j0, j1) of block table[k].
  for (int64_t k = first / a.block_size, j = first; j < len; ++k) {
    const int64_t blk = table[k];
    const int64_t j1 = std::min(len, (k + 1) * a.block_size);
    if (blk < 0 || blk * a.block_size + (j1 - 1) % a.block_size >= a.slots) {
      throw std::out_of_range(
          "[paged_attention] block " + std::to_string(blk) + " is outside a pool of " +
          std::to_string(a.slots) + " slots");
    }
    const T* cell =
        a.kv + ((blk * a.block_size + j % a.block_size) * a.kv_heads + g) * cell_size;
    const int64_t v_off = a.latent ? 0 : D;
    for (; j < j1; ++j, cell += a.kv_heads * cell_size) {
      if constexpr (is_f32) {
        keys[j - first] = cell;
        values[j - first] = cell + v_off;
      } else {  // half precision: widen the cell once into scratch
        float* dst = rows.data() + (j - first) * cell_size;
        for (int64_t e = 0; e < cell_size; ++e) {
          dst[e] = static_cast<float>(cell[e]);
        }
        keys[j - first] = dst;
        values[j - first] = dst + v_off;
      }
    }
  }
  const T* qp = a.q + (b * a.heads + g * R) * D;
  for (int64_t i = 0; i < R * D; ++i) {
    qf[i] = static_cast<float>(qp[i]);
  }
  const vun::ScoreOpts opts = score_opts(a, g, R);
  if (!vun::attend_rows_f32_fixed(qf.data(), R, D, keys.data(), values.data(), n, a.scale,
                                  scores.data(), of.data(), opts)) {
    vun::attend_rows_f32(qf.data(), R, D, keys.data(), values.data(), n, a.scale,
                         scores.data(), of.data(), opts);
  }
  T* op = a.out + (b * a.heads + g * R) * D;
  for (int64_t i = 0; i < R * D; ++i) {
    op[i] = static_cast<T>(of[i]);
  }
}

// paged_attention_item over a quantized pool: each key's cell is read where it lies and
// dequantized in registers (vun::attend_rows_quant). int4 follows vLLM's
// unified_attention_int4: queries rotated (single_rht, rounded to T), the scale divided by the
// rotation's norm `block`, the output rotated back (rounded to T first) and divided by it.
template <typename T>
void paged_attention_item_quant(const PagedAttentionArgs<T>& a, int64_t b, int64_t g) {
  const int64_t D = a.dim;
  const int64_t R = a.heads / a.kv_heads;
  const int64_t cell_bytes = static_cast<int64_t>(vun::kv_cell_bytes(a.mode, D));
  thread_local std::vector<float> qf, of, scores;
  thread_local std::vector<const uint8_t*> cells;
  const int64_t len = a.lens[b];
  const int64_t first = first_visible_key(a, len);
  const int64_t n = len - first;
  qf.resize(R * D);
  of.resize(R * D);
  scores.resize(R * n);
  cells.resize(n);
  const int32_t* table = a.tables + a.seqs[b] * a.max_blocks;
  for (int64_t k = first / a.block_size, j = first; j < len; ++k) {
    const int64_t blk = table[k];
    const int64_t j1 = std::min(len, (k + 1) * a.block_size);
    if (blk < 0 || blk * a.block_size + (j1 - 1) % a.block_size >= a.slots) {
      throw std::out_of_range(
          "[paged_attention] block " + std::to_string(blk) + " is outside a pool of " +
          std::to_string(a.slots) + " slots");
    }
    const uint8_t* cell =
        a.kvq + ((blk * a.block_size + j % a.block_size) * a.kv_heads + g) * cell_bytes;
    for (; j < j1; ++j, cell += a.kv_heads * cell_bytes) {
      cells[j - first] = cell;
    }
  }
  // this step's own keys read unquantized (turboquant_k8v4 prefill chunks): fp32 rows where
  // they lie, half-precision ones widened once
  thread_local std::vector<float> raw;
  thread_local std::vector<const float*> raw_k, raw_v;
  const int64_t rf = a.fk != nullptr ? std::max<int64_t>(a.raw_from[b], first) : len;
  if (rf < len) {
    if constexpr (!std::is_same_v<T, float>) {
      raw.resize((len - rf) * 2 * D);
    }
    raw_k.assign(n, nullptr);
    raw_v.assign(n, nullptr);
    for (int64_t j = rf; j < len; ++j) {
      const int64_t row = a.raw_row0[b] + (j - a.raw_from[b]);
      if (row < 0 || row >= a.fresh_rows) {
        throw std::out_of_range("[paged_attention] fresh row " + std::to_string(row) +
                                " is outside " + std::to_string(a.fresh_rows) + " rows");
      }
      const T* ks = a.fk + (row * a.kv_heads + g) * D;
      const T* vs = a.fv + (row * a.kv_heads + g) * D;
      if constexpr (std::is_same_v<T, float>) {
        raw_k[j - first] = ks;
        raw_v[j - first] = vs;
      } else {
        float* dst = raw.data() + (j - rf) * 2 * D;
        for (int64_t e = 0; e < D; ++e) {
          dst[e] = static_cast<float>(ks[e]);
          dst[D + e] = static_cast<float>(vs[e]);
        }
        raw_k[j - first] = dst;
        raw_v[j - first] = dst + D;
      }
    }
  }
  const T* qp = a.q + (b * a.heads + g * R) * D;
  for (int64_t i = 0; i < R * D; ++i) {
    qf[i] = static_cast<float>(qp[i]);
  }
  float scale = a.scale;
  const bool rotate = a.mode == vun::kKVInt4;
  if (rotate) {
    for (int64_t r = 0; r < R; ++r) {
      float* x = qf.data() + r * D;
      vun::rht_forward(x, D, a.block, a.signs);
      for (int64_t e = 0; e < D; ++e) {
        x[e] = static_cast<float>(static_cast<T>(x[e]));
      }
    }
    scale = a.scale / static_cast<float>(a.block);
  }
  vun::attend_rows_quant(a.mode, qf.data(), R, D, cells.data(), n, scale, scores.data(),
                         of.data(), rf < len ? raw_k.data() : nullptr,
                         rf < len ? raw_v.data() : nullptr, score_opts(a, g, R));
  if (rotate) {
    for (int64_t r = 0; r < R; ++r) {
      float* x = of.data() + r * D;
      for (int64_t e = 0; e < D; ++e) {
        x[e] = static_cast<float>(static_cast<T>(x[e]));
      }
      vun::rht_inverse(x, D, a.block, a.signs);
      for (int64_t e = 0; e < D; ++e) {
        x[e] /= static_cast<float>(a.block);
      }
    }
  }
  T* op = a.out + (b * a.heads + g * R) * D;
  for (int64_t i = 0; i < R * D; ++i) {
    op[i] = static_cast<T>(of[i]);
  }
}

// Rows [b0, b0 + rows) of one sequence x KV head g by the blocked kernel (vun::attend_tile):
// the rows' keys read where they lie in the pool (16-bit ones widened per key block).
template <typename T>
void paged_attention_tile(const PagedAttentionArgs<T>& a, int64_t b0, int64_t rows, int64_t g) {
  const int64_t D = a.dim;
  const int64_t R = a.heads / a.kv_heads;
  thread_local std::vector<float> qf, of;
  thread_local std::vector<int64_t> first, len;
  thread_local std::vector<const void*> keys, values;
  first.resize(rows);
  len.resize(rows);
  int64_t k0 = INT64_MAX, k1 = 0;
  for (int64_t t = 0; t < rows; ++t) {
    len[t] = a.lens[b0 + t];
    first[t] = first_visible_key(a, len[t]);
    k0 = std::min(k0, first[t]);
    k1 = std::max(k1, len[t]);
  }
  keys.resize(k1 - k0);
  values.resize(k1 - k0);
  const int32_t* table = a.tables + a.seqs[b0] * a.max_blocks;
  for (int64_t k = k0 / a.block_size, j = k0; j < k1; ++k) {
    const int64_t blk = table[k];
    const int64_t j1 = std::min(k1, (k + 1) * a.block_size);
    if (blk < 0 || blk * a.block_size + (j1 - 1) % a.block_size >= a.slots) {
      throw std::out_of_range(
          "[paged_attention] block " + std::to_string(blk) + " is outside a pool of " +
          std::to_string(a.slots) + " slots");
    }
    const T* cell = a.kv + ((blk * a.block_size + j % a.block_size) * a.kv_heads + g) * 2 * D;
    for (; j < j1; ++j, cell += a.kv_heads * 2 * D) {
      keys[j - k0] = cell;
      values[j - k0] = cell + D;
    }
  }
  qf.resize(rows * R * D);
  of.resize(rows * R * D);
  for (int64_t t = 0; t < rows; ++t) {
    const T* qp = a.q + ((b0 + t) * a.heads + g * R) * D;
    for (int64_t i = 0; i < R * D; ++i) {
      qf[t * R * D + i] = static_cast<float>(qp[i]);
    }
  }
  constexpr vun::TileKV type = std::is_same_v<T, float> ? vun::TileKV::kF32
      : std::is_same_v<T, mx::float16_t> ? vun::TileKV::kF16 : vun::TileKV::kBF16;
  vun::attend_tile(vun::AttendTile{
      qf.data(), static_cast<size_t>(rows), static_cast<size_t>(R), static_cast<size_t>(D),
      first.data(), len.data(), keys.data(), values.data(), k0, k1, type, a.scale,
      score_opts(a, g, R), of.data()});
  for (int64_t t = 0; t < rows; ++t) {
    T* op = a.out + ((b0 + t) * a.heads + g * R) * D;
    for (int64_t i = 0; i < R * D; ++i) {
      op[i] = static_cast<T>(of[t * R * D + i]);
    }
  }
}

// Checks every row's sequence and length first (a bad row writes nothing), then runs the
// items on the kernel pool: (tile, KV head) items of the blocked kernel for the rows of
// prefill chunks (runs of 2+ consecutive rows of one sequence, cut into tiles of up to
// vun::kTileRows rows) where it applies (dense pools, head sizes 64 / 128 / 256, AVX-512 or
// AVX2), (row, KV head) items of the row kernel for the others (decode rows). Each item's arithmetic
// for a row depends on that row alone, so a row's output is the same whatever else the step
// holds, however its chunk is cut into tiles and however the items are split over threads
// (batch-invariant); a row of a chunk and a lone (decode) row of the same query take different
// kernels and may differ in the last bits.
template <typename T>
void paged_attention_impl(const PagedAttentionArgs<T>& a) {
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t len = a.lens[b];
    const int64_t seq = a.seqs[b];
    if (seq < 0 || seq >= a.num_seqs) {
      throw std::out_of_range(
          "[paged_attention] row " + std::to_string(b) + ": sequence " + std::to_string(seq) +
          " is outside a table of " + std::to_string(a.num_seqs) + " rows");
    }
    if (len < 1 || len > a.max_blocks * a.block_size) {
      throw std::out_of_range(
          "[paged_attention] row " + std::to_string(b) + ": " + std::to_string(len) +
          " keys do not fit a block table of " +
          std::to_string(a.max_blocks) + " blocks of " + std::to_string(a.block_size));
    }
  }
  // Tiles (first row, rows), and the rows left to the row kernel.
  std::vector<std::pair<int64_t, int64_t>> tiles;
  std::vector<int64_t> lone;
  const bool tiled = a.mode == vun::kKVDense && !a.latent &&
                     vun::attend_tile_usable(static_cast<size_t>(a.dim));
  for (int64_t b = 0; b < a.batch;) {
    int64_t e = b + 1;
    while (e < a.batch && a.seqs[e] == a.seqs[b]) {
      ++e;
    }
    if (tiled && e - b >= 2) {
      for (int64_t t = b; t < e; t += vun::kTileRows) {
        tiles.emplace_back(t, std::min<int64_t>(vun::kTileRows, e - t));
      }
    } else {
      for (int64_t t = b; t < e; ++t) {
        lone.push_back(t);
      }
    }
    b = e;
  }
  if (!tiles.empty()) {
    // the costliest tiles (most keys) first: the pool's threads claim items dynamically
    auto keys_of = [&](const std::pair<int64_t, int64_t>& t) {
      const int64_t last = a.lens[t.first + t.second - 1];
      return (last - first_visible_key(a, a.lens[t.first])) * t.second;
    };
    std::stable_sort(tiles.begin(), tiles.end(), [&](const auto& x, const auto& y) {
      return keys_of(x) > keys_of(y);
    });
    const size_t items = tiles.size() * static_cast<size_t>(a.kv_heads);
    auto run_item = [&](size_t i) {
      const auto& tile = tiles[i / a.kv_heads];
      paged_attention_tile(a, tile.first, tile.second, static_cast<int64_t>(i) % a.kv_heads);
    };
    if (items == 1) {
      run_item(0);
    } else {
      kernel_pool().run(items, run_item);
    }
  }
  if (lone.empty()) {
    return;
  }
  // Every call is split: one item already reads all of its row's keys.
  const size_t items = lone.size() * static_cast<size_t>(a.kv_heads);
  split_work(items, SIZE_MAX / (items + 1), 1, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const int64_t b = lone[i / a.kv_heads];
      const int64_t g = static_cast<int64_t>(i) % a.kv_heads;
      if (a.mode == vun::kKVDense) {
        paged_attention_item(a, b, g);
      } else {
        paged_attention_item_quant(a, b, g);
      }
    }
  });
}

class PagedAttention : public SameShapePrimitive {
 public:
  PagedAttention(mx::Stream s, float scale, int64_t block_size, int64_t window, int mode,
                 int64_t chunk, float softcap, bool sinks, bool latent)
      : SameShapePrimitive(s, "paged_attention"), scale_(scale), block_size_(block_size),
        window_(window), mode_(mode), chunk_(chunk), softcap_(softcap), sinks_(sinks),
        latent_(latent) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    if (!inputs[1].flags().row_contiguous) {
      throw std::invalid_argument("[paged_attention] the K|V pool must be row-contiguous");
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> args;
    for (const auto& x : inputs) {
      args.push_back(row_contiguous(x, enc));
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    for (const auto& x : args) {
      enc.set_input_array(x);
    }
    enc.set_output_array(out);
    switch (args[0].dtype()) {
      case mx::float32:
        dispatch<float>(enc, args, out);
        break;
      case mx::float16:
        dispatch<mx::float16_t>(enc, args, out);
        break;
      case mx::bfloat16:
        dispatch<mx::bfloat16_t>(enc, args, out);
        break;
      default:
        throw std::invalid_argument("[paged_attention] float32, float16 or bfloat16 only");
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[paged_attention] CPU only; GPU backends have their own kernels");
  }

  const char* name() const override {
    return "PagedAttention";
  }

 private:
  template <typename T>
  void dispatch(
      mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& in, mx::array& out) {
    const bool quant = mode_ != vun::kKVDense;
    PagedAttentionArgs<T> a{
        in[0].data<T>(), quant ? nullptr : in[1].data<T>(), in[2].data<int32_t>(),
        in[3].data<int32_t>(), in[4].data<int32_t>(), out.data<T>(), in[0].shape(0),
        in[0].shape(1), in[1].shape(1), in[0].shape(2), in[2].shape(1), block_size_,
        in[1].shape(0), in[2].shape(0), window_, scale_};
    a.chunk = chunk_;
    a.softcap = softcap_;
    a.latent = latent_;
    if (sinks_) {  // after the signs, before the fresh K/V
      a.sinks = in[6].data<float>();
    }
    const size_t fresh0 = sinks_ ? 7 : 6;
    if (quant) {
      a.mode = mode_;
      a.kvq = in[1].data<uint8_t>();
      a.signs = in[5].data<float>();
      a.block = in[5].shape(0);
      if (in.size() == fresh0 + 4) {  // fresh K/V of the step (turboquant_k8v4)
        a.fk = in[fresh0].data<T>();
        a.fv = in[fresh0 + 1].data<T>();
        a.raw_from = in[fresh0 + 2].data<int32_t>();
        a.raw_row0 = in[fresh0 + 3].data<int32_t>();
        a.fresh_rows = in[fresh0].shape(0);
      }
    }
    enc.dispatch([a]() { paged_attention_impl<T>(a); });
  }

  float scale_;
  int64_t block_size_;
  int64_t window_;
  int mode_;
  int64_t chunk_;
  float softcap_;
  bool sinks_;
  bool latent_;
};

// out = paged_attention(q [N, H, D], kv_pool [slots, Hkv, 2D], tables int32 [S, MB],
//                       seqs int32 [N], lens int32 [N], scale, block_size, window,
//                       kv_mode, rht_signs, ..., chunk, softcap, sinks, latent) -> [N, H, D]
// latent: kv_pool is a dense MLA pool [slots, 1, D] whose rows are keys and values at once
// (the absorbed form of multi-head latent attention; the caller keeps the latent part).
// softcap > 0: the scaled scores become softcap * tanh(scores / softcap) (0: none); sinks:
// float [H], one logit per query head that joins the softmax's denominator (gpt-oss).
// kv_mode != 0 (vun::KVMode): kv_pool is uint8/int8 [slots, Hkv, cell bytes] of that format;
// int4 takes vLLM's RHT signs (fp32 [block], block the largest power-of-two divisor of D).
mx::array paged_attention(
    const mx::array& q, const mx::array& kv_pool, const mx::array& tables, const mx::array& seqs,
    const mx::array& lens, float scale, int64_t block_size, int64_t window, int kv_mode,
    std::optional<mx::array> rht_signs, std::optional<mx::array> fresh_k,
    std::optional<mx::array> fresh_v, std::optional<mx::array> raw_from,
    std::optional<mx::array> raw_row0, int64_t chunk, float softcap,
    std::optional<mx::array> sinks, bool latent, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "paged_attention");
  if (latent && (kv_mode != vun::kKVDense || kv_pool.ndim() != 3 || kv_pool.shape(1) != 1)) {
    raise_py(PyExc_ValueError,
             "paged_attention: a latent pool is dense (kv_mode 0) and [slots, 1, D]");
  }
  if (kv_mode < vun::kKVDense || kv_mode > vun::kKVLastMode) {
    raise_py(PyExc_ValueError,
             "paged_attention: kv_mode must be 0 (dense), 1 (int8), 2 (int4), 3 (fp8) or 4 "
             "(turboquant_k8v4)");
  }
  const bool quant = kv_mode != vun::kKVDense;
  const int64_t want_c = quant && q.ndim() == 3
      ? static_cast<int64_t>(vun::kv_cell_bytes(kv_mode, q.shape(2)))
      : (latent ? 1 : 2) * q.shape(2);
  if (q.ndim() != 3 || kv_pool.ndim() != 3 || kv_pool.shape(2) != want_c ||
      kv_pool.shape(1) < 1 || q.shape(1) % kv_pool.shape(1) != 0) {
    raise_py(
        PyExc_ValueError,
        "paged_attention: q must be [N, H, D] and kv_pool [slots, Hkv, " +
            std::string(quant ? "cell bytes" : "2D") + "] with Hkv >= 1 and "
            "H % Hkv == 0, got " +
            shape_str(q.shape()) + " and " + shape_str(kv_pool.shape()));
  }
  if (!quant && q.dtype() != kv_pool.dtype()) {
    raise_py(PyExc_TypeError, "paged_attention: q and kv_pool must have one dtype");
  }
  if (quant) {
    if (kv_pool.dtype() != mx::uint8 && kv_pool.dtype() != mx::int8) {
      raise_py(PyExc_TypeError, "paged_attention: a quantized kv_pool must be uint8 or int8");
    }
    if (q.shape(2) % 8 != 0 || q.shape(2) > 512 || q.shape(1) / kv_pool.shape(1) > 64) {
      raise_py(PyExc_ValueError,
               "paged_attention: quantized pools take head sizes that are multiples of 8 up "
               "to 512 and at most 64 query heads per KV head");
    }
  }
  mx::array signs = kv_rht_signs("paged_attention", kv_mode, rht_signs, q.shape(2));
  if (tables.dtype() != mx::int32 || seqs.dtype() != mx::int32 || lens.dtype() != mx::int32) {
    raise_py(PyExc_TypeError, "paged_attention: tables, seqs and lens must be int32");
  }
  if (tables.ndim() != 2 || seqs.shape() != mx::Shape{q.shape(0)} ||
      lens.shape() != mx::Shape{q.shape(0)}) {
    raise_py(
        PyExc_ValueError,
        "paged_attention: tables must be [S, max_blocks] and seqs, lens [N] for N = " +
            std::to_string(q.shape(0)));
  }
  if (window < 0) {
    raise_py(PyExc_ValueError, "paged_attention: window must be >= 0 (0: no window)");
  }
  if (chunk < 0) {
    raise_py(PyExc_ValueError, "paged_attention: chunk must be >= 0 (0: no attention chunk)");
  }
  if (block_size < 1 || kv_pool.shape(0) % block_size != 0) {
    raise_py(PyExc_ValueError, "paged_attention: the pool's slots are not whole blocks");
  }
  // The pool is read where it lies: a non-contiguous pool is an error, never a silent copy.
  if (kv_pool.is_available() && !kv_pool.flags().row_contiguous) {
    raise_py(PyExc_ValueError, "paged_attention: kv_pool must be row-contiguous");
  }
  std::vector<mx::array> inputs{q, kv_pool, contiguous_input(tables, s),
                                contiguous_input(seqs, s), contiguous_input(lens, s),
                                contiguous_input(signs, s)};
  if (!(softcap >= 0.f) || std::isinf(softcap)) {
    raise_py(PyExc_ValueError, "paged_attention: softcap must be finite and >= 0 (0: none)");
  }
  if (sinks) {
    if (sinks->shape() != mx::Shape{q.shape(1)} || !mx::issubdtype(sinks->dtype(),
                                                                    mx::floating)) {
      raise_py(PyExc_ValueError, "paged_attention: sinks must be a float [H] array for q " +
                                     shape_str(q.shape()));
    }
    inputs.push_back(contiguous_input(mx::astype(*sinks, mx::float32, s), s));
  }
  const bool fresh = fresh_k || fresh_v || raw_from || raw_row0;
  if (fresh) {
    if (kv_mode != vun::kKVTqK8V4 || !fresh_k || !fresh_v || !raw_from || !raw_row0) {
      raise_py(PyExc_ValueError,
               "paged_attention: fresh_k, fresh_v, raw_from and raw_row0 go together, with "
               "kv_mode 4 (turboquant_k8v4) only");
    }
    if (fresh_k->dtype() != q.dtype() || fresh_v->dtype() != q.dtype() ||
        fresh_k->ndim() != 3 || fresh_v->shape() != fresh_k->shape() ||
        fresh_k->shape(1) != kv_pool.shape(1) || fresh_k->shape(2) != q.shape(2) ||
        raw_from->dtype() != mx::int32 || raw_row0->dtype() != mx::int32 ||
        raw_from->shape() != mx::Shape{q.shape(0)} || raw_row0->shape() != raw_from->shape()) {
      raise_py(PyExc_ValueError,
               "paged_attention: fresh_k / fresh_v must be [T, Hkv, D] in q's dtype and "
               "raw_from / raw_row0 int32 [N]");
    }
    for (const auto* x : {&*fresh_k, &*fresh_v, &*raw_from, &*raw_row0}) {
      inputs.push_back(contiguous_input(*x, s));
    }
  }
  return mx::array(
      q.shape(), q.dtype(),
      std::make_shared<PagedAttention>(s, scale, block_size, window, kv_mode, chunk, softcap,
                                       sinks.has_value(), latent),
      std::move(inputs));
}

// ---------------------------------------------------------------------------------------------
// write_kv_quant

// Quantizes keys/values [T, Hkv, D] (float32/16, bfloat16) per (token, head) into the cells of
// a quantized pool [slots, Hkv, cell bytes] at slot_mapping[t] (negative: skipped, as vLLM's
// kernels do), in place: the output shares the pool's buffer (write_rows' contract). int4
// rotates each row first (vLLM's single_rht, rounded to the input dtype).
struct KVQuantArgs {
  uint8_t* dst;
  const void* keys;
  const void* values;
  const void* slots;
  const float* signs;
  bool slots_i32;
  int64_t tokens, kv_heads, dim, nrows, block;
  int mode;
};

template <typename T>
void write_kv_quant_impl(const KVQuantArgs& a) {
  const int64_t D = a.dim;
  const int64_t cell = static_cast<int64_t>(vun::kv_cell_bytes(a.mode, D));
  const int64_t dk = static_cast<int64_t>(vun::kv_data_bytes(a.mode, D));
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t slot = a.slots_i32 ? static_cast<const int32_t*>(a.slots)[t]
                                     : static_cast<const int64_t*>(a.slots)[t];
    if (slot >= a.nrows) {
      throw std::out_of_range(out_of_range_msg(slot, a.nrows));
    }
  }
  const size_t items = static_cast<size_t>(a.tokens * a.kv_heads);
  split_work(items, 8 * static_cast<size_t>(D), 1, [&](size_t begin, size_t end) {
    std::vector<float> x(D), y(D);
    for (size_t i = begin; i < end; ++i) {
      const int64_t t = static_cast<int64_t>(i) / a.kv_heads;
      const int64_t h = static_cast<int64_t>(i) % a.kv_heads;
      const int64_t slot = a.slots_i32 ? static_cast<const int32_t*>(a.slots)[t]
                                       : static_cast<const int64_t*>(a.slots)[t];
      if (slot < 0) {
        continue;
      }
      uint8_t* c = a.dst + (slot * a.kv_heads + h) * cell;
      if (a.mode == vun::kKVTqK8V4) {  // one cell of both sides: [K fp8 | V 4-bit | s | z]
        const T* kp = static_cast<const T*>(a.keys) + (t * a.kv_heads + h) * D;
        const T* vp = static_cast<const T*>(a.values) + (t * a.kv_heads + h) * D;
        for (int64_t e = 0; e < D; ++e) {
          x[e] = static_cast<float>(kp[e]);
          y[e] = static_cast<float>(vp[e]);
        }
        vun::quantize_tq_k8v4(x.data(), y.data(), D, c);
        continue;
      }
      for (int side = 0; side < 2; ++side) {
        const T* src = static_cast<const T*>(side == 0 ? a.keys : a.values) +
            (t * a.kv_heads + h) * D;
        for (int64_t e = 0; e < D; ++e) {
          x[e] = static_cast<float>(src[e]);
        }
        if (a.mode == vun::kKVInt4) {
          vun::rht_forward(x.data(), D, a.block, a.signs);
          for (int64_t e = 0; e < D; ++e) {
            x[e] = static_cast<float>(static_cast<T>(x[e]));
          }
        }
        vun::quantize_side(a.mode, x.data(), D, c + side * (dk + 4));
      }
    }
  });
}

class WriteKVQuant : public mx::Primitive {
 public:
  WriteKVQuant(mx::Stream s, int mode) : mx::Primitive(s), mode_(mode) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& dst = inputs[0];
    auto& out = outputs[0];
    if (!dst.flags().row_contiguous) {
      throw std::invalid_argument("[write_kv_quant] the pool is not row-contiguous");
    }
    out.copy_shared_buffer(dst);
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array idx = row_contiguous(inputs[1], enc);
    const mx::array k = row_contiguous(inputs[2], enc);
    const mx::array v = row_contiguous(inputs[3], enc);
    const mx::array sg = row_contiguous(inputs[4], enc);
    if (idx.size() == 0) {
      return;
    }
    enc.set_input_array(dst);
    enc.set_input_array(idx);
    enc.set_input_array(k);
    enc.set_input_array(v);
    enc.set_input_array(sg);
    enc.set_output_array(out);
    KVQuantArgs a{out.data<uint8_t>(), k.data<void>(), v.data<void>(),
                  idx.dtype() == mx::int32 ? static_cast<const void*>(idx.data<int32_t>())
                                           : static_cast<const void*>(idx.data<int64_t>()),
                  sg.data<float>(), idx.dtype() == mx::int32, k.shape(0), k.shape(1),
                  k.shape(2), dst.shape(0), sg.shape(0), mode_};
    switch (k.dtype()) {
      case mx::float32:
        enc.dispatch([a]() { write_kv_quant_impl<float>(a); });
        break;
      case mx::float16:
        enc.dispatch([a]() { write_kv_quant_impl<mx::float16_t>(a); });
        break;
      case mx::bfloat16:
        enc.dispatch([a]() { write_kv_quant_impl<mx::bfloat16_t>(a); });
        break;
      default:
        throw std::invalid_argument("[write_kv_quant] float32, float16 or bfloat16 only");
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[write_kv_quant] CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override {
    return "WriteKVQuant";
  }

 private:
  int mode_;
};

mx::array write_kv_quant(
    const mx::array& dst, const mx::array& slot_mapping, const mx::array& keys,
    const mx::array& values, int kv_mode, std::optional<mx::array> rht_signs,
    nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "write_kv_quant");
  if (kv_mode < vun::kKVInt8 || kv_mode > vun::kKVLastMode) {
    raise_py(PyExc_ValueError,
             "write_kv_quant: kv_mode must be 1 (int8), 2 (int4), 3 (fp8) or 4 "
             "(turboquant_k8v4)");
  }
  if (keys.ndim() != 3 || values.shape() != keys.shape() || dst.ndim() != 3 ||
      dst.shape(1) != keys.shape(1) ||
      dst.shape(2) != static_cast<int64_t>(vun::kv_cell_bytes(kv_mode, keys.shape(2))) ||
      keys.shape(2) % 8 != 0) {
    raise_py(PyExc_ValueError,
             "write_kv_quant: keys and values must be [T, Hkv, D] (D a multiple of 8) and dst "
             "[slots, Hkv, cell bytes], got " + shape_str(keys.shape()) + ", " +
                 shape_str(values.shape()) + " and " + shape_str(dst.shape()));
  }
  if (dst.dtype() != mx::uint8 && dst.dtype() != mx::int8) {
    raise_py(PyExc_TypeError, "write_kv_quant: dst must be uint8 or int8");
  }
  if (keys.dtype() != values.dtype()) {
    raise_py(PyExc_TypeError, "write_kv_quant: keys and values must have one dtype");
  }
  if (slot_mapping.ndim() != 1 || slot_mapping.shape(0) != keys.shape(0) ||
      (slot_mapping.dtype() != mx::int32 && slot_mapping.dtype() != mx::int64)) {
    raise_py(PyExc_TypeError, "write_kv_quant: slot_mapping must be int32/int64 [T]");
  }
  mx::array signs = kv_rht_signs("write_kv_quant", kv_mode, rht_signs, keys.shape(2));
  if (dst.status() != mx::array::Status::unscheduled && !dst.flags().row_contiguous) {
    raise_py(PyExc_ValueError, "write_kv_quant: dst is not row-contiguous");
  }
  return mx::array(dst.shape(), dst.dtype(), std::make_shared<WriteKVQuant>(s, kv_mode),
                   {dst, slot_mapping, keys, values, contiguous_input(signs, s)});
}

// ---------------------------------------------------------------------------------------------
// linear

// One pool for every kernel call in the process, sized to the CPUs this process may use (at
// most the thread cap), created when a kernel first runs; never destroyed (its workers must
// outlive MLX's stream threads, which run the kernels, at exit).
vun::ThreadPool& kernel_pool() {
  static vun::ThreadPool* pool = [] {
    size_t n = std::thread::hardware_concurrency();
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      n = static_cast<size_t>(CPU_COUNT(&set));
    }
#endif
    // The thread cap (vun::configure): at most this many threads (1: the MLX stream thread
    // alone).
    if (const size_t cap = vun::thread_cap(); cap >= 1 && cap < n) {
      n = cap;
    }
    return new vun::ThreadPool(n);
  }();
  return *pool;
}

// The output shape of a linear layer of N outputs on x [..., K]: x's shape with N last. Leading
// axes are taken as they are (rows = x.size / K), so callers need no reshape node around the
// call (a graph node per linear, ~2.5 us each to evaluate on MLX's CPU backend).
mx::Shape linear_out_shape(const mx::Shape& x, int n) {
  mx::Shape out = x;
  out.back() = n;
  return out;
}

// y = x @ w.T for fp32 x [..., K] (rows M = x.size / K), w [N, K] (nn.Linear's weight layout):
// the weight rows are split over the kernel pool's threads in groups of 4 (see
// vun::linear_rows_f32).
class Linear : public CpuOnlyPrimitive {
 public:
  explicit Linear(mx::Stream s) : CpuOnlyPrimitive(s, "linear") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& w = inputs[1];
    auto& y = outputs[0];
    if (!w.flags().row_contiguous) {
      throw std::invalid_argument("[linear] w must be row-contiguous");
    }
    if (inputs[0].ndim() < 1 || w.ndim() != 2 || inputs[0].shape(-1) != w.shape(1)) {
      throw std::invalid_argument("[linear] x must be [..., K] and w [N, K]");  // shapeless
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array x = row_contiguous(inputs[0], enc);
    y.set_data(mx::allocator::malloc(y.nbytes()));
    enc.set_input_array(x);
    enc.set_input_array(w);
    enc.set_output_array(y);
    enc.dispatch([xp = x.data<float>(), wp = w.data<float>(), yp = y.data<float>(),
                  M = x.size() / static_cast<size_t>(w.shape(1)),
                  N = static_cast<size_t>(w.shape(0)), K = static_cast<size_t>(w.shape(1))]() {
      // Chunks of whole 4-row groups, several per thread so that a thread that is late (the
      // CPU busy with other work) costs at most a chunk, not a share.
      auto& pool = kernel_pool();
      const size_t groups = (N + 3) / 4;
      const size_t chunks = std::min(groups, 8 * pool.size());
      pool.run(chunks, [&](size_t c) {
        const size_t n0 = std::min(N, groups * c / chunks * 4);
        const size_t n1 = std::min(N, groups * (c + 1) / chunks * 4);
        vun::linear_rows_f32(xp, wp, yp, M, N, K, n0, n1);
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {linear_out_shape(inputs[0].shape(), inputs[1].shape(0))};
  }

  const char* name() const override {
    return "Linear";
  }
};

mx::array linear(const mx::array& x, const mx::array& w, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "linear");
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, "linear: x and w must be float32");
  }
  if (x.ndim() < 1 || w.ndim() != 2 || x.shape(-1) != w.shape(1)) {
    raise_py(
        PyExc_ValueError,
        "linear: x must be [..., K] and w [N, K], got " + shape_str(x.shape()) + " and " +
            shape_str(w.shape()));
  }
  // A weight that is not row-contiguous would be copied on every call: refuse instead.
  if (w.is_available() && !w.flags().row_contiguous) {
    raise_py(PyExc_ValueError, "linear: w must be row-contiguous (a weight, not a view)");
  }
  return mx::array(
      linear_out_shape(x.shape(), w.shape(0)), mx::float32, std::make_shared<Linear>(s), {x, w});
}

// ---------------------------------------------------------------------------------------------
// lora_update: each row of a step under its own LoRA adapter slot (cpu_lora.h)

// out = y + per row t with slot s >= 0: (x[t] @ a_s.T) @ b_s over the slot's first rank[s]
// rank rows. y [..., N], x [..., K] (the same T = size / last rows, leading axes as they are:
// no reshape node around the call), a [S * R, K], b [S * R, N] fp32; slot [T], rank [S] int32.
// y's buffer is reused when MLX may donate it (the base layer's output, read by nothing else).
class LoraUpdate : public CpuOnlyPrimitive {
 public:
  explicit LoraUpdate(mx::Stream s) : CpuOnlyPrimitive(s, "lora_update") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array y = row_contiguous(inputs[0], enc);
    const mx::array x = row_contiguous(inputs[1], enc);
    const mx::array a = row_contiguous(inputs[2], enc);
    const mx::array b = row_contiguous(inputs[3], enc);
    const mx::array slot = row_contiguous(inputs[4], enc);
    const mx::array rank = row_contiguous(inputs[5], enc);
    auto& out = outputs[0];
    const bool donated = inputs[0].flags().row_contiguous && inputs[0].is_donatable();
    if (donated) {
      out.copy_shared_buffer(inputs[0]);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    for (const auto* in : {&y, &x, &a, &b, &slot, &rank}) {
      enc.set_input_array(*in);
    }
    enc.set_output_array(out);
    const size_t K = static_cast<size_t>(x.shape(-1)), T = x.size() / K;
    const size_t N = static_cast<size_t>(b.shape(1));
    const size_t R = static_cast<size_t>(a.shape(0) / rank.shape(0));
    enc.dispatch([yp = y.data<float>(), xp = x.data<float>(), ap = a.data<float>(),
                  bp = b.data<float>(), sp = slot.data<int32_t>(), rp = rank.data<int32_t>(),
                  op = out.data<float>(), donated, T, K, N, R]() {
      if (!donated) {
        std::memcpy(op, yp, T * N * sizeof(float));
      }
      std::vector<float> h(T * R);
      auto& pool = kernel_pool();
      // A decode step's update is tens of microseconds of work: waking the pool's sleeping
      // workers for it cost more than it saves (one chunk runs on this thread).
      const size_t work = T * R * (K + N);
      const size_t threads = work < (size_t{1} << 18) ? 1 : 4 * pool.size();
      const size_t row_chunks = std::min(T, threads);
      pool.run(row_chunks, [&](size_t c) {
        vun::lora_shrink_f32(xp, ap, h.data(), sp, rp, K, R, T * c / row_chunks,
                             T * (c + 1) / row_chunks);
      });
      const size_t blocks = (N + 15) / 16;
      const size_t col_chunks = std::min(blocks, threads);
      pool.run(col_chunks, [&](size_t c) {
        vun::lora_expand_f32(h.data(), bp, op, sp, rp, T, N, R,
                             std::min(N, blocks * c / col_chunks * 16),
                             std::min(N, blocks * (c + 1) / col_chunks * 16));
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override {
    return "LoraUpdate";
  }
};

mx::array lora_update(const mx::array& y, const mx::array& x, const mx::array& a,
                      const mx::array& b, const mx::array& slot, const mx::array& rank,
                      nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "lora_update");
  for (const auto* m : {&y, &x, &a, &b}) {
    if (m->dtype() != mx::float32 || m->ndim() < 2 || (m->ndim() != 2 && (m == &a || m == &b))) {
      raise_py(PyExc_TypeError, "lora_update: y, x, a and b must be float32, a and b 2-D");
    }
  }
  if (slot.dtype() != mx::int32 || rank.dtype() != mx::int32 || slot.ndim() != 1 ||
      rank.ndim() != 1) {
    raise_py(PyExc_TypeError, "lora_update: slot and rank must be 1-D int32");
  }
  const int S = rank.shape(0);
  mx::Shape y_rows = y.shape(), x_rows = x.shape();
  y_rows.pop_back();
  x_rows.pop_back();
  const size_t T = y.size() / static_cast<size_t>(std::max(y.shape(-1), 1));
  if (y_rows != x_rows || static_cast<size_t>(slot.shape(0)) != T || a.shape(1) != x.shape(-1) ||
      b.shape(1) != y.shape(-1) || a.shape(0) != b.shape(0) || S < 1 || a.shape(0) % S) {
    raise_py(PyExc_ValueError,
             "lora_update: expected y [..., N], x [..., K] (same leading axes, T rows), "
             "a [S*R, K], b [S*R, N], slot [T], "
             "rank [S]; got y " + shape_str(y.shape()) + ", x " + shape_str(x.shape()) +
                 ", a " + shape_str(a.shape()) + ", b " + shape_str(b.shape()) + ", slot " +
                 shape_str(slot.shape()) + ", rank " + shape_str(rank.shape()));
  }
  return mx::array(y.shape(), mx::float32, std::make_shared<LoraUpdate>(s),
                   {y, x, a, b, slot, rank});
}

// ---------------------------------------------------------------------------------------------
// quantized_linear, dequantize: MLX affine-quantized weights (mx.quantize's layout)

// Elements per row of a packed weight of `words` uint32 per row (MLX packs every width as a
// bit stream: words * 32 / bits, whole for the widths check_quantized admits).
int64_t packed_columns(int64_t words, int bits) {
  return words * 32 / bits;
}

// The checks both quantized entry points share; raises TypeError/ValueError naming what failed.
void check_quantized(const char* what, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group_size, int bits) {
  const std::string fn(what);
  if (bits < 2 || bits > 8 || bits == 7) {
    raise_py(PyExc_ValueError,
             fn + ": bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  }
  if (group_size <= 0 || group_size % 16 != 0) {
    raise_py(PyExc_ValueError,
             fn + ": group_size must be a positive multiple of 16, got " +
                 std::to_string(group_size));
  }
  const auto st = scales.dtype();
  if (w.dtype() != mx::uint32 || biases.dtype() != st ||
      (st != mx::float32 && st != mx::float16 && st != mx::bfloat16)) {
    raise_py(PyExc_TypeError,
             fn + ": w must be uint32 and scales, biases both float32, float16 or bfloat16");
  }
  if (w.ndim() != 2) {
    raise_py(PyExc_ValueError, fn + ": w must be [N, K * bits / 32], got " + shape_str(w.shape()));
  }
  if (int64_t{w.shape(1)} * 32 % bits != 0) {
    raise_py(PyExc_ValueError, fn + ": w's " + std::to_string(w.shape(1)) +
                                   " words do not hold whole " + std::to_string(bits) +
                                   "-bit elements");
  }
  const int64_t K = packed_columns(w.shape(1), bits);
  const mx::Shape groups{w.shape(0), static_cast<int>(K / group_size)};
  if (K % group_size != 0 || scales.shape() != groups || biases.shape() != groups) {
    raise_py(PyExc_ValueError,
             fn + ": scales and biases must be [N, K / group_size] = " + shape_str(groups) +
                 " for w " + shape_str(w.shape()) + " (K = " + std::to_string(K) +
                 "), got " + shape_str(scales.shape()) + " and " + shape_str(biases.shape()));
  }
  // Parameters that are not row-contiguous would be copied on every call: refuse instead.
  for (const mx::array* a : {&w, &scales, &biases}) {
    if (a->is_available() && !a->flags().row_contiguous) {
      raise_py(PyExc_ValueError, fn + ": w, scales and biases must be row-contiguous");
    }
  }
}

// The ScaleType of a quantized weight's scales (check_quantized admitted its dtype).
vun::ScaleType scale_type(const mx::array& scales) {
  if (scales.dtype() == mx::float16) {
    return vun::ScaleType::kF16;
  }
  return scales.dtype() == mx::bfloat16 ? vun::ScaleType::kBF16 : vun::ScaleType::kF32;
}

// vun::dequantize_rows_f32 for scales and biases of any ScaleType: 16-bit ones are widened to
// fp32 (exactly) a few rows at a time into per-thread buffers first, so the results are those
// of the same weight with fp32 scales, bit for bit.
void dequantize_rows(const uint32_t* wq, const void* scales, const void* biases,
                     vun::ScaleType st, float* out, size_t r0, size_t r1, size_t K,
                     size_t group_size, int bits) {
  if (st == vun::ScaleType::kF32) {
    vun::dequantize_rows_f32(wq, static_cast<const float*>(scales),
                             static_cast<const float*>(biases), out, r0, r1, K, group_size, bits);
    return;
  }
  constexpr size_t kRows = 16;
  const size_t groups = K / group_size;
  const size_t words = K * static_cast<size_t>(bits) / 32;
  for (size_t r = r0; r < r1; r += kRows) {
    const size_t count = std::min(kRows, r1 - r);
    const vun::ScaleRowsF32 sr = vun::scale_rows_f32(scales, biases, st, groups, r, count);
    vun::dequantize_rows_f32(wq + r * words, sr.s, sr.b, out + (r - r0) * K, 0, count, K,
                             group_size, bits);
  }
}

// Scratch rows for dequantized weights, one buffer per thread (kernels run on MLX's stream
// thread and the pool's workers), grown as needed and kept.
float* scratch_rows(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) {
    buf.resize(floats);
  }
  return buf.data();
}

// Rows of x from which QuantizedLinear runs on AMX tiles. Below, the AVX-512 kernel is as fast or
// faster (SmolLM2's 49,152 x 576 8-bit output head: 1.32 vs 1.75 ms at 1 row, 1.86 vs 1.83 at 4;
// its 4-bit layers equal within 10% up to 4 rows), since a tile computes 16 rows regardless.
constexpr size_t kAmxMinRows = 4;

// Whether QuantizedLinear runs on AMX tiles for x [M, K] and this group size: enough rows, the
// CPU and OS allow it (vun::amx_usable), and K and the groups are whole 32-element tile rows.
bool use_amx(size_t M, size_t K, size_t group_size) {
  return M >= kAmxMinRows && K % 32 == 0 && group_size % 32 == 0 && vun::amx_usable();
}

// Whether an AMX call unpacks the whole weight once into a shared panel: x has more than 2
// 16-row blocks (decode-sized x unpacks each weight tile where it is used instead).
bool amx_uses_panel(size_t M) {
  return (M + 15) / 16 > 2;
}

// Bytes of the AMX kernels' scratch for x [M, K] through w [N, K]: x's bf16 tiles and per-group
// sums, plus the unpacked weight panel (amx_uses_panel); 64 bytes of slack for aligning each
// part.
struct AmxScratch {
  size_t tile_elems, sum_floats, panel_elems;
  size_t bytes() const { return 2 * tile_elems + 4 * sum_floats + 2 * panel_elems + 3 * 64; }
};

AmxScratch amx_scratch(size_t M, size_t N, size_t K, size_t group_size) {
  return {vun::amx_x_tile_elems(M, K), vun::amx_x_sum_floats(M, K, group_size),
          amx_uses_panel(M) ? vun::amx_weight_elems(N, K) : 0};
}

// `p` rounded up to a multiple of 64 bytes.
char* align64(char* p) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) / 64 * 64);
}

// The panel kernels' work on the pool: items of up to item_m m-blocks x item_n n-blocks (an
// item's x and weight tiles stay in L2 while it computes), fn(nb0, nb1, mb0, mb1) per item.
template <class Fn>
void run_block_items(size_t mblocks, size_t nblocks, size_t item_m, size_t item_n, const Fn& fn) {
  const size_t m_items = (mblocks + item_m - 1) / item_m;
  const size_t n_items = (nblocks + item_n - 1) / item_n;
  kernel_pool().run(m_items * n_items, [&](size_t item) {
    const size_t mb = item / n_items * item_m, nb = item % n_items * item_n;
    fn(nb, std::min(nblocks, nb + item_n), mb, std::min(mblocks, mb + item_m));
  });
}

// `scratch`: amx_scratch(M, N, K, group_size).bytes() bytes, any alignment.
void amx_quantized_linear(const float* x, const uint32_t* w, const void* scales,
                          const void* biases, vun::ScaleType st, float* y, size_t M, size_t N,
                          size_t K, size_t group_size, int bits, char* scratch) {
  constexpr size_t kItemMBlocks = 4;   // 64 rows of x: 3 bf16 parts = 384 bytes per k
  constexpr size_t kItemNBlocks = 24;  // 384 rows of w: 64 bytes per k (multiple of 4 blocks)
  const AmxScratch sizes = amx_scratch(M, N, K, group_size);
  auto* tiles = reinterpret_cast<uint16_t*>(align64(scratch));
  auto* sums = reinterpret_cast<float*>(align64(reinterpret_cast<char*>(tiles + sizes.tile_elems)));
  auto* panel =
      reinterpret_cast<uint16_t*>(align64(reinterpret_cast<char*>(sums + sizes.sum_floats)));
  const size_t mblocks = (M + 15) / 16;
  const size_t nblocks = (N + 15) / 16;
  split_work(mblocks, 16 * K * 8, 1, [&](size_t b, size_t e) {
    vun::amx_prepare_x(x, M, K, group_size, tiles, sums, b, e);
  });
  if (!amx_uses_panel(M)) {
    split_work(nblocks, 16 * K * mblocks, 4, [&](size_t b, size_t e) {
      vun::amx_quantized_linear_blocks(tiles, sums, w, scales, biases, st, y, M, N, K, group_size,
                                       bits, b, e);
    });
    return;
  }
  split_work(nblocks, 16 * K, 1, [&](size_t b, size_t e) {
    vun::amx_unpack_weight(w, N, K, bits, panel, b, e);
  });
  run_block_items(mblocks, nblocks, kItemMBlocks, kItemNBlocks,
                  [&](size_t nb0, size_t nb1, size_t mb0, size_t mb1) {
                    vun::amx_quantized_linear_panel(tiles, sums, panel, scales, biases, st, y, M,
                                                    N, K, group_size, nb0, nb1, mb0, mb1);
                  });
}

// The arithmetic of QuantizedLinear's gemv: 1 by default (exact, vun::quantized_gemv_f32's
// table mode), 2 exact without the table, 0 turns it off (the scratch path for every M); 3 and
// 4 compute against x quantized per 32 elements (vun::quantized_gemv_q8; not exact) where
// use_int8 allows it, else as 1: 3 in one int8 term (llama.cpp's arithmetic), 4 in two (x to
// ~16 bits). Set by quantized_gemv_mode (vllm_unified_native sets it from
// VLLM_UNIFIED_CPU_ACTIVATIONS; benchmarks compare the variants in one process).
std::atomic<int>& gemv_mode() {
  static std::atomic<int> mode{1};
  return mode;
}

int set_gemv_mode(int mode) {
  if (mode < 0 || mode > 4) {
    raise_py(PyExc_ValueError, "quantized_gemv_mode: mode must be 0, 1, 2, 3 or 4");
  }
  return gemv_mode().exchange(mode);
}

// Rows of x from which the AVX-512 VNNI GEMM takes a layer where AMX-INT8 does not run; the
// int8 gemv takes fewer. In decode steps of SmolLM2 and Qwen2.5-0.5B the gemv (each weight
// row read once, x's rows in chunks of 4) beat the GEMM (codes unpacked into panels per call)
// up to 5 rows, most at 4 (the 8-bit output heads, which the gemv reads without unpacking);
// from 6 they tied, and the GEMM pulls ahead as rows grow (benchmarks/results/HISTORY.md).
constexpr size_t kQ8GemmMinRows = 6;

bool use_q8_gemm(size_t M, size_t K, size_t group_size, int bits);

// Whether quantized_linear takes the int8 gemv for x [M, K] (mode 3 or 4, the CPU and the
// layer allow it): up to 4 rows where AMX-INT8 tiles take 5 and more, else below
// kQ8GemmMinRows (where use_q8_gemm starts). Beyond, its cost grows with the rows (the
// weight's unpacking repeats per 4 of them): the AMX kernels or the GEMM take those.
bool use_int8(size_t M, size_t K, size_t group_size, int bits) {
  const size_t most = vun::amx_usable() ? 4 : kQ8GemmMinRows - 1;
  return gemv_mode().load(std::memory_order_relaxed) >= 3 && M >= 1 && M <= most &&
         vun::q8_usable(K, group_size, bits) && !use_q8_gemm(M, K, group_size, bits);
}

// Forward declarations (defined with the GEMMs' dispatch below).
bool use_q8_avx2_gemm(size_t M, size_t K, size_t group_size, int bits);
void q8_gemm_linear(const float* x, const uint32_t* w, const void* scales, const void* biases,
                    vun::ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
                    int bits, bool two_terms, bool avx2, char* scratch);

// Whether quantized_linear takes the AMX-INT8 tiles for x [M, K]: modes 3 and 4 from 5 rows,
// where the integer gemv's cost grows with the rows and the bf16 tiles need three products per
// x value (Qwen2.5-Coder batch-16 forward and 2,048-token prefill: benchmarks/results/HISTORY.md).
// Groups of 16 (Q6_K, Q3_K, Q2_K) run on these tiles too, which the bf16 tiles cannot take.
// Up to 16 rows each weight tile is unpacked where it is used (vun::amx_q8_linear_blocks);
// beyond, the codes are unpacked once per call into a panel (vun::amx_q8_linear_panel).
bool use_amx_int8(size_t M, size_t K, size_t group_size, int bits) {
  return gemv_mode().load(std::memory_order_relaxed) >= 3 && M >= 5 && vun::amx_usable() &&
         vun::q8_usable(K, group_size, bits);
}

// Whether quantized_linear takes the AVX-512 VNNI GEMM for x [M, K] (vun::q8_gemm_*): modes 3
// and 4 from kQ8GemmMinRows rows where AMX-INT8 does not run and the int8 gemv's layout rules
// hold.
bool use_q8_gemm(size_t M, size_t K, size_t group_size, int bits) {
  return gemv_mode().load(std::memory_order_relaxed) >= 3 && M >= kQ8GemmMinRows &&
         !vun::amx_usable() && vun::q8_usable(K, group_size, bits);
}

// Whether the AVX2 integer kernels (vun::q8_avx2_*) take x [M, K]: modes 3 and 4 at every size
// where neither AMX-INT8 nor the AVX-512 VNNI kernels run (a CPU without AVX-512 VNNI and
// VBMI, or VLLM_UNIFIED_CPU_ISA=avx2) and the layout is one the int8 kernels take; the gemv up
// to kQ8Avx2GemvMaxRows rows, the GEMM (same bits as the AVX-512 GEMM) beyond.
bool use_q8_avx2(size_t M, size_t K, size_t group_size, int bits) {
  return gemv_mode().load(std::memory_order_relaxed) >= 3 && M >= 1 && !vun::amx_usable() &&
         !vun::q8_usable(K, group_size, bits) && vun::q8_avx2_usable(K, group_size, bits);
}

// Rows of x up to which the AVX2 gemv (vun::q8_avx2_gemv) runs: it reads each weight row once
// and unpacks its codes in registers, where the GEMM writes and rereads a panel of int16 codes
// per call (benchmarks/kernels.py linear --isa avx2).
constexpr size_t kQ8Avx2GemvMaxRows = 4;

bool use_q8_avx2_gemv(size_t M, size_t K, size_t group_size, int bits) {
  return M <= kQ8Avx2GemvMaxRows && use_q8_avx2(M, K, group_size, bits);
}

bool use_q8_avx2_gemm(size_t M, size_t K, size_t group_size, int bits) {
  return M > kQ8Avx2GemvMaxRows && use_q8_avx2(M, K, group_size, bits);
}

// The AVX2 gemv for x [M <= kQ8Avx2GemvMaxRows, K]: x prepared once, in the gemv's order, into
// `scratch` (q8_avx2_x_layout's bytes + 64), then the weight's rows split over the pool.
void q8_avx2_gemv_linear(const float* x, const uint32_t* w, const void* scales,
                         const void* biases, vun::ScaleType st, float* y, size_t M, size_t N,
                         size_t K, size_t group_size, int bits, bool two_terms, char* scratch) {
  const vun::Q8GemmXLayout l = vun::q8_avx2_x_layout(M, K, group_size);
  auto* xbuf = reinterpret_cast<uint8_t*>(align64(scratch));
  vun::q8_avx2_prepare_x(x, l, group_size, two_terms, bits == 4, xbuf, 0, M);
  auto& pool = kernel_pool();
  const size_t chunks = std::min(N, 8 * pool.size());
  pool.run(chunks, [&](size_t c) {
    vun::q8_avx2_gemv(xbuf, l, w, scales, biases, st, y, N, group_size, bits,
                      N * c / chunks, N * (c + 1) / chunks);
  });
}

// The AVX-512 VNNI GEMM, or (avx2) its AVX2 twin: x prepared once (rows split over the pool)
// into `scratch` (q8_gemm_x_layout(...).bytes, or q8_avx2_x_layout's, + 64 bytes), then items
// of 2-8 panel blocks x a range of x's rows, each item unpacking its blocks into a per-thread
// panel.
void q8_gemm_linear(const float* x, const uint32_t* w, const void* scales, const void* biases,
                    vun::ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
                    int bits, bool two_terms, bool avx2, char* scratch) {
  // weight rows per item: up to 8 panel blocks (AVX-512: 128 rows; AVX2: 64), fewer (pairs)
  // where that leaves fewer than 4 items per thread: k/v of 128 rows made one item of 8
  // AVX-512 blocks, which one thread computed while the other waited
  constexpr size_t kItemBlocks = 8, kMinItemRows = 64;
  auto& pool = kernel_pool();
  const size_t want = 4 * pool.size();
  const size_t block_rows = avx2 ? 8 : 16;
  const size_t nblocks = (N + block_rows - 1) / block_rows;
  const size_t item_blocks = std::clamp<size_t>(nblocks / want / 2 * 2, 2, kItemBlocks);
  const vun::Q8GemmXLayout l = avx2 ? vun::q8_avx2_x_layout(M, K, group_size)
                                    : vun::q8_gemm_x_layout(M, K, group_size, two_terms);
  auto* xbuf = reinterpret_cast<uint8_t*>(align64(scratch));
  const bool even_odd = avx2 && vun::q8_avx2_even_odd(bits, two_terms, group_size);
  split_work(M, 8 * K, 1, [&](size_t b, size_t e) {
    if (avx2) {
      vun::q8_avx2_prepare_x(x, l, group_size, two_terms, even_odd, xbuf, b, e);
    } else {
      vun::q8_gemm_prepare_x(x, l, group_size, two_terms, xbuf, b, e);
    }
  });
  const size_t nitems = (nblocks + item_blocks - 1) / item_blocks;
  // few weight items (a narrow layer, k/v): x's rows split too, so that every thread has work
  const size_t mparts = std::clamp<size_t>((want + nitems - 1) / nitems, 1,
                                           std::max<size_t>(1, M / kMinItemRows));
  const size_t panel_bytes = avx2 ? vun::q8_avx2_panel_bytes(K, group_size)
                                  : vun::q8_gemm_panel_bytes(K, group_size);
  // AVX2: the item's blocks unpacked in pairs, as many pairs at once as fit kAvx2PanelBudget,
  // so that a chunk of x's rows meets all of them (y written a few lines per row per chunk,
  // not one row's line per page across all of x)
  constexpr size_t kAvx2PanelBudget = 256 << 10;
  const size_t avx2_blocks =
      std::clamp<size_t>(kAvx2PanelBudget / (2 * panel_bytes), 1, item_blocks / 2) * 2;
  pool.run(nitems * mparts, [&](size_t item) {
    const size_t c = item / mparts, p = item % mparts;
    const size_t nb0 = c * item_blocks, nb1 = std::min(nblocks, nb0 + item_blocks);
    const size_t m0 = M * p / mparts / 4 * 4;
    const size_t m1 = p + 1 == mparts ? M : M * (p + 1) / mparts / 4 * 4;
    thread_local std::vector<char> buf;
    buf.resize((avx2 ? avx2_blocks : item_blocks) * panel_bytes + 64);
    auto* panel = reinterpret_cast<uint8_t*>(align64(buf.data()));
    if (avx2) {  // avx2_blocks at a time: their panel stays in L2 (512 KiB on Zen 2/3)
      for (size_t nb = nb0; nb < nb1; nb += avx2_blocks) {
        const size_t end = std::min(nb1, nb + avx2_blocks);
        vun::q8_avx2_pack(w, scales, biases, st, N, K, group_size, bits, two_terms, nb, end,
                          panel);
        vun::q8_avx2_compute(xbuf, l, panel, y, N, group_size, bits, two_terms, nb, end, m0,
                             m1);
      }
    } else {
      vun::q8_gemm_pack(w, scales, biases, st, N, K, group_size, bits, nb0, nb1, panel);
      vun::q8_gemm_compute(xbuf, l, panel, y, N, group_size, two_terms, nb0, nb1, m0, m1);
    }
  });
}

// Bytes of the AMX-INT8 panel path's scratch for x [M > 16, K] through w [N, K]: x prepared
// per m-block, then the unpacked codes, 64 bytes of slack for aligning each part.
size_t amx_q8_scratch(size_t M, size_t N, size_t K, size_t group_size) {
  return (M + 15) / 16 * vun::amx_q8_x_bytes(K, group_size) +
         (N + 15) / 16 * 16 * K + 2 * 64;
}

// The AMX-INT8 panel path (M > 16 rows): x prepared per m-block and the codes unpacked, each
// split over the pool, then items of kItemMBlocks x kItemNBlocks blocks (run_block_items).
void amx_q8_linear(const float* x, const uint32_t* w, const void* scales, const void* biases,
                   vun::ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
                   int bits, bool two_terms, char* scratch) {
  constexpr size_t kItemMBlocks = 4, kItemNBlocks = 16;
  const size_t x_bytes = vun::amx_q8_x_bytes(K, group_size);
  const size_t mblocks = (M + 15) / 16, nblocks = (N + 15) / 16;
  auto* xbufs = reinterpret_cast<uint8_t*>(align64(scratch));
  auto* panel = reinterpret_cast<uint8_t*>(align64(reinterpret_cast<char*>(xbufs) +
                                                   mblocks * x_bytes));
  split_work(mblocks, 16 * K * 8, 1, [&](size_t b, size_t e) {
    for (size_t mb = b; mb < e; ++mb) {
      vun::amx_q8_prepare_x(x + mb * 16 * K, std::min<size_t>(16, M - mb * 16), K, group_size,
                            two_terms, xbufs + mb * x_bytes);
    }
  });
  split_work(nblocks, 16 * K, 1, [&](size_t b, size_t e) {
    vun::amx_q8_unpack_panel(w, N, K, group_size, bits, panel, b, e);
  });
  run_block_items(mblocks, nblocks, kItemMBlocks, kItemNBlocks,
                  [&](size_t nb0, size_t nb1, size_t mb0, size_t mb1) {
                    vun::amx_q8_linear_panel(xbufs, panel, scales, biases, st, y, M, N, K,
                                             group_size, two_terms, nb0, nb1, mb0, mb1);
                  });
}

// x quantized once per call for the int8 gemv (vun::Q8Activations), in this thread's buffers:
// the pool's workers read them during the call.
vun::Q8Activations q8_activations(const float* x, size_t M, size_t K, size_t group_size,
                                  bool two_terms) {
  thread_local std::vector<char> buf;
  const size_t spans = (K + 63) / 64;
  const size_t xq_bytes = M * spans * 64, dx_bytes = M * spans * 16 * 4;
  buf.resize(2 * xq_bytes + dx_bytes + M * (K / group_size) * 4 + 64);
  auto* xq = reinterpret_cast<int8_t*>(align64(buf.data()));  // parts 64-byte multiples apart
  int8_t* xq_lo = xq + xq_bytes;
  auto* dx = reinterpret_cast<float*>(xq + 2 * xq_bytes);
  auto* sx = reinterpret_cast<float*>(xq + 2 * xq_bytes + dx_bytes);
  vun::q8_quantize_rows(x, M, K, group_size, two_terms, xq, xq_lo, dx, sx);
  return {xq, two_terms ? xq_lo : nullptr, dx, sx};
}

// vun::quantized_gemv_f32 for scales and biases of any ScaleType: 16-bit ones are widened 64
// rows at a time into per-thread buffers, and the kernel runs on those rows as a matrix of their
// own (w and y offset to the first row; y's row stride stays N). Returns the first row not
// computed, as the kernel does.
size_t quantized_gemv(const float* x, const vun::Q8Activations* q8, const uint32_t* wq,
                      const void* scales, const void* biases, vun::ScaleType st, float* y,
                      size_t M, size_t N, size_t K, size_t group_size, int bits, size_t n0,
                      size_t n1, int mode) {
  if (q8 != nullptr) {  // the int8 gemv on these prepared activations reads 16-bit scales
    return vun::quantized_gemv_q8(*q8, wq, scales, biases, st, y, M, N, K, group_size, bits,
                                  n0, n1);
  }
  const auto kernel = [&](const float* s, const float* b, const uint32_t* w, float* out,
                          size_t r0, size_t r1) {
    return vun::quantized_gemv_f32(x, w, s, b, out, M, N, K, group_size, bits, r0, r1, mode);
  };
  if (st == vun::ScaleType::kF32) {
    return kernel(static_cast<const float*>(scales), static_cast<const float*>(biases), wq, y,
                  n0, n1);
  }
  constexpr size_t kRows = 64;  // a multiple of the kernel's 4-row blocks
  const size_t groups = K / group_size;
  const size_t words = K * static_cast<size_t>(bits) / 32;
  for (size_t n = n0; n < n1; n += kRows) {
    const size_t end = std::min(n1, n + kRows);
    const vun::ScaleRowsF32 sr = vun::scale_rows_f32(scales, biases, st, groups, n, end - n);
    const size_t done = n + kernel(sr.s, sr.b, wq + n * words, y + n, 0, end - n);
    if (done < end) {
      return done;  // a last block of fewer than 4 rows, or no kernel here: the caller's
    }
  }
  return n1;
}

// The state and boilerplate of the two primitives on MLX affine-quantized weights.
class QuantizedWeightPrimitive : public CpuOnlyPrimitive {
 public:
  QuantizedWeightPrimitive(mx::Stream s, const char* what, int group_size, int bits)
      : CpuOnlyPrimitive(s, what), group_size_(group_size), bits_(bits) {}

  // MLX compares primitives of the same type only.
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedWeightPrimitive&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 protected:
  int group_size_;
  int bits_;
};

// y = x @ dequantize(w).T for fp32 x [..., K] (M rows): each group of 4 weight rows is dequantized into a
// per-thread scratch (L1/L2) and multiplied like Linear's, so the weight streams from memory at
// bits / 32 of its fp32 size and the result is bit-identical to Linear on mx.dequantize(w).
class QuantizedLinear : public QuantizedWeightPrimitive {
 public:
  QuantizedLinear(mx::Stream s, int group_size, int bits)
      : QuantizedWeightPrimitive(s, "quantized_linear", group_size, bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& y = outputs[0];
    for (size_t i = 1; i < inputs.size(); ++i) {
      if (!inputs[i].flags().row_contiguous) {
        throw std::invalid_argument("[quantized_linear] w, scales, biases must be row-contiguous");
      }
    }
    const auto& xin = inputs[0];
    const auto& wq = inputs[1];
    if (xin.ndim() < 1 || wq.ndim() != 2 ||
        int64_t{xin.shape(-1)} != packed_columns(wq.shape(1), bits_) ||
        xin.shape(-1) % group_size_ != 0 ||
        inputs[2].size() != static_cast<size_t>(wq.shape(0)) * (xin.shape(-1) / group_size_) ||
        inputs[3].size() != inputs[2].size()) {
      throw std::invalid_argument(
          "[quantized_linear] x [..., K], w [N, K * bits / 32], scales and biases "
          "[N, K / group_size] do not fit");  // re-checked: shapeless compilation
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array x = row_contiguous(inputs[0], enc);
    y.set_data(mx::allocator::malloc(y.nbytes()));
    for (const auto& a : inputs) {
      enc.set_input_array(a);
    }
    enc.set_output_array(y);
    // The AMX kernels' scratch: an MLX temporary, returned to MLX's buffer cache when the
    // command completes (mx.clear_cache frees it), rather than memory kept per thread.
    const auto depth = static_cast<size_t>(x.shape(-1)), rows = x.size() / depth;
    const auto gs = static_cast<size_t>(group_size_);
    char* scratch = nullptr;
    const int mode = gemv_mode().load(std::memory_order_relaxed);
    const bool int8 = use_int8(rows, depth, gs, bits_);
    const bool amx_int8 = use_amx_int8(rows, depth, gs, bits_);
    const auto out_features = static_cast<size_t>(wq.shape(0));
    const bool q8_panel = amx_int8 && rows > 16;
    const bool avx2_gemv = use_q8_avx2_gemv(rows, depth, gs, bits_);
    const bool q8_avx2 = use_q8_avx2_gemm(rows, depth, gs, bits_);
    const bool q8_gemm = q8_avx2 || use_q8_gemm(rows, depth, gs, bits_);
    if (avx2_gemv || q8_panel || q8_gemm || (!int8 && !amx_int8 && use_amx(rows, depth, gs))) {
      const size_t bytes =
          avx2_gemv || q8_avx2 ? vun::q8_avx2_x_layout(rows, depth, gs).bytes + 64
          : q8_gemm  ? vun::q8_gemm_x_layout(rows, depth, gs, mode == 4).bytes + 64
          : q8_panel ? amx_q8_scratch(rows, out_features, depth, gs)
                     : amx_scratch(rows, out_features, depth, gs).bytes();
      constexpr size_t kPage = 4096;  // a 2-D shape: int extents for any size
      mx::array buf({static_cast<int>((bytes + kPage - 1) / kPage), static_cast<int>(kPage)},
                    mx::uint8, nullptr, {});
      buf.set_data(mx::allocator::malloc(buf.nbytes()));
      enc.add_temporary(buf);
      scratch = buf.data<char>();
    }
    enc.dispatch([xp = x.data<float>(), wp = inputs[1].data<uint32_t>(), scratch,
                  sp = static_cast<const void*>(inputs[2].data<char>()),
                  bp = static_cast<const void*>(inputs[3].data<char>()),
                  st = scale_type(inputs[2]), yp = y.data<float>(), M = rows,
                  N = static_cast<size_t>(inputs[1].shape(0)), K = depth, gs, bits = bits_,
                  mode, int8, amx_int8, q8_gemm, q8_avx2, avx2_gemv]() {
      auto& pool = kernel_pool();
      if (avx2_gemv) {
        q8_avx2_gemv_linear(xp, wp, sp, bp, st, yp, M, N, K, gs, bits, mode == 4, scratch);
        return;
      }
      if (q8_gemm) {
        q8_gemm_linear(xp, wp, sp, bp, st, yp, M, N, K, gs, bits, mode == 4, q8_avx2, scratch);
        return;
      }
      if (amx_int8 && M > 16) {
        amx_q8_linear(xp, wp, sp, bp, st, yp, M, N, K, gs, bits, mode == 4, scratch);
        return;
      }
      if (amx_int8) {
        thread_local std::vector<char> xbuf;  // read by the pool's workers during the call
        xbuf.resize(vun::amx_q8_x_bytes(K, gs) + 64);
        auto* xq = reinterpret_cast<uint8_t*>(align64(xbuf.data()));
        vun::amx_q8_prepare_x(xp, M, K, gs, mode == 4, xq);
        const size_t nblocks = (N + 15) / 16;
        const size_t chunks = std::min(nblocks, 4 * pool.size());
        pool.run(chunks, [&](size_t c) {
          vun::amx_q8_linear_blocks(xq, wp, sp, bp, st, yp, M, N, K, gs, bits, mode == 4,
                                    nblocks * c / chunks, nblocks * (c + 1) / chunks);
        });
        return;
      }
      if (scratch != nullptr) {
        amx_quantized_linear(xp, wp, sp, bp, st, yp, M, N, K, gs, bits, scratch);
        return;
      }
      vun::Q8Activations q8{};
      if (int8) {
        q8 = q8_activations(xp, M, K, gs, mode == 4);
      }
      const size_t groups = (N + 3) / 4;
      const size_t chunks = std::min(groups, 8 * pool.size());
      pool.run(chunks, [&](size_t c) {
        const size_t n0 = std::min(N, groups * c / chunks * 4);
        const size_t n1 = std::min(N, groups * (c + 1) / chunks * 4);
        // gemv: the weight dequantized in registers (AVX-512) or multiplied
        // against int8 x (mode 3); the rows it leaves (other CPUs, a last block of fewer than
        // 4) take the scratch path below.
        size_t n = quantized_gemv(xp, int8 ? &q8 : nullptr, wp, sp, bp, st, yp, M, N, K, gs,
                                  bits, n0, n1, mode >= 3 ? 1 : mode);
        float* rows = scratch_rows(4 * K);
        for (; n < n1; n += 4) {
          const size_t count = std::min<size_t>(4, n1 - n);
          dequantize_rows(wp, sp, bp, st, rows, n, n + count, K, gs, bits);
          vun::linear_cols_f32(xp, rows, yp, M, N, K, n, count);
        }
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {linear_out_shape(inputs[0].shape(), inputs[1].shape(0))};
  }

  const char* name() const override {
    return "QuantizedLinear";
  }
};

mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "quantized_linear");
  check_quantized("quantized_linear", w, scales, biases, group_size, bits);
  if (x.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, "quantized_linear: x must be float32");
  }
  if (x.ndim() < 1 || int64_t{x.shape(-1)} != packed_columns(w.shape(1), bits)) {
    raise_py(PyExc_ValueError,
             "quantized_linear: x must be [..., K] with K = w.shape[1] * 32 / bits = " +
                 std::to_string(packed_columns(w.shape(1), bits)) + ", got " +
                 shape_str(x.shape()));
  }
  return mx::array(
      linear_out_shape(x.shape(), w.shape(0)), mx::float32,
      std::make_shared<QuantizedLinear>(s, group_size, bits),
      {x, w, scales, biases});
}

// dequantize(w) as a dense fp32 [N, K] array, rows split over the kernel pool: for inputs too
// large for QuantizedLinear (prefill), whose matmul then runs in BLAS.
class Dequantize : public QuantizedWeightPrimitive {
 public:
  Dequantize(mx::Stream s, int group_size, int bits)
      : QuantizedWeightPrimitive(s, "dequantize", group_size, bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    for (const auto& a : inputs) {
      if (!a.flags().row_contiguous) {
        throw std::invalid_argument("[dequantize] inputs must be row-contiguous");
      }
    }
    const int64_t K = packed_columns(inputs[0].shape(1), bits_);
    if (inputs[0].ndim() != 2 || K % group_size_ != 0 ||
        inputs[1].size() != static_cast<size_t>(inputs[0].shape(0) * (K / group_size_)) ||
        inputs[2].size() != inputs[1].size()) {
      throw std::invalid_argument(  // re-checked: shapeless compilation
          "[dequantize] scales and biases must be [N, K / group_size] for w [N, K * bits / 32]");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      enc.set_input_array(a);
    }
    enc.set_output_array(out);
    enc.dispatch([wp = inputs[0].data<uint32_t>(),
                  sp = static_cast<const void*>(inputs[1].data<char>()),
                  bp = static_cast<const void*>(inputs[2].data<char>()),
                  st = scale_type(inputs[1]), op = out.data<float>(),
                  N = static_cast<size_t>(out.shape(0)), K = static_cast<size_t>(out.shape(1)),
                  gs = static_cast<size_t>(group_size_), bits = bits_]() {
      auto& pool = kernel_pool();
      const size_t chunks = std::min(N, 8 * pool.size());
      pool.run(chunks, [&](size_t c) {
        const size_t r0 = N * c / chunks;
        const size_t r1 = N * (c + 1) / chunks;
        dequantize_rows(wp, sp, bp, st, op + r0 * K, r0, r1, K, gs, bits);
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), static_cast<int>(packed_columns(inputs[0].shape(1), bits_))}};
  }

  const char* name() const override {
    return "Dequantize";
  }
};

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits, nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "dequantize");
  check_quantized("dequantize", w, scales, biases, group_size, bits);
  return mx::array(
      {w.shape(0), static_cast<int>(packed_columns(w.shape(1), bits))}, mx::float32,
      std::make_shared<Dequantize>(s, group_size, bits), {w, scales, biases});
}

// ---------------------------------------------------------------------------------------------
// gather_quantized_linear: mixture-of-experts layers (mx.gather_qmm with rhs_indices, transpose)

// The quantization formats of gather_quantized_linear's experts.
enum class ExpertFormat { kAffine, kMxfp4 };

// The pairs (x entry, expert) of one gather_quantized_linear call grouped by expert, on the
// stream thread: the experts that occur (ascending), each with its pairs in call order.
struct ExpertGroups {
  std::vector<uint32_t> experts;  // experts[a]: the a-th active expert
  std::vector<size_t> start;      // its pairs: order[start[a] .. start[a + 1])
  std::vector<uint32_t> order;    // pair ids, stably sorted by expert (invalid ones left out)
  std::vector<uint32_t> invalid;  // pairs whose index is not an expert (outside [0, E))
  bool identity = true;           // order[i] == i for every pair: no gather, no scatter
};

// Groups P indices (int32 or uint32, read as uint32: a negative int32 is out of range) of E
// experts by a counting sort.
void group_by_expert(const uint32_t* idx, size_t P, size_t E, ExpertGroups& g) {
  std::vector<size_t> count(E + 1, 0);
  g.invalid.clear();
  for (size_t p = 0; p < P; ++p) {
    if (idx[p] < E) {
      ++count[idx[p]];
    } else {
      g.invalid.push_back(static_cast<uint32_t>(p));
    }
  }
  g.experts.clear();
  g.start.assign(1, 0);
  std::vector<size_t> next(E, 0);
  for (size_t e = 0; e < E; ++e) {
    if (count[e] != 0) {
      next[e] = g.start.back();
      g.experts.push_back(static_cast<uint32_t>(e));
      g.start.push_back(g.start.back() + count[e]);
    }
  }
  g.order.resize(g.start.back());
  g.identity = g.invalid.empty();
  for (size_t p = 0; p < P; ++p) {
    if (idx[p] < E) {
      const size_t at = next[idx[p]]++;
      g.order[at] = static_cast<uint32_t>(p);
      g.identity = g.identity && at == p;
    }
  }
}

// One piece of work: weight rows [n0, n1) of active expert a, for all of that expert's rows.
struct ExpertItem {
  uint32_t a;
  uint32_t n0, n1;
};

// Pieces of about equal cost over the active experts (cost of a 4-row weight block: its
// dequantization plus one dot product per row of x), about 8 per thread so that a thread the
// OS holds back costs at most one piece; an expert's rows are never split below 4-row blocks.
std::vector<ExpertItem> expert_items(const ExpertGroups& g, size_t M, size_t N, size_t threads) {
  const size_t blocks = (N + 3) / 4;
  size_t total = 0;
  for (size_t a = 0; a < g.experts.size(); ++a) {
    total += blocks * ((g.start[a + 1] - g.start[a]) * M + 4);
  }
  const size_t target = std::max<size_t>(1, total / (8 * threads));
  std::vector<ExpertItem> items;
  for (size_t a = 0; a < g.experts.size(); ++a) {
    const size_t cost = blocks * ((g.start[a + 1] - g.start[a]) * M + 4);
    const size_t pieces = std::clamp<size_t>((cost + target - 1) / target, 1, blocks);
    for (size_t i = 0; i < pieces; ++i) {
      items.push_back({static_cast<uint32_t>(a),
                       static_cast<uint32_t>(std::min(N, blocks * i / pieces * 4)),
                       static_cast<uint32_t>(std::min(N, blocks * (i + 1) / pieces * 4))});
    }
  }
  return items;
}

// y[p] = x[p / r] @ dequantize(w[idx[p]]).T for fp32 x [..., M, K] (Px = x.size / (M * K)
// entries, each serving r = P / Px consecutive pairs), P = idx.size expert indices, w the
// experts' packed weights [E, N, K * bits / 32] (affine: scales, biases [E, N, K / group_size];
// mxfp4: uint8 e8m0 scales [E, N, K / 32], no biases); y: idx.shape + [M, N].
// The pairs are grouped by expert: each active expert's weight rows are dequantized (or decoded
// in registers) once per call and multiplied by all of its rows of x, exactly as
// QuantizedLinear multiplies that expert's weight by those rows (the same kernels and rules:
// per expert, 1-3 rows by the gemv, 1-4 rows against int8 x where use_int8 says so, from 4
// rows the VNNI GEMM where use_q8_gemm says so, the AVX2 GEMM where use_q8_avx2_gemm says
// so (every size), the rest by the scratch rows and
// linear_cols_f32; no AMX; mxfp4: the gemv's table mode or the scratch rows, always exact).
// Experts no index names are not read.
class GatherQuantizedLinear : public QuantizedWeightPrimitive {
 public:
  GatherQuantizedLinear(mx::Stream s, int group_size, int bits, ExpertFormat format)
      : QuantizedWeightPrimitive(s, "gather_quantized_linear", group_size, bits),
        format_(format) {}

  bool is_equivalent(const mx::Primitive& other) const override {
    return QuantizedWeightPrimitive::is_equivalent(other) &&
           static_cast<const GatherQuantizedLinear&>(other).format_ == format_;
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& y = outputs[0];
    const bool affine = format_ == ExpertFormat::kAffine;
    const auto& wq = inputs[1];
    for (size_t i = 1; i + 1 < inputs.size(); ++i) {
      if (!inputs[i].flags().row_contiguous) {
        throw std::invalid_argument(
            "[gather_quantized_linear] w, scales, biases must be row-contiguous");
      }
    }
    const auto& xin = inputs[0];
    if (xin.ndim() < 2 || wq.ndim() != 3 ||
        int64_t{xin.shape(-1)} != packed_columns(wq.shape(2), bits_)) {
      throw std::invalid_argument(  // re-checked: shapeless compilation
          "[gather_quantized_linear] x [..., M, K] and w [E, N, K * bits / 32] do not fit");
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array x = row_contiguous(xin, enc);
    // the router's top-k is usually a slice of its argpartition (strided)
    const mx::array idx = row_contiguous(inputs.back(), enc);
    y.set_data(mx::allocator::malloc(y.nbytes()));
    for (const auto& a : inputs) {
      enc.set_input_array(a);
    }
    enc.set_output_array(y);
    const size_t M = static_cast<size_t>(xin.shape(-2)), K = static_cast<size_t>(xin.shape(-1));
    const size_t P = idx.size(), Px = M * K == 0 ? 0 : x.size() / (M * K);
    if (P == 0 || M * K == 0 || y.size() == 0) {
      return;
    }
    if (Px == 0 || P % Px != 0) {
      throw std::invalid_argument("[gather_quantized_linear] x's entries must divide the indices");
    }
    enc.dispatch([xp = x.data<float>(), wp = wq.data<uint32_t>(),
                  sp = static_cast<const char*>(inputs[2].data<char>()),
                  bp = affine ? static_cast<const char*>(inputs[3].data<char>()) : nullptr,
                  ip = idx.data<uint32_t>(), yp = y.data<float>(),
                  st = affine ? scale_type(inputs[2]) : vun::ScaleType::kF32,
                  scale_bytes = inputs[2].itemsize(), E = static_cast<size_t>(wq.shape(0)),
                  N = static_cast<size_t>(wq.shape(1)), M, K, P, r = P / Px,
                  gs = static_cast<size_t>(group_size_), bits = bits_, affine]() {
      // a reference, so that the pool's workers read this thread's groups, not their own
      thread_local ExpertGroups grouped;
      ExpertGroups& g = grouped;
      group_by_expert(ip, P, E, g);
      for (const uint32_t p : g.invalid) {
        std::fill_n(yp + p * M * N, M * N, std::numeric_limits<float>::quiet_NaN());
      }
      // x's rows in expert order and y's rows as computed, unless the pairs are in that order
      // already with one x entry each (mlx-lm's sorted call shape: nothing to move).
      const bool direct = g.identity && r == 1;
      std::vector<float> xs, ys;
      const float* xg = xp;
      float* yg = yp;
      if (!direct) {
        xs.resize(g.order.size() * M * K);
        ys.resize(g.order.size() * M * N);
        for (size_t i = 0; i < g.order.size(); ++i) {
          std::memcpy(xs.data() + i * M * K, xp + g.order[i] / r * M * K, M * K * sizeof(float));
        }
        xg = xs.data();
        yg = ys.data();
      }
      const int mode = gemv_mode().load(std::memory_order_relaxed);
      const size_t spans = (K + 63) / 64;
      const size_t groups = K / gs, words = K * static_cast<size_t>(bits) / 32;
      // experts with rows for an integer GEMM (the AVX-512 one from 4 rows, the AVX2 one at
      // every size, as quantized_linear takes them): one GEMM each, the pool inside it
      std::vector<char> gemm_done(g.experts.size(), 0);
      std::vector<char> gemm_scratch;
      for (size_t a = 0; affine && a < g.experts.size(); ++a) {
        const size_t row0 = g.start[a] * M, rows = g.start[a + 1] * M - row0;
        const bool gemv = use_q8_avx2_gemv(rows, K, gs, bits);
        const bool avx2 = use_q8_avx2_gemm(rows, K, gs, bits);
        if (!gemv && !avx2 && !use_q8_gemm(rows, K, gs, bits)) {
          continue;
        }
        gemm_scratch.resize(
            (gemv || avx2 ? vun::q8_avx2_x_layout(rows, K, gs)
                          : vun::q8_gemm_x_layout(rows, K, gs, mode == 4)).bytes + 64);
        const size_t e = g.experts[a];
        const uint32_t* we = wp + e * N * words;
        const char* se = sp + e * N * groups * scale_bytes;
        const char* be = bp + e * N * groups * scale_bytes;
        if (gemv) {
          q8_avx2_gemv_linear(xg + row0 * K, we, se, be, st, yg + row0 * N, rows, N, K, gs, bits,
                              mode == 4, gemm_scratch.data());
        } else {
          q8_gemm_linear(xg + row0 * K, we, se, be, st, yg + row0 * N, rows, N, K, gs, bits,
                         mode == 4, avx2, gemm_scratch.data());
        }
        gemm_done[a] = 1;
      }
      // int8 x where some expert takes it (use_int8 per expert's rows), quantized once
      vun::Q8Activations q8{};
      bool any_int8 = false;
      for (size_t a = 0; affine && a < g.experts.size(); ++a) {
        any_int8 = any_int8 || use_int8((g.start[a + 1] - g.start[a]) * M, K, gs, bits);
      }
      if (any_int8) {
        q8 = q8_activations(xg, g.order.size() * M, K, gs, mode == 4);
      }
      const auto q8_rows = [&](size_t row0) {  // q8's rows from row0 on
        return vun::Q8Activations{
            q8.xq + row0 * spans * 64,
            q8.xq_lo != nullptr ? q8.xq_lo + row0 * spans * 64 : nullptr,
            q8.dx + row0 * spans * 16, q8.sx + row0 * groups};
      };
      auto& pool = kernel_pool();
      const std::vector<ExpertItem> items = expert_items(g, M, N, pool.size());
      pool.run(items.size(), [&](size_t c) {
        const ExpertItem& it = items[c];
        if (gemm_done[it.a]) {
          return;
        }
        const size_t e = g.experts[it.a], row0 = g.start[it.a] * M;
        const size_t rows = g.start[it.a + 1] * M - row0;
        const float* xe = xg + row0 * K;
        float* ye = yg + row0 * N;
        const uint32_t* we = wp + e * N * words;
        const char* se = sp + e * N * groups * scale_bytes;
        const char* be = affine ? bp + e * N * groups * scale_bytes : nullptr;
        size_t n = it.n0;
        if (affine) {
          const bool int8 = use_int8(rows, K, gs, bits);
          const vun::Q8Activations part = int8 ? q8_rows(row0) : vun::Q8Activations{};
          n = quantized_gemv(xe, int8 ? &part : nullptr, we, se, be, st, ye, rows, N, K, gs,
                             bits, it.n0, it.n1, mode >= 3 ? 1 : mode);
        } else if (mode > 0) {  // mode 0: the scratch path, as for affine weights
          n = vun::quantized_gemv_mxfp4(xe, we, reinterpret_cast<const uint8_t*>(se), ye, rows,
                                        N, K, it.n0, it.n1);
        }
        float* w4 = scratch_rows(4 * K);
        for (; n < it.n1; n += 4) {
          const size_t count = std::min<size_t>(4, it.n1 - n);
          if (affine) {
            dequantize_rows(we, se, be, st, w4, n, n + count, K, gs, bits);
          } else {
            vun::dequantize_rows_mxfp4(we, reinterpret_cast<const uint8_t*>(se), w4, n,
                                       n + count, K);
          }
          vun::linear_cols_f32(xe, w4, ye, rows, N, K, n, count);
        }
      });
      if (!direct) {
        for (size_t i = 0; i < g.order.size(); ++i) {
          std::memcpy(yp + g.order[i] * M * N, ys.data() + i * M * N, M * N * sizeof(float));
        }
      }
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape out = inputs.back().shape();
    out.push_back(inputs[0].shape(-2));
    out.push_back(inputs[1].shape(1));
    return {out};
  }

  const char* name() const override {
    return "GatherQuantizedLinear";
  }

 private:
  ExpertFormat format_;
};

mx::array gather_quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales,
                                  const std::optional<mx::array>& biases, const mx::array& indices,
                                  int group_size, int bits, const std::string& mode,
                                  nb::handle stream) {
  const mx::Stream s = resolve_stream(stream, "gather_quantized_linear");
  const std::string fn = "gather_quantized_linear";
  ExpertFormat format;
  if (mode == "affine") {
    format = ExpertFormat::kAffine;
    if (!biases) {
      raise_py(PyExc_ValueError, fn + ": affine mode needs biases");
    }
  } else if (mode == "mxfp4") {
    format = ExpertFormat::kMxfp4;
    if (biases || group_size != 32 || bits != 4 || scales.dtype() != mx::uint8) {
      raise_py(PyExc_ValueError,
               fn + ": mxfp4 takes group_size 32, bits 4, uint8 scales and no biases");
    }
  } else {
    raise_py(PyExc_ValueError, fn + ": mode must be 'affine' or 'mxfp4', got '" + mode + "'");
  }
  if (w.ndim() != 3 || scales.ndim() != 3 || (biases && biases->ndim() != 3)) {
    raise_py(PyExc_ValueError, fn + ": w, scales and biases must be [E, N, ...], got w " +
                                   shape_str(w.shape()) + ", scales " + shape_str(scales.shape()));
  }
  // The per-expert checks of the dense kernels, on expert 0's shapes (the same for every expert).
  const auto expert = [](const mx::array& a) {
    return mx::array(mx::Shape{a.shape(1), a.shape(2)}, a.dtype(), nullptr, {});
  };
  if (format == ExpertFormat::kAffine) {
    check_quantized("gather_quantized_linear", expert(w), expert(scales), expert(*biases),
                    group_size, bits);
  } else if (w.dtype() != mx::uint32 || w.shape(2) % 4 != 0 ||
             scales.shape() != mx::Shape{w.shape(0), w.shape(1), w.shape(2) / 4}) {
    raise_py(PyExc_ValueError, fn + ": mxfp4 w must be uint32 [E, N, K / 8] with scales "
                                    "[E, N, K / 32], got " + shape_str(w.shape()) + " and " +
                                    shape_str(scales.shape()));
  }
  if (scales.shape(0) != w.shape(0) || (biases && biases->shape() != scales.shape())) {
    raise_py(PyExc_ValueError, fn + ": scales and biases must have w's experts");
  }
  for (const mx::array* a : {&w, &scales}) {
    if (a->is_available() && !a->flags().row_contiguous) {
      raise_py(PyExc_ValueError, fn + ": w, scales and biases must be row-contiguous");
    }
  }
  if (x.dtype() != mx::float32) {
    raise_py(PyExc_TypeError, fn + ": x must be float32");
  }
  const int64_t K = packed_columns(w.shape(2), bits);
  if (x.ndim() < 2 || x.shape(-1) != K) {
    raise_py(PyExc_ValueError, fn + ": x must be [..., M, K] with K = " + std::to_string(K) +
                                   ", got " + shape_str(x.shape()));
  }
  if (indices.dtype() != mx::uint32 && indices.dtype() != mx::int32) {
    raise_py(PyExc_TypeError, fn + ": indices must be uint32 or int32");
  }
  const size_t row = static_cast<size_t>(x.shape(-2)) * static_cast<size_t>(x.shape(-1));
  const size_t entries = row == 0 ? 0 : x.size() / row;
  if (row != 0 && indices.size() != 0 && (entries == 0 || indices.size() % entries != 0)) {
    raise_py(PyExc_ValueError, fn + ": x's " + std::to_string(entries) +
                                   " entries [M, K] must divide the " +
                                   std::to_string(indices.size()) + " indices");
  }
  mx::Shape out = indices.shape();
  out.push_back(x.shape(-2));
  out.push_back(w.shape(1));
  std::vector<mx::array> inputs{x, w, scales};
  if (biases) {
    inputs.push_back(*biases);
  }
  inputs.push_back(indices);
  return mx::array(out, mx::float32,
                   std::make_shared<GatherQuantizedLinear>(s, group_size, bits, format),
                   std::move(inputs));
}

// ---------------------------------------------------------------------------------------------
// to_torch

nb::dlpack::dtype dlpack_dtype(mx::Dtype t) {
  using code = nb::dlpack::dtype_code;
  const auto bits = static_cast<uint8_t>(8 * t.size());
  switch (t.val()) {
    case mx::Dtype::Val::bool_:
      return {static_cast<uint8_t>(code::Bool), 8, 1};
    case mx::Dtype::Val::uint8:
    case mx::Dtype::Val::uint16:
    case mx::Dtype::Val::uint32:
    case mx::Dtype::Val::uint64:
      return {static_cast<uint8_t>(code::UInt), bits, 1};
    case mx::Dtype::Val::int8:
    case mx::Dtype::Val::int16:
    case mx::Dtype::Val::int32:
    case mx::Dtype::Val::int64:
      return {static_cast<uint8_t>(code::Int), bits, 1};
    case mx::Dtype::Val::float16:
    case mx::Dtype::Val::float32:
    case mx::Dtype::Val::float64:
      return {static_cast<uint8_t>(code::Float), bits, 1};
    case mx::Dtype::Val::bfloat16:
      return {static_cast<uint8_t>(code::Bfloat), 16, 1};
    default:
      raise_py(PyExc_TypeError, "to_torch: unsupported MLX dtype");
  }
}

// A torch tensor over the array's bytes, whatever its offset. MLX's own __dlpack__ passes the
// array's offset as DLPack's unsigned byte_offset; for an adopted array that offset can be
// negative, and torch 2.13 then builds a tensor whose data pointer is right but whose storage
// offset is ~2**62 (any indexing fails: "Storage size calculation overflowed"). Here the data
// pointer is exact and byte_offset is 0. The tensor keeps a copy of the array (and so its
// buffer) alive.
nb::ndarray<nb::pytorch> to_torch(mx::array& a) {
  if (a.status() != mx::array::Status::available) {
    nb::gil_scoped_release nogil;
    mx::eval({a});
    a.wait();
  }
  const auto dt = dlpack_dtype(a.dtype());
  std::vector<size_t> shape(a.shape().begin(), a.shape().end());
  std::vector<int64_t> strides(a.strides().begin(), a.strides().end());
  auto* keep = new mx::array(a);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<mx::array*>(p); });
  return nb::ndarray<nb::pytorch>(
      keep->data<void>(), shape.size(), shape.data(), owner, strides.data(), dt,
      nb::device::cpu::value);
}

// ---------------------------------------------------------------------------------------------
// info

nb::dict info(mx::array& a) {
  if (a.status() != mx::array::Status::available) {
    nb::gil_scoped_release nogil;  // the eval may run deleters that need the GIL
    mx::eval({a});
    a.wait();
  }
  nb::dict d;
  const auto& data = a.data_shared_ptr();
  d["data_ptr"] = reinterpret_cast<uintptr_t>(a.data<char>());
  d["buffer_ptr"] = reinterpret_cast<uintptr_t>(a.buffer().ptr());
  d["offset"] = a.offset();
  d["nbytes"] = a.nbytes();
  d["owned"] = data->is_owned();
  d["donatable"] = a.is_donatable();
  d["data_use_count"] = data.use_count();
  d["row_contiguous"] = static_cast<bool>(a.flags().row_contiguous);
  return d;
}

} // namespace

NB_MODULE(_native, m) {
  m.doc() = "Zero-copy torch <-> MLX helpers for MLX's CPU backend (see vllm_unified.bridge).";
  m.def("adopt", &adopt, nb::arg("ptr"), nb::arg("nbytes"), nb::arg("shape"), nb::arg("dtype"),
        nb::arg("owner"),
        "Wrap foreign memory as an MLX array without copying; `owner` is kept alive until MLX "
        "drops its last reference.");
  m.def("write_rows", &write_rows, nb::arg("dst"), nb::arg("row_idx"), nb::arg("src"),
        nb::kw_only(), nb::arg("stream") = nb::none(),
        "Lazy in-place row write: dst[row_idx[i]] = src[i]; the result shares dst's buffer.");
  m.def("gather_kv", &gather_kv, nb::arg("pool"), nb::arg("rows"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy row gather from a K|V pool [rows, 2D]: (pool[rows, :D], pool[rows, D:]), each "
        "row-contiguous with shape rows.shape + (D,).");
  m.def("silu_mul", &silu_mul, nb::arg("gate"), nb::arg("up"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy fp32 silu(gate) * up (mlx-lm's SwiGLU), vectorized; CPU streams only.");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, nb::arg("gate"), nb::arg("up"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy fp32 gelu_approx(gate) * up (Gemma's GeGLU), vectorized; CPU streams only.");
  m.def("gelu", &gelu, nb::arg("x"), nb::kw_only(), nb::arg("approximate") = false,
        nb::arg("stream") = nb::none(),
        "Lazy fp32 GELU: exact (erf; MLX's nn.gelu) or with approximate=True the tanh form "
        "(nn.gelu_approx), vectorized; CPU streams only.");
  m.def("softmax", &softmax, nb::arg("x"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "Lazy fp32 softmax over the last axis (mx.softmax), vectorized; CPU streams only.");
  m.def("softcap", &softcap, nb::arg("x"), nb::arg("cap"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy fp32 cap * tanh(x / cap) (logit soft-capping), vectorized; CPU streams only.");
  m.def("paged_attention", &paged_attention, nb::arg("q"), nb::arg("kv_pool"),
        nb::arg("tables"), nb::arg("seqs"), nb::arg("lens"), nb::arg("scale"),
        nb::arg("block_size"), nb::arg("window") = 0, nb::kw_only(),
        nb::arg("kv_mode") = 0, nb::arg("rht_signs").none() = nb::none(),
        nb::arg("fresh_k").none() = nb::none(), nb::arg("fresh_v").none() = nb::none(),
        nb::arg("raw_from").none() = nb::none(), nb::arg("raw_row0").none() = nb::none(),
        nb::arg("chunk") = 0, nb::arg("softcap") = 0.f, nb::arg("sinks").none() = nb::none(),
        nb::arg("latent") = false, nb::arg("stream") = nb::none(),
        "Lazy attention read from a paged K|V pool [slots, Hkv, 2D] through block tables, one "
        "query token per row (row r: sequence seqs[r], keys [0, lens[r])); q [N, H, D] -> "
        "[N, H, D]; softcap > 0 caps the scaled scores (softcap * tanh(s / softcap)), sinks "
        "[H] join the softmax's denominator; latent: the pool is an MLA pool [slots, 1, D] "
        "whose rows are both keys and values; CPU streams only.");
  m.def("write_kv_quant", &write_kv_quant, nb::arg("dst"), nb::arg("slot_mapping"),
        nb::arg("keys"), nb::arg("values"), nb::arg("kv_mode"),
        nb::arg("rht_signs").none() = nb::none(), nb::kw_only(), nb::arg("stream") = nb::none(),
        "Lazy in-place quantizing K/V write into a quantized pool [slots, Hkv, cell bytes] "
        "(kv_mode 1: int8_per_token_head, 2: int4_per_token_head, 3: fp8_per_token_head, "
        "4: turboquant_k8v4, vLLM's formats); the result "
        "shares dst's buffer.");
  m.def("linear", &linear, nb::arg("x"), nb::arg("w"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy fp32 x @ w.T for x [..., K] (its leading axes the rows), w [N, K], without packing "
        "w (for few rows); CPU streams only.");
  m.def("lora_update", &lora_update, nb::arg("y"), nb::arg("x"), nb::arg("a"), nb::arg("b"),
        nb::arg("slot"), nb::arg("rank"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "Lazy y + each row's LoRA update: row t under slot s = slot[t] >= 0 adds "
        "(x[t] @ a[s*R:s*R+rank[s]].T) @ b[s*R:s*R+rank[s]]; y [..., N], x [..., K] (T rows), "
        "a [S*R, K], "
        "b [S*R, N] float32, slot [T], rank [S] int32; rows with slot < 0 keep y's values. "
        "CPU streams only.");
  m.def("write_kv", &write_kv, nb::arg("dst"), nb::arg("slot_mapping"), nb::arg("keys"),
        nb::arg("values"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "Lazy in-place write of keys[t] and values[t] ([T, Hkv, D] or [T, Hkv, 1, D], dst's "
        "dtype) side by side into slot slot_mapping[t] of a dense K|V pool [slots, Hkv, 2 * D]; "
        "returns the pool (its buffer); indices outside [0, slots) raise. CPU streams only.");
  m.def("quantized_linear", &quantized_linear, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy fp32 x @ dequantize(w).T for x [..., K] and an MLX affine-quantized w (bits 2-6 or 8, "
        "scales/biases float32, float16 or bfloat16), bit-identical to linear(x, "
        "mx.dequantize(w, ...)) with the scales/biases as float32; CPU streams only.");
  m.def("gather_quantized_linear", &gather_quantized_linear, nb::arg("x"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases").none(), nb::arg("indices"), nb::arg("group_size"),
        nb::arg("bits"), nb::arg("mode") = "affine", nb::kw_only(), nb::arg("stream") = nb::none(),
        "Lazy fp32 mixture-of-experts linear: y[p] = x[p // r] @ dequantize(w[indices[p]]).T for "
        "x [..., M, K] (its Px entries [M, K] each serving r = indices.size / Px consecutive "
        "indices), w [E, N, K * bits / 32] (mode 'affine': bits 2-6 or 8, scales/biases "
        "float32, float16 or bfloat16 [E, N, K / group_size]; 'mxfp4': bits 4, group_size 32, "
        "uint8 scales, biases None), int32/uint32 indices of any shape -> indices.shape + "
        "(M, N); mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) for "
        "those shapes. Pairs grouped by expert: each active expert's weight read once per "
        "call, as quantized_linear would on its rows; an index outside [0, E) gives NaN rows. "
        "CPU streams only.");
  m.def("quantized_gemv_mode", &set_gemv_mode, nb::arg("mode"),
        "quantized_linear's kernel for decode-sized x: 0 the scratch path, 1 by table lookup "
        "(the extension's default), 2 in registers without the table (0-2 bit-identical, 1-3 "
        "rows); where int8_runs says so, against x quantized per 32 elements by int8 dot "
        "products (not exact): 3 in one int8 term, 4 in two (~16 bits). vllm_unified_native "
        "sets 4, 3 or 1 from VLLM_UNIFIED_CPU_ACTIVATIONS. Returns the previous mode.");
  m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "Lazy fp32 mx.dequantize of an MLX affine-quantized w (bits 2-6 or 8, scales/biases "
        "float32, float16 or bfloat16), bit-identical to it with the scales/biases as float32, "
        "threaded; CPU streams only.");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy fp32 RMSNorm over the last axis (mx.fast.rms_norm's function) as one primitive; "
        "CPU streams only.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("inv_freq"), nb::arg("scale"), nb::arg("offsets"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "Lazy fp32 rotary embedding of x [B, H, L, D] (mx.fast.rope's function) with per-batch "
        "int32 offsets [B] and inverse frequencies [dims / 2], as one primitive; CPU streams "
        "only.");
  m.def("to_torch", &to_torch, nb::arg("a"),
        "A torch CPU tensor over the array's bytes (exact data pointer, any offset).");
  m.def("configure", &vun::configure, nb::arg("cpu_isa").none(), nb::arg("cpu_threads").none(),
        "Set the kernels' caps: the highest instruction set (amx, avx512, avx2, portable; None: "
        "the CPU's best) and the most threads (None: the CPUs allowed). Each is fixed once a "
        "kernel has decided with it: changing it then raises RuntimeError. vllm_unified_native "
        "calls it at import with vllm_unified.envs' values.");
  m.def("amx_usable", &vun::amx_usable,
        "Whether quantized_linear runs on Intel AMX tiles (CPU, OS and the ISA cap allow it; "
        "decided once per process).");
  m.def("attention_tile_runs", [](int64_t dim) {
          return dim > 0 && vun::attend_tile_usable(static_cast<size_t>(dim));
        }, nb::arg("dim"),
        "Whether paged_attention computes the rows of prefill chunks (2+ consecutive rows of "
        "one sequence) of a dense pool with this head size by its blocked kernel (head sizes "
        "64, 128, 256 on AVX-512 or AVX2 within the ISA cap); else by the row kernel.");
  m.def("attention_tile_isa", [] { return std::string(vun::attend_tile_isa()); },
        "The instruction set of paged_attention's blocked kernel here: 'avx512', 'avx2' or '' "
        "(none: every row by the row kernel); decided once per process.");
  m.def("amx_runs", &use_amx, nb::arg("rows"), nb::arg("in_features"), nb::arg("group_size"),
        "Whether quantized_linear takes the AMX path for x [rows, in_features] with this "
        "group size (amx_usable, at least AMX_MIN_ROWS rows, whole 32-element tile rows).");
  m.def("int8_runs", &use_int8, nb::arg("rows"), nb::arg("in_features"), nb::arg("group_size"),
        nb::arg("bits"),
        "Whether quantized_linear computes x [rows, in_features] against x quantized per 32 "
        "elements (quantized_gemv_mode 3 or 4, AVX-512 VNNI and VBMI, a width and group size "
        "the kernel takes, 1-4 rows, 1-3 where q8_gemm_runs takes 4).");
  m.def("amx_int8_runs", &use_amx_int8, nb::arg("rows"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("bits"),
        "Whether quantized_linear computes x [rows, in_features] on AMX-INT8 tiles against x "
        "quantized per 32 elements (quantized_gemv_mode 3 or 4, amx_usable, a layout int8_runs "
        "takes, 5-16 rows).");
  m.def("q8_gemm_runs", &use_q8_gemm, nb::arg("rows"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("bits"),
        "Whether quantized_linear computes x [rows, in_features] by the AVX-512 VNNI GEMM "
        "against x quantized per 32 elements (quantized_gemv_mode 3 or 4, no AMX, a layout "
        "int8_runs takes, 4 rows and more).");
  m.def("q8_avx2_gemv_runs", &use_q8_avx2_gemv, nb::arg("rows"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("bits"),
        "Whether quantized_linear computes x [rows, in_features] by the AVX2 gemv (where "
        "q8_avx2_gemm_runs, up to 4 rows): the GEMM's integer sums, its fp32 sums in another "
        "order.");
  m.def("q8_avx2_vnni_runs", &vun::q8_avx2_vnni_runs,
        "Whether the AVX2 GEMM's int16 products run on AVX-VNNI (VPDPWSSD): the CPU has it and "
        "the ISA cap (VLLM_UNIFIED_CPU_ISA) is avxvnni or above.");
  m.def("q8_avx2_gemm_runs", &use_q8_avx2_gemm, nb::arg("rows"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("bits"),
        "Whether quantized_linear computes x [rows, in_features] by the AVX2 GEMM against x "
        "quantized per 32 elements, bit-identical to q8_gemm_runs' kernel (quantized_gemv_mode "
        "3 or 4, AVX2, FMA and F16C without AVX-512 VNNI and VBMI or VLLM_UNIFIED_CPU_ISA=avx2, no "
        "AMX, bits 2-6 or 8, group size 16, 32 or a multiple of 64, in_features a multiple of "
        "32 and of the group size, more rows than q8_avx2_gemv_runs takes).");
  m.def("info", &info, nb::arg("a"), "Pointers and ownership facts of an array (evaluates it).");
  m.attr("MLX_VERSION") = VUN_MLX_VERSION;
  m.attr("NANOBIND_VERSION") = VUN_NANOBIND_VERSION;
  m.attr("AMX_MIN_ROWS") = kAmxMinRows;
}
