/* Elementwise math: one inline scalar function per op, for float (_f32) and double (_f64).
 *
 * The generated step writes the loops (shapes and broadcast strides are compile-time
 * constants there, so the compiler unrolls and vectorises them) and calls these for the
 * math; integer and bool ops use plain C operators in the loop. */
#ifndef PE_T
#ifndef PE_ELEMENTWISE_H
#define PE_ELEMENTWISE_H
#include <tgmath.h>
#include "pe_kernels.h"
#include "pe_exp.h"

/* erf for float32 without a libm call, so the GELU loop that calls it vectorises where the
 * target has no fused multiply-add (pe_gelu32 below serves the others): x *
 * P(x^2) / Q(x^2), a rational fit of degrees 6 and 5 in x^2 on |x| <= 3.925 (relative
 * error under 2e-9, increasing to 0.99999997 there), evaluated in double (x^2 exact) and
 * rounded once, so the result is within 0.54 ulp of the exact erf (libm's erff: 0.5). Past
 * 3.925 erf rounds to +-1 in float: one select after the arithmetic, which also covers the
 * fit overflowing to NaN for huge x (a clamp before it would keep GCC from vectorising the
 * loop); NaN passes through. */
static inline float pe_erf32(float xf) {
    double x = (double)xf, t = x * x;
    double p = -1.2829347774022949e-08;
    p = p * t + 4.614729410915899e-06;
    p = p * t + 3.769663539995778e-04;
    p = p * t + 3.839472349866083e-03;
    p = p * t + 5.424944904133873e-02;
    p = p * t + 1.8514162828236025e-01;
    p = p * t + 1.1283791691680443;
    double q = 6.245079204385112e-05;
    q = q * t + 1.3019742182782152e-03;
    q = q * t + 1.5432484156413696e-02;
    q = q * t + 1.1388047372649542e-01;
    q = q * t + 4.97410902821783e-01;
    q = q * t + 1.0;
    double r = x * p / q;
    return (float)(t > 15.405625 ? copysign(1.0, x) : r);
}

/* The GELU gradient's two float parts from one exponential, without a libm call, so its
 * loop vectorises (the forward, which wants Phi alone, takes pe_gelu32 or pe_erf32):
 * the normal density pdf = e^(-x^2/2) / sqrt(2 pi) and the distribution cdf = Phi(x) = 1 -
 * Q(x) for x >= 0 and Q(|x|) for x < 0, where Q(z) = erfc(z / sqrt 2) / 2 = e^(-z^2/2) u
 * P(u) / 2 with u = 1 / (1 + z / (2 sqrt 2)) and P of degree 8 (a weighted least-squares
 * fit to erfc(w) e^(w^2) / u over w in [0, 10.5]: relative error under 1e-7). The lower
 * tail is a product, never 1 minus something near 1, so Phi keeps its relative accuracy
 * for negative x; x^2 / 2 goes to the exponential as its rounded value and exact remainder
 * (pe_exp32_lo). |x| is clamped to 14.85 (past it the density and the lower tail are 0 in
 * float) and the two branches are selected on bits, so the loops vectorise on every
 * target; NaN passes through (GELU's gradient is NaN at +-inf through its x * pdf term, as
 * the double formula's). */
static inline float pe_gelu_parts32(float x, float *pdf) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t neg = (uint32_t)0 - (bits >> 31);
    float a = fabsf(pe_clamp_magnitude32(x, 0x416d999au)); /* 14.85 */
    float t = a * a;
#if PE_HAS_FMA
    float low = PE_FMAF(a, a, -t);
#else /* Dekker: a = hi + lo with 12-bit halves, so hi * hi, hi * lo and lo * lo are exact */
    float hi = a * 4097.0f;
    hi = hi - (hi - a);
    float lo = a - hi;
    float low = ((hi * hi - t) + 2.0f * hi * lo) + lo * lo;
#endif
    float e = pe_exp32_lo(-0.5f * t, -0.5f * low);
    float u = 1.0f / (a * 0.35355339059327373f + 1.0f);
    float p = -5.920651183e-02f;
    p = p * u + 2.852451503e-01f;
    p = p * u - 4.885853529e-01f;
    p = p * u + 2.796491086e-01f;
    p = p * u - 2.771295235e-02f;
    p = p * u + 2.031456679e-01f;
    p = p * u + 2.429881692e-01f;
    p = p * u + 2.823911309e-01f;
    p = p * u + 2.820855677e-01f; /* P(1) = 1 in float: Phi(0) = 1/2 exactly */
    float tail = 0.5f * e * (u * p);
    *pdf = e * 0.3989422804014327f;
    float upper = 1.0f - tail; /* Phi(x) for x >= 0; the tail itself for x < 0 (sign bit) */
    uint32_t ub, tb;
    memcpy(&ub, &upper, sizeof ub);
    memcpy(&tb, &tail, sizeof tb);
    ub = (ub & ~neg) | (tb & neg);
    memcpy(&upper, &ub, sizeof upper);
    return upper;
}
#if PE_HAS_FMA
/* GELU (erf) for float where the target fuses a * b + c, in float throughout: x Phi(x) =
 * x / 2 + x s with s = Phi(x) - 1/2 = x P(x^2) / Q(x^2), pe_erf32's fit rescaled from
 * erf(x / sqrt 2) / 2 and evaluated in float (a float division costs a third of the two
 * double ones the erf route needs), the last step fused, so y = x Phi(x) within 1.7 eps
 * |x| of the exact value (gelu_check.c's bound is 2). Past |x| = 5.5508 Phi rounds to 1
 * (x > 0) or y to 0 in float: one select, which also covers the fit overflowing to NaN for
 * huge x; NaN passes through. */
static inline float pe_gelu32(float x) {
    float t = x * x;
    float p = -7.0872803197e-11f;
    p = p * t + 5.0986038434e-08f;
    p = p * t + 8.3298582873e-06f;
    p = p * t + 1.6968230842e-04f;
    p = p * t + 4.7950191616e-03f;
    p = p * t + 3.2728725210e-02f;
    p = p * t + 3.9894228113e-01f;
    float q = 1.9515872514e-06f;
    q = q * t + 8.1373388642e-05f;
    q = q * t + 1.9290605196e-03f;
    q = q * t + 2.8470118432e-02f;
    q = q * t + 2.4870545141e-01f;
    q = q * t + 1.0f;
    float y = PE_FMAF(x, x * p / q, 0.5f * x);
    float far = x > 0.0f ? x : 0.0f;
    return t > 30.81125f ? far : y;
}
#endif
#define PE_SELF "elementwise.h"
#include "pe_instantiate.h"
#undef PE_SELF
#endif
#else

#define PE_C(x) ((PE_T)(x))
#if PE_TSIZE == 4
#define PE_ERF pe_erf32
#define PE_EXP pe_exp32
#else
#define PE_ERF erf
#define PE_EXP exp
#endif

static inline PE_T PE_S(pe_sigmoid)(PE_T x) { return PE_C(1) / (PE_EXP(-x) + PE_C(1)); }
static inline PE_T PE_S(pe_silu)(PE_T x) { return x * PE_S(pe_sigmoid)(x); }
static inline PE_T PE_S(pe_rsqrt)(PE_T x) { return PE_C(1) / sqrt(x); }
/* NaN passes through, as np.maximum(x, 0) and torch.relu propagate it */
static inline PE_T PE_S(pe_relu)(PE_T x) { return (x > 0 || x != x) ? x : PE_C(0); }
static inline PE_T PE_S(pe_relu_grad)(PE_T gz, PE_T y) { return y > 0 ? gz : PE_C(0); }

static inline PE_T PE_S(pe_clip)(PE_T x, PE_T lo, PE_T hi) {
    /* NaN passes through, as np.maximum/np.minimum propagate it */
    return x < lo ? lo : (x > hi ? hi : x);
}

static inline PE_T PE_S(pe_hardtanh_grad)(PE_T gz, PE_T y, PE_T lo, PE_T hi) {
    return (y > lo && y < hi) ? gz : PE_C(0);
}

static inline PE_T PE_S(pe_gelu)(PE_T x, int tanh_mode) {
    if (tanh_mode) {
        PE_T inner = PE_C(0.7978845608028654) * (x + PE_C(0.044715) * x * x * x);
        return PE_C(0.5) * x * (PE_C(1) + tanh(inner));
    }
#if PE_TSIZE == 4 && PE_HAS_FMA
    return pe_gelu32(x);
#else
    return PE_C(0.5) * x * (PE_C(1) + PE_ERF(x * PE_C(0.7071067811865476)));
#endif
}

static inline PE_T PE_S(pe_gelu_grad)(PE_T gz, PE_T x, int tanh_mode) {
    if (tanh_mode) {
        PE_T x2 = x * x;
        PE_T t = tanh(PE_C(0.7978845608028654) * (x + PE_C(0.044715) * x2 * x));
        PE_T dinner = PE_C(0.7978845608028654) * (PE_C(1) + PE_C(3 * 0.044715) * x2);
        return gz * (PE_C(0.5) * (PE_C(1) + t) + PE_C(0.5) * x * (PE_C(1) - t * t) * dinner);
    }
#if PE_TSIZE == 4
    float pdf, cdf = pe_gelu_parts32(x, &pdf);
#else
    PE_T cdf = PE_C(0.5) * (PE_C(1) + PE_ERF(x * PE_C(0.7071067811865476)));
    PE_T pdf = exp(PE_C(-0.5) * x * x) * PE_C(0.3989422804014327);
#endif
    return gz * (cdf + x * pdf);
}

#undef PE_ERF
#undef PE_EXP
#undef PE_C
#endif
