/* The fused batch norm + hardtanh kernels against the unfused ones they replace, in float
 * and double on random shapes (rows of 1-300 elements, 1-5 images, 1-9 channels; values on
 * both sides of the bounds, a NaN now and then): pe_batch_norm_hardtanh equals
 * pe_batch_norm then the clip, and pe_batch_norm_hardtanh_grad equals pe_hardtanh_grad of
 * the clipped output then pe_batch_norm_grad, bit for bit (the same operations in the same
 * order), and pe_batch_norm_apply of the saved statistics equals pe_batch_norm's output,
 * clipped or not; then rows of 1024 elements and more (the gradient keeps gy in gx between
 * its passes) and channels of up to 12 images. Both gradients given no gx (nothing reads
 * it) give the same gw and gb. Prints "ok <cases>" and exits 0, or names
 * each case that differs and exits 1.
 * tests/test_c_norm.py builds it with the backend's flags, portably, with the address and
 * undefined-behaviour sanitizers, and for aarch64 (run under qemu). */
#include <stdio.h>
#include <stdlib.h>
#include "pe_kernels.h"
#include "elementwise.h"

static unsigned s_ = 7;
static int rnd(int n) { s_ = s_ * 1103515245u + 12345u; return (int)((s_ >> 8) % (unsigned)n); }

#define CHECK(T, S)                                                                          \
    static int check_##S(long N, long C, long L, int nan) {                                  \
        long n = N * C * L;                                                                  \
        T *x = malloc(sizeof(T) * n), *g = malloc(sizeof(T) * n), *y = malloc(sizeof(T) * n); \
        T *z = malloc(sizeof(T) * n), *hg = malloc(sizeof(T) * n), *gx = malloc(sizeof(T) * n); \
        T *gx2 = malloc(sizeof(T) * n), w[16], b[16], m[16], v[16], m2[16], v2[16];            \
        T gw[16], gb[16], gw2[16], gb2[16];                                                  \
        for (long i = 0; i < n; i++) {                                                       \
            x[i] = (T)(rnd(4000) / 1000.0 - 2.0);                                            \
            g[i] = (T)(rnd(2000) / 1000.0 - 1.0);                                            \
        }                                                                                    \
        if (nan) x[rnd((int)n)] = (T)NAN;                                                    \
        for (long c = 0; c < C; c++) {                                                       \
            w[c] = (T)(rnd(3000) / 1000.0 - 1.0);                                            \
            b[c] = (T)(rnd(2000) / 1000.0);                                                  \
        }                                                                                    \
        pe_batch_norm_##S(x, w, b, y, m, v, N, C, L, 1e-5);                                  \
        pe_batch_norm_apply_##S(x, w, b, m, v, z, N, C, L, 1e-5, 0, 0.0, 0.0);               \
        int bad = memcmp(y, z, sizeof(T) * n);                                               \
        for (long i = 0; i < n; i++) y[i] = pe_clip_##S(y[i], (T)0, (T)1.5);                 \
        pe_batch_norm_apply_##S(x, w, b, m, v, z, N, C, L, 1e-5, 1, 0.0, 1.5);               \
        bad |= memcmp(y, z, sizeof(T) * n);                                                  \
        pe_batch_norm_hardtanh_##S(x, w, b, z, m2, v2, N, C, L, 1e-5, 0.0, 1.5);             \
        for (long i = 0; i < n; i++) hg[i] = pe_hardtanh_grad_##S(g[i], y[i], (T)0, (T)1.5); \
        pe_batch_norm_grad_##S(hg, x, w, m, v, gx, gw, gb, N, C, L, 1e-5);                   \
        pe_batch_norm_hardtanh_grad_##S(g, x, w, b, m, v, gx2, gw2, gb2, N, C, L, 1e-5, 0.0,  \
                                        1.5);                                                \
        bad |= memcmp(y, z, sizeof(T) * n) || memcmp(m, m2, sizeof(T) * C) ||            \
                  memcmp(v, v2, sizeof(T) * C) || memcmp(gx, gx2, sizeof(T) * n) ||          \
                  memcmp(gw, gw2, sizeof(T) * C) || memcmp(gb, gb2, sizeof(T) * C);          \
        /* gx NULL (unread): the same gw and gb */                                           \
        pe_batch_norm_grad_##S(hg, x, w, m, v, NULL, gw2, gb2, N, C, L, 1e-5);               \
        bad |= memcmp(gw, gw2, sizeof(T) * C) || memcmp(gb, gb2, sizeof(T) * C);             \
        pe_batch_norm_hardtanh_grad_##S(g, x, w, b, m, v, NULL, gw2, gb2, N, C, L, 1e-5, 0.0, \
                                        1.5);                                                \
        bad |= memcmp(gw, gw2, sizeof(T) * C) || memcmp(gb, gb2, sizeof(T) * C);             \
        if (bad) printf(#S " differs: N%ld C%ld L%ld nan%d\n", N, C, L, nan);                 \
        free(x), free(g), free(y), free(z), free(hg), free(gx), free(gx2);                   \
        return bad;                                                                          \
    }
CHECK(float, f32)
CHECK(double, f64)

/* count random shapes, N in [1, n], C in [1, c], L in [l0, l0 + l): both element types,
 * every nan_every-th with NaN inputs; adds the cases run to *cases. */
static int random_cases(int count, int n, int c, int l0, int l, int nan_every, int *cases) {
    int bad = 0;
    for (int it = 0; it < count; it++) {
        long N = 1 + rnd(n), C = 1 + rnd(c), L = l0 + rnd(l);
        int nan = it % nan_every == 0;
        bad |= check_f32(N, C, L, nan);
        bad |= check_f64(N, C, L, nan);
        *cases += 2;
    }
    return bad;
}

int main(void) {
    int cases = 0, bad = 0;
    bad |= random_cases(200, 5, 9, 1, 300, 17, &cases);
    /* Rows on both sides of PE_BN_KEEP (1024: from there the masked gradient waits in gx
     * for the second pass) and channels of many images. */
    long edges[][3] = {{8, 3, 256}, {8, 3, 257}, {1, 2, 2048}, {2, 2, 1024}, {3, 2, 1023}};
    for (int e = 0; e < 5; e++) {
        bad |= check_f32(edges[e][0], edges[e][1], edges[e][2], e == 1);
        bad |= check_f64(edges[e][0], edges[e][1], edges[e][2], e == 3);
        cases += 2;
    }
    bad |= random_cases(30, 12, 4, 150, 1500, 7, &cases);
    if (!bad) printf("ok %d\n", cases);
    return bad;
}
