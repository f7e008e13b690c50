/* pe_erf32 (elementwise.h's float erf, which the float GELU uses) against libm's double
 * erf: every STEP-th float in [0, 4.5] and its negative within 1 ulp of the correctly
 * rounded value, erf odd exactly, the specials exact. pe_gelu_parts32 (the float normal
 * distribution and density, which GELU's gradient uses) against libm's double erfc and
 * exp: on every STEP-th float of [0, 12.5] and its negative, Phi(x) within 8 ulp of the
 * correctly rounded value (relative, the lower tail too) and the density within 3 ulp (to
 * 13, where it is still a normal float), both 0 past 14.5 (Phi 1 above); the float GELU
 * (pe_gelu32 where the target fuses a * b + c) within 2 eps |x| of x Phi(x) on the same
 * grid; the specials; and the float GELU and its gradient, in a loop the compiler
 * vectorises, within 2 ulp-scaled relative error of the double formulas over [-12, 12],
 * equal to the scalar calls.
 * Prints "ok <floats checked>" and exits 0, or names each failure and exits 1.
 * tests/test_c_gelu.py builds it with the backend's flags, portably, with the address and
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
    float w = (float)fabs(want);
    if ((double)w > fabs(want)) w = nextafterf(w, 0.0f);
    double sp = (double)nextafterf(w, INFINITY) - (double)w;
    return fabs((double)got - want) / sp;
}

static void gelu_loop(const float *restrict x, float *restrict y, float *restrict g, long n) {
    for (long i = 0; i < n; i++) y[i] = pe_gelu_f32(x[i], 0);
    for (long i = 0; i < n; i++) g[i] = pe_gelu_grad_f32(1.0f, x[i], 0);
}

int main(void) {
    long n = 0;
    for (uint32_t b = 0; b <= 0x40900000u; b += STEP, n++) { /* 4.5f */
        float x = from_bits(b);
        float got = pe_erf32(x), neg = pe_erf32(-x);
        double want = erf((double)x);
        if (ulps(got, want) > 1.0) fail("erf", x, got, want);
        if (neg != -got) fail("erf odd", -x, neg, -(double)got);
    }
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
    if (!isnan(pe_erf32(NAN))) fail("erf NaN", NAN, pe_erf32(NAN), NAN);
    for (uint32_t b = 0; b <= 0x41480000u; b += STEP) { /* 12.5f */
        for (int s = 0; s < 2; s++, n++) {
            float x = from_bits(b | (s ? 0x80000000u : 0u)), pdf;
            float cdf = pe_gelu_parts32(x, &pdf);
            double want = 0.5 * erfc(-(double)x * 0.7071067811865476);
            double dens = exp(-0.5 * (double)x * (double)x) * 0.3989422804014327;
            if (!(ulps(cdf, want) <= 8.0)) fail("Phi", x, cdf, want);
            if (!(ulps(pdf, dens) <= 3.0)) fail("pdf", x, pdf, dens);
            /* the forward on the same grid: pe_gelu32 where the target fuses, else erf */
            float y = pe_gelu_f32(x, 0);
            if (!(fabs(y - (double)x * want) <= 2 * FLT_EPSILON * fabs((double)x) + FLT_TRUE_MIN))
                fail("gelu grid", x, y, (double)x * want);
        }
    }
    const float far[] = {14.5f, 14.85f, 15.0f, 100.0f, 1e30f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof far / sizeof *far; i++, n++) {
        float pdf, up = pe_gelu_parts32(far[i], &pdf), down = pe_gelu_parts32(-far[i], &pdf);
        if (up != 1.0f || down != 0.0f || pdf != 0.0f) fail("Phi far", far[i], up, 1.0);
    }
    float pdf;
    if (pe_gelu_parts32(0.0f, &pdf) != 0.5f || pe_gelu_parts32(-0.0f, &pdf) != 0.5f ||
        fabsf(pdf - 0.3989422804014327f) > FLT_EPSILON * 0.4f)
        fail("Phi(0)", 0.0f, pe_gelu_parts32(0.0f, &pdf), 0.5);
    if (!isnan(pe_gelu_parts32(NAN, &pdf)) || !isnan(pdf) || !isnan(pe_gelu_f32(NAN, 0)) ||
        !isnan(pe_gelu_grad_f32(1, NAN, 0)))
        fail("NaN in", NAN, 0, NAN);
    if (pe_gelu_f32(INFINITY, 0) != INFINITY || pe_gelu_f32(-1e30f, 0) != 0.0f ||
        pe_gelu_grad_f32(1, 1e30f, 0) != 1.0f || pe_gelu_grad_f32(1, -1e30f, 0) != 0.0f)
        fail("gelu far", INFINITY, pe_gelu_f32(INFINITY, 0), INFINITY);
    n += 4;

    enum { M = 96001 };
    float *x = malloc(sizeof(float) * M), *y = malloc(sizeof(float) * M);
    float *g = malloc(sizeof(float) * M);
    if (!x || !y || !g) return 2;
    for (long i = 0; i < M; i++) x[i] = (float)(-12.0 + 24.0 * (double)i / (M - 1));
    gelu_loop(x, y, g, M);
    for (long i = 0; i < M; i++, n++) {
        if (y[i] != pe_gelu_f32(x[i], 0) || g[i] != pe_gelu_grad_f32(1.0f, x[i], 0))
            fail("loop and call", x[i], y[i], pe_gelu_f32(x[i], 0));
        double xd = x[i], cdf = 0.5 * erfc(-xd * 0.7071067811865476);
        double gy = xd * cdf, gg = cdf + xd * exp(-0.5 * xd * xd) * 0.3989422804014327;
        /* the float formula's own roundings: a few ulp of the terms it adds */
        if (fabs(y[i] - gy) > 2 * FLT_EPSILON * fabs(xd) + FLT_TRUE_MIN)
            fail("gelu", x[i], y[i], gy);
        if (fabs(g[i] - gg) > 2 * FLT_EPSILON * (1.0 + fabs(xd) * 0.4))
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
