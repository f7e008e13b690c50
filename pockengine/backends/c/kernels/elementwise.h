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

/* erf for float32 without a libm call, so the loops that call it (GELU and its gradient)
 * vectorise: x * P(x^2) / Q(x^2), a rational fit of degrees 6 and 5 in x^2 on
 * |x| <= 3.925 (relative error under 2e-9, increasing to 0.99999997 there), evaluated in
 * double (x^2 exact) and rounded once, so the result is within 0.54 ulp of the exact erf
 * (libm's erff: 0.5). Past 3.925 erf rounds to +-1 in float: one select after the
 * arithmetic, which also covers the fit overflowing to NaN for huge x (a clamp before it
 * would keep GCC from vectorising the loop); NaN passes through. */
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

/* exp(-x^2 / 2) for float32 without a libm call, for the GELU gradient's loop to vectorise:
 * |x| clamped to 15 on its bits (a select the compiler keeps branch-free; the result there
 * is below float's least subnormal, so 0), x^2 / 2 exact in double, exp by 2^k e^r with
 * k = round(v / ln 2) (the 1.5 * 2^52 shift), |r| <= ln 2 / 2, a degree-8 Taylor
 * polynomial (error under 3e-10) and 2^k made from k's bits; rounded once to float:
 * within 0.51 ulp of the exact value. NaN gives 0, as inf does (GELU's gradient is NaN
 * there through its x * pdf term). */
static inline float pe_gauss32(float xf) {
    uint32_t u;
    memcpy(&u, &xf, sizeof u);
    u &= 0x7fffffffu;
    uint32_t big = (uint32_t)0 - (uint32_t)(u > 0x41700000u); /* |x| > 15 or NaN */
    u = (u & ~big) | (0x41700000u & big);
    float a;
    memcpy(&a, &u, sizeof a);
    double v = (double)a * (double)a * -0.5;
    double kd = v * 1.4426950408889634 + 6755399441055744.0;
    uint64_t kb;
    memcpy(&kb, &kd, sizeof kb);
    kd -= 6755399441055744.0;
    double r = v - kd * 0.6931471805599453;
    double e = 1.0 / 40320;
    e = e * r + 1.0 / 5040;
    e = e * r + 1.0 / 720;
    e = e * r + 1.0 / 120;
    e = e * r + 1.0 / 24;
    e = e * r + 1.0 / 6;
    e = e * r + 0.5;
    e = e * r + 1.0;
    e = e * r + 1.0;
    uint64_t sb = (kb - UINT64_C(0x4338000000000000) + 1023u) << 52;
    double s;
    memcpy(&s, &sb, sizeof s);
    return (float)(e * s);
}
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
    return PE_C(0.5) * x * (PE_C(1) + PE_ERF(x * PE_C(0.7071067811865476)));
}

static inline PE_T PE_S(pe_gelu_grad)(PE_T gz, PE_T x, int tanh_mode) {
    if (tanh_mode) {
        PE_T x2 = x * x;
        PE_T t = tanh(PE_C(0.7978845608028654) * (x + PE_C(0.044715) * x2 * x));
        PE_T dinner = PE_C(0.7978845608028654) * (PE_C(1) + PE_C(3 * 0.044715) * x2);
        return gz * (PE_C(0.5) * (PE_C(1) + t) + PE_C(0.5) * x * (PE_C(1) - t * t) * dinner);
    }
    PE_T cdf = PE_C(0.5) * (PE_C(1) + PE_ERF(x * PE_C(0.7071067811865476)));
#if PE_TSIZE == 4
    PE_T pdf = pe_gauss32(x) * PE_C(0.3989422804014327);
#else
    PE_T pdf = exp(PE_C(-0.5) * x * x) * PE_C(0.3989422804014327);
#endif
    return gz * (cdf + x * pdf);
}

#undef PE_ERF
#undef PE_EXP
#undef PE_C
#endif
