// LoRA shrink and expand (cpu_lora.h): 16-wide vector loops, one clone per ISA level. Runs of
// up to four consecutive rows under the same slot (the rows of one request) share each load
// of the slot's A and B.

#include "cpu_lora.h"

#include <type_traits>

#include "cpu_math.h"  // VUN_CLONES
#include "cpu_vec16.h"

namespace vun {

namespace {

// Rows [t, t + n) all under slot[t] (n <= 4): how many of the next rows share t's slot.
VUN_INLINE size_t run_of(const int32_t* slot, size_t t, size_t t1) {
  size_t n = 1;
  while (n < 4 && t + n < t1 && slot[t + n] == slot[t]) {
    ++n;
  }
  return n;
}

// h[i, j] = dot(x_i, a_j) for M rows x_i = x + i * K and J rows a_j = a + j * K.
template <int M, int J>
VUN_INLINE void dots(const float* x, const float* a, float* h, size_t K, size_t R) {
  const size_t k16 = K / 16 * 16;
  v16 acc[M][J] = {};
  for (size_t k = 0; k < k16; k += 16) {
    v16 av[J];
    for (int j = 0; j < J; ++j) {
      av[j] = load16(a + j * K + k);
    }
    for (int i = 0; i < M; ++i) {
      const v16 xv = load16(x + i * K + k);
      for (int j = 0; j < J; ++j) {
        acc[i][j] += xv * av[j];
      }
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < J; ++j) {
      float s = hsum(acc[i][j]);
      for (size_t k = k16; k < K; ++k) {
        s += x[i * K + k] * a[j * K + k];
      }
      h[i * R + j] = s;
    }
  }
}

template <int M>
VUN_INLINE void shrink_rows(const float* x, const float* as, float* h, size_t r, size_t K,
                            size_t R) {
  size_t j = 0;
  for (; j + 4 <= r; j += 4) {
    dots<M, 4>(x, as + j * K, h + j, K, R);
  }
  for (; j < r; ++j) {
    dots<M, 1>(x, as + j * K, h + j, K, R);
  }
}

// y rows [t, t + M) += h rows @ bs over the 16 columns at n (bs: the slot's B at column n).
template <int M>
VUN_INLINE void expand_block(const float* h, const float* bs, float* y, size_t r, size_t N,
                             size_t R) {
  v16 acc[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = load16(y + i * N);
  }
  for (size_t j = 0; j < r; ++j) {
    const v16 bv = load16(bs + j * N);
    for (int i = 0; i < M; ++i) {
      acc[i] += h[i * R + j] * bv;
    }
  }
  for (int i = 0; i < M; ++i) {
    store16(y + i * N, acc[i]);
  }
}

// f(std::integral_constant<int, M>{}) for the run length m in 1..4 (a compile-time row count).
template <class F>
VUN_INLINE void with_rows(size_t m, F&& f) {
  switch (m) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

} // namespace

VUN_CLONES void lora_shrink_f32(const float* x, const float* a, float* h, const int32_t* slot,
                                const int32_t* rank, size_t K, size_t R, size_t t0, size_t t1) {
  for (size_t t = t0; t < t1;) {
    const int32_t s = slot[t];
    const size_t n = run_of(slot, t, t1);
    if (s >= 0) {
      const size_t r = static_cast<size_t>(rank[s]);
      const float* as = a + static_cast<size_t>(s) * R * K;
      const float* xt = x + t * K;
      float* ht = h + t * R;
      // always_inline: the lambda's body is compiled into each clone (its ISA)
      with_rows(n, [&](auto M) __attribute__((always_inline)) {
        shrink_rows<M()>(xt, as, ht, r, K, R);
      });
    }
    t += n;
  }
}

VUN_CLONES void lora_expand_f32(const float* h, const float* b, float* y, const int32_t* slot,
                                const int32_t* rank, size_t T, size_t N, size_t R, size_t n0,
                                size_t n1) {
  // Runs of rows outer, column blocks inner: a run streams its slot's B rows [n0, n1) (rank
  // streams, what the prefetchers follow), a chunk small enough to stay in L1 for the next run
  // of the same slot.
  const size_t n16 = n0 + (n1 - n0) / 16 * 16;
  for (size_t t = 0; t < T;) {
    const int32_t s = slot[t];
    const size_t m = run_of(slot, t, T);
    if (s >= 0) {
      const size_t r = static_cast<size_t>(rank[s]);
      const float* bs = b + static_cast<size_t>(s) * R * N;
      const float* ht = h + t * R;
      for (size_t n = n0; n < n16; n += 16) {
        float* yt = y + t * N + n;
        with_rows(m, [&](auto M) __attribute__((always_inline)) {
          expand_block<M()>(ht, bs + n, yt, r, N, R);
        });
      }
      for (size_t i = 0; i < m; ++i) {
        for (size_t n = n16; n < n1; ++n) {
          float acc = y[(t + i) * N + n];
          for (size_t j = 0; j < r; ++j) {
            acc += ht[i * R + j] * bs[j * N + n];
          }
          y[(t + i) * N + n] = acc;
        }
      }
    }
    t += m;
  }
}

} // namespace vun
