// Blocked attention of a tile of query rows (cpu_attn_tile.h), in AVX-512 and in AVX2
// intrinsics (one kernel, cpu_attn_tile_body.inc, included once per instruction set).
//
// The tile's query vectors (rows x heads) lie in the lanes of vector registers (16 in a zmm,
// 8 in a ymm), so that both products are register-blocked GEMMs of broadcast FMAs and the
// softmax is vertical:
//   scores S[j][lane] = sum_d Qt[d][lane] * K[j][d]   (Qt: the queries transposed once per tile)
//   out^T  O[d][lane] = alpha[lane] * O[d][lane] + sum_j V[j][d] * P[j][lane]
// with no horizontal reduction anywhere. Keys come in blocks of kKeyBlock positions aligned to
// absolute positions, packed (widened) into L1-resident scratch once per tile and block and
// shared by every group of query vectors.
//
// Bit-invariance: every lane runs the same sequence of explicit FMAs, maxima, exps and sums
// over the blocks it visits, whatever micro-kernel (group width) computes it; this file is
// compiled without fast-math and without FP contraction (CMakeLists.txt). A lane visits the
// blocks its group needs; a block holding none of the lane's keys is an exact no-op for it
// (its scores -inf, so its maximum is unchanged, alpha = exp(0) = 1, every p = 0), and a
// masked key's p is exactly 0, so only a zero's sign could depend on the tile; the output
// adds +0 at the end, which makes every zero +0.

#include "cpu_attn_tile.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VUN_TILE_X86 1
#endif

namespace vun {

#if VUN_TILE_X86

namespace {

constexpr int kKeyBlock = 32;  // keys per block, aligned to multiples of it

// The state of one group of vectors of query vectors (the lanes one micro-kernel computes).
struct Group {
  int v0, nv;               // first vector, vectors
  int64_t lo, hi;           // the union of its lanes' key ranges
  int64_t full_lo, full_hi; // keys visible to all of its lanes
};

// Groups of at most max_group of the nv vectors (of `lanes` query vectors each), as even as
// they come.
std::vector<Group> make_groups(const AttendTile& t, int nv, int lanes, int max_group) {
  const int ng = (nv + max_group - 1) / max_group;
  std::vector<Group> groups(ng);
  for (int gi = 0, v0 = 0; gi < ng; ++gi) {
    Group& g = groups[gi];
    g.v0 = v0;
    g.nv = nv / ng + (gi < nv % ng ? 1 : 0);
    v0 += g.nv;
    g.lo = INT64_MAX;
    g.hi = 0;
    g.full_lo = 0;
    g.full_hi = INT64_MAX;
    for (size_t i = static_cast<size_t>(g.v0) * lanes;
         i < static_cast<size_t>(g.v0 + g.nv) * lanes; ++i) {
      const size_t row = std::min(i / t.heads, t.rows - 1);
      g.lo = std::min(g.lo, t.first[row]);
      g.hi = std::max(g.hi, t.len[row]);
      g.full_lo = std::max(g.full_lo, t.first[row]);
      g.full_hi = std::min(g.full_hi, t.len[row]);
    }
  }
  return groups;
}

struct Scratch {
  std::vector<float> buf;
  float* take(size_t n, size_t& at) {  // 64-byte aligned pieces of buf
    float* base = buf.data() + at;
    const size_t mis = (reinterpret_cast<uintptr_t>(base) / 4) % 16;
    at += (mis ? 16 - mis : 0);
    float* p = buf.data() + at;
    at += (n + 15) / 16 * 16;
    return p;
  }
};

} // namespace

namespace tile512 {

#define VUN_T __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")))
#define VUN_OP static VUN_T inline __attribute__((always_inline))

struct Ops {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxGroup = 3;
  template <int NIV>
  static constexpr int keys_per_pass() {
    return NIV == 1 ? 16 : 8;
  }
  template <int NIV>
  static constexpr int dims_per_pass() {
    return NIV == 1 ? 16 : 8;
  }
  VUN_OP V zero() { return _mm512_setzero_ps(); }
  VUN_OP V load(const float* p) { return _mm512_load_ps(p); }
  VUN_OP void store(float* p, V v) { _mm512_store_ps(p, v); }
  VUN_OP V set1(float x) { return _mm512_set1_ps(x); }
  VUN_OP V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  VUN_OP V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  VUN_OP V add(V a, V b) { return _mm512_add_ps(a, b); }
  VUN_OP V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  VUN_OP V max(V a, V b) { return _mm512_max_ps(a, b); }
  VUN_OP V div(V a, V b) { return _mm512_div_ps(a, b); }

  // exp(x) for every float x (NaN aside): 2^n * e^r with |r| <= ln2 / 2, the polynomial of
  // Cephes' expf; x <= -110 gives exactly 0 (the masked keys' p), x = 0 exactly 1.
  VUN_OP V exp(V x) {
    x = _mm512_min_ps(_mm512_max_ps(x, set1(-110.f)), set1(88.5f));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.9875691500e-4f);
    p = fmadd(p, r, set1(1.3981999507e-3f));
    p = fmadd(p, r, set1(8.3334519073e-3f));
    p = fmadd(p, r, set1(4.1665795894e-2f));
    p = fmadd(p, r, set1(1.6666665459e-1f));
    p = fmadd(p, r, set1(5.0000001201e-1f));
    const V y = add(fmadd(p, mul(r, r), r), set1(1.f));
    return _mm512_scalef_ps(y, n);
  }

  // cap * tanh(x / cap): tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|).
  VUN_OP V softcap(V x, float cap) {
    const V y = mul(x, set1(1.f / cap));
    const V e = exp(mul(_mm512_abs_ps(y), set1(-2.f)));
    const V t = div(sub(set1(1.f), e), add(set1(1.f), e));
    return mul(_mm512_or_ps(t, _mm512_and_ps(y, set1(-0.f))), set1(cap));
  }

  // x where first <= pos < len (per lane), else -inf.
  VUN_OP V visible(V x, int32_t pos, const int32_t* first, const int32_t* len) {
    const __m512i p = _mm512_set1_epi32(pos);
    const __mmask16 vis = _mm512_cmpge_epi32_mask(p, _mm512_load_si512(first)) &
                          _mm512_cmplt_epi32_mask(p, _mm512_load_si512(len));
    return _mm512_mask_blend_ps(vis, set1(-std::numeric_limits<float>::infinity()), x);
  }

  // m, or 0 where m is -inf.
  VUN_OP V finite_or_zero(V m) {
    return _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(m, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ), m,
        zero());
  }

  // Elements [e, e + 16) of a K or V row of `type` as fp32.
  VUN_OP V widen(const void* row, TileKV type, int e) {
    if (type == TileKV::kF32) {
      return _mm512_loadu_ps(static_cast<const float*>(row) + e);
    }
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + e));
    if (type == TileKV::kF16) {
      return _mm512_cvtph_ps(h);
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

#include "cpu_attn_tile_body.inc"

#undef VUN_OP
#undef VUN_T

} // namespace tile512

namespace tile256 {

#define VUN_T __attribute__((target("avx2,fma,f16c")))
#define VUN_OP static VUN_T inline __attribute__((always_inline))

// 16 ymm registers: groups of at most 2 vectors and 8 accumulators per micro-kernel pass, the
// other registers for its loads and broadcasts.
struct Ops {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxGroup = 2;
  template <int NIV>
  static constexpr int keys_per_pass() {
    return NIV == 1 ? 8 : 4;
  }
  template <int NIV>
  static constexpr int dims_per_pass() {
    return NIV == 1 ? 8 : 4;
  }
  VUN_OP V zero() { return _mm256_setzero_ps(); }
  VUN_OP V load(const float* p) { return _mm256_load_ps(p); }
  VUN_OP void store(float* p, V v) { _mm256_store_ps(p, v); }
  VUN_OP V set1(float x) { return _mm256_set1_ps(x); }
  VUN_OP V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  VUN_OP V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  VUN_OP V add(V a, V b) { return _mm256_add_ps(a, b); }
  VUN_OP V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  VUN_OP V max(V a, V b) { return _mm256_max_ps(a, b); }
  VUN_OP V div(V a, V b) { return _mm256_div_ps(a, b); }

  // exp(x) as tile512's (the same polynomial), 2^n built in the exponent field: x in
  // [-87, 88] (n a normal exponent); x < -87 gives exactly 0, x = 0 exactly 1.
  VUN_OP V exp(V x) {
    const V low = _mm256_cmp_ps(x, set1(-87.f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, set1(-87.f)), set1(88.f));
    const V n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.9875691500e-4f);
    p = fmadd(p, r, set1(1.3981999507e-3f));
    p = fmadd(p, r, set1(8.3334519073e-3f));
    p = fmadd(p, r, set1(4.1665795894e-2f));
    p = fmadd(p, r, set1(1.6666665459e-1f));
    p = fmadd(p, r, set1(5.0000001201e-1f));
    const V y = add(fmadd(p, mul(r, r), r), set1(1.f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(low, mul(y, _mm256_castsi256_ps(e)));
  }

  VUN_OP V softcap(V x, float cap) {
    const V y = mul(x, set1(1.f / cap));
    const V e = exp(mul(_mm256_andnot_ps(set1(-0.f), y), set1(-2.f)));
    const V t = div(sub(set1(1.f), e), add(set1(1.f), e));
    return mul(_mm256_or_ps(t, _mm256_and_ps(y, set1(-0.f))), set1(cap));
  }

  VUN_OP V visible(V x, int32_t pos, const int32_t* first, const int32_t* len) {
    const __m256i p = _mm256_set1_epi32(pos);
    const __m256i f = _mm256_load_si256(reinterpret_cast<const __m256i*>(first));
    const __m256i l = _mm256_load_si256(reinterpret_cast<const __m256i*>(len));
    // hidden: pos < first or pos >= len, i.e. first > pos or !(len > pos)
    const __m256i hidden = _mm256_or_si256(
        _mm256_cmpgt_epi32(f, p), _mm256_xor_si256(_mm256_cmpgt_epi32(l, p),
                                                   _mm256_set1_epi32(-1)));
    return _mm256_blendv_ps(x, set1(-std::numeric_limits<float>::infinity()),
                            _mm256_castsi256_ps(hidden));
  }

  VUN_OP V finite_or_zero(V m) {
    return _mm256_blendv_ps(
        m, zero(),
        _mm256_cmp_ps(m, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ));
  }

  VUN_OP V widen(const void* row, TileKV type, int e) {
    if (type == TileKV::kF32) {
      return _mm256_loadu_ps(static_cast<const float*>(row) + e);
    }
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + e));
    if (type == TileKV::kF16) {
      return _mm256_cvtph_ps(h);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

#include "cpu_attn_tile_body.inc"

#undef VUN_OP
#undef VUN_T

} // namespace tile256

namespace {

// 2: AVX-512, 1: AVX2 with FMA and F16C, 0: neither (the CPU's and the ISA cap's lower).
int tile_level() {
  static const int level = [] {
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const int cpu = avx512 ? 2 : avx2 ? 1 : 0;
    const IsaCap cap = isa_cap();  // fixed once read
    return std::min(cpu, cap >= IsaCap::kAvx512 ? 2 : cap >= IsaCap::kAvx2 ? 1 : 0);
  }();
  return level;
}

} // namespace

bool attend_tile_usable(size_t dim) {
  return (dim == 64 || dim == 128 || dim == 256) && tile_level() > 0;
}

const char* attend_tile_isa() {
  return tile_level() == 2 ? "avx512" : tile_level() == 1 ? "avx2" : "";
}

void attend_tile(const AttendTile& t) {
  if (tile_level() == 2) {
    tile512::attend(t);
  } else {
    tile256::attend(t);
  }
}

#else  // not x86: the row kernel takes every row

bool attend_tile_usable(size_t) {
  return false;
}

const char* attend_tile_isa() {
  return "";
}

void attend_tile(const AttendTile&) {}

#endif

} // namespace vun
