/* Checks of the layer norm kernels (kernels/norm.c: pe_layer_norm, pe_layer_norm_grad),
 * built by tests/test_c_layer_norm.py natively, portably, with the sanitizers and for
 * aarch64 under qemu. Prints one line per failure and "ok N" at the end; exits 1 on any
 * failure.
 *
 * Over rows of 1 to 1000 columns (vector lanes, their flush into double every 1024
 * elements, short tails), with and without weight and bias, rows offset far from zero:
 * y, mean, rstd, gx, gw and gb equal a double-precision reference within float32 (2e-5 of
 * the largest entry; 1e-4 for gx, a difference of near-equal sums) or float64 (1e-11)
 * tolerance; with OpenMP, two threads give the same bits as one. */
#include "pe_kernels.h"
#include <stdio.h>
#include <stdlib.h>

#include "check_draw.h"

static int failures = 0, checks = 0;

/* Within tol of the largest |want| (NaN where want is NaN). */
static void near(const double *want, const void *got, int f32, long n, double tol,
                 const char *what, long rows, long cols) {
    double g;
    long i = first_off(want, got, f32, n, tol, &g);
    checks++;
    if (i < 0)
        return;
    failures++;
    fprintf(stderr, "%s %s rows %ld cols %ld [%ld]: %.9g, want %.9g\n",
            f32 ? "f32" : "f64", what, rows, cols, i, g, want[i]);
}

/* out: y, mean, rstd, gx, gw, gb of the inputs as the kernels read them. */
static void reference(long R, long C, const double *x, const double *w, const double *b,
                      const double *gy, double eps, double *out) {
    double *y = out, *mean = y + R * C, *rstd = mean + R, *gx = rstd + R, *gw = gx + R * C;
    double *gb = gw + C;
    for (long j = 0; j < C; j++) gw[j] = gb[j] = 0;
    for (long r = 0; r < R; r++) {
        const double *row = x + r * C, *g = gy + r * C;
        double mu = 0, var = 0, s1 = 0, s2 = 0;
        for (long j = 0; j < C; j++) mu += row[j] / (double)C;
        for (long j = 0; j < C; j++) var += (row[j] - mu) * (row[j] - mu) / (double)C;
        double rs = 1 / sqrt(var + eps);
        mean[r] = mu, rstd[r] = rs;
        for (long j = 0; j < C; j++) {
            double xh = (row[j] - mu) * rs, gh = g[j] * (w ? w[j] : 1);
            y[r * C + j] = xh * (w ? w[j] : 1) + (b ? b[j] : 0);
            s1 += gh / (double)C, s2 += gh * xh / (double)C;
            gw[j] += g[j] * xh, gb[j] += g[j];
        }
        for (long j = 0; j < C; j++) {
            double xh = (row[j] - mu) * rs, gh = g[j] * (w ? w[j] : 1);
            gx[r * C + j] = rs * (gh - s1 - xh * s2);
        }
    }
}

#define DEFINE_CHECK(S, T, TOL)                                                                \
    static void run_##S(long R, long C, const T *x, const T *w, const T *b, const T *gy,       \
                        T *out) {                                                              \
        T *y = out, *mean = y + R * C, *rstd = mean + R, *gx = rstd + R, *gw = gx + R * C;     \
        pe_layer_norm_##S(x, w, b, y, mean, rstd, R, C, 1e-5);                                 \
        pe_layer_norm_grad_##S(gy, x, w, mean, rstd, gx, w ? gw : NULL, b ? gw + C : NULL, R, C); \
    }                                                                                          \
    static void check_##S(long R, long C, int affine, double offset) {                         \
        long n = 2 * R * C + 2 * R + 2 * C;                                                    \
        double *dx = malloc(sizeof(double) * (size_t)(R * C)), *dg = malloc(sizeof(double) * (size_t)(R * C)); \
        double *dw = malloc(sizeof(double) * (size_t)C), *db = malloc(sizeof(double) * (size_t)C); \
        double *ref = malloc(sizeof(double) * (size_t)n);                                      \
        T *x = malloc(sizeof(T) * (size_t)(R * C)), *g = malloc(sizeof(T) * (size_t)(R * C));   \
        T *w = malloc(sizeof(T) * (size_t)C), *b = malloc(sizeof(T) * (size_t)C);               \
        T *out = calloc((size_t)n, sizeof(T)), *again = calloc((size_t)n, sizeof(T));          \
        for (long i = 0; i < R * C; i++) {                                                     \
            x[i] = (T)(offset * (double)(i / C % 3) + 3 * draw((unsigned long)i, 1));          \
            g[i] = (T)draw((unsigned long)i, 2), dx[i] = (double)x[i], dg[i] = (double)g[i];   \
        }                                                                                      \
        for (long j = 0; j < C; j++) {                                                         \
            w[j] = (T)(1 + draw((unsigned long)j, 3)), b[j] = (T)draw((unsigned long)j, 4);    \
            dw[j] = (double)w[j], db[j] = (double)b[j];                                        \
        }                                                                                      \
        reference(R, C, dx, affine ? dw : NULL, affine ? db : NULL, dg, 1e-5, ref);            \
        run_##S(R, C, x, affine ? w : NULL, affine ? b : NULL, g, out);                        \
        int f32 = sizeof(T) == 4;                                                              \
        near(ref, out, f32, R * C, TOL, "y", R, C);                                            \
        near(ref + R * C, out + R * C, f32, R, TOL, "mean", R, C);                             \
        near(ref + R * C + R, out + R * C + R, f32, R, TOL, "rstd", R, C);                     \
        near(ref + R * C + 2 * R, out + R * C + 2 * R, f32, R * C, 5 * TOL, "gx", R, C);       \
        if (affine) {                                                                          \
            near(ref + n - 2 * C, out + n - 2 * C, f32, C, TOL, "gw", R, C);                   \
            near(ref + n - C, out + n - C, f32, C, TOL, "gb", R, C);                           \
        }                                                                                      \
        if (pe_set_threads(2) == 2) {                                                          \
            run_##S(R, C, x, affine ? w : NULL, affine ? b : NULL, g, again);                  \
            pe_set_threads(1);                                                                 \
            checks++;                                                                          \
            if (memcmp(again, out, sizeof(T) * (size_t)n)) {                                   \
                failures++;                                                                    \
                fprintf(stderr, #S " rows %ld cols %ld: two threads differ\n", R, C);         \
            }                                                                                  \
        }                                                                                      \
        free(dx); free(dg); free(dw); free(db); free(ref); free(x); free(g); free(w); free(b); \
        free(out); free(again);                                                                \
    }

DEFINE_CHECK(f32, float, 2e-5)
DEFINE_CHECK(f64, double, 1e-11)

int main(void) {
    static const long shapes[][2] = {{1, 1}, {3, 7}, {5, 16}, {37, 33}, {64, 384},
                                     {300, 100}, {4, 1000}, {2, 2600}};
    pe_set_threads(1);
    for (int i = 0; i < 8; i++)
        for (int v = 0; v < 4; v++) {
            double offset = v & 2 ? 100 : 0;
            check_f32(shapes[i][0], shapes[i][1], v & 1, offset);
            check_f64(shapes[i][0], shapes[i][1], v & 1, offset);
        }
    if (failures) {
        printf("%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d\n", checks);
    return 0;
}
