/* Checks of the low-bit GEMM (kernels/lowbit_gemm.c), built by tests/test_c_lowbit_gemm.py
 * under each micro-kernel (native, AVX2, portable, aarch64 NEON under qemu). Prints one
 * line per failure and "ok N" at the end; exits 1 on any failure.
 *
 * For every scheme (int8, int4 with offsets, int4_sym), f16 and float scales, groups of
 * 32, 64 and a whole row, both orientations (x W^T and x W), accumulating or not, on
 * shapes with partial panels, partial slivers, k blocks cut inside a group, more rows of x
 * than one packed block and a first row other than 0: pe_dequantize equals the scalar formula bit for bit (the SIMD groups
 * included), and pe_qgemm equals pe_gemm on the matrix pe_dequantize makes, bit for bit,
 * in float and double (the double build reads float scales only). The fused loss head on
 * a low-bit [V, K] table (loss.c's pe_qlinear_*: forward, gradient, both merged) equals
 * the float kernels on the dequantised table bit for bit, over more rows than one chunk
 * and vocabulary tiles with a short last one. */
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

static int same(const void *a, const void *b, size_t bytes, const char *what, int scheme) {
    checks++;
    if (!memcmp(a, b, bytes)) return 1;
    failures++;
    fprintf(stderr, "loss head %s differs (scheme %d)\n", what, scheme);
    return 0;
}

#define DEFINE_LOSS_CHECK(S, T)                                                                \
    static void check_loss_##S(int scheme, int half) {                                         \
        enum { V = 300, K = 96, R = 600 };                                                     \
        long groups = V * K / 32, width = scheme == PE_Q_INT8 ? K : K / 2;                     \
        unsigned char *codes = malloc((size_t)(V * width));                                    \
        for (long i = 0; i < V * width; i++) codes[i] = (unsigned char)mix((unsigned long)i + 3u); \
        size_t ss = half ? sizeof(uint16_t) : sizeof(T);                                       \
        unsigned char *scales = malloc(ss * (size_t)groups), *offsets = malloc(ss * (size_t)groups); \
        for (long g = 0; g < groups; g++) {                                                    \
            unsigned long h = mix((unsigned long)g * 17u + 1u);                                \
            if (half) {                                                                        \
                ((uint16_t *)scales)[g] = (uint16_t)(0x2C00u | (h & 0x03FFu));                 \
                ((uint16_t *)offsets)[g] = (uint16_t)(0xAC00u | ((h >> 12) & 0x03FFu));        \
            } else {                                                                           \
                ((T *)scales)[g] = (T)((double)(h % 1000) / 4000.0 + 0.01);                    \
                ((T *)offsets)[g] = (T)(-(double)((h >> 10) % 1000) / 3000.0);                 \
            }                                                                                  \
        }                                                                                      \
        const void *offs = scheme == PE_Q_INT4 ? offsets : NULL;                               \
        pe_qmat q = {codes, scales, offs, scheme, half, 32, V, K};                             \
        T *w = malloc(sizeof(T) * V * K), *x = malloc(sizeof(T) * R * K);                      \
        T *gp = malloc(sizeof(T) * R), *sc = malloc(sizeof(T) * R);                            \
        T *out = malloc(sizeof(T) * 2 * (2 * R + R * K));                                      \
        T *got = out, *want = out + 2 * R + R * K;                                             \
        int64_t *index = malloc(sizeof(int64_t) * R);                                          \
        pe_dequantize_##S(codes, scales, offs, scheme, half, groups, 32, w);                   \
        for (long i = 0; i < R * K; i++) x[i] = (T)((double)(mix((unsigned long)i) % 2001) / 500.0 - 2.0); \
        for (long r = 0; r < R; r++) {                                                         \
            index[r] = (int64_t)(mix((unsigned long)r + 11u) % V);                             \
            gp[r] = (T)(-1.0 / R), sc[r] = (T)(r % 7 ? 1.0 / R : 0.0);                         \
        }                                                                                      \
        index[0] = V - 1, index[1] = 128;                                                      \
        T *gl = got + 2 * R, *wl = want + 2 * R;                                               \
        pe_qlinear_log_softmax_gather_with_grad_##S(gp, sc, x, &q, index, 1, got, got + R, gl, \
                                                    R, K, V);                                  \
        pe_linear_log_softmax_gather_with_grad_##S(gp, sc, x, w, index, 1, NULL, want,        \
                                                   want + R, wl, NULL, NULL, R, K, V, 1);     \
        same(got, want, sizeof(T) * (2 * R + R * K), #S " with_grad", scheme);                 \
        pe_qlinear_log_softmax_gather_grad_##S(gp, sc, x, &q, index, 1, want + R, gl, R, K, V); \
        pe_linear_log_softmax_gather_grad_##S(gp, sc, x, w, index, 1, want + R, NULL, wl, NULL, \
                                              NULL, R, K, V, 1);                               \
        same(gl, wl, sizeof(T) * R * K, #S " grad", scheme);                                   \
        pe_qlinear_log_softmax_gather_##S(x, &q, index, 1, got, got + R, R, K, V);             \
        pe_linear_log_softmax_gather_##S(x, w, index, 1, NULL, want, want + R, R, K, V, 1);    \
        same(got, want, sizeof(T) * 2 * R, #S " forward", scheme);                             \
        free(codes); free(scales); free(offsets); free(w); free(x); free(gp); free(sc);        \
        free(out); free(index);                                                                \
    }

DEFINE_LOSS_CHECK(f32, float)
DEFINE_LOSS_CHECK(f64, double)

/* With an argument (emulated builds, where each product costs 10-50x): the largest shape,
 * the only one whose x spans two packed blocks, in its first group size only, and the
 * transposed and accumulating variants together (both or neither), one loss head a scheme. */
int main(int argc, char **argv) {
    (void)argv;
    int quick = argc > 1;
    /* rows, cols of W, rows of x: the last has more rows of x than one packed block (528)
     * and K split in two blocks of 144 */
    static const long shapes[][3] = {{37, 320, 19}, {16, 256, 6}, {5, 64, 1}, {70, 576, 64},
                                     {33, 96, 13}, {40, 288, 545}};
    for (int scheme = 0; scheme < 3; scheme++)
        for (int half = 0; half < 2; half++)
            for (int gi = 0; gi < 3; gi++)
                for (int s = 0; s < 6; s++) {
                    long rows = shapes[s][0], cols = shapes[s][1], M = shapes[s][2];
                    long group = gi == 0 ? 32 : gi == 1 ? 64 : cols;
                    if (cols % group || group % 2 || (quick && s == 5 && gi > 0)) continue;
                    for (int t = 0; t < 2; t++)
                        for (int acc = 0; acc < 2; acc++) {
                            if (quick && acc != t) continue;
                            long row0 = rows > 4 ? 3 : 0, n = rows - row0 - (rows > 8 ? 2 : 0);
                            check_f32(scheme, half, group, rows, cols, M, row0, n, t, acc);
                            if (!half) check_f64(scheme, 0, group, rows, cols, M, row0, n, t, acc);
                        }
                }
    for (int scheme = 0; scheme < 3; scheme++) {
        if (quick) { /* one float loss head a scheme, the first with half-precision scales */
            check_loss_f32(scheme, scheme == 0);
            continue;
        }
        check_loss_f32(scheme, 1);
        check_loss_f32(scheme, 0);
        check_loss_f64(scheme, 0);
    }
    if (failures) {
        printf("%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d\n", checks);
    return 0;
}
