/* Checks of the loss head's merged kernel with the weight gradient (kernels/loss_once.c,
 * reached through loss.c's pe_linear_log_softmax_gather_with_grad), built by
 * tests/test_c_loss_once.py natively, portably, with the sanitizers and for aarch64 under
 * qemu. Prints one line per failure and "ok N" at the end; exits 1 on any failure.
 *
 * Over shapes where the logits fit in gw's buffer (rows <= K: loss_once.c) and where they
 * do not (rows > K, or more rows than its stack copy: loss.c's two passes), both weight
 * layouts, with and without a bias and the input gradient, a vocabulary of one tile, of
 * whole tiles and with a short last tile, int64 and int32 targets, one target out of
 * range (picked NaN, the rest finite) and masked rows (gp and scale 0): picked, lse, gx,
 * gw and gb equal a double-precision reference within float32 (1e-4 of the largest
 * entry) or float64 (1e-10) tolerance; with OpenMP, two threads give the same bits as
 * one. */
#include "pe_kernels.h"
#include <stdio.h>
#include <stdlib.h>

#include "check_draw.h"

static int failures = 0, checks = 0;

/* Within tol of the largest |want| (NaN where want is NaN). */
static void near(const double *want, const void *got, int f32, long n, double tol,
                 const char *what, long rows, long K, long V, int major) {
    double g;
    long i = first_off(want, got, f32, n, tol, &g);
    checks++;
    if (i < 0)
        return;
    failures++;
    fprintf(stderr, "%s %s rows %ld K %ld V %ld major %d [%ld]: %.9g, want %.9g\n",
            f32 ? "f32" : "f64", what, rows, K, V, major, i, g, want[i]);
}

typedef struct {
    long rows, K, V;
    int major, bias, grad_x, wide;
} shape;

/* The double reference of every output, from the inputs as the kernel reads them. */
static void reference(const shape *s, const double *x, const double *w, const double *b,
                      const long *t, const double *gp, const double *sc, double *picked,
                      double *lse, double *gx, double *gw, double *gb) {
    long R = s->rows, K = s->K, V = s->V;
    double *z = malloc(sizeof(double) * (size_t)V);
    for (long i = 0; i < K * V; i++) gw[i] = 0;
    for (long j = 0; j < V; j++) gb[j] = 0;
    for (long r = 0; r < R; r++) {
        double m = -INFINITY, total = 0;
        for (long j = 0; j < V; j++) {
            double acc = b ? b[j] : 0;
            for (long k = 0; k < K; k++) acc += x[r * K + k] * w[s->major ? j * K + k : k * V + j];
            z[j] = acc, m = acc > m ? acc : m;
        }
        for (long j = 0; j < V; j++) total += exp(z[j] - m);
        lse[r] = m + log(total);
        picked[r] = t[r] >= 0 && t[r] < V ? z[t[r]] - lse[r] : NAN;
        for (long k = 0; k < K; k++) gx[r * K + k] = 0;
        for (long j = 0; j < V; j++) {
            double d = sc[r] * exp(z[j] - lse[r]) + (j == t[r] ? gp[r] : 0);
            gb[j] += d;
            for (long k = 0; k < K; k++) {
                double wk = w[s->major ? j * K + k : k * V + j];
                gx[r * K + k] += d * wk;
                gw[s->major ? j * K + k : k * V + j] += d * x[r * K + k];
            }
        }
    }
    free(z);
}

#define DEFINE_CHECK(S, T, TOL)                                                                \
    static void run_##S(const shape *s, const T *x, const T *w, const T *b, const void *index,  \
                        const T *gp, const T *sc, T *out) {                                    \
        long R = s->rows, K = s->K, V = s->V;                                                  \
        pe_linear_log_softmax_gather_with_grad_##S(gp, sc, x, w, index, s->wide, b, out,       \
                                                   out + R, s->grad_x ? out + 2 * R : NULL,    \
                                                   out + 2 * R + R * K, b ? out + 2 * R + R * K + K * V : NULL, \
                                                   R, K, V, s->major);                         \
    }                                                                                          \
    static void check_##S(const shape *s) {                                                    \
        long R = s->rows, K = s->K, V = s->V, n = 2 * R + R * K + K * V + V;                   \
        double *dx = malloc(sizeof(double) * (size_t)(R * K)), *dw = malloc(sizeof(double) * (size_t)(K * V)); \
        double *db = malloc(sizeof(double) * (size_t)V), *dgp = malloc(sizeof(double) * (size_t)R); \
        double *dsc = malloc(sizeof(double) * (size_t)R), *ref = malloc(sizeof(double) * (size_t)n); \
        long *t = malloc(sizeof(long) * (size_t)R);                                            \
        T *x = malloc(sizeof(T) * (size_t)(R * K)), *w = malloc(sizeof(T) * (size_t)(K * V));   \
        T *b = malloc(sizeof(T) * (size_t)V), *gp = malloc(sizeof(T) * (size_t)R);              \
        T *sc = malloc(sizeof(T) * (size_t)R), *out = malloc(sizeof(T) * (size_t)n);            \
        T *again = malloc(sizeof(T) * (size_t)n);                                              \
        void *index = malloc(sizeof(int64_t) * (size_t)R);                                     \
        for (long i = 0; i < R * K; i++) x[i] = (T)(2 * draw((unsigned long)i, 1)), dx[i] = (double)x[i]; \
        for (long i = 0; i < K * V; i++) w[i] = (T)(draw((unsigned long)i, 2) / 2), dw[i] = (double)w[i]; \
        for (long j = 0; j < V; j++) b[j] = (T)draw((unsigned long)j, 3), db[j] = (double)b[j]; \
        for (long r = 0; r < R; r++) {                                                         \
            t[r] = (long)((draw((unsigned long)r, 4) + 1) / 2 * (double)(V - 1));              \
            if (r == 1) t[r] = V - 1;                                                          \
            if (r == 2 && R > 3) t[r] = V; /* out of range: picked NaN */                      \
            int masked = r % 5 == 4;                                                           \
            gp[r] = (T)(masked ? 0 : -1.0 / (double)R), sc[r] = (T)(masked ? 0 : 1.0 / (double)R); \
            dgp[r] = (double)gp[r], dsc[r] = (double)sc[r];                                    \
            if (s->wide) ((int64_t *)index)[r] = t[r];                                         \
            else ((int32_t *)index)[r] = (int32_t)t[r];                                        \
        }                                                                                      \
        reference(s, dx, dw, s->bias ? db : NULL, t, dgp, dsc, ref, ref + R, ref + 2 * R,      \
                  ref + 2 * R + R * K, ref + 2 * R + R * K + K * V);                           \
        run_##S(s, x, w, s->bias ? b : NULL, index, gp, sc, out);                              \
        int f32 = sizeof(T) == 4;                                                              \
        near(ref, out, f32, R, TOL, "picked", R, K, V, s->major);                              \
        near(ref + R, out + R, f32, R, TOL, "lse", R, K, V, s->major);                         \
        if (s->grad_x) near(ref + 2 * R, out + 2 * R, f32, R * K, TOL, "gx", R, K, V, s->major); \
        near(ref + 2 * R + R * K, out + 2 * R + R * K, f32, K * V, TOL, "gw", R, K, V, s->major); \
        if (s->bias) near(ref + n - V, out + n - V, f32, V, TOL, "gb", R, K, V, s->major);     \
        if (pe_set_threads(2) == 2) {                                                          \
            memcpy(again, out, sizeof(T) * (size_t)n);                                         \
            run_##S(s, x, w, s->bias ? b : NULL, index, gp, sc, again);                        \
            pe_set_threads(1);                                                                 \
            checks++;                                                                          \
            if (memcmp(again, out, sizeof(T) * (size_t)n)) {                                   \
                failures++;                                                                    \
                fprintf(stderr, #S " rows %ld K %ld V %ld: two threads differ\n", R, K, V);   \
            }                                                                                  \
        }                                                                                      \
        free(dx); free(dw); free(db); free(dgp); free(dsc); free(ref); free(t); free(x);       \
        free(w); free(b); free(gp); free(sc); free(out); free(again); free(index);             \
    }

DEFINE_CHECK(f32, float, 1e-4)
DEFINE_CHECK(f64, double, 1e-10)

/* With an argument (emulated and sanitized builds, where each product costs 10-50x): the
 * two largest shapes in their first variant only, the largest in float only. */
static int variants(int shape, int quick) {
    if (shape == 4) return quick ? 1 : 8;
    if (shape == 7) return quick ? 1 : 2;
    return 8;
}

int main(int argc, char **argv) {
    (void)argv;
    int quick = argc > 1;
    /* rows, K, V: in gw's buffer (rows <= K <= ...), then not (rows > K; rows > 512) */
    static const long shapes[][3] = {{1, 1, 1},     {5, 8, 130},     {37, 40, 300},
                                     {64, 64, 256}, {100, 120, 1000}, {3, 200, 129},
                                     {300, 24, 700}, {520, 530, 140}};
    pe_set_threads(1);
    for (int i = 0; i < 8; i++)
        for (int v = 0; v < variants(i, quick); v++) {
            shape s = {shapes[i][0], shapes[i][1], shapes[i][2], v & 1, (v >> 1) & 1,
                       (v >> 2) & 1, (v + i) & 1};
            check_f32(&s);
            if (!(quick && i == 7)) check_f64(&s);
        }
    if (failures) {
        printf("%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d\n", checks);
    return 0;
}
