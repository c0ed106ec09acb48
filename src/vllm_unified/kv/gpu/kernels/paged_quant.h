
UNI_FUNC float uni_kvq_e4m3_value(unsigned int b) {
    if ((b & 0x7fu) == 0x7fu) {
        return uni_as_float(0x7fc00000u);  // e4m3fn's NaN (it has no infinity)
    }
    const unsigned int e = (b >> 3) & 15u;
    const unsigned int m = b & 7u;
    const float mag = e == 0u ? (float)m * 0.001953125f
                              : uni_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) != 0u ? -mag : mag;
}
UNI_FUNC float uni_kvq_f16_value(unsigned int h) {
    const unsigned int e = (h >> 10) & 31u;
    const unsigned int m = h & 0x3ffu;
    const float mag = e == 0u ? (float)m * 5.9604644775390625e-8f  // m * 2^-24
                    : e == 31u ? uni_as_float(m != 0u ? 0x7fc00000u : 0x7f800000u)
                               : uni_as_float(((e + 112u) << 23) | (m << 13));
    return (h & 0x8000u) != 0u ? -mag : mag;
}
UNI_FUNC unsigned int uni_kvq_word(const UNI_DEVICE unsigned char* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16)
        | ((unsigned int)p[3] << 24);
}
