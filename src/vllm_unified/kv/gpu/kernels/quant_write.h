
// Triton's where(x >= 0, (x + 0.5).to(int32), (x - 0.5).to(int32)): half away from zero
UNI_FUNC float uni_kvq_round(float x) {
    return x >= 0.0f ? (float)(int)uni_add_rn(x, 0.5f) : (float)(int)uni_add_rn(x, -0.5f);
}
// |x| (bits a, below the format's smallest normal) as a whole number of the format's
// subnormal step 2^(top - 150): the significand >> (top - exponent), round to nearest even;
// 0 where it is below half a step (float subnormals included). fp8 e4m3fn: top 141 (2^-9),
// fp16: top 126 (2^-24).
UNI_FUNC unsigned int uni_kvq_steps(unsigned int a, unsigned int top) {
    const unsigned int e = a >> 23;
    const unsigned int shift = top - e;
    if (e == 0u || shift > 24u) {
        return 0u;
    }
    const unsigned int m = (a & 0x7fffffu) | 0x800000u;
    unsigned int q = m >> shift;
    const unsigned int rest = m & ((1u << shift) - 1u);
    const unsigned int halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (q & 1u) != 0u)) {
        q += 1u;
    }
    return q;
}
// float -> float8 e4m3fn byte, round to nearest even (native f32_to_e4m3, in integers)
UNI_FUNC unsigned int uni_kvq_e4m3(float x) {
    const unsigned int bits = uni_as_uint(x);
    const unsigned int sign = (bits >> 24) & 0x80u;
    const unsigned int a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7fu;  // NaN
    }
    if (a < 0x3c800000u) {  // below 2^-6: multiples of 2^-9 (8 of them are the first normal)
        return sign | uni_kvq_steps(a, 141u);
    }
    const unsigned int r = a + 0x7ffffu + ((a >> 20) & 1u);  // 3 mantissa bits, ties to even
    const int e = (int)(r >> 23) - 120;
    const unsigned int m = (r >> 20) & 7u;
    if (e > 15 || (e == 15 && m == 7u)) {
        return sign | 0x7fu;  // beyond 448: e4m3fn has no infinity
    }
    return sign | ((unsigned int)e << 3) | m;
}
// float -> float16 bits, round to nearest even (native f32_to_f16, in integers)
UNI_FUNC unsigned int uni_kvq_f16(float x) {
    const unsigned int bits = uni_as_uint(x);
    const unsigned int sign = (bits >> 16) & 0x8000u;
    const unsigned int a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u;  // NaN
    }
    if (a >= 0x477ff000u) {
        return sign | 0x7c00u;  // from 65520 up: infinity
    }
    if (a < 0x38800000u) {  // below 2^-14: multiples of 2^-24
        return sign | uni_kvq_steps(a, 126u);
    }
    const unsigned int r = a + 0xfffu + ((a >> 13) & 1u);  // 10 mantissa bits, ties to even
    return sign | ((r - (112u << 23)) >> 13);
}
