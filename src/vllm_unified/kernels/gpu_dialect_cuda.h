
// vllm_unified.gpu_dialect: cuda
#define UNI_DEVICE
#define UNI_SHARED __shared__
#define UNI_BARRIER() __syncthreads()
#define UNI_WRITABLE(T, p) const_cast<T*>(p)
__device__ __forceinline__ float uni_shfl_xor(float x, int mask) {
  return __shfl_xor_sync(0xffffffffu, x, mask);
}
__device__ __forceinline__ float uni_simd_sum(float x) {
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}
__device__ __forceinline__ float uni_simd_max(float x) {
  for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
__device__ __forceinline__ float uni_exp(float x) { return __expf(x); }
__device__ __forceinline__ float uni_fmax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float uni_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float uni_cos(float x) { return cosf(x); }
__device__ __forceinline__ float uni_sin(float x) { return sinf(x); }
__device__ __forceinline__ float uni_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float uni_neg_inf() { return __int_as_float(0xff800000); }
#define UNI_FUNC __device__ __forceinline__
__device__ __forceinline__ unsigned int uni_as_uint(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float uni_as_float(unsigned int x) { return __uint_as_float(x); }
__device__ __forceinline__ float uni_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float uni_add_rn(float a, float b) { return __fadd_rn(a, b); }
