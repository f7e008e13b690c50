/* pe_exp32 (kernels/pe_exp.h) against libm's double exp: on every STEP-th float in
 * [-110, 100] (both signs' bit patterns walked), the result within 1 ulp of the exact value
 * where the target fuses multiply-adds, 1.05 ulp where it does not (float's spacing at the
 * result; subnormals at the least subnormal), and the specials exact: exp(0) = 1,
 * exp(-inf) = 0, exp(inf) = inf, NaN through, 0 far below, inf above 88.73. The vectorised
 * loop (f below) gives the scalar call's bits.
 * Prints "ok N" (N: cases checked) or the first failure. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "pe_exp.h"

#if PE_HAS_FMA
#define PE_EXP_ULPS 1.0
#else
#define PE_EXP_ULPS 1.05
#endif

#ifndef STEP
#define STEP 61u
#endif

static void f(const float *restrict x, float *restrict y, long n) {
    for (long i = 0; i < n; i++) y[i] = pe_exp32(x[i]);
}

static double spacing(double exact) {
    if (exact < 0x1p-126) return 0x1p-149;
    float lo = (float)exact;
    if ((double)lo > exact) lo = nextafterf(lo, 0.0f);
    return (double)nextafterf(lo, INFINITY) - (double)lo;
}

static int check(float x, float got, long *count) {
    ++*count;
    double exact = exp((double)x);
    if (exact > 0x1.fffffep127 * (1 + 0x1p-25)) return isinf(got) ? 0 : 1;
    double err = fabs((double)got - exact) / spacing(exact);
    if (!(err <= PE_EXP_ULPS)) {
        printf("x=%a got=%a exact=%a err=%.6f ulp\n", (double)x, (double)got, exact, err);
        return 1;
    }
    return 0;
}

int main(void) {
    long count = 0;
    enum { CHUNK = 4096 };
    static float xs[CHUNK], ys[CHUNK];
    for (int sign = 0; sign < 2; sign++) {
        uint32_t top = sign ? 0x42dc0000u : 0x42c80000u; /* 110, 100 */
        for (uint32_t u = 0; u <= top;) {
            int n = 0;
            for (; n < CHUNK && u <= top; n++, u += STEP) {
                uint32_t bits = u | (sign ? 0x80000000u : 0u);
                memcpy(&xs[n], &bits, sizeof bits);
            }
            f(xs, ys, n);
            for (int i = 0; i < n; i++) {
                if (ys[i] != pe_exp32(xs[i]) && !(isnan(ys[i]) && isnan(pe_exp32(xs[i])))) {
                    printf("loop and call differ at %a\n", (double)xs[i]);
                    return 1;
                }
                if (check(xs[i], ys[i], &count)) return 1;
            }
        }
    }
    float specials[][2] = {{0.0f, 1.0f}, {-0.0f, 1.0f}, {-INFINITY, 0.0f},
                           {INFINITY, INFINITY}, {-200.0f, 0.0f}, {-1e30f, 0.0f},
                           {89.0f, INFINITY}, {1e30f, INFINITY}};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++, count++)
        if (pe_exp32(specials[i][0]) != specials[i][1]) {
            printf("exp(%a) = %a\n", (double)specials[i][0], (double)pe_exp32(specials[i][0]));
            return 1;
        }
    count++;
    if (!isnan(pe_exp32(NAN))) return printf("NaN lost\n"), 1;
    printf("ok %ld\n", count);
    return 0;
}
