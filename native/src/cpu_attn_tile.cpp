// Blocked attention of a tile of query rows (cpu_attn_tile.h), in AVX-512 intrinsics.
//
// The tile's query vectors (rows x heads) lie in the 16 lanes of zmm registers, so that both
// products are register-blocked GEMMs of broadcast FMAs and the softmax is vertical:
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

#define VUN_TILE_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma,f16c")))
#define VUN_TILE_INLINE VUN_TILE_TARGET inline __attribute__((always_inline))

constexpr int kKeyBlock = 32;  // keys per block, aligned to multiples of it
constexpr int kLanes = 16;

// exp(x) for every float x (NaN aside): 2^n * e^r with |r| <= ln2 / 2, the polynomial of
// Cephes' expf; x <= -110 gives exactly 0 (the masked keys' p), x = 0 exactly 1.
VUN_TILE_INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-110.f)), _mm512_set1_ps(88.5f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
                                 _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// cap * tanh(x / cap) (soft-capping): tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|).
VUN_TILE_INLINE __m512 softcap16(__m512 x, float cap) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.f / cap));
  const __m512 ay = _mm512_abs_ps(y);
  const __m512 e = exp16(_mm512_mul_ps(ay, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 st = _mm512_or_ps(t, _mm512_and_ps(y, _mm512_set1_ps(-0.f)));
  return _mm512_mul_ps(st, _mm512_set1_ps(cap));
}

// S[j][group lanes] for keys j in [j0, j0 + NJ) of the packed block kb [kKeyBlock][D]: qt and s
// point at the group's first lane of Qt [D][ld] and S [kKeyBlock][ld].
template <int D, int NIV, int NJ>
VUN_TILE_INLINE void scores_mk(const float* qt, const float* kb, float* s, size_t ld, int j0) {
  __m512 acc[NJ][NIV];
  for (int j = 0; j < NJ; ++j) {
    for (int i = 0; i < NIV; ++i) {
      acc[j][i] = _mm512_setzero_ps();
    }
  }
  const float* k = kb + j0 * D;
  for (int d = 0; d < D; ++d) {
    __m512 qv[NIV];
    for (int i = 0; i < NIV; ++i) {
      qv[i] = _mm512_load_ps(qt + d * ld + kLanes * i);
    }
    for (int j = 0; j < NJ; ++j) {
      const __m512 kv = _mm512_set1_ps(k[j * D + d]);
      for (int i = 0; i < NIV; ++i) {
        acc[j][i] = _mm512_fmadd_ps(qv[i], kv, acc[j][i]);
      }
    }
  }
  for (int j = 0; j < NJ; ++j) {
    for (int i = 0; i < NIV; ++i) {
      _mm512_store_ps(s + (j0 + j) * ld + kLanes * i, acc[j][i]);
    }
  }
}

// O[d][group lanes] = alpha * O + sum_j V[j][d] * P[j] for d in [d0, d0 + ND), j ascending.
template <int D, int NIV, int ND>
VUN_TILE_INLINE void values_mk(const float* p, const float* vb, float* o, const __m512* alpha,
                               size_t ld, int d0) {
  __m512 acc[ND][NIV];
  for (int c = 0; c < ND; ++c) {
    for (int i = 0; i < NIV; ++i) {
      acc[c][i] = _mm512_mul_ps(_mm512_load_ps(o + (d0 + c) * ld + kLanes * i), alpha[i]);
    }
  }
  for (int j = 0; j < kKeyBlock; ++j) {
    __m512 pv[NIV];
    for (int i = 0; i < NIV; ++i) {
      pv[i] = _mm512_load_ps(p + j * ld + kLanes * i);
    }
    const float* v = vb + j * D + d0;
    for (int c = 0; c < ND; ++c) {
      const __m512 vv = _mm512_set1_ps(v[c]);
      for (int i = 0; i < NIV; ++i) {
        acc[c][i] = _mm512_fmadd_ps(pv[i], vv, acc[c][i]);
      }
    }
  }
  for (int c = 0; c < ND; ++c) {
    for (int i = 0; i < NIV; ++i) {
      _mm512_store_ps(o + (d0 + c) * ld + kLanes * i, acc[c][i]);
    }
  }
}

// The per-lane state of one group of NIV vectors of query vectors.
struct Group {
  int v0, nv;               // first vector, vectors
  int64_t lo, hi;           // the union of its lanes' key ranges
  int64_t full_lo, full_hi; // keys visible to all of its lanes
};

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

// One key block [pos0, pos0 + kKeyBlock) for a group of NIV vectors: scores, the online
// softmax's update, then P . V.
template <int D, int NIV>
VUN_TILE_INLINE void block_group(const AttendTile& t, const Group& g, int64_t pos0,
                                 const float* qt, const float* kb, const float* vb, float* s,
                                 float* o, float* m, float* l, const int32_t* first,
                                 const int32_t* len, size_t ld) {
  const int off = g.v0 * kLanes;
  constexpr int NJ = NIV == 1 ? 16 : 8;
  for (int j0 = 0; j0 < kKeyBlock; j0 += NJ) {
    scores_mk<D, NIV, NJ>(qt + off, kb, s + off, ld, j0);
  }
  const bool full = pos0 >= g.full_lo && pos0 + kKeyBlock <= g.full_hi;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(t.scale);
  __m512 alpha[NIV];
  for (int i = 0; i < NIV; ++i) {
    const int v = g.v0 + i;
    float* sv = s + kLanes * v;
    const __m512i fv = _mm512_load_si512(first + kLanes * v);
    const __m512i lv = _mm512_load_si512(len + kLanes * v);
    const __m512 m_old = _mm512_load_ps(m + kLanes * v);
    __m512 bm = ninf;
    for (int j = 0; j < kKeyBlock; ++j) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(sv + j * ld), scale);
      if (t.opts.softcap > 0.f) {
        x = softcap16(x, t.opts.softcap);
      }
      if (!full) {
        const __m512i pos = _mm512_set1_epi32(static_cast<int>(pos0 + j));
        const __mmask16 vis =
            _mm512_cmpge_epi32_mask(pos, fv) & _mm512_cmplt_epi32_mask(pos, lv);
        x = _mm512_mask_blend_ps(vis, ninf, x);
      }
      bm = _mm512_max_ps(bm, x);
      _mm512_store_ps(sv + j * ld, x);
    }
    const __m512 m_new = _mm512_max_ps(m_old, bm);
    // a lane with no key yet keeps m = -inf: exps taken against 0 then give alpha = p = 0
    const __m512 m_use =
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ), m_new,
                             _mm512_setzero_ps());
    alpha[i] = exp16(_mm512_sub_ps(m_old, m_use));
    __m512 sum = _mm512_mul_ps(_mm512_load_ps(l + kLanes * v), alpha[i]);
    for (int j = 0; j < kKeyBlock; ++j) {
      const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(sv + j * ld), m_use));
      _mm512_store_ps(sv + j * ld, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_store_ps(l + kLanes * v, sum);
    _mm512_store_ps(m + kLanes * v, m_new);
  }
  constexpr int ND = NIV == 1 ? 16 : 8;
  for (int d0 = 0; d0 < D; d0 += ND) {
    values_mk<D, NIV, ND>(s + off, vb, o + off, alpha, ld, d0);
  }
}

// Widens (or copies) the rows of positions [pos0, pos0 + kKeyBlock) that lie in [u0, u1) into
// kb / vb [kKeyBlock][D]; the other rows are zero.
template <int D>
VUN_TILE_INLINE void pack_block(const AttendTile& t, int64_t pos0, int64_t u0, int64_t u1,
                                float* kb, float* vb) {
  for (int j = 0; j < kKeyBlock; ++j) {
    const int64_t p = pos0 + j;
    float* kd = kb + j * D;
    float* vd = vb + j * D;
    if (p < u0 || p >= u1) {
      for (int e = 0; e < D; e += kLanes) {
        _mm512_store_ps(kd + e, _mm512_setzero_ps());
        _mm512_store_ps(vd + e, _mm512_setzero_ps());
      }
      continue;
    }
    const void* ks = t.keys[p - t.k0];
    const void* vs = t.values[p - t.k0];
    for (int e = 0; e < D; e += kLanes) {
      __m512 kx, vx;
      if (t.type == TileKV::kF32) {
        kx = _mm512_loadu_ps(static_cast<const float*>(ks) + e);
        vx = _mm512_loadu_ps(static_cast<const float*>(vs) + e);
      } else {
        const __m256i kh = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(ks) + e));
        const __m256i vh = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(vs) + e));
        if (t.type == TileKV::kF16) {
          kx = _mm512_cvtph_ps(kh);
          vx = _mm512_cvtph_ps(vh);
        } else {
          kx = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(kh), 16));
          vx = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vh), 16));
        }
      }
      _mm512_store_ps(kd + e, kx);
      _mm512_store_ps(vd + e, vx);
    }
  }
}

template <int D>
VUN_TILE_TARGET void attend_tile_impl(const AttendTile& t) {
  const size_t M = t.rows * t.heads;
  const int nv = static_cast<int>((M + kLanes - 1) / kLanes);
  const size_t ld = static_cast<size_t>(nv) * kLanes;
  thread_local Scratch sc;
  const size_t need = ld * D * 2 + ld * kKeyBlock + 2 * kKeyBlock * D + 4 * ld + 9 * 16;
  if (sc.buf.size() < need) {
    sc.buf.resize(need);
  }
  size_t at = 0;
  float* qt = sc.take(ld * D, at);
  float* o = sc.take(ld * D, at);
  float* s = sc.take(ld * kKeyBlock, at);
  float* kb = sc.take(kKeyBlock * D, at);
  float* vb = sc.take(kKeyBlock * D, at);
  // lane i: query vector i (row i / heads, head i % heads); lanes past M repeat the last row
  // with a zero query (their outputs are dropped). Per lane: its keys [first, len), the
  // running maximum m and sum l.
  int32_t* first = reinterpret_cast<int32_t*>(sc.take(ld, at));
  int32_t* len = reinterpret_cast<int32_t*>(sc.take(ld, at));
  float* m = sc.take(ld, at);
  float* l = sc.take(ld, at);
  int64_t u0 = INT64_MAX, u1 = 0;
  for (size_t r = 0; r < t.rows; ++r) {
    u0 = std::min(u0, t.first[r]);
    u1 = std::max(u1, t.len[r]);
  }
  for (size_t i = 0; i < ld; ++i) {
    const size_t row = std::min(i / t.heads, t.rows - 1);
    first[i] = static_cast<int32_t>(t.first[row]);
    len[i] = static_cast<int32_t>(t.len[row]);
    const float* sink = t.opts.sinks != nullptr ? t.opts.sinks + i % t.heads : nullptr;
    // a sink is a key of score `sink` and value 0 seen first: m = sink, l = exp(0) = 1
    m[i] = sink != nullptr ? *sink : -std::numeric_limits<float>::infinity();
    l[i] = sink != nullptr ? 1.f : 0.f;
  }
  for (int d = 0; d < D; ++d) {
    float* qd = qt + d * ld;
    for (size_t i = 0; i < ld; ++i) {
      qd[i] = i < M ? t.q[i * D + d] : 0.f;
    }
    for (size_t i = 0; i < ld; i += kLanes) {
      _mm512_store_ps(o + d * ld + i, _mm512_setzero_ps());
    }
  }
  // groups of at most 3 vectors, as even as they come
  const int ng = (nv + 2) / 3;
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
    for (size_t i = static_cast<size_t>(g.v0) * kLanes;
         i < static_cast<size_t>(g.v0 + g.nv) * kLanes; ++i) {
      const size_t row = std::min(i / t.heads, t.rows - 1);
      g.lo = std::min(g.lo, t.first[row]);
      g.hi = std::max(g.hi, t.len[row]);
      g.full_lo = std::max(g.full_lo, t.first[row]);
      g.full_hi = std::min(g.full_hi, t.len[row]);
    }
  }
  for (int64_t pos0 = u0 / kKeyBlock * kKeyBlock; pos0 < u1; pos0 += kKeyBlock) {
    pack_block<D>(t, pos0, u0, u1, kb, vb);
    for (const Group& g : groups) {
      if (pos0 + kKeyBlock <= g.lo || pos0 >= g.hi) {
        continue;
      }
      switch (g.nv) {
        case 1:
          block_group<D, 1>(t, g, pos0, qt, kb, vb, s, o, m, l, first, len, ld);
          break;
        case 2:
          block_group<D, 2>(t, g, pos0, qt, kb, vb, s, o, m, l, first, len, ld);
          break;
        default:
          block_group<D, 3>(t, g, pos0, qt, kb, vb, s, o, m, l, first, len, ld);
          break;
      }
    }
  }
  // out = O / l, transposed back; + 0 turns a -0 into +0
  for (int v = 0; v < nv; ++v) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_load_ps(l + v * kLanes));
    for (int d = 0; d < D; ++d) {
      alignas(64) float lane[kLanes];
      _mm512_store_ps(lane, _mm512_add_ps(
          _mm512_mul_ps(_mm512_load_ps(o + d * ld + v * kLanes), inv), _mm512_setzero_ps()));
      for (int e = 0; e < kLanes; ++e) {
        const size_t i = static_cast<size_t>(v) * kLanes + e;
        if (i < M) {
          t.out[i * D + d] = lane[e];
        }
      }
    }
  }
}

bool cpu_has_tile_isa() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

} // namespace

bool attend_tile_usable(size_t dim) {
  return (dim == 64 || dim == 128 || dim == 256) && cpu_has_tile_isa() &&
         isa_cap() >= IsaCap::kAvx512;
}

void attend_tile(const AttendTile& t) {
  switch (t.dim) {
    case 64:
      attend_tile_impl<64>(t);
      break;
    case 128:
      attend_tile_impl<128>(t);
      break;
    default:
      attend_tile_impl<256>(t);
      break;
  }
}

#else  // not x86: the row kernel takes every row

bool attend_tile_usable(size_t) {
  return false;
}

void attend_tile(const AttendTile&) {}

#endif

} // namespace vun
