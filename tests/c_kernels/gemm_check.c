/* Checks of the C backend's GEMM (kernels/linalg.c), built by tests/test_c_gemm.py under
 * each micro-kernel (native, AVX2, portable, aarch64 NEON under qemu) with and without
 * OpenMP. Prints one line per failure and "ok N" at the end; exits 1 on any failure.
 *
 *  - every transposition case, accumulating or not, float and double, on shapes with
 *    edges in every direction, against a double reference (error within a bound of the
 *    sum of |a||b| products: a product dropped or counted twice exceeds it);
 *  - a block of C computed alone equals the same elements of the whole product, bit for
 *    bit (edge tiles and full tiles sum in the same order, wherever a run of packed
 *    slivers of B starts), and one thread equals two; shapes such as 30 x 2000 x 16 cross
 *    several runs of slivers;
 *  - images side by side (pe_gemm_images) and a k axis split across images (the
 *    pointwise convolution's weight gradient) equal the per-image products bit for bit;
 *  - all of it under each of the build's micro-kernel shapes (pe_gemm_shape), and every
 *    shape's product equals the default shape's bit for bit. */
#include "pe_kernels.h"
#include <stdio.h>
#include <stdlib.h>

static int failures = 0, checks = 0;

#define FAIL(...)                     \
    do {                              \
        failures++;                   \
        fprintf(stderr, __VA_ARGS__); \
        fprintf(stderr, "\n");        \
    } while (0)

static double value(long i, long salt) {
    unsigned long h = (unsigned long)(i * 2654435761L + salt * 40503L);
    h ^= h >> 13;
    h *= 0x5bd1e995UL;
    h ^= h >> 15;
    return (double)(h % 2001) / 1000.0 - 1.0;
}

#define DEFINE_CHECKS(S, T, TOL)                                                               \
    static void fill_##S(T *x, long n, long salt) {                                            \
        for (long i = 0; i < n; i++) x[i] = (T)value(i, salt);                                 \
    }                                                                                          \
    static void check_case_##S(long M, long N, long K, int ta, int tb, int acc) {              \
        long lda = ta ? M + 3 : K + 1, ldb = tb ? K + 2 : N + 5, ldc = N + 7;                  \
        T *A = malloc(sizeof(T) * (size_t)((ta ? K : M) * lda + 1));                           \
        T *B = malloc(sizeof(T) * (size_t)((tb ? N : K) * ldb + 1));                           \
        T *C = malloc(sizeof(T) * (size_t)(M * ldc + 1));                                      \
        fill_##S(A, (ta ? K : M) * lda, 1);                                                    \
        fill_##S(B, (tb ? N : K) * ldb, 2);                                                    \
        fill_##S(C, M * ldc, 3);                                                               \
        T *C0 = malloc(sizeof(T) * (size_t)(M * ldc + 1));                                     \
        memcpy(C0, C, sizeof(T) * (size_t)(M * ldc));                                          \
        pe_gemm_##S(M, N, K, A, lda, ta, B, ldb, tb, C, ldc, acc);                             \
        checks++;                                                                              \
        for (long i = 0; i < M; i++)                                                           \
            for (long j = 0; j < ldc; j++) {                                                   \
                if (j >= N) {                                                                  \
                    if (C[i * ldc + j] != C0[i * ldc + j])                                     \
                        FAIL(#S " %ldx%ldx%ld ta%d tb%d: wrote outside C at (%ld,%ld)", M, N, \
                             K, ta, tb, i, j);                                                 \
                    continue;                                                                  \
                }                                                                              \
                double ref = acc ? (double)C0[i * ldc + j] : 0, mag = 0;                       \
                for (long k = 0; k < K; k++) {                                                 \
                    double a = ta ? A[k * lda + i] : A[i * lda + k];                           \
                    double b = tb ? B[j * ldb + k] : B[k * ldb + j];                           \
                    ref += a * b;                                                              \
                    mag += a * b < 0 ? -a * b : a * b;                                         \
                }                                                                              \
                double err = C[i * ldc + j] - ref;                                             \
                if (err < 0) err = -err;                                                       \
                if (err > TOL * (mag + 1)) {                                                   \
                    FAIL(#S " %ldx%ldx%ld ta%d tb%d acc%d: C(%ld,%ld) = %g, want %g", M, N, K, \
                         ta, tb, acc, i, j, (double)C[i * ldc + j], ref);                      \
                    i = M;                                                                     \
                    break;                                                                     \
                }                                                                              \
            }                                                                                  \
        free(A);                                                                               \
        free(B);                                                                               \
        free(C);                                                                               \
        free(C0);                                                                              \
    }                                                                                          \
    /* The block [i0, i0+m) x [j0, j0+n) of C computed alone equals the whole product's. */  \
    static void check_block_##S(long M, long N, long K, long i0, long m, long j0, long n) {    \
        T *A = malloc(sizeof(T) * (size_t)(M * K)), *B = malloc(sizeof(T) * (size_t)(K * N));  \
        T *C = malloc(sizeof(T) * (size_t)(M * N)), *D = calloc((size_t)(M * N), sizeof(T));    \
        fill_##S(A, M * K, 4);                                                                 \
        fill_##S(B, K * N, 5);                                                                 \
        pe_gemm_##S(M, N, K, A, K, 0, B, N, 0, C, N, 0);                                       \
        pe_gemm_##S(m, n, K, A + i0 * K, K, 0, B + j0, N, 0, D + i0 * N + j0, N, 0);           \
        checks++;                                                                              \
        for (long i = i0; i < i0 + m; i++)                                                     \
            for (long j = j0; j < j0 + n; j++)                                                 \
                if (C[i * N + j] != D[i * N + j]) {                                            \
                    FAIL(#S " block (%ld,%ld) of %ldx%ldx%ld differs from the whole", i, j, M, \
                         N, K);                                                                \
                    i = i0 + m;                                                                \
                    break;                                                                     \
                }                                                                              \
        if (pe_set_threads(0) > 1) {                                                           \
            int before = pe_set_threads(0);                                                    \
            pe_set_threads(1);                                                                 \
            pe_gemm_##S(M, N, K, A, K, 0, B, N, 0, D, N, 0);                                   \
            pe_set_threads(before);                                                            \
            checks++;                                                                          \
            if (memcmp(C, D, sizeof(T) * (size_t)(M * N)) != 0)                                \
                FAIL(#S " %ldx%ldx%ld: one thread differs from %d", M, N, K, before);          \
        }                                                                                      \
        free(A);                                                                               \
        free(B);                                                                               \
        free(C);                                                                               \
        free(D);                                                                               \
    }                                                                                          \
    /* Every micro-kernel shape computes the default shape's bits. */                        \
    static void check_shapes_##S(long M, long N, long K, int ta, int tb, int acc) {            \
        long lda = ta ? M : K, ldb = tb ? K : N;                                               \
        T *A = malloc(sizeof(T) * (size_t)(M * K + 1)), *B = malloc(sizeof(T) * (size_t)(K * N + 1)); \
        T *C = malloc(sizeof(T) * (size_t)(M * N + 1)), *D = malloc(sizeof(T) * (size_t)(M * N + 1)); \
        fill_##S(A, M * K, 8);                                                                 \
        fill_##S(B, K * N, 9);                                                                 \
        fill_##S(C, M * N, 10);                                                                \
        memcpy(D, C, sizeof(T) * (size_t)(M * N));                                             \
        int rows[8], cols[8], shapes = pe_gemm_shape_list_##S(rows, cols, 8), before = pe_gemm_shape; \
        pe_gemm_shape = 0;                                                                     \
        pe_gemm_##S(M, N, K, A, lda, ta, B, ldb, tb, C, N, acc);                               \
        for (int s = 1; s < shapes; s++) {                                                     \
            T *E = malloc(sizeof(T) * (size_t)(M * N + 1));                                    \
            memcpy(E, D, sizeof(T) * (size_t)(M * N));                                         \
            pe_gemm_shape = s;                                                                 \
            pe_gemm_##S(M, N, K, A, lda, ta, B, ldb, tb, E, N, acc);                           \
            checks++;                                                                          \
            if (memcmp(C, E, sizeof(T) * (size_t)(M * N)) != 0)                               \
                FAIL(#S " %ldx%ldx%ld ta%d tb%d: shape %dx%d differs from %dx%d", M, N, K, ta, \
                     tb, rows[s], cols[s], rows[0], cols[0]);                                  \
            free(E);                                                                           \
        }                                                                                      \
        pe_gemm_shape = before;                                                                \
        free(A);                                                                               \
        free(B);                                                                               \
        free(C);                                                                               \
        free(D);                                                                               \
    }                                                                                          \
    /* Images side by side and a k axis split across images equal per-image products. */    \
    static void check_images_##S(long count, long M, long HW, long K) {                        \
        T *W = malloc(sizeof(T) * (size_t)(M * K)), *X = malloc(sizeof(T) * (size_t)(count * K * HW)); \
        T *Y = malloc(sizeof(T) * (size_t)(count * M * HW)), *Z = malloc(sizeof(T) * (size_t)(count * M * HW)); \
        T *G = malloc(sizeof(T) * (size_t)(M * K)), *H = malloc(sizeof(T) * (size_t)(M * K));  \
        fill_##S(W, M * K, 6);                                                                 \
        fill_##S(X, count * K * HW, 7);                                                        \
        pe_gemm_images_##S(count, M, HW, K, W, K, 0, X, K * HW, Y, M * HW);                    \
        for (long n = 0; n < count; n++)                                                       \
            pe_gemm_##S(M, HW, K, W, K, 0, X + n * K * HW, HW, 0, Z + n * M * HW, HW, 0);      \
        checks++;                                                                              \
        if (memcmp(Y, Z, sizeof(T) * (size_t)(count * M * HW)) != 0)                           \
            FAIL(#S " images: %ld x [%ld, %ld] x %ld differs from per-image products", count,  \
                 M, HW, K);                                                                    \
        /* G[M, K] = sum_n Y[n] X[n]^T: k runs over count * HW, split at each image. */       \
        pe_layout la = {HW, 1, HW, M * HW, 2}, lb = {1, HW, HW, K * HW, 1}, lc = {K, 1, 0, 0, 0}; \
        pe_gemm_strided_##S(M, K, count * HW, Y, la, X, lb, G, lc, 0);                         \
        for (long n = 0; n < count; n++)                                                       \
            pe_gemm_##S(M, K, HW, Y + n * M * HW, HW, 0, X + n * K * HW, HW, 1, H, K, n > 0);  \
        checks++;                                                                              \
        if (memcmp(G, H, sizeof(T) * (size_t)(M * K)) != 0)                                    \
            FAIL(#S " k split over %ld images of %ld differs from accumulated products", count, \
                 HW);                                                                          \
        free(W);                                                                               \
        free(X);                                                                               \
        free(Y);                                                                               \
        free(Z);                                                                               \
        free(G);                                                                               \
        free(H);                                                                               \
    }

DEFINE_CHECKS(f32, float, 2e-6)
DEFINE_CHECKS(f64, double, 1e-14)

static void check_all(void) {
    static const long shapes[][3] = {{1, 1, 1},    {5, 7, 3},    {13, 33, 17},  {40, 4, 300},
                                     {37, 53, 300}, {64, 64, 64}, {70, 97, 290},  {7, 300, 260},
                                     {300, 40, 9},  {193, 65, 0},  {30, 2000, 16}, {29, 1501, 23},
                                     {13, 203, 530}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        for (int t = 0; t < 8; t++) {
            check_case_f32(shapes[s][0], shapes[s][1], shapes[s][2], t & 1, (t >> 1) & 1, t >> 2);
            check_case_f64(shapes[s][0], shapes[s][1], shapes[s][2], t & 1, (t >> 1) & 1, t >> 2);
        }
    check_block_f32(200, 97, 300, 37, 50, 13, 40);
    check_block_f32(500, 300, 700, 0, 12, 32, 32);
    check_block_f64(200, 97, 300, 37, 50, 13, 40);
    /* a block whose columns start and end inside runs of packed slivers */
    check_block_f32(30, 2000, 16, 5, 20, 1000, 700);
    check_block_f64(29, 1501, 23, 0, 29, 77, 1300);
    int before = pe_set_threads(0);
    pe_set_threads(2);
    check_block_f32(600, 400, 300, 101, 77, 3, 290);
    pe_set_threads(before);
    static const long images[][4] = {{3, 40, 16, 300}, {8, 24, 49, 96}, {5, 17, 4, 33}, {2, 64, 64, 64}};
    for (size_t s = 0; s < sizeof(images) / sizeof(images[0]); s++) {
        check_images_f32(images[s][0], images[s][1], images[s][2], images[s][3]);
        check_images_f64(images[s][0], images[s][1], images[s][2], images[s][3]);
    }
}

int main(void) {
    /* every check under each micro-kernel shape of the build */
    int rows[8], cols[8], shapes = pe_gemm_shape_list_f32(rows, cols, 8);
    if (shapes != pe_gemm_shape_list_f64(rows, cols, 8) || shapes < 1 || shapes > 8) {
        FAIL("the float and double GEMMs list %d and %d shapes", shapes,
             pe_gemm_shape_list_f64(rows, cols, 8));
        return 1;
    }
    for (int s = 0; s < shapes; s++) {
        pe_gemm_shape = s;
        check_all();
    }
    pe_gemm_shape = 0;
    static const long cases[][3] = {{1, 1, 1}, {5, 7, 3}, {13, 33, 17}, {25, 17, 300},
                                    {7, 65, 40}, {70, 97, 290}, {300, 40, 9}, {30, 2000, 16}};
    for (size_t s = 0; s < sizeof(cases) / sizeof(cases[0]); s++)
        for (int t = 0; t < 8; t++) {
            check_shapes_f32(cases[s][0], cases[s][1], cases[s][2], t & 1, (t >> 1) & 1, t >> 2);
            check_shapes_f64(cases[s][0], cases[s][1], cases[s][2], t & 1, (t >> 1) & 1, t >> 2);
        }
    if (failures) return 1;
    printf("ok %d\n", checks);
    return 0;
}
