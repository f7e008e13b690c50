/* exp for float32 without a libm call, so the loops that call it (sigmoid and SiLU, softmax,
 * the attention kernels' probabilities) vectorise: |x| clamped to 110 on its bits (masks,
 * which the compiler keeps branch-free; infinities clamp too, NaN passes through), then in double exp(x) = 2^k e^r with
 * k = round(x / ln 2) (the 1.5 * 2^52 shift), |r| <= ln 2 / 2, a degree-10 Taylor
 * polynomial (relative error under 2e-14) and 2^k made from k's bits; rounded once to float:
 * within 0.5 ulp plus 1e-13 of the exact value, so it rounds as libm's expf does except
 * where the exact value lies within that of a rounding boundary. Past the clamp the float
 * result is 0 (below -110: under float's least subnormal) or inf (above 88.73). */
#ifndef PE_EXP_H
#define PE_EXP_H
#include <stdint.h>
#include <string.h>

static inline float pe_exp32(float xf) {
    uint32_t u;
    memcpy(&u, &xf, sizeof u);
    uint32_t a = u & 0x7fffffffu;
    uint32_t big = (uint32_t)0 - ((uint32_t)(a > 0x42dc0000u) & (uint32_t)(a <= 0x7f800000u));
    u = (u & ~big) | (((u & 0x80000000u) | 0x42dc0000u) & big); /* +-110 */
    float c;
    memcpy(&c, &u, sizeof c);
    double v = (double)c;
    double kd = v * 1.4426950408889634 + 6755399441055744.0;
    uint64_t kb;
    memcpy(&kb, &kd, sizeof kb);
    kd -= 6755399441055744.0;
    double r = v - kd * 0.6931471805599453;
    r -= kd * 2.3190468138462996e-17; /* ln 2's low bits: r exact to double rounding */
    double e = 1.0 / 3628800;
    e = e * r + 1.0 / 362880;
    e = e * r + 1.0 / 40320;
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
#endif
