/* The GEMM's register-blocked micro-kernels, one per instruction set, chosen when the
 * kernels are compiled (-march=native, or the target's flags):
 *
 *   float, AVX-512F        12 x 32   (24 zmm accumulators)
 *   float, AVX2 + FMA       6 x 16   (12 ymm accumulators)
 *   float, NEON (aarch64)   8 x 8    (16 q accumulators, fused lane multiply-adds)
 *   float, elsewhere        4 x 8    (portable C, as the compiler vectorises it)
 *   double, every target    4 x 8    (portable C)
 *
 * Defining PE_GEMM_PORTABLE forces the portable kernels (tests build that way).
 *
 * Each computes c[r * ldc + j] = (load ? c[r * ldc + j] : 0) + sum_k a[k * MR + r] *
 * b[k * NR + j] over r < MR, j < NR, with a and b packed panels: every element sums its
 * products in k order, so a result does not depend on blocking, tile position or threads.
 * Included by linalg.c inside its PE_T instantiation; PE_MR and PE_NR name the block. */
#include "pe_simd.h"

#ifndef PE_GEMM_MICRO_ONCE
#define PE_GEMM_MICRO_ONCE
#if defined(PE_GEMM_ISA_AVX512)
#define PE_MR_F32 12
#define PE_NR_F32 32
static void pe_gemm_micro_simd_f32(long kc, const float *restrict a, const float *restrict b,
                                   float *restrict c, long ldc, int load) {
    __m512 acc[12][2];
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {
        acc[r][0] = load ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
        acc[r][1] = load ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
    }
    for (long k = 0; k < kc; k++) {
        __m512 b0 = _mm512_loadu_ps(b + k * 32), b1 = _mm512_loadu_ps(b + k * 32 + 16);
#pragma GCC unroll 12
        for (int r = 0; r < 12; r++) {
            __m512 av = _mm512_set1_ps(a[k * 12 + r]);
            acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {
        _mm512_storeu_ps(c + r * ldc, acc[r][0]);
        _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
    }
}
#elif defined(PE_GEMM_ISA_AVX2)
#define PE_MR_F32 6
#define PE_NR_F32 16
static void pe_gemm_micro_simd_f32(long kc, const float *restrict a, const float *restrict b,
                                   float *restrict c, long ldc, int load) {
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        acc[r][0] = load ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
        acc[r][1] = load ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
    }
    for (long k = 0; k < kc; k++) {
        __m256 b0 = _mm256_loadu_ps(b + k * 16), b1 = _mm256_loadu_ps(b + k * 16 + 8);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            __m256 av = _mm256_broadcast_ss(a + k * 6 + r);
            acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        _mm256_storeu_ps(c + r * ldc, acc[r][0]);
        _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
    }
}
#elif defined(PE_GEMM_ISA_NEON)
#define PE_MR_F32 8
#define PE_NR_F32 8
/* Row r of the block: two q accumulators, a's lane (r % 4) of its (r / 4) vector. */
#define PE_NEON_ROW(r, av, lane)                                  \
    acc[r][0] = vfmaq_laneq_f32(acc[r][0], b0, av, lane);        \
    acc[r][1] = vfmaq_laneq_f32(acc[r][1], b1, av, lane)
static void pe_gemm_micro_simd_f32(long kc, const float *restrict a, const float *restrict b,
                                   float *restrict c, long ldc, int load) {
    float32x4_t acc[8][2];
    for (int r = 0; r < 8; r++) {
        acc[r][0] = load ? vld1q_f32(c + r * ldc) : vdupq_n_f32(0.0f);
        acc[r][1] = load ? vld1q_f32(c + r * ldc + 4) : vdupq_n_f32(0.0f);
    }
    for (long k = 0; k < kc; k++) {
        float32x4_t b0 = vld1q_f32(b + k * 8), b1 = vld1q_f32(b + k * 8 + 4);
        float32x4_t a0 = vld1q_f32(a + k * 8), a1 = vld1q_f32(a + k * 8 + 4);
        PE_NEON_ROW(0, a0, 0);
        PE_NEON_ROW(1, a0, 1);
        PE_NEON_ROW(2, a0, 2);
        PE_NEON_ROW(3, a0, 3);
        PE_NEON_ROW(4, a1, 0);
        PE_NEON_ROW(5, a1, 1);
        PE_NEON_ROW(6, a1, 2);
        PE_NEON_ROW(7, a1, 3);
    }
    for (int r = 0; r < 8; r++) {
        vst1q_f32(c + r * ldc, acc[r][0]);
        vst1q_f32(c + r * ldc + 4, acc[r][1]);
    }
}
#undef PE_NEON_ROW
#endif
#endif /* PE_GEMM_MICRO_ONCE */

/* This instantiation's block and kernel: the SIMD one for float where there is one, else
 * the portable one (c = c + a*b, unfused, as ISO C compiles it), whose fixed-size block of
 * accumulators the compiler keeps in registers. */
#if PE_TSIZE == 4 && defined(PE_MR_F32)
#define PE_MR PE_MR_F32
#define PE_NR PE_NR_F32
#define PE_MICRO pe_gemm_micro_simd_f32
#else
#define PE_MR 4
#define PE_NR 8
#define PE_MICRO PE_S(pe_gemm_micro_c)
static void PE_S(pe_gemm_micro_c)(long kc, const PE_T *restrict a, const PE_T *restrict b,
                                  PE_T *restrict c, long ldc, int load) {
    PE_T acc[PE_MR][PE_NR];
    for (int r = 0; r < PE_MR; r++)
        for (int j = 0; j < PE_NR; j++) acc[r][j] = load ? c[r * ldc + j] : (PE_T)0;
    for (long k = 0; k < kc; k++)
        for (int r = 0; r < PE_MR; r++)
            for (int j = 0; j < PE_NR; j++)
                acc[r][j] = acc[r][j] + a[k * PE_MR + r] * b[k * PE_NR + j];
    for (int r = 0; r < PE_MR; r++)
        for (int j = 0; j < PE_NR; j++) c[r * ldc + j] = acc[r][j];
}
#endif
