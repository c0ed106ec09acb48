
// vllm_unified.gpu_dialect: metal
#define UNI_DEVICE device
#define UNI_SHARED threadgroup
#define UNI_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define UNI_WRITABLE(T, p) const_cast<device T*>(p)
inline float uni_simd_sum(float x) { return simd_sum(x); }
inline float uni_simd_max(float x) { return simd_max(x); }
inline float uni_shfl_xor(float x, int mask) { return simd_shuffle_xor(x, ushort(mask)); }
inline float uni_exp(float x) { return metal::fast::exp(x); }
inline float uni_fmax(float a, float b) { return metal::max(a, b); }
inline float uni_rsqrt(float x) { return metal::precise::rsqrt(x); }
inline float uni_cos(float x) { return metal::precise::cos(x); }
inline float uni_sin(float x) { return metal::precise::sin(x); }
inline float uni_tanh(float x) { return metal::precise::tanh(x); }
inline float uni_neg_inf() { return -INFINITY; }
#define UNI_FUNC inline
inline uint32_t uni_as_uint(float x) { return as_type<uint32_t>(x); }
inline float uni_as_float(uint32_t x) { return as_type<float>(x); }
inline float uni_mul_rn(float a, float b) { return metal::fma(a, b, 0.0f); }
inline float uni_add_rn(float a, float b) { return a + b; }
