/* The ``dequantize`` op (pe_quant.h): low-bit codes and per-group scales to floats, in the
 * NumPy reference's order of operations (the code as a float, minus 8 for Q4_0, times the
 * scale, plus the offset; no fused multiply-add), so results equal it bit for bit. A float
 * group of 32 runs pe_simd.h's AVX2 or NEON code, others one pass of independent lanes that
 * the compiler vectorises; large tensors split their groups across threads. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "quant.c"
#include "pe_instantiate.h"
#else

#include "pe_simd.h"

static inline PE_T PE_S(pe_scale_at)(const void *p, int half, long k) {
    if (half) return (PE_T)pe_half_to_float(((const uint16_t *)p)[k]);
    return ((const PE_T *)p)[k];
}

/* One group of GGUF's 32 elements, with constant trip counts the compiler vectorises. */
static inline void PE_S(pe_dequantize_int4_32)(const uint8_t *restrict c, PE_T s, PE_T m,
                                               PE_T *restrict o) {
#if PE_TSIZE == 4
    pe_dequant_q4_16_f32(c, s, m, 1, 0, o);
    pe_dequant_q4_16_f32(c, s, m, 1, 1, o + 16);
    return;
#endif
    for (int j = 0; j < 16; j++) o[j] = (PE_T)(c[j] & 0x0F) * s + m;
    for (int j = 0; j < 16; j++) o[16 + j] = (PE_T)(c[j] >> 4) * s + m;
}

static inline void PE_S(pe_dequantize_sym4_32)(const uint8_t *restrict c, PE_T s,
                                               PE_T *restrict o) {
#if PE_TSIZE == 4
    pe_dequant_q4_16_f32(c, s, 0.0f, 0, 0, o);
    pe_dequant_q4_16_f32(c, s, 0.0f, 0, 1, o + 16);
    return;
#endif
    for (int j = 0; j < 16; j++) o[j] = ((PE_T)(c[j] & 0x0F) - (PE_T)8) * s;
    for (int j = 0; j < 16; j++) o[16 + j] = ((PE_T)(c[j] >> 4) - (PE_T)8) * s;
}

static inline void PE_S(pe_dequantize_int8_32)(const int8_t *restrict c, PE_T s,
                                               PE_T *restrict o) {
#if PE_TSIZE == 4
    pe_dequant_i8_f32(c, s, 32, o);
    return;
#endif
    for (int j = 0; j < 32; j++) o[j] = (PE_T)c[j] * s;
}

static void PE_S(pe_dequantize_int8)(const int8_t *restrict c, PE_T s, long group,
                                     PE_T *restrict o) {
    if (group == 32) {
        PE_S(pe_dequantize_int8_32)(c, s, o);
        return;
    }
    for (long j = 0; j < group; j++) o[j] = (PE_T)c[j] * s;
}

static void PE_S(pe_dequantize_int4)(const uint8_t *restrict c, PE_T s, PE_T m, PE_T shift,
                                     int offset, long group, PE_T *restrict o) {
    long half = group / 2;
    if (group == 32) {
        if (offset)
            PE_S(pe_dequantize_int4_32)(c, s, m, o);
        else
            PE_S(pe_dequantize_sym4_32)(c, s, o);
    } else if (offset) {
        for (long j = 0; j < half; j++) o[j] = (PE_T)(c[j] & 0x0F) * s + m;
        for (long j = 0; j < half; j++) o[half + j] = (PE_T)(c[j] >> 4) * s + m;
    } else {
        for (long j = 0; j < half; j++) o[j] = ((PE_T)(c[j] & 0x0F) - shift) * s;
        for (long j = 0; j < half; j++) o[half + j] = ((PE_T)(c[j] >> 4) - shift) * s;
    }
}

void PE_S(pe_dequantize)(const void *codes, const void *scales, const void *offsets, int scheme,
                         int half_scales, long groups, long group, PE_T *out) {
    PE_PARALLEL_FOR(groups * group)
    for (long g = 0; g < groups; g++) {
        PE_T s = PE_S(pe_scale_at)(scales, half_scales, g);
        if (scheme == PE_Q_INT8) {
            PE_S(pe_dequantize_int8)((const int8_t *)codes + g * group, s, group, out + g * group);
        } else {
            int asym = scheme == PE_Q_INT4;
            PE_T m = asym ? PE_S(pe_scale_at)(offsets, half_scales, g) : (PE_T)0;
            PE_S(pe_dequantize_int4)((const uint8_t *)codes + g * (group / 2), s, m, (PE_T)8,
                                     asym, group, out + g * group);
        }
    }
}

#endif
