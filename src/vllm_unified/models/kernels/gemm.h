// Header of the decode GEMM (vllm_unified.models.gpu_gemm, CUDA only). HEADER, its MMA filled
// with the section MMA once per 16-bit type (CTYPE: the CUDA type, PTX: its name in PTX).
//@ HEADER

template <typename T> struct UniMma;
@MMA@
//@ MMA
template <> struct UniMma<@CTYPE@> {
  __device__ __forceinline__ static void run(float* c, unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.@PTX@.@PTX@.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
