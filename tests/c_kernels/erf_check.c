/* pe_erf32 and pe_gauss32 (elementwise.h's float erf and exp(-x^2 / 2), which GELU and its
 * gradient use) against libm's double erf and exp: every STEP-th float in [0, 4.5] (erf) or
 * [0, 20] (exp(-x^2 / 2)) and its negative within 1 ulp of the correctly rounded value (for
 * a subnormal result, one subnormal step), erf odd and exp(-x^2 / 2) even exactly, the
 * specials (+-0, subnormals, +-inf, NaN, huge), and the float GELU and its gradient, in a
 * loop the compiler vectorises, within 4 ulp-scaled relative error of the double formulas
 * over [-12, 12].
 * Prints "ok <floats checked>" and exits 0, or names each failure and exits 1.
 * tests/test_c_erf.py builds it with the backend's flags, portably, with the address and
 * undefined-behaviour sanitizers, and for aarch64 (run under qemu). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "pe_kernels.h"
#include "elementwise.h"

#ifndef STEP
#define STEP 61u
#endif

static float from_bits(uint32_t b) { float f; memcpy(&f, &b, sizeof f); return f; }

static int bad = 0;

static void fail(const char *what, float x, double got, double want) {
    if (bad++ < 20) printf("%s(%.9g) = %.9g, want %.9g\n", what, (double)x, got, want);
}

/* |got - want| in units of the float spacing at want */
static double ulps(float got, double want) {
    float w = (float)want;
    double sp = (double)nextafterf(fabsf(w), INFINITY) - (double)fabsf(w);
    return fabs((double)got - want) / sp;
}

int main(void) {
    long n = 0;
    const uint32_t top = 0x40900000u; /* 4.5f */
    for (uint32_t b = 0; b <= top; b += STEP, n++) {
        float x = from_bits(b);
        float got = pe_erf32(x), neg = pe_erf32(-x);
        double want = erf((double)x);
        if (ulps(got, want) > 1.0) fail("erf", x, got, want);
        if (neg != -got) fail("erf odd", -x, neg, -(double)got);
    }
    for (uint32_t b = 0; b <= 0x41a00000u; b += STEP, n++) { /* 20.0f */
        float x = from_bits(b);
        float got = pe_gauss32(x), neg = pe_gauss32(-x);
        double want = exp(-0.5 * (double)x * (double)x);
        if (want < FLT_MIN ? fabs(got - want) > FLT_TRUE_MIN : ulps(got, want) > 1.0)
            fail("gauss", x, got, want);
        if (neg != got) fail("gauss even", -x, neg, got);
    }
    if (pe_gauss32(INFINITY) != 0 || pe_gauss32(-INFINITY) != 0 || pe_gauss32(NAN) != 0 ||
        pe_gauss32(FLT_MAX) != 0 || pe_gauss32(0) != 1)
        fail("gauss special", INFINITY, pe_gauss32(INFINITY), 0);
    const float special[] = {0.0f, FLT_TRUE_MIN, FLT_MIN, 1e-30f, 3.925f, 3.93f, 10.0f,
                             1e30f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof special / sizeof *special; i++, n++) {
        float x = special[i];
        for (int s = 0; s < 2; s++, x = -x) {
            float got = pe_erf32(x);
            double want = erf((double)x);
            if ((float)want != got || signbit(got) != signbit(x)) fail("erf special", x, got, want);
        }
    }
    if (!isnan(pe_erf32(NAN)) || !isnan(pe_gelu_f32(NAN, 0)) || !isnan(pe_gelu_grad_f32(1, NAN, 0)))
        fail("NaN in", NAN, 0, NAN);

    enum { M = 96001 };
    float *x = malloc(sizeof(float) * M), *y = malloc(sizeof(float) * M);
    float *g = malloc(sizeof(float) * M);
    if (!x || !y || !g) return 2;
    for (long i = 0; i < M; i++) x[i] = (float)(-12.0 + 24.0 * (double)i / (M - 1));
    for (long i = 0; i < M; i++) y[i] = pe_gelu_f32(x[i], 0);
    for (long i = 0; i < M; i++) g[i] = pe_gelu_grad_f32(1.0f, x[i], 0);
    for (long i = 0; i < M; i++, n++) {
        double xd = x[i], cdf = 0.5 * (1.0 + erf(xd * 0.7071067811865476));
        double gy = xd * cdf, gg = cdf + xd * exp(-0.5 * xd * xd) * 0.3989422804014327;
        /* the float formula's own roundings: a few ulp of the terms it adds */
        if (fabs(y[i] - gy) > 4 * FLT_EPSILON * fabs(xd) + FLT_TRUE_MIN)
            fail("gelu", x[i], y[i], gy);
        if (fabs(g[i] - gg) > 4 * FLT_EPSILON * (1.0 + fabs(xd) * 0.4))
            fail("gelu_grad", x[i], g[i], gg);
    }
    free(x), free(y), free(g);
    if (bad) {
        printf("%d failures\n", bad);
        return 1;
    }
    printf("ok %ld\n", n);
    return 0;
}
