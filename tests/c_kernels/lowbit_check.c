/* Checks of the low-bit GEMM (kernels/lowbit_gemm.c), built by tests/test_c_lowbit_gemm.py
 * under each micro-kernel (native, AVX2, portable, aarch64 NEON under qemu). Prints one
 * line per failure and "ok N" at the end; exits 1 on any failure.
 *
 * For every scheme (int8, int4 with offsets, int4_sym), f16 and float scales, groups of
 * 32, 64 and a whole row, both orientations (x W^T and x W), accumulating or not, on
 * shapes with partial panels, partial slivers, k blocks cut inside a group and a first
 * row other than 0: pe_dequantize equals the scalar formula bit for bit (the SIMD groups
 * included), and pe_qgemm equals pe_gemm on the matrix pe_dequantize makes, bit for bit,
 * in float and double (the double build reads float scales only). */
#include "pe_kernels.h"
#include <stdio.h>
#include <stdlib.h>

static int failures = 0, checks = 0;

static unsigned long mix(unsigned long h) {
    h ^= h >> 13;
    h *= 0x5bd1e995UL;
    h ^= h >> 15;
    return h;
}

#define DEFINE_CHECK(S, T)                                                                     \
    static void check_##S(int scheme, int half, long group, long rows, long cols, long M,      \
                          long row0, long nrows, int transpose, int acc) {                     \
        long groups = rows * cols / group, width = scheme == PE_Q_INT8 ? cols : cols / 2;      \
        unsigned char *codes = malloc((size_t)(rows * width));                                 \
        for (long i = 0; i < rows * width; i++) codes[i] = (unsigned char)mix((unsigned long)i + 7u); \
        size_t ss = half ? sizeof(uint16_t) : sizeof(T);                                       \
        unsigned char *scales = malloc(ss * (size_t)groups), *offsets = malloc(ss * (size_t)groups); \
        for (long g = 0; g < groups; g++) {                                                    \
            unsigned long h = mix((unsigned long)g * 31u + 5u);                                \
            if (half) {                                                                        \
                ((uint16_t *)scales)[g] = (uint16_t)(0x1C00u | (h & 0x0FFFu));                 \
                ((uint16_t *)offsets)[g] = (uint16_t)(0x9C00u | ((h >> 12) & 0x0FFFu));        \
            } else {                                                                           \
                ((T *)scales)[g] = (T)((double)(h % 1000) / 9000.0 + 0.001);                   \
                ((T *)offsets)[g] = (T)(-(double)((h >> 10) % 1000) / 7000.0);                 \
            }                                                                                  \
        }                                                                                      \
        const void *offs = scheme == PE_Q_INT4 ? offsets : NULL;                               \
        T *w = malloc(sizeof(T) * (size_t)(rows * cols));                                     \
        pe_dequantize_##S(codes, scales, offs, scheme, half, groups, group, w);                \
        checks++;                                                                              \
        for (long i = 0; i < rows * cols; i++) { /* the scalar formula, operation by operation */ \
            long g = i / group, e = i % group;                                                 \
            T sc = half ? (T)pe_half_to_float(((uint16_t *)scales)[g]) : ((T *)scales)[g];     \
            T of = half ? (T)pe_half_to_float(((uint16_t *)offsets)[g]) : ((T *)offsets)[g];   \
            const unsigned char *b = codes + g * (group / 2);                                  \
            T code = scheme == PE_Q_INT8 ? (T)(signed char)codes[i]                            \
                     : (T)(e < group / 2 ? b[e] & 0x0F : b[e - group / 2] >> 4);                \
            T ref = scheme == PE_Q_INT8 ? code * sc                                            \
                    : scheme == PE_Q_INT4 ? code * sc + of : (code - (T)8) * sc;               \
            if (memcmp(&ref, &w[i], sizeof(T)) != 0) {                                         \
                failures++;                                                                    \
                fprintf(stderr, #S " dequantize scheme %d half %d group %ld element %ld\n",   \
                        scheme, half, group, i);                                               \
                break;                                                                         \
            }                                                                                  \
        }                                                                                      \
        pe_qmat q = {codes, scales, offs, scheme, half, group, rows, cols};                    \
        long K = transpose ? cols : nrows, N = transpose ? nrows : cols;                       \
        T *x = malloc(sizeof(T) * (size_t)(M * K));                                            \
        T *got = malloc(sizeof(T) * (size_t)(M * N)), *want = malloc(sizeof(T) * (size_t)(M * N)); \
        for (long i = 0; i < M * K; i++) x[i] = (T)((double)(mix((unsigned long)i) % 2001) / 1000.0 - 1.0); \
        for (long i = 0; i < M * N; i++) got[i] = want[i] = (T)((double)(i % 7) - 3.0);      \
        pe_qgemm_##S(M, N, K, x, K, &q, row0, transpose, got, N, acc);                         \
        if (transpose)                                                                         \
            pe_gemm_##S(M, N, K, x, K, 0, w + row0 * cols, cols, 1, want, N, acc);              \
        else                                                                                   \
            pe_gemm_##S(M, N, K, x, K, 0, w + row0 * cols, cols, 0, want, N, acc);              \
        checks++;                                                                              \
        if (memcmp(got, want, sizeof(T) * (size_t)(M * N)) != 0) {                             \
            failures++;                                                                        \
            fprintf(stderr, #S " scheme %d half %d group %ld %ldx%ld M %ld row0 %ld rows %ld " \
                    "transpose %d acc %d differs\n", scheme, half, group, rows, cols, M, row0,   \
                    nrows, transpose, acc);                                                     \
        }                                                                                      \
        free(codes); free(scales); free(offsets); free(w); free(x); free(got); free(want);     \
    }

DEFINE_CHECK(f32, float)
DEFINE_CHECK(f64, double)

int main(void) {
    static const long shapes[][3] = {{37, 320, 19}, {16, 256, 6}, {5, 64, 1}, {70, 576, 64},
                                     {33, 96, 13}};
    for (int scheme = 0; scheme < 3; scheme++)
        for (int half = 0; half < 2; half++)
            for (int gi = 0; gi < 3; gi++)
                for (int s = 0; s < 5; s++) {
                    long rows = shapes[s][0], cols = shapes[s][1], M = shapes[s][2];
                    long group = gi == 0 ? 32 : gi == 1 ? 64 : cols;
                    if (cols % group || group % 2) continue;
                    for (int t = 0; t < 2; t++)
                        for (int acc = 0; acc < 2; acc++) {
                            long row0 = rows > 4 ? 3 : 0, n = rows - row0 - (rows > 8 ? 2 : 0);
                            check_f32(scheme, half, group, rows, cols, M, row0, n, t, acc);
                            if (!half) check_f64(scheme, 0, group, rows, cols, M, row0, n, t, acc);
                        }
                }
    if (failures) {
        printf("%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d\n", checks);
    return 0;
}
