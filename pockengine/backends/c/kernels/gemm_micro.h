/* The GEMM's register-blocked micro-kernels: for each instruction set, chosen when the
 * kernels are compiled (-march=native, or the target's flags), three block shapes, rows x
 * columns. Shape 0 is the default; the others pad less on narrow or short operands, and the
 * backend may choose one per node by measurement (pe_gemm_shape, linalg.c):
 *
 *   float, AVX-512F        12 x 32 | 24 x 16 | 6 x 64   (24 zmm accumulators each)
 *   float, AVX2 + FMA       6 x 16 | 12 x 8  | 4 x 24   (12 ymm accumulators each)
 *   float, NEON (aarch64)   8 x 8  | 12 x 8  | 4 x 16   (16, 24, 16 q accumulators)
 *   float, elsewhere        4 x 8  | 8 x 4   | 2 x 16   (portable C, as the compiler
 *   double, every target    4 x 8  | 8 x 4   | 2 x 16    vectorises it)
 *
 * Defining PE_GEMM_PORTABLE forces the portable kernels (tests build that way).
 *
 * Each computes c[r * ldc + j] = (load ? c[r * ldc + j] : 0) + sum_k a[k * MR + r] *
 * b[k * NR + j] over r < MR, j < NR, with a and b packed panels: every element sums its
 * products in k order, one multiply-add at a time (fused in the SIMD kernels), so a
 * result does not depend on the shape, blocking, tile position or threads.
 * Included by linalg.c and lowbit_gemm.c inside their PE_T instantiation: PE_GEMM_SHAPES
 * is the number of shapes, PE_MR_<i>, PE_NR_<i> and PE_MICRO_<i> name shape i, and
 * PE_MR, PE_NR and PE_MICRO name shape 0. */
#include "pe_simd.h"

#ifndef PE_GEMM_MICRO_ONCE
#define PE_GEMM_MICRO_ONCE
#if defined(__GNUC__)
#define PE_MAYBE_UNUSED __attribute__((unused)) /* a file may call shape 0's alone */
#else
#define PE_MAYBE_UNUSED
#endif
#if defined(PE_GEMM_ISA_AVX512)
/* MR rows of NV vectors of 16: a is broadcast a row at a time, b loaded a vector at a time. */
#define PE_MICRO_AVX512(NAME, MR, NV)                                                         \
    PE_MAYBE_UNUSED static void NAME(long kc, const float *restrict a, const float *restrict b,               \
                     float *restrict c, long ldc, int load) {                                 \
        __m512 acc[MR][NV];                                                                   \
        _Pragma("GCC unroll 24") for (int r = 0; r < MR; r++)                                 \
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                  \
            acc[r][v] = load ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();   \
        _Pragma("GCC unroll 4") for (long k = 0; k < kc; k++) {                               \
            __m512 bv[NV];                                                                    \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                              \
                bv[v] = _mm512_loadu_ps(b + k * (16 * NV) + 16 * v);                          \
            _Pragma("GCC unroll 24") for (int r = 0; r < MR; r++) {                           \
                __m512 av = _mm512_set1_ps(a[k * MR + r]);                                    \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                          \
                    acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);                        \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 24") for (int r = 0; r < MR; r++)                                 \
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                  \
            _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);                                \
    }
PE_MICRO_AVX512(pe_gemm_micro_12x32_f32, 12, 2)
PE_MICRO_AVX512(pe_gemm_micro_24x16_f32, 24, 1)
PE_MICRO_AVX512(pe_gemm_micro_6x64_f32, 6, 4)
#undef PE_MICRO_AVX512
#define PE_SIMD_SHAPES {{12, 32}, {24, 16}, {6, 64}}
#define PE_SIMD_0 pe_gemm_micro_12x32_f32, 12, 32
#define PE_SIMD_1 pe_gemm_micro_24x16_f32, 24, 16
#define PE_SIMD_2 pe_gemm_micro_6x64_f32, 6, 64
#elif defined(PE_GEMM_ISA_AVX2)
/* MR rows of NV vectors of 8. */
#define PE_MICRO_AVX2(NAME, MR, NV)                                                           \
    PE_MAYBE_UNUSED static void NAME(long kc, const float *restrict a, const float *restrict b,               \
                     float *restrict c, long ldc, int load) {                                 \
        __m256 acc[MR][NV];                                                                   \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)                                 \
        _Pragma("GCC unroll 3") for (int v = 0; v < NV; v++)                                  \
            acc[r][v] = load ? _mm256_loadu_ps(c + r * ldc + 8 * v) : _mm256_setzero_ps();    \
        for (long k = 0; k < kc; k++) {                                                       \
            __m256 bv[NV];                                                                    \
            _Pragma("GCC unroll 3") for (int v = 0; v < NV; v++)                              \
                bv[v] = _mm256_loadu_ps(b + k * (8 * NV) + 8 * v);                            \
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {                           \
                __m256 av = _mm256_broadcast_ss(a + k * MR + r);                              \
                _Pragma("GCC unroll 3") for (int v = 0; v < NV; v++)                          \
                    acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);                        \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)                                 \
        _Pragma("GCC unroll 3") for (int v = 0; v < NV; v++)                                  \
            _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);                                 \
    }
PE_MICRO_AVX2(pe_gemm_micro_6x16_f32, 6, 2)
PE_MICRO_AVX2(pe_gemm_micro_12x8_f32, 12, 1)
PE_MICRO_AVX2(pe_gemm_micro_4x24_f32, 4, 3)
#undef PE_MICRO_AVX2
#define PE_SIMD_SHAPES {{6, 16}, {12, 8}, {4, 24}}
#define PE_SIMD_0 pe_gemm_micro_6x16_f32, 6, 16
#define PE_SIMD_1 pe_gemm_micro_12x8_f32, 12, 8
#define PE_SIMD_2 pe_gemm_micro_4x24_f32, 4, 24
#elif defined(PE_GEMM_ISA_NEON)
/* Rows 4q .. 4q+3 of the block: lanes 0-3 of a's q-th vector times each of b's vectors. */
#define PE_NEON_ROWS(q, av)                                                                   \
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                    \
        acc[4 * (q)][v] = vfmaq_laneq_f32(acc[4 * (q)][v], bv[v], av, 0);                     \
        acc[4 * (q) + 1][v] = vfmaq_laneq_f32(acc[4 * (q) + 1][v], bv[v], av, 1);             \
        acc[4 * (q) + 2][v] = vfmaq_laneq_f32(acc[4 * (q) + 2][v], bv[v], av, 2);             \
        acc[4 * (q) + 3][v] = vfmaq_laneq_f32(acc[4 * (q) + 3][v], bv[v], av, 3);             \
    }
/* 4 * MQ rows of NV vectors of 4. */
#define PE_MICRO_NEON(NAME, MQ, NVEC)                                                         \
    PE_MAYBE_UNUSED static void NAME(long kc, const float *restrict a, const float *restrict b,               \
                     float *restrict c, long ldc, int load) {                                 \
        enum { MR = 4 * (MQ), NV = (NVEC) };                                                  \
        float32x4_t acc[MR][NV];                                                              \
        for (int r = 0; r < MR; r++)                                                          \
            for (int v = 0; v < NV; v++)                                                      \
                acc[r][v] = load ? vld1q_f32(c + r * ldc + 4 * v) : vdupq_n_f32(0.0f);        \
        for (long k = 0; k < kc; k++) {                                                       \
            float32x4_t bv[NV];                                                               \
            for (int v = 0; v < NV; v++) bv[v] = vld1q_f32(b + k * (4 * NV) + 4 * v);         \
            _Pragma("GCC unroll 3") for (int q = 0; q < (MQ); q++) {                          \
                float32x4_t av = vld1q_f32(a + k * MR + 4 * q);                               \
                PE_NEON_ROWS(q, av)                                                           \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < MR; r++)                                                          \
            for (int v = 0; v < NV; v++) vst1q_f32(c + r * ldc + 4 * v, acc[r][v]);           \
    }
PE_MICRO_NEON(pe_gemm_micro_8x8_f32, 2, 2)
PE_MICRO_NEON(pe_gemm_micro_12x8_f32, 3, 2)
PE_MICRO_NEON(pe_gemm_micro_4x16_f32, 1, 4)
#undef PE_MICRO_NEON
#undef PE_NEON_ROWS
#define PE_SIMD_SHAPES {{8, 8}, {12, 8}, {4, 16}}
#define PE_SIMD_0 pe_gemm_micro_8x8_f32, 8, 8
#define PE_SIMD_1 pe_gemm_micro_12x8_f32, 12, 8
#define PE_SIMD_2 pe_gemm_micro_4x16_f32, 4, 16
#endif
#endif /* PE_GEMM_MICRO_ONCE */

/* The portable kernel of block MR x NR (c = c + a*b, unfused, as ISO C compiles it), whose
 * fixed-size block of accumulators the compiler keeps in registers. */
#ifndef PE_MICRO_C
#define PE_MICRO_C(NAME, MR, NR)                                                              \
    PE_MAYBE_UNUSED static void NAME(long kc, const PE_T *restrict a, const PE_T *restrict b,                 \
                     PE_T *restrict c, long ldc, int load) {                                  \
        PE_T acc[MR][NR];                                                                     \
        for (int r = 0; r < MR; r++)                                                          \
            for (int j = 0; j < NR; j++) acc[r][j] = load ? c[r * ldc + j] : (PE_T)0;         \
        for (long k = 0; k < kc; k++)                                                         \
            for (int r = 0; r < MR; r++)                                                      \
                for (int j = 0; j < NR; j++)                                                  \
                    acc[r][j] = acc[r][j] + a[k * MR + r] * b[k * NR + j];                    \
        for (int r = 0; r < MR; r++)                                                          \
            for (int j = 0; j < NR; j++) c[r * ldc + j] = acc[r][j];                          \
    }
#endif

/* This instantiation's shapes: the SIMD ones for float where there are, else the portable
 * ones. PE_SHAPE_<i> expands to kernel, MR, NR of shape i. */
#undef PE_SHAPE_LIST
#undef PE_SHAPE_0
#undef PE_SHAPE_1
#undef PE_SHAPE_2
#undef PE_MICRO
#undef PE_MR
#undef PE_NR
#if PE_TSIZE == 4 && defined(PE_SIMD_0)
#define PE_SHAPE_LIST PE_SIMD_SHAPES
#define PE_SHAPE_0 PE_SIMD_0
#define PE_SHAPE_1 PE_SIMD_1
#define PE_SHAPE_2 PE_SIMD_2
#else
PE_MICRO_C(PE_S(pe_gemm_micro_4x8), 4, 8)
PE_MICRO_C(PE_S(pe_gemm_micro_8x4), 8, 4)
PE_MICRO_C(PE_S(pe_gemm_micro_2x16), 2, 16)
#define PE_SHAPE_LIST {{4, 8}, {8, 4}, {2, 16}}
#define PE_SHAPE_0 PE_S(pe_gemm_micro_4x8), 4, 8
#define PE_SHAPE_1 PE_S(pe_gemm_micro_8x4), 8, 4
#define PE_SHAPE_2 PE_S(pe_gemm_micro_2x16), 2, 16
#endif
#ifndef PE_GEMM_SHAPES
#define PE_GEMM_SHAPES 3
#define PE_ARG0(k, m, n) k
#define PE_ARG1(k, m, n) m
#define PE_ARG2(k, m, n) n
#define PE_ARGS0(x) PE_ARG0(x)
#define PE_ARGS1(x) PE_ARG1(x)
#define PE_ARGS2(x) PE_ARG2(x)
#endif
#define PE_MICRO PE_ARGS0(PE_SHAPE_0)
#define PE_MR PE_ARGS1(PE_SHAPE_0)
#define PE_NR PE_ARGS2(PE_SHAPE_0)
