/* The instruction set the GEMM and its packing are built for (pe_isa.h), and the SIMD
 * helpers packing shares: register-tile transposes and the low-bit groups'
 * dequantisation. Defining PE_GEMM_PORTABLE forces the portable code.
 *
 * Every helper computes what its portable loop computes, bit for bit: the transposes move
 * values, and the dequantisation does the scalar code's operations in its order (the code
 * as a float, minus 8 for Q4_0, times the scale, plus the offset; no fused multiply-add). */
#ifndef PE_SIMD_H
#define PE_SIMD_H

#include <stdint.h>

#include "pe_isa.h"

#if defined(PE_GEMM_ISA_AVX512) || defined(PE_GEMM_ISA_AVX2)
#include <immintrin.h>
#elif defined(PE_GEMM_ISA_NEON)
#include <arm_neon.h>
#endif

#if defined(PE_GEMM_ISA_AVX512) || defined(PE_GEMM_ISA_AVX2)
/* Columns k .. k+7 of rows r .. r+7 (src, rows ld apart) to dst[t * R + i] = row i's t. */
static inline void pe_transpose8x8(const float *src, long ld, float *dst, long R) {
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + ld);
    __m256 r2 = _mm256_loadu_ps(src + 2 * ld), r3 = _mm256_loadu_ps(src + 3 * ld);
    __m256 r4 = _mm256_loadu_ps(src + 4 * ld), r5 = _mm256_loadu_ps(src + 5 * ld);
    __m256 r6 = _mm256_loadu_ps(src + 6 * ld), r7 = _mm256_loadu_ps(src + 7 * ld);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + R, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * R, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * R, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * R, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * R, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * R, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * R, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* The same for 4 rows and 4 columns. */
static inline void pe_transpose4x4(const float *src, long ld, float *dst, long R) {
    __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + ld);
    __m128 r2 = _mm_loadu_ps(src + 2 * ld), r3 = _mm_loadu_ps(src + 3 * ld);
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
    _mm_storeu_ps(dst, r0);
    _mm_storeu_ps(dst + R, r1);
    _mm_storeu_ps(dst + 2 * R, r2);
    _mm_storeu_ps(dst + 3 * R, r3);
}
#define PE_GEMM_TRANSPOSE_PACK 1
#elif defined(PE_GEMM_ISA_NEON)
static inline void pe_transpose4x4(const float *src, long ld, float *dst, long R) {
    float32x4x2_t p01 = vtrnq_f32(vld1q_f32(src), vld1q_f32(src + ld));
    float32x4x2_t p23 = vtrnq_f32(vld1q_f32(src + 2 * ld), vld1q_f32(src + 3 * ld));
    vst1q_f32(dst, vcombine_f32(vget_low_f32(p01.val[0]), vget_low_f32(p23.val[0])));
    vst1q_f32(dst + R, vcombine_f32(vget_low_f32(p01.val[1]), vget_low_f32(p23.val[1])));
    vst1q_f32(dst + 2 * R, vcombine_f32(vget_high_f32(p01.val[0]), vget_high_f32(p23.val[0])));
    vst1q_f32(dst + 3 * R, vcombine_f32(vget_high_f32(p01.val[1]), vget_high_f32(p23.val[1])));
}
#define PE_GEMM_TRANSPOSE_PACK 1
#endif

#ifdef PE_GEMM_TRANSPOSE_PACK
/* dst[k * R + r] = src[r * ld + k] for r < rows, k < kc: a block whose k axis is
 * contiguous packed k-major, transposed in register tiles (contiguous loads and stores). */
static inline void pe_pack_transposed_f32(float *restrict dst, long R, const float *src,
                                          long ld, long rows, long kc) {
    long r = 0;
#if defined(PE_GEMM_ISA_AVX512) || defined(PE_GEMM_ISA_AVX2)
    for (; r + 8 <= rows; r += 8) {
        long k = 0;
        for (; k + 8 <= kc; k += 8) pe_transpose8x8(src + r * ld + k, ld, dst + k * R + r, R);
        for (; k < kc; k++)
            for (long i = r; i < r + 8; i++) dst[k * R + i] = src[i * ld + k];
    }
#endif
    for (; r + 4 <= rows; r += 4) {
        long k = 0;
        for (; k + 4 <= kc; k += 4) pe_transpose4x4(src + r * ld + k, ld, dst + k * R + r, R);
        for (; k < kc; k++)
            for (long i = r; i < r + 4; i++) dst[k * R + i] = src[i * ld + k];
    }
    for (; r < rows; r++)
        for (long k = 0; k < kc; k++) dst[k * R + r] = src[r * ld + k];
}
#endif

/* Sixteen elements of a 4-bit group of 32 (byte j holds element j in its low nibble and
 * j + 16 in its high one): the low nibbles (high = 0) or the high ones, as
 * (c - 8) * s, or c * s + m when asym. */
static inline void pe_dequant_q4_16_f32(const uint8_t *restrict c, float s, float m, int asym,
                                        int high, float *restrict o) {
#if defined(PE_GEMM_ISA_AVX512) || defined(PE_GEMM_ISA_AVX2)
    __m128i b = _mm_loadu_si128((const __m128i *)c), mask = _mm_set1_epi8(0x0F);
    __m128i nib = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, mask);
    __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m), eight = _mm256_set1_ps(8.0f);
    for (int q = 0; q < 2; q++) {
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q ? _mm_srli_si128(nib, 8) : nib));
        f = asym ? _mm256_add_ps(_mm256_mul_ps(f, vs), vm)
                 : _mm256_mul_ps(_mm256_sub_ps(f, eight), vs);
        _mm256_storeu_ps(o + 8 * q, f);
    }
#elif defined(PE_GEMM_ISA_NEON)
    uint8x16_t b = vld1q_u8(c);
    uint8x16_t nib = high ? vshrq_n_u8(b, 4) : vandq_u8(b, vdupq_n_u8(0x0F));
    uint16x8_t w[2] = {vmovl_u8(vget_low_u8(nib)), vmovl_u8(vget_high_u8(nib))};
    float32x4_t vs = vdupq_n_f32(s), vm = vdupq_n_f32(m), eight = vdupq_n_f32(8.0f);
    for (int q = 0; q < 4; q++) {
        uint16x4_t u = q % 2 ? vget_high_u16(w[q / 2]) : vget_low_u16(w[q / 2]);
        float32x4_t f = vcvtq_f32_u32(vmovl_u16(u));
        f = asym ? vaddq_f32(vmulq_f32(f, vs), vm) : vmulq_f32(vsubq_f32(f, eight), vs);
        vst1q_f32(o + 4 * q, f);
    }
#else
    for (int j = 0; j < 16; j++) {
        float code = (float)(high ? c[j] >> 4 : c[j] & 0x0F);
        o[j] = asym ? code * s + m : (code - 8.0f) * s;
    }
#endif
}

/* n int8 codes times the scale s. */
static inline void pe_dequant_i8_f32(const int8_t *restrict c, float s, long n,
                                     float *restrict o) {
    long t = 0;
#if defined(PE_GEMM_ISA_AVX512) || defined(PE_GEMM_ISA_AVX2)
    __m256 vs = _mm256_set1_ps(s);
    for (; t + 8 <= n; t += 8) {
        __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + t)));
        _mm256_storeu_ps(o + t, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vs));
    }
#elif defined(PE_GEMM_ISA_NEON)
    float32x4_t vs = vdupq_n_f32(s);
    for (; t + 8 <= n; t += 8) {
        int16x8_t w = vmovl_s8(vld1_s8(c + t));
        vst1q_f32(o + t, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vs));
        vst1q_f32(o + t + 4, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))), vs));
    }
#endif
    for (long rest = n - t, i = 0; i < rest; i++) o[t + i] = (float)c[t + i] * s;
}

#endif /* PE_SIMD_H */
